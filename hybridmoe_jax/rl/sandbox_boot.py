"""The first code a sandbox child runs (`python -I -S -B sandbox_boot.py`, cwd = its work dir).

Never imported by the package: it runs as a script, started by rl/sandbox_ns.py inside the
run's namespaces (as /sandbox_boot.py, cwd /sandbox, after the rlimits, no_new_privs and
the seccomp filter are in place) or, in the audit-hook mode, by rl/sandbox.py in a temp dir.
sandbox_ns.py also loads it by path for `set_limits`. It reads `job.json` and
`solution.py` from the cwd, sets the resource limits (again: the same values), installs the
audit hook, then runs the solution: as a script (mode "script"), or defines its functions
and calls each (name, args) of job["calls"], printing one line per call:
    <nonce> <index> <json of the return value>      or      <nonce> <index> !<exception name>
The parent compares the values with the expected ones, which never enter this process.

The audit hook ends the process (exit code VIOLATION_EXIT, a "[sandbox] denied ..." line on
stderr) on: process creation (fork, exec, spawn, system, subprocess, posix_spawn), signals
to other processes, socket creation / connect / bind / name lookup, ctypes, importing
ctypes / _posixsubprocess / _socket, raising resource limits, walking the garbage
collector's objects (how a solution could reach the hook), creating links, and any write,
create, delete, rename or mode change of a path outside the work dir (writes through
os.open or a dir_fd are refused everywhere, since their real target cannot be checked).
It keeps its own references to the functions it calls, so patching os / builtins from the
solution does not switch it off; code that reaches the hook's frame or closure (an object
whose methods run inside the hook), corrupts interpreter memory or loads a C module under
another name does. It is a guard rail that names what it stops, not a security boundary:
with namespaces the kernel enforces the guarantees (rl/sandbox.py lists them); in the
audit-hook mode nothing does.
"""

import json
import os
import resource
import stat
import sys

VIOLATION_EXIT = 86


def set_limits(limits: dict) -> None:
  """Sets the rlimits of SandboxLimits `limits` (a dict), soft = hard so the solution
  cannot raise them again (no process of a namespaced run has CAP_SYS_RESOURCE; in the
  audit-hook mode as root, only the hook's refusal of resource.setrlimit stands)."""
  mb = 1024 * 1024
  pairs = [(resource.RLIMIT_CPU, (int(limits["cpu_s"]), int(limits["cpu_s"]) + 1)),
           (resource.RLIMIT_AS, (limits["memory_mb"] * mb,) * 2),
           (resource.RLIMIT_FSIZE, (limits["file_size_mb"] * mb,) * 2),
           # The count includes the process itself: max_procs more processes or threads.
           (resource.RLIMIT_NPROC, (limits["max_procs"] + 1,) * 2),
           (resource.RLIMIT_NOFILE, (limits["max_open_files"],) * 2),
           (resource.RLIMIT_CORE, (0, 0))]
  for which, value in pairs:
    resource.setrlimit(which, value)


def _install_hook(root: str, max_files: int) -> None:
  """The audit hook; every name it uses is a local bound now (closure), not a global, and
  every method it calls on a path is the unbound method of the exact builtin type, called on
  a fresh copy: a str / bytes subclass (overriding startswith, split, __eq__, __str__ ...)
  passed as a path is read for its characters only. PathLike objects never reach the hook
  (CPython converts them with __fspath__ before raising the event)."""
  write, exit_, getcwd, lstat, readlink = (os.write, os._exit, os.getcwd,  # pylint: disable=protected-access
                                           os.lstat, os.readlink)
  is_link, is_reg = stat.S_ISLNK, stat.S_ISREG
  str_, bytes_, int_, isinstance_, repr_, len_, any_, os_error = (
      str, bytes, int, isinstance, repr, len, any, OSError)
  violation_exit = VIOLATION_EXIT
  str_copy, startswith, split, join = str.__str__, str.startswith, str.split, str.join
  bytes_copy, decode = bytes.__bytes__, bytes.decode
  fs_encoding = sys.getfilesystemencoding()
  write_flags = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND
  root = str_copy(root).rstrip("/") + "/"
  kill_prefixes = ("os.fork", "os.forkpty", "os.exec", "os.spawn", "os.posix_spawn",
                   "os.system", "os.kill", "os.killpg", "subprocess.", "socket.", "ctypes.",
                   "resource.setrlimit", "resource.prlimit", "gc.get_", "os.link",
                   "os.symlink", "signal.pthread_kill", "pty.", "_posixsubprocess",
                   "os.chroot", "os.setuid", "os.setgid")
  bad_imports = ("ctypes", "_ctypes", "_posixsubprocess", "_socket", "socket")
  path_events = ("os.remove", "os.rmdir", "os.mkdir", "os.truncate", "os.chmod", "os.chown",
                 "os.utime", "os.setxattr", "os.removexattr", "shutil.chown", "os.chflags",
                 "os.lchflags", "os.lchmod", "os.lchown")
  creations = [0]   # files opened for writing + directories made: bounds the disk used

  def deny(event, detail):
    write(2, ("[sandbox] denied " + event + ": " + detail + "\n").encode("utf-8", "replace"))
    exit_(violation_exit)

  def show(args):
    """The event's args for the violation line, without calling any of their methods (a
    subclass's __repr__ would run the solution's code inside the hook)."""
    out = []
    for a in args:
      t = text(a)
      out.append(repr_(t) if t is not None else repr_(int_.__int__(a)) if isinstance_(a, int_)
                 else "None" if a is None else "<" + "object" + ">")
    return ("(" + join(", ", out) + ")")[:200]

  def text(path):
    """The characters of a str / bytes path as a fresh exact str, else None."""
    if isinstance_(path, str_):
      return str_copy(path)
    if isinstance_(path, bytes_):
      return decode(bytes_copy(path), fs_encoding, "surrogateescape")
    return None

  def resolve(path):
    """Absolute path with '.', '..' and every existing symlink resolved (/proc/self/root,
    /proc/self/cwd, /dev/fd/N ... included), by its own code: posixpath.realpath is Python
    code the solution could patch. None for a symlink loop."""
    if not startswith(path, "/"):
      path = getcwd() + "/" + path
    todo = [p for p in split(path, "/") if p not in ("", ".")]
    done, hops = [], 0
    while todo:
      part = todo.pop(0)
      if part == "..":
        if done:
          done.pop()
        continue
      here = "/" + join("/", done + [part])
      try:
        mode = lstat(here).st_mode
      except os_error:  # does not exist (yet): the rest is taken as written
        done.append(part)
        continue
      if not is_link(mode):
        done.append(part)
        continue
      hops += 1
      if hops > 40:
        return None
      target = text(readlink(here))
      if startswith(target, "/"):
        done = []
      todo = [p for p in split(target, "/") if p not in ("", ".")] + todo
    return "/" + join("/", done)

  def inside(path) -> bool:
    """Is `path` (relative to the cwd) inside the temp dir once resolved?"""
    path = text(path)
    if path is None:
      return False
    real = resolve(path)
    return real is not None and startswith(real + "/", root)

  def check_creation(event, path):
    creations[0] += 1
    if creations[0] > max_files:
      deny(event, f"more than {max_files} files or directories created or opened for "
                  f"writing (SandboxLimits.max_files): {repr_(text(path))[:200]}")

  def hook(event, args):
    if startswith(event, kill_prefixes):
      deny(event, show(args))
    elif event == "import":
      name = text(args[0]) or ""
      if name in bad_imports or split(name, ".")[0] in bad_imports:
        deny(event, name)
    elif event == "open":
      path, mode, flags = args
      if isinstance_(mode, str_):
        mode = str_copy(mode)
      writing = (isinstance_(mode, str_) and any_(c in mode for c in "wax+")) or \
          (isinstance_(flags, int_) and flags & write_flags)
      if not writing:
        return
      if isinstance_(path, int_) or mode is None:
        deny(event, f"os.open / fd write {show((path,))}: only open() by path is allowed")
      if not inside(path):
        deny(event, f"write outside the sandbox dir: {repr_(text(path))[:200]}")
      try:
        mode_bits = lstat(text(path)).st_mode
      except os_error:
        mode_bits = None
      if mode_bits is not None and not is_reg(mode_bits):  # a device or FIFO made in the dir
        deny(event, f"write to a non-regular file: {repr_(text(path))[:200]}")
      check_creation(event, path)
    elif event == "os.rename":
      src, dst = args[0], args[1]
      if args[2] not in (None, -1) or args[3] not in (None, -1) or \
          not (inside(src) and inside(dst)):
        deny(event, show(args))
    elif event in path_events:
      # The last arg is the dir_fd, except for os.truncate(path, length).
      dir_fd = args[-1] if event != "os.truncate" and len_(args) > 1 else None
      if isinstance_(args[0], int_) or dir_fd not in (None, -1) or not inside(args[0]):
        deny(event, show(args))
      if event == "os.mkdir":
        check_creation(event, args[0])

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
  set_limits(job["limits"])
  _install_hook(os.path.realpath(os.getcwd()), int(job["limits"]["max_files"]))
  code = compile(source, "solution.py", "exec")
  namespace = {"__name__": "__main__" if job["mode"] == "script" else "solution"}
  exec(code, namespace)  # pylint: disable=exec-used
  if job["mode"] == "calls":
    _run_calls(namespace, job)


if __name__ == "__main__":
  main()
