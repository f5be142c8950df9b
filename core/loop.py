"""The training loop. It reads in one screen; everything it calls is a small named part."""

from __future__ import annotations

import time

from polyrl.core.observe import timeline
from polyrl.core.observe.progress import Progress
from polyrl.core.observe.throughput import Throughput
from polyrl.core.observe.timeline import Tracer, span, tracing
from polyrl.core.recipe import Config
from polyrl.core.record import valid_rows
from polyrl.core.rollout.truncation import TruncationWatch
from polyrl.core.runner.failures import Failures
from polyrl.core.runner.run import RunDir
from polyrl.core.runner.session import Session
from polyrl.core.train.credit import assign


def train(cfg: Config) -> RunDir:
    """Rollout -> reward -> credit -> update -> sync -> log -> save, ``cfg.train.steps`` times."""
    s = Session.open(cfg)  # run dir checked first, then data, policies, engines, resume
    with s.freed_on_error():  # a raising run still frees its actors, placement groups, loggers
        failures = _steps(cfg, s)
    failures.check(f"{s.run.path}/samples/")  # RunFailedError; `polyrl train` exits 3
    return s.run


def _steps(cfg: Config, s: Session) -> Failures:
    """The steps, the final evaluation and the run's end (export, plots, shutdown)."""
    run, rollouts = s.run, s.rollouts
    failures = Failures(max_unscored=cfg.train.max_unscored_steps)  # stop early, exit 3
    cut = TruncationWatch(cfg.rollout.max_new_tokens, cfg.rollout.warn_truncated)
    perf = Throughput(s.policies, cfg.algorithm)  # tokens/s and MFU
    tracer = Tracer(run.path / "trace", cfg.run.trace_every) if cfg.run.trace_every else None
    first = s.evaluate("eval") if s.step == 0 else {}
    run.log(s.step, first)
    with (
        Progress(cfg.train.steps, s.step, enabled=cfg.run.progress) as bar,
        tracing(tracer),
    ):
        bar.update(s.step, first)
        for step in range(s.step + 1, cfg.train.steps + 1):
            t0, updates = time.perf_counter(), dict[str, float]()
            with timeline.step(step):  # recorded every run.trace_every steps
                with span("rollout"):
                    record, own = rollouts.next(step)  # made now, or by a producer k ahead
                with span("rewards"):
                    metrics = s.score(record)
                with span("credit"):
                    metrics |= assign(record, cfg.algorithm)
                    metrics |= s.learn(record)  # a workflow's own learned parts (a critic)
                failures.step(step, record)  # no valid row: the first error and the count
                valid = valid_rows(record)
                for names in s.update_groups():  # LoRA agents of one base: one pass for all
                    t1 = time.perf_counter()
                    with span("update", policies=names):
                        out = s.update_group(names, valid)
                    updates |= dict.fromkeys(names, (time.perf_counter() - t1) / len(names))
                    for name, upd in out.items():
                        metrics |= {f"{name}/{k}": v for k, v in upd.items()}
                        with span("weight_sync", policy=name):
                            rollouts.publish(name, step)  # its engine gets the new weights
                step_s = time.perf_counter() - t0
                metrics |= s.rollout_stats(record, own) | {"time/step_s": step_s}
                metrics |= perf.step(record, step_s, updates)
                cut.step(step, record, metrics)  # too many cut at max_new_tokens: once
                if cfg.eval.every and step % cfg.eval.every == 0 and step < cfg.train.steps:
                    with span("eval"):
                        metrics |= s.evaluate("eval", step)
                if step % cfg.run.log_every == 0 or step == cfg.train.steps or failures.stop:
                    run.log(step, metrics)
                    s.write_samples(step, record)
                if (cfg.run.save_every and step % cfg.run.save_every == 0) or (
                    step == cfg.train.steps
                ):
                    with span("checkpoint"):
                        s.save(step)
            bar.update(step, metrics)
            if failures.stop:  # train.max_unscored_steps in a row with no valid row
                break
        final = {} if failures.stop else s.evaluate("eval", cfg.train.steps)
        if not failures.stop:
            run.log(cfg.train.steps, final)
            bar.update(cfg.train.steps, final, final=True)
    s.finish(final, export=not (failures.failed or failures.stop))  # failed: no export
    return failures
