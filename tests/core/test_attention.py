"""polyrl_sdpa: one-token decoding attention equals transformers' SDPA function."""

from __future__ import annotations

import pytest
import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from polyrl.core.attention import NAME, decode_attention, decoding


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
    with torch.inference_mode():  # the engines' decoding
        ours, _ = decode_attention(module, q, key, value, am, scaling=0.3)
    ref, _ = sdpa_attention_forward(module, q, key, value, am, scaling=0.3)
    assert ours.shape == ref.shape == (b, 1, heads, d)
    torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-6)


def test_longer_queries_and_trainer_passes_are_sdpa_itself():
    """Only decoding (one query, inference mode) changes path: a trainer's pass, with or
    without gradients, computes exactly what SDPA computes, in local and Ray mode alike."""
    g = torch.Generator().manual_seed(1)
    module = _module(1)
    for q_len, mode in ((5, torch.inference_mode), (1, torch.no_grad), (1, torch.enable_grad)):
        q = torch.randn(2, 2, q_len, 8, generator=g)
        key, value = (torch.randn(2, 2, 5, 8, generator=g) for _ in range(2))
        with mode():
            ours, _ = decode_attention(module, q, key, value, None)
            ref, _ = sdpa_attention_forward(module, q, key, value, None)
        assert torch.equal(ours, ref), (q_len, mode)


def test_decoding_switches_for_the_block_only_and_keeps_the_outputs(tiny_model_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    ids = torch.tensor([[5, 6, 7, 8, 9], [0, 0, 7, 8, 9]])
    mask = (ids != 0).long()
    step_mask = torch.cat([mask, torch.ones(2, 1, dtype=torch.long)], 1)
    with torch.inference_mode():
        full = model(input_ids=ids, attention_mask=mask, use_cache=True)
        before = model(input_ids=ids[:, -1:] * 0 + 10, attention_mask=step_mask,
                       past_key_values=full.past_key_values)
        with decoding(model):
            assert model.config._attn_implementation == NAME
            full2 = model(input_ids=ids, attention_mask=mask, use_cache=True)
            after = model(input_ids=ids[:, -1:] * 0 + 10, attention_mask=step_mask,
                          past_key_values=full2.past_key_values)
    assert model.config._attn_implementation == "sdpa"  # the trainer's passes are SDPA's
    torch.testing.assert_close(full2.logits, full.logits, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(after.logits, before.logits, rtol=1e-5, atol=1e-5)
    model.save_pretrained(tmp_path)  # the export stays loadable anywhere
    assert NAME not in (tmp_path / "config.json").read_text()


def test_an_eager_model_is_left_alone(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, attn_implementation="eager")
    with decoding(model):
        assert model.config._attn_implementation == "eager"
