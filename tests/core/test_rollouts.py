"""Async rollouts (rollout.max_staleness): the staleness bound and a schedule that does
not depend on which side is slower."""

from __future__ import annotations

import pytest

from tests.helpers.rollouts import LOW_DIGIT  # registers test_slow_hf, test_slow_low_digit
from tests.helpers.runs import metrics_by_step


def _run(make_config, tmp_path, name, *overrides):
    from polyrl.core.loop import train

    cfg = make_config(
        f"run.dir={tmp_path}/{name}",
        "train.steps=5",
        "rollout.prompts_per_step=4",
        "eval.every=2",
        "eval.temperature=1.0",
        "algorithm.minibatches=2",
        f"reward.terms=[{LOW_DIGIT}]",
        *overrides,
    )
    return metrics_by_step(train(cfg).path)


@pytest.mark.parametrize("k", [1, 2])
def test_staleness_is_bounded_and_the_same_whichever_side_is_slow(make_config, tmp_path, k):
    plain = _run(make_config, tmp_path, "plain", f"rollout.max_staleness={k}")
    slow_engine = _run(
        make_config,
        tmp_path,
        "slow_engine",
        f"rollout.max_staleness={k}",
        "policies.main.engine.name=test_slow_hf",
    )
    for step in range(1, 6):
        m = plain[step]
        age = min(step - 1, k)  # batch s is made with the weights after update s-1-k
        assert m["async/staleness_max"] == m["async/staleness_mean"] == age
        assert m[f"async/staleness_{age}"] == m["rollout/rows"]
        assert m["async/dropped_groups"] == 0
        assert m["main/mismatch/rho_max"] > 0  # the mismatch is measured every step
    # the engine four times slower than the trainer: the same batches, the same update
    for step in plain:
        assert slow_engine[step] == plain[step], f"step {step} differs with a slow engine"


def test_slow_trainer_changes_nothing_and_k0_is_the_synchronous_loop(make_config, tmp_path):
    fast = _run(make_config, tmp_path, "fast", "rollout.max_staleness=1")
    slow = _run(
        make_config,
        tmp_path,
        "slow",
        "rollout.max_staleness=1",
        "reward.terms=[{name: test_slow_low_digit}]",
    )
    for step in fast:  # reward term names differ; every other metric is equal
        same = {k: v for k, v in fast[step].items() if "regex_format" not in k}
        other = {k: v for k, v in slow[step].items() if "test_slow_low_digit" not in k}
        assert same == other, f"step {step} differs with a slow trainer"
    sync = _run(make_config, tmp_path, "sync")
    assert not any(k.startswith("async/") for k in sync[2])
    assert sync[1]["rollout/response_len"] == fast[1]["rollout/response_len"]  # same batch 1
    assert sync[2] != fast[2]  # batch 2: made with the weights of step 1 vs of step 0
