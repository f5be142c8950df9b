"""Mixture-of-experts policies: routing capture and replay, router metrics, the
load-balancing loss (issue 32, core/train/moe.py).

The references are independent of core/train/moe.py's hooks and layouts: routing recomputed
by hand from each router's weight and input, the model's routers swapped for modules that
route as told (a hand-built forward over the padded rows), transformers' own router
logits and load-balancing loss.
"""

from __future__ import annotations

import pytest
import torch

from polyrl.core.config import ConfigError, UserError
from polyrl.core.demo.tiny import tiny_qwen3_moe
from polyrl.core.record import Row, build_rows, concat
from polyrl.core.rollout.engine import HFEngine, SamplingParams
from polyrl.core.train.algorithms import AggInfo
from polyrl.core.train.moe import MoeConfig, Routing, routers
from polyrl.core.train.passes import prefix_units
from tests.helpers.trainer import chat_ids, make_policy

E, K, LAYERS = 4, 2, 2  # the tiny model's experts, top-k, MoE layers
EXPERT_KEYS = ("prompt_experts", "response_experts")


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("models") / "tiny-moe"
    return str(tiny_qwen3_moe(path, num_experts=E, experts_per_token=K, num_layers=LAYERS))


def _record(policy, seed: int = 0, n: int = 3, tokens: int = 6):
    """HF-engine samples of the test prompts, as build_rows makes the record."""
    ids = chat_ids(policy.tokenizer)
    outs = HFEngine(policy, seed=seed).generate(ids, SamplingParams(n=n, max_new_tokens=tokens))
    rows = [Row(o.prompt, o.tokens, "main", o.prompt_index) for o in outs]
    return build_rows(rows, policy.tokenizer.pad_token_id), outs, ids


def _hand_routing(model, ids: torch.Tensor) -> list[torch.Tensor]:
    """Each layer's top-k experts [N, k] of one unpadded forward, by hand: softmax of the
    router's input times its weight, top k."""
    inputs: list[torch.Tensor] = []
    handles = [
        r.register_forward_pre_hook(lambda m, args: inputs.append(args[0].detach()))
        for r in routers(model)
    ]
    with torch.no_grad():
        model(input_ids=ids)
    for h in handles:
        h.remove()
    out = []
    for router, x in zip(routers(model), inputs, strict=True):
        probs = torch.softmax(x.reshape(-1, x.shape[-1]) @ router.weight.T, -1)
        out.append(probs.topk(K, -1).indices)
    return out


class _Told(torch.nn.Module):
    """A router that routes token i to ``experts[i]`` (-1 rows: its own top k), with the
    original router's softmax weights at them: the hand-built replay."""

    def __init__(self, router, experts: torch.Tensor) -> None:
        super().__init__()
        self.router, self.experts = router, experts

    def forward(self, x):
        logits = x.reshape(-1, x.shape[-1]) @ self.router.weight.T
        probs = torch.softmax(logits.float(), -1)
        own = probs.topk(K, -1).indices
        idx = torch.where((self.experts >= 0).all(-1, keepdim=True), self.experts.long(), own)
        scores = probs.gather(-1, idx)
        scores = scores / scores.sum(-1, keepdim=True)  # the tiny model renormalises
        return logits, scores, idx


def _told_logprobs(policy, batch) -> torch.Tensor:
    """Response log-probs of the policy's model with its routers swapped for ones that route
    as the record says, from one unpadded forward per row (prompt then response); gradients
    reach the original routers' weights."""
    blocks = [m for m in policy.model.modules() if hasattr(m, "gate")]
    originals = [b.gate for b in blocks]
    out = torch.zeros(batch["response_mask"].shape)
    try:
        for i in range(batch.batch_size[0]):
            pm, rm = batch["prompt_mask"][i].bool(), batch["response_mask"][i].bool()
            ids = torch.cat([batch["prompt_ids"][i][pm], batch["response_ids"][i][rm]])[None]
            ex = torch.cat([batch["prompt_experts"][i][pm], batch["response_experts"][i][rm]])
            for layer, (block, router) in enumerate(zip(blocks, originals, strict=True)):
                block.gate = _Told(router, ex[:, layer])
            logits = policy.model(input_ids=ids).logits[0].float()
            p = int(pm.sum())
            logp = torch.log_softmax(logits[p - 1 : -1], -1)
            row = logp.gather(-1, ids[0, p:, None]).squeeze(-1)
            out = out.index_put((torch.tensor([i]), torch.arange(len(row))), row)
    finally:
        for block, router in zip(blocks, originals, strict=True):
            block.gate = router
    return out


def test_builder_makes_a_qwen3_moe_with_the_dense_models_tokenizer(moe_dir, tiny_model_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(moe_dir)
    assert type(model).__name__ == "Qwen3MoeForCausalLM"
    assert len(routers(model)) == LAYERS
    assert all((r.top_k, r.num_experts) == (K, E) for r in routers(model))
    moe_tok, dense_tok = (
        AutoTokenizer.from_pretrained(moe_dir),
        AutoTokenizer.from_pretrained(tiny_model_dir),
    )
    assert moe_tok.get_vocab() == dense_tok.get_vocab()


def test_engine_records_the_routing_computed_by_hand(moe_dir, one_thread):
    policy = make_policy(moe_dir)
    _, outs, ids = _record(policy, n=2)
    for o in outs:
        experts = (o.prompt + o.tokens).experts  # prompt then response
        prompt = ids[o.prompt_index]
        assert experts is not None and experts.dtype == torch.int8
        assert experts.shape == (len(prompt) + len(o.token_ids), LAYERS, K)
        hand = _hand_routing(policy.model, torch.tensor([prompt + o.token_ids]))
        fed = len(prompt) + len(o.token_ids) - 1  # the last token is never fed to the engine
        for layer in range(LAYERS):
            got = experts[:fed, layer].long().sort(-1).values
            assert torch.equal(got, hand[layer][:fed].sort(-1).values)
        assert bool((experts[fed:] == -1).all())


@pytest.mark.parametrize(
    "pack,shared", [(True, True), (True, False), (False, True), (False, False)]
)
def test_replayed_pass_equals_engine_and_free_pass(moe_dir, one_thread, pack, shared):
    """With the engine's own experts, replay changes nothing: the trainer's log-probs equal
    the engine's and the unreplayed pass's, and no token is counted as routed differently."""
    kw = dict(pack=pack, shared_prefix=shared, shared_prefix_min_tokens=4)
    replayed = make_policy(moe_dir, moe=MoeConfig(replay="rollout"), **kw)
    free = make_policy(moe_dir, **kw)
    batch, _, _ = _record(replayed)
    mask = batch["response_mask"].bool()
    with torch.no_grad():
        a = replayed.logprobs(batch)[0]
        b = free.logprobs(batch)[0]
    torch.testing.assert_close(a[mask], batch["rollout_logprobs"][mask], atol=1e-5, rtol=0)
    torch.testing.assert_close(a, b, atol=1e-6, rtol=0)
    routed = replayed.routed_logprobs(batch)
    metrics: dict = {}
    replayed.router_loss(routed.router, batch, AggInfo(), metrics)
    assert metrics["moe/route_mismatch"] == [0.0]
    assert metrics["moe/route_mismatch_prompt"] == [0.0]


def _rerouted(batch, seed: int = 0):
    """``batch`` with every recorded token sent to random experts, the same for a prompt's
    rows (as an engine prefills a prompt once; a pass that shares the prompt routes it once)."""
    out = batch.clone()
    gen = torch.Generator().manual_seed(seed)
    for key in ("prompt_experts", "response_experts"):
        ex = out[key]
        rand = torch.rand((*ex.shape[:-1], E), generator=gen).topk(K, -1).indices
        if key == "prompt_experts":
            rand = rand[batch["uid"]]  # the first rows' draws, one per prompt
        out[key] = torch.where(ex >= 0, rand.to(ex.dtype), ex)
    return out


@pytest.mark.parametrize("pack", [True, False])
def test_replay_follows_recorded_experts_like_a_hand_built_forward(moe_dir, one_thread, pack):
    """Recorded experts the trainer would not choose: the replayed pass (every layout: tree
    or packed, shared KV or padded) gives the log-probs, and the router gradients, of a
    forward whose routers are told the same experts."""
    policy = make_policy(
        moe_dir, moe=MoeConfig(replay="rollout"), pack=pack, shared_prefix_min_tokens=4
    )
    batch = _rerouted(_record(policy)[0])
    mask = batch["response_mask"].bool()
    got = policy.logprobs(batch)[0]
    got[mask].sum().backward()
    got_grads = [r.weight.grad.clone() for r in routers(policy.model)]
    want = _told_logprobs(policy, batch)
    torch.testing.assert_close(got.detach(), want.detach(), atol=1e-5, rtol=0)
    free = make_policy(moe_dir).logprobs(batch)[0].detach()
    assert float((free - want.detach())[mask].abs().max()) > 1e-3  # replay did change them
    policy.model.zero_grad()
    want[mask].sum().backward()
    for g, r in zip(got_grads, routers(policy.model), strict=True):
        assert float(g.abs().max()) > 0  # gradients reach every router under replay
        torch.testing.assert_close(g, r.weight.grad, atol=1e-5, rtol=1e-4)


def test_rows_with_equal_tokens_but_other_experts_share_no_prefix(moe_dir, one_thread):
    """Two rows of a group with the same response the engine routed differently (a noisy or
    nondeterministic engine): a tree pass that computed their common tokens once would give
    one row the other's experts. Under replay each row keeps its own experts (found as a
    2026-11-28 bug: the tree shared tokens by ids alone)."""
    policy = make_policy(
        moe_dir, moe=MoeConfig(replay="rollout"), pack=True, shared_prefix_min_tokens=4
    )
    batch, _, _ = _record(policy, n=3, tokens=6)
    twin = batch.clone()
    for key in ("response_ids", "response_mask", "rollout_logprobs", "loss_mask"):
        twin[key][1] = batch[key][0]  # row 1: row 0's response, rerouted below
    twin = _rerouted(twin, seed=1)
    assert torch.equal(twin["response_ids"][0], twin["response_ids"][1])
    assert not torch.equal(twin["response_experts"][0], twin["response_experts"][1])
    with torch.no_grad():
        got = policy.logprobs(twin)[0]
    torch.testing.assert_close(got, _told_logprobs(policy, twin).detach(), atol=1e-5, rtol=0)
    free = make_policy(moe_dir, pack=True, shared_prefix_min_tokens=4)  # no replay: shares
    assert any(u.shared for u in prefix_units(free.model, twin.exclude(*EXPERT_KEYS), 4))


def test_aux_loss_and_load_by_hand(moe_dir, one_thread):
    """Switch-style loss per layer, E * sum_e f_e P_e (f: share of the k*T assignments, P:
    mean router probability), averaged over layers; equal to transformers' loss for one
    layer divided by k (it sums the k slots). The micro-batch's weight is its share of the
    mini-batch's loss tokens."""
    from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

    coef = 0.3
    policy = make_policy(
        moe_dir, moe=MoeConfig(aux_loss_coef=coef), pack=False, shared_prefix=False
    )
    batch, _, _ = _record(policy)
    routed = policy.routed_logprobs(batch)
    metrics: dict = {}
    tokens = int(batch["loss_mask"].sum())
    agg = AggInfo(batch_num_tokens=2 * tokens)  # this micro-batch: half the mini-batch
    loss = policy.router_loss(routed.router, batch, agg, metrics)
    ids = torch.cat([batch["prompt_ids"], batch["response_ids"]], 1)
    mask = torch.cat([batch["prompt_mask"], batch["response_mask"]], 1)
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        out = policy.model(
            input_ids=ids, attention_mask=mask, position_ids=pos, output_router_logits=True
        )
    real = mask.reshape(-1).bool()
    per_layer, hf = [], []
    for layer, logits in enumerate(out.router_logits):
        probs = torch.softmax(logits[real].double(), -1)
        top = probs.topk(K, -1).indices
        f = torch.tensor([float((top == e).sum()) for e in range(E)]) / (K * len(top))
        per_layer.append(E * float((f.double() * probs.mean(0)).sum()))
        hf.append(float(load_balancing_loss_func((logits,), E, K, mask)) / K)
        assert metrics[f"moe/load_max/l{layer}"][0] == pytest.approx(E * float(f.max()))
        for e in range(E):
            assert metrics[f"moe/load/l{layer}/e{e}"][0] == pytest.approx(float(f[e]))
    aux = sum(per_layer) / LAYERS
    assert metrics["moe/aux_loss"][0] == pytest.approx(aux, rel=1e-5)
    assert aux == pytest.approx(sum(hf) / LAYERS, rel=1e-5)
    assert float(loss.detach()) == pytest.approx(coef * 0.5 * aux, rel=1e-5)
    loss.backward()  # the loss trains the routers
    assert all(float(r.weight.grad.abs().max()) > 0 for r in routers(policy.model))


def test_route_mismatch_counts_the_tokens_recorded_otherwise(moe_dir, one_thread):
    """Replay off: the share of recorded response (prompt) tokens whose own experts differ
    from the record's in some layer; here exactly the tokens changed by hand."""
    policy = make_policy(moe_dir, pack=False, shared_prefix=False)
    batch, _, _ = _record(policy)
    recorded = (batch["response_experts"] >= 0).all(-1).all(-1)
    where = recorded.nonzero()[::3]  # every third recorded response token
    changed = batch["response_experts"].clone()
    for i, t in where.tolist():  # layer 1 of that token: the experts it was not sent to
        own = set(changed[i, t, 1].tolist())
        changed[i, t, 1] = torch.tensor([e for e in range(E) if e not in own][:K])
    batch["response_experts"] = changed
    routed = policy.routed_logprobs(batch)
    metrics: dict = {}
    policy.router_loss(routed.router, batch, AggInfo(), metrics)
    assert metrics["moe/route_mismatch"][0] == pytest.approx(len(where) / int(recorded.sum()))
    assert metrics["moe/route_mismatch_prompt"][0] == 0.0


def test_record_columns_survive_concat_and_selection(moe_dir, one_thread):
    policy = make_policy(moe_dir)
    a, _, _ = _record(policy, seed=0, tokens=3)
    b, outs, ids = _record(policy, seed=1, tokens=7)
    both = concat([a, b])
    assert both["prompt_experts"].shape[1] == both["prompt_ids"].shape[1]
    assert both["response_experts"].shape[1] == both["response_ids"].shape[1]
    for i, o in enumerate(outs):  # b's rows: their own experts, then -1 padding
        row = both[a.batch_size[0] + i]
        pm, rm = row["prompt_mask"].bool(), row["response_mask"].bool()
        assert torch.equal(
            torch.cat([row["prompt_experts"][pm], row["response_experts"][rm]]),
            (o.prompt + o.tokens).experts,
        )
        assert bool((row["response_experts"][~rm] == -1).all())
        assert bool((row["prompt_experts"][~pm] == -1).all())


def test_replay_errors_name_the_policy_and_the_fix(moe_dir, tiny_model_dir):
    with pytest.raises(ConfigError, match=r"policies\.main\.moe.*not a mixture-of-experts"):
        make_policy(tiny_model_dir, moe=MoeConfig(replay="rollout"))
    with pytest.raises(ConfigError, match="gradient_checkpointing"):
        make_policy(moe_dir, moe=MoeConfig(replay="rollout"), gradient_checkpointing=True)
    policy = make_policy(moe_dir, moe=MoeConfig(replay="rollout"))
    batch, _, _ = _record(policy)
    del batch["prompt_experts"], batch["response_experts"]
    policy.logprobs(batch)  # rows no engine sampled (a warm start's) route freely
    batch["advantages"] = torch.zeros(batch["response_ids"].shape)  # a rollout record
    with pytest.raises(UserError, match=r"policies\.main\.moe\.replay.*no prompt_experts"):
        policy.logprobs(batch)


def test_routing_hooks_are_gone_after_each_call(moe_dir):
    """Engine calls and trainer passes leave no hook on the routers (they share the module
    in local mode), even when a replay pass fails."""
    policy = make_policy(moe_dir, moe=MoeConfig(replay="rollout"))
    batch, _, _ = _record(policy)
    assert all(not r._forward_hooks for r in routers(policy.model))
    policy.logprobs(batch)
    assert all(not r._forward_hooks for r in routers(policy.model))
    bad = batch.clone()
    bad["response_experts"] = bad["response_experts"][:, :-1]  # one token short
    with pytest.raises(ValueError, match="response_experts is"):
        policy.logprobs(bad)
    assert all(not r._forward_hooks for r in routers(policy.model))
    with Routing(policy.model) as routing:
        assert all(len(r._forward_hooks) == 1 for r in routers(policy.model))
        assert routing.num_layers == LAYERS


# --- learning ---------------------------------------------------------------------------

MOE_DEMO = {  # the dense demo's widths; 4 experts of half its MLP width, 2 per token
    "corpus": "arithmetic",
    "hidden_size": 128,
    "num_layers": 2,
    "num_heads": 2,
    "head_dim": 64,
    "num_experts": 4,
    "experts_per_token": 2,
    "moe_intermediate_size": 128,
    "seed": 0,
}


@pytest.mark.slow
def test_grpo_with_replay_reports_the_router_metrics_every_step(tmp_path, one_thread):
    """The README demo (SFT warm start, then GRPO on arithmetic) on the tiny Qwen3-MoE with
    routing replay on, for a few steps: the router metrics are reported every step, and the
    HF engine's recorded routes are the trainer's. That the demo learns with replay is
    test_moe_replay_learning.py's (under an engine that routes differently)."""
    import yaml

    from polyrl.core.config import load
    from polyrl.core.loop import train
    from polyrl.core.recipe import Config
    from tests.helpers.runs import ARITHMETIC_RECIPE, metrics

    recipe = yaml.safe_load(ARITHMETIC_RECIPE.read_text())
    recipe["policies"]["main"] |= {
        "model": str(tmp_path / "tiny-moe"),
        "build": "tiny_qwen3_moe",
        "build_args": MOE_DEMO,
        "moe": {"replay": "rollout"},
    }
    path = tmp_path / "moe.yaml"
    path.write_text(yaml.safe_dump(recipe))
    quiet = ["run.progress=false", "run.tensorboard=false", "run.save_every=0", "run.export=false"]
    cfg = load(
        Config,
        path,
        ["seed=0", f"run.dir={tmp_path}/run", "train.steps=4", "eval.every=0", "sft.steps=10"]
        + quiet,
    )
    train(cfg)
    rows = metrics(tmp_path / "run")
    steps = [r for r in rows if "reward/mean" in r]
    assert len(steps) == 4
    assert all(r["main/moe/route_mismatch"] == 0.0 for r in steps)  # the HF engine: exact
    assert all(r["main/mismatch/logp_abs_max"] < 1e-4 for r in steps)
    assert all(1.0 <= r["main/moe/load_max/l0"] <= E / K for r in steps)
