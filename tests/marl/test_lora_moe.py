"""``lora_agent`` on a mixture-of-experts base honours the ``moe`` options (routing replay,
load-balancing loss, router metrics) whatever ``args.batch_update`` says, and refuses them on
a dense base. Replay is checked against tests/helpers/moe.py's forwards with told routing."""

from __future__ import annotations

import pytest
import torch

from polyrl.core.config import ConfigError
from polyrl.core.demo.tiny import tiny_qwen3_moe
from polyrl.core.record import strings
from polyrl.core.rollout.engine import HFEngine, SamplingParams
from polyrl.marl.signaling import make_row
from tests.helpers.lora import NAMES, lora_pair
from tests.helpers.moe import check_replayed_rows
from tests.helpers.runs import metrics_by_step

E = 4


@pytest.fixture(scope="module")
def moe_base(tmp_path_factory) -> str:
    out = tmp_path_factory.mktemp("moe") / "moe"
    return str(tiny_qwen3_moe(out, corpus="signaling", num_experts=E, num_layers=2))


def test_adapters_replay_the_engines_experts(marl_config, make_items, moe_base, one_thread):
    from polyrl.core.registry import WORKFLOWS
    from polyrl.core.rollout.workflow import Context

    cfg, pols = lora_pair(
        marl_config,
        *(f"policies.{n}.{k}" for n in NAMES for k in (f"model={moe_base}", "moe.replay=rollout")),
        "rollout.workflow=parallel",
        "rollout.args={agents: [{name: a, policy: speaker}, {name: b, policy: listener}]}",
    )
    assert all(p.update_group() is None and p.row_group() is None for p in pols.values())
    engines = {n: HFEngine(p, seed=i) for i, (n, p) in enumerate(pols.items())}
    wf = WORKFLOWS.get(cfg.rollout.workflow)(Context(cfg, pols, engines), **cfg.rollout.args)
    rows = [make_row("apple", ["cat", "apple"], "QXZJ"), make_row("dog", ["dog"], "QXZJ")]
    params = SamplingParams(n=2, temperature=1.0, max_new_tokens=3, stop_token_ids=[])
    rec = wf.rollout(make_items(rows), params)
    owner = strings(rec, "policy")
    for n in NAMES:  # each adapter's rows, through its own (perturbed) adapter
        idx = [i for i, p in enumerate(owner) if p == n]
        assert len(idx) == 4
        check_replayed_rows(pols[n], rec[idx], E)


def test_moe_options_reach_the_default_batched_update(marl_config, moe_base):
    """The default ``batch_update: true`` crashed in multi_lora on an MoE base; such a
    policy now updates alone (``update_group() is None``, as with ``false``: one path)."""
    from polyrl.core.loop import train

    cfg = marl_config(
        *(
            f"policies.{n}.{k}"
            for n in NAMES
            for k in (
                "kind=lora_agent",
                "lora.r=4",
                f"model={moe_base}",
                "moe.replay=rollout",
                "moe.aux_loss_coef=0.01",
            )
        ),
        "train.steps=1",
        "eval.every=0",
    )
    last = metrics_by_step(train(cfg).path)[1]
    for n in NAMES:  # router metrics from the policy's own replayed passes
        assert 0.5 < last[f"{n}/moe/aux_loss"] < E + 0.5
        assert last[f"{n}/moe/route_mismatch"] == 0.0  # replayed: the engine's experts
        assert torch.isfinite(torch.tensor(last[f"{n}/loss"]))


def test_moe_options_on_a_dense_base_are_refused(marl_config):
    with pytest.raises(ConfigError, match=r"policies\.speaker\.moe .*no top-k router"):
        lora_pair(marl_config, "policies.speaker.moe.aux_loss_coef=0.01")
