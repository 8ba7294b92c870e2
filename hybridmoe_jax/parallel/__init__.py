"""Device meshes, logical-axis sharding rules, expert-parallel MoE dispatch, multi-host setup.

Modules: `mesh` (mesh from {axis: size}, batch placement, divisibility checks),
`rules` (the one logical-axis rule table and the parameter-path -> logical-names table),
`exchange` (ragged all-to-all: the real collective and its all_gather emulation for CPU),
`ep_moe` (dropless / capacity-limited expert-parallel MoE dispatch inside `jax.shard_map`),
`shard_state` (placing a state pytree on a mesh), `context` / `context_decode` (the
sequence over `context`: the training forward; prefill and decode over a sharded MLA
cache), `runtime` (a run's mesh, checks and MoE dispatch), `distributed`
(`jax.distributed` setup). Nothing here imports `train`.
"""
