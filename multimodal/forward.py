"""The Qwen-VL forward pass both engine and trainer use: the model side of vision-language RL.

:func:`vl_forward` runs Qwen2-VL / Qwen2.5-VL / Qwen3-VL through `transformers` with the
vision features computed once per distinct prompt in the batch (rows that share a
:class:`~polyrl.multimodal.vision.VisionInputs` share its features: one vision-tower pass
per group, gradients flow to every use) and with M-RoPE position ids from the model's own
``get_rope_index`` over prompt + response (video grids and ``second_per_grid_ts`` too), so
response positions continue after the vision-compressed prompt positions. Videos go
through the model's ``get_video_features`` (one pass per micro-batch for all its distinct
prompts' videos, like images). :func:`response_logprobs` with ``shared_prefix`` computes a
prefix that rows share (a group's prompt and image, a multi-turn episode's history) once,
packed as a tree of prefixes (:func:`shared_logprobs`). A batch without images still runs
the vision tower on a dummy patch with weight zero, so FSDP ranks never disagree about
which parameters took part (a rank with only text rows would otherwise hang the others).
The inputs come from :mod:`polyrl.multimodal.vision` (the host side).
"""

from __future__ import annotations

import hashlib
import inspect
from dataclasses import dataclass
from typing import Any

import torch

from polyrl.core import prefix
from polyrl.core.passes import shares, token_logprobs
from polyrl.multimodal.turns import placeholder_mask
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


def _features(
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


def _dummy(
    p: Parts, device: torch.device, dtype: torch.dtype
) -> tuple[torch.Tensor, list[torch.Tensor] | None]:
    pv = torch.zeros(p.merge_size**2, p.patch_dim, device=device, dtype=dtype)
    grid = torch.tensor([[1, p.merge_size, p.merge_size]], device=device)
    COUNTERS["dummy_vision_passes"] += 1
    return _features(p, pv, grid)


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
    feats, deep = _features(p, pv, torch.cat([grid_of(v) for v in with_media]).to(device), video)
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
            feats, deep = _dummy(p, device, dtype)
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


def vl_forward(
    model: torch.nn.Module,
    ids: torch.Tensor,
    mask: torch.Tensor,
    rows: list[VisionInputs | None],
    *,
    logits_to_keep: int,
    dummy_if_empty: bool = True,
    use_cache: bool = False,
    position_ids: torch.Tensor | None = None,
    image_mask: torch.Tensor | None = None,
    video_mask: torch.Tensor | None = None,
    cache: Any = None,
):
    """Logits of the last ``logits_to_keep`` positions (and the cache and positions).

    Returns ``(logits, past_key_values, position_ids)``; ``cache``: the KV cache to fill
    (default: the model's own).
    """
    p = parts(model)
    if image_mask is None:
        image_mask = token_mask(p, ids)
    if video_mask is None:
        video_mask = token_mask(p, ids, video=True)
    emb, grids, extra = embed(
        p, ids, rows, dummy_if_empty=dummy_if_empty, image_mask=image_mask, video_mask=video_mask
    )
    if position_ids is None:
        position_ids = rope_index(p, ids, mask, grids, image_mask, video_mask)
    logits, past = _lm_logits(p, emb, mask, position_ids, cache, use_cache, logits_to_keep, extra)
    return logits, past, position_ids


def decode_step(
    model: torch.nn.Module,
    tokens: torch.Tensor,
    mask: torch.Tensor,
    position_ids: torch.Tensor,
    cache: Any,
) -> tuple[torch.Tensor, Any]:
    """One cached decoding step for new text tokens ``[B, 1]`` at ``position_ids [3, B, 1]``."""
    p = parts(model)
    emb = p.language_model.get_input_embeddings()(tokens)
    return _lm_logits(p, emb, mask, position_ids, cache, True, 1, {})


def _lm_logits(
    p: Parts,
    emb: torch.Tensor,
    mask: torch.Tensor,
    position_ids: torch.Tensor,
    cache: Any,
    use_cache: bool,
    keep: int,
    extra: dict,
) -> tuple[torch.Tensor, Any]:
    """The language model over embeddings ``emb``: logits of the last ``keep`` positions
    and the cache (``extra``: the vision inputs' keywords, e.g. deepstack features)."""
    out = p.language_model(
        input_ids=None,
        inputs_embeds=emb,
        attention_mask=mask,
        position_ids=position_ids,
        use_cache=use_cache,
        past_key_values=cache,
        **extra,
    )
    return p.lm_head(out.last_hidden_state[:, -keep:]), out.past_key_values


def image_masks(
    p: Parts,
    ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    rows: list[VisionInputs | None],
    default: torch.Tensor,
) -> torch.Tensor:
    """``default`` (image placeholders by token id) with the multi-turn rows' images taken
    from their ``image_starts`` instead (:func:`polyrl.multimodal.turns.placeholder_mask`);
    ``ids`` start with the left-padded prompts."""
    left_pad = prompt_mask.shape[1] - prompt_mask.sum(-1)
    return placeholder_mask(ids, left_pad, rows, default, p.merge_size, p.image_token_id)


def next_positions(prompt_positions: torch.Tensor) -> torch.Tensor:
    """``[B]``: where text after left-padded prompts starts, given their positions ``[3, B, P]``.

    ``get_rope_index`` continues text from the previous text token + 1. Every Qwen-VL prompt
    ends with text (``<|vision_end|>`` at least), so that is the last prompt token's position
    + 1. With images this also equals the prompt's largest position + 1; with videos it need
    not (transformers 5.10's ``get_rope_index`` spaces a video's temporal positions by
    ``tokens_per_second * second_per_grid_ts`` but advances the text after it only by the
    spatial extent), so the last token, not the maximum, is the rule.
    """
    return prompt_positions[:, :, -1].amax(dim=0) + 1


def sequence_positions(
    p: Parts,
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    response_len: int,
    rows: list[VisionInputs | None],
) -> torch.Tensor:
    """M-RoPE positions ``[3, B, P + R]`` of left-padded prompts followed by responses.

    ``get_rope_index`` runs once per distinct prompt with images or videos (a group of ``n``
    shares it); text rows count up from their first real token. Response tokens continue
    from the prompt's last position + 1 in all three rows (:func:`next_positions`), which
    is what ``get_rope_index`` gives for text that follows the prompt (the unit tests check
    the two agree).
    """
    b, plen = prompt_ids.shape
    device = prompt_ids.device
    pos = ((prompt_mask.cumsum(-1) - 1).clamp(min=0) * prompt_mask).unsqueeze(0).repeat(3, 1, 1)
    first: dict[str, int] = {}
    for i, v in enumerate(rows):  # multi-turn rows (image_starts) get theirs over the row
        if v is not None and v.image_starts is None and v.key not in first:
            first[v.key] = i
    if first:
        reps = list(first.values())
        rep_ids = prompt_ids[reps]
        rep_pos = rope_index(
            p, rep_ids, prompt_mask[reps], batch_grids([rows[i] for i in reps], device)
        )
        slot = {key: k for k, key in enumerate(first)}
        for i, v in enumerate(rows):
            if v is not None and v.key in slot:
                pos[:, i] = rep_pos[:, slot[v.key]]
    start = next_positions(pos)  # [B]
    resp = start[:, None] + torch.arange(response_len, device=device)[None, :]
    return torch.cat([pos, resp.unsqueeze(0).expand(3, b, response_len)], dim=2)


def row_positions(
    p: Parts,
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    ids: torch.Tensor,
    mask: torch.Tensor,
    rows: list[VisionInputs | None],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """M-RoPE positions ``[3, B, L]`` and the image and video masks of left-padded prompts
    followed by their responses (``ids``, ``mask``: both joined).

    Only the prompt holds vision placeholders (a sampled image-token id is text), except
    in multi-turn rows (``image_starts``), whose images sit anywhere in the row: there the
    images are placed by position and ``get_rope_index`` runs over the whole row.
    """
    r = ids.shape[1] - prompt_ids.shape[1]
    no = torch.zeros((ids.shape[0], r), dtype=torch.bool, device=ids.device)
    image_mask = torch.cat([token_mask(p, prompt_ids), no], dim=1)
    video_mask = torch.cat([token_mask(p, prompt_ids, video=True), no], dim=1)
    positions = sequence_positions(p, prompt_ids, prompt_mask, r, rows)
    turns = [i for i, v in enumerate(rows) if v is not None and v.image_starts is not None]
    if turns:
        image_mask = image_masks(p, ids, prompt_mask, rows, image_mask)
        video_mask[turns] = False  # multi-turn rows carry no video: a sampled id is text
        positions[:, turns] = rope_index(
            p,
            ids[turns],
            mask[turns],
            batch_grids([rows[i] for i in turns], ids.device),
            image_mask[turns],
            video_mask[turns],
        )
    return positions, image_mask, video_mask


def response_logprobs(
    model: torch.nn.Module,
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    response_ids: torch.Tensor,
    response_mask: torch.Tensor,
    rows: list[VisionInputs | None],
    temperature: float = 1.0,
    with_entropy: bool = False,
    dummy_if_empty: bool = True,
    shared_prefix: bool = False,
    min_shared: int = 16,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs (and entropy) of each response token, images and videos included, positions
    by M-RoPE.

    ``shared_prefix``: where the cost model says it pays, :func:`shared_logprobs` (each
    shared prefix, images included, once); else the padded pass over every row."""
    ids = torch.cat([prompt_ids, response_ids], dim=1)
    mask = torch.cat([prompt_mask, response_mask], dim=1)
    r = response_ids.shape[1]
    p = parts(model)
    positions, image_mask, video_mask = row_positions(p, prompt_ids, prompt_mask, ids, mask, rows)
    if shared_prefix:
        out = shared_logprobs(
            model,
            prompt_ids,
            prompt_mask,
            response_ids,
            response_mask,
            rows,
            (positions, image_mask, video_mask),
            temperature,
            with_entropy,
            dummy_if_empty=dummy_if_empty,
            min_shared=min_shared,
        )
        if out is not None:
            return out
    logits, _, _ = vl_forward(
        model,
        ids,
        mask,
        rows,
        logits_to_keep=r + 1,
        dummy_if_empty=dummy_if_empty,
        image_mask=image_mask,
        video_mask=video_mask,
        position_ids=positions,
    )
    return token_logprobs(logits[:, :-1].float(), response_ids, temperature, with_entropy)


def _digest(pixels: torch.Tensor, grid: torch.Tensor) -> bytes:
    """What tells one image (or video) from another: its grid and its pixel values' bytes."""
    h = hashlib.blake2b(digest_size=16)
    h.update(grid.cpu().numpy().tobytes())
    h.update(str(pixels.dtype).encode())
    h.update(pixels.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return h.digest()


Media = list[tuple[torch.Tensor, torch.Tensor]]  # distinct items: (pixel values, grid [3])


def mark_media(
    p: Parts,
    ids: torch.Tensor,
    rows: list[VisionInputs | None],
    image_mask: torch.Tensor,
    video_mask: torch.Tensor,
) -> tuple[torch.Tensor, tuple[Media, Media]] | None:
    """``ids`` with each image (video) placeholder replaced by ``-2 - i``, ``i`` the row of its
    feature in the features of the distinct images followed by those of the distinct
    videos, and those images and videos. An image is told apart by its content (grid and
    pixel values, hashed once per :attr:`VisionInputs.key`), so rows whose prompts carry
    the same image share it whatever their key or object (a group's rows; a multi-turn
    episode's later turns, whose rows repeat its earlier images): equal marks mean equal
    inputs to the language model. None where a row's placeholders do not match its images
    (the padded pass says what is wrong)."""
    marked = ids.clone()
    media: list[Media] = []
    offset, merge = 0, p.merge_size**2
    for video, where in ((False, image_mask), (True, video_mask)):
        seen: dict[bytes, int] = {}  # digest -> distinct item
        items: Media = []
        starts: list[int] = []  # each item's first feature row
        of_key: dict[str, list[int]] = {}  # each prompt's items, in order
        index: list[torch.Tensor] = []
        total = 0
        for b, v in enumerate(rows):
            if v is None:
                if bool(where[b].any()):
                    return None
                continue
            if v.key not in of_key:
                grid = v.video_grid_thw if video else v.image_grid_thw
                pixels = v.pixel_values_videos if video else v.pixel_values
                mine = []
                if len(grid):
                    if pixels is None:
                        return None
                    chunks = pixels.split(grid.prod(-1).tolist())
                    for chunk, g in zip(chunks, grid, strict=True):
                        d = _digest(chunk, g)
                        if d not in seen:
                            seen[d] = len(items)
                            items.append((chunk, g))
                            starts.append(total)
                            total += int(g.prod()) // merge
                        mine.append(seen[d])
                of_key[v.key] = mine
            spans = [
                torch.arange(starts[i], starts[i] + int(items[i][1].prod()) // merge)
                for i in of_key[v.key]
            ]
            if sum(len(x) for x in spans) != int(where[b].sum()):
                return None
            index += spans
        if index:
            marked[where] = -2 - (torch.cat(index).to(ids.device) + offset)
        media.append(items)
        offset = total
    return marked, (media[0], media[1])


def shared_units(
    model: torch.nn.Module,
    marked: torch.Tensor,
    prompt_mask: torch.Tensor,
    response_mask: torch.Tensor,
    min_shared: int,
) -> tuple[list[prefix.Unit], torch.Tensor, torch.Tensor] | None:
    """How :func:`shared_logprobs` would run the rows (``marked``: prompt + response ids with
    each vision placeholder replaced by ``-2 - its feature's index``, so rows share an image
    only where they share its features): the units of
    :func:`polyrl.core.prefix.plan_units` with the rows' left-aligned tokens and lengths;
    None where no prefix is shared (the attention cannot take a tree mask, or the cost
    model says sharing does not pay)."""
    if len(marked) < 2 or not shares(model, True, True):
        return None
    plen = prompt_mask.shape[1]
    view = {
        "prompt_ids": marked[:, :plen],
        "prompt_mask": prompt_mask,
        "response_ids": marked[:, plen:],
        "response_mask": response_mask,
    }
    tokens, lengths = prefix.row_tokens(view)
    order, lcp = prefix.sorted_lcp(tokens, lengths)
    units = prefix.plan_units(
        lengths.tolist(),
        order,
        lcp,
        min_shared=max(1, min_shared),
        weights=prefix.cost_weights(hf_model(model).config),
    )
    if not any(u.shared for u in units):
        return None
    return units, tokens, lengths


def shared_logprobs(
    model: torch.nn.Module,
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    response_ids: torch.Tensor,
    response_mask: torch.Tensor,
    rows: list[VisionInputs | None],
    placed: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    temperature: float = 1.0,
    with_entropy: bool = False,
    *,
    dummy_if_empty: bool = True,
    min_shared: int = 16,
) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """:func:`response_logprobs` with each shared prefix computed once, images included;
    None where nothing is shared (the caller runs the padded pass).

    ``placed``: :func:`row_positions` of the rows (M-RoPE positions ``[3, B, P + R]``, image
    and video masks). Each distinct image or video (by content, :func:`mark_media`) goes
    through the vision tower once; a vision placeholder is told apart by the feature it
    takes, so rows share a prefix only where its tokens and images are the same.
    The rows' units (:func:`shared_units`) are packed as trees
    (:func:`polyrl.core.prefix.tree_layout`): the distinct tokens once, each row's M-RoPE
    positions at its columns (a shared prefix has the same positions in every row: they
    depend only on what comes before), image features (and Qwen3-VL's deepstack features)
    at the image columns, a tree mask (sdpa, eager). Only the columns that predict a
    response token reach the LM head. Equal to the padded pass up to float rounding.
    """
    positions, image_mask, video_mask = placed
    rmask = response_mask.bool()
    if not bool(rmask.any()) or not bool(prompt_mask.bool().any(-1).all()):
        return None
    p = parts(model)
    ids = torch.cat([prompt_ids, response_ids], dim=1)
    mask = torch.cat([prompt_mask, response_mask], dim=1).bool()
    found = mark_media(p, ids, rows, image_mask, video_mask)
    if found is None:
        return None
    marked, media = found
    plan = shared_units(model, marked, prompt_mask, response_mask, min_shared)
    if plan is None:
        return None
    units, tokens, lengths = plan
    lay = prefix.tree_layout(units, tokens, lengths.tolist(), len(lengths))
    device = ids.device
    # each row's M-RoPE positions at its columns (rows sharing a column agree on it)
    real = mask.sum(-1).tolist()
    col_bin = torch.cat(
        [torch.full((n,), b, device=device) for n, b in zip(real, lay.row_bin, strict=True)]
    )
    cols = torch.cat(lay.cols)
    pos = torch.zeros((3, *lay.ids.shape), dtype=positions.dtype, device=device)
    pos[:, col_bin, cols] = positions[:, mask]
    # embeddings: text tokens, then the vision features at their columns
    vis = lay.ids < -1
    emb = p.language_model.get_input_embeddings()(lay.ids.clamp(min=0))
    dtype = p.visual.dtype if hasattr(p.visual, "dtype") else emb.dtype
    got = [
        _features(
            p,
            torch.cat([c for c, _ in items]).to(device=device, dtype=dtype),
            torch.stack([g for _, g in items]).to(device),
            video,
        )
        for items, video in zip(media, (False, True), strict=True)
        if items
    ]
    extra: dict[str, Any] = {}
    if got:
        at = -2 - lay.ids[vis]
        emb = emb.masked_scatter(
            vis.unsqueeze(-1), torch.cat([f[0] for f in got])[at].to(emb.dtype)
        )
        if p.deepstack and all(f[1] for f in got):
            layers = zip(*[f[1] for f in got], strict=True)
            extra = {
                "visual_pos_masks": vis,
                "deepstack_visual_embeds": [torch.cat(d)[at].to(emb.dtype) for d in layers],
            }
    elif dummy_if_empty:  # every parameter takes part, so FSDP ranks stay in step
        dfeats, deep = _dummy(p, device, dtype)
        zero = dfeats.sum() * 0.0 + sum((d.sum() * 0.0 for d in deep or []), 0.0)
        emb = emb + zero.to(emb.dtype)
    attn = lay.visible
    if str(getattr(hf_model(model).config, "_attn_implementation", "")) == "eager":
        attn = torch.zeros(attn.shape, dtype=emb.dtype, device=device).masked_fill_(
            ~attn, torch.finfo(emb.dtype).min
        )
    hidden = p.language_model(
        input_ids=None,
        inputs_embeds=emb,
        attention_mask=attn,
        position_ids=pos,
        use_cache=False,
        **extra,
    ).last_hidden_state
    # response token k of row i is predicted from the column of its position plen + k - 1
    plen = prompt_mask.sum(-1).tolist()
    width = lay.ids.shape[1]
    flat = []
    for i, c in enumerate(lay.cols):
        n = int(rmask[i].sum())
        if n:
            flat.append(lay.row_bin[i] * width + c[plen[i] - 1 : plen[i] - 1 + n])
    keep, slot = torch.unique(torch.cat(flat), return_inverse=True)
    logits = p.lm_head(hidden.reshape(-1, hidden.shape[-1])[keep])[slot]
    logp, ent = token_logprobs(logits.float(), response_ids[rmask], temperature, with_entropy)
    out = torch.zeros(rmask.shape, dtype=logp.dtype, device=device).masked_scatter(rmask, logp)
    if ent is not None:
        ent = torch.zeros_like(out).masked_scatter(rmask, ent)
    return out, ent
