"""Where each step's rollout comes from: generated in the step, or by a producer ahead.

``rollout.max_staleness: 0`` (:class:`InStep`) is the synchronous loop: the batch of step
``s`` is generated with the weights after update ``s - 1``, and each update is synced
into the engine before the next rollout.

``max_staleness: k >= 1`` (:class:`Ahead`) overlaps the two. The engines run on their own
copy of each trained policy's weights (local mode: a *shadow* copy in this process; Ray:
the engine actor's own model), driven by a background thread that generates batch ``b``
with the weights of version ``max(0, b - 1 - k)``
(version ``v`` = the weights after update ``v``) while the trainer updates. The schedule
is fixed, not timing-dependent: every batch is generated with exactly the same weights,
RNG state and data whichever side is slower, so a run is reproducible and resumable, and
in steady state each batch is exactly ``k`` versions old. The producer waits for the
version it needs, so it is never more than ``k + 1`` batches ahead.

Each row records ``policy_version [B]`` (the weights version its tokens were sampled
with). At update time a group (a prompt's rows) with a row more than ``k`` versions old
is dropped whole and counted; with this schedule none is, and the check guards every
source of rows alike.

``rollout.partial`` (AReaL's partial rollouts) drops the fixed schedule for speed: batch
``b`` still waits for version ``b - 1 - k``, but starts with the newest published weights,
and the engine asks for newer ones before every decoding step
(:class:`~polyrl.core.interfaces.PartialRollouts`), so a publish never waits for the
generations in flight: they go on under the new weights, with the KV cache the old ones
made. Each row's ``token_version [B, R]`` says which version sampled each token, and
``policy_version`` is its oldest; the bound holds because a batch starts no older than
``b - 1 - k``. Which token gets which version depends on timing where a publish lands
mid-call, so two such runs are not bitwise equal then. Under Ray the engine actor
refreshes itself from versions offered to it as they are published (:class:`Versions`
``offer``).

Resume: a checkpoint at step ``s`` holds the data position and engine RNG as they were
before batch ``s + 1`` was generated, and the weights of versions ``s - k .. s - 1`` that
batches ``s + 1 .. s + k`` need. Batches in flight when a run is killed are discarded and
generated again from that state, identically. In partial mode the checkpoint also holds
which versions each batch after ``s`` had taken by then (:class:`Taken`: its start and
the refresh call at which each newer one came), and the batches made again take the same
at the same calls, then the newest published (``s`` or later, as in the killed run, where
``s`` was published before the checkpoint). So a resumed partial run equals the
uninterrupted one wherever the latter's schedule does not depend on timing (publishes at
call boundaries, or at a decoding step the engine waits at); otherwise they differ only in
where versions published after ``s`` land, as two uninterrupted runs do. The replay counts
refresh calls (one per decoding step); under Ray the actor refreshes itself, so only the
start version is replayed.
"""

from __future__ import annotations

import contextlib
import contextvars
import copy
import queue
import threading
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from tensordict import TensorDict

from polyrl.core.interfaces import Engine, Policy, ReportsRollout, Shadows, Workflow
from polyrl.core.observe.timeline import instant, span
from polyrl.core.observe.timeline import step as traced_step
from polyrl.core.record import GROUP_KEYS, group_ids, mark_invalid
from polyrl.core.rollout.data import PromptSampler
from polyrl.core.rollout.engine import SamplingParams


def _own_metrics(workflow: Workflow) -> dict[str, float]:
    return dict(workflow.rollout_metrics()) if isinstance(workflow, ReportsRollout) else {}


@dataclass
class Parts:
    """What a rollout source drives, given to it by the session (never the session)."""

    workflow: Workflow
    engines: Mapping[str, Engine]
    sampler: PromptSampler
    sampling: Callable[[], SamplingParams]  # the training rollouts' sampling setting
    steps: int  # train.steps: the last batch a producer makes


class InStep:
    """max_staleness 0: generate in the step, sync each update before the next rollout."""

    def __init__(self, parts: Parts) -> None:
        self.s = parts

    def next(self, step: int) -> tuple[TensorDict, dict[str, float]]:
        s = self.s
        record = s.workflow.rollout(s.sampler.next_batch(), s.sampling(), phase="train")
        return record, _own_metrics(s.workflow)

    def publish(self, name: str, step: int) -> None:
        self.s.engines[name].sync()

    def exclusive(self) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def state_dict(self, step: int) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any], step: int) -> None:
        return None

    def close(self, timeout: float | None = None) -> None:
        return None


def shadow(policy: Policy) -> Policy:
    """A copy of ``policy`` for an engine: same object, its own (frozen) model weights
    (the policy's own copy where it makes one: interfaces.Shadows)."""
    if isinstance(policy, Shadows):
        return policy.shadow()
    twin = copy.copy(policy)
    twin.model = copy.deepcopy(policy.model)
    twin.model.requires_grad_(False)
    twin.model.train(False)
    return twin


def _trainable(policy: Policy) -> dict[str, torch.Tensor]:
    """The weights an update can change (the rest never moves from the shadow's copy)."""
    return {n: p.detach().clone() for n, p in policy.model.named_parameters() if p.requires_grad}


class Versions(Protocol):
    """How a backend keeps versions of a trained policy's weights for its engine."""

    engine_policy: Policy  # what the engine is built on (its own copy of the weights)

    def capture(self) -> Any: ...  # the policy's weights now, as a version

    def load(self, engine: Engine, version: Any) -> None: ...  # into the engine's copy

    # toward the engine ahead of its load, while an earlier batch generates (any thread)
    def prefetch(self, engine: Engine, version: Any) -> None: ...

    # partial rollouts: the engine's calls take newer versions mid-call from ``start``;
    # ``refresh()`` is the producer's (the newest published, loaded), ``offer`` hands a
    # newly published version ``number`` to an engine that refreshes on its own
    def begin_partial(self, engine: Any, start: int, refresh: Any) -> None: ...

    def offer(self, engine: Engine, number: int, version: Any) -> None: ...

    def end_partial(self, engine: Any) -> None: ...

    engine_in_process: bool  # False: which version a partial call left is not known here

    def saved(self, version: Any) -> Any: ...  # for a checkpoint

    def restored(self, saved: Any) -> Any: ...  # from a checkpoint


class LocalVersions:
    """Local mode: versions are clones of the trainable weights; the engine runs on a
    shadow copy of the policy, and loading a version copies it in."""

    def __init__(self, policy: Policy) -> None:
        self.policy, self.engine_policy = policy, shadow(policy)

    def capture(self) -> dict[str, torch.Tensor]:
        return _trainable(self.policy)

    def load(self, engine: Engine, version: dict[str, torch.Tensor]) -> None:
        params = dict(self.engine_policy.model.named_parameters())
        with torch.no_grad():
            for key, value in version.items():
                params[key].copy_(value)
        engine.sync()

    def prefetch(self, engine: Engine, version: Any) -> None:
        return None  # a load is a copy within this process: nothing to move ahead

    engine_in_process = True

    def begin_partial(self, engine: Any, start: int, refresh: Any) -> None:
        engine.set_refresh(refresh)

    def offer(self, engine: Engine, number: int, version: Any) -> None:
        return None  # refresh reads the producer's versions itself

    def end_partial(self, engine: Any) -> None:
        engine.set_refresh(None)

    def saved(self, version: Any) -> Any:
        return version

    def restored(self, saved: Any) -> Any:
        return saved


@dataclass
class Taken:
    """Which versions a partial batch's engine calls took: ``start`` (loaded before its
    first call), then, per trained policy, the number of refresh calls so far and each
    change as ``(call index, version)``. Checkpointed for the batches in flight, and
    replayed when a resume makes them again."""

    start: int
    calls: dict[str, int]
    changes: dict[str, list[tuple[int, int]]] = field(default_factory=dict)

    def version(self, name: str, at: int) -> int:
        """The version refresh call ``at`` took."""
        return max(
            ((i, v) for i, v in self.changes.get(name, []) if i <= at), default=(-1, self.start)
        )[1]

    def take(self, name: str, version: int) -> None:
        at = self.calls[name]
        if version != self.version(name, at):
            self.changes.setdefault(name, []).append((at, version))
        self.calls[name] = at + 1

    def state_dict(self) -> dict[str, Any]:
        return {
            "start": self.start,
            "calls": dict(self.calls),
            "changes": copy.deepcopy(self.changes),
        }

    @classmethod
    def restored(cls, state: dict[str, Any]) -> Taken:
        return cls(state["start"], dict(state["calls"]), copy.deepcopy(state["changes"]))


class Ahead:
    """max_staleness k >= 1: a background producer generates batch b with version b-1-k."""

    def __init__(
        self, parts: Parts, k: int, versions: dict[str, Versions], partial: bool = False
    ) -> None:
        self.s, self.k, self.versions, self.partial = parts, k, versions, partial
        self.snapshots = {n: {0: v.capture()} for n, v in versions.items()}
        self.published = 0  # the newest version every trained policy has published
        self._pending: dict[int, set[str]] = {}
        self.loaded: dict[str, int | None] = dict.fromkeys(versions, 0)
        self.cond = threading.Condition()
        self.engine_lock = threading.Lock()  # the engines serve one caller at a time
        self.out: queue.Queue = queue.Queue()
        self.first = 1  # the first batch the producer makes
        self.prestates: dict[int, dict[str, Any]] = {}
        self.ahead: int | None = None  # the next batch's version, prefetched at its publish
        # partial: batch -> the versions its engines took, and those a resume replays
        self.taken: dict[int, Taken] = {}
        self.replay: dict[int, Taken] = {}
        self.thread: threading.Thread | None = None
        self.stop = False
        self.dropped_groups = 0

    # --- producer -----------------------------------------------------------------------
    def _load(self, version: int) -> None:
        """Put weights ``version`` into every trained policy's engine."""
        for name, versions in self.versions.items():
            if self.loaded[name] == version:
                continue
            with self.cond:
                snap = self.snapshots[name][version]
            versions.load(self.s.engines[name], snap)
            self.loaded[name] = version

    def _prefetch(self, version: int) -> None:
        """Send the weights the next batch loads toward its engines (holding ``cond``)."""
        for name, versions in self.versions.items():
            versions.prefetch(self.s.engines[name], self.snapshots[name][version])

    def _send_ahead(self, b: int, need: int) -> None:
        """Batch ``b`` (with version ``need``) is about to generate: the version batch b+1
        needs goes toward the engines when it is published, so that its transfer overlaps
        this batch's generation. One published already would be fetched before this batch
        generates (an engine runs its calls in order): it is left to the load."""
        nxt = max(0, b - self.k)
        if nxt == need or b == self.s.steps:
            return
        with self.cond:
            if self.published < nxt:
                self.ahead = nxt

    def _refresh(self, name: str, b: int) -> int:
        """Partial mode, between decoding steps of batch ``b``: the newest published
        weights into ``name``'s engine (or, for a batch a resume makes again, the version
        the killed run's call took here); returns their version."""
        with self.cond:
            taken, again = self.taken[b], self.replay.get(b)
            at = taken.calls[name]
            newest = self.published
            if again is not None and at < again.calls[name]:
                newest = again.version(name, at)
            taken.take(name, newest)
            snap = self.snapshots[name][newest]
        if self.loaded[name] != newest:
            self.versions[name].load(self.s.engines[name], snap)
            self.loaded[name] = newest
        return newest

    def _partial_rollout(self, items: list, b: int, start: int) -> TensorDict:
        """Batch ``b`` with engines that take newer weights mid-call (from version
        ``start``); ``policy_version`` is each row's oldest token version."""
        s = self.s
        for name, versions in self.versions.items():
            versions.begin_partial(s.engines[name], start, lambda n=name: self._refresh(n, b))
        try:
            record = s.workflow.rollout(items, s.sampling(), phase="train")
        finally:
            for name, versions in self.versions.items():
                versions.end_partial(s.engines[name])
                if not versions.engine_in_process:
                    self.loaded[name] = None  # the next load asks the engine (cheap if equal)
        if "token_version" not in record.keys():  # noqa: SIM118 (TensorDict)
            raise RuntimeError(
                f"rollout.partial: workflow {type(s.workflow).__name__} gave no "
                "token_version column: build its rows from the completions' token segments "
                "(core/segment.py, record.build_rows)"
            )
        tv = record["token_version"]
        real = tv >= 0
        oldest = torch.where(real, tv, torch.iinfo(torch.long).max).amin(1)
        newest = torch.where(real, tv, -1).amax(1)
        record["policy_version"] = torch.where(real.any(1), oldest, start)
        self.mixed_rows = int((real.any(1) & (newest > oldest)).sum())
        return record

    def _capture(self) -> dict[str, Any]:
        s = self.s
        return copy.deepcopy(
            {
                "sampler": s.sampler.state_dict(),
                "engines": {n: e.state_dict() for n, e in s.engines.items()},
            }
        )

    def _produce(self) -> None:
        s = self.s
        try:
            for b in range(self.first, s.steps + 1):
                need = max(0, b - 1 - self.k)

                def ready(n: int = need) -> bool:
                    return self.published >= n or self.stop

                with traced_step(b, "batch"):  # this batch's phases, when its step is traced
                    with span("wait_staleness_bound", version=need), self.cond:
                        self.cond.wait_for(ready)
                        if self.stop:
                            return
                    with self.engine_lock:
                        if self.partial:
                            with self.cond:  # the newest; newer ones come mid-call
                                again = self.replay.get(b)
                                need = self.published if again is None else again.start
                                self.taken[b] = Taken(need, dict.fromkeys(self.versions, 0))
                        with span("load_weights", version=need):
                            self._load(need)
                        pre = self._capture()
                        with self.cond:
                            self.prestates[b] = pre
                        with span("rollout", version=need):
                            if self.partial:
                                record = self._partial_rollout(s.sampler.next_batch(), b, need)
                            else:
                                self._send_ahead(b, need)
                                record = s.workflow.rollout(
                                    s.sampler.next_batch(), s.sampling(), phase="train"
                                )
                                record["policy_version"] = torch.full((record.batch_size[0],), need)
                        own = _own_metrics(s.workflow)
                    if self.partial:
                        own["async/mixed_version_rows"] = float(self.mixed_rows)
                    self.out.put((b, record, own))
                    # live readers (polyrl.core.observe.prometheus): how far ahead the producer is
                    instant("batch_ready", batch=b, version=need, queued=self.out.qsize())
        except BaseException as e:  # surfaces in the trainer's next()
            self.out.put((None, e, None))

    # --- trainer side -------------------------------------------------------------------
    def next(self, step: int) -> tuple[TensorDict, dict[str, float]]:
        if self.thread is None:
            # the producer runs in this context (the run's tracer: timeline.step finds it)
            run = contextvars.copy_context().run
            self.thread = threading.Thread(
                target=run, args=(self._produce,), name="polyrl-rollouts"
            )
            self.thread.daemon = True
            self.thread.start()
        with span("wait_rollout") as waited:
            b, record, own = self.out.get()
            waited.add(queued=self.out.qsize())
        if b is None:
            raise record
        if b != step:
            raise RuntimeError(f"rollout producer made batch {b} for step {step}")
        with self.cond:
            for kept in (self.prestates, self.taken, self.replay):
                for old in [v for v in kept if v <= step]:
                    del kept[old]
        return record, own | self._drop_stale(record, step)

    def _drop_stale(self, record: TensorDict, step: int) -> dict[str, float]:
        """Rows more than k versions behind the weights they update invalidate their group."""
        age = (step - 1) - record["policy_version"]
        groups = group_ids(record, GROUP_KEYS[:1])  # a prompt's rows
        stale_groups = torch.unique(groups[age > self.k])
        rows = torch.isin(groups, stale_groups).nonzero().flatten().tolist()
        if rows:
            mark_invalid(record, rows, ["stale: more than max_staleness versions old"] * len(rows))
        self.dropped_groups += len(stale_groups)
        hist = {f"async/staleness_{a}": float((age == a).sum()) for a in range(self.k + 1)}
        return hist | {
            "async/staleness_mean": float(age.float().mean()) if age.numel() else 0.0,
            "async/staleness_max": float(age.max()) if age.numel() else 0.0,
            "async/dropped_groups": float(len(stale_groups)),
            "async/dropped_groups_total": float(self.dropped_groups),
        }

    def publish(self, name: str, step: int) -> None:
        """Update ``step`` of policy ``name`` is done: its weights become version ``step``."""
        if name not in self.versions:
            return
        snap = self.versions[name].capture()
        with self.cond:
            self.snapshots[name][step] = snap
            if step == 0:  # a warm start replaced version 0: the shadow must reload it
                self.loaded[name] = None
            waiting = self._pending.setdefault(step, set(self.versions))
            waiting.discard(name)
            if not waiting:
                del self._pending[step]
                self.published = step
                if self.partial:  # a call in flight may take it at its next decoding step
                    for n, v in self.versions.items():
                        v.offer(self.s.engines[n], step, self.snapshots[n][step])
                if self.ahead == step:
                    self.ahead = None
                    self._prefetch(step)
                for snaps in self.snapshots.values():  # later batches need >= step - k
                    for old in [v for v in snaps if v < step - self.k]:
                        del snaps[old]
                self.cond.notify_all()

    @contextlib.contextmanager
    def exclusive(self) -> Iterator[None]:
        """The engines with the newest weights and the RNG state they had before the next
        batch (as in the synchronous loop, whatever the producer has drawn since), the
        producer paused (evaluation)."""
        with self.engine_lock:
            self._load(self.published)
            engines = self.s.engines
            now = {n: e.state_dict() for n, e in engines.items()}
            with self.cond:
                pre = self.prestates.get(self.published + 1)
            if pre is not None:
                for n, e in engines.items():
                    e.load_state_dict(copy.deepcopy(pre["engines"][n]))
            try:
                yield
            finally:
                for n, e in engines.items():
                    e.load_state_dict(now[n])

    def state_dict(self, step: int) -> dict[str, Any]:
        """What resuming at ``step`` needs: the state before batch step+1, and the older
        weights batches step+1 .. step+k are generated with."""
        with self.cond:
            pre = self.prestates.get(step + 1)
            versions = range(max(0, step - self.k), step)
            snaps = {n: {v: s[v] for v in versions} for n, s in self.snapshots.items()}
            taken = {b: t.state_dict() for b, t in self.taken.items() if b > step}
        if pre is None:  # batch step+1 not started: capture it with the engines idle
            with self.engine_lock, self.cond:
                pre = self.prestates.get(step + 1) or self._capture()
        # a batch in flight already captured its state: the save does not wait for it
        saved = {n: {v: self.versions[n].saved(w) for v, w in s.items()} for n, s in snaps.items()}
        return {"before_next": pre, "snapshots": saved, "taken": taken}

    def load_state_dict(self, state: dict[str, Any], step: int) -> None:
        s = self.s
        s.sampler.load_state_dict(state["before_next"]["sampler"])
        for n, e in s.engines.items():
            e.load_state_dict(state["before_next"]["engines"][n])
        for name, versions in self.versions.items():
            saved = state["snapshots"][name]
            self.snapshots[name] = {v: versions.restored(w) for v, w in saved.items()}
            self.snapshots[name][step] = versions.capture()
        self.loaded = dict.fromkeys(self.versions)
        self.published, self.first = step, step + 1
        # checkpoints written before partial resumes were exact keep no "taken"
        self.replay = {b: Taken.restored(t) for b, t in state.get("taken", {}).items()}

    def close(self, timeout: float | None = None) -> None:
        """Stop the producer (it ends after the batch it is making) and wait for it, at
        most ``timeout`` s (a failed run's teardown: the thread is a daemon)."""
        with self.cond:
            self.stop = True
            self.cond.notify_all()
        if self.thread is not None:
            self.thread.join(timeout)
