"""Where data files live: local paths, globs, directories, and `gs://` (cloud storage).

Cloud paths go through etils `epath` (the `cloud` extra: etils[epath] + gcsfs): orbax
already reads and writes checkpoints through it, so data, checkpoints, the workdir and
exports share one path layer; without TensorFlow its gs:// backend is fsspec's gcsfs, which
honours STORAGE_EMULATOR_HOST (the GCS emulator the tests start on 127.0.0.1).

Every storage failure is turned into one line (`storage_error`) naming the path and which of
three things is wrong: the path does not exist, there are no credentials (or they are
refused), or the storage cannot be reached.
"""

from __future__ import annotations

import fnmatch
import glob as glob_lib
import hashlib
import json
import os
import pathlib
import shutil
from collections.abc import Iterable, Sequence

_GLOB_CHARS = "*?["
CACHE_ENV = "HYBRIDMOE_DATA_CACHE"   # where remote shards are copied for random access


def is_remote(path) -> bool:
  """True for a URL-like path (gs://bucket/...): read through epath, not the OS."""
  return "://" in str(path)


def epath_module():
  """etils.epath, or a one-line ImportError naming the extra that brings it."""
  try:
    from etils import epath  # pylint: disable=g-import-not-at-top
  except ImportError as e:
    raise ImportError("gs:// paths need etils[epath] and gcsfs: pip install -e '.[cloud]'") from e
  return epath


def as_path(path):
  """A local path as pathlib.Path; a remote one as epath.Path (same methods we use)."""
  if is_remote(path):
    return epath_module().Path(str(path))
  return pathlib.Path(path).expanduser()


def _kind(e: BaseException) -> str:
  """'missing', 'credentials', 'unreachable' or 'other', from the exception and its causes."""
  seen = []
  while e is not None and len(seen) < 8:
    seen.append(e)
    e = e.__cause__ or e.__context__
  for x in seen:
    name = type(x).__name__
    text = str(x).lower()
    if isinstance(x, FileNotFoundError) or "nosuchbucket" in text or "404" in text:
      return "missing"
    if ("credential" in name.lower() or "auth" in name.lower() or "401" in text
        or "403" in text or "credentials" in text or isinstance(x, PermissionError)):
      return "credentials"
    if isinstance(x, (ConnectionError, TimeoutError)) or any(
        w in name for w in ("Connect", "Timeout", "ServerDisconnected")) or any(
            w in text for w in ("cannot connect", "connection refused", "timed out")):
      return "unreachable"
  return "other"


def storage_error(path, e: BaseException, doing: str = "read") -> OSError:
  """One line: the path, what failed, and the cause (missing / credentials / unreachable)."""
  kind = _kind(e)
  first = str(e).splitlines()[0][:200] if str(e) else type(e).__name__
  if kind == "missing":
    return FileNotFoundError(f"{path}: does not exist (cannot {doing} it)")
  if kind == "credentials":
    return PermissionError(f"{path}: cannot {doing} it: no credentials or access refused "
                           f"({first}); run `gcloud auth application-default login` or set "
                           "GOOGLE_APPLICATION_CREDENTIALS")
  if kind == "unreachable":
    where = os.environ.get("STORAGE_EMULATOR_HOST", "the storage service")
    return ConnectionError(f"{path}: cannot {doing} it: {where} is unreachable ({first})")
  return OSError(f"{path}: cannot {doing} it ({type(e).__name__}: {first})")


def _has_glob(path: str) -> bool:
  return any(c in path for c in _GLOB_CHARS)


def walk(root, suffixes) -> list[str]:
  """Files under directory `root` (a Path, local or remote), recursively, sorted as str,
  hidden entries (".git", ".DS_Store": a part below `root` starting with ".") skipped,
  names ending in `suffixes` only (all when None)."""
  if is_remote(root):  # one listing call (epath refuses recursive globs on GCS)
    fs, base = fsspec_for(str(root))
    scheme = str(root).split("://")[0]
    found = [f"{scheme}://{p}" for p in fs.find(base)]
    found = [(p, p[len(str(root)):].lstrip("/")) for p in found]
  else:  # relative to root, not a prefix of its text: root "." lists "x", not "./x"
    found = [(str(p), p.relative_to(root).as_posix()) for p in root.rglob("*") if p.is_file()]
  return sorted(p for p, rel in found if not any(part.startswith(".") for part in rel.split("/"))
                and (suffixes is None or p.endswith(tuple(suffixes))))


def fsspec_for(path: str):
  """(fsspec filesystem, path without the scheme) for a remote path: listings and
  directory copies that epath does not offer on GCS."""
  epath_module()
  from etils.epath import backend  # pylint: disable=g-import-not-at-top
  # epath's own filesystem object: one listing cache for both (a copy made through another
  # instance would leave epath's cached listing stale).
  fs = backend.fsspec_backend.fs(path)
  return fs, fs._strip_protocol(path)  # pylint: disable=protected-access


def list_files(paths: Iterable, suffixes: Sequence[str] | None, *,
               what: str = "data") -> list[str]:
  """Files named by `paths`: files as given, directories walked (sorted), globs expanded.

  Sorting makes the document order (so the shuffle and the held-out split) independent of
  the listing order of the file system or the bucket. Inside directories and globs only
  names ending in `suffixes` are taken (all when None); hidden entries are ignored.

  Raises:
    FileNotFoundError: a path or glob matches nothing (one line naming it).
    ValueError: a directory holds no file with a wanted suffix; no paths given.
    PermissionError / ConnectionError / OSError: cloud storage failures (`storage_error`).
  """
  paths = [str(p) for p in ([paths] if isinstance(paths, (str, os.PathLike)) else paths)]
  if not paths:
    raise ValueError(f"no {what} paths given")
  wanted = ("files" if suffixes is None else "/".join(f"*{s}" for s in suffixes) + " files")
  out: list[str] = []
  for raw in paths:
    try:
      if _has_glob(raw):
        if is_remote(raw):
          head, _, pattern = raw.partition("://")
          bucket_and_dir = pattern.split("/")
          k = next(i for i, part in enumerate(bucket_and_dir) if _has_glob(part))
          base = as_path(f"{head}://" + "/".join(bucket_and_dir[:k]))
          hits = sorted(str(p) for p in base.glob("/".join(bucket_and_dir[k:])))
        else:
          hits = sorted(glob_lib.glob(os.path.expanduser(raw), recursive=True))
        hits = [h for h in hits if not as_path(h).is_dir()
                and (suffixes is None or h.endswith(tuple(suffixes)))]
        if not hits:
          raise FileNotFoundError(f"{what} glob {raw!r} matches no {wanted}")
        out.extend(hits)
        continue
      path = as_path(raw)
      if path.is_file():
        out.append(str(path))
      elif path.is_dir():
        found = walk(path, suffixes)
        if not found:
          raise ValueError(f"{what} directory {raw!r} contains no {wanted}")
        out.extend(found)
      else:
        raise FileNotFoundError(f"{what} path {raw!r} does not exist")
    except (FileNotFoundError, ValueError, ImportError):
      raise
    except Exception as e:  # pylint: disable=broad-except  # cloud clients raise many kinds
      raise storage_error(raw, e, "list") from None
  return out


def open_read(path):
  """A binary, seekable file object for a local or remote path (one-line errors)."""
  try:
    return as_path(path).open("rb")
  except Exception as e:  # pylint: disable=broad-except
    raise storage_error(path, e) from None


def file_size(path) -> int:
  """Bytes in a local or remote file (epath's stat names it `length`)."""
  st = as_path(path).stat()
  return int(st.st_size if hasattr(st, "st_size") else st.length)


def cache_dir() -> pathlib.Path:
  return pathlib.Path(os.environ.get(CACHE_ENV) or
                      pathlib.Path.home() / ".cache" / "hybridmoe_jax" / "remote")


def mirror(url: str, dst: str | os.PathLike | None = None, *, skip: Sequence[str] = (),
           what: str = "directory") -> str:
  """The objects under `url` copied into local directory `dst` (default: the cache, keyed by
  the URL) -> dst; `url` itself when local.

  The copy is exact: files that are no longer in the bucket are removed from dst. Objects
  whose generation has not changed since the last mirror (recorded in dst/.mirror.json) are
  not fetched again. Each file is written beside its name and renamed into place. Names whose
  first path part matches a pattern of `skip` (fnmatch) are left out on both sides.

  Raises:
    FileNotFoundError: nothing is stored under `url` (one line naming it and `what`);
    PermissionError / ConnectionError / OSError: storage failures (`storage_error`).
  """
  if not is_remote(url):
    return str(url)
  url = str(url).rstrip("/")
  local = pathlib.Path(dst) if dst is not None else (
      cache_dir() / ("mirror-" + hashlib.sha256(url.encode()).hexdigest()[:16]))
  skipped = lambda rel: any(fnmatch.fnmatchcase(rel.split("/")[0], s) for s in skip)  # noqa: E731
  try:
    fs, base = fsspec_for(url)
    fs.invalidate_cache()  # another machine may have written since this process listed
    found = {p[len(base):].lstrip("/"): info for p, info in fs.find(base, detail=True).items()}
  except Exception as e:  # pylint: disable=broad-except  # cloud clients raise many kinds
    raise storage_error(url, e, "list") from None
  found = {rel: info for rel, info in found.items() if rel and not skipped(rel)}
  if not found:
    raise FileNotFoundError(f"{url}: no {what} there (nothing stored under it)")
  manifest = local / ".mirror.json"
  try:
    seen = json.loads(manifest.read_text()) if manifest.is_file() else {}
  except (OSError, ValueError):
    seen = {}
  local.mkdir(parents=True, exist_ok=True)
  for p in local.rglob("*"):
    rel = p.relative_to(local).as_posix()
    if p.is_file() and rel != manifest.name and rel not in found and not skipped(rel):
      p.unlink()
  for rel, info in sorted(found.items()):
    gen = str(info.get("generation") or info.get("md5Hash") or info.get("size"))
    out = local / rel
    if seen.get(rel) == gen and out.is_file():
      continue
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + f".part{os.getpid()}")
    try:
      fs.get_file(f"{base}/{rel}", str(tmp))
    except Exception as e:  # pylint: disable=broad-except
      tmp.unlink(missing_ok=True)
      raise storage_error(f"{url}/{rel}", e) from None
    os.replace(tmp, out)
    seen[rel] = gen
  manifest.write_text(json.dumps({k: v for k, v in seen.items() if k in found}))
  return str(local)


def upload(local: str, url: str, names: Sequence[str] | None = None) -> None:
  """Files under directory `local` (`names`, relative, in that order; default all, sorted)
  written as whole objects under `url`. A failure: one line (`storage_error`)."""
  if names is None:
    names = sorted(os.path.relpath(os.path.join(d, n), local)
                   for d, _, files in os.walk(local) for n in files)
  url = str(url).rstrip("/")
  fs, root = fsspec_for(url)
  for name in names:
    try:
      fs.put_file(os.path.join(local, name), f"{root}/{name}")
    except Exception as e:  # pylint: disable=broad-except  # cloud clients raise many kinds
      raise storage_error(f"{url}/{name}", e, "write") from None
  fs.invalidate_cache()


def local_copy(path: str) -> str:
  """`path` itself when local; a remote file copied once into the cache (`cache_dir()`).

  ArrayRecord's reader needs a local file for random access. The copy is made next to its
  final name and renamed into place when complete, so a killed copy is never taken for a
  whole one; a cached copy of another size (the object changed) is fetched again.
  """
  if not is_remote(path):
    return str(path)
  src = as_path(path)
  try:
    size = file_size(src)
  except Exception as e:  # pylint: disable=broad-except
    raise storage_error(path, e) from None
  key = hashlib.sha256(str(path).encode()).hexdigest()[:16]
  dst = cache_dir() / key / src.name
  if dst.is_file() and dst.stat().st_size == size:
    return str(dst)
  dst.parent.mkdir(parents=True, exist_ok=True)
  tmp = dst.with_name(dst.name + f".part{os.getpid()}")
  try:
    with src.open("rb") as fin, open(tmp, "wb") as fout:
      shutil.copyfileobj(fin, fout, 8 << 20)
  except OSError as e:
    tmp.unlink(missing_ok=True)
    if isinstance(e, (FileNotFoundError, PermissionError, ConnectionError)):
      raise storage_error(path, e) from None
    raise
  except Exception as e:  # pylint: disable=broad-except
    tmp.unlink(missing_ok=True)
    raise storage_error(path, e) from None
  os.replace(tmp, dst)
  return str(dst)
