"""Prefix-shared packed passes: each prefix rows share is computed once.

The padded pass (``pack=False``, no shared prefix) is the reference for values and
gradients; the tree layout is checked against what each row must see, computed from the
rows alone; the planner and the trainer's units against hand computations.
"""

from __future__ import annotations

import copy

import pytest
import torch

from polyrl.core.record import text_record
from polyrl.core.train import prefix
from polyrl.core.train.algorithms import AlgorithmConfig
from polyrl.core.train.credit import group_credit
from polyrl.core.train.passes import prefix_units, response_logprobs
from polyrl.core.train.policy import PolicyConfig
from polyrl.core.train.trainer import _micro_batch_rows, update
from tests.helpers.packing import make_policy, passes
from tests.helpers.trainer import grads_at_step


def tree_batch(seed=0, plens=(40, 25, 33), group=4):
    """GRPO groups (one prompt, ``group`` responses of different lengths), three step rows
    of one episode (each turn's prompt is the history: the turn before's prompt, response
    and an observation), a row identical to the first, and a row sharing nothing."""
    gen = torch.Generator().manual_seed(seed)

    def ids(n):
        return torch.randint(5, 60, (n,), generator=gen).tolist()

    prompts, responses = [], []
    for plen in plens:
        p = ids(plen)
        for k in range(group):
            prompts.append(p)
            responses.append(ids(1 + 7 * k % 11))
    history = ids(30)
    for _ in range(3):
        response = ids(5)
        prompts.append(list(history))
        responses.append(response)
        history = history + response + ids(6)
    prompts.append(prompts[0])
    responses.append(list(responses[0]))
    prompts.append(ids(12))
    responses.append(ids(3))
    rec = text_record(
        prompt_ids=prompts,
        response_ids=responses,
        rollout_logprobs=[[-1.0] * len(r) for r in responses],
        policy=["main"] * len(prompts),
        uid=[min(i // group, len(plens)) for i in range(len(prompts))],
        pad_id=0,
    )
    rec["reward"] = torch.rand(len(prompts), generator=gen)
    group_credit(rec, AlgorithmConfig())
    return rec


def rows_of(rec):
    tokens, lengths = prefix.row_tokens(rec)
    return [t[:n] for t, n in zip(tokens.tolist(), lengths.tolist(), strict=True)]


def test_tree_layout_shows_each_token_exactly_its_own_row_before_it():
    """Every row's tokens sit at its columns with positions 0..L-1; the column of its
    position p sees exactly the columns of its positions 0..p; the layout holds each
    distinct prefix once (counted as the set of all rows' prefixes)."""
    rec = tree_batch()
    rows = rows_of(rec)
    tokens, lengths = prefix.row_tokens(rec)
    order, lcp = prefix.sorted_lcp(tokens, lengths)
    # one tree of every row (rows that share nothing hang side by side under the root)
    units = [prefix.Unit(order, lcp, int(lengths.sum()) - sum(lcp))]
    lay = prefix.tree_layout(units, tokens, lengths.tolist(), len(rows))
    for i, row in enumerate(rows):
        b, cols = lay.row_bin[i], lay.cols[i]
        assert lay.ids[b, cols].tolist() == row
        assert lay.positions[b, cols].tolist() == list(range(len(row)))
        for p in range(len(row)):
            seen = lay.visible[b, 0, cols[p]].nonzero().flatten().tolist()
            assert seen == sorted(cols[: p + 1].tolist()), (i, p)
    prefixes = {tuple(row[: k + 1]) for row in rows for k in range(len(row))}
    real = sum(u.distinct for u in units)
    assert real == len(prefixes)
    assert real < sum(map(len, rows))  # something was shared
    for b in range(lay.ids.shape[0]):  # fillers see only themselves (no empty mask row)
        assert bool(lay.visible[b, 0].any(-1).all())


def test_plan_units_by_hand():
    """Rows A = 1x20 2 3, D = A + 9, B = 1x20 4, C = 5 6 7. Sorted: A, D, B, C; LCPs
    0, 22, 20, 0. Linear cost (b = 0): sharing always pays where allowed."""
    a, b, c, d = [1] * 20 + [2, 3], [1] * 20 + [4], [5, 6, 7], [1] * 20 + [2, 3, 9]
    rows = [a, b, c, d]
    lengths = torch.tensor([len(r) for r in rows])
    tokens = torch.full((4, 23), -1)
    for i, r in enumerate(rows):
        tokens[i, : len(r)] = torch.tensor(r)
    order, lcp = prefix.sorted_lcp(tokens, lengths)
    assert (order, lcp) == ([0, 3, 1, 2], [0, 22, 20, 0])

    def plan(min_shared, limit=None, weights=(1.0, 0.0)):
        units = prefix.plan_units(
            lengths.tolist(), order, lcp, min_shared=min_shared, weights=weights, limit=limit
        )
        return [(u.rows, u.distinct) for u in units]

    assert plan(16) == [([0, 3, 1], 20 + 2 + 1 + 1), ([2], 3)]
    assert plan(21) == [([0, 3], 23), ([1], 21), ([2], 3)]  # B shares only 20 tokens
    assert plan(16, limit=23) == [([0, 3], 23), ([1], 21), ([2], 3)]  # 24 > 23
    assert plan(16, limit=22) == [([0], 22), ([3], 23), ([1], 21), ([2], 3)]
    # attention-bound (a = 0): a tree of S tokens costs S^2 against sum L^2 for its rows:
    # A, D, B: 24^2 = 576 < 22^2 + 23^2 + 21^2; two rows sharing 16 of 46 tokens each:
    # 76^2 = 5776 > 2 * 46^2 = 4232, so they run apart
    assert plan(16, weights=(0.0, 1.0))[0] == ([0, 3, 1], 24)
    two = torch.tensor([[1] * 16 + [2] * 30, [1] * 16 + [3] * 30])
    o2, l2 = prefix.sorted_lcp(two, torch.tensor([46, 46]))
    linear = prefix.plan_units([46, 46], o2, l2, min_shared=16, weights=(1.0, 0.0))
    quadratic = prefix.plan_units([46, 46], o2, l2, min_shared=16, weights=(0.0, 1.0))
    assert [u.rows for u in linear] == [[0, 1]] and [u.rows for u in quadratic] == [[0], [1]]


@pytest.mark.parametrize("attn,lora", [("sdpa", 0), ("eager", 0), ("sdpa", 4)])
def test_shared_pass_equals_the_padded_pass(tiny_model_dir, attn, lora):
    """Values, entropies and gradients (full weights, or LoRA adapters) of the tree pass
    equal the padded pass's, on groups, step rows, a duplicate row and a lone row."""
    policy = make_policy(tiny_model_dir, attn=attn, lora=lora)
    batch = tree_batch()
    units = prefix_units(policy.model, batch, 16)
    shared = {tuple(sorted(u.rows)) for u in units if u.shared}
    assert {(0, 1, 2, 3, 15), (4, 5, 6, 7), (8, 9, 10, 11), (12, 13, 14)} <= shared
    mask = batch["response_mask"].bool()
    lp, ep, gp = passes(policy.model, batch, shared_prefix=False, pack=False)
    ls, es, gs = passes(policy.model, batch, shared_prefix=True, pack=True)
    torch.testing.assert_close(ls[mask], lp[mask], atol=2e-6, rtol=1e-5)
    torch.testing.assert_close(es[mask], ep[mask], atol=2e-6, rtol=1e-5)
    assert not ls[~mask].any() and not es[~mask].any()
    assert gp.keys() == gs.keys() and len(gp) > 0
    for k in gp:  # float32 sums in another order: within 1e-5 of the tensor's scale
        assert (gs[k] - gp[k]).abs().max() <= 1e-5 * gp[k].abs().max() + 1e-9, k
    assert any(g.abs().sum() > 0 for g in gs.values())


def test_micro_batch_rows_keep_units_together_by_hand():
    """Units {0,3} (charged 10 + 2) and {1,2,4} (6 + 1 + 1), row 5 alone (9); budget 12:
    largest first: {0,3}=12 fills micro-batch 0, row 5 (9) opens 1, {1,2,4}=8 opens 2.
    Two ranks: {0,3} to rank 0, row 5 to rank 1, {1,2,4} to rank 1 (9 < 12)."""
    tokens = torch.tensor([10, 6, 1, 2, 1, 9])
    budget = (tokens, 12, [[0, 3], [1, 2, 4], [5]])
    single = _micro_batch_rows(6, 4, None, budget)
    assert [m.tolist() for m in single] == [[0, 3], [5], [1, 2, 4]]
    r0 = _micro_batch_rows(6, 4, (0, 2), budget)
    r1 = _micro_batch_rows(6, 4, (1, 2), budget)
    assert [m.tolist() for m in r0 if m is not None] == [[0, 3]]
    assert r0[1] is None
    assert [m.tolist() for m in r1] == [[5], [1, 2, 4]]


@pytest.mark.parametrize("budget", [None, 60])
def test_shared_update_keeps_the_gradient(tiny_model_dir, budget):
    """One optimizer step from the same weights: padded row-count micro-batches against
    shared packed passes under the default budget and a small one (units split across
    micro-batches, several trees per pass); the budget counts a shared prefix once."""
    base = make_policy(tiny_model_dir)
    batch = tree_batch()
    algo = AlgorithmConfig()
    runs = {}
    for name, kw in {
        "padded": dict(pack=False, shared_prefix=False, micro_batch_size=4),
        "shared": dict(micro_batch_size=4, max_tokens_per_micro_batch=budget),
    }.items():
        policy = copy.deepcopy(base)
        policy.cfg = PolicyConfig(**{**vars(base.cfg), **kw})
        if name == "shared":
            tokens, limit, units = policy.token_budget(batch)
            lengths = batch["prompt_mask"].sum(-1) + batch["response_mask"].sum(-1)
            assert int(tokens.sum()) < int(lengths.sum())  # prefixes counted once
            rows = rows_of(batch)
            for mb in _micro_batch_rows(len(batch), 4, None, (tokens, limit, units)):
                distinct = {
                    tuple(rows[i][: k + 1]) for i in mb.tolist() for k in range(len(rows[i]))
                }
                assert len(distinct) <= limit or len(mb) == 1
                for u in units:  # a unit's rows stay in one micro-batch
                    assert set(u) <= set(mb.tolist()) or not set(u) & set(mb.tolist())
        seen = grads_at_step(policy)
        out = update(policy, batch.clone(), algo)
        runs[name] = (seen[0], out["loss"])
    (ref, ref_loss), (grads, loss) = runs["padded"], runs["shared"]
    assert loss == pytest.approx(ref_loss, rel=1e-5, abs=1e-7)
    for a, b in zip(grads, ref, strict=True):
        torch.testing.assert_close(a, b, atol=1e-7, rtol=1e-4)


def test_reference_pass_shares_and_matches(tiny_model_dir):
    """The reference pass of a LoRA policy (adapter disabled), shared, equals the padded
    pass of the base model."""
    policy = make_policy(tiny_model_dir, lora=4)
    batch = tree_batch()
    mask = batch["response_mask"].bool()
    ref = policy.ref_logprobs(batch)
    with torch.no_grad(), policy.model.disable_adapter():
        padded, _ = response_logprobs(policy.model, batch, shared_prefix=False, pack=False)
    torch.testing.assert_close(ref[mask], padded[mask], atol=2e-6, rtol=1e-5)


def test_no_tree_where_the_attention_cannot_take_its_mask(tiny_model_dir):
    """Flash attention (varlen: no tree mask) and sliding windows keep the packed pass, and
    the token budget then has no units; ``shared_prefix: false`` too."""
    from polyrl.core.train.passes import shares

    policy = make_policy(tiny_model_dir)
    batch = tree_batch()
    config = policy.model.config
    assert shares(policy.model, True, True) and len(policy.token_budget(batch)) == 3
    assert not shares(policy.model, True, False) and not shares(policy.model, False, True)
    config._attn_implementation = "flash_attention_2"
    assert not shares(policy.model, True, True)
    assert len(policy.token_budget(batch)) == 2
    config._attn_implementation = "sdpa"
    config.use_sliding_window, config.sliding_window = True, 8
    assert not shares(policy.model, True, True)


def test_shared_ranks_sum_to_the_single_process_gradient(tiny_model_dir):
    """Two data-parallel ranks, each its share of units balanced by distinct tokens: the
    ranks' gradients average to the single-process one (as FSDP's reduction makes them)."""
    base = make_policy(tiny_model_dir, max_tokens_per_micro_batch=80)
    batch = tree_batch()
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
