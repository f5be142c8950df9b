"""Recipe loading: YAML + overrides, strict keys with hints, types, names checked at load."""

from __future__ import annotations

import dataclasses
import typing
from pathlib import Path

import pytest
import yaml

import polyrl.core  # noqa: F401  (registers the core's parts)
from polyrl.core.config import ConfigError, load, parse_overrides
from polyrl.core.recipe import Config
from polyrl.core.registry import UnknownNameError
from polyrl.core.runner.cli import main

EXAMPLES = sorted((Path(__file__).resolve().parents[2] / "examples").glob("*.yaml"))
RECIPE = {
    "run": {"name": "t", "dir": "runs/{name}"},
    "policies": {"main": {"model": "some/model", "optim": {"lr": 1.0e-4}}},
    "algorithm": {"advantage": "grpo"},
    "train": {"steps": 3},
}


@pytest.fixture
def recipe(tmp_path) -> Path:
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(RECIPE))
    return path


def write(tmp_path: Path, data: dict) -> Path:
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


# --------------------------------------------------------------------------- loading


def test_yaml_and_overrides(recipe):
    cfg = load(
        Config,
        recipe,
        [
            "train.steps=7",
            "policies.main.optim.lr=1e-5",
            "rollout.stop=['</answer>', '\\n\\n']",
            "run.tensorboard=false",
        ],
    )
    assert cfg.run.name == "t" and cfg.train.steps == 7
    assert cfg.policies["main"].model == "some/model"
    assert cfg.policies["main"].optim.lr == pytest.approx(1e-5)  # YAML reads "1e-5" as a string
    assert isinstance(cfg.policies["main"].optim.lr, float)
    assert cfg.rollout.stop == ["</answer>", "\\n\\n"]
    assert cfg.run.tensorboard is False
    assert cfg.policies["main"].optim.weight_decay == 0.0  # untouched defaults survive the merge


def test_overrides_parse_yaml_values():
    out = parse_overrides(
        [
            "a.list=[1, 2, x]",
            "a.map={k: v, n: 3}",
            "b=4",
            "c=2.5",
            "d=true",
            "e=null",
            "f=",
            "g=some text",
            "a.deep.er=false",
        ]
    )
    assert out == {
        "a": {"list": [1, 2, "x"], "map": {"k": "v", "n": 3}, "deep": {"er": False}},
        "b": 4,
        "c": 2.5,
        "d": True,
        "e": None,
        "f": "",
        "g": "some text",
    }
    with pytest.raises(ConfigError, match="key.sub=value"):
        parse_overrides(["no_equals_sign"])


def test_override_replaces_a_mapping_value(recipe):
    cfg = load(
        Config,
        recipe,
        ["task.name=arithmetic", "task.args={n_train: 5, n_eval: 2, ops: '+-'}"],
    )
    # the whole mapping is replaced (no key of the recipe's survives), then typed
    assert (cfg.task.args.n_train, cfg.task.args.n_eval, cfg.task.args.ops) == (5, 2, "+-")
    assert cfg.task.args.max_operand == 20  # the task's default, not the recipe's


def test_missing_recipe_file(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load(Config, tmp_path / "nope.yaml")


# --------------------------------------------------------------------------- strict keys


@pytest.mark.parametrize(
    "override, where, hint",
    [
        ("algoritm.advantage=grpo", "algoritm", "algorithm"),
        ("algorithm.clip_ratoi_low=0.3", "algorithm.clip_ratoi_low", "algorithm.clip_ratio_low"),
        ("policies.main.optim.lrr=0.1", "policies.main.optim.lrr", "policies.main.optim.lr"),
        ("eval.data.promt_field=q", "eval.data.promt_field", "eval.data.prompt_field"),
    ],
)
def test_unknown_key_names_nearest_and_file(tmp_path, override, where, hint):
    """A typo in the file fails naming the key, the closest valid key and the file."""
    data = yaml.safe_load(yaml.safe_dump(RECIPE))
    node = data
    key, _, value = override.partition("=")
    *parents, leaf = key.split(".")
    for p in parents:
        node = node.setdefault(p, {})
    node[leaf] = yaml.safe_load(value)
    path = write(tmp_path, data)
    with pytest.raises(ConfigError) as e:
        load(Config, path)
    msg = str(e.value)
    assert repr(where) in msg and f"did you mean {hint!r}" in msg and str(path) in msg


def test_unknown_key_in_override(recipe):
    with pytest.raises(ConfigError, match=r"did you mean 'rollout.temperature'.*") as e:
        load(Config, recipe, ["rollout.temprature=0.5"])
    assert "command-line overrides" in str(e.value)


def test_unknown_key_in_a_reward_term(recipe):
    with pytest.raises(ConfigError, match=r"did you mean 'reward.terms\[0\].weight'"):
        load(Config, recipe, ["reward.terms=[{name: exact_match, wieght: 2}]"])


@pytest.mark.parametrize(
    "override, key, kind",
    [
        ("train.steps=ten", "train.steps", "integer"),
        ("train.steps=2.5", "train.steps", "integer"),
        ("rollout.temperature=hot", "rollout.temperature", "number"),
        ("run.resume=maybe", "run.resume", "true or false"),
        ("rollout.stop=7", "rollout.stop", "list"),
        ("policies.main.optim=0.1", "policies.main.optim", "mapping"),
        ("policies.main.model=[a, b]", "policies.main.model", "string"),
    ],
)
def test_wrong_type_names_the_key(recipe, override, key, kind):
    with pytest.raises(ConfigError) as e:
        load(Config, recipe, [override])
    assert key in str(e.value) and kind in str(e.value) and str(recipe) in str(e.value)


def test_literal_rejects_bad_value_with_hint(recipe):
    with pytest.raises(ConfigError, match=r"distributed.backend='rayy'.*did you mean 'ray'"):
        load(Config, recipe, ["distributed.backend=rayy"])
    assert load(Config, recipe, ["distributed.backend=ray"]).distributed.backend == "ray"


# --------------------------------------------------------------------------- names at load


@pytest.mark.parametrize(
    "override, hint",
    [
        ("reward.terms=[{name: exact_mach}]", "exact_match"),
        ("algorithm.advantage=grpoo", "grpo"),
        ("algorithm.policy_loss=ppo_clp", "ppo_clip"),
        ("rollout.workflow=single_trn", "single_turn"),
        ("policies.main.engine.name=hff", "hf"),
        ("policies.main.kind=causal_llm", "causal_lm"),
        ("task.name=arithmetc", "arithmetic"),
    ],
)
def test_unknown_part_name_fails_at_load(recipe, override, hint):
    """Registered names are resolved by Config.validate, before anything is built."""
    with pytest.raises(UnknownNameError, match=f"did you mean {hint!r}"):
        load(Config, recipe, [override])


def test_loss_agg_typo(recipe):
    with pytest.raises(ConfigError, match="did you mean 'token-mean'"):
        load(Config, recipe, ["algorithm.loss_agg=token_mean"])


def test_lora_warm_start_with_kl_is_refused(recipe):
    """A LoRA policy's reference is the base without the adapter, i.e. before the warm
    start: KL would pull RL back past it, so the recipe fails at load time."""
    base = ["sft.steps=5", "algorithm.kl_coef=0.01"]
    with pytest.raises(ConfigError, match=r"LoRA on \['main'\].*kl_coef: 0"):
        load(Config, recipe, [*base, "policies.main.lora.r=4"])
    load(Config, recipe, base)  # a full fine-tune's frozen copy takes the SFT weights
    load(Config, recipe, ["sft.steps=5", "policies.main.lora.r=4"])  # no KL: nothing to anchor


def test_no_policies_fails_clearly(tmp_path):
    data = {k: v for k, v in RECIPE.items() if k != "policies"}
    with pytest.raises(ConfigError, match="declares no policies"):
        load(Config, write(tmp_path, data))
    with pytest.raises(ConfigError, match="no policies"):
        load(Config, None, [])


def test_empty_model_and_unknown_trained_policy(recipe):
    with pytest.raises(ConfigError, match="policies.main.model is empty"):
        load(Config, recipe, ["policies.main.model="])
    with pytest.raises(ConfigError, match="did you mean 'main'"):
        load(Config, recipe, ["train.policies=[mian]"])


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_example_recipes_load(path):
    cfg = load(Config, path)
    assert cfg.policies and cfg.train.steps > 0


def test_there_are_examples():
    assert EXAMPLES


# --------------------------------------------------------------------------- docs


def config_classes(cls: type, seen: set | None = None) -> set[type]:
    """Every dataclass reachable from ``cls`` through fields, dicts, lists and unions."""
    seen = set() if seen is None else seen
    if cls in seen:
        return seen
    seen.add(cls)

    def visit(tp: typing.Any) -> None:
        if dataclasses.is_dataclass(tp):
            config_classes(tp, seen)
        for arg in typing.get_args(tp):
            visit(arg)

    for tp in typing.get_type_hints(cls).values():
        visit(tp)
    return seen


def test_every_recipe_field_has_a_doc():
    classes = config_classes(Config)
    names = {c.__name__ for c in classes}
    assert {"PolicyConfig", "OptimConfig", "RewardTerm", "DataConfig", "AlgorithmConfig"} <= names
    missing = [
        f"{c.__name__}.{f.name}"
        for c in classes
        for f in dataclasses.fields(c)
        if not str(f.metadata.get("doc", "")).strip()
    ]
    assert not missing, f"fields without a doc: {missing}"


def test_polyrl_config_lists_keys_with_docs(capsys):
    assert main(["config"]) == 0
    out = capsys.readouterr().out
    lines = {line.split(" ")[0].rstrip(":"): line for line in out.splitlines()}
    for key in (
        "seed",
        "algorithm.clip_ratio_low",
        "policies.<name>.optim.lr",
        "reward.terms[].name",
        "eval.data.path",
        "distributed.backend",
    ):
        assert key in lines, f"polyrl config does not list {key}"
        assert lines[key].split(": ", 1)[1].strip(), f"{key} has no doc"
    assert "'local' | 'ray'" in lines["distributed.backend"]


def test_yaml_boolean_for_a_string_field_is_an_error(recipe):
    """`run.name=no` would silently become 'False'; it must be quoted instead."""
    with pytest.raises(ConfigError, match="run.name.*quote"):
        load(Config, recipe, ["run.name=no"])
    assert load(Config, recipe, ["run.name='no'"]).run.name == "no"
    assert load(Config, recipe, ["run.name=2024"]).run.name == "2024"
