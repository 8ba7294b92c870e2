"""Device meshes, logical-axis sharding rules, expert-parallel MoE dispatch, context
parallelism, multi-host setup: one module each (docs/ARCHITECTURE.md lists them). Nothing
here imports `train`.
"""
