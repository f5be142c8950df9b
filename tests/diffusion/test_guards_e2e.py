"""Guards end to end on the colour demo (child processes on the pre-trained tiny SD3).

Reward hacking: ``examples/diffusion_colour_hacking.yaml`` (JPEG compressibility alone)
collapses each prompt's images to one flat image (diversity falls); its diversity guard
keeps them apart. GRPO-Guard: the colour recipe with ratio normalisation, 1/|dt| step
weights and two mini-batches (so the clip acts) learns the colour.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from tests.helpers.diffusion_runs import EXAMPLES, build_model, metrics, run_recipe, wait

RECIPE = EXAMPLES / "diffusion_colour_hacking.yaml"
COLOUR = RECIPE.with_name("diffusion_colour_grpo.yaml")
GUARD = (
    "policies.main.args={max_sequence_length: 1, ratio_norm: true}",
    "algorithm.credit_args={adv_clip: 5.0, step_weight: inv_dt}",
)


@pytest.fixture(scope="module")
def demo_model(tmp_path_factory) -> str:
    return build_model(RECIPE, tmp_path_factory, "tiny-sd3-colour")


def _curves(run: Path) -> dict[str, list[float]]:
    rows = [r for r in metrics(run) if r.get("diversity/mean") is not None]
    keys = ("diversity/mean", "guard/fired_frac", "reward/mean", "reward/colour/mean")
    return {k: [r[k] for r in rows] for k in keys}


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs)


def _run_pair(model: str, root: Path, seed: int, steps: int) -> tuple[dict, dict]:
    wait(
        {
            name: run_recipe(RECIPE, model, root / name, seed, f"train.steps={steps}", *extra)
            for name, extra in (
                ("guard", ()),
                ("off", ("algorithm.credit_args.diversity_floor=0.0",)),
            )
        }
    )
    return _curves(root / "guard"), _curves(root / "off")


def _check(guard: dict, off: dict, label: str) -> None:
    d_off, d_guard = off["diversity/mean"], guard["diversity/mean"]
    start, end_off, end_guard = _mean(d_off[:2]), _mean(d_off[-5:]), _mean(d_guard[-5:])
    print(
        f"{label}: diversity {start:.3f} -> {end_off:.3f} without the guard, -> {end_guard:.3f}"
        f" with it (fired on {_mean(guard['guard/fired_frac'][-5:]):.2f} of the groups, last "
        f"5 steps); JPEG reward {_mean(off['reward/mean'][:2]):.3f} -> "
        f"{_mean(off['reward/mean'][-5:]):.3f} (off), {_mean(guard['reward/mean'][-5:]):.3f} "
        f"(guard); colour {_mean(off['reward/colour/mean'][:2]):.3f} -> "
        f"{_mean(off['reward/colour/mean'][-5:]):.3f} (off), "
        f"{_mean(guard['reward/colour/mean'][-5:]):.3f} (guard)"
    )
    # the hack: the proxy reward rises while the images collapse and the colour disappears
    assert _mean(off["reward/mean"][-5:]) > _mean(off["reward/mean"][:2])
    assert end_off < 0.5 * start, (start, end_off)
    assert max(off["guard/fired_frac"]) == 0.0  # off: never fires
    # the guard fires once diversity drops below its floor, and keeps it well above
    assert max(guard["guard/fired_frac"]) > 0.5
    assert end_guard > 2 * end_off, (end_guard, end_off)


@pytest.mark.learning
@pytest.mark.slow
@pytest.mark.timeout(1800)  # 114 s at a load average of ~9 on 2 cores; more when busier
def test_jpeg_reward_collapses_diversity_and_the_guard_reacts(demo_model, tmp_path):
    t0 = time.perf_counter()
    guard, off = _run_pair(demo_model, tmp_path, 0, steps=15)
    _check(guard, off, f"seed 0, 15 steps ({time.perf_counter() - t0:.0f}s)")


@pytest.mark.learning
@pytest.mark.seeds
@pytest.mark.timeout(3600)
def test_reward_hacking_and_the_guard_three_seeds(demo_model, tmp_path):
    for seed in (0, 1, 2):
        guard, off = _run_pair(demo_model, tmp_path / f"seed{seed}", seed, steps=30)
        _check(guard, off, f"seed {seed}, 30 steps")


@pytest.mark.learning
@pytest.mark.seeds
@pytest.mark.timeout(3600)
def test_grpo_guard_learns_the_colour_three_seeds(demo_model, tmp_path):
    """ratio_norm + inv_dt with two mini-batches per update (the second is off-policy, so
    the clip acts) learns the colour as the plain recipe does: >= 0.9 over the last 5 of
    40 steps on each seed."""
    for seed in (0, 1, 2):
        runs = {
            name: run_recipe(
                COLOUR,
                demo_model,
                tmp_path / f"seed{seed}" / name,
                seed,
                "train.steps=40",
                "eval.every=0",
                "algorithm.minibatches=2",
                *extra,
            )
            for name, extra in (("guard", GUARD), ("plain", ()))
        }
        wait(runs)
        last = {}
        for name in runs:
            rows = metrics(tmp_path / f"seed{seed}" / name)
            rewards = [r["reward/mean"] for r in rows if r.get("diversity/mean") is not None]
            clip = [r["main/pg_clipfrac"] for r in rows if r.get("main/pg_clipfrac") is not None]
            last[name] = (_mean(rewards[:3]), _mean(rewards[-5:]), _mean(clip))
        print(
            f"seed {seed}: GRPO-Guard reward {last['guard'][0]:.3f} -> {last['guard'][1]:.3f} "
            f"(clip fraction {last['guard'][2]:.3f}); plain {last['plain'][0]:.3f} -> "
            f"{last['plain'][1]:.3f} (clip fraction {last['plain'][2]:.3f})"
        )
        assert last["guard"][1] >= 0.9, (seed, last)
