"""The padded and packed log-prob passes the packing and prefix-sharing tests compare."""

from __future__ import annotations

import torch

from polyrl.core.train.passes import response_logprobs
from polyrl.core.train.policy import CausalLMPolicy, OptimConfig, PolicyConfig


def make_policy(model_dir, *, attn="sdpa", lora=0, **kw):
    """A CausalLMPolicy (lr 1e-3, no clipping) with LoRA rank ``lora`` and attention ``attn``."""
    from polyrl.core.train.policy import LoraConfig

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
