"""Checkpoint integrity (core/runner/checksums.py): every checkpoint carries the SHA-256 of each of
its files, and a block of zeros inside a tensor (bit rot: the file keeps its size and still
loads) is refused before any model loads, naming the file and the previous checkpoint; a
checkpoint written before manifests still loads. A checkpoint write that fails for real
(file-size limit, disk full, permission) is one line naming the path, the .tmp is gone and
the earlier checkpoints are intact."""

from __future__ import annotations

import contextlib
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import torch

from tests.helpers.checkpoints import copy_run, refused, saved_run
from tests.helpers.faults import sized_state as _state
from tests.helpers.faults import zero_block, zero_block_in_tensor
from tests.helpers.runs import spawn_train

RECIPE = {
    "run": {"progress": False, "tensorboard": False},
    "task": {"name": "arithmetic", "args": {"n_train": 64, "n_eval": 4, "ops": "+"}},
    "data": {"max_prompt_tokens": 32},
    "rollout": {"n": 2, "prompts_per_step": 4, "max_new_tokens": 4},
    "sft": {"steps": 0},
    "train": {"steps": 4},
}


@pytest.fixture(scope="module")
def saved(tiny_model_dir, tmp_path_factory):
    """A run with two complete checkpoints (after one update, after two), and a copy whose
    step 2 holds its policy sharded (DCP), with the manifest of those files."""
    return saved_run(tmp_path_factory.mktemp("integrity"), RECIPE, tiny_model_dir)


def _verify(recipe: Path, run: Path):
    from polyrl.core.config import load
    from polyrl.core.recipe import Config
    from polyrl.core.runner.checkpoint import verify_checkpoint

    return verify_checkpoint(load(Config, recipe, [f"run.dir={run}", "run.resume=true"]), run)


def test_every_file_is_in_the_manifest_with_its_hash(saved):
    from polyrl.core.runner.checksums import MANIFEST, file_sha256

    _, run, sharded = saved
    for step in (run / "checkpoints" / "step_000002", sharded / "checkpoints" / "step_000002"):
        files = json.loads((step / MANIFEST).read_text())["files"]
        on_disk = sorted(
            str(p.relative_to(step))
            for p in step.rglob("*")
            if p.is_file() and p.name not in (MANIFEST, "COMPLETE")
        )
        assert sorted(files) == on_disk and "trainer.pt" in files
        for rel, v in files.items():
            assert v["size"] == (step / rel).stat().st_size
            assert v["sha256"] == file_sha256(step / rel)
    assert "policy_main/__0_0.distcp" in on_disk  # the shards are covered too


def test_a_zeroed_block_in_a_tensor_is_refused_with_the_previous_checkpoint(
    saved, tmp_path, capsys
):
    from polyrl.core.runner.checksums import MANIFEST

    recipe, src, _ = saved
    run, step = copy_run(src, tmp_path)
    before = torch.load(step / "policy_main.pt", weights_only=False)["weights"]
    size = (step / "policy_main.pt").stat().st_size
    zero_block_in_tensor(step / "policy_main.pt")
    # the damage is silent to the file system and to torch: same size, loads, wrong weights
    assert (step / "policy_main.pt").stat().st_size == size
    after = torch.load(step / "policy_main.pt", weights_only=False)["weights"]
    changed = [k for k in before if not torch.equal(before[k], after[k])]
    assert len(changed) == 1 and (after[changed[0]] == 0).sum() >= 1024
    hint = (
        f"mv {step} {step}.damaged",
        "to resume from step_000001",
        f"--resume {run}",
    )
    msg = f"checkpoint {step}: policy_main.pt does not match its SHA-256 in {MANIFEST}"
    refused(capsys, ["train", str(recipe), "--resume", str(run)], msg, *hint)
    refused(capsys, ["eval", str(recipe), "--run-dir", str(run)], msg)
    refused(capsys, ["export", str(recipe), str(run)], msg)
    assert not (run / "export").exists()
    # without the manifest the same file passes every structural check (the old behaviour)
    legacy, legacy_step = copy_run(run, tmp_path / "legacy")
    for m in legacy.glob(f"checkpoints/*/{MANIFEST}"):
        m.unlink()
    assert _verify(recipe, legacy).checkpoint == legacy_step
    # the hint works: step 2 moved aside, the run resumes from step 1
    step.rename(f"{step}.damaged")
    assert _verify(recipe, run).checkpoint == run / "checkpoints" / "step_000001"


def test_a_zeroed_block_in_a_shard_names_the_shard(saved, tmp_path, capsys):
    recipe, _, sharded = saved
    run, step = copy_run(sharded, tmp_path)
    shard = step / "policy_main" / "__0_0.distcp"
    zero_block(shard, shard.stat().st_size // 2)
    refused(
        capsys,
        ["train", str(recipe), "--resume", str(run)],
        f"checkpoint {step}: policy_main/__0_0.distcp does not match its SHA-256",
        "to resume from step_000001",
    )


def test_a_damaged_previous_checkpoint_is_not_offered(saved, tmp_path, capsys):
    recipe, src, _ = saved
    run, step = copy_run(src, tmp_path)
    zero_block_in_tensor(step / "policy_main.pt")
    zero_block_in_tensor(run / "checkpoints" / "step_000001" / "policy_main.pt")
    err = refused(
        capsys,
        ["train", str(recipe), "--resume", str(run)],
        "policy_main.pt does not match its SHA-256",
        "start a fresh run",
    )
    assert "step_000001" not in err


def test_a_file_added_after_the_checkpoint_is_named(saved, tmp_path, capsys):
    recipe, src, _ = saved
    run, step = copy_run(src, tmp_path)
    torch.save({"w": torch.zeros(2)}, step / "extra.pt")
    refused(
        capsys,
        ["train", str(recipe), "--resume", str(run)],
        "extra.pt is not in MANIFEST.json",
    )


def test_a_checkpoint_without_a_manifest_still_resumes(saved, tmp_path, capsys):
    from polyrl.core.runner.checksums import MANIFEST

    recipe, src, sharded = saved
    for origin in (src, sharded):
        run, step = copy_run(origin, tmp_path / origin.name)
        (step / MANIFEST).unlink()
        assert _verify(recipe, run).checkpoint == step
        err = capsys.readouterr().err
        assert f"note: checkpoint {step} has no {MANIFEST}" in err and err.count("\n") == 1


# ------------------------------------------------------------------- failed checkpoint writes
# Each fault is the kernel's own: a file-size limit (RLIMIT_FSIZE, SIGXFSZ ignored as a
# shell's `ulimit -f` leaves it), a write into /dev/full (ENOSPC), a directory the process
# may not write (EACCES); torch.save runs unchanged.


def _intact(run: Path, steps: list[int]) -> None:
    """Only these complete checkpoints, no .tmp left, each matching its manifest and its
    state."""
    from polyrl.core.runner.checksums import check_manifest
    from polyrl.core.runner.run import RunDir

    ckpts = run / "checkpoints"
    assert sorted(p.name for p in ckpts.iterdir()) == [f"step_{s:06d}" for s in steps]
    for s in steps:
        assert check_manifest(ckpts / f"step_{s:06d}") is None
    rd = RunDir(run, tensorboard=False, loggers=())
    step, state = rd.load_latest()
    rd.close()
    assert step == steps[-1]
    assert torch.equal(
        state["policy_main"]["weights"]["w"], _state(step, 1000)["policy_main"]["weights"]["w"]
    )


CHILD = """\
import resource, signal, sys
import torch
from polyrl.core.runner.run import RunDir, CheckpointWriteError

def _state(step, n):  # as tests.helpers.faults.sized_state (a site package owns `tests`)
    w = torch.randn(n, generator=torch.Generator().manual_seed(step))
    return {"trainer": {"step": step}, "policy_main": {"weights": {"w": w}}}

rd = RunDir(sys.argv[1], tensorboard=False, loggers=())
rd.save(1, _state(1, 1000))
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
resource.setrlimit(resource.RLIMIT_FSIZE, (64 * 1024, resource.RLIM_INFINITY))
try:
    rd.save(2, _state(2, 100_000))
except CheckpointWriteError as e:
    print(e)
    sys.exit(5)
"""


def test_a_file_size_limit_is_one_line_naming_the_file_and_the_size(tmp_path):
    run = tmp_path / "run"
    out = subprocess.run(
        [sys.executable, "-c", CHILD, str(run)],
        capture_output=True,
        text=True,
        cwd=Path(__file__).parents[2],
        timeout=120,
    )
    assert out.returncode == 5, out.stderr[-3000:]
    line = out.stdout.strip()
    assert "\n" not in line
    for needle in (
        f"checkpoint step 2 could not be written, {run}/checkpoints/step_000002.tmp/"
        "policy_main.pt failed",
        "file-size limit (File too large; ulimit -f: 64.0 KiB)",
        "needs about 390.6 KiB",  # 100_000 float32 weights
        "the earlier checkpoints are intact (latest step_000001)",
        f"--resume {run}",
    ):
        assert needle in line, (needle, line)
    _intact(run, [1])


def test_a_full_disk_names_the_space_needed_and_free(tmp_path):
    """The part after the first one is a link to /dev/full: each write there fails with
    the kernel's ENOSPC, as on a full disk."""
    from polyrl.core.runner.checkpoint import DirectoryPart
    from polyrl.core.runner.run import CheckpointWriteError, RunDir

    if not os.path.exists("/dev/full"):
        pytest.skip("no /dev/full on this system")
    run = tmp_path / "run"
    rd = RunDir(run, tensorboard=False, loggers=())
    rd.save(1, _state(1, 1000))
    full = _state(2, 50_000) | {"trainer": _state(2, 1)["trainer"]}
    link = DirectoryPart(lambda p: (p.parent / "policy_main.pt").symlink_to("/dev/full"))
    with pytest.raises(CheckpointWriteError) as e:
        rd.save(2, {"disk": link, **full})
    rd.close()
    msg = str(e.value)
    free = shutil.disk_usage(run).free
    assert (
        "step_000002.tmp/policy_main.pt failed: the disk is full (No space left on device)" in msg
    )
    assert "needs about 195.3 KiB" in msg and " is free there" in msg, msg
    assert f"{free / 2**30:.1f} GiB is free" in msg or "MiB is free" in msg, (free, msg)
    _intact(run, [1])


@contextlib.contextmanager
def _unprivileged():
    """Root writes everywhere: act as nobody (effective uid, given back after)."""
    if os.geteuid() != 0:
        yield
        return
    os.seteuid(65534)
    try:
        yield
    finally:
        os.seteuid(0)


@pytest.fixture
def open_dir():
    """A folder anyone may enter (pytest's tmp_path lies under a root-only folder)."""
    path = Path(tempfile.mkdtemp(prefix="polyrl-perm-"))
    path.chmod(0o755)
    yield path
    shutil.rmtree(path)


def test_a_read_only_checkpoint_folder_is_one_line(open_dir):
    from polyrl.core.runner.run import CheckpointWriteError, RunDir

    run = open_dir / "run"
    rd = RunDir(run, tensorboard=False, loggers=())
    rd.save(1, _state(1, 1000))
    (run / "checkpoints").chmod(0o555)
    try:
        with _unprivileged(), pytest.raises(CheckpointWriteError) as e:
            rd.save(2, _state(2, 1000))
    finally:
        (run / "checkpoints").chmod(0o755)
        rd.close()
    msg = str(e.value)
    assert (
        f"checkpoint step 2 could not be written, {run}/checkpoints/step_000002.tmp failed: "
        "Permission denied" in msg
    ), msg
    assert f"make {run}/checkpoints writable" in msg
    assert "the earlier checkpoints are intact (latest step_000001)" in msg
    _intact(run, [1])


@pytest.mark.slow
def test_train_stops_with_exit_2_when_a_checkpoint_cannot_be_written(saved, tmp_path):
    """A real run gets a file-size limit after its first checkpoint: the next one fails,
    ``polyrl train`` says so in one line and exits 2, step 1 is intact and verifies."""
    recipe, _, _ = saved
    run = tmp_path / "run"
    ignore = (
        "import signal, sys; signal.signal(signal.SIGXFSZ, signal.SIG_IGN); "
        "from polyrl.core.runner.cli import main; sys.exit(main(sys.argv[1:]))"
    )
    proc = spawn_train(
        recipe, tmp_path, f"run.dir={run}", "run.save_every=1", "train.steps=6", script=ignore
    )
    first = run / "checkpoints" / "step_000001" / "COMPLETE"
    deadline = time.monotonic() + 180
    while not first.is_file() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)
    limit = (first.parent / "policy_main.pt").stat().st_size // 2
    resource.prlimit(proc.pid, resource.RLIMIT_FSIZE, (limit, resource.RLIM_INFINITY))
    rc = proc.wait(timeout=180)
    proc.log.close()
    log = Path(proc.log.name).read_text()
    assert rc == 2, log[-3000:]
    errors = [x for x in log.splitlines() if x.startswith("polyrl train: error:")]
    assert len(errors) == 1 and "Traceback" not in log, log[-3000:]
    assert "could not be written" in errors[0] and "file-size limit" in errors[0]
    assert f"--resume {run}" in errors[0]
    kept = sorted(p.name for p in (run / "checkpoints").iterdir())
    assert kept and all(not k.endswith(".tmp") for k in kept), kept
    assert _verify(recipe, run).checkpoint == run / "checkpoints" / kept[-1]
