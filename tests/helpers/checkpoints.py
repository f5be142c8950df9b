"""Saved runs to damage: two complete checkpoints and a sharded copy, and the CLI's
refusal of them (tests/core/test_checkpoint_verify.py, test_checkpoint_integrity.py)."""

from __future__ import annotations

import shutil
from pathlib import Path

import yaml


def saved_run(root: Path, recipe: dict, model_dir: str, batches: int = 0):
    """(recipe path, run dir, sharded copy): a run of ``recipe`` on ``model_dir`` with
    complete checkpoints at steps 1 and 2 (``batches`` batches drawn between them), and a
    copy whose step 2 holds its policy sharded (DCP) as Ray writes it, with the manifest
    of those files."""
    from polyrl.core.config import load
    from polyrl.core.recipe import Config
    from polyrl.core.runner.checkpoint import save_policy
    from polyrl.core.runner.checksums import write_manifest
    from polyrl.core.runner.session import Session

    path = root / "recipe.yaml"
    body = recipe | {"policies": {"main": {"model": model_dir, "micro_batch_size": 64}}}
    path.write_text(yaml.safe_dump(body))
    cfg = load(Config, path, [f"run.dir={root}/run"])
    s = Session.open(cfg)
    s.save(1)
    for _ in range(batches):
        s.sampler.next_batch()
    s.save(2)
    sharded = root / "sharded"
    shutil.copytree(root / "run", sharded)
    step = sharded / "checkpoints" / "step_000002"
    (step / "policy_main.pt").unlink()
    save_policy(s.policies["main"], step / "policy_main", lora=False)
    write_manifest(step)  # the checksums of the files as Ray writes them
    s.run.close()
    s.backend.shutdown()
    return path, root / "run", sharded


def copy_run(src: Path, tmp_path: Path) -> tuple[Path, Path]:
    """A copy of run ``src`` to damage, and its step-2 checkpoint."""
    run = tmp_path / "run"
    shutil.copytree(src, run)
    return run, run / "checkpoints" / "step_000002"


def refused(capsys, argv: list[str], *needles: str) -> str:
    """``polyrl ARGV`` exits 2 with one message (no traceback) holding every needle."""
    from polyrl.core.runner.cli import main

    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    for n in needles:
        assert n in err, (n, err)
    return err
