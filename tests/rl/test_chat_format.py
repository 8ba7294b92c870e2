"""Chat format: render / parse round trips, the assistant mask covers exactly the assistant
tokens, malformed turns are reported, and oracle demonstrations render solved episodes."""

import numpy as np
import pytest

from hybridmoe_jax.data.tokenizers.base import TokenizerError
from hybridmoe_jax.data.tokenizers.byte import ByteTokenizer
from hybridmoe_jax.rl import chat_format as cf
from hybridmoe_jax.rl.envs import Answer, Malformed, ToolCall, make_env
from hybridmoe_jax.rl.sft import oracle_conversation, oracle_demos

TOK = ByteTokenizer(chat=True)
R = cf.chat_ids(TOK)


def _conversation():
  return [cf.Message("system", "sys"), cf.Message("user", "what is 6*7?"),
          cf.Message("assistant", "let me compute", ToolCall("calculator", "6 * 7")),
          cf.Message("tool_result", "42"),
          cf.Message("assistant", "", Answer("42 ✓"))]


def test_render_layout_and_mask_cover_exactly_the_assistant_tokens():
  r = cf.render(TOK, _conversation())
  assert r.ids.dtype == r.assistant_mask.dtype == r.turn_index.dtype == np.int32
  assert r.ids.shape == r.assistant_mask.shape == r.turn_index.shape
  e = lambda s: list(TOK.encode(s))
  expected_ids = ([TOK.bos_id] + [R["system"]] + e("sys") + [R["end_turn"]]
                  + [R["user"]] + e("what is 6*7?") + [R["end_turn"]]
                  + [R["assistant"]] + e("let me compute") + [R["tool_call"]]
                  + e("calculator 6 * 7") + [R["end_turn"]]
                  + [R["tool_result"]] + e("42") + [R["end_turn"]]
                  + [R["assistant"]] + [R["answer"]] + e("42 ✓") + [R["end_turn"]])
  assert r.ids.tolist() == expected_ids
  # The mask: everything after each <assistant> header up to and including its <end_turn>.
  want = np.zeros(len(expected_ids), np.int32)
  in_turn = False
  for k, i in enumerate(expected_ids):
    if in_turn:
      want[k] = 1
      in_turn = i != R["end_turn"]
    elif i == R["assistant"]:
      in_turn = True
  np.testing.assert_array_equal(r.assistant_mask, want)
  assert r.assistant_mask.sum() == (len(e("let me compute")) + 1 + len(e("calculator 6 * 7"))
                                    + 1 + 1 + len(e("42 ✓")) + 1)
  # Masked tokens belong to assistant turns only.
  assert set(r.turn_index[r.assistant_mask == 1].tolist()) == {2, 4}
  assert r.turn_index[0] == -1 and r.turn_index[-1] == 4
  gen = cf.render(TOK, _conversation()[:2], add_generation_prompt=True)
  assert gen.ids[-1] == R["assistant"] and gen.assistant_mask[-1] == 0 and gen.turn_index[-1] == 2


@pytest.mark.parametrize("action", [ToolCall("calculator", "(1 + 2) * 3"), ToolCall("lookup", ""),
                                    ToolCall("run_tests", "def f0(xs):\n  return xs\n"),
                                    ToolCall("t", " leading space"), Answer(""),
                                    Answer("héllo\nworld 🚀")])
def test_render_parse_round_trip(action):
  message = cf.Message("assistant", "thinking…", action)
  ids, mask = cf.render_message(TOK, message)
  assert ids[0] == R["assistant"] and mask[0] == 0 and mask[1:].all()
  assert cf.parse_assistant(TOK, ids[1:]) == action
  parsed = cf.parse_message(TOK, ids[1:])
  assert parsed.action == action and parsed.text == "thinking…"
  # Token-in/token-out: a message carrying sampled ids renders them verbatim.
  again, again_mask = cf.render_message(TOK, parsed)
  np.testing.assert_array_equal(again, ids)
  np.testing.assert_array_equal(again_mask, mask)


def test_sampled_ids_are_never_re_encoded():
  # Ids whose text would encode differently (a cut UTF-8 character) stay as sampled.
  odd = (0xC3, R["answer"], ord("a"), R["end_turn"])
  msg = cf.parse_message(TOK, odd)
  assert msg.action == Answer("a") and msg.text == "\ufffd"
  ids, _ = cf.render_message(TOK, msg)
  assert tuple(ids[1:]) == odd


@pytest.mark.parametrize("ids, fragment", [
    ([ord("h"), ord("i")], "no <end_turn>"),
    ([ord("h"), R["end_turn"]], "no <tool_call> or <answer>"),
    ([R["answer"], ord("1"), R["end_turn"], ord("x")], "1 token(s) after <end_turn>"),
    ([R["tool_call"], ord("1"), ord("x"), R["end_turn"]], "expected a tool name"),
    ([R["tool_call"], R["end_turn"]], "expected a tool name"),
    ([R["user"], R["answer"], ord("1"), R["end_turn"]], "unexpected <user>"),
    ([R["answer"], ord("1"), R["answer"], R["end_turn"]], "unexpected <answer>"),
    ([R["answer"], TOK.bos_id, R["end_turn"]], "unexpected <bos>"),
    ([R["answer"], 9999, R["end_turn"]], "outside the vocabulary [0, 266)"),
])
def test_malformed_turns_are_reported(ids, fragment):
  action = cf.parse_assistant(TOK, ids)
  assert isinstance(action, Malformed) and fragment in action.error, action
  env = make_env("arithmetic")
  env.reset(0, 0)
  r = env.step(action)   # the env reports it as a failed turn and goes on
  assert not r.done and r.text.startswith("error: ") and r.reward == 0.0


def test_tokenizer_without_chat_roles_and_bad_messages_fail_clearly():
  with pytest.raises(TokenizerError, match=r"no id for chat role.*--config.data.tokenizer="
                     r"byte_chat --config.model.vocab_size=266"):
    cf.render(ByteTokenizer(), _conversation())
  with pytest.raises(ValueError, match="Message.role = 'bot'"):
    cf.Message("bot", "x")
  with pytest.raises(ValueError, match="needs ids or an action"):
    cf.Message("assistant", "x")
  with pytest.raises(ValueError, match="only assistant turns"):
    cf.Message("user", "x", Answer("1"))
  with pytest.raises(ValueError, match="ToolCall.name = 'a b'"):
    cf.render_message(TOK, cf.Message("assistant", "", ToolCall("a b", "")))


def test_vision_and_chat_tokenizer_works_too():
  tok = ByteTokenizer(vision=True, chat=True)
  r = cf.render(tok, _conversation())
  assert r.ids.max() == tok.special_ids["end_turn"] == 268
  assert cf.parse_assistant(tok, cf.render_message(tok, _conversation()[2])[0][1:]) == \
      ToolCall("calculator", "6 * 7")


@pytest.mark.parametrize("env_name, level", [("arithmetic", 0), ("arithmetic", 3),
                                             ("retrieval", 2), ("code", 1)])
def test_oracle_demos_render_solved_episodes(env_name, level):
  demos = oracle_demos(env_name, TOK, level=level, seeds=[0, 1])
  assert len(demos) == 2 and demos[0].ids.tolist() != demos[1].ids.tolist()
  for demo in demos:
    assert demo.reward == 1.0 and demo.level == level
    roles = [m.role for m in demo.messages]
    calls = level + 1
    assert roles == ["system", "user"] + ["assistant", "tool_result"] * calls + ["assistant"]
    assert np.array_equal(demo.ids, cf.render(TOK, demo.messages).ids)
    # Each assistant turn in the rendered ids parses back to the oracle's action.
    starts = np.flatnonzero(demo.ids == R["assistant"])
    actions = []
    for s in starts:
      end = s + 1 + int(np.argmax(demo.ids[s + 1:] == R["end_turn"]))
      assert demo.assistant_mask[s] == 0 and demo.assistant_mask[s + 1:end + 1].all()
      actions.append(cf.parse_assistant(TOK, demo.ids[s + 1:end + 1]))
    env = make_env(env_name)
    env.reset(demo.seed, level)
    assert actions == env.oracle()
    assert demo.assistant_mask.sum() == sum(
        len(cf.assistant_body(TOK, m)) for m in demo.messages if m.role == "assistant")


def test_oracle_conversation_replays_through_the_env():
  env = make_env("retrieval")
  messages, reward = oracle_conversation(env, 7, 1)
  assert reward == 1.0 and messages[0].role == "system" and "lookup" in messages[0].text
  assert messages[3].role == "tool_result" and messages[3].text == \
      messages[4].action.argument
