"""The episode runtime's batcher: concurrent episodes ask for completions, and each
*flush* serves everything waiting with one engine call per policy and sampling setting
(per group of policies, when their engines serve each other's requests in one call:
``MixedCalls``, e.g. LoRA adapters on one base).

Every workflow that runs episodes side by side uses it: ``multi_turn`` (both schedules),
marl's teams, vision-language agents and the agent gateway. An episode awaits
:meth:`Batcher.generate` with a :class:`~polyrl.core.rollout.engine.Request`; requests with
different budgets (``Request.max_new_tokens``) or ``n`` share a call, and a request with
images is served by the same ``generate`` (the engine's ``caps`` must say ``takes_images``).

The engine runs on a worker thread, so while it generates the event loop keeps stepping
the other episodes' environments (async tools, sandboxes, thread-pool steps); what they
ask for meanwhile waits for the next flush. When a flush happens is the driver's choice:

- :meth:`Batcher.drive` runs the episodes on this loop and flushes when the loop has
  settled (every episode that can still submit before blocking on something else has
  done so). With environments that step inline that is exactly the lock-step round: same
  prompts, same order (requests sorted by key), same calls. With environments that take
  time, an episode goes back to the engine as soon as its own step is done.
- :meth:`Batcher.serve` flushes for episodes driven from outside (HTTP clients of the
  gateway): when every open episode has a request waiting, or none arrived for ``wait``
  seconds; but for a while after a flush (:attr:`Batcher.patience` of its longest engine
  call) it waits for every open episode however far apart their requests come.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any, cast

from polyrl.core.interfaces import Engine, MixedCalls, takes_images
from polyrl.core.rollout.engine import Completion, Request, SamplingParams, TokenSink
from polyrl.core.rollout.paint import ImageRequest, Painting, PaintsImages, paints_images


def _as_sample(sink: TokenSink, sample: int) -> TokenSink:
    """``sink`` for a request copy sampled once in place of its request's sample ``sample``."""
    return lambda _, token, logprob, top: sink(sample, token, logprob, top)


class EpisodeClosed(Exception):
    """A request whose episode ended (timed out) before a flush took it; never generated."""


@dataclasses.dataclass
class _Waiting:
    policy: str
    request: Request
    params: SamplingParams
    key: Any
    future: asyncio.Future
    episode: Any  # who asked (serve: "every open episode waits" counts distinct ones)
    alive: Callable[[], bool] | None
    image: ImageRequest | None = None  # an image request (``request`` then holds no prompt)

    def group(self, engine: Any) -> tuple:
        """Requests that may share one engine call: same engine (or ``engine``, the mix key
        of engines that serve each other's requests) and sampling setting (a seeded
        request's samples: a call of their own, as the seed fixes that call). Image
        requests of one painter share one ``paint`` call."""
        if self.image is not None:
            return (engine, "paint")
        p = self.params
        key = (engine, p.temperature, p.top_p, tuple(p.stop), tuple(p.stop_token_ids))
        return key + ((p.seed, id(p)) if p.seed is not None else (None,))


class Batcher:
    """Queues the requests of concurrent episodes; one engine call per (policy, sampling
    setting) per flush, or per (mix key, sampling setting) for engines that declare
    ``MixedCalls``. ``sizes``: requests per engine call; ``calls``: engine calls each policy
    took part in; ``mixed``: calls that served several policies; ``generate_s``: seconds
    spent in engine calls."""

    # serve: for this share of the last flush's longest engine call, a flush waits for every
    # open episode, whatever the pauses between their requests. Agents answered together
    # come back one by one (their client code takes a few to tens of ms a request, on one
    # loop, sharing the GIL), with pauses well past ``wait`` among them; a flush in such a
    # pause splits the round into two engine calls, and a second call costs far more than
    # the wait (an engine call has a large fixed cost: 12 rows took 3.3 s where 64 took
    # 5.9 s, HF on CPU). Bounded: an agent slower than this is not waited for.
    patience = 0.5

    def __init__(self, engines: Mapping[str, Engine], *, in_thread: bool = True) -> None:
        self.engines = engines
        self.in_thread = in_thread
        self.pending: list[_Waiting] = []
        self.sizes: list[int] = []
        self.calls: Counter[str] = Counter()
        self.mixed = 0
        self.flushes = 0
        self.generate_s = 0.0
        self.longest_call_s = 0.0  # the last flush's longest engine call
        self.flushing = False  # an engine call may be running (read from other threads)
        self._submitted = 0
        self._wake: asyncio.Future | None = None
        self._failure: BaseException | None = None

    async def generate(
        self,
        policy: str,
        request: Request,
        params: SamplingParams,
        *,
        key: Any = None,
        episode: Any = None,
        alive: Callable[[], bool] | None = None,
    ) -> list[Completion]:
        """``params.n`` completions of ``request`` by ``policy``'s engine, from the next
        flush that takes it. ``key`` orders requests within a call (None: arrival);
        ``alive() == False`` at flush time drops the request with :class:`EpisodeClosed`."""
        if policy not in self.engines:
            raise KeyError(f"no engine for policy {policy!r}; have {sorted(self.engines)}")
        if not request.text_only and not takes_images(self.engines[policy]):
            raise TypeError(
                f"the engine of policy {policy!r} ({type(self.engines[policy]).__name__}) "
                f"takes no images; set policies.{policy}.engine.name=hf_vl (or vllm_vl)"
            )
        request.budget(params)  # a bad budget fails here, in the episode that sent it
        fut = asyncio.get_running_loop().create_future()
        order = self._submitted if key is None else key
        self.pending.append(_Waiting(policy, request, params, order, fut, episode, alive))
        self._submitted += 1
        if self._wake is not None and not self._wake.done():
            self._wake.set_result(None)
        return await fut

    async def paint(
        self, policy: str, request: ImageRequest, *, key: Any = None, episode: Any = None
    ) -> list[Painting]:
        """``request.n`` paintings of ``request`` by ``policy``'s engine (one that
        :class:`~polyrl.core.rollout.paint.PaintsImages`), from the next flush: every image request
        of that policy waiting then is served by one ``paint`` call."""
        if policy not in self.engines:
            raise KeyError(f"no engine for policy {policy!r}; have {sorted(self.engines)}")
        if not paints_images(self.engines[policy]):
            raise TypeError(
                f"the engine of policy {policy!r} ({type(self.engines[policy]).__name__}) "
                "paints no images; give it a diffusion policy (kind: diffusion, engine "
                "diffusion)"
            )
        fut = asyncio.get_running_loop().create_future()
        order = self._submitted if key is None else key
        self.pending.append(
            _Waiting(policy, Request([]), SamplingParams(), order, fut, episode, None, request)
        )
        self._submitted += 1
        if self._wake is not None and not self._wake.done():
            self._wake.set_result(None)
        return await fut

    # ------------------------------------------------------------------ drive
    async def _settle(self, tasks: list[asyncio.Task]) -> None:
        """Yield until nothing moves: every live episode waits on the engine or on
        something slower than a few loop turns (a timer, a thread, a subprocess)."""
        stable, last = 0, None
        while stable < 3:
            await asyncio.sleep(0)
            sig = (self._submitted, sum(t.done() for t in tasks), len(asyncio.all_tasks()))
            stable = stable + 1 if sig == last else 0
            last = sig

    async def drive(self, episodes: Sequence[Awaitable[Any]]) -> None:
        """Run ``episodes`` on this loop to the end, flushing their requests. An episode's
        exception, or an engine call's, ends the drive and propagates."""
        tasks = [asyncio.ensure_future(e) for e in episodes]
        try:
            while True:
                await self._settle(tasks)
                for t in tasks:
                    if t.done() and not t.cancelled() and (exc := t.exception()) is not None:
                        raise exc
                if self.pending:
                    await self.flush()
                    if self._failure is not None:
                        raise self._failure
                    continue
                live = [t for t in tasks if not t.done()]
                if not live:
                    return
                # Every live episode waits on something other than the engine: sleep until a
                # request arrives or an episode ends.
                self._wake = asyncio.get_running_loop().create_future()
                await asyncio.wait([self._wake, *live], return_when=asyncio.FIRST_COMPLETED)
                self._wake = None
        finally:
            for t in tasks:
                if not t.done():
                    t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    # ------------------------------------------------------------------ serve
    def serve(self, wait: float, open_episodes: Callable[[], int]) -> asyncio.Task:
        """Flush in the background for episodes driven from outside this loop: when every
        open episode (``open_episodes()`` of them) has a request waiting, or none arrived
        for ``wait`` seconds. An engine error fails the requests of its call only."""
        return asyncio.get_running_loop().create_task(self._serve(wait, open_episodes))

    async def _serve(self, wait: float, open_episodes: Callable[[], int]) -> None:
        while True:
            if not self.pending:
                self._wake = asyncio.get_running_loop().create_future()
                await self._wake
                self._wake = None
            window = self.patience * self.longest_call_s if wait else 0.0
            await self._gather(wait, open_episodes, window)
            await self.flush()
            self._failure = None  # answered to each failed request; the server goes on

    async def _gather(
        self, wait: float, open_episodes: Callable[[], int], window: float = 0.0
    ) -> None:
        """Until every open episode has a request waiting; or, ``window`` seconds (wall
        clock) after the gathering began, until none arrived for ``wait`` seconds."""
        step = min(wait, 0.001)
        quiet, seen, start = 0.0, self._submitted, time.perf_counter()
        while quiet < wait or time.perf_counter() - start < window:
            if len({id(w.episode) for w in self.pending}) >= open_episodes():
                return
            await asyncio.sleep(step)
            quiet = 0.0 if self._submitted != seen else quiet + step
            seen = self._submitted

    # ------------------------------------------------------------------ flush
    async def flush(self) -> None:
        """Serve every waiting request: one engine call per group, groups in order."""
        batch, self.pending = self.pending, []
        taken = []
        for w in batch:
            if w.future.done():  # its episode gave up on it (cancelled)
                continue
            if w.alive is not None and not w.alive():
                w.future.set_exception(EpisodeClosed("the episode is over (it timed out)"))
                continue
            taken.append(w)
        if not taken:
            return
        self.flushes += 1
        self.longest_call_s = 0.0
        groups: dict[tuple, list[_Waiting]] = {}
        mix = {p: self._mix_key(p) for p in {w.policy for w in taken}}
        for w in sorted(taken, key=lambda w: w.key):
            groups.setdefault(w.group(mix[w.policy]), []).append(w)
        self.flushing = True
        try:
            for waiting in groups.values():
                await self._call(waiting)
        finally:
            self.flushing = False

    def _mix_key(self, policy: str) -> tuple:
        """Policies whose requests may share an engine call: their engines' equal mix key,
        else the policy alone."""
        engine = self.engines[policy]
        key = engine.mix_key() if isinstance(engine, MixedCalls) else None
        return ("policy", policy) if key is None else ("mix", key)

    async def _call(self, waiting: list[_Waiting]) -> None:
        waiting = [w for w in waiting if not w.future.done()]  # given up while others ran
        if not waiting:
            return
        if waiting[0].image is not None:
            await self._paint(waiting)
            return
        policy, first = waiting[0].policy, waiting[0].params
        counts = [w.params.n for w in waiting]
        if len(set(counts)) == 1:  # the engine samples n per prompt itself
            owner, n = list(range(len(waiting))), counts[0]
        else:  # mixed n: one prompt copy per sample, still one call
            owner, n = [j for j, k in enumerate(counts) for _ in range(k)], 1
        budgets = [waiting[j].request.budget(waiting[j].params) for j in owner]
        requests = [
            dataclasses.replace(waiting[j].request, max_new_tokens=b)
            for j, b in zip(owner, budgets, strict=True)
        ]
        if n == 1 and len(owner) > len(waiting):  # mixed n: copy c streams as sample c
            for c, r in enumerate(requests):
                if r.on_token is not None:
                    r.on_token = _as_sample(r.on_token, owner[:c].count(owner[c]))
        params = dataclasses.replace(
            first,
            n=n,
            max_new_tokens=max(budgets),
            top_logprobs=max(w.params.top_logprobs for w in waiting),  # the gateway's
            stop=list(first.stop),
            stop_token_ids=list(first.stop_token_ids),
        )
        policies = list(dict.fromkeys(w.policy for w in waiting))
        self.sizes.append(len(waiting))
        self.calls.update(policies)
        self.mixed += len(policies) > 1

        def call() -> list[list[Completion]]:
            generate: Callable[[list[Request], SamplingParams], list[Completion]]
            if len(policies) == 1:
                generate = self.engines[policy].generate
            else:  # one call over several engines' requests; `outs` in `requests` order
                generate = self._mixed_generate(policies, [waiting[j].policy for j in owner])
            outs = generate(requests, params)
            if len(outs) != len(requests) * n:
                raise RuntimeError(
                    f"the engine of policy {policy!r} returned {len(outs)} completions for "
                    f"{len(requests)} prompts x n={n}"
                )
            got: list[list[Completion]] = [[] for _ in waiting]
            for c in outs:
                got[owner[c.prompt_index]].append(c)
            return got

        await self._answer(waiting, call)

    async def _paint(self, waiting: list[_Waiting]) -> None:
        """One ``paint`` call for a painter's waiting image requests."""
        policy = waiting[0].policy
        requests = [w.image for w in waiting if w.image is not None]
        self.sizes.append(len(waiting))
        self.calls.update([policy])
        paint = cast(PaintsImages, self.engines[policy]).paint  # its caps say paints_images

        def call() -> list[list[Painting]]:
            outs = paint(requests)
            if len(outs) != len(requests):
                raise RuntimeError(
                    f"the engine of policy {policy!r} painted for {len(outs)} of "
                    f"{len(requests)} image requests"
                )
            return outs

        await self._answer(waiting, call)

    async def _answer(self, waiting: list[_Waiting], call: Callable[[], Sequence[Any]]) -> None:
        """Answer the ``waiting`` requests with ``call()``'s answers (one each, in order):
        the engine call, timed into ``generate_s``, on a worker thread when ``in_thread``.
        If it raises, every waiting request learns the error; none hangs."""
        t0 = time.perf_counter()
        try:
            answers = await asyncio.to_thread(call) if self.in_thread else call()
        except Exception as e:
            self._failure = self._failure or e
            for w in waiting:
                if not w.future.done():
                    w.future.set_exception(e)
            return
        finally:
            took = time.perf_counter() - t0
            self.generate_s += took
            self.longest_call_s = max(self.longest_call_s, took)
        for w, answer in zip(waiting, answers, strict=True):
            if not w.future.done():  # an episode that already failed may have cancelled it
                w.future.set_result(answer)

    def _mixed_generate(
        self, policies: list[str], owners: list[str]
    ) -> Callable[[list[Request], SamplingParams], list[Completion]]:
        """``generate`` over requests of several policies (``owners[i]``: request i's), as
        one ``generate_mixed`` on the first policy's engine, its answer in request order."""

        def generate(requests: list[Request], params: SamplingParams) -> list[Completion]:
            index = {p: [i for i, o in enumerate(owners) if o == p] for p in policies}
            calls = [(self.engines[p], [requests[i] for i in index[p]]) for p in policies]
            engine = self.engines[policies[0]]
            assert isinstance(engine, MixedCalls)  # how the group was formed
            answers = engine.generate_mixed(calls, params)
            outs: list[Completion] = []
            for p, got in zip(policies, answers, strict=True):
                if len(got) != len(index[p]) * params.n:
                    raise RuntimeError(
                        f"the mixed call of policies {policies} returned {len(got)} "
                        f"completions of policy {p!r} for {len(index[p])} prompts x "
                        f"n={params.n}"
                    )
                outs += [dataclasses.replace(c, prompt_index=index[p][c.prompt_index]) for c in got]
            return outs

        return generate
