"""``polyrl train | plot | export | eval`` on a tiny recipe, through ``main([...])``.

One short training run is shared by the module; plot, export and eval then work on it.
"""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path

import pytest
import torch
import yaml

from polyrl.core.runner.cli import main

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def write_recipe(path: Path, model: str, run_dir: Path) -> Path:
    recipe = {
        "seed": 0,
        "run": {"name": "cli", "dir": str(run_dir), "progress": False, "tensorboard": False},
        "task": {
            "name": "arithmetic",
            "args": {"n_train": 64, "n_eval": 8, "max_operand": 30, "ops": "+"},
        },
        "policies": {"main": {"model": model, "optim": {"lr": 5.0e-5}, "micro_batch_size": 64}},
        "data": {"max_prompt_tokens": 32},
        "eval": {"data": {"shuffle": False}},
        "rollout": {"n": 4, "prompts_per_step": 4, "max_new_tokens": 6},
        "train": {"steps": 2},
    }
    path.write_text(yaml.safe_dump(recipe))
    return path


@pytest.fixture(scope="module")
def trained(tiny_model_dir, tmp_path_factory):
    """(recipe, run_dir, stdout) of one `polyrl train` run."""
    root = tmp_path_factory.mktemp("cli")
    recipe = write_recipe(root / "recipe.yaml", tiny_model_dir, root / "runs" / "{name}")
    out = io.StringIO()  # capsys is per test; this fixture is per module
    with contextlib.redirect_stdout(out):
        assert main(["train", str(recipe)]) == 0
    return recipe, root / "runs" / "cli", out.getvalue()


def is_png(path: Path) -> bool:
    return path.is_file() and path.read_bytes()[:8] == PNG_MAGIC


def checkpoint_weights(run_dir: Path) -> dict[str, torch.Tensor]:
    step = sorted((run_dir / "checkpoints").glob("step_*"))[-1]
    return torch.load(step / "policy_main.pt", weights_only=False)["weights"]


def assert_loadable(path: Path, weights: dict[str, torch.Tensor] | None = None) -> None:
    """A Hugging Face folder that transformers loads, generates from and (optionally)
    holds exactly ``weights``."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path)
    ids = tok.apply_chat_template(
        [{"role": "user", "content": "3+4="}], add_generation_prompt=True, return_tensors="pt"
    )
    if not isinstance(ids, torch.Tensor):  # some versions return a BatchEncoding
        ids = ids["input_ids"]
    out = model.generate(ids, max_new_tokens=2, do_sample=False)
    assert out.shape[1] > ids.shape[1]
    if weights is not None:
        state = model.state_dict()
        shared = set(state) & set(weights)
        assert len(shared) >= len(weights) - 1, "export and checkpoint name different tensors"
        for k in shared:
            assert torch.equal(state[k], weights[k]), f"{k} differs from the checkpoint"


# --------------------------------------------------------------------------- train


def test_train_leaves_a_complete_run(trained):
    _, run_dir, out = trained
    assert f"run directory: {run_dir}" in out
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r["step"] for r in rows if "reward/mean" in r]
    assert steps == [1, 2]
    assert any("eval/accuracy" in r for r in rows)
    for panel in ("reward", "accuracy", "kl", "entropy", "length", "loss"):
        assert is_png(run_dir / "plots" / f"{panel}.png"), f"no {panel} curve"
    ckpts = sorted((run_dir / "checkpoints").glob("step_*"))
    assert [p.name for p in ckpts] == ["step_000002"]
    assert (ckpts[0] / "COMPLETE").is_file()
    assert (run_dir / "config.yaml").is_file() and (run_dir / "summary.json").is_file()
    assert_loadable(run_dir / "export" / "main", checkpoint_weights(run_dir))


# --------------------------------------------------------------------------- plot


def test_plot_writes_pngs(trained, capsys):
    _, run_dir, _ = trained
    for png in (run_dir / "plots").glob("*.png"):
        png.unlink()
    assert main(["plot", str(run_dir)]) == 0
    printed = capsys.readouterr().out.split()
    assert str(run_dir / "plots" / "reward.png") in printed
    assert is_png(run_dir / "plots" / "reward.png")
    assert is_png(run_dir / "plots" / "accuracy.png")


def test_plot_on_a_non_run_dir_fails_clearly(tmp_path, capsys):
    assert main(["plot", str(tmp_path)]) == 2
    msg = capsys.readouterr().err
    assert "Traceback" not in msg
    assert str(tmp_path) in msg and "metrics.jsonl" in msg and "run directory" in msg
    assert not (tmp_path / "plots").exists()


# --------------------------------------------------------------------------- export / eval


def run_record(run_dir: Path) -> tuple[str, str]:
    return (run_dir / "config.yaml").read_text(), (run_dir / "metrics.jsonl").read_text()


def test_export_writes_a_loadable_model(trained, tmp_path, capsys):
    recipe, run_dir, _ = trained
    before = run_record(run_dir)
    out = tmp_path / "exported"
    assert main(["export", str(recipe), str(run_dir), "--out", str(out)]) == 0
    assert str(out / "main") in capsys.readouterr().out
    assert_loadable(out / "main", checkpoint_weights(run_dir))
    assert run_record(run_dir) == before  # the run's config and metrics are left alone


def test_export_of_a_dir_without_checkpoints_fails(trained, tmp_path, capsys):
    """Never export the untrained base model from a mistyped run directory."""
    recipe, _, _ = trained
    args = ["export", str(recipe), str(tmp_path / "not-a-run"), "--out", str(tmp_path / "x")]
    assert main(args) == 2
    assert "no complete checkpoint" in capsys.readouterr().err
    assert not (tmp_path / "x").exists() and not (tmp_path / "not-a-run").exists()


def test_eval_prints_accuracy(trained, capsys):
    recipe, run_dir, _ = trained
    before = run_record(run_dir)
    assert main(["eval", str(recipe), "--run-dir", str(run_dir)]) == 0
    lines = dict(line.split(": ") for line in capsys.readouterr().out.splitlines() if ": " in line)
    assert 0.0 <= float(lines["eval/accuracy"]) <= 1.0
    assert "eval/reward" in lines
    assert run_record(run_dir) == before


def test_eval_takes_overrides_after_the_run_dir(trained, capsys):
    """`polyrl eval R.yaml --run-dir D key=val`: the override applies (answers of one token)."""
    recipe, run_dir, _ = trained
    assert main(["eval", str(recipe), "--run-dir", str(run_dir), "eval.max_new_tokens=1"]) == 0
    lines = dict(line.split(": ") for line in capsys.readouterr().out.splitlines() if ": " in line)
    assert 0.0 < float(lines["eval/response_len"]) <= 1.0
    with pytest.raises(SystemExit) as exit_:  # a stray option is still refused
        main(["eval", str(recipe), "--run-dir", str(run_dir), "--bogus", "a=b"])
    assert exit_.value.code == 2 and "unrecognized arguments: --bogus" in capsys.readouterr().err


def test_eval_of_a_dir_without_checkpoints_fails(trained, tmp_path, capsys):
    recipe, _, _ = trained
    assert main(["eval", str(recipe), "--run-dir", str(tmp_path / "not-a-run")]) == 2
    assert "no complete checkpoint" in capsys.readouterr().err


def test_train_without_a_recipe_uses_the_embedded_default():
    """`polyrl train [key=value ...]`: the README's main job needs no recipe path."""
    from polyrl.core.runner.cli import DEFAULT_RECIPE, _load

    assert DEFAULT_RECIPE.is_file()
    cfg = _load(None, ["train.steps=3"])
    assert cfg.task.name == "arithmetic" and cfg.train.steps == 3
    cfg = _load("train.steps=2", ["seed=5"])  # the first override lands where a recipe would
    assert cfg.train.steps == 2 and cfg.seed == 5 and cfg.task.name == "arithmetic"


# --------------------------------------------------------------------------- errors and config


@pytest.mark.parametrize(
    "recipe_text, expected",
    [
        ("policies: {main: {model: m}}\nrollout: {args: {polciy: main}}\n", "rollout.args.polciy"),
        ("policies: {main: {model: m}}\ntrain: {steps: [1\n", "not valid YAML"),
        ("policies: {main: {model: m}}\ntask: {name: arithmetic, args: {n_train: x}}\n", "integer"),
    ],
    ids=["unknown-option", "malformed-yaml", "wrong-type"],
)
def test_recipe_errors_print_one_message_and_exit_2(tmp_path, capsys, recipe_text, expected):
    """The message alone on stderr, status 2, no traceback (the process itself: below)."""
    recipe = tmp_path / "bad.yaml"
    recipe.write_text(recipe_text)
    assert main(["train", str(recipe)]) == 2
    out = capsys.readouterr()
    assert expected in out.err and str(recipe) in out.err
    assert "Traceback" not in out.err and out.out == ""


def test_a_recipe_error_through_the_real_command_and_with_debug(tmp_path):
    """``python -m polyrl.core.runner.cli``: one message on stderr, status 2; --debug (in
    this process: one start of the command is enough to show the real one's exit): the
    error itself, which Python prints with its traceback (status 1)."""
    import subprocess
    import sys

    from polyrl.core.config import ConfigError

    recipe = tmp_path / "bad.yaml"
    recipe.write_text("policies: {main: {model: m}}\nrollout: {args: {polciy: main}}\n")
    cmd = [sys.executable, "-m", "polyrl.core.runner.cli"]
    out = subprocess.run([*cmd, "train", str(recipe)], capture_output=True, text=True, timeout=300)
    assert out.returncode == 2, out.stderr
    assert "rollout.args.polciy" in out.stderr and str(recipe) in out.stderr
    assert "Traceback" not in out.stderr and out.stdout == ""
    with pytest.raises(ConfigError, match="rollout.args.polciy"):
        main(["--debug", "train", str(recipe)])


def test_config_lists_every_part_option_with_type_and_doc(capsys):
    assert main(["config"]) == 0
    lines = capsys.readouterr().out.splitlines()
    # the Ray backend's declared options, under distributed.args
    placement = [line for line in lines if line.strip().startswith("distributed.args.placement ")]
    assert len(placement) == 1
    assert "'colocate' | 'split'" in placement[0] and "engine shares worker 0" in placement[0]
    # a task's options: its split counts (core.tasks.common.split_task), then those derived
    # from its row maker's documented keyword parameters
    n_eval = [line for line in lines if line.strip().startswith("task.args.n_eval ")]
    assert n_eval and "int = required" in n_eval[0] and "held-out problems" in n_eval[0]
    ops = [line for line in lines if line.strip().startswith("task.args.ops ")]
    assert ops and "str = '+'" in ops[0] and "a subset of '+-*'" in ops[0]
    # a builder's options
    assert any(
        line.strip().startswith("policies.<name>.build_args.hidden_size (int = 64)")
        for line in lines
    )
    # every options field names the parts it can hold
    assert any("[rollout.workflow: single_turn]" in line for line in lines)
    assert any("[task.name: arithmetic]" in line for line in lines)
