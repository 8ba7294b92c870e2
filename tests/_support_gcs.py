"""A Google Cloud Storage API on 127.0.0.1 for the gs:// tests (tests/cloud,
tests/parallel/test_multiprocess.py) and the input benchmark (benchmarks/input_formats.py):
`gcp-storage-emulator` (the cloud-test extra) in a subprocess, in memory, with one bucket.
Never used by training itself.

Clients find it through the environment: gcsfs (what etils epath uses for gs:// without
TensorFlow) reads STORAGE_EMULATOR_HOST; TensorStore (orbax's array writer) reads
TENSORSTORE_GCS_HTTP_URL and takes GOOGLE_AUTH_TOKEN_FOR_TESTING instead of credentials.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import subprocess
import sys
import tempfile
import time

BUCKET = "hm-test"
# Three shims: two for TensorStore (orbax's array store), which the emulator was not written
# for, and GCS preconditions (below).
# The emulator's HTTP server handles one connection at a time: a client connection that is
# open but idle (aiohttp's pool in gcsfs, TensorStore's) then blocks every other one, and
# orbax's parallel reads wait forever. Serve each connection in its own thread, and run the
# requests themselves one at a time (its in-memory store is not thread-safe).
_LAUNCH = (
    "import sys, runpy, threading\n"
    "from http import server\n"
    "server.HTTPServer = server.ThreadingHTTPServer\n"
    # Downloads carry the object's generation (TensorStore reads it from x-goog-generation
    # and calls a reply without it a malformed generation); patched before the server
    # module builds its routing table from these functions.
    "from gcp_storage_emulator.handlers import objects\n"
    "plain = objects.download\n"
    "def download(request, response, storage, *a, **k):\n"
    "  plain(request, response, storage, *a, **k)\n"
    "  try:\n"
    "    o = storage.get_file_obj(request.params['bucket_name'], request.params['object_id'])\n"
    "    response['x-goog-generation'] = str(o['generation'])\n"
    "    response['x-goog-metageneration'] = str(o.get('metageneration', '1'))\n"
    "  except Exception:\n"
    "    pass\n"
    "objects.download = download\n"
    # Preconditions (ifGenerationMatch: 0 = only if absent) on uploads, deletes and metadata
    # patches, which the emulator ignores: the gs:// workdir lock is built on them.
    "from http import HTTPStatus\n"
    "def guarded(f):\n"
    "  def run(request, response, storage, *a, **k):\n"
    "    want = request.query.get('ifGenerationMatch', [None])[0]\n"
    "    if want is not None and 'upload_id' not in request.query:\n"
    "      name = request.params.get('object_id') or request.query.get('name', [None])[0]\n"
    "      if name is None and isinstance(request.data, dict):\n"
    "        name = (request.data.get('meta') or request.data).get('name')\n"
    "      try:\n"
    "        have = str(storage.get_file_obj(request.params['bucket_name'], name)['generation'])\n"
    "      except Exception:\n"
    "        have = '0'\n"
    "      if have != str(want):\n"
    "        response.status = HTTPStatus.PRECONDITION_FAILED\n"
    "        return response.json({'error': {'code': 412, 'message': 'conditionNotMet'}})\n"
    "    return f(request, response, storage, *a, **k)\n"
    "  return run\n"
    "for m in ('insert', 'delete', 'patch'):\n"
    "  setattr(objects, m, guarded(getattr(objects, m)))\n"
    "from gcp_storage_emulator import server as emu\n"
    "lock = threading.Lock()\n"
    "def serial(f):\n"
    "  def run(self):\n"
    "    with lock:\n"
    "      return f(self)\n"
    "  return run\n"
    "for m in ('do_GET', 'do_POST', 'do_DELETE', 'do_PUT', 'do_PATCH'):\n"
    "  setattr(emu.RequestHandler, m, serial(getattr(emu.RequestHandler, m)))\n"
    "sys.argv = ['gcp_storage_emulator'] + sys.argv[1:]\n"
    "runpy.run_module('gcp_storage_emulator', run_name='__main__')\n")


def free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def env_for(url: str) -> dict[str, str]:
  return {"STORAGE_EMULATOR_HOST": url, "TENSORSTORE_GCS_HTTP_URL": url,
          "GOOGLE_AUTH_TOKEN_FOR_TESTING": "emulator"}


def _reset_clients() -> None:
  # gcsfs caches one filesystem per argument set; the endpoint is read at creation.
  try:
    import gcsfs  # pylint: disable=g-import-not-at-top
    gcsfs.GCSFileSystem.clear_instance_cache()
  except ImportError:
    pass


@contextlib.contextmanager
def running(timeout_s: float = 30.0):
  """Starts the emulator, points this process's environment at it -> its URL; stops it.

  Raises:
    RuntimeError: it did not answer within timeout_s (the caller skips with the reason).
  """
  port = free_port()
  # Its log goes to a file, never a pipe: an unread pipe fills (64 KiB of request lines) and
  # the emulator then blocks mid-reply, hanging every client (seen under pytest -n 2).
  log = tempfile.TemporaryFile(mode="w+")
  proc = subprocess.Popen([sys.executable, "-c", _LAUNCH, "start", "--host=127.0.0.1",
                           f"--port={port}", "--in-memory", f"--default-bucket={BUCKET}"],
                          stdout=subprocess.DEVNULL, stderr=log, text=True)
  url = f"http://127.0.0.1:{port}"
  saved = {k: os.environ.get(k) for k in env_for(url)}
  try:
    deadline = time.time() + timeout_s
    while True:
      try:
        socket.create_connection(("127.0.0.1", port), 0.2).close()
        break
      except OSError:
        if proc.poll() is not None or time.time() > deadline:
          log.seek(0)
          raise RuntimeError("gcp-storage-emulator did not start: "
                             f"{(log.read() if proc.poll() is not None else 'timeout')[-300:]}")
        time.sleep(0.1)
    os.environ.update(env_for(url))
    _reset_clients()
    # gcsfs asks every bucket whether it is hierarchical and logs a warning when it cannot.
    logging.getLogger("gcsfs").setLevel(logging.ERROR)
    yield url
  finally:
    proc.terminate()
    try:
      proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
      proc.kill()
    log.close()
    for k, v in saved.items():
      if v is None:
        os.environ.pop(k, None)
      else:
        os.environ[k] = v
    _reset_clients()
