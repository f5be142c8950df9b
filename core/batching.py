"""Per-episode generation: concurrent episodes ask for one completion each, and the engine
serves whatever is waiting in one ``generate`` call (a *flush*).

The engine runs on a worker thread, so while it generates the event loop keeps stepping
the other episodes' environments (async tools, sandboxes, thread-pool steps); what they
ask for meanwhile waits for the next flush. A flush happens when the engine is idle, at
least one request waits, and the loop has settled (every episode that can still submit
before blocking on something else has done so). With environments that step inline, that
is exactly the lock-step round: same prompts, same order (requests sorted by key), same
calls. With environments that take time, an episode goes back to the engine as soon as its
own step is done, without waiting for the slowest step of a round, and the batches then
depend on timing.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from polyrl.core.engine import Completion, SamplingParams


@dataclasses.dataclass
class _Request:
    key: Any
    prompt: list[int]
    max_new_tokens: int
    future: asyncio.Future
    vision: Any = None  # the prompt's joined images (TakesImageTurns); None: text only


class FlushBatcher:
    """Queues single-completion requests of concurrent episodes; one engine call per flush.

    ``params`` is the call's sampling setting; each request may ask for fewer new tokens
    (the call asks for the largest and each completion is cut to its own request's budget
    by the caller). ``on_flush(prompts)`` runs before each call (counting, logging). A
    flush with any request carrying images calls the engine's ``generate_vl`` for all.
    """

    def __init__(
        self,
        engine: Any,
        params: SamplingParams,
        *,
        on_flush: Callable[[list[list[int]]], None] | None = None,
        in_thread: bool = True,
    ) -> None:
        self.engine, self.params = engine, params
        self.on_flush = on_flush
        self.in_thread = in_thread
        self.pending: list[_Request] = []
        self.sizes: list[int] = []  # requests per flush
        self._wake: asyncio.Future | None = None
        self._submitted = 0

    async def generate(
        self, key: Any, prompt: Sequence[int], max_new_tokens: int, vision: Any = None
    ) -> Completion:
        """One completion for ``prompt`` (with its images' ``vision`` handle, if any);
        resolved by the next flush that takes it."""
        fut = asyncio.get_running_loop().create_future()
        self.pending.append(_Request(key, list(prompt), max_new_tokens, fut, vision))
        self._submitted += 1
        if self._wake is not None and not self._wake.done():
            self._wake.set_result(None)
        return await fut

    async def _settle(self, tasks: list[asyncio.Task]) -> None:
        """Yield until nothing moves: every live episode waits on the engine or on
        something slower than a few loop turns (a timer, a thread, a subprocess)."""
        stable, last = 0, None
        while stable < 3:
            await asyncio.sleep(0)
            sig = (self._submitted, sum(t.done() for t in tasks))
            stable = stable + 1 if sig == last else 0
            last = sig

    async def drive(self, episodes: Sequence[Awaitable[None]]) -> None:
        """Run ``episodes`` to the end, flushing their requests into the engine."""
        tasks = [asyncio.ensure_future(e) for e in episodes]
        try:
            while True:
                await self._settle(tasks)
                for t in tasks:
                    if t.done() and not t.cancelled() and t.exception() is not None:
                        raise t.exception()
                if self.pending:
                    await self._flush()
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

    async def _flush(self) -> None:
        batch = sorted(self.pending, key=lambda r: r.key)
        self.pending = []
        self.sizes.append(len(batch))
        prompts = [r.prompt for r in batch]
        params = dataclasses.replace(
            self.params,
            n=1,
            max_new_tokens=max(r.max_new_tokens for r in batch),
            stop=list(self.params.stop),
            stop_token_ids=list(self.params.stop_token_ids),
        )
        if self.on_flush is not None:
            self.on_flush(prompts)
        visions = [r.vision for r in batch]
        if any(v is not None for v in visions):
            call = functools.partial(self.engine.generate_vl, prompts, visions, params)
        else:
            call = functools.partial(self.engine.generate, prompts, params)
        outs = await asyncio.to_thread(call) if self.in_thread else call()
        if len(outs) != len(batch):
            raise RuntimeError(f"engine returned {len(outs)} completions for {len(batch)} prompts")
        for out in outs:
            req = batch[out.prompt_index]
            if not req.future.done():
                req.future.set_result(out)
