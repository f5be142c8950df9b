"""Partial rollouts: a refresh that switches an engine's weights at a known decoding step,
and an independent reference for what such a response's log-probs must be: computed step
by step with the model's own cache, token ``t``'s distribution from the forward pass that
produced its logits (the prompt pass for ``t = 0``, the pass over token ``t - 1`` otherwise),
made with the weights of ``versions[t]`` on the KV cache the earlier passes left."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from transformers import DynamicCache

SWITCH = 3  # tokens 0..2 come from the old weights, the rest from the new


def switching_refresh(model: torch.nn.Module, new_state: dict, calls: list[int]):
    """A refresh that loads ``new_state`` at its (SWITCH + 1)-th call: the version the next
    token is sampled with, as the async producer's refresh returns it."""

    def refresh() -> int:
        calls.append(1)
        if len(calls) == SWITCH + 1:
            model.load_state_dict(new_state)
        return int(len(calls) > SWITCH)

    return refresh


@torch.no_grad()
def mixed_logprobs(
    model: torch.nn.Module,
    states: dict[int, dict[str, torch.Tensor]],
    prompt: list[int],
    tokens: list[int],
    versions: list[int],
    temperature: float = 1.0,
) -> torch.Tensor:
    """Log-probs of ``tokens`` after ``prompt``, token ``t`` under ``states[versions[t]]``
    (float32, the temperature-scaled distribution). Leaves ``model`` with the last state."""
    cache = DynamicCache()
    out: list[torch.Tensor] = []
    inputs = torch.tensor([prompt])
    for t, (tok, v) in enumerate(zip(tokens, versions, strict=True)):
        model.load_state_dict(states[v])
        pos = torch.arange(len(prompt) + t - inputs.shape[1], len(prompt) + t)[None]
        logits = model(input_ids=inputs, position_ids=pos, past_key_values=cache, use_cache=True)
        row = torch.log_softmax(logits.logits[0, -1].float() / temperature, -1)
        out.append(row[tok])
        inputs = torch.tensor([[tok]])
    return torch.stack(out)


def moved(state: dict[str, torch.Tensor], scale: float, seed: int) -> dict[str, torch.Tensor]:
    """``state`` with every floating tensor moved by Gaussian noise (a big update)."""
    gen = torch.Generator().manual_seed(seed)
    return {
        k: v + scale * torch.randn(v.shape, generator=gen) if v.is_floating_point() else v
        for k, v in state.items()
    }


def check_partial_run(run_dir: Path, steps: int, every: bool = True) -> dict[int, dict]:
    """A ``rollout.partial`` run's per-step async metrics, checked: every batch within the
    staleness bound of 1, no group dropped, and rows that span a publish in every batch
    after the first (the crawling engine waits for one mid-call), or in at least one of
    them (``every=False``: where the next batch's first engine call may come after the
    trainer published, e.g. agents in worker processes on a loaded machine, the crawler
    waits in vain for a publish that needs that very batch)."""
    rows = [json.loads(x) for x in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]
    by_step = {r["step"]: r for r in rows if "async/staleness_max" in r}
    assert sorted(by_step) == list(range(1, steps + 1))
    for r in by_step.values():
        assert r["async/staleness_max"] <= 1
        assert r["async/dropped_groups"] == 0
    mixed = [by_step[s]["async/mixed_version_rows"] > 0 for s in range(2, steps + 1)]
    assert all(mixed) if every else any(mixed), mixed
    return by_step
