"""From image references to model inputs: the host side of vision-language prompts.

:class:`VisionSpec` is a prompt's images and videos (lists of frames) as references (what a
dataset item holds). :func:`process` decodes, resizes (``qwen_vl_utils``) and runs the image
processor and the video processor once each, giving :class:`VisionInputs`
(``pixel_values`` + ``image_grid_thw``; ``pixel_values_videos`` + ``video_grid_thw`` +
``second_per_grid_ts``). A workflow calls it once per prompt; the ``n`` samples of the
prompt's group share that one object, in the rollout record and through the update. The
model side (the Qwen-VL forward pass engine and trainer share) is
:mod:`polyrl.multimodal.forward`.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import torch
from PIL import Image

from polyrl.multimodal.images import ImageError, ImageRef, ResizeRule, decode

# Process-wide counters (tests and metrics read them): images / videos / frames decoded and
# processed here; vision tower passes (``vision_passes`` for images, ``video_passes`` for
# videos) and the images / videos they covered, counted by :mod:`polyrl.multimodal.forward`.
COUNTERS: Counter = Counter()


@dataclass(frozen=True)
class VideoSpec:
    """One video of a prompt: its frames (already capped by ``max_frames``) as references.

    ``size`` is the source (width, height) every frame's header gave at load time; ``fps``
    is the frame rate of these frames (after subsampling), which sets the M-RoPE temporal
    spacing through ``second_per_grid_ts = temporal_patch_size / fps``; ``times`` are the
    kept frames' times in seconds (their source index / source frame rate), which Qwen3-VL
    writes into the prompt.
    """

    refs: tuple[ImageRef, ...]
    size: tuple[int, int]
    fps: float
    where: str
    times: tuple[float, ...] = ()

    def group_times(self, temporal_patch_size: int) -> list[float]:
        """Seconds of each temporal step (``temporal_patch_size`` frames, an odd count padded
        with the last frame as the processor does): the mean of its first and last frame,
        as transformers' Qwen3-VL processor computes the timestamps it writes."""
        times = list(self.times)
        times += times[-1:] * (-len(times) % temporal_patch_size)
        return [
            (times[i] + times[i + temporal_patch_size - 1]) / 2
            for i in range(0, len(times), temporal_patch_size)
        ]


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
    videos: tuple[VideoSpec, ...] = ()
    video_rule: ResizeRule | None = None  # video_min/max_pixels; None: the image rule

    def grids(self) -> list[tuple[int, int, int]]:
        return [self.rule.grid(w, h) for w, h in self.sizes]

    def token_counts(self) -> list[int]:
        return [self.rule.tokens(w, h) for w, h in self.sizes]

    @property
    def vrule(self) -> ResizeRule:
        return self.video_rule or self.rule

    def video_grids(self) -> list[tuple[int, int, int]]:
        return [self.vrule.video_grid(len(v.refs), *v.size) for v in self.videos]

    def video_token_counts(self) -> list[int]:
        return [self.vrule.video_tokens(len(v.refs), *v.size) for v in self.videos]

    def second_per_grid(self) -> list[float]:
        return [self.vrule.temporal_patch_size / v.fps for v in self.videos]


def _no_grid() -> torch.Tensor:
    return torch.zeros((0, 3), dtype=torch.long)


@dataclass
class VisionInputs:
    """One prompt's processed images: what the model's vision tower takes."""

    key: str
    pixel_values: torch.Tensor | None  # [patches of all images, C * T * P * P]; None: no image
    image_grid_thw: torch.Tensor  # [images, 3] (int64)
    sizes: tuple[tuple[int, int], ...] = ()  # source (width, height) per image
    resized: tuple[tuple[int, int], ...] = ()  # (width, height) the model saw
    pixel_values_videos: torch.Tensor | None = None  # [patches of all videos, C * T * P * P]
    video_grid_thw: torch.Tensor = field(default_factory=_no_grid)  # [videos, 3] (int64)
    second_per_grid_ts: torch.Tensor | None = None  # [videos] seconds per temporal grid step
    video_sizes: tuple[tuple[int, int], ...] = ()  # source (width, height) per video
    video_resized: tuple[tuple[int, int], ...] = ()  # (width, height) of its frames, resized
    video_frames: tuple[int, ...] = ()  # frames per video (before the processor's padding)
    # multi-turn rows (multimodal/turns.py): each image's first placeholder token, counted
    # from the row's first prompt token; None: every image-token id in the prompt is one
    image_starts: tuple[int, ...] | None = None

    @property
    def num_images(self) -> int:
        return int(self.image_grid_thw.shape[0])

    @property
    def num_videos(self) -> int:
        return int(self.video_grid_thw.shape[0])


def _load_image(
    ref: ImageRef, size: tuple[int, int], grid: tuple[int, int, int], rule: ResizeRule
) -> Image.Image:
    """One image (or frame) decoded and resized; its size must still be the header's."""
    w, h = size
    img = decode(ref, rule.max_source_pixels)
    if img.size != (w, h):
        raise ImageError(
            f"{ref.where}: the image is {img.width}x{img.height} now but was "
            f"{w}x{h} when the dataset was loaded; was the file replaced?"
        )
    img = rule.apply(img)
    if img.size != (grid[2] * rule.patch_size, grid[1] * rule.patch_size):
        raise ImageError(
            f"{ref.where}: resized to {img.size}, not the size the prompt's "
            f"{grid} grid was counted for"
        )  # pragma: no cover (defensive)
    return img


def _check_grid(spec: VisionSpec, got: torch.Tensor, expected: list, what: str) -> torch.Tensor:
    got = got.to(torch.long)
    want = torch.tensor(expected, dtype=torch.long).reshape(-1, 3)
    if not torch.equal(got, want):
        raise ImageError(
            f"{spec.key}: the {what} processor gave grids {got.tolist()}, but the "
            f"prompt was built for {want.tolist()}; its patch/merge size "
            "differs from data.args (patch_size, merge_size)"
        )
    return got


def process_frames(
    spec: VisionSpec, image_processor: Any, video_processor: Any = None
) -> tuple[VisionInputs, list[Image.Image], list[list[Image.Image]]]:
    """Decode, resize and run the image and video processors once for one prompt.

    Returns the processed inputs, the resized RGB images and each video's resized frames
    (what rewards look at). The video processor gets the frames as they are (no resizing,
    no frame sampling: the dataset already capped them); an odd frame count is padded by
    the processor, repeating the last frame. Errors name the file and row.
    """
    images = [
        _load_image(ref, size, grid, spec.rule)
        for ref, size, grid in zip(spec.refs, spec.sizes, spec.grids(), strict=True)
    ]
    videos = [
        [_load_image(ref, video.size, grid, spec.vrule) for ref in video.refs]
        for video, grid in zip(spec.videos, spec.video_grids(), strict=True)
    ]
    pixel_values, grid = None, _no_grid()
    if images:
        out = image_processor(images=images, do_resize=False, return_tensors="pt")
        pixel_values = out["pixel_values"]
        grid = _check_grid(spec, out["image_grid_thw"], spec.grids(), "image")
    video_values, video_grid, seconds = None, _no_grid(), None
    if videos:
        if video_processor is None:
            raise ImageError(
                f"{spec.key}: the prompt has {len(videos)} videos but the model's "
                "processor has no video processor"
            )
        out = video_processor(
            videos=videos, do_resize=False, do_sample_frames=False, return_tensors="pt"
        )
        video_values = out["pixel_values_videos"]
        video_grid = _check_grid(spec, out["video_grid_thw"], spec.video_grids(), "video")
        seconds = torch.tensor(spec.second_per_grid(), dtype=torch.float32)
    COUNTERS["images_processed"] += len(images)
    COUNTERS["videos_processed"] += len(videos)
    COUNTERS["frames_processed"] += sum(len(v) for v in videos)
    COUNTERS["prompts_processed"] += 1
    inputs = VisionInputs(
        spec.key,
        pixel_values,
        grid,
        spec.sizes,
        tuple(img.size for img in images),
        video_values,
        video_grid,
        seconds,
        tuple(v.size for v in spec.videos),
        tuple(frames[0].size for frames in videos),
        tuple(len(frames) for frames in videos),
    )
    return inputs, images, videos


def process(
    spec: VisionSpec, image_processor: Any, video_processor: Any = None
) -> tuple[VisionInputs, list]:
    """Decode, resize and run the processors once for one prompt.

    Returns the processed inputs and the resized RGB images (what rewards look at: box
    coordinates of Qwen2.5-VL refer to these pixels); :func:`process_frames` also returns
    the videos' frames. Errors name the file and row.
    """
    inputs, images, _ = process_frames(spec, image_processor, video_processor)
    return inputs, images


def recover_images(inputs: VisionInputs, image_processor: Any) -> list[Image.Image]:
    """The resized 8-bit images ``inputs.pixel_values`` were made from, in order.

    Qwen-VL's image processor resizes to 8-bit pixels, then rescales, normalises and cuts
    them into patches, so undoing those steps gives the resized images back exactly; an
    engine that takes images (vLLM) then sees what the trainer scores without the images
    travelling beside their pixels. Pixels that do not invert to 8-bit values (another
    processor, another dtype) are an error, never rounded into a guess.
    """
    if not inputs.num_images:
        return []
    pv = inputs.pixel_values
    if pv is None or pv.dtype != torch.float32:
        raise ImageError(
            f"{inputs.key}: recovering images needs float32 pixel values, got "
            f"{None if pv is None else pv.dtype}"
        )
    ip = image_processor
    m, p, tp = ip.merge_size, ip.patch_size, ip.temporal_patch_size
    mean = torch.tensor(ip.image_mean, dtype=torch.float64).view(3, 1, 1)
    std = torch.tensor(ip.image_std, dtype=torch.float64).view(3, 1, 1)
    images, at = [], 0
    for k, (t, gh, gw) in enumerate(inputs.image_grid_thw.tolist()):
        n = t * gh * gw
        patches = pv[at : at + n].to(torch.float64)
        at += n
        # the processor's layout: (t, h/m, w/m, m, m, C, T, p, p) from (t*T, C, h*p, w*p)
        x = patches.reshape(t, gh // m, gw // m, m, m, 3, tp, p, p)
        x = x.permute(0, 6, 5, 1, 3, 7, 2, 4, 8).reshape(t * tp, 3, gh * p, gw * p)[0]
        raw = (x * std + mean) / ip.rescale_factor
        off = float((raw - raw.round()).abs().max())
        if off > 0.01 or float(raw.min()) < -0.01 or float(raw.max()) > 255.01:
            raise ImageError(
                f"{inputs.key}: image {k}'s pixel values do not come from 8-bit pixels "
                f"(off by {off:.3g}); was it processed by another image processor?"
            )
        pixels = raw.round().clamp(0, 255).to(torch.uint8).permute(1, 2, 0).numpy()
        images.append(Image.fromarray(pixels))
    if at != pv.shape[0]:
        raise ImageError(f"{inputs.key}: {pv.shape[0]} patches but the image grids count {at}")
    return images
