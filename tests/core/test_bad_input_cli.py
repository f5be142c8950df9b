"""Bad input through the CLI (issue 38): each case exits with status 2 and a message that
names the key or file and the fix, before any model loads, with nothing written or lost."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

import polyrl.core  # noqa: F401  (registers the core's parts)
from polyrl.core.runner.cli import main

# the model does not exist: a case that got past the recipe would fail on it instead
RECIPE = {"policies": {"main": {"model": "no/such-model"}}, "train": {"steps": 3}}


@pytest.fixture
def recipe(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # runs/ would appear here
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(RECIPE))
    return path


def refused(capsys, argv: list[str], *needles: str) -> str:
    """``polyrl argv`` exits 2 with every needle in its one error line, no traceback, and
    no run directory made."""
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.count("error:") == 1, err
    for needle in needles:
        assert needle in err, err
    assert not Path("runs").exists()
    return err


@pytest.mark.parametrize(
    "override, needles",
    [
        ("policies.main.moe.aux_loss_coef=.nan", ("aux_loss_coef=nan", "finite")),
        ("policies.main.moe.aux_loss_coef=.inf", ("aux_loss_coef=inf", "finite")),
        ("policies.main.moe.aux_loss_coef=-0.01", ("aux_loss_coef=-0.01", ">= 0")),
        ("policies.main.shared_prefix_min_tokens=-1", ("shared_prefix_min_tokens=-1", ">= 0")),
        ("algorithm.kl_coef=.nan", ("algorithm.kl_coef=nan", "finite")),  # nan < 0 is False
        ("algorithm.entropy_coef=-1", ("algorithm.entropy_coef=-1", ">= 0")),
        ("algorithm.gamma=1.5", ("algorithm.gamma=1.5", "<= 1")),
        ("algorithm.ppo_epochs=0", ("algorithm.ppo_epochs=0", ">= 1")),
        ("policies.main.optim.betas=[0.9, .nan]", ("optim.betas[1]=nan", "finite")),
        (  # a plugin part's derived options (an environment's keywords)
            "rollout.args={env: gridworld, env_args: {goal_reward: .nan}}",
            ("rollout.args.env_args.goal_reward=nan", "finite"),
        ),
    ],
)
def test_option_values_that_cannot_train_are_refused(recipe, capsys, override, needles):
    plugin = override.startswith("rollout.args")  # an environment's options: "in the recipe"
    extra = ["rollout.workflow=multi_turn"] if plugin else []
    where = () if plugin else (str(recipe),)
    refused(capsys, ["train", str(recipe), *extra, override], *needles, *where)


def test_an_infinite_dual_clip_is_still_a_setting(recipe):
    from polyrl.core.config import load
    from polyrl.core.recipe import Config

    cfg = load(Config, recipe, ["algorithm.clip_ratio_c=.inf"])  # Flow-GRPO: no dual clip
    assert cfg.algorithm.clip_ratio_c == float("inf")


def test_a_recursive_yaml_alias_names_the_key_and_line(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    path = tmp_path / "recipe.yaml"
    path.write_text("policies: {main: {model: no/such-model}}\nrollout:\n  stop: &s [a, *s]\n")
    refused(capsys, ["train", str(path)], "alias at 'rollout.stop[1]' (line 3)", "contains it")


@pytest.mark.parametrize("name", ["../../x", "a/b", ".."])
def test_a_run_name_that_leads_out_of_the_run_folder_is_refused(recipe, capsys, name):
    refused(capsys, ["train", str(recipe), f"run.name={name}"], f"run.name={name!r}", "plain")
    assert not Path("x").exists() and not (Path("..") / "x").exists()


TASK = """\
from pathlib import Path

class Task:
    @staticmethod
    def write_dataset(out_dir, seed=0, *, rows: int = 4):
        RESULT
"""


@pytest.mark.parametrize(
    "result, needles",
    [
        ("return None", ("write_dataset returned None", "(train_path, eval_path)")),
        (  # paths it never wrote: the task is at fault, not data.path
            "return Path(out_dir) / 'train.jsonl', Path(out_dir) / 'eval.jsonl'",
            ("train.jsonl' as its train file, but wrote no such file", "Fix the task's"),
        ),
    ],
    ids=["none", "unwritten"],
)
def test_a_task_that_returns_no_files_is_told_to_fix_the_task(recipe, capsys, result, needles):
    (recipe.parent / "my_task.py").write_text(TASK.replace("RESULT", result))
    cfg = RECIPE | {"task": {"name": "./my_task.py:Task"}, "run": {"dir": "out/run"}}
    recipe.write_text(yaml.safe_dump(cfg))
    err = refused(capsys, ["train", str(recipe)], "task", *needles)
    assert "Fix data.path" not in err


def test_export_of_a_run_without_checkpoint_says_what_to_give_it(recipe, capsys, tmp_path):
    run = tmp_path / "stopped"
    run.mkdir()
    (run / "config.yaml").write_text("seed: 0\n")
    err = refused(
        capsys, ["export", str(recipe), str(run)], "has no complete checkpoint", "Give export"
    )
    assert "polyrl export: error:" in err and "--resume" not in err
    assert [p.name for p in run.iterdir()] == ["config.yaml"]


@pytest.fixture(scope="module")
def moe_run(tmp_path_factory):
    """A run directory with one complete checkpoint of policy 'main', a tiny Qwen3-MoE as
    wide as the tiny dense model (conftest's tiny_model_dir), and its recipe."""
    from polyrl.core.config import load
    from polyrl.core.demo.tiny import tiny_qwen3_moe
    from polyrl.core.recipe import Config
    from polyrl.core.runner.session import Session

    root = tmp_path_factory.mktemp("moe-run")
    model = tiny_qwen3_moe(root / "moe", corpus="arithmetic", hidden_size=128, num_heads=2)
    body = {
        "run": {"dir": str(root / "run"), "progress": False, "tensorboard": False},
        "task": {"name": "arithmetic", "args": {"n_train": 40, "n_eval": 4}},
        "policies": {"main": {"model": str(model)}},
        "rollout": {"n": 2, "prompts_per_step": 2, "max_new_tokens": 4},
        "train": {"steps": 2},
    }
    recipe = root / "recipe.yaml"
    recipe.write_text(yaml.safe_dump(body))
    s = Session.open(load(Config, recipe))
    s.save(1)
    s.run.close()
    s.backend.shutdown()
    return body, root / "run"


def _files(run: Path) -> dict[str, int]:
    return {str(p.relative_to(run)): p.stat().st_size for p in run.rglob("*") if p.is_file()}


def test_export_with_another_recipe_names_the_runs_own(moe_run, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    body, run = moe_run
    other = tmp_path / "other.yaml"
    other.write_text(yaml.safe_dump(body | {"policies": {"actor": body["policies"]["main"]}}))
    before = _files(run)
    err = refused(
        capsys,
        ["export", str(other), str(run)],
        "holds policies ['main'], the recipe names ['actor']",
        f"{run / 'config.yaml'}",
    )
    assert "resume from a copy" not in err and _files(run) == before


def test_a_moe_checkpoint_into_a_dense_model_is_refused(moe_run, tiny_model_dir, tmp_path, capsys):
    body, run = moe_run
    dense = tmp_path / "dense.yaml"
    dense.write_text(yaml.safe_dump(body | {"policies": {"main": {"model": tiny_model_dir}}}))
    before = _files(run)
    refused(capsys, ["export", str(dense), str(run)], "policy 'main'", "another model")
    assert _files(run) == before and not (run / "export").exists()
