"""Issue 21's Demo B: a tiny VL looker and a text-only solver learn to talk.

The task's warm-start rows are checked here (fast): the looker's carry no image and name
symbols uniformly, the solver's follow its code in the ``solver_bias`` share. The learning
evidence is a ``seeds`` run (three seeds of ``examples/vl_team_colour.yaml``, minutes each
on CPU: too long for CI): held-out greedy joint success starts near 1/4 and rises to at
least 0.9 (mean of 3 seeds), and the trained solver with the looker's warm-start
(RL-untrained) weights is back near chance: what was learned lives in the looker's use of
the image.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from polyrl.marl import vl_team
from polyrl.marl.workflows import LOOKER_ROLE, SOLVER_ROLE
from tests.helpers.recipes import vl_team_recipe

CHANCE = 1 / len(vl_team.COLOURS)


def _rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_dataset_images_show_the_answer_colour(tmp_path):
    train, evals = vl_team.write_dataset(tmp_path, seed=3, n_train=40, n_eval=8, size=56)
    rows = _rows(train)
    assert len(rows) == 40 and len(_rows(evals)) == 8
    for row in rows[:10]:
        with Image.open(tmp_path / row["images"]) as img:
            colours = Counter(map(tuple, np.asarray(img.convert("RGB")).reshape(-1, 3).tolist()))
        assert img.size == (56, 56)
        assert set(colours) == {vl_team.BACKGROUND, vl_team.COLOURS[row["answer"]]}
    code = rows[0]["code"]
    assert sorted(code.values()) == sorted(vl_team.COLOURS)  # one symbol per colour
    assert set(code) <= set(rows[0]["symbols"])
    assert "code" not in _rows(evals)[0]  # held-out rows carry no warm-start habit


@pytest.mark.parametrize("bias", [0.0, 0.9])
def test_warm_start_teaches_formats_and_only_the_solver_a_habit(tmp_path, bias):
    train, _ = vl_team.write_dataset(tmp_path, seed=0, n_train=2000, n_eval=4, solver_bias=bias)
    rows = _rows(train)
    sft = vl_team.sft_rows(rows)
    looker = [r for r in sft if r["prompt"][0]["content"] == LOOKER_ROLE]
    solver = [r for r in sft if r["prompt"][0]["content"] == SOLVER_ROLE]
    assert len(looker) == len(solver) == len(rows)
    # the looker's prompt is the question alone: it cannot see the colour it is to name
    assert {r["prompt"][1]["content"] for r in looker} == {vl_team.QUESTION}
    said = Counter(r["response"] for r in looker)
    assert set(said) == set(rows[0]["symbols"])
    assert min(said.values()) > 0.8 * len(rows) / len(said)  # about uniform
    code = rows[0]["code"]
    heard = [(r["prompt"][1]["content"].rsplit(" ", 1)[1], r["response"]) for r in solver]
    assert {a for _, a in heard} == set(vl_team.COLOURS)
    coded = [(m, a) for m, a in heard if m in code]
    follows = sum(code[m] == a for m, a in coded) / len(coded)
    # bias b of the rows follow the code, the rest hit it by chance 1/4
    assert follows == pytest.approx(bias + (1 - bias) * CHANCE, abs=0.04)


def test_options_are_checked_with_the_key_named(tmp_path):
    with pytest.raises(ValueError, match="task.args.n_symbols"):
        vl_team.write_dataset(tmp_path, seed=0, n_symbols=3)
    with pytest.raises(ValueError, match="task.args.solver_bias"):
        vl_team.write_dataset(tmp_path, seed=0, solver_bias=1.5)


def test_recipe_loads_with_the_task_and_workflow(tmp_path):
    cfg = vl_team_recipe(tmp_path, tmp_path / "models")
    assert cfg.task.name == "vl_team_colour" and cfg.rollout.workflow == "look_and_answer"
    assert cfg.task.args["solver_bias"] > 0 and cfg.sft.steps > 0


def _curve(run_dir: Path) -> list[tuple[int, float]]:
    rows = _rows(run_dir / "metrics.jsonl")
    return [(r["step"], r["eval/accuracy"]) for r in rows if r.get("eval/accuracy") is not None]


@pytest.mark.learning
@pytest.mark.seeds
@pytest.mark.timeout(5400)
def test_looker_and_solver_learn_and_the_untrained_looker_is_back_at_chance(
    tmp_path_factory,
):
    import torch

    from polyrl.core import loop
    from polyrl.core.runner.session import Session

    # tiny models on a busy 2-core machine run far faster on one thread than on two
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        _three_seeds(tmp_path_factory, loop, Session)
    finally:
        torch.set_num_threads(before)


def _three_seeds(tmp_path_factory, loop, Session) -> None:
    models = tmp_path_factory.mktemp("vl-team-models")
    ends, swaps = [], []
    for seed in (0, 1, 2):
        where = tmp_path_factory.mktemp(f"seed{seed}")
        run = loop.train(vl_team_recipe(where, models, f"seed={seed}"))
        points = _curve(run.path)
        print(f"\nseed {seed}: held-out success {points}")
        assert points[0][1] <= 0.4, f"after the warm start success should be near 1/4: {points}"
        ends.append(points[-1][1])
        # the trained solver, frozen, with the looker's warm start only (the same SFT rows)
        swap = vl_team_recipe(
            where / "swap",
            models,
            f"seed={seed}",
            f"policies.solver.model={run.path}/export/solver",
            "policies.solver.train=false",
            "train.steps=0",
        )
        swaps.append(Session.open(swap).evaluate("swap")["swap/accuracy"])
        print(f"seed {seed}: trained solver + warm-start looker: {swaps[-1]:.2f}")
    print(f"held-out success per seed {ends}, mean {sum(ends) / 3:.3f}; swapped {swaps}")
    assert sum(ends) / 3 >= 0.9, ends  # issue 21's bar, from chance after the warm start
    assert min(ends) >= CHANCE + 0.3, ends
    assert max(swaps) <= 0.4, swaps
