"""Several ``lora_agent`` adapters in one forward/backward (marl/multi_lora.py) and the
batched update built on it (core/train/trainer.py ``update_together``), against the per-adapter
passes and the one-by-one update as they run today."""

from __future__ import annotations

import pytest
import torch

from polyrl.core.record import concat, text_record
from polyrl.core.train.passes import response_logprobs
from polyrl.marl.multi_lora import _Grouping, _StackedTerms, adapter_rows
from tests.helpers.runs import wall_clock

NAMES = ("a0", "a1", "a2")


def make_agents(marl_config, names=NAMES, *overrides):
    """Lora_agent policies on one base, each adapter's B drawn at random (so adapters
    differ from the base and each other)."""
    from polyrl.core.registry import POLICIES

    model = marl_config().policies["speaker"].model
    sets = []
    for n in names:
        sets += [f"policies.{n}.model={model}", f"policies.{n}.kind=lora_agent"]
        sets += [f"policies.{n}.lora.r=4"]
    cfg = marl_config(*sets, *overrides)
    shared: dict = {}
    torch.manual_seed(0)  # PEFT draws lora_A from the global generator
    gen = torch.Generator().manual_seed(0)
    pols = {}
    for n in names:
        p = POLICIES.get("lora_agent")(
            n, cfg.policies[n], total_steps=4, need_reference=False, shared=shared
        )
        with torch.no_grad():
            for k, w in p._own.items():
                if ".lora_B." in k:
                    w.copy_(torch.randn(w.shape, generator=gen) * 0.05)
        pols[n] = p
    return cfg, pols


def rows(policy: str, prompts: list[list[int]], responses: list[list[int]]):
    return text_record(
        prompt_ids=prompts,
        response_ids=responses,
        rollout_logprobs=[[0.0] * len(r) for r in responses],
        policy=[policy] * len(prompts),
        uid=list(range(len(prompts))),
        pad_id=0,
    )


def batches():
    """Per-adapter rows: groups sharing long prompts (>= 16 tokens: packed passes share them
    as trees), a prompt also used by the other adapters, uneven lengths."""
    common = list(range(20, 40))
    out = []
    for k, _ in enumerate(NAMES):
        own = list(range(50 + 7 * k, 70 + 7 * k))
        prompts = [common, common, own, own, [5 + k, 6, 7]]
        responses = [[8, 9, 10], [8, 11], [9 + k] * (2 + k), [12, 13, 14, 15], [16]]
        out.append(rows(NAMES[k], prompts, responses))
    return out


def grads_of(pols):
    return {
        n: {k: w.grad.detach().clone() for k, w in p._own.items() if w.grad is not None}
        for n, p in pols.items()
    }


def zero(pols):
    for p in pols.values():
        for w in p._own.values():
            w.grad = None


@pytest.mark.parametrize(
    "layout",
    ["padded", "packed", "tree", "padded, rows mixed", "packed, rows mixed", "tree, rows mixed"],
)
def test_routed_forward_equals_each_adapters_own(marl_config, layout):
    """Log-probs and each adapter's gradient from one routed pass over every adapter's rows
    equal the per-adapter passes, in the three layouts: padded (prompts shared through a
    KV cache), packed, and packed trees of shared prefixes (the long prompts); with the
    batch's rows in adapter order and mixed. The rows' adapters travel once (the router's
    rows): the packed layouts group each adapter's tokens (no gather in the layers) and a
    padded pass over mixed rows gathers them. A prompt used by every adapter must not be
    shared across them."""
    pack = not layout.startswith("padded")
    opts = {"pack": pack, "min_shared": 10**6 if layout.startswith("packed") else 16}
    _, pols = make_agents(marl_config)
    peft = pols["a0"]._peft
    parts = batches()
    weights = [
        torch.randn(b["response_ids"].shape, generator=torch.Generator().manual_seed(i))
        for i, b in enumerate(parts)
    ]
    peft.train(True)
    # today's passes: one adapter at a time
    want = []
    for p, b, w in zip(pols.values(), parts, weights, strict=True):
        lp = response_logprobs(p.model, b, **opts)[0]
        (lp * w).sum().backward()
        want.append(lp.detach())
    want_grads = grads_of(pols)
    zero(pols)
    # one pass over the union, each row through its own adapter
    union = concat(parts)
    ids = torch.cat([torch.full((b.batch_size[0],), k) for k, b in enumerate(parts)])
    mixed = layout.endswith("rows mixed")
    order = torch.randperm(len(ids), generator=torch.Generator().manual_seed(1))
    if not mixed:
        order = torch.arange(len(ids))
    with adapter_rows(peft, list(NAMES), trainable=NAMES) as router:
        router.set_rows(ids[order])
        lp = response_logprobs(peft, union[order], **opts, owners=router)[0]
        last = next(iter(router._groups.values()))  # the last forward's tokens
        assert (last.order is None) == (pack or not mixed)  # grouped by adapter
    lp = torch.empty_like(lp).index_copy_(0, order, lp)
    (lp * torch.cat(weights)).sum().backward()
    got_grads = grads_of(pols)
    peft.train(False)
    for k, part in enumerate(lp.detach().split([b.batch_size[0] for b in parts])):
        width = want[k].shape[1]
        assert torch.allclose(part[:, :width], want[k], atol=1e-5), k
        assert not part[:, width:].any()
    for n in NAMES:
        assert want_grads[n].keys() == got_grads[n].keys() and want_grads[n]
        for key, g in want_grads[n].items():
            assert torch.allclose(got_grads[n][key], g, atol=1e-5, rtol=1e-4), key


def terms_case(owner, bias, dt, absent=True):
    """A layer (Linear with or without bias, in ``dt``) and three float32 adapters (rank 3,
    scalings 0.5 / 0 / 2): adapter 0 trained, 1 absent from the layer (``absent``; else
    trained), 2 frozen; the input ``x`` (from a leaf ``emb``) and a probe for the loss."""
    gen = torch.Generator().manual_seed(0)
    d_in, d_out, r = 6, 5, 3
    base = torch.nn.Linear(d_in, d_out, bias=bias).to(dt).requires_grad_(False)
    a = [torch.randn(r, d_in, generator=gen) for _ in range(3)]
    b = [torch.randn(d_out, r, generator=gen) for _ in range(3)]
    for k in (0,) if absent else (0, 1):
        a[k].requires_grad_(), b[k].requires_grad_()
    emb = torch.randn(2, len(owner) // 2, d_in, generator=gen).to(dt).requires_grad_()
    probe = torch.randn(2, len(owner) // 2, d_out, generator=gen).to(dt)
    return base, a, b, emb, probe, [0.5, 0.0 if absent else 1.5, 2.0]


def terms_reference(base, a, b, emb, probe, scales, owner, absent):
    """Every adapter's term for every token, picked by owner, added as PEFT adds it (in the
    adapters' float32, then cast): output and gradients of emb and the trained A, B."""
    x = emb * 1.5
    flat = x.reshape(-1, x.shape[-1]).float()
    every = torch.stack([(flat @ a[k].t() @ b[k].t()) * scales[k] for k in range(3)])
    if absent:
        every[1] = 0
    picked = every[owner, torch.arange(len(owner))].view(*x.shape[:-1], -1)
    want = (base(x).float() + picked).to(x.dtype)
    trained = [w for w in (*a, *b) if w.requires_grad]
    return want, torch.autograd.grad((want * probe).sum(), [emb, *trained])


@pytest.mark.parametrize("grouped", [True, False])
@pytest.mark.parametrize(
    ("bias", "base_dtype"), [(True, "float32"), (False, "float32"), (True, "bfloat16")]
)
def test_in_place_terms_match_a_plain_autograd_sum(grouped, bias, base_dtype):
    """_StackedTerms (each adapter's LoRA term written into the base output in place, its
    backward by hand) against the terms of every adapter for every token, picked by owner,
    through autograd: output, input gradient and each trained adapter's A and B gradients.
    Three adapters: one without LoRA on this layer (its tokens pass unchanged), one frozen
    (no gradient), the trained one of a lower rank (zero-padded in the stack). A Linear with bias over
    3-D input returns a view (the in-place bookkeeping case); tokens interleaved or grouped
    by adapter; a bfloat16 base with float32 adapters (PEFT's autocast) summed as PEFT
    does: in float32, then cast."""
    dt = getattr(torch, base_dtype)
    owner = torch.tensor([0, 2, 1, 0, 2, 2, 0, 1, 0, 2, 1, 0])
    if grouped:
        owner = owner.sort().values
    base, a, b, emb, probe, scales = terms_case(owner, bias, dt)
    a[0] = a[0][:2].detach().requires_grad_()  # the trained adapter: rank 2 of 3
    b[0] = b[0][:, :2].detach().requires_grad_()
    slots = _Grouping(owner, 3).slots((0, 2), torch.device("cpu"))
    x = emb * 1.5
    got = _StackedTerms.apply(base(x), x, slots, torch.tensor([0.5, 2.0]), a[0], b[0], a[2], b[2])
    got_grads = torch.autograd.grad((got * probe).sum(), [emb, a[0], b[0]])
    want, want_grads = terms_reference(base, a, b, emb, probe, scales, owner, True)
    tol = {"atol": 1e-5} if dt == torch.float32 else {"atol": 0.05, "rtol": 0.02}
    assert got.dtype == dt and torch.allclose(got, want, **tol)
    for g, w in zip(got_grads, want_grads, strict=True):
        assert g.dtype == w.dtype and torch.allclose(g, w, **tol)
    assert torch.equal(got.view(-1, 5)[owner == 1], base(x).view(-1, 5)[owner == 1])


@pytest.mark.parametrize(
    ("layout", "base_dtype"),
    [("interleaved", "float32"), ("grouped", "float32"), ("even", "float32"), ("even", "bfloat16")],
)
def test_stacked_terms_match_a_plain_autograd_sum(layout, base_dtype):
    """_StackedTerms (adapters of one rank: each product one bmm over all adapters) against
    the same autograd sum: tokens interleaved, grouped with uneven counts (zero-padded
    stacks; an adapter absent from the layer left out), and grouped with even counts and
    every adapter present (the stack is a view of the tokens, nothing copied)."""
    dt = getattr(torch, base_dtype)
    absent = layout != "even"
    owner = torch.tensor([0, 2, 1, 0, 2, 2, 0, 1, 0, 2, 1, 0])
    if layout == "even":
        owner = torch.arange(3).repeat_interleave(4)
    elif layout == "grouped":
        owner = owner.sort().values
    base, a, b, emb, probe, scales = terms_case(owner, True, dt, absent)
    present = (0, 2) if absent else (0, 1, 2)
    grouping = _Grouping(owner, 3)
    assert (grouping.order is None) == (layout != "interleaved")
    slots = grouping.slots(present, torch.device("cpu"))
    assert slots[-1] == (layout == "even")  # a view only when grouped and even
    x = emb * 1.5
    pairs = [w for k in present for w in (a[k], b[k])]
    rates = torch.tensor([scales[k] for k in present])
    got = _StackedTerms.apply(base(x), x, slots, rates, *pairs)
    trained = [w for w in (*a, *b) if w.requires_grad]
    got_grads = torch.autograd.grad((got * probe).sum(), [emb, *trained])
    want, want_grads = terms_reference(base, a, b, emb, probe, scales, owner, absent)
    tol = {"atol": 1e-5} if dt == torch.float32 else {"atol": 0.05, "rtol": 0.02}
    assert got.dtype == dt and torch.allclose(got, want, **tol)
    for g, w in zip(got_grads, want_grads, strict=True):
        assert g.dtype == w.dtype and torch.allclose(g, w, **tol)


def test_per_row_ids_route_a_plain_forward(marl_config):
    """Per-row adapters (a generation's prefill or decode step): row i runs through the
    adapter set for it, as the same rows through that adapter alone."""
    _, pols = make_agents(marl_config)
    peft = pols["a0"]._peft
    ids = torch.tensor([[5, 6, 7, 8], [0, 9, 10, 11], [12, 13, 14, 15], [0, 0, 6, 7]])
    mask = (ids != 0).long()
    owner = [2, 0, 1, 2]
    with torch.no_grad():
        want = torch.stack(
            [
                pols[NAMES[k]]
                .model(input_ids=ids[i : i + 1], attention_mask=mask[i : i + 1])
                .logits[0]
                for i, k in enumerate(owner)
            ]
        )
        with adapter_rows(peft, list(NAMES)) as router:
            router.set_rows(owner)
            got = peft(input_ids=ids, attention_mask=mask).logits
            with pytest.raises(ValueError, match="per-row adapter ids"):
                peft(input_ids=ids[:2], attention_mask=mask[:2])
    keep = mask.bool()
    assert torch.allclose(got[keep], want[keep], atol=1e-5)


def with_advantages(parts):
    """Each adapter's rows with uneven advantages (some zero) and a rollout log-prob."""
    out = []
    for k, b in enumerate(parts):
        g = torch.Generator().manual_seed(10 + k)
        b = b.clone()
        b["advantages"] = torch.randn(b["response_ids"].shape, generator=g)
        b["advantages"][0] = 0.0
        b["rollout_logprobs"] = -torch.rand(b["response_ids"].shape, generator=g) * 3
        out.append(b)
    return out


# per agent: learning rate, clipping (0: none), micro-batch rows, packed token budget
AGENT_OPTS = [("1e-2", "0.05", 2, 40), ("3e-3", "0", 3, 60), ("5e-2", "1.0", 5, 1000)]


def agents_with_own_optim(marl_config, pack, *extra):
    overrides = [f"policies.{n}.pack={str(pack).lower()}" for n in NAMES]
    for n, (lr, clip, rows_, tokens) in zip(NAMES, AGENT_OPTS, strict=True):
        overrides += [
            f"policies.{n}.optim.lr={lr}",
            f"policies.{n}.optim.max_grad_norm={clip}",
            f"policies.{n}.micro_batch_size={rows_}",
            # Adam's first step is g / (|g| + eps): with the default eps a gradient of
            # rounding size (1e-9) moves a weight by lr. A larger eps keeps the step a
            # smooth function of the gradient, so weights compare at 1e-5 too
            f"policies.{n}.optim.eps=0.1",
        ]
        overrides += [f"policies.{n}.max_tokens_per_micro_batch={tokens}"] if pack else []
    return make_agents(marl_config, NAMES, *overrides, *extra)


def record_grads(pols) -> dict[str, list[dict[str, torch.Tensor]]]:
    """Each optimizer step's gradients (after clipping), per policy, via step pre-hooks."""
    seen: dict[str, list] = {n: [] for n in pols}
    for n, p in pols.items():
        own = {id(w): k for k, w in p._own.items()}

        def hook(opt, args, kwargs, n=n, own=own):
            seen[n].append(
                {own[id(w)]: w.grad.clone() for g in opt.param_groups for w in g["params"]}
            )

        p.optimizer.register_step_pre_hook(hook)
    return seen


def run_both(marl_config, pack, algo_kw, seed=0):
    """The one-by-one updates and the batched one from equal starts: (metrics, grads,
    weights after) of each."""
    from polyrl.core.train.algorithms import AlgorithmConfig
    from polyrl.core.train.trainer import update, update_together

    algo = AlgorithmConfig(**algo_kw)
    parts = with_advantages(batches())
    out = []
    for together in (False, True):
        _, pols = agents_with_own_optim(marl_config, pack)
        assert len({p.update_group() for p in pols.values()}) == 1
        grads = record_grads(pols)
        gen = torch.Generator().manual_seed(seed)
        ps = list(pols.values())
        if together:
            metrics = update_together(ps, parts, algo, generator=gen)
        else:
            metrics = [update(p, b, algo, generator=gen) for p, b in zip(ps, parts, strict=True)]
        out.append((metrics, grads, {n: p.trainable_state() for n, p in pols.items()}))
    return out


def assert_same(one, batched):
    (m1, g1, w1), (m2, g2, w2) = one, batched
    for a, b in zip(m1, m2, strict=True):
        assert a.keys() == b.keys()
        for key in a:
            assert abs(a[key] - b[key]) <= 1e-5 * max(1.0, abs(a[key])), key
    for n in NAMES:
        assert len(g1[n]) == len(g2[n]) >= 1
        for s1, s2 in zip(g1[n], g2[n], strict=True):
            assert any(bool(g.abs().sum() > 0) for g in s1.values())
            for key, g in s1.items():
                assert torch.allclose(s2[key], g, atol=1e-5, rtol=1e-4), (n, key)
        for key, w in w1[n].items():
            assert torch.allclose(w2[n][key], w, atol=1e-5), (n, key)


@pytest.mark.parametrize("pack", [False, True])
def test_batched_update_equals_one_by_one(marl_config, pack):
    """Three adapters with their own learning rate, clipping (one clipped hard, one not at
    all) and micro-batches: one batched update takes each adapter's gradient, step and
    metrics of its own update."""
    one, batched = run_both(marl_config, pack, {})
    assert_same(one, batched)
    clipped = one[0][0]["grad_norm"]  # the first agent's norm lies above its 0.05 clip
    assert clipped > 0.05


def test_batched_update_keeps_each_partition(marl_config, monkeypatch):
    """Two mini-batches and two epochs (old log-probs recomputed; each policy's shuffles
    drawn from the shared generator in the one-by-one order, not epoch by epoch) and a KL
    term: each policy's mini-batches are those of its own update. The batched update takes
    the old and reference log-probs from shared passes too: no per-policy pass."""
    from polyrl.core.train import trainer
    from polyrl.marl.lora import LoraAgentPolicy

    calls: list[str] = []
    for name in ("logprobs", "ref_logprobs"):
        real = getattr(LoraAgentPolicy, name)

        def counted(self, *a, _real=real, _name=name, **k):
            calls.append(_name)
            return _real(self, *a, **k)

        monkeypatch.setattr(LoraAgentPolicy, name, counted)
    inside: list[str] = []
    real_together = trainer.update_together

    def together(*a, **k):
        start = len(calls)
        out = real_together(*a, **k)
        inside.extend(calls[start:])
        return out

    monkeypatch.setattr(trainer, "update_together", together)
    kw = {"minibatches": 2, "ppo_epochs": 2, "kl_coef": 0.1}
    one, batched = run_both(marl_config, True, kw, seed=3)
    assert_same(one, batched)
    assert {"logprobs", "ref_logprobs"} <= set(calls) and inside == []


def test_team_run_logs_the_same_batched_and_one_by_one(marl_config, tmp_path, monkeypatch):
    """The signaling team as two lora_agent policies on one base, 2 steps: every logged
    metric (rewards, losses, grad norms, eval) equals the run with args.batch_update off,
    and the batched run did update both in one call per step."""
    import json

    from polyrl.core import loop
    from polyrl.core.train import trainer

    calls = []
    real = trainer.update_together
    monkeypatch.setattr(
        trainer, "update_together", lambda ps, *a, **k: calls.append(len(ps)) or real(ps, *a, **k)
    )

    def timing(key: str) -> bool:
        return wall_clock(key) or key.endswith("_s")

    logs = []
    for batch_update in ("true", "false"):
        sets = []
        for n, lr in (("speaker", "1e-3"), ("listener", "3e-3")):
            sets += [
                f"policies.{n}.kind=lora_agent",
                f"policies.{n}.lora.r=4",
                f"policies.{n}.optim.lr={lr}",
                f"policies.{n}.args.batch_update={batch_update}",
            ]
        cfg = marl_config(*sets, f"run.dir={tmp_path}/run-{batch_update}", "algorithm.kl_coef=0.05")
        torch.manual_seed(0)
        run = loop.train(cfg)
        with open(run.path / "metrics.jsonl") as f:
            logs.append([json.loads(line) for line in f])
    assert calls == [2, 2]  # the batched run only: one call for both, each step
    batched, alone = logs
    assert len(batched) == len(alone) and any("speaker/grad_norm" in r for r in batched)
    for a, b in zip(alone, batched, strict=True):
        keys = {k for k in a if not timing(k)}
        assert keys == {k for k in b if not timing(k)}
        for k in keys:
            if isinstance(a[k], float):
                assert abs(a[k] - b[k]) <= 1e-4 * max(1.0, abs(a[k])), k
            else:
                assert a[k] == b[k], k


@pytest.mark.parametrize(
    ("shared", "min_tokens", "trees"), [(True, 16, True), (False, 16, False), (True, 64, False)]
)
def test_lora_passes_follow_the_shared_prefix_options(
    marl_config, monkeypatch, shared, min_tokens, trees
):
    """A lora_agent's own passes, its reference pass and the shared passes take the
    policy's ``shared_prefix`` and ``shared_prefix_min_tokens``: the 20-token prompts run as
    prefix trees only when sharing is on and their length reaches the minimum."""
    from polyrl.core.train import passes

    sets = []
    for n in NAMES:
        sets += [f"policies.{n}.pack=true", f"policies.{n}.shared_prefix={str(shared).lower()}"]
        sets += [f"policies.{n}.shared_prefix_min_tokens={min_tokens}"]
    _, pols = make_agents(marl_config, NAMES, *sets)
    seen: list[str] = []
    for name in ("shared_logprobs", "packed_logprobs"):
        real = getattr(passes, name)

        def spy(*a, _real=real, _name=name, **k):
            seen.append(_name)
            return _real(*a, **k)

        monkeypatch.setattr(passes, name, spy)
    parts = batches()
    first = pols[NAMES[0]]
    with torch.no_grad():
        first.logprobs(parts[0])
        first.ref_logprobs(parts[0])
        first.logprobs_together(list(pols.values()), parts)
        first.ref_logprobs_together(list(pols.values()), parts)
    want = "shared_logprobs" if trees else "packed_logprobs"
    assert seen == [want] * 4
