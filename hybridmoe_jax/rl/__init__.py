"""Agentic RL post-training (DESIGN s9): environments, sandbox, chat format, rollouts,
losses, curriculum, learner, the run and agent evaluation, one module each
(docs/ARCHITECTURE.md lists them).

Import the submodule you need (`from hybridmoe_jax.rl import chat_format`,
`from hybridmoe_jax.rl.envs import make_env`); nothing is imported eagerly.
"""
