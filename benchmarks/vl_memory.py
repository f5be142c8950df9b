"""Peak host memory of VL training against dataset size: lazy image loading keeps it flat.

For each dataset size N (default 100, 1,000 and 5,000 image prompts of the vl_shapes
colour task, 112x112 PNG files), a fresh Python process runs ``polyrl.core.loop.train``
with the ``vl`` dataset kind over the N prompts for 3 GRPO steps (the tiny Qwen2.5-VL of
the demo; 16 prompts x 8 samples per step) and reports its peak resident set size
(``ru_maxrss``). The ``vl`` kind reads only image headers at load time; pixels are decoded
per rollout and dropped after the step, so the peak should not depend on N.

For scale, a second kind of process shows what the same N prompts cost when loaded
eagerly (every image decoded to RGB and kept, as loaders that hold raw images do): the
same model and imports, plus the decoded images. The eager process processes nothing
into pixel tensors; keeping those too (about 300 KB per 112x112 image in fp32) would
cost roughly ten times more.

    .venv/bin/python benchmarks/vl_memory.py [--sizes 100 1000 5000] [--no-eager]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as c  # noqa: E402
import vl_grpo_vs_trl as vl  # noqa: E402

TAG = "VLMEM "


def _peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def run_lazy(model: str, data: str) -> dict:
    """3 GRPO steps of PolyRL over the whole data file (vl dataset kind)."""
    out = tempfile.mkdtemp(prefix="vlmem-")
    times = vl.run_polyrl(model, data, 3, out)
    return {"peak_rss_mb": _peak_rss_mb(), "steps": len(times)}


def run_eager(model: str, data: str) -> dict:
    """The same imports and model, plus every image of the data file decoded and kept."""
    import torch
    from PIL import Image
    from transformers import AutoModelForImageTextToText

    import polyrl.multimodal  # noqa: F401

    net = AutoModelForImageTextToText.from_pretrained(model, dtype=torch.float32)
    root = Path(data).parent
    rows = [json.loads(x) for x in Path(data).read_text().splitlines()]
    images = [Image.open(root / r["images"][0]).convert("RGB") for r in rows]
    return {
        "peak_rss_mb": _peak_rss_mb(),
        "images": len(images),
        "params": sum(p.numel() for p in net.parameters()),
    }


def measure(kind: str, model: str, data: str, threads: int) -> dict:
    """Run one measurement in a fresh process (peak RSS is per process)."""
    env = {
        **os.environ,
        "OMP_NUM_THREADS": str(threads),
        "TOKENIZERS_PARALLELISM": "false",
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
    }
    cmd = [
        sys.executable,
        __file__,
        "--child",
        kind,
        "--model",
        model,
        "--data",
        data,
        "--threads",
        str(threads),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
    for line in proc.stdout.splitlines():
        if line.startswith(TAG):
            return json.loads(line[len(TAG) :])
    raise RuntimeError(f"{kind} on {data} failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--sizes", type=int, nargs="+", default=[100, 1000, 5000])
    p.add_argument("--threads", type=int, default=1, help="torch threads per process")
    p.add_argument("--no-eager", action="store_true", help="skip the eager-loading reference")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    p.add_argument("--model", default=None, help=argparse.SUPPRESS)
    p.add_argument("--data", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        import torch

        torch.set_num_threads(args.threads)
        run = run_lazy if args.child == "lazy" else run_eager
        print(TAG + json.dumps(run(args.model, args.data)), flush=True)
        return
    print("vl_memory: peak host RSS (fresh process per row) against the number of image prompts\n")
    c.print_machine(args.threads)
    kinds = ["lazy"] + ([] if args.no_eager else ["eager"])
    peaks: dict[str, dict[int, float]] = {k: {} for k in kinds}
    print(
        f"\n  {'prompts':>8}  {'PolyRL vl kind, 3 GRPO steps':>30}"
        + ("" if args.no_eager else f"  {'eager (decoded images kept)':>28}")
    )
    for n in args.sizes:
        model, data = vl.build(n)
        for kind in kinds:
            peaks[kind][n] = measure(kind, model, data, args.threads)["peak_rss_mb"]
        print(
            f"  {n:>8}  {peaks['lazy'][n]:>27.0f} MB"
            + ("" if args.no_eager else f"  {peaks['eager'][n]:>25.0f} MB")
        )
    lo, hi = min(args.sizes), max(args.sizes)
    for kind in kinds:
        grow = peaks[kind][hi] - peaks[kind][lo]
        print(
            f"\n  {kind}: {lo} -> {hi} prompts: {grow:+.0f} MB "
            f"({grow / (hi - lo) * 1024:+.1f} KB per extra prompt)"
        )


if __name__ == "__main__":
    main()
