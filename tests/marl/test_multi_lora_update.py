"""Several ``lora_agent`` adapters in one forward/backward (marl/multi_lora.py) and the
batched update built on it (core/trainer.py ``update_together``), against the per-adapter
passes and the one-by-one update as they run today."""

from __future__ import annotations

import pytest
import torch

from polyrl.core.policy import response_logprobs
from polyrl.core.record import concat, text_record
from polyrl.marl.multi_lora import adapter_rows

NAMES = ("a0", "a1", "a2")


def make_agents(marl_config, names=NAMES, *overrides):
    """Lora_agent policies on one base, each adapter's B drawn at random (so adapters
    differ from the base and each other)."""
    from polyrl.core.registry import POLICIES

    model = marl_config().policies["speaker"].model
    sets = []
    for n in names:
        sets += [f"policies.{n}.model={model}", f"policies.{n}.kind=lora_agent"]
        sets += [f"policies.{n}.lora.r=4"]
    cfg = marl_config(*sets, *overrides)
    shared: dict = {}
    gen = torch.Generator().manual_seed(0)
    pols = {}
    for n in names:
        p = POLICIES.get("lora_agent")(
            n, cfg.policies[n], total_steps=4, need_reference=False, shared=shared
        )
        with torch.no_grad():
            for k, w in p._own.items():
                if ".lora_B." in k:
                    w.copy_(torch.randn(w.shape, generator=gen) * 0.05)
        pols[n] = p
    return cfg, pols


def rows(policy: str, prompts: list[list[int]], responses: list[list[int]]):
    return text_record(
        prompt_ids=prompts,
        response_ids=responses,
        rollout_logprobs=[[0.0] * len(r) for r in responses],
        policy=[policy] * len(prompts),
        uid=list(range(len(prompts))),
        pad_id=0,
    )


def batches():
    """Per-adapter rows: groups sharing long prompts (>= 16 tokens: packed passes share them
    as trees), a prompt also used by the other adapters, uneven lengths."""
    common = list(range(20, 40))
    out = []
    for k, _ in enumerate(NAMES):
        own = list(range(50 + 7 * k, 70 + 7 * k))
        prompts = [common, common, own, own, [5 + k, 6, 7]]
        responses = [[8, 9, 10], [8, 11], [9 + k] * (2 + k), [12, 13, 14, 15], [16]]
        out.append(rows(NAMES[k], prompts, responses))
    return out


def grads_of(pols):
    return {
        n: {k: w.grad.detach().clone() for k, w in p._own.items() if w.grad is not None}
        for n, p in pols.items()
    }


def zero(pols):
    for p in pols.values():
        for w in p._own.values():
            w.grad = None


@pytest.mark.parametrize("layout", ["padded", "packed", "tree"])
def test_routed_forward_equals_each_adapters_own(marl_config, layout):
    """Log-probs and each adapter's gradient from one routed pass over every adapter's rows
    equal the per-adapter passes, in the three layouts: padded (prompts shared through a
    KV cache), packed, and packed trees of shared prefixes (the long prompts). A prompt used
    by every adapter must not be shared across them."""
    pack = layout != "padded"
    opts = {"pack": pack, "min_shared": 10**6 if layout == "packed" else 16}
    _, pols = make_agents(marl_config)
    peft = pols["a0"]._peft
    parts = batches()
    weights = [
        torch.randn(b["response_ids"].shape, generator=torch.Generator().manual_seed(i))
        for i, b in enumerate(parts)
    ]
    peft.train(True)
    # today's passes: one adapter at a time
    want = []
    for p, b, w in zip(pols.values(), parts, weights, strict=True):
        lp = response_logprobs(p.model, b, **opts)[0]
        (lp * w).sum().backward()
        want.append(lp.detach())
    want_grads = grads_of(pols)
    zero(pols)
    # one pass over the union, each row through its own adapter
    union = concat(parts)
    ids = torch.cat([torch.full((b.batch_size[0],), k) for k, b in enumerate(parts)])
    with adapter_rows(peft, list(NAMES), trainable=NAMES) as router:
        union["prompt_ids"] = router.tag(union["prompt_ids"], ids)
        lp = response_logprobs(peft, union, **opts)[0]
    (lp * torch.cat(weights)).sum().backward()
    got_grads = grads_of(pols)
    peft.train(False)
    for k, part in enumerate(lp.detach().split([b.batch_size[0] for b in parts])):
        width = want[k].shape[1]
        assert torch.allclose(part[:, :width], want[k], atol=1e-5), k
        assert not part[:, width:].any()
    for n in NAMES:
        assert want_grads[n].keys() == got_grads[n].keys() and want_grads[n]
        for key, g in want_grads[n].items():
            assert torch.allclose(got_grads[n][key], g, atol=1e-5, rtol=1e-4), key


def test_per_row_ids_route_a_plain_forward(marl_config):
    """Untagged input (a generation's prefill or decode step): row i runs through the
    adapter set for it, as the same rows through that adapter alone."""
    _, pols = make_agents(marl_config)
    peft = pols["a0"]._peft
    ids = torch.tensor([[5, 6, 7, 8], [0, 9, 10, 11], [12, 13, 14, 15], [0, 0, 6, 7]])
    mask = (ids != 0).long()
    owner = [2, 0, 1, 2]
    with torch.no_grad():
        want = torch.stack(
            [
                pols[NAMES[k]]
                .model(input_ids=ids[i : i + 1], attention_mask=mask[i : i + 1])
                .logits[0]
                for i, k in enumerate(owner)
            ]
        )
        with adapter_rows(peft, list(NAMES)) as router:
            router.set_rows(owner)
            got = peft(input_ids=ids, attention_mask=mask).logits
            with pytest.raises(ValueError, match="per-row adapter ids"):
                peft(input_ids=ids[:2], attention_mask=mask[:2])
    keep = mask.bool()
    assert torch.allclose(got[keep], want[keep], atol=1e-5)
