"""What a denoising step costs: the FLOPs of one SD3 (MMDiT) transformer call, from its
config, for :mod:`polyrl.core.observe.throughput`'s images/s and MFU of diffusion policies.

A call on one image of ``S`` latent patches (``S = (h / p) * (w / p)`` for latents
``[C, h, w]`` and patch size ``p``) with ``T`` prompt-embedding tokens, inner width
``d = heads * head_dim``, counts 2 FLOPs per multiply-add of every matrix product and
convolution (what ``torch.utils.flop_counter`` counts; ``tests/diffusion/test_flops.py``
checks it against that counter on a real model):

- patch embedding ``2 S (C p^2) d``; projection out ``2 S d (p^2 C_out)``;
- prompt projection ``2 T J d_c`` (``J = joint_attention_dim``, ``d_c`` the caption width);
- timestep and pooled-text embeddings ``2 (256 d + d^2 + P d + d^2)`` (``P`` the pooled width);
- each of the ``L`` blocks: the image and prompt streams' q, k, v and out projections
  ``2 (S + T) 4 d^2`` (the last block's prompt stream has no out projection),
  joint attention over all ``S + T`` tokens ``4 (S + T)^2 d`` (scores and weighted sum),
  the GELU MLPs (width ``4d``) ``2 (S + T) 8 d^2`` (the last block: the image's alone), the
  adaptive norms' modulation ``2 d (6d + 6d)`` (the last block's prompt norm ``2d``; a
  dual-attention block's image norm ``9d``), and a dual-attention block's second,
  image-only attention ``2 S 4 d^2 + 4 S^2 d``;
- the final norm's modulation ``2 d 2d``.

A sampling step calls it once, or twice with classifier-free guidance (``guidance > 1``);
a trained step runs its forward and backward (3 calls' worth), plus the unconditional
call without gradient when guidance is trained (``train_cfg``). LoRA's low-rank products
are not counted (a small fraction).
"""

from __future__ import annotations

from typing import Any

TIMESTEP_CHANNELS = 256  # diffusers' Timesteps(num_channels=256) ahead of the embedding MLP


def sd3_call_flops(config: Any, latent_shape: tuple[int, ...], text_tokens: int) -> float:
    """FLOPs of one SD3Transformer2DModel call on one image (see the module docstring)."""
    p, layers = config.patch_size, config.num_layers
    d = config.num_attention_heads * config.attention_head_dim
    c_in, h, w = latent_shape[-3:]
    c_out = config.out_channels or c_in
    s, t = (h // p) * (w // p), text_tokens
    caption = config.caption_projection_dim
    dual = set(getattr(config, "dual_attention_layers", None) or ())
    flops = 2.0 * s * c_in * p * p * d + 2.0 * s * d * p * p * c_out
    flops += 2.0 * t * config.joint_attention_dim * caption
    flops += 2.0 * (TIMESTEP_CHANNELS * d + d * d + config.pooled_projection_dim * d + d * d)
    for i in range(layers):
        last = i == layers - 1  # the prompt stream ends here (context_pre_only)
        flops += 2.0 * s * 4 * d * d + 2.0 * t * (3 if last else 4) * d * d
        flops += 4.0 * (s + t) ** 2 * d
        flops += 2.0 * (s + (0 if last else t)) * 8 * d * d
        flops += 2.0 * d * ((9 if i in dual else 6) * d + (2 if last else 6) * d)
        if i in dual:
            flops += 2.0 * s * 4 * d * d + 4.0 * s * s * d
    return flops + 2.0 * d * 2 * d
