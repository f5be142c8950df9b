"""The checkpoint/resume contract.

Checkpoints are atomic (``step_N.tmp`` renamed to ``step_N`` once a ``COMPLETE`` marker
is in), carry weights, optimizer, scheduler, every RNG and the data position, and a run
killed at any moment resumes from its last complete checkpoint bit-for-bit.
"""

from __future__ import annotations

import json
import os
import random
import signal
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from polyrl.core.config import ConfigError
from polyrl.core.runner import run as run_mod
from polyrl.core.runner.run import RunDir, RunDirError, rng_state, set_rng_state
from tests.helpers.rollouts import LOW_DIGIT
from tests.helpers.runs import (
    KILL_MID_WRITE,
    assert_same_policy_part,
    assert_same_tensors,
    assert_weights_moved,
    finish_train,
    load_part,
    metrics,
    metrics_by_step,
    spawn_train,
)

# --------------------------------------------------------------------------- helpers


def _state(step: int) -> dict:
    g = torch.Generator().manual_seed(step)
    return {
        "trainer": {
            "step": step,
            "sampler": {"epoch": 1, "position": step},
            "rng": rng_state(),
            "gen": g.get_state(),
        },
        "policy_main": {
            "weights": {
                "w": torch.randn(3, 4, generator=g),
                "b": torch.arange(step, dtype=torch.float64),
            },
            "optimizer": None,
            "scheduler": {"last_epoch": step},
        },
    }


def _steps(rd: RunDir) -> list[int]:
    return [s for s, _ in rd.checkpoints()]


def _trained_steps(run_dir: Path) -> list[int]:
    """Steps of the RL-step lines in metrics.jsonl, in the order they were written."""
    return [r["step"] for r in metrics(run_dir) if "reward/mean" in r]


# --------------------------------------------------------------------------- RunDir unit tests


def test_save_load_round_trip(tmp_path):
    rd = RunDir(tmp_path / "run", {"seed": 1}, tensorboard=False)
    assert rd.load_latest() is None
    state = _state(3)
    path = rd.save(3, state)
    assert path == rd.ckpt_dir / "step_000003" and (path / "COMPLETE").is_file()
    assert sorted(p.name for p in rd.ckpt_dir.iterdir()) == ["step_000003"]  # no .tmp left
    step, loaded = rd.load_latest()
    assert step == 3 and loaded.keys() == state.keys()
    assert loaded["trainer"]["sampler"] == {"epoch": 1, "position": 3}
    assert_same_tensors(
        loaded["policy_main"]["weights"], state["policy_main"]["weights"], "weights"
    )
    assert loaded["policy_main"]["weights"]["b"].dtype == torch.float64
    assert torch.equal(loaded["trainer"]["gen"], state["trainer"]["gen"])
    # the saved RNG state continues every stream exactly as it was when saved
    set_rng_state(loaded["trainer"]["rng"])
    first = (torch.rand(4), np.random.rand(4), [random.random() for _ in range(4)])
    random.random(), np.random.rand(), torch.rand(1)  # move on, then go back
    set_rng_state(rd.load_latest()[1]["trainer"]["rng"])
    again = (torch.rand(4), np.random.rand(4), [random.random() for _ in range(4)])
    assert torch.equal(first[0], again[0]) and np.array_equal(first[1], again[1])
    assert first[2] == again[2]
    rd.close()


def test_checkpoints_ignore_incomplete(tmp_path):
    rd = RunDir(tmp_path / "run", tensorboard=False)
    rd.save(2, _state(2))
    tmp = rd.ckpt_dir / "step_000004.tmp"  # killed before the rename
    tmp.mkdir()
    (tmp / "policy_main.pt").write_bytes(b"\x80half")
    (tmp / "COMPLETE").write_text("4")  # even a marker does not make a .tmp count
    no_marker = rd.ckpt_dir / "step_000006"  # a step dir without COMPLETE
    no_marker.mkdir()
    (no_marker / "trainer.pt").write_bytes(b"junk")
    (rd.ckpt_dir / "notes.txt").write_text("not a checkpoint")
    assert _steps(rd) == [2]
    step, state = rd.load_latest()
    assert step == 2 and torch.equal(
        state["policy_main"]["weights"]["w"], _state(2)["policy_main"]["weights"]["w"]
    )
    assert not tmp.exists()  # leftovers of a killed write are cleaned on load
    rd.save(6, _state(6))  # a new save replaces the unmarked dir
    assert _steps(rd) == [2, 6] and rd.load_latest()[0] == 6
    assert sorted(p.name for p in (rd.ckpt_dir / "step_000006").iterdir()) == [
        "COMPLETE",
        "MANIFEST.json",  # the checksums of the other files
        "policy_main.pt",
        "trainer.pt",
    ]
    rd.close()


@pytest.mark.parametrize("keep, left", [(2, [4, 5]), (1, [5]), (0, [1, 2, 3, 4, 5])])
def test_keep_deletes_older(tmp_path, keep, left):
    rd = RunDir(tmp_path / "run", tensorboard=False)
    for step in range(1, 6):
        rd.save(step, _state(step), keep=keep)
    assert _steps(rd) == left
    assert rd.load_latest()[0] == 5
    rd.close()


def test_crash_during_torch_save_keeps_previous(tmp_path, monkeypatch):
    rd = RunDir(tmp_path / "run", tensorboard=False)
    rd.save(2, _state(2))
    real_save = torch.save
    calls = []

    def dying_save(obj, f, *args, **kwargs):
        calls.append(obj)
        if len(calls) == 1:
            return real_save(obj, f, *args, **kwargs)
        f.write(b"\x80\x02half a pickle")  # the second part is cut off mid-write
        raise KeyboardInterrupt("killed while writing")

    monkeypatch.setattr(run_mod.torch, "save", dying_save)
    with pytest.raises(KeyboardInterrupt):
        rd.save(4, _state(4))
    monkeypatch.undo()
    assert (rd.ckpt_dir / "step_000004.tmp").is_dir()
    assert not (rd.ckpt_dir / "step_000004").exists()
    assert _steps(rd) == [2]
    step, state = rd.load_latest()
    assert step == 2 and state["trainer"]["step"] == 2
    assert not (rd.ckpt_dir / "step_000004.tmp").exists()
    rd.close()


def _unwritable(tmp_path: Path, how: str) -> Path:
    if how == "read_only_dir":
        if os.geteuid() == 0:
            pytest.skip("root writes into read-only directories")
        ro = tmp_path / "ro"
        ro.mkdir()
        ro.chmod(0o500)
        return ro / "run"
    afile = tmp_path / "afile"  # a path under a regular file fails even for root
    afile.write_text("x")
    return afile / "run"


@pytest.mark.parametrize("how", ["read_only_dir", "under_a_file"])
def test_unwritable_run_dir(tmp_path, how):
    path = _unwritable(tmp_path, how)
    try:
        with pytest.raises(RunDirError) as err:
            RunDir(path, {"seed": 0}, tensorboard=False)
    finally:
        if (tmp_path / "ro").exists():
            (tmp_path / "ro").chmod(0o700)  # let pytest clean it up
    msg = str(err.value)
    assert str(path) in msg and "not writable" in msg and "run.dir" in msg
    assert isinstance(err.value, OSError)


def test_fresh_run_refuses_run_dir_with_checkpoints(make_config, tmp_path):
    from polyrl.core.runner.session import Session

    done = tmp_path / "run" / "checkpoints" / "step_000002"
    done.mkdir(parents=True)
    (done / "COMPLETE").write_text("2")
    with pytest.raises(ConfigError, match=r"already has checkpoints.*resume"):
        Session.open(make_config())
    assert not (tmp_path / "run" / "config.yaml").exists()  # refused before touching anything


def test_cli_resume_without_dir_finds_newest_run(tmp_path):
    from polyrl.core.runner.cli import _latest_run

    runs = tmp_path / "runs"
    for i, name in enumerate(["exp-20240101-000000", "exp-20240102-000000", "other-20240103"]):
        (runs / name / "checkpoints").mkdir(parents=True)
        os.utime(runs / name / "checkpoints", (1e9 + i, 1e9 + i))
    (runs / "exp-20240104-000000").mkdir()  # newest, but never checkpointed
    assert _latest_run(f"{runs}/{{name}}-{{time}}", "exp") == str(runs / "exp-20240102-000000")
    (runs / "exp" / "checkpoints").mkdir(parents=True)
    assert _latest_run(f"{runs}/{{name}}", "exp") == str(runs / "exp")
    with pytest.raises(ConfigError, match="no run directory"):
        _latest_run(f"{runs}/{{name}}-{{time}}", "nothing")


def test_cli_resume_of_missing_dir_refuses(tmp_path, capsys):
    from polyrl.core.runner.cli import main

    # not a silent fresh start
    assert main(["train", str(tmp_path / "recipe.yaml"), "--resume", str(tmp_path / "typo")]) == 2
    assert "is not a directory" in capsys.readouterr().err


# --------------------------------------------------------------------------- resume after a kill
#
# Both end-to-end tests use an algorithm with two minibatches (the trainer's generator) and
# sampled evaluation between steps (it must not move the engine's generator), so every piece
# of state the checkpoint carries matters. The untrained model never answers correctly, so
# the reward is "the response has a digit 0-4": it varies within groups, the advantages are
# non-zero and the weights really move with the data order and the sampled tokens.


RESUME_OVERRIDES = (
    "algorithm.minibatches=2",
    "eval.every=2",
    "eval.temperature=1.0",
    "run.save_every=2",
    "run.export=false",
    "rollout.prompts_per_step=4",
    "task.args={n_train: 40, n_eval: 8, max_operand: 30, ops: '+'}",
    f"reward.terms=[{LOW_DIGIT}]",
)


RECIPE = """\
seed: 3
run: {{progress: false, tensorboard: false, save_every: 2, keep_checkpoints: 2,
      samples_per_step: 2}}
task: {{name: arithmetic, args: {{n_train: 24, n_eval: 8, max_operand: 30, ops: '+'}}}}
policies:
  main:
    model: {model}
    micro_batch_size: 16
    optim: {{lr: 1.0e-4, warmup_steps: 3, schedule: cosine}}
data: {{max_prompt_tokens: 32}}
eval: {{data: {{shuffle: false}}, every: 3, temperature: 1.0}}
rollout: {{n: 4, prompts_per_step: 4, max_new_tokens: 6}}
algorithm: {{minibatches: 2, kl_coef: 0.01}}
reward: {{terms: [{reward}]}}
sft: {{steps: 5, batch_size: 8}}
train: {{steps: {steps}}}
"""
STEPS = 12  # 24 prompts, 4 per step: the data stream goes into its second epoch at step 7


@pytest.mark.slow
@pytest.mark.parametrize("staleness", [2])
def test_exact_resume_after_sigkill(tiny_model_dir, tmp_path, spawned, staleness):
    """With async rollouts (max_staleness 2): the batches in flight at the kill are made
    again from the checkpoint, identically. (The synchronous loop's SIGKILL and resume is
    test_sigkill_while_writing_a_checkpoint_resumes_from_the_one_before.)"""
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(RECIPE.format(model=tiny_model_dir, steps=STEPS, reward=LOW_DIGIT))
    dir_a, dir_b = tmp_path / "a", tmp_path / "b"
    k = f"rollout.max_staleness={staleness}"
    run_a = spawn_train(recipe, tmp_path, f"run.dir={dir_a}", k)  # uninterrupted, alongside B
    run_b = spawn_train(recipe, tmp_path, f"run.dir={dir_b}", k)
    spawned += [run_a, run_b]
    killed_after = None
    deadline = time.monotonic() + 240
    while killed_after is None and run_b.poll() is None and time.monotonic() < deadline:
        done = [
            s
            for s in range(2, STEPS, 2)
            if (dir_b / "checkpoints" / f"step_{s:06d}" / "COMPLETE").is_file()
        ]
        if done:
            os.kill(run_b.pid, signal.SIGKILL)
            killed_after = done[-1]
        else:
            time.sleep(0.02)
    rc_b = run_b.wait(timeout=60)
    run_b.log.close()
    if killed_after is None or rc_b != -signal.SIGKILL:
        pytest.fail(
            f"run B was not killed mid-run (exit code {rc_b}, checkpoint seen: "
            f"{killed_after}); it must be killed before it finishes:\n"
            + Path(run_b.log.name).read_text()[-3000:]
        )
    final = dir_b / "checkpoints" / f"step_{STEPS:06d}"
    assert not final.exists() and not (dir_b / "summary.json").exists(), (
        "B finished before the kill"
    )

    # a fresh start into B's directory is refused; --resume continues it
    refused = spawn_train(recipe, tmp_path, f"run.dir={dir_b}", k)
    spawned.append(refused)
    assert refused.wait(timeout=120) != 0
    refused.log.close()
    assert "already has checkpoints" in Path(refused.log.name).read_text()
    spawned.append(resume := spawn_train(recipe, tmp_path, k, "--resume", str(dir_b)))
    finish_train(resume)
    finish_train(run_a)

    ckpt_a = dir_a / "checkpoints" / f"step_{STEPS:06d}"
    pa, pb = load_part(ckpt_a, "policy_main"), load_part(final, "policy_main")
    # A's last two steps (after any resume point of B) moved its weights
    before_a = dir_a / "checkpoints" / f"step_{STEPS - 2:06d}"
    # measured 1.6e-5 (staleness 0) and 1.56e-5 (2): the cosine tail, lr near its end
    assert_weights_moved(load_part(before_a, "policy_main")["weights"], pa["weights"], 1e-6)
    assert_same_policy_part(pa, pb)
    assert pa["scheduler"] == pb["scheduler"]
    ta, tb = load_part(ckpt_a, "trainer"), load_part(final, "trainer")
    assert ta["sampler"] == tb["sampler"] == {"epoch": 1, "position": 24}  # end of the 2nd epoch
    assert torch.equal(ta["gen"], tb["gen"]) and torch.equal(ta["rng"]["torch"], tb["rng"]["torch"])
    ea, eb = ta["engines"]["main"], tb["engines"]["main"]  # engine.name auto: {choice, inner}
    assert ea["choice"] == eb["choice"] == "hf"
    assert torch.equal(ea["inner"]["rng"], eb["inner"]["rng"])

    from safetensors.torch import load_file

    assert_same_tensors(
        load_file(dir_a / "export" / "main" / "model.safetensors"),
        load_file(dir_b / "export" / "main" / "model.safetensors"),
        "export",
    )

    # SFT ran once, in B's fresh start; the resume went on from the checkpoint
    lines_b = [json.loads(x) for x in (dir_b / "metrics.jsonl").read_text().splitlines()]
    assert sum("sft/step" in r and r["sft/step"] == 0 for r in lines_b) == 1
    trained_b = _trained_steps(dir_b)
    resumed_at = len(trained_b) - (STEPS - killed_after)  # steps the killed run had logged
    assert trained_b[:killed_after] == list(range(1, killed_after + 1))
    assert trained_b[resumed_at:] == list(range(killed_after + 1, STEPS + 1))
    ma, mb = metrics_by_step(dir_a), metrics_by_step(dir_b)
    assert sorted(ma) == sorted(mb) == list(range(STEPS + 1))
    assert sum(ma[s]["advantage/zero_frac"] < 1 for s in range(1, STEPS + 1)) >= STEPS // 2
    # warm-up + cosine over every optimizer step (2 per RL step here), not over RL steps only
    assert 0 < ma[STEPS - 1]["main/lr"] < ma[STEPS // 2]["main/lr"] < 1.0e-4
    for step in range(STEPS + 1):  # step 0: data, SFT and first eval; the last: final eval
        assert ma[step] == mb[step], f"metrics of step {step} differ"
    assert json.loads((dir_a / "summary.json").read_text()) == json.loads(
        (dir_b / "summary.json").read_text()
    )


@pytest.mark.slow
def test_sigkill_while_writing_a_checkpoint_resumes_from_the_one_before(
    tiny_model_dir, tmp_path, spawned
):
    """A real SIGKILL in the middle of writing checkpoint 6 (half a file on disk, no COMPLETE):
    --resume goes on from checkpoint 4 and ends bitwise equal to a run that was never killed."""
    steps = 6
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(RECIPE.format(model=tiny_model_dir, steps=steps, reward=LOW_DIGIT))
    dir_a, dir_b = tmp_path / "a", tmp_path / "b"
    spawned.append(run_a := spawn_train(recipe, tmp_path, f"run.dir={dir_a}"))
    spawned.append(
        run_b := spawn_train(
            recipe, tmp_path, f"run.dir={dir_b}", script=KILL_MID_WRITE.format(step=steps)
        )
    )
    rc_b = run_b.wait(timeout=240)
    run_b.log.close()
    assert rc_b == -signal.SIGKILL, Path(run_b.log.name).read_text()[-3000:]
    half = dir_b / "checkpoints" / f"step_{steps:06d}.tmp"
    written = sorted(p.name for p in half.iterdir())
    assert len(written) == 1 and "COMPLETE" not in written  # killed inside its first file
    assert [p.name for p in sorted((dir_b / "checkpoints").glob("step_??????"))] == [
        "step_000002",
        "step_000004",
    ]

    spawned.append(resume := spawn_train(recipe, tmp_path, "--resume", str(dir_b)))
    finish_train(resume)
    finish_train(run_a)
    assert not half.exists()
    assert _trained_steps(dir_b) == [1, 2, 3, 4, 5, 6, 5, 6]  # the killed run had logged 5, 6
    final_a, final_b = (d / "checkpoints" / f"step_{steps:06d}" for d in (dir_a, dir_b))
    pa, pb = load_part(final_a, "policy_main"), load_part(final_b, "policy_main")
    at_resume = load_part(dir_a / "checkpoints" / "step_000004", "policy_main")["weights"]
    assert_weights_moved(at_resume, pa["weights"], 8e-6)  # A moved 8.0e-5 after B's resume
    assert_same_policy_part(pa, pb)
    ma, mb = metrics_by_step(dir_a), metrics_by_step(dir_b)
    assert all(ma[s] == mb[s] for s in range(1, steps + 1))
