"""The runtime that batches every agent's generations per policy.

All episodes of a step run concurrently on one event loop. ``act()`` does not generate: it
queues a :class:`~polyrl.marl.api.Request` and waits. When every episode is blocked, the
runtime flushes the queue with *one* ``engine.generate`` per policy (per distinct sampling
setting), resolves the waiting acts, and repeats. Two agents on one policy share its call.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections import Counter, defaultdict
from typing import Any

from polyrl.core.engine import SamplingParams
from polyrl.marl.api import AgentInfo, Request

# ----------------------------------------------------------------------------- runtime


class Runtime:
    """Queues act() requests of all episodes; flushes one generate per policy per round."""

    def __init__(self, engines: dict[str, Any], params: SamplingParams) -> None:
        self.engines = engines
        self.params = params
        self.pending: list[Request] = []
        self.calls: Counter[str] = Counter()
        self.rounds = 0
        self.acts = 0
        self.done = 0
        self.generate_s = 0.0
        self._wake: asyncio.Future | None = None

    def params_for(
        self, agent: AgentInfo, n: int, max_new_tokens: int | None, temperature: float | None
    ) -> SamplingParams:
        p = self.params
        temp = p.temperature
        if p.temperature > 0:  # a greedy evaluation stays greedy
            temp = (
                temperature
                if temperature is not None
                else (agent.temperature if agent.temperature is not None else p.temperature)
            )
        return dataclasses.replace(
            p,
            n=n,
            temperature=temp,
            stop=list(p.stop),
            stop_token_ids=list(p.stop_token_ids),
            max_new_tokens=max_new_tokens or agent.max_new_tokens or p.max_new_tokens,
        )

    def submit(self, request: Request) -> None:
        self.pending.append(request)
        self.acts += 1
        if self._wake is not None and not self._wake.done():
            self._wake.set_result(None)

    async def _settle(self) -> None:
        """Yield until nothing moves any more: every live episode waits on an act()."""
        stable, last = 0, None
        while stable < 3:
            await asyncio.sleep(0)
            sig = (len(self.pending), self.acts, self.done, len(asyncio.all_tasks()))
            stable = stable + 1 if sig == last else 0
            last = sig

    async def drive(self, tasks: list[asyncio.Task]) -> None:
        try:
            while True:
                await self._settle()
                if self.pending:
                    self.flush()
                    continue
                live = [t for t in tasks if not t.done()]
                if not live:
                    return
                # Episodes wait on something else (an async tool, a sandbox): sleep until a
                # new request arrives or an episode ends.
                self._wake = asyncio.get_running_loop().create_future()
                await asyncio.wait([self._wake, *live], return_when=asyncio.FIRST_COMPLETED)
                self._wake = None
        finally:
            for t in tasks:
                if not t.done():
                    t.cancel()

    def flush(self) -> None:
        """One engine.generate per (policy, sampling setting) for everything queued."""
        requests, self.pending = self.pending, []
        self.rounds += 1
        groups: dict[tuple, list[Request]] = defaultdict(list)
        for r in requests:
            p = r.params
            groups[
                (
                    r.agent.policy,
                    p.temperature,
                    p.top_p,
                    p.max_new_tokens,
                    tuple(p.stop),
                    tuple(p.stop_token_ids),
                )
            ].append(r)
        for (policy, *_), reqs in groups.items():
            self._generate(policy, reqs)

    def _generate(self, policy: str, reqs: list[Request]) -> None:
        tokenizer = reqs[0].agent.tokenizer
        special = not getattr(tokenizer, "chat_template", None)
        ids = tokenizer([r.text for r in reqs], add_special_tokens=special)["input_ids"]
        counts = [r.params.n for r in reqs]
        if len(set(counts)) == 1:  # the engine samples n per prompt itself
            prompts, owner = ids, list(range(len(reqs)))
            params = dataclasses.replace(reqs[0].params, n=counts[0])
        else:  # mixed n: one prompt copy per sample, still one call
            owner = [j for j, k in enumerate(counts) for _ in range(k)]
            prompts = [ids[j] for j in owner]
            params = dataclasses.replace(reqs[0].params, n=1)
        t0 = time.perf_counter()
        completions = self.engines[policy].generate(prompts, params)
        self.generate_s += time.perf_counter() - t0
        self.calls[policy] += 1
        out: list[list] = [[] for _ in reqs]
        for c in completions:
            out[owner[c.prompt_index]].append(c)
        for j, r in enumerate(reqs):
            if len(out[j]) != r.params.n:
                raise RuntimeError(
                    f"engine of policy {policy!r} returned {len(out[j])} "
                    f"completions for a prompt that asked for {r.params.n}"
                )
            if not r.future.done():  # an episode that already failed may have cancelled it
                r.future.set_result((list(ids[j]), out[j]))
