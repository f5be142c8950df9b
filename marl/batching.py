"""The marl runtime: every agent's act() becomes a request of the core's episode runtime.

All episodes of a step run concurrently on one event loop. ``act()`` does not generate: it
renders and encodes its prompt, hands a :class:`~polyrl.core.rollout.engine.Request` to the core
:class:`~polyrl.core.rollout.batching.Batcher` and waits. When every episode is blocked, the
batcher flushes the queue with *one* engine call per policy (per distinct sampling
setting), resolves the waiting acts, and repeats. Two agents on one policy share its call;
``lora_agent`` policies on one base share one call too (``MixedCalls`` engines).

A policy that takes image turns (:class:`~polyrl.core.interfaces.TakesImageTurns`) gets
acts with images through the same call: each act's images are encoded once, their ids
spliced in place of the placeholders, and the joined images sent as the request's
``vision``.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

from polyrl.core.interfaces import Engine, splice_images, takes_images
from polyrl.core.rollout.batching import Batcher
from polyrl.core.rollout.engine import Completion, Request, SamplingParams
from polyrl.core.rollout.paint import ImageRequest, Painting
from polyrl.marl.api import AgentInfo


class Runtime:
    """Agents' acts as requests of one core :class:`Batcher` over the run's engines."""

    def __init__(
        self, engines: Mapping[str, Engine], params: SamplingParams, key: str = "marl"
    ) -> None:
        self.engines = engines
        self.params = params
        self.key = key  # names the joined images: f"{key}:{act}" (unique within a record)
        self.batcher = Batcher(engines)
        self.serial = 0
        self.acts = 0

    @property
    def rounds(self) -> int:
        return self.batcher.flushes

    @property
    def calls(self) -> Mapping[str, int]:
        return self.batcher.calls

    @property
    def generate_s(self) -> float:
        return self.batcher.generate_s

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

    async def act(
        self, agent: AgentInfo, text: str, images: Sequence[Any], params: SamplingParams
    ) -> tuple[list[int], list[Completion], Any]:
        """The act's prompt ids, its ``params.n`` completions and its joined images."""
        self.acts += 1
        tokenizer = agent.tokenizer
        special = not getattr(tokenizer, "chat_template", None)
        ids = list(tokenizer(text, add_special_tokens=special)["input_ids"])
        vision = None
        if images:
            ids, vision = self._images(agent, list(images), ids)
        request = Request(ids, vision=vision)
        return ids, await self.batcher.generate(agent.policy, request, params), vision

    async def paint(self, agent: AgentInfo, text: str, n: int, seed: int | None) -> list[Painting]:
        """``n`` paintings of ``text`` by the agent's painter: an image request of the
        core's runtime, served with every image request of that policy in its flush
        (evaluation rollouts, temperature 0, paint deterministically)."""
        self.acts += 1
        request = ImageRequest(text, n=n, seed=seed, deterministic=self.params.temperature == 0)
        return await self.batcher.paint(agent.policy, request)

    async def drive(self, tasks: Sequence[asyncio.Task]) -> None:
        await self.batcher.drive(tasks)

    def _images(self, agent: AgentInfo, images: list, ids: list[int]) -> tuple[list[int], Any]:
        """The act's prompt ids with each image placeholder replaced by the image's tokens
        (encoded once, by the policy), and its images joined for the engine and record."""
        policy, vision = agent.policy, agent.vision
        if vision is None:  # AgentInfo.render refuses images for such a policy
            raise TypeError(f"agent {agent.name!r}: policy {policy!r} cannot take images")
        if not takes_images(self.engines[policy]):
            raise TypeError(
                f"agent {agent.name!r}: the engine of policy {policy!r} "
                f"({type(self.engines[policy]).__name__}) takes no images; "
                f"set policies.{policy}.engine.name=hf_vl"
            )
        expansions, handle = vision.encode_images(images)
        where = f"agent {agent.name!r} (policy {policy!r})"
        out, starts = splice_images(ids, vision.image_token_id, expansions, where)
        self.serial += 1
        return out, vision.join_images([handle], starts, f"{self.key}:{self.serial}")
