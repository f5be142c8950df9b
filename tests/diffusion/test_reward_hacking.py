"""Reward hacking on the colour demo: JPEG compressibility alone collapses each prompt's
images to one flat image (diversity falls), and the diversity guard keeps them apart.

``examples/diffusion_colour_hacking.yaml`` runs twice in parallel child processes on the
pre-trained tiny SD3: with its guard, and with ``diversity_floor=0`` (off).
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from tests.diffusion.test_colour_e2e import _metrics, _train

RECIPE = Path(__file__).parents[2] / "examples" / "diffusion_colour_hacking.yaml"


@pytest.fixture(scope="module")
def demo_model(tmp_path_factory) -> str:
    import torch
    import yaml

    from polyrl.diffusion.tiny import tiny_sd3

    build_args = yaml.safe_load(RECIPE.read_text())["policies"]["main"]["build_args"]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return str(tiny_sd3(tmp_path_factory.mktemp("models") / "tiny-sd3-colour", **build_args))
    finally:
        torch.set_num_threads(threads)


def _curves(run: Path) -> dict[str, list[float]]:
    rows = [r for r in _metrics(run) if r.get("diversity/mean") is not None]
    keys = ("diversity/mean", "guard/fired_frac", "reward/mean", "reward/colour/mean")
    return {k: [r[k] for r in rows] for k in keys}


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs)


def _run_pair(model: str, root: Path, seed: int, steps: int) -> tuple[dict, dict]:
    procs = {
        name: _train(model, root / name, seed, f"train.steps={steps}", *extra, recipe=RECIPE)
        for name, extra in (
            ("guard", ()),
            ("off", ("algorithm.credit_args.diversity_floor=0.0",)),
        )
    }
    for name, proc in procs.items():
        out, _ = proc.communicate(timeout=900)
        assert proc.returncode == 0, f"{name} failed:\n{out[-3000:]}"
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


@pytest.mark.slow
def test_jpeg_reward_collapses_diversity_and_the_guard_reacts(demo_model, tmp_path):
    t0 = time.perf_counter()
    guard, off = _run_pair(demo_model, tmp_path, 0, steps=15)
    _check(guard, off, f"seed 0, 15 steps ({time.perf_counter() - t0:.0f}s)")


@pytest.mark.seeds
def test_reward_hacking_and_the_guard_three_seeds(demo_model, tmp_path):
    for seed in (0, 1, 2):
        guard, off = _run_pair(demo_model, tmp_path / f"seed{seed}", seed, steps=30)
        _check(guard, off, f"seed {seed}, 30 steps")
