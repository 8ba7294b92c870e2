"""Agentic RL post-training (DESIGN s9): multi-turn environments with tools (envs/), the
sandbox for model-written code, the chat / tool-call format that turns conversations into
token ids, batched multi-turn rollouts on the model's decode cache (episode.py, rollout.py),
advantages and policy losses (losses.py), the curriculum (curriculum.py), the learner step
(batch.py, learner.py), the run (sft.py, run_state.py, trainer.py, monitor.py), held-out
agent evaluation (evaluate.py) and readable trajectory logs (trajectory_log.py).

Import the submodule you need (`from hybridmoe_jax.rl import chat_format`,
`from hybridmoe_jax.rl.envs import make_env`); nothing is imported eagerly.
"""
