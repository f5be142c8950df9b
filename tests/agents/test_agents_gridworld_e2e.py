"""End-to-end: on the grid world, GiGPO beats plain episode-level GRPO after the same number
of steps (mean over 3 seeds), and both improve on the shared starting point.

Runs ``examples/gridworld_compare.py``: one format-only SFT warm start, then 3 seeds x 2
credit schemes of ``examples/gridworld_gigpo.yaml`` for ``STEPS`` RL steps each, spread over
two worker processes. Success is the greedy policy's on held-out maps. Both schemes get
close to solving the task given enough steps; the comparison is taken early, where the
finer step-level credit shows.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from tests.helpers.examples import example_for_spawned_workers

STEPS = 10


@pytest.mark.learning
@pytest.mark.slow
def test_gigpo_beats_episode_grpo_on_the_grid_world(grid_model_dir, tmp_path):
    with example_for_spawned_workers("gridworld_compare") as compare:
        start = time.perf_counter()
        result = compare.compare(
            tmp_path, steps=STEPS, seeds=(0, 1, 2), workers=2, model=grid_model_dir, eval_every=5
        )
        elapsed = time.perf_counter() - start
    for key, run in sorted(result["runs"].items()):
        curve = " ".join(f"{s}:{a:.2f}" for s, a in run["curve"])
        print(f"{key:16s} {curve}  ({run['step_s']:.2f} s/step, {run['wall_s']:.0f} s)")
    means = compare.summary(result)
    print(f"means {means}; total {elapsed:.0f} s")
    for scheme in ("gigpo", "episode_grpo"):
        assert means[scheme]["end"] > means[scheme]["start"] + 0.05, (scheme, means)
    assert means["gigpo"]["end"] > means["episode_grpo"]["end"], means
    # transcripts of every run are in its run directory
    some = Path(result["runs"]["gigpo/0"]["run_dir"]) / "samples"
    assert any(p.name.startswith("eval_step_") for p in some.iterdir())
