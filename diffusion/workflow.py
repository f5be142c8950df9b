"""The ``text_to_image`` and ``text_to_video`` workflows: prompts -> recorded denoising
trajectories -> record.

Each prompt is sampled ``rollout.n`` times by the policy's diffusion engine; images are
decoded for the rewards. One record row per trajectory (see :func:`diffusion_record`).
``text_to_video`` is the same with a video model (Wan): a row's frames are its
``meta["images"]``, and each evaluation writes an animated GIF grid (one tile per sample)
and a PNG film strip (one row per sample, one column per frame) to ``<run>/samples/``;
the first and latest are also ``video_before.gif`` / ``video_after.gif`` (and ``.png``) in
the run directory; with ``rollout.args.mp4`` also H.264 MP4s (PyAV).

Evaluation is a call with ``phase="eval"`` (the session evaluates with ``eval.n`` and
``eval.temperature``): at temperature 0 it samples
with the deterministic ODE from seeds the session restores each time, so every
evaluation sees the same prompts and the same starting noise. Each evaluation writes an
image grid (one row per prompt) to ``<run>/samples/eval_rollout_<k>.png``; the first is
also ``grid_before.png`` and the latest ``grid_after.png`` in the run directory.

The workflow talks to the engine only through ``sample``, ``decode`` and ``state_dict``,
and never to the policy, so under ``distributed.backend: ray`` it runs unchanged on the
driver with the backend's handles (sampling and VAE decoding happen on the engine actor).
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Annotated

import torch
from tensordict import NonTensorData, NonTensorStack, TensorDict

from polyrl.core.config import ConfigError
from polyrl.core.interfaces import Phase
from polyrl.core.registry import POLICIES, WORKFLOWS
from polyrl.core.rollout.data import PromptItem
from polyrl.core.rollout.engine import SamplingParams
from polyrl.core.rollout.workflow import Context
from polyrl.diffusion.credit import GAUSSIAN_MEAN
from polyrl.diffusion.engine import Denoises, Trajectories, sampling_options
from polyrl.diffusion.guards import ratio_scale
from polyrl.diffusion.member import trajectory_tensors
from polyrl.diffusion.nft import NFT_LOSS
from polyrl.diffusion.policy import DiffusionPolicy, policy_options
from polyrl.diffusion.rewards import prepare_rewards, to_pil

RECORD_TENSORS = (
    "latents",
    "sigmas",
    "timesteps",
    "rollout_logprobs",
    "loss_mask",
    "response_mask",
    "noise_mask",
    "prompt_embeds",
    "pooled_prompt_embeds",
    "negative_prompt_embeds",
    "negative_pooled_prompt_embeds",
    "guidance",
    "noise_level",
)


def _stack(values: list) -> NonTensorStack:
    return NonTensorStack(*[NonTensorData(v) for v in values])


def diffusion_record(
    traj: Trajectories,
    *,
    policy: str,
    uid: list[int],
    prompt_text: list[str],
    meta: list[dict],
) -> TensorDict:
    """The rollout record of diffusion trajectories (``B`` rows, ``N`` steps).

    Tensors: ``latents [B,N+1,*L]`` (x before every step and the final one), ``sigmas
    [B,N+1]``, ``timesteps [B,N]``, ``rollout_logprobs [B,N]`` (float32, the sampler's),
    ``loss_mask [B,N]`` (trained steps), ``response_mask [B,N]`` (1 on every step),
    ``noise_mask [B,N]`` (noisy steps), prompt and negative-prompt embeddings,
    ``guidance [B]``, ``noise_level [B]``, the group keys ``uid/agent_id/turn/node``,
    ``reward`` (NaN until scored), ``valid``, ``truncated``. Non-tensor: ``policy``,
    ``prompt_text``, ``response_text``, ``error``, ``meta`` (with ``images``),
    ``sampler`` (the step rule the policy recomputes log-probs with).
    """
    b, n = traj.logprobs.shape
    valid = traj.alive
    zeros = torch.zeros(b, dtype=torch.long)
    td = TensorDict(
        {
            **trajectory_tensors(traj),
            "uid": torch.as_tensor(uid, dtype=torch.long),
            "agent_id": zeros.clone(),
            "turn": zeros.clone(),
            "node": zeros.clone(),
            "reward": torch.full((b,), float("nan")),
            "valid": valid,
            "truncated": torch.zeros(b, dtype=torch.bool),
        },
        batch_size=[b],
    )
    td["policy"] = _stack([policy] * b)
    td["prompt_text"] = _stack(list(prompt_text))
    td["response_text"] = _stack([f"<image {traj.sampler}, {n} steps>" for _ in range(b)])
    td["error"] = _stack(list(traj.errors))
    td["meta"] = _stack(list(meta))
    td["sampler"] = _stack([traj.sampler] * b)
    return td


def image_grid(images: list, cols: int, scale: int = 1, pad: int = 2):
    """One PIL image with ``images`` (None = grey tile) in rows of ``cols``."""
    from PIL import Image

    tiles = [to_pil(im) if im is not None else None for im in images]
    w, h = next((t.size for t in tiles if t is not None), (16, 16))
    w, h = w * scale, h * scale
    rows = (len(tiles) + cols - 1) // cols
    grid = Image.new("RGB", (cols * (w + pad) + pad, max(1, rows) * (h + pad) + pad), "white")
    for k, t in enumerate(tiles):
        tile = (
            t.resize((w, h), Image.NEAREST) if t is not None else Image.new("RGB", (w, h), "grey")
        )
        grid.paste(tile, (pad + (k % cols) * (w + pad), pad + (k // cols) * (h + pad)))
    return grid


def _diffusion_kind(kind: str) -> bool:
    part = POLICIES.get(kind) if kind in POLICIES else None
    return isinstance(part, type) and issubclass(part, DiffusionPolicy)


def _check_forward_process(cfg) -> None:
    """A forward-process policy (diffusion_nft) trains with its own loss, one optimizer step
    per rollout (its old velocity is the sampling weights') and no KL; and only it can."""
    algo = cfg.algorithm
    nft = [
        n
        for n, p in cfg.policies.items()
        if _diffusion_kind(p.kind) and POLICIES.get(p.kind).forward_process
    ]
    if nft and algo.policy_loss != NFT_LOSS:
        raise ConfigError(
            f"policies.{nft[0]}.kind={cfg.policies[nft[0]].kind!r} trains on the forward "
            f"process: set algorithm.policy_loss: {NFT_LOSS} (got {algo.policy_loss!r})"
        )
    if algo.policy_loss == NFT_LOSS and not nft:
        raise ConfigError(
            f"algorithm.policy_loss={NFT_LOSS} needs a policy of kind diffusion_nft, which "
            "computes it; set policies.<name>.kind: diffusion_nft"
        )
    if nft and (algo.ppo_epochs != 1 or algo.minibatches != 1 or algo.kl_coef != 0):
        raise ConfigError(
            f"algorithm.policy_loss={NFT_LOSS} takes one optimizer step per rollout "
            "(ppo_epochs: 1, minibatches: 1: its old velocity is the sampling weights') and "
            f"no KL term (kl_coef: 0); got ppo_epochs={algo.ppo_epochs}, "
            f"minibatches={algo.minibatches}, kl_coef={algo.kl_coef}"
        )


def _check_guards(cfg) -> None:
    """GRPO-Guard's scaled log-probs make log-prob KL estimators meaningless, and the
    per-term credit must name reward terms the recipe has."""
    algo = cfg.algorithm
    for pname, p in cfg.policies.items():
        if not _diffusion_kind(p.kind) or not policy_options(p, pname).ratio_norm:
            continue
        if POLICIES.get(p.kind).forward_process:
            raise ConfigError(
                f"policies.{pname}.args.ratio_norm: kind {p.kind!r} trains on the forward "
                "process, without log-ratios to normalise; set ratio_norm: false"
            )
        if algo.kl_coef > 0 and algo.kl_estimator != GAUSSIAN_MEAN:
            raise ConfigError(
                f"policies.{pname}.args.ratio_norm scales the log-probs (GRPO-Guard), so a "
                f"KL from them (algorithm.kl_estimator={algo.kl_estimator!r}) would be "
                f"scaled too: use kl_estimator: {GAUSSIAN_MEAN} (from the step means)"
            )
    if algo.credit == "per_prompt":
        terms = dict(algo.credit_args).get("terms") or {}
        keys = [t.key for t in cfg.reward.terms]
        missing = [k for k in terms if k not in keys]
        if missing:
            raise ConfigError(
                f"algorithm.credit_args.terms names {missing}, not reward terms of this "
                f"recipe (reward.terms keys: {keys})"
            )


class TextToImage:
    """Sample ``n`` images per prompt with a diffusion policy; one row per image."""

    @staticmethod
    def validate_config(cfg) -> None:
        """Config-time checks beyond the workflow's own options (``Config.validate`` calls
        this before any model loads, after binding every part's options): the policy it
        samples with, and the engine and kind options of every diffusion policy."""
        args = dict(cfg.rollout.args)
        name = args.get("policy") or next(iter(cfg.policies), None)
        if name not in cfg.policies:
            raise ConfigError(
                f"rollout.args.policy={name!r} is not a policy; have {sorted(cfg.policies)}"
            )
        if not _diffusion_kind(cfg.policies[name].kind):
            raise ConfigError(
                f"the text_to_image workflow samples with policy {name!r}, whose "
                f"kind is {cfg.policies[name].kind!r}; set policies.{name}.kind: "
                "diffusion"
            )
        for pname, p in cfg.policies.items():
            if _diffusion_kind(p.kind):
                sampling_options(p, pname)
                policy_options(p, pname)
        _check_forward_process(cfg)
        _check_guards(cfg)
        if cfg.sft.steps:
            raise ConfigError(
                "sft.steps must be 0 with the text_to_image workflow (text targets); a "
                "diffusion warm start on images is rollout.args.sft_steps / sft_data"
            )

    def __init__(
        self,
        ctx: Context,
        policy: Annotated[
            str | None, "the diffusion policy that samples (null: the first policy)"
        ] = None,
        grid_scale: Annotated[
            int, "evaluation grids: pixels per image pixel (0: enough for 64-pixel tiles)"
        ] = 0,
        save_grids: Annotated[
            bool, "write an image grid at each evaluation (samples/, grid_before/after.png)"
        ] = True,
        sft_data: Annotated[
            str | None,
            "warm start: JSON lines of {prompt, image} (image paths relative to the file)",
        ] = None,
        sft_steps: Annotated[
            int, "flow-matching warm-start steps on sft_data before the first rollout (0: none)"
        ] = 0,
        sft_batch_size: Annotated[int, "warm start: (prompt, image) pairs per step"] = 16,
        sft_lr: Annotated[
            float | None, "warm start: constant learning rate (null: the policy's optim.lr)"
        ] = None,
    ) -> None:
        name = policy or next(iter(ctx.policies))
        if name not in ctx.policies:
            raise ConfigError(
                f"text_to_image: unknown policy {name!r}; have {sorted(ctx.policies)}"
            )
        self.name, self.ctx, self.cfg = name, ctx, ctx.cfg
        # the policy's kind, not the object: under Ray, ctx holds the backend's handles
        kind = POLICIES.get(self.cfg.policies[name].kind)
        if not (isinstance(kind, type) and issubclass(kind, DiffusionPolicy)):
            raise ConfigError(
                f"text_to_image: policy {name!r} is of kind "
                f"{self.cfg.policies[name].kind!r}; set policies.{name}.kind: "
                "diffusion"
            )
        self.engine = ctx.engines[name]  # DiffusionEngine, or the Ray backend's handle on one
        if not isinstance(self.engine, Denoises):
            raise ConfigError(f"text_to_image: policy {name!r} needs engine.name: diffusion")
        if self.cfg.sft.steps:
            raise ConfigError(
                "sft.steps must be 0 with the text_to_image workflow (text targets); a "
                "diffusion warm start on images is rollout.args.sft_steps / sft_data"
            )
        algo = self.cfg.algorithm
        if algo.credit == "group":
            warnings.warn(
                "text_to_image: algorithm.credit=group groups rows by dataset row; "
                "per_prompt (Flow-GRPO's per-prompt statistics) is the usual choice",
                stacklevel=2,
            )
        prepare_rewards(self.cfg.reward.terms)  # reward paths/models fail before sampling
        pcfg = self.cfg.policies[name]
        self.ratio_norm = policy_options(pcfg, name).ratio_norm
        self.logprob_form = sampling_options(pcfg, name).logprob
        self.run_dir = ctx.run_dir
        self.grid_scale = grid_scale
        self.save_grids = save_grids
        self._grids = 0
        self.sft_losses: list[float] = []
        if sft_steps:
            self.sft_losses = self._warm_start(sft_data, sft_steps, sft_batch_size, sft_lr)

    def _warm_start(
        self, data: str | None, steps: int, batch_size: int, lr: float | None
    ) -> list[float]:
        """Flow matching on the given images (diffusion/sft.py) in this process: the policy
        object is here only with the local backend."""
        from polyrl.diffusion.sft import load_pairs, warm_start

        if steps < 0 or batch_size < 1 or not data:
            raise ConfigError(
                f"rollout.args.sft_steps={steps} needs sft_steps >= 0, sft_batch_size >= 1 "
                f"(got {batch_size}) and sft_data (a JSON-lines file of prompt/image rows)"
            )
        policy = self.ctx.policies[self.name]
        if not isinstance(policy, DiffusionPolicy):
            raise ConfigError(
                "rollout.args.sft_steps: the diffusion warm start runs in the driver process, "
                "so it needs distributed.backend: local"
            )
        if self.cfg.algorithm.kl_coef > 0 and self.cfg.policies[self.name].lora.r > 0:
            raise ConfigError(
                "rollout.args.sft_steps with algorithm.kl_coef > 0 and LoRA: the reference "
                "(the adapter switched off) would be the weights before the warm start"
            )
        prompts, images = load_pairs(data)
        losses = warm_start(
            policy, prompts, images, steps=steps, batch_size=batch_size, lr=lr, seed=self.cfg.seed
        )
        if self.run_dir is not None:
            out = Path(self.run_dir) / "sft_warm_start.json"
            out.write_text(json.dumps({"data": data, "losses": losses}))
        return losses

    def rollout(
        self, items: list[PromptItem], params: SamplingParams, phase: Phase = "train"
    ) -> TensorDict:
        training = phase == "train"
        traj = self.engine.sample(
            [it.prompt_text for it in items], n=params.n, deterministic=params.temperature == 0
        )
        if self.ratio_norm:  # GRPO-Guard: recorded as the policy recomputes them
            traj.logprobs = traj.logprobs * ratio_scale(traj.stds, self.logprob_form)
        alive = traj.alive
        pictures: list = [None] * len(traj.errors)
        if bool(alive.any()):
            decoded = self.engine.decode(traj.latents[alive, -1])
            for k, i in enumerate(alive.nonzero().flatten().tolist()):
                pictures[i] = self.frames(decoded[k])
        rows = [items[int(i)] for i in traj.prompt_index]
        meta = [
            {"answer": it.answer, "row": it.row, "images": p if p is not None else []}
            for it, p in zip(rows, pictures, strict=True)
        ]
        record = diffusion_record(
            traj,
            policy=self.name,
            uid=[it.uid for it in rows],
            prompt_text=[it.prompt_text for it in rows],
            meta=meta,
        )
        if not training and self.save_grids:
            self.write_grid(pictures, [it.prompt_text for it in items], params.n)
        return record

    @staticmethod
    def frames(pixels: torch.Tensor) -> list:
        """A row's ``meta["images"]`` (so ``sample.images``) from its decoded pixels."""
        return [to_pil(pixels)]

    def write_grid(self, pictures: list, prompts: list[str], n: int) -> Path | None:
        if self.run_dir is None:
            return None
        run = Path(self.run_dir)
        images = [p[0] if p is not None else None for p in pictures]
        height = next((im.size[1] for im in images if im is not None), 64)
        scale = self.grid_scale or max(1, 64 // max(1, height))
        grid = image_grid(images, cols=n, scale=scale)
        out = self._grid_path(run, ".png")
        grid.save(out)
        (out.with_suffix(".json")).write_text(json.dumps({"rows": prompts, "per_row": n}))
        if self._grids == 0 and not (run / "grid_before.png").exists():
            grid.save(run / "grid_before.png")
        grid.save(run / "grid_after.png")
        self._grids += 1
        return out

    def _grid_path(self, run: Path, suffix: str) -> Path:
        """``samples/eval_rollout_<k><suffix>``, k the engine's rollout count."""
        rollouts = int(self.engine.state_dict()["rollouts"])  # the engine may be remote
        out = run / "samples" / f"eval_rollout_{rollouts:06d}{suffix}"
        out.parent.mkdir(parents=True, exist_ok=True)
        return out


WORKFLOWS.register("text_to_image", TextToImage)


# ---------------------------------------------------------------------------- video


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

    @staticmethod
    def frames(pixels: torch.Tensor) -> list:
        """A video's frames [3, F, H, W], in order, as the row's images."""
        return [to_pil(pixels[:, f]) for f in range(pixels.shape[1])]

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
        out = self._grid_path(run, ".gif")
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
