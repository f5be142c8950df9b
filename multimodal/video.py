"""Videos given as lists of frames: loading them for the ``vl`` dataset kind.

A row's ``data.args.video_field`` (``videos``) is a list of videos, each a list of frame
references of the kinds images accept (video files are not decoded: extract frames
offline), marked in the prompt by ``<video>`` (or ``{"type": "video"}`` parts) with the same
rules as images. All frames of a video must have one size (a different size is an error
naming the row, video and frame: resizing some frames silently would distort what the model
sees, and transformers' video processor needs one size per video). Frames are resized like
images with ``video_min_pixels`` / ``video_max_pixels`` (default: the image limits).

``max_frames`` caps the frames per video, keeping evenly spaced ones (first and last
included; dropped frames counted as ``frames_dropped``); only kept frames are probed. Qwen's
vision tower merges ``temporal_patch_size`` (2) frames per temporal step; an odd count is
padded by the video processor repeating the last frame (as transformers does; counted
``videos_padded``), so a video of F frames takes ``ceil(F/2)*h*w / merge^2`` tokens.

The frame rate (``video_fps_field`` of the row: one number or one per video, else
``video_fps``, 2.0 as in ``qwen_vl_utils``) times kept/total frames gives
``second_per_grid_ts = temporal_patch_size / fps``, the M-RoPE temporal spacing of
Qwen2.5-VL. Qwen3-VL instead reads time as text: each temporal step of a video is written
``<{seconds:.1f} seconds><|vision_start|>`` + its tokens + ``<|vision_end|>`` (seconds: the
mean time of the step's first and last frame, a kept frame's time being its source index /
frame rate), exactly as transformers' processor does; those text tokens count towards the
length filter (:func:`token_expansions`).
"""

from __future__ import annotations

import dataclasses
import math
from collections import Counter
from collections.abc import Callable
from typing import Any

from polyrl.core.rollout.data import DataError
from polyrl.multimodal.images import Header, ImageRef, ResizeRule
from polyrl.multimodal.vision import VideoSpec, VisionSpec

DEFAULT_VIDEO_FPS = 2.0  # qwen_vl_utils' sample_fps for videos given as frame lists


def positive(value: Any) -> bool:
    """A finite number above 0 (not a bool)."""
    return (
        isinstance(value, (int, float))
        and not isinstance(value, bool)
        and math.isfinite(value)
        and value > 0
    )


def video_resize_rule(
    rule: ResizeRule, min_pixels: int | None, max_pixels: int | None
) -> ResizeRule:
    """The frames' resize rule: ``min_pixels`` / ``max_pixels`` (``video_min_pixels`` /
    ``video_max_pixels``), each defaulting to the image rule's limit (frames are resized
    like images, one size per video)."""
    try:
        return dataclasses.replace(
            rule,
            min_pixels=min_pixels or rule.min_pixels,
            max_pixels=max_pixels or rule.max_pixels,
        )
    except ValueError as e:
        raise DataError(f"data.args (video_min_pixels / video_max_pixels): {e}") from None


def frame_indices(total: int, cap: int | None) -> list[int]:
    """``cap`` frame indices spread evenly over ``total`` (first and last kept), or all."""
    if cap is None or total <= cap:
        return list(range(total))
    if cap == 1:
        return [0]
    return [round(i * (total - 1) / (cap - 1)) for i in range(cap)]


def frame_rates(raw: Any, field: str, default: float, loc: str, n: int) -> list[float]:
    """Frames per second of each of a row's ``n`` videos: ``raw`` (the row's ``field``: one
    number, or one per video), else ``default``."""
    if raw is None:
        return [float(default)] * n
    values = list(raw) if isinstance(raw, (list, tuple)) else [raw] * n
    if len(values) != n or not all(positive(v) for v in values):
        raise DataError(
            f"{loc}: field {field!r} is {raw!r:.80}; give one positive frame "
            f"rate for all the row's videos, or a list of {n} (one per video)."
        )
    return [float(v) for v in values]


def load_videos(
    row: dict,
    *,
    field: str,
    fps_field: str,
    default_fps: float,
    loc: str,
    max_frames: int | None,
    rule: ResizeRule,
    ref: Callable[[Any, str, tuple[int, int]], ImageRef],
    probe: Callable[[ImageRef], Header | None],
    stats: Counter,
) -> list[VideoSpec] | None:
    """The videos of ``row[field]``: frame references (capped by ``max_frames``), one header
    size per video, frame rates from ``row[fps_field]`` (else ``default_fps``).

    ``ref(value, where, (video, frame))`` makes a frame's reference; ``probe(ref)`` reads
    its header, or gives None for a bad frame the dataset skips (then so does this: None).
    Counts go to ``stats``.
    """
    raw = row.get(field)
    if raw is None:
        return []
    if not isinstance(raw, (list, tuple)) or any(not isinstance(v, (list, tuple)) for v in raw):
        raise DataError(
            f"{loc}: field {field!r} must be a list of videos, each a list of "
            f"frames (paths, bytes or PIL images), not {raw!r:.80}; for one "
            "video write [[frame0, frame1, ...]]. Video files are not decoded: "
            "extract their frames offline."
        )
    fps = frame_rates(row.get(fps_field), fps_field, default_fps, loc, len(raw))
    videos = []
    for j, frames in enumerate(raw):
        at = f"{loc}, video {j}"
        if not frames:
            raise DataError(
                f"{at}: field {field!r} holds an empty video (no frames); give "
                "its frames or drop it (and its marker)."
            )
        keep = frame_indices(len(frames), max_frames)
        refs = [ref(frames[f], f"{at}, frame {f}", (j, f)) for f in keep]
        size = None
        for f, r in zip(keep, refs, strict=True):
            header = probe(r)
            if header is None:
                return None
            if size is None:
                size, first = (header.width, header.height), f
            elif (header.width, header.height) != size:
                raise DataError(
                    f"{at}: frame {f} is {header.width}x{header.height} but "
                    f"frame {first} is {size[0]}x{size[1]} (field {field!r}); "
                    "all frames of a video must have one size. Resize them "
                    "offline."
                )
        stats["videos"] += 1
        stats["video_frames"] += len(refs)
        stats["frames_dropped"] += len(frames) - len(refs)
        if len(refs) % rule.temporal_patch_size:
            stats["videos_padded"] += 1
        videos.append(
            VideoSpec(
                tuple(refs),
                size,
                fps[j] * len(refs) / len(frames),
                at,
                tuple(f / fps[j] for f in keep),
            )
        )
    return videos


def token_expansions(
    spec: VisionSpec | None,
    *,
    video_token_id: int,
    timestamps: bool,
    encode: Callable[[str], list[int]],
    vision_start_id: int | None = None,
    vision_end_id: int | None = None,
) -> list[list[int]]:
    """Each video placeholder token's replacement: its ``t*h*w/merge^2`` video tokens, or
    with ``timestamps`` (Qwen3-VL), per temporal step, ``<{seconds:.1f} seconds>`` as text
    (``encode``) then ``<|vision_start|>``, that step's ``h*w/merge^2`` video tokens and
    ``<|vision_end|>`` (what transformers' Qwen3-VL processor writes in place of the token;
    the template's own start/end pair stays around the whole video)."""
    if spec is None:
        return []
    if not timestamps:
        return [[video_token_id] * c for c in spec.video_token_counts()]
    out = []
    step = spec.vrule.temporal_patch_size
    for video, count in zip(spec.videos, spec.video_token_counts(), strict=True):
        times = video.group_times(step)
        per_step, ids = count // len(times), []
        for t in times:
            ids += encode(f"<{t:.1f} seconds>")
            ids += [vision_start_id] + [video_token_id] * per_step + [vision_end_id]
        out.append(ids)
    return out
