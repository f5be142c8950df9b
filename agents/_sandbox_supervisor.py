"""The sandbox supervisor: a short-lived process between the trainer and the untrusted code.

The trainer starts it in a new session (``python -I -S -c <this source>``) and sends one
JSON request on stdin; it answers with one JSON line on stdout. Standard library only.

It isolates itself first (namespaces, private mounts), then forks the *worker*, which sets
resource limits, drops to a throwaway uid, joins a fresh session keyring, installs the
seccomp filter and executes the runner. A tests run (``"tests"`` in the request) forks
two: the checker first (the row's checks, arriving on a pipe), then, once the checker
has read them, the code's worker, which answers the checker's calls; passing is read
from the checker's status channel only. The supervisor reads the worker's output with a
size cap, enforces the wall-time limit and the run's memory budget and kills everything
the code started. Because the supervisor is the worker's parent, code that signals "its
parent" reaches the supervisor (or, in a PID namespace, nothing), never the trainer. The
seccomp filter and keyring (``_sandbox_seccomp``) and the memory accounting
(``_sandbox_memory``) arrive as source in the request, loaded by :func:`_load`.
"""

import contextlib
import ctypes
import fcntl
import json
import os
import random
import resource
import select
import signal
import sys
import time

CLONE_NEWNS, CLONE_NEWIPC, CLONE_NEWUSER, CLONE_NEWPID, CLONE_NEWNET = (
    0x20000,
    0x08000000,
    0x10000000,
    0x20000000,
    0x40000000,
)
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = (
    1,
    2,
    4,
    8,
    32,
    4096,
    16384,
    1 << 18,
)
MNT_DETACH = 2
PR_SET_PDEATHSIG, PR_SET_NO_NEW_PRIVS, PR_SET_CHILD_SUBREAPER = 1, 38, 36
# Top-level directories the worker keeps (system files it needs to run Python); every
# other top-level directory -- wherever the project, its data or the user's home live --
# is replaced by an empty tmpfs in the worker's private mount namespace, and the Python
# installation is mounted back read-only where it lives below them. An allowlist, because
# a list of places to hide misses the one a machine happens to use (``/check/...``).
KEEP = frozenset(
    {
        "/usr",
        "/lib",
        "/lib32",
        "/lib64",
        "/libx32",
        "/bin",
        "/sbin",
        "/etc",
        "/proc",
        "/dev",
        "/sys",
    }
)
EXTRA_HIDE = ("/dev/shm",)


def _to_hide() -> list:
    tops = [f"/{d}" for d in sorted(os.listdir("/"))]
    return [
        h
        for h in tops + list(EXTRA_HIDE)
        if h not in KEEP and os.path.isdir(h) and not os.path.islink(h)
    ]


_libc = ctypes.CDLL(None, use_errno=True)


def _check(ret: int, what: str) -> None:
    if ret != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def _mount(source, target, fstype, flags, data=None) -> None:
    def enc(s):
        return s.encode() if isinstance(s, str) else s

    _check(
        _libc.mount(enc(source), enc(target), enc(fstype), ctypes.c_ulong(flags), enc(data)),
        f"mount {target}",
    )


def _unshare(flags: int) -> None:
    _check(_libc.unshare(ctypes.c_int(flags)), "unshare")


def _write(path: str, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)


def _exposed_paths(python_paths: list) -> list:
    """Python directories the worker must read, minus those inside another one."""
    paths = sorted({os.path.realpath(p) for p in python_paths if p and os.path.isdir(p)})
    out = []
    for p in paths:
        if not any(p == q or p.startswith(q + "/") for q in out):
            out.append(p)
    return out


def _private_filesystem(work_mb: int, inodes: int, python_paths: list, layers: list) -> str:
    """Private mounts: hide user/project directories, expose Python read-only; returns workdir."""
    _mount(None, "/", None, MS_REC | MS_PRIVATE)
    # noexec: nothing the code writes can be executed or mapped executable (no dropped
    # binaries, no extension modules loaded from the working directory)
    noexec = MS_NOSUID | MS_NODEV | MS_NOEXEC
    # nr_inodes: bytes alone are capped by size=; empty files and directories cost none
    _mount("tmpfs", "/tmp", "tmpfs", noexec, f"size={work_mb}m,nr_inodes={inodes},mode=1777")
    stage = "/tmp/.stage"
    os.mkdir(stage, 0o700)
    exposed = _exposed_paths(python_paths)
    for k, p in enumerate(exposed):
        os.mkdir(f"{stage}/{k}")
        _mount(p, f"{stage}/{k}", None, MS_BIND | MS_REC)
    hidden = []
    for h in _to_hide():
        if h == "/tmp":
            continue
        _mount("tmpfs", h, "tmpfs", noexec, "size=1m,nr_inodes=256,mode=755")
        hidden.append(h)
    for k, p in enumerate(exposed):
        under = [h for h in hidden + ["/tmp"] if p.startswith(h + "/")]
        if not under:
            continue
        os.makedirs(p, 0o755, exist_ok=True)
        _mount(f"{stage}/{k}", p, None, MS_BIND | MS_REC)
        _mount(None, p, None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV)
    for k in range(len(exposed)):
        _libc.umount2(f"{stage}/{k}".encode(), MNT_DETACH)
        os.rmdir(f"{stage}/{k}")
    os.rmdir(stage)
    work = "/tmp/work"
    os.mkdir(work, 0o700)
    layers.append(
        "mount-namespace(hidden: "
        + " ".join(hidden)
        + f"; private tmpfs workdir, noexec, {inodes} inodes)"
    )
    return work


def _isolate(req: dict, layers: list, notes: list) -> tuple:
    """Enter new namespaces; returns (workdir or None, can_drop_uid)."""
    if not req["isolate"]:
        return None, os.geteuid() == 0
    root = os.geteuid() == 0
    flags = CLONE_NEWNS | CLONE_NEWPID | CLONE_NEWNET | CLONE_NEWIPC
    try:
        if root:
            _unshare(flags)
        else:
            uid, gid = os.getuid(), os.getgid()
            _unshare(flags | CLONE_NEWUSER)
            _write("/proc/self/setgroups", "deny")
            _write("/proc/self/uid_map", f"{uid} {uid} 1")
            _write("/proc/self/gid_map", f"{gid} {gid} 1")
    except OSError as e:
        notes.append(f"namespaces unavailable ({e}); running without them")
        return None, root
    layers.append("network-namespace(no interfaces)")
    layers.append("ipc-namespace(System V IPC and POSIX message queues vanish with the run)")
    layers.append("pid-namespace(killing its init kills every process the code started)")
    if not root:
        layers.append("user-namespace")
    try:
        lim = req["limits"]
        work = _private_filesystem(
            lim["tmpfs_mb"], lim["tmpfs_inodes"], req["python_paths"], layers
        )
    except OSError as e:
        notes.append(f"private mounts failed ({e}); using a temporary directory")
        work = None
    return work, root


def _reachable(paths: list) -> bool:
    """Whether a user with no relation to these files may reach (traverse into) them all."""
    for path in paths:
        if not path or not os.path.exists(path):
            continue
        parts = os.path.realpath(path).split("/")
        for k in range(2, len(parts) + 1):
            d = "/".join(parts[:k])
            if os.path.isdir(d) and not os.stat(d).st_mode & 0o001:
                return False
    return True


def _own_proc() -> None:
    """In the worker (PID 1 of the new PID namespace, still root): a /proc of its own.

    The /proc inherited from the host lists every host process and its command line; a
    proc mounted from inside the namespace lists only the sandbox's processes. Reports
    what it did on the status channel (fd 3).
    """
    flags = MS_NOSUID | MS_NODEV | MS_NOEXEC
    try:
        _mount("proc", "/proc", "proc", flags)
    except OSError as e:  # e.g. a host /proc partly masked in a container
        _mount("tmpfs", "/proc", "tmpfs", flags, "size=1m,mode=755")
        _status("note", f"could not mount a /proc for the PID namespace ({e}); /proc is empty")
    else:
        _status("layer", "own /proc (lists only the sandbox's processes)")
    try:  # pid-namespace scoped (Linux 6.3+): no executable memfd, the noexec workdir's twin
        _write("/proc/sys/vm/memfd_noexec", "2")
    except OSError as e:
        _status("note", f"memfd_noexec unavailable ({e.strerror}); memfds may be executed")
    else:
        _status("layer", "memfd_noexec=2 (no executable memory files)")


def _status(kind: str, text: str) -> None:
    os.write(STATUS_FD, f"{kind} {text}\n".encode())


# The runner's descriptors besides stdin/stdout/stderr: the status channel (setup reports,
# then "start" before the code runs and "done <nonce>" after it returned), the pipe the
# per-run nonce (or, for the checker, the checks) arrives on, read and closed before any
# code runs, and in a tests run the request and reply pipes between the two processes.
STATUS_FD, NONCE_FD, REQUEST_FD, REPLY_FD = 3, 4, 5, 6


def _worker(req: dict, kernel, cwd: str, uid, fds: dict, own_proc: bool, mode: str, budget) -> None:
    """In the child: the run's memory cgroup (first, before it allocates anything),
    limits, privileges, keyring, seccomp, then exec the runner in ``mode`` with ``fds``
    ({target descriptor: pipe end}). Never returns."""
    try:
        budget.join()  # a failure here ends the run ("sandbox"), never a weaker one
        lim = req["limits"]
        os.setsid()
        _libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        _libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0)
        high = {t: fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, 10) for t, fd in fds.items()}
        devnull = os.open("/dev/null", os.O_RDONLY)
        os.dup2(devnull, 0)
        for target, fd in high.items():
            os.dup2(fd, target)
        if own_proc:
            _own_proc()
        cpu = max(1, int(lim["cpu_seconds"] + 0.999))
        mem = int(lim["memory_mb"]) * 2**20
        fsize = int(lim["file_size_mb"]) * 2**20
        for res, value in (
            # soft = hard: SIGKILL right at the limit (SIGXCPU, sent at a lower soft limit,
            # is ignored by the worker as PID 1 of its namespace)
            (resource.RLIMIT_CPU, (cpu, cpu)),
            (resource.RLIMIT_AS, (mem, mem)),
            (resource.RLIMIT_DATA, (mem, mem)),
            (resource.RLIMIT_FSIZE, (fsize, fsize)),
            (resource.RLIMIT_NOFILE, (lim["open_files"], lim["open_files"])),
            (resource.RLIMIT_CORE, (0, 0)),
        ):
            resource.setrlimit(res, value)
        if uid is not None:
            nproc = int(lim["max_processes"])
            resource.setrlimit(resource.RLIMIT_NPROC, (nproc, nproc))
            os.chown(cwd, uid, uid)
            if mode != "check":
                os.chown(os.path.join(cwd, "snippet.py"), uid, uid)
            os.setgroups([])
            os.setresgid(uid, uid, uid)
            os.setresuid(uid, uid, uid)
        try:
            kernel.fresh_keyring()
        except OSError as e:
            _status("note", f"could not join a fresh session keyring ({e.strerror})")
        else:
            _status("layer", "fresh session keyring (the trainer's keys are not possessed)")
        if req.get("seccomp", True):
            try:
                machine = kernel.install_seccomp()
            except OSError as e:
                _status("note", f"no seccomp filter ({e.strerror})")
            else:
                if machine:
                    _status("layer", kernel.SECCOMP_LAYER)
                else:
                    _status("note", f"no seccomp filter for {os.uname().machine}")
        os.chdir(cwd)
        env = {
            "PATH": "/usr/bin:/bin",
            "HOME": cwd,
            "TMPDIR": cwd,
            "LANG": "C.UTF-8",
            "PYTHONDONTWRITEBYTECODE": "1",
            "PYTHONHASHSEED": "0",
            "OMP_NUM_THREADS": "1",
            "OPENBLAS_NUM_THREADS": "1",
            "MKL_NUM_THREADS": "1",
        }
        argv = [req["python"], "-I", "-B", "-c", req["runner"]]
        argv += ["1" if req["audit"] and mode != "check" else "0", str(STATUS_FD)]
        argv += [str(NONCE_FD) if NONCE_FD in fds else "-1", mode]
        argv += [str(REQUEST_FD), str(REPLY_FD)]
        os.execve(req["python"], argv, env)
    except BaseException as e:  # report setup failures on the error pipe
        try:
            os.write(2, f"sandbox setup failed: {type(e).__name__}: {e}\n".encode())
        finally:
            os._exit(126)


def _kill_all(pid: int, uid, pid_ns: bool) -> None:
    """Kill the worker and everything it started."""
    for kill, target in ((os.killpg, pid), (os.kill, pid)):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            kill(target, signal.SIGKILL)
    if uid is not None and not pid_ns:
        # Processes that left the process group still run as the throwaway uid: a helper
        # with that uid signals every process it may signal, i.e. exactly those.
        helper = os.fork()
        if helper == 0:
            try:
                os.setresuid(uid, uid, uid)
                os.kill(-1, signal.SIGKILL)
            finally:
                os._exit(0)
        os.waitpid(helper, 0)


def _cpu_wait(proc_fd: int, pid: int) -> float:
    """Seconds the worker's busiest thread has waited for a CPU (runnable, not running):
    time a loaded machine took from it. 0 where the kernel keeps no scheduler stats."""
    waited = 0
    try:
        task = os.open(f"{pid}/task", os.O_RDONLY | os.O_DIRECTORY, dir_fd=proc_fd)
    except OSError:
        return 0.0
    try:
        for tid in os.listdir(task):
            try:
                fd = os.open(f"{tid}/schedstat", os.O_RDONLY, dir_fd=task)
            except OSError:
                continue
            try:
                fields = os.read(fd, 200).split()
            finally:
                os.close(fd)
            if len(fields) >= 2:
                waited = max(waited, int(fields[1]))
    finally:
        os.close(task)
    return waited / 1e9


class _StatusChannel:
    """Reads a status channel: setup reports, then "start", then "done <nonce>".

    Reports before "start" come from the sandbox's own code (the worker, the runner's
    setup); after it the code runs and may write anything here, so only the nonce line,
    which it does not know, counts. ``completed``: the code ran to its last statement.
    ``trusted``: no model code writes to this channel (the checker's): its "harness"
    lines (the row's checks could not be run as written) are kept.
    """

    MAX_LINE = 4096

    def __init__(self, nonce: str, layers: list, notes: list, trusted: bool = False) -> None:
        self.done_line = f"done {nonce}".encode()
        self.layers, self.notes, self.trusted = layers, notes, trusted
        self.started = self.completed = False
        self.harness: list = []
        self.partial = b""

    def feed(self, chunk: bytes) -> None:
        *lines, self.partial = (self.partial + chunk).split(b"\n")
        if len(self.partial) > self.MAX_LINE:
            self.partial = b""  # nothing we wait for is this long
        for line in lines:
            if self.started:
                self.completed = self.completed or line == self.done_line
                if self.trusted and line.startswith(b"harness ") and len(self.harness) < 8:
                    self.harness.append(line[8:].decode("utf-8", "replace"))
            elif line == b"start":
                self.started = True
            elif line.startswith((b"layer ", b"note ")):
                kind, text = line.decode("utf-8", "replace").split(" ", 1)
                seen = self.layers if kind == "layer" else self.notes
                if text not in seen:
                    seen.append(text)


class _Worker:
    def __init__(self, role: str, uid, channel: _StatusChannel) -> None:
        self.role, self.uid, self.channel = role, uid, channel
        self.pid = None
        self.status = None


def _throwaway_uid(taken: set) -> int:
    rng = random.SystemRandom()
    while (uid := rng.randrange(1_000_000, 2_000_000_000)) in taken:
        pass
    taken.add(uid)
    return uid


def _load(name: str, source: str):
    """One of the sandbox's modules, from the source the trainer sent (this process has
    no import path to them)."""
    import types

    module = types.ModuleType(name)
    exec(compile(source, f"{name}.py", "exec"), module.__dict__)
    return module


def main() -> None:
    req = json.loads(sys.stdin.read())
    kernel = _load("_sandbox_seccomp", req["modules"]["_sandbox_seccomp"])
    memory = _load("_sandbox_memory", req["modules"]["_sandbox_memory"])
    lim = req["limits"]
    tests = req.get("tests")
    layers: list = []
    notes: list = []
    # the run's memory cgroup, made before anything of the run starts (or a polled budget)
    budget = memory.RunBudget(int(lim["run_memory_mb"]), req.get("memory_cgroup", True), notes)
    work, can_drop = _isolate(req, layers, notes)
    pid_ns = any(x.startswith("pid-namespace") for x in layers)
    temp = None
    if work is None:
        import tempfile

        temp = work = tempfile.mkdtemp(prefix="polyrl-sandbox-")
        layers.append("temporary working directory (removed afterwards)")
    with open(os.path.join(work, "snippet.py"), "w", encoding="utf-8") as f:
        f.write(req["code"])
    private_fs = any(x.startswith("mount-namespace") for x in layers)
    if (
        can_drop
        and req["drop_privileges"]
        and not private_fs
        and not _reachable([req["python"], *req["python_paths"]])
    ):
        can_drop = False
        notes.append(
            "the Python installation is not readable by other users (e.g. it lives "
            "under /root) and there is no mount namespace to expose it: running as "
            "the current user"
        )
    uids: set = set()
    code_uid = check_uid = None
    if can_drop and req["drop_privileges"]:
        code_uid = _throwaway_uid(uids)
        layers.append(
            f"throwaway uid {code_uid} (no file it does not own is writable; RLIMIT_NPROC "
            f"caps its processes at {lim['max_processes']})"
        )
        if tests is not None:
            check_uid = _throwaway_uid(uids)
            layers.append(f"checker uid {check_uid} (the code's uid cannot reach it)")
    layers.append("resource limits (cpu, address space, file size, open files, no core dumps)")
    layers.append("new session; output capped; wall-time kill")
    layers.append(budget.layer)
    if req["audit"]:
        layers.append("audit hook (files outside the workdir, sockets, processes, signals, ctypes)")
    if tests is not None:
        layers.append(
            "checks in a separate process (the code answers calls with plain data; the "
            "checks, their verdict and the nonce never reach the code's process)"
        )
    own_ipc = any(x.startswith("ipc-namespace") for x in layers)
    proc_fd = os.open("/proc", os.O_RDONLY | os.O_DIRECTORY)  # the host's view, kept
    ipc_before = {(o[0], o[1]) for o in memory.ipc_objects(proc_fd)}
    # the run's processes are this one's descendants, orphans included (they come back
    # here, or to the PID namespace's init), and its memory is summed against the budget
    _libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    budget.watch(proc_fd, os.getpid(), own_ipc, set(uids))
    nonce = os.urandom(16).hex()
    out_r, out_w = os.pipe()
    err_r, err_w = os.pipe()
    st_r, st_w = os.pipe()
    in_r, in_w = os.pipe()  # the nonce (run) or the checks (tests run)
    if tests is None:
        os.write(in_w, nonce.encode())
        os.close(in_w)
        in_w = -1
        pending = b""
    else:
        pending = json.dumps({**tests, "nonce": nonce}).encode()
        os.set_blocking(in_w, False)
    own_proc = pid_ns and private_fs
    code = _Worker("code", code_uid, _StatusChannel(nonce, layers, notes))
    code_fds = {1: out_w, 2: err_w, STATUS_FD: st_w}
    streams = {out_r: "out", err_r: "err", st_r: code}
    checker = None
    if tests is not None:
        # the checker is forked first (PID 1 of the namespace: when it exits, the code's
        # process dies with it) and the code only once the checker has read its checks
        # and made itself non-dumpable, so not even a process of the same uid reads them
        checker = _Worker("check", check_uid, _StatusChannel(nonce, layers, notes, True))
        chk_out_r, chk_out_w = os.pipe()
        chk_st_r, chk_st_w = os.pipe()
        req_r, req_w = os.pipe()
        rep_r, rep_w = os.pipe()
        if private_fs:
            checks_dir = os.path.join(os.path.dirname(work), "checks")
            os.mkdir(checks_dir, 0o700)
        else:
            import tempfile

            checks_dir = tempfile.mkdtemp(prefix="polyrl-checks-")
        check_fds = {1: chk_out_w, 2: chk_out_w, STATUS_FD: chk_st_w, NONCE_FD: in_r}
        check_fds.update({REQUEST_FD: req_w, REPLY_FD: rep_r})
        code_fds.update({REQUEST_FD: req_r, REPLY_FD: rep_w})
        streams.update({chk_out_r: "checks", chk_st_r: checker})
    else:
        code_fds[NONCE_FD] = in_r
    first = checker or code
    start = time.monotonic()
    first.pid = os.fork()
    if first.pid == 0:
        if checker is not None:
            _worker(req, kernel, checks_dir, check_uid, check_fds, own_proc, "check", budget)
        _worker(req, kernel, work, code_uid, code_fds, own_proc, "run", budget)
    if checker is not None:
        for fd in (chk_out_w, chk_st_w, in_r, req_w, rep_r):
            os.close(fd)
    else:
        for fd in (out_w, err_w, st_w, in_r):
            os.close(fd)
    workers = [first]
    buffers = {"out": bytearray(), "err": bytearray(), "checks": bytearray()}
    cap = int(lim["output_bytes"])
    deadline = start + float(lim["wall_seconds"])
    grace = float(lim["load_grace_seconds"])
    extended = 0.0
    killed = ""
    open_fds = list(streams)
    if checker is not None:
        open_fds = [chk_out_r, chk_st_r]  # the code's streams open once it is forked
    ended_at = None

    def kill_everything() -> None:
        for w in workers:
            if w.pid is not None:
                _kill_all(w.pid, w.uid, pid_ns)

    while True:
        now = time.monotonic()
        if now >= deadline and not killed and extended < grace:
            # Wall time the code spent waiting for a CPU on a loaded machine does not
            # count (up to ``load_grace_seconds``): a busy loop then ends on its CPU limit.
            extended = min(grace, max(_cpu_wait(proc_fd, w.pid) for w in workers))
            deadline = start + float(lim["wall_seconds"]) + extended
        if now >= deadline and not killed:
            killed = "wall_time"
            kill_everything()
        if now >= budget.next_poll and not killed and budget.over(now):
            killed = "memory"
            kill_everything()
        if checker is not None and code.pid is None:
            if killed or checker.status is not None:
                code.pid = -1  # the checker ended (or was stopped) before it was ready
            elif checker.channel.started:
                code.pid = os.fork()
                if code.pid == 0:
                    _worker(req, kernel, work, code_uid, code_fds, False, "serve", budget)
                for fd in code_fds.values():
                    os.close(fd)
                workers.append(code)
                open_fds += [out_r, err_r, st_r]
        writing = [in_w] if pending else []
        ready, can_write, _ = select.select(
            open_fds, writing, [], max(0.0, min(0.05, deadline - now, budget.next_poll - now))
        )
        if can_write:
            try:
                pending = pending[os.write(in_w, pending[:65536]) :]
            except BlockingIOError:
                pass
            except OSError:  # the checker is gone
                pending = b""
            if not pending:
                os.close(in_w)
                in_w = -1
        for fd in ready:
            chunk = os.read(fd, 65536)
            if not chunk:
                open_fds.remove(fd)
                continue
            role = streams[fd]
            if isinstance(role, _Worker):
                role.channel.feed(chunk)
                continue
            if role == "checks":  # the dataset's own output: kept up to the cap, never fatal
                buffers["checks"] += chunk[: max(0, cap - len(buffers["checks"]))]
                continue
            buffers[role] += chunk
            if len(buffers["out"]) + len(buffers["err"]) > cap and not killed:
                killed = "output_limit"
                kill_everything()
        for w in workers:
            if w.status is None and w.pid is not None and w.pid > 0:
                done, st = os.waitpid(w.pid, os.WNOHANG)
                if done:
                    w.status = st
                    if not pid_ns:  # children it left behind (the namespace cleans up itself)
                        _kill_all(w.pid, w.uid, pid_ns)
        if checker is not None and checker.status is not None and ended_at is None:
            ended_at = time.monotonic()
            if code.pid is not None and code.pid > 0 and code.status is None:
                _kill_all(code.pid, code.uid, pid_ns)  # its checks are over
        finished = all(w.status is not None for w in workers) and (
            checker is None or code.pid is not None
        )
        if finished and not open_fds:
            break
        if finished and killed:
            break
        if finished and ended_at is not None and time.monotonic() - ended_at > 1.0:
            break  # a tests run: what a leftover process still holds open is not waited for
        if not open_fds and not finished:
            time.sleep(0.01)
    if in_w >= 0 and checker is not None:
        os.close(in_w)
    if budget.finish(kill_everything, notes) and not killed:
        killed = "memory"  # the kernel's kill ended the run before the loop saw it
    elapsed = time.monotonic() - start
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    if extended > 0.05:
        notes.append(
            f"the wall-time limit was extended by {extended:.1f} s the code spent waiting "
            "for a CPU (a loaded machine)"
        )
    if killed == "wall_time":
        notes.append(f"stopped by the wall-time limit after {elapsed:.1f} s")
    ipc_left = memory.cleanup_ipc(proc_fd, ipc_before, own_ipc, code_uid, notes)
    if not private_fs:  # /dev/shm is the host's: what the run's uids left there goes
        ipc_left.update(memory.cleanup_dev_shm(set(uids), budget.dev_shm_before, notes))
    if killed == "memory":
        notes.append(budget.stopped())
    for path in (temp, None if checker is None or private_fs else checks_dir):
        if path is not None:
            import shutil

            shutil.rmtree(path, ignore_errors=True)
    status = code.status
    exit_code = os.WEXITSTATUS(status) if status is not None and os.WIFEXITED(status) else None
    sig = os.WTERMSIG(status) if status is not None and os.WIFSIGNALED(status) else None
    result = {
        "stdout": bytes(buffers["out"][:cap]).decode("utf-8", "replace"),
        "stderr": bytes(buffers["err"][:cap]).decode("utf-8", "replace"),
        "output_bytes": len(buffers["out"]) + len(buffers["err"]),
        "exit_code": exit_code,
        "signal": sig,
        "killed": killed,
        "wall_seconds": elapsed,
        "cpu_seconds": usage.ru_utime + usage.ru_stime,
        "layers": layers,
        "notes": notes,
        "ipc_left": ipc_left,
        "memory_peak": budget.peak,
        "memory_enforcement": budget.enforcement,
        "started": code.channel.started,
        "completed": code.channel.completed,
    }
    if checker is not None:
        st = checker.status
        result["checks"] = {
            "output": bytes(buffers["checks"]).decode("utf-8", "replace"),
            "started": checker.channel.started,
            "passed": checker.channel.completed
            and st is not None
            and os.WIFEXITED(st)
            and os.WEXITSTATUS(st) == 0,
            "harness": checker.channel.harness,
            "exit_code": os.WEXITSTATUS(st) if st is not None and os.WIFEXITED(st) else None,
        }
    sys.stdout.write(json.dumps(result))
    sys.stdout.flush()


main()
