"""A run whose rows all fail is not a success: it says why each step, exits non-zero and
exports nothing; a reward that raises on every row fails the run the same way."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from polyrl.core.runner.failures import EXIT_STATUS, RunFailedError

HELPER = """\
def call_the_tool(row):
    raise ValueError("the calculator tool is broken")  # the agent's failing line
"""

AGENT = """\
import agent_helpers  # a module beside this file, no PYTHONPATH


def agent(row, endpoint):
    return agent_helpers.call_the_tool(row)
"""


def line_of(text: str, source: str) -> int:
    return next(i for i, line in enumerate(source.splitlines(), 1) if text in line)


def test_a_run_whose_agent_always_raises_exits_3_and_says_where(tiny_model_dir, tmp_path):
    """Through the CLI, as a user runs it: a gateway agent (in a file beside the recipe,
    importing a module beside it) that raises in every episode."""
    project = tmp_path / "project"
    project.mkdir()
    (project / "agent_helpers.py").write_text(HELPER)
    (project / "my_agent.py").write_text(AGENT)
    recipe = {
        "seed": 0,
        "run": {"name": "broken", "dir": str(tmp_path / "run"), "tensorboard": False},
        "task": {
            "name": "arithmetic",
            "dir": str(tmp_path / "data"),
            "args": {"n_train": 8, "n_eval": 2, "max_operand": 9, "ops": "+"},
        },
        "policies": {"main": {"model": tiny_model_dir}},
        "data": {"max_prompt_tokens": 32},
        "eval": {"data": {"shuffle": False}},
        "rollout": {
            "workflow": "gateway",
            "args": {"agent": "./my_agent.py:agent"},
            "n": 2,
            "prompts_per_step": 2,
            "max_new_tokens": 4,
        },
        "train": {"steps": 2, "max_unscored_steps": 3},  # both steps run: none stops it
    }
    (project / "recipe.yaml").write_text(yaml.safe_dump(recipe))
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1")
    done = subprocess.run(
        [sys.executable, "-m", "polyrl.core.runner.cli", "train", "project/recipe.yaml"],
        cwd=tmp_path,  # not the recipe's folder: its files are found beside it
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == EXIT_STATUS, done.stderr[-3000:]
    where = f"{project / 'agent_helpers.py'}:{line_of('is broken', HELPER)}"
    cause = f"the agent raised ValueError: the calculator tool is broken ({where})"
    # each step says so as it ends, with the count; the end says the run failed
    for step in (1, 2):
        assert f"step {step}: no valid row, nothing to train on (4 of 4 rows failed); " in (
            done.stderr
        )
    assert done.stderr.count(cause) == 3, done.stderr[-3000:]
    assert "polyrl train: the run failed: no step of this run had a valid row" in done.stderr
    assert "8 rows failed over 2 steps" in done.stderr
    assert not (tmp_path / "run" / "export").exists()  # nothing trained: nothing exported
    assert "run directory:" not in done.stdout
    # stdout is a pipe: one progress line per step, the last one the final evaluation
    lines = [x for x in done.stdout.splitlines() if x.startswith("train ")]
    assert [x.split()[1] for x in lines] == ["0/2", "1/2", "2/2", "2/2"], done.stdout
    assert lines[-1].endswith("final eval") and lines[1].endswith("s/step")


def always_raises(sample) -> float:
    raise RuntimeError("judge unreachable")


def test_a_reward_that_raises_on_every_row_fails_the_run(make_config, tmp_path, capsys):
    from polyrl.core.loop import train

    cfg = make_config(
        f"reward.terms=[{{name: '{__name__}:always_raises'}}]",
        "task.args={n_train: 16, n_eval: 4, max_operand: 30, ops: '+'}",
        "rollout.prompts_per_step=2",
        "train.steps=1",
    )
    with pytest.raises(RunFailedError) as err:
        train(cfg)
    msg = str(err.value)
    assert "8 rows failed over 1 steps" in msg and "no model was exported" in msg
    assert "reward" in msg and "raised RuntimeError: judge unreachable" in msg
    assert f"{Path(__file__)}:" in msg  # the reward's own line
    assert "step 1: no valid row, nothing to train on (8 of 8 rows failed)" in (
        capsys.readouterr().err
    )
    run = Path(cfg.run.dir)
    assert not (run / "export").exists()
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["reward/errors"] for r in rows if "reward/errors" in r] == [8.0]
