"""Registries: naming parts, finding them by name, import path or file, and their options.

Derived and declared options in depth are in test_options.py; this file covers the
registry's own behaviour around them.
"""

from __future__ import annotations

import dataclasses
import sys
from typing import Annotated

import pytest

import polyrl.core  # noqa: F401  (registers the core's parts)
from polyrl.core.config import ConfigError, UserError, doc
from polyrl.core.options import Options
from polyrl.core.registry import CREDIT, Registry, UnknownNameError, import_path, nearest
from polyrl.core.train.algorithms import AlgorithmConfig


def reward_exact(sample, *, strict: Annotated[bool, "compare case"] = True):
    return 1.0


def reward_length(sample, *, target: Annotated[int, "tokens"] = 10):
    return 0.0


def rewards() -> Registry:
    reg = Registry("reward", skip=1)
    reg.register("exact", reward_exact)
    reg.register("length", reward_length)
    return reg


# ------------------------------------------------------------------------------ register


def test_a_name_holds_one_part():
    reg = rewards()
    reg.register("exact", reward_exact)  # the same part again (a re-imported module) is fine
    with pytest.raises(ValueError, match="reward 'exact' is already registered"):
        reg.register("exact", reward_length)
    assert reg.get("exact") is reward_exact


def test_register_works_as_a_decorator():
    reg = Registry("reward", skip=1)

    @reg.register("constant")
    def constant(sample):
        return 0.5

    assert reg.get("constant") is constant and constant(None) == 0.5
    assert "constant" in reg and "other" not in reg


def test_names_are_listed_sorted():
    reg = rewards()
    reg.register("accuracy", reward_exact)
    assert list(reg) == ["accuracy", "exact", "length"]
    assert reg.names() == ["accuracy", "exact", "length"]  # after loading the plugins


# ------------------------------------------------------------------------------ get


def test_an_unknown_name_gets_the_nearest_and_the_registered_names():
    with pytest.raises(UnknownNameError) as e:
        rewards().get("lenght")
    msg = str(e.value)
    assert msg.startswith("unknown reward 'lenght'; did you mean 'length'?")
    assert "Registered: exact, length." in msg
    assert "'./my_file.py:Name'" in msg  # and how to name a part of one's own
    assert isinstance(e.value, UserError) and isinstance(e.value, KeyError)
    assert not msg.startswith('"')  # not quoted as KeyError quotes its message


def test_an_unknown_name_with_nothing_near_gets_no_guess():
    with pytest.raises(UnknownNameError) as e:
        rewards().get("zzzzzz")
    assert "did you mean" not in str(e.value)
    with pytest.raises(UnknownNameError, match=r"Registered: \(none\)"):
        Registry("thing").get("x")
    with pytest.raises(UnknownNameError, match="unknown reward 'lenght'"):
        rewards().check("lenght")


def test_nearest():
    assert nearest("grop", ["group", "gigpo", "magrpo"]) == "group"
    assert nearest("qqq", ["group"]) is None


def test_import_paths_resolve_without_registering():
    reg = Registry("reward", skip=1)
    from polyrl.core.train.credit import group_stats

    assert reg.get("polyrl.core.train.credit:group_stats") is group_stats
    assert import_path("polyrl.core.train.credit.group_stats") is group_stats  # dotted form
    assert import_path("polyrl.core.registry:Registry.get") is Registry.get  # attribute chain
    assert "polyrl.core.train.credit:group_stats" not in reg
    with pytest.raises(ValueError, match="is not an import path"):
        import_path("group_stats")


def test_a_module_whose_own_import_fails_reports_that_import(tmp_path, monkeypatch):
    """A missing dependency of an existing module is not 'no such module'."""
    (tmp_path / "needs_missing.py").write_text("import polyrl_no_such_dependency\nX = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ModuleNotFoundError, match="polyrl_no_such_dependency"):
        import_path("needs_missing:X")


def recipe_naming(folder, reward: str):
    """A recipe in ``folder`` whose one reward term is ``reward``."""
    folder.mkdir(exist_ok=True)
    path = folder / "recipe.yaml"
    path.write_text(
        f"policies: {{main: {{model: {folder / 'model'}}}}}\nreward: {{terms: [{{name: '{reward}'}}]}}\n"
    )
    return path


def test_a_file_is_found_beside_the_recipe_before_the_working_directory(tmp_path, monkeypatch):
    from polyrl.core.config import load
    from polyrl.core.recipe import Config
    from polyrl.core.registry import REWARDS

    beside_recipe, cwd = tmp_path / "recipes", tmp_path / "cwd"
    cwd.mkdir()
    recipe = recipe_naming(beside_recipe, "./parts.py:score")
    (beside_recipe / "parts.py").write_text("def score(sample):\n    return 'recipe'\n")
    (cwd / "parts.py").write_text("def score(sample):\n    return 'cwd'\n")
    monkeypatch.chdir(cwd)
    name = load(Config, recipe).reward.terms[0].name
    assert name == f"{beside_recipe / 'parts.py'}:score"  # the file the recipe meant
    score = REWARDS.get(name)
    assert score(None) == "recipe"
    assert REWARDS.get(name) is score  # imported once
    assert score.__module__.startswith("polyrl_user.parts_")
    assert import_path("./parts.py:score")(None) == "cwd"  # outside a recipe: the working dir


def test_two_recipes_loaded_in_one_process_keep_their_own_files(tmp_path, monkeypatch):
    """Loading a recipe changes nothing global: each resolves the file beside it, whichever
    was loaded last."""
    from polyrl.core.config import load
    from polyrl.core.recipe import Config
    from polyrl.core.registry import REWARDS

    monkeypatch.chdir(tmp_path)
    path_before = list(sys.path)
    cfgs = {}
    for folder in ("a", "b"):
        recipe = recipe_naming(tmp_path / folder, "./same.py:score")
        (tmp_path / folder / "same.py").write_text(f"def score(sample):\n    return {folder!r}\n")
        cfgs[folder] = load(Config, recipe)
    assert sys.path == path_before
    for folder, cfg in cfgs.items():  # a first, after b was loaded
        assert REWARDS.get(cfg.reward.terms[0].name)(None) == folder


def test_a_recipe_file_can_import_the_modules_beside_it(tmp_path):
    """``./my_agent.py`` importing ``helpers.py`` beside it, as a script would."""
    folder = tmp_path / "proj"
    folder.mkdir()
    (folder / "polyrl_test_helper_mod.py").write_text("VALUE = 41\n")
    (folder / "my_agent.py").write_text(
        "import polyrl_test_helper_mod\n\n"
        "def agent(row):\n    return polyrl_test_helper_mod.VALUE + 1\n"
    )
    path_before = list(sys.path)
    try:
        assert import_path(f"{folder / 'my_agent.py'}:agent")(None) == 42
    finally:
        sys.modules.pop("polyrl_test_helper_mod", None)
    assert sys.path == path_before  # its folder was on the path only while it imported


def test_a_missing_file_says_where_it_looked(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(UnknownNameError) as e:
        import_path("./absent.py:score")
    assert "no file './absent.py'" in str(e.value) and str(tmp_path) in str(e.value)
    assert "beside the recipe" in str(e.value)


def test_a_file_that_fails_to_import_is_not_kept_half_imported(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    part = tmp_path / "broken.py"
    part.write_text("raise RuntimeError('broken at import')\n")
    before = set(sys.modules)
    with pytest.raises(UserError, match=r"broken.py, line 1: RuntimeError: broken at import"):
        import_path("./broken.py:score")  # the user's file: a told error naming file and line
    assert not [m for m in set(sys.modules) - before if m.startswith("polyrl_user.broken_")]
    part.write_text("def score(sample):\n    return 2.0\n")
    assert import_path("./broken.py:score")(None) == 2.0  # fixed: imports afresh


# ------------------------------------------------------------------------------ options


class Engine:
    """A toy engine."""

    def __init__(self, policy, seed: int = 0, *, temperature: float = 1.0):
        self.seed, self.temperature = seed, temperature


class Task:
    @staticmethod
    def write_dataset(out_dir, seed: int, n: int = 4):
        return n


def test_derived_options_skip_what_the_core_passes():
    engines = Registry("engine", skip=1, reserved=("seed",))
    engines.register("toy", Engine)
    fields = [f.name for f in dataclasses.fields(engines.options("toy"))]
    assert fields == ["temperature"]  # not policy (positional), not seed (reserved)
    assert engines.options("toy") is engines.options("toy")  # derived once
    tasks = Registry("task", call="write_dataset", skip=1, reserved=("seed",))
    tasks.register("toy", Task)
    assert [f.name for f in dataclasses.fields(tasks.options("toy"))] == ["n"]


def test_a_part_named_by_import_path_has_options_too():
    reg = Registry("reward", skip=1)
    options = reg.options(f"{__name__}:reward_length")
    assert options.__name__ == "RewardLengthOptions"
    assert reg.bind(f"{__name__}:reward_length", {"target": 3}, "reward.terms[0].args").target == 3


@dataclasses.dataclass
class Depth(Options):
    depth: int = doc(1, "how deep")


def test_declared_options_win_over_the_signature():
    def part(record, algo, depth=1, extra="x"):
        return depth

    reg = Registry("credit", skip=2)
    reg.register("deep", part, options=Depth)
    assert reg.options("deep") is Depth  # 'extra' is not an option unless declared
    with pytest.raises(ConfigError, match="has no option 'extra'"):
        reg.bind("deep", {"extra": "y"}, "algorithm.credit_args")


def test_binding_an_unknown_key_names_the_recipe_key_and_the_part():
    with pytest.raises(ConfigError) as e:
        CREDIT.bind("group", {"scale": 2}, "algorithm.credit_args", "recipe.yaml")
    msg = str(e.value)
    assert msg.startswith("algorithm.credit_args.scale in recipe.yaml:")
    assert "credit assignment 'group' has no option 'scale'" in msg
    assert "it takes no options" in msg


def test_bound_options_unpack_into_the_call():
    typed = rewards().bind("length", {"target": 7}, "reward.terms[0].args")
    assert typed.target == 7 and dict(typed) == {"target": 7}
    assert rewards().bind("length", None, "reward.terms[0].args").target == 10
    assert rewards().bind("length", typed, "reward.terms[0].args") is typed
    # the core's default credit scheme takes no options and is called with none
    assert dict(CREDIT.bind("group", {}, "algorithm.credit_args")) == {}
    assert CREDIT.options("group") is CREDIT.options("group")
    assert AlgorithmConfig().credit == "group"


def test_traits_are_kept_by_the_registry_not_set_on_the_part():
    reg = Registry("reward", skip=1)

    def judge(samples):
        return [1.0 for _ in samples]

    reg.register("judge", judge, traits={"batched": True})
    assert reg.traits(reg.get("judge")) == {"batched": True}
    assert judge.__dict__ == {}  # nothing written onto the function
    assert reg.traits(reward_exact) == {}  # never registered: no traits
    reg.register("judge", judge, traits={"batched": True})  # the same again: fine
    with pytest.raises(ValueError, match="already with traits"):
        reg.register("judge_alias", judge, traits={"batched": False})
