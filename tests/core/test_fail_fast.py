"""Fail fast and say why (issue 44): a run whose reward fails on every row stops after
``train.max_unscored_steps`` such steps (exit 3, nothing exported) instead of retrying the
failing reward for every remaining step; a step where too many responses hit
``rollout.max_new_tokens`` says so on the console, once."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
import yaml
from tensordict import TensorDict

from polyrl.core.config import ConfigError
from polyrl.core.rollout.truncation import TruncationWatch
from polyrl.core.runner.failures import EXIT_STATUS, Failures, RunFailedError

REWARD = """\
def judge(sample):
    raise ConnectionError("the judge at http://judge:8000 is unreachable")
"""


def test_a_reward_that_always_fails_stops_the_run_after_one_step(tiny_model_dir, tmp_path):
    """Through the CLI: 5 steps asked, the first has no valid row, so the run ends there
    with exit 3 and its message; metrics.jsonl has that one training step."""
    (tmp_path / "my_reward.py").write_text(REWARD)
    run_dir = tmp_path / "run"
    recipe = {
        "run": {"dir": str(run_dir), "tensorboard": False, "progress": False},
        "task": {
            "name": "arithmetic",
            "dir": str(tmp_path / "data"),
            "args": {"n_train": 8, "n_eval": 2, "max_operand": 9, "ops": "+"},
        },
        "policies": {"main": {"model": tiny_model_dir}},
        "data": {"max_prompt_tokens": 32},
        "reward": {"terms": [{"name": "./my_reward.py:judge"}]},
        "rollout": {"n": 2, "prompts_per_step": 2, "max_new_tokens": 4},
        "train": {"steps": 5},
    }
    (tmp_path / "recipe.yaml").write_text(yaml.safe_dump(recipe))
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1")
    done = subprocess.run(
        [sys.executable, "-m", "polyrl.core.runner.cli", "train", "recipe.yaml"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == EXIT_STATUS, done.stderr[-3000:]
    err = done.stderr
    assert "step 1: no valid row, nothing to train on (4 of 4 rows failed)" in err
    assert "step 2:" not in err  # the failing reward was not tried again
    assert "no step of this run had a valid row: 4 rows failed over 1 steps" in err
    assert "train.max_unscored_steps=1" in err and "the judge at http://judge:8000" in err
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    trained = [r["step"] for r in rows if "rollout/valid_frac" in r]
    assert trained == [1] and max(r["step"] for r in rows) == 1, rows
    assert not (run_dir / "export").exists()
    assert (run_dir / "samples" / "train_step_000001.jsonl").exists()  # the errors, to read


def record(valid: list[bool], error: str = "the reward raised") -> TensorDict:
    """A record of ``len(valid)`` rows: only what Failures reads."""
    from polyrl.core.record import Row, build_rows
    from polyrl.core.segment import Tokens

    rows = [
        Row(Tokens.given([1]), Tokens.sampled([2], [0.0]), "main", i, error="" if ok else error)
        for i, ok in enumerate(valid)
    ]
    td = build_rows(rows, pad_id=0)
    td["valid"] = torch.tensor(valid)
    return td


def test_only_steps_in_a_row_without_a_valid_row_count():
    f = Failures(out=open(os.devnull, "w"), max_unscored=2)  # noqa: SIM115
    seen = []
    for step, valid in enumerate([[False], [True, False], [False, False], [True], [False]], 1):
        f.step(step, record(valid, f"error of step {step}"))
        seen.append(f.stop)
    assert seen == [False, False, False, False, False]  # never 2 in a row
    f.step(6, record([False], "error of step 6"))
    assert f.stop and f.unscored == 2
    with pytest.raises(RunFailedError) as e:
        f.check("run/samples/")
    msg = str(e.value)
    # it trained before: the message says where it stopped and the latest error, not step 1's
    assert "the last 2 steps had no valid row (train.max_unscored_steps=2)" in msg
    assert "stopped after step 6" in msg and "step 4 was the last that trained" in msg
    assert "(step 6): error of step 6" in msg and "run.resume: true" in msg


def test_without_a_limit_a_run_that_never_trained_still_fails_at_the_end():
    f = Failures(out=open(os.devnull, "w"))  # noqa: SIM115
    for step in (1, 2, 3):
        f.step(step, record([False, False]))
        assert not f.stop
    with pytest.raises(RunFailedError, match="6 rows failed over 3 steps"):
        f.check()


@pytest.mark.parametrize(
    ("key", "value"), [("train.max_unscored_steps", 0), ("rollout.warn_truncated", 1.5)]
)
def test_the_new_options_are_checked_before_any_model_loads(make_config, key, value):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.") + ".* must be"):
        make_config(f"{key}={value}")


def cut_record(lengths: list[int], cut: list[bool]) -> TensorDict:
    width = max(lengths)
    mask = torch.tensor([[1] * n + [0] * (width - n) for n in lengths])
    return TensorDict(
        {"truncated": torch.tensor(cut), "response_mask": mask}, batch_size=[len(lengths)]
    )


def test_the_truncation_warning_names_the_key_the_lengths_and_warns_once(capsys):
    watch = TruncationWatch(max_new_tokens=32, threshold=0.25)
    # 1 of 4 cut: 25% is not past the threshold
    assert not watch.step(1, cut_record([32, 5, 7, 9], [True, False, False, False]), {})
    assert capsys.readouterr().err == ""
    # 2 of 4 cut (lengths 32, 30 -> median 31), the others 5 and 8 (median 6.5), one mid-call
    rec = cut_record([32, 5, 30, 8], [True, False, True, False])
    assert watch.step(2, rec, {"rollout/tool_call_cut": 1.0})
    err = capsys.readouterr().err
    assert "step 2: 2 of 4 responses (50%) were cut" in err
    assert "rollout.max_new_tokens=32" in err and "median length of the cut ones 31 tokens" in err
    assert "the others' 6.5" in err and "1 of them ended inside a tool call" in err
    assert not watch.step(3, rec, {})  # once per run
    assert capsys.readouterr().err == ""
    never = TruncationWatch(max_new_tokens=32, threshold=1.0)
    assert not never.step(1, cut_record([32, 32], [True, True]), {})
