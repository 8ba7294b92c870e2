"""Readable figures of a run: expert load, MaxVio / bias ranges, loss curves, NIAH, VQA,
agentic RL (success per level over steps, agent-eval bars).

Every plot function returns a `matplotlib.figure.Figure` built without pyplot (no global
figure registry, no display: safe in threads and on headless machines); `save` writes it as
PNG and `png_bytes` / `rgb_array` give it to HTML reports and TensorBoard. This package
imports only numpy and matplotlib (rank 0 in tests/test_layering.py).
"""

from hybridmoe_jax.plots.curves import loss_figure
from hybridmoe_jax.plots.evals import niah_figure
from hybridmoe_jax.plots.evals import ruler_figure
from hybridmoe_jax.plots.evals import vqa_figure
from hybridmoe_jax.plots.figure import new_figure
from hybridmoe_jax.plots.figure import png_bytes
from hybridmoe_jax.plots.figure import rgb_array
from hybridmoe_jax.plots.figure import save
from hybridmoe_jax.plots.moe import expert_load_figure
from hybridmoe_jax.plots.moe import maxvio_figure
from hybridmoe_jax.plots.rl import agent_eval_bars
from hybridmoe_jax.plots.rl import rl_training_figure
from hybridmoe_jax.plots.rl import success_by_level
