"""``multi_turn`` with a ``max_context`` no episode can act within: a recipe error through the
CLI (exit 2, the key and the fix), not a crash in the update after the rollout."""

from __future__ import annotations

from pathlib import Path

from polyrl.core.runner.cli import main

RECIPE = Path(__file__).resolve().parents[2] / "examples" / "gridworld_gigpo.yaml"


def test_a_context_smaller_than_the_first_observation_is_a_recipe_error(
    grid_model_dir, tmp_path, capsys
):
    run = tmp_path / "run"
    argv = [
        "train",
        str(RECIPE),
        f"policies.main.model={grid_model_dir}",
        f"run.dir={run}",
        f"task.dir={tmp_path}/data",
        "task.args={n_train: 8, n_eval: 4, size: 4, holes: 3, min_dist: 4, fixed_goal: true}",
        "sft.steps=0",
        "eval.every=0",
        "train.steps=1",
        "rollout.n=2",
        "rollout.prompts_per_step=2",
        "rollout.args.max_context=8",
        "run.progress=false",
        "run.tensorboard=false",
    ]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.count("error:") == 1, err
    assert "rollout.args.max_context=8" in err and "leaving no room for an action" in err
    assert not list(run.glob("checkpoints/step_*"))  # stopped before any update
