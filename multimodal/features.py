"""What the Qwen-VL language model takes: image and video features placed in the input
embeddings, and M-RoPE positions.

:func:`embed` computes the vision features once per distinct prompt in a batch (rows that
share a :class:`~polyrl.multimodal.vision.VisionInputs` share its features: one vision-tower
pass per group, gradients flow to every use) and puts them at the placeholders;
:func:`rope_index` runs the model's own ``get_rope_index`` (video grids and
``second_per_grid_ts`` too). A batch without images can run the vision tower on a dummy
patch with weight zero (:func:`dummy_features`), so FSDP ranks never disagree about which
parameters took part. :mod:`polyrl.multimodal.forward` runs the passes on top.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any

import torch

from polyrl.multimodal.vision import COUNTERS, VisionInputs


def hf_model(model: torch.nn.Module) -> torch.nn.Module:
    """The `transformers` model under a PEFT wrapper (or the model itself)."""
    get = getattr(model, "get_base_model", None)
    return get() if callable(get) else model


@dataclass
class Parts:
    inner: Any  # Qwen*VLModel: .visual, .language_model, get_rope_index
    visual: torch.nn.Module
    language_model: torch.nn.Module
    lm_head: torch.nn.Module
    image_token_id: int
    merge_size: int
    patch_dim: int  # channels * temporal_patch * patch * patch
    deepstack: bool  # Qwen3-VL injects vision features into early LM layers
    video_token_id: int | None = None


def parts(model: torch.nn.Module) -> Parts:
    hf = hf_model(model)
    inner = getattr(hf, "model", None)
    if inner is None or not hasattr(inner, "visual") or not hasattr(inner, "language_model"):
        raise TypeError(
            f"{type(hf).__name__} is not a Qwen2-VL/Qwen2.5-VL/Qwen3-VL model "
            "(expected .model.visual and .model.language_model)"
        )
    vcfg = hf.config.vision_config
    patch = vcfg.patch_size if isinstance(vcfg.patch_size, int) else vcfg.patch_size[0]
    temporal = (
        vcfg.temporal_patch_size
        if isinstance(vcfg.temporal_patch_size, int)
        else vcfg.temporal_patch_size[0]
    )
    video_id = getattr(hf.config, "video_token_id", None)
    return Parts(
        inner=inner,
        visual=inner.visual,
        language_model=inner.language_model,
        lm_head=hf.lm_head,
        image_token_id=int(hf.config.image_token_id),
        merge_size=int(vcfg.spatial_merge_size),
        patch_dim=int(getattr(vcfg, "in_channels", getattr(vcfg, "in_chans", 3)))
        * temporal
        * patch
        * patch,
        deepstack=bool(getattr(vcfg, "deepstack_visual_indexes", None)),
        video_token_id=None if video_id is None else int(video_id),
    )


def token_mask(p: Parts, ids: torch.Tensor, video: bool = False) -> torch.Tensor:
    """Positions holding the image (or video) token id."""
    token = p.video_token_id if video else p.image_token_id
    return torch.zeros_like(ids, dtype=torch.bool) if token is None else ids == token


@dataclass
class Grids:
    """The grids of a batch's images and videos in row order (what ``get_rope_index`` and the
    vision tower take); None where the batch has none."""

    image: torch.Tensor | None = None
    video: torch.Tensor | None = None
    second_per_grid: torch.Tensor | None = None


def batch_grids(rows: list[VisionInputs | None], device: torch.device | None = None) -> Grids:
    """Image grids, video grids and seconds per temporal step of ``rows``, in row order."""
    images = [v.image_grid_thw for v in rows if v is not None and v.num_images]
    videos = [v for v in rows if v is not None and v.num_videos]
    return Grids(
        torch.cat(images).to(device) if images else None,
        torch.cat([v.video_grid_thw for v in videos]).to(device) if videos else None,
        torch.cat([_seconds(v) for v in videos]).to(device) if videos else None,
    )


def _seconds(v: VisionInputs) -> torch.Tensor:
    if v.second_per_grid_ts is None:
        raise ValueError(f"{v.key}: videos without second_per_grid_ts")
    return v.second_per_grid_ts.reshape(-1).to(torch.float32)


def rope_index(
    p: Parts,
    ids: torch.Tensor,
    mask: torch.Tensor,
    grids: Grids | torch.Tensor | None,
    image_mask: torch.Tensor | None = None,
    video_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """M-RoPE position ids ``[3, B, L]`` from the model's own ``get_rope_index``.

    ``grids`` holds the ``image_grid_thw`` rows of every image in the batch in row order (a
    tensor), or a :class:`Grids` with the videos' grids and ``second_per_grid_ts`` too;
    ``image_mask`` / ``video_mask`` mark the placeholder positions (default: every image /
    video token id). Padding positions get 0 (the attention mask hides them).
    """
    if not isinstance(grids, Grids):
        grids = Grids(image=grids)
    if image_mask is None:
        image_mask = token_mask(p, ids)
    if video_mask is None:
        video_mask = token_mask(p, ids, video=True)
    fn = p.inner.get_rope_index
    params = inspect.signature(fn).parameters
    kwargs: dict[str, Any] = {"input_ids": ids, "attention_mask": mask}
    if "image_grid_thw" in params:
        kwargs["image_grid_thw"] = grids.image
    if grids.video is not None:
        if "video_grid_thw" not in params:
            raise TypeError(f"{type(p.inner).__name__}.get_rope_index takes no video grids")
        kwargs["video_grid_thw"] = grids.video
        if "second_per_grid_ts" in params:  # Qwen2.5-VL: temporal spacing in seconds
            kwargs["second_per_grid_ts"] = grids.second_per_grid
    if "mm_token_type_ids" in params:  # transformers >= 5: text 0, image 1, video 2
        kwargs["mm_token_type_ids"] = image_mask.to(torch.int32) + 2 * video_mask.to(torch.int32)
    else:  # this transformers version finds images by token id alone: hide sampled ones
        hide = (~image_mask & token_mask(p, ids)) | (~video_mask & token_mask(p, ids, True))
        if bool(hide.any()):
            kwargs["input_ids"] = ids.masked_fill(hide, 0)
    position_ids, _ = fn(**kwargs)
    return position_ids


def features(
    p: Parts, pixel_values: torch.Tensor, grid: torch.Tensor, video: bool = False
) -> tuple[torch.Tensor, list[torch.Tensor] | None]:
    """Merged image (or video) features ``[tokens, hidden]`` (and Qwen3-VL's deepstack)."""
    if video:
        out = p.inner.get_video_features(pixel_values_videos=pixel_values, video_grid_thw=grid)
    else:
        out = p.inner.get_image_features(pixel_values=pixel_values, image_grid_thw=grid)
    deep = None
    if hasattr(out, "pooler_output"):
        feats, deep = out.pooler_output, getattr(out, "deepstack_features", None)
    elif isinstance(out, tuple) and len(out) == 2 and isinstance(out[1], list):
        feats, deep = out  # older Qwen3-VL: (embeds, deepstack)
    else:
        feats = out
    if isinstance(feats, (tuple, list)):
        feats = torch.cat(list(feats), dim=0)
    if video:
        COUNTERS["video_passes"] += 1
        COUNTERS["vision_videos"] += int(grid.shape[0])
    else:
        COUNTERS["vision_passes"] += 1
        COUNTERS["vision_images"] += int(grid.shape[0])
    return feats, (list(deep) if deep else None)


def dummy_features(
    p: Parts, device: torch.device, dtype: torch.dtype
) -> tuple[torch.Tensor, list[torch.Tensor] | None]:
    pv = torch.zeros(p.merge_size**2, p.patch_dim, device=device, dtype=dtype)
    grid = torch.tensor([[1, p.merge_size, p.merge_size]], device=device)
    COUNTERS["dummy_vision_passes"] += 1
    return features(p, pv, grid)


def _place(
    p: Parts,
    order: list[VisionInputs],
    rows: list[VisionInputs | None],
    unique: dict[str, int],
    mask: torch.Tensor,
    video: bool,
    device: torch.device,
    dtype: torch.dtype,
) -> tuple[torch.Tensor, list[torch.Tensor] | None] | None:
    """Features of every placeholder in ``mask`` (row-major order), from one vision pass over
    the distinct prompts' images (or videos); None when the batch has none."""
    what = "video" if video else "image"
    count = (lambda v: v.num_videos) if video else (lambda v: v.num_images)
    grid_of = (lambda v: v.video_grid_thw) if video else (lambda v: v.image_grid_thw)
    with_media = [v for v in order if count(v)]
    per_prompt = [
        int((grid_of(v).prod(-1) // p.merge_size**2).sum()) if count(v) else 0 for v in order
    ]
    for b, v in enumerate(rows):
        n_tokens = int(mask[b].sum())
        want = 0 if v is None else per_prompt[unique[v.key]]
        if n_tokens != want:
            whose = "no vision inputs" if v is None else f"{what}s giving {want} features"
            raise ValueError(
                f"row {b} ({v.key if v else 'text'}) has {n_tokens} {what} tokens "
                f"in its prompt but {whose} (t*h*w/merge^2 per {what}); the "
                f"prompt ids and the {what}s do not belong together"
            )
    if not with_media:
        return None
    values = [v.pixel_values_videos if video else v.pixel_values for v in with_media]
    pv = torch.cat(values).to(device=device, dtype=dtype)
    feats, deep = features(p, pv, torch.cat([grid_of(v) for v in with_media]).to(device), video)
    starts = torch.tensor([0] + per_prompt[:-1]).cumsum(0).tolist()
    index = [
        torch.arange(starts[unique[v.key]], starts[unique[v.key]] + per_prompt[unique[v.key]])
        for v in rows
        if v is not None
    ]
    gather = torch.cat(index).to(device)
    return feats[gather], ([d[gather] for d in deep] if deep else None)


def embed(
    p: Parts,
    ids: torch.Tensor,
    rows: list[VisionInputs | None],
    *,
    dummy_if_empty: bool,
    image_mask: torch.Tensor | None = None,
    video_mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, Grids, dict[str, Any]]:
    """Input embeddings with image and video features in place, grids in row order, extra
    LM kwargs.

    Features are computed once per distinct ``VisionInputs.key`` among ``rows`` (one vision
    pass for the images, one for the videos). ``image_mask`` / ``video_mask`` mark the
    placeholder positions (default: every image / video token id; pass the prompt's only
    when responses may contain a sampled vision token, which stays text).
    """
    emb = p.language_model.get_input_embeddings()(ids)
    device, dtype = emb.device, p.visual.dtype if hasattr(p.visual, "dtype") else emb.dtype
    unique: dict[str, int] = {}
    order: list[VisionInputs] = []
    for v in rows:
        if v is not None and v.key not in unique:
            unique[v.key] = len(order)
            order.append(v)
    if image_mask is None:
        image_mask = token_mask(p, ids)
    if video_mask is None:
        video_mask = token_mask(p, ids, video=True)
    if not order:
        if bool(image_mask.any() or video_mask.any()):
            raise ValueError(
                "the batch has image or video tokens in its prompts but no vision "
                "inputs; the rows lost them (was the record built by a VL "
                "workflow?)"
            )
        if dummy_if_empty:  # every parameter takes part, so FSDP ranks stay in step
            feats, deep = dummy_features(p, device, dtype)
            zero = feats.sum() * 0.0 + sum((d.sum() * 0.0 for d in deep or []), 0.0)
            emb = emb + zero.to(emb.dtype)
        return emb, Grids(), {}
    image = _place(p, order, rows, unique, image_mask, False, device, dtype)
    video = _place(p, order, rows, unique, video_mask, True, device, dtype)
    if image is not None:
        emb = emb.masked_scatter(image_mask.unsqueeze(-1), image[0].to(emb.dtype))
    if video is not None:
        emb = emb.masked_scatter(video_mask.unsqueeze(-1), video[0].to(emb.dtype))
    extra = _deepstack(image, video, image_mask, video_mask, emb.dtype) if p.deepstack else {}
    return emb, batch_grids(rows, device), extra


def _deepstack(
    image: tuple | None,
    video: tuple | None,
    image_mask: torch.Tensor,
    video_mask: torch.Tensor,
    dtype: torch.dtype,
) -> dict[str, Any]:
    """Qwen3-VL's deepstack inputs: per injected layer, the image and video features over
    the positions of either, in sequence order (as the model's own forward joins them)."""
    deep = {
        "image": image[1] if image is not None else None,
        "video": video[1] if video is not None else None,
    }
    if not deep["image"] and not deep["video"]:
        return {}
    if not deep["video"]:
        return {
            "visual_pos_masks": image_mask,
            "deepstack_visual_embeds": [d.to(dtype) for d in deep["image"]],
        }
    if not deep["image"]:
        return {
            "visual_pos_masks": video_mask,
            "deepstack_visual_embeds": [d.to(dtype) for d in deep["video"]],
        }
    both = image_mask | video_mask
    at_image, at_video = image_mask[both], video_mask[both]
    joined = []
    for a, b in zip(deep["image"], deep["video"], strict=True):
        layer = a.new_zeros(int(both.sum()), a.shape[-1])
        layer[at_image], layer[at_video] = a, b
        joined.append(layer.to(dtype))
    return {"visual_pos_masks": both, "deepstack_visual_embeds": joined}
