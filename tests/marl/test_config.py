"""Bad recipes fail at config time, before any model loads, naming the closest valid name."""

from __future__ import annotations

import dataclasses

import pytest

from polyrl.core.config import ConfigError

TWO = "agents: [{name: a, policy: speaker}, {name: b, policy: listener}]"
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
        (AGENTS + ", jiont: cross}", "did you mean rollout.args.joint?"),
        (AGENTS + ", joint: cross}", "rollout.args.joint='cross'"),
        ("algorithm.credit_args={counterfactual: true}", "needs rollout.args.joint: cross"),
        (AGENTS + ", credit: {per_agent_norm: true}}", "workflow 'signaling' has no option"),
        ("algorithm.credit_args={per_agent_nrom: true}", "algorithm.credit_args.per_agent_norm"),
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
    with pytest.raises(ConfigError, match="did you mean rollout.args.rounds?"):
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
    from polyrl.marl.config import resolve_agents

    cfg = marl_config()
    spec = WORKFLOWS.get("signaling")
    agents = resolve_agents(
        cfg.rollout.args.agents, workflow="signaling", roles=spec.roles, policies=cfg.policies
    )
    assert [(a.name, a.policy, a.train) for a in agents] == [
        ("speaker", "speaker", True),
        ("listener", "listener", True),
    ]
    assert agents[0].role.startswith("You are the speaker")
    assert cfg.rollout.args.agents == []  # the recipe stays as written
    assert spec.params == ()  # signaling's function takes no options of its own


def test_each_workflow_has_its_own_typed_options(marl_config):
    """joint lists exactly the modes a workflow supports; tree exists only where turns do;
    a workflow function's keyword parameters are options with their types."""
    from typing import get_args, get_type_hints

    from polyrl.core.registry import WORKFLOWS

    def joints(name):
        return get_args(get_type_hints(WORKFLOWS.options(name))["joint"])

    assert joints("parallel") == ("aligned", "cross") and joints("chain") == ("aligned",)
    for name, turns in [
        ("signaling", True),
        ("debate", True),
        ("chain", False),
        ("parallel", False),
        ("aggregator", False),
    ]:
        names = [f.name for f in dataclasses.fields(WORKFLOWS.options(name))]
        assert ("tree" in names) == turns, name
    with pytest.raises(ConfigError, match=r"rollout\.args\.tree .*workflow 'chain' has no option"):
        marl_config("rollout.workflow=chain", "rollout.args={tree: true, " + TWO + "}")
    with pytest.raises(ConfigError, match=r"rollout\.args\.rounds .*must be an integer"):
        marl_config("rollout.workflow=debate", "rollout.args={rounds: two, " + TWO + "}")
    with pytest.raises(ConfigError, match=r"rollout\.args\.final='best'"):
        marl_config("rollout.workflow=parallel", "rollout.args={final: best, " + TWO + "}")
    cfg = marl_config(
        "rollout.workflow=parallel", "rollout.args={joint: cross, final: vote, " + TWO + "}"
    )
    assert cfg.rollout.args.final == "vote" and cfg.rollout.args.separator == "\n"


def test_credit_options_come_from_algorithm_credit_args(marl_config):
    cfg = marl_config("algorithm.credit_args={per_agent_norm: true, shaping_alpha: 0.5}")
    assert cfg.algorithm.credit_args.per_agent_norm is True
    assert cfg.algorithm.credit_args.shaping_alpha == 0.5
    assert cfg.algorithm.credit_args.cross_value == "mean"  # the credit's own default


def test_polyrl_config_documents_marl_options(capsys):
    """`polyrl config` shows each workflow's joint modes and the critic's options with
    their types and docs, and the magrpo credit's options."""
    from polyrl.core.runner.cli import main

    assert main(["config"]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert "  [rollout.workflow: parallel] " in out
    assert any(
        line.strip().startswith("rollout.args.joint ('aligned' | 'cross' = 'aligned'): aligned:")
        for line in lines
    )
    assert any(
        line.strip().startswith("rollout.args.joint ('aligned' = 'aligned'): aligned:")
        for line in lines
    )
    assert any(
        line.strip()
        == "rollout.args.critic.lr (float = 0.0001): AdamW learning rate of the critic's "
        "backbone and head"
        for line in lines
    )
    assert any(
        line.strip().startswith("rollout.args.tree (bool = False): multi-turn") for line in lines
    )
    assert any(
        line.strip().startswith("algorithm.credit_args.per_agent_norm (bool = False): normalise")
        for line in lines
    )
    assert any(line.strip().startswith("rollout.args.template (str = ") for line in lines)
    assert "options not declared (signaling" not in out and "(vllm_lora" not in out


def test_the_cli_reports_the_error(signaling_model_dir, tmp_path, capsys):
    """Through `polyrl train`: the error, no traceback into model loading."""
    from polyrl.core.runner.cli import main

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
    assert main(["train", str(recipe)]) == 2
    err = capsys.readouterr().err
    assert "did you mean 'listener'" in err and "Traceback" not in err
    assert not (tmp_path / "missing-a").exists() and not (tmp_path / "run").exists()


def test_the_main_demo_runs_by_name_from_the_package():
    """`polyrl train signaling` (the README's command 1) needs no path into the repository."""
    from polyrl.core.registry import RECIPES, UnknownNameError
    from polyrl.core.runner.cli import _load

    cfg = _load("signaling", ["train.steps=2"])
    assert cfg.task.name == "signaling" and cfg.train.steps == 2
    assert cfg.rollout.workflow == "signaling" and set(cfg.policies) == {"speaker", "listener"}
    assert RECIPES.get("signaling").is_file() and "arithmetic" in RECIPES.names()
    with pytest.raises(UnknownNameError, match="did you mean 'signaling'"):
        _load("signalling", [])
