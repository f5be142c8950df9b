"""From image references to model inputs, and the Qwen-VL forward pass both engine and trainer use.

Two halves:

- **Host side.** :class:`VisionSpec` is a prompt's images as references (what a dataset item
  holds). :func:`process` decodes, resizes (``qwen_vl_utils``) and runs the image processor
  once, giving :class:`VisionInputs` (``pixel_values`` + ``image_grid_thw``). A workflow calls
  it once per prompt; the ``n`` samples of the prompt's group share that one object, in the
  rollout record and through the update.
- **Model side.** :func:`vl_forward` runs Qwen2-VL / Qwen2.5-VL / Qwen3-VL through
  `transformers` with the vision features computed once per distinct prompt in the batch
  (rows that share a :class:`VisionInputs` share its features: one vision-tower pass per
  group, gradients flow to every use) and with M-RoPE position ids from the model's own
  ``get_rope_index`` over prompt + response, so response positions continue after the
  image-compressed prompt positions. A batch without images still runs the vision tower on
  a dummy patch with weight zero, so FSDP ranks never disagree about which parameters took
  part (a rank with only text rows would otherwise hang the others).
"""

from __future__ import annotations

import inspect
from collections import Counter
from dataclasses import dataclass
from typing import Any

import torch

from polyrl.multimodal.images import ImageError, ImageRef, ResizeRule, decode

# Process-wide counters (tests and metrics read them): images decoded+processed, vision
# tower passes and the images they covered.
COUNTERS: Counter = Counter()


@dataclass(frozen=True)
class VisionSpec:
    """A prompt's images before processing: references plus the sizes their headers gave.

    ``key`` identifies the prompt (dataset name and row), so rows that share it share the
    processed inputs. ``sizes`` are source (width, height), read at load time; the token
    counts in the prompt ids were computed from them.
    """

    key: str
    refs: tuple[ImageRef, ...]
    sizes: tuple[tuple[int, int], ...]
    rule: ResizeRule

    def grids(self) -> list[tuple[int, int, int]]:
        return [self.rule.grid(w, h) for w, h in self.sizes]

    def token_counts(self) -> list[int]:
        return [self.rule.tokens(w, h) for w, h in self.sizes]


@dataclass
class VisionInputs:
    """One prompt's processed images: what the model's vision tower takes."""

    key: str
    pixel_values: torch.Tensor  # [patches of all images, C * T * P * P]
    image_grid_thw: torch.Tensor  # [images, 3] (int64)
    sizes: tuple[tuple[int, int], ...] = ()  # source (width, height) per image
    resized: tuple[tuple[int, int], ...] = ()  # (width, height) the model saw

    @property
    def num_images(self) -> int:
        return int(self.image_grid_thw.shape[0])


def process(spec: VisionSpec, image_processor: Any) -> tuple[VisionInputs, list]:
    """Decode, resize and run the image processor once for one prompt.

    Returns the processed inputs and the resized RGB images (what rewards look at: box
    coordinates of Qwen2.5-VL refer to these pixels). Errors name the file and row.
    """
    images = []
    for ref, (w, h), grid in zip(spec.refs, spec.sizes, spec.grids(), strict=True):
        img = decode(ref, spec.rule.max_source_pixels)
        if img.size != (w, h):
            raise ImageError(f"{ref.where}: the image is {img.width}x{img.height} now but was "
                             f"{w}x{h} when the dataset was loaded; was the file replaced?")
        img = spec.rule.apply(img)
        if img.size != (grid[2] * spec.rule.patch_size, grid[1] * spec.rule.patch_size):
            raise ImageError(f"{ref.where}: resized to {img.size}, not the size the prompt's "
                             f"{grid} grid was counted for")  # pragma: no cover (defensive)
        images.append(img)
    out = image_processor(images=images, do_resize=False, return_tensors="pt")
    grid = out["image_grid_thw"].to(torch.long)
    expected = torch.tensor(spec.grids(), dtype=torch.long).reshape(-1, 3)
    if not torch.equal(grid, expected):
        raise ImageError(f"{spec.key}: the image processor gave grids {grid.tolist()}, but the "
                         f"prompt was built for {expected.tolist()}; its patch/merge size "
                         "differs from data.args (patch_size, merge_size)")
    COUNTERS["images_processed"] += len(images)
    COUNTERS["prompts_processed"] += 1
    return (VisionInputs(spec.key, out["pixel_values"], grid, spec.sizes,
                         tuple(img.size for img in images)), images)


# --------------------------------------------------------------------------- model side


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


def parts(model: torch.nn.Module) -> Parts:
    hf = hf_model(model)
    inner = getattr(hf, "model", None)
    if inner is None or not hasattr(inner, "visual") or not hasattr(inner, "language_model"):
        raise TypeError(f"{type(hf).__name__} is not a Qwen2-VL/Qwen2.5-VL/Qwen3-VL model "
                        "(expected .model.visual and .model.language_model)")
    vcfg = hf.config.vision_config
    patch = vcfg.patch_size if isinstance(vcfg.patch_size, int) else vcfg.patch_size[0]
    temporal = vcfg.temporal_patch_size if isinstance(vcfg.temporal_patch_size, int) \
        else vcfg.temporal_patch_size[0]
    return Parts(inner=inner, visual=inner.visual, language_model=inner.language_model,
                 lm_head=hf.lm_head, image_token_id=int(hf.config.image_token_id),
                 merge_size=int(vcfg.spatial_merge_size),
                 patch_dim=int(getattr(vcfg, "in_channels", getattr(vcfg, "in_chans", 3)))
                 * temporal * patch * patch,
                 deepstack=bool(getattr(vcfg, "deepstack_visual_indexes", None)))


def rope_index(p: Parts, ids: torch.Tensor, mask: torch.Tensor, grids: torch.Tensor | None,
               image_mask: torch.Tensor | None = None) -> torch.Tensor:
    """M-RoPE position ids ``[3, B, L]`` from the model's own ``get_rope_index``.

    ``grids`` holds the ``image_grid_thw`` rows of every image in the batch, in row order;
    ``image_mask`` marks the image placeholder positions (default: every image-token id).
    Padding positions get 0 (the attention mask hides them).
    """
    if image_mask is None:
        image_mask = ids == p.image_token_id
    fn = p.inner.get_rope_index
    params = inspect.signature(fn).parameters
    kwargs: dict[str, Any] = {"input_ids": ids, "attention_mask": mask}
    if "image_grid_thw" in params:
        kwargs["image_grid_thw"] = grids
    if "mm_token_type_ids" in params:  # transformers >= 5: which tokens are image tokens
        kwargs["mm_token_type_ids"] = image_mask.to(torch.int32)
    elif bool((image_mask != (ids == p.image_token_id)).any()):
        # this transformers version finds images by token id alone: hide sampled ones
        kwargs["input_ids"] = ids.masked_fill(~image_mask & (ids == p.image_token_id), 0)
    position_ids, _ = fn(**kwargs)
    return position_ids


def _features(p: Parts, pixel_values: torch.Tensor, grid: torch.Tensor
              ) -> tuple[torch.Tensor, list[torch.Tensor] | None]:
    """Merged image features ``[tokens, hidden]`` (and Qwen3-VL's deepstack features)."""
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
    COUNTERS["vision_passes"] += 1
    COUNTERS["vision_images"] += int(grid.shape[0])
    return feats, (list(deep) if deep else None)


def _dummy(p: Parts, device: torch.device, dtype: torch.dtype
           ) -> tuple[torch.Tensor, list[torch.Tensor] | None]:
    pv = torch.zeros(p.merge_size ** 2, p.patch_dim, device=device, dtype=dtype)
    grid = torch.tensor([[1, p.merge_size, p.merge_size]], device=device)
    COUNTERS["dummy_vision_passes"] += 1
    return _features(p, pv, grid)


def embed(p: Parts, ids: torch.Tensor, rows: list[VisionInputs | None], *,
          dummy_if_empty: bool, image_mask: torch.Tensor | None = None
          ) -> tuple[torch.Tensor, torch.Tensor | None, dict[str, Any]]:
    """Input embeddings with image features in place, grids in row order, extra LM kwargs.

    Features are computed once per distinct ``VisionInputs.key`` among ``rows``.
    ``image_mask`` marks the placeholder positions (default: every image-token id; pass the
    prompt's only when responses may contain a sampled image token, which stays text).
    """
    emb_layer = p.language_model.get_input_embeddings()
    emb = emb_layer(ids)
    device, dtype = emb.device, p.visual.dtype if hasattr(p.visual, "dtype") else emb.dtype
    unique: dict[str, int] = {}
    order: list[VisionInputs] = []
    for v in rows:
        if v is not None and v.key not in unique:
            unique[v.key] = len(order)
            order.append(v)
    if image_mask is None:
        image_mask = ids == p.image_token_id
    extra: dict[str, Any] = {}
    if not order:
        if bool(image_mask.any()):
            raise ValueError("the batch has image tokens in its prompts but no images; the "
                             "rows lost their vision inputs (was the record built by a VL "
                             "workflow?)")
        if dummy_if_empty:  # every parameter takes part, so FSDP ranks stay in step
            feats, deep = _dummy(p, device, dtype)
            zero = feats.sum() * 0.0 + sum((d.sum() * 0.0 for d in deep or []), 0.0)
            emb = emb + zero.to(emb.dtype)
        return emb, None, extra
    pv = torch.cat([v.pixel_values for v in order]).to(device=device, dtype=dtype)
    grid = torch.cat([v.image_grid_thw for v in order]).to(device)
    feats, deep = _features(p, pv, grid)
    # where each prompt's features start in ``feats``
    per_prompt = [int((v.image_grid_thw.prod(-1) // p.merge_size ** 2).sum()) for v in order]
    starts = torch.tensor([0] + per_prompt[:-1]).cumsum(0).tolist()
    index, grids = [], []
    for b, v in enumerate(rows):
        n_tokens = int(image_mask[b].sum())
        if v is None:
            if n_tokens:
                raise ValueError(f"row {b} has {n_tokens} image tokens but no images")
            continue
        k = unique[v.key]
        if n_tokens != per_prompt[k]:
            raise ValueError(f"row {b} ({v.key}) has {n_tokens} image tokens in its prompt, but "
                             f"its images give {per_prompt[k]} features (t*h*w/merge^2 per "
                             "image); the prompt ids and the images do not belong together")
        index.append(torch.arange(starts[k], starts[k] + per_prompt[k]))
        grids.append(v.image_grid_thw)
    gather = torch.cat(index).to(device)
    emb = emb.masked_scatter(image_mask.unsqueeze(-1), feats[gather].to(emb.dtype))
    if p.deepstack and deep:
        extra = {"visual_pos_masks": image_mask,
                 "deepstack_visual_embeds": [d[gather].to(emb.dtype) for d in deep]}
    return emb, torch.cat(grids).to(device), extra


def vl_forward(model: torch.nn.Module, ids: torch.Tensor, mask: torch.Tensor,
               rows: list[VisionInputs | None], *, logits_to_keep: int,
               dummy_if_empty: bool = True, use_cache: bool = False,
               position_ids: torch.Tensor | None = None, image_mask: torch.Tensor | None = None):
    """Logits of the last ``logits_to_keep`` positions (and the cache and positions).

    Returns ``(logits, past_key_values, position_ids)``.
    """
    p = parts(model)
    if image_mask is None:
        image_mask = ids == p.image_token_id
    emb, grids, extra = embed(p, ids, rows, dummy_if_empty=dummy_if_empty, image_mask=image_mask)
    if position_ids is None:
        position_ids = rope_index(p, ids, mask, grids, image_mask)
    out = p.language_model(input_ids=None, inputs_embeds=emb, attention_mask=mask,
                           position_ids=position_ids, use_cache=use_cache, **extra)
    hidden = out.last_hidden_state[:, -logits_to_keep:]
    return p.lm_head(hidden), out.past_key_values, position_ids


def decode_step(model: torch.nn.Module, tokens: torch.Tensor, mask: torch.Tensor,
                position_ids: torch.Tensor, cache: Any) -> tuple[torch.Tensor, Any]:
    """One cached decoding step for new text tokens ``[B, 1]`` at ``position_ids [3, B, 1]``."""
    p = parts(model)
    emb = p.language_model.get_input_embeddings()(tokens)
    out = p.language_model(input_ids=None, inputs_embeds=emb, attention_mask=mask,
                           position_ids=position_ids, past_key_values=cache, use_cache=True)
    return p.lm_head(out.last_hidden_state[:, -1:]), out.past_key_values


def sequence_positions(p: Parts, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor,
                       response_len: int, rows: list[VisionInputs | None]) -> torch.Tensor:
    """M-RoPE positions ``[3, B, P + R]`` of left-padded prompts followed by responses.

    ``get_rope_index`` runs once per distinct prompt with images (a group of ``n`` shares
    it); text rows count up from their first real token. Response tokens continue from the
    prompt's largest position + 1 in all three rows, which is what ``get_rope_index`` gives
    for text that follows the prompt (the unit tests check the two agree).
    """
    b, plen = prompt_ids.shape
    device = prompt_ids.device
    pos = ((prompt_mask.cumsum(-1) - 1).clamp(min=0) * prompt_mask).unsqueeze(0).repeat(3, 1, 1)
    first: dict[str, int] = {}
    for i, v in enumerate(rows):
        if v is not None and v.key not in first:
            first[v.key] = i
    if first:
        reps = list(first.values())
        grids = torch.cat([rows[i].image_grid_thw for i in reps]).to(device)
        rep_pos = rope_index(p, prompt_ids[reps], prompt_mask[reps], grids,
                             prompt_ids[reps] == p.image_token_id)
        slot = {key: k for k, key in enumerate(first)}
        for i, v in enumerate(rows):
            if v is not None:
                pos[:, i] = rep_pos[:, slot[v.key]]
    start = pos.amax(dim=(0, 2)) + 1  # [B]
    resp = start[:, None] + torch.arange(response_len, device=device)[None, :]
    return torch.cat([pos, resp.unsqueeze(0).expand(3, b, response_len)], dim=2)


def response_logprobs(model: torch.nn.Module, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor,
                      response_ids: torch.Tensor, response_mask: torch.Tensor,
                      rows: list[VisionInputs | None], temperature: float = 1.0,
                      with_entropy: bool = False, dummy_if_empty: bool = True
                      ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs (and entropy) of each response token, images included, positions by M-RoPE."""
    ids = torch.cat([prompt_ids, response_ids], dim=1)
    mask = torch.cat([prompt_mask, response_mask], dim=1)
    r = response_ids.shape[1]
    # only the prompt holds image placeholders; a sampled image-token id is text
    image_mask = torch.cat([prompt_ids == parts(model).image_token_id,
                            torch.zeros_like(response_ids, dtype=torch.bool)], dim=1)
    positions = sequence_positions(parts(model), prompt_ids, prompt_mask, r, rows)
    logits, _, _ = vl_forward(model, ids, mask, rows, logits_to_keep=r + 1,
                              dummy_if_empty=dummy_if_empty, image_mask=image_mask,
                              position_ids=positions)
    logits = logits[:, :-1].float()
    if temperature != 1.0:
        logits = logits / temperature
    lse = torch.logsumexp(logits, dim=-1)
    logp = logits.gather(-1, response_ids.unsqueeze(-1)).squeeze(-1) - lse
    entropy = None
    if with_entropy:
        probs = torch.softmax(logits, dim=-1)
        entropy = lse - (probs * logits).sum(-1)
    return logp, entropy
