"""End-to-end: the diffusion demo recipe learns the prompt's colour (3 seeds, CPU).

The tiny SD3 is built and pre-trained once (as the recipe's builder does), then
``polyrl train examples/diffusion_colour_grpo.yaml`` runs for seed 0 (CI) or three seeds in
parallel processes (``seeds``). Each must lift the colour reward clearly and end with the named colour right
in at least 90% of its samples.
"""

from __future__ import annotations

import resource
import time
from pathlib import Path

import pytest

from tests.helpers.diffusion_runs import (
    EXAMPLES,
    build_model,
    check_colour_learns,
    metrics,
    run_recipe,
    wait,
)

RECIPE = EXAMPLES / "diffusion_colour_grpo.yaml"
NFT_RECIPE = RECIPE.with_name("diffusion_colour_nft.yaml")
IMAGES_PER_STEP = 64  # rollout.n x prompts_per_step in both recipes
SEEDS = (0, 1, 2)


@pytest.fixture(scope="module")
def demo_model(tmp_path_factory) -> str:
    return build_model(RECIPE, tmp_path_factory, "tiny-sd3-colour")


def _train(model: str, run_dir: Path, seed: int, *overrides: str, recipe: Path = RECIPE):
    return run_recipe(recipe, model, run_dir, seed, *overrides)


@pytest.mark.learning
@pytest.mark.slow
@pytest.mark.parametrize(
    "seeds",
    [pytest.param((0,), id="seed0"), pytest.param(SEEDS, marks=pytest.mark.seeds, id="three")],
)
def test_grpo_learns_the_prompt_colour(seeds, demo_model, tmp_path):
    """Each seed clears the bar on its own; CI runs seed 0, ``seeds`` all three."""
    procs = {}
    t0 = time.perf_counter()
    cpu0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    for seed in seeds:
        procs[seed] = _train(demo_model, tmp_path / f"seed{seed}", seed)
    wait(procs)
    cpu1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (cpu1.ru_utime - cpu0.ru_utime) + (cpu1.ru_stime - cpu0.ru_stime)
    print(
        f"{len(seeds)} seed(s) in {time.perf_counter() - t0:.0f}s wall, {cpu:.0f} CPU-seconds "
        "(parallel processes, one thread each)"
    )
    for seed in seeds:
        run = tmp_path / f"seed{seed}"
        check_colour_learns(run, seed)
        assert (run / "grid_before.png").is_file() and (run / "grid_after.png").is_file()


@pytest.mark.learning
@pytest.mark.seeds
def test_flow_grpo_conventions_with_its_published_kl_and_clip_learn(demo_model, tmp_path):
    """The colour recipe with Flow-GRPO's KL form (kl_form: flow_grpo) and its published
    kl_coef (beta 0.04) and clip range (1e-4) still learns the colour (one seed; a variant's
    evidence, under ``seeds`` for CI's time)."""
    t0 = time.perf_counter()
    proc = _train(
        demo_model,
        tmp_path / "run",
        0,
        "policies.main.args.kl_form=flow_grpo",
        "algorithm.kl_coef=0.04",
        "algorithm.clip_ratio_low=1.0e-4",
        "algorithm.clip_ratio_high=1.0e-4",
    )
    wait({"flow_grpo KL": proc})
    rows = metrics(tmp_path / "run")
    train = [r for r in rows if r.get("reward/mean") is not None]
    kl = [r["main/kl"] for r in train if r.get("main/kl") is not None]
    first = sum(r["reward/mean"] for r in train[:3]) / 3
    last = sum(r["reward/mean"] for r in train[-5:]) / 5
    acc = sum(r["reward/colour_accuracy/mean"] for r in train[-5:]) / 5
    print(
        f"flow_grpo KL 0.04: reward {first:.3f} -> {last:.3f}, colour right {acc:.2f} (last 5 "
        f"steps), KL max {max(kl):.2e}, {time.perf_counter() - t0:.0f}s"
    )
    assert len(kl) == len(train) and max(kl) > 0  # the KL term was on
    assert last > first + 0.4 and acc >= 0.9, (first, last, acc)


def _training_rewards(run_dir: Path) -> list[float]:
    return [r["reward/mean"] for r in metrics(run_dir) if r.get("reward/mean") is not None]


def _images_to_reach(rewards: list[float], target: float = 0.9) -> int | None:
    """Sampled training images until the first step whose mean reward reaches ``target``."""
    step = next((i + 1 for i, r in enumerate(rewards) if r >= target), None)
    return None if step is None else step * IMAGES_PER_STEP


def _run_seeds(model: str, root: Path, recipe: Path, seeds) -> dict[int, list[float]]:
    wait({s: _train(model, root / f"seed{s}", s, recipe=recipe) for s in seeds})
    return {s: _training_rewards(root / f"seed{s}") for s in seeds}


@pytest.mark.learning
@pytest.mark.slow
def test_nft_learns_the_prompt_colour(demo_model, tmp_path):
    """DiffusionNFT (ODE data collection, forward-process loss): the colour reward rises
    from about 0.14 by at least 0.5 to at least 0.75 (mean of the last 5 of 50 steps), one
    seed. Where it ends turns on the CPU's float rounding: 0.9 or more on the machine that
    set the first bar, 0.804 on another (the same 50 steps, value for value, from this
    code and from the code before the 2026-11-28 round)."""
    rewards = _run_seeds(demo_model, tmp_path, NFT_RECIPE, (0,))[0]
    first, last = sum(rewards[:3]) / 3, sum(rewards[-5:]) / 5
    print(f"NFT: reward {first:.3f} -> {last:.3f}; 0.9 after {_images_to_reach(rewards)} images")
    assert first < 0.3 and last >= first + 0.5 and last >= 0.75, (first, last)
    assert (tmp_path / "seed0" / "grid_after.png").is_file()


@pytest.mark.learning
@pytest.mark.seeds
def test_nft_and_grpo_images_to_reach_0_9(demo_model, tmp_path):
    """Three seeds of each recipe: NFT ends at >= 0.9; the sampled images each needs to reach
    a 0.9 training reward, NFT vs Flow-GRPO (diffusion/README.md reports them)."""
    nft = _run_seeds(demo_model, tmp_path / "nft", NFT_RECIPE, SEEDS)
    grpo = _run_seeds(demo_model, tmp_path / "grpo", RECIPE, SEEDS)
    for seed in SEEDS:
        n, g = nft[seed], grpo[seed]
        print(
            f"seed {seed}: NFT {sum(n[:3]) / 3:.3f} -> {sum(n[-5:]) / 5:.3f}, 0.9 after "
            f"{_images_to_reach(n)} images; GRPO {sum(g[:3]) / 3:.3f} -> {sum(g[-5:]) / 5:.3f}, "
            f"0.9 after {_images_to_reach(g)} images"
        )
        assert sum(n[-5:]) / 5 >= 0.9 and _images_to_reach(n) is not None, (seed, n)
