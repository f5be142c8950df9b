"""Rewards: plain callables that score whole samples and never hide their failures.

A reward is a function (sync or ``async def``) that receives a :class:`Sample` plus the
keyword ``args`` of its :class:`RewardTerm` and returns a number. A *batched* reward
(registered with ``batched=True``, e.g. a CLIP model) receives ``list[Sample]`` and returns
one number per sample. Recipes name rewards by registered short name (``"gsm8k"``) or by
import path (``"my_pkg.rewards:score"``).

A reward that raises, or returns None, NaN, inf or something that is not a number, does
*not* score the row 0: :func:`score` records the error text on the row, marks it invalid so
the update leaves it out, and counts it in the metrics. Only the rows a term could not
score fail: a per-row reward fails for the rows it raised on; a batched reward that cannot
score some rows puts an exception in their place in the list it returns (a batched call
that raises scored none of its rows, so all of them fail).

Every call has a time limit, the term's ``timeout_s`` (default 60 s; a batched call of
``n`` rows gets ``n * timeout_s``; null: none). A call past it fails its rows with a
timeout error -- never a 0. Sync rewards with a limit run on a helper thread, one call at
a time per term; a call past its limit cannot be stopped, so its thread is left to finish
on its own and the next call gets a new one.

:func:`score` writes into the record:

- ``reward [B]`` (float32): the weighted sum of the terms; NaN for failed rows.
- ``reward_terms/<key> [B]`` (float32), one flat key per term (``key`` is the term's
  ``label``, else its ``name``): that term's raw, unweighted value; NaN where the term
  failed or the row was already invalid.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import inspect
import math
import numbers
import queue
import re
import threading
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from tensordict import TensorDict

from polyrl.core.config import doc, doc_factory
from polyrl.core.record import mark_invalid, set_strings, strings
from polyrl.core.registry import REWARDS
from polyrl.core.rollout.workflow import run_sync
from polyrl.core.runner.failures import where


@dataclass
class Sample:
    """Everything a reward may look at for one record row."""

    prompt: str
    response: str
    answer: Any  # ground truth (meta["answer"]); None when the dataset has none
    meta: dict  # the dataset row plus anything the workflow added
    images: list | None = None
    index: int = 0  # row in the record


def register_reward(name: str, *, batched: bool = False) -> Callable[[Callable], Callable]:
    """Register a reward under ``name``; ``batched`` ones get the whole list of samples."""

    def add(fn: Callable) -> Callable:
        REWARDS.register(name, fn, traits={"batched": batched})
        return fn

    return add


def is_batched(fn: Callable) -> bool:
    """Whether ``fn`` takes ``list[Sample]`` (registered by ``register_reward(...,
    batched=True)``; the registry keeps that fact, the function carries no mark)."""
    return bool(REWARDS.traits(fn).get("batched", False))


def resolve(name: str) -> Callable:
    """The reward function for a short name or ``package.module:function`` path."""
    fn = REWARDS.get(name)
    if not callable(fn):
        raise TypeError(f"reward {name!r} resolved to {type(fn).__name__}, not a callable")
    return fn


# ---------------------------------------------------------------------------- config


@dataclass
class RewardTerm:
    """One reward in the weighted sum."""

    name: str = dataclasses.field(
        metadata={"doc": "registered reward name or 'package.module:function'"}
    )
    weight: float = doc(1.0, "multiplier of this term in the summed reward")
    args: Any = doc({}, "options of the reward", options=REWARDS, chooser="name")
    label: str = doc("", "key for metrics and reward_terms/<key>; defaults to name")
    timeout_s: float | None = doc(
        60.0,
        "seconds one call may take before its rows fail with a timeout error (never 0); "
        "a batched call of n rows gets n * timeout_s; null: no limit",
    )
    actor: dict = doc(
        {},
        "Ray mode: score this term on its own Ray actor with these resources, "
        "e.g. {num_cpus: 1, num_gpus: 0.25}; a reward model loads there once "
        "and stays. Empty: in the driver (local mode always runs in-process)",
    )

    @property
    def key(self) -> str:
        return self.label or self.name


REWARD_ACTOR_KEYS = ("num_cpus", "num_gpus", "threads")


def _as_term(value: Any) -> RewardTerm:
    if isinstance(value, RewardTerm):
        return value
    if isinstance(value, str):
        return RewardTerm(value)
    if isinstance(value, dict):
        known = {f.name for f in dataclasses.fields(RewardTerm)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"reward term has unknown keys {unknown}; valid: {sorted(known)}")
        return RewardTerm(**value)
    raise TypeError(f"a reward term must be a RewardTerm, dict or name, not {type(value).__name__}")


@dataclass
class RewardConfig:
    """Which rewards score the rollouts and how they are weighted."""

    terms: list[RewardTerm] = doc_factory(
        lambda: [RewardTerm("exact_match")],
        "reward terms; the row reward is sum(weight * value) over them",
    )
    concurrency: int = doc(256, "most async reward calls in flight at once")

    def __post_init__(self) -> None:
        self.terms = [_as_term(t) for t in self.terms]

    def validate(self) -> None:
        """Resolve every reward now, so a typo fails at config time, not mid-run."""
        self.terms = [_as_term(t) for t in self.terms]
        if not self.terms:
            raise ValueError("reward.terms is empty; name at least one reward")
        if self.concurrency < 1:
            raise ValueError(f"reward.concurrency must be >= 1, got {self.concurrency}")
        seen: set[str] = set()
        for term in self.terms:
            resolve(term.name)
            if term.key in seen:
                raise ValueError(f"two reward terms share the key {term.key!r}; give one a label")
            seen.add(term.key)
            if not math.isfinite(float(term.weight)):
                raise ValueError(f"reward {term.name!r} has non-finite weight {term.weight}")
            limit = term.timeout_s
            if limit is not None and (
                isinstance(limit, bool)
                or not isinstance(limit, int | float)
                or not 0 < limit < math.inf
            ):
                raise ValueError(
                    f"reward term {term.key!r}: timeout_s must be a positive number of "
                    f"seconds or null (no limit), got {term.timeout_s!r}"
                )
            term.args = REWARDS.bind(term.name, term.args, f"reward term {term.key!r} args")
            unknown = sorted(set(term.actor) - set(REWARD_ACTOR_KEYS))
            if unknown:
                raise ValueError(
                    f"reward term {term.key!r}: unknown actor keys {unknown}; "
                    f"valid: {list(REWARD_ACTOR_KEYS)}"
                )


# ---------------------------------------------------------------------------- scoring


def samples_from_record(record: TensorDict) -> list[Sample]:
    """Build one :class:`Sample` per row from the record's non-tensor fields."""
    n = record.batch_size[0]
    keys = set(record.keys())

    def column(key: str, default: Any) -> list:
        return strings(record, key) if key in keys else [default] * n

    prompts = column("prompt_text", "")
    responses = column("response_text", "")
    metas = [m if isinstance(m, dict) else {} for m in column("meta", None)]
    return [
        Sample(
            prompt=p or "",
            response=r or "",
            answer=m.get("answer"),
            meta=m,
            images=m.get("images"),
            index=i,
        )
        for i, (p, r, m) in enumerate(zip(prompts, responses, metas, strict=True))
    ]


def _short(value: Any, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _check_value(name: str, value: Any) -> float | str:
    """The value as a float, or an error text when it is not a finite number."""
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        value = value.item()
    if value is None:
        return f"reward {name!r} returned None"
    if not isinstance(value, numbers.Real):
        return f"reward {name!r} returned non-numeric {type(value).__name__} {_short(value)}"
    out = float(value)
    if not math.isfinite(out):
        return f"reward {name!r} returned {out}"
    return out


class _Escaped(Exception):
    """A reward raised a ``BaseException`` that is not an ``Exception`` (``SystemExit``, a
    ``KeyboardInterrupt`` of its own): it is that row's error, never the trainer's end."""

    def __init__(self, exc: BaseException) -> None:
        super().__init__(exc)
        self.exc = exc


def _contain(exc: BaseException) -> Exception:
    """What a reward raised, as an error to record on its rows. Only cancellation and a
    Ctrl-C (a KeyboardInterrupt in the main thread, where signals arrive) go on."""
    if isinstance(exc, Exception):
        return exc
    if isinstance(exc, asyncio.CancelledError) or (
        isinstance(exc, KeyboardInterrupt) and threading.current_thread() is threading.main_thread()
    ):
        raise exc
    return _Escaped(exc)


def _raised(name: str, exc: BaseException) -> str:
    if isinstance(exc, _Escaped):
        inner = exc.exc
        return (
            f"reward {name!r} raised {type(inner).__name__}({inner}){where(inner)}; a reward "
            "cannot stop the run: return a number, or raise an Exception for a row it "
            "cannot score"
        )
    return f"reward {name!r} raised {type(exc).__name__}: {exc}{where(exc)}"


class _Timeout(Exception):
    """A reward call ran past its term's ``timeout_s``."""


class _SyncCaller:
    """Runs one term's sync calls one at a time on a daemon thread, so that a call can be
    given up on: a call past its limit keeps that thread (a thread cannot be stopped) and
    the next call gets a fresh one. Daemon, so a hung reward never holds up exit."""

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue | None = None

    async def call(self, fn: Callable, arg: Any, kwargs: dict, timeout: float) -> Any:
        loop = asyncio.get_running_loop()
        done = loop.create_future()
        if self._jobs is None:
            self._jobs = queue.SimpleQueue()
            state = (torch.is_grad_enabled(), _cuda_device())
            threading.Thread(
                target=_serve, args=(self._jobs, state), name="polyrl-reward", daemon=True
            ).start()
        self._jobs.put((fn, arg, kwargs, loop, done))
        try:
            return await asyncio.wait_for(done, timeout)
        except TimeoutError:
            self.close()  # the thread is stuck in this call; leave it
            raise _Timeout from None

    def close(self) -> None:
        if self._jobs is not None:
            self._jobs.put(None)
            self._jobs = None


def _cuda_device() -> int | None:
    return torch.cuda.current_device() if torch.cuda.is_initialized() else None


def _serve(jobs: queue.SimpleQueue, state: tuple) -> None:
    """The helper thread: the caller's grad mode and CUDA device (both per thread), then
    calls until told to stop."""
    grad, device = state
    torch.set_grad_enabled(grad)
    if device is not None:
        torch.cuda.set_device(device)
    while (job := jobs.get()) is not None:
        fn, arg, kwargs, loop, done = job
        try:
            outcome = (True, fn(arg, **kwargs))
        except Exception as e:  # handed to the caller, which decides
            outcome = (False, e)
        except BaseException as e:  # no signal arrives in this thread: the reward raised it
            outcome = (False, _Escaped(e))
        # a closed loop means the caller gave up on this call: nobody to tell
        with contextlib.suppress(RuntimeError):
            loop.call_soon_threadsafe(_settle, done, outcome)


def _settle(done: asyncio.Future, outcome: tuple) -> None:
    if not done.done():
        ok, value = outcome
        done.set_result(value) if ok else done.set_exception(value)


async def _guarded(awaitable: Awaitable) -> Any:
    """Awaits an async reward's awaitable here, before it becomes a task: a ``SystemExit``
    it raises inside a task would stop the event loop itself."""
    try:
        return await awaitable
    except Exception:
        raise
    except BaseException as e:
        raise _contain(e) from None


async def _limited(awaitable: Awaitable, timeout: float | None) -> Any:
    try:
        return await asyncio.wait_for(_guarded(awaitable), timeout)
    except TimeoutError:
        raise _Timeout from None


def _error(term: RewardTerm, exc: BaseException, rows: int = 1) -> str:
    if isinstance(exc, _Timeout):
        assert term.timeout_s is not None  # only a call with a time limit times out
        limit = term.timeout_s * rows
        what = f"a batched call of {rows} rows" if rows > 1 else "a call"
        return (
            f"reward {term.name!r} timed out: {what} took more than {limit:g} s "
            f"(reward term timeout_s = {term.timeout_s:g})"
        )
    return _raised(term.name, exc)


@dataclass
class _Calls:
    """How one term's reward ``fn`` is called, row by row or batched alike."""

    term: RewardTerm
    fn: Callable
    sem: asyncio.Semaphore
    caller: _SyncCaller

    async def start(self, arg: Any, timeout: float | None) -> Any:
        """``fn(arg, **term.args)``: a sync reward with a limit runs on the term's helper
        thread within it; otherwise in place. An async reward's awaitable is returned
        unawaited."""
        if timeout is not None and not inspect.iscoroutinefunction(self.fn):
            return await self.caller.call(self.fn, arg, self.term.args, timeout)
        return self.fn(arg, **self.term.args)

    async def finish(self, awaitable: Awaitable, timeout: float | None) -> Any:
        """An async reward's result, within ``timeout`` and the run's concurrency bound."""
        async with self.sem:
            return await _limited(awaitable, timeout)


async def _run_term(
    term: RewardTerm, fn: Callable, samples: list[Sample], sem: asyncio.Semaphore
) -> list[float | str]:
    """One value (or error text) per sample; async calls of this term run concurrently."""
    calls = _Calls(term, fn, sem, _SyncCaller())
    try:
        return await (_run_batched if is_batched(fn) else _run_rows)(calls, samples)
    finally:
        calls.caller.close()


async def _run_batched(calls: _Calls, samples: list[Sample]) -> list[float | str]:
    term = calls.term
    name = term.name
    timeout = None if term.timeout_s is None else term.timeout_s * max(1, len(samples))
    try:
        values = await calls.start(samples, timeout)
        if inspect.isawaitable(values):
            values = await calls.finish(values, timeout)
    except BaseException as e:
        return [_error(term, _contain(e), len(samples))] * len(samples)
    if isinstance(values, torch.Tensor):
        values = values.tolist()
    if not isinstance(values, Sequence) or isinstance(values, str | bytes):
        err = f"reward {name!r} (batched) returned {type(values).__name__}, not a list"
        return [err] * len(samples)
    if len(values) != len(samples):
        err = f"reward {name!r} (batched) returned {len(values)} values for {len(samples)}"
        return [err] * len(samples)
    # an exception in a row's place: the reward could not score that row
    return [_raised(name, v) if isinstance(v, Exception) else _check_value(name, v) for v in values]


async def _run_rows(calls: _Calls, samples: list[Sample]) -> list[float | str]:
    term = calls.term
    name = term.name
    out: list[float | str] = [""] * len(samples)
    pending: list[tuple[int, Awaitable]] = []
    for j, sample in enumerate(samples):
        try:
            value = await calls.start(sample, term.timeout_s)
        except BaseException as e:
            out[j] = _error(term, _contain(e))
            continue
        if inspect.isawaitable(value):
            pending.append((j, calls.finish(value, term.timeout_s)))
        else:
            out[j] = _check_value(name, value)
    if pending:
        results = await asyncio.gather(*(a for _, a in pending), return_exceptions=True)
        for (j, _), value in zip(pending, results, strict=True):
            if isinstance(value, Exception):
                out[j] = _error(term, value)
            elif isinstance(value, BaseException):  # cancellation, interrupts: not a score
                raise value
            else:
                out[j] = _check_value(name, value)
    return out


async def run_term(
    term: RewardTerm, samples: list[Sample], concurrency: int = 256
) -> list[float | str]:
    """One term's value (or error text) per sample: what a remote reward actor runs."""
    return await _run_term(term, resolve(term.name), samples, asyncio.Semaphore(concurrency))


Runner = Callable[[list[Sample]], Awaitable[list]]


async def ascore(
    record: TensorDict,
    cfg: RewardConfig,
    samples: list[Sample] | None = None,
    runners: dict[str, Runner] | None = None,
) -> dict[str, float]:
    """Async :func:`score`, for callers already inside an event loop."""
    terms = [_as_term(t) for t in cfg.terms]
    fns = [resolve(t.name) for t in terms]
    n = record.batch_size[0]
    if samples is None:
        samples = samples_from_record(record)
    elif len(samples) != n:
        raise ValueError(f"score: {len(samples)} samples for a record of {n} rows")
    keys = set(record.keys())
    if "valid" not in keys:
        record["valid"] = torch.ones(n, dtype=torch.bool)
    if "error" not in keys:
        set_strings(record, "error", [""] * n)
    if "reward" not in keys:
        record["reward"] = torch.full((n,), float("nan"))

    rows = [i for i in range(n) if bool(record["valid"][i])]
    todo = [samples[i] for i in rows]
    sem = asyncio.Semaphore(max(1, int(cfg.concurrency)))
    runners = runners or {}
    calls = (
        runners[t.key](todo) if t.key in runners else _run_term(t, f, todo, sem)
        for t, f in zip(terms, fns, strict=True)
    )
    per_term = await asyncio.gather(*calls)

    reward = record["reward"].to(torch.float32).clone()
    term_values = torch.full((len(terms), n), float("nan"))
    failed_rows: list[int] = []
    failed_texts: list[str] = []
    for j, row in enumerate(rows):
        total, errors = 0.0, []
        for k, term in enumerate(terms):
            value = per_term[k][j]
            if isinstance(value, str):
                errors.append(value)
            else:
                term_values[k, row] = value
                total += float(term.weight) * value
        if errors:
            reward[row] = float("nan")
            failed_rows.append(row)
            failed_texts.append("; ".join(errors))
        else:
            reward[row] = total

    record["reward"] = reward
    for k, term in enumerate(terms):
        record[f"reward_terms/{term.key}"] = term_values[k].clone()
    if failed_rows:
        mark_invalid(record, failed_rows, failed_texts)

    failed = set(failed_rows)
    ok = [r for r in rows if r not in failed]
    metrics = {"reward/mean": _mean(reward[ok]) if ok else float("nan")}
    for k, term in enumerate(terms):
        metrics[f"reward/{term.key}/mean"] = _mean(term_values[k, rows]) if rows else float("nan")
    metrics["reward/errors"] = float(len(failed_rows))
    metrics["reward/error_rate"] = len(failed_rows) / len(rows) if rows else 0.0
    return metrics


def _mean(values: torch.Tensor) -> float:
    """Mean over the finite entries (a term's mean counts the rows where it succeeded)."""
    values = values[torch.isfinite(values)]
    return float(values.mean()) if values.numel() else float("nan")


def score(
    record: TensorDict,
    cfg: RewardConfig,
    samples: list[Sample] | None = None,
    runners: dict[str, Runner] | None = None,
) -> dict[str, float]:
    """Score every valid row of ``record`` in place and return reward metrics.

    Writes ``reward`` and ``reward_terms/<key>``; rows whose reward failed are marked invalid
    with the error text. ``samples`` overrides the Samples built from the record (row ``i``
    is ``samples[i]``). Metrics: ``reward/mean`` over successfully scored rows,
    ``reward/<key>/mean`` over rows where that term succeeded, ``reward/errors`` (rows that
    failed in this call) and ``reward/error_rate`` (of the rows that were valid on entry).
    Called from inside a running event loop, the scoring runs on a helper thread; async
    callers should ``await ascore(...)`` instead. ``runners`` (term key -> async function of
    the samples) score those terms elsewhere: the Ray backend's reward actors.
    """
    return run_sync(ascore(record, cfg, samples, runners))


# ---------------------------------------------------------------------------- built-ins

_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_THOUSANDS = re.compile(r"[+-]?\d{1,3}(,\d{3})+(\.\d*)?")


def last_boxed(text: str) -> str | None:
    """Contents of the last ``\\boxed{...}`` (balanced braces), or None."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    i = start + len("\\boxed{")
    depth = 1
    for j in range(i, len(text)):
        if text[j] == "{":
            depth += 1
        elif text[j] == "}":
            depth -= 1
            if depth == 0:
                return text[i:j]
    return None


def extract_answer(response: str) -> str:
    """The final answer: last ``<answer>`` block, else last ``\\boxed{}``, else everything."""
    tagged = _ANSWER_TAG.findall(response)
    if tagged:
        return tagged[-1]
    boxed = last_boxed(response)
    return boxed if boxed is not None else response


def normalize_answer(text: str) -> str:
    """Strip, collapse whitespace and drop one trailing period."""
    text = " ".join(text.split())
    return text[:-1].rstrip() if text.endswith(".") else text


def _as_number(text: str) -> float | None:
    if _THOUSANDS.fullmatch(text):
        text = text.replace(",", "")
    try:
        value = float(text)
    except ValueError:
        return None
    return value if math.isfinite(value) else None


@register_reward("exact_match")
def exact_match(sample: Sample) -> float:
    """1.0 when the extracted answer equals the ground truth (numerically for numbers)."""
    if sample.answer is None:
        raise ValueError("exact_match needs a ground-truth answer in meta['answer']; got None")
    pred = normalize_answer(extract_answer(sample.response))
    gold = normalize_answer(str(sample.answer))
    a, b = _as_number(pred), _as_number(gold)
    if a is not None and b is not None:
        return 1.0 if math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-12) else 0.0
    return 1.0 if pred == gold else 0.0


DEFAULT_FORMAT = r"(?s)^<think>.*</think>\s*<answer>.*</answer>$"


@register_reward("regex_format")
def regex_format(sample: Sample, pattern: str = DEFAULT_FORMAT, mode: str = "fullmatch") -> float:
    """1.0 when the response has the required shape (``mode``: fullmatch or search)."""
    if mode == "fullmatch":
        return 1.0 if re.fullmatch(pattern, sample.response) else 0.0
    if mode == "search":
        return 1.0 if re.search(pattern, sample.response) else 0.0
    raise ValueError(f"regex_format mode must be 'fullmatch' or 'search', got {mode!r}")


def _ground_truth(sample: Sample, reward: str) -> str:
    if sample.answer is None:
        raise ValueError(f"{reward} needs a ground-truth answer in meta['answer']; got None")
    return str(sample.answer)


@register_reward("gsm8k")
def gsm8k(
    sample: Sample, method: str = "strict", format_score: float = 0.0, score: float = 1.0
) -> float:
    """verl's GSM8K checker (``#### <number>``); a raw ``... #### 72`` answer is cut to 72."""
    from verl.utils.reward_score import gsm8k as verl_gsm8k

    gold = _ground_truth(sample, "gsm8k")
    if "####" in gold:  # the dataset's full solution text: its final answer follows ####
        gold = gold.split("####")[-1].strip().replace(",", "")
    return float(
        verl_gsm8k.compute_score(
            sample.response, gold, method=method, format_score=format_score, score=score
        )
    )


@register_reward("math")
def math_reward(sample: Sample) -> float:
    """verl's Hendrycks-MATH checker: last ``\\boxed{}`` vs the answer after normalisation."""
    from verl.utils.reward_score import math_reward as verl_math

    return float(verl_math.compute_score(sample.response, _ground_truth(sample, "math")))


@register_reward("math_dapo")
def math_dapo(sample: Sample, strict_box_verify: bool = False, field: str = "score") -> float:
    """verl's DAPO checker (``Answer: ...``): ``field='score'`` gives +1/-1, ``'acc'`` 1/0."""
    from verl.utils.reward_score import math_dapo as verl_dapo

    if field not in ("score", "acc"):
        raise ValueError(f"math_dapo field must be 'score' or 'acc', got {field!r}")
    result = verl_dapo.compute_score(
        sample.response, _ground_truth(sample, "math_dapo"), strict_box_verify=strict_box_verify
    )
    # verl annotates compute_score as returning a float; it returns a dict of scores
    return float(result[field])  # type: ignore[index]
