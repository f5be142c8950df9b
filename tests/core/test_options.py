"""Typed options of registered parts, user parts named by file path, declared hooks."""

from __future__ import annotations

import dataclasses
from typing import Annotated, Literal

import pytest
import torch
import yaml

import polyrl.core  # noqa: F401  (registers the core's parts)
from polyrl.core.config import ConfigError, doc, load
from polyrl.core.options import Options
from polyrl.core.recipe import Config
from polyrl.core.registry import Registry, UnknownNameError, import_path
from polyrl.core.train.credit import group_stats

# --------------------------------------------------------------------------- derived options


def scorer(
    sample,
    *,
    scale: Annotated[float, "multiplies the score"] = 1.0,
    mode: Annotated[Literal["strict", "loose"], "how to compare"] = "strict",
    tags: list[str] = [],  # noqa: B006  (a default the options must copy, not share)
):
    return scale


def test_keyword_parameters_are_the_options_with_types_defaults_and_docs():
    reg = Registry("thing", skip=1)
    reg.register("scorer", scorer)
    options = reg.options("scorer")
    fields = {f.name: f for f in dataclasses.fields(options)}
    assert list(fields) == ["scale", "mode", "tags"]
    assert (
        fields["scale"].default == 1.0 and fields["scale"].metadata["doc"] == "multiplies the score"
    )
    typed = reg.bind("scorer", {"scale": 2, "mode": "loose"}, "x.args")
    assert (typed.scale, typed.mode, typed.tags) == (2.0, "loose", [])
    assert isinstance(typed.scale, float)
    assert scorer(None, **typed) == 2.0  # options unpack as the part's keywords
    assert reg.bind("scorer", {}, "x.args").tags is not reg.bind("scorer", {}, "x.args").tags


@pytest.mark.parametrize(
    "value, message",
    [
        (
            {"scael": 2.0},
            "x.args.scael in r.yaml: thing 'scorer' has no option 'scael'; did you mean x.args.scale?",
        ),
        ({"mode": "lose"}, "not one of ['strict', 'loose']; did you mean 'loose'?"),
        ({"scale": "big"}, "x.args.scale in r.yaml must be a number"),
        ([1, 2], "x.args in r.yaml must be a mapping"),
    ],
)
def test_bad_options_name_the_key_the_part_and_the_fix(value, message):
    reg = Registry("thing", skip=1)
    reg.register("scorer", scorer)
    with pytest.raises(ConfigError) as e:
        reg.bind("scorer", value, "x.args", "r.yaml")
    assert message in str(e.value)


def test_a_part_taking_kwargs_must_declare_its_options():
    def loose(sample, **kw):
        return 0.0

    reg = Registry("thing", skip=1)
    reg.register("loose", loose)
    with pytest.raises(TypeError, match=r"takes \*\*kw.*register it with options="):
        reg.options("loose")


@dataclasses.dataclass
class Knobs(Options):
    depth: int = doc(2, "how deep")
    name: str = doc("a", "what to call it")


def test_declared_options_are_checked_against_the_signature():
    reg = Registry("thing", skip=1)

    def part(ctx, depth=2, name="a"):
        return depth, name

    reg.register("part", part, options=Knobs)
    assert reg.options("part") is Knobs
    assert part(None, **reg.bind("part", {"depth": 5}, "y")) == (5, "a")

    def narrow(ctx, depth=2):
        return depth

    with pytest.raises(TypeError, match=r"declares options \['name'\]"):
        reg.register("narrow", narrow, options=Knobs)

    @dataclasses.dataclass
    class Plain:
        depth: int = 1

    with pytest.raises(TypeError, match="subclassing polyrl Options"):
        reg.register("plain", part, options=Plain)


def test_parts_that_read_their_config_take_no_options_unless_declared():
    reg = Registry("kind", keywords=False)
    reg.register("bare", object)
    with pytest.raises(ConfigError, match="it takes no options"):
        reg.bind("bare", {"x": 1}, "policies.main.args")
    reg.register("knobs", dict, options=Knobs)
    assert reg.bind("knobs", {"depth": 3}, "policies.main.args").depth == 3


# --------------------------------------------------------------------------- recipes


def test_a_recipe_key_the_chosen_part_does_not_take_fails_at_load(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text(
        yaml.safe_dump(
            {
                "policies": {"main": {"model": "m"}},
                "task": {"name": "arithmetic", "args": {"n_train": 4, "n_eval": 2, "opz": "+"}},
            }
        )
    )
    with pytest.raises(ConfigError) as e:
        load(Config, recipe)
    msg = str(e.value)
    assert "task.args.opz" in msg and "task 'arithmetic'" in msg and "task.args.ops" in msg
    assert str(recipe) in msg


def test_options_are_typed_and_written_back_as_the_mapping(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text(
        yaml.safe_dump(
            {
                "policies": {
                    "main": {"model": "m", "build": "tiny_qwen2", "build_args": {"hidden_size": 32}}
                },
                "task": {"name": "arithmetic", "args": {"n_train": 4, "n_eval": 2}},
            }
        )
    )
    cfg = load(Config, recipe)
    assert cfg.policies["main"].build_args.hidden_size == 32
    assert cfg.task.args.max_operand == 20  # the task's own default
    written = dataclasses.asdict(cfg)
    assert written["task"]["args"]["n_train"] == 4
    assert written["policies"]["main"]["build_args"]["hidden_size"] == 32
    # the written config loads again to the same options
    again = tmp_path / "again.yaml"
    again.write_text(yaml.safe_dump(written))
    assert load(Config, again).task.args == cfg.task.args


# --------------------------------------------------------------------------- user parts by path

TASK_FILE = """
from pathlib import Path
from typing import Annotated
import json

def write_dataset(out_dir, seed: int, n: Annotated[int, "rows"] = 3):
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for name in ("train", "eval"):
        (out / f"{name}.jsonl").write_text(
            "".join(json.dumps({"prompt": f"{i}", "answer": f"{i}"}) + "\\n" for i in range(n))
        )
    return out / "train.jsonl", out / "eval.jsonl"
"""


def test_a_py_file_beside_the_recipe_names_a_part_with_no_pythonpath(tmp_path, monkeypatch):
    (tmp_path / "recipes").mkdir()
    (tmp_path / "recipes" / "my_task.py").write_text(
        TASK_FILE + "\nimport sys\nTask = sys.modules[__name__]\n"
    )
    recipe = tmp_path / "recipes" / "r.yaml"
    recipe.write_text(
        yaml.safe_dump(
            {
                "policies": {"main": {"model": "m"}},
                "task": {"name": "./my_task.py:Task", "args": {"n": 5}},
            }
        )
    )
    monkeypatch.chdir(tmp_path)  # not the recipe's folder: found beside the recipe
    cfg = load(Config, recipe)
    assert cfg.task.args.n == 5
    from polyrl.core.registry import TASKS

    assert cfg.task.name == f"{tmp_path / 'recipes' / 'my_task.py'}:Task"  # made absolute
    task = TASKS.get(cfg.task.name)
    train, _ = task.write_dataset(tmp_path / "out", seed=0, **cfg.task.args)
    assert len(train.read_text().splitlines()) == 5


def test_import_path_errors_say_what_is_missing(tmp_path):
    with pytest.raises(UnknownNameError, match="no file 'nope.py'"):
        import_path("nope.py:Thing")
    with pytest.raises(UnknownNameError, match="no module 'not_a_module_xyz'"):
        import_path("not_a_module_xyz:Thing")
    (tmp_path / "parts.py").write_text("def reward(sample):\n    return 1.0\n")
    with pytest.raises(UnknownNameError, match="has no attribute 'rewrad'; did you mean 'reward'"):
        import_path(f"{tmp_path / 'parts.py'}:rewrad")
    assert import_path(f"{tmp_path / 'parts.py'}:reward")(None) == 1.0


# --------------------------------------------------------------------------- group statistics


def test_group_stats_match_a_hand_computation():
    values = torch.tensor([1.0, 4.0, 7.0, 2.0, 10.0])
    groups = torch.tensor([5, 5, 5, -1, 8])  # any integer ids
    mean, std, count = group_stats(values, groups)
    assert mean.tolist() == [4.0, 4.0, 4.0, 2.0, 10.0]
    assert std.tolist() == [3.0, 3.0, 3.0, 0.0, 0.0]  # sqrt((9+0+9)/2); one-row groups 0
    assert count.tolist() == [3.0, 3.0, 3.0, 1.0, 1.0]
    _, pop, _ = group_stats(values, groups, unbiased=False)
    assert pop[0].item() == pytest.approx((18 / 3) ** 0.5)


def test_verl_actor_config_is_not_mutated_between_calls():
    from polyrl.core.train.algorithms import (
        AggInfo,
        AlgorithmConfig,
        _actor_config,
        _verl_actor_config,
    )

    cfg = AlgorithmConfig()
    first = _verl_actor_config("vanilla", cfg, AggInfo(batch_num_tokens=10, global_batch_size=2))
    second = _verl_actor_config("vanilla", cfg, AggInfo(batch_num_tokens=99, global_batch_size=7))
    assert first.global_batch_info["batch_num_tokens"] == 10
    assert second.global_batch_info["batch_num_tokens"] == 99
    assert _actor_config.cache_info().currsize >= 1  # the settings are still built once


def test_an_options_check_runs_when_a_recipe_binds_them():
    import dataclasses

    import pytest

    from polyrl.core.config import ConfigError, doc
    from polyrl.core.options import Options, bind

    @dataclasses.dataclass
    class Clip(Options):
        clip: float = doc(5.0, "advantage clip (> 0)")

        def check(self, where, source="<config>"):
            if self.clip <= 0:
                raise ConfigError(f"{where}.clip={self.clip} in {source}: must be > 0")

    assert bind(Clip, {"clip": 2.0}, "algorithm.credit_args", "r.yaml", "credit 'x'").clip == 2.0
    with pytest.raises(ConfigError, match=r"algorithm.credit_args.clip=-1.0 in r.yaml"):
        bind(Clip, {"clip": -1.0}, "algorithm.credit_args", "r.yaml", "credit 'x'")
