"""Text-to-video on Wan: the colour-over-time task, video rewards, the ``text_to_video``
workflow and the frame-wise PatchVAE of tiny CPU demos.

The Wan family itself (``WanTransformer3DModel``, UMT5, ``AutoencoderKLWan``) is
:class:`polyrl.diffusion.models.WanFamily`; its latents ``[C, F, h, w]`` are the record's
``latents`` rows, stepped by the same samplers as images. The engine's ``frames`` option
sets the video length.

- Task ``colour_video``: prompts such as "red, then blue" ask for a video whose first
  frames are red and whose last frames are blue (a blob on a dark background).
- Rewards (batched; ``sample.images`` is the row's list of frames, in order):
  ``video_colour`` (per frame, the share of pixels nearest to the colour that frame should
  have, averaged over frames: an analytic per-frame score in place of a CLIP score, which
  would need downloaded weights), ``video_colour_accuracy`` (1 when every frame's main
  colour is right) and ``temporal_consistency`` (1 - the mean absolute change between
  consecutive frames that should show the same colour: flicker costs, the prompted change
  does not).
- Workflow ``text_to_video``: ``text_to_image`` with frames; each evaluation writes an
  animated GIF grid (one tile per sample) and a PNG film strip (one row per sample, one
  column per frame) to ``<run>/samples/``; the first and latest are also
  ``video_before.gif`` / ``video_after.gif`` (and ``.png``) in the run directory; with
  ``rollout.args.mp4`` also H.264 MP4s (PyAV).
"""

from __future__ import annotations

import json
import math
import random
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Annotated, Any

import torch
from diffusers import ConfigMixin, ModelMixin
from diffusers.configuration_utils import register_to_config
from torch import Tensor, nn

from polyrl.core.config import ConfigError
from polyrl.core.data import PromptItem, write_jsonl
from polyrl.core.engine import SamplingParams
from polyrl.core.registry import TASKS, WORKFLOWS
from polyrl.core.rewards import Sample, register_reward
from polyrl.diffusion import colour as colour_task
from polyrl.diffusion.engine import sampling_options
from polyrl.diffusion.rewards import image_tensor, to_pil
from polyrl.diffusion.workflow import TextToImage, diffusion_record, image_grid

# --------------------------------------------------------------------------- the VAE


class _Dist:
    def __init__(self, z: Tensor) -> None:
        self.z = z

    def sample(self, generator: torch.Generator | None = None) -> Tensor:
        return self.z

    def mode(self) -> Tensor:
        return self.z


class PatchVideoVAE(ModelMixin, ConfigMixin):
    """Videos [B, 3, F, H, W] in [-1, 1] <-> latents [B, 3p², F, H/p, W/p] by pixel
    (un)shuffle of each frame: ``decode(encode(x)) == x`` with no weights to train, so a tiny
    demo's reward sees exactly the colours the transformer drew. It has the slice of
    ``AutoencoderKLWan``'s config that ``WanPipeline`` reads (``z_dim``, ``latents_mean``,
    ``latents_std``, ``scale_factor_temporal`` = 1, ``scale_factor_spatial`` = p), and the
    ``temperal_downsample`` that ``QwenImagePipeline`` reads (the tiny Qwen-Image's VAE)."""

    config_name = "config.json"

    @register_to_config
    def __init__(
        self,
        patch: int = 2,
        in_channels: int = 3,
        z_dim: int | None = None,
        latents_mean: list[float] | None = None,
        latents_std: list[float] | None = None,
        scale_factor_temporal: int = 1,
        scale_factor_spatial: int | None = None,
    ) -> None:
        super().__init__()
        z = in_channels * patch * patch
        self.register_to_config(
            z_dim=z,
            latents_mean=latents_mean or [0.0] * z,
            latents_std=latents_std or [1.0] * z,
            scale_factor_temporal=1,
            scale_factor_spatial=patch,
        )
        self.patch = patch
        self.register_buffer("marker", torch.ones(1))  # a weights file diffusers accepts

    @staticmethod
    def _framewise(x: Tensor, fn) -> Tensor:
        b, c, f, h, w = x.shape
        y = fn(x.transpose(1, 2).reshape(b * f, c, h, w))
        return y.reshape(b, f, *y.shape[1:]).transpose(1, 2)

    @property
    def temperal_downsample(self) -> list[bool]:
        """One entry per 2x spatial level, no temporal one: ``QwenImagePipeline`` reads its
        VAE factor as ``2 ** len(vae.temperal_downsample)`` (diffusers' spelling)."""
        return [False] * int(math.log2(self.patch))

    def encode(self, x: Tensor, return_dict: bool = True):
        z = self._framewise(x, lambda v: nn.functional.pixel_unshuffle(v, self.patch))
        out = SimpleNamespace(latent_dist=_Dist(z))
        return out if return_dict else (out.latent_dist,)

    def decode(self, z: Tensor, return_dict: bool = True, **_: Any):
        x = self._framewise(z, lambda v: nn.functional.pixel_shuffle(v, self.patch))
        return SimpleNamespace(sample=x) if return_dict else (x,)


# ---------------------------------------------------------------------------- the task

TEMPLATES = ("{a}, then {b}", "{a} then {b}", "{a} turning {b}")


def prompt_colours(prompt: str, names: list[str] | None = None) -> tuple[str, str] | None:
    """The first two palette colours a prompt names, in order ("red, then blue")."""
    words = prompt.lower().replace(",", " ").split()
    found = [w for w in words if w in (names or colour_task.PALETTE)]
    return (found[0], found[1]) if len(found) >= 2 else None


def frame_targets(frames: int) -> list[int]:
    """Which colour each frame should show: 0 (the first) for the first half, 1 for the
    second half; -1 for the middle frame of an odd count (the change, scored by neither)."""
    half = frames // 2
    return [0] * half + [-1] * (frames - 2 * half) + [1] * half


def pairs(names: list[str] | None = None, both_orders: bool = True) -> list[tuple[str, str]]:
    """Ordered pairs of distinct colours; ``both_orders=False`` keeps each pair in palette
    order only ("red, then blue" but not "blue, then red")."""
    names = colour_task.palette_names(names)
    return [
        (a, b)
        for i, a in enumerate(names)
        for j, b in enumerate(names)
        if i != j and (both_orders or i < j)
    ]


def write_dataset(
    out_dir: str | Path,
    seed: int,
    n_train: Annotated[int, "training prompts, each a random ordered pair and template"] = 512,
    colours: Annotated[list[str] | None, "palette colours (null: red, green, blue, yellow)"] = None,
    eval_pairs: Annotated[
        list[str] | None,
        "evaluation prompts (null: every pair of colours with the first template)",
    ] = None,
    both_orders: Annotated[
        bool,
        "each pair in both orders (false: palette order only, e.g. 'red, then blue' but not "
        "'blue, then red': then the set of colours alone tells the order)",
    ] = True,
) -> tuple[Path, Path]:
    """train.jsonl (random "a, then b" prompts) and eval.jsonl (fixed ones) under ``out_dir``."""
    all_pairs = pairs(colours, both_orders)
    rng = random.Random(seed)
    train = []
    for _ in range(n_train):
        a, b = rng.choice(all_pairs)
        train.append({"prompt": rng.choice(TEMPLATES).format(a=a, b=b), "answer": [a, b]})
    evl = []
    for p in (
        eval_pairs
        if eval_pairs is not None
        else [TEMPLATES[0].format(a=a, b=b) for a, b in all_pairs]
    ):
        ab = prompt_colours(p, colours)
        if ab is None:
            raise ValueError(f"task.args.eval_pairs: {p!r} names fewer than two palette colours")
        evl.append({"prompt": p, "answer": list(ab)})
    out = Path(out_dir).expanduser()
    return write_jsonl(out / "train.jsonl", train), write_jsonl(out / "eval.jsonl", evl)


def corpus(both_orders: bool = True, colours: list[str] | None = None) -> list[str]:
    """Every prompt of the task (the tiny tokenizer's vocabulary and pre-training captions)."""
    return [t.format(a=a, b=b) for a, b in pairs(colours, both_orders) for t in TEMPLATES]


def sft_rows(rows) -> list[dict]:
    raise NotImplementedError("the colour_video task has no supervised targets; set sft.steps=0")


def render_videos(
    colour_idx: Tensor,
    frames: int,
    size: int,
    generator: torch.Generator,
    names: list[str],
    blob: bool = False,
) -> Tensor:
    """Videos [B, 3, frames, size, size] in [0, 1] whose colour is ``colour_idx[:, 0]`` in
    the first half and ``colour_idx[:, 1]`` in the second (the middle frame of an odd count
    takes the second), with a little pixel noise. ``blob``: one still blob of that colour on
    the dark background (as the image task); otherwise the whole frame has the colour."""
    pal = torch.tensor([colour_task.PALETTE[n] for n in names])
    b = colour_idx.shape[0]
    if blob:
        first = colour_task.render_blobs(colour_idx[:, 0], size, generator, names)
        # the same blob (same place), recoloured
        bg = torch.tensor(colour_task.BACKGROUND)[None, :, None, None]
        fg = (first - bg).abs().sum(1) > 0.3
        second = torch.where(fg[:, None], pal[colour_idx[:, 1]][:, :, None, None], first)
    else:
        first, second = (
            pal[colour_idx[:, k]][:, :, None, None].expand(b, 3, size, size) for k in (0, 1)
        )
    out = []
    for f, tgt in enumerate(frame_targets(frames)):
        img = first if tgt == 0 else second
        noise = 0.03 * torch.randn(img.shape, generator=generator) if f else 0.0
        out.append((img + noise).clamp(0, 1))
    return torch.stack(out, dim=2)


TASKS.register("colour_video", sys.modules[__name__])


# ------------------------------------------------------------------------- the rewards

_COLOURS = Annotated[list[str] | None, "palette colours to tell apart (null: the whole palette)"]


def frames_of(sample: Sample) -> list[Tensor]:
    if not sample.images or len(sample.images) < 2:
        raise ValueError(
            f"row {sample.index} has {len(sample.images or [])} frame(s): a video reward needs "
            "the text_to_video workflow (engine.args.frames >= 2)"
        )
    return [image_tensor(im) for im in sample.images]


def _targets(sample: Sample, names: list[str]) -> tuple[int, int]:
    ans = sample.answer
    ab = (
        tuple(ans)
        if isinstance(ans, (list, tuple)) and len(ans) == 2 and all(a in names for a in ans)
        else prompt_colours(sample.prompt, names)
    )
    if ab is None:
        raise ValueError(
            f"row {sample.index}: the prompt {sample.prompt!r} names fewer than two of the "
            f"colours {names} (and the answer is {ans!r})"
        )
    return names.index(ab[0]), names.index(ab[1])


def _palette(colours: list[str] | None) -> tuple[list[str], Tensor]:
    names = colour_task.palette_names(colours)
    pal = torch.tensor([colour_task.PALETTE[n] for n in names] + [colour_task.BACKGROUND])
    return names, pal


def _nearest(frame: Tensor, pal: Tensor) -> Tensor:
    return ((frame[None] - pal[:, :, None, None]) ** 2).sum(1).argmin(0)


@register_reward("video_colour", batched=True)
def video_colour(samples: list[Sample], colours: _COLOURS = None) -> list[float]:
    """Mean over frames of the share of pixels nearest to the colour that frame should show
    (the first named colour in the first half, the second in the second half)."""
    names, pal = _palette(colours)
    out = []
    for s in samples:
        frames, ab = frames_of(s), _targets(s, names)
        scores = [
            float((_nearest(fr, pal) == ab[t]).float().mean())
            for fr, t in zip(frames, frame_targets(len(frames)), strict=True)
            if t >= 0
        ]
        out.append(sum(scores) / len(scores))
    return out


@register_reward("video_colour_accuracy", batched=True)
def video_colour_accuracy(samples: list[Sample], colours: _COLOURS = None) -> list[float]:
    """1 when in every scored frame the colour it should show is its most common
    non-background colour."""
    names, pal = _palette(colours)
    out = []
    for s in samples:
        frames, ab = frames_of(s), _targets(s, names)
        ok = True
        for fr, t in zip(frames, frame_targets(len(frames)), strict=True):
            if t < 0:
                continue
            counts = torch.bincount(_nearest(fr, pal).flatten(), minlength=len(pal))[:-1]
            ok &= int(counts.argmax()) == ab[t] and int(counts.max()) > 0
        out.append(float(ok))
    return out


@register_reward("temporal_consistency", batched=True)
def temporal_consistency(samples: list[Sample]) -> list[float]:
    """1 - the mean absolute pixel change (in [0, 1]) between consecutive frames that should
    show the same colour; the change the prompt asks for is not counted."""
    out = []
    for s in samples:
        frames = frames_of(s)
        tgt = frame_targets(len(frames))
        diffs = [
            float((frames[f + 1] - frames[f]).abs().mean())
            for f in range(len(frames) - 1)
            if tgt[f] == tgt[f + 1] >= 0
        ]
        if not diffs:
            raise ValueError(
                f"row {s.index}: {len(frames)} frames leave no two consecutive frames of one "
                "colour; temporal_consistency needs frames >= 4"
            )
        out.append(1.0 - sum(diffs) / len(diffs))
    return out


# ------------------------------------------------------------------------- the workflow


def save_gif(frames: list, path: Path, ms_per_frame: int = 250) -> None:
    frames[0].save(path, save_all=True, append_images=frames[1:], duration=ms_per_frame, loop=0)


def save_mp4(frames: list, path: Path, ms_per_frame: int = 250) -> None:
    """H.264 (yuv420p) through PyAV; odd sides are padded by one pixel (the codec's rule)."""
    from fractions import Fraction

    import av
    import numpy as np

    w, h = frames[0].size
    with av.open(str(path), mode="w") as out:
        stream = out.add_stream("libx264", rate=Fraction(1000, ms_per_frame))
        stream.width, stream.height, stream.pix_fmt = w + w % 2, h + h % 2, "yuv420p"
        stream.options = {"crf": "18"}
        for im in frames:
            arr = np.zeros((stream.height, stream.width, 3), dtype=np.uint8)
            arr[:h, :w] = np.asarray(im.convert("RGB"))
            out.mux(stream.encode(av.VideoFrame.from_ndarray(arr, format="rgb24")))
        out.mux(stream.encode())


class TextToVideo(TextToImage):
    """Sample ``n`` videos per prompt with a Wan policy; one row per video, its frames in
    ``meta["images"]`` (so ``sample.images`` is the list of frames)."""

    @staticmethod
    def validate_config(cfg) -> None:
        TextToImage.validate_config(cfg)
        name = dict(cfg.rollout.args).get("policy") or next(iter(cfg.policies))
        if sampling_options(cfg.policies[name], name).frames < 2:
            raise ConfigError(
                f"rollout.workflow=text_to_video: set policies.{name}.engine.args.frames "
                "(>= 2, a video model such as Wan)"
            )

    def __init__(
        self,
        ctx,
        policy: Annotated[
            str | None, "the video policy that samples (null: the first policy)"
        ] = None,
        grid_scale: Annotated[
            int, "evaluation grids: pixels per video pixel (0: enough for 64-pixel tiles)"
        ] = 0,
        save_grids: Annotated[
            bool, "write a GIF grid and a PNG film strip at each evaluation"
        ] = True,
        ms_per_frame: Annotated[int, "GIF (and MP4) frame duration in milliseconds"] = 250,
        mp4: Annotated[
            bool, "also write each grid as an H.264 MP4 (needs PyAV: pip install av)"
        ] = False,
    ) -> None:
        super().__init__(ctx, policy=policy, grid_scale=grid_scale, save_grids=save_grids)
        if ms_per_frame < 1:
            raise ConfigError(f"rollout.args.ms_per_frame must be >= 1, got {ms_per_frame}")
        if mp4:
            try:
                import av  # noqa: F401
            except ImportError:
                raise ConfigError(
                    "rollout.args.mp4=true needs PyAV (pip install av); or set mp4: false "
                    "(the GIF grids are always written)"
                ) from None
        self.ms_per_frame, self.mp4 = ms_per_frame, mp4

    def rollout(self, items: list[PromptItem], params: SamplingParams):
        training = self.is_training(params)
        traj = self.engine.sample(
            [it.prompt_text for it in items], n=params.n, deterministic=params.temperature == 0
        )
        alive = traj.alive
        videos: list = [None] * len(traj.errors)
        if bool(alive.any()):
            decoded = self.engine.decode(traj.latents[alive, -1])  # [B, 3, F, H, W]
            for k, i in enumerate(alive.nonzero().flatten().tolist()):
                videos[i] = [to_pil(decoded[k, :, f]) for f in range(decoded.shape[2])]
        rows = [items[int(i)] for i in traj.prompt_index]
        meta = [
            {"answer": it.answer, "row": it.row, "images": v if v is not None else []}
            for it, v in zip(rows, videos, strict=True)
        ]
        record = diffusion_record(
            traj,
            policy=self.name,
            uid=[it.uid for it in rows],
            prompt_text=[it.prompt_text for it in rows],
            meta=meta,
        )
        if not training and self.save_grids:
            self.write_grid(videos, [it.prompt_text for it in items], params.n)
        return record

    def write_grid(self, videos: list, prompts: list[str], n: int) -> Path | None:
        """``samples/eval_rollout_<k>.gif`` (frame f of every sample, one row per prompt)
        and ``.png`` (a film strip: one row per sample, one column per frame)."""
        if self.run_dir is None:
            return None
        run = Path(self.run_dir)
        some = next((v for v in videos if v is not None), None)
        frames = len(some) if some else 1
        height = some[0].size[1] if some else 64
        scale = self.grid_scale or max(1, 64 // max(1, height))
        per_frame = [
            image_grid([v[f] if v is not None else None for v in videos], cols=n, scale=scale)
            for f in range(frames)
        ]
        strip = image_grid(
            [v[f] if v is not None else None for v in videos for f in range(frames)],
            cols=frames,
            scale=scale,
        )
        rollouts = int(self.engine.state_dict()["rollouts"])  # the engine may be remote
        out = run / "samples" / f"eval_rollout_{rollouts:06d}.gif"
        out.parent.mkdir(parents=True, exist_ok=True)
        save_gif(per_frame, out, self.ms_per_frame)
        if self.mp4:
            save_mp4(per_frame, out.with_suffix(".mp4"), self.ms_per_frame)
        strip.save(out.with_suffix(".png"))
        out.with_suffix(".json").write_text(
            json.dumps({"rows": prompts, "per_row": n, "frames": frames})
        )
        if self._grids == 0 and not (run / "video_before.gif").exists():
            save_gif(per_frame, run / "video_before.gif", self.ms_per_frame)
            strip.save(run / "video_before.png")
        save_gif(per_frame, run / "video_after.gif", self.ms_per_frame)
        if self.mp4:
            save_mp4(per_frame, run / "video_after.mp4", self.ms_per_frame)
        strip.save(run / "video_after.png")
        self._grids += 1
        return out


WORKFLOWS.register("text_to_video", TextToVideo)


# ---------------------------------------------------------------------- pre-training


def pretrain_colour_video(
    path: Path,
    *,
    steps: int,
    frames: int,
    size: int,
    both_orders: bool = True,
    colours: list[str] | None = None,
    blob: bool = False,
    batch_size: int = 32,
    lr: float = 2e-3,
    label_noise: float = 0.0,
    cond_dropout: float = 0.1,
    seed: int = 0,
    log_every: int = 0,
) -> dict[str, float]:
    """Flow-matching pre-training of ``path``'s Wan transformer on colour-over-time videos.

    With ``label_noise = p`` a share p of the videos shows a random pair of colours (the
    same colour twice included) instead of the one its prompt names, so the model follows
    the prompt only part of the time and RL has something to fix."""
    from polyrl.diffusion.models import WanFamily

    fam = WanFamily(
        str(path), dtype=torch.float32, device=torch.device("cpu"), max_sequence_length=8
    )
    names = colour_task.palette_names(colours)
    prompts = corpus(both_orders, names)
    emb, _ = fam.encode(prompts + [""])
    null_emb, emb = emb[-1:], emb[:-1]
    want = torch.tensor([[names.index(c) for c in prompt_colours(p)] for p in prompts])
    model = fam.transformer.train().requires_grad_(True)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda k: min(1.0, (k + 1) / 20) * (0.1 + 0.9 * (1 - k / max(1, steps)))
    )
    gen = torch.Generator().manual_seed(seed)
    shift = fam.scheduler.config.shift
    t0, losses = time.perf_counter(), []
    for k in range(steps):
        which = torch.randint(len(prompts), (batch_size,), generator=gen)
        cols = want[which].clone()
        wrong = torch.rand(batch_size, generator=gen) < label_noise
        cols[wrong] = torch.randint(len(names), (int(wrong.sum()), 2), generator=gen)
        x0 = fam.encode_videos(render_videos(cols, frames, size, gen, names, blob))
        u = torch.rand(batch_size, generator=gen)
        sigma = shift * u / (1 + (shift - 1) * u)
        eps = torch.randn(x0.shape, generator=gen)
        s = sigma[:, None, None, None, None]
        xt = (1 - s) * x0 + s * eps
        drop = torch.rand(batch_size, generator=gen) < cond_dropout
        e = torch.where(drop[:, None, None], null_emb, emb[which])
        v = fam.velocity(model, xt, sigma * 1000, e, e[:, 0, :0]).float()
        loss = ((v - (eps - x0)) ** 2).mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        losses.append(float(loss.detach()))
        if log_every and (k % log_every == 0 or k == steps - 1):
            recent = losses[-log_every:]
            print(
                f"pretrain step {k}: loss {sum(recent) / len(recent):.4f} "
                f"({time.perf_counter() - t0:.0f}s)",
                flush=True,
            )
    model.eval().requires_grad_(False)
    model.save_pretrained(path / "transformer")
    tail = losses[-max(1, steps // 10) :]
    return {"loss_last": sum(tail) / len(tail), "seconds": time.perf_counter() - t0}


__all__ = [
    "PatchVideoVAE",
    "TextToVideo",
    "frame_targets",
    "pretrain_colour_video",
    "prompt_colours",
    "render_videos",
    "temporal_consistency",
    "video_colour",
    "video_colour_accuracy",
]
