"""The HF engine: grouping, sampling controls, and log-probs that match the trainer's."""

from __future__ import annotations

import pytest
import torch

from polyrl.core.record import text_record
from polyrl.core.rollout.engine import HFEngine, SamplingParams
from polyrl.core.train.policy import CausalLMPolicy, PolicyConfig
from tests.helpers.trainer import TEXTS, chat_ids


@pytest.fixture(scope="module")
def policy(tiny_model_dir):
    return CausalLMPolicy(
        "main", PolicyConfig(model=tiny_model_dir), total_steps=1, need_reference=False
    )


def record_of(policy, ids, outs):
    return text_record(
        prompt_ids=[ids[o.prompt_index] for o in outs],
        response_ids=[o.token_ids for o in outs],
        rollout_logprobs=[o.logprobs for o in outs],
        policy=["main"] * len(outs),
        uid=[o.prompt_index for o in outs],
        pad_id=policy.tokenizer.pad_token_id,
    )


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_engine_logprobs_match_trainer(policy, temperature):
    ids = chat_ids(policy.tokenizer, TEXTS[:3])
    outs = HFEngine(policy, seed=1).generate(
        ids, SamplingParams(n=4, temperature=temperature, max_new_tokens=8)
    )
    rec = record_of(policy, ids, outs)
    with torch.no_grad():
        lp, _ = policy.logprobs(rec, temperature)
    m = rec["response_mask"].bool()
    diff = (lp[m] - rec["rollout_logprobs"][m]).abs()
    assert diff.max() < 1e-4, f"max |engine - trainer| = {diff.max():.2e}"


def test_groups_are_contiguous_and_complete(policy):
    ids = chat_ids(policy.tokenizer, TEXTS[:3])
    outs = HFEngine(policy).generate(ids, SamplingParams(n=5, max_new_tokens=4))
    assert [o.prompt_index for o in outs] == [i for i in range(3) for _ in range(5)]
    assert all(len(o.token_ids) == len(o.logprobs) >= 1 for o in outs)


def test_seeded_sampling_is_reproducible_and_greedy_is_deterministic(policy):
    ids = chat_ids(policy.tokenizer, TEXTS[:3])
    params = SamplingParams(n=4, max_new_tokens=6)
    a = [o.token_ids for o in HFEngine(policy, seed=3).generate(ids, params)]
    b = [o.token_ids for o in HFEngine(policy, seed=3).generate(ids, params)]
    c = [o.token_ids for o in HFEngine(policy, seed=4).generate(ids, params)]
    assert a == b and a != c
    greedy = SamplingParams(n=3, temperature=0.0, max_new_tokens=6)
    g = [o.token_ids for o in HFEngine(policy, seed=5).generate(ids, greedy)]
    assert all(g[3 * i] == g[3 * i + 1] == g[3 * i + 2] for i in range(3))


def test_engine_state_restores_the_sample_stream(policy):
    ids = chat_ids(policy.tokenizer, TEXTS[:3])
    params = SamplingParams(n=2, max_new_tokens=5)
    eng = HFEngine(policy, seed=9)
    eng.generate(ids, params)
    state = eng.state_dict()
    first = [o.token_ids for o in eng.generate(ids, params)]
    eng.load_state_dict(state)
    assert [o.token_ids for o in eng.generate(ids, params)] == first


def test_a_call_with_its_own_seed_repeats_and_leaves_the_stream_alone(policy):
    """``SamplingParams.seed``: the same seed gives the same samples whatever the engine's
    stream, another seed others, and the engine's stream goes on as if the call never ran."""
    ids = chat_ids(policy.tokenizer, TEXTS[:3])
    own = SamplingParams(n=4, max_new_tokens=6, seed=11)
    plain = SamplingParams(n=4, max_new_tokens=6)
    eng = HFEngine(policy, seed=9)
    untouched = [o.token_ids for o in HFEngine(policy, seed=9).generate(ids, plain)]
    a = eng.generate(ids, own)
    assert eng.state_dict()["rng"].equal(HFEngine(policy, seed=9).state_dict()["rng"])
    assert [o.token_ids for o in eng.generate(ids, plain)] == untouched
    b = HFEngine(policy, seed=2).generate(ids, own)  # another engine stream, same seed
    assert [o.token_ids for o in a] == [o.token_ids for o in b]
    assert [o.logprobs for o in a] == [o.logprobs for o in b]
    other = eng.generate(ids, SamplingParams(n=4, max_new_tokens=6, seed=12))
    assert [o.token_ids for o in other] != [o.token_ids for o in a]
    assert [o.token_ids for o in a] != untouched


def test_length_limit_and_eos(policy):
    ids = chat_ids(policy.tokenizer, TEXTS[:3])
    outs = HFEngine(policy).generate(ids, SamplingParams(n=8, max_new_tokens=3))
    eos = policy.tokenizer.eos_token_id
    for o in outs:
        assert len(o.token_ids) <= 3
        if o.finish_reason == "length":
            assert len(o.token_ids) == 3 and eos not in o.token_ids[:-1]
        else:
            assert o.token_ids[-1] == eos


def test_stop_strings_end_the_response(policy):
    """Greedy text from the untrained model, then stop at a piece of it."""
    ids = chat_ids(policy.tokenizer, TEXTS[:1])
    free = HFEngine(policy).generate(ids, SamplingParams(temperature=0.0, max_new_tokens=12))[0]
    text = free.text
    if len(text) < 3:
        pytest.skip(f"untrained model produced too little text to cut: {text!r}")
    stop = text[1:3]
    cut = HFEngine(policy).generate(
        ids, SamplingParams(temperature=0.0, max_new_tokens=12, stop=[stop])
    )[0]
    assert cut.finish_reason == "stop"
    assert stop in cut.text and len(cut.token_ids) < len(free.token_ids)
    assert cut.token_ids == free.token_ids[: len(cut.token_ids)]  # same ids, never re-encoded


def test_top_p_tiny_is_greedy(policy):
    ids = chat_ids(policy.tokenizer, TEXTS[:3])
    nucleus = HFEngine(policy, seed=0).generate(
        ids, SamplingParams(n=2, top_p=1e-6, max_new_tokens=5)
    )
    greedy = HFEngine(policy).generate(ids, SamplingParams(n=2, temperature=0.0, max_new_tokens=5))
    assert [o.token_ids for o in nucleus] == [o.token_ids for o in greedy]


def test_auto_engine_on_cpu_is_the_hf_engine_and_resumes_its_choice(policy):
    from polyrl.core.rollout.vllm_engine import AutoEngine

    ids = chat_ids(policy.tokenizer, TEXTS[:3])
    params = SamplingParams(n=3, max_new_tokens=5)
    auto = AutoEngine(policy, seed=7)
    assert auto.choice == "hf" and isinstance(auto.inner, HFEngine)
    want = [o.token_ids for o in HFEngine(policy, seed=7).generate(ids, params)]
    assert [o.token_ids for o in auto.generate(ids, params)] == want
    state = auto.state_dict()
    again = AutoEngine(policy, seed=0)
    again.load_state_dict(state)
    assert again.choice == "hf"
    assert [o.token_ids for o in again.generate(ids, params)] == [
        o.token_ids for o in auto.generate(ids, params)
    ]
    assert auto.tokenizer is policy.tokenizer  # engine attributes pass through
    assert auto.caps == HFEngine.caps  # and what the chosen engine can do (streams, exact)
    assert AutoEngine.caps.partial_rollouts  # the recipe's check reads the class


def test_draw_follows_the_distribution_and_never_picks_a_zero():
    from polyrl.core.rollout.engine import draw

    probs = torch.tensor([[0.0, 0.5, 0.25, 0.0, 0.125, 0.125], [1e-3, 0.0, 0.0, 0.0, 0.0, 0.999]])
    gen = torch.Generator().manual_seed(0)
    picks = torch.stack([draw(probs, gen) for _ in range(20000)])  # [draws, rows]
    counts = torch.stack([torch.bincount(picks[:, r], minlength=6) for r in range(2)]).double()
    freq = counts / counts.sum(-1, keepdim=True)
    assert counts[0, 0] == counts[0, 3] == 0 and counts[1, 1:5].sum() == 0
    # within 5 standard errors of the binomial for every entry with mass
    se = (probs * (1 - probs) / 20000).sqrt().double()
    assert ((freq - probs.double()).abs() <= 5 * se + 1e-12).all(), freq
    assert counts[1, 0] > 0  # a 1e-3 entry still gets its share (about 20 of 20000)


def test_reserved_cache_decodes_exactly_like_transformers_cache(policy, monkeypatch):
    import polyrl.core.rollout.engine as engine_mod

    ids = chat_ids(policy.tokenizer, TEXTS[:3])
    params = SamplingParams(n=4, max_new_tokens=10)
    ours = HFEngine(policy, seed=5).generate(ids, params)
    monkeypatch.setattr(engine_mod, "reserved_cache", lambda model, room: None)  # transformers'
    theirs = HFEngine(policy, seed=5).generate(ids, params)
    assert [o.token_ids for o in ours] == [o.token_ids for o in theirs]
    assert (
        max(
            abs(a - b)
            for o, t in zip(ours, theirs, strict=True)
            for a, b in zip(o.logprobs, t.logprobs, strict=True)
        )
        < 1e-5
    )


def test_reserved_cache_layers_select_repeat_and_refuse_overflow():
    from polyrl.core.rollout.kv_cache import _ReservedLayer

    layer = _ReservedLayer(room=2)
    k = torch.arange(2 * 1 * 3 * 2, dtype=torch.float32).view(2, 1, 3, 2)
    keys, _ = layer.update(k, k + 100)
    assert torch.equal(keys, k) and layer.get_seq_length() == 3
    layer.batch_repeat_interleave(2)  # rows 0,0,1,1
    layer.batch_select_indices(torch.tensor([1, 2]))  # rows 0,1 again
    step = torch.full((2, 1, 1, 2), -1.0)
    keys, values = layer.update(step, step)
    assert torch.equal(keys[:, :, :3], k) and torch.equal(values[:, :, :3], k + 100)
    assert torch.equal(keys[:, :, 3:], step) and layer.get_seq_length() == 4
    layer.update(step, step)
    with pytest.raises(RuntimeError, match="room exhausted"):
        layer.update(step, step)
