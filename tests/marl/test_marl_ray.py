"""marl under distributed.backend=ray: each agent's policy trains on its own FSDP worker
group and samples from its own engine actor; the centralized critic stays in the driver.
The same recipe gives the same first step as local mode."""

from __future__ import annotations

import json

import pytest

pytestmark = [pytest.mark.ray, pytest.mark.slow]


def first_step(run_dir) -> dict:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return next(r for r in rows if r.get("step") == 1 and "speaker/loss" in r)


def test_signaling_step_matches_local_mode(ray_cluster, marl_config, signaling_model_dir, tmp_path):
    from polyrl.core.loop import train

    common = [
        "rollout.args={agents: [{name: speaker, policy: speaker}, {name: listener, "
        f"policy: listener}}], tree: true, critic: {{model: {signaling_model_dir}}}}}",
        "train.steps=1",
        "eval.every=0",
        "algorithm.kl_coef=0.05",
        "algorithm.entropy_coef=0.01",  # the untrained pair never wins: a reward that
        # varies between samples (an upper-case letter anywhere) gives real advantages
        "reward.terms=[{name: regex_format, args: {pattern: '[A-Z]', mode: search}}]",
    ]
    local = first_step(train(marl_config(*common, f"run.dir={tmp_path}/local")).path)
    ray = first_step(
        train(
            marl_config(
                *common,
                f"run.dir={tmp_path}/ray",
                "distributed.backend=ray",
                "distributed.args={workers_per_policy: 2, policies: {listener: "
                "{workers_per_policy: 1}}}",
            )
        ).path
    )
    assert ray["reward/mean"] == local["reward/mean"]  # same samples from the engine actors
    assert 0 < local["reward/mean"] < 1 and local["speaker/grad_norm"] > 0
    assert ray["critic/fit_mse"] == pytest.approx(local["critic/fit_mse"], rel=1e-6)
    for name in ("speaker", "listener"):
        print(f"{name}: loss local {local[f'{name}/loss']:.6g} ray {ray[f'{name}/loss']:.6g}")
        for key in ("loss", "grad_norm", "kl"):
            assert ray[f"{name}/{key}"] == pytest.approx(
                local[f"{name}/{key}"], rel=1e-4, abs=1e-7
            ), (name, key)
