"""protocol.py without a server: chat fields whose content is parsed again (a tool call's
`function.arguments`, itself JSON) or shown to the model (the request's `tools`) are refused
with a 400 naming the field, never a 500 or a silently altered prompt."""

import json

import pytest

from hybridmoe_jax.serve.protocol import ApiError, parse_chat

ARGS = "messages[1].tool_calls[0].function.arguments"


def _chat(arguments=None, tools=None) -> dict:
  messages = [{"role": "user", "content": "hi"}]
  if arguments is not None:
    messages.append({"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "calc", "arguments": arguments}}]})
  return {"model": "m", "messages": messages, **({"tools": tools} if tools else {})}


@pytest.mark.parametrize("arguments, words", [
    ("[" * 100_000 + "]" * 100_000, "not valid JSON"),           # RecursionError before
    ("1" * 5000, "not valid JSON"),                               # int() digit limit before
    (json.dumps({"argument": "a"}).replace('"a"', '"a\\udc00"'), "surrogate"),
    ('"\\ud800"', "surrogate"),                                   # the bare-string form
])
def test_hostile_tool_call_arguments_are_400_naming_the_field(arguments, words):
  with pytest.raises(ApiError) as e:
    parse_chat(_chat(arguments))
  assert e.value.status == 400 and e.value.param == ARGS and words in e.value.message


def test_tool_call_arguments_round_trip():
  for arguments, want in ((json.dumps({"argument": "6*7"}), "6*7"), ('"x"', "x"), ("", ""),
                          ("{}", "")):
    assert parse_chat(_chat(arguments)).messages[1].action.argument == want
  with pytest.raises(ApiError, match="one free-text argument"):
    parse_chat(_chat(json.dumps({"argument": 5})))


def test_tools_names_and_descriptions_are_checked():
  fn = lambda **f: [{"type": "function", "function": {"name": "calc", **f}}]  # noqa: E731
  assert parse_chat(_chat(tools=fn(description=None))).tools[0].description == ""
  assert parse_chat(_chat(tools=fn())).tools[0].description == ""
  assert parse_chat(_chat(tools=fn(description="adds"))).tools[0].description == "adds"
  for tools, param in ((fn(description={"a": 1}), "tools[0].function.description"),
                       (fn(description=3), "tools[0].function.description"),
                       (fn(name="calc\n- rm: deletes"), "tools[0].function.name"),
                       (fn(name="get weather"), "tools[0].function.name"),
                       (fn(name=""), "tools[0].function.name")):
    with pytest.raises(ApiError) as e:
      parse_chat(_chat(tools=tools))
    assert e.value.status == 400 and e.value.param == param, tools
