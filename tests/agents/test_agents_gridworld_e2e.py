"""End-to-end: on the grid world, GiGPO and plain episode-level GRPO both lift held-out
success far above the shared starting point within 10 steps, and GiGPO trains no worse
than episode GRPO (mean over 3 seeds). CI runs seed 0, each scheme's gain alone; the three
seeds and the comparison are the ``seeds`` case.

Runs ``examples/gridworld_compare.py``: one format-only SFT warm start, then 3 seeds x 2
credit schemes of ``examples/gridworld_gigpo.yaml`` for ``STEPS`` RL steps each, spread over
two worker processes. Success is the greedy policy's on held-out maps.

Measured (mean held-out success at step 10, GiGPO / episode GRPO, from 0.111): Intel Xeon
avx512 0.722 / 0.729 (seeds 0-5: 0.701 / 0.701; mean over the evaluations at steps 2-10
0.683 / 0.670), avx2 0.736 / 0.708, default 0.736 / 0.715; AMD EPYC avx2, where the test
was written, GiGPO ahead.
On this 4x4 map with at most 8 turns the step-level credit does not separate from episode
credit by more than the seeds' spread (up to 0.125 on one seed), so the test does not claim
GiGPO wins: each scheme must gain 0.3 (lowest measured gain 0.59), and GiGPO must end within
0.1 of episode GRPO (lowest measured -0.007). Seed 0 alone, GiGPO / episode GRPO at step 10
from 0.146, Intel Xeon: avx512 0.750 / 0.646, avx2 0.750 / 0.688, default 0.750 / 0.646
(lowest gain 0.50; the bar 0.3 holds for one seed too).
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from tests.helpers.examples import example_for_spawned_workers

STEPS = 10


@pytest.mark.learning
@pytest.mark.slow
@pytest.mark.parametrize(
    "seeds",
    [pytest.param((0,), id="seed0"), pytest.param((0, 1, 2), marks=pytest.mark.seeds, id="three")],
)
def test_gigpo_and_episode_grpo_both_learn_the_grid_world(seeds, grid_model_dir, tmp_path):
    """CI: seed 0, each scheme gains 0.3; ``seeds``: three seeds, and GiGPO against GRPO."""
    with example_for_spawned_workers("gridworld_compare") as compare:
        start = time.perf_counter()
        result = compare.compare(
            tmp_path, steps=STEPS, seeds=seeds, workers=2, model=grid_model_dir, eval_every=5
        )
        elapsed = time.perf_counter() - start
    for key, run in sorted(result["runs"].items()):
        curve = " ".join(f"{s}:{a:.2f}" for s, a in run["curve"])
        print(f"{key:16s} {curve}  ({run['step_s']:.2f} s/step, {run['wall_s']:.0f} s)")
    means = compare.summary(result)
    print(f"means {means}; total {elapsed:.0f} s")
    for scheme in ("gigpo", "episode_grpo"):
        assert means[scheme]["end"] > means[scheme]["start"] + 0.3, (scheme, means)
    if len(seeds) > 1:  # one seed's schemes differ by up to 0.125: compared over three
        assert means["gigpo"]["end"] >= means["episode_grpo"]["end"] - 0.1, means
    # transcripts of every run are in its run directory
    some = Path(result["runs"]["gigpo/0"]["run_dir"]) / "samples"
    assert any(p.name.startswith("eval_step_") for p in some.iterdir())
