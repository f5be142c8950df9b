"""Token segments: every per-token fact slices, joins and reaches the record as one."""

from __future__ import annotations

import pytest
import torch

from polyrl.core.record import Row, build_rows, concat, trim
from polyrl.core.segment import FACTS, Tokens


def routed(n: int, start: int, layers: int = 2, k: int = 2) -> torch.Tensor:
    """Distinct experts per token, ``[n, layers, k]`` int8 (token i's from ``start + i``)."""
    base = torch.arange(start, start + n, dtype=torch.int8)[:, None, None]
    return (base + torch.zeros((n, layers, k), dtype=torch.int8)) % 100


def sampled(ids: list[int], version: int, start: int) -> Tokens:
    """A sampled segment with every fact recorded (the last token's routing unrecorded)."""
    experts = routed(len(ids), start)
    experts[-1] = -1  # never fed back to the engine
    return Tokens.sampled(
        ids,
        [-0.1 * (i + 1) for i in range(len(ids))],
        versions=[version] * len(ids),
        top=[([t, t + 1], [-0.1, -0.2]) for t in ids],
        experts=experts,
    )


def test_slicing_then_joining_gives_back_every_fact():
    seg = sampled([5, 6, 7, 8], version=3, start=10)
    assert {"logprobs", "mask", "versions", "top", "experts"} <= {name for name, _ in FACTS}
    for cut in range(len(seg) + 1):
        left, right = seg[:cut], seg[cut:]
        assert len(left) == cut and len(right) == len(seg) - cut
        back = left + right
        assert back == seg
        for name, _ in FACTS:  # each fact itself, not only the equality
            a, b = getattr(back, name), getattr(seg, name)
            assert torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b, name
    assert Tokens.cat([seg[:1], seg[1:3], seg[3:]]) == seg


def test_given_tokens_take_the_defaults_and_cost_nothing_until_joined():
    env = Tokens.given([1, 2, 3])
    assert env.ids == [1, 2, 3]
    assert all(getattr(env, name) is None for name, _ in FACTS)  # nothing materialised
    joined = env + Tokens.given([4])
    assert joined.ids == [1, 2, 3, 4]
    assert all(getattr(joined, name) is None for name, _ in FACTS)
    with_facts = sampled([9], version=0, start=0) + env
    assert with_facts.logprobs[1:] == [0.0] * 3
    assert with_facts.mask == [1, 0, 0, 0]
    assert with_facts.versions == [0, -1, -1, -1]
    assert with_facts.top[1:] == [([], [])] * 3
    assert bool((with_facts.experts[1:] == -1).all())
    assert with_facts.experts.dtype == torch.int8


def test_a_row_of_two_sampled_turns_and_environment_tokens():
    """The row a multi-turn workflow builds, against the one written by hand."""
    prompt = Tokens.given([1, 2], experts=routed(2, 0))
    first = sampled([10, 11, 12], version=0, start=20)
    reply = Tokens.given([40, 41])
    second = sampled([13, 14], version=1, start=30)
    row = Row(prompt, Tokens.cat([first, reply, second]), "main", 0)
    record = build_rows([row], pad_id=0)
    assert record["prompt_ids"].tolist() == [[1, 2]]
    assert record["response_ids"].tolist() == [[10, 11, 12, 40, 41, 13, 14]]
    assert record["loss_mask"].tolist() == [[1, 1, 1, 0, 0, 1, 1]]
    assert record["token_version"].tolist() == [[0, 0, 0, -1, -1, 1, 1]]
    want = torch.full((7, 2, 2), -1, dtype=torch.int8)
    want[0:2], want[5:6] = routed(2, 20), routed(1, 30)  # last tokens of each turn unrecorded
    assert torch.equal(record["response_experts"][0], want)
    assert torch.equal(record["prompt_experts"][0], routed(2, 0))
    lp = record["rollout_logprobs"][0]
    assert torch.allclose(lp, torch.tensor([-0.1, -0.2, -0.3, 0.0, 0.0, -0.1, -0.2]))


def test_fill_takes_a_later_prefill_only_where_nothing_was_recorded():
    prompt = Tokens.given([1, 2], experts=routed(2, 0))
    action = sampled([10, 11], version=0, start=20)
    row = Tokens.cat([prompt, action, Tokens.given([40])])
    # the next call prefilled prompt + action + reply: its own routing of every token
    later = Tokens.given(row.ids, experts=routed(5, 60))
    filled = row.fill(later)
    assert torch.equal(filled.experts[:3], row.experts[:3])  # the first call's, kept
    assert torch.equal(filled.experts[3:], routed(5, 60)[3:])  # unrecorded: the later call's
    assert filled.versions == row.versions and filled.mask == row.mask
    assert row.fill(Tokens.given(row.ids)) is row  # a dense model's prompt: nothing to fill
    with pytest.raises(ValueError, match="do not begin"):
        row.fill(Tokens.given([1, 3], experts=routed(2, 0)))


def test_a_trajectory_takes_each_tokens_experts_from_the_first_call_that_routed_it():
    """Two calls (hand-built experts, 1 layer, top-1): the first call's prompt and action,
    the second's prefill for what only it routed (the action's last token, the
    observation); -1 where no call did."""

    def ex(*rows):
        return torch.tensor(rows, dtype=torch.int8).reshape(-1, 1, 1)

    # prompt 5 6, action 7 8, observation 9, action 10 11
    first_prompt = Tokens.given([5, 6], experts=ex(0, 1))
    first = Tokens.sampled([7, 8], [0.0, 0.0], experts=ex(2, -1))  # its last never fed
    second_prompt = Tokens.given([5, 6, 7, 8, 9], experts=ex(3, 3, 3, 1, 2))
    second = Tokens.sampled([10, 11], [0.0, 0.0], experts=ex(0, -1))
    row = Tokens.cat([first_prompt, first, Tokens.given([9]), second]).fill(second_prompt)
    assert row.experts.flatten().tolist() == [0, 1, 2, 1, 2, 0, -1]
    unrecorded = Tokens.cat([Tokens.given([5, 6]), Tokens.sampled([7, 8], [0.0, 0.0])])
    row = Tokens.cat([unrecorded, Tokens.given([9]), second]).fill(second_prompt)
    assert row.experts.flatten().tolist() == [3, 3, 3, 1, 2, 0, -1]
    dense = Tokens.cat([unrecorded, Tokens.given([9, 10, 11])])
    assert dense.fill(Tokens.given(dense.ids[:5])).experts is None


def test_rows_without_a_fact_get_no_column_and_padding_keeps_defaults():
    plain = Row(Tokens.given([1]), Tokens.sampled([5, 6], [-0.5, -0.6]), "main", 0)
    record = build_rows([plain], pad_id=0)
    assert "token_version" not in record.keys()  # noqa: SIM118 (TensorDict)
    assert "response_experts" not in record.keys()  # noqa: SIM118 (TensorDict)
    versioned = Row(Tokens.given([1, 2]), sampled([7, 8, 9], version=2, start=0), "main", 1)
    both = build_rows([plain, versioned], pad_id=0)
    assert both["token_version"].tolist() == [[-1, -1, -1], [2, 2, 2]]
    assert bool((both["prompt_experts"][0] == -1).all())  # a row without: unrecorded
    wider = Row(Tokens.given([1]), sampled([7, 8, 9, 10], version=3, start=0), "main", 2)
    merged = concat([both, build_rows([wider], pad_id=0)])
    assert merged["token_version"].tolist() == [[-1, -1, -1, -1], [2, 2, 2, -1], [3, 3, 3, 3]]
    assert bool((merged["response_experts"][1, 3] == -1).all())
    assert trim(merged[:1])["response_ids"].shape == (1, 2)


def test_segments_refuse_facts_that_do_not_line_up():
    with pytest.raises(ValueError, match="versions has 1 entries for 2 ids"):
        Tokens.sampled([1, 2], [0.0, 0.0], versions=[0])
    with pytest.raises(TypeError, match="contiguous slices"):
        Tokens.given([1, 2, 3])[::2]
    with pytest.raises(ValueError, match="per token"):
        Tokens.cat(
            [Tokens.given([1], experts=routed(1, 0)), Tokens.given([2], experts=routed(1, 0, k=3))]
        )
