"""Async rollouts send the version the next batch needs toward the engines at its publish,
while the batch before it generates (under Ray, the engine actor fetches it meanwhile):
what is sent ahead is exactly the next version loaded, never one not yet published."""

from __future__ import annotations

import pytest

from tests.helpers import rollouts  # noqa: F401  (registers test_slow_hf, test_slow_low_digit)


def _events(make_config, tmp_path, monkeypatch, name, *overrides) -> list[tuple[str, int]]:
    """The run's ordered publishes, sends ahead and the producer's weight loads (versions
    that changed an engine's weights)."""
    import threading

    from polyrl.core.loop import train
    from polyrl.core.rollout.rollouts import Ahead

    log: list[tuple[str, int]] = []
    load, prefetch, publish = Ahead._load, Ahead._prefetch, Ahead.publish

    def spy_load(self, version):
        producer = threading.current_thread().name == "polyrl-rollouts"
        if producer and any(v != version for v in self.loaded.values()):
            log.append(("load", version))
        load(self, version)

    def spy_prefetch(self, version):
        log.append(("ahead", version))
        prefetch(self, version)

    def spy_publish(self, name, step):
        log.append(("publish", step))  # one trained policy: this publish completes `step`
        publish(self, name, step)

    monkeypatch.setattr(Ahead, "_load", spy_load)
    monkeypatch.setattr(Ahead, "_prefetch", spy_prefetch)
    monkeypatch.setattr(Ahead, "publish", spy_publish)
    cfg = make_config(
        f"run.dir={tmp_path}/{name}",
        "train.steps=6",
        "rollout.prompts_per_step=4",
        "eval.every=0",
        "rollout.max_staleness=1",
        *overrides,
    )
    train(cfg)
    return log


@pytest.mark.parametrize(
    "slow",
    [
        ["policies.main.engine.name=test_slow_hf"],  # the engine is the slower side
        ["reward.terms=[{name: test_slow_low_digit}]"],  # the trainer is
    ],
    ids=["slow_engine", "slow_trainer"],
)
def test_the_next_version_goes_ahead_at_its_publish(make_config, tmp_path, monkeypatch, slow):
    log = _events(make_config, tmp_path, monkeypatch, "run", *slow)
    ahead = [v for e, v in log if e == "ahead"]
    # k=1: batch b loads version b-2; batches 3..6 load 1..4, each sent ahead by batch b-1
    # (batch 6 is the last: nothing after it to send ahead for)
    assert ahead == [1, 2, 3, 4]
    loads = [v for e, v in log if e == "load"]
    assert loads == [1, 2, 3, 4]
    for v in ahead:
        sent = log.index(("ahead", v))
        assert log.index(("publish", v)) < sent  # never before it exists
        # and the next load after it is that version's
        assert next(x for e, x in log[sent:] if e == "load") == v
