"""Bad recipes fail at config time, before any model loads, naming the closest valid name."""

from __future__ import annotations

import pytest

from polyrl.core.config import ConfigError

AGENTS = (
    "rollout.args={agents: [{name: speaker, policy: speaker}, {name: listener, policy: listener}]"
)


@pytest.mark.parametrize(
    "override,match",
    [
        ("rollout.args={agents: [{name: speker}, {name: listener}]}", "did you mean 'speaker'"),
        (
            "rollout.args={agents: [{name: speaker, policy: speakr}, {name: listener}]}",
            "unknown policy 'speakr'; did you mean 'speaker'",
        ),
        ("rollout.workflow=signalling", "did you mean 'signaling'"),
        ("rollout.args={agents: [{name: speaker}]}", "lacks 'listener'"),
        (AGENTS + ", jiont: cross}", "did you mean 'rollout.args.joint'"),
        (AGENTS + ", joint: cross}", "supports aligned"),
        (AGENTS + ", credit: {counterfactual: true}}", "needs joint: cross"),
        (
            "rollout.args={agents: [{name: speaker, rol: x}, {name: listener}]}",
            "did you mean 'rollout.args.agents[0].role'",
        ),
        ("algorithm.credit=group", "algorithm.credit='magrpo'"),
    ],
)
def test_bad_recipe_fails_before_models_load(marl_config, tmp_path, override, match):
    never = tmp_path / "never-built"
    with pytest.raises((ConfigError, KeyError)) as err:
        marl_config(
            f"policies.speaker.model={never}", "policies.speaker.build=tiny_qwen2", override
        )
    assert match in str(err.value)
    assert not never.exists()  # nothing was built or loaded


def test_workflow_keyword_arguments_are_checked(marl_config):
    ok = marl_config(
        "rollout.workflow=debate",
        "rollout.args={rounds: 3, agents: [{name: a, "
        "policy: speaker}, {name: b, policy: listener}]}",
    )
    assert ok.rollout.args["rounds"] == 3
    with pytest.raises(ConfigError, match="did you mean 'rollout.args.rounds'"):
        marl_config(
            "rollout.workflow=debate",
            "rollout.args={roundz: 3, agents: [{name: a, "
            "policy: speaker}, {name: b, policy: listener}]}",
        )
    with pytest.raises(ConfigError, match="at least 2 agents"):
        marl_config(
            "rollout.workflow=debate", "rollout.args={agents: [{name: a, policy: speaker}]}"
        )


def test_a_frozen_policy_cannot_train_an_agent(marl_config):
    with pytest.raises(ConfigError, match="train: false"):
        marl_config(
            "policies.speaker.train=false",
            "rollout.args={agents: [{name: speaker, train: true}, {name: listener}]}",
        )
    cfg = marl_config("policies.speaker.train=false")
    assert cfg.trained_policies() == ["listener"]


def test_agents_default_to_the_roles_and_same_named_policies(marl_config):
    from polyrl.core.registry import WORKFLOWS
    from polyrl.marl.config import parse_args

    cfg = marl_config()
    spec = WORKFLOWS.get("signaling")
    args, kwargs = parse_args(
        cfg.rollout.args, workflow="signaling", fn=spec.fn, roles=spec.roles, policies=cfg.policies
    )
    assert [(a.name, a.policy, a.train) for a in args.agents] == [
        ("speaker", "speaker", True),
        ("listener", "listener", True),
    ]
    assert args.agents[0].role.startswith("You are the speaker")
    assert kwargs == {}


def test_the_cli_reports_the_error(signaling_model_dir, tmp_path, capsys):
    """Through `polyrl train`: the error, no traceback into model loading."""
    from polyrl.core.cli import main

    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"""
task: {{name: signaling, dir: {tmp_path}/data}}
policies:
  speaker: {{model: {tmp_path}/missing-a, build: tiny_qwen2}}
  listener: {{model: {tmp_path}/missing-b, build: tiny_qwen2}}
rollout:
  workflow: signaling
  args: {{agents: [{{name: speaker}}, {{name: lisener}}]}}
algorithm: {{credit: magrpo}}
run: {{dir: {tmp_path}/run}}
""")
    with pytest.raises(ConfigError, match="did you mean 'listener'"):
        main(["train", str(recipe)])
    assert not (tmp_path / "missing-a").exists() and not (tmp_path / "run").exists()


def test_the_main_demo_runs_by_name_from_the_package():
    """`polyrl train signaling` (the README's command 1) needs no path into the repository."""
    from polyrl.core.cli import _load
    from polyrl.core.registry import RECIPES, UnknownNameError

    cfg = _load("signaling", ["train.steps=2"])
    assert cfg.task.name == "signaling" and cfg.train.steps == 2
    assert cfg.rollout.workflow == "signaling" and set(cfg.policies) == {"speaker", "listener"}
    assert RECIPES.get("signaling").is_file() and "arithmetic" in RECIPES.names()
    with pytest.raises(UnknownNameError, match="did you mean 'signaling'"):
        _load("signalling", [])
