"""Multi-turn environments with tools: the protocol (base.py) and the built-in environments
(arithmetic with a calculator, key-value pointer chasing, code checked in the sandbox), plus
single-turn reasoning-gym tasks (`reasoning_gym`, needs the reasoning-gym extra when built).

Importing this package registers the built-ins: `make_env("arithmetic")`, `env_names()`.
"""

from hybridmoe_jax.rl.envs.base import (  # noqa: F401 (the public names)
    FINISH_REASONS, Action, Answer, Environment, Malformed, Observation, StepResult, Tool,
    ToolCall, ToolSpec, env_names, get_tool, make_env, register_env, register_tool,
    tool_names)
from hybridmoe_jax.rl.envs import (  # noqa: F401 (registers the built-ins)
    arithmetic, calculator, code, reasoning_gym, retrieval)
