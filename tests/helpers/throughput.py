"""One logged step's tokens/s and MFU recomputed by hand from what the run wrote: its
``metrics.jsonl`` line and every row's token counts in ``samples/`` (run with
``run.samples_per_step`` above the step's rows)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from polyrl.core.observe.throughput import device_peak

# what the hand count assumes of the run: one epoch, no old or reference pass, every valid
# row trained (a zero advantage leaves none out)
ONE_PASS = (
    "algorithm.ppo_epochs=1",
    "algorithm.minibatches=1",
    "algorithm.kl_coef=0",
    "algorithm.skip_zero_advantage=false",
    "run.samples_per_step=100000",
)


@dataclass(frozen=True)
class Cost:
    """A language model's cost by hand: the weights a token multiplies (every ``Linear``
    of the model, LM head included), its layers and its query heads x head size."""

    weights: int
    layers: int
    width: int
    extra: float = 0.0  # FLOPs each row adds per forward (a vision tower's patches)

    def forward(self, length: int) -> float:
        # 2 FLOPs per weight per token, and at position t each layer's scores and weighted
        # sum cost 2 * t * width each: sum over t = 1..L
        attention = sum(4 * t * self.width for t in range(1, length + 1))
        return 2.0 * self.weights * length + self.layers * attention + self.extra


def linear_weights(module: torch.nn.Module) -> int:
    """The weights of every ``nn.Linear`` in ``module`` (not the embedding lookup)."""
    return sum(m.weight.numel() for m in module.modules() if isinstance(m, torch.nn.Linear))


def logged_step(run_dir: Path, step: int = 1) -> tuple[dict, list[dict]]:
    """The step's metrics line and the transcripts of its rows."""
    lines = (Path(run_dir) / "metrics.jsonl").read_text().splitlines()
    (row,) = [r for r in map(json.loads, lines) if r["step"] == step and "time/step_s" in r]
    samples = Path(run_dir) / "samples" / f"train_step_{step:06d}.jsonl"
    return row, [json.loads(x) for x in samples.read_text().splitlines()]


def check_by_hand(run_dir: Path, costs: dict[str, Cost], step: int = 1) -> dict:
    """Assert the step's ``perf/*`` figures equal the hand count (``costs``: each sampling
    policy's); return the metrics line."""
    m, rows = logged_step(run_dir, step)
    step_s, peak = m["time/step_s"], device_peak("cpu")[0]
    total_flops = 0.0
    gen_all = 0
    for name, cost in costs.items():
        mine = [r for r in rows if r["policy"] == name]
        assert mine, f"no row of {name}"
        gen = sum(r["generated_tokens"] for r in mine)
        assert m[f"perf/{name}/gen_tokens"] == gen
        assert m[f"perf/{name}/gen_tokens_per_s"] == pytest.approx(gen / step_s)
        gen_all += gen
        lengths = [r["prompt_tokens"] + r["response_tokens"] for r in mine]
        total_flops += sum(cost.forward(n) for n in lengths)  # sampling: one forward a row
        if f"perf/{name}/train_tokens" not in m:  # frozen: not trained
            continue
        trained = [n for n, r in zip(lengths, mine, strict=True) if r["valid"]]
        assert m[f"perf/{name}/train_tokens"] == sum(trained)
        update_s = m[f"perf/{name}/train_tokens"] / m[f"perf/{name}/train_tokens_per_s"]
        train_flops = 3 * sum(cost.forward(n) for n in trained)  # forward + backward
        total_flops += train_flops
        assert m[f"perf/{name}/mfu"] == pytest.approx(train_flops / (update_s * peak))
    assert m["perf/gen_tokens_per_s"] == pytest.approx(gen_all / step_s)
    assert m["perf/tflops"] == pytest.approx(total_flops / 1e12)
    assert m["perf/mfu"] == pytest.approx(total_flops / (step_s * peak))
    assert 0 < m["perf/mfu"] < 1
    return m
