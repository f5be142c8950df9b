"""A log-prob pass returns its own MoE routing (issue 39): ``routed_logprobs`` hands back
the pass's router terms and ``router_loss`` takes them, where the policy used to keep the
last pass's routing for the next ``router_loss`` call to pick up.

The reference is independent of core/train/moe.py's hooks and the packed layout: each row's
forward alone, unpadded, its routers swapped for ones told the record's experts
(tests/helpers/moe.py), the load-balancing loss and the mismatch share computed from
their logits by hand."""

from __future__ import annotations

import pytest
import torch

from polyrl.core.demo.tiny import tiny_qwen3_moe
from polyrl.core.record import Row, build_rows
from polyrl.core.rollout.engine import HFEngine, SamplingParams
from polyrl.core.train.algorithms import AggInfo
from polyrl.core.train.moe import MoeConfig, routers
from tests.helpers.moe import Routed
from tests.helpers.trainer import chat_ids, make_policy

E, K, LAYERS = 4, 2, 2  # the tiny model's experts, top-k, MoE layers
COEF = 0.5


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("models") / "tiny-moe"
    return str(tiny_qwen3_moe(path, num_experts=E, experts_per_token=K, num_layers=LAYERS))


def record(policy, seed: int, reroute: bool):
    """Engine samples as build_rows makes the record; with ``reroute`` every recorded token
    of the response sent to random experts (replay then routes them otherwise than the
    trainer's routers would)."""
    ids = chat_ids(policy.tokenizer)
    outs = HFEngine(policy, seed=seed).generate(ids, SamplingParams(n=2, max_new_tokens=6))
    batch = build_rows(
        [Row(o.prompt, o.tokens, "main", o.prompt_index) for o in outs],
        policy.tokenizer.pad_token_id,
    )
    if reroute:
        ex = batch["response_experts"]
        gen = torch.Generator().manual_seed(seed)
        rand = torch.rand((*ex.shape[:-1], E), generator=gen).topk(K, -1).indices
        batch["response_experts"] = torch.where(ex >= 0, rand.to(ex.dtype), ex)
    return batch


class Keeping(Routed):
    """:class:`Routed` that keeps its logits (with their graph) and the experts it used."""

    def forward(self, x: torch.Tensor):
        logits, scores, idx = super().forward(x)
        self.logits, self.used = logits, idx
        return logits, scores, idx


def by_hand(policy, batch) -> tuple[torch.Tensor, float]:
    """The load-balancing loss (per layer E * sum_e f_e P_e over every real token, averaged
    over layers; differentiable in the routers' weights) and the share of fully recorded
    response tokens whose own top-k differs from the record in some layer, from one told
    forward per row."""
    model = policy.model
    blocks = [m for m in model.modules() if getattr(m, "gate", None) in routers(model)]
    saved = [b.gate for b in blocks]
    logits: list[list[torch.Tensor]] = [[] for _ in blocks]
    used: list[list[torch.Tensor]] = [[] for _ in blocks]
    differs, counted = 0, 0
    try:
        for i in range(batch.batch_size[0]):
            pm, rm = batch["prompt_mask"][i].bool(), batch["response_mask"][i].bool()
            ids = torch.cat([batch["prompt_ids"][i][pm], batch["response_ids"][i][rm]])
            ex = torch.cat([batch["prompt_experts"][i][pm], batch["response_experts"][i][rm]])
            told = [Keeping(r, ex[:, layer]) for layer, r in enumerate(saved)]
            for b, t in zip(blocks, told, strict=True):
                b.gate = t
            model(input_ids=ids[None])
            for layer, t in enumerate(told):
                logits[layer].append(t.logits)
                used[layer].append(t.used)
            own = torch.stack([t.own for t in told], 1).sort(-1).values  # [N, L, k]
            rec = ex.long().sort(-1).values
            resp = torch.arange(len(ids)) >= int(pm.sum())
            full = resp & (ex >= 0).all(-1).all(-1)
            differs += int((own != rec).any(-1).any(-1)[full].sum())
            counted += int(full.sum())
    finally:
        for b, r in zip(blocks, saved, strict=True):
            b.gate = r
    per_layer = []
    for layer in range(len(blocks)):
        p = torch.softmax(torch.cat(logits[layer]).float(), -1).mean(0)
        f = torch.nn.functional.one_hot(torch.cat(used[layer]), E).sum((0, 1)).float()
        per_layer.append(E * (f / f.sum() * p).sum())
    return torch.stack(per_layer).mean(), differs / counted


def test_replayed_pass_returns_the_routing_its_loss_is_made_of(moe_dir, one_thread):
    """Routes the trainer would not choose, replayed in a packed pass: the returned terms
    give the load-balancing loss, its router gradients and the mismatch share of the
    told forward's routers."""
    policy = make_policy(
        moe_dir, moe=MoeConfig(replay="rollout", aux_loss_coef=COEF), shared_prefix=False
    )
    batch = record(policy, seed=0, reroute=True)
    routed = policy.routed_logprobs(batch)
    assert routed.router is not None and len(routed.router.steps) == 1  # one packed forward
    metrics: dict = {}
    tokens = int(batch["loss_mask"].sum())
    loss = policy.router_loss(routed.router, batch, AggInfo(batch_num_tokens=tokens), metrics)
    loss.backward()
    got_grads = [r.weight.grad.clone() for r in routers(policy.model)]
    policy.model.zero_grad()
    aux, mismatch = by_hand(policy, batch)
    assert mismatch > 0.2  # the rerouted tokens: replay did route them otherwise
    assert metrics["moe/route_mismatch"][0] == pytest.approx(mismatch)
    assert metrics["moe/aux_loss"][0] == pytest.approx(float(aux.detach()), rel=1e-5)
    assert float(loss.detach()) == pytest.approx(COEF * float(aux.detach()), rel=1e-5)
    (COEF * aux).backward()
    for got, r in zip(got_grads, routers(policy.model), strict=True):
        assert float(got.abs().max()) > 0
        torch.testing.assert_close(got, r.weight.grad, atol=1e-6, rtol=1e-4)


def test_a_pass_keeps_its_routing_whatever_runs_in_between(moe_dir, one_thread):
    """Passes over another batch between a pass and its router loss (an old-log-prob
    pass, another micro-batch) leave that pass's terms as they were: the loss
    and metrics equal those taken right after it."""
    policy = make_policy(moe_dir, moe=MoeConfig(replay="rollout", aux_loss_coef=COEF))
    a, b = record(policy, seed=0, reroute=True), record(policy, seed=1, reroute=False)

    def loss_of(routed, batch) -> tuple[float, dict]:
        metrics: dict = {}
        loss = policy.router_loss(routed.router, batch, AggInfo(), metrics)
        return float(loss.detach()), metrics

    alone = loss_of(policy.routed_logprobs(a), a)
    first = policy.routed_logprobs(a)
    other = policy.routed_logprobs(b)
    with torch.no_grad():
        policy.logprobs(b)  # an old-log-prob pass
    assert loss_of(first, a) == alone
    assert loss_of(other, b) != alone  # another batch's routing: another loss
