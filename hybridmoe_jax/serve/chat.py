"""`python -m hybridmoe_jax.serve.chat --workdir=DIR`: a terminal chat with a model, streamed.

Reads one line per user turn, keeps the whole conversation, and streams the reply token by
token (`Engine.generate_stream` + `infer.streaming.TextStream`, the pieces
`LoadedModel.generate_stream` is made of; the conversation is kept as the sampled ids,
never re-encoded text). Commands: /reset (forget the conversation), /exit (or end of input),
/help.

Format: a model whose tokenizer has the chat roles (the byte tokenizer with chat=True, the
RL runs) is prompted in the RL chat format (rl/chat_format.py: <user> line <end_turn>
<assistant>, the reply ends at <end_turn>); any other model (or --plain) continues a plain
transcript "User: line\\nAssistant:" and the reply ends at "\\nUser:". A conversation that
no longer fits --max_len with --max_tokens of room is refused with a message (/reset),
never cut silently.
"""

from __future__ import annotations

import argparse
import sys
from typing import TextIO

import numpy as np

from hybridmoe_jax.api import load
from hybridmoe_jax.data.tokenizers.base import TokenizerError
from hybridmoe_jax.infer import SamplingConfig
from hybridmoe_jax.infer.streaming import TextStream
from hybridmoe_jax.rl import chat_format
from hybridmoe_jax.rl.chat_format import Message

PROMPT = ">>> "
HELP = "commands: /reset (forget the conversation), /exit (quit), /help"
PLAIN_STOP = "\nUser:"
EMPTY_REPLY = "[empty reply]"   # shown when a reply has no visible text (e.g. <end_turn> first)


class Conversation:
  """The conversation as token ids, and how a user line and a reply extend it.

  Args:
    model: a LoadedModel.
    system: optional system text (chat format only).
    plain: use the plain transcript even when the tokenizer has chat roles.
  """

  def __init__(self, model, *, system: str = "", plain: bool = False):
    self.model, self.tokenizer, self.system = model, model.tokenizer, system
    self.roles = None
    if not plain:
      try:
        self.roles = chat_format.chat_ids(self.tokenizer)
      except TokenizerError:
        self.roles = None
    self.reset()

  @property
  def chat(self) -> bool:
    return self.roles is not None

  def reset(self) -> None:
    if self.chat:
      first = [Message("system", self.system)] if self.system else []
      self.ids = chat_format.render(self.tokenizer, first).ids.tolist()
    else:
      self.ids = [int(self.tokenizer.bos_id)]

  def user_turn(self, line: str) -> list[int]:
    """The ids to append for a user line, the assistant header / "Assistant:" included."""
    if self.chat:
      body, _ = chat_format.render_message(self.tokenizer, Message("user", line))
      return body.tolist() + chat_format.generation_prompt(self.tokenizer).tolist()
    return self.tokenizer.encode(f"User: {line}\nAssistant:").tolist()

  @property
  def stop_tokens(self) -> tuple[int, ...]:
    eos = int(self.tokenizer.eos_id)
    return (self.roles["end_turn"], eos) if self.chat else (eos,)

  @property
  def stop_strings(self) -> tuple[str, ...]:
    return () if self.chat else (PLAIN_STOP,)

  def add_reply(self, prompt: list[int], ids: list[int], text: str) -> None:
    """The history after a reply: chat format, the sampled ids verbatim (token-in /
    token-out) closed by <end_turn>; plain, the shown text and a newline."""
    if self.chat:
      body = [t for t in ids if t not in self.stop_tokens]
      self.ids = prompt + body + [self.roles["end_turn"]]
    else:
      self.ids = prompt + self.tokenizer.encode(text + "\n").tolist()


def reply(conv: Conversation, line: str, *, max_tokens: int, sampling: SamplingConfig,
          seed: int, out: TextIO) -> None:
  """Generate and stream the reply to `line`; extend the conversation with it."""
  new = conv.user_turn(line)
  prompt = conv.ids + new
  room = conv.model.max_len - len(prompt)
  if room < max_tokens:
    out.write(f"[the conversation has {len(prompt)} tokens: with --max_tokens={max_tokens} "
              f"it exceeds --max_len={conv.model.max_len}; /reset to start over]\n")
    return
  text = TextStream(conv.tokenizer, conv.stop_strings)
  special = set(conv.tokenizer.special_ids.values())
  ids: list[int] = []
  for tok in conv.model.engine.generate_stream(np.asarray(prompt, np.int32),
                                               max_new_tokens=max_tokens, sampling=sampling,
                                               stop_tokens=conv.stop_tokens, seed=seed):
    ids.append(tok)
    if tok in special:
      continue
    out.write(text.push(tok))
    out.flush()
    if text.stopped:
      break
  tail = text.finish()
  out.write((tail if text.text else EMPTY_REPLY) + "\n")
  out.flush()
  conv.add_reply(prompt, ids, text.text)


def _parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(prog="python -m hybridmoe_jax.serve.chat", description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--workdir", required=True, help="the model (workdir, params export, HF dir)")
  p.add_argument("--max_tokens", type=int, default=256, help="tokens per reply at most")
  p.add_argument("--temperature", type=float, default=0.7, help="0 = greedy")
  p.add_argument("--top_p", type=float, default=0.95)
  p.add_argument("--seed", type=int, default=0, help="sampling seed (per reply: seed + turn)")
  p.add_argument("--max_len", type=int, default=4096, help="tokens the conversation may hold")
  p.add_argument("--system", default="", help="a system turn (chat format only)")
  p.add_argument("--plain", action="store_true", help="plain transcript even for a chat "
                 "tokenizer")
  return p


def main(argv=None, stdin: TextIO | None = None, stdout: TextIO | None = None) -> int:
  stdin, stdout = stdin or sys.stdin, stdout or sys.stdout
  args = _parser().parse_args(argv)
  try:
    if args.max_tokens < 1 or args.max_len < 2:
      raise ValueError(f"--max_tokens={args.max_tokens} / --max_len={args.max_len}: allowed "
                       "integers >= 1 / >= 2")
    SamplingConfig(temperature=args.temperature, top_p=args.top_p)   # checks the ranges
    model = load(args.workdir, max_len=args.max_len)
  except (FileNotFoundError, ValueError) as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  sampling = SamplingConfig(temperature=args.temperature, top_p=args.top_p,
                            vocab_limit=int(model.tokenizer.vocab_size))
  conv = Conversation(model, system=args.system, plain=args.plain)
  mode = "chat format" if conv.chat else "plain transcript"
  print(f"{model!r}\n{mode}; {HELP}", file=sys.stderr)
  turn = 0
  while True:
    stdout.write(PROMPT)
    stdout.flush()
    line = stdin.readline()
    if not line:
      stdout.write("\n")
      return 0
    line = line.rstrip("\n")
    if line.strip() == "/exit":
      return 0
    if line.strip() == "/reset":
      conv.reset()
      stdout.write("[conversation reset]\n")
      continue
    if line.strip() == "/help" or not line.strip():
      stdout.write(HELP + "\n")
      continue
    reply(conv, line, max_tokens=args.max_tokens, sampling=sampling, seed=args.seed + turn,
          out=stdout)
    turn += 1


if __name__ == "__main__":
  sys.exit(main())
