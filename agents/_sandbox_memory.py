"""The sandbox's memory accounting: one budget for a whole run, and its System V cleanup.

Loaded by the supervisor from source (it runs as ``python -I -S -c``, with no import
path to this package); standard library only. ``RLIMIT_AS`` bounds each process's
address space, not a run: four processes under 512 MB each held 1.63 GB, and System V
shared memory, POSIX shared memory (``/dev/shm``) and memory files (``memfd``) are in no
process's address space once unmapped. Where a memory cgroup is writable (v2 with its
memory controller, else v1; root on CI), :class:`KernelMemory` gives the run one of its
own and the kernel holds it at ``run_memory_mb``. Elsewhere (no memory controller in a
container's v2 hierarchy, no root) :class:`RunMemory` sums the run's memory from
``/proc`` and the supervisor stops the run when the sum passes the budget (polled: a
loaded machine lets it overshoot by what the run grows between polls). The supervisor
uses :class:`RunBudget`, which holds one or the other. A run cgroup is named for the
supervisor that made it, so one a killed supervisor left is removed by the next.
"""

import atexit
import contextlib
import ctypes
import os
import signal
import time
from collections.abc import Callable

_libc = ctypes.CDLL(None, use_errno=True)
IPC_RMID = 0
# /proc/sysvipc tables (read through a descriptor of the host's /proc, opened before the
# worker starts): each lists the System V objects of the reader's IPC namespace.
SYSVIPC = {"shm": "shmid", "msg": "msqid", "sem": "semid"}
IPC_NAMES = {"shm": "shared-memory segment", "msg": "message queue", "sem": "semaphore set"}
DEV_SHM = "/dev/shm"


def _table(proc_fd: int, kind: str) -> list:
    """The rows of /proc/sysvipc/<kind> as dicts ({} when the kernel has no table)."""
    try:
        fd = os.open(f"sysvipc/{kind}", os.O_RDONLY, dir_fd=proc_fd)
    except OSError:
        return []
    with os.fdopen(fd) as f:
        lines = f.read().splitlines()
    header = lines[0].split() if lines else []
    return [dict(zip(header, line.split(), strict=False)) for line in lines[1:]]


def ipc_objects(proc_fd: int) -> list:
    """(kind, id, creator uid, bytes) of every System V IPC object this process can see."""
    out = []
    for kind, id_col in SYSVIPC.items():
        for row in _table(proc_fd, kind):
            size = int(row.get("size", row.get("cbytes", 0)))
            out.append((kind, int(row[id_col]), int(row["cuid"]), size))
    return out


def _remove_ipc(kind: str, ident: int) -> bool:
    if kind == "shm":
        return _libc.shmctl(ctypes.c_int(ident), IPC_RMID, None) == 0
    if kind == "msg":
        return _libc.msgctl(ctypes.c_int(ident), IPC_RMID, None) == 0
    return _libc.semctl(ctypes.c_int(ident), 0, IPC_RMID) == 0


def cleanup_ipc(proc_fd: int, before: set, own_ns: bool, uid, notes: list) -> dict:
    """The per-call check: System V objects the code left behind, reported and removed.

    In its own IPC namespace every object is the code's (and would vanish with the
    namespace anyway); without one, new objects created by the throwaway uid are; with
    neither, new objects cannot be told from the host's, so they are reported, not removed.
    """
    left = [o for o in ipc_objects(proc_fd) if (o[0], o[1]) not in before]
    if not own_ns:
        if uid is None:
            if left:
                notes.append(
                    f"{len(left)} System V IPC object(s) appeared during the run; without an "
                    "IPC namespace or a throwaway uid they cannot be attributed, so they were "
                    "left in place"
                )
            return {"shm": 0, "msg": 0, "sem": 0, "shm_bytes": 0}
        left = [o for o in left if o[2] == uid]
    counts = {"shm": 0, "msg": 0, "sem": 0, "shm_bytes": 0}
    failed = [o for o in left if not _remove_ipc(o[0], o[1])]
    for kind, _, _, size in left:
        counts[kind] += 1
        counts["shm_bytes"] += size if kind == "shm" else 0
    if left:
        what = ", ".join(
            f"{n} {IPC_NAMES[k]}(s)" for k, n in counts.items() if k in IPC_NAMES and n
        )
        notes.append(
            f"removed System V IPC the code left behind: {what} "
            f"({counts['shm_bytes'] / 2**20:.0f} MiB of shared memory)"
        )
    still = {(o[0], o[1]) for o in ipc_objects(proc_fd)} & {(o[0], o[1]) for o in left}
    if failed or still:
        notes.append(f"could not remove {len(still) or len(failed)} System V IPC object(s)")
    return counts


def dev_shm_files(uids: set, before: set) -> list:
    """(path, bytes held) of the files in /dev/shm that are the run's: owned by one of its
    throwaway uids, or (without any) not there when it started."""
    out = []
    try:
        entries = list(os.scandir(DEV_SHM))
    except OSError:
        return out
    for e in entries:
        try:
            st = e.stat(follow_symlinks=False)
        except OSError:
            continue
        if (st.st_uid in uids) if uids else ((st.st_dev, st.st_ino) not in before):
            out.append((e.path, st.st_blocks * 512))
    return out


def dev_shm_inodes() -> set:
    try:
        return {(e.stat().st_dev, e.stat().st_ino) for e in os.scandir(DEV_SHM)}
    except OSError:
        return set()


def cleanup_dev_shm(uids: set, before: set, notes: list) -> dict:
    """POSIX shared memory (files in /dev/shm) the run's throwaway uids left: removed.
    Without a throwaway uid new files cannot be told from the host's: reported only."""
    files = dev_shm_files(uids, before)
    if files and not uids:
        notes.append(
            f"{len(files)} file(s) appeared in /dev/shm during the run; without a throwaway "
            "uid they cannot be attributed, so they were left in place"
        )
        return {"posix_shm": 0, "posix_shm_bytes": 0}
    for path, _ in files:
        try:
            os.unlink(path)
        except OSError:
            notes.append(f"could not remove {path}")
    held = sum(b for _, b in files)
    if files:
        notes.append(
            f"removed {len(files)} POSIX shared-memory file(s) the code left in /dev/shm "
            f"({held / 2**20:.0f} MiB)"
        )
    return {"posix_shm": len(files), "posix_shm_bytes": held}


class RunMemory:
    """The memory one sandbox run holds, summed over everything it can allocate.

    Counted: every process the supervisor started and their descendants (the supervisor
    is their child subreaper, so orphans stay in the tree; found by parent pid in the
    host's /proc), the System V segments of the run (its IPC namespace's, or its uids'),
    its files in /dev/shm and the memory files (``memfd``) its processes hold open. A poll
    first sums resident set sizes (cheap, an upper bound: pages shared between the
    processes count once per process); only above the budget does it sum proportional
    set sizes (PSS, each shared page split between its users), and the run is over its
    budget only if that sum is. Shared memory both mapped and resident counts in the
    process and in its segment or file: a run is stopped early by it, never late.
    """

    # bytes a run could add between polls, per second: a poll comes sooner near the budget
    RATE = 4 * 2**30
    PSS_EVERY = 0.25  # seconds between PSS sums while resident sizes exceed the budget

    def __init__(self, proc_fd: int, root: int, budget: int, shm_own_ns: bool, uids: set):
        self.proc_fd, self.root, self.budget = proc_fd, root, budget
        self.shm_own_ns, self.uids = shm_own_ns, uids
        self.members: set = set()
        self.others: set = set()
        self.shm_before = {o[1] for o in ipc_objects(proc_fd) if o[0] == "shm"}
        self.dev_shm_before = dev_shm_inodes()
        self.page = os.sysconf("SC_PAGE_SIZE")
        self.peak = 0
        self.overcount = 0  # resident minus proportional sizes at the last PSS sum
        self.pss_at = float("-inf")
        self.headroom = budget

    def _read(self, path: str, limit: int = 4096) -> bytes:
        fd = os.open(path, os.O_RDONLY, dir_fd=self.proc_fd)
        try:
            return os.read(fd, limit)
        finally:
            os.close(fd)

    def processes(self) -> set:
        """The run's live processes (host pids), updated from a listing of /proc."""
        alive = {int(p) for p in os.listdir(self.proc_fd) if p.isdigit()}
        self.members &= alive
        self.others &= alive
        parents = {}
        for pid in alive - self.members - self.others - {self.root}:
            try:
                stat = self._read(f"{pid}/stat", 512)
                parents[pid] = int(stat[stat.rindex(b")") + 2 :].split()[1])
            except (OSError, ValueError, IndexError):
                continue  # exited meanwhile
        grew = True
        while grew:
            grew = False
            for pid, parent in list(parents.items()):
                if parent == self.root or parent in self.members:
                    self.members.add(pid)
                    del parents[pid]
                    grew = True
        self.others.update(parents)
        return set(self.members)

    def _resident(self, pids: set) -> int:
        total = 0
        for pid in pids:
            try:
                total += int(self._read(f"{pid}/statm", 256).split()[1]) * self.page
            except (OSError, ValueError, IndexError):
                continue
        return total

    def _proportional(self, pids: set) -> int:
        total = 0
        for pid in pids:
            try:
                text = self._read(f"{pid}/smaps_rollup", 8192)
            except OSError:
                continue
            for line in text.splitlines():
                if line.startswith(b"Pss:"):
                    total += int(line.split()[1]) * 1024
                    break
        return total

    def _shared(self, pids: set) -> int:
        """Bytes in System V segments, /dev/shm files and open memory files of the run."""
        total = 0
        for row in _table(self.proc_fd, "shm"):
            mine = self.shm_own_ns or (
                int(row["cuid"]) in self.uids
                if self.uids
                else int(row["shmid"]) not in self.shm_before
            )
            if mine:
                total += int(row.get("rss", row.get("size", 0)))
        total += sum(b for _, b in dev_shm_files(self.uids, self.dev_shm_before))
        seen = set()
        for pid in pids:
            try:
                dfd = os.open(f"{pid}/fd", os.O_RDONLY | os.O_DIRECTORY, dir_fd=self.proc_fd)
            except OSError:
                continue
            try:
                for name in os.listdir(dfd):
                    try:
                        if not os.readlink(name, dir_fd=dfd).startswith("/memfd:"):
                            continue
                        st = os.stat(name, dir_fd=dfd)
                    except OSError:
                        continue
                    if (st.st_dev, st.st_ino) not in seen:
                        seen.add((st.st_dev, st.st_ino))
                        total += st.st_blocks * 512
            finally:
                os.close(dfd)
        return total

    def poll(self, now: float) -> bool:
        """Measure once; True when the run holds more than its budget."""
        pids = self.processes()
        shared = self._shared(pids)
        resident = self._resident(pids)
        held = resident + shared - self.overcount
        if resident + shared > self.budget and (
            held > self.budget or now - self.pss_at >= self.PSS_EVERY
        ):
            proportional = self._proportional(pids)
            self.overcount = max(0, resident - proportional)
            self.pss_at = now
            held = proportional + shared
        self.peak = max(self.peak, held)
        self.headroom = self.budget - held
        return held > self.budget

    def interval(self) -> float:
        """Seconds until the next poll: sooner the closer the run is to its budget."""
        return min(0.05, max(0.002, self.headroom / self.RATE))


CGROUP_ROOT = "/sys/fs/cgroup"
# A run cgroup is named for its supervisor: PREFIX + "<pid namespace>-<pid>-<start time>-<random>"
# (the namespace's inode, the pid and its start time in clock ticks after boot), so that a
# later supervisor can tell one whose owner was killed (SIGKILL leaves it behind, empty)
# from one in use, even after the pid is reused.
PREFIX = "polyrl-sandbox-"


def _own_cgroup(controller: str) -> str | None:
    """This process's cgroup path in the v1 hierarchy of ``controller`` (or, for "", in
    the v2 hierarchy), from /proc/self/cgroup; None when it has none."""
    try:
        with open("/proc/self/cgroup") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    for line in lines:
        _, names, path = line.split(":", 2)
        if (controller == "" and names == "") or controller in names.split(","):
            return path
    return None


def _v2_mount() -> str | None:
    """Where the v2 hierarchy is mounted (the root on a v2-only machine, /unified beside v1)."""
    for where in (CGROUP_ROOT, f"{CGROUP_ROOT}/unified"):
        if os.path.exists(f"{where}/cgroup.controllers"):
            return where
    return None


def parents() -> list[tuple[int, str]]:
    """(version, directory) where this process's run cgroups go, in the order tried: below
    its own cgroup in the v2 hierarchy, then in the v1 memory hierarchy."""
    out = []
    v2, own2, own1 = _v2_mount(), _own_cgroup(""), _own_cgroup("memory")
    if v2 is not None and own2 is not None:
        out.append((2, v2 + own2.rstrip("/")))
    if own1 is not None and os.path.isdir(f"{CGROUP_ROOT}/memory"):
        out.append((1, f"{CGROUP_ROOT}/memory{own1.rstrip('/')}"))
    return out


def _identity(pid: str) -> str | None:
    """A live process's "<pid namespace>-<pid>-<start time>" ("self": this one's) as this
    one sees it; None when it is gone or /proc cannot say."""
    try:
        ns = os.stat("/proc/self/ns/pid").st_ino
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
        start = int(stat[stat.rindex(b")") + 2 :].split()[19])
    except (OSError, ValueError, IndexError):
        return None
    return f"{ns}-{os.getpid() if pid == 'self' else pid}-{start}"


def owner_gone(name: str) -> bool:
    """Whether the supervisor that made run cgroup ``name`` is dead. False where that cannot
    be told: another PID namespace, a name not of this form, no /proc to read."""
    parts = name[len(PREFIX) :].split("-") if name.startswith(PREFIX) else []
    own = _identity("self")
    if len(parts) != 4 or own is None or parts[0] != own.split("-")[0]:
        return False
    return _identity(parts[1]) != "-".join(parts[:3])


def reclaim(parent: str, notes: list[str]) -> int:
    """Remove the run cgroups in ``parent`` whose supervisor is dead; returns how many.
    One a process of its run still holds stays (rmdir refuses it) and is reported."""
    try:
        names = [e.name for e in os.scandir(parent) if e.is_dir() and owner_gone(e.name)]
    except OSError:
        return 0
    removed = busy = 0
    for name in names:
        try:
            os.rmdir(f"{parent}/{name}")
            removed += 1
        except FileNotFoundError:
            pass  # another supervisor reclaimed it first
        except OSError:
            busy += 1
    if removed:
        notes.append(
            f"removed {removed} memory cgroup(s) left in {parent} by sandbox supervisors "
            "that were killed"
        )
    if busy:
        notes.append(
            f"{busy} memory cgroup(s) of killed sandbox supervisors in {parent} still hold "
            "processes: left in place"
        )
    return removed


class KernelMemory:
    """The run's memory budget enforced by the kernel: a memory cgroup of its own.

    Every process of the run joins it before it executes anything (the worker writes
    itself into ``cgroup.procs`` between fork and exec), so every page the run touches
    is charged to it: each process's memory, and the System V, POSIX (``/dev/shm``) and
    memory-file pages it faults in (shared memory is charged to the cgroup that touched
    it). Past the limit the kernel reclaims what it can and then kills a process of the
    run (out of memory, inside the budget); the supervisor sees the cgroup's ``oom_kill``
    count rise, stops the rest and reports the budget. cgroup v2 (``memory.max``,
    ``memory.swap.max`` 0) where its memory controller can be enabled below this
    process's cgroup; else v1 (``memory.limit_in_bytes``, and ``memory.memsw.limit_in_bytes``
    where swap is accounted). :meth:`create` returns None where neither is writable: the
    supervisor then polls (:class:`RunMemory`). Its :meth:`close` also runs at exit, so a
    supervisor that fails leaves no cgroup; one that is killed leaves it to the next.
    """

    def __init__(self, path: str, version: int, budget: int) -> None:
        self.path, self.version, self.budget = path, version, budget
        self.procs_fd = os.open(f"{path}/cgroup.procs", os.O_WRONLY)
        self.peak = 0
        self.owner = os.getpid()
        self.closed = False
        atexit.register(self.close, [])

    @property
    def layer(self) -> str:
        what = "memory.max, memory.swap.max=0" if self.version == 2 else "memory.limit_in_bytes"
        if self.version == 1 and os.path.exists(f"{self.path}/memory.memsw.limit_in_bytes"):
            what += ", memory.memsw.limit_in_bytes"
        return f"enforced by the kernel: memory cgroup v{self.version} ({what})"

    @classmethod
    def create(cls, budget: int, notes: list[str]) -> "KernelMemory | None":
        name = f"{PREFIX}{_identity('self') or f'0-{os.getpid()}-0'}-{os.urandom(4).hex()}"
        tried = []
        for version, parent in parents():
            try:
                if version == 2:
                    with open(f"{parent}/cgroup.controllers") as f:
                        available = f.read().split()
                    if "memory" not in available:
                        raise OSError(f"no memory controller in {parent}/cgroup.controllers")
                    with open(f"{parent}/cgroup.subtree_control") as f:
                        enabled = f.read().split()
                    if "memory" not in enabled:
                        with open(f"{parent}/cgroup.subtree_control", "w") as f:
                            f.write("+memory")
                made = cls._make(f"{parent}/{name}", version, budget)
            except OSError as e:
                tried.append(f"v{version}: {e}")
                continue
            reclaim(parent, notes)
            return made
        if not any(version == 1 for version, _ in parents()):
            tried.append("v1: no memory hierarchy")
        notes.append(
            "no writable memory cgroup (" + "; ".join(tried) + "): the run's memory budget "
            "is polled by the supervisor"
        )
        return None

    @classmethod
    def _make(cls, path: str, version: int, budget: int) -> "KernelMemory":
        os.mkdir(path, 0o700)
        try:
            if version == 2:
                _write_file(f"{path}/memory.max", str(budget))
                if os.path.exists(f"{path}/memory.swap.max"):
                    _write_file(f"{path}/memory.swap.max", "0")
                _write_file(f"{path}/memory.oom.group", "1")  # one OOM kill stops the run
            else:
                _write_file(f"{path}/memory.limit_in_bytes", str(budget))
                if os.path.exists(f"{path}/memory.memsw.limit_in_bytes"):
                    _write_file(f"{path}/memory.memsw.limit_in_bytes", str(budget))
                with open(f"{path}/memory.limit_in_bytes") as f:
                    if int(f.read()) > budget:
                        raise OSError(f"{path}: the limit did not hold")
            return cls(path, version, budget)
        except BaseException:
            with contextlib.suppress(OSError):
                os.rmdir(path)
            raise

    def join(self) -> None:
        """In a child, before it executes anything: move the calling process into the cgroup."""
        os.write(self.procs_fd, b"0")

    def _field(self, name: str, key: str) -> int:
        try:
            with open(f"{self.path}/{name}") as f:
                for line in f:
                    parts = line.split()
                    if len(parts) == 2 and parts[0] == key:
                        return int(parts[1])
        except (OSError, ValueError):
            pass
        return 0

    def oom_kills(self) -> int:
        """Processes of the run the kernel killed at the budget so far."""
        if self.version == 2:
            return self._field("memory.events", "oom_kill")
        return self._field("memory.oom_control", "oom_kill")

    def usage_peak(self) -> int:
        """The most the cgroup held, by its own count (v2 ``memory.peak``, v1
        ``memory.max_usage_in_bytes``)."""
        name = "memory.peak" if self.version == 2 else "memory.max_usage_in_bytes"
        try:
            with open(f"{self.path}/{name}") as f:
                self.peak = max(self.peak, int(f.read()))
        except (OSError, ValueError):
            pass
        return self.peak

    def close(self, notes: list[str]) -> None:
        """Kill what is left in the cgroup, then remove it (once, in the supervisor only)."""
        if self.closed or os.getpid() != self.owner:
            return
        self.closed = True
        self.usage_peak()
        os.close(self.procs_fd)
        until = time.monotonic() + 5.0
        while True:
            try:
                with open(f"{self.path}/cgroup.procs") as f:
                    left = [int(p) for p in f.read().split()]
            except OSError:
                left = []
            for pid in left:
                with contextlib.suppress(OSError):
                    os.kill(pid, signal.SIGKILL)
            with contextlib.suppress(ChildProcessError, OSError):
                while os.waitpid(-1, os.WNOHANG)[0] > 0:  # orphans that came back here
                    pass
            try:
                os.rmdir(self.path)
                return
            except OSError as e:
                if time.monotonic() > until:
                    notes.append(f"could not remove the run's memory cgroup {self.path} ({e})")
                    return
            time.sleep(0.01)


class RunBudget:
    """``run_memory_mb`` as the supervisor holds it: a memory cgroup of the run's own
    (:class:`KernelMemory`) where one is writable and ``use_cgroup`` (the default), else
    polled from /proc (:class:`RunMemory`, the fallback; ``use_cgroup=False`` forces it,
    to test it where a cgroup is writable).

    Made before anything of the run starts (:meth:`join` in each worker), watching once
    the supervisor knows the run's uids (:meth:`watch`); :meth:`over` is asked at
    :attr:`next_poll`; :meth:`finish` ends it.
    """

    def __init__(self, budget_mb: int, use_cgroup: bool, notes: list[str]) -> None:
        self.mb, self.budget = budget_mb, budget_mb * 2**20
        self.cgroup = KernelMemory.create(self.budget, notes) if use_cgroup else None
        if not use_cgroup:
            notes.append(
                "the memory cgroup was turned off (Sandbox(memory_cgroup=False)): the run's "
                "memory budget is polled by the supervisor"
            )
        self.polled: RunMemory | None = None
        self.next_poll = 0.0
        self.peak = 0

    @property
    def enforcement(self) -> str:
        """What holds the budget: ``SandboxResult.memory_enforcement``."""
        return f"cgroup v{self.cgroup.version}" if self.cgroup is not None else "polled"

    @property
    def layer(self) -> str:
        how = self.cgroup.layer if self.cgroup is not None else "polled by the supervisor"
        return (
            f"run memory budget ({self.mb} MiB for every process, System V and POSIX shared "
            f"memory and memory files together; {how})"
        )

    def join(self) -> None:
        """In a worker, before it executes anything (a failure ends the run, "sandbox")."""
        if self.cgroup is not None:
            self.cgroup.join()

    def watch(self, proc_fd: int, root: int, shm_own_ns: bool, uids: set[int]) -> None:
        """Start counting: ``root`` is the supervisor (the run is its descendants)."""
        self.polled = RunMemory(proc_fd, root, self.budget, shm_own_ns, uids)

    @property
    def dev_shm_before(self) -> set[tuple[int, int]]:
        return self.polled.dev_shm_before if self.polled is not None else set()

    def over(self, now: float) -> bool:
        """Whether the run is past its budget (the kernel killed a process of it, or the
        poll measured more); sets :attr:`next_poll`."""
        if self.cgroup is not None:
            self.next_poll = now + 0.01
            return self.cgroup.oom_kills() > 0
        assert self.polled is not None, "watch() first"
        past = self.polled.poll(now)
        self.peak = self.polled.peak
        self.next_poll = now + self.polled.interval()
        return past

    def finish(self, stop_all: Callable[[], None], notes: list[str]) -> bool:
        """After the run: with a cgroup, ``stop_all()`` the run's processes and remove the
        cgroup, keeping its peak. True when the kernel killed a process at the budget."""
        if self.cgroup is None:
            return False
        killed = self.cgroup.oom_kills() > 0
        stop_all()
        self.cgroup.close(notes)
        self.peak = self.cgroup.peak
        return killed

    def stopped(self) -> str:
        """The note of a run stopped by its budget."""
        by = (
            "the kernel's memory cgroup killed a process at the budget"
            if self.cgroup is not None
            else "the supervisor measured"
        )
        return (
            f"stopped by the run's memory budget (run_memory_mb={self.mb}; {by}): its "
            f"processes and shared memory held {self.peak / 2**20:.0f} MiB"
        )


def _write_file(path: str, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)
