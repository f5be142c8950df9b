"""A Qwen-VL vision tower's FLOPs: the count from its modules and config against what
torch's FLOP counter counts of a real forward, for each family (Qwen2.5-VL's windowed
blocks included), on images of several grids and a video."""

from __future__ import annotations

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from polyrl.multimodal.flops import vision_flops

GRIDS = [(1, 8, 8), (1, 12, 20), (2, 8, 12)]  # patch grids: two images, a 2-frame video


def _qwen2_vl():
    from transformers.models.qwen2_vl.configuration_qwen2_vl import Qwen2VLVisionConfig
    from transformers.models.qwen2_vl.modeling_qwen2_vl import (
        Qwen2VisionTransformerPretrainedModel,
    )

    cfg = Qwen2VLVisionConfig(depth=2, embed_dim=32, hidden_size=48, num_heads=2, mlp_ratio=2)
    return Qwen2VisionTransformerPretrainedModel, cfg


def _qwen2_5_vl():
    from transformers.models.qwen2_5_vl.configuration_qwen2_5_vl import Qwen2_5_VLVisionConfig
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import (
        Qwen2_5_VisionTransformerPretrainedModel,
    )

    cfg = Qwen2_5_VLVisionConfig(
        depth=3,
        hidden_size=32,
        intermediate_size=48,
        num_heads=2,
        out_hidden_size=48,
        fullatt_block_indexes=[1],
        window_size=112,  # 4 x 4 merged groups (8 x 8 patches) a window
    )
    return Qwen2_5_VisionTransformerPretrainedModel, cfg


def _qwen3_vl():
    from transformers.models.qwen3_vl.configuration_qwen3_vl import Qwen3VLVisionConfig
    from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLVisionModel

    cfg = Qwen3VLVisionConfig(
        depth=2,
        hidden_size=32,
        intermediate_size=48,
        num_heads=2,
        out_hidden_size=48,
        num_position_embeddings=64,
        deepstack_visual_indexes=[0],
    )
    return Qwen3VLVisionModel, cfg


@pytest.mark.parametrize("family", [_qwen2_vl, _qwen2_5_vl, _qwen3_vl])
def test_the_towers_count_is_what_torch_counts(family):
    cls, cfg = family()
    cfg._attn_implementation = "eager"  # attention as matmuls torch's counter sees
    torch.manual_seed(0)
    tower = cls._from_config(cfg).eval()
    grid = torch.tensor(GRIDS)
    size = cfg.in_channels * cfg.temporal_patch_size * cfg.patch_size**2
    pixels = torch.randn(int(grid.prod(-1).sum()), size)
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        tower(pixels, grid_thw=grid)
    assert vision_flops(tower, cfg, GRIDS) == counter.get_total_flops()
    # the images one at a time cost what they cost together (attention stays per frame)
    assert sum(vision_flops(tower, cfg, [g]) for g in GRIDS) == vision_flops(tower, cfg, GRIDS)
