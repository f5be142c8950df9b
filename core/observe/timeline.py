"""A per-step timeline of a run: where each sampled step's time went, as a trace file.

``run.trace_every: N`` (0, the default: off) records every N-th step's phases -- the
rollout and each engine call (requests, tokens), environment steps and tool calls (each
episode on a track of its own), rewards, the old / reference log-prob
passes, each micro-batch of the update, optimizer steps, weight syncs, checkpoint writes,
waits on the staleness bound -- into ``RUN_DIR/trace/<process>-<pid>.json``, in the Chrome
Trace Event format that Perfetto (ui.perfetto.dev) and chrome://tracing open.

Each process (and each Ray actor that traces) writes its own file; events carry the
process and thread ids and a wall-clock timestamp, so the files of one run merge on one
time axis. A file is a JSON array written one event per line and flushed as it goes: a
run that is killed leaves every finished span readable (the format allows the missing
closing bracket; :func:`read_trace` reads such a file).

Code marks phases with :func:`span` and :func:`instant`; both find the recording tracer
in a context variable that :func:`step` sets for a sampled step (a thread inherits it
where it is started with the caller's context, as the async producer is), so nothing is
handed through every call and an unsampled step costs one ``ContextVar.get``.

Live readers (the Prometheus endpoint, :mod:`polyrl.core.observe.prometheus`) :func:`watch` every
span and instant of the process, sampled or not: a watcher is process-wide, since the
gateway's server threads and a run's worker threads do not all share the loop's context.
"""

from __future__ import annotations

import contextlib
import contextvars
import json
import os
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from types import TracebackType
from typing import Any

# the run's tracer (set for the whole run) and the one recording now (a sampled step)
_TRACER: contextvars.ContextVar[Tracer | None] = contextvars.ContextVar(
    "polyrl_tracer", default=None
)
_LIVE: contextvars.ContextVar[Tracer | None] = contextvars.ContextVar("polyrl_live", default=None)
# the track of the innermost span given a lane: spans inside it (an episode's environment
# step and its tool calls, each asyncio task in its own context) land on the same track
_LANE: contextvars.ContextVar[str | None] = contextvars.ContextVar("polyrl_lane", default=None)

# (name, start_us, dur_us or None for an instant, args): told of every span and instant
Watcher = Callable[[str, float, "float | None", dict[str, Any]], None]
_WATCHERS: tuple[Watcher, ...] = ()  # replaced whole, so span() reads it without a lock
_WATCH_LOCK = threading.Lock()


def _now_us() -> float:
    """Wall-clock microseconds: one time axis for every process of the run (one machine;
    across nodes as good as their clocks agree)."""
    return time.time_ns() / 1000.0


class Tracer:
    """Writes one process's events to ``directory/<process>-<pid>.json``; thread-safe."""

    def __init__(self, directory: Path | str, every: int, process: str = "trainer") -> None:
        if every < 0:
            raise ValueError(f"trace every={every}: give 0 (off) or a step interval >= 1")
        self.directory, self.every, self.process = Path(directory), every, process
        self.pid = os.getpid()
        self.path = self.directory / f"{process}-{self.pid}.json"
        self._lock = threading.Lock()
        self._file: Any = None
        self._threads: set[int] = set()
        self._lanes: dict[str, int] = {}

    def sampled(self, step: int) -> bool:
        return self.every > 0 and step % self.every == 0

    def emit(self, event: dict[str, Any], lane: str | None = None) -> None:
        """Write ``event`` on this thread's track, or on track ``lane`` (work that overlaps
        on one thread, e.g. a server's concurrent requests, each on its own track)."""
        tid = threading.get_native_id() if lane is None else self._lane(lane)
        event = {"pid": self.pid, "tid": tid, **event}
        with self._lock:
            if self._file is None:
                self.directory.mkdir(parents=True, exist_ok=True)
                self._file = self.path.open("a", encoding="utf-8")
                if self._file.tell() == 0:
                    self._file.write("[\n")
                self._write(self._meta("process_name", self.pid, {"name": self.process}))
            if tid not in self._threads:
                self._threads.add(tid)
                name = threading.current_thread().name if lane is None else lane
                self._write(self._meta("thread_name", tid, {"name": name}))
            self._write(event)
            self._file.flush()  # a killed run keeps what ran

    def _lane(self, lane: str) -> int:
        """A track id for ``lane``, apart from thread ids (which are below 2**22 on Linux)."""
        with self._lock:
            return self._lanes.setdefault(lane, (1 << 30) + len(self._lanes))

    def _meta(self, name: str, tid: int, args: dict) -> dict[str, Any]:
        return {"ph": "M", "name": name, "pid": self.pid, "tid": tid, "args": args}

    def _write(self, event: dict[str, Any]) -> None:
        self._file.write(json.dumps(event, default=float) + ",\n")

    def close(self) -> None:
        with self._lock:
            if self._file is not None:
                self._file.close()
                self._file = None


class Span:
    """An open span; :meth:`add` puts facts learned inside it (tokens made) in its args.
    ``tracer`` None: only the watchers hear of it (an unsampled step)."""

    __slots__ = ("tracer", "name", "args", "start", "lane", "_lane_token")

    def __init__(
        self, tracer: Tracer | None, name: str, args: dict[str, Any], lane: str | None = None
    ) -> None:
        self.tracer, self.name, self.args, self.lane = tracer, name, args, lane

    def add(self, **args: Any) -> None:
        self.args.update(args)

    def __enter__(self) -> Span:
        self._lane_token = None if self.lane is None else _LANE.set(self.lane)
        self.start = _now_us()
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        end = _now_us()
        if self._lane_token is not None:
            _LANE.reset(self._lane_token)
        if kind is not None:
            self.args["error"] = kind.__name__
        if self.tracer is not None:
            self.tracer.emit(
                {
                    "ph": "X",
                    "name": self.name,
                    "ts": self.start,
                    "dur": end - self.start,
                    "args": self.args,
                },
                self.lane,
            )
        for watcher in _WATCHERS:
            watcher(self.name, self.start, end - self.start, self.args)


class _Off:
    """What :func:`span` returns when nothing records: enters, adds and exits as no-ops."""

    __slots__ = ()

    def add(self, **args: Any) -> None:
        return None

    def __enter__(self) -> _Off:
        return self

    def __exit__(self, *exc: Any) -> None:
        return None


OFF = _Off()


def span(name: str, *, lane: str | None = None, **args: Any) -> Span | _Off:
    """``with span("generate", requests=8) as s: ...; s.add(tokens=n)``: one complete
    event when a sampled step is recording, nothing otherwise. ``lane``: a track of its
    own (see :meth:`Tracer.emit`; by default the lane of the span it runs in, if any).
    Watchers hear of it in every step."""
    tracer = _LIVE.get()
    if tracer is None and not _WATCHERS:
        return OFF
    return Span(tracer, name, args, lane if lane is not None else _LANE.get())


def instant(name: str, **args: Any) -> None:
    """A point in time (a dropped group, a refresh), when a sampled step is recording;
    watchers hear of it in every step."""
    tracer = _LIVE.get()
    now = _now_us()
    if tracer is not None:
        tracer.emit({"ph": "i", "s": "t", "name": name, "ts": now, "args": args})
    for watcher in _WATCHERS:
        watcher(name, now, None, args)


@contextlib.contextmanager
def watch(watcher: Watcher) -> Iterator[None]:
    """Tell ``watcher`` of every span and instant in this process within the block (from
    any thread, recorded or not). It runs on the thread that closes the span: keep it quick."""
    global _WATCHERS
    with _WATCH_LOCK:
        _WATCHERS = (*_WATCHERS, watcher)
    try:
        yield
    finally:
        with _WATCH_LOCK:
            rest = list(_WATCHERS)
            rest.remove(watcher)
            _WATCHERS = tuple(rest)


def recording() -> Tracer | None:
    """The tracer recording now (for a thread or server that does not share this context:
    hand it over and enter :func:`recording_with` there)."""
    return _LIVE.get()


@contextlib.contextmanager
def recording_with(tracer: Tracer | None) -> Iterator[None]:
    """Record into ``tracer`` (None: nothing) within the block, e.g. in a server thread
    serving a request of a sampled step."""
    token = _LIVE.set(tracer)
    try:
        yield
    finally:
        _LIVE.reset(token)


@contextlib.contextmanager
def tracing(tracer: Tracer | None) -> Iterator[Tracer | None]:
    """The run's tracer for the block (closed at its end); None: no tracing."""
    token = _TRACER.set(tracer)
    try:
        yield tracer
    finally:
        _TRACER.reset(token)
        if tracer is not None:
            tracer.close()


@contextlib.contextmanager
def step(number: int, name: str = "step") -> Iterator[Span | _Off]:
    """Step ``number``'s block: recorded (as span ``name`` holding its phases) when the
    run's tracer samples it; the phases of other steps record nothing."""
    tracer = _TRACER.get()
    live = tracer if tracer is not None and tracer.sampled(number) else None
    token = _LIVE.set(live)
    try:
        with span(name, step=number) as s:
            yield s
    finally:
        _LIVE.reset(token)


def read_trace(path: Path | str) -> list[dict[str, Any]]:
    """The events of a trace file as written (a JSON array, one event a line; a killed
    run's file without its closing bracket reads as well)."""
    events = []
    lines = Path(path).read_text(encoding="utf-8").splitlines()
    for i, line in enumerate(lines):
        line = line.strip().rstrip(",")
        if line in ("", "[", "]"):
            continue
        try:
            events.append(json.loads(line))
        except json.JSONDecodeError as e:
            if i == len(lines) - 1:  # the line a kill cut short: what ran before stays
                break
            raise ValueError(f"{path}: line {i + 1} is not a trace event ({e})") from None
    return events


def read_run(run_dir: Path | str) -> list[dict[str, Any]]:
    """Every process's events of a run (``RUN_DIR/trace/*.json``), merged by time."""
    files = sorted((Path(run_dir) / "trace").glob("*.json"))
    if not files:
        raise FileNotFoundError(
            f"{run_dir}: no trace/*.json; trace a run with run.trace_every: N (every N-th step)"
        )
    events = [e for f in files for e in read_trace(f)]
    return sorted(events, key=lambda e: (e.get("ts", 0.0), -e.get("dur", 0.0)))
