"""What a Qwen-VL vision tower costs: the FLOPs of encoding images (and video frames) of
given patch grids, for the MFU of a VL policy (:mod:`polyrl.core.observe.throughput`).

A grid ``(t, h, w)`` is ``t * h * w`` patches. Each patch goes through the patch embedding
and every block's projections (2 FLOPs per weight it multiplies: the ``Linear`` and
``Conv3d`` weights of the tower, read off the module); each group of ``spatial_merge_size
** 2`` patches goes through the merger (and Qwen3-VL's deepstack mergers), every module
whose name holds ``merger``. Attention in a block costs ``4 * n * n * width`` for each group
of ``n`` patches that attend to each other (scores and weighted sum; ``width`` the tower's
hidden size): a frame of an image (``h * w`` patches) in full-attention blocks, a window of
it in Qwen2.5-VL's windowed blocks (those not in ``fullatt_block_indexes``), with the
windows transformers' own ``get_vision_window_index`` cuts.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

Grid = tuple[int, int, int]


def tower_weights(visual: torch.nn.Module) -> tuple[int, int]:
    """(weights each patch multiplies, weights each merged group multiplies) of a tower."""
    per_patch = per_group = 0
    for name, m in visual.named_modules():
        if not isinstance(m, torch.nn.Linear | torch.nn.Conv3d | torch.nn.Conv2d):
            continue
        if "merger" in name:
            per_group += m.weight.numel()
        else:
            per_patch += m.weight.numel()
    return per_patch, per_group


def attention_groups(config: Any, grids: Sequence[Grid]) -> list[list[int]]:
    """For each block of the tower: the sizes of the groups of patches attending together."""
    full = [h * w for t, h, w in grids for _ in range(t)]  # each frame of each image
    windowed = getattr(config, "fullatt_block_indexes", None)
    if windowed is None or not grids:  # Qwen2-VL, Qwen3-VL: full attention everywhere
        return [full] * config.depth
    from transformers.vision_utils import get_vision_window_index

    _, cu = get_vision_window_index(
        torch.tensor(grids), config.spatial_merge_size, config.window_size, config.patch_size
    )
    cu = torch.as_tensor(cu).unique_consecutive()  # windows with patches in them
    windows = (cu[1:] - cu[:-1]).tolist()
    return [full if i in windowed else windows for i in range(config.depth)]


def vision_flops(visual: torch.nn.Module, config: Any, grids: Sequence[Grid]) -> float:
    """FLOPs of one forward of the tower ``visual`` (vision config ``config``) over images
    and videos of these patch grids."""
    per_patch, per_group = tower_weights(visual)
    patches = sum(t * h * w for t, h, w in grids)
    groups = patches // config.spatial_merge_size**2
    width = getattr(config, "embed_dim", None) or config.hidden_size
    attention = sum(4.0 * n * n * width for block in attention_groups(config, grids) for n in block)
    return 2.0 * per_patch * patches + 2.0 * per_group * groups + attention
