"""``unit_tests``: code from a response, run against a row's tests in the sandbox; the
tests run in a process of their own, so the code can only answer calls."""

from __future__ import annotations

import pytest

from polyrl.agents.rewards import extract_code, program_parts, unit_tests
from polyrl.core.rollout.rewards import Sample

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


def test_program_parts_keep_the_tests_apart_from_the_code():
    parts = program_parts(sample(fenced("def total(xs): return sum(xs)")))
    assert parts.preamble == "from typing import List\n"
    assert parts.code == "def total(xs): return sum(xs)"
    assert parts.checks == TESTS and "check" not in parts.code
    assert parts.entry_point == "total"
    with pytest.raises(ValueError, match=r"'entry_point' is 'total\(\)', not a Python name"):
        program_parts(sample("x", entry_point="total()"))


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
    from polyrl.core.rollout.rewards import RewardConfig, RewardTerm, score

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


# Shortcuts to 1.0 without solving the task (issue 33); each defines a wrong ``total``.
# The first six scored 1.0 when the tests ran in the code's own process.
FORGE_DONE = """
import os, sys
def forge():  # find the run's nonce in a caller's frame, write "done <nonce>" everywhere
    f = sys._getframe()
    while f is not None:
        for v in list(f.f_locals.values()):
            if isinstance(v, bytes) and len(v) == 32:
                for fd in range(3, 10):
                    try:
                        os.write(fd, b"done " + v + b"\\n")
                    except OSError:
                        pass
                os._exit(0)
        f = f.f_back
"""
SHORTCUTS = {
    "eq_always_true": "class Any:\n    def __eq__(self, other):\n        return True\n"
    "    def __sub__(self, other):\n        return self\n    def __abs__(self):\n"
    "        return 0\ndef total(xs):\n    return Any()\n",
    # a table of the tests' answers, parsed from the file the code runs from
    "tests_from_own_file": "import ast, re\nTABLE = {}\n"
    "for m in re.finditer(r'candidate\\((\\[.*?\\])\\)\\W+([-\\d.]+)', open(__file__).read()):\n"
    "    TABLE[m.group(1)] = ast.literal_eval(m.group(2))\n"
    "def total(xs):\n    return TABLE.get(repr(xs), -1)\n",
    "nonce_from_stack_frames": FORGE_DONE + "def total(xs):\n    forge()\n",
    "patched_sys_exit": FORGE_DONE + "sys.exit = lambda *a: forge()\n"
    "def total(xs):\n    return -1\n",
    "float_subclass_eq": "class F(float):\n    def __eq__(self, o):\n        return True\n"
    "    def __sub__(self, o):\n        return 0.0\n    __hash__ = float.__hash__\n"
    "def total(xs):\n    return F(-1)\n",
    "patched_builtins": "import builtins\nbuiltins.abs = lambda x: 0\n"
    "def total(xs):\n    return -1\n",
    # scored 0 before too
    "forged_result_lines": "import os\nfor fd in (1, 3, 4, 5, 6):\n    try:\n"
    "        os.write(fd, b'{\"value\": true}\\n' * 4 + b'done x\\n')\n"
    "    except OSError:\n        pass\ndef total(xs):\n    return -1\n",
    "os_exit_0_in_the_call": "import os\ndef total(xs):\n    os._exit(0)\n",
    "raise_base_exception": "def total(xs):\n    raise KeyboardInterrupt\n",
    "sleep_past_the_limit": "import time\ndef total(xs):\n    time.sleep(600)\n",
}
ATTACKED = (
    "def check(candidate):\n    assert candidate([1, 2, 3]) == 6\n    assert candidate([]) == 0\n"
    "    assert abs(candidate([0.5, 0.25]) - 0.75) < 1e-9\n"
)


def test_shortcuts_to_a_pass_score_0_and_a_correct_answer_1():
    """Issue 33: the checks ran in the code's process and namespace."""
    names = ["correct", *SHORTCUTS]
    codes = [RIGHT, *SHORTCUTS.values()]
    rows = [sample(fenced(c), i, test=ATTACKED) for i, c in enumerate(codes)]
    scores = unit_tests(rows, cpu_seconds=2, wall_seconds=3)
    assert dict(zip(names, scores, strict=True)) == {"correct": 1.0} | dict.fromkeys(SHORTCUTS, 0.0)


# Reads everything the code's process can reach without the audit hook: files around it,
# every process's command line, environment and descriptors, every string in its memory.
SNOOP = """
import gc, os
blob = []
def grab(path):
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
        try:
            blob.append(os.read(fd, 1 << 20))
        finally:
            os.close(fd)
    except OSError:
        pass
for top in (".", "/tmp", os.environ.get("HOME", ".")):
    for d, _, files in os.walk(top):
        for f in files:
            grab(os.path.join(d, f))
for pid in [p for p in os.listdir("/proc") if p.isdigit() and int(p) != os.getpid()]:
    for part in ("cmdline", "environ"):
        grab(f"/proc/{pid}/{part}")
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        fds = []
    for fd in fds:
        grab(f"/proc/{pid}/fd/{fd}")
blob += [o.encode(errors="replace") for o in gc.get_objects() if isinstance(o, str)]
marker = ("9182" + "73645").encode()
print("FOUND" if any(marker in b for b in blob) else "clean", len(blob))
def total(xs):
    return -1
"""


def test_the_tests_never_reach_the_codes_process():
    """Without the audit hook, the OS layers alone keep the row's tests (and so their
    expected values) out of everything the code can read."""
    from polyrl.agents.sandbox import Sandbox, SandboxLimits

    checks = "def check(candidate):\n    assert candidate([918273645]) == 918273645\n"
    r = Sandbox(SandboxLimits(cpu_seconds=4, wall_seconds=8), audit=False).run_tests(
        SNOOP, checks, entry_point="total"
    )
    assert r.stdout.startswith("clean "), (r.stdout, r.stderr)
    assert int(r.stdout.split()[1]) >= 3  # it did read (its own file, command lines)
    assert r.error == "failed" and not r.completed
    assert "AssertionError" in r.checks


def test_results_cross_as_plain_data_of_the_same_types():
    value = "(1, [2.5, None, True], {'a': b'x', 3: (4,)}, {5}, frozenset({6}), 1+2j, 'é')"
    checks = (
        f"v = value()\nassert v == {value}\n"
        "assert [type(x).__name__ for x in v] == "
        "['int', 'list', 'dict', 'set', 'frozenset', 'complex', 'str']\n"
        "assert type(v[2][3]) is tuple and type(v[2]['a']) is bytes\n"
    )
    rows = [
        sample(fenced(f"def value():\n    return {value}"), 0, test=checks, entry_point=""),
        # a list where the tests expect a tuple: not equal, as in plain Python
        sample(fenced(f"def value():\n    return list({value})"), 1, test=checks, entry_point=""),
        # a generator is not plain data: the call fails
        sample(fenced(f"def value():\n    return iter({value})"), 2, test=checks, entry_point=""),
        # numpy values arrive as their plain equivalents
        sample(
            fenced("import numpy as np\ndef total(xs):\n    return np.array(xs).sum()"),
            3,
            test="def check(candidate):\n    assert candidate([1, 2, 3]) == 6\n"
            "    assert type(candidate([1])) is int\n",
        ),
    ]
    assert unit_tests(rows) == [1.0, 0.0, 0.0, 1.0]


def test_exceptions_reach_the_checks_but_cannot_end_their_iteration():
    expects_error = (
        "def check(candidate):\n    try:\n        candidate([-1])\n    except ValueError:\n"
        "        pass\n    else:\n        raise AssertionError('no ValueError')\n"
    )
    raises = "def total(xs):\n    raise ValueError('negative')\n"
    # all(map(candidate, ...)) would be true if a StopIteration from the call ended the map
    iterated = "def check(candidate):\n    assert all(map(candidate, [[1], [2]]))\n"
    stops = "def total(xs):\n    raise StopIteration\n"
    rows = [
        sample(fenced(raises), 0, test=expects_error),
        sample(fenced(RIGHT), 1, test=expects_error),
        sample(fenced(stops), 2, test=iterated),
        sample(fenced(RIGHT), 3, test=iterated),
    ]
    assert unit_tests(rows) == [1.0, 0.0, 0.0, 1.0]


def test_tests_that_pass_what_cannot_cross_are_the_rows_error_not_a_0():
    unsendable = "def check(candidate):\n    assert candidate(lambda x: x) == 1\n"
    out = unit_tests([sample(fenced(RIGHT), 0, test=unsendable), sample(fenced(RIGHT), 1)])
    assert isinstance(out[0], ValueError) and out[1] == 1.0
    assert "row 0's tests (field 'test')" in str(out[0]) and "function" in str(out[0])


POLY_PROMPT = (
    "import math\n\n\ndef poly(xs: list, x: float):\n    return sum(c * math.pow(x, i) "
    'for i, c in enumerate(xs))\n\n\ndef find_zero(xs: list):\n    """A zero of poly."""\n'
)
POLY_TESTS = (
    "def check(candidate):\n    for xs in ([-6, 11, -6, 1], [2, -3, 1], [-1, 1]):\n"
    "        assert math.fabs(poly(xs, candidate(xs))) < 1e-4\n"
)


def test_helpers_the_prompt_defines_are_the_datasets_in_both_processes():
    """HumanEval/32-style: the checks call the prompt's ``poly``. A response cannot
    replace it for the checks; a response that only writes ``find_zero`` may call it."""
    newton = (
        "def find_zero(xs):\n    x = 0.0\n    for _ in range(200):\n"
        "        d = sum(i * c * x ** (i - 1) for i, c in enumerate(xs) if i)\n"
        "        x = x - poly(xs, x) / d if d else x + 0.1\n    return x\n"
    )
    cheat = "def poly(xs, x):\n    return 0.0\ndef find_zero(xs):\n    return 0.0\n"
    rows = [
        sample(fenced(code), i, prompt=POLY_PROMPT, test=POLY_TESTS, entry_point="find_zero")
        for i, code in enumerate([newton, cheat])
    ]
    assert unit_tests(rows) == [1.0, 0.0]
    parts = program_parts(rows[0])
    assert "def poly" in parts.preamble and "find_zero" not in parts.preamble
    assert parts.preamble.startswith("import math\n")
