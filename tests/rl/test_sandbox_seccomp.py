"""The sandbox's seccomp filter, read by a small classic-BPF interpreter: every verdict for
every call number on both machines, and the numbers against the kernel headers here."""

import os
import re
import struct

import pytest

from hybridmoe_jax.rl import sandbox_seccomp as sc

ERRNO = 0x00050000
FOREIGN = {"x86_64": 0x40000003, "aarch64": 0x40000028}   # AUDIT_ARCH_I386, AUDIT_ARCH_ARM
HEADERS = {"x86_64": "/usr/include/x86_64-linux-gnu/asm/unistd_64.h",
           "aarch64": "/usr/include/asm-generic/unistd.h"}


def verdict(machine: str, nr: int, args=(0,) * 6, arch=None) -> int:
  """What the filter returns for one call (seccomp_data built as the kernel lays it out)."""
  prog = sc.program(machine)
  data = struct.pack("<iIQ6Q", nr, sc.ARCHES[machine] if arch is None else arch, 0,
                     *(list(args) + [0] * (6 - len(args))))
  code = [struct.unpack("=HBBI", prog[i:i + 8]) for i in range(0, len(prog), 8)]
  pc, acc = 0, 0
  for _ in range(len(code)):   # forward jumps only: at most one pass
    op, jt, jf, k = code[pc]
    if op == 0x20:
      acc, pc = struct.unpack_from("<I", data, k)[0], pc + 1
    elif op == 0x06:
      return k
    else:
      taken = {0x15: acc == k, 0x35: acc >= k, 0x25: acc > k, 0x45: bool(acc & k)}[op]
      pc += 1 + (jt if taken else jf)
  raise AssertionError("the program fell off its end")


@pytest.mark.parametrize("machine", sorted(sc.SYSCALLS))
def test_every_call_number_gets_the_documented_verdict(machine):
  table = sc.SYSCALLS[machine]
  denied = {table[n] for n in sc.DENIED if n in table}
  special = {table[n] for n in ("clone", "clone3", "socket", "socketpair", "ioctl")}
  for nr in range(sc.LAST_KNOWN + 1):
    want = ERRNO | sc.EPERM if nr in denied else None if nr in special else sc.RET_ALLOW
    if want is not None:
      assert verdict(machine, nr) == want, (machine, nr)
  for nr in (sc.LAST_KNOWN + 1, 1000, sc.X32_BIT - 1):
    assert verdict(machine, nr) == ERRNO | sc.ENOSYS, nr
  assert verdict(machine, table["clone3"]) == ERRNO | sc.ENOSYS
  assert verdict(machine, table["getpid" if "getpid" in table else "ptrace"],
                 arch=FOREIGN[machine]) == sc.RET_KILL_PROCESS
  assert verdict(machine, 0, arch=FOREIGN[machine]) == sc.RET_KILL_PROCESS
  if machine == "x86_64":
    assert verdict(machine, sc.X32_BIT | 39) == sc.RET_KILL_PROCESS   # x32 getpid


@pytest.mark.parametrize("machine", sorted(sc.SYSCALLS))
def test_argument_rules(machine):
  t = sc.SYSCALLS[machine]
  sigchld, thread = 17, 0x3D0F00   # fork; pthread_create's clone flags
  for flags in (sigchld, thread):
    assert verdict(machine, t["clone"], (flags,)) == sc.RET_ALLOW
  for bit in range(32):
    if sc.CLONE_NEW_FLAGS & (1 << bit):
      assert verdict(machine, t["clone"], (sigchld | (1 << bit),)) == ERRNO | sc.EPERM, bit
  for call in ("socket", "socketpair"):
    assert verdict(machine, t[call], (1, 1)) == sc.RET_ALLOW       # AF_UNIX
    for family in (2, 10, 16, 17, 40):   # INET, INET6, NETLINK, PACKET, VSOCK
      assert verdict(machine, t[call], (family, 1)) == ERRNO | sc.EPERM, (call, family)
  # The kernel reads the ioctl request as an unsigned int: high bits cannot hide TIOCSTI.
  for request in (sc.TIOCSTI, sc.TIOCSTI | 1 << 32, sc.TIOCLINUX):
    assert verdict(machine, t["ioctl"], (1, request)) == ERRNO | sc.EPERM
  assert verdict(machine, t["ioctl"], (1, 0x5401)) == sc.RET_ALLOW   # TCGETS


def test_an_unknown_machine_is_refused():
  with pytest.raises(ValueError, match="no seccomp table for machine 'riscv64'"):
    sc.program("riscv64")


@pytest.mark.parametrize("machine", sorted(sc.SYSCALLS))
def test_numbers_match_the_kernel_headers(machine):
  path = HEADERS[machine]
  if not os.path.exists(path):
    pytest.skip(f"{path} not installed")
  with open(path, encoding="utf-8") as f:
    defined = {m[1]: int(m[2]) for m in re.finditer(r"#define __NR_(\w+)\s+(\d+)", f.read())}
  # open_tree_attr (Linux 6.15) is newer than some installed headers.
  checked = {n: nr for n, nr in sc.SYSCALLS[machine].items() if n in defined}
  assert {n: defined[n] for n in checked} == checked
  assert set(sc.SYSCALLS[machine]) - set(checked) <= {"open_tree_attr"}
  assert max(defined.values()) <= sc.LAST_KNOWN
