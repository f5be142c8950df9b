"""Several ``lora_agent`` policies on one base served by ONE engine call (HF engine).

The merged decode loop runs every row through its own adapter at every step (prefill,
decode, rows leaving the batch); checked against each policy's own call, which runs
PEFT's single-adapter path, and against the trainer's teacher-forced log-probs. A marl
team and the agent gateway with two such policies take the merged path in real rollouts.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from polyrl.core.record import strings, text_record
from polyrl.core.rollout.engine import HFEngine, SamplingParams
from polyrl.marl import JOINT_POLICY
from polyrl.marl.signaling import make_row
from tests.helpers.lora import NAMES, assert_same_completions, lora_pair, mixed_asks, prompts

HERE = "tests.marl.test_multi_lora_engine"


def trainer_logprobs(policy, prompt_ids, outs):
    """The trainer's log-probs (teacher-forced, the policy's own adapter) of ``outs``."""
    rec = text_record(
        prompt_ids=[prompt_ids[o.prompt_index] for o in outs],
        response_ids=[o.token_ids for o in outs],
        rollout_logprobs=[o.logprobs for o in outs],
        policy=[policy.name] * len(outs),
        uid=list(range(len(outs))),
        pad_id=policy.tokenizer.pad_token_id,
    )
    with torch.no_grad():
        lp = policy.logprobs(rec)[0]
    m = rec["response_mask"].bool()
    return lp[m], rec["rollout_logprobs"][m]


def test_mixed_call_equals_each_policys_own_call(marl_config):
    _, pols = lora_pair(marl_config)
    engines = {n: HFEngine(p, seed=i) for i, (n, p) in enumerate(pols.items())}
    s, lis = engines["speaker"], engines["listener"]
    assert s.mix_key() == lis.mix_key() is not None
    asks = mixed_asks(pols)
    greedy = SamplingParams(n=2, temperature=0.0, max_new_tokens=6)
    apart = {n: engines[n].generate(asks[n], greedy) for n in NAMES}
    peft = pols["speaker"].model
    grads = {k: p.requires_grad for k, p in peft.named_parameters()}
    streamed: dict = {}  # each request's tokens as the loop samples them (Request.on_token)

    def sink(key):
        return lambda sample, tok, lp, top: streamed.setdefault((*key, sample), []).append(tok)

    listen = {n: [replace(r, on_token=sink((n, i))) for i, r in enumerate(asks[n])] for n in NAMES}
    merged = s.generate_mixed([(engines[n], listen[n]) for n in NAMES], greedy)
    assert grads == {k: p.requires_grad for k, p in peft.named_parameters()}
    for n, got in zip(NAMES, merged, strict=True):
        for j, c in enumerate(got):
            assert streamed[(n, c.prompt_index, j % greedy.n)] == c.token_ids
    for n, got in zip(NAMES, merged, strict=True):
        assert_same_completions(got, apart[n], atol=1e-5)
    # the two adapters really answer differently on a shared prompt
    same = prompts(pols["speaker"], ["object 1"])
    one = s.generate_mixed([(s, same), (lis, same)], greedy)
    assert [c.logprobs for c in one[0]] != [c.logprobs for c in one[1]]

    # sampled: every token of each row is its own adapter's (the trainer agrees)
    hot = SamplingParams(n=3, temperature=1.0, max_new_tokens=5)
    ids = {n: [r.prompt for r in asks[n]] for n in NAMES}
    merged = s.generate_mixed([(engines[n], ids[n]) for n in NAMES], hot)
    for n, got in zip(NAMES, merged, strict=True):
        trainer, engine = trainer_logprobs(pols[n], ids[n], got)
        assert torch.allclose(trainer, engine, atol=1e-4, rtol=0), (trainer - engine).abs().max()
        other = pols["listener" if n == "speaker" else "speaker"]
        wrong, _ = trainer_logprobs(other, ids[n], got)
        assert (wrong - engine).abs().max() > 1e-2


def test_a_marl_team_takes_one_call_per_round(marl_config, make_items):
    from polyrl.core.registry import ENGINES, WORKFLOWS
    from polyrl.core.rollout.workflow import Context

    cfg, pols = lora_pair(
        marl_config,
        "rollout.workflow=parallel",
        "rollout.args={agents: [{name: a, policy: speaker}, {name: b, policy: listener}]}",
    )
    # the engines a run builds: engine.name's default, auto (the HF engine on CPU)
    engines = {
        n: ENGINES.get(cfg.policies[n].engine.name)(p, seed=i)
        for i, (n, p) in enumerate(pols.items())
    }
    assert {cfg.policies[n].engine.name for n in NAMES} == {"auto"}
    wf = WORKFLOWS.get(cfg.rollout.workflow)(Context(cfg, pols, engines), **cfg.rollout.args)
    rows = [make_row("apple", ["cat", "apple", "dog"], "QXZJ"), make_row("dog", ["dog"], "QXZJ")]
    rec = wf.rollout(make_items(rows), SamplingParams(n=2, temperature=1.0, max_new_tokens=3))
    m = wf.rollout_metrics()
    assert m["marl/generate_rounds"] == 1 and m["marl/engine_calls"] == 1
    assert m["marl/generate_calls/speaker"] == m["marl/generate_calls/listener"] == 1
    # each agent row's sampled log-probs are its own policy's (the trainer recomputes them)
    policy = strings(rec, "policy")
    for n in NAMES:
        idx = [i for i, p in enumerate(policy) if p == n]
        assert len(idx) == 4 and JOINT_POLICY not in n
        sub = rec[idx]
        with torch.no_grad():
            lp = pols[n].logprobs(sub)[0]
        mask = sub["response_mask"].bool()
        assert torch.allclose(lp[mask], sub["rollout_logprobs"][mask], atol=1e-4, rtol=0)


def one_chat(row, ep):
    """A gateway agent: one chat completion from the row's model."""
    r = ep.openai().chat.completions.create(
        model=row["model"],
        messages=[{"role": "user", "content": row["prompt"]}],
        max_tokens=3,
        logprobs=True,
    )
    return float(len(r.choices[0].message.content) > 0)


def test_the_gateway_serves_two_lora_models_in_one_call(marl_config, make_items):
    from polyrl.agents.gateway import Gateway
    from polyrl.core.rollout.workflow import Context

    _, pols = lora_pair(marl_config)
    engines = {n: HFEngine(p, seed=i) for i, (n, p) in enumerate(pols.items())}
    wf = Gateway(Context(None, pols, engines), agent=f"{HERE}:one_chat")
    try:
        data = [{"prompt": "pick 1", "model": n} for n in NAMES]
        rec = wf.rollout(make_items(data), SamplingParams(n=1, temperature=1.0, max_new_tokens=3))
        batcher = wf.server.batcher
        assert batcher.mixed == 1 and len(batcher.sizes) == 1
        assert dict(batcher.calls) == {"speaker": 1, "listener": 1}
    finally:
        wf.close()
    policy = strings(rec, "policy")
    for n in NAMES:
        idx = [i for i, p in enumerate(policy) if p == n]
        sub = rec[idx]
        with torch.no_grad():
            lp = pols[n].logprobs(sub)[0]
        mask = sub["response_mask"].bool()
        assert mask.any()
        assert torch.allclose(lp[mask], sub["rollout_logprobs"][mask], atol=1e-4, rtol=0)
