"""Routing replay with partial rollouts (issue 32): when the engine takes new weights
between decoding steps (``rollout.partial``), each token's recorded experts are those of
the version that routed it, so replay repeats the computation that really sampled.

The reference is independent of the engine and of core/train/moe.py: the step-by-step forward of
tests/helpers/partial.py (the prompt pass with the old weights, each later token fed with
the weights of the version its step used, on the cache the earlier passes left), with each
router's top-k computed by hand from its input and weight.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache

from polyrl.core.demo.tiny import tiny_qwen3_moe
from polyrl.core.rollout.engine import HFEngine, SamplingParams
from polyrl.core.train.moe import routers
from polyrl.core.train.policy import CausalLMPolicy, PolicyConfig
from tests.helpers.partial import moved, switching_refresh
from tests.helpers.trainer import chat_ids

K = 2


@torch.no_grad()
def _mixed_routing(model, states, prompt, tokens, versions) -> torch.Tensor:
    """Experts [prompt + response - 1, L, k] of the step-by-step forward in which step t
    (feeding the prompt for t = 0, token t - 1 after) runs with ``states[versions[t]]``:
    each router's top-k of softmax(input @ weight.T), by hand."""
    seen: list[torch.Tensor] = []
    hooks = [
        r.register_forward_pre_hook(
            lambda m, args: seen.append(
                torch.softmax(args[0].reshape(-1, args[0].shape[-1]) @ m.weight.T, -1)
                .topk(K, -1)
                .indices
            )
        )
        for r in routers(model)
    ]
    cache, rows = DynamicCache(), []
    inputs = torch.tensor([prompt])
    try:
        for t, v in enumerate(versions):
            model.load_state_dict(states[v])
            pos = torch.arange(len(prompt) + t - inputs.shape[1], len(prompt) + t)[None]
            seen.clear()
            model(input_ids=inputs, position_ids=pos, past_key_values=cache, use_cache=True)
            rows.append(torch.stack(seen, 1))  # [tokens fed, L, k]
            inputs = torch.tensor([[tokens[t]]])
    finally:
        for h in hooks:
            h.remove()
    return torch.cat(rows)


def test_partial_call_records_each_tokens_experts_from_its_version(tmp_path):
    path = tiny_qwen3_moe(tmp_path / "moe", pretrain_steps=30)
    policy = CausalLMPolicy(
        "main", PolicyConfig(model=str(path)), total_steps=1, need_reference=False
    )
    model = policy.model
    old = {k: v.clone() for k, v in model.state_dict().items()}
    new = moved(old, 0.5, seed=1)  # a big update: many tokens route elsewhere under it
    states = {0: old, 1: new}
    engine = HFEngine(policy, seed=0)
    calls: list[int] = []
    engine.set_refresh(switching_refresh(model, new, calls))
    prompts = chat_ids(policy.tokenizer, ("12+7=", "3+4="))
    params = SamplingParams(n=2, temperature=1.0, max_new_tokens=8, stop_token_ids=[])
    outs = engine.generate(prompts, params)
    engine.set_refresh(None)
    spanning, before_differs = 0, 0
    for o in outs:
        experts = (o.prompt + o.tokens).experts  # prompt then response
        prompt, fed = prompts[o.prompt_index], len(prompts[o.prompt_index]) + len(o.token_ids) - 1
        assert o.tokens.versions is not None and experts is not None
        want = _mixed_routing(model, states, prompt, o.token_ids, o.tokens.versions)
        assert want.shape[0] == fed
        got = experts[:fed].long()
        assert torch.equal(got.sort(-1).values, want.sort(-1).values)
        assert bool((experts[fed:] == -1).all())
        if 0 in o.tokens.versions and 1 in o.tokens.versions:
            spanning += 1
            # what the new version alone would have chosen for the tokens the old one routed
            # (the prompt and the responses fed before the switch): not what was recorded
            alone = _mixed_routing(model, states, prompt, o.token_ids, [1] * len(o.tokens.versions))
            early = len(prompt) + o.tokens.versions.index(1) - 1
            before_differs += int(
                (alone[:early].sort(-1).values != got[:early].sort(-1).values).any()
            )
    assert spanning > 0, [o.tokens.versions for o in outs]  # the switch fell inside responses
    assert before_differs == spanning  # so the check above could tell the versions apart
