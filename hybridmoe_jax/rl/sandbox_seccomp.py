"""The seccomp filter of the RL code sandbox: a classic BPF program assembled here by hand.

Standard library only and importable by path (`rl/sandbox_ns.py` runs as a script and
loads it as a top-level module): no libseccomp bindings exist on these machines, and the
program is small enough to read. `program(machine)` returns the filter for x86_64 or
aarch64 (the bytes `prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ...)` takes); any other
machine gets a ValueError, so the sandbox refuses to start rather than run unfiltered.

What the filter guarantees, per system call (checked in this order):
  - a call made under another architecture (`seccomp_data.arch`: i386 `int 0x80` on
    x86_64, arm32 on aarch64) or an x32 call (nr >= 0x40000000) kills the process;
  - a call in DENIED returns EPERM (what namespaces do not cover: ptrace, other processes'
    memory / priority / CPUs / pidfds, device nodes, keyrings, kernel modules, kexec, every
    mount call, new namespaces, bpf, perf, userfaultfd, io_uring, clock setting, ...);
  - clone with any CLONE_NEW* flag returns EPERM; clone3 returns ENOSYS (its flags live in
    memory a filter cannot read; glibc then falls back to clone);
  - socket / socketpair with a family other than AF_UNIX return EPERM;
  - ioctl TIOCSTI / TIOCLINUX (typing into a terminal) return EPERM;
  - a number above LAST_KNOWN (a call newer than this table) returns ENOSYS;
  - everything else is allowed.
The numbers come from the kernel's unistd headers (tests/rl/test_sandbox_seccomp.py checks
them against the headers installed on the machine, when there are any).
"""

from __future__ import annotations

import struct

# seccomp_data: int nr; u32 arch; u64 instruction_pointer; u64 args[6] (little-endian on
# both machines, so the low 32 bits of args[i] are at 16 + 8 i).
_NR, _ARCH, _ARG0, _ARG1 = 0, 4, 16, 24
# Classic BPF opcodes (linux/bpf_common.h): load word absolute, jumps on a constant, return.
_LD_W_ABS, _JEQ, _JGE, _JGT, _JSET, _RET = 0x20, 0x15, 0x35, 0x25, 0x45, 0x06
RET_KILL_PROCESS = 0x80000000
RET_ALLOW = 0x7FFF0000
_RET_ERRNO = 0x00050000
EPERM, ENOSYS = 1, 38
X32_BIT = 0x40000000
LAST_KNOWN = 467          # open_tree_attr (Linux 6.15): newer numbers get ENOSYS

AF_UNIX = 1
TIOCSTI, TIOCLINUX = 0x5412, 0x541C
CLONE_NEW_FLAGS = (0x00000080 | 0x00020000 | 0x02000000 | 0x04000000 | 0x08000000 |
                   0x10000000 | 0x20000000 | 0x40000000)  # TIME NS CGROUP UTS IPC USER PID NET

# AUDIT_ARCH_* and the numbers of the calls the filter looks at, per `platform.machine()`.
ARCHES = {"x86_64": 0xC000003E, "aarch64": 0xC00000B7}
SYSCALLS = {
    "x86_64": dict(
        ptrace=101, process_vm_readv=310, process_vm_writev=311, kcmp=312, mknod=133,
        mknodat=259, pidfd_open=434, pidfd_send_signal=424, pidfd_getfd=438,
        setpriority=141, sched_setaffinity=203, sched_setscheduler=144, sched_setparam=142,
        sched_setattr=314, ioprio_set=251, migrate_pages=256, move_pages=279,
        process_madvise=440, process_mrelease=448, personality=135, keyctl=250,
        add_key=248, request_key=249, init_module=175, finit_module=313, delete_module=176,
        kexec_load=246, kexec_file_load=320, mount=165, umount2=166, pivot_root=155,
        chroot=161, open_tree=428, move_mount=429, fsopen=430, fsconfig=431, fsmount=432,
        fspick=433, mount_setattr=442, open_tree_attr=467, name_to_handle_at=303,
        open_by_handle_at=304, quotactl=179, quotactl_fd=443, unshare=272, setns=308,
        bpf=321, perf_event_open=298, userfaultfd=323, fanotify_init=300,
        io_uring_setup=425, io_uring_enter=426, io_uring_register=427, reboot=169,
        swapon=167, swapoff=168, acct=163, settimeofday=164, clock_settime=227,
        clock_adjtime=305, adjtimex=159, sethostname=170, setdomainname=171, syslog=103,
        vhangup=153, lookup_dcookie=212, nfsservctl=180, uselib=134, iopl=172, ioperm=173,
        modify_ldt=154, clone=56, clone3=435, socket=41, socketpair=53, ioctl=16),
    "aarch64": dict(
        ptrace=117, process_vm_readv=270, process_vm_writev=271, kcmp=272, mknodat=33,
        pidfd_open=434, pidfd_send_signal=424, pidfd_getfd=438, setpriority=140,
        sched_setaffinity=122, sched_setscheduler=119, sched_setparam=118,
        sched_setattr=274, ioprio_set=30, migrate_pages=238, move_pages=239,
        process_madvise=440, process_mrelease=448, personality=92, keyctl=219, add_key=217,
        request_key=218, init_module=105, finit_module=273, delete_module=106,
        kexec_load=104, kexec_file_load=294, mount=40, umount2=39, pivot_root=41, chroot=51,
        open_tree=428, move_mount=429, fsopen=430, fsconfig=431, fsmount=432, fspick=433,
        mount_setattr=442, open_tree_attr=467, name_to_handle_at=264,
        open_by_handle_at=265, quotactl=60, quotactl_fd=443, unshare=97, setns=268, bpf=280,
        perf_event_open=241, userfaultfd=282, fanotify_init=262, io_uring_setup=425,
        io_uring_enter=426, io_uring_register=427, reboot=142, swapon=224, swapoff=225,
        acct=89, settimeofday=170, clock_settime=112, clock_adjtime=266, adjtimex=171,
        sethostname=161, setdomainname=162, syslog=116, vhangup=58, lookup_dcookie=18,
        nfsservctl=42, clone=220, clone3=435, socket=198, socketpair=199, ioctl=29),
}
# Every call of the tables except the ones with a rule on their arguments.
_ARG_RULES = ("clone", "clone3", "socket", "socketpair", "ioctl")
DENIED = tuple(sorted({n for t in SYSCALLS.values() for n in t} - set(_ARG_RULES)))


class _Asm:
  """A list of classic BPF instructions whose jumps name labels, resolved by `bytes()`."""

  def __init__(self):
    self.code, self.labels = [], {}

  def label(self, name: str) -> None:
    self.labels[name] = len(self.code)

  def load(self, offset: int) -> None:
    self.code.append((_LD_W_ABS, None, None, offset))

  def ret(self, value: int) -> None:
    self.code.append((_RET, None, None, value))

  def jump(self, op: int, k: int, true: str | None, false: str | None) -> None:
    """`if A <op> k goto true else goto false`; None: the next instruction."""
    self.code.append((op, true, false, k))

  def bytes(self) -> bytes:
    out = []
    for i, (op, true, false, k) in enumerate(self.code):
      jt, jf = (0 if t is None else self.labels[t] - i - 1 for t in (true, false))
      assert 0 <= jt <= 255 and 0 <= jf <= 255, "a BPF jump is longer than 255 instructions"
      out.append(struct.pack("=HBBI", op, jt, jf, k))
    return b"".join(out)


def program(machine: str) -> bytes:
  """The filter for `machine` (platform.machine()); ValueError for one without a table."""
  if machine not in SYSCALLS:
    raise ValueError(f"no seccomp table for machine {machine!r} (have {sorted(SYSCALLS)})")
  nr = SYSCALLS[machine]
  a = _Asm()
  a.load(_ARCH)
  a.jump(_JEQ, ARCHES[machine], None, "kill")
  a.load(_NR)
  if machine == "x86_64":
    a.jump(_JGE, X32_BIT, "kill", None)
  a.jump(_JGT, LAST_KNOWN, "enosys", None)
  for name in DENIED:
    if name in nr:
      a.jump(_JEQ, nr[name], "eperm", None)
  a.jump(_JEQ, nr["clone3"], "enosys", None)
  a.jump(_JEQ, nr["clone"], "clone", None)
  a.jump(_JEQ, nr["socket"], "socket", None)
  a.jump(_JEQ, nr["socketpair"], "socket", None)
  a.jump(_JEQ, nr["ioctl"], "ioctl", None)
  a.ret(RET_ALLOW)
  a.label("clone")                # clone(flags, ...): the flags are args[0] on both machines
  a.load(_ARG0)
  a.jump(_JSET, CLONE_NEW_FLAGS, "eperm", "allow")
  a.label("socket")               # socket(domain, ...) / socketpair(domain, ...)
  a.load(_ARG0)
  a.jump(_JEQ, AF_UNIX, "allow", "eperm")
  a.label("ioctl")                # the kernel reads the request as an unsigned int
  a.load(_ARG1)
  a.jump(_JEQ, TIOCSTI, "eperm", None)
  a.jump(_JEQ, TIOCLINUX, "eperm", "allow")
  a.label("allow")
  a.ret(RET_ALLOW)
  a.label("eperm")
  a.ret(_RET_ERRNO | EPERM)
  a.label("enosys")
  a.ret(_RET_ERRNO | ENOSYS)
  a.label("kill")
  a.ret(RET_KILL_PROCESS)
  return a.bytes()
