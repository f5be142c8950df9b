"""End-to-end: the README demo's recipe learns (GRPO lifts held-out accuracy after SFT)."""

from __future__ import annotations

import pytest

from polyrl.core.config import load
from polyrl.core.loop import train
from polyrl.core.recipe import Config
from tests.helpers.runs import ARITHMETIC_RECIPE, accuracy_after_sft_and_grpo


@pytest.mark.learning
@pytest.mark.slow
@pytest.mark.timeout(2400)  # ~4 min on 2 idle cores; a loaded machine can be 5x slower
def test_grpo_beats_sft_on_held_out_arithmetic(tiny_model_dir, tmp_path):
    gains = []
    for seed in (0, 1, 2):
        cfg = load(
            Config,
            ARITHMETIC_RECIPE,
            [
                f"seed={seed}",
                f"run.dir={tmp_path}/seed{seed}",
                "run.progress=false",
                "run.tensorboard=false",
                "run.export=false",
                "run.save_every=0",
                "eval.every=0",
                f"policies.main.model={tiny_model_dir}",
            ],
        )
        run = train(cfg)
        after_sft, after_grpo = accuracy_after_sft_and_grpo(run.path)
        gains.append(after_grpo - after_sft)
        print(
            f"seed {seed}: held-out accuracy {after_sft:.3f} after SFT -> {after_grpo:.3f} after GRPO"
        )
    assert all(g > 0 for g in gains), gains
    assert sum(gains) / len(gains) >= 0.15, gains
