"""The driver's handle on a policy's engine actor; a dead actor is restarted in the run.

Under ``distributed.args.max_restarts: n`` (default 0: a dead engine actor ends the run,
which resumes from its last checkpoint) an engine actor that dies during a call (its
process killed, out of memory, its node lost) is replaced up to ``n`` times per policy
over the run: a fresh actor in the same placement-group bundle is set up as the dead one
was, given what made the dead one what it was, and the interrupted call is sent again.
What the fresh actor is given:

- **the weights** the dead actor held: the version loaded last (async rollouts,
  ``load_version``); after a ``sync`` (the synchronous loop, where the engine holds the
  trainer's weights whenever it generates), the trainer's weights, gathered again as a
  publish gathers them; before either, the weights its setup loads (version 0);
- **partial rollouts** on, from the newest version offered to the dead actor (a partial
  call in flight may have taken it mid-call);
- **the engine's state** (its RNG) as the last completed call left it.

So a re-issued call samples exactly what the lost call would have, for engines whose state
holds their sampling streams (``hf``: its generator; ``vllm``: the call counter that each
sample's seed derives from); a synchronous or async run with a restart ends bitwise equal to
one without. A partial call is re-issued whole from the newest version offered, so its rows
may be sampled with newer weights than the lost call's (within the staleness bound; partial
runs are not reproducible anyway). No rows are dropped: every interrupted call is re-issued.
Calls sent without waiting to the dead actor (a version staged ahead of its load) are not
replayed: the load fetches the version itself. When no restart is left the call fails with
one line naming the actor and the option. A dead trainer worker still ends the run (its
FSDP group cannot lose a rank).
"""

from __future__ import annotations

import contextlib
import copy
import threading
from collections.abc import Callable
from typing import Any

from polyrl.core.distributed.ray_workers import ActorError, EngineWorker, require_ray, wait

_AS_SET_UP = "set up"  # the weights the actor's setup loads: version 0
_TRAINERS = "trainer"  # the trainer's current weights (after a sync)


def _died(err: ActorError) -> bool:
    from ray.exceptions import RayActorError

    return isinstance(err.__cause__, RayActorError)


class EngineActor:
    """A policy's engine actor (:class:`EngineWorker`) as the driver calls it: calls in
    order, calls sent without waiting, the engine state each call leaves, and the restart
    of a dead actor (module doc)."""

    def __init__(
        self,
        name: str,
        cfg: Any,
        *,
        seed: int,
        gpu: bool,
        threads: int,
        options: dict[str, Any],
        max_restarts: int,
        gather: Callable[[], Any],
    ) -> None:
        """``options``: the actor's Ray options (resources, placement); ``gather``: the
        trainer's current weights as an object reference (what a publish sends)."""
        self.name, self.cfg, self.seed, self.gpu = name, cfg, seed, gpu
        self.threads, self.options, self.max_restarts = threads, options, max_restarts
        self.gather = gather
        self.label = f"engine for policy {name!r}"
        self.restarts = 0
        self.generation = 0  # one per actor started; orders the states the calls return
        self._lock = threading.Lock()  # the trainer and the async producer both send
        self._restart_lock = threading.Lock()
        self._sent: list = []  # calls not waited for yet; a failure is raised by the next call
        # what a fresh actor needs to continue where this one stopped
        self._weights: Any = _AS_SET_UP  # or _TRAINERS, or the version loaded last (a ref)
        self._partial: int | None = None  # partial rollouts on, from this version
        self._offered: tuple[int, Any] | None = None  # the newest version offered meanwhile
        self._state: tuple[tuple[int, int], dict] | None = None  # (generation, call), state
        self.handle = self._spawn()
        self._sent.append(self._setup(self.handle))

    def _spawn(self) -> Any:
        ray = require_ray()
        # "offers": partial rollouts hand newer weights to a call in flight
        remote = ray.remote(concurrency_groups={"offers": 1})(EngineWorker)
        return remote.options(**self.options).remote(self.threads)

    def _setup(self, handle: Any) -> Any:
        return handle.setup.remote(self.name, self.cfg, seed=self.seed, gpu=self.gpu)

    # --- sending ------------------------------------------------------------------------
    def submit(self, method: str, *args: Any) -> None:
        """``method`` on the actor, not waited for: the actor runs this process's calls in
        the order they were sent; a failure is raised by the next :meth:`call`."""
        with self._lock:
            if method == "load_version":
                self._weights = args[0][0]
            elif method == "partial":
                self._partial = args[0]
                if args[0] is None:  # the actor drops the offers it holds
                    self._offered = None
            self._sent.append(getattr(self.handle, method).remote(*args))

    def offer(self, version: int, ref: Any) -> None:
        """Partial rollouts: version ``version`` to the actor beside its running call (its
        "offers" group); a failure is raised by the next :meth:`call`."""
        with self._lock:
            if self._offered is None or version > self._offered[0]:
                self._offered = (version, ref)
            method = self.handle.offer.options(concurrency_group="offers")
            self._sent.append(method.remote(version, ref.hex(), ref))

    def call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        """``method`` on the actor, after the calls sent before it; its result."""
        return self._call(method, args, kwargs)[0]

    def call_keeping(self, method: str, *args: Any, **kwargs: Any) -> Any:
        """A call that returns ``(out, (call number, engine state))``: the state is kept
        (:meth:`state`), ``out`` returned."""
        (out, numbered), generation = self._call(method, args, kwargs)
        self._keep(generation, numbered)
        return out

    def load_state(self, state: dict) -> None:
        numbered, generation = self._call("load_state_dict", (state,), {})
        self._keep(generation, numbered)

    def state(self) -> dict:
        """The engine's state after its last call, without a call once one has returned it
        (async rollouts take it before every batch)."""
        if self._state is None:
            numbered, generation = self._call("state_dict", (), {})
            self._keep(generation, numbered)
        assert self._state is not None  # _keep set it
        return copy.deepcopy(self._state[1])

    def _keep(self, generation: int, numbered: tuple[int, dict]) -> None:
        key = (generation, numbered[0])
        with self._lock:  # calls from two threads may come back in either order
            if self._state is None or key >= self._state[0]:
                self._state = (key, numbered[1])

    def _call(self, method: str, args: tuple, kwargs: dict) -> tuple[Any, int]:
        while True:
            with self._lock:
                if method == "sync":
                    self._weights = args[0]
                generation = self.generation
                ref = getattr(self.handle, method).remote(*args, **kwargs)
                refs, self._sent = [*self._sent, ref], []
            try:
                out = wait(refs, [self.label] * len(refs))[-1]
            except ActorError as err:
                if not _died(err):
                    raise
                self._restart(generation, method, err)
                continue
            if method == "sync":
                with self._lock:  # the trainer's weights: gathered again if needed, not kept
                    if self._weights is args[0]:
                        self._weights = _TRAINERS
            return out, generation

    # --- restarting ---------------------------------------------------------------------
    def _restart(self, generation: int, method: str, err: ActorError) -> None:
        """Replace the actor that died (``generation``) unless another call did already."""
        with self._restart_lock:
            while self.generation == generation:
                if self.restarts >= self.max_restarts:
                    raise ActorError(self._used_up(method)) from err
                self.restarts += 1
                with contextlib.suppress(Exception):
                    require_ray().kill(self.handle)
                # (a trainer worker's failure here is its own error, not a restart)
                trainers = self.gather() if self._weights is _TRAINERS else None
                try:
                    self._start_again(trainers)
                except ActorError as again:
                    if not _died(again):
                        raise
                    generation, err = self.generation, again  # died in its setup: again

    def _start_again(self, trainers: Any) -> None:
        """A fresh actor, set up and given the dead one's weights (``trainers``: the
        trainer's, gathered, when those are what it held), partial setting and state, in
        that order, before any call another thread sends meanwhile. Only the thread that
        generates changes the weights, so they are still what ``trainers`` was chosen by."""
        with self._lock:
            handle = self._spawn()
            replay = [self._setup(handle)]
            weights = self._weights
            if weights is _TRAINERS:
                replay.append(handle.sync.remote(trainers))
            elif weights is not _AS_SET_UP:
                replay.append(handle.load_version.remote([weights]))
            if self._partial is not None:
                start = self._partial
                if self._offered is not None and self._offered[0] > start:
                    start, newest = self._offered
                    replay.append(handle.load_version.remote([newest]))
                replay.append(handle.partial.remote(start))
            if self._state is not None:
                replay.append(handle.load_state_dict.remote(self._state[1]))
            self.handle, self._sent = handle, []
            self.generation += 1
        wait(replay, [self.label] * len(replay))

    def _used_up(self, method: str) -> str:
        if self.max_restarts == 0:
            return (
                f"{self.label} died during {method}; distributed.args.max_restarts is 0, so "
                "the run cannot continue in this process: set it > 0 to restart the engine "
                "in the run, or resume from the last checkpoint (run.resume=true, or "
                "polyrl train --resume)"
            )
        return (
            f"{self.label} died during {method} after {self.restarts} restarts, all that "
            f"distributed.args.max_restarts={self.max_restarts} allows: raise it, or resume "
            "from the last checkpoint (run.resume=true, or polyrl train --resume)"
        )

    def kill(self) -> None:
        with contextlib.suppress(Exception):
            require_ray().kill(self.handle)
