"""Bad input a user can give the core: each fails early with the key or file and the fix,
or is a documented, logged fallback."""

from __future__ import annotations

import json
import warnings

import pytest
import yaml

import polyrl.core  # noqa: F401  (registers the core's parts)
from polyrl.core.config import ConfigError, load
from polyrl.core.recipe import Config
from polyrl.core.rollout.data import DataError, load_rows
from polyrl.core.runner.cli import main

RECIPE = {"policies": {"main": {"model": "some/model"}}, "train": {"steps": 3}}


@pytest.fixture
def recipe(tmp_path):
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(RECIPE))
    return path


@pytest.mark.parametrize(
    "override, message",
    [
        ("train.steps=-1", "train.steps=-1 in"),
        ("rollout.temperature=-0.5", "rollout.temperature=-0.5 in"),
        ("rollout.max_new_tokens=0", "rollout.max_new_tokens=0 in"),
        ("rollout.top_p=0", "rollout.top_p=0"),
        ("policies.main.micro_batch_size=0", "policies.main.micro_batch_size=0 in"),
        ("policies.main.optim.lr=.nan", "policies.main.optim.lr=nan in"),
        ("policies.main.optim.lr=-0.001", "must be a finite number >= 0"),
        ("policies.main.lora.r=-4", "policies.main.lora.r=-4 in"),
        ("policies.main.lora.dropout=1.5", "policies.main.lora.dropout=1.5"),
        ("policies.main.dtype=float17", "is not one of ['float32', 'bfloat16']"),
        ("policies.main.optim.schedule=cosin", "did you mean 'cosine'"),
        ("sft.batch_size=0", "sft.batch_size=0 in"),
        ("rollout.max_staleness=-1", "rollout.max_staleness=-1 in"),
        ("algorithm.rollout_correction.max=0.5", "rollout_correction.max=0.5"),
        ("algorithm.rollout_correction.level=tokens", "did you mean 'token'"),
    ],
)
def test_numbers_a_run_cannot_mean_fail_at_load(recipe, override, message):
    with pytest.raises(ConfigError) as e:
        load(Config, recipe, [override])
    assert message in str(e.value) and str(recipe) in str(e.value)


def test_an_unquoted_off_means_the_choice_off_not_false(recipe):
    cfg = load(Config, recipe, ["algorithm.rollout_correction.level=off"])
    assert cfg.algorithm.rollout_correction.level == "off"  # YAML 1.1 read it as False


def test_a_group_of_one_under_grpo_warns(recipe):
    with pytest.warns(UserWarning, match="rollout.n=1 .* every advantage is 0"):
        load(Config, recipe, ["rollout.n=1"])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        load(Config, recipe, ["rollout.n=2"])


def test_a_latin1_data_file_names_file_and_line(tmp_path):
    path = tmp_path / "rows.jsonl"
    path.write_bytes(
        b'{"prompt": "a", "answer": "1"}\n{"prompt": "caf\xe9", "answer": "2"}\n'
    )  # Latin-1 e-acute
    with pytest.raises(DataError) as e:
        load_rows(str(path))
    assert f"{path}, line 2: not UTF-8" in str(e.value) and "UTF-8" in str(e.value)


def test_duplicate_keys_in_a_row_are_an_error_not_last_wins(tmp_path):
    path = tmp_path / "rows.jsonl"
    path.write_text(
        json.dumps({"prompt": "a", "answer": "1"}) + "\n" + '{"prompt": "b", "prompt": "c"}\n'
    )
    with pytest.raises(DataError, match=r"line 2: the key 'prompt' appears twice"):
        load_rows(str(path))
    whole = tmp_path / "rows.json"
    whole.write_text('[{"prompt": "a", "answer": "1", "answer": "2"}]')
    with pytest.raises(DataError, match="the key 'answer' appears twice"):
        load_rows(str(whole))


@pytest.mark.parametrize("state", ["missing", "not-a-run", "no-checkpoint", "incomplete"])
def test_resume_refuses_a_directory_it_cannot_resume(tmp_path, recipe, capsys, state):
    run_dir = tmp_path / "run"
    expected = {
        "missing": "is not a directory",
        "not-a-run": "not a PolyRL run directory",
        "no-checkpoint": "stopped before its first checkpoint",
        "incomplete": "only incomplete checkpoints (step_000006, step_000008.tmp",
    }[state]
    if state != "missing":
        run_dir.mkdir()
    if state in ("no-checkpoint", "incomplete"):
        (run_dir / "config.yaml").write_text("seed: 0\n")
    if state == "incomplete":
        (run_dir / "checkpoints" / "step_000006").mkdir(parents=True)  # no COMPLETE marker
        (run_dir / "checkpoints" / "step_000008.tmp").mkdir()
    assert main(["train", str(recipe), "--resume", str(run_dir)]) == 2
    err = capsys.readouterr().err
    assert expected in err and "Traceback" not in err


def test_lora_targets_that_do_not_exist_list_the_linear_layers():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from polyrl.core.train.policy import check_lora_targets

    model = Qwen2ForCausalLM(
        Qwen2Config(
            vocab_size=32,
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=1,
        )
    )
    check_lora_targets(model, ["q_proj", "down_proj"])  # real ones pass
    with pytest.raises(ConfigError) as e:
        check_lora_targets(model, ["q_proj", "qkv_proj"])
    msg = str(e.value)
    assert "['qkv_proj']" in msg and "k_proj" in msg and "lm_head" in msg
