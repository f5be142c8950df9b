"""``polyrl train | eval | plot | trace | export | serve | config``.

Exit status: 0 done; 2 the recipe, data or run directory is wrong (one message, before any
training; or, mid-run, a checkpoint could not be written: disk full, file-size limit,
permission); 3 the run ran but no step had a valid row (every rollout or reward failed), so
nothing was trained and no model was exported. ``key.sub=value`` overrides may come
anywhere on the command line, before or after the options.
"""

from __future__ import annotations

import argparse
import glob
import os
import re
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from polyrl.core.config import ConfigError, UserError
from polyrl.core.runner.failures import EXIT_STATUS as RUN_FAILED
from polyrl.core.runner.failures import RunFailedError

if TYPE_CHECKING:
    from polyrl.core.recipe import Config

# The embedded default: what `polyrl train` with no recipe runs (the README's main job).
DEFAULT_RECIPE = Path(__file__).parents[1] / "recipes" / "arithmetic_grpo.yaml"


def _load(recipe: str | None, overrides: list[str]) -> Config:
    import polyrl.core  # noqa: F401  (registers the core's parts)
    from polyrl.core.config import load
    from polyrl.core.recipe import Config
    from polyrl.core.registry import RECIPES, load_plugins

    load_plugins()
    if recipe is not None and "=" in recipe and not Path(recipe).exists():
        overrides = [recipe, *overrides]  # `polyrl train key=value ...`
        recipe = None
    if recipe is not None and not Path(recipe).exists() and re.fullmatch(r"[\w-]+", recipe):
        recipe = str(RECIPES.get(recipe))  # a packaged recipe by name: `polyrl train signaling`
    return load(Config, DEFAULT_RECIPE if recipe is None else recipe, overrides)


def _latest_run(pattern_dir: str, name: str) -> str:
    """The newest directory with checkpoints that ``run.dir`` (e.g. runs/{name}-{time}) names."""
    pattern = re.sub(
        r"\{[^{}]*\}",
        lambda m: glob.escape(name) if m.group(0) == "{name}" else "*",
        os.path.expanduser(pattern_dir),
    )
    found = sorted(
        (p for p in map(Path, glob.glob(pattern)) if (p / "checkpoints").is_dir()),
        key=lambda p: (p / "checkpoints").stat().st_mtime,
    )
    if not found:
        raise ConfigError(f"--resume: no run directory with checkpoints matches {pattern}")
    return str(found[-1])


def cmd_train(args: argparse.Namespace) -> int:
    from polyrl.core.loop import train

    overrides = list(args.overrides)
    if args.resume and not Path(args.resume).expanduser().is_dir():  # a typo must not start afresh
        raise ConfigError(
            f"--resume: {args.resume!r} is not a directory; give the run directory "
            "to continue (or --resume alone for the newest run)"
        )
    if args.resume is not None:
        overrides.append("run.resume=true")
    cfg = _load(args.recipe, overrides)
    if args.resume:
        cfg.run.dir = args.resume
    elif args.resume is not None and "{" in cfg.run.dir:
        cfg.run.dir = _latest_run(cfg.run.dir, cfg.run.name)
    if args.resume is not None:  # an explicit --resume never starts afresh without a word
        _require_checkpoint(cfg.run.dir, "train --resume")
    run = train(cfg)
    print(f"run directory: {run.path}")
    return 0


def _require_checkpoint(run_dir: str, cmd: str) -> None:
    """Stop unless ``run_dir`` holds a complete checkpoint (never fall back to the base model
    or a fresh run), saying what the directory holds instead."""
    from polyrl.core.runner.run import CKPT_RE

    root = Path(run_dir).expanduser()
    ckpts = root / "checkpoints"
    entries = sorted(p.name for p in ckpts.iterdir()) if ckpts.is_dir() else []
    if any(CKPT_RE.match(n) and (ckpts / n / "COMPLETE").is_file() for n in entries):
        return
    if not root.is_dir():
        why = "the directory does not exist"
    elif not (root / "config.yaml").is_file() and not entries:
        why = "it is not a PolyRL run directory (no config.yaml, no checkpoints/)"
    elif entries:
        why = (
            f"checkpoints/ holds only incomplete checkpoints ({', '.join(entries)}: no COMPLETE "
            "marker; the run stopped while writing them)"
        )
    else:
        why = "the run stopped before its first checkpoint"
    fix = (
        "Start a fresh run without --resume (another run.dir), or give the right directory."
        if cmd == "train --resume"
        else f"Give {cmd} the directory of a run that saved a checkpoint (every "
        "run.save_every steps and at its end)."
    )
    raise ConfigError(  # main() prefixes "polyrl <cmd>: error:"
        f"{run_dir!r} has no complete checkpoint (checkpoints/step_*/COMPLETE): {why}. {fix}"
    )


def cmd_eval(args: argparse.Namespace) -> int:
    from polyrl.core.runner.session import Session

    overrides = list(args.overrides) + ["sft.steps=0", "run.export=false", "train.steps=0"]
    if args.run_dir:
        _require_checkpoint(args.run_dir, "eval")
        overrides.append("run.resume=true")
    cfg = _load(args.recipe, overrides)
    if args.run_dir:
        cfg.run.dir = args.run_dir
    s = Session.open(cfg, record=not args.run_dir)
    metrics = s.evaluate("eval")
    for k, v in sorted(metrics.items()):
        print(f"{k}: {v:.4f}")
    return 0


def cmd_plot(args: argparse.Namespace) -> int:
    from polyrl.core.observe.plot import plot_run

    if not (Path(args.run_dir) / "metrics.jsonl").is_file():
        raise ConfigError(
            f"polyrl plot: {args.run_dir!r} has no metrics.jsonl; is it a PolyRL run directory?"
        )
    for p in plot_run(args.run_dir):
        print(p)
    return 0


def cmd_trace(args: argparse.Namespace) -> int:
    from polyrl.core.observe.trace_report import plot_step, report

    if not any((Path(args.run_dir) / "trace").glob("*.json")):
        raise ConfigError(
            f"polyrl trace: {args.run_dir!r} has no trace/*.json; trace a run with "
            "run.trace_every=N (every N-th step)"
        )
    print(report(args.run_dir))
    print(plot_step(args.run_dir, args.step))
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    from polyrl.core.runner.session import Session

    _require_checkpoint(args.run_dir, "export")
    cfg = _load(args.recipe, list(args.overrides) + ["run.resume=true", "sft.steps=0"])
    cfg.run.dir = args.run_dir
    s = Session.open(cfg, record=False)
    out = Path(args.out or Path(args.run_dir) / "export")
    for name, p in s.policies.items():
        print(p.export(out / name))
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    """A long-running service a plugin registers (``tinker``: the Tinker API)."""
    from polyrl.core.registry import SERVICES, load_plugins

    load_plugins()
    if not Path(args.config).is_file():
        raise ConfigError(f"polyrl serve: the config {args.config!r} does not exist")
    return SERVICES.get(args.service)(args.config, list(args.overrides))


def main(argv: list[str] | None = None) -> int:
    torch.set_num_threads(max(1, torch.get_num_threads()))
    parser = argparse.ArgumentParser(
        prog="polyrl", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--debug", action="store_true", help="show the traceback of a recipe or data error"
    )
    sub = parser.add_subparsers(dest="cmd", required=True)
    t = sub.add_parser("train", help="train from a recipe")
    t.add_argument(
        "recipe",
        nargs="?",
        default=None,
        help="recipe YAML, or the name of a packaged recipe (arithmetic, signaling); "
        "default: core/recipes/arithmetic_grpo.yaml",
    )
    t.add_argument("overrides", nargs="*", help="key.sub=value")
    t.add_argument(
        "--resume",
        nargs="?",
        const="",
        default=None,
        help="continue the last complete checkpoint (of RUN_DIR, or the newest run)",
    )
    t.set_defaults(fn=cmd_train)
    e = sub.add_parser("eval", help="evaluate a recipe's policies (from a run's checkpoint)")
    e.add_argument("recipe")
    e.add_argument("overrides", nargs="*")
    e.add_argument("--run-dir", default=None)
    e.set_defaults(fn=cmd_eval)
    p = sub.add_parser("plot", help="write PNG curves of a run")
    p.add_argument("run_dir")
    p.set_defaults(fn=cmd_plot)
    r = sub.add_parser("trace", help="sum up a traced run (run.trace_every) and draw a step")
    r.add_argument("run_dir")
    r.add_argument("--step", type=int, default=None, help="the step drawn (default: slowest)")
    r.set_defaults(fn=cmd_trace)
    x = sub.add_parser("export", help="export a run's last checkpoint in Hugging Face format")
    x.add_argument("recipe")
    x.add_argument("run_dir")
    x.add_argument("overrides", nargs="*")
    x.add_argument("--out", default=None)
    x.set_defaults(fn=cmd_export)
    v = sub.add_parser("serve", help="run a service (tinker: the Tinker training API)")
    v.add_argument("service", help="the service's name, e.g. tinker")
    v.add_argument("--config", required=True, help="the service's YAML config")
    v.add_argument("overrides", nargs="*", help="key=value")
    v.set_defaults(fn=cmd_serve)
    h = sub.add_parser("config", help="list every recipe key with its type, default and doc")
    h.set_defaults(fn=cmd_config)
    args, extra = parser.parse_known_args(argv)
    # `polyrl eval R.yaml --run-dir D key=val`: argparse takes the positional overrides only
    # before the options; the ones after them come back here
    stray = [a for a in extra if a.startswith("-") or "=" not in a]
    if stray or (extra and not hasattr(args, "overrides")):
        parser.error(f"unrecognized arguments: {' '.join(stray or extra)}")
    if extra:
        args.overrides = [*args.overrides, *extra]
    if args.debug:
        return args.fn(args)
    try:
        return args.fn(args)
    except UserError as e:
        # What the user gave is wrong: the message names file, key or row and what to do;
        # a traceback would only bury it.
        print(f"polyrl {args.cmd}: error: {e}", file=sys.stderr)
        print("(run with --debug for the traceback)", file=sys.stderr)
        return 2
    except RunFailedError as e:
        print(f"polyrl {args.cmd}: the run failed: {e}", file=sys.stderr)
        return RUN_FAILED


def cmd_config(args: argparse.Namespace) -> int:
    """Every recipe key, and under each options field the options of every installed part."""
    import polyrl.core  # noqa: F401  (registers the core's parts)
    from polyrl.core.config import describe
    from polyrl.core.recipe import Config
    from polyrl.core.registry import load_plugins

    load_plugins()
    print("\n".join(describe(Config)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
