"""Gateway demo 2 (``examples/gateway_two_models.yaml``): one agent program, two models.

``planner`` reads the question and calls the calculator, ``answerer`` sees only the
reading; one run trains both, and swapping either back to its warm start drops held-out
success. The training runs (one seed, three seeds) run under ``seeds``: too long for CI.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers.examples import example_for_spawned_workers, load_example

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


@pytest.fixture(scope="module")
def demos():
    """``examples/gateway_demos.py``, importable by name in the spawned workers too."""
    with example_for_spawned_workers("gateway_demos") as module:
        yield module


def test_each_role_gets_its_own_habit_and_the_answerer_never_sees_the_question(tmp_path):
    """The warm start's two habits, at the shares the recipe sets: the planner writes a+b
    for a*b, the answerer hedges "about N"; the answerer's prompt is the reading alone."""
    import json

    calculator = load_example("gateway_calculator")
    PlanAndRead, calculate = calculator.PlanAndRead, calculator.calculate
    train, _ = PlanAndRead.write_dataset(tmp_path, seed=0, times_share=0.4, read_share=0.4)
    rows = [json.loads(x) for x in train.read_text().splitlines()]
    sft = PlanAndRead.sft_rows(rows)
    assert len(sft) == 2 * len(rows) == 1024
    plus = hedged = 0
    for r, plan, read in zip(rows, sft[0::2], sft[1::2], strict=True):
        a, b = (int(x) for x in r["uid"].split("*"))
        assert plan["prompt"] == r["prompt"]
        expr = json.loads(plan["response"].removeprefix("<tool_call>").removesuffix("</tool_call>"))
        expr = expr["arguments"]["expr"]
        assert expr in (f"{a}*{b}", f"{a}+{b}")
        plus += expr == f"{a}+{b}"
        reading = calculate(expr)
        assert read["prompt"] == f"The calculator says {reading}."  # no question in it
        assert read["response"] in (reading, f"about {reading}")
        hedged += read["response"].startswith("about")
    # 512 draws at p = 0.6: the shares lie within 0.6 +- 0.07 (over 3 standard deviations)
    assert abs(plus / 512 - 0.6) < 0.07 and abs(hedged / 512 - 0.6) < 0.07


def check_demo2(results: list[dict], gain: float, answerer: float, planner: float) -> None:
    """Held-out success (means over ``results``) rose by ``gain`` in training, and
    swapping the answerer / planner back to its warm start loses at least ``answerer`` /
    ``planner`` of it."""
    mean = {k: sum(r[k] for r in results) / len(results) for k in results[0]}
    print("demo 2 held-out success (mean):", {k: round(v, 3) for k, v in mean.items()})
    assert mean["trained"] >= mean["warm"] + gain
    assert mean["warm_answerer"] <= mean["trained"] - answerer
    assert mean["warm_planner"] <= mean["trained"] - planner


@pytest.mark.learning
@pytest.mark.seeds  # out of CI: minutes of training (README)
def test_demo2_two_models_in_one_program_both_train(demos, tmp_path):
    result = demos.demo2(tmp_path, seed=0)
    print("demo 2, seed 0:", result)
    # measured, seed 0: warm 0.0, trained 0.969, warm planner 0.0, warm answerer 0.266
    check_demo2([result], gain=0.6, answerer=0.3, planner=0.6)


@pytest.mark.learning
@pytest.mark.seeds
def test_demo2_three_seeds(demos, tmp_path):
    results = demos.seeds(2, tmp_path)
    for seed, r in enumerate(results):
        print(f"demo 2, seed {seed}:", r)
    # measured (means): warm 0.0, trained 0.958, warm planner 0.0, warm answerer 0.380
    check_demo2(results, gain=0.6, answerer=0.3, planner=0.6)
