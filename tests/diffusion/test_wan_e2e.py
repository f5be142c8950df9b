"""End-to-end: a tiny Wan learns "red, then blue" (colour over time) with GRPO on CPU.

The tiny Wan is built and pre-trained once (as the recipe's builder does), then
``polyrl train examples/diffusion_wan_colour_video.yaml`` runs as a child process for three
seeds, under ``seeds`` (CI skips it for time: about 135 CPU-seconds a seed with the build;
the Wan path's mechanics are CI's in test_wan.py). The per-frame colour reward must rise
clearly (to >= 0.85), the share of videos whose every frame has the right main colour must
rise by more than 0.35, evaluation must end better than it started, and the run directory
must hold the before/after video grids. diffusion/README.md reports the numbers.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers.diffusion_runs import EXAMPLES, build_model, metrics, run_recipe, wait

RECIPE = EXAMPLES / "diffusion_wan_colour_video.yaml"


@pytest.fixture(scope="module")
def wan_model(tmp_path_factory) -> str:
    return build_model(RECIPE, tmp_path_factory, "tiny-wan-video")


def _train(model: str, run_dir: Path, seed: int, *overrides: str):
    return run_recipe(RECIPE, model, run_dir, seed, *overrides)


def _check(run: Path, seed: int) -> None:
    rows = metrics(run)
    train = [r for r in rows if r.get("reward/mean") is not None]
    colour = [r["reward/video_colour/mean"] for r in train]
    acc = [r["reward/video_colour_accuracy/mean"] for r in train]
    tc = [r["reward/temporal_consistency/mean"] for r in train]
    evals = [r["eval/accuracy"] for r in rows if r.get("eval/accuracy") is not None]
    first, last = sum(colour[:3]) / 3, sum(colour[-5:]) / 5
    acc0, acc1 = sum(acc[:3]) / 3, sum(acc[-5:]) / 5
    print(
        f"seed {seed}: per-frame colour {first:.3f} -> {last:.3f}; every frame right "
        f"{acc0:.2f} -> {acc1:.2f} (training), {evals[0]:.2f} -> {evals[-1]:.2f} (eval, ODE); "
        f"temporal consistency {sum(tc[:3]) / 3:.3f} -> {sum(tc[-5:]) / 5:.3f}"
    )
    assert last > first + 0.15 and last >= 0.85, (seed, first, last)
    assert acc1 > acc0 + 0.35 and evals[-1] > evals[0], (seed, acc0, acc1, evals)
    for name in ("video_before.gif", "video_after.gif", "video_after.png"):
        assert (run / name).is_file(), name


@pytest.mark.learning
@pytest.mark.seeds
def test_tiny_wan_learns_red_then_blue_three_seeds(wan_model, tmp_path):
    wait({s: _train(wan_model, tmp_path / f"seed{s}", s) for s in (0, 1, 2)}, timeout=1800)
    for seed in (0, 1, 2):
        _check(tmp_path / f"seed{seed}", seed)
