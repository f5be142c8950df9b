"""The ``hf_vl`` engine: sampling from a Qwen-VL policy with images and videos.

Like the core's HF engine (same RNG state, sampling rule and stop handling), plus images and
videos: ``generate`` with requests carrying ``vision`` prefills each prompt *once* (its images
and videos through the vision tower once), then repeats the KV cache for the prompt's ``n``
samples, so a group of ``n`` never processes its images or videos ``n`` times. Decoding
continues the M-RoPE positions after the prompt's last position
(:func:`~polyrl.multimodal.forward.next_positions`), as ``get_rope_index`` does for text that
follows the prompt.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Annotated

import torch

from polyrl.core.engine import (
    Completion,
    HFEngine,
    Prompt,
    Request,
    SamplingParams,
    as_requests,
    reserved_cache,
    sample_next,
    seeded,
    stream_tokens,
    token_sinks,
    top_logprobs,
)
from polyrl.core.record import pad_left
from polyrl.core.registry import ENGINES
from polyrl.multimodal.forward import (
    decode_step,
    image_masks,
    next_positions,
    parts,
    token_mask,
    vl_forward,
)
from polyrl.multimodal.vision import VisionInputs


class VLEngine(HFEngine):
    """Batched sampling with a KV cache and images; ``batch_size`` counts sampled rows."""

    takes_images = True  # core/interfaces.py TakesImages: requests carry ``vision``
    partial_rollouts = True  # interfaces.PartialRollouts: refresh before each decoding step

    def __init__(
        self,
        policy,
        *,
        batch_size: Annotated[
            int, "sampled rows per forward pass: each chunk holds batch_size // n prompts"
        ] = 256,
        seed: int = 0,
    ) -> None:
        if batch_size < 1:
            raise ValueError(f"hf_vl engine: batch_size must be >= 1, got {batch_size}")
        super().__init__(policy, batch_size=batch_size, seed=seed)

    @torch.no_grad()
    def generate(self, prompts: Sequence[Prompt], params: SamplingParams) -> list[Completion]:
        """``params.n`` completions per prompt, grouped by prompt (prompt 0's first); a
        request's ``vision`` holds its images and videos (``images`` are not needed here)."""
        requests = as_requests(prompts)
        per_chunk = max(1, self.batch_size // max(1, params.n))
        out: list[Completion] = []
        for start in range(0, len(requests), per_chunk):
            idx = list(range(start, min(len(requests), start + per_chunk)))
            out += self._generate_chunk(idx, [requests[i] for i in idx], params)
        return out

    def _generate_chunk(
        self, index: list[int], requests: list[Request], params: SamplingParams
    ) -> list[Completion]:
        prompts = [r.prompt for r in requests]
        visions: list[VisionInputs | None] = [r.vision for r in requests]
        model = self.policy.model
        device = next(model.parameters()).device
        stop_t = self._stop_ids(params, device)
        ids, mask = pad_left(prompts, self.tokenizer.pad_token_id)
        ids, mask = ids.to(device), mask.to(device)
        image_mask = video_mask = None
        turns = [i for i, v in enumerate(visions) if v is not None and v.image_starts is not None]
        if turns:  # multi-turn prompts: images by position, a sampled vision token is text
            p = parts(model)
            image_mask = image_masks(p, ids, mask, visions, token_mask(p, ids))
            video_mask = token_mask(p, ids, video=True)
            video_mask[turns] = False
        refresh = self._refresh
        version = refresh() if refresh is not None else 0  # of the weights that make `logits`
        logits, cache, pos = vl_forward(
            model,
            ids,
            mask,
            visions,
            logits_to_keep=1,
            dummy_if_empty=False,
            use_cache=True,
            cache=reserved_cache(model, params.max_new_tokens),
            image_mask=image_mask,
            video_mask=video_mask,
        )
        next_pos = next_positions(pos)  # text after the prompt continues from its last token
        n = params.n
        gen = self.gen if params.seed is None else seeded(params.seed)
        if n > 1:  # the group shares the prompt's prefill (and its single vision pass)
            cache.batch_repeat_interleave(n)
            logits = logits.repeat_interleave(n, dim=0)
            mask = mask.repeat_interleave(n, dim=0)
            next_pos = next_pos.repeat_interleave(n, dim=0)
        b = mask.shape[0]
        caps = torch.tensor(
            [r.budget(params) for r in requests for _ in range(n)], dtype=torch.long, device=device
        )
        tokens = torch.zeros((b, params.max_new_tokens), dtype=torch.long, device=device)
        logps = torch.zeros((b, params.max_new_tokens), dtype=torch.float32, device=device)
        versions = torch.zeros((b, params.max_new_tokens), dtype=torch.long, device=device)
        done = torch.zeros(b, dtype=torch.bool, device=device)
        stopped = torch.zeros(b, dtype=torch.bool, device=device)
        lengths = torch.full((b,), params.max_new_tokens, dtype=torch.long, device=device)
        k_top = params.top_logprobs  # as the HF engine: the k likeliest of each step
        top_ids = torch.zeros((b, params.max_new_tokens, k_top), dtype=torch.long, device=device)
        top_lps = torch.zeros((b, params.max_new_tokens, k_top), device=device)
        last = logits[:, -1]
        sinks, rows = token_sinks(requests, n), torch.arange(b)  # Request.on_token
        for t in range(params.max_new_tokens):
            tok, lp = sample_next(last, params, gen)
            tokens[:, t], logps[:, t], versions[:, t] = tok, lp, version
            if k_top:
                top_lps[:, t], top_ids[:, t] = top_logprobs(last, params)
            if sinks:
                stream_tokens(
                    sinks, rows, done, tok, lp, (top_lps[:, t], top_ids[:, t]) if k_top else None
                )
            finished = ~done & torch.isin(tok, stop_t)
            if params.stop:
                finished |= ~done & self._hit_stop_string(tokens[:, : t + 1], done, params.stop)
            lengths = torch.where(finished, t + 1, lengths)
            done |= finished
            capped = ~done & (caps <= t + 1)  # a request's own, shorter budget
            lengths = torch.where(capped, t + 1, lengths)
            stopped |= finished
            done |= capped
            if bool(done.all()) or t == params.max_new_tokens - 1:
                break
            mask = torch.cat([mask, torch.ones((b, 1), dtype=mask.dtype, device=device)], 1)
            step_pos = next_pos.view(1, b, 1).expand(3, b, 1)
            if refresh is not None:  # newer weights go on from the cache the old ones made
                version = refresh()
            step_logits, cache = decode_step(model, tok[:, None], mask, step_pos, cache)
            last = step_logits[:, -1]
            next_pos = next_pos + 1
        result = []
        for k in range(b):
            m = int(lengths[k])
            tid = tokens[k, :m].tolist()
            text = self.tokenizer.decode(tid, skip_special_tokens=True)
            reason = "stop" if bool(stopped[k]) else "length"
            vers = versions[k, :m].tolist() if refresh is not None else None
            tops = None
            if k_top:
                tops = list(zip(top_ids[k, :m].tolist(), top_lps[k, :m].tolist(), strict=True))
            result.append(
                Completion(index[k // n], tid, logps[k, :m].tolist(), reason, text, vers, tops)
            )
        return result


ENGINES.register("hf_vl", VLEngine)
