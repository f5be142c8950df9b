"""Gateway demo 1 (``examples/gateway_calculator.yaml``), trained through the core loop.

An agent written only against the ``openai`` client (a loop that may call a calculator
tool, then answers) learns past its warm start on held-out problems. Held-out success is
the greedy policy's, per episode (``success_rate``). One seed runs in CI (``slow``), three
under ``seeds``.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.helpers.examples import example_for_spawned_workers

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


@pytest.fixture(scope="module")
def demos():
    """``examples/gateway_demos.py``, importable by name in the spawned workers too."""
    with example_for_spawned_workers("gateway_demos") as module:
        yield module


EVAL_TRANSCRIPT_ROWS = 32  # an evaluation writes its first 32 rows (Session.evaluate)


def check_demo1_transcripts(run_dir: str) -> None:
    """The last held-out pass: correct episodes called the tool, then answered on a
    stitched turn (the call's sampled ids reused, nothing re-tokenised)."""
    last = sorted((Path(run_dir) / "samples").glob("eval_step_*"))[-1]
    lines = [json.loads(x) for x in last.read_text().splitlines()]
    episodes: dict = {}
    for line in lines:
        episodes.setdefault(line["episode"], []).append(line)
    if len(lines) == EVAL_TRANSCRIPT_ROWS:  # the file's last episode may be cut short
        episodes.pop(lines[-1]["episode"])
    solved = [turns for turns in episodes.values() if turns[0]["return"] == 1.0]
    assert solved
    for turns in solved:
        assert len(turns) == 2 and '"name": "calc"' in turns[0]["response"]
        assert turns[1]["stitched"] is True and turns[1]["response"] == turns[0]["answer"]


@pytest.mark.learning
@pytest.mark.slow
def test_demo1_an_openai_agent_learns_to_use_its_calculator(demos, tmp_path):
    result = demos.demo1(tmp_path, seed=0)
    (_, start), (_, end) = result["curve"][0], result["curve"][-1]
    print(f"demo 1, seed 0: held-out success {start:.3f} -> {end:.3f}")
    assert end >= start + 0.15
    check_demo1_transcripts(result["run_dir"])


@pytest.mark.learning
@pytest.mark.seeds
def test_demo1_three_seeds(demos, tmp_path):
    results = demos.seeds(1, tmp_path)
    starts = [r["curve"][0][1] for r in results]
    ends = [r["curve"][-1][1] for r in results]
    for seed, (s, e) in enumerate(zip(starts, ends, strict=True)):
        print(f"demo 1, seed {seed}: held-out success {s:.3f} -> {e:.3f}")
    gain = sum(ends) / 3 - sum(starts) / 3
    print(f"demo 1: mean gain {gain:+.3f}")
    assert gain >= 0.15
