"""Async rollouts still learn: the README demo with max_staleness 1 and 2 against the
synchronous run, with the HF and the vLLM engine. One seed (HF) in CI (slow); the
three-seed comparisons run under -m seeds."""

from __future__ import annotations

import pytest

from polyrl.core.config import load
from polyrl.core.loop import train
from polyrl.core.recipe import Config
from tests.helpers.runs import ARITHMETIC_RECIPE, accuracy_after_sft_and_grpo

VLLM = [
    "policies.main.engine.name=vllm",
    "policies.main.engine.args={max_model_len: 64, kv_cache_gb: 0.0625}",
]


def _gain(tiny_model_dir, tmp_path, seed: int, k: int, engine: str = "hf") -> tuple[float, float]:
    cfg = load(
        Config,
        ARITHMETIC_RECIPE,
        [
            f"seed={seed}",
            f"run.dir={tmp_path}/{engine}-k{k}-seed{seed}",
            "run.progress=false",
            "run.tensorboard=false",
            "run.export=false",
            "run.save_every=0",
            "eval.every=0",
            f"rollout.max_staleness={k}",
            f"policies.main.model={tiny_model_dir}",
            *(VLLM if engine == "vllm" else []),
        ],
    )
    after_sft, after_grpo = accuracy_after_sft_and_grpo(train(cfg).path)
    print(f"{engine} k={k} seed {seed}: held-out accuracy {after_sft:.3f} -> {after_grpo:.3f}")
    return after_sft, after_grpo


@pytest.mark.learning
@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_grpo_with_one_step_stale_rollouts_beats_sft(tiny_model_dir, tmp_path):
    after_sft, after_grpo = _gain(tiny_model_dir, tmp_path, seed=0, k=1)
    assert after_grpo - after_sft >= 0.1


@pytest.mark.learning
@pytest.mark.seeds
@pytest.mark.timeout(7200)
@pytest.mark.parametrize("engine", ["hf", pytest.param("vllm", marks=pytest.mark.vllm)])
def test_stale_rollouts_end_within_five_points_of_synchronous(tiny_model_dir, tmp_path, engine):
    final = {
        k: [_gain(tiny_model_dir, tmp_path, s, k, engine)[1] for s in (0, 1, 2)] for k in (0, 1, 2)
    }
    mean = {k: sum(v) / len(v) for k, v in final.items()}
    print(f"{engine}: held-out accuracy, mean of 3 seeds:", mean, final)
    assert mean[1] >= mean[0] - 0.05 and mean[2] >= mean[0] - 0.05, mean
