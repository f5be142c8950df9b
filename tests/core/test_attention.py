"""polyrl_sdpa: one-token decoding attention equals transformers' SDPA function."""

from __future__ import annotations

import pytest
import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from polyrl.core.attention import NAME, decode_attention, use_decode_attention


def _module(groups: int) -> torch.nn.Module:
    m = torch.nn.Module()
    m.num_key_value_groups = groups
    m.is_causal = True
    return m


def _mask(kind: str, b: int, q: int, k: int) -> torch.Tensor | None:
    if kind == "none":
        return None
    keep = torch.ones(b, 1, q, k, dtype=torch.bool)
    keep[0, :, :, :3] = False  # row 0 is left-padded by three positions
    keep[1, :, :, :1] = False
    if kind == "bool":
        return keep
    return torch.zeros(b, 1, q, k).masked_fill(~keep, torch.finfo(torch.float32).min)


@pytest.mark.parametrize("mask", ["none", "bool", "float"])
@pytest.mark.parametrize(("heads", "kv_heads"), [(4, 4), (4, 2), (6, 1)])
def test_one_token_queries_match_sdpa(mask, heads, kv_heads):
    g = torch.Generator().manual_seed(0)
    b, k, d = 3, 11, 16
    q = torch.randn(b, heads, 1, d, generator=g)
    key = torch.randn(b, kv_heads, k, d, generator=g)
    value = torch.randn(b, kv_heads, k, d, generator=g)
    module = _module(heads // kv_heads)
    am = _mask(mask, b, 1, k)
    ours, _ = decode_attention(module, q, key, value, am, scaling=0.3)
    ref, _ = sdpa_attention_forward(module, q, key, value, am, scaling=0.3)
    assert ours.shape == ref.shape == (b, 1, heads, d)
    torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-6)


def test_longer_queries_are_sdpa_itself():
    g = torch.Generator().manual_seed(1)
    q, key, value = (torch.randn(2, 2, 5, 8, generator=g) for _ in range(3))
    module = _module(1)
    ours, _ = decode_attention(module, q, key, value, None)
    ref, _ = sdpa_attention_forward(module, q, key, value, None)
    assert torch.equal(ours, ref)


def test_switching_a_model_keeps_its_outputs_and_its_saved_config(tiny_model_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    ids = torch.tensor([[5, 6, 7, 8, 9], [0, 0, 7, 8, 9]])
    mask = (ids != 0).long()
    with torch.no_grad():
        full = model(input_ids=ids, attention_mask=mask, use_cache=True)
        before = model(input_ids=ids[:, -1:] * 0 + 10, attention_mask=torch.cat(
            [mask, torch.ones(2, 1, dtype=torch.long)], 1), past_key_values=full.past_key_values)
    assert use_decode_attention(model)
    assert model.config._attn_implementation == NAME
    assert not use_decode_attention(model)  # already switched: nothing to do
    with torch.no_grad():
        full2 = model(input_ids=ids, attention_mask=mask, use_cache=True)
        after = model(input_ids=ids[:, -1:] * 0 + 10, attention_mask=torch.cat(
            [mask, torch.ones(2, 1, dtype=torch.long)], 1), past_key_values=full2.past_key_values)
    torch.testing.assert_close(full2.logits, full.logits, rtol=0, atol=0)  # prefill: SDPA
    torch.testing.assert_close(after.logits, before.logits, rtol=1e-5, atol=1e-5)
    model.save_pretrained(tmp_path)  # the export stays loadable anywhere
    assert NAME not in (tmp_path / "config.json").read_text()


def test_an_eager_model_is_left_alone(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, attn_implementation="eager")
    assert not use_decode_attention(model)
    assert model.config._attn_implementation == "eager"
