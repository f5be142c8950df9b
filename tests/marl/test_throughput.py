"""tokens/s and MFU of the signaling demo: each agent's policy, the step's total, and no
figures for the joint-action rows (their text is the agents', sampled once)."""

from __future__ import annotations

import json

import pytest

from polyrl.core.loop import train
from polyrl.core.throughput import device_peak


def test_a_signaling_runs_metrics_hold_each_agents_tokens_and_the_steps_mfu(marl_config):
    run = train(marl_config("eval.every=0", "train.steps=1", "run.export=false"))
    rows = [json.loads(x) for x in (run.path / "metrics.jsonl").read_text().splitlines()]
    (step,) = [r for r in rows if "time/step_s" in r]
    perf = {k: v for k, v in step.items() if k.startswith("perf/")}
    assert not [k for k in perf if "<joint>" in k]
    gen = 0.0
    for name in ("speaker", "listener"):
        assert perf[f"perf/{name}/gen_tokens"] > 0 and perf[f"perf/{name}/train_tokens"] > 0
        assert 0 < perf[f"perf/{name}/mfu"] < 1
        gen += perf[f"perf/{name}/gen_tokens"]
    assert perf["perf/gen_tokens_per_s"] == pytest.approx(gen / step["time/step_s"])
    # the step's FLOPs (both policies, generation and training) over its time and the peak
    peak = device_peak("cpu")[0]
    assert perf["perf/mfu"] == pytest.approx(
        perf["perf/tflops"] * 1e12 / (step["time/step_s"] * peak)
    )
