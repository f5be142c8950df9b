"""The GPU recipes in examples/ (CoopHumanEval pair, GSM8K debate) validate without loading
a model, and run end to end when their hub models and datasets are swapped for tiny local
ones: the wiring (workflow arguments, dataset fields the rewards read) is what breaks
silently on a GPU box an hour into a download."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from polyrl.core.config import load
from polyrl.core.recipe import Config

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
COOP, DEBATE = (
    EXAMPLES / "coop_humaneval_qwen2.5_coder.yaml",
    EXAMPLES / "gsm8k_debate_qwen2.5.yaml",
)


def recipe(path: Path, *overrides: str) -> Config:
    from polyrl.core.registry import load_plugins

    load_plugins()
    return load(Config, path, list(overrides))


def test_coop_humaneval_recipe_validates_without_models():
    cfg = recipe(COOP)
    assert {n: p.model for n, p in cfg.policies.items()} == {
        "helper": "Qwen/Qwen2.5-Coder-0.5B-Instruct",
        "main": "Qwen/Qwen2.5-Coder-1.5B-Instruct",
    }
    assert cfg.rollout.workflow == "parallel" and cfg.rollout.args["final"] == "concat"
    assert [a.name for a in cfg.rollout.args.agents] == ["helper", "main"]
    assert [t.name for t in cfg.reward.terms] == ["unit_tests"]
    assert cfg.data.split == "test[:132]" and cfg.eval.data.split == "test[132:]"


def test_debate_recipe_validates_without_models():
    cfg = recipe(DEBATE)
    assert set(cfg.policies) == {"alice", "bob", "carol"}
    assert {p.kind for p in cfg.policies.values()} == {"lora_agent"}
    assert len({p.model for p in cfg.policies.values()}) == 1  # one shared base
    assert cfg.rollout.workflow == "debate" and cfg.rollout.args["rounds"] == 2
    assert [t.name for t in cfg.reward.terms] == ["gsm8k"]


def tiny(cfg_policies: list[str], model: str) -> list[str]:
    out = []
    for name in cfg_policies:
        out += [
            f"policies.{name}.model={model}",
            f"policies.{name}.dtype=float32",
            f"policies.{name}.gradient_checkpointing=false",
        ]
    return out


def hf_engines(path: Path, policies: list[str], tmp_path: Path) -> Path:
    """The recipe with each policy's vLLM engine (and its vLLM options) replaced by hf:
    overrides merge into the recipe's engine.args, they cannot drop them."""
    data = yaml.safe_load(path.read_text())
    for name in policies:
        data["policies"][name]["engine"] = {"name": "hf"}
    out = tmp_path / path.name
    out.write_text(yaml.safe_dump(data))
    return out


def run_small(path: Path, policies: list[str], model: str, data: Path, tmp_path: Path, *extra: str):
    from polyrl.core.loop import train

    cfg = recipe(
        hf_engines(path, policies, tmp_path),
        *tiny(policies, model),
        f"run.dir={tmp_path}/run",
        "run.progress=false",
        "run.tensorboard=false",
        "run.export=false",
        f"data.path={data}",
        "data.split=train",
        f"eval.data.path={data}",
        "eval.data.split=train",
        "eval.data.limit=null",
        "data.subset=null",
        "eval.data.subset=null",
        "rollout.n=2",
        "rollout.prompts_per_step=2",
        "rollout.max_new_tokens=8",
        "train.steps=1",
        "eval.every=0",
        *extra,
    )
    run = train(cfg)
    rows = [json.loads(line) for line in (run.path / "metrics.jsonl").read_text().splitlines()]
    return run, rows


@pytest.mark.slow
def test_coop_humaneval_recipe_runs_on_tiny_models(tiny_model_dir, tmp_path):
    data = tmp_path / "humaneval.jsonl"
    rows = [
        {
            "task_id": f"T/{i}",
            "prompt": f'def add{i}(a, b):\n    """a + b"""\n',
            "test": f"def check(candidate):\n    assert candidate(1, {i}) == {1 + i}\n",
            "entry_point": f"add{i}",
            "canonical_solution": "    return a + b\n",
        }
        for i in range(4)
    ]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    run, metrics = run_small(COOP, ["helper", "main"], tiny_model_dir, data, tmp_path)
    trained = [r for r in metrics if "reward/unit_tests/mean" in r]
    assert trained and trained[-1]["reward/errors"] == 0, trained  # every program was run
    assert 0.0 <= trained[-1]["reward/unit_tests/mean"] <= 1.0
    joint = [
        json.loads(line)
        for line in (run.path / "samples" / "train_step_000001.jsonl").read_text().splitlines()
    ]
    assert all(
        "[t0 helper]" in j["prompt"] and "[t0 main]" in j["prompt"]
        for j in joint
        if j["policy"] == "<joint>"
    )
    assert any("helper/grad_norm" in r for r in metrics) and any(
        "main/grad_norm" in r for r in metrics
    )


@pytest.mark.slow
def test_debate_recipe_runs_on_tiny_models(tiny_model_dir, tmp_path):
    data = tmp_path / "gsm8k.jsonl"
    rows = [
        {"question": f"{i}+{i}=", "answer": f"{i} plus {i} is {2 * i}.\n#### {2 * i}"}
        for i in range(4)
    ]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    run, metrics = run_small(DEBATE, ["alice", "bob", "carol"], tiny_model_dir, data, tmp_path)
    trained = [r for r in metrics if "reward/gsm8k/mean" in r]
    assert trained and trained[-1]["reward/errors"] == 0, trained
    for name in ("alice", "bob", "carol"):
        assert any(f"{name}/grad_norm" in r for r in metrics), name
