"""The chat / tool-call format: conversations <-> token ids, and generated turns -> actions.

Layout (`<r>` is the special id of role r; text is the tokenizer's encoding):
    <bos>
    <system> text <end_turn>                 the format and the tools (system_prompt)
    <user> text <end_turn>                   the task
    <assistant> [free text] <tool_call> name[ argument] <end_turn>      a tool call
    <tool_result> text <end_turn>            the environment's answer to it
    <assistant> [free text] <answer> text <end_turn>                  the final answer
The `<assistant>` header belongs to the prompt (the rollout appends it, as a generation
prompt); everything the model samples after it, up to and including its `<end_turn>` (the
stop token), is assistant-generated: `assistant_mask` is 1 exactly there (the future loss
mask), 0 on every other token. A tool call's name is an identifier; one space or newline
separates it from the argument, which runs verbatim up to `<end_turn>`.

Token-in/token-out: an assistant Message may carry the ids the model sampled (`ids`);
rendering uses them verbatim, never a re-encoding of their text.

Works with any tokenizer whose `special_ids` has every CHAT_ROLES role (the byte tokenizer
with `ByteTokenizer(chat=True)`, file tokenizers always).
"""

from __future__ import annotations

import dataclasses
import re
from typing import Sequence

import numpy as np

from hybridmoe_jax.data.tokenizers.base import CHAT_ROLES, TokenizerError
from hybridmoe_jax.rl.envs.base import Action, Answer, Malformed, Observation, ToolCall

MESSAGE_ROLES = ("system", "user", "assistant", "tool_result")
# An OpenAI-style message's role -> its MESSAGE_ROLES role (the server's and `api.chat`'s).
OPENAI_ROLES = {"system": "system", "developer": "system", "user": "user",
                "assistant": "assistant", "tool": "tool_result"}
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_CALL = re.compile(r"([A-Za-z_][A-Za-z0-9_]*)(?:[ \n](.*))?", re.DOTALL)


@dataclasses.dataclass(frozen=True)
class Message:
  """One turn of a conversation.

  Attributes:
    role: one of MESSAGE_ROLES.
    text: the content; for an assistant turn the free text before its action.
    action: assistant only: the ToolCall or Answer the turn ends with (Malformed when the
      turn carries raw `ids` that did not parse).
    ids: assistant only, optional: the sampled ids after the <assistant> header, rendered
      verbatim (token-in/token-out); then `text` / `action` are only informative.
  """
  role: str
  text: str = ""
  action: Action | None = None
  ids: tuple[int, ...] | None = None

  def __post_init__(self):
    if self.role not in MESSAGE_ROLES:
      raise ValueError(f"Message.role = {self.role!r}: allowed one of {list(MESSAGE_ROLES)}")
    if self.role != "assistant" and (self.action is not None or self.ids is not None):
      raise ValueError(f"Message.role = {self.role!r}: only assistant turns carry an "
                       "action or ids")
    if self.role == "assistant" and self.ids is None and \
        not isinstance(self.action, (ToolCall, Answer)):
      raise ValueError("an assistant Message needs ids or an action (ToolCall or Answer)")


@dataclasses.dataclass(frozen=True)
class Rendered:
  """A rendered conversation.

  Attributes:
    ids: int32 [n] token ids.
    assistant_mask: int32 [n], 1 on the tokens an assistant generates (each turn's body and
      its <end_turn>), 0 elsewhere (bos, headers, system, user, tool results).
    turn_index: int32 [n], the index of the message each token belongs to (-1 for bos; the
      generation prompt's header gets len(messages)).
  """
  ids: np.ndarray
  assistant_mask: np.ndarray
  turn_index: np.ndarray


def chat_ids(tokenizer) -> dict[str, int]:
  """Role -> id for every CHAT_ROLES role.

  Raises:
    TokenizerError: the tokenizer lacks chat roles (one line naming them and the fix).
  """
  ids = tokenizer.special_ids
  missing = [r for r in CHAT_ROLES if r not in ids]
  if missing:
    name = getattr(tokenizer, "name", type(tokenizer).__name__)
    raise TokenizerError(
        f"tokenizer {name!r} has no id for chat role(s) {missing}: the chat format needs all "
        "of them; train with a chat vocabulary, e.g. --config.data.tokenizer=byte_chat "
        "--config.model.vocab_size=266 (bytes), or a tokenizer file that has the roles")
  return {r: int(ids[r]) for r in CHAT_ROLES}


def system_prompt(tools, *, brief: bool = False) -> str:
  """The system text: the turn format and one line per tool (ToolSpec or Tool); `brief`:
  only "Tools: name, name" (a model trained on the format needs no description)."""
  if brief:
    return "Tools: " + (", ".join(t.name for t in tools) or "none")
  lines = ["You solve the task in turns. Each turn either calls one tool, written as "
           "tool_call then the tool name, a space and its argument, or gives the final "
           "answer, written as answer then the answer. Tool results come back as "
           "tool_result turns.", "Tools:"]
  lines += [f"- {t.name}: {t.description}" for t in tools] or ["- none"]
  return "\n".join(lines)


def initial_messages(obs: Observation) -> list[Message]:
  """The system and user turns an episode starts from."""
  return [Message("system", system_prompt(obs.tools, brief=obs.brief)),
          Message("user", obs.prompt)]


def action_text(action: ToolCall | Answer) -> tuple[str, str]:
  """(role, body text) of an action: ("tool_call", "name argument") or ("answer", text)."""
  if isinstance(action, ToolCall):
    if not _NAME.fullmatch(action.name):
      raise ValueError(f"ToolCall.name = {action.name!r}: allowed an identifier")
    return "tool_call", action.name + (" " + action.argument if action.argument else "")
  return "answer", action.text


def _encode(tokenizer, text: str) -> np.ndarray:
  return np.asarray(tokenizer.encode(text), np.int32).reshape(-1)


def assistant_body(tokenizer, message: Message) -> np.ndarray:
  """int32 [k]: the ids after an assistant turn's header, <end_turn> included."""
  if message.ids is not None:
    return np.asarray(message.ids, np.int32).reshape(-1)
  roles = chat_ids(tokenizer)
  role, body = action_text(message.action)
  return np.concatenate([_encode(tokenizer, message.text), [roles[role]],
                         _encode(tokenizer, body), [roles["end_turn"]]]).astype(np.int32)


def render_message(tokenizer, message: Message) -> tuple[np.ndarray, np.ndarray]:
  """(ids int32 [k], assistant_mask int32 [k]) of one turn, header included.

  What a rollout prefills after a tool runs is `render_message(tool_result)` followed by
  `generation_prompt()`.
  """
  roles = chat_ids(tokenizer)
  if message.role == "assistant":
    body = assistant_body(tokenizer, message)
    ids = np.concatenate([[roles["assistant"]], body]).astype(np.int32)
    mask = np.concatenate([[0], np.ones(len(body), np.int32)]).astype(np.int32)
    return ids, mask
  ids = np.concatenate([[roles[message.role]], _encode(tokenizer, message.text),
                        [roles["end_turn"]]]).astype(np.int32)
  return ids, np.zeros(len(ids), np.int32)


def generation_prompt(tokenizer) -> np.ndarray:
  """int32 [1]: the <assistant> header the model generates after."""
  return np.array([chat_ids(tokenizer)["assistant"]], np.int32)


def render(tokenizer, messages: Sequence[Message], *, bos: bool = True,
           add_generation_prompt: bool = False) -> Rendered:
  """Renders a conversation into ids, the assistant mask and per-token turn indices.

  Args:
    tokenizer: with all CHAT_ROLES ids (see chat_ids).
    messages: the turns in order.
    bos: start with the tokenizer's bos id.
    add_generation_prompt: end with an <assistant> header (for sampling the next turn).

  Raises:
    TokenizerError: the tokenizer lacks chat roles.
  """
  parts = []   # (ids, assistant mask, turn index) per piece
  if bos:
    parts.append(([tokenizer.bos_id], [0], -1))
  parts += [(*render_message(tokenizer, m), i) for i, m in enumerate(messages)]
  if add_generation_prompt:
    parts.append((generation_prompt(tokenizer), [0], len(messages)))
  cat = lambda xs: np.concatenate(xs).astype(np.int32) if xs else np.zeros(0, np.int32)
  return Rendered(cat([p[0] for p in parts]), cat([p[1] for p in parts]),
                  cat([np.full(len(p[0]), p[2]) for p in parts]))


def _decode(tokenizer, ids) -> str:
  return tokenizer.decode(np.asarray(ids, np.int32)) if len(ids) else ""


def parse_assistant(tokenizer, ids) -> Action:
  """The action of a generated assistant turn (the ids sampled after its <assistant> header).

  The turn must be: free text without special ids, one <tool_call> or <answer>, its body
  without special ids, then <end_turn> as the last id. Anything else is Malformed with a
  one-line reason (the environment reports it to the model as a failed turn).

  Args:
    tokenizer: with all CHAT_ROLES ids.
    ids: integer array-like [k].

  Returns:
    ToolCall(name, argument), Answer(text) or Malformed(error).
  """
  roles = chat_ids(tokenizer)
  names = {v: k for k, v in tokenizer.special_ids.items()}
  ids = [int(i) for i in np.asarray(ids).reshape(-1)]
  vocab = tokenizer.vocab_size
  bad = [i for i in ids if not 0 <= i < vocab]
  if bad:
    return Malformed(f"token id {bad[0]} is outside the vocabulary [0, {vocab})")
  if roles["end_turn"] not in ids:
    return Malformed("the turn has no <end_turn> (cut at the token limit?)")
  end = ids.index(roles["end_turn"])
  if end != len(ids) - 1:
    return Malformed(f"{len(ids) - 1 - end} token(s) after <end_turn>")
  markers = [(j, names[i]) for j, i in enumerate(ids[:end]) if i in names]
  actions = [(j, r) for j, r in markers if r in ("tool_call", "answer")]
  if not actions:
    return Malformed("the turn has no <tool_call> or <answer>")
  j, role = actions[0]
  stray = [r for k, r in markers if k != j]
  if stray:
    return Malformed(f"unexpected <{stray[0]}> in an assistant turn; allowed: free text, one "
                     "<tool_call> or <answer>, its text, <end_turn>")
  body = _decode(tokenizer, ids[j + 1:end])
  if role == "answer":
    return Answer(body)
  m = _CALL.fullmatch(body)
  if m is None:
    return Malformed(f"tool call {body[:40]!r}: expected a tool name (an identifier), then a "
                     "space and the argument")
  return ToolCall(m.group(1), m.group(2) or "")


def parse_message(tokenizer, ids) -> Message:
  """An assistant Message holding the sampled `ids` verbatim, its free text and action."""
  action = parse_assistant(tokenizer, ids)
  roles = chat_ids(tokenizer)
  ids = tuple(int(i) for i in np.asarray(ids).reshape(-1))
  cut = next((k for k, i in enumerate(ids) if i in (roles["tool_call"], roles["answer"])),
             len(ids))
  text = _decode(tokenizer, [i for i in ids[:cut] if 0 <= i < tokenizer.vocab_size])
  return Message("assistant", text, action, ids)
