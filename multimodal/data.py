"""Vision-language prompt data: the ``vl`` dataset kind.

Rows come from JSONL/JSON/CSV files, Parquet files, dataset directories or the Hugging Face
hub. A row's images (``data.args.image_field``, default ``images``) are one value or a list:
local paths (relative ones are read from ``data.args.image_root``, by default the data
file's directory), encoded bytes, ``datasets`` image values or PIL images. The prompt holds
one ``<image>`` placeholder per image, where the image goes (multi-image prompts work);
chat-message prompts may use ``{"type": "image"}`` parts instead.

**Lazy.** Loading reads each image's header only (size and mode): nothing is decoded and
no pixels are kept. Parquet and hub rows stay in the memory-mapped Arrow table, so the
encoded bytes are not held either. The pixels are decoded when a rollout needs them.

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

``data.args`` (all optional):

- ``image_field`` (``images``): row field holding the image(s)
- ``image_root`` (data file's directory): where relative image paths are read from
- ``min_pixels`` / ``max_pixels`` (the processor's): resize limits per image
- ``max_source_pixels`` (64M): larger source images are an error, not a memory blow-up
- ``placeholder`` (``<image>``): the image marker in prompt text
- ``missing_placeholders`` (``prepend``): ``prepend`` or ``error``
- ``bad_images`` (``error``): ``error`` or ``skip`` (drop rows whose images are missing,
  unreadable or too large at load time, counted as ``skipped_bad_image``)
"""

from __future__ import annotations

import dataclasses
import difflib
import math
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from polyrl.core.data import DataConfig, DataError, PromptItem, load_rows
from polyrl.core.registry import DATASETS
from polyrl.multimodal.images import (
    DEFAULT_MAX_SOURCE_PIXELS,
    ImageError,
    ImageRef,
    ResizeRule,
    make_ref,
    probe,
)
from polyrl.multimodal.vision import VisionSpec

VISION_FIELD = "_vision"  # where a VL item's row keeps its VisionSpec (policies read it)
QWEN_IMAGE_SEQUENCE = "<|vision_start|><|image_pad|><|vision_end|>"


@dataclass
class VLDataOptions:
    """``data.args`` of the ``vl`` dataset kind (see the module docstring)."""

    image_field: str = "images"
    image_root: str | None = None
    min_pixels: int | None = None
    max_pixels: int | None = None
    max_source_pixels: int = DEFAULT_MAX_SOURCE_PIXELS
    placeholder: str = "<image>"
    missing_placeholders: str = "prepend"
    bad_images: str = "error"

    @classmethod
    def parse(cls, args: dict, where: str) -> VLDataOptions:
        names = [f.name for f in dataclasses.fields(cls)]
        for key in args:
            if key not in names:
                hint = difflib.get_close_matches(str(key), names, n=1, cutoff=0.5)
                raise DataError(f"{where}: unknown option {key!r} of the vl dataset kind"
                                + (f"; did you mean {hint[0]!r}?" if hint else "")
                                + f" Valid: {', '.join(names)}.")
        opts = cls(**args)
        if opts.missing_placeholders not in ("prepend", "error"):
            raise DataError(f"{where}: missing_placeholders must be 'prepend' or 'error', not "
                            f"{opts.missing_placeholders!r}")
        if opts.bad_images not in ("error", "skip"):
            raise DataError(f"{where}: bad_images must be 'error' or 'skip', not "
                            f"{opts.bad_images!r}")
        if not opts.placeholder:
            raise DataError(f"{where}: placeholder must be a non-empty string")
        return opts


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
    raise DataError("the vl dataset kind needs a vision-language processor, but the policy's "
                    f"tokenizer ({type(tokenizer).__name__}) has none. Use a VL policy kind "
                    "(policies.<name>.kind=qwen_vl).")


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
        return ResizeRule(min_pixels=opts.min_pixels or lo, max_pixels=opts.max_pixels or hi,
                          patch_size=patch if isinstance(patch, int) else patch[0],
                          merge_size=getattr(ip, "merge_size", 2),
                          temporal_patch_size=getattr(ip, "temporal_patch_size", 2),
                          max_source_pixels=opts.max_source_pixels)
    except ValueError as e:
        raise DataError(f"data.args: {e}") from None


# --------------------------------------------------------------------------- row sources


class _ArrowRows:
    """Rows of a memory-mapped ``datasets`` table, read one at a time, images undecoded."""

    def __init__(self, table: Any, image_field: str) -> None:
        import datasets

        feature = table.features.get(image_field)
        inner = getattr(feature, "feature", None)
        if isinstance(feature, datasets.Image) and feature.decode:
            table = table.cast_column(image_field, datasets.Image(decode=False))
        elif isinstance(inner, datasets.Image) and inner.decode:
            table = table.cast_column(image_field, type(feature)(datasets.Image(decode=False)))
        elif isinstance(feature, list) and feature and isinstance(feature[0], datasets.Image):
            table = table.cast_column(image_field, [datasets.Image(decode=False)])
        self.table = table

    def __len__(self) -> int:
        return len(self.table)

    def __getitem__(self, i: int) -> dict:
        return self.table[i]


def _load_source(cfg: DataConfig, image_field: str, name: str
                 ) -> tuple[Any, list[str], Path | None, bool]:
    """(rows, where, default image root, arrow-backed) for ``cfg.path``."""
    p = Path(cfg.path).expanduser() if cfg.path else None
    if p is not None and p.is_file() and p.suffix.lower() != ".parquet":
        rows, where = load_rows(cfg.path, cfg.split, cfg.limit, what=f"{name} data",
                                subset=cfg.subset)
        return rows, where, p.parent, False
    import datasets

    try:
        if p is not None and p.is_file():
            table = datasets.load_dataset("parquet", data_files=str(p), split="train")
            label, root = str(p), p.parent
        elif p is not None and p.is_dir():
            table = datasets.load_dataset(str(p), cfg.subset, split=cfg.split)
            label, root = f"{p} (split {cfg.split!r})", p
        else:
            if not cfg.path or cfg.path.startswith(("/", ".", "~")):
                # not a hub name: let the core say what is missing and what is nearby
                load_rows(cfg.path, cfg.split, cfg.limit, what=f"{name} data")
            table = datasets.load_dataset(cfg.path, cfg.subset, split=cfg.split)
            label, root = f"hub dataset {cfg.path!r} (split {cfg.split!r})", None
    except DataError:
        raise
    except Exception as e:
        raise DataError(f"{name} data: could not load {cfg.path!r} with datasets.load_dataset: "
                        f"{type(e).__name__}: {e}") from e
    if cfg.limit is not None:
        table = table.select(range(min(cfg.limit, len(table))))
    rows = _ArrowRows(table, image_field)
    return rows, [f"{label}, row {i}" for i in range(len(rows))], root, True


# --------------------------------------------------------------------------- prompts


def _blank(value: Any) -> bool:
    return value is None or (isinstance(value, float) and math.isnan(value)) or (
        isinstance(value, str) and not value.strip())


def _split_markers(text: str, marker: str) -> list[dict]:
    parts: list[dict] = []
    for k, piece in enumerate(text.split(marker)):
        if k:
            parts.append({"type": "image"})
        if piece:
            parts.append({"type": "text", "text": piece})
    return parts


def _to_messages(prompt: Any, marker: str, where: str, field: str) -> list[dict]:
    """Chat messages whose contents are part lists (text / image) in prompt order."""
    if isinstance(prompt, str):
        return [{"role": "user", "content": _split_markers(prompt, marker)}]
    if not isinstance(prompt, list) or not prompt:
        raise DataError(f"{where}: field {field!r} must be a string or a non-empty list of "
                        f"{{'role', 'content'}} messages, not {type(prompt).__name__}.")
    messages = []
    for j, m in enumerate(prompt):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or "content" not in m:
            raise DataError(f"{where}: field {field!r}, message {j} is {m!r:.80}; chat "
                            "messages must be dicts with a string 'role' and a 'content'.")
        content = m["content"]
        if isinstance(content, str):
            parts = _split_markers(content, marker)
        elif isinstance(content, list):
            parts = []
            for part in content:
                if isinstance(part, dict) and (part.get("type") == "image" or "image" in part):
                    parts.append({"type": "image"})
                elif isinstance(part, dict) and part.get("type") == "text":
                    parts.extend(_split_markers(str(part.get("text", "")), marker))
                else:
                    raise DataError(f"{where}: field {field!r}, message {j} has a content part "
                                    f"{part!r:.80}; use {{'type': 'text', 'text': ...}} or "
                                    "{'type': 'image'}.")
        else:
            raise DataError(f"{where}: field {field!r}, message {j}: 'content' must be a "
                            f"string or a list of parts, not {type(content).__name__}.")
        messages.append({"role": m["role"], "content": parts})
    return messages


def _count_images(messages: list[dict]) -> int:
    return sum(part["type"] == "image" for m in messages for part in m["content"])


def _prepend_images(messages: list[dict], k: int) -> None:
    target = next((m for m in messages if m["role"] == "user"), messages[0])
    target["content"] = [{"type": "image"} for _ in range(k)] + target["content"]


# --------------------------------------------------------------------------- dataset


class VLDataset:
    """Every usable VL prompt of one dataset: validated, tokenised, images as references."""

    def __init__(self, cfg: DataConfig, tokenizer: Any, *, name: str = "train",
                 rows: list[dict] | None = None) -> None:
        if cfg.overlong not in ("filter", "error"):
            raise DataError(f"data.overlong must be 'filter' or 'error', not {cfg.overlong!r}")
        if cfg.max_prompt_tokens <= 0:
            raise DataError(f"data.max_prompt_tokens must be positive, not "
                            f"{cfg.max_prompt_tokens}")
        self.cfg, self.name = cfg, name
        self.opts = VLDataOptions.parse(dict(cfg.args), f"{name} data.args")
        self.processor = processor_of(tokenizer)
        self.tokenizer = self.processor.tokenizer
        self.rule = resize_rule(self.processor, self.opts)
        self.image_token = getattr(self.processor, "image_token", "<|image_pad|>")
        self.image_token_id = self.tokenizer.convert_tokens_to_ids(self.image_token)
        self._arrow_source = None
        if rows is not None:  # in-memory rows (PIL images, bytes, paths)
            where = [f"{name} rows, row {i}" for i in range(len(rows))]
            root, arrow = None, False
        else:
            rows, where, root, arrow = _load_source(cfg, self.opts.image_field, name)
        self._arrow_source = rows.table if arrow else None
        if self.opts.image_root:
            root = Path(self.opts.image_root).expanduser()
        self.image_root = root
        if len(rows) == 0:
            raise DataError(f"{name} data: {cfg.path!r} has no rows.")
        self.stats: dict[str, int] = Counter()
        self.items: list[VLPromptItem] = []
        self._build(rows, where, arrow)
        self.stats = {"rows": len(rows), "kept": len(self.items), **{
            k: self.stats.get(k, 0) for k in (
                "filtered_overlong", "skipped_bad_image", "images", "converted_rgb",
                "downscaled", "upscaled", "placeholders_added", "text_only")}}
        if not self.items:
            raise DataError(f"{name} data: no usable rows in {cfg.path or 'the rows'!r} "
                            f"({dict(self.stats)}).")

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
            counts = spec.token_counts() if spec else []
            found = sum(t == self.image_token_id for t in toks)
            if found != len(counts):
                raise DataError(f"{loc}: the templated prompt holds {found} image tokens after "
                                f"tokenisation but the row has {len(counts)} images; does the "
                                "prompt text itself contain the image token "
                                f"{self.image_token!r}?")
            total = len(toks) - found + sum(counts)
            if total > self.cfg.max_prompt_tokens:
                if self.cfg.overlong == "error":
                    raise DataError(f"{loc}: prompt is {total} tokens ({sum(counts)} of them "
                                    f"image tokens), over data.max_prompt_tokens="
                                    f"{self.cfg.max_prompt_tokens}. Raise the limit, lower "
                                    "data.args.max_pixels, or set data.overlong=filter.")
                self.stats["filtered_overlong"] += 1
                continue
            expanded: list[int] = []
            k = 0
            for t in toks:
                if t == self.image_token_id:
                    expanded.extend([self.image_token_id] * counts[k])
                    k += 1
                else:
                    expanded.append(t)
            if spec is None:
                self.stats["text_only"] += 1
            self.items.append(VLPromptItem(uid=uid, prompt_ids=expanded, prompt_text=shown,
                                           answer=answer, row=kept_row, vision=spec))

    def _row(self, row: Any, loc: str, uid: int, arrow: bool):
        cfg, opts = self.cfg, self.opts
        if not isinstance(row, dict):
            raise DataError(f"{loc}: expected a row object with a {cfg.prompt_field!r} field, "
                            f"got a {type(row).__name__}.")
        for field, setting in ((cfg.prompt_field, "prompt_field"),
                               (cfg.answer_field, "answer_field")):
            if field is not None and field not in row:
                fields = [str(k) for k in row]
                hint = difflib.get_close_matches(field, fields, n=1, cutoff=0.5)
                raise DataError(f"{loc}: the row has no field {field!r}. Its fields are: "
                                f"{', '.join(map(repr, fields))}."
                                + (f" Did you mean {hint[0]!r}? Set data.{setting}={hint[0]}."
                                   if hint else f" Set data.{setting}."))
        prompt = row[cfg.prompt_field]
        if _blank(prompt):
            raise DataError(f"{loc}: field {cfg.prompt_field!r} is empty. Fill in the prompt "
                            "or drop the row.")
        answer = row[cfg.answer_field] if cfg.answer_field is not None else None
        if cfg.answer_field is not None and answer is None:
            raise DataError(f"{loc}: field {cfg.answer_field!r} is null. Give every row an "
                            "answer, or set data.answer_field=null.")
        # images
        raw = row.get(opts.image_field)
        values = [] if raw is None else list(raw) if isinstance(raw, (list, tuple)) else [raw]
        refs: list[ImageRef] = []
        for j, value in enumerate(values):
            at = f"{loc}, image {j}"
            try:
                ref = make_ref(value, at, self.image_root)
                if arrow and ref.kind == "bytes":  # keep the bytes in the mapped table only
                    ref = ImageRef("arrow", (self._arrow_table, uid, opts.image_field,
                                             j if isinstance(raw, (list, tuple)) else None),
                                   at, f"<image {j} of {loc}>")
                refs.append(ref)
            except ImageError as e:
                raise DataError(str(e)) from None
        sizes = []
        for ref in refs:
            try:
                header = probe(ref, opts.max_source_pixels)
            except ImageError as e:
                if opts.bad_images == "skip":
                    self.stats["skipped_bad_image"] += 1
                    return None
                raise DataError(f"{e} (or set data.args.bad_images=skip to drop such rows)") \
                    from None
            sizes.append((header.width, header.height))
            self.stats["images"] += 1
            if header.mode != "RGB":
                self.stats["converted_rgb"] += 1
            rw, rh = self.rule.resized(header.width, header.height)
            if rw * rh < header.width * header.height:
                self.stats["downscaled"] += 1
            elif rw * rh > header.width * header.height:
                self.stats["upscaled"] += 1
        # prompt and placeholders
        messages = _to_messages(prompt, opts.placeholder, loc, cfg.prompt_field)
        for m in messages:
            for part in m["content"]:
                if part["type"] == "text" and self.image_token in part["text"]:
                    raise DataError(
                        f"{loc}: the prompt text contains the model's image token "
                        f"{self.image_token!r}, which would give the model more image tokens "
                        f"than images. Mark images with {opts.placeholder!r} instead.")
        markers = _count_images(messages)
        if markers != len(refs):
            if markers == 0 and opts.missing_placeholders == "prepend":
                _prepend_images(messages, len(refs))
                self.stats["placeholders_added"] += 1
            else:
                what = "more" if markers > len(refs) else "fewer"
                raise DataError(
                    f"{loc}: the prompt has {markers} {opts.placeholder!r} markers but the row "
                    f"has {len(refs)} images (field {opts.image_field!r}): {what} markers than "
                    "images. Put one marker where each image goes"
                    + (" (or none: the images then go before the text)."
                       if opts.missing_placeholders == "prepend" else "."))
        if cfg.system_prompt and messages[0]["role"] != "system":
            messages.insert(0, {"role": "system",
                                "content": [{"type": "text", "text": cfg.system_prompt}]})
        text = self._render(messages, loc)
        rendered = text.count(self.image_token)
        if rendered != len(refs):
            raise DataError(f"{loc}: the chat template rendered {rendered} image tokens for "
                            f"{len(refs)} images; the processor's template does not place "
                            "image parts. Use the model's own processor.")
        shown = text
        for ref in refs:
            shown = shown.replace(self.image_token, f"<image: {ref.name}>", 1)
        spec = VisionSpec(f"{self.name}/{uid}", tuple(refs), tuple(sizes), self.rule) \
            if refs else None
        kept = {k: v for k, v in row.items() if k != opts.image_field}
        kept[opts.image_field] = [r.name for r in refs]
        kept[VISION_FIELD] = spec
        return text, spec, answer, kept, shown

    @property
    def _arrow_table(self) -> Any:
        return self._arrow_source

    def _render(self, messages: list[dict], loc: str) -> str:
        if not self.cfg.chat_template:
            chunks = []
            for m in messages:
                for part in m["content"]:
                    chunks.append(QWEN_IMAGE_SEQUENCE if part["type"] == "image"
                                  else part["text"])
            return "".join(chunks)
        owner = self.processor if getattr(self.processor, "chat_template", None) \
            else self.tokenizer
        if not getattr(owner, "chat_template", None):
            raise DataError(f"{self.name} data: the processor has no chat template; use the "
                            "model's processor or set data.chat_template=false.")
        try:
            text = owner.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        except Exception as e:
            raise DataError(f"{loc}: the chat template failed on this prompt: "
                            f"{type(e).__name__}: {e}") from e
        return text[0] if isinstance(text, list) else text

    # --- access ---------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, index: int) -> VLPromptItem:
        return self.items[index]

    def __iter__(self) -> Iterator[VLPromptItem]:
        return iter(self.items)


DATASETS.register("vl", VLDataset)
