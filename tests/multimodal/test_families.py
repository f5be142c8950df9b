"""The VL forward pass against each family's own ``forward``: Qwen2-VL, Qwen2.5-VL, Qwen3-VL.

Tiny random models of each family: logits from :func:`forward.vl_forward` (features once
per distinct prompt, positions from get_rope_index, Qwen3-VL's deepstack features placed
by hand) must equal ``model(input_ids, pixel_values, image_grid_thw, ...)``.
"""

from __future__ import annotations

import pytest
import torch

from polyrl.core.record import pad_left
from polyrl.multimodal import forward, vision

VOCAB, IMG, VID, START, END = 64, 60, 61, 62, 63


def _qwen2_vl():
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration

    cfg = Qwen2VLConfig(
        text_config={
            "vocab_size": VOCAB,
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_hidden_layers": 2,
            "num_attention_heads": 2,
            "num_key_value_heads": 2,
            "rope_parameters": {
                "rope_type": "default",
                "rope_theta": 10000.0,
                "mrope_section": [4, 6, 6],
            },
        },
        vision_config={
            "depth": 1,
            "embed_dim": 32,
            "hidden_size": 64,
            "num_heads": 2,
            "mlp_ratio": 2,
            "patch_size": 14,
            "spatial_merge_size": 2,
            "temporal_patch_size": 2,
        },
        image_token_id=IMG,
        video_token_id=VID,
        vision_start_token_id=START,
        vision_end_token_id=END,
    )
    return Qwen2VLForConditionalGeneration(cfg), 14


def _qwen2_5_vl():
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    cfg = Qwen2_5_VLConfig(
        text_config={
            "vocab_size": VOCAB,
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_hidden_layers": 2,
            "num_attention_heads": 2,
            "num_key_value_heads": 2,
            "rope_parameters": {
                "rope_type": "default",
                "rope_theta": 10000.0,
                "mrope_section": [4, 6, 6],
            },
        },
        vision_config={
            "depth": 2,
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_heads": 2,
            "out_hidden_size": 64,
            "fullatt_block_indexes": [1],
            "window_size": 56,
        },
        image_token_id=IMG,
        video_token_id=VID,
        vision_start_token_id=START,
        vision_end_token_id=END,
    )
    return Qwen2_5_VLForConditionalGeneration(cfg), 14


def _qwen3_vl():
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

    cfg = Qwen3VLConfig(
        text_config={
            "vocab_size": VOCAB,
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_hidden_layers": 2,
            "num_attention_heads": 2,
            "num_key_value_heads": 2,
            "head_dim": 32,
            "rope_parameters": {
                "rope_type": "default",
                "rope_theta": 10000.0,
                "mrope_section": [6, 5, 5],
                "mrope_interleaved": True,
            },
        },
        vision_config={
            "depth": 2,
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_heads": 2,
            "out_hidden_size": 64,
            "deepstack_visual_indexes": [0],
            "num_position_embeddings": 64,
            "patch_size": 16,
        },
        image_token_id=IMG,
        video_token_id=VID,
        vision_start_token_id=START,
        vision_end_token_id=END,
    )
    return Qwen3VLForConditionalGeneration(cfg), 16


@pytest.mark.parametrize(
    "build", [_qwen2_vl, _qwen2_5_vl, _qwen3_vl], ids=["qwen2-vl", "qwen2.5-vl", "qwen3-vl"]
)
def test_vl_forward_equals_the_models_own(build, one_thread):
    torch.manual_seed(0)
    model, patch = build()
    model.eval()
    p = forward.parts(model)
    assert p.deepstack == (build is _qwen3_vl)
    dim = 3 * 2 * patch * patch
    grids = {"a": torch.tensor([[1, 4, 6]]), "b": torch.tensor([[1, 2, 2], [1, 4, 2]])}
    inputs = {
        k: vision.VisionInputs(k, torch.randn(int(g.prod(-1).sum()), dim), g)
        for k, g in grids.items()
    }

    def prompt(key):
        ids = [1, 2, START]
        for g in grids[key].tolist():
            ids += [IMG] * (g[0] * g[1] * g[2] // 4) + [END, 3]
        return ids + [4, 5]

    rows = [inputs["a"], inputs["a"], None, inputs["b"]]
    seqs = [prompt("a"), prompt("a") + [7, 8], [1, 2, 3, 9, 9], prompt("b")]
    ids, mask = pad_left(seqs, 0)
    before = vision.COUNTERS["vision_passes"]
    with torch.no_grad():
        mine, _, _ = forward.vl_forward(model, ids, mask, rows, logits_to_keep=ids.shape[1])
        assert vision.COUNTERS["vision_passes"] == before + 1  # a, b: one pass for both
        pv = torch.cat(
            [inputs["a"].pixel_values, inputs["a"].pixel_values, inputs["b"].pixel_values]
        )
        grid = torch.cat([grids["a"], grids["a"], grids["b"]])
        theirs = model(
            input_ids=ids,
            attention_mask=mask,
            pixel_values=pv,
            image_grid_thw=grid,
            mm_token_type_ids=(ids == IMG).int(),
        ).logits
    keep = mask.bool()
    assert torch.allclose(mine[keep], theirs[keep], atol=1e-5), (mine - theirs).abs().max()
