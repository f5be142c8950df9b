"""Vision-language prompt data: the ``vl`` dataset kind.

Rows come from JSONL/JSON/CSV files, Parquet files, dataset directories or the Hugging Face
hub. A row's images (``data.args.image_field``, default ``images``) are one value or a list:
local paths (relative ones are read from ``data.args.image_root``, by default the data
file's directory), encoded bytes, ``datasets`` image values or PIL images. The prompt holds
one ``<image>`` placeholder per image, where the image goes (multi-image prompts work);
chat-message prompts may use ``{"type": "image"}`` parts instead.

**Videos** are lists of frames (``data.args.video_field``, default ``videos``), marked by
``<video>`` (or ``{"type": "video"}`` parts) with the same rules as images; how frames are
capped, sized, timed and counted is in :mod:`polyrl.multimodal.video`.

**Lazy.** Loading reads each image's header (size, mode, EXIF orientation) and checks that
its data is complete (a JPEG's or PNG's end marker, 16 bytes at each end; other images are
decoded once), so a truncated image is an error naming its row before training, not at a
rollout; no pixels are kept. Parquet and hub rows stay in the memory-mapped Arrow table, so
the encoded bytes are not held either. The pixels are decoded when a rollout needs them.

**Cheap length filter.** The prompt's token count is the templated text's tokens plus, for
each image, ``t*h*w / merge^2`` placeholder tokens computed from the header size through
``qwen_vl_utils.smart_resize`` with the recipe's ``min_pixels``/``max_pixels``; the image
processor never runs at load time. The prompt ids are built with those placeholder counts.

**Bad input** is an error naming the file, row and fix, or a documented fix counted in
``stats`` (logged as ``data/<key>`` at step 0); see :mod:`polyrl.multimodal.images` for
images. Placeholders: more ``<image>`` markers than images, or some but fewer, is an error;
a row with images and no marker gets its images put before the prompt text
(``missing_placeholders: prepend``, counted as ``placeholders_added``) or fails
(``missing_placeholders: error``).

Its options (``data.args``, also ``eval.data.args`` and ``sft.data.args``) are
:class:`VLDataOptions`: where images and videos are, their resize limits, the markers, and
what to do with bad images. Where rows come from is :mod:`.sources`; how a prompt becomes
chat messages of text and vision parts, :mod:`.prompts`.
"""

from __future__ import annotations

import difflib
import logging
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from polyrl.core.config import ConfigError, doc
from polyrl.core.options import Options, bind
from polyrl.core.registry import DATASETS
from polyrl.core.rollout.data import DataConfig, DataError, PromptDataset, PromptItem
from polyrl.multimodal.images import (
    DEFAULT_MAX_SOURCE_PIXELS,
    ImageError,
    ImageRef,
    ResizeRule,
    check_complete,
    check_pixels,
    make_ref,
    probe,
)
from polyrl.multimodal.prompts import blank, count_parts, prepend_parts, to_messages
from polyrl.multimodal.sources import load_source
from polyrl.multimodal.video import (
    DEFAULT_VIDEO_FPS,
    load_videos,
    positive,
    token_expansions,
    video_resize_rule,
)
from polyrl.multimodal.vision import VideoSpec, VisionSpec

log = logging.getLogger(__name__)

VISION_FIELD = "_vision"  # where a VL item's row keeps its VisionSpec (policies read it)
QWEN_IMAGE_SEQUENCE = "<|vision_start|><|image_pad|><|vision_end|>"
QWEN_VIDEO_SEQUENCE = "<|vision_start|><|video_pad|><|vision_end|>"


@dataclass
class VLDataOptions(Options):
    """``data.args`` of the ``vl`` dataset kind."""

    image_field: str = doc("images", "row field holding the image(s): one value or a list")
    image_root: str | None = doc(
        None, "where relative image paths are read from (null: the data file's directory)"
    )
    min_pixels: int | None = doc(None, "least pixels per resized image (null: the processor's)")
    max_pixels: int | None = doc(None, "most pixels per resized image (null: the processor's)")
    max_source_pixels: int = doc(
        DEFAULT_MAX_SOURCE_PIXELS,
        "a larger source image is an error, not a memory blow-up (downscale it offline)",
    )
    placeholder: str = doc("<image>", "the image marker in prompt text")
    missing_placeholders: Literal["prepend", "error"] = doc(
        "prepend",
        "a row with images and no marker: prepend (images before the text, counted as "
        "placeholders_added) or error",
    )
    bad_images: Literal["error", "skip"] = doc(
        "error",
        "a missing, unreadable, truncated or too large image or frame: error, or skip "
        "(drop the row at load, counted as skipped_bad_image; skip decodes each image "
        "once at load to find truncated data)",
    )
    video_field: str = doc("videos", "row field holding the videos, each a list of frames")
    video_placeholder: str = doc("<video>", "the video marker in prompt text")
    video_min_pixels: int | None = doc(None, "least pixels per resized frame (null: min_pixels)")
    video_max_pixels: int | None = doc(None, "most pixels per resized frame (null: max_pixels)")
    max_frames: int | None = doc(
        None, "frames kept per video, evenly spaced, first and last included (null: all)"
    )
    video_fps: float = doc(
        DEFAULT_VIDEO_FPS, "frame rate of the given frames, unless the row's video_fps_field says"
    )
    video_fps_field: str = doc("video_fps", "row field with a row's frame rate(s)")

    def check(self, where: str = "data.args", source: str = "<config>") -> None:
        """Values the types cannot say, checked when the recipe binds them."""

        def bad(key: str, need: str) -> ConfigError:
            return ConfigError(f"{where}.{key}={getattr(self, key)!r} in {source}: must be {need}")

        if not self.placeholder:
            raise bad("placeholder", "a non-empty string")
        if not self.video_placeholder or self.video_placeholder == self.placeholder:
            raise bad("video_placeholder", f"a non-empty string other than {self.placeholder!r}")
        if self.max_frames is not None and self.max_frames < 1:
            raise bad("max_frames", "a positive integer or null")
        if not positive(self.video_fps):
            raise bad("video_fps", "a positive number")
        if self.max_source_pixels < 1:
            raise bad("max_source_pixels", "a positive integer")


@dataclass
class VLPromptItem(PromptItem):
    """A prompt whose ids already hold each image's placeholder tokens, with its images as
    references (``vision``; None for a text-only row)."""

    vision: VisionSpec | None = None


def processor_of(tokenizer: Any) -> Any:
    """The VL processor a ``qwen_vl`` policy's tokenizer carries (or ``tokenizer`` itself
    when it already is one)."""
    proc = getattr(tokenizer, "polyrl_processor", None)
    if proc is not None:
        return proc
    if hasattr(tokenizer, "image_processor") and hasattr(tokenizer, "tokenizer"):
        return tokenizer
    raise DataError(
        "the vl dataset kind needs a vision-language processor, but the policy's "
        f"tokenizer ({type(tokenizer).__name__}) has none. Use a VL policy kind "
        "(policies.<name>.kind=qwen_vl)."
    )


def resize_rule(processor: Any, opts: VLDataOptions) -> ResizeRule:
    ip = processor.image_processor
    size = getattr(ip, "size", None)
    if isinstance(size, dict) or hasattr(size, "shortest_edge"):
        get = size.get if isinstance(size, dict) else (lambda k: getattr(size, k, None))
        lo, hi = get("shortest_edge"), get("longest_edge")
    else:
        lo, hi = None, None
    lo = lo or getattr(ip, "min_pixels", None) or 56 * 56
    hi = hi or getattr(ip, "max_pixels", None) or 28 * 28 * 1280
    patch = getattr(ip, "patch_size", 14)
    try:
        return ResizeRule(
            min_pixels=opts.min_pixels or lo,
            max_pixels=opts.max_pixels or hi,
            patch_size=patch if isinstance(patch, int) else patch[0],
            merge_size=getattr(ip, "merge_size", 2),
            temporal_patch_size=getattr(ip, "temporal_patch_size", 2),
            max_source_pixels=opts.max_source_pixels,
        )
    except ValueError as e:
        raise DataError(f"data.args: {e}") from None


class VLDataset:
    """Every usable VL prompt of one dataset: validated, tokenised, images as references."""

    def __init__(
        self,
        cfg: DataConfig,
        tokenizer: Any,
        *,
        name: str = "train",
        rows: list[dict] | None = None,
    ) -> None:
        if cfg.overlong not in ("filter", "error"):
            raise DataError(f"data.overlong must be 'filter' or 'error', not {cfg.overlong!r}")
        if cfg.max_prompt_tokens <= 0:
            raise DataError(f"data.max_prompt_tokens must be positive, not {cfg.max_prompt_tokens}")
        self.cfg, self.name = cfg, name
        # typed by the recipe; bound here too for a config built in code
        self.opts = bind(
            VLDataOptions, cfg.args, f"{name} data.args", "<config>", "dataset kind 'vl'"
        )
        self.processor = processor_of(tokenizer)
        self.tokenizer = self.processor.tokenizer
        self.rule = resize_rule(self.processor, self.opts)
        self.image_token = getattr(self.processor, "image_token", "<|image_pad|>")
        self.image_token_id = self.tokenizer.convert_tokens_to_ids(self.image_token)
        self.video_rule = video_resize_rule(
            self.rule, self.opts.video_min_pixels, self.opts.video_max_pixels
        )
        self.video_token = getattr(self.processor, "video_token", "<|video_pad|>")
        self.video_token_id = self.tokenizer.convert_tokens_to_ids(self.video_token)
        # Qwen3-VL's processor writes each video's frame times into the prompt
        self.timestamps = hasattr(self.processor, "_calculate_timestamps")
        self.markers = {self.opts.placeholder: "image", self.opts.video_placeholder: "video"}
        self._arrow_source = None
        if rows is not None:  # in-memory rows (PIL images, bytes, paths)
            where = [f"{name} rows, row {i}" for i in range(len(rows))]
            root, arrow = None, False
        else:
            rows, where, root, arrow = load_source(
                cfg, (self.opts.image_field, self.opts.video_field), name
            )
        self._arrow_source = rows.table if arrow else None
        if self.opts.image_root:
            root = Path(self.opts.image_root).expanduser()
        self.image_root = root
        if len(rows) == 0:
            raise DataError(f"{name} data: {cfg.path!r} has no rows.")
        self.stats: dict[str, int] = Counter()
        self.items: list[VLPromptItem] = []
        self._build(rows, where, arrow)
        self.stats = {
            "rows": len(rows),
            "kept": len(self.items),
            **{
                k: self.stats.get(k, 0)
                for k in (
                    "filtered_overlong",
                    "skipped_bad_image",
                    "images",
                    "converted_rgb",
                    "scaled_16bit",
                    "exif_transposed",
                    "downscaled",
                    "upscaled",
                    "placeholders_added",
                    "text_only",
                    "videos",
                    "video_frames",
                    "frames_dropped",
                    "videos_padded",
                )
            },
        }
        if not self.items:
            raise DataError(
                f"{name} data: no usable rows in {cfg.path or 'the rows'!r} ({dict(self.stats)})."
            )
        fixed = {
            "scaled_16bit": "are 16-bit grey: scaled to 8 bits (0..65535 -> 0..255)",
            "exif_transposed": "carry an EXIF orientation: turned as image viewers show them",
        }
        for key, what in fixed.items():
            if self.stats[key]:
                log.warning(
                    "%s data %s: %d image(s) %s (data/%s; see polyrl.multimodal.images)",
                    name,
                    cfg.path or "rows",
                    self.stats[key],
                    what,
                    key,
                )

    # --- building -------------------------------------------------------------------
    def _build(self, rows: Any, where: list[str], arrow: bool) -> None:
        texts, pending = [], []
        for uid in range(len(rows)):
            row, loc = rows[uid], where[uid]
            got = self._row(row, loc, uid, arrow)
            if got is None:
                continue
            text, spec, answer, kept_row, shown = got
            texts.append(text)
            pending.append((uid, spec, answer, kept_row, shown))
        if not texts:
            return
        ids = self.tokenizer(texts, add_special_tokens=False)["input_ids"]
        for (uid, spec, answer, kept_row, shown), toks in zip(pending, ids, strict=True):
            loc = where[uid]
            counts = {
                self.image_token_id: spec.token_counts() if spec else [],
                self.video_token_id: spec.video_token_counts() if spec else [],
            }
            found = 0
            for token, name, what in (
                (self.image_token_id, self.image_token, "images"),
                (self.video_token_id, self.video_token, "videos"),
            ):
                n = sum(t == token for t in toks)
                if n != len(counts[token]):
                    raise DataError(
                        f"{loc}: the templated prompt holds {n} {name!r} tokens "
                        f"after tokenisation but the row has {len(counts[token])} "
                        f"{what}; does the prompt text itself contain that token?"
                    )
                found += n
            image_tokens, video_tokens = (sum(c) for c in counts.values())
            expansions = {
                self.image_token_id: [
                    [self.image_token_id] * c for c in counts[self.image_token_id]
                ],
                self.video_token_id: self._video_expansions(spec),
            }
            total = (
                len(toks)
                - found
                + image_tokens
                + sum(len(e) for e in expansions[self.video_token_id])
            )
            if total > self.cfg.max_prompt_tokens:
                if self.cfg.overlong == "error":
                    raise DataError(
                        f"{loc}: prompt is {total} tokens ({image_tokens} of them "
                        "image tokens"
                        + (f", {video_tokens} video tokens" if video_tokens else "")
                        + f"), over data.max_prompt_tokens="
                        f"{self.cfg.max_prompt_tokens}. Raise the limit, lower "
                        "data.args.max_pixels (video_max_pixels, max_frames), or "
                        "set data.overlong=filter."
                    )
                self.stats["filtered_overlong"] += 1
                continue
            left = {token: iter(e) for token, e in expansions.items()}
            expanded: list[int] = []
            for t in toks:
                expanded.extend(next(left[t]) if t in left else [t])
            if spec is None:
                self.stats["text_only"] += 1
            self.items.append(
                VLPromptItem(
                    uid=uid,
                    prompt_ids=expanded,
                    prompt_text=shown,
                    answer=answer,
                    row=kept_row,
                    vision=spec,
                )
            )

    def _video_expansions(self, spec: VisionSpec | None) -> list[list[int]]:
        """Each video placeholder token's replacement (:func:`video.token_expansions`)."""
        ids = self.tokenizer.convert_tokens_to_ids
        return token_expansions(
            spec,
            video_token_id=self.video_token_id,
            timestamps=self.timestamps,
            encode=lambda text: self.tokenizer.encode(text, add_special_tokens=False),
            vision_start_id=ids(self.processor.vision_start_token) if self.timestamps else None,
            vision_end_id=ids(self.processor.vision_end_token) if self.timestamps else None,
        )

    def _row(self, row: Any, loc: str, uid: int, arrow: bool):
        cfg, opts = self.cfg, self.opts
        if not isinstance(row, dict):
            raise DataError(
                f"{loc}: expected a row object with a {cfg.prompt_field!r} field, "
                f"got a {type(row).__name__}."
            )
        for field, setting in (
            (cfg.prompt_field, "prompt_field"),
            (cfg.answer_field, "answer_field"),
        ):
            if field is not None and field not in row:
                fields = [str(k) for k in row]
                hint = difflib.get_close_matches(field, fields, n=1, cutoff=0.5)
                raise DataError(
                    f"{loc}: the row has no field {field!r}. Its fields are: "
                    f"{', '.join(map(repr, fields))}."
                    + (
                        f" Did you mean {hint[0]!r}? Set data.{setting}={hint[0]}."
                        if hint
                        else f" Set data.{setting}."
                    )
                )
        prompt = row[cfg.prompt_field]
        if blank(prompt):
            raise DataError(
                f"{loc}: field {cfg.prompt_field!r} is empty. Fill in the prompt or drop the row."
            )
        answer = row[cfg.answer_field] if cfg.answer_field is not None else None
        if cfg.answer_field is not None and answer is None:
            raise DataError(
                f"{loc}: field {cfg.answer_field!r} is null. Give every row an "
                "answer, or set data.answer_field=null."
            )
        images = self._images(row, loc, uid, arrow)
        videos = self._videos(row, loc, uid, arrow) if images is not None else None
        if images is None or videos is None:
            return None  # a bad image or frame, and bad_images=skip
        refs, sizes = images
        # prompt and placeholders
        messages = to_messages(prompt, self.markers, loc, cfg.prompt_field)
        for m in messages:
            for part in m["content"]:
                for token, marker in (
                    (self.image_token, opts.placeholder),
                    (self.video_token, opts.video_placeholder),
                ):
                    if part["type"] == "text" and token in part["text"]:
                        raise DataError(
                            f"{loc}: the prompt text contains the model's token {token!r}, "
                            "which would give the model more vision tokens than inputs. "
                            f"Mark where each goes with {marker!r} instead."
                        )
        for kind, n, marker, field in (
            ("video", len(videos), opts.video_placeholder, opts.video_field),
            ("image", len(refs), opts.placeholder, opts.image_field),
        ):
            self._check_markers(messages, kind, n, marker, field, loc)
        if cfg.system_prompt and messages[0]["role"] != "system":
            messages.insert(
                0, {"role": "system", "content": [{"type": "text", "text": cfg.system_prompt}]}
            )
        text = self._render(messages, loc)
        for token, n, what in (
            (self.image_token, len(refs), "images"),
            (self.video_token, len(videos), "videos"),
        ):
            rendered = text.count(token)
            if rendered != n:
                raise DataError(
                    f"{loc}: the chat template rendered {rendered} {token!r} tokens "
                    f"for {n} {what}; the processor's template does not place "
                    f"{what[:-1]} parts. Use the model's own processor."
                )
        shown = text
        for ref in refs:
            shown = shown.replace(self.image_token, f"<image: {ref.name}>", 1)
        for video in videos:
            shown = shown.replace(
                self.video_token, f"<video: {len(video.refs)} frames from {video.refs[0].name}>", 1
            )
        spec = (
            VisionSpec(
                f"{self.name}/{uid}",
                tuple(refs),
                tuple(sizes),
                self.rule,
                tuple(videos),
                self.video_rule,
            )
            if refs or videos
            else None
        )
        kept = {k: v for k, v in row.items() if k not in (opts.image_field, opts.video_field)}
        kept[opts.image_field] = [r.name for r in refs]
        if videos or opts.video_field in row:
            kept[opts.video_field] = [[r.name for r in v.refs] for v in videos]
        kept[VISION_FIELD] = spec
        return text, spec, answer, kept, shown

    def _check_markers(
        self, messages: list[dict], kind: str, n: int, marker: str, field: str, loc: str
    ) -> None:
        """Markers of ``kind`` must match the row's ``n`` inputs; none: prepend them."""
        markers = count_parts(messages, kind)
        if markers == n:
            return
        if markers == 0 and self.opts.missing_placeholders == "prepend":
            prepend_parts(messages, n, kind)
            self.stats["placeholders_added"] += 1
            return
        what = "more" if markers > n else "fewer"
        raise DataError(
            f"{loc}: the prompt has {markers} {marker!r} markers but the row has {n} {kind}s "
            f"(field {field!r}): {what} markers than {kind}s. Put one marker where each "
            f"{kind} goes"
            + (
                f" (or none: the {kind}s then go before the text)."
                if self.opts.missing_placeholders == "prepend"
                else "."
            )
        )

    def _ref(self, value: Any, at: str, uid: int, field: str, index: Any, arrow: bool) -> ImageRef:
        """An image or frame reference; an Arrow table's bytes stay in the mapped table."""
        try:
            ref = make_ref(value, at, self.image_root)
        except ImageError as e:
            raise DataError(str(e)) from None
        if arrow and ref.kind == "bytes":
            ref = ImageRef("arrow", (self._arrow_table, uid, field, index), at, f"<{at}>")
        return ref

    def _probe(self, ref: ImageRef):
        """The header, or None for a bad image when ``bad_images: skip`` (counted). With
        skip, the pixels are decoded once too (and dropped): an image whose data is truncated
        or corrupt past its header is found here, not when a rollout needs it."""
        try:
            header = probe(ref, self.opts.max_source_pixels)
            if self.opts.bad_images == "skip":
                check_pixels(ref)
            else:  # a truncated file is found now, not at the first rollout
                check_complete(ref)
        except ImageError as e:
            if self.opts.bad_images == "skip":
                self.stats["skipped_bad_image"] += 1
                return None
            raise DataError(f"{e} (or set data.args.bad_images=skip to drop such rows)") from None
        if header.mode != "RGB":
            self.stats["converted_rgb"] += 1
        self.stats["scaled_16bit"] += header.scaled_16bit
        self.stats["exif_transposed"] += header.transposed
        return header

    def _count_resize(self, rule: ResizeRule, width: int, height: int) -> None:
        rw, rh = rule.resized(width, height)
        if rw * rh < width * height:
            self.stats["downscaled"] += 1
        elif rw * rh > width * height:
            self.stats["upscaled"] += 1

    def _images(
        self, row: dict, loc: str, uid: int, arrow: bool
    ) -> tuple[list[ImageRef], list[tuple[int, int]]] | None:
        """The row's image references and header sizes (None: skip the row)."""
        field = self.opts.image_field
        raw = row.get(field)
        listed = isinstance(raw, (list, tuple))
        values = [] if raw is None else list(raw) if listed else [raw]
        refs = [
            self._ref(value, f"{loc}, image {j}", uid, field, j if listed else None, arrow)
            for j, value in enumerate(values)
        ]
        sizes = []
        for ref in refs:
            header = self._probe(ref)
            if header is None:
                return None
            sizes.append((header.width, header.height))
            self.stats["images"] += 1
            self._count_resize(self.rule, header.width, header.height)
        return refs, sizes

    def _videos(self, row: dict, loc: str, uid: int, arrow: bool) -> list[VideoSpec] | None:
        """The row's videos (:func:`video.load_videos`; None: skip the row)."""
        opts, field = self.opts, self.opts.video_field
        videos = load_videos(
            row,
            field=field,
            fps_field=opts.video_fps_field,
            default_fps=opts.video_fps,
            loc=loc,
            max_frames=opts.max_frames,
            rule=self.video_rule,
            ref=lambda value, at, index: self._ref(value, at, uid, field, index, arrow),
            probe=self._probe,
            stats=self.stats,
        )
        for video in videos or ():
            self._count_resize(self.video_rule, *video.size)
        return videos

    @property
    def _arrow_table(self) -> Any:
        return self._arrow_source

    def _render(self, messages: list[dict], loc: str) -> str:
        if not self.cfg.chat_template:
            chunks = []
            for m in messages:
                for part in m["content"]:
                    chunks.append(
                        QWEN_IMAGE_SEQUENCE
                        if part["type"] == "image"
                        else QWEN_VIDEO_SEQUENCE
                        if part["type"] == "video"
                        else part["text"]
                    )
            return "".join(chunks)
        owner = self.processor if getattr(self.processor, "chat_template", None) else self.tokenizer
        if not getattr(owner, "chat_template", None):
            raise DataError(
                f"{self.name} data: the processor has no chat template; use the "
                "model's processor or set data.chat_template=false."
            )
        try:
            text = owner.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        except Exception as e:
            raise DataError(
                f"{loc}: the chat template failed on this prompt: {type(e).__name__}: {e}"
            ) from e
        return text[0] if isinstance(text, list) else text

    # --- access: a sequence of ``items``, as the text datasets are ------------------
    __len__ = PromptDataset.__len__
    __getitem__ = PromptDataset.__getitem__
    __iter__ = PromptDataset.__iter__


DATASETS.register("vl", VLDataset, options=VLDataOptions)
