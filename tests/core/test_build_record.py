"""Built models carry a record of their build settings; changed settings are never ignored."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from polyrl.core.config import ConfigError, load
from polyrl.core.recipe import Config
from polyrl.core.registry import MODELS
from polyrl.core.runner.builds import BUILD_RECORD, ensure_model

# The tiniest tiny_qwen2: one layer, width 8 (a build takes a second or two).
TINY = {"hidden_size": 8, "num_layers": 1, "head_dim": 8, "intermediate_size": 16}


def _config(path) -> dict:
    return json.loads((path / "config.json").read_text())


def test_same_settings_reuse_and_changed_settings_build_beside(tmp_path, caplog):
    path = tmp_path / "m"
    assert ensure_model(path, "tiny_qwen2", TINY) == str(path)
    record = json.loads((path / BUILD_RECORD).read_text())
    assert record["builder"] == "tiny_qwen2"
    assert record["options"]["num_layers"] == 1 and record["options"]["seed"] == 0  # a default
    assert "model.safetensors" in record["files"] and BUILD_RECORD not in record["files"]

    mtimes = {p.name: p.stat().st_mtime_ns for p in path.iterdir()}
    ensure_model(path, "tiny_qwen2", dict(TINY))  # same settings: untouched
    assert {p.name: p.stat().st_mtime_ns for p in path.iterdir()} == mtimes

    with caplog.at_level("WARNING", logger="polyrl.core.runner.builds"):
        other = Path(ensure_model(path, "tiny_qwen2", {**TINY, "num_layers": 2}))
    # built beside, under a name keyed by its settings; the first model is not touched
    assert other.parent == tmp_path and other.name.startswith("m-build-")
    assert _config(other)["num_hidden_layers"] == 2 and _config(path)["num_hidden_layers"] == 1
    assert {p.name: p.stat().st_mtime_ns for p in path.iterdir()} == mtimes
    assert "num_layers: 1 -> 2" in caplog.text and str(other) in caplog.text
    # asked again: the same keyed model, reused; another setting gets its own
    before = (other / "model.safetensors").stat().st_mtime_ns
    assert ensure_model(path, "tiny_qwen2", {**TINY, "num_layers": 2}) == str(other)
    assert (other / "model.safetensors").stat().st_mtime_ns == before
    third = ensure_model(path, "tiny_qwen2", {**TINY, "seed": 3})
    assert third not in (str(path), str(other))
    # each build was staged and moved into place: nothing else left behind
    locks = {".m.lock", f".{other.name}.lock", f".{Path(third).name}.lock"}
    assert {p.name for p in tmp_path.iterdir()} == {"m", other.name, Path(third).name} | locks


def test_typed_options_and_a_mapping_record_the_same_build(tmp_path):
    """A recipe passes bound options, a direct call a mapping: one record either way."""
    path = tmp_path / "m"
    ensure_model(path, "tiny_qwen2", MODELS.bind("tiny_qwen2", TINY, "build_args"))
    mtime = (path / "model.safetensors").stat().st_mtime_ns
    ensure_model(path, "tiny_qwen2", TINY)
    assert (path / "model.safetensors").stat().st_mtime_ns == mtime


def test_a_build_that_lost_files_is_refused_not_rebuilt_in_place(tmp_path):
    path = tmp_path / "m"
    ensure_model(path, "tiny_qwen2", TINY)
    (path / "my_notes.txt").write_text("mine")
    ensure_model(path, "tiny_qwen2", TINY)  # same settings: reused, extra file and all
    (path / "config.json").unlink()
    with pytest.raises(ConfigError) as err:
        ensure_model(path, "tiny_qwen2", TINY)
    msg = str(err.value)
    assert str(path) in msg and "config.json" in msg and "delete the directory" in msg
    assert (path / "my_notes.txt").read_text() == "mine"


def test_a_model_without_a_record_is_used_as_it_is(tmp_path, caplog):
    """A model PolyRL did not build (a user's own, a trained export, an older PolyRL's
    build) is never touched: used as it is, with a warning that build_args did not apply."""
    path = MODELS.get("tiny_qwen2")(tmp_path / "own", **TINY)
    before = {p.name: p.stat().st_mtime_ns for p in path.iterdir()}
    with caplog.at_level("WARNING", logger="polyrl.core.runner.builds"):
        assert ensure_model(path, "tiny_qwen2", {**TINY, "num_layers": 2}) == str(path)
        ensure_model(path, "tiny_qwen2", {**TINY, "num_layers": 2})
    assert {p.name: p.stat().st_mtime_ns for p in path.iterdir()} == before
    assert _config(path)["num_hidden_layers"] == 1 and not (path / BUILD_RECORD).exists()
    warned = [r.getMessage() for r in caplog.records if str(path) in r.getMessage()]
    assert len(warned) == 1, warned  # once per path, however often the run resolves it
    assert BUILD_RECORD in warned[0] and "not applied" in warned[0] and "delete it" in warned[0]


def test_a_file_at_the_model_path_is_refused(tmp_path):
    (tmp_path / "m").write_text("not a model")
    with pytest.raises(ConfigError, match="is a file"):
        ensure_model(tmp_path / "m", "tiny_qwen2", TINY)


RECIPE = """
policies:
  speaker: &agent
    model: {model}
    build: tiny_qwen2
    build_args: {{hidden_size: 8, num_layers: 1, head_dim: 8, intermediate_size: 16, seed: 1}}
  listener:
    <<: *agent
"""


def test_two_policies_building_one_path_differently_fail_at_load(tmp_path):
    """The issue's case: a YAML anchor shares the model, an override reaches one agent."""
    recipe = tmp_path / "r.yaml"
    model = tmp_path / "never-built"
    recipe.write_text(RECIPE.format(model=model))
    cfg = load(Config, recipe)  # the same build for both: fine
    assert cfg.policies["listener"].build_args.seed == 1
    with pytest.raises(ConfigError) as err:
        load(Config, recipe, ["policies.listener.build_args.seed=2"])
    msg = str(err.value)
    assert "policies.speaker" in msg and "policies.listener" in msg
    assert "seed: 1 -> 2" in msg and str(model) in msg and "its own model path" in msg
    # each its own path: no conflict
    load(
        Config,
        recipe,
        ["policies.listener.build_args.seed=2", f"policies.listener.model={model}-b"],
    )
    assert not model.exists()  # nothing was built at load
