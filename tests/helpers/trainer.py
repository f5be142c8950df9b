"""Tiny causal-LM policies, records sampled from them, and the gradients the optimizer sees."""

from __future__ import annotations

import torch

from polyrl.core.record import text_record
from polyrl.core.rollout.engine import HFEngine, SamplingParams
from polyrl.core.train.algorithms import AlgorithmConfig
from polyrl.core.train.credit import group_credit
from polyrl.core.train.policy import CausalLMPolicy, OptimConfig, PolicyConfig

TEXTS = ("12+7=", "3+4=", "25+30=", "8+8=")  # arithmetic prompts the tiny model knows


def chat_ids(tok, texts=TEXTS) -> list[list[int]]:
    """Each text as a one-turn user chat with the generation prompt, as token ids."""
    return [
        tok.encode(
            tok.apply_chat_template(
                [{"role": "user", "content": t}], tokenize=False, add_generation_prompt=True
            ),
            add_special_tokens=False,
        )
        for t in texts
    ]


def make_policy(model_dir, name="main", lr=1e-3, micro=64, max_grad_norm=1.0, **kw):
    """A CausalLMPolicy on ``model_dir`` (no reference model); ``kw`` goes to PolicyConfig."""
    cfg = PolicyConfig(
        model=model_dir,
        optim=OptimConfig(lr=lr, max_grad_norm=max_grad_norm),
        micro_batch_size=micro,
        **kw,
    )
    return CausalLMPolicy(name, cfg, total_steps=10, need_reference=False)


def sampled_record(policy, seed: int = 0, n: int = 4, name: str = "main"):
    """A GRPO-ready record: ``n`` HF-engine samples (6 tokens) per prompt of ``TEXTS``, random
    0/1 rewards from ``seed``, group credit assigned."""
    tok = policy.tokenizer
    ids = chat_ids(tok)
    outs = HFEngine(policy, seed=seed).generate(ids, SamplingParams(n=n, max_new_tokens=6))
    rec = text_record(
        prompt_ids=[ids[o.prompt_index] for o in outs],
        response_ids=[o.token_ids for o in outs],
        rollout_logprobs=[o.logprobs for o in outs],
        policy=[name] * len(outs),
        uid=[o.prompt_index for o in outs],
        pad_id=tok.pad_token_id,
    )
    gen = torch.Generator().manual_seed(seed)
    rec["reward"] = torch.randint(0, 2, (len(outs),), generator=gen).float()
    group_credit(rec, AlgorithmConfig())
    return rec


def grads_at_step(policy) -> list:
    """A list that gets, at each optimizer step, the gradients it steps with."""
    seen = []
    policy.optimizer.register_step_pre_hook(
        lambda opt, args, kwargs: seen.append(
            [p.grad.clone() for g in opt.param_groups for p in g["params"]]
        )
    )
    return seen
