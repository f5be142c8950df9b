"""A marl team whose VLM agent samples with ``vllm_vl`` (issue 21, vLLM part).

Demo B's recipe, shortened to two training steps, with the looker (a tiny Qwen2.5-VL that
sees the image) on vLLM and the text-only solver on the HF engine: the marl runtime hands
the looker's joined image turns to vLLM (no images passed; the engine recovers them from
the pixel values), and the trainer's log-probs equal vLLM's on both steps, so the weights
pushed after the first update reached the vision tower and the language model alike.
"""

from __future__ import annotations

import json

import pytest

pytest.importorskip("vllm")

pytestmark = pytest.mark.vllm


def test_vl_looker_on_vllm_matches_the_trainer_across_a_sync(tmp_path):
    from polyrl.core import loop
    from tests.helpers.recipes import vl_team_recipe

    recipe = vl_team_recipe(
        tmp_path,
        tmp_path / "models",
        "policies.looker.engine.name=vllm_vl",
        "policies.looker.engine.args.max_model_len=256",
        "policies.looker.engine.args.kv_cache_gb=0.0625",
        "task.args.n_train=64",
        "task.args.n_eval=8",
        "sft.steps=10",
        "train.steps=2",
        "eval.every=0",
        "rollout.prompts_per_step=4",
        "rollout.n=4",
        # every row in the update, so the mismatch metric covers them all (a step whose
        # groups all tie would otherwise keep one row, and the metric could be vacuous)
        "algorithm.skip_zero_advantage=false",
    )
    run = loop.train(recipe)
    rows = [json.loads(line) for line in (run.path / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "looker/mismatch/logp_abs_max" in r]
    assert [r["step"] for r in steps] == [1, 2]
    for r in steps:
        print(
            f"step {r['step']}: looker |vllm_vl - trainer| max {r['looker/mismatch/logp_abs_max']:.2e}"
        )
        assert r["looker/mismatch/logp_abs_max"] <= 1e-5
        assert r["looker/mismatch/logp_abs_mean"] > 0  # vLLM's own numbers, not the trainer's
