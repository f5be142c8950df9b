"""Two ``lora_agent`` policies on one tiny base and their requests, for the multi-adapter
engine tests (tests/marl/test_multi_lora_*.py)."""

from __future__ import annotations

import torch

from polyrl.core.rollout.engine import Request

NAMES = ("speaker", "listener")


def lora_pair(marl_config, *extra: str):
    """Two lora_agent policies on the tiny signaling base, with adapters that differ from
    each other and from the base (random lora_B: PEFT starts it at zero)."""
    from polyrl.core.registry import POLICIES

    cfg = marl_config(
        *(f"policies.{n}.{k}" for n in NAMES for k in ("kind=lora_agent", "lora.r=4")), *extra
    )
    torch.manual_seed(0)
    shared: dict = {}
    pols = {
        n: POLICIES.get(p.kind)(n, p, total_steps=1, need_reference=False, shared=shared)
        for n, p in cfg.policies.items()
    }
    for p in pols.values():
        state = p.trainable_state()
        p.load_trainable_state({k: v + 0.3 * torch.randn_like(v) for k, v in state.items()})
    return cfg, pols


def prompts(policy, texts):
    tok = policy.tokenizer
    chat = [
        tok.apply_chat_template(
            [{"role": "user", "content": t}], tokenize=False, add_generation_prompt=True
        )
        for t in texts
    ]
    return [tok.encode(c, add_special_tokens=False) for c in chat]


def mixed_asks(pols) -> dict[str, list[Request]]:
    """Each policy's requests: prompts of different lengths and short budgets, so rows leave
    the decode batch at different steps."""
    texts = {"speaker": ["object 1", "pick the object 2 3"], "listener": ["c", "dog 2", "ab"]}
    budgets = {"speaker": (2, None), "listener": (None, 1, 3)}
    return {
        n: [
            Request(p, max_new_tokens=b)
            for p, b in zip(prompts(pols[n], texts[n]), budgets[n], strict=True)
        ]
        for n in NAMES
    }


def assert_same_completions(got, want, atol: float) -> None:
    """A merged call's completions for one request list equal its separate call's: the
    same prompts and token ids, log-probs within ``atol``."""
    assert [c.prompt_index for c in got] == [c.prompt_index for c in want]
    assert [c.token_ids for c in got] == [c.token_ids for c in want]
    a = torch.tensor([x for c in got for x in c.logprobs])
    b = torch.tensor([x for c in want for x in c.logprobs])
    assert torch.allclose(a, b, atol=atol, rtol=0), (a - b).abs().max()
