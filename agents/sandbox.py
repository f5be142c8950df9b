"""A code-execution sandbox for model-written Python; the trainer survives anything it does.

``Sandbox().run(code)`` runs ``code`` in a separate, throwaway process tree and returns a
:class:`SandboxResult` (stdout, stderr, exit status and, when something went wrong, a short
``error`` such as ``wall_time`` or ``blocked``). ``python_tool`` wraps it as a tool.
``Sandbox().run_tests(code, checks)`` runs a row's checks in a process of their own
against ``code`` in another (the ``unit_tests`` reward; see its docstring).

Processes::

    trainer --(new session)--> supervisor (root part, stdlib only) --fork--> worker --exec--> python runner
                                 reads output (capped), enforces wall time, kills the tree

Layers, from the outside in (what each one stops); each is used where the machine
offers it, and ``SandboxResult.layers`` lists those that were active:

1. **Separate processes, new session.** The trainer only waits on a pipe with a deadline;
   a crash, ``sys.exit`` or ``os._exit`` ends the worker, not the trainer. Signals the
   code sends to "its parent" reach the supervisor (or nothing, see 3), never the trainer.
2. **Resource limits** (``setrlimit`` in the worker): CPU seconds (``RLIMIT_CPU``: an
   infinite loop is killed at the limit), address space (``RLIMIT_AS``: allocating 10 GB
   raises MemoryError), file size, open files, no core dumps. Output is read by the
   supervisor and capped (printing 100 MB stops at the cap and the tree is killed); a
   wall-time deadline kills sleepers and anything the CPU limit misses. Time the code
   waited for a CPU on a loaded machine is added to the deadline (up to
   ``load_grace_seconds``), so a busy loop ends on its CPU limit, not on wall time;
   ``error`` and a note say which limit fired.
3. **Namespaces** (``unshare``; as root, or through a user namespace where unprivileged
   ones are allowed): a *network* namespace with no interfaces (no socket can reach
   anything), an *IPC* namespace (System V shared memory, message queues and semaphores,
   and POSIX message queues, die with the run instead of staying resident in the host), a
   *PID* namespace whose init is the worker (killing it kills every process
   the code started, even ones that left the process group) with a /proc of its own (the
   code sees only its own processes, no host command line), and a *mount* namespace in
   which every top-level directory but the system ones (``/usr``, ``/lib``, ``/etc``,
   ``/proc``, ``/dev``, ...) is replaced by an empty tmpfs mount (homes, ``/tmp``, the
   project wherever it lives), the Python installation is mounted back read-only,
   and the working directory is a fresh tmpfs, limited in size and inodes, that vanishes
   with the run, mounted ``noexec``: a binary, script or extension module the code writes there cannot
   be executed or loaded (and ``vm.memfd_noexec`` keeps memory files from standing in).
4. **A throwaway uid** (as root): the worker drops to a random unused uid with no
   groups and ``no_new_privs``. It owns no file, so it can write nothing outside the
   working directory and read nothing that is not world-readable; it cannot signal the
   trainer's processes; ``RLIMIT_NPROC`` (which root ignores, hence the uid) caps its
   processes tightly, so a fork bomb stalls at ``max_processes``.
5. **A fresh session keyring and a seccomp filter** (in the worker, before exec): the
   trainer's keyring (whose keys any possessor may read) is left behind, and io_uring,
   the keyring calls, new namespaces (``unshare``, ``setns``, ``clone`` with a
   ``CLONE_NEW*`` flag), BPF, perf, ptrace, ``process_vm_*`` and userfaultfd are refused.
6. **An audit hook** (PEP 578) in the worker's interpreter refuses, with a clear
   ``PermissionError``, file access outside the working directory (reads of the Python
   installation excepted), sockets, signals, process creation and ctypes calls. It is not
   a security boundary on its own (C code can bypass it); it turns attempts into readable
   errors and backs up the layers above where they are missing.

After every run the supervisor checks for System V IPC objects the code left behind,
removes them and reports them (``SandboxResult.ipc_left`` and a note). See
``agents/SANDBOX.md`` for the threat model.

Without root or user namespaces only 1, 2, 5 and 6 (plus a temporary directory that is
removed afterwards) remain; ``capabilities()`` says what this machine offers.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

_HERE = Path(__file__).resolve().parent


@dataclass
class SandboxLimits:
    cpu_seconds: float = 5.0  # CPU time of the code's process
    wall_seconds: float = 10.0  # wall time of the whole run
    # most extra wall time granted for time the code waited for a CPU (a loaded machine),
    # so that a busy loop ends on its CPU limit rather than on wall time
    load_grace_seconds: float = 10.0
    memory_mb: int = 512  # address space of each process
    # resident memory of the whole run: every process, System V and POSIX shared memory,
    # memory files; the run is stopped when it holds more (see agents/SANDBOX.md)
    run_memory_mb: int = 1024
    output_bytes: int = 16_384  # stdout + stderr kept; more kills the run
    max_processes: int = 16  # processes the throwaway uid may own (fork-bomb cap)
    file_size_mb: int = 16  # largest file the code may write
    open_files: int = 64
    tmpfs_mb: int = 64  # size of the private working directory (mount namespace)
    tmpfs_inodes: int = 4096  # files and directories it may hold (the sandbox's own included)

    def __post_init__(self) -> None:
        for name in ("memory_mb", "run_memory_mb", "max_processes", "open_files"):
            value = getattr(self, name)
            if type(value) is not int or value <= 0:
                raise ValueError(f"SandboxLimits.{name} must be a positive integer, not {value!r}")


@dataclass
class SandboxResult:
    stdout: str
    stderr: str
    exit_code: int | None
    signal: int | None
    error: str  # "" (ran to the end with status 0) or what went wrong, see below
    wall_seconds: float
    cpu_seconds: float = 0.0
    output_bytes: int = 0
    layers: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    # System V IPC objects the code left behind, found and removed after the run: counts
    # per kind ("shm", "msg", "sem") and "shm_bytes" (see the per-call cleanup check)
    ipc_left: dict[str, int] = field(default_factory=dict)
    # the code ran to its last statement: the runner sent the run's nonce back on its own
    # channel after the code returned (an exit of any status, or text on stdout/stderr,
    # cannot produce it). ``started``: the sandbox set up and began running the code.
    completed: bool = False
    started: bool = False
    # a tests run (``Sandbox.run_tests``): the checker's output (a failing check's
    # traceback) and why the row's checks could not run as written (not the code's fault)
    checks: str = ""
    harness: list[str] = field(default_factory=list)
    # the SandboxLimits field that stopped the run ("" when none did): wall_seconds,
    # cpu_seconds, output_bytes, memory_mb (an allocation past a process's address
    # space) or run_memory_mb (the run's processes and shared memory together)
    limit: str = ""
    # the most memory the run's processes and shared memory held (MiB): under a memory
    # cgroup its own count (v1 memory.max_usage_in_bytes, v2 memory.peak), polled the
    # supervisor's largest sum
    memory_peak_mb: float = 0.0
    # how ``run_memory_mb`` was held: "cgroup v2" / "cgroup v1" (a memory cgroup of the
    # run's own: the kernel refuses the run more) or "polled" (no writable memory cgroup:
    # the supervisor sums the run's memory from /proc and stops it past the budget)
    memory_enforcement: str = ""

    # error kinds: wall_time, cpu_time, output_limit, memory, blocked (audit hook or OS
    # refused an operation and the code did not handle it), exception (uncaught error),
    # exit (non-zero exit status), killed (other signal), sandbox (the sandbox failed
    # before the code started; nothing the code does can produce this one); tests runs
    # only: failed (the checks did not all pass), harness (the checks could not run)

    @property
    def ok(self) -> bool:
        return not self.error

    def as_text(self, limit: int = 2000) -> str:
        """The tool result the model reads: output, then what went wrong (if anything)."""
        parts = []
        if self.stdout:
            parts.append(_clip(self.stdout, limit))
        if self.stderr and self.error:
            parts.append(_clip(self.stderr, limit))
        if self.error:
            parts.append(f"[error: {ERROR_TEXT.get(self.error, self.error)}]")
        return "\n".join(parts) if parts else "[no output]"


ERROR_TEXT = {
    "wall_time": "time limit exceeded; the code was stopped",
    "cpu_time": "CPU time limit exceeded; the code was stopped",
    "output_limit": "output limit exceeded; the code was stopped",
    "memory": "memory limit exceeded",
    "blocked": "an operation the sandbox forbids (files outside the working directory, "
    "network, processes or signals)",
    "exception": "the code raised an exception",
    "exit": "the code exited with a non-zero status",
    "killed": "the code was killed by a signal",
    "sandbox": "the sandbox could not run the code",
    "failed": "the checks did not pass",
    "harness": "the checks could not be run as written",
}


def _clip(text: str, limit: int) -> str:
    text = text.rstrip("\n")
    return text if len(text) <= limit else text[: limit // 2] + "\n...\n" + text[-limit // 2 :]


# Sandbox runs in flight at once in this process (each is two processes); more wait.
_SLOTS = threading.BoundedSemaphore(max(2, 2 * (os.cpu_count() or 1)))


@functools.cache
def _python_paths(python: str) -> tuple[str, ...]:
    """Directories ``python -I`` reads from (prefixes and its import path)."""
    probe = (
        "import sys, json; print(json.dumps([sys.prefix, sys.base_prefix, sys.exec_prefix, "
        "sys.base_exec_prefix, *sys.path]))"
    )
    out = subprocess.run(
        [python, "-I", "-c", probe], capture_output=True, text=True, timeout=60, check=True
    )
    return tuple(p for p in json.loads(out.stdout) if p)


@functools.cache
def _source(name: str) -> str:
    return (_HERE / name).read_text(encoding="utf-8")


class Sandbox:
    """Runs Python code in isolation. Thread-safe: each ``run`` is its own process tree.

    ``isolate``: use namespaces when available; ``drop_privileges``: run as a throwaway
    uid when the supervisor is root; ``audit``: install the audit hook; ``seccomp``:
    install the system-call filter; ``memory_cgroup``: hold ``run_memory_mb`` with a memory
    cgroup where one is writable (False: the polled fallback). Turn layers off only to
    test the others.
    """

    def __init__(
        self,
        limits: SandboxLimits | None = None,
        *,
        isolate: bool = True,
        drop_privileges: bool = True,
        audit: bool = True,
        seccomp: bool = True,
        memory_cgroup: bool = True,
        python: str | None = None,
    ) -> None:
        self.limits = limits or SandboxLimits()
        self.isolate, self.drop_privileges, self.audit = isolate, drop_privileges, audit
        self.seccomp = seccomp
        if not isinstance(memory_cgroup, bool):
            raise TypeError(f"memory_cgroup must be a bool, not {type(memory_cgroup).__name__}")
        self.memory_cgroup = memory_cgroup
        self.python = python or sys.executable
        # the run's memory budget is held by a memory cgroup (made per run by the
        # supervisor) or, without one, polled from /proc: with neither it could not be
        # held at all, which is an error now rather than a run with no budget
        cgroup = memory_cgroup and os.access("/sys/fs/cgroup", os.W_OK)
        if not os.access("/proc/self/statm", os.R_OK) and not cgroup:
            raise RuntimeError(
                f"SandboxLimits.run_memory_mb={self.limits.run_memory_mb} cannot be enforced "
                "here: no writable memory cgroup and no /proc to poll the run's memory from"
            )

    def run(self, code: str) -> SandboxResult:
        """Run ``code``; at most ``2 x cpu_count`` runs execute at once per process."""
        if not isinstance(code, str):
            raise TypeError(f"code must be a string, not {type(code).__name__}")
        with _SLOTS:
            return self._run(code)

    def run_tests(
        self, code: str, checks: str, *, entry_point: str = "", preamble: str = ""
    ) -> SandboxResult:
        """Run ``checks`` (Python asserts; then ``check(<entry_point>)`` when one is named)
        against ``code``, each in its own process: the checks never enter the code's.

        The code's process runs ``preamble`` + ``code`` and answers the checker's requests;
        every name the checks neither define nor find in builtins is looked up there (a
        function becomes a stub that calls it remotely, any other value is copied), and
        every result crosses as plain data, decoded into fresh builtins before a check
        sees it, so no check ever calls an ``__eq__`` of the code's. Passing
        (``completed``, ``error == ""``) is said by the checker alone, with the run's
        nonce, on a channel the code's process does not hold. ``stdout``/``stderr`` are
        the code's; ``checks`` is the checker's output (a failing assert's traceback).
        """
        for name, text in (("code", code), ("checks", checks), ("preamble", preamble)):
            if not isinstance(text, str):
                raise TypeError(f"{name} must be a string, not {type(text).__name__}")
        tests = {"preamble": preamble, "source": checks, "entry_point": entry_point or ""}
        with _SLOTS:
            return self._run(preamble + "\n" + code if preamble else code, tests)

    def _request(self, code: str, tests: dict | None = None) -> dict:
        """What the supervisor reads on its stdin for one run."""
        return {
            "tests": tests,
            "seccomp": self.seccomp,
            "memory_cgroup": self.memory_cgroup,
            "code": code,
            "limits": asdict(self.limits),
            "isolate": self.isolate,
            "drop_privileges": self.drop_privileges,
            "audit": self.audit,
            "python": os.path.realpath(self.python),
            "runner": _source("_sandbox_runner.py"),
            "modules": {m: _source(f"{m}.py") for m in ("_sandbox_seccomp", "_sandbox_memory")},
            "python_paths": list(_python_paths(self.python)),
        }

    def _run(self, code: str, tests: dict | None = None) -> SandboxResult:
        request = self._request(code, tests)
        start = time.monotonic()
        proc = subprocess.Popen(
            [sys.executable, "-I", "-S", "-c", _source("_sandbox_supervisor.py")],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            start_new_session=True,
            env={"PATH": os.environ.get("PATH", "/usr/bin:/bin")},
        )
        try:
            out, err = proc.communicate(
                json.dumps(request).encode(),
                timeout=self.limits.wall_seconds + self.limits.load_grace_seconds + 30,
            )
        except subprocess.TimeoutExpired:
            _kill_group(proc)
            out, err = proc.communicate()
            return _supervisor_failed(
                err, start, "the supervisor did not finish; its session was killed"
            )
        finally:
            if proc.poll() is None:
                _kill_group(proc)
        try:
            rep = json.loads(out.decode())
        except ValueError:
            return _supervisor_failed(err, start, f"supervisor exited with {proc.returncode}")
        result = SandboxResult(
            rep["stdout"],
            rep["stderr"],
            rep["exit_code"],
            rep["signal"],
            "",
            rep["wall_seconds"],
            rep["cpu_seconds"],
            rep["output_bytes"],
            rep["layers"],
            rep["notes"],
            rep["ipc_left"],
            rep["completed"],
            rep["started"],
        )
        result.memory_peak_mb = rep["memory_peak"] / 2**20
        result.memory_enforcement = rep["memory_enforcement"]
        if tests is not None:
            result = _tests_result(rep, result)
        else:
            result.error = _classify(rep, result, float(self.limits.cpu_seconds))
        result.limit = _LIMITS.get(result.error, "")
        if rep["killed"] == "memory":
            result.limit = "run_memory_mb"
        if tests is not None:
            return result
        if result.error == "cpu_time":
            result.notes.append(
                f"stopped by the CPU-time limit (RLIMIT_CPU) after {result.cpu_seconds:.1f} s "
                "of CPU"
            )
        return result


# the SandboxLimits field behind each error kind (a supervisor's "memory" kill is the
# run's budget; a MemoryError in the code is its address space)
_LIMITS = {
    "wall_time": "wall_seconds",
    "cpu_time": "cpu_seconds",
    "output_limit": "output_bytes",
    "memory": "memory_mb",
}


def _tests_result(rep: dict, r: SandboxResult) -> SandboxResult:
    """A tests run's verdict comes from the checker alone: the code's exit, its output
    and anything it wrote on its own channels say nothing about passing."""
    checks = rep["checks"]
    r.checks, r.harness = checks["output"], checks["harness"]
    # the code's process ran if it said "start"; a checker that finished without calling
    # it (checks that need no code) ran the row all the same
    r.started = checks["started"] and (r.started or checks["passed"])
    r.completed = checks["passed"]
    if rep["killed"]:
        r.error = rep["killed"]
    elif not r.started:
        r.error = "sandbox"
    elif r.harness:
        r.error = "harness"
    elif not r.completed:
        r.error = "failed"
    else:
        r.error = ""
    if r.error and r.error != "failed" and r.completed:
        r.completed = False  # a limit fired: the run does not pass
    return r


def _supervisor_failed(err: bytes, start: float, note: str) -> SandboxResult:
    """A run whose supervisor gave no reply: its stderr's tail, error "sandbox", and why."""
    return SandboxResult(
        "",
        err.decode(errors="replace")[-2000:],
        None,
        None,
        "sandbox",
        time.monotonic() - start,
        notes=[note],
    )


def _kill_group(proc: subprocess.Popen) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)


# The OS refused an operation: EPERM, EACCES, EROFS, ENETUNREACH (no network in the
# namespace), or the loader's refusal to map a library from a noexec mount (the errno
# text of that one is lost in dlopen's message).
_OS_REFUSAL = re.compile(
    r"^\w*(Error|Exception): (\[Errno (1|13|30|101)\] |.*failed to map segment from shared object)"
)


def _classify(rep: dict, r: SandboxResult, cpu_limit: float) -> str:
    if rep["killed"]:
        return rep["killed"]
    if not r.started:  # the code never ran (the runner says "start" first): setup failed
        return "sandbox"
    # SIGXCPU at the soft CPU limit, or SIGKILL at the hard one: the kernel sends SIGKILL
    # when SIGXCPU is ignored, as it is for a PID-namespace init (the worker is PID 1 there)
    if r.signal == signal.SIGXCPU or (
        r.signal == signal.SIGKILL
        and r.exit_code is None
        and (r.cpu_seconds >= 0.9 * cpu_limit or "cpu" in r.stderr.lower())
    ):
        return "cpu_time"
    if r.exit_code == 0:
        return ""
    last = r.stderr.strip().splitlines()[-1] if r.stderr.strip() else ""
    if last.startswith("MemoryError"):
        return "memory"
    if (
        last.startswith("PermissionError: sandbox:")
        or (
            last.startswith(("PermissionError", "OSError", "ConnectionError")) and "sandbox" in last
        )
        or _OS_REFUSAL.match(last)
    ):
        return "blocked"
    if r.signal is not None:
        return "killed"
    if last and "Error" in last.split(":")[0] or last.startswith(("Traceback", "Exception")):
        return "exception"
    return "exit"


@functools.cache
def capabilities() -> dict[str, bool]:
    """Which isolation layers this machine offers (probed once with a trivial run)."""
    r = Sandbox(SandboxLimits(wall_seconds=20)).run("print('ok')")
    text = " ".join(r.layers)
    return {
        "ran": r.ok and r.stdout.strip() == "ok",
        "network_namespace": "network-" in text,
        "ipc_namespace": "ipc-" in text,
        "pid_namespace": "pid-" in text,
        "mount_namespace": "mount-" in text,
        "throwaway_uid": "throwaway uid" in text,
        "audit_hook": "audit hook" in text,
        "seccomp": "seccomp filter" in text,
        "fresh_keyring": "fresh session keyring" in text,
        "memory_cgroup": r.memory_enforcement.startswith("cgroup"),
    }


def run_python(code: str, limits: SandboxLimits | None = None) -> SandboxResult:
    """Run ``code`` in a default :class:`Sandbox`."""
    return Sandbox(limits).run(code)
