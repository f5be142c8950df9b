"""The sandbox against hostile code: each attack is contained, reported as a tool error, and
the test process (standing in for the trainer) is untouched.

Every attack runs twice where that is safe: with all layers, and with the audit hook off,
to show the OS layers (namespaces, throwaway uid, rlimits) contain it on their own. The
hook-off variants run only when this machine gives the sandbox those layers.
"""

from __future__ import annotations

import json
import os
import re
import signal
import sys

import pytest

from polyrl.agents.sandbox import Sandbox, SandboxLimits, capabilities, run_python

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux sandbox")

LIMITS = SandboxLimits(
    cpu_seconds=2, wall_seconds=4, memory_mb=512, output_bytes=8192, max_processes=8
)


@pytest.fixture(scope="module")
def caps():
    return capabilities()


def box(audit: bool = True) -> Sandbox:
    return Sandbox(LIMITS, audit=audit)


def os_layers(caps) -> bool:
    """Whether the layers below the audit hook can contain attacks on this machine."""
    return caps["throwaway_uid"] and caps["pid_namespace"] and caps["mount_namespace"]


def assert_contained(result, *kinds):
    assert result.error in kinds, (result.error, result.stderr[-500:])
    text = result.as_text()
    assert "[error:" in text  # what the model reads back as the tool result
    assert os.getpid() == MY_PID  # the test process is alive and itself


MY_PID = os.getpid()


def test_plain_code_runs_with_numpy_and_reports_its_layers(caps):
    r = box().run("import numpy as np\nprint(int(np.arange(5).sum()), 6 * 7)")
    assert r.ok and r.stdout.strip() == "10 42" and r.exit_code == 0
    assert r.as_text() == "10 42"
    assert caps["ran"] and caps["audit_hook"]
    assert any("resource limits" in layer for layer in r.layers)


def test_infinite_loop_is_stopped():
    r = box().run("while True:\n    pass")
    assert_contained(r, "cpu_time", "wall_time")
    assert r.signal == signal.SIGKILL and r.exit_code is None  # killed at a limit
    assert r.started and not r.completed


def test_sleeping_forever_hits_the_wall_time_limit():
    r = Sandbox(SandboxLimits(wall_seconds=1.5)).run("import time\ntime.sleep(600)")
    assert_contained(r, "wall_time")
    assert r.signal == signal.SIGKILL and not r.completed  # killed, not left to sleep
    assert any("stopped by the wall-time limit" in n for n in r.notes), r.notes


def count_processes_of(uid: int) -> int:
    n = 0
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                with open(f"/proc/{pid}/status") as f:
                    n += any(line.startswith("Uid:") and int(line.split()[1]) == uid for line in f)
            except OSError:
                pass
    return n


FORK_BOMB = "import os\nwhile True:\n    os.fork()\n"


def test_fork_bomb_is_refused(caps):
    assert_contained(box().run(FORK_BOMB), "blocked")


def test_fork_bomb_without_the_audit_hook_is_capped_and_killed(caps):
    if not os_layers(caps):
        pytest.skip("needs the throwaway uid (RLIMIT_NPROC) and a PID namespace")
    before = len([p for p in os.listdir("/proc") if p.isdigit()])
    r = box(audit=False).run(FORK_BOMB)
    # refused by RLIMIT_NPROC: the tree dies of BlockingIOError, and with many processes
    # writing one stderr the last traceback line can be interleaved -> "exit" (non-zero)
    assert_contained(r, "exception", "blocked", "wall_time", "cpu_time", "killed", "exit")
    assert r.exit_code != 0
    uid = int(re.search(r"throwaway uid (\d+)", " ".join(r.layers)).group(1))
    assert count_processes_of(uid) == 0  # nothing it started is still running
    after = len([p for p in os.listdir("/proc") if p.isdigit()])
    assert after < before + 8


def test_allocating_10_gb_fails_with_a_memory_error():
    r = box().run("x = bytearray(10 * 1024**3)\nprint(len(x))")
    assert_contained(r, "memory")
    assert "MemoryError" in r.stderr


@pytest.mark.parametrize("audit", [True, False])
def test_writing_outside_the_workdir_changes_nothing(tmp_path, caps, audit):
    if not audit and not os_layers(caps):
        pytest.skip("needs the mount namespace and throwaway uid")
    target = tmp_path / "pwned.txt"
    code = (
        f"open({str(target)!r}, 'w').write('x')\n"
        f"open('../escape.txt', 'w').write('x')\nprint('wrote')"
    )
    r = box(audit).run(code)
    assert not target.exists()
    assert not os.path.exists("/tmp/escape.txt")
    if audit:
        assert_contained(r, "blocked")
    # without the hook the writes may succeed -- inside the private tmpfs, invisible here


@pytest.mark.parametrize("audit", [True, False])
def test_reading_outside_the_workdir_is_refused(tmp_path, caps, audit):
    if not audit and not os_layers(caps):
        pytest.skip("needs the mount namespace and throwaway uid")
    secret = tmp_path / "secret.txt"
    secret.write_text("TOP-SECRET")
    secret.chmod(0o600)
    r = box(audit).run(f"print(open({str(secret)!r}).read())")
    assert "TOP-SECRET" not in r.stdout
    assert_contained(r, "blocked", "exception")
    r = box(audit).run(f"print(open({os.path.abspath(__file__)!r}).read()[:50])")
    assert "sandbox against hostile code" not in r.stdout  # the project is hidden too
    assert_contained(r, "blocked", "exception")


@pytest.mark.parametrize("audit", [True, False])
def test_network_sockets_cannot_reach_anything(caps, audit):
    if not audit and not caps["network_namespace"]:
        pytest.skip("needs a network namespace")
    code = (
        "import socket\ns = socket.socket()\ns.settimeout(2)\n"
        "s.connect(('1.1.1.1', 80))\nprint('connected')"
    )
    r = box(audit).run(code)
    assert "connected" not in r.stdout
    assert_contained(r, "blocked")  # by the hook, or by the OS (no route: ENETUNREACH)
    if audit:
        assert "socket" in r.stderr


def test_printing_100_mb_is_cut_at_the_output_cap():
    r = box().run("import sys\nfor _ in range(100):\n    sys.stdout.write('x' * 2**20)\n")
    assert_contained(r, "output_limit")
    assert len(r.stdout) <= LIMITS.output_bytes < r.output_bytes
    assert r.signal == signal.SIGKILL and not r.completed  # killed at the cap, not drained


@pytest.mark.parametrize("audit", [True, False])
def test_killing_the_parent_or_the_trainer_fails(caps, audit):
    if not audit and not os_layers(caps):
        pytest.skip("needs the throwaway uid and a PID namespace")
    # os.getppid() is the sandbox's supervisor (0 inside a PID namespace), never this
    # process; the second attempt names this test process's pid outright.
    code = (
        f"import os, signal\nos.kill(os.getppid(), signal.SIGKILL)\n"
        f"os.kill({MY_PID}, signal.SIGKILL)\nprint('still here')"
    )
    r = box(audit).run(code)
    assert os.getpid() == MY_PID  # we survived
    if audit:
        assert_contained(r, "blocked")
    else:
        assert r.error in ("exception", "blocked"), r.stderr  # PermissionError/ProcessLookup


@pytest.mark.parametrize(
    "code",
    [
        "import os, signal\nsignal.pidfd_send_signal(os.pidfd_open({pid}), signal.SIGKILL)",
        "import importlib, os, signal\nimportlib.reload(os)\nimportlib.reload(signal)\n"
        "signal.pidfd_send_signal(os.pidfd_open({pid}), signal.SIGKILL)",
        "import _posixsubprocess\n_posixsubprocess.fork_exec()",
    ],
    ids=["pidfd", "pidfd-after-reload", "fork_exec"],
)
def test_calls_without_an_audit_event_are_refused_too(code):
    """Where no separate uid or namespace guards the trainer, the hook is all there is:
    signalling through a pidfd or forking through subprocess's C helper is refused."""
    r = box().run(code.format(pid=MY_PID) + "\nprint('still here')")
    assert os.getpid() == MY_PID
    assert_contained(r, "blocked")
    assert "still here" not in r.stdout


def test_sys_exit_is_reported_with_its_status():
    r = box().run("import sys\nprint('bye')\nsys.exit(3)")
    assert_contained(r, "exit")
    assert r.exit_code == 3 and r.stdout.strip() == "bye"
    r = box().run("import os\nos._exit(0)")
    assert r.ok  # a clean exit is not an error


def test_missing_module_is_an_exception_the_model_can_read():
    r = run_python("import no_such_module_xyz", LIMITS)
    assert_contained(r, "exception")
    assert "ModuleNotFoundError: No module named 'no_such_module_xyz'" in r.as_text()


def test_the_sandbox_leaves_no_working_directory_behind(caps):
    if caps["mount_namespace"]:
        pytest.skip("the working directory is a private tmpfs; nothing reaches the host")
    before = {p for p in os.listdir("/tmp") if p.startswith("polyrl-sandbox-")}
    box().run("open('x.txt', 'w').write('x')")
    after = {p for p in os.listdir("/tmp") if p.startswith("polyrl-sandbox-")}
    assert after <= before


def host_ipc() -> set[tuple[str, int, int]]:
    """(kind, id, creator uid) of every System V IPC object in this (the host's) namespace."""
    out = set()
    for kind in ("shm", "msg", "sem"):
        with open(f"/proc/sysvipc/{kind}") as f:
            header, *rows = f.read().splitlines()
        cols = header.split()
        for row in rows:
            values = dict(zip(cols, row.split(), strict=False))
            out.add((kind, int(row.split()[1]), int(values["cuid"])))
    return out


# Creates two 32 MiB shared-memory segments (attached, written, detached: resident memory
# that outlives the process, over any RLIMIT_AS), a message queue holding a message, and
# a semaphore set, lists the segments it can see, then returns -- leaving them all behind.
IPC_LEAK = """
import ctypes, json
libc = ctypes.CDLL(None, use_errno=True)
libc.shmat.restype = ctypes.c_void_p
IPC_CREAT = 0o1000
made = []
for _ in range(2):
    shmid = libc.shmget(0, ctypes.c_size_t(32 * 2**20), IPC_CREAT | 0o666)
    addr = libc.shmat(shmid, None, 0)
    ctypes.memset(addr, 1, 32 * 2**20)
    libc.shmdt(ctypes.c_void_p(addr))
    made.append(shmid)
queue = libc.msgget(0, IPC_CREAT | 0o666)
msg = ctypes.create_string_buffer(b"\\x01" + b"\\x00" * 7 + b"hello", 16)
sent = libc.msgsnd(queue, msg, ctypes.c_size_t(5), 0)
sem = libc.semget(0, 1, IPC_CREAT | 0o666)
seen = [int(row.split()[1]) for row in open("/proc/sysvipc/shm").read().splitlines()[1:]]
print(json.dumps({"shm": made, "queue": queue, "sent": sent, "sem": sem, "seen": seen}))
"""


def test_system_v_ipc_does_not_outlive_the_call(caps):
    """Issue 23: segments made inside a tool call stayed resident in the host after it."""
    if not (caps["ipc_namespace"] and os_layers(caps)):
        pytest.skip("needs an IPC namespace and a throwaway uid")
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    canary = libc.shmget(0, ctypes.c_size_t(4096), 0o1000 | 0o600)  # the host's own segment
    assert canary >= 0
    try:
        before = host_ipc()
        r = box(audit=False).run(IPC_LEAK)  # ctypes: the audit hook would refuse it
        assert r.ok, r.stderr
        made = json.loads(r.stdout)
        assert min(made["shm"]) >= 0 and made["queue"] >= 0 and made["sem"] >= 0, made
        assert made["sent"] == 0
        assert sorted(made["seen"]) == sorted(made["shm"])  # its own namespace: no canary
        # the per-call check found them in the sandbox's namespace and removed them ...
        assert r.ipc_left == {"shm": 2, "msg": 1, "sem": 1, "shm_bytes": 64 * 2**20}
        assert any("removed System V IPC" in n and "64 MiB" in n for n in r.notes), r.notes
        # ... and the host's namespace never held them
        uid = int(re.search(r"throwaway uid (\d+)", " ".join(r.layers)).group(1))
        after = host_ipc()
        assert not [o for o in after if o[2] == uid]
        assert after - before == set()
        assert ("shm", canary, os.getuid()) in after  # the host's segment is untouched
    finally:
        libc.shmctl(canary, 0, None)
    # a clean call leaves nothing to report
    clean = box(audit=False).run("print(1)")
    assert clean.ipc_left == {"shm": 0, "msg": 0, "sem": 0, "shm_bytes": 0}


# The audit hook resolves a relative path against the working directory, the kernel
# against the ``dir_fd`` given: with symlinks that differ between the two, a path that
# stays inside for the hook reaches /proc for the kernel (issue 23: the hook is no wall).
PAST_THE_HOOK = """
import os
os.makedirs("deep/1/2/3/4/5/6/7")
os.mkdir("x")
os.symlink(".", "x/s")  # in x, s is x itself
os.symlink("deep/1/2/3/4/5/6/7", "s")  # in the workdir, s is 8 levels down
proc = os.open("s/" + "../" * 7 + "proc", os.O_RDONLY, dir_fd=os.open("x", os.O_RDONLY))
"""
LIST_PROC = """
import json, os
pids = sorted(int(p) for p in os.listdir(proc) if p.isdigit())
cmds = [open(f"{p}/cmdline", "rb", opener=lambda f, m: os.open(f, m, dir_fd=proc)).read(300)
        for p in pids]
print(json.dumps([pids, [c.decode(errors="replace") for c in cmds]]))
"""


@pytest.mark.parametrize("audit", [True, False])
def test_proc_lists_only_the_sandboxs_own_processes(caps, audit):
    if not (caps["pid_namespace"] and caps["mount_namespace"]):
        pytest.skip("needs PID and mount namespaces")
    opening = PAST_THE_HOOK if audit else "import os\nproc = os.open('/proc', os.O_RDONLY)\n"
    r = box(audit).run(opening + LIST_PROC)
    assert r.ok, r.stderr
    pids, cmds = json.loads(r.stdout)
    assert pids == [1]  # the worker, PID 1 of its namespace, is all there is
    assert "python" in cmds[0] and "-I" in cmds[0]
    assert not any("pytest" in c for c in cmds)  # no host command line
    assert any(layer.startswith("own /proc") for layer in r.layers)


def an_extension_module() -> str:
    """The file of a C extension module of the standard library (a real ELF .so)."""
    import importlib

    for name in ("_json", "_csv", "_bisect", "_struct", "math"):
        path = getattr(importlib.import_module(name), "__file__", None)
        if path and path.endswith(".so"):
            return path
    pytest.skip("no standard-library extension module is a separate .so here")


# Copies an extension module into the working directory under a new name and imports it
# (no audit event covers that), then tries to execute a copied binary and a script.
LOAD_AND_EXEC = """
import importlib.util, os, shutil
data = open({so!r}, "rb").read()
open("mine.so", "wb").write(data)
spec = importlib.util.spec_from_file_location({name!r}, "mine.so")
try:
    importlib.util.module_from_spec(spec)
    print("imported")
except ImportError as e:
    print("import refused:", e)
for path, body in (("mytrue", open("/bin/true", "rb").read()), ("script", b"#!/bin/sh\\n")):
    open(path, "wb").write(body)
    os.chmod(path, 0o755)
    try:
        os.execv(path, [path])
    except OSError as e:
        print("exec refused:", e.errno)
"""


def test_code_written_to_the_workdir_cannot_be_loaded_or_executed(caps, tmp_path):
    if not (caps["mount_namespace"] and os_layers(caps)):
        pytest.skip("needs the private noexec working directory")
    so = an_extension_module()
    name = os.path.basename(so).split(".")[0]
    # the same file loads fine from an ordinary directory: the refusal is the mount's
    import importlib.util
    import shutil

    copy = tmp_path / "mine.so"
    shutil.copy(so, copy)
    assert importlib.util.module_from_spec(importlib.util.spec_from_file_location(name, copy))
    r = box(audit=False).run(LOAD_AND_EXEC.format(so=so, name=name))
    assert r.ok, r.stderr
    lines = r.stdout.splitlines()
    assert lines[0].startswith("import refused:") and "failed to map segment" in lines[0]
    assert lines[1:] == ["exec refused: 13", "exec refused: 13"]  # EACCES, twice
    assert any("noexec" in layer for layer in r.layers)
    # with the hook on, the import is refused the same way and reported as blocked
    r = box().run(
        "import importlib.util\n"
        f"open('mine.so', 'wb').write(open({so!r}, 'rb').read())\n"
        f"importlib.util.module_from_spec(importlib.util.spec_from_file_location({name!r}, 'mine.so'))"
    )
    assert_contained(r, "blocked")


MEMFD_EXEC = """
import os
fd = os.memfd_create("payload")
os.write(fd, open("/bin/true", "rb").read())
try:
    os.fchmod(fd, 0o755)
    os.execv(f"/proc/self/fd/{fd}", ["payload"])
except OSError as e:
    print("refused:", e.errno)
"""


def test_memory_files_cannot_be_executed_either(caps):
    r = box(audit=False).run("print(1)")
    if not any(layer.startswith("memfd_noexec") for layer in r.layers):
        pytest.skip("vm.memfd_noexec needs Linux 6.3+ and a PID namespace")
    r = box(audit=False).run(MEMFD_EXEC)
    assert r.stdout.startswith("refused:"), (r.stdout, r.stderr)


@pytest.mark.parametrize(
    "code",
    [
        "open('/etc/polyrl-was-here', 'w')",  # EACCES: the throwaway uid owns nothing there
        "import os\nos.setuid(0)",  # EPERM
        "import os\nopen(os.__file__, 'a')",  # the Python installation: read-only mount
    ],
    ids=["write-etc", "setuid", "write-python"],
)
def test_refusals_by_the_os_are_reported_as_blocked(caps, code):
    """With the hook off, what stops the code is the OS: still "blocked", not "exception"."""
    if not os_layers(caps):
        pytest.skip("needs the throwaway uid")
    assert_contained(box(audit=False).run(code), "blocked")


def test_an_error_the_code_raises_itself_is_an_exception():
    r = box().run("raise PermissionError('my own rule')")
    assert_contained(r, "exception")


def test_a_busy_loop_on_a_loaded_machine_ends_on_cpu_time():
    """Issue 23: under load the wall clock fired before RLIMIT_CPU. Time spent waiting
    for a CPU no longer counts against the wall-time limit.

    The load is made certain: this process (whose affinity the sandbox inherits) and four
    spinners, each in its own session (so the kernel's per-session scheduling groups
    cannot hand the sandbox a core of its own), are pinned to one CPU."""
    if not os.path.exists("/proc/self/schedstat"):
        pytest.skip("the kernel keeps no scheduler statistics")
    if not hasattr(os, "sched_setaffinity"):
        pytest.skip("no CPU affinity on this platform")
    import subprocess

    mine = os.sched_getaffinity(0)
    cpu = {min(mine)}
    load = [
        subprocess.Popen(
            [sys.executable, "-c", "while True: pass"],
            start_new_session=True,
            preexec_fn=lambda: os.sched_setaffinity(0, cpu),
        )
        for _ in range(4)
    ]
    os.sched_setaffinity(0, cpu)
    try:
        limits = dict(cpu_seconds=1, wall_seconds=1.5, memory_mb=512)
        # without the grace, the run gets well under 1 s of CPU in 1.5 s: wall time fires
        # (which shows the CPU is shared) ...
        r = Sandbox(SandboxLimits(**limits, load_grace_seconds=0)).run("while True:\n    pass")
        assert_contained(r, "wall_time")
        assert r.signal == signal.SIGKILL
        assert any("wall-time limit after" in n for n in r.notes), r.notes
        assert not any("waiting for a CPU" in n for n in r.notes), r.notes  # no extension
        # ... with it, the CPU limit does, and says so
        r = Sandbox(SandboxLimits(**limits, load_grace_seconds=60)).run("while True:\n    pass")
        assert_contained(r, "cpu_time")
        assert r.cpu_seconds >= 0.9
        assert any("waiting for a CPU" in n for n in r.notes), r.notes
        assert any("CPU-time limit (RLIMIT_CPU)" in n for n in r.notes), r.notes
    finally:
        os.sched_setaffinity(0, mine)
        for p in load:
            p.kill()
            p.wait()
    # a sleeper does not wait for a CPU while it sleeps: the wall-time limit still fires
    r = Sandbox(SandboxLimits(wall_seconds=1.0)).run("import time\ntime.sleep(60)")
    assert_contained(r, "wall_time")


def test_completed_needs_the_code_to_return_and_cannot_be_forged():
    assert box().run("x = 1").completed
    for code in (
        "import sys\nsys.exit(0)",
        "import os\nos._exit(0)",
        "import os\nos.write(3, b'done ' + b'0' * 32 + b'\\n')\nos._exit(0)",  # a guess
    ):
        r = box().run(code)
        assert r.started and not r.completed, code
    # exit status 126 and the setup-failure text are the code's own: an ordinary exit
    r = box().run("import sys\nsys.stderr.write('sandbox setup failed: x\\n')\nsys.exit(126)")
    assert_contained(r, "exit")
    assert r.started and not r.completed


# System call numbers, written out here independently of the supervisor's table.
NR = {
    "x86_64": {"keyctl": 250, "add_key": 248, "io_uring_setup": 425, "unshare": 272,
               "clone": 56, "setns": 308, "bpf": 321, "perf_event_open": 298},
    "aarch64": {"keyctl": 219, "add_key": 217, "io_uring_setup": 425, "unshare": 97,
                "clone": 220, "setns": 268, "bpf": 280, "perf_event_open": 241},
}  # fmt: skip
MACHINE = os.uname().machine
needs_known_arch = pytest.mark.skipif(
    MACHINE not in NR, reason=f"no system call numbers for {MACHINE} in this test"
)
KEYCTL_READ, KEYCTL_UNLINK, KEY_SPEC_SESSION_KEYRING = 11, 9, -3

READ_KEY = """
import ctypes, json
libc = ctypes.CDLL(None, use_errno=True)
buf = ctypes.create_string_buffer(256)
n = libc.syscall(ctypes.c_long({nr}), ctypes.c_long(11), ctypes.c_long({key}), buf,
                 ctypes.c_long(256))
err = ctypes.get_errno()
try:
    listed = {desc!r} in open("/proc/keys").read()
except OSError:
    listed = False
print(json.dumps([n, err, buf.raw[: max(n, 0)].decode(errors="replace"), listed]))
"""


@needs_known_arch
@pytest.mark.parametrize("seccomp", [True, False])
def test_a_key_the_trainer_holds_is_not_readable_inside(seccomp):
    """Issue 33: the trainer's session keyring was inherited; a possessor reads its keys
    whatever its uid. The sandbox joins a fresh one (and seccomp refuses keyctl)."""
    import ctypes
    import secrets

    libc = ctypes.CDLL(None, use_errno=True)
    nr = NR[MACHINE]
    desc = f"polyrl-test-{secrets.token_hex(4)}"
    key = libc.syscall(
        ctypes.c_long(nr["add_key"]), b"user", desc.encode(), b"TOP-SECRET-KEY",
        ctypes.c_size_t(14), ctypes.c_int(KEY_SPEC_SESSION_KEYRING),
    )  # fmt: skip
    if key < 0:
        pytest.skip(f"the host refuses add_key ({os.strerror(ctypes.get_errno())})")
    try:
        buf = ctypes.create_string_buffer(64)
        n = libc.syscall(ctypes.c_long(nr["keyctl"]), ctypes.c_long(KEYCTL_READ),
                         ctypes.c_long(key), buf, ctypes.c_long(64))  # fmt: skip
        assert buf.raw[:n] == b"TOP-SECRET-KEY"  # the trainer itself reads it
        r = Sandbox(LIMITS, audit=False, seccomp=seccomp).run(
            READ_KEY.format(nr=nr["keyctl"], key=key, desc=desc)
        )
        assert r.ok, r.stderr
        n, err, data, listed = json.loads(r.stdout)
        assert n == -1 and data == "" and not listed, r.stdout
        # seccomp: EPERM for every keyctl; without it the key is simply not possessed
        assert err == 1 if seccomp else err in (13, 126), err  # EACCES, ENOKEY
        assert any(layer.startswith("fresh session keyring") for layer in r.layers)
        assert any(layer.startswith("seccomp filter") for layer in r.layers) == seccomp
    finally:
        libc.syscall(ctypes.c_long(nr["keyctl"]), ctypes.c_long(KEYCTL_UNLINK),
                     ctypes.c_long(key), ctypes.c_long(KEY_SPEC_SESSION_KEYRING))  # fmt: skip


# Each refused call, then what must keep working under the filter: threads and fork.
SYSCALLS = """
import ctypes, json, os, threading
libc = ctypes.CDLL(None, use_errno=True)
def call(nr, *args):
    ret = libc.syscall(ctypes.c_long(nr), *[ctypes.c_long(a) for a in args])
    if ret == 0 and nr == {clone}:  # a clone that went through: the child leaves at once
        os._exit(0)
    return ret, ctypes.get_errno()
params = ctypes.create_string_buffer(120)
out = {{
    "io_uring_setup": (libc.syscall(ctypes.c_long({io_uring_setup}), ctypes.c_long(8), params),
                       ctypes.get_errno()),
    "unshare_user": call({unshare}, 0x10000000),
    "unshare_net": call({unshare}, 0x40000000),
    "clone_newuser": call({clone}, 0x10000000 | 17, 0, 0, 0, 0),
    "setns": call({setns}, 0, 0),
    "bpf": call({bpf}, 0, 0, 0),
    "perf_event_open": call({perf_event_open}, 0, 0, -1, -1, 0),
}}
seen = []
t = threading.Thread(target=seen.append, args=(1,))
t.start()
t.join()
pid = os.fork()
if pid == 0:
    os._exit(7)
out["thread"] = seen == [1]
out["fork"] = os.waitpid(pid, 0)[1] >> 8
print(json.dumps(out))
"""


@needs_known_arch
def test_io_uring_namespaces_bpf_and_perf_are_refused_inside():
    """Issue 33: io_uring and nested user namespaces with mounts were reachable."""
    import ctypes

    code = SYSCALLS.format(**NR[MACHINE])
    r = Sandbox(LIMITS, audit=False).run(code)
    assert r.ok, r.stderr
    out = json.loads(r.stdout)
    for name in ("io_uring_setup", "unshare_user", "unshare_net", "clone_newuser", "setns"):
        assert out[name] == [-1, 1], (name, out[name])  # EPERM from the filter
    for name in ("bpf", "perf_event_open"):
        assert out[name] == [-1, 1], (name, out[name])
    assert out["thread"] is True and out["fork"] == 7  # clone3 -> ENOSYS -> clone works
    # the filter is what refuses io_uring: the host itself allows it (where it does)
    libc = ctypes.CDLL(None, use_errno=True)
    fd = libc.syscall(ctypes.c_long(NR[MACHINE]["io_uring_setup"]), ctypes.c_long(8),
                      ctypes.create_string_buffer(120))  # fmt: skip
    if fd >= 0:
        os.close(fd)
        unfiltered = json.loads(Sandbox(LIMITS, audit=False, seccomp=False).run(code).stdout)
        assert unfiltered["io_uring_setup"][0] >= 0


def test_the_private_tmpfs_caps_its_inodes(caps):
    """Issue 33: bytes were capped, inodes not (130k empty files in 3 s)."""
    if not caps["mount_namespace"]:
        pytest.skip("needs the private tmpfs (mount namespace)")
    code = (
        "import os\nmade = 0\ntry:\n    for i in range(300):\n"
        "        open(f'f{i}', 'w').close()\n        made += 1\n"
        "except OSError as e:\n    print(made, e.errno)\nelse:\n    print(made, 0)\n"
    )
    r = Sandbox(SandboxLimits(tmpfs_inodes=100), audit=False).run(code)
    made, errno = map(int, r.stdout.split())
    assert errno == 28 and made < 100, r.stdout  # ENOSPC before the limit's count
    assert any("100 inodes" in layer for layer in r.layers), r.layers
    assert Sandbox(LIMITS, audit=False).run(code).stdout.split() == ["300", "0"]
