"""The runtime that batches every agent's generations per policy.

All episodes of a step run concurrently on one event loop. ``act()`` does not generate: it
queues a :class:`~polyrl.marl.api.Request` and waits. When every episode is blocked, the
runtime flushes the queue with *one* ``engine.generate`` per policy (per distinct sampling
setting), resolves the waiting acts, and repeats. Two agents on one policy share its call.

A policy that takes image turns (:class:`~polyrl.core.interfaces.TakesImageTurns`) gets
acts with images through the same call: each act's images are encoded once, their ids
spliced in place of the placeholders, and the batch sampled with ``generate_vl``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections import Counter, defaultdict
from typing import Any

from polyrl.core.engine import SamplingParams
from polyrl.core.interfaces import splice_images
from polyrl.marl.api import AgentInfo, Request

# ----------------------------------------------------------------------------- runtime


class Runtime:
    """Queues act() requests of all episodes; flushes one generate per policy per round."""

    def __init__(self, engines: dict[str, Any], params: SamplingParams, key: str = "marl") -> None:
        self.engines = engines
        self.params = params
        self.key = key  # names the joined images: f"{key}:{act}" (unique within a record)
        self.serial = 0
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
        visions: list[Any] = [None] * len(reqs)
        failed = set()
        for j, r in enumerate(reqs):
            if r.images:
                try:
                    ids[j], visions[j] = self._images(policy, r, list(ids[j]))
                except Exception as e:  # this act's episode records it (and is counted)
                    failed.add(j)
                    if not r.future.done():
                        r.future.set_exception(e)
        if failed:
            keep = [j for j in range(len(reqs)) if j not in failed]
            reqs, ids, visions = (
                [reqs[j] for j in keep],
                [ids[j] for j in keep],
                [visions[j] for j in keep],
            )
            if not reqs:
                return
        counts = [r.params.n for r in reqs]
        if len(set(counts)) == 1:  # the engine samples n per prompt itself
            prompts, owner = ids, list(range(len(reqs)))
            params = dataclasses.replace(reqs[0].params, n=counts[0])
        else:  # mixed n: one prompt copy per sample, still one call
            owner = [j for j, k in enumerate(counts) for _ in range(k)]
            prompts = [ids[j] for j in owner]
            params = dataclasses.replace(reqs[0].params, n=1)
        engine = self.engines[policy]
        t0 = time.perf_counter()
        if any(v is not None for v in visions):
            completions = engine.generate_vl(prompts, [visions[j] for j in owner], params)
        else:
            completions = engine.generate(prompts, params)
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
                r.future.set_result((list(ids[j]), out[j], visions[j]))

    def _images(self, policy: str, r: Request, ids: list[int]) -> tuple[list[int], Any]:
        """The act's prompt ids with each image placeholder replaced by the image's tokens
        (encoded once, by the policy), and its images joined for the engine and record."""
        vision = r.agent.vision
        if vision is None:  # AgentInfo.render refuses images for such a policy
            raise TypeError(f"agent {r.agent.name!r}: policy {policy!r} cannot take images")
        if not hasattr(self.engines[policy], "generate_vl"):
            raise TypeError(
                f"agent {r.agent.name!r}: the engine of policy {policy!r} "
                f"({type(self.engines[policy]).__name__}) has no generate_vl, so it cannot "
                f"take images; set policies.{policy}.engine.name=hf_vl"
            )
        expansions, handle = vision.encode_images(r.images)
        where = f"agent {r.agent.name!r} (policy {policy!r})"
        out, starts = splice_images(ids, vision.image_token_id, expansions, where)
        self.serial += 1
        return out, vision.join_images([handle], starts, f"{self.key}:{self.serial}")
