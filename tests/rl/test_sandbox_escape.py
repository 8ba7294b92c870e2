"""Adversarial programs against the RL code sandbox (issue 33): each tries to change
something outside its work dir, reach the host, or use unbounded resources. For every one,
nothing outside changes (a victim directory is compared file by file, content and mode,
before and after) and the run ends within its limits.

Issue 33 (the audit hook on): str / bytes subclasses that override the methods a guard
would call (startswith, split, __eq__, __str__, __fspath__, __repr__), PathLike objects that
answer differently on each call, `..`, symlinks through /proc (/proc/self/root,
/proc/self/cwd, /dev/fd), writes via builtins.open / io.open / os.open / pathlib, rename /
replace / unlink / rmdir / mkdir / chmod / truncate / shutil, patched builtins and __main__,
a device node made in the dir, fork and thread bombs, one big file, many files.

The kernel-enforced walls (issue 45) are attacked in test_sandbox_kernel_walls.py.
"""

import os

import pytest

from hybridmoe_jax.rl.sandbox import SandboxLimits, run_python
from tests.rl.sandbox_attacks import DISK_LIMITS, snapshot, victim  # noqa: F401 (fixture)

FAST = SandboxLimits(timeout_s=3.0, cpu_s=2, memory_mb=256)


# Each attack is formatted with V (the victim dir) and F (its file keep.txt).
ATTACKS = {
    # --- str / bytes subclasses -------------------------------------------------------------
    # A guard asking the path "startswith('/')?" takes it as relative to the cwd: inside.
    "str_startswith": "class S(str):\n  def startswith(self, *a): return False\n"
                      "open(S({F!r}), 'w').write('pwned')",
    "str_startswith_remove": "class S(str):\n  def startswith(self, *a): return False\n"
                             "import os\nos.remove(S({F!r}))",
    "str_split_eq": "import os\nclass S(str):\n"
                    "  def split(self, *a): return os.getcwd().split('/') + ['x']\n"
                    "  def __eq__(self, o): return True\n  __hash__ = str.__hash__\n"
                    "os.remove(S({F!r}))",
    "str_str_fspath": "class S(str):\n  def __str__(self): return 'inside.txt'\n"
                      "  def __fspath__(self): return 'inside.txt'\n"
                      "import os\nos.rename(S({F!r}), 'stolen.txt')",
    "str_repr_runs_code": "class S(str):\n  def __repr__(self):\n    print('REPR RAN')\n"
                          "    return 'x'\nimport os\nos.remove(S({F!r}))",
    "bytes_subclass": "class B(bytes):\n  def decode(self, *a, **k): return 'inside.txt'\n"
                      "  def startswith(self, *a): return True\n"
                      "open(B({F!r}.encode()), 'w').write('pwned')",
    "bytes_remove": "import os\nos.remove({F!r}.encode())",
    "pathlike_flips": "class P:\n  n = 0\n  def __fspath__(self):\n    P.n += 1\n"
                      "    return 'inside.txt' if P.n % 2 else {F!r}\n"
                      "for _ in range(4):\n  open(P(), 'w').write('pwned')",
    "import_name_subclass": "class S(str):\n  def __eq__(self, o): return False\n"
                            "  __hash__ = str.__hash__\n  def split(self, *a): return ['ok']\n"
                            "m = __import__(S('ctypes'))\n"
                            "m.CDLL(None).unlink({F!r}.encode())",
    # --- where a path leads ------------------------------------------------------------------
    "dotdot": "open('../' * 40 + {F!r}.lstrip('/'), 'w').write('pwned')",
    "proc_self_root": "open('/proc/self/root' + {F!r}, 'w').write('pwned')",
    "proc_self_cwd_up": "import os\nopen('/proc/self/cwd/../' + os.path.basename("
                        "os.getcwd()) + '/../../' + {F!r}.lstrip('/'), 'w').write('pwned')",
    "proc_cwd_parent": "open('/proc/self/cwd/../escape_by_proc.txt', 'w').write('pwned')",
    "dev_fd": "import os\nfd = os.open({V!r}, os.O_RDONLY)\n"
              "open('/dev/fd/%d/keep.txt' % fd, 'w').write('pwned')",
    "chdir_then_relative": "import os\nos.chdir({V!r})\nopen('keep.txt', 'w').write('pwned')",
    "symlink_create": "import os\nos.symlink({V!r}, 'v')\nopen('v/keep.txt', 'w').write('pwned')",
    "hardlink_create": "import os\nos.link({F!r}, 'h')\nopen('h', 'w').write('pwned')",
    # --- every way to write or change ---------------------------------------------------------
    "io_open": "import io\nio.open({F!r}, 'a').write('pwned')",
    "os_open": "import os\nos.write(os.open({F!r}, os.O_WRONLY | os.O_TRUNC), b'pwned')",
    "os_open_dir_fd": "import os\nd = os.open({V!r}, os.O_RDONLY)\n"
                      "os.write(os.open('keep.txt', os.O_WRONLY, dir_fd=d), b'pwned')",
    "pathlib_write": "import pathlib\npathlib.Path({F!r}).write_text('pwned')",
    "pathlib_touch_new": "import pathlib\npathlib.Path({V!r}, 'new.txt').touch()",
    "pathlib_unlink": "import pathlib\npathlib.Path({F!r}).unlink()",
    "pathlib_rename_in": "import pathlib\npathlib.Path({F!r}).rename('mine.txt')",
    "os_replace_over": "open('evil.txt', 'w').write('pwned')\nimport os\n"
                       "os.replace('evil.txt', {F!r})",
    "os_rename_out": "open('evil.txt', 'w').write('pwned')\nimport os\n"
                     "os.rename('evil.txt', {V!r} + '/planted.txt')",
    "os_unlink": "import os\nos.unlink({F!r})",
    "os_rmdir": "import os\nos.remove({V!r} + '/sub/inner.txt')\nos.rmdir({V!r} + '/sub')",
    "os_mkdir": "import os\nos.mkdir({V!r} + '/newdir')",
    "os_makedirs": "import os\nos.makedirs({V!r} + '/a/b/c')",
    "os_chmod": "import os\nos.chmod({F!r}, 0o777)",
    "os_fchmod": "import os\nos.fchmod(os.open({F!r}, os.O_RDONLY), 0o777)",
    "os_truncate": "import os\nos.truncate({F!r}, 0)",
    "os_utime": "import os\nos.utime({F!r}, (0, 0))",
    "shutil_rmtree": "import shutil\nshutil.rmtree({V!r})",
    "shutil_move": "import shutil\nshutil.move({F!r}, 'taken.txt')",
    "shutil_copy_over": "open('evil.txt', 'w').write('pwned')\nimport shutil\n"
                        "shutil.copy('evil.txt', {F!r})",
    # --- disabling the guard ------------------------------------------------------------------
    "patch_builtins": "import builtins\nbuiltins.any = lambda it: False\n"
                      "builtins.isinstance = lambda *a: False\nbuiltins.OSError = KeyError\n"
                      "open({F!r}, 'w').write('pwned')",
    "patch_main_exit_code": "import __main__, os\n__main__.VIOLATION_EXIT = 0\n"
                            "os._exit = lambda c: None\nopen({F!r}, 'w').write('pwned')",
    "patch_os_functions": "import os, posixpath\nos.getcwd = lambda: '/'\nos.lstat = None\n"
                          "os.readlink = None\nposixpath.realpath = lambda p, **k: '/'\n"
                          "open('/proc/self/root' + {F!r}, 'w').write('pwned')",
    "device_node": "import os, stat\nos.mknod('null', stat.S_IFCHR | 0o600, os.makedev(1, 3))\n"
                   "open('null', 'w').write('x')",
}


@pytest.mark.parametrize("attack", sorted(ATTACKS))
def test_nothing_outside_the_temp_dir_changes(victim, attack):
  before = snapshot(victim)
  parent_before = sorted(os.listdir(victim.parent))
  tmp_before = set(os.listdir("/tmp"))
  source = ATTACKS[attack].format(V=str(victim), F=str(victim / "keep.txt"))
  r = run_python(source, FAST)
  assert snapshot(victim) == before, (attack, r.killed, r.detail, r.stderr_tail)
  assert sorted(os.listdir(victim.parent)) == parent_before
  assert not {n for n in set(os.listdir("/tmp")) - tmp_before if n.startswith("escape")}
  assert "REPR RAN" not in r.stdout
  # Every attack is stopped by the guard or fails on its own (no attack may "succeed").
  assert r.killed in ("violation", "error"), (attack, r.killed, r.detail, r.stderr_tail)


def test_honest_paths_inside_still_work():
  """The guard resolves paths rather than pattern-matching them: /proc/self/cwd, `..` that
  stays inside, subclasses with honest contents and bytes paths are all fine inside."""
  src = ("import os, pathlib\n"
         "class S(str):\n  pass\n"
         "os.mkdir('d')\nopen('d/../a.txt', 'w').write('x')\n"
         "open('/proc/self/cwd/b.txt', 'w').write('y')\n"
         "open(S('c.txt'), 'w').write('z')\nos.remove(b'c.txt')\n"
         "pathlib.Path('a.txt').replace('d/a2.txt')\nos.chmod('b.txt', 0o600)\n"
         "print(sorted(os.listdir('.')), sorted(os.listdir('d')))")
  r = run_python(src, FAST)
  assert r.killed is None, r.stderr_tail
  assert "'b.txt'" in r.stdout and "['a2.txt']" in r.stdout


# --- resources --------------------------------------------------------------------------------
BOUNDED = {
    "fork_bomb": ("import os\nwhile True:\n  os.fork()\n", ("violation",)),
    "thread_bomb": ("import threading, time\nts = []\nwhile True:\n"
                    "  t = threading.Thread(target=time.sleep, args=(60,))\n  t.start()\n"
                    "  ts.append(t)\n", ("memory", "error", "cpu", "timeout")),
    "big_file": ("f = open('big.bin', 'wb')\nwhile True:\n  f.write(b'x' * 2**20)\n",
                 ("output",)),
    "sparse_file": ("import os\nopen('s.bin', 'w').close()\nos.truncate('s.bin', 2**40)\n",
                    ("output",)),
    "many_files": ("i = 0\nwhile True:\n  open('f%d' % i, 'wb').write(b'x' * 2**20)\n"
                   "  i += 1\n", ("violation",)),
    "many_dirs": ("import os\ni = 0\nwhile True:\n  os.mkdir('d%d' % i)\n  i += 1\n",
                  ("violation",)),
    "reopen_append": ("while True:\n  open('a.bin', 'ab').write(b'x' * 2**20)\n",
                      ("output", "violation")),
    "stdout_flood": ("while True:\n  print('x' * 100000)\n", ("output",)),
}

@pytest.mark.parametrize("case", sorted(BOUNDED))
def test_resource_use_is_bounded(case):
  body, kinds = BOUNDED[case]
  limits = DISK_LIMITS
  r = run_python(body, limits)
  assert r.killed in kinds, (case, r.killed, r.detail, r.stderr_tail)
  assert r.wall_s < limits.timeout_s + 2.0
  cap = (limits.max_files + 2) * limits.file_size_mb * 2**20
  assert r.disk_bytes <= cap, (case, r.disk_bytes, cap)
