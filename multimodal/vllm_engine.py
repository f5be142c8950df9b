"""The ``vllm_vl`` engine: the vLLM engine with images (``engine.name: vllm_vl``).

``generate(requests, params)`` keeps ``hf_vl``'s contract (``n``
completions per prompt, grouped by prompt; token ids exactly as sampled; temperature-scaled
log-probs) and hands each prompt's images to vLLM as ``multi_modal_data``. Everything else
(start-up, per-row seeds, ``sync``, sleep/wake) is the core's
:class:`~polyrl.core.rollout.vllm_engine.VLLMEngine`.

What keeps vLLM's view of a prompt equal to the trainer's:

- **Placeholders.** The prompt ids of a VL dataset already hold each image's
  ``t*h*w/merge^2`` image-pad tokens. vLLM's Qwen-VL processor (0.31) expands *every*
  image-pad token it finds into a full image, so the engine sends one pad per image and
  vLLM expands it back from the grid of the image it processed. The prompt ids vLLM
  returns must equal the original ids; if they do not (vLLM saw another grid), the call
  fails rather than train on a prompt the engine never saw.
- **Pixels.** The images handed over are the resized ones the workflow made
  (:func:`vision.process` returns them), or, where a workflow passes none (agents'
  ``multi_turn``, marl's runtime: images across turns), the resized images recovered
  exactly from the row's pixel values (:func:`vision.recover_images`). vLLM's image
  processor runs with ``do_resize=False``: the same images through the same processor
  config give the ``image_grid_thw`` and (up to float rounding: vLLM normalises on its
  device) the ``pixel_values`` the trainer scores with.
- **Turns.** A multi-turn row's images sit where its ``image_starts`` say; an image-pad id
  the policy sampled as text in an earlier turn is served after the last image, but is
  refused before one (vLLM takes the first pads it finds for the images).
- **Weights.** ``sync`` pushes the policy's full state dict (language model, vision tower
  and merger) under `transformers`' names; vLLM's Qwen2.5-VL ``load_weights`` maps
  ``model.language_model.`` / ``model.visual.`` / ``lm_head.`` itself. The engine then
  clears vLLM's encoder cache (the worker's reload clears only its own half of it), so no
  image features of the old weights are reused.

Images resized with a larger ``data.args.max_pixels`` than the model's processor has work
too (checked with 168x168 images against a 112x112 processor limit).

Importing this module does not import vllm (the engine does, when it is built).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from polyrl.core.config import doc
from polyrl.core.registry import ENGINES
from polyrl.core.rollout.engine import Completion, Prompt, SamplingParams, as_requests
from polyrl.core.rollout.vllm_engine import VLLMEngine, VLLMOptions
from polyrl.core.segment import Tokens
from polyrl.multimodal.forward import parts
from polyrl.multimodal.vision import VisionInputs, recover_images


def collapse_image_pads(
    ids: Sequence[int],
    pad_id: int,
    counts: Sequence[int],
    starts: Sequence[int] | None = None,
) -> list[int]:
    """The prompt with each image's run of ``counts[k]`` pad tokens cut to one pad.

    vLLM expands one pad per image into the image's tokens; the runs are taken in order, so
    two images whose runs touch are still told apart. ``starts`` (a multi-turn row's
    ``image_starts``) place the runs by position: a pad id elsewhere is text the policy
    sampled, which vLLM (it takes the first pads it finds for the images) can serve only
    after the last image. Errors say which run or token did not fit.
    """
    if starts is not None:
        return _collapse_at(list(ids), pad_id, counts, starts)
    out: list[int] = []
    i, k = 0, 0
    while i < len(ids):
        if ids[i] != pad_id:
            out.append(int(ids[i]))
            i += 1
            continue
        if k == len(counts):
            raise ValueError(
                f"the prompt has image-pad tokens at position {i} beyond its "
                f"{len(counts)} image(s); prompt ids and images do not belong "
                "together"
            )
        run = ids[i : i + counts[k]]
        if len(run) < counts[k] or any(t != pad_id for t in run):
            got = next((j for j, t in enumerate(run) if t != pad_id), len(run))
            raise ValueError(
                f"image {k} needs {counts[k]} image-pad tokens at position {i}, "
                f"the prompt has {got}; were its ids built for another resize?"
            )
        out.append(pad_id)
        i += counts[k]
        k += 1
    if k != len(counts):
        raise ValueError(
            f"the prompt has image-pad tokens for {k} image(s) but {len(counts)} were given"
        )
    return out


def _collapse_at(
    ids: list[int], pad_id: int, counts: Sequence[int], starts: Sequence[int]
) -> list[int]:
    if len(starts) != len(counts):
        raise ValueError(f"{len(starts)} image starts for {len(counts)} images")
    out: list[int] = []
    i = 0
    for k, (start, n) in enumerate(zip(starts, counts, strict=True)):
        run = ids[start : start + n]
        if start < i or len(run) < n or any(t != pad_id for t in run):
            raise ValueError(
                f"image {k} needs {n} image-pad tokens at position {start}; the prompt "
                "has other ids there: its ids and vision inputs do not belong together"
            )
        text = ids[i:start]
        if pad_id in text:
            raise ValueError(
                f"the prompt holds the image-pad id as text at position "
                f"{i + text.index(pad_id)}, before image {k} (sampled by the policy in "
                "an earlier turn): vLLM would take it for the image. Sample this "
                "conversation with hf_vl, which places images by position"
            )
        out += text + [pad_id]
        i = start + n
    return out + ids[i:]


def image_token_counts(vision: VisionInputs, merge_size: int) -> list[int]:
    """Placeholder tokens per image: ``t*h*w / merge^2`` of its grid."""
    return [int(t * h * w) // merge_size**2 for t, h, w in vision.image_grid_thw.tolist()]


class VLLMVLEngine(VLLMEngine):
    """vLLM sampling with images, following a ``qwen_vl`` policy's weights (``sync``)."""

    # requests may carry the resized images (Request.images); weights between calls only
    caps = dataclasses.replace(
        VLLMEngine.caps, takes_images=True, needs_images=True, partial_rollouts=False
    )

    def __init__(
        self,
        policy,
        *,
        seed: int = 0,
        mm_processor_kwargs: dict[str, Any] | None = None,
        **vllm: Any,
    ) -> None:
        """``vllm``: the vllm engine's options (:class:`~polyrl.core.rollout.vllm_engine.VLLMOptions`)."""
        p = parts(policy.model)
        self.image_token_id, self.merge_size = p.image_token_id, p.merge_size
        self.image_processor = policy.processor.image_processor
        # The images arrive resized (vision.process): keep vLLM from resizing them again.
        mm_kwargs = {**(mm_processor_kwargs or {}), "do_resize": False}
        super().__init__(policy, seed=seed, mm_processor_kwargs=mm_kwargs, **vllm)

    def generate(self, prompts: Sequence[Prompt], params: SamplingParams) -> list[Completion]:
        """``params.n`` completions per prompt, grouped by prompt (prompt 0's first).

        A request's ``images``: the resized PIL images its ``vision`` was processed from
        (``vision.process`` returns both); None: recovered from the vision inputs' pixel
        values, as a multi-turn workflow sends them.
        """
        requests = as_requests(prompts)
        self.wake()
        prepared = [
            self._request(i, r.prompt, r.vision, None if r.images is None else list(r.images))
            for i, r in enumerate(requests)
        ]
        rows = [r for r in prepared for _ in range(params.n)]
        index = [i for i in range(len(requests)) for _ in range(params.n)]
        expected = [requests[i].prompt for i in index]
        caps = [requests[i].budget(params) for i in index]
        seeds = self._row_seeds(len(rows), params)
        outs = self._generate_rows(rows, params, seeds, caps, check=self._same_prompt(expected))
        if self.sleep_enabled:
            self.sleep()
        decode = self.tokenizer.decode
        return [
            Completion(
                i,
                Tokens.given(requests[i].prompt),
                Tokens.sampled(ids, lps),
                reason,
                decode(ids, skip_special_tokens=True),
            )
            for i, (ids, lps, reason) in zip(index, outs, strict=True)
        ]

    def _push_weights(self, reset_cache: bool = True) -> None:
        super()._push_weights(reset_cache)
        # The worker's reload_weights clears its cached image features, but the scheduler
        # still lists them as cached, and the next request with a seen image then fails
        # ("Encoder cache miss"). Clearing both also keeps old-weight features from reuse.
        self.llm.llm_engine.reset_encoder_cache()

    def _request(
        self, i: int, ids: list[int], vision: VisionInputs | None, images: list[Any] | None
    ) -> dict[str, Any]:
        """One vLLM ``TokensPrompt``: one pad per image, the resized images as its data."""
        from vllm.inputs import TokensPrompt

        if vision is None:
            if images:
                raise ValueError(
                    f"vllm_vl: prompt {i} has {len(images)} image(s) but no vision inputs"
                )
            return TokensPrompt(prompt_token_ids=collapse_image_pads(ids, self.image_token_id, []))
        if images is None:
            images = recover_images(vision, self.image_processor)
        if len(images) != vision.num_images:
            raise ValueError(
                f"vllm_vl: prompt {i} ({vision.key}) has {vision.num_images} "
                f"processed image(s) but {len(images)} image(s) were passed; the "
                "vllm_vl engine needs the resized images too (Request.images)"
            )
        sizes = tuple(tuple(img.size) for img in images)
        if vision.resized and sizes != tuple(vision.resized):
            raise ValueError(
                f"vllm_vl: prompt {i} ({vision.key}): images of sizes {sizes} "
                f"but its vision inputs were processed at {vision.resized}; pass "
                "the resized images vision.process returned"
            )
        counts = image_token_counts(vision, self.merge_size)
        pads = collapse_image_pads(ids, self.image_token_id, counts, vision.image_starts)
        return TokensPrompt(
            prompt_token_ids=pads,
            multi_modal_data={"image": images},
        )

    @staticmethod
    def _same_prompt(expected: list[list[int]]):
        """A check that vLLM expanded row ``k``'s pads back to the trainer's prompt ids."""

        def check(k: int, out: Any) -> None:
            if list(out.prompt_token_ids) != expected[k]:
                raise RuntimeError(
                    f"vllm_vl: vLLM expanded row {k}'s prompt to {len(out.prompt_token_ids)} "
                    f"tokens, the trainer's prompt has {len(expected[k])}; vLLM's processor "
                    "gave its images other grids (another patch or merge size than the "
                    "policy's processor?)"
                )

        return check


@dataclasses.dataclass
class VLLMVLOptions(VLLMOptions):
    """Options of the vllm_vl engine: the vllm engine's and its multimodal processor's."""

    mm_processor_kwargs: dict | None = doc(
        None,
        "options of vLLM's multimodal processor (do_resize is always false: images arrive resized)",
    )


ENGINES.register("vllm_vl", VLLMVLEngine, options=VLLMVLOptions)
