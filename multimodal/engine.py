"""The ``hf_vl`` engine: sampling from a Qwen-VL policy with images and videos.

It is the core's HF engine (:class:`~polyrl.core.rollout.engine.HFEngine`: one decode loop, with its
sampling rule, stops, budgets, finished rows leaving the batch, token streams, partial
rollouts and MoE capture) with the Qwen-VL family's pieces (:class:`VisionFamily`): the
prefill embeds each distinct prompt's images and videos (through the vision tower once) and
places M-RoPE positions; the n samples of a prompt then share its KV cache, so a group of n
never processes its images or videos n times. Decoding continues the M-RoPE positions after
the prompt's last position (:func:`~polyrl.multimodal.forward.next_positions`), as
``get_rope_index`` does for text that follows the prompt.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Annotated, Any

import torch

from polyrl.core.record import pad_left
from polyrl.core.registry import ENGINES
from polyrl.core.rollout.engine import (
    Completion,
    HFEngine,
    Prefill,
    Prompt,
    Request,
    Row,
    RowStreams,
    SamplingParams,
    as_requests,
)
from polyrl.core.rollout.kv_cache import reserved_cache
from polyrl.multimodal.forward import (
    decode_step,
    image_masks,
    next_positions,
    parts,
    token_mask,
    vl_forward,
)
from polyrl.multimodal.vision import VisionInputs


class VisionFamily:
    """The Qwen-VL pieces of the decode loop (:class:`polyrl.core.rollout.engine.DecodeFamily`)."""

    def __init__(self, pad_token_id: int) -> None:
        self.pad_token_id = pad_token_id

    def prefill(self, model: Any, requests: Sequence[Request], room: int) -> Prefill:
        """Embeddings with each prompt's image and video features in place, M-RoPE positions
        from the model's ``get_rope_index``; the next position is text's after the prompt."""
        device = next(model.parameters()).device
        visions: list[VisionInputs | None] = [r.vision for r in requests]
        ids, mask = pad_left([r.prompt for r in requests], self.pad_token_id)
        ids, mask = ids.to(device), mask.to(device)
        image_mask = video_mask = None
        turns = [i for i, v in enumerate(visions) if v is not None and v.image_starts is not None]
        if turns:  # multi-turn prompts: images by position, a sampled vision token is text
            p = parts(model)
            image_mask = image_masks(p, ids, mask, visions, token_mask(p, ids))
            video_mask = token_mask(p, ids, video=True)
            video_mask[turns] = False
        logits, cache, pos = vl_forward(
            model,
            ids,
            mask,
            visions,
            logits_to_keep=1,
            dummy_if_empty=False,
            use_cache=True,
            cache=reserved_cache(model, room),
            image_mask=image_mask,
            video_mask=video_mask,
        )
        return Prefill(logits[:, -1], cache, mask, next_positions(pos))

    def step(
        self, model: Any, tokens: torch.Tensor, mask: torch.Tensor, pos: torch.Tensor, cache: Any
    ) -> torch.Tensor:
        """A sampled token is text: the same position in M-RoPE's three rows."""
        b = tokens.shape[0]
        logits, _ = decode_step(
            model, tokens[:, None], mask, pos.view(1, b, 1).expand(3, b, 1), cache
        )
        return logits[:, -1]


class VLEngine(HFEngine):
    """Batched sampling with a KV cache and images; ``batch_size`` counts sampled rows.

    A chunk holds whole groups (``batch_size // n`` prompts). Each chunk draws one random
    number per row per step until its last row ends, finished rows included, as this
    engine always has: finished rows leaving the decode batch (``drop_finished``) change
    no sample, only the work."""

    caps = replace(HFEngine.caps, takes_images=True)  # requests carry ``vision``

    def __init__(
        self,
        policy,
        *,
        batch_size: Annotated[
            int, "sampled rows per forward pass: each chunk holds batch_size // n prompts"
        ] = 256,
        seed: int = 0,
        drop_finished: Annotated[
            bool, "rows that stopped leave the decode batch once they are an eighth of it"
        ] = True,
    ) -> None:
        if batch_size < 1:
            raise ValueError(f"hf_vl engine: batch_size must be >= 1, got {batch_size}")
        super().__init__(policy, batch_size=batch_size, seed=seed, drop_finished=drop_finished)
        self.family = VisionFamily(self.tokenizer.pad_token_id)

    def requests(self, prompts: Sequence[Prompt]) -> list[Request]:
        """A request's ``vision`` holds its images and videos (``images`` are not needed)."""
        return as_requests(prompts)

    def batches(self, rows: Sequence[Row], n: int) -> list[slice]:
        step = max(1, self.batch_size // max(1, n)) * max(1, n)  # whole groups
        return [slice(s, s + step) for s in range(0, len(rows), step)]

    def stream(self, gen: torch.Generator, rows: int) -> RowStreams:
        return RowStreams([gen], [0] * rows, [False])

    def mix_key(self) -> Any:
        """None: a VL engine serves its own policy's calls only (the merged multi-policy
        call routes rows by token ids, and a VL forward runs on embeddings)."""
        return None

    def generate_mixed(
        self, calls: Sequence[tuple[Any, Sequence[Prompt]]], params: SamplingParams
    ) -> list[list[Completion]]:
        raise TypeError(
            f"hf_vl engine of policy {self.policy.name!r}: no merged calls over several "
            "policies (mix_key is None); call generate on each engine"
        )


ENGINES.register("hf_vl", VLEngine)
