"""The run directory: resolved config, metrics and its loggers' files, samples, checkpoints.

Checkpoints are written to ``step_N.tmp`` and renamed only when complete, so a run
killed mid-write resumes from the previous one. A checkpoint carries everything that
makes a resumed run continue bit-for-bit: weights, optimizer, scheduler, every RNG,
the data position and the step.
"""

from __future__ import annotations

import errno
import json
import math
import os
import random
import re
import resource
import shutil
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
import yaml

from polyrl.core.config import UserError
from polyrl.core.observe.loggers import open_loggers
from polyrl.core.runner.checkpoint import DirectoryPart, SavedDirectory
from polyrl.core.runner.checksums import COMPLETE, MANIFEST, write_manifest

CKPT_RE = re.compile(r"^step_(\d+)$")


class RunDirError(UserError, OSError):
    """The run directory cannot be used (said before any training starts)."""


class CheckpointWriteError(RunDirError):
    """A checkpoint could not be written (disk full, file-size limit, permission); the
    earlier checkpoints are intact and the run resumes from the latest."""


def _os_error(exc: BaseException) -> OSError | None:
    """The OSError behind a failed write: torch's zip writer reports it as a
    ``RuntimeError: [enforce fail at inline_container.cc]`` whose context holds it."""
    seen: set[int] = set()
    e: BaseException | None = exc
    while e is not None and id(e) not in seen:
        if isinstance(e, OSError) and e.errno is not None:
            return e
        seen.add(id(e))
        e = e.__cause__ or e.__context__
    return None


def _size(n: float) -> str:
    """``n`` bytes in the largest binary unit that keeps the number above 1."""
    units = ["bytes", "KiB", "MiB", "GiB", "TiB"]
    while n >= 1024 and len(units) > 1:
        n /= 1024
        units.pop(0)
    return f"{n:.0f} bytes" if units[0] == "bytes" else f"{n:.1f} {units[0]}"


def _tensor_bytes(obj: Any) -> int:
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(_tensor_bytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(_tensor_bytes(v) for v in obj)
    return 0


def _bytes_needed(state: dict[str, Any], kept: list[tuple[int, Path]]) -> int:
    """About what the checkpoint takes: its tensors, or the last one's size if larger
    (a sharded part's size is known only from the last checkpoint)."""
    last = kept[-1][1] if kept else None
    on_disk = sum(f.stat().st_size for f in last.rglob("*") if f.is_file()) if last else 0
    return max(on_disk, _tensor_bytes(list(state.values())))


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def rng_state() -> dict:
    state = {
        "torch": torch.get_rng_state(),
        "numpy": np.random.get_state(),
        "python": random.getstate(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():  # GPU dropout etc.
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    np.random.set_state(state["numpy"])
    random.setstate(state["python"])
    if (
        "cuda" in state
        and torch.cuda.is_available()
        and torch.cuda.device_count() == len(state["cuda"])
    ):
        torch.cuda.set_rng_state_all(state["cuda"])


class RunDir:
    """``loggers`` (``run.loggers``) receive every logged step besides ``metrics.jsonl``;
    ``tensorboard=False`` (``run.tensorboard``) leaves TensorBoard out of them;
    ``prometheus_port`` (``run.prometheus_port``) serves them live until :meth:`close`."""

    def __init__(
        self,
        path: str | Path,
        config: dict | None = None,
        *,
        tensorboard: bool = True,
        loggers: Sequence[str] = ("tensorboard",),
        prometheus_port: int | None = None,
    ):
        self.path = Path(path).expanduser()
        try:
            self.path.mkdir(parents=True, exist_ok=True)
            probe = self.path / ".write_test"
            probe.write_text("ok")
            probe.unlink()
        except OSError as e:
            raise RunDirError(
                f"run directory {str(self.path)!r} is not writable ({e.strerror or e}); "
                "set run.dir to a folder you can write to"
            ) from None
        self.ckpt_dir = self.path / "checkpoints"
        self.samples_dir = self.path / "samples"
        self.ckpt_dir.mkdir(exist_ok=True)
        self.samples_dir.mkdir(exist_ok=True)
        if config is not None:
            (self.path / "config.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
        names = [n for n in loggers if tensorboard or n != "tensorboard"]
        self._loggers = open_loggers(names, self.path, self.path.name, config, prometheus_port)
        self._metrics = open(self.path / "metrics.jsonl", "a")  # noqa: SIM115 (closed in close())

    # --- logs ---------------------------------------------------------------------------
    def log(self, step: int, metrics: dict[str, float]) -> None:
        clean = {
            k: (float(v) if isinstance(v, (int, float)) and math.isfinite(float(v)) else None)
            for k, v in metrics.items()
        }
        self._metrics.write(json.dumps({"step": step, "time": time.time(), **clean}) + "\n")
        self._metrics.flush()
        finite = {k: v for k, v in clean.items() if v is not None}
        for logger in self._loggers:
            logger.log(finite, step)

    def write_samples(self, step: int, rows: list[dict], tag: str = "train") -> Path:
        out = self.samples_dir / f"{tag}_step_{step:06d}.jsonl"
        with open(out, "w") as f:
            for row in rows:
                f.write(json.dumps(row, default=str) + "\n")
        return out

    def close(self) -> None:
        """Close the metrics file and the loggers (a Prometheus endpoint stops serving);
        a second call does nothing."""
        if self._metrics.closed:
            return
        self._metrics.close()
        for logger in self._loggers:
            logger.close()

    # --- checkpoints --------------------------------------------------------------------
    def checkpoints(self) -> list[tuple[int, Path]]:
        """Complete checkpoints, oldest first (half-written ``.tmp`` ones are ignored)."""
        found = []
        for p in self.ckpt_dir.iterdir():
            m = CKPT_RE.match(p.name)
            if m and (p / "COMPLETE").is_file():
                found.append((int(m.group(1)), p))
        return sorted(found)

    def save(self, step: int, state: dict[str, Any], keep: int = 2) -> Path:
        """Atomically write ``state`` (a dict of picklable parts) as checkpoint ``step``,
        with the checksum manifest of every file in it. A write that fails (disk full,
        file-size limit, permission) removes the ``.tmp``, keeps the earlier checkpoints and
        raises :class:`CheckpointWriteError`."""
        final = self.ckpt_dir / f"step_{step:06d}"
        tmp = self.ckpt_dir / f"step_{step:06d}.tmp"
        writing = tmp
        try:
            if tmp.exists():
                shutil.rmtree(tmp)
            tmp.mkdir()
            for name, part in state.items():
                if isinstance(part, DirectoryPart):  # e.g. a policy's shards, one file per rank
                    writing = tmp / name
                    part.write(writing)
                    continue
                writing = tmp / f"{name}.pt"
                with open(writing, "wb") as f:
                    torch.save(part, f)
                    f.flush()
                    os.fsync(f.fileno())
            writing = tmp / MANIFEST
            write_manifest(tmp)
            writing = tmp / COMPLETE
            (tmp / COMPLETE).write_text(str(step))
            _fsync_dir(tmp)
        except (OSError, RuntimeError) as e:
            shutil.rmtree(tmp, ignore_errors=True)
            err = _os_error(e)
            if err is None:  # not a failed write: the error is someone else's to say
                raise
            raise CheckpointWriteError(
                self._write_failure(step, writing, err, _bytes_needed(state, self.checkpoints()))
            ) from e
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        _fsync_dir(self.ckpt_dir)
        for _, old in self.checkpoints()[:-keep] if keep > 0 else []:
            shutil.rmtree(old)
        return final

    def _write_failure(self, step: int, file: Path, err: OSError, need: int) -> str:
        """One line: which file, why, the space needed against the space free, what is
        kept and how to go on."""
        code = err.errno
        if code in (errno.ENOSPC, errno.EDQUOT):
            free = shutil.disk_usage(self.ckpt_dir).free
            why = (
                f"the disk is full ({err.strerror}): the checkpoint needs about "
                f"{_size(need)}, {_size(free)} is free there"
            )
            fix = "free space (or set run.keep_checkpoints lower, or run.dir on a larger disk)"
        elif code == errno.EFBIG:
            limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
            shown = "unlimited" if limit == resource.RLIM_INFINITY else _size(limit)
            why = (
                f"a file grew past the file-size limit ({err.strerror}; ulimit -f: {shown}); "
                f"the checkpoint needs about {_size(need)}"
            )
            fix = "raise the limit (ulimit -f unlimited)"
        elif code in (errno.EACCES, errno.EPERM, errno.EROFS):
            why = f"{err.strerror}" + (f" ({err.filename})" if err.filename else "")
            fix = f"make {self.ckpt_dir} writable"
        else:
            why = f"{err.strerror or err}" + (f" ({err.filename})" if err.filename else "")
            fix = "fix the disk"
        kept = self.checkpoints()
        keep = (
            f"the earlier checkpoints are intact (latest {kept[-1][1].name})"
            if kept
            else "no earlier checkpoint exists"
        )
        return (
            f"checkpoint step {step} could not be written, {file} failed: {why}. The .tmp "
            f"was removed and {keep}; {fix}, then continue with --resume {self.path}"
        )

    def load_latest(self) -> tuple[int, dict[str, Any]] | None:
        ckpts = self.checkpoints()
        for tmp in self.ckpt_dir.glob("*.tmp"):  # leftovers of a run killed mid-write
            shutil.rmtree(tmp)
        if not ckpts:
            return None
        step, path = ckpts[-1]
        state: dict[str, Any] = {
            p.stem: torch.load(p, weights_only=False) for p in path.glob("*.pt")
        }
        state |= {p.name: SavedDirectory(p) for p in path.iterdir() if p.is_dir()}
        return step, state
