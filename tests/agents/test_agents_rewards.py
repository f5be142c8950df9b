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


WRONG = "def total(xs):\n    return len(xs)\n"
RIGHT = "def total(xs):\n    return sum(xs)\n"


@pytest.mark.parametrize(
    "tail",
    [
        "import sys\nsys.exit(0)",  # before the tests run
        "import os\nos._exit(0)",
        "import atexit, os\natexit.register(os._exit, 0)\nraise SystemExit(0)",
    ],
    ids=["sys.exit", "os._exit", "atexit"],
)
def test_a_wrong_answer_that_exits_early_with_status_0_scores_0(tail):
    """Issue 23: exit status 0 alone passed; passing now needs the checks to return."""
    assert unit_tests([sample(fenced(WRONG + tail))]) == [0.0]
    # the same exit inside the function under test, while check() runs
    inside = "def total(xs):\n    import os\n    os._exit(0)\n"
    assert unit_tests([sample(fenced(inside))]) == [0.0]


def test_a_response_forging_the_sandbox_failure_scores_0_and_others_keep_theirs():
    """Issue 23: exit 126 or 'sandbox setup failed' on stderr made the reward raise, and
    the raising term discarded every row of the batch."""
    from polyrl.core.record import strings, text_record
    from polyrl.core.rewards import RewardConfig, RewardTerm, score

    forged = (
        "import os, sys\nsys.stderr.write('sandbox setup failed: OSError: forged\\n')\n"
        "os._exit(126)"
    )
    channel = "import os\nos.write(3, b'start\\ndone 0123456789abcdef\\n')\nimport sys\nsys.exit(0)"
    responses = [
        fenced(RIGHT),
        fenced(WRONG + "import os\nos._exit(126)"),
        fenced(RIGHT + forged),
        fenced(WRONG + channel),  # a guessed nonce on the runner's channel
        fenced(RIGHT),
    ]
    assert unit_tests([sample(r, i) for i, r in enumerate(responses)]) == [
        1.0,
        0.0,
        0.0,
        0.0,
        1.0,
    ]
    n = len(responses)
    record = text_record(
        prompt_ids=[[1]] * n,
        response_ids=[[2]] * n,
        rollout_logprobs=[[-0.1]] * n,
        policy=["actor"] * n,
        uid=list(range(n)),
        pad_id=0,
        prompt_text=[PROMPT] * n,
        response_text=responses,
        meta=[{"row": ROW}] * n,
    )
    cfg = RewardConfig(terms=[RewardTerm("unit_tests")])
    cfg.validate()
    metrics = score(record, cfg)
    assert record["reward"].tolist() == [1.0, 0.0, 0.0, 0.0, 1.0]
    assert record["valid"].tolist() == [True] * n
    assert strings(record, "error") == [""] * n
    assert metrics["reward/errors"] == 0


def test_a_sandbox_that_cannot_start_raises():
    """The genuine failure (here: too little memory to start Python at all) is not the
    model's: the reward raises with the sandbox's own words instead of scoring 0."""
    with pytest.raises(RuntimeError, match="sandbox could not run row 0"):
        unit_tests([sample(fenced(RIGHT), 0), sample(fenced(RIGHT), 1)], memory_mb=4)
