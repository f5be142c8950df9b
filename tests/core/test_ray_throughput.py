"""tokens/s and MFU of a policy trained on a Ray worker group: the driver reads the
model's config from its folder, so the FLOP count is the local one."""

from __future__ import annotations

import json

import pytest

from polyrl.core.loop import train
from polyrl.core.observe.throughput import device_peak


@pytest.mark.slow
def test_a_ray_runs_metrics_hold_mfu(ray_cluster, make_config):
    cfg = make_config(
        "distributed.backend=ray",
        "distributed.args={workers_per_policy: 1}",
        "train.steps=1",
        "run.export=false",
        "eval.data.limit=8",
    )
    run = train(cfg)  # before: no MFU, the model being on the workers
    rows = [json.loads(x) for x in (run.path / "metrics.jsonl").read_text().splitlines()]
    (step,) = [r for r in rows if "time/step_s" in r]
    assert step["perf/main/train_tokens"] > 0 and 0 < step["perf/main/mfu"] < 1
    peak = device_peak("cpu")[0]
    assert step["perf/mfu"] == pytest.approx(
        step["perf/tflops"] * 1e12 / (step["time/step_s"] * peak)
    )
