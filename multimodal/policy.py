"""The ``qwen_vl`` policy kind: Qwen2-VL, Qwen2.5-VL and Qwen3-VL through `transformers`.

It is the core's causal-LM policy (optimizer, schedule, reference, checkpoints, SFT
optimizer, export) with a vision-language forward pass: each record row carries its
prompt's processed images and videos (the ``vision`` column a VL workflow writes, shared by
the prompt's ``n`` samples), the vision tower runs once per distinct prompt in a micro-batch,
and M-RoPE position ids come from the model's own ``get_rope_index`` over prompt and
response. With ``shared_prefix`` (the default) rows of a micro-batch that share a prefix
(a group's prompt and image) compute it once where the cost model says that pays
(:func:`polyrl.multimodal.forward.shared_logprobs`). Rows without a ``vision`` column (the
core's SFT warm start) are processed from the references their dataset row keeps. A batch without images runs the vision tower on a
dummy patch with weight zero (safe under FSDP). Under ``distributed.backend: ray`` each rank
shards the vision blocks and decoder layers with FSDP2, with :class:`ResponseScorer` (the
module whose forward runs the pass) as the root unit.

Its options (``policies.<name>.args``) are :class:`QwenVLOptions`: ``freeze_vision``,
``lora_vision``, ``attn_implementation``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Unpack

import torch
from tensordict import TensorDict

from polyrl.core.config import doc
from polyrl.core.interfaces import PolicyBuild
from polyrl.core.options import Options, bind
from polyrl.core.record import strings
from polyrl.core.registry import POLICIES
from polyrl.core.runner.builds import ensure_model
from polyrl.core.train.policy import (
    CausalLMPolicy,
    PolicyConfig,
    check_moe_options,
    prepare_for_training,
)
from polyrl.multimodal import flops, forward, turns, vision
from polyrl.multimodal.data import VISION_FIELD

VISION_LORA_TARGETS = ("qkv", "proj")  # attention projections of the Qwen-VL vision blocks


@dataclass
class QwenVLOptions(Options):
    """``policies.<name>.args`` of the ``qwen_vl`` policy kind."""

    freeze_vision: bool = doc(False, "the vision tower (and its merger) takes no gradient")
    lora_vision: bool = doc(
        False,
        "with lora.r > 0, adapters on the vision tower's attention too (default: the "
        "language model only)",
    )
    attn_implementation: str | None = doc(
        None,
        "transformers' attention kernel, e.g. sdpa, eager, flash_attention_2 (null: its default)",
    )


def lora_target_regex(names: list[str], with_vision: bool) -> str:
    """A PEFT ``target_modules`` regex: the named linear layers of the language model only,
    or of the vision tower too (``with_vision``)."""
    text = "|".join(re.escape(n) for n in names)
    if not with_vision:
        return rf"^(?!.*\bvisual\b).*\.({text})$"
    vis = "|".join(re.escape(n) for n in (*names, *VISION_LORA_TARGETS))
    return rf"^(?:(?!.*\bvisual\b).*\.({text})|.*\bvisual\b.*\.({vis}))$"


class ResponseScorer(torch.nn.Module):
    """A Qwen-VL model's response log-probs as one module's forward.

    The pass calls the model's parts one by one (embeddings, vision tower, language model,
    head), never the model's own forward. Under FSDP2 (the Ray backend) this wrapper is the
    root unit (:meth:`QwenVLPolicy.fsdp_root`), so the weights outside the sharded layers
    and blocks (embeddings, head, patch embedding, merger) are gathered around its forward
    and their gradients reduced after its backward.
    """

    def __init__(
        self, model: torch.nn.Module, shared_prefix: bool = False, min_shared: int = 16
    ) -> None:
        super().__init__()
        self.model = model
        self.shared_prefix, self.min_shared = shared_prefix, min_shared

    def forward(
        self,
        batch: dict[str, torch.Tensor],
        rows: list[vision.VisionInputs | None],
        temperature: float,
        with_entropy: bool,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        return forward.response_logprobs(
            self.model,
            batch,
            rows,
            temperature,
            with_entropy,
            shared_prefix=self.shared_prefix,
            min_shared=self.min_shared,
        )


class QwenVLPolicy(CausalLMPolicy):
    """A Qwen-VL model, fully fine-tuned or with a PEFT LoRA adapter (language model only by
    default); see the module docstring for its options."""

    # its own pass routes no experts: moe options are refused
    caps = replace(CausalLMPolicy.caps, routes_experts=False)

    def __init__(self, name: str, cfg: PolicyConfig, **build: Unpack[PolicyBuild]) -> None:
        from transformers import AutoModelForImageTextToText

        check_moe_options(name, cfg, kind=type(self))  # config built in code: before loading
        self.name, self.cfg = name, cfg
        self.device = torch.device(build.get("device") or "cpu")
        # typed by the recipe; bound here too for a config built in code
        self.options = bind(
            QwenVLOptions, cfg.args, f"policies.{name}.args", "<config>", "policy kind 'qwen_vl'"
        )
        path = ensure_model(cfg.model, cfg.build, cfg.build_args)
        self.tokenizer = self.load_tokenizer(cfg)
        self.processor = self.tokenizer.polyrl_processor
        dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[cfg.dtype]
        kwargs: dict[str, Any] = {"dtype": dtype}
        if self.options.attn_implementation:
            kwargs["attn_implementation"] = self.options.attn_implementation
        model = AutoModelForImageTextToText.from_pretrained(path, **kwargs).to(self.device)
        forward.parts(model)  # fail now, with a clear message, if this is not a Qwen-VL model
        if cfg.gradient_checkpointing:
            model.gradient_checkpointing_enable()
        if self.options.freeze_vision:
            forward.parts(model).visual.requires_grad_(False)
        self.need_reference = build["need_reference"]
        self.reference_warmed = False  # a warm start has not moved the reference yet
        self.model, self.reference, self.optimizer, self.scheduler = prepare_for_training(
            model,
            cfg,
            need_reference=self.need_reference,
            total_steps=build["total_steps"],
            lora_targets=lora_target_regex(list(cfg.lora.target_modules), self.options.lora_vision),
        )
        share = (cfg.shared_prefix, cfg.shared_prefix_min_tokens)
        self.scorer = ResponseScorer(self.model, *share)
        self.ref_scorer = (
            ResponseScorer(self.reference, *share) if self.reference is not None else None
        )

    def fsdp_root(self, model: torch.nn.Module) -> torch.nn.Module:
        """The module whose forward runs ``model`` (the policy's or the reference) in training;
        the Ray backend makes it the FSDP2 root unit (see :class:`ResponseScorer`)."""
        for scorer in (self.scorer, self.ref_scorer):
            if scorer is not None and scorer.model is model:
                return scorer
        raise ValueError(
            f"policy {self.name!r}: {type(model).__name__} is neither its model nor its reference"
        )

    @staticmethod
    def load_tokenizer(cfg: PolicyConfig):
        """The model's tokenizer, carrying its processor as ``polyrl_processor`` (the ``vl``
        dataset kind resizes and counts image tokens with it)."""
        from transformers import AutoProcessor

        path = ensure_model(cfg.model, cfg.build, cfg.build_args)
        processor = AutoProcessor.from_pretrained(path)
        tokenizer = getattr(processor, "tokenizer", None)
        if tokenizer is None or not hasattr(processor, "image_processor"):
            raise ValueError(
                f"{cfg.model!r}: AutoProcessor gave {type(processor).__name__}, not "
                "a vision-language processor; is this a Qwen-VL model?"
            )
        if tokenizer.pad_token_id is None:
            tokenizer.pad_token = tokenizer.eos_token
        tokenizer.polyrl_processor = processor
        return tokenizer

    # --- images across turns (core/interfaces.py TakesImageTurns, HostImageTurns) ------
    @classmethod
    def image_turns(cls, tokenizer) -> turns.ImageTurns:
        return turns.ImageTurns(tokenizer.polyrl_processor)

    @property
    def image_token_id(self) -> int:
        return turns.image_token_id(self.processor)

    def encode_images(self, images: list) -> tuple[list[list[int]], vision.VisionInputs]:
        return turns.encode_images(self.processor, images)

    def join_images(self, handles: list, starts: list[int], key: str) -> vision.VisionInputs | None:
        return turns.join_images(handles, starts, key)

    # --- per-row images ----------------------------------------------------------------
    def vision_rows(self, batch: TensorDict) -> list[vision.VisionInputs | None]:
        """Each row's processed images: the record's ``vision`` column, or processed now
        (once per distinct prompt) from the dataset row's references."""
        n = batch.batch_size[0]
        keys = set(batch.keys())
        if "vision" in keys:
            return list(strings(batch, "vision"))
        if "meta" not in keys:
            return [None] * n
        done: dict[str, vision.VisionInputs] = {}
        out: list[vision.VisionInputs | None] = []
        for meta in strings(batch, "meta"):
            row = meta.get("row") if isinstance(meta, dict) else None
            spec = row.get(VISION_FIELD) if isinstance(row, dict) else None
            if spec is None:
                out.append(None)
                continue
            if spec.key not in done:
                done[spec.key] = vision.process(
                    spec,
                    self.processor.image_processor,
                    getattr(self.processor, "video_processor", None),
                )[0]
            out.append(done[spec.key])
        return out

    def vision_flops(self, record: TensorDict) -> tuple[torch.Tensor, torch.Tensor]:
        """Per row: the FLOPs of the vision tower encoding the row's images and videos once
        (a forward; counted per row, though the engine encodes a prompt's once for its
        samples), and in a training pass: forward and backward, or the forward alone when
        the tower takes no gradient (``freeze_vision``, LoRA on the language model)."""
        visual = forward.parts(self.model).visual
        trains = any(p.requires_grad for p in visual.parameters())
        done: dict[tuple, float] = {}
        out = []
        for inputs in self.vision_rows(record):
            grids: tuple = ()
            # a mixed team's record: other members' rows hold no images (an empty entry)
            if isinstance(inputs, vision.VisionInputs):
                both = inputs.image_grid_thw.tolist() + inputs.video_grid_thw.tolist()
                grids = tuple(tuple(int(x) for x in g) for g in both)
            if grids not in done:
                done[grids] = flops.vision_flops(visual, visual.config, grids) if grids else 0.0
            out.append(done[grids])
        once = torch.tensor(out, dtype=torch.float64)
        return once, once * (3.0 if trains else 1.0)

    # --- what the trainer calls -------------------------------------------------------
    def _logprobs(
        self, scorer: ResponseScorer, batch: TensorDict, temperature: float, with_entropy: bool
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        rows = self.vision_rows(batch)
        t = {
            k: batch[k].to(self.device)
            for k in ("prompt_ids", "prompt_mask", "response_ids", "response_mask")
        }
        return scorer(t, rows, temperature, with_entropy)

    def logprobs(
        self, batch: TensorDict, temperature: float = 1.0, with_entropy: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        return self._logprobs(self.scorer, batch, temperature, with_entropy)

    @torch.no_grad()
    def ref_logprobs(self, batch: TensorDict, temperature: float = 1.0) -> torch.Tensor:
        if self.ref_scorer is not None:
            return self._logprobs(self.ref_scorer, batch, temperature, False)[0]
        with self.model.disable_adapter():
            return self._logprobs(self.scorer, batch, temperature, False)[0]

    def export(self, out_dir: str | Path) -> Path:
        """Hugging Face format with the processor (a PEFT adapter folder for LoRA)."""
        out = Path(out_dir)
        self.model.save_pretrained(out)
        self.processor.save_pretrained(out)
        return out


POLICIES.register("qwen_vl", QwenVLPolicy, options=QwenVLOptions)
