"""Bad inputs through the real run path: each fails clearly and early, or is counted and survived.

Data and the run directory are checked before any model loads, so those tests replace the
policy constructor with one that fails the test if it is ever called.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from polyrl.core.loop import train
from polyrl.core.rollout.data import DataError, write_jsonl
from polyrl.core.rollout.rewards import Sample, exact_match, register_reward
from polyrl.core.runner.failures import RunFailedError
from polyrl.core.runner.run import RunDirError
from polyrl.core.runner.session import Session
from polyrl.core.train import trainer
from polyrl.core.train.policy import CausalLMPolicy


@register_reward("test_session_raises")
def raises_on_some_rows(sample: Sample, every: int = 2) -> float:
    """Raises on every ``every``-th row of a record (every=1: on all of them)."""
    if sample.index % every == 0:
        raise ValueError(f"boom on purpose (row {sample.index})")
    return exact_match(sample)


@register_reward("test_session_bad_value")
def bad_value_on_some_rows(sample: Sample) -> float | None:
    """None on a quarter of the rows, NaN on another quarter, a score on the rest."""
    return [None, math.nan, 0.0, 1.0][sample.index % 4]


@pytest.fixture
def no_model_load(monkeypatch):
    """Fail the test if a policy (and so a model) is ever built."""

    def boom(self, *args, **kwargs):
        raise AssertionError("a model was loaded before the inputs were checked")

    monkeypatch.setattr(CausalLMPolicy, "__init__", boom)


def metrics(run_dir) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def strict_json(line: str) -> dict:
    """Parse JSON as the standard defines it (no NaN / Infinity)."""

    def reject(token: str):
        raise ValueError(f"non-standard JSON constant {token}")

    return json.loads(line, parse_constant=reject)


def arith_rows(n: int) -> list[dict]:
    return [{"prompt": f"{i}+{i + 1}=", "answer": str(2 * i + 1)} for i in range(n)]


# --------------------------------------------------------------------------- data


def test_missing_dataset_fails_before_models_load(make_config, no_model_load):
    cfg = make_config("task.name=null", "data.path=/nonexistent.jsonl")
    with pytest.raises(DataError, match="'/nonexistent.jsonl' does not exist"):
        train(cfg)


def test_missing_eval_dataset_names_eval(make_config, tmp_path, no_model_load):
    cfg = make_config(f"eval.data.path={tmp_path}/eval.jsnl")
    with pytest.raises(DataError, match=r"eval data: .*eval.jsnl.*does not exist"):
        train(cfg)


def test_row_without_prompt_field(make_config, tmp_path, no_model_load):
    path = write_jsonl(
        tmp_path / "train.jsonl", [*arith_rows(2), {"question": "1+2=", "answer": "3"}]
    )
    with pytest.raises(DataError) as e:
        train(make_config("task.name=null", f"data.path={path}"))
    msg = str(e.value)
    assert str(path) in msg and "line 3" in msg and "no field 'prompt'" in msg
    assert "'question'" in msg  # lists the fields the row does have


def test_empty_prompt(make_config, tmp_path, no_model_load):
    path = write_jsonl(tmp_path / "train.jsonl", [*arith_rows(2), {"prompt": "  ", "answer": "1"}])
    with pytest.raises(DataError, match=r"line 3: field 'prompt' is empty"):
        train(make_config("task.name=null", f"data.path={path}"))


@pytest.fixture
def overlong_data(tmp_path):
    long = {"prompt": "+".join(["1"] * 30) + "=", "answer": "30"}  # one token per character
    return write_jsonl(tmp_path / "train.jsonl", [*arith_rows(16), long, long, long])


def test_overlong_prompts_are_filtered_and_counted(make_config, overlong_data):
    s = Session.open(make_config("task.name=null", f"data.path={overlong_data}"))
    s.run.close()
    data = metrics(s.run.path)[0]
    assert data["data/filtered_overlong"] == 3 and data["data/kept"] == 16
    assert data["data/rows"] == 19
    assert all(len(item.prompt_ids) <= 32 for item in s.sampler.dataset)


def test_overlong_prompts_can_be_an_error(make_config, overlong_data, no_model_load):
    cfg = make_config("task.name=null", f"data.path={overlong_data}", "data.overlong=error")
    with pytest.raises(DataError, match=r"line 17: prompt is \d+ tokens.*max_prompt_tokens=32"):
        train(cfg)


# --------------------------------------------------------------------------- rewards


@pytest.fixture
def update_spy(monkeypatch):
    """Record the rows each policy update receives."""
    seen: list[dict] = []
    real = trainer.update

    def spy(policy, batch, *args, **kwargs):
        n = batch.batch_size[0]
        seen.append(
            {
                "rows": n,
                "all_valid": bool(batch["valid"].all()) if n else True,
                "finite": bool(torch.isfinite(batch["reward"]).all()) if n else True,
            }
        )
        return real(policy, batch, *args, **kwargs)

    monkeypatch.setattr(trainer, "update", spy)
    return seen


@pytest.mark.parametrize(
    "term, errors, valid_frac",
    [
        ("{name: test_session_raises}", ["raised ValueError: boom on purpose"], 0.5),
        (
            "{name: test_session_raises, args: {every: 1}}",
            ["raised ValueError: boom on purpose"],
            0.0,
        ),
        ("{name: test_session_bad_value}", ["returned None", "returned nan"], 0.5),
    ],
    ids=["raises-half", "raises-all", "returns-none-or-nan"],
)
def test_failing_reward_is_counted_and_excluded(make_config, update_spy, term, errors, valid_frac):
    """A reward that raises or returns None/NaN: the run finishes, the rows are left out of
    the update (never scored 0), the errors are counted and their text is in the samples."""
    cfg = make_config(
        f"reward.terms=[{term}]",
        "train.steps=2",
        "train.max_unscored_steps=2",  # both steps run even when neither scores a row
        "run.export=false",
        "task.args.n_eval=4",
    )
    if valid_frac == 0:  # no step had a valid row: the run fails (see test_failed_runs.py)
        with pytest.raises(RunFailedError):
            train(cfg)
    else:
        train(cfg)
    path = Path(cfg.run.dir)
    assert (path / "summary.json").is_file()
    steps = [m for m in metrics(path) if "reward/errors" in m]
    assert [m["step"] for m in steps] == [1, 2]
    rows = 4 * 8  # rollout.n * prompts_per_step
    for m in steps:
        assert m["reward/errors"] == rows * (1 - valid_frac) > 0
        assert m["rollout/valid_frac"] == valid_frac
    if valid_frac == 0:
        assert steps[0]["reward/mean"] is None  # no row scored: no fake 0
    assert update_spy == [{"rows": int(rows * valid_frac), "all_valid": True, "finite": True}] * 2

    samples = [
        strict_json(line)
        for line in (path / "samples" / "train_step_000001.jsonl").read_text().splitlines()
    ]
    failed = [s for s in samples if s["error"]]
    for error in errors:
        assert any(error in s["error"] for s in failed), f"no sample shows {error!r}"
    assert all(s["reward"] is None for s in failed)
    assert all(s["reward"] is not None for s in samples if not s["error"])


def test_a_step_that_raises_frees_the_run_and_the_error_goes_on(make_config, monkeypatch):
    """The error a step raises (here step 1's save) reaches the caller itself, after the
    run freed what it held: the metrics file closed and the async producer stopped (else its
    thread waits for a publish forever, holding the engines). Ray's actors and placement
    groups: tests/core/test_ray_backend.py::test_grpo_run_survives_a_dead_worker_by_resuming."""

    class Boom(Exception):
        pass

    err, held = Boom("step 1's save"), []

    def save(self, step):
        held.append(self)
        raise err

    monkeypatch.setattr(Session, "save", save)
    cfg = make_config(
        "rollout.max_staleness=1", "train.steps=3", "run.save_every=1", "task.args.n_eval=4"
    )
    with pytest.raises(Boom) as got:
        train(cfg)
    assert got.value is err
    s = held[0]
    assert s.run._metrics.closed
    assert s.rollouts.thread is not None and not s.rollouts.thread.is_alive()


# --------------------------------------------------------------------------- run directory


def test_unwritable_run_dir_fails_before_anything(make_config, tmp_path, no_model_load):
    (tmp_path / "afile").write_text("a regular file, so nothing can be created under it")
    cfg = make_config(f"run.dir={tmp_path}/afile/run")
    with pytest.raises(RunDirError, match=r"afile/run.*not writable.*run.dir"):
        train(cfg)
    assert not (tmp_path / "data").exists()  # the task wrote no data: nothing ran before


def test_lr_zero_is_a_policy_frozen_after_its_warm_start(make_config, one_thread):
    """``optim.lr: 0``: the SFT warm start (at ``sft.lr``) moves the weights, the RL steps
    then leave them bitwise as it made them (a frozen baseline with the same warm start); a
    warm start that would take the policy's rate of 0 is refused at load."""
    from polyrl.core.config import ConfigError
    from polyrl.core.loop import _steps

    with pytest.raises(ConfigError, match=r"optim.lr=0.0 .*set sft.lr"):
        make_config("policies.main.optim.lr=0", "sft.steps=2")
    cfg = make_config(
        "policies.main.optim.lr=0",
        "sft.steps=3",
        "sft.lr=1e-2",
        "train.steps=2",
        "reward.terms=[{name: regex_format, args: {pattern: '[0-9]', mode: search}}]",
    )
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(cfg.policies["main"].model).state_dict()
    s = Session.open(cfg)
    model = s.policies["main"].model
    warm = {k: v.detach().clone() for k, v in model.state_dict().items()}
    assert any(not torch.equal(warm[k], base[k]) for k in base)  # the warm start moved it
    with s.freed_on_error():
        _steps(s.cfg, s).check(f"{s.run.path}/samples/")
    steps = [json.loads(x) for x in (Path(s.run.path) / "metrics.jsonl").read_text().splitlines()]
    assert [m["main/grad_norm"] > 0 for m in steps if "main/grad_norm" in m] == [True, True]
    assert all(torch.equal(v, warm[k]) for k, v in model.state_dict().items())
