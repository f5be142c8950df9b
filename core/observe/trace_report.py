"""``polyrl trace RUN_DIR``: a traced run's timeline in ten seconds, and one step drawn.

Read from ``RUN_DIR/trace/*.json`` (:mod:`polyrl.core.observe.timeline`), over the traced steps:

- the share of the step each phase took (the spans directly inside ``step``);
- the engine's idle share (1 - the generation time of the step's batch / step time) and
  the trainer's (1 - update time / step time);
- the overlap async bought: the generation time of each step's batch the trainer did not
  wait for (a synchronous run waits for all of it: 0);
- the slowest engine calls, gateway requests and environment steps, with their facts.
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path
from typing import Any

from polyrl.core.observe.timeline import read_run

SLOW = ("generate", "gateway_request", "env_step", "tool_call")  # the "episodes" ranked


def _inside(child: dict, parent: dict) -> bool:
    return (
        (child["pid"], child["tid"]) == (parent["pid"], parent["tid"])
        and parent["ts"] <= child["ts"]
        and child["ts"] + child["dur"] <= parent["ts"] + parent["dur"]
    )


def _top_phases(step: dict, spans: list[dict]) -> list[dict]:
    """The spans directly inside ``step`` on its thread."""
    inner = [s for s in spans if s is not step and _inside(s, step)]
    return [s for s in inner if not any(o is not s and _inside(s, o) for o in inner)]


def _batch_generation(step_no: int, step: dict, spans: list[dict]) -> tuple[float, float]:
    """(generation seconds of the step's batch, of which the trainer waited for)."""
    batch = [s for s in spans if s["name"] == "batch" and s["args"].get("step") == step_no]
    if batch:  # async: the producer made it; the trainer waited in wait_rollout
        made = sum(
            s["dur"] for s in spans if s["name"] == "rollout" and any(_inside(s, b) for b in batch)
        )
        waited = sum(s["dur"] for s in spans if s["name"] == "wait_rollout" and _inside(s, step))
        return made / 1e6, min(waited, made) / 1e6
    made = sum(s["dur"] for s in spans if s["name"] == "rollout" and _inside(s, step))
    return made / 1e6, made / 1e6


def summarize(run_dir: str | Path) -> dict[str, Any]:
    """The figures :func:`report` prints (seconds and shares)."""
    spans = [e for e in read_run(run_dir) if e["ph"] == "X"]
    steps = [s for s in spans if s["name"] == "step"]
    if not steps:
        raise ValueError(f"{run_dir}/trace holds no traced step (run.trace_every too large?)")
    total = sum(s["dur"] for s in steps) / 1e6
    phases: dict[str, float] = defaultdict(float)
    made = waited = busy_update = 0.0
    for s in steps:
        for p in _top_phases(s, spans):
            phases[p["name"]] += p["dur"] / 1e6
        gen, wait = _batch_generation(s["args"]["step"], s, spans)
        made, waited = made + gen, waited + wait
        busy_update += sum(p["dur"] for p in _top_phases(s, spans) if p["name"] == "update") / 1e6
    slow = sorted((s for s in spans if s["name"] in SLOW), key=lambda s: -s["dur"])[:5]
    return {
        "steps": sorted(s["args"]["step"] for s in steps),
        "step_s": total / len(steps),
        "phases": {k: v / total for k, v in sorted(phases.items(), key=lambda kv: -kv[1])},
        "engine_idle": max(0.0, 1.0 - made / total),
        "trainer_idle": max(0.0, 1.0 - busy_update / total),
        "generation_s": made,
        "overlap_s": made - waited,
        "overlap": (made - waited) / made if made else 0.0,
        "slowest": [(s["name"], s["dur"] / 1e6, s["args"]) for s in slow],
    }


def report(run_dir: str | Path) -> str:
    """The summary as a few lines of text."""
    f = summarize(run_dir)
    lines = [
        f"{len(f['steps'])} traced steps ({', '.join(map(str, f['steps'][:8]))}"
        f"{', ...' if len(f['steps']) > 8 else ''}), {f['step_s']:.3f} s per step",
        "share of the step:",
        *(f"  {name:<16} {share:6.1%}" for name, share in f["phases"].items()),
        f"engine idle {f['engine_idle']:.1%}   trainer idle {f['trainer_idle']:.1%}",
        f"async overlap: {f['overlap_s']:.3f} s of {f['generation_s']:.3f} s generation "
        f"hidden behind training ({f['overlap']:.1%})",
        "slowest calls:",
        *(
            f"  {name:<16} {sec:8.3f} s  "
            + " ".join(f"{k}={v}" for k, v in args.items() if k != "step")
            for name, sec, args in f["slowest"]
        ),
    ]
    return "\n".join(lines)


def plot_step(run_dir: str | Path, step: int | None = None) -> Path:
    """A PNG of one traced step (the slowest, or ``step``): a lane per thread, each span
    a bar at its depth; written to RUN_DIR/plots/trace_step_<n>.png."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    spans = [e for e in read_run(run_dir) if e["ph"] == "X"]
    steps = [s for s in spans if s["name"] == "step"]
    if step is not None:
        steps = [s for s in steps if s["args"].get("step") == step]
    if not steps:
        raise ValueError(f"{run_dir}: step {step} was not traced")
    chosen = max(steps, key=lambda s: s["dur"])
    lo, hi = chosen["ts"], chosen["ts"] + chosen["dur"]
    shown = [s for s in spans if s["ts"] < hi and s["ts"] + s["dur"] > lo]
    lanes = sorted(
        {(s["pid"], s["tid"]) for s in shown}, key=lambda k: k != (chosen["pid"], chosen["tid"])
    )
    names = sorted({s["name"] for s in shown})
    colours = {n: plt.get_cmap("tab20")(i % 20) for i, n in enumerate(names)}
    fig, ax = plt.subplots(figsize=(12, 1.2 + 1.4 * len(lanes)))
    for lane, key in enumerate(lanes):
        mine = [s for s in shown if (s["pid"], s["tid"]) == key]
        for s in mine:
            depth = sum(o is not s and _inside(s, o) for o in mine)
            y = -(lane * 6 + depth)
            x0, x1 = max(s["ts"], lo), min(s["ts"] + s["dur"], hi)
            ax.barh(y, (x1 - x0) / 1e3, left=(x0 - lo) / 1e3, height=0.8, color=colours[s["name"]])
            if (x1 - x0) / (hi - lo) > 0.06:
                ax.text((x0 - lo) / 1e3, y, f" {s['name']}", va="center", fontsize=7)
    ax.set_yticks([-(i * 6) for i in range(len(lanes))], [f"pid {p} tid {t}" for p, t in lanes])
    ax.set_xlabel("ms from the step's start")
    ax.set_title(f"step {chosen['args'].get('step')}: {chosen['dur'] / 1e6:.3f} s")
    handles = [plt.Rectangle((0, 0), 1, 1, color=colours[n]) for n in names]
    ax.legend(handles, names, fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    out = Path(run_dir) / "plots" / f"trace_step_{chosen['args'].get('step')}.png"
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out
