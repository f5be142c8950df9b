"""End-to-end: the README demo's recipe learns (GRPO lifts held-out accuracy after SFT)."""

from __future__ import annotations

import pytest

from polyrl.core.config import load
from polyrl.core.loop import train
from polyrl.core.recipe import Config
from tests.helpers.runs import ARITHMETIC_RECIPE, accuracy_after_sft_and_grpo

# Seed 0 alone, held-out accuracy after SFT -> after GRPO, Intel Xeon: avx512 0.18 -> 0.45,
# avx2 0.32 -> 0.56, default 0.27 -> 0.48; the bar is half the lowest gain (0.21)
SEED0_GAIN = 0.1


@pytest.mark.learning
@pytest.mark.slow
@pytest.mark.timeout(2400)  # ~80 s a seed on 2 idle cores; a loaded machine can be 5x slower
@pytest.mark.parametrize(
    "seeds",
    [pytest.param((0,), id="seed0"), pytest.param((0, 1, 2), marks=pytest.mark.seeds, id="three")],
)
def test_grpo_beats_sft_on_held_out_arithmetic(seeds, tiny_model_dir, tmp_path):
    """CI: seed 0 gains SEED0_GAIN; ``seeds``: every seed gains, 15 points on average."""
    gains = []
    for seed in seeds:
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
    if len(seeds) == 1:
        assert gains[0] >= SEED0_GAIN, gains
    else:
        assert sum(gains) / len(gains) >= 0.15, gains
