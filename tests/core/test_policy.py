"""The causal-LM policy's log-prob pass: the shared-prefix path equals the full pass."""

from __future__ import annotations

import torch

from polyrl.core.record import text_record
from polyrl.core.train.passes import response_logprobs
from polyrl.core.train.policy import CausalLMPolicy, OptimConfig, PolicyConfig


def batch_with_groups(tok, n=4):
    """Three prompts of different lengths (so left padding differs), n responses each, of
    different lengths (so right padding differs), plus one row whose prompt is its own."""
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
    gen = torch.Generator().manual_seed(0)
    prompts, responses = [], []
    for i, p in enumerate(ids):
        for k in range(n):
            prompts.append(p)
            responses.append(torch.randint(5, 60, (2 + (i + k) % 5,), generator=gen).tolist())
    prompts.append(ids[0][:-2])
    responses.append([7, 8, 9])
    return text_record(
        prompt_ids=prompts,
        response_ids=responses,
        rollout_logprobs=[[0.0] * len(r) for r in responses],
        policy=["main"] * len(prompts),
        uid=list(range(len(prompts))),
        pad_id=tok.pad_token_id,
    )


def test_shared_prefix_equals_the_full_pass_in_values_and_gradients(tiny_model_dir):
    policy = CausalLMPolicy(
        "main",
        PolicyConfig(model=tiny_model_dir, optim=OptimConfig()),
        total_steps=1,
        need_reference=False,
    )
    batch = batch_with_groups(policy.tokenizer)
    mask = batch["response_mask"].bool()
    results = {}
    for shared in (False, True):
        policy.model.zero_grad()
        logp, ent = response_logprobs(policy.model, batch, 0.7, True, shared_prefix=shared)
        (logp * mask).sum().backward()
        grads = {k: p.grad.clone() for k, p in policy.model.named_parameters()}
        results[shared] = (logp[mask], ent[mask], grads)
    (lf, ef, gf), (ls, es, gs) = results[False], results[True]
    assert torch.allclose(lf, ls, atol=1e-5), (lf - ls).abs().max()
    assert torch.allclose(ef, es, atol=1e-5)
    for k in gf:
        # summed over every token, a gradient's rounding error scales with its largest
        # entries: avx512 kernels put embed_tokens 6.7e-6 apart at max |g| 19.3 (3.5e-7 of
        # it), so the floor is 2e-6 of the tensor's largest entry (about 16 float32 ulps)
        atol = 2e-6 * float(gf[k].abs().max())
        assert torch.allclose(gf[k], gs[k], rtol=1e-4, atol=atol), k
    assert any(g.abs().sum() > 0 for g in gs.values())


def test_all_distinct_prompts_take_the_full_pass_bitwise(tiny_model_dir):
    policy = CausalLMPolicy(
        "main", PolicyConfig(model=tiny_model_dir), total_steps=1, need_reference=False
    )
    batch = batch_with_groups(policy.tokenizer, n=1)
    with torch.no_grad():
        a, _ = response_logprobs(policy.model, batch, shared_prefix=False)
        b, _ = response_logprobs(policy.model, batch, shared_prefix=True)
    assert torch.equal(a, b)


def test_warm_start_hands_the_reference_its_weights_and_checkpoints_keep_them(tiny_model_dir):
    """KL anchors RL to the policy it starts from: after a warm start the frozen reference
    scores like the policy (KL 0 at RL step 1), and a checkpoint restores that reference
    in a fresh policy (a resumed run does not fall back to the pre-warm-start weights)."""
    from polyrl.core.train import trainer

    cfg = PolicyConfig(model=tiny_model_dir, optim=OptimConfig(lr=1e-2))
    policy = CausalLMPolicy("main", cfg, total_steps=10, need_reference=True)
    batch = batch_with_groups(policy.tokenizer)
    same = {"atol": 2e-6, "rtol": 1e-6}  # no-autograd pass: a few float32 ulps apart
    torch.testing.assert_close(
        policy.ref_logprobs(batch), policy.logprobs(batch)[0].detach(), **same
    )
    assert "reference" not in policy.state_dict()  # still the model's own initial weights
    with policy.sft_optimizer(1e-2):
        for _ in range(3):
            trainer.sft_update(policy, batch.clone())
    with torch.no_grad():
        now = policy.logprobs(batch)[0]
    fresh = CausalLMPolicy("main", cfg, total_steps=10, need_reference=True)
    assert (fresh.ref_logprobs(batch) - now).abs().max() > 1e-2  # the warm start moved it
    torch.testing.assert_close(policy.ref_logprobs(batch), now, **same)
    fresh.load_state_dict(policy.state_dict())
    assert torch.equal(fresh.ref_logprobs(batch), policy.ref_logprobs(batch))
