"""Agentic RL: multi-turn environments with tools (envs/), the sandbox for model-written
code, and the chat / tool-call format that turns conversations into token ids.

Import the submodule you need (`from hybridmoe_jax.rl import chat_format`,
`from hybridmoe_jax.rl.envs import make_env`); nothing is imported eagerly.
"""
