"""One process of the per-host input test (test_multiprocess.py): joins a CPU cluster with
jax.distributed (when --num_processes > 1), builds the training data as run_inputs does for
this process, and saves its batches (and, "first", the gathered iterator states; "resume",
continues from them).

    python tests/parallel/host_batches.py MODE OUT PORT NUM_PROCESSES PROCESS_ID DATA_FILE
MODE: "run" (5 batches), "first" (3 batches, then the state), "resume" (2 batches after it).
"""

import json
import os
import sys

import numpy as np


def main(mode, out, port, nproc, pid, data_file):
  nproc, pid = int(nproc), int(pid)
  from hybridmoe_jax.parallel import distributed
  if nproc > 1:
    distributed.initialize(coordinator_address=f"localhost:{port}", num_processes=nproc,
                           process_id=pid)
  import jax
  from hybridmoe_jax.data.pipeline import build_train_and_eval
  from hybridmoe_jax.data.tokenizers.byte import ByteTokenizer
  from hybridmoe_jax.config.run import DataConfig
  cfg = DataConfig(source="jsonl", paths=(data_file,), input_shards=2)
  global_batch = 8
  data = build_train_and_eval(cfg, vocab_size=ByteTokenizer().vocab_size, seq_len=32,
                              batch_size=global_batch // jax.process_count(), seed=5,
                              shard_index=jax.process_index(), shard_count=jax.process_count())
  it = data.train
  state_file = os.path.join(out, "state.json")
  if mode == "resume":
    with open(state_file) as f:
      it.set_state(distributed.own_host_state(json.load(f)))
  n = {"run": 5, "first": 3, "resume": 2}[mode]
  tokens = np.stack([next(it)["tokens"] for _ in range(n)])
  np.save(os.path.join(out, f"{mode}_{nproc}_{pid}.npy"), tokens)
  if mode == "first":
    saved = distributed.gather_host_states(it.get_state())
    if jax.process_index() == 0:
      with open(state_file, "w") as f:
        json.dump(saved, f)


if __name__ == "__main__":
  main(*sys.argv[1:])
