"""Stage 0 of a namespaced sandbox run: builds the kernel's walls, then starts the boot script.

Started by `rl/sandbox.py` as `python -I -S -B sandbox_ns.py WORKDIR REPORT_FD PARENT_PID
DEADLINE` with cwd, stdout and stderr set; the package never imports it, and it imports
nothing of the package (it loads its siblings sandbox_boot.py and sandbox_seccomp.py by
path, as top-level modules). Pure standard library (os.unshare
and ctypes calls into libc): no bubblewrap on these machines, and no new dependency.

Three processes, each doing one thing:
  stage 0 (this script, in the host's namespaces): dies with its parent (PR_SET_PDEATHSIG),
    reads WORKDIR/job.json and solution.py and the boot script, drops its supplementary
    groups, enters new user, mount, PID, network, IPC, UTS and cgroup namespaces (a forked
    helper that stays outside writes the maps: inside uid / gid 0 = outside 65534 when the
    parent is root and has that id, else the parent's own ids; setgroups denied), forks
    the new PID namespace's init and waits for it.
  init (PID 1 of the run): while it still has the host's file identity, makes every mount
    private and clones read-only, nosuid trees of what `python -I -S` needs (/usr, the /lib*
    and /bin trees, sys.base_prefix, the interpreter's dir, /etc/ld.so.cache); then becomes
    the namespace's root (outside 65534: it can no longer open anything of root's), dies
    with stage 0, turns non-dumpable, and builds the new root on a tmpfs: those trees, the
    boot script, a fresh procfs of this PID namespace (its /proc/sys read-only), a /dev of
    null / zero / full / random / urandom, and ONE size- and inode-limited tmpfs seen as
    /sandbox (the cwd, holding copies of job.json and solution.py), /tmp and /dev/shm.
    It pivots into that root and detaches the old one, remounts / and /dev read-only, forks
    the payload, and waits: at DEADLINE (monotonic clock) it kills everything in the
    namespace; at the payload's end likewise (nothing of the run survives it: when PID 1
    exits the kernel kills the namespace). It reports on REPORT_FD one JSON line: the
    payload's wait status, whether the deadline hit, the tmpfs bytes used.
  payload: enters one more user namespace (uid 1000 there, no capability over any namespace
    init made), sets the rlimits (sandbox_boot.set_limits), PR_SET_NO_NEW_PRIVS and the
    seccomp filter (sandbox_seccomp), keeps only fds 0-2 and execs
    `python -I -S -B /sandbox_boot.py` (which adds the audit hook and runs the solution).
A step that fails writes {"setup_error": "<what> failed: <errno name> (<text>)"} on
REPORT_FD and exits SETUP_EXIT: the parent refuses to run rather than run with less.
"""

import ctypes
import errno
import json
import os
import select
import signal
import sys
import time

SETUP_EXIT = 87
NS_FLAGS = (("CLONE_NEWUSER", os.CLONE_NEWUSER), ("CLONE_NEWNS", os.CLONE_NEWNS),
            ("CLONE_NEWPID", os.CLONE_NEWPID), ("CLONE_NEWNET", os.CLONE_NEWNET),
            ("CLONE_NEWIPC", os.CLONE_NEWIPC), ("CLONE_NEWUTS", os.CLONE_NEWUTS),
            ("CLONE_NEWCGROUP", os.CLONE_NEWCGROUP))
NOBODY = 65534             # the outside uid / gid of a run when the parent is root
PAYLOAD_ID = 1000          # the payload's uid / gid in its own user namespace
SYSTEM_TREES = ("/usr", "/bin", "/sbin", "/lib", "/lib64", "/lib32", "/libx32")
SYSTEM_FILES = ("/etc/ld.so.cache",)
DEVICES = ("null", "zero", "full", "random", "urandom")
BOOT_NAME = "sandbox_boot.py"
HOSTNAME = "sandbox"

MS_NOSUID, MS_NODEV, MS_NOEXEC = 2, 4, 8
MS_BIND, MS_REC, MS_PRIVATE, MNT_DETACH = 4096, 16384, 1 << 18, 2
OPEN_TREE_CLONE, OPEN_TREE_CLOEXEC, AT_RECURSIVE, AT_EMPTY_PATH = 1, 0o2000000, 0x8000, 0x1000
AT_FDCWD, MOVE_MOUNT_F_EMPTY_PATH = -100, 4
ATTR_RDONLY, ATTR_NOSUID, ATTR_NODEV, ATTR_NOEXEC = 1, 2, 4, 8
PR_SET_PDEATHSIG, PR_SET_DUMPABLE, PR_SET_SECCOMP, PR_SET_NO_NEW_PRIVS = 1, 4, 22, 38
SECCOMP_MODE_FILTER = 2
# The calls libc has no wrapper for (the same numbers on x86_64 and aarch64 from 428 on).
NR_OPEN_TREE, NR_MOVE_MOUNT, NR_MOUNT_SETATTR = 428, 429, 442
NR_PIVOT_ROOT = {"x86_64": 155, "aarch64": 41}

_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long


class SetupError(Exception):
  """A step of the setup failed; the message names it and the errno."""


class _MountAttr(ctypes.Structure):
  _fields_ = [("attr_set", ctypes.c_uint64), ("attr_clr", ctypes.c_uint64),
              ("propagation", ctypes.c_uint64), ("userns_fd", ctypes.c_uint64)]


class _SockFprog(ctypes.Structure):
  _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]


def _failed(what: str, err: int) -> SetupError:
  return SetupError(f"{what} failed: {errno.errorcode.get(err, err)} ({os.strerror(err)})")


def _check(ret: int, what: str) -> int:
  if ret < 0:
    raise _failed(what, ctypes.get_errno())
  return ret


def _arg(v):
  if isinstance(v, str):
    return ctypes.c_char_p(os.fsencode(v))
  if isinstance(v, int):
    return ctypes.c_long(v)
  return v  # None or a ctypes byref


def _syscall(nr: int, what: str, *args) -> int:
  return _check(_libc.syscall(ctypes.c_long(nr), *map(_arg, args)), what)


def _prctl(what: str, option: int, *args) -> None:
  args = [_arg(a) for a in args] + [ctypes.c_ulong(0)] * (4 - len(args))
  _check(_libc.prctl(ctypes.c_int(option), *args), what)


def _mount(src, target: str, fstype, flags: int, data=None) -> None:
  what = f"mount({src or 'none'} on {target}, {fstype or 'flags ' + hex(flags)})"
  _check(_libc.mount(*map(_arg, (src, target, fstype)), ctypes.c_ulong(flags), _arg(data)), what)


def _set_attr(fd: int, path: str, attrs: int, recursive: bool, what: str) -> None:
  attr = _MountAttr(attrs, 0, 0, 0)
  flags = (AT_EMPTY_PATH if fd != AT_FDCWD else 0) | (AT_RECURSIVE if recursive else 0)
  _syscall(NR_MOUNT_SETATTR, f"mount_setattr({what})", fd, path, flags, ctypes.byref(attr),
           ctypes.sizeof(attr))


def _clone_tree(src: str, attrs: int) -> int:
  """A detached recursive copy of the mount tree at `src` with `attrs` set on every mount."""
  fd = _syscall(NR_OPEN_TREE, f"open_tree({src})", AT_FDCWD, src,
                OPEN_TREE_CLONE | OPEN_TREE_CLOEXEC | AT_RECURSIVE)
  _set_attr(fd, "", attrs, True, src)
  return fd


def _attach(fd: int, target: str) -> None:
  _syscall(NR_MOVE_MOUNT, f"move_mount(onto {target})", fd, "", AT_FDCWD, target,
           MOVE_MOUNT_F_EMPTY_PATH)
  os.close(fd)


def _write(path: str, text: str, what: str) -> None:
  try:
    with open(path, "w", encoding="ascii") as f:
      f.write(text)
  except OSError as e:
    raise _failed(what, e.errno) from e


class _Report:
  """JSON lines to the parent's report file (an fd only stage 0 and init hold)."""

  def __init__(self, fd: int):
    self.fd = fd

  def send(self, **fields) -> None:
    os.write(self.fd, (json.dumps(fields) + "\n").encode())

  def fail(self, error: Exception, stage: str) -> None:
    self.send(setup_error=str(error) if isinstance(error, SetupError) else
              f"{stage} setup: {error}")
    os._exit(SETUP_EXIT)  # pylint: disable=protected-access


# --- stage 0 ----------------------------------------------------------------------------------
def _name_failing_flag() -> tuple[str, int]:
  """(name, errno) of the namespace the kernel refuses, checked flag by flag in a throwaway
  child; ("", 0) if each alone works."""
  r, w = os.pipe()
  pid = os.fork()
  if pid == 0:
    os.close(r)
    name, err = "", 0
    try:
      for name, flag in NS_FLAGS:
        os.unshare(flag)
      name = ""
    except OSError as e:
      err = e.errno
    os.write(w, f"{name} {err}".encode())
    os._exit(0)  # pylint: disable=protected-access
  os.close(w)
  name, err = (os.read(r, 200).decode().split(" ") + ["", "0"])[:2]
  os.close(r)
  os.waitpid(pid, 0)
  return name, int(err)


def _maps_id(path: str, wanted: int) -> bool:
  """Does /proc/self/{uid,gid}_map map id `wanted` of this namespace to something?"""
  with open(path, encoding="ascii") as f:
    return any(int(first) <= wanted < int(first) + int(count)
               for first, _, count in (line.split() for line in f))


def _outside_ids() -> tuple[int, int]:
  """The ids the run's root maps to: 65534 when this process is root and has that id (in a
  rootless container it may not), else this process's own (the only ones it may map)."""
  if os.geteuid() == 0 and _maps_id("/proc/self/uid_map", NOBODY) and \
      _maps_id("/proc/self/gid_map", NOBODY):
    return NOBODY, NOBODY
  return os.geteuid(), os.getegid()


def _enter_namespaces() -> None:
  """New user, mount, PID, net, IPC, UTS and cgroup namespaces for this process, with the
  maps written by a helper that stays outside (a process cannot map an id other than its
  own from inside; the helper, as root, can map inside 0 to the unprivileged 65534)."""
  if os.geteuid() == 0:
    try:
      os.setgroups([])   # else root's supplementary groups would go along into the run
    except PermissionError:
      pass   # a user namespace with setgroups denied: its groups cannot change at all
  uid, gid = _outside_ids()
  go_r, go_w = os.pipe()
  ack_r, ack_w = os.pipe()
  helper = os.fork()
  if helper == 0:
    os.close(go_w)
    os.close(ack_r)
    msg = "ok"
    if os.read(go_r, 1) == b"1":
      target = f"/proc/{os.getppid()}"
      try:
        _write(f"{target}/setgroups", "deny", "writing setgroups")
        _write(f"{target}/uid_map", f"0 {uid} 1\n", f"writing uid_map (0 {uid} 1)")
        _write(f"{target}/gid_map", f"0 {gid} 1\n", f"writing gid_map (0 {gid} 1)")
      except SetupError as e:
        msg = str(e)
    os.write(ack_w, msg.encode())
    os._exit(0)  # pylint: disable=protected-access
  os.close(go_r)
  os.close(ack_w)
  try:
    os.unshare(sum(flag for _, flag in NS_FLAGS))
  except OSError as e:
    os.close(go_w)
    os.waitpid(helper, 0)
    name, err = _name_failing_flag()
    raise (_failed(f"unshare({name})", err) if name else
           _failed("unshare(" + "|".join(n for n, _ in NS_FLAGS) + ")", e.errno)) from e
  os.write(go_w, b"1")
  msg = os.read(ack_r, 4096).decode()
  os.waitpid(helper, 0)
  if msg != "ok":
    raise SetupError(msg)


def _trees(executable: str) -> tuple[list, list]:
  """(paths to clone read-only, (path, link text) symlinks to recreate) for the new root:
  the system trees (as symlinks where the host has a symlink: /bin -> usr/bin), the
  interpreter's prefix and dir when outside them."""
  clones, links = [], []
  for path in SYSTEM_TREES + SYSTEM_FILES:
    if os.path.islink(path):
      links.append((path, os.readlink(path)))
    elif os.path.exists(path):
      clones.append(path)
  for path in (os.path.realpath(sys.base_prefix), os.path.dirname(executable)):
    if not any(path == c or path.startswith(c + "/") for c in clones):
      clones.append(path)
  return clones, links


def main() -> None:
  workdir, report_fd, parent, deadline = sys.argv[1:5]
  report = _Report(int(report_fd))
  try:
    _prctl("prctl(PR_SET_PDEATHSIG)", PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != int(parent):   # the parent died before the line above
      os._exit(1)  # pylint: disable=protected-access
    machine = os.uname().machine
    try:
      seccomp_filter = sandbox_seccomp.program(machine)
    except ValueError as e:
      raise SetupError(f"seccomp: {e}") from e
    with open(os.path.join(workdir, "job.json"), "rb") as f:
      job_bytes = f.read()
    with open(os.path.join(workdir, "solution.py"), "rb") as f:
      source = f.read()
    here = os.path.dirname(os.path.abspath(__file__))
    with open(os.path.join(here, BOOT_NAME), "rb") as f:
      boot = f.read()
    executable = os.path.realpath(sys.executable)
    clones, links = _trees(executable)
    _enter_namespaces()
  except (SetupError, OSError) as e:
    report.fail(e, "stage 0")
  lifeline_r, lifeline_w = os.pipe()
  pid = os.fork()
  if pid == 0:
    os.close(lifeline_w)
    _init(workdir, report, lifeline_r, float(deadline), executable, clones, links,
          dict(job=job_bytes, source=source, boot=boot, machine=machine,
               filter=seccomp_filter))
  os.close(lifeline_r)
  _, status = os.waitpid(pid, 0)
  os._exit(min(255, abs(os.waitstatus_to_exitcode(status))))  # pylint: disable=protected-access


# --- init (PID 1) -----------------------------------------------------------------------------
def _work_tmpfs_options(job: dict, job_size: int) -> str:
  """The one writable tmpfs: room for max_files files of file_size_mb plus the job's own
  files; inodes for max_files plus its root, sandbox/, tmp/, shm/ and the two job files."""
  limits = job["limits"]
  page = 4096
  size = limits["max_files"] * limits["file_size_mb"] * 2**20 + (job_size // page + 2) * page
  return f"mode=0755,uid=0,gid=0,size={size},nr_inodes={limits['max_files'] + 6}"


def _build_root(root: str, clones: list, links: list, files: dict, job: dict) -> bool:
  """Fills the new root at `root` (a tmpfs; "." in practice); returns whether /proc could be
  mounted."""
  for path, fd, is_dir in clones:
    target = root + path
    os.makedirs(os.path.dirname(target), mode=0o755, exist_ok=True)
    if is_dir:
      os.makedirs(target, mode=0o755, exist_ok=True)
    else:
      open(target, "wb").close()
    _attach(fd, target)
  for path, text in links:
    os.symlink(text, root + path)
  with open(f"{root}/{BOOT_NAME}", "wb") as f:
    f.write(files["boot"])
  dev = root + "/dev"
  os.mkdir(dev, 0o755)
  _mount("tmpfs", dev, "tmpfs", MS_NOSUID | MS_NOEXEC, "mode=0755,size=65536,nr_inodes=64")
  for name, fd in files["devices"]:
    open(f"{dev}/{name}", "wb").close()
    _attach(fd, f"{dev}/{name}")
  for name, text in (("fd", "/proc/self/fd"), ("stdin", "/proc/self/fd/0"),
                     ("stdout", "/proc/self/fd/1"), ("stderr", "/proc/self/fd/2")):
    os.symlink(text, f"{dev}/{name}")
  # One tmpfs for every writable place, so one size and inode limit covers them all.
  work = root + "/.work"
  os.mkdir(work, 0o700)
  _mount("tmpfs", work, "tmpfs", MS_NOSUID | MS_NODEV | MS_NOEXEC,   # no dropped binaries
         _work_tmpfs_options(job, len(files["job"]) + len(files["source"])))
  for name, mode, target in (("sandbox", 0o755, "/sandbox"), ("tmp", 0o1777, "/tmp"),
                             ("shm", 0o1777, "/dev/shm")):
    os.mkdir(f"{work}/{name}")
    os.chmod(f"{work}/{name}", mode)
    os.makedirs(root + target, mode=0o755, exist_ok=True)
    if name == "sandbox":
      for fname, data in (("job.json", files["job"]), ("solution.py", files["source"])):
        with open(f"{work}/sandbox/{fname}", "wb") as f:
          f.write(data)
    _mount(f"{work}/{name}", root + target, None, MS_BIND)
  _check(_libc.umount2(_arg(work), MNT_DETACH), "umount2(work tmpfs)")
  os.rmdir(work)
  os.mkdir(root + "/proc", 0o555)
  try:
    _mount("proc", root + "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
  except SetupError:
    os.rmdir(root + "/proc")   # the kernel refuses a procfs here: no /proc in the run
    return False
  _attach(_clone_tree(root + "/proc/sys", ATTR_RDONLY | ATTR_NOSUID | ATTR_NODEV |
                      ATTR_NOEXEC), root + "/proc/sys")
  return True


def _kill_all() -> None:
  """From PID 1, kill(-1) reaches every other process of the namespace (and nothing else)."""
  try:
    os.kill(-1, signal.SIGKILL)
  except ProcessLookupError:
    pass


def _wait(payload: int, deadline: float) -> tuple[int, bool]:
  """Reaps every child until the payload ends or the deadline passes (then kills all in
  the namespace); returns (the payload's wait status, whether the deadline hit)."""
  pidfd = os.pidfd_open(payload)
  status, timed_out = None, False
  while status is None:
    remaining = deadline - time.monotonic()
    if remaining <= 0 and not timed_out:
      timed_out = True
      _kill_all()
    select.select([pidfd], [], [], min(max(remaining, 0), 0.25) if not timed_out else 0.25)
    while True:   # orphans of the run are reparented here: reap them as they end
      try:
        pid, st = os.waitpid(-1, os.WNOHANG)
      except ChildProcessError:
        break
      if pid == 0:
        break
      if pid == payload:
        status = st
  _kill_all()   # what the payload left running (a daemon, a setsid'd tree) ends with it
  while True:
    try:
      os.waitpid(-1, 0)
    except ChildProcessError:
      break
  return status, timed_out


def _init(workdir, report, lifeline, deadline, executable, clones, links, files) -> None:
  job = json.loads(files["job"])
  try:
    _mount(None, "/", None, MS_REC | MS_PRIVATE)
    _mount("tmpfs", workdir, "tmpfs", MS_NOSUID | MS_NODEV,
           "mode=0755,uid=0,gid=0,size=1048576")
    # From here on the new root is the cwd and every path is relative to it: the host path
    # to it may cross directories the unprivileged id below cannot enter (a 0700 TMPDIR).
    os.chdir(workdir)
    root = "."
    # Cloned while this process still has the host's file identity (the interpreter may sit
    # under a directory only root can enter); read-only and nosuid before they are attached.
    ro = ATTR_RDONLY | ATTR_NOSUID | ATTR_NODEV
    trees = [(path, _clone_tree(path, ro), os.path.isdir(path)) for path in clones]
    files["devices"] = [(name, _clone_tree(f"/dev/{name}", ATTR_RDONLY | ATTR_NOSUID |
                                           ATTR_NOEXEC)) for name in DEVICES]
    os.setresgid(0, 0, 0)
    os.setresuid(0, 0, 0)   # the namespace's root: outside 65534 when the parent is root
    # Set after the uid change (which clears it); then make sure stage 0 is still there.
    _prctl("prctl(PR_SET_PDEATHSIG)", PR_SET_PDEATHSIG, signal.SIGKILL)
    if select.select([lifeline], [], [], 0)[0]:
      os._exit(1)  # pylint: disable=protected-access
    _prctl("prctl(PR_SET_DUMPABLE)", PR_SET_DUMPABLE, 0)
    has_proc = _build_root(root, trees, links, files, job)
    _check(_libc.sethostname(_arg(HOSTNAME), ctypes.c_size_t(len(HOSTNAME))), "sethostname")
    _syscall(NR_PIVOT_ROOT[files["machine"]], "pivot_root", ".", ".")
    _check(_libc.umount2(_arg("."), MNT_DETACH), "umount2(old root)")
    os.chdir("/")
    for path in ("/", "/dev"):
      _set_attr(AT_FDCWD, path, ATTR_RDONLY | ATTR_NOSUID | ATTR_NODEV, False, path)
  except (SetupError, OSError) as e:
    report.fail(e, "init")
  signal.signal(signal.SIGINT, signal.SIG_IGN)   # no signal from inside may end PID 1
  payload = os.fork()
  if payload == 0:
    _payload(report, executable, job, files["filter"], has_proc)
  status, timed_out = _wait(payload, deadline)
  st = os.statvfs("/sandbox")
  report.send(status=status, timeout=timed_out, disk=(st.f_blocks - st.f_bfree) * st.f_frsize,
              proc=has_proc)
  os._exit(0)  # pylint: disable=protected-access


# --- payload ----------------------------------------------------------------------------------
def _payload(report, executable: str, job: dict, code: bytes, has_proc: bool) -> None:
  try:
    os.chdir("/sandbox")
    # init made itself non-dumpable, which makes /proc/self root's: undone for the maps (the
    # payload's memory holds nothing of init's, and exec sets dumpability anew anyway).
    _prctl("prctl(PR_SET_DUMPABLE)", PR_SET_DUMPABLE, 1)
    if has_proc:   # writing the maps needs /proc; without it the payload stays in init's
      os.unshare(os.CLONE_NEWUSER)
      _write("/proc/self/setgroups", "deny", "nested setgroups")
      _write("/proc/self/uid_map", f"{PAYLOAD_ID} 0 1\n", "nested uid_map")
      _write("/proc/self/gid_map", f"{PAYLOAD_ID} 0 1\n", "nested gid_map")
    set_limits(job["limits"])
    _prctl("prctl(PR_SET_NO_NEW_PRIVS)", PR_SET_NO_NEW_PRIVS, 1)
    buf = ctypes.create_string_buffer(code, len(code))
    prog = _SockFprog(len(code) // 8, ctypes.cast(buf, ctypes.c_void_p))
    _prctl("prctl(PR_SET_SECCOMP)", PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.byref(prog))
    # As subprocess does before exec: signals this interpreter ignores go back to default.
    for sig in (signal.SIGINT, signal.SIGPIPE, signal.SIGXFSZ):
      signal.signal(sig, signal.SIG_DFL)
    os.closerange(3, report.fd)
    os.closerange(report.fd + 1, os.sysconf("SC_OPEN_MAX"))
    os.set_inheritable(report.fd, False)
    os.execve(executable, [executable, "-I", "-S", "-B", "/" + BOOT_NAME], dict(os.environ))
  except (SetupError, OSError, ValueError) as e:
    report.fail(e, "payload")


if __name__ == "__main__":
  # The siblings, as top-level modules by path (this script never imports the package).
  sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
  import sandbox_seccomp  # pylint: disable=import-error
  from sandbox_boot import set_limits  # pylint: disable=import-error
  main()
