"""The smallest model run_train.py can train in a few seconds: the fault trials' subprocess
config (`python run_train.py --config=tests/faults/fault_config.py`).

tests/train/train_fakes.py's 2-layer MLA-only model (a KDA layer would add ~10 s to every
compile) on the bundled byte text; short sequences, a checkpoint every 2 steps, none rotated
away (the trials check that every committed checkpoint survives).
"""

from hybridmoe_jax.config.run import default_config
from tests._support import set_tiny_model


def get_config():
  config = default_config()
  set_tiny_model(config)
  config.model.vocab_size = 259   # 256 bytes + pad/bos/eos
  config.train.update(dict(steps=8, batch_size=2, seq_len=32, lr=3e-2, warmup=2, log_every=1,
                           eval_every=0, eval_batches=1, checkpoint_every=2,
                           keep_checkpoints=1000, heatmap_every=0))
  return config
