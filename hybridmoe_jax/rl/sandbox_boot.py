"""The first code a sandbox child runs (`python -I -S -B sandbox_boot.py`, cwd = its temp dir).

Never imported by the package: `rl/sandbox.py` starts it as a script. It reads `job.json`
and `solution.py` from the cwd, sets the resource limits, installs the audit hook, then
runs the solution: as a script (mode "script"), or defines its functions and calls each
(name, args) of job["calls"], printing one line per call:
    <nonce> <index> <json of the return value>      or      <nonce> <index> !<exception name>
The parent compares the values with the expected ones, which never enter this process.

The audit hook ends the process (exit code VIOLATION_EXIT, a "[sandbox] denied ..." line on
stderr) on: process creation (fork, exec, spawn, system, subprocess, posix_spawn), signals
to other processes, socket creation / connect / bind / name lookup, ctypes, importing
ctypes / _posixsubprocess / _socket, raising resource limits, walking the garbage
collector's objects (how a solution could reach the hook), creating links, and any write,
create, delete, rename or mode change of a path outside the temp dir (writes through
os.open or a dir_fd are refused everywhere, since their real target cannot be checked).
It keeps its own references to the functions it calls, so patching os / builtins from the
solution does not switch it off. It is a guard rail, not a security boundary: see
rl/sandbox.py for what is and is not guaranteed.
"""

import json
import os
import resource
import sys

VIOLATION_EXIT = 86


def _set_limits(limits: dict) -> None:
  """Soft = hard, so the solution cannot raise them again (unless it runs as root, which
  the audit hook covers by refusing resource.setrlimit)."""
  mb = 1024 * 1024
  pairs = [(resource.RLIMIT_CPU, (int(limits["cpu_s"]), int(limits["cpu_s"]) + 1)),
           (resource.RLIMIT_AS, (limits["memory_mb"] * mb,) * 2),
           (resource.RLIMIT_FSIZE, (limits["file_size_mb"] * mb,) * 2),
           (resource.RLIMIT_NPROC, (limits["max_procs"],) * 2),
           (resource.RLIMIT_NOFILE, (limits["max_open_files"],) * 2),
           (resource.RLIMIT_CORE, (0, 0))]
  for which, value in pairs:
    resource.setrlimit(which, value)


def _install_hook(root: str) -> None:
  """The audit hook; every name it uses is a local bound now (closure), not a global."""
  write, exit_, getcwd = os.write, os._exit, os.getcwd          # pylint: disable=protected-access
  str_, bytes_, int_, isinstance_, repr_ = str, bytes, int, isinstance, repr
  write_flags = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND
  root = root.rstrip("/") + "/"
  kill_prefixes = ("os.fork", "os.forkpty", "os.exec", "os.spawn", "os.posix_spawn",
                   "os.system", "os.kill", "os.killpg", "subprocess.", "socket.", "ctypes.",
                   "resource.setrlimit", "resource.prlimit", "gc.get_", "os.link",
                   "os.symlink", "signal.pthread_kill", "pty.", "_posixsubprocess")
  bad_imports = ("ctypes", "_ctypes", "_posixsubprocess", "_socket", "socket")
  path_events = ("os.remove", "os.rmdir", "os.mkdir", "os.truncate", "os.chmod", "os.chown",
                 "os.utime", "os.setxattr", "os.removexattr", "shutil.chown")

  def deny(event, detail):
    write(2, ("[sandbox] denied " + event + ": " + detail + "\n").encode("utf-8", "replace"))
    exit_(VIOLATION_EXIT)

  def inside(path) -> bool:
    """Is `path` (relative to the cwd) inside the temp dir? Pure string work: '..' and '.'
    are resolved by hand; links cannot exist (creating them is denied)."""
    if isinstance_(path, bytes_):
      path = path.decode("utf-8", "replace")
    if not isinstance_(path, str_):
      return False
    if not path.startswith("/"):
      path = getcwd() + "/" + path
    parts = []
    for part in path.split("/"):
      if part in ("", "."):
        continue
      if part == "..":
        if parts:
          parts.pop()
      else:
        parts.append(part)
    return ("/" + "/".join(parts) + "/").startswith(root)

  def hook(event, args):
    if event.startswith(kill_prefixes):
      deny(event, repr_(args)[:200])
    elif event == "import":
      if args[0] in bad_imports or args[0].split(".")[0] in bad_imports:
        deny(event, args[0])
    elif event == "open":
      path, mode, flags = args
      writing = (mode is not None and any(c in mode for c in "wax+")) or \
          (isinstance_(flags, int_) and flags & write_flags)
      if writing and (isinstance_(path, int_) or mode is None):
        deny(event, f"os.open / fd write {repr_(path)[:200]}: only open() by path is allowed")
      if writing and not isinstance_(path, (str_, bytes_)):
        # A PathLike's __fspath__ could answer differently when open() asks again.
        deny(event, f"write to a {type(path).__name__} path: pass a str")
      if writing and not inside(path):
        deny(event, f"write outside the sandbox dir: {repr_(path)[:200]}")
    elif event == "os.rename":
      src, dst = args[0], args[1]
      if args[2] not in (None, -1) or args[3] not in (None, -1) or \
          not (inside(src) and inside(dst)):
        deny(event, repr_(args)[:200])
    elif event in path_events:
      # The last arg is the dir_fd, except for os.truncate(path, length).
      dir_fd = args[-1] if event != "os.truncate" and len(args) > 1 else None
      if isinstance_(args[0], int_) or dir_fd not in (None, -1) or not inside(args[0]):
        deny(event, repr_(args)[:200])

  sys.addaudithook(hook)


def _run_calls(namespace: dict, job: dict) -> None:
  nonce = job["nonce"]
  for index, (name, args_json) in enumerate(job["calls"]):
    try:
      # Fresh arguments per call: a solution that mutates its input cannot spoil the next.
      value = namespace[name](*json.loads(args_json))
      line = f"{nonce} {index} {json.dumps(value)}"
    except BaseException as e:  # pylint: disable=broad-except
      line = f"{nonce} {index} !{type(e).__name__}"
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def main() -> None:
  with open("job.json", encoding="utf-8") as f:
    job = json.load(f)
  with open("solution.py", encoding="utf-8") as f:
    source = f.read()
  _set_limits(job["limits"])
  _install_hook(os.getcwd())
  code = compile(source, "solution.py", "exec")
  namespace = {"__name__": "__main__" if job["mode"] == "script" else "solution"}
  exec(code, namespace)  # pylint: disable=exec-used
  if job["mode"] == "calls":
    _run_calls(namespace, job)


if __name__ == "__main__":
  main()
