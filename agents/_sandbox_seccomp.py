"""The sandbox worker's kernel-interface layers: a seccomp filter and a fresh keyring.

Loaded by the supervisor from source (it runs as ``python -I -S -c``); standard library
only. Both are applied in the worker, after it dropped privileges, before the runner.
"""

import ctypes
import os

_libc = ctypes.CDLL(None, use_errno=True)
PR_SET_SECCOMP, SECCOMP_MODE_FILTER = 22, 2
KEYCTL_JOIN_SESSION_KEYRING = 1
# System calls the code never needs and that widen what it can reach (per architecture):
# io_uring (its own path around the syscall layer), the kernel keyrings, new or other
# namespaces (nested user namespaces with mounts), BPF, perf, reading or writing other
# processes' memory, userfaultfd. ``clone`` is refused only with a namespace flag; clone3
# (whose flags seccomp cannot read) answers ENOSYS, so libc falls back to clone.
SYSCALLS = {
    "x86_64": {
        "io_uring_setup": 425,
        "io_uring_enter": 426,
        "io_uring_register": 427,
        "keyctl": 250,
        "add_key": 248,
        "request_key": 249,
        "unshare": 272,
        "setns": 308,
        "bpf": 321,
        "perf_event_open": 298,
        "ptrace": 101,
        "process_vm_readv": 310,
        "process_vm_writev": 311,
        "userfaultfd": 323,
        "clone": 56,
        "clone3": 435,
    },
    "aarch64": {
        "io_uring_setup": 425,
        "io_uring_enter": 426,
        "io_uring_register": 427,
        "keyctl": 219,
        "add_key": 217,
        "request_key": 218,
        "unshare": 97,
        "setns": 268,
        "bpf": 280,
        "perf_event_open": 241,
        "ptrace": 117,
        "process_vm_readv": 270,
        "process_vm_writev": 271,
        "userfaultfd": 282,
        "clone": 220,
        "clone3": 435,
    },
}
AUDIT_ARCH = {"x86_64": 0xC000003E, "aarch64": 0xC00000B7}
NAMESPACE_FLAGS = 0x7E020000  # CLONE_NEW{NS,CGROUP,UTS,IPC,USER,PID,NET}
X32_SYSCALL_BIT = 0x40000000


class _SockFilter(ctypes.Structure):
    _fields_ = [
        ("code", ctypes.c_ushort),
        ("jt", ctypes.c_ubyte),
        ("jf", ctypes.c_ubyte),
        ("k", ctypes.c_uint),
    ]


class _SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.POINTER(_SockFilter))]


def _seccomp_program(machine: str) -> list:
    """A classic-BPF seccomp filter (code, jt, jf, k): refuse SYSCALLS with EPERM."""
    ld, jeq, jge, jset, ret = 0x20, 0x15, 0x35, 0x45, 0x06
    allow, kill, errno = 0x7FFF0000, 0x80000000, 0x00050000
    nrs = SYSCALLS[machine]
    denied = [nr for name, nr in nrs.items() if name not in ("clone", "clone3")]
    head = [
        (ld, 0, 0, 4),  # seccomp_data.arch
        (jeq, 1, 0, AUDIT_ARCH[machine]),
        (ret, 0, 0, kill),  # another ABI (i386 on x86_64): its numbers differ
        (ld, 0, 0, 0),  # seccomp_data.nr
    ]
    checks = [(jge, None, 0, X32_SYSCALL_BIT)] if machine == "x86_64" else []
    checks += [(jeq, None, 0, nr) for nr in denied]
    checks.append((jeq, "enosys", 0, nrs["clone3"]))
    tail = [
        (jeq, 0, 2, nrs["clone"]),
        (ld, 0, 0, 16),  # args[0], low half: clone's flags
        (jset, 1, 0, NAMESPACE_FLAGS),
        (ret, 0, 0, allow),
        (ret, 0, 0, errno | 1),  # EPERM
        (ret, 0, 0, errno | 38),  # ENOSYS
    ]
    prog = head + checks + tail
    deny_at, enosys_at = len(prog) - 2, len(prog) - 1
    out = []
    for i, (code, jt, jf, k) in enumerate(prog):
        if jt is None:
            jt = deny_at - i - 1
        elif jt == "enosys":
            jt = enosys_at - i - 1
        out.append((code, jt, jf, k))
    return out


def install_seccomp() -> str:
    machine = os.uname().machine
    if machine not in SYSCALLS:
        return ""
    prog = _seccomp_program(machine)
    filters = (_SockFilter * len(prog))(*[_SockFilter(*insn) for insn in prog])
    fprog = _SockFprog(len(prog), filters)
    _check(
        _libc.prctl(
            ctypes.c_int(PR_SET_SECCOMP),
            ctypes.c_ulong(SECCOMP_MODE_FILTER),
            ctypes.byref(fprog),
            ctypes.c_ulong(0),
            ctypes.c_ulong(0),
        ),
        "prctl(PR_SET_SECCOMP)",
    )
    return machine


def fresh_keyring() -> None:
    """Join a new, empty session keyring: the trainer's (and the keys it holds, which a
    possessor may read whatever its uid) is no longer the process's."""
    nr = SYSCALLS.get(os.uname().machine, {}).get("keyctl")
    if nr is None:
        raise OSError(0, "unknown system call numbers on this architecture")
    ret = _libc.syscall(
        ctypes.c_long(nr), ctypes.c_long(KEYCTL_JOIN_SESSION_KEYRING), ctypes.c_void_p(None)
    )
    if ret < 0:
        err = ctypes.get_errno()
        raise OSError(err, f"keyctl(KEYCTL_JOIN_SESSION_KEYRING): {os.strerror(err)}")


SECCOMP_LAYER = (
    "seccomp filter (refuses io_uring, keyctl/add_key/request_key, unshare, setns, "
    "clone with namespace flags, bpf, perf_event_open, ptrace, process_vm_*, userfaultfd)"
)


def _check(ret: int, what: str) -> None:
    if ret != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")
