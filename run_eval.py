"""Evaluate a trained hybrid model: perplexity, passkey NIAH, MQAR, text generation.

  python run_eval.py --workdir=runs/x --task=all                 # newest checkpoint of a run
  python run_eval.py --params=runs/x/export --task=generate --prompt="The sky is"
  python run_eval.py --workdir=runs/x --task=niah --niah_lengths=512,2048 --niah_samples=8
  python run_eval.py --workdir=runs/vlm --task=vqa                # vision models
  python run_eval.py --params=runs/x/export --task=ruler --ruler_lengths=8192,32768 --ruler_samples=100
  python run_eval.py --workdir=runs/x --task=report   # runs/x/report.html (no model loaded)
  python run_eval.py --workdir=runs/rl --task=agent --agent_levels=0,1,2 --agent_episodes=16
  # vision models: an image at <image> in the prompt (else before it); a generated scene:
  python -c "import numpy as np; from hybridmoe_jax.data import images as im; im.write_pnm('scene.ppm', im.render_scene(im.random_scene(np.random.default_rng(7), [32])))"
  python run_eval.py --workdir=runs/vlm --task=generate --image=scene.ppm --prompt=$'Q: colour at top left?\\n<image>\\nA:'

Results go to --output_dir (default <workdir>/eval, or <params>_eval beside a params export)
as <task>.json, niah_heatmap.png (a labelled figure) and results.json (every task's latest
result: a later single task replaces only its own), with a short table on stdout; generate
reports its compile and run (prefill + decode) seconds apart. The logic lives in
`hybridmoe_jax.evals` (this file's flags go to `hybridmoe_jax.tools.evaluate.main`).
--task=agent (not part of "all": it needs a model trained with the chat tokenizer) rolls out
held-out tool-use episodes per env and level under the policies model / oracle / random and
writes agent.json and agent_success.png (`hybridmoe_jax.tools.agent_eval`).
"""

import sys

from absl import app
from absl import flags
from absl import logging

from hybridmoe_jax.tools.agent_eval import AgentOptions
from hybridmoe_jax.evals.runner import EvalOptions, TASKS

_D = EvalOptions()
_WORKDIR = flags.DEFINE_string("workdir", None, "Training run: evaluate its newest checkpoint.")
_PARAMS = flags.DEFINE_string("params", None,
                              "A params-only export (run_train.py --export_params_to).")
_OUTPUT = flags.DEFINE_string("output_dir", None, "Where results go (default <workdir>/eval; "
                               "with --params, <params>_eval beside the export).")
_CONFIG = flags.DEFINE_string("config", None, "Optional configs/*.py: must match the stored one.")
_TASK = flags.DEFINE_enum("task", "all", list(TASKS) + ["all", "report", "agent"],
                          "Which evaluation to run; report: an HTML page about the run; "
                          "agent: tool-use episodes per env and level (chat models).")
flags.DEFINE_string("prompt", _D.prompt, "generate: text to continue.")
flags.DEFINE_integer("max_new_tokens", _D.max_new_tokens, "generate: tokens to sample.")
flags.DEFINE_integer("max_len", _D.max_len, "generate: cache capacity (prompt + new tokens).")
flags.DEFINE_float("temperature", _D.temperature, "generate: 0 = greedy.")
flags.DEFINE_integer("top_k", _D.top_k, "generate: 0 = off.")
flags.DEFINE_float("top_p", _D.top_p, "generate: 1 = off.")
flags.DEFINE_integer("seed", _D.seed, "Sampling and synthetic-task seed.")
flags.DEFINE_integer("prefill_chunk", _D.prefill_chunk, "Tokens per prefill step.")
flags.DEFINE_integer("kv_block", _D.kv_block, "Keys per MLA decode-attention block.")
flags.DEFINE_integer("ppl_max_len", _D.ppl_max_len, "ppl: tokens scored per document.")
flags.DEFINE_integer("ppl_max_docs", _D.ppl_max_docs, "ppl: held-out documents scored.")
flags.DEFINE_list("text_files", [], "ppl: text files to score instead of the held-out split.")
flags.DEFINE_list("niah_lengths", [str(x) for x in _D.niah_lengths], "niah: context lengths.")
flags.DEFINE_list("niah_depths", [str(x) for x in _D.niah_depths], "niah: needle depths.")
flags.DEFINE_integer("niah_samples", _D.niah_samples, "niah: prompts per cell.")
flags.DEFINE_integer("niah_digits", _D.niah_digits, "niah: passkey digits.")
flags.DEFINE_list("mqar_lengths", [str(x) for x in _D.mqar_lengths], "mqar: sequence lengths.")
flags.DEFINE_list("mqar_pairs", [str(x) for x in _D.mqar_pairs], "mqar: key-value pairs.")
flags.DEFINE_integer("mqar_samples", _D.mqar_samples, "mqar: sequences per cell.")
flags.DEFINE_string("image", _D.image, "generate: image file (.npy, .ppm, .pgm) before the prompt.")
flags.DEFINE_bool("pad_image", _D.pad_image,
                  "Pad an image whose sides are not multiples of 2 * patch_size (else reject).")
flags.DEFINE_integer("vqa_images", _D.vqa_images, "vqa: held-out generated images.")
flags.DEFINE_integer("vqa_seed", _D.vqa_seed,
                     "vqa: scene seed (-1: the run's data.vision.heldout_seed).")
flags.DEFINE_list("ruler_tasks", list(_D.ruler_tasks), "ruler: tasks (RULER-style suite).")
flags.DEFINE_list("ruler_lengths", [str(x) for x in _D.ruler_lengths],
                  "ruler: prompt lengths in the model's tokens.")
flags.DEFINE_integer("ruler_samples", _D.ruler_samples, "ruler: prompts per task x length.")
flags.DEFINE_integer("ruler_batch", _D.ruler_batch, "ruler: prompts decoded together.")
flags.DEFINE_integer("ruler_seed", _D.ruler_seed,
                     "ruler: prompt seed (-1: fresh per call, recorded in ruler.json).")
flags.DEFINE_enum("ruler_split", _D.ruler_split, ["validation", "test"],
                  "ruler: haystack files; validation to choose a recipe, test to report.")

# --task=agent (also uses --temperature for the model policy, --seed, --prefill_chunk,
# --kv_block).
_A = AgentOptions()
flags.DEFINE_list("agent_envs", None,
                  "agent: env names (default: the run's RL envs, else arithmetic).")
flags.DEFINE_list("agent_levels", [str(x) for x in _A.levels], "agent: levels per env.")
flags.DEFINE_integer("agent_episodes", _A.episodes, "agent: held-out tasks per env and level.")
flags.DEFINE_list("agent_policies", list(_A.policies),
                  "agent: model (greedy at --temperature), oracle (forced: must score 1), "
                  "random (an untrained model of the same config, temperature 1).")
flags.DEFINE_bool("agent_brief", None,
                  "agent: short prompts (default: the run's env kwargs, else off).")
flags.DEFINE_integer("agent_max_tokens", _A.max_tokens, "agent: tokens per episode.")
flags.DEFINE_integer("agent_max_turn_tokens", _A.max_turn_tokens,
                     "agent: tokens per assistant turn.")
flags.DEFINE_integer("agent_batch", _A.batch, "agent: episodes in flight at once.")


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
  if bool(_WORKDIR.value) == bool(_PARAMS.value):
    raise app.UsageError("give exactly one of --workdir or --params")
  if not flags.FLAGS["verbosity"].present:
    logging.set_verbosity(logging.WARNING)   # orbax logs dozens of INFO lines per restore
  # pylint: disable=g-import-not-at-top
  from hybridmoe_jax.cli import terminal
  terminal.skip_absent_tpu()   # before any backend starts: no libtpu probe without a TPU
  terminal.install(bar=False)  # clean "warning: ..." lines instead of absl's prefix
  from hybridmoe_jax.tools import evaluate
  options = {name: flags.FLAGS[name].value for name in flags.FLAGS
             if name in _D.__dict__ or (_TASK.value == "agent" and name.startswith("agent_"))}
  try:
    evaluate.main(task=_TASK.value, workdir=_WORKDIR.value, params=_PARAMS.value,
                  output_dir=_OUTPUT.value, config=_CONFIG.value, option_values=options)
  except (ValueError, OSError) as e:    # ConfigError is a ValueError
    sys.exit(f"error: {e}")


if __name__ == "__main__":
  app.run(main)
