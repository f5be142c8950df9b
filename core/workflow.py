"""Workflows turn a batch of prompts into a rollout record.

A workflow is built once per run from the run context and called every step. The core
ships the single-turn workflow; plugins register multi-turn, multi-agent, vision and
diffusion workflows in the same registry.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from dataclasses import dataclass, field
from typing import Any

from tensordict import TensorDict

from polyrl.core.data import PromptItem
from polyrl.core.engine import SamplingParams
from polyrl.core.record import text_record
from polyrl.core.registry import WORKFLOWS


@dataclass
class Context:
    """What a workflow may use: the recipe, policies and their engines."""

    cfg: Any
    policies: dict[str, Any]
    engines: dict[str, Any]
    extras: dict[str, Any] = field(default_factory=dict)

    def sampling(
        self,
        *,
        n: int | None = None,
        temperature: float | None = None,
        max_new_tokens: int | None = None,
    ) -> SamplingParams:
        r = self.cfg.rollout
        return SamplingParams(
            n=r.n if n is None else n,
            temperature=r.temperature if temperature is None else temperature,
            top_p=r.top_p,
            stop=list(r.stop),
            max_new_tokens=r.max_new_tokens if max_new_tokens is None else max_new_tokens,
        )


class SingleTurn:
    """One policy answers each prompt ``n`` times; one row per answer."""

    token_versions = True  # interfaces.RecordsTokenVersions

    def __init__(self, ctx: Context, policy: str | None = None) -> None:
        name = policy or next(iter(ctx.policies))
        if name not in ctx.policies:
            raise KeyError(f"single_turn: unknown policy {name!r}; have {sorted(ctx.policies)}")
        self.name, self.engine = name, ctx.engines[name]
        self.tokenizer = ctx.policies[name].tokenizer

    def rollout(self, items: list[PromptItem], params: SamplingParams) -> TensorDict:
        outs = self.engine.generate([it.prompt_ids for it in items], params)
        rows = [items[o.prompt_index] for o in outs]
        return text_record(
            prompt_ids=[it.prompt_ids for it in rows],
            response_ids=[o.token_ids for o in outs],
            rollout_logprobs=[o.logprobs for o in outs],
            policy=[self.name] * len(outs),
            uid=[it.uid for it in rows],
            pad_id=self.tokenizer.pad_token_id,
            prompt_text=[it.prompt_text for it in rows],
            response_text=[o.text for o in outs],
            meta=[{"answer": it.answer, "row": it.row} for it in rows],
            truncated=[o.finish_reason == "length" for o in outs],
            token_version=[o.versions for o in outs],
        )


WORKFLOWS.register("single_turn", SingleTurn)


def run_sync(coro: Any) -> Any:
    """Run a coroutine to completion from sync code, also from inside a running event loop
    (a notebook, an async caller): async workflows keep a sync ``rollout``."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return _run(coro)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(_run, coro).result()


def _run(coro: Any) -> Any:
    """``asyncio.run`` without its SIGINT handler (Ctrl-C raises KeyboardInterrupt as in
    sync code). Python 3.11's runner, restoring the previous handler, has ``signal`` look
    the old handler up in an enum, and the failed lookup formats its repr: the finished
    main task with its result, i.e. the whole rollout record (90 ms for a marl record)."""
    loop = asyncio.new_event_loop()
    try:
        return loop.run_until_complete(coro)
    finally:
        try:
            pending = asyncio.all_tasks(loop)
            for task in pending:
                task.cancel()
            if pending:
                loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
            loop.run_until_complete(loop.shutdown_asyncgens())
            loop.run_until_complete(loop.shutdown_default_executor())
        finally:
            loop.close()
