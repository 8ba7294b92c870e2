"""An OpenAI-compatible server with continuous batching on the hybrid cache.

`python -m hybridmoe_jax.serve --workdir=runs/default` (the optional extra `serve`: fastapi,
uvicorn). scheduler.py: the batching thread (no web dependency); protocol.py: requests and
errors; app.py: the routes (imports fastapi).
"""
