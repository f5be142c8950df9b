"""Async rollouts under Ray: the engine actor generates ahead on versions kept in the object
store while the FSDP group updates; the same schedule as local mode, and exact resume."""

from __future__ import annotations

import json

import pytest
import torch

from tests.helpers.rollouts import LOW_DIGIT
from tests.helpers.runs import assert_same_tensors, assert_weights_moved, load_part

RAY = ["distributed.backend=ray", "distributed.args={workers_per_policy: 2}"]
ASYNC = [
    "rollout.max_staleness=1",
    "train.steps=4",
    "run.save_every=1",
    "eval.every=0",
    f"reward.terms=[{LOW_DIGIT}]",  # rewards that differ within a group: the weights move
]


def _rows(run_dir) -> dict[int, dict]:
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r for r in rows if "main/loss" in r}


@pytest.mark.ray
@pytest.mark.slow
def test_ray_async_follows_the_local_schedule_and_resumes_exactly(
    ray_cluster, make_config, tmp_path, monkeypatch
):
    import polyrl.core.runner.session as session_mod
    from polyrl.core.distributed.ray_backend import ActorError
    from polyrl.core.loop import train
    from polyrl.core.runner.checkpoint import SavedDirectory, read_full

    local = _rows(train(make_config(*ASYNC, f"run.dir={tmp_path}/local")).path)
    run_a = train(make_config(*ASYNC, *RAY, f"run.dir={tmp_path}/a")).path
    a = _rows(run_a)
    assert sorted(a) == sorted(local) == [1, 2, 3, 4]
    for step in (1, 2):  # both batches from the initial weights, sampled alike
        assert a[step]["reward/mean"] == local[step]["reward/mean"], step
        assert a[step]["main/loss"] == pytest.approx(local[step]["main/loss"], abs=1e-5)
    for step in (2, 3, 4):  # steady state: every row exactly one version old, none dropped
        rows = a[step]["async/staleness_0"] + a[step]["async/staleness_1"]
        assert a[step]["async/staleness_1"] == rows > 0
        assert a[step]["async/dropped_groups"] == 0
        assert a[step]["async/staleness_1"] == local[step]["async/staleness_1"]

    # run B: a worker dies after step 2's checkpoint, with batches 3 in flight; --resume
    opened: list = []
    save = session_mod.Session.save

    def save_then_kill(self, step):
        save(self, step)
        opened.append(self)
        if step == 2:
            ray_cluster.kill(self.backend.groups["main"].workers[1])

    monkeypatch.setattr(session_mod.Session, "save", save_then_kill)
    try:
        with pytest.raises(ActorError, match="policy 'main' worker 1 died"):
            train(make_config(*ASYNC, *RAY, f"run.dir={tmp_path}/b"))
    finally:
        for s in opened[-1:]:
            s.rollouts.close()
            s.backend.shutdown()
    monkeypatch.undo()
    run_b = train(make_config(*ASYNC, *RAY, f"run.dir={tmp_path}/b", "run.resume=true")).path
    b = _rows(run_b)
    for step in (3, 4):
        assert b[step]["reward/mean"] == a[step]["reward/mean"], step
        assert b[step]["main/loss"] == a[step]["main/loss"], step
    ckpt = "checkpoints/step_000004"
    pa, pb = (read_full(SavedDirectory(r / ckpt / "policy_main")) for r in (run_a, run_b))
    # A's last step (after B's resume point, step 2) moved its weights: measured 5.0e-5
    step3 = read_full(SavedDirectory(run_a / "checkpoints/step_000003" / "policy_main"))
    assert_weights_moved(step3["weights"], pa["weights"], 5e-6)
    assert_same_tensors(pa["weights"], pb["weights"], "final weights")  # sharded (the default)
    for k, moments in pa["optimizer"]["state"].items():
        assert_same_tensors(moments, pb["optimizer"]["state"][k], f"optimizer {k}")
    ra, rb = load_part(run_a / ckpt, "rollouts"), load_part(run_b / ckpt, "rollouts")
    assert ra["before_next"]["sampler"] == rb["before_next"]["sampler"]
    assert torch.equal(
        ra["before_next"]["engines"]["main"]["inner"]["rng"],
        rb["before_next"]["engines"]["main"]["inner"]["rng"],
    )


@pytest.mark.ray
@pytest.mark.slow
def test_ray_partial_rollouts_take_newer_weights_mid_call(ray_cluster, make_config, tmp_path):
    """``rollout.partial`` under Ray: each publish is offered to the engine actor beside
    the call in flight (its "offers" concurrency group), which takes it at the next
    decoding step. The crawling engine (loaded on the actor by file path) holds every call
    after the first until the update lands, so batches 2.. mix two versions in a row,
    within the staleness bound, none dropped. A checkpoint every step (``ASYNC``) does not
    wait for the crawling batch in flight: it saves the state that batch captured."""
    from pathlib import Path

    from polyrl.core.loop import train

    crawling = Path(__file__).parents[1] / "helpers" / "crawling_engine.py"
    run = train(
        make_config(
            *ASYNC,
            *RAY,
            f"run.dir={tmp_path}/partial",
            "rollout.prompts_per_step=4",
            "rollout.partial=true",
            f"policies.main.engine.name={crawling}:CrawlingEngine",
        )
    ).path
    m = _rows(run)
    assert sorted(m) == [1, 2, 3, 4]
    for step in m:
        assert m[step]["async/staleness_max"] <= 1
        assert m[step]["async/dropped_groups"] == 0
    assert m[1]["async/mixed_version_rows"] == 0  # nothing is published before update 1
    assert all(m[s]["async/mixed_version_rows"] > 0 for s in (2, 3, 4)), m
