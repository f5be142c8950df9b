"""Bad input through the CLI (issue 38): each case exits with status 2 and a message that
names the key or file and the fix, before any model loads, with nothing written or lost."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

import polyrl.core  # noqa: F401  (registers the core's parts)
from polyrl.core.cli import main

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
        (  # a plugin part's derived options: Annotated[int, "doc", AT_LEAST_1]
            "rollout.args={max_turns: 0}",
            ("rollout.args.max_turns=0", ">= 1"),
        ),
    ],
)
def test_option_values_that_cannot_train_are_refused(recipe, capsys, override, needles):
    extra = ["rollout.workflow=multi_turn"] if override.startswith("rollout.args") else []
    refused(capsys, ["train", str(recipe), *extra, override], *needles, str(recipe))


def test_an_infinite_dual_clip_is_still_a_setting(recipe):
    from polyrl.core.config import load
    from polyrl.core.recipe import Config

    cfg = load(Config, recipe, ["algorithm.clip_ratio_c=.inf"])  # Flow-GRPO: no dual clip
    assert cfg.algorithm.clip_ratio_c == float("inf")
