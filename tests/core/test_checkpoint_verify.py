"""A damaged or mismatched checkpoint is refused before any model loads (exit 2, one
message naming the checkpoint, the file or key and what to do), through the CLI as a user
resumes or evaluates a run; local (``.pt``) and sharded (DCP) policy parts alike."""

from __future__ import annotations

import pytest

from tests.helpers.checkpoints import copy_run, refused, saved_run

PER_STEP = 8  # rollout.prompts_per_step
BATCHES = 10  # prompts drawn before the checkpoint: its data position is row 80

RECIPE = {
    "run": {"progress": False, "tensorboard": False},
    "task": {
        "name": "arithmetic",
        "args": {"n_train": 200, "n_eval": 8, "max_operand": 30, "ops": "+"},
    },
    "policies": {"main": {"micro_batch_size": 64}},
    "data": {"max_prompt_tokens": 32},
    "rollout": {"n": 2, "prompts_per_step": PER_STEP, "max_new_tokens": 4},
    "train": {"steps": 4},
}


@pytest.fixture(scope="module")
def saved(tiny_model_dir, tmp_path_factory):
    """A run with two complete checkpoints (steps 1 and 2), and a copy of step 2 whose
    policy part is sharded (DCP) as Ray writes it."""
    return saved_run(tmp_path_factory.mktemp("verify"), RECIPE, tiny_model_dir, batches=BATCHES)


def test_an_intact_checkpoint_passes_with_its_data_position(saved, tmp_path):
    from polyrl.core.config import load
    from polyrl.core.recipe import Config
    from polyrl.core.runner.checkpoint import verify_checkpoint

    recipe, run, sharded = saved
    for src in (run, sharded):
        cfg = load(Config, recipe, [f"run.dir={src}", "run.resume=true"])
        pos = verify_checkpoint(cfg, src)
        assert pos.checkpoint == src / "checkpoints" / "step_000002"
        assert (pos.epoch, pos.position) == (0, BATCHES * PER_STEP)


def test_a_truncated_policy_file_names_it_and_the_older_checkpoint(saved, tmp_path, capsys):
    recipe, src, _ = saved
    run, step = copy_run(src, tmp_path)
    data = (step / "policy_main.pt").read_bytes()
    (step / "policy_main.pt").write_bytes(data[: len(data) // 2])
    refused(
        capsys,
        ["train", str(recipe), "--resume", str(run)],
        f"checkpoint {step}: policy_main.pt ({len(data) // 2} bytes)",
        "truncated",
        "to resume from step_000001",
    )


def test_an_empty_trainer_state_is_refused_in_eval_too(saved, tmp_path, capsys):
    recipe, src, _ = saved
    run, step = copy_run(src, tmp_path)
    (step / "trainer.pt").write_bytes(b"")
    msg = "trainer.pt is empty (0 bytes)"
    refused(capsys, ["train", str(recipe), "--resume", str(run)], msg)
    refused(capsys, ["eval", str(recipe), "--run-dir", str(run)], msg)


def test_a_deleted_part_with_complete_kept_is_named(saved, tmp_path, capsys):
    recipe, src, _ = saved
    run, step = copy_run(src, tmp_path)
    (step / "policy_main.pt").unlink()
    refused(
        capsys,
        ["train", str(recipe), "--resume", str(run)],
        "the recipe has policy 'main', but it has no policy_main",
        "'trainer.pt'",  # what it holds instead
    )


def test_lora_over_a_full_fine_tune_isrefused(saved, tmp_path, capsys):
    recipe, src, sharded = saved
    for origin in (src, sharded):
        run, _ = copy_run(origin, tmp_path / origin.name)
        refused(
            capsys,
            ["train", str(recipe), "policies.main.lora.r=4", "--resume", str(run)],
            "policy 'main' is a full fine-tune",
            "policies.main.lora.r=4",
        )


@pytest.fixture(scope="module")
def wider_model(tmp_path_factory):
    """The tiny model's tokenizer and depth, hidden size 64 instead of 128."""
    from polyrl.core.demo.tiny import tiny_qwen2

    path = tmp_path_factory.mktemp("models") / "tiny-64"
    tiny_qwen2(
        path,
        corpus="arithmetic",
        hidden_size=64,
        num_layers=2,
        num_heads=2,
        head_dim=32,
        intermediate_size=128,
        seed=0,
    )
    return path


def test_another_hidden_size_names_the_tensor_and_both_shapes(saved, wider_model, tmp_path, capsys):
    recipe, src, sharded = saved
    for origin in (src, sharded):
        run, _ = copy_run(origin, tmp_path / origin.name)
        err = refused(
            capsys,
            ["train", str(recipe), f"policies.main.model={wider_model}", "--resume", str(run)],
            f"the model in {wider_model} (policies.main.model)",
            "written for another model or another size",
        )
        # the embedding: (vocab, 128) saved, (vocab, 64) in the model
        assert ", 128]" in err and ", 64]" in err


def test_a_dataset_that_shrank_below_the_saved_position(saved, tmp_path, capsys):
    recipe, src, _ = saved
    run, step = copy_run(src, tmp_path)
    refused(
        capsys,
        ["eval", str(recipe), "task.args.n_train=50", "--run-dir", str(run)],
        f"checkpoint {step}: its data position is row {BATCHES * PER_STEP}",
        "now has 50 rows",
    )


def test_a_sharded_part_missing_or_truncated_shard(saved, tmp_path, capsys):
    recipe, _, sharded = saved
    run, step = copy_run(sharded, tmp_path / "gone")
    (step / "policy_main" / "__0_0.distcp").unlink()
    refused(
        capsys,
        ["train", str(recipe), "--resume", str(run)],
        "sharded part policy_main/__0_0.distcp is missing (.metadata names it)",
    )
    run, step = copy_run(sharded, tmp_path / "cut")
    shard = step / "policy_main" / "__0_0.distcp"
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) // 2])
    refused(
        capsys,
        ["train", str(recipe), "--resume", str(run)],
        f"policy_main/__0_0.distcp is {len(data) // 2} bytes",
        "the file is truncated",
    )
