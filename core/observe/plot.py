"""PNG curves of a run's metrics (reward, accuracy, KL, entropy, lengths)."""

from __future__ import annotations

import json
from pathlib import Path

PANELS = {
    "reward": ("reward/mean",),
    "accuracy": ("eval/accuracy", "eval_init/accuracy"),
    "kl": ("/kl", "/ppo_kl"),
    "entropy": ("/entropy",),
    "length": ("rollout/response_len", "eval/response_len"),
    "loss": ("/loss", "sft/"),
}


def read_metrics(run_dir: str | Path) -> list[dict]:
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist: is {run_dir!r} a PolyRL run directory?")
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def plot_run(run_dir: str | Path) -> list[Path]:
    """One PNG per panel that has data, under RUN_DIR/plots/."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = read_metrics(run_dir)
    out_dir = Path(run_dir) / "plots"
    out_dir.mkdir(exist_ok=True)
    written = []
    for panel, patterns in PANELS.items():
        keys = sorted(
            {
                k
                for r in rows
                for k in r
                if k not in ("step", "time") and any(p in k for p in patterns)
            }
        )
        series = {k: [(r["step"], r[k]) for r in rows if r.get(k) is not None] for k in keys}
        series = {k: v for k, v in series.items() if v}
        if not series:
            continue
        fig, ax = plt.subplots(figsize=(6, 3.5))
        for k, pts in series.items():
            xs, ys = zip(*pts, strict=True)
            ax.plot(xs, ys, marker="o" if len(pts) < 12 else None, label=k)
        ax.set_xlabel("step")
        ax.set_title(panel)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
        fig.tight_layout()
        path = out_dir / f"{panel}.png"
        fig.savefig(path, dpi=100)
        plt.close(fig)
        written.append(path)
    return written
