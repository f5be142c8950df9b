"""The ``vl_single_turn`` workflow: one VL policy answers each image prompt ``n`` times.

Per prompt, the images are decoded, resized and processed once (:func:`vision.process`);
the ``n`` rows of the prompt's group share that one :class:`~vision.VisionInputs` object in
the record's ``vision`` column, and the engine prefills the prompt once for all ``n``.
``meta`` carries what image-aware rewards need: ``images`` (the resized RGB images the model
saw, one list shared by the group), ``image_sizes`` (source width, height) and
``resized_sizes``; for videos ``videos`` (each video's resized RGB frames, before the
processor repeats the last frame of an odd count), ``video_sizes`` (source width, height)
and ``video_resized_sizes``. ``images`` holds only the row's images, never frames. Nothing
outlives the step: the dataset keeps references only.

Each evaluation (a rollout whose sampling settings differ from the training rollouts')
draws the first answer to each held-out prompt under its image, with the ground truth, to
``<run>/samples/eval_answers_<k>.png`` (up to 32 prompts; response in green where it equals
the answer); the first is also ``answers_before.png`` and the latest ``answers_after.png``
in the run directory.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

from tensordict import TensorDict

from polyrl.core.interfaces import Phase, engine_caps, takes_images
from polyrl.core.record import build_rows
from polyrl.core.registry import WORKFLOWS
from polyrl.core.rollout.engine import Request, SamplingParams
from polyrl.core.rollout.workflow import Context, completion_rows
from polyrl.multimodal import vision
from polyrl.multimodal.data import processor_of
from polyrl.multimodal.samples import MATCH, draw_sheet

SHEET_PROMPTS = 32  # prompts drawn per evaluation sheet


class VLSingleTurn:
    """One VL policy answers each image prompt ``n`` times; registered as ``vl_single_turn``."""

    def __init__(
        self,
        ctx: Context,
        policy: Annotated[str | None, "the answering policy (null: the first)"] = None,
    ) -> None:
        name = policy or next(iter(ctx.policies))
        if name not in ctx.policies:
            raise KeyError(f"vl_single_turn: unknown policy {name!r}; have {sorted(ctx.policies)}")
        self.name, self.engine = name, ctx.engines[name]
        if not takes_images(self.engine):
            raise TypeError(
                f"vl_single_turn: the engine of policy {name!r} "
                f"({type(self.engine).__name__}) takes no images; set "
                f"policies.{name}.engine.name=hf_vl (or vllm_vl)"
            )
        self.tokenizer = ctx.policies[name].tokenizer
        self.processor = processor_of(self.tokenizer)
        self.ctx = ctx
        self.run_dir = ctx.run_dir
        self._sheets = 0

    @staticmethod
    def validate_config(cfg) -> None:
        """Config-time check (called by the recipe): an image-capable engine."""
        from polyrl.core.config import ConfigError
        from polyrl.core.registry import ENGINES

        name = cfg.rollout.args.policy or next(iter(cfg.policies))
        if name not in cfg.policies:
            raise ConfigError(
                f"rollout.args.policy={name!r} is not one of the recipe's "
                f"policies {sorted(cfg.policies)}"
            )
        engine = cfg.policies[name].engine.name
        if not takes_images(ENGINES.get(engine)):
            raise ConfigError(
                f"rollout.workflow=vl_single_turn needs an engine that takes "
                f"images; policies.{name}.engine.name={engine!r} does not. Set "
                f"it to hf_vl, or vllm_vl where vLLM is installed."
            )

    def rollout(self, items: list, params: SamplingParams, phase: Phase = "train") -> TensorDict:
        visions, images, videos = [], [], []
        video_processor = getattr(self.processor, "video_processor", None)
        for it in items:
            spec = getattr(it, "vision", None)
            if spec is None:
                visions.append(None)
                images.append([])
                videos.append([])
                continue
            v, imgs, frames = vision.process_frames(
                spec, self.processor.image_processor, video_processor
            )
            visions.append(v)
            images.append(imgs)
            videos.append(frames)
        # vllm_vl hands vLLM the resized images themselves (hf_vl needs only their pixels)
        needs = engine_caps(self.engine).needs_images
        if needs and any(frames for frames in videos):
            raise ValueError(
                f"vl_single_turn: the engine of policy {self.name!r} "
                f"({type(self.engine).__name__}) takes images but not videos; "
                f"set policies.{self.name}.engine.name=hf_vl for video prompts"
            )
        requests = [
            Request(list(it.prompt_ids), vision=v, images=imgs if needs else None)
            for it, v, imgs in zip(items, visions, images, strict=True)
        ]
        outs = self.engine.generate(requests, params)
        metas = [
            {
                "answer": it.answer,
                "row": it.row,
                "images": images[k],
                "image_sizes": list(v.sizes) if v else [],
                "resized_sizes": list(v.resized) if v else [],
                "videos": videos[k],
                "video_sizes": list(v.video_sizes) if v else [],
                "video_resized_sizes": list(v.video_resized) if v else [],
            }
            for k, (it, v) in enumerate(zip(items, visions, strict=True))
        ]
        rows = completion_rows(self.name, items, outs)
        for row, o in zip(rows, outs, strict=True):
            row.meta, row.vision = metas[o.prompt_index], visions[o.prompt_index]
        record = build_rows(rows, self.tokenizer.pad_token_id)
        if self.run_dir is not None and phase == "eval":
            # a video prompt without images is drawn under its first frame
            self.write_sheet(
                items,
                [
                    imgs or [f[0] for f in frames][:1]
                    for imgs, frames in zip(images, videos, strict=True)
                ],
                outs,
            )
        return record

    def write_sheet(self, items: list, images: list[list], outs: list) -> Path:
        """The evaluation's answers under their images (first answer per prompt)."""
        first: dict[int, str] = {}
        for o in outs:
            first.setdefault(o.prompt_index, o.text)
        cells = []
        for k in sorted(first)[:SHEET_PROMPTS]:
            response, answer = first[k].strip(), str(items[k].answer).strip()
            colour = MATCH if response.lower() == answer.lower() else (0, 0, 0)
            cells.append((images[k][0] if images[k] else None, response, answer, colour))
        run = Path(self.run_dir)
        out = run / "samples" / f"eval_answers_{self._sheets:06d}.png"
        out.parent.mkdir(parents=True, exist_ok=True)
        sheet = draw_sheet(cells)
        sheet.save(out)
        if self._sheets == 0 and not (run / "answers_before.png").exists():
            sheet.save(run / "answers_before.png")
        sheet.save(run / "answers_after.png")
        self._sheets += 1
        return out


WORKFLOWS.register("vl_single_turn", VLSingleTurn)
