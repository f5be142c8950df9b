"""What a run directory holds, read back for assertions: metrics, checkpoint parts."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch

# The README demo's recipe (SFT warm start, then GRPO on arithmetic).
ARITHMETIC_RECIPE = Path(__file__).parents[2] / "core" / "recipes" / "arithmetic_grpo.yaml"


def metrics(run_dir: Path) -> list[dict]:
    """Every line of the run's ``metrics.jsonl``, in the order written."""
    return [json.loads(x) for x in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]


def metrics_by_step(run_dir: Path) -> dict[int, dict]:
    """Step -> every metric logged at that step (later lines win, as after a resume), without
    the wall-clock ones, which differ between equal runs: ``time``, ``time/*`` and the
    rates of ``perf/*`` (tokens/s, TFLOP/s, MFU; the token counts stay)."""
    out: dict[int, dict] = {}
    for row in metrics(run_dir):
        step = row.pop("step")
        row.pop("time")
        out.setdefault(step, {}).update({k: v for k, v in row.items() if not wall_clock(k)})
    return out


def wall_clock(key: str) -> bool:
    """A metric measured in wall-clock time (it differs between equal runs)."""
    return key.startswith("time/") or (key.startswith("perf/") and not key.endswith("_tokens"))


def accuracy_after_sft_and_grpo(run_dir) -> tuple[float, float]:
    """The first held-out accuracy (after SFT) and the last (after GRPO)."""
    evals = [r["eval/accuracy"] for r in metrics(run_dir) if r.get("eval/accuracy") is not None]
    return evals[0], evals[-1]


def assert_same_tensors(a: dict, b: dict, what: str) -> None:
    """Same keys and bit-equal tensors; ``what`` names the state in the failure."""
    assert a.keys() == b.keys(), what
    for k in a:
        assert torch.equal(a[k], b[k]), f"{what}: {k} differs"


def assert_same_policy_part(pa: dict, pb: dict) -> None:
    """Two checkpoints' policy parts (``load_part``): bit-equal weights and optimizer state,
    parameter by parameter."""
    assert_same_tensors(pa["weights"], pb["weights"], "final weights")
    for (ka, sa), (kb, sb) in zip(
        pa["optimizer"]["state"].items(), pb["optimizer"]["state"].items(), strict=True
    ):
        assert ka == kb
        assert_same_tensors(sa, sb, f"optimizer state of parameter {ka}")


def max_weight_change(start: dict, final: dict) -> float:
    """The largest |final - start| over every floating tensor (``start`` cast to
    ``final``'s dtype); both hold the same keys."""
    assert start.keys() == final.keys(), sorted(start.keys() ^ final.keys())[:5]
    return max(
        (
            float((final[k].float() - start[k].to(final[k].dtype).float()).abs().max())
            for k in final
            if final[k].is_floating_point() and final[k].numel()
        ),
        default=0.0,
    )


def assert_weights_moved(
    start: dict, final: dict, at_least: float, what: str = "reference"
) -> float:
    """The ``what`` run trained: its ``final`` weights lie at least ``at_least`` (max abs)
    from ``start``, so a resumed run equal to it is not equal trivially (a run with no
    gradient ends where it began). Prints and returns the change."""
    change = max_weight_change(start, final)
    print(f"{what}: weights moved {change:.3e} (max abs), at least {at_least:.1e} asked")
    assert change >= at_least, (
        f"{what} run's weights moved only {change:.3e} (max abs) < {at_least:.1e}: "
        "it did not train, so comparing a resumed run with it proves nothing"
    )
    return change


def load_part(ckpt: Path, part: str) -> dict:
    """One part (``trainer``, ``policy_main``, ``rollouts``...) of a checkpoint directory."""
    return torch.load(Path(ckpt) / f"{part}.pt", weights_only=False)


# ---------------------------------------------------------------- save, then kill, then resume


def spawn_train(recipe: Path, cwd: Path, *args: str, script: str | None = None) -> subprocess.Popen:
    """``polyrl train RECIPE ARGS`` in a fresh process (``script``: run this code instead of
    the CLI module, with the same arguments)."""
    env = dict(
        os.environ,
        OMP_NUM_THREADS="1",
        MKL_NUM_THREADS="1",
        HF_HUB_OFFLINE="1",
        TOKENIZERS_PARALLELISM="false",
        PYTHONHASHSEED="0",
    )
    log = open(cwd / f"log-{len(list(cwd.glob('log-*')))}.txt", "w")  # noqa: SIM115
    entry = ["-c", script] if script else ["-m", "polyrl.core.runner.cli"]
    proc = subprocess.Popen(
        [sys.executable, *entry, "train", str(recipe), *args],
        cwd=cwd,
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    proc.log = log  # type: ignore[attr-defined]
    return proc


def finish_train(proc: subprocess.Popen, timeout: float = 240) -> str:
    """Wait for a ``spawn_train`` child; it must exit 0 (else its log's tail fails the test)."""
    rc = proc.wait(timeout=timeout)
    proc.log.close()
    text = Path(proc.log.name).read_text()
    assert rc == 0, f"training exited with {rc}:\n{text[-4000:]}"
    return text


# ``spawn_train(..., script=KILL_MID_WRITE.format(step=N))``: the child trains normally until
# it writes checkpoint N: it writes half of that checkpoint's first file and then SIGKILLs
# itself, as a power cut or an OOM kill would.
KILL_MID_WRITE = """\
import io, os, signal, sys
import torch

real_save = torch.save

def save(obj, f, *args, **kwargs):
    if isinstance(f, io.IOBase) and "step_{step:06d}.tmp" in getattr(f, "name", ""):
        buf = io.BytesIO()
        real_save(obj, buf, *args, **kwargs)
        f.write(buf.getvalue()[: len(buf.getvalue()) // 2])
        f.flush()
        os.kill(os.getpid(), signal.SIGKILL)
    return real_save(obj, f, *args, **kwargs)

torch.save = save
from polyrl.core.runner.cli import main
sys.exit(main(sys.argv[1:]))
"""
