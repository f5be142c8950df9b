"""Partial rollouts (``rollout.partial``): newer weights taken between decoding steps, the
version of every token recorded, and the staleness bound kept."""

from __future__ import annotations

import pytest
import torch

from polyrl.core.config import ConfigError
from polyrl.core.record import Row, build_rows, concat, trim
from polyrl.core.registry import ENGINES
from polyrl.core.rollout.engine import HFEngine, SamplingParams
from polyrl.core.rollout.rollouts import shadow
from polyrl.core.segment import Tokens
from polyrl.core.train.policy import CausalLMPolicy, PolicyConfig
from tests.helpers.crawling_engine import CrawlingEngine
from tests.helpers.partial import SWITCH, mixed_logprobs, moved, switching_refresh
from tests.helpers.runs import metrics_by_step
from tests.helpers.trainer import TEXTS, chat_ids


@pytest.fixture(scope="module")
def policy(tiny_model_dir):
    return CausalLMPolicy(
        "main", PolicyConfig(model=tiny_model_dir), total_steps=1, need_reference=False
    )


def test_hf_engine_takes_new_weights_mid_call_and_records_each_tokens_version(policy):
    twin = shadow(policy)
    old = {k: v.clone() for k, v in twin.model.state_dict().items()}
    new = moved(old, 0.05, seed=1)
    ids = chat_ids(policy.tokenizer, TEXTS[:3])
    params = SamplingParams(n=2, temperature=1.0, max_new_tokens=8)
    engine = HFEngine(twin, seed=3)
    start = engine.state_dict()
    plain = engine.generate(ids, params)
    assert all(o.tokens.versions is None for o in plain)  # no refresh: no versions

    engine.load_state_dict(start)
    calls: list[int] = []
    engine.set_refresh(switching_refresh(twin.model, new, calls))
    outs = engine.generate(ids, params)
    engine.set_refresh(None)
    assert any(len(o.token_ids) > SWITCH for o in outs)
    for o, p in zip(outs, plain, strict=True):
        n = len(o.token_ids)
        assert o.tokens.versions == [0] * min(n, SWITCH) + [1] * max(0, n - SWITCH)
        # before the switch the same RNG and weights draw the same tokens
        assert o.token_ids[:SWITCH] == p.token_ids[:SWITCH]
        assert o.logprobs[:SWITCH] == p.logprobs[:SWITCH]

    ref_model = shadow(policy).model
    gaps, shifts = [], []
    for o in outs:
        mixed = mixed_logprobs(
            ref_model, {0: old, 1: new}, ids[o.prompt_index], o.token_ids, o.tokens.versions
        )
        gaps.append((mixed - torch.tensor(o.logprobs)).abs().max())
        if len(o.token_ids) > SWITCH:  # what the old weights alone would have given
            stale = mixed_logprobs(
                ref_model, {0: old}, ids[o.prompt_index], o.token_ids, [0] * len(o.token_ids)
            )
            shifts.append((stale - mixed)[SWITCH:].abs().max())
    print(f"|engine - reference| max {max(gaps):.2e}; new vs old weights {max(shifts):.3f}")
    assert max(gaps) < 1e-4  # tokens after the switch: new weights over the old KV cache
    assert max(shifts) > 1e-2  # ... and the new weights did change them


def test_token_versions_survive_record_padding_trim_and_concat():
    def rec(responses, versions):
        rows = [
            Row(Tokens.given([1, 2]), Tokens.sampled(r, [0.0] * len(r), versions=v), "main", i)
            for i, (r, v) in enumerate(zip(responses, versions, strict=True))
        ]
        return build_rows(rows, pad_id=0)

    a = rec([[5, 6, 7], [5]], [[0, 0, 1], [1]])
    assert a["token_version"].tolist() == [[0, 0, 1], [1, -1, -1]]
    b = rec([[5, 6, 7, 8, 9]], [[2, 2, 2, 3, 3]])
    both = concat([a, b])
    assert both["token_version"].tolist() == [
        [0, 0, 1, -1, -1],
        [1, -1, -1, -1, -1],
        [2, 2, 2, 3, 3],
    ]
    assert trim(both[:2])["token_version"].tolist() == [[0, 0, 1], [1, -1, -1]]
    assert "token_version" not in rec([[5]], [None]).keys()  # noqa: SIM118 (TensorDict)
    with pytest.raises(ValueError, match="versions has 1 entries for 2 ids"):
        rec([[5, 6]], [[0]])


ENGINES.register("test_crawling_hf", CrawlingEngine)


def test_partial_rollouts_mix_versions_within_the_bound(make_config, tmp_path):
    from polyrl.core.loop import train

    cfg = make_config(
        f"run.dir={tmp_path}/partial",
        "train.steps=4",
        "rollout.prompts_per_step=4",
        "rollout.max_staleness=1",
        "rollout.partial=true",
        "policies.main.engine.name=test_crawling_hf",
    )
    m = metrics_by_step(train(cfg).path)
    for step in range(1, 5):
        assert m[step]["async/staleness_max"] <= 1
        assert m[step]["async/dropped_groups"] == 0
    # batches 2.. start on an older version and take the newer one mid-call
    assert all(m[s]["async/mixed_version_rows"] > 0 for s in range(2, 5))
    assert m[1]["async/mixed_version_rows"] == 0  # nothing is published before update 1


def test_partial_needs_a_producer_ahead(make_config):
    """Any workflow records token versions (its rows are built from the engines' token
    segments); what rollout.partial still needs is a producer ahead of the trainer."""
    with pytest.raises(ConfigError, match="max_staleness >= 1"):
        make_config("rollout.partial=true", "rollout.max_staleness=0").validate()
