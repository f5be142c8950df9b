"""A gateway run with run.prometheus_port: its agents' requests reach the endpoint's
latency histogram while the run trains, and the run's metrics hold tokens/s and MFU."""

from __future__ import annotations

import json

import pytest

from polyrl.core.config import load
from polyrl.core.recipe import Config
from tests.helpers.gateway import GRID_AGENT, gateway_recipe, small_grid
from tests.helpers.prometheus import most, train_scraping

pytest.importorskip("prometheus_client")


def test_gateway_requests_are_served_live(grid_model_dir, tmp_path, capsys):
    cfg = load(
        Config,
        gateway_recipe(tmp_path, GRID_AGENT),
        [
            f"run.dir={tmp_path}/run",
            "run.progress=false",
            "run.tensorboard=false",
            "run.export=false",
            "run.prometheus_port=0",
            *small_grid(tmp_path, grid_model_dir),
            "rollout.n=4",
            "rollout.prompts_per_step=4",
            "train.steps=2",
            "eval.every=0",
        ],
    )
    run, _, scrapes = train_scraping(cfg, capsys)
    # each episode asks twice: a step's 4 prompts x 4 samples make 32 requests, and the
    # run made two steps' (the endpoint closes only after the final evaluation)
    assert most(scrapes, "polyrl_gateway_request_seconds_count") >= 64
    assert most(scrapes, "polyrl_gateway_request_seconds_sum") > 0
    assert not [
        k for got in scrapes for k in got if k[0].startswith("polyrl_gateway_request_errors")
    ]
    rows = [json.loads(x) for x in (run.path / "metrics.jsonl").read_text().splitlines()]
    for step in [r for r in rows if "time/step_s" in r]:
        assert step["perf/main/gen_tokens"] > 0 and 0 < step["perf/main/mfu"] < 1
        assert 0 < step["perf/mfu"] < 1
