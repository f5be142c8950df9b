"""Rewards score whole samples; failures are recorded and excluded, never scored 0."""

from __future__ import annotations

import asyncio
import math
import threading
from pathlib import Path

import pytest
import torch

from polyrl.core.record import mark_invalid, strings, text_record
from polyrl.core.registry import UnknownNameError
from polyrl.core.rollout.rewards import (
    RewardConfig,
    RewardTerm,
    Sample,
    ascore,
    exact_match,
    extract_answer,
    is_batched,
    regex_format,
    register_reward,
    resolve,
    samples_from_record,
    score,
)


def line_of(text: str) -> int:
    """The line of this file that raises ``text`` (counted here, not by the code under test)."""
    lines = Path(__file__).read_text().splitlines()
    return next(i for i, line in enumerate(lines, 1) if "raise" in line and text in line)


# Test-only rewards, registered once when this module is imported.
CALLS: dict[str, list] = {"batched": [], "count": []}


@register_reward("test_raise_on_bad")
def _raise_on_bad(sample: Sample) -> float:
    if sample.response == "bad":
        raise ValueError("cannot parse 'bad'")
    return 1.0


@register_reward("test_nan_on_bad")
def _nan_on_bad(sample: Sample) -> float:
    return float("nan") if sample.response == "bad" else 1.0


@register_reward("test_none_on_bad")
def _none_on_bad(sample: Sample) -> float | None:
    return None if sample.response == "bad" else 1.0


@register_reward("test_str_on_bad")
def _str_on_bad(sample: Sample) -> object:
    return "oops" if sample.response == "bad" else 1.0


IN_FLIGHT = {"now": 0, "peak": 0}


@register_reward("test_in_flight")
async def _in_flight(sample: Sample) -> float:
    """Counts the calls running at once (they overlap at their awaits)."""
    IN_FLIGHT["now"] += 1
    IN_FLIGHT["peak"] = max(IN_FLIGHT["peak"], IN_FLIGHT["now"])
    for _ in range(3):
        await asyncio.sleep(0)
    IN_FLIGHT["now"] -= 1
    return float(sample.index)


RELEASE = threading.Event()  # set by a test to let a stuck sync reward finish


@register_reward("test_hangs_on_slow")
def _hangs_on_slow(sample: Sample) -> float:
    if sample.response == "slow":
        RELEASE.wait(60)
    return 1.0


@register_reward("test_async_hangs_on_slow")
async def _async_hangs_on_slow(sample: Sample) -> float:
    if sample.response == "slow":
        await asyncio.sleep(60)
    return 2.0


@register_reward("test_batched_hangs", batched=True)
def _batched_hangs(samples: list[Sample]) -> list[float]:
    if any(s.response == "slow" for s in samples):
        RELEASE.wait(60)
    return [1.0] * len(samples)


@register_reward("test_batched_row_error", batched=True)
def _batched_row_error(samples: list[Sample]) -> list:
    return [ValueError("cannot score 'bad'") if s.response == "bad" else 3.0 for s in samples]


@register_reward("test_where")
def _where(sample: Sample) -> float:
    """Records the thread and grad mode each call ran with."""
    CALLS.setdefault("where", []).append(
        (threading.current_thread() is threading.main_thread(), torch.is_grad_enabled())
    )
    return 0.0


@register_reward("test_async_raise")
async def _async_raise(sample: Sample) -> float:
    await asyncio.sleep(0)
    if sample.response == "bad":
        raise RuntimeError("remote judge down")
    return 0.5


@register_reward("test_len_batched", batched=True)
def _len_batched(samples: list[Sample], scale: float = 1.0) -> list[float]:
    CALLS["batched"].append([s.index for s in samples])
    return [scale * len(s.response) for s in samples]


@register_reward("test_short_batched", batched=True)
def _short_batched(samples: list[Sample]) -> list[float]:
    return [1.0] * (len(samples) - 1)


@register_reward("test_counting")
def _counting(sample: Sample) -> float:
    CALLS["count"].append(sample.index)
    return 2.0


def make_record(responses: list[str], answers: list | None = None, metas: list | None = None):
    n = len(responses)
    if metas is None:
        metas = [{"answer": a} for a in (answers if answers is not None else [None] * n)]
    return text_record(
        prompt_ids=[[1, 2, 3]] * n,
        response_ids=[[4, 5]] * n,
        rollout_logprobs=[[-0.1, -0.2]] * n,
        policy=["actor"] * n,
        uid=list(range(n)),
        pad_id=0,
        prompt_text=[f"question {i}" for i in range(n)],
        response_text=responses,
        meta=metas,
    )


def sample(response: str, answer: object = None) -> Sample:
    return Sample(prompt="q", response=response, answer=answer, meta={"answer": answer})


def cfg(*terms: RewardTerm) -> RewardConfig:
    c = RewardConfig(terms=list(terms))
    c.validate()
    return c


# ---------------------------------------------------------------- exact_match


@pytest.mark.parametrize(
    ("response", "answer", "expected"),
    [
        ("<think>6*11+2</think> <answer>68</answer>", "68", 1.0),
        ("<answer> 68. </answer>", 68, 1.0),
        ("<answer>67</answer>", "68", 0.0),
        ("first <answer>1</answer> then <answer>68</answer>", "68", 1.0),
        ("so the result is \\boxed{68}", "68", 1.0),
        ("\\boxed{\\frac{1}{2}}", "\\frac{1}{2}", 1.0),
        ("\\boxed{3} no wait \\boxed{4}", "3", 0.0),
        ("  68  ", "68", 1.0),
        ("68", "68.0", 1.0),
        ("<answer>68.0</answer>", 68, 1.0),
        ("1,000", "1000", 1.0),
        ("Paris  is   nice.", "Paris is nice", 1.0),
        ("paris", "Paris", 0.0),
        ("68", "69", 0.0),
    ],
)
def test_exact_match(response: str, answer: object, expected: float) -> None:
    assert exact_match(sample(response, answer)) == expected


def test_extract_answer_prefers_tag_then_boxed() -> None:
    assert extract_answer("\\boxed{1} <answer>2</answer>") == "2"
    assert extract_answer("x \\boxed{a{b}c} y") == "a{b}c"
    assert extract_answer("plain") == "plain"


def test_exact_match_without_answer_raises() -> None:
    with pytest.raises(ValueError, match="exact_match needs a ground-truth answer"):
        exact_match(sample("68", None))


# ---------------------------------------------------------------- regex_format


def test_regex_format_default_pattern() -> None:
    assert regex_format(sample("<think>a\nb</think>\n<answer>4</answer>")) == 1.0
    assert regex_format(sample("<answer>4</answer>")) == 0.0
    assert regex_format(sample("<think>a</think><answer>4</answer> trailing")) == 0.0


def test_regex_format_modes() -> None:
    assert regex_format(sample("value: 42 units"), pattern=r"\d+", mode="search") == 1.0
    assert regex_format(sample("value: 42 units"), pattern=r"\d+", mode="fullmatch") == 0.0
    assert regex_format(sample("no digits"), pattern=r"\d+", mode="search") == 0.0
    with pytest.raises(ValueError, match="mode"):
        regex_format(sample("x"), pattern="x", mode="match")


# ---------------------------------------------------------------- verl wrappers


GSM8K_CASES = [
    ("Natalia sold 48 + 24 = 72 clips.\n#### 72", "72"),
    ("Natalia sold 48 + 24 = 72 clips.\n#### 71", "72"),
    ("The answer is 72", "72"),
    ("#### 1,234", "1234"),
]


@pytest.mark.parametrize(("response", "gold"), GSM8K_CASES)
def test_gsm8k_matches_verl(response: str, gold: str) -> None:
    from verl.utils.reward_score import gsm8k as verl_gsm8k

    fn = resolve("gsm8k")
    assert fn(sample(response, gold)) == float(verl_gsm8k.compute_score(response, gold))
    flexible = verl_gsm8k.compute_score(response, gold, method="flexible")
    assert fn(sample(response, gold), method="flexible") == float(flexible)


def test_gsm8k_scores_right_and_wrong_and_cuts_raw_solution() -> None:
    fn = resolve("gsm8k")
    assert fn(sample("... #### 72", "72")) == 1.0
    assert fn(sample("... #### 71", "72")) == 0.0
    # a raw dataset answer: worked solution then '#### 72'
    assert fn(sample("... #### 72", "48/2 = 24 and 48+24 = 72\n#### 72")) == 1.0


MATH_CASES = [
    ("so the answer is $\\boxed{\\frac{1}{2}}$", "\\frac12"),
    ("so the answer is $\\boxed{\\frac{1}{3}}$", "\\frac12"),
    ("The final answer is \\boxed{10}", "10"),
    ("no box here: 10", "10"),
]


@pytest.mark.parametrize(("response", "gold"), MATH_CASES)
def test_math_matches_verl(response: str, gold: str) -> None:
    from verl.utils.reward_score import math_reward as verl_math

    assert resolve("math")(sample(response, gold)) == float(verl_math.compute_score(response, gold))


def test_math_right_and_wrong() -> None:
    fn = resolve("math")
    assert fn(sample(*MATH_CASES[0])) == 1.0
    assert fn(sample(*MATH_CASES[1])) == 0.0


@pytest.mark.parametrize(
    ("response", "gold"),
    [("Let me think. Answer: 5", "5"), ("Answer: 6", "5"), ("\\boxed{5}", "5")],
)
def test_math_dapo_matches_verl(response: str, gold: str) -> None:
    from verl.utils.reward_score import math_dapo as verl_dapo

    expected = verl_dapo.compute_score(response, gold)
    fn = resolve("math_dapo")
    assert fn(sample(response, gold)) == float(expected["score"])
    assert fn(sample(response, gold), field="acc") == float(expected["acc"])


def test_math_dapo_right_and_wrong() -> None:
    fn = resolve("math_dapo")
    assert fn(sample("Answer: 5", "5")) == 1.0
    assert fn(sample("Answer: 6", "5")) == -1.0


# ---------------------------------------------------------------- score()


def test_score_exact_match_record() -> None:
    td = make_record(["<answer>68</answer>", "\\boxed{3}", "7"], answers=["68", "4", 7])
    metrics = score(td, RewardConfig())
    assert td["reward"].dtype == torch.float32
    assert td["reward"].tolist() == [1.0, 0.0, 1.0]
    assert td["reward_terms/exact_match"].tolist() == [1.0, 0.0, 1.0]
    assert td["valid"].tolist() == [True, True, True]
    assert metrics["reward/mean"] == pytest.approx(2 / 3)
    assert metrics["reward/exact_match/mean"] == pytest.approx(2 / 3)
    assert metrics["reward/errors"] == 0
    assert metrics["reward/error_rate"] == 0


@pytest.mark.parametrize(
    ("name", "needle"),
    [
        ("test_raise_on_bad", "reward 'test_raise_on_bad' raised ValueError: cannot parse 'bad'"),
        ("test_nan_on_bad", "reward 'test_nan_on_bad' returned nan"),
        ("test_none_on_bad", "reward 'test_none_on_bad' returned None"),
        ("test_str_on_bad", "reward 'test_str_on_bad' returned non-numeric str 'oops'"),
        ("test_async_raise", "reward 'test_async_raise' raised RuntimeError: remote judge down"),
    ],
)
def test_failing_reward_marks_row_invalid_not_zero(name: str, needle: str) -> None:
    td = make_record(["good", "bad", "good"])
    metrics = score(td, cfg(RewardTerm(name)))
    reward = td["reward"]
    assert math.isnan(reward[1].item())  # never 0
    good = 0.5 if name == "test_async_raise" else 1.0
    assert reward[0].item() == good and reward[2].item() == good
    assert td["valid"].tolist() == [True, False, True]
    errors = strings(td, "error")
    assert errors[0] == "" and errors[2] == ""
    if "raised" in needle:  # where it raised: this file, the line of its raise statement
        cause = needle.rpartition(": ")[2]
        needle += f" ({__file__}:{line_of(cause)})"
    assert errors[1] == needle
    assert math.isnan(td[f"reward_terms/{name}"][1].item())
    assert metrics["reward/errors"] == 1
    assert metrics["reward/error_rate"] == pytest.approx(1 / 3)
    assert metrics["reward/mean"] == good


def test_exact_match_without_ground_truth_is_an_error_not_zero() -> None:
    td = make_record(["68", "68"], metas=[{"answer": "68"}, {}])
    metrics = score(td, RewardConfig())
    assert td["reward"][0].item() == 1.0
    assert math.isnan(td["reward"][1].item())
    assert "reward 'exact_match' raised ValueError: exact_match needs" in strings(td, "error")[1]
    assert metrics["reward/errors"] == 1


def test_failure_in_one_term_drops_row_and_keeps_other_terms_value() -> None:
    td = make_record(["good", "bad"])
    score(td, cfg(RewardTerm("test_counting"), RewardTerm("test_raise_on_bad")))
    assert td["reward"][0].item() == 3.0
    assert math.isnan(td["reward"][1].item())
    assert td["reward_terms/test_counting"].tolist() == [2.0, 2.0]
    assert td["valid"].tolist() == [True, False]


def test_rows_already_invalid_are_not_scored() -> None:
    td = make_record(["a", "b", "c"])
    mark_invalid(td, [1], ["engine failed"])
    CALLS["count"].clear()
    metrics = score(td, cfg(RewardTerm("test_counting")))
    assert CALLS["count"] == [0, 2]
    assert strings(td, "error")[1] == "engine failed"
    assert math.isnan(td["reward"][1].item())
    assert metrics["reward/errors"] == 0 and metrics["reward/error_rate"] == 0


@pytest.mark.parametrize(("concurrency", "peak"), [(256, 8), (3, 3), (1, 1)])
def test_async_rewards_overlap_up_to_the_concurrency_limit(concurrency: int, peak: int) -> None:
    td = make_record([f"r{i}" for i in range(8)])
    IN_FLIGHT.update(now=0, peak=0)
    c = RewardConfig(terms=[RewardTerm("test_in_flight")], concurrency=concurrency)
    c.validate()
    score(td, c)
    assert IN_FLIGHT["peak"] == peak
    assert td["reward"].tolist() == [float(i) for i in range(8)]


@pytest.mark.parametrize(
    ("name", "good"), [("test_hangs_on_slow", 1.0), ("test_async_hangs_on_slow", 2.0)]
)
def test_a_reward_past_its_timeout_fails_its_row_not_zero(name: str, good: float) -> None:
    """Issue 23: a reward that hangs held up the whole run. Now the call's row fails with
    a timeout error (never 0) and the other rows are scored."""
    RELEASE.clear()
    td = make_record(["fast", "slow", "fast"])
    try:
        metrics = score(td, cfg(RewardTerm(name, timeout_s=0.3)))
    finally:
        RELEASE.set()  # the abandoned sync call may finish now
    assert td["reward"][0].item() == good and td["reward"][2].item() == good
    assert math.isnan(td["reward"][1].item())
    assert td["valid"].tolist() == [True, False, True]
    error = strings(td, "error")[1]
    assert error.startswith(f"reward {name!r} timed out: a call took more than 0.3 s")
    assert "timeout_s" in error
    assert metrics["reward/errors"] == 1


def test_a_batched_call_past_its_timeout_fails_the_rows_it_was_given() -> None:
    RELEASE.clear()
    td = make_record(["a", "slow"])
    mark_invalid(td, [0], ["engine failed"])
    try:
        score(td, cfg(RewardTerm("test_batched_hangs", timeout_s=0.3)))
    finally:
        RELEASE.set()
    assert td["valid"].tolist() == [False, False]
    assert strings(td, "error")[0] == "engine failed"  # not given to the call
    assert "timed out: a call took more than 0.3 s" in strings(td, "error")[1]
    td = make_record(["a", "b", "slow"])
    RELEASE.clear()
    try:  # a batched call of n rows gets n * timeout_s
        score(td, cfg(RewardTerm("test_batched_hangs", timeout_s=0.1)))
    finally:
        RELEASE.set()
    assert "a batched call of 3 rows took more than 0.3 s" in strings(td, "error")[2]


def test_a_batched_reward_fails_only_the_rows_it_could_not_score() -> None:
    td = make_record(["good", "bad", "good"])
    metrics = score(td, cfg(RewardTerm("test_batched_row_error")))
    assert td["valid"].tolist() == [True, False, True]
    assert td["reward"][0].item() == 3.0 and td["reward"][2].item() == 3.0
    assert strings(td, "error")[1] == (
        "reward 'test_batched_row_error' raised ValueError: cannot score 'bad'"
    )
    assert metrics["reward/errors"] == 1


def test_sync_rewards_with_a_timeout_keep_the_callers_grad_mode() -> None:
    CALLS["where"] = []
    td = make_record(["a", "b"])
    with torch.no_grad():
        score(td, cfg(RewardTerm("test_where")))  # default timeout: on a helper thread
        score(td, cfg(RewardTerm("test_where", timeout_s=None)))  # no limit: in place
    assert CALLS["where"] == [(False, False)] * 2 + [(True, False)] * 2


@pytest.mark.parametrize("bad", [0, -1.0, float("inf"), "10", True])
def test_timeout_must_be_positive_seconds_or_null(bad: object) -> None:
    with pytest.raises(ValueError, match="timeout_s must be a positive number"):
        cfg(RewardTerm("exact_match", timeout_s=bad))
    assert cfg(RewardTerm("exact_match", timeout_s=None)).terms[0].timeout_s is None
    assert RewardTerm("exact_match").timeout_s == 60.0


def test_score_inside_running_loop_and_ascore() -> None:
    async def main() -> tuple[dict, dict]:
        a, b = make_record(["1", "2"], ["1", "3"]), make_record(["1"], ["1"])
        m1 = score(a, RewardConfig())  # falls back to a helper thread
        m2 = await ascore(b, RewardConfig())
        return m1, m2

    m1, m2 = asyncio.run(main())
    assert m1["reward/mean"] == 0.5 and m2["reward/mean"] == 1.0


def test_batched_reward_receives_the_list() -> None:
    assert is_batched(resolve("test_len_batched")) and not is_batched(exact_match)
    # the registry keeps the fact; the function carries no mark of it
    assert resolve("test_len_batched").__dict__ == {}
    td = make_record(["a", "bbb", "cc", "dddd"])
    mark_invalid(td, [3], ["earlier failure"])
    CALLS["batched"].clear()
    score(td, cfg(RewardTerm("test_len_batched", args={"scale": 2.0})))
    assert CALLS["batched"] == [[0, 1, 2]]  # one call with every still-valid row
    assert td["reward"][:3].tolist() == [2.0, 6.0, 4.0]


def test_batched_reward_with_wrong_length_fails_every_row() -> None:
    td = make_record(["a", "b"])
    metrics = score(td, cfg(RewardTerm("test_short_batched")))
    assert metrics["reward/errors"] == 2
    assert td["valid"].tolist() == [False, False]
    assert "returned 1 values for 2" in strings(td, "error")[0]


def test_weighted_combination() -> None:
    responses = ["<think>x</think><answer>68</answer>", "<answer>68</answer>", "<answer>1</answer>"]
    td = make_record(responses, ["68", "68", "68"])
    c = cfg(RewardTerm("exact_match", weight=1.0), RewardTerm("regex_format", weight=0.25))
    metrics = score(td, c)
    em, fmt = [1.0, 1.0, 0.0], [1.0, 0.0, 0.0]
    expected = [1.0 * a + 0.25 * b for a, b in zip(em, fmt, strict=True)]
    assert td["reward"].tolist() == pytest.approx(expected)
    assert td["reward_terms/exact_match"].tolist() == em
    assert td["reward_terms/regex_format"].tolist() == fmt
    assert metrics["reward/regex_format/mean"] == pytest.approx(1 / 3)
    assert metrics["reward/mean"] == pytest.approx(sum(expected) / 3)


def test_same_reward_twice_needs_labels() -> None:
    terms = [RewardTerm("regex_format"), RewardTerm("regex_format", args={"pattern": "a"})]
    with pytest.raises(ValueError, match="label"):
        cfg(*terms)
    terms[1].label = "starts_a"
    td = make_record(["abc"])
    score(td, cfg(*terms))
    assert td["reward_terms/starts_a"].tolist() == [0.0]  # fullmatch of 'a' on 'abc'


def test_import_path_reward() -> None:
    td = make_record(["<answer>5</answer>", "6"], ["5", "5"])
    c = cfg(RewardTerm("polyrl.core.rollout.rewards:exact_match"))
    metrics = score(td, c)
    assert td["reward"].tolist() == [1.0, 0.0]
    assert metrics["reward/polyrl.core.rollout.rewards:exact_match/mean"] == 0.5


def test_samples_from_record_and_override() -> None:
    td = make_record(["r0", "r1"], metas=[{"answer": 1, "images": ["img"]}, {"answer": None}])
    s = samples_from_record(td)
    assert [x.index for x in s] == [0, 1]
    assert s[0].prompt == "question 0" and s[0].response == "r0"
    assert s[0].answer == 1 and s[0].images == ["img"] and s[1].images is None
    override = [Sample("q", "<answer>1</answer>", "1", {}, index=i) for i in range(2)]
    score(td, RewardConfig(), samples=override)
    assert td["reward"].tolist() == [1.0, 1.0]
    with pytest.raises(ValueError, match="1 samples"):
        score(td, RewardConfig(), samples=override[:1])


# ---------------------------------------------------------------- config


def test_default_config_is_exact_match_and_terms_are_not_shared() -> None:
    a, b = RewardConfig(), RewardConfig()
    assert [t.name for t in a.terms] == ["exact_match"] and a.terms[0].weight == 1.0
    a.terms[0].weight = 3.0
    a.terms[0].args["x"] = 1
    assert b.terms[0].weight == 1.0 and b.terms[0].args == {}


def test_config_accepts_dicts_and_names() -> None:
    c = RewardConfig(terms=[{"name": "gsm8k", "weight": 0.5}, "regex_format"])
    c.validate()
    assert [(t.name, t.weight) for t in c.terms] == [("gsm8k", 0.5), ("regex_format", 1.0)]
    with pytest.raises(ValueError, match="unknown keys"):
        RewardConfig(terms=[{"name": "gsm8k", "wieght": 1.0}])


def test_unknown_reward_name_hints_nearest() -> None:
    c = RewardConfig(terms=[RewardTerm("exact_mach")])
    with pytest.raises(UnknownNameError, match="did you mean 'exact_match'"):
        c.validate()


def test_bad_args_fail_at_config_time() -> None:
    with pytest.raises(ValueError, match="has no option 'patern'"):
        RewardConfig(terms=[RewardTerm("regex_format", args={"patern": "x"})]).validate()


def test_empty_terms_rejected() -> None:
    with pytest.raises(ValueError, match="empty"):
        RewardConfig(terms=[]).validate()


@register_reward("test_exits")
def _exits(sample: Sample) -> float:
    if sample.response == "bad":
        raise SystemExit(3)
    return 1.0


@register_reward("test_async_exits")
async def _async_exits(sample: Sample) -> float:
    await asyncio.sleep(0)
    if sample.response == "bad":
        raise SystemExit(4)
    return 1.0


@register_reward("test_interrupts")
def _interrupts(sample: Sample) -> float:
    if sample.response == "bad":
        raise KeyboardInterrupt("not a Ctrl-C")
    return 1.0


@register_reward("test_batched_exits", batched=True)
def _batched_exits(samples: list[Sample]) -> list[float]:
    raise SystemExit("batched bye")


@pytest.mark.parametrize(
    ("name", "timeout_s", "what"),
    [
        ("test_exits", 60.0, "SystemExit(3)"),  # on the term's helper thread
        ("test_exits", None, "SystemExit(3)"),  # in place, no limit
        ("test_async_exits", 60.0, "SystemExit(4)"),  # inside the event loop's task
        ("test_interrupts", 60.0, "KeyboardInterrupt(not a Ctrl-C)"),  # raised by the reward
    ],
)
def test_a_reward_that_exits_fails_its_row_and_the_scoring_goes_on(name, timeout_s, what):
    td = make_record(["good", "bad", "good"])
    metrics = score(td, cfg(RewardTerm(name, timeout_s=timeout_s)))
    assert td["valid"].tolist() == [True, False, True]
    assert td["reward"][0].item() == 1.0 and math.isnan(td["reward"][1].item())
    error = strings(td, "error")[1]
    cause = "KeyboardInterrupt(" if "Keyboard" in what else what
    assert error.startswith(f"reward {name!r} raised {what} ({__file__}:{line_of(cause)})")
    assert "cannot stop the run" in error
    assert metrics["reward/errors"] == 1


def test_a_batched_reward_that_exits_fails_its_rows() -> None:
    td = make_record(["a", "b"])
    metrics = score(td, cfg(RewardTerm("test_batched_exits")))
    assert td["valid"].tolist() == [False, False] and metrics["reward/errors"] == 2
    assert "raised SystemExit(batched bye)" in strings(td, "error")[0]
