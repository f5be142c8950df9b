"""Workflows turn a batch of prompts into a rollout record.

A workflow is built once per run from the run context and called every step. The core
ships the single-turn workflow; plugins register multi-turn, multi-agent, vision and
diffusion workflows in the same registry.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tensordict import TensorDict

from polyrl.core.interfaces import Engine, Phase, Policy
from polyrl.core.record import Row, build_rows
from polyrl.core.registry import WORKFLOWS
from polyrl.core.rollout.data import PromptItem
from polyrl.core.rollout.engine import Completion, SamplingParams


@dataclass
class Context:
    """What a workflow may use: the recipe, policies and their engines, and the run
    directory (None outside a run) for what a workflow draws or writes beside the metrics."""

    cfg: Any
    policies: dict[str, Policy]
    engines: dict[str, Engine]
    run_dir: Path | None = None

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

    def __init__(self, ctx: Context, policy: str | None = None) -> None:
        name = policy or next(iter(ctx.policies))
        if name not in ctx.policies:
            raise KeyError(f"single_turn: unknown policy {name!r}; have {sorted(ctx.policies)}")
        self.name, self.engine = name, ctx.engines[name]
        self.tokenizer = ctx.policies[name].tokenizer

    def rollout(
        self, items: list[PromptItem], params: SamplingParams, phase: Phase = "train"
    ) -> TensorDict:
        outs = self.engine.generate([it.prompt_ids for it in items], params)
        rows = completion_rows(self.name, items, outs)
        for row, out in zip(rows, outs, strict=True):
            row.meta = {
                "answer": items[out.prompt_index].answer,
                "row": items[out.prompt_index].row,
            }
        return build_rows(rows, self.tokenizer.pad_token_id)


def completion_rows(
    policy: str, items: Sequence[PromptItem], outs: Sequence[Completion]
) -> list[Row]:
    """One record row per completion of a single-turn call: the completion's prompt and
    sampled token segments (meta is the caller's)."""
    rows = []
    for o in outs:
        it = items[o.prompt_index]
        rows.append(
            Row(
                o.prompt,
                o.tokens,
                policy,
                it.uid,
                prompt_text=it.prompt_text,
                response_text=o.text,
                truncated=o.finish_reason == "length",
            )
        )
    return rows


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
