"""``vllm_lora``: one vLLM engine serves two ``lora_agent`` adapters on the tiny signaling base.

Each handle's log-probs equal its adapter's in the trainer, the adapters route to different
weights (and differ from the base), ``sync`` follows one adapter's update while leaving the
other alone, and both policies share one ``vllm.LLM``. vLLM's state is process-global: the
module builds both engines once and closes them at the end.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("vllm")

from polyrl.core.record import text_record  # noqa: E402
from polyrl.core.rollout.engine import SamplingParams  # noqa: E402
from polyrl.core.train.algorithms import AlgorithmConfig  # noqa: E402
from polyrl.core.train.policy import LoraConfig, OptimConfig, PolicyConfig  # noqa: E402
from polyrl.core.train.trainer import update  # noqa: E402

pytestmark = pytest.mark.vllm

NAMES = ("speaker", "listener")


def train(policy, target: int, steps: int = 3) -> None:
    """A few optimizer steps pushing the adapter towards ``target`` tokens (hand-made RL)."""
    b = text_record(
        prompt_ids=[[5, 6, 7]] * 4,
        response_ids=[[target, target]] * 4,
        rollout_logprobs=[[0.0, 0.0]] * 4,
        policy=[policy.name] * 4,
        uid=list(range(4)),
        pad_id=0,
    )
    b["advantages"] = torch.ones(4, 2)
    for _ in range(steps):
        b["rollout_logprobs"] = policy.logprobs(b)[0].detach()
        update(policy, b, AlgorithmConfig())


@pytest.fixture(scope="module")
def setup(signaling_model_dir):
    import polyrl.marl  # noqa: F401  (registers lora_agent and vllm_lora)
    from polyrl.core.registry import ENGINES, POLICIES

    torch.manual_seed(0)  # PEFT's random lora_A init: the same adapters every run
    shared: dict = {}
    cfgs = {
        n: PolicyConfig(
            model=signaling_model_dir,
            kind="lora_agent",
            lora=LoraConfig(r=8, alpha=16.0),
            optim=OptimConfig(lr=0.05),
        )
        for n in NAMES
    }
    pols = {
        n: POLICIES.get(c.kind)(n, c, total_steps=10, need_reference=False, shared=shared)
        for n, c in cfgs.items()
    }
    train(pols["speaker"], 8)
    train(pols["listener"], 12)
    args = {"max_model_len": 128, "kv_cache_gb": 0.0625}
    engines = {
        n: ENGINES.get("vllm_lora")(p, seed=i, **args) for i, (n, p) in enumerate(pols.items())
    }
    print(f"shared vLLM start-up (with first adapter): {engines['speaker'].startup_s:.1f} s")
    yield pols, engines
    for e in engines.values():
        e.close()
    from polyrl.marl import vllm_lora

    assert vllm_lora._SERVER is None  # the last close shut the shared LLM down


def encode(policy, texts=("object 1", "object 2 3", "pick")):
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


def record(policy, ids, outs):
    return text_record(
        prompt_ids=[ids[o.prompt_index] for o in outs],
        response_ids=[o.token_ids for o in outs],
        rollout_logprobs=[o.logprobs for o in outs],
        policy=[policy.name] * len(outs),
        uid=[o.prompt_index for o in outs],
        pad_id=policy.tokenizer.pad_token_id,
    )


def trainer_vs_engine(policy, ids, outs):
    """(trainer's recomputed log-probs, engine's log-probs) over the response tokens."""
    rec = record(policy, ids, outs)
    with torch.no_grad():
        lp, _ = policy.logprobs(rec)
    m = rec["response_mask"].bool()
    return lp[m], rec["rollout_logprobs"][m]


PARAMS = SamplingParams(n=4, temperature=1.0, max_new_tokens=6)


def test_one_llm_serves_both_policies(setup):
    from vllm import LLM

    from polyrl.marl import vllm_lora

    _, engines = setup
    s, listener = engines["speaker"], engines["listener"]
    # The handles own no LLM: both use the process's one server's. (A gc scan for LLM
    # objects cannot tell: vLLM's gc.freeze() hides them from gc.get_objects().)
    assert s.server is listener.server is vllm_lora._SERVER
    llm = s.server.engine.llm
    assert type(llm) is LLM and s.llm is listener.llm is llm
    ids = {s.lora_request.lora_int_id, listener.lora_request.lora_int_id}
    assert len(ids) == 2 and llm.llm_engine.list_loras() == ids


def test_logprobs_match_each_adapter(setup):
    pols, engines = setup
    for name in NAMES:
        ids = encode(pols[name])
        trainer, rollout = trainer_vs_engine(pols[name], ids, engines[name].generate(ids, PARAMS))
        diff = (trainer - rollout).abs()
        print(
            f"{name}: |vLLM - trainer| mean {diff.mean():.2e}, max {diff.max():.2e} "
            f"over {diff.numel()} tokens"
        )
        assert diff.mean() <= 1e-3 and diff.max() <= 1e-2


def test_adapters_route_to_different_weights(setup):
    pols, engines = setup
    speaker = pols["speaker"]
    ids = encode(speaker)
    outs = engines["speaker"].generate(ids, PARAMS)
    rec = record(speaker, ids, outs)
    m = rec["response_mask"].bool()
    with torch.no_grad():  # the same tokens, scored by each adapter and by the bare base
        listener_lp = pols["listener"].logprobs(rec)[0][m]
        base_lp = speaker.ref_logprobs(rec)[m]
    vllm_speaker = rec["rollout_logprobs"][m]
    # Replay the speaker's tokens through the listener's adapter and through the base in vLLM:
    # teacher-forcing is not exposed, so compare the trainer's scores, which (a) pins to vLLM.
    gap_sl = (vllm_speaker - listener_lp).abs().mean()
    gap_sb = (vllm_speaker - base_lp).abs().mean()
    gap_lb = (listener_lp - base_lp).abs().mean()
    print(
        f"mean |dlogp| speaker-listener {gap_sl:.3f}, speaker-base {gap_sb:.3f}, "
        f"listener-base {gap_lb:.3f}"
    )
    assert min(gap_sl, gap_sb, gap_lb) > 0.01
    # vLLM itself gives three streams for the same seeds: each adapter's and the base's.
    base_engine = engines["speaker"].server.engine
    streams = []
    for eng in (engines["speaker"], engines["listener"], base_engine):
        start = eng.state_dict()
        eng.load_state_dict({"seed": 7, "calls": 0})
        streams.append([o.logprobs[0] for o in eng.generate(ids, PARAMS)])
        eng.load_state_dict(start)
    first = [torch.tensor(s) for s in streams]  # log-prob of each row's first token
    assert not torch.allclose(first[0], first[1], atol=1e-3)
    assert not torch.allclose(first[0], first[2], atol=1e-3)
    assert not torch.allclose(first[1], first[2], atol=1e-3)


def test_sync_follows_one_adapter_only(setup):
    pols, engines = setup
    speaker, listener = pols["speaker"], pols["listener"]
    ids = encode(speaker)
    start = {n: engines[n].state_dict() for n in NAMES}
    before = {n: engines[n].generate(ids, PARAMS) for n in NAMES}
    train(speaker, 20, steps=2)
    stale, old_rollout = trainer_vs_engine(speaker, ids, before["speaker"])
    moved = (stale - old_rollout).abs().mean()
    old_id = engines["speaker"].lora_request.lora_int_id
    engines["speaker"].sync()
    print(f"adapter sync: {engines['speaker'].last_sync_s * 1e3:.0f} ms")
    assert engines["speaker"].lora_request.lora_int_id != old_id
    for n in NAMES:
        engines[n].load_state_dict(start[n])
    after = {n: engines[n].generate(ids, PARAMS) for n in NAMES}
    new, rollout = trainer_vs_engine(speaker, ids, after["speaker"])
    follow = (new - rollout).abs()
    print(
        f"speaker update moved mean |dlogp| {moved:.3f}; after sync |vLLM - trainer| mean "
        f"{follow.mean():.2e}, max {follow.max():.2e}"
    )
    assert moved > 0.01 and follow.mean() <= 1e-3
    # The listener's adapter is untouched: same seeds, same tokens and log-probs.
    assert [o.token_ids for o in after["listener"]] == [o.token_ids for o in before["listener"]]
    assert [o.logprobs for o in after["listener"]] == [o.logprobs for o in before["listener"]]
    still, rollout_l = trainer_vs_engine(listener, ids, after["listener"])
    assert (still - rollout_l).abs().mean() <= 1e-3


def test_one_call_serves_both_adapters(setup):
    """Both policies' requests in one batcher flush take one ``llm.generate``, each prompt
    through its own adapter with the seeds its own call would have drawn: the samples are
    those of the two separate calls (vLLM's LoRA path on CPU is batch-invariant here)."""
    import asyncio
    import dataclasses

    from polyrl.core.rollout.batching import Batcher
    from polyrl.core.rollout.engine import Request

    pols, engines = setup
    ids = {
        n: encode(pols[n], texts)
        for n, texts in zip(NAMES, (("a 1", "b 2 3"), ("c",)), strict=True)
    }
    start = {n: engines[n].state_dict() for n in NAMES}
    apart = {n: engines[n].generate(ids[n], PARAMS) for n in NAMES}
    after = {n: engines[n].state_dict() for n in NAMES}
    for n in NAMES:
        engines[n].load_state_dict(start[n])
    batcher = Batcher(engines, in_thread=False)

    async def together() -> dict:
        asks = {n: [batcher.generate(n, Request(p), PARAMS) for p in ids[n]] for n in NAMES}
        tasks = {n: [asyncio.ensure_future(a) for a in asks[n]] for n in NAMES}
        await batcher.drive([t for ts in tasks.values() for t in ts])
        return {n: [c for t in ts for c in t.result()] for n, ts in tasks.items()}

    merged = asyncio.run(together())
    assert len(batcher.sizes) == 1 and batcher.mixed == 1  # one engine call for both
    for n in NAMES:
        assert engines[n].state_dict() == after[n]  # each handle's stream moved one call
        assert [c.token_ids for c in merged[n]] == [c.token_ids for c in apart[n]]
        got = torch.tensor([lp for c in merged[n] for lp in c.logprobs])
        want = torch.tensor([lp for c in apart[n] for lp in c.logprobs])
        print(f"{n}: merged vs apart max |dlogp| {(got - want).abs().max():.2e}")
        assert torch.allclose(got, want, atol=1e-5, rtol=0)
        # and each row went through its own adapter: the trainer's scores agree
        flat = [dataclasses.replace(o, prompt_index=k // PARAMS.n) for k, o in enumerate(merged[n])]
        trainer, rollout = trainer_vs_engine(pols[n], ids[n], flat)
        assert (trainer - rollout).abs().mean() <= 1e-3
