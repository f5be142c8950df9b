"""The sandbox's memory accounting: one budget for a whole run, and its System V cleanup.

Loaded by the supervisor from source (it runs as ``python -I -S -c``, with no import
path to this package); standard library only. ``RLIMIT_AS`` bounds each process's
address space, not a run: four processes under 512 MB each held 1.63 GB, and System V
shared memory, POSIX shared memory (``/dev/shm``) and memory files (``memfd``) are in no
process's address space once unmapped. cgroup v2 would bound them all in the kernel, but
it is not delegated where the sandbox usually runs (a container whose v2 hierarchy has
no memory controller), so :class:`RunMemory` sums the run's memory from ``/proc`` and
the supervisor stops the run when the sum passes ``run_memory_mb``.
"""

import ctypes
import os

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
