"""``unit_tests`` (issue 38): what the checker calls and what it compares.

Three ways a wrong answer scored, or escaped its 0: an entry point named like a builtin
(the checks called the builtin), a deep value fed back to the candidate (a harness error
dropped the row), and a NaN (``assert not abs(a - b) > tol`` holds for it)."""

from __future__ import annotations

from polyrl.agents.rewards import unit_tests
from polyrl.agents.sandbox import Sandbox, SandboxLimits
from polyrl.core.rollout.rewards import Sample

LIMITS = SandboxLimits(cpu_seconds=4, wall_seconds=8)


def row(code: str, index: int, test: str, entry_point: str) -> Sample:
    meta = {"row": {"prompt": "", "test": test, "entry_point": entry_point}}
    return Sample(
        prompt="", response=f"```python\n{code}\n```", answer=None, meta=meta, index=index
    )


SORT_TESTS = (
    "def check(candidate):\n    assert candidate([3, 1, 2]) == [1, 2, 3]\n"
    "    assert candidate([]) == []\n"
)


def test_an_entry_point_named_like_a_builtin_is_the_candidates_own():
    """``sorted``: the builtin passes these checks; the response's function is what counts."""
    right = "def sorted(xs):\n    out = list(xs)\n    out.sort()\n    return out"
    wrong = "def sorted(xs):\n    return list(xs)"
    absent = "def sort_list(xs):\n    return list(xs)"
    rows = [row(c, i, SORT_TESTS, "sorted") for i, c in enumerate([right, wrong, absent])]
    assert unit_tests(rows, cpu_seconds=4, wall_seconds=8) == [1.0, 0.0, 0.0]
    r = Sandbox(LIMITS).run_tests(absent, SORT_TESTS, entry_point="sorted")
    assert r.error == "failed" and not r.harness
    assert "the response defines no 'sorted'" in r.checks


# The checks feed the candidate's result back to it: a 64-deep wrong answer is plain data
# on the way out, one level too deep on the way back in.
FEED_BACK = "def check(candidate):\n    first = candidate(3)\n    assert candidate(first) == 6\n"
DEEP = "def double(x):\n    v = 0\n    for _ in range(64):\n        v = [v]\n    return v"


def test_a_value_that_cannot_be_fed_back_fails_the_check_instead_of_dropping_the_row():
    right = "def double(x):\n    return 2 * x if x < 6 else 6"
    scores = unit_tests(
        [row(DEEP, 0, FEED_BACK, "double"), row(right, 1, FEED_BACK, "double")],
        cpu_seconds=4,
        wall_seconds=8,
    )
    assert scores == [0.0, 1.0]
    r = Sandbox(LIMITS).run_tests(DEEP, FEED_BACK, entry_point="double")
    assert r.error == "failed" and not r.harness
    assert "cannot be sent" in r.checks and "deeper than 64" in r.checks


NAN = "float('nan')"
CLOSE_TESTS = [
    # the form that passed a NaN: every comparison with a NaN is false
    "def check(candidate):\n    assert not abs(candidate([0.5, 0.25]) - 0.75) > 1e-9\n",
    "def check(candidate):\n    v = candidate([0.5, 0.25])\n    assert not (v < 0.74 or v > 0.76)\n",
    # a comparison inside a generator, on values inside a list
    "def check(candidate):\n    got = [candidate([0.5, 0.25]), 1.0]\n"
    "    assert not any(abs(a - b) > 1e-9 for a, b in zip(got, [0.75, 1.0]))\n",
    # numpy arrays built from the candidate's value
    "import numpy as np\ndef check(candidate):\n    got = np.array([candidate([0.5, 0.25])])\n"
    "    assert not np.any(np.abs(got - 0.75) > 1e-9)\n",
    # the check's own ``except Exception`` cannot catch the refusal into a pass
    "def check(candidate):\n    try:\n        bad = abs(candidate([0.5, 0.25]) - 0.75) > 1e-9\n"
    "    except Exception:\n        bad = False\n    assert not bad\n",
]


def test_nan_and_infinities_satisfy_no_numeric_check_however_written():
    answers = {
        "right": "def total(xs):\n    return sum(xs)",
        "nan": f"def total(xs):\n    return {NAN}",
        "inf": "def total(xs):\n    return float('inf')",
        "nan in a complex": f"def total(xs):\n    return complex({NAN}, 0)",
    }
    # a NaN against every form; the other answers against the first
    pairs = [(t, answers["nan"]) for t in CLOSE_TESTS]
    pairs += [(CLOSE_TESTS[0], answers[k]) for k in ("right", "inf", "nan in a complex")]
    rows = [row(code, i, test, "total") for i, (test, code) in enumerate(pairs)]
    scores = unit_tests(rows, cpu_seconds=4, wall_seconds=8, workers=4)
    assert scores == [0.0] * len(CLOSE_TESTS) + [1.0, 0.0, 0.0]
    r = Sandbox(LIMITS).run_tests(answers["nan"], CLOSE_TESTS[0], entry_point="total")
    assert r.error == "failed" and "a NaN cannot satisfy a check" in r.checks


def test_comparisons_keep_their_meaning_order_and_short_circuits():
    """The guard changes only what a NaN does: chains, ``in``, ``is``, infinities that
    are the expected answer and the checks' own NaN tests work as written."""
    checks = (
        "calls = []\n"
        "def seen(x):\n    calls.append(x)\n    return x\n"
        "def check(candidate):\n"
        "    assert 0 < candidate([1, 2]) <= 3 < 10\n"
        "    assert not (seen(5) < seen(1) < seen(99))\n"  # stops after the first link
        "    assert calls == [5, 1]\n"
        "    assert candidate([]) == float('inf') and candidate([]) > 1e308\n"
        "    assert candidate([1]) in (1, 2) and 3 not in [candidate([1])]\n"
        "    assert candidate([None]) is None\n"
        "    import math\n    assert math.isnan(candidate([float('nan')]))\n"
    )
    code = (
        "def total(xs):\n    if not xs:\n        return float('inf')\n"
        "    if xs[0] is None or xs[0] != xs[0]:\n        return xs[0]\n    return sum(xs)"
    )
    r = Sandbox(LIMITS).run_tests(code, checks, entry_point="total")
    assert r.error == "" and r.completed, r.checks
