"""Launch recipes for multi-host runs: an XPK command (TPU slices on GKE), a Kubernetes
JobSet manifest (TPU or GPU nodes) and a SLURM batch script (GPU nodes), rendered from a
topology and the run_train.py flags (`python -m hybridmoe_jax.launch`, recipes.py).

Nothing here starts anything: it prints text to review and submit. A tool (rank of
hybridmoe_jax/tools): no package module imports it.
"""
