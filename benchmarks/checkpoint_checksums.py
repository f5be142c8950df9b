"""What the checkpoint checksums cost: SHA-256 of every file against writing the files.

Trains the README's arithmetic demo (core/recipes/arithmetic_grpo.yaml, model built
offline) for one GRPO step, so its checkpoint holds weights and Adam moments, then times in
this one process, on the same files: writing its parts as ``RunDir.save`` does (torch.save,
fsync), writing the manifest (``write_manifest``: hash every file) and checking it
(``check_manifest``: what resume, eval and export pay). Prints the medians and the ratios
manifest/write and check/write.

    .venv/bin/python benchmarks/checkpoint_checksums.py [--repeats 5]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch


def _write(parts: dict, into: Path) -> None:
    into.mkdir()
    for name, part in parts.items():
        with open(into / f"{name}.pt", "wb") as f:
            torch.save(part, f)
            f.flush()
            os.fsync(f.fileno())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args()
    torch.set_num_threads(1)
    from polyrl.core.loop import train
    from polyrl.core.runner.checksums import check_manifest, write_manifest
    from polyrl.core.runner.cli import DEFAULT_RECIPE, _load

    with tempfile.TemporaryDirectory() as tmp:
        run_dir = Path(tmp) / "run"
        cfg = _load(
            str(DEFAULT_RECIPE),
            [
                f"run.dir={run_dir}",
                "sft.steps=0",
                "train.steps=1",
                "task.args.n_eval=4",
                "run.progress=false",
                "run.tensorboard=false",
                "run.export=false",
            ],
        )
        train(cfg)
        ckpt = max((run_dir / "checkpoints").glob("step_*"))
        parts = {f.stem: torch.load(f, weights_only=False) for f in ckpt.glob("*.pt")}
        size = sum(f.stat().st_size for f in ckpt.glob("*.pt"))
        write, hashing, checking = [], [], []
        for i in range(args.repeats):
            scratch = Path(tmp) / f"w{i}"
            t0 = time.perf_counter()
            _write(parts, scratch)
            t1 = time.perf_counter()
            write_manifest(scratch)
            t2 = time.perf_counter()
            assert check_manifest(scratch) is None
            t3 = time.perf_counter()
            write.append(t1 - t0)
            hashing.append(t2 - t1)
            checking.append(t3 - t2)
    w, h, c = (statistics.median(x) for x in (write, hashing, checking))
    print(f"arithmetic demo checkpoint: {size / 2**20:.1f} MiB in {len(parts)} files")
    print(f"write (torch.save + fsync)  {w * 1e3:8.1f} ms")
    print(f"write_manifest (SHA-256)    {h * 1e3:8.1f} ms   {h / w:.2f}x the write")
    print(f"check_manifest (on resume)  {c * 1e3:8.1f} ms   {c / w:.2f}x the write")
    print(f"hashing throughput          {size / 2**20 / h:8.0f} MiB/s")


if __name__ == "__main__":
    main()
