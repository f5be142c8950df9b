"""marl/README.md's tutorial, "Your own multi-agent task", run as written: its task file and
recipe are taken from the README's fenced blocks, written to a fresh folder, and trained for
two steps through the installed ``polyrl`` command (no PYTHONPATH, the user's way)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[2] / "marl" / "README.md"


def block(name: str) -> str:
    """The README's fenced block whose info string names the file (```python relay.py)."""
    found = re.findall(rf"^```\w+ {re.escape(name)}\n(.*?)^```$", README.read_text(), re.S | re.M)
    assert len(found) == 1, f"marl/README.md should have one fenced block for {name}"
    return found[0]


def test_the_tutorial_blocks_are_complete():
    code, recipe = block("relay.py"), block("relay.yaml")
    assert len(code.splitlines()) <= 60  # the tutorial's promise: a task in <= 60 lines
    compile(code, "relay.py", "exec")
    assert "./relay.py:Task" in recipe and "./relay.py:relay" in recipe


@pytest.mark.slow
def test_the_tutorial_trains_through_the_cli(tmp_path):
    (tmp_path / "relay.py").write_text(block("relay.py"))
    (tmp_path / "relay.yaml").write_text(block("relay.yaml"))
    polyrl = Path(sys.executable).parent / "polyrl"
    overrides = [
        "train.steps=2",
        "sft.steps=2",
        "sft.batch_size=8",
        "task.args={n_train: 16, n_eval: 4}",
        "rollout.n=2",
        "rollout.prompts_per_step=2",
        "eval.every=0",
        f"policies.sender.model={tmp_path}/model",
        f"policies.receiver.model={tmp_path}/model",
        "run.dir=run",
        "run.progress=false",
        "run.tensorboard=false",
        "run.export=false",
    ]
    out = subprocess.run(
        [str(polyrl), "train", "relay.yaml", *overrides],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "reward/exact_match/mean" in r]
    assert [r["step"] for r in steps] == [1, 2]
    for r in steps:
        assert 0.0 <= r["reward/mean"] <= 1.0 and r["reward/errors"] == 0
        assert r["marl/joint_actions"] == 2 * 2 and r["marl/episode_errors"] == 0
        assert r["marl/generate_calls/sender"] == 1 and r["marl/generate_calls/receiver"] == 1
    assert any("eval/accuracy" in r for r in rows)  # before and after training
    joint = [
        json.loads(x)
        for x in (tmp_path / "run" / "samples" / "train_step_000002.jsonl").read_text().splitlines()
        if json.loads(x)["policy"] == "<joint>"
    ]
    assert joint and all("[t0 sender] Secret:" in j["prompt"] for j in joint)
    assert all("Secret" not in j["prompt"].split("[t0 receiver]")[1] for j in joint)
