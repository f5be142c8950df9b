"""Padding-free (packed) log-prob passes.

The padded pass (``pack=False``, no shared prefix) is the reference: packing must give its
log-probs, entropies and gradients to float tolerance.
"""

from __future__ import annotations

import pytest
import torch

from polyrl.core.algorithms import AlgorithmConfig
from polyrl.core.credit import group_credit
from polyrl.core.policy import (
    CausalLMPolicy,
    OptimConfig,
    PolicyConfig,
    pack_rows,
    packs,
    response_logprobs,
)
from polyrl.core.record import text_record

# response lengths: most short, some long (the workload packing is for)
LENGTHS = [1, 2, 40, 3, 1, 2, 33, 4, 2, 1, 3, 27]


def variable_batch(tok, lengths=LENGTHS, seed=0):
    """Three prompts of different lengths, four responses each of ``lengths``; rewards
    that vary within each group so every row has an advantage."""
    texts = ["12+7=", "3+4=", "125+30="]
    ids = [
        tok.encode(
            tok.apply_chat_template(
                [{"role": "user", "content": t}], tokenize=False, add_generation_prompt=True
            ),
            add_special_tokens=False,
        )
        for t in texts
    ]
    gen = torch.Generator().manual_seed(seed)
    prompts = [ids[i // 4] for i in range(len(lengths))]
    responses = [torch.randint(5, 60, (n,), generator=gen).tolist() for n in lengths]
    rec = text_record(
        prompt_ids=prompts,
        response_ids=responses,
        rollout_logprobs=[[-1.0] * len(r) for r in responses],
        policy=["main"] * len(prompts),
        uid=[i // 4 for i in range(len(lengths))],
        pad_id=tok.pad_token_id,
    )
    rec["reward"] = torch.rand(len(lengths), generator=gen)
    group_credit(rec, AlgorithmConfig())
    return rec


def make_policy(model_dir, *, attn="sdpa", lora=0, **kw):
    from polyrl.core.policy import LoraConfig

    cfg = PolicyConfig(
        model=model_dir,
        optim=OptimConfig(lr=1e-3, max_grad_norm=0.0),
        lora=LoraConfig(r=lora),
        **kw,
    )
    policy = CausalLMPolicy("main", cfg, total_steps=10, need_reference=False)
    policy.model.set_attn_implementation(attn)
    return policy


def passes(model, batch, **kw):
    """Log-probs, entropies and parameter gradients of one pass (T = 0.7)."""
    model.zero_grad()
    mask = batch["response_mask"].bool()
    logp, ent = response_logprobs(model, batch, 0.7, True, **kw)
    (logp * mask * torch.linspace(0.5, 1.5, mask.shape[1])).sum().backward()
    grads = {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}
    return logp, ent, grads


@pytest.mark.parametrize("attn,lora", [("sdpa", 0), ("eager", 0), ("sdpa", 4)])
def test_packed_pass_equals_the_padded_pass(tiny_model_dir, attn, lora):
    """Values and gradients (full weights, or LoRA adapters) equal the padded pass's; the
    padded slots of a packed pass hold 0."""
    policy = make_policy(tiny_model_dir, attn=attn, lora=lora)
    assert packs(policy.model, True)
    batch = variable_batch(policy.tokenizer)
    mask = batch["response_mask"].bool()
    lp, ep, gp = passes(policy.model, batch, shared_prefix=False, pack=False)
    lk, ek, gk = passes(policy.model, batch, shared_prefix=False, pack=True)
    torch.testing.assert_close(lk[mask], lp[mask], atol=2e-6, rtol=1e-5)
    torch.testing.assert_close(ek[mask], ep[mask], atol=2e-6, rtol=1e-5)
    assert not lk[~mask].any() and not ek[~mask].any()
    assert gp.keys() == gk.keys() and len(gp) > 0
    for k in gp:  # float32 sums in another order: within 1e-5 of the tensor's scale
        assert (gk[k] - gp[k]).abs().max() <= 1e-5 * gp[k].abs().max() + 1e-9, k
    assert any(g.abs().sum() > 0 for g in gk.values())


def test_packed_rows_do_not_see_each_other(tiny_model_dir):
    """Each row's packed log-probs are those of the row run alone (most rows share a bin
    with others here: 12 rows in 6 bins, three of them holding three short rows each)."""
    policy = make_policy(tiny_model_dir)
    batch = variable_batch(policy.tokenizer)
    lengths = (batch["prompt_mask"].sum(-1) + batch["response_mask"].sum(-1)).tolist()
    assert pack_rows(lengths, max(lengths))[2] == 6
    mask = batch["response_mask"].bool()
    with torch.no_grad():
        packed, _ = response_logprobs(policy.model, batch, pack=True)
        for i in range(len(lengths)):
            alone, _ = response_logprobs(policy.model, batch[i : i + 1], pack=False)
            torch.testing.assert_close(packed[i][mask[i]], alone[0][mask[i]], atol=2e-6, rtol=1e-5)


def test_pack_rows_first_fit_decreasing():
    """By hand: lengths 5,3,8,2,4,6 into bins of 8, longest first: 8 -> bin 0; 6 -> bin 1;
    5 -> bin 2; 4 -> bin 3; 3 -> bin 2 (5+3); 2 -> bin 1 (6+2)."""
    row_bin, start, bins, width = pack_rows([5, 3, 8, 2, 4, 6], 8)
    assert (bins, width) == (4, 8)
    assert row_bin == [2, 2, 0, 1, 3, 1]
    assert start == [0, 5, 0, 6, 0, 0]
    assert pack_rows([5, 3, 8], None) == ([0, 0, 0], [0, 5, 8], 1, 16)
    assert pack_rows([3, 12, 2], 8) == ([1, 0, 1], [0, 0, 3], 2, 8)  # too long: alone


def test_packing_is_off_where_rows_could_mix(tiny_model_dir):
    """An attention implementation that does not read packed position ids keeps the padded
    pass (and row-count micro-batches)."""
    policy = make_policy(tiny_model_dir)
    assert packs(policy.model, True) and not packs(policy.model, False)
    policy.model.config._attn_implementation = "some_kernel"
    assert not packs(policy.model, True)
