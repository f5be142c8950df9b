"""A CPU-friendly attention for one-token decoding steps, registered with `transformers`.

On CPU, PyTorch's fused ``scaled_dot_product_attention`` is tuned for long queries: with
one query token per row (every decoding step) it costs 2-3x an explicit
``softmax(q k^T) v`` on the shapes of small models (measured here: 4.2 ms against 1.8 ms
for 128 rows x 8 heads x 46 keys x 64 dims, one thread). Decoding runs that shape once per
layer per generated token, so the HF engine selects ``polyrl_sdpa`` through transformers'
public ``AttentionInterface`` registry: one-token queries on CPU under
``torch.inference_mode`` (the engines' decoding) take the explicit path; everything else
(prefill, every trainer pass, CUDA) is transformers' own SDPA function unchanged, so a
policy computes bit for bit the same whether or not an engine shares its model (local
mode) or not (a Ray worker).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from transformers import AttentionInterface, AttentionMaskInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import sdpa_mask

NAME = "polyrl_sdpa"


def decode_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                     value: torch.Tensor, attention_mask: torch.Tensor | None,
                     dropout: float = 0.0, scaling: float | None = None,
                     is_causal: bool | None = None, **kwargs) -> tuple[torch.Tensor, None]:
    """transformers' attention signature: ``query [B, H, Q, D]``, ``key/value [B, Hkv, K, D]``;
    returns ``([B, Q, H, D], None)`` like its SDPA function."""
    b, h, q_len, d = query.shape
    if (q_len != 1 or query.device.type != "cpu" or not torch.is_inference_mode_enabled()
            or kwargs.get("output_attentions") or kwargs.get("s_aux") is not None):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                      scaling=scaling, is_causal=is_causal, **kwargs)
    hkv = key.shape[1]
    scale = scaling if scaling is not None else d ** -0.5
    q = query.reshape(b, hkv, h // hkv, d)  # the query heads that share each KV head
    scores = torch.matmul(q, key.transpose(-1, -2)).float() * scale  # [B, Hkv, G, K]
    if attention_mask is not None:
        mask = attention_mask[:, :, -1:, -scores.shape[-1]:].reshape(b, 1, 1, -1)
        if mask.dtype == torch.bool:
            scores = scores.masked_fill(~mask, float("-inf"))
        else:
            scores = scores + mask
    probs = torch.softmax(scores, dim=-1).to(value.dtype)
    out = torch.matmul(probs, value)  # [B, Hkv, G, D]
    return out.reshape(b, 1, h, d), None


AttentionInterface.register(NAME, decode_attention)
AttentionMaskInterface.register(NAME, sdpa_mask)


@contextlib.contextmanager
def decoding(model: torch.nn.Module) -> Iterator[None]:
    """Run ``model`` with ``polyrl_sdpa`` inside the block (an engine's ``generate``).

    Only a model that runs SDPA switches, and it switches back on the way out: a trainer's
    passes keep transformers' own SDPA and its own masks (with ``polyrl_sdpa`` selected,
    transformers builds explicit masks where SDPA would skip them, which changes the
    float rounding), so local mode, where the engine shares the policy's model, trains
    exactly as a Ray worker does.
    """
    if getattr(model.config, "_attn_implementation", None) != "sdpa":
        yield
        return
    model.set_attn_implementation(NAME)
    try:
        yield
    finally:
        model.set_attn_implementation("sdpa")
