"""The Qwen-VL forward pass both engine and trainer use: the model side of vision-language RL.

:func:`vl_forward` runs Qwen2-VL / Qwen2.5-VL / Qwen3-VL through `transformers` with the
vision features computed once per distinct prompt in the batch and M-RoPE position ids from
the model's own ``get_rope_index`` over prompt + response (both from
:mod:`polyrl.multimodal.features`), so response positions continue after the
vision-compressed prompt positions. Videos go through the model's ``get_video_features``
(one pass per micro-batch for all its distinct prompts' videos, like images).
:func:`response_logprobs` with ``shared_prefix`` computes a prefix that rows share (a
group's prompt and image, a multi-turn episode's history) once: the core's tree pass
(:func:`polyrl.core.train.passes.shared_logprobs`) with this family's embeddings and positions
(:func:`shared_logprobs`). A batch without images still runs the vision tower on a dummy
patch with weight zero, so FSDP ranks never disagree about which parameters took part (a
rank with only text rows would otherwise hang the others). The inputs come from
:mod:`polyrl.multimodal.vision` (the host side).
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from typing import Any

import torch

from polyrl.core.train import prefix
from polyrl.core.train.passes import TreeInputs, prefix_units, shares, token_logprobs
from polyrl.core.train.passes import shared_logprobs as passes_shared
from polyrl.multimodal.features import (
    Parts,
    batch_grids,
    dummy_features,
    embed,
    features,
    parts,
    rope_index,
    token_mask,
)
from polyrl.multimodal.turns import placeholder_mask
from polyrl.multimodal.vision import VisionInputs


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
    keep = slice(-logits_to_keep, None)
    logits, past = _lm_logits(p, emb, mask, position_ids, cache, use_cache, keep, extra)
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
    return _lm_logits(p, emb, mask, position_ids, cache, True, slice(-1, None), {})


def _lm_logits(
    p: Parts,
    emb: torch.Tensor,
    mask: torch.Tensor,
    position_ids: torch.Tensor,
    cache: Any,
    use_cache: bool,
    keep: slice | torch.Tensor,
    extra: dict,
) -> tuple[torch.Tensor, Any]:
    """The language model over embeddings ``emb``: logits of the positions ``keep`` (a
    slice or an index tensor) and the cache (``extra``: the vision inputs' keywords, e.g.
    deepstack features)."""
    out = p.language_model(
        input_ids=None,
        inputs_embeds=emb,
        attention_mask=mask,
        position_ids=position_ids,
        use_cache=use_cache,
        past_key_values=cache,
        **extra,
    )
    return p.lm_head(out.last_hidden_state[:, keep]), out.past_key_values


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
    batch: Mapping[str, torch.Tensor],
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
    shared prefix, images included, once); else the padded pass over every row. ``batch``:
    the rows' ``prompt_ids``, ``prompt_mask``, ``response_ids`` and ``response_mask``."""
    prompt_ids, prompt_mask = batch["prompt_ids"], batch["prompt_mask"]
    response_ids, response_mask = batch["response_ids"], batch["response_mask"]
    ids = torch.cat([prompt_ids, response_ids], dim=1)
    mask = torch.cat([prompt_mask, response_mask], dim=1)
    r = response_ids.shape[1]
    p = parts(model)
    positions, image_mask, video_mask = row_positions(p, prompt_ids, prompt_mask, ids, mask, rows)
    if shared_prefix:
        out = shared_logprobs(
            model,
            batch,
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


def _marked_view(
    marked: torch.Tensor, prompt_mask: torch.Tensor, response_mask: torch.Tensor
) -> dict[str, torch.Tensor]:
    plen = prompt_mask.shape[1]
    return {
        "prompt_ids": marked[:, :plen],
        "prompt_mask": prompt_mask,
        "response_ids": marked[:, plen:],
        "response_mask": response_mask,
    }


def shared_units(
    model: torch.nn.Module,
    marked: torch.Tensor,
    prompt_mask: torch.Tensor,
    response_mask: torch.Tensor,
    min_shared: int,
) -> tuple[list[prefix.Unit], torch.Tensor, torch.Tensor] | None:
    """How :func:`shared_logprobs` would run the rows (``marked``: prompt + response ids with
    each vision placeholder replaced by ``-2 - its feature's index``, so rows share an image
    only where they share its features): the core's units
    (:func:`polyrl.core.train.passes.prefix_units`) with the rows' left-aligned tokens and
    lengths; None where no prefix is shared (the attention cannot take a tree mask, or the
    cost model says sharing does not pay)."""
    if len(marked) < 2 or not shares(model, True, True):
        return None
    view = _marked_view(marked, prompt_mask, response_mask)
    units = prefix_units(model, view, min_shared)
    if not any(u.shared for u in units):
        return None
    tokens, lengths = prefix.row_tokens(view)
    return units, tokens, lengths


def shared_logprobs(
    model: torch.nn.Module,
    batch: Mapping[str, torch.Tensor],
    rows: list[VisionInputs | None],
    placed: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    temperature: float = 1.0,
    with_entropy: bool = False,
    *,
    dummy_if_empty: bool = True,
    min_shared: int = 16,
) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """:func:`response_logprobs` with each shared prefix computed once, images included:
    the core's tree pass (:func:`polyrl.core.train.passes.shared_logprobs`) with this family's
    inputs; None where nothing is shared (the caller runs the padded pass).

    ``placed``: :func:`row_positions` of the rows (M-RoPE positions ``[3, B, P + R]``, image
    and video masks). Each distinct image or video (by content, :func:`mark_media`) goes
    through the vision tower once; a vision placeholder is told apart by the feature it
    takes, so rows share a prefix only where its tokens and images are the same.
    """
    positions, image_mask, video_mask = placed
    prompt_mask, response_mask = batch["prompt_mask"], batch["response_mask"]
    if not bool(response_mask.bool().any()) or not bool(prompt_mask.bool().any(-1).all()):
        return None
    p = parts(model)
    ids = torch.cat([batch["prompt_ids"], batch["response_ids"]], dim=1)
    found = mark_media(p, ids, rows, image_mask, video_mask)
    if found is None:
        return None
    marked, media = found
    plan = shared_units(model, marked, prompt_mask, response_mask, min_shared)
    if plan is None:
        return None
    units, tokens, _ = plan
    inputs = TreeInputs(tokens, positions, _tree_forward(p, media, dummy_if_empty))
    return passes_shared(model, batch, units, temperature, with_entropy, inputs=inputs)


def _tree_forward(p: Parts, media: tuple[Media, Media], dummy_if_empty: bool):
    """The tree pass's forward over marked ids (:func:`mark_media`): text embeddings, each
    distinct image's and video's features at its columns (and Qwen3-VL's deepstack
    features), the language model, the head at the kept columns."""

    def run(
        ids: torch.Tensor, attention: torch.Tensor, pos: torch.Tensor, keep: torch.Tensor
    ) -> torch.Tensor:
        vis = ids < -1
        emb = p.language_model.get_input_embeddings()(ids.clamp(min=0))
        device, dtype = emb.device, p.visual.dtype if hasattr(p.visual, "dtype") else emb.dtype
        got = [
            features(
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
            at = -2 - ids[vis]
            feats = torch.cat([f[0] for f in got])[at].to(emb.dtype)
            emb = emb.masked_scatter(vis.unsqueeze(-1), feats)
            if p.deepstack and all(f[1] for f in got):
                layers = zip(*[f[1] for f in got], strict=True)
                extra = {
                    "visual_pos_masks": vis,
                    "deepstack_visual_embeds": [torch.cat(d)[at].to(emb.dtype) for d in layers],
                }
        elif dummy_if_empty:  # every parameter takes part, so FSDP ranks stay in step
            dfeats, deep = dummy_features(p, device, dtype)
            zero = dfeats.sum() * 0.0 + sum((d.sum() * 0.0 for d in deep or []), 0.0)
            emb = emb + zero.to(emb.dtype)
        return _lm_logits(p, emb, attention, pos, None, False, keep, extra)[0]

    return run
