"""``unit_tests``: code from a response, run against a row's tests in the sandbox."""

from __future__ import annotations

import pytest

from polyrl.agents.rewards import extract_code, program_with_tests, unit_tests
from polyrl.core.rewards import Sample

PROMPT = 'from typing import List\n\n\ndef total(xs: List[int]) -> int:\n    """Sum."""\n'
TESTS = (
    "def check(candidate):\n    assert candidate([1, 2, 3]) == 6\n    assert candidate([]) == 0\n"
)
ROW = {"prompt": PROMPT, "test": TESTS, "entry_point": "total"}


def sample(response: str, index: int = 0, **meta) -> Sample:
    return Sample(
        prompt=PROMPT, response=response, answer=None, meta={"row": {**ROW, **meta}}, index=index
    )


def fenced(code: str, lang: str = "python") -> str:
    return f"Here it is:\n```{lang}\n{code}\n```\nDone."


def test_extract_code_joins_fences_in_order_and_keeps_unfenced_text():
    text = fenced("def helper(x):\n    return x") + "\nthen\n" + fenced("y = helper(1)", "")
    assert extract_code(text) == "def helper(x):\n    return x\n\ny = helper(1)"
    assert extract_code("x = 1\nprint(x)") == "x = 1\nprint(x)"
    assert extract_code("```py\nunclosed = True\n") == "unclosed = True"


def test_program_puts_prompt_imports_first_and_calls_check():
    program = program_with_tests(sample(fenced("def total(xs): return sum(xs)")))
    assert program.startswith("from typing import List\n")
    assert program.rstrip().endswith("check(total)")
    assert "def check(candidate)" in program


def test_passing_failing_and_hostile_code_score_one_and_zero():
    helper_and_main = (
        fenced("def add(a, b):\n    return a + b")
        + "\n"
        + fenced(
            "def total(xs: List[int]) -> int:\n    out = 0\n"
            "    for x in xs:\n        out = add(out, x)\n    return out"
        )
    )
    responses = [
        helper_and_main,  # two agents' code, joined
        fenced("def total(xs):\n    return len(xs)"),  # wrong answer
        fenced("def total(xs):\n    return sum(xs"),  # syntax error
        fenced("def total(xs):\n    while True:\n        pass"),  # never returns
        fenced("import os\ndef total(xs):\n    os.kill(os.getppid(), 9)"),  # attacks the trainer
    ]
    scores = unit_tests(
        [sample(r, i) for i, r in enumerate(responses)], cpu_seconds=2, wall_seconds=4
    )
    assert scores == [1.0, 0.0, 0.0, 0.0, 0.0]


def test_rows_without_tests_name_the_field():
    def row(tests):
        return Sample(prompt="p", response="x = 1", answer=None, meta={"row": {"tests": tests}})

    with pytest.raises(ValueError, match=r"field 'test'.*tests_field"):
        unit_tests([row("assert x == 1")])
    # MBPP-style rows: plain asserts in another field, no entry point to check()
    assert unit_tests([row("assert x == 1"), row("assert x == 2")], tests_field="tests") == [
        1.0,
        0.0,
    ]
