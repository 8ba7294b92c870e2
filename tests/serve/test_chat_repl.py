"""The chat REPL (`python -m hybridmoe_jax.serve.chat`) with stdin piped: streamed replies equal the
engine's greedy generation of the whole conversation so far (chat format, the sampled ids
kept), /reset forgets it, /exit ends; the plain-transcript mode and the refusal of a
conversation that no longer fits."""

import io
import os
import subprocess
import sys

import numpy as np
import pytest

from hybridmoe_jax import api
from hybridmoe_jax.serve import chat
from hybridmoe_jax.infer.streaming import stream_text
from hybridmoe_jax.rl import chat_format
from hybridmoe_jax.rl.chat_format import Message
from tests.conftest import ROOT
from tests.serve.fixtures import model_path  # noqa: E402,F401 (a fixture)


def _greedy(lm, ids, n, stop):
  out = lm.engine.generate(np.asarray(ids)[None], max_new_tokens=n, stop_tokens=stop)
  return out.tokens[0, :out.lengths[0]].tolist()


def test_piped_conversation_equals_generate_and_reset_forgets(model_path):
  lines = "hello\nmore please\n/reset\nhello\n/exit\n"
  env = dict(os.environ, PYTHONIOENCODING="utf-8")
  r = subprocess.run([sys.executable, "-m", "hybridmoe_jax.serve.chat", f"--workdir={model_path}",
                      "--max_tokens=6", "--temperature=0", "--max_len=128"], input=lines,
                     capture_output=True, text=True, cwd=ROOT, env=env, timeout=300)
  assert r.returncode == 0, r.stderr[-2000:]
  lm = api.load(model_path, max_len=128)
  tok = lm.tokenizer
  roles = chat_format.chat_ids(tok)
  stop = (roles["end_turn"], tok.eos_id)
  specials = set(tok.special_ids.values())
  show = lambda ids: stream_text(tok, [t for t in ids if t not in specials]) or \
      chat.EMPTY_REPLY  # noqa: E731
  first = chat_format.render(tok, [Message("user", "hello")], add_generation_prompt=True)
  r1 = _greedy(lm, first.ids, 6, stop)
  history = first.ids.tolist() + [t for t in r1 if t not in stop] + [roles["end_turn"]]
  second = history + chat_format.render_message(tok, Message("user", "more please"))[0].tolist() \
      + chat_format.generation_prompt(tok).tolist()
  r2 = _greedy(lm, second, 6, stop)
  want = (f">>> {show(r1)}\n>>> {show(r2)}\n>>> [conversation reset]\n>>> {show(r1)}\n>>> ")
  assert r.stdout == want
  assert "chat format" in r.stderr


def test_plain_transcript_and_an_overlong_conversation_is_refused(model_path):
  out = io.StringIO()
  code = chat.main([f"--workdir={model_path}", "--plain", "--max_len=40", "--max_tokens=8",
                    "--temperature=0"], stdin=io.StringIO("hi\n" + "x" * 20 + "\n"), stdout=out)
  assert code == 0
  lm = api.load(model_path, max_len=40)
  r1 = lm.generate("User: hi\nAssistant:", max_new_tokens=8, stop=chat.PLAIN_STOP)
  used = 1 + len("User: hi\nAssistant:") + len((r1 + "\n").encode())
  need = used + len(f"User: {'x' * 20}\nAssistant:")
  assert out.getvalue() == (
      f">>> {r1}\n>>> [the conversation has {need} tokens: with --max_tokens=8 it exceeds "
      f"--max_len=40; /reset to start over]\n>>> \n")


def test_an_empty_reply_shows_a_marker(model_path, monkeypatch):
  """A reply that ends before any visible text (<end_turn> first) prints EMPTY_REPLY, not a
  blank line that reads like a hang; the conversation still records the turn."""
  lm = api.load(model_path, max_len=64)
  conv = chat.Conversation(lm)
  end = conv.roles["end_turn"]
  monkeypatch.setattr(lm.engine, "generate_stream", lambda *a, **k: iter([end]))
  out = io.StringIO()
  chat.reply(conv, "hi", max_tokens=4, sampling=chat.SamplingConfig(), seed=0, out=out)
  assert out.getvalue() == chat.EMPTY_REPLY + "\n"
  assert conv.ids[-1] == end
