"""Device meshes, logical-axis sharding rules, expert-parallel MoE dispatch, multi-host setup.

Modules: `mesh` (mesh from the `mesh` config section, batch placement, divisibility checks),
`rules` (the one logical-axis rule table and the parameter-path -> logical-names table),
`exchange` (ragged all-to-all: the real collective and its all_gather emulation for CPU),
`ep_moe` (dropless / capacity-limited expert-parallel MoE inside `jax.shard_map`),
`shard_state` (placing a TrainState on a mesh), `distributed` (`jax.distributed` setup).
"""
