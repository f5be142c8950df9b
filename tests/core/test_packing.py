"""Padding-free (packed) log-prob passes and token-budget micro-batches.

The padded pass (``pack=False``, no shared prefix) is the reference: packing must give its
log-probs, entropies, losses and gradients to float tolerance, and forming micro-batches by
a token budget must leave the optimizer's gradient what the row-count micro-batches give.
"""

from __future__ import annotations

import copy

import pytest
import torch

from polyrl.core.record import text_record
from polyrl.core.train.algorithms import AlgorithmConfig
from polyrl.core.train.credit import group_credit
from polyrl.core.train.passes import pack_rows, packs, response_logprobs
from polyrl.core.train.policy import CausalLMPolicy, PolicyConfig
from polyrl.core.train.trainer import _micro_batch_rows, update
from tests.helpers.packing import make_policy, passes
from tests.helpers.trainer import grads_at_step

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


def test_pack_rows_keeps_segments_apart_and_in_order():
    """By hand: segment 1 rows (lengths 5, 3) and segment 0 rows (8, 2, 4) into bins of 8.
    Segment 0 first: 8 -> bin 0, 4 -> bin 1, 2 -> bin 1 (4+2); then segment 1: 5 -> bin 2,
    3 -> bin 2 (5+3)."""
    row_bin, start, bins, width = pack_rows([5, 8, 3, 2, 4], 8, segments=[1, 0, 1, 0, 0])
    assert (bins, width) == (3, 8)
    assert row_bin == [2, 0, 2, 1, 1]
    assert start == [0, 0, 5, 4, 0]
    # lengths 5, 6, 2: alone the 2 joins the 6 (first fit); in the 5's segment, the 5
    assert pack_rows([5, 6, 2], 8) == ([1, 0, 0], [0, 0, 6], 2, 8)
    assert pack_rows([5, 6, 2], 8, segments=[0, 1, 0]) == ([0, 1, 0], [0, 0, 5], 2, 8)


def test_token_budget_micro_batches_cover_every_row_within_budget():
    lengths = torch.tensor([30, 5, 7, 60, 6, 5, 31, 8, 5, 9, 70, 4, 6, 5])
    budget = 64
    single = _micro_batch_rows(len(lengths), 4, None, (lengths, budget))
    rows = torch.cat(single)
    assert sorted(rows.tolist()) == list(range(len(lengths)))
    for mb in single:  # within budget, or one row longer than it
        assert lengths[mb].sum() <= budget or len(mb) == 1
    assert len(single) == 4  # 251 tokens: 70 | 60+4 | 31+30 | the 9 short rows (56)
    plans = [_micro_batch_rows(len(lengths), 4, (r, 2), (lengths, budget)) for r in range(2)]
    assert len(plans[0]) == len(plans[1])  # same number of passes on every rank
    real = [[mb for mb in plan if mb is not None] for plan in plans]
    every = sorted(torch.cat([mb for plan in real for mb in plan]).tolist())
    assert every == list(range(len(lengths)))
    loads = [sum(int(lengths[mb].sum()) for mb in plan) for plan in real]
    assert abs(loads[0] - loads[1]) <= int(lengths.max())  # balanced to within one row
    assert loads == [124, 127]  # by hand, longest first to the lighter rank (ties: rank 0):
    # rank 0: 70, 30, 8, 6, 5, 5; rank 1: 60, 31, 9, 7, 6, 5, 5, 4


@pytest.mark.parametrize("loss_agg", ["token-mean", "seq-mean-token-mean"])
def test_token_budget_update_keeps_the_gradient(tiny_model_dir, loss_agg):
    """One optimizer step from the same weights: padded row-count micro-batches (3 rows),
    packed row-count-sized budget (the default), a small budget (many micro-batches) and
    one budget over everything see the same gradient and report the same loss."""
    base = make_policy(tiny_model_dir)
    batch = variable_batch(base.tokenizer)
    algo = AlgorithmConfig(loss_agg=loss_agg)
    runs = {}
    for name, kw in {
        "padded rows": dict(pack=False, shared_prefix=False, micro_batch_size=3),
        "packed default": dict(micro_batch_size=3),
        "packed 60": dict(max_tokens_per_micro_batch=60),
        "packed all": dict(max_tokens_per_micro_batch=10_000),
    }.items():
        policy = copy.deepcopy(base)
        policy.cfg = PolicyConfig(**{**vars(base.cfg), **kw})
        seen = grads_at_step(policy)
        out = update(policy, batch.clone(), algo)
        runs[name] = (seen[0], out["loss"])
    ref, ref_loss = runs.pop("padded rows")
    for name, (grads, loss) in runs.items():
        assert loss == pytest.approx(ref_loss, rel=1e-5, abs=1e-7), name
        for a, b in zip(grads, ref, strict=True):
            torch.testing.assert_close(a, b, atol=1e-7, rtol=1e-4, msg=name)


def test_token_budget_ranks_sum_to_the_single_process_gradient(tiny_model_dir):
    """Two data-parallel ranks (each its share by tokens; no collectives are needed with
    one epoch and no reference): the ranks' gradients average to the single-process one,
    as FSDP's reduction would make them."""
    base = make_policy(tiny_model_dir, max_tokens_per_micro_batch=50)
    batch = variable_batch(base.tokenizer)
    grads = []
    for dp in (None, (0, 2), (1, 2)):
        policy = copy.deepcopy(base)
        seen = grads_at_step(policy)
        update(policy, batch.clone(), AlgorithmConfig(), dp=dp)
        grads.append(seen[0])
    single, r0, r1 = grads
    for s, a, b in zip(single, r0, r1, strict=True):
        torch.testing.assert_close((a + b) / 2, s, atol=1e-7, rtol=1e-4)
    assert any(not torch.equal(a, b) for a, b in zip(r0, r1, strict=True))


def test_packing_is_off_where_rows_could_mix(tiny_model_dir):
    """An attention implementation that does not read packed position ids keeps the padded
    pass, and row-count micro-batches; so does a kind that brings its own pass."""
    policy = make_policy(tiny_model_dir)
    batch = variable_batch(policy.tokenizer)
    assert policy.token_budget(batch)[1] == policy.cfg.micro_batch_size * int(
        (batch["prompt_mask"].sum(-1) + batch["response_mask"].sum(-1)).max()
    )
    policy.model.config._attn_implementation = "some_kernel"
    assert not packs(policy.model, True)
    assert policy.token_budget(batch) is None
    policy.model.config._attn_implementation = "sdpa"

    class OwnPass(CausalLMPolicy):  # a kind with its own (padded) pass, as the VLM kind
        def logprobs(self, batch, temperature=1.0, with_entropy=False):
            return super().logprobs(batch, temperature, with_entropy)

    policy.__class__ = OwnPass
    assert policy.token_budget(batch) is None
    policy.__class__ = CausalLMPolicy
    policy.cfg.pack = False
    policy.model.config._attn_implementation = "sdpa"
    assert policy.token_budget(batch) is None


@pytest.mark.parametrize(
    "overrides",
    [
        ["policies.main.max_tokens_per_micro_batch=0"],
        ["policies.main.pack=false", "policies.main.max_tokens_per_micro_batch=4096"],
    ],
)
def test_a_token_budget_without_packing_fails_at_load(tmp_path, overrides):
    import polyrl.core  # noqa: F401  (registers the core's parts)
    from polyrl.core.config import ConfigError, load
    from polyrl.core.recipe import Config

    recipe = tmp_path / "recipe.yaml"
    recipe.write_text("policies: {main: {model: some/model}}\ntrain: {steps: 3}\n")
    with pytest.raises(ConfigError, match="policies.main.max_tokens_per_micro_batch=") as e:
        load(Config, recipe, overrides)
    assert "pack: true" in str(e.value) and str(recipe) in str(e.value)
    cfg = load(Config, recipe, ["policies.main.max_tokens_per_micro_batch=4096"])
    assert cfg.policies["main"].max_tokens_per_micro_batch == 4096
