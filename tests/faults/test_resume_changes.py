"""Issue 33: silent changes on resume. Another tokenizer of the same vocabulary size, a corpus
edited in place, and a raised `train.steps` (which moves the LR schedule's end) each went
unnoticed. Now: the tokenizer change is refused (one line naming the record) unless
`train.allow_tokenizer_change`; the data change and the new schedule end are one warning
each. Nothing saved is changed by a refused resume."""

import pytest

from hybridmoe_jax.data.tokenizers.byte import ByteTokenizer
from hybridmoe_jax.train import run_inputs
from hybridmoe_jax.train.loop import train_and_evaluate
from hybridmoe_jax.config.run import run_config_from_dict
from tests._support import tiny_run_config
from tests.faults import helpers


class OtherBytes(ByteTokenizer):
  """Another tokenizer with the same vocabulary size (what nothing else notices)."""


def _config(corpus, **train):
  config = tiny_run_config(trial=True, **train)
  config.data.source = "text"
  config.data.paths = (str(corpus),)
  return config


def _data(config, tokenizer):
  data = helpers.fake_data(config)
  data.tokenizer = tokenizer
  return data


@pytest.mark.slow  # five short runs: ~25 CPU-s
def test_tokenizer_data_and_steps_changes_on_resume_are_told(tmp_path):
  corpus, workdir = tmp_path / "corpus.txt", tmp_path / "run"
  corpus.write_text("some text\n" * 100)
  config = _config(corpus, steps=4)
  train_and_evaluate(run_config_from_dict(config), str(workdir),
                     data=_data(config, ByteTokenizer()))
  assert (workdir / run_inputs.FILE).is_file()

  # The corpus edited in place and train.steps raised: one warning each, training goes on.
  corpus.write_text("some text\n" * 99 + "edited\n")
  config = _config(corpus, steps=6)
  with helpers.LogLines() as log:
    s = train_and_evaluate(run_config_from_dict(config), str(workdir),
                           data=_data(config, ByteTokenizer()))
  assert s["start_step"] == 4 and s["end_step"] == 6
  data_warn = [m for m in log.messages() if "training data under data.paths changed" in m]
  steps_warn = [m for m in log.messages() if "train.steps changed from 4 to 6" in m]
  assert len(data_warn) == 1 and len(steps_warn) == 1, log.messages()
  assert "now ends at step 6 instead of 4" in steps_warn[0]
  assert "the learning rate at step 4 was" in steps_warn[0]
  kept = helpers.all_hashes(workdir)

  # Another tokenizer of the same size: refused before anything is trained or written.
  with pytest.raises(run_inputs.TokenizerChanged) as e:
    train_and_evaluate(run_config_from_dict(config), str(workdir), data=_data(config, OtherBytes()))
  message = str(e.value)
  assert "\n" not in message and str(workdir / run_inputs.FILE) in message
  assert "allow_tokenizer_change=True" in message and "OtherBytes" in message
  helpers.assert_kept(workdir, kept)

  # ... unless asked for: one warning, and the run goes on.
  config = _config(corpus, steps=6, allow_tokenizer_change=True)
  with helpers.LogLines() as log:
    train_and_evaluate(run_config_from_dict(config), str(workdir), data=_data(config, OtherBytes()))
  assert len([m for m in log.messages() if "with another tokenizer" in m]) == 1
  # No change, no warning.
  with helpers.LogLines() as log:
    train_and_evaluate(run_config_from_dict(config), str(workdir), data=_data(config, OtherBytes()))
  assert not [m for m in log.messages() if "changed" in m or "another tokenizer" in m], \
      log.messages()
  helpers.assert_kept(workdir, kept)
