"""Recipe input that used to pass silently: keys given twice, greedy sampling under a group
estimator, an absurd staleness, a token budget a padded policy kind ignores. Each is a
ConfigError naming the file and key (exit 2, before any model loads) or a logged warning."""

from __future__ import annotations

import warnings

import pytest
import yaml

import polyrl.core  # noqa: F401  (registers the core's parts)
from polyrl.core.config import ConfigError, load
from polyrl.core.recipe import MAX_STALENESS, Config
from polyrl.core.runner.cli import main

RECIPE = {"policies": {"main": {"model": "some/model"}}, "train": {"steps": 3}}


@pytest.fixture
def recipe(tmp_path):
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(RECIPE))
    return path


# ------------------------------------------------------------------------- duplicate keys

# after the two lines that declare the policy
TWICE = {
    "top level": ("seed: 1\nseed: 2\n", "'seed' (line 3 and line 4)"),
    "nested": (
        "rollout:\n  n: 4\n  temperature: 0.7\n  n: 8\n",
        "'rollout.n' (line 4 and line 6)",
    ),
    "in a list item": (
        "reward:\n  terms:\n    - name: exact_match\n      weight: 1\n      weight: 2\n",
        "'reward.terms[0].weight' (line 6 and line 7)",
    ),
}


@pytest.mark.parametrize("case", sorted(TWICE))
def test_a_key_given_twice_names_file_key_and_both_lines(tmp_path, case):
    text, expected = TWICE[case]
    path = tmp_path / "twice.yaml"
    path.write_text("policies:\n  main: {model: some/model}\n" + text)
    with pytest.raises(ConfigError) as e:
        load(Config, path)
    assert str(path) in str(e.value) and expected in str(e.value)
    assert "keep only the last" in str(e.value)


def test_a_key_given_twice_exits_2_through_the_cli(tmp_path, capsys):
    path = tmp_path / "twice.yaml"
    path.write_text("policies:\n  main: {model: some/model}\ntrain:\n  steps: 1\n  steps: 2\n")
    assert main(["train", str(path)]) == 2
    err = capsys.readouterr().err
    assert "'train.steps' (line 4 and line 5)" in err and "Traceback" not in err


def test_a_merge_key_may_still_be_overridden(tmp_path):
    path = tmp_path / "merge.yaml"
    path.write_text(
        "policies:\n"
        "  main: &main {model: some/model, micro_batch_size: 2}\n"
        "  other:\n    <<: *main\n    micro_batch_size: 4\n"
    )
    cfg = load(Config, path)
    assert cfg.policies["other"].micro_batch_size == 4
    assert cfg.policies["other"].model == "some/model"


# ---------------------------------------------------------------- greedy group sampling


@pytest.mark.parametrize("advantage", ["grpo", "rloo", "reinforce_plus_plus_baseline"])
def test_greedy_sampling_with_a_group_estimator_warns(recipe, advantage):
    with pytest.warns(UserWarning, match="rollout.temperature=0 .* no group can have a non-zero"):
        load(Config, recipe, ["rollout.temperature=0", f"algorithm.advantage={advantage}"])


@pytest.mark.parametrize(
    "overrides",
    [
        ["rollout.temperature=0.7"],  # sampled
        ["rollout.temperature=0", "algorithm.advantage=reinforce_plus_plus"],  # batch baseline
        ["rollout.temperature=0", "train.steps=0"],  # evaluation only
    ],
)
def test_no_warning_where_groups_can_differ_or_nothing_trains(recipe, overrides):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        load(Config, recipe, overrides)


# -------------------------------------------------------------------------- staleness


def test_an_absurd_staleness_is_refused_saying_why(recipe):
    with pytest.raises(ConfigError) as e:
        load(Config, recipe, ["rollout.max_staleness=1000000"])
    msg = str(e.value)
    assert "rollout.max_staleness=1000000" in msg and str(recipe) in msg
    assert f"in [0, {MAX_STALENESS}]" in msg and "copies of each trained policy's weights" in msg
    assert load(Config, recipe, [f"rollout.max_staleness={MAX_STALENESS}"])


# -------------------------------------------------------------- token budget, padded kinds

PADDED_KIND = """
from polyrl.core.train.policy import CausalLMPolicy


class PaddedKind(CausalLMPolicy):
    def logprobs(self, batch, temperature=1.0, with_entropy=False):
        raise AssertionError("never built at load")
"""


def test_a_token_budget_on_a_kind_with_its_own_padded_pass_is_refused(tmp_path, recipe):
    (tmp_path / "padded_kind.py").write_text(PADDED_KIND)
    padded = tmp_path / "padded.yaml"
    padded.write_text("policies:\n  main: {model: some/model, kind: ./padded_kind.py:PaddedKind}\n")
    budget = "policies.main.max_tokens_per_micro_batch=4096"
    load(Config, padded)  # the kind itself loads
    with pytest.raises(ConfigError) as e:
        load(Config, padded, [budget])
    msg = str(e.value)
    assert "policies.main.max_tokens_per_micro_batch=4096" in msg and str(padded) in msg
    assert "padded" in msg and "micro_batch_size" in msg
    assert load(Config, recipe, [budget]).policies["main"].max_tokens_per_micro_batch == 4096


def test_a_token_budget_on_a_vlm_is_refused(recipe):
    pytest.importorskip("polyrl.multimodal")
    with pytest.raises(ConfigError, match="policy kind 'qwen_vl' keeps its log-prob passes"):
        load(
            Config,
            recipe,
            ["policies.main.kind=qwen_vl", "policies.main.max_tokens_per_micro_batch=4096"],
        )
