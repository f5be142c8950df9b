"""Image and video rewards (batched): JPEG size, CLIP score, aesthetic, PickScore, HPSv2,
colour; per-frame colour and temporal consistency of videos.

Registered names: ``jpeg_compressibility``, ``jpeg_incompressibility``, ``t2i_clip_score``
(image vs *prompt*; the multimodal plugin's ``clip_score`` scores an image against a
response), ``aesthetic``, ``pickscore``, ``hpsv2``, ``colour``, ``colour_accuracy``,
``colour_named`` (the response names the image's main colour: a judge reading a picture); for
videos (``sample.images`` is the row's list of frames, in order): ``video_colour`` (per
frame, the share of pixels nearest to the colour that frame should have, averaged over
frames: an analytic per-frame score in place of a CLIP score, which would need downloaded
weights), ``video_colour_accuracy`` (1 when every frame's main colour is right) and
``temporal_consistency`` (1 - the mean absolute change between consecutive frames that
should show the same colour: flicker costs, the prompted change does not).

Every reward here is registered with ``register_reward(..., batched=True)`` and receives
the whole list of samples; ``sample.images[0]`` is the row's image (a PIL image; tensors
and arrays also work). Weighted combinations are the core's: list several terms with
weights under ``reward.terms`` and the row reward is their weighted sum (each term is also
logged on its own as ``reward/<name>/mean``).

Reward models are loaded from a local path or hub id the user gives, once per process.
A reward with a ``prepare(**options)`` attribute is prepared (with all of the term's
options) by the text-to-image workflow before the first rollout, so a checkpoint path that
does not exist (or a model that will not load) fails before any sampling, naming it.
"""

from __future__ import annotations

import functools
import inspect
import io
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any

import numpy as np
import torch
from torch import Tensor

from polyrl.core.rollout.rewards import Sample, extract_answer, normalize_answer, register_reward
from polyrl.diffusion import colour as colour_task
from polyrl.diffusion.colour_video import frame_targets, prompt_colours

_LOCK = threading.Lock()
_CACHE: dict[tuple, Any] = {}
_PATH_SUFFIXES = (".pt", ".pth", ".bin", ".safetensors", ".ckpt", ".json", ".npz")

# Options several rewards share.
_DEVICE = Annotated[str | None, "where the reward model runs (null: cuda when visible, else cpu)"]
_QUALITY = Annotated[int, "JPEG quality of the encoding whose size is measured"]
_COLOURS = Annotated[list[str] | None, "palette colours to tell apart (null: the whole palette)"]


# ----------------------------------------------------------------------------- helpers


def image_tensor(image: Any) -> Tensor:
    """[3, H, W] float32 in [0, 1] from a PIL image, HxWx3 array or CxHxW tensor."""
    if isinstance(image, Tensor):
        t = image.detach().float().cpu()
        if t.dim() == 3 and t.shape[0] not in (1, 3) and t.shape[-1] in (1, 3):
            t = t.permute(2, 0, 1)
        return (t / 255.0 if t.max() > 1.5 else t).clamp(0, 1)
    if hasattr(image, "convert"):  # PIL
        image = np.asarray(image.convert("RGB"))
    arr = np.asarray(image)
    if arr.ndim != 3:
        raise ValueError(f"expected an RGB image, got an array of shape {arr.shape}")
    t = torch.from_numpy(arr.astype(np.float32))
    t = t.permute(2, 0, 1) if t.shape[-1] in (1, 3) else t
    return (t / 255.0 if arr.dtype == np.uint8 or t.max() > 1.5 else t).clamp(0, 1)


def to_pil(image: Any):
    from PIL import Image

    if hasattr(image, "convert"):
        return image.convert("RGB")
    t = image_tensor(image)
    return Image.fromarray((t.permute(1, 2, 0).numpy() * 255).round().astype(np.uint8))


def first_image(sample: Sample) -> Any:
    if not sample.images:
        raise ValueError(f"row {sample.index} has no image (sample.images is empty)")
    return sample.images[0]


def looks_like_path(value: str) -> bool:
    return (
        value.startswith(("/", ".", "~"))
        or value.lower().endswith(_PATH_SUFFIXES)
        or value.startswith("local-dir:")
    )


def check_path(reward: str, arg: str, value: str | None, *, required: bool = False) -> None:
    """Fail with a clear message when a path-like argument names nothing on disk."""
    if value is None or value == "":
        if required:
            raise ValueError(f"reward {reward!r} needs args.{arg} (a local path or hub id)")
        return
    path = value.removeprefix("local-dir:")
    if looks_like_path(value) and not Path(path).expanduser().exists():
        raise FileNotFoundError(
            f"reward {reward!r}: args.{arg}={value!r} does not exist; give "
            "the checkpoint's local path (or a hub id / pretrained tag)"
        )


def _device(device: str | None) -> torch.device:
    return torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))


def cached(key: tuple, build: Callable[[], Any]) -> Any:
    with _LOCK:
        if key not in _CACHE:
            _CACHE[key] = build()
        return _CACHE[key]


def with_prepare(prepare: Callable[..., None]):
    """Attach ``fn.prepare(**options)``: checks (and loads) what the reward needs, before
    sampling. ``prepare`` has no defaults of its own: the options not given take the
    reward's defaults (its keyword parameters are its options)."""

    def add(fn):
        defaults = {
            k: p.default
            for k, p in inspect.signature(fn).parameters.items()
            if p.default is not inspect.Parameter.empty
        }

        def run(**options: Any) -> None:
            prepare(**{**defaults, **options})

        fn.prepare = run
        return fn

    return add


# ------------------------------------------------------------------------ JPEG size


def jpeg_kb(image: Any, quality: int = 95) -> float:
    buf = io.BytesIO()
    to_pil(image).save(buf, format="JPEG", quality=quality)
    return buf.tell() / 1000.0


@register_reward("jpeg_compressibility", batched=True)
def jpeg_compressibility(samples: list[Sample], quality: _QUALITY = 95) -> list[float]:
    """Minus the JPEG size in kB (smaller files score higher)."""
    return [-jpeg_kb(first_image(s), quality) for s in samples]


@register_reward("jpeg_incompressibility", batched=True)
def jpeg_incompressibility(samples: list[Sample], quality: _QUALITY = 95) -> list[float]:
    """The JPEG size in kB (more detail scores higher)."""
    return [jpeg_kb(first_image(s), quality) for s in samples]


# -------------------------------------------------------------------------- colour


def _palette(names: list[str] | None) -> tuple[list[str], Tensor]:
    names = colour_task.palette_names(names)
    cols = torch.tensor([colour_task.PALETTE[n] for n in names] + [colour_task.BACKGROUND])
    return names, cols


def _target(sample: Sample, names: list[str]) -> int:
    name = (
        sample.answer
        if isinstance(sample.answer, str) and sample.answer in names
        else colour_task.prompt_colour(sample.prompt, names)
    )
    if name is None:
        raise ValueError(
            f"row {sample.index}: the prompt {sample.prompt!r} names none of the "
            f"colours {names} (and the answer is {sample.answer!r})"
        )
    return names.index(name)


def nearest_colour(image: Any, palette: Tensor) -> Tensor:
    """[H, W] index of the nearest palette colour (the last entry is the background)."""
    img = image_tensor(image)
    d = ((img[None] - palette[:, :, None, None]) ** 2).sum(1)
    return d.argmin(0)


@register_reward("colour", batched=True)
def colour(samples: list[Sample], colours: _COLOURS = None) -> list[float]:
    """Share of pixels nearest to the colour the prompt names (answer field, else the prompt)."""
    names, pal = _palette(colours)
    return [
        float((nearest_colour(first_image(s), pal) == _target(s, names)).float().mean())
        for s in samples
    ]


def main_colour(image: Any, names: list[str], pal: Tensor) -> str | None:
    """The most common non-background palette colour of ``image``; None for background only."""
    counts = torch.bincount(nearest_colour(image, pal).flatten(), minlength=len(names) + 1)
    counts = counts[: len(names)]
    return names[int(counts.argmax())] if counts.sum() > 0 else None


@register_reward("colour_accuracy", batched=True)
def colour_accuracy(samples: list[Sample], colours: _COLOURS = None) -> list[float]:
    """1 when the named colour is the most common non-background colour of the image."""
    names, pal = _palette(colours)
    return [
        float(main_colour(first_image(s), names, pal) == names[_target(s, names)]) for s in samples
    ]


@register_reward("colour_named", batched=True)
def colour_named(
    samples: list[Sample],
    colours: _COLOURS = None,
    goal: Annotated[
        bool,
        "1 only when the named main colour is also the row's answer (the goal): the chain held",
    ] = False,
) -> list[float]:
    """1 when the response names the image's main colour: a reader's reward, whose truth is
    the pixels, not a goal it cannot see (a picture of background only has no right answer).
    With ``goal``, 1 only when that colour is also the row's goal: unlike ``exact_match``
    against the goal, a reader of a picture that misses its goal is not paid for a guess."""
    names, pal = _palette(colours)
    out = []
    for s in samples:
        main = main_colour(first_image(s), names, pal)
        wanted = names[_target(s, names)] if goal else main  # a row without a goal fails here
        out.append(float(normalize_answer(extract_answer(s.response)) == main == wanted))
    return out


# -------------------------------------------------------------------------- video colour


def frames_of(sample: Sample) -> list[Tensor]:
    if not sample.images or len(sample.images) < 2:
        raise ValueError(
            f"row {sample.index} has {len(sample.images or [])} frame(s): a video reward needs "
            "the text_to_video workflow (engine.args.frames >= 2)"
        )
    return [image_tensor(im) for im in sample.images]


def _targets(sample: Sample, names: list[str]) -> tuple[int, int]:
    """The two colours (palette indices) a video row asks for: its answer, else its prompt."""
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


@register_reward("video_colour", batched=True)
def video_colour(samples: list[Sample], colours: _COLOURS = None) -> list[float]:
    """Mean over frames of the share of pixels nearest to the colour that frame should show
    (the first named colour in the first half, the second in the second half)."""
    names, pal = _palette(colours)
    out = []
    for s in samples:
        frames, ab = frames_of(s), _targets(s, names)
        scores = [
            float((nearest_colour(fr, pal) == ab[t]).float().mean())
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
            counts = torch.bincount(nearest_colour(fr, pal).flatten(), minlength=len(pal))[:-1]
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


# ---------------------------------------------------------------------- open_clip models


def _open_clip(model: str, pretrained: str | None, device: torch.device):
    import open_clip

    def build():
        net, _, preprocess = open_clip.create_model_and_transforms(
            model, pretrained=pretrained or None, device=device
        )
        return net.eval().requires_grad_(False), preprocess, open_clip.get_tokenizer(model)

    return cached(("open_clip", model, pretrained, str(device)), build)


def _check_open_clip(reward: str, model: str, pretrained: str | None) -> None:
    if model.startswith("local-dir:"):
        check_path(reward, "model", model)
    check_path(reward, "pretrained", pretrained)


@torch.no_grad()
def _clip_features(
    net,
    preprocess,
    tokenizer,
    samples: list[Sample],
    device: torch.device,
    prompts: list[str] | None = None,
) -> tuple[Tensor, Tensor]:
    images = torch.stack([preprocess(to_pil(first_image(s))) for s in samples]).to(device)
    text = tokenizer(prompts if prompts is not None else [s.prompt for s in samples]).to(device)
    img = net.encode_image(images).float()
    txt = net.encode_text(text).float()
    return (torch.nn.functional.normalize(img, dim=-1), torch.nn.functional.normalize(txt, dim=-1))


def _clip_cosine(loaded: tuple, samples: list[Sample], device: torch.device) -> Tensor:
    """cosine(image, prompt) of each sample with an open_clip ``(net, preprocess, tokenizer)``."""
    img, txt = _clip_features(*loaded, samples, device)
    return (img * txt).sum(-1)


def _prepare_clip(*, model: str, pretrained: str | None, device: str | None, scale: float) -> None:
    _check_open_clip("t2i_clip_score", model, pretrained)
    _open_clip(model, pretrained, _device(device))


@register_reward("t2i_clip_score", batched=True)
@with_prepare(_prepare_clip)
def clip_score(
    samples: list[Sample],
    model: Annotated[
        str, "open_clip model name, or local-dir:/path (open_clip_config.json + weights)"
    ] = "ViT-B-32",
    pretrained: Annotated[str | None, "open_clip checkpoint path or pretrained tag"] = None,
    device: _DEVICE = None,
    scale: Annotated[float, "the score is scale x cosine"] = 1.0,
) -> list[float]:
    """scale x cosine(CLIP image embedding, CLIP prompt embedding) via open_clip.

    ``model``: an open_clip model name (``ViT-B-32``) or ``local-dir:/path`` (a folder with
    ``open_clip_config.json`` + weights); ``pretrained``: a checkpoint path or tag.
    """
    dev = _device(device)
    return (scale * _clip_cosine(_open_clip(model, pretrained, dev), samples, dev)).cpu().tolist()


def _load_hps(model: str, checkpoint: str, device: torch.device):
    import open_clip

    def build():
        net, _, preprocess = open_clip.create_model_and_transforms(
            model, pretrained=None, device=device
        )
        state = torch.load(Path(checkpoint).expanduser(), map_location=device, weights_only=True)
        state = state.get("state_dict", state) if isinstance(state, dict) else state
        net.load_state_dict(state)
        return net.eval().requires_grad_(False), preprocess, open_clip.get_tokenizer(model)

    return cached(("hps", model, checkpoint, str(device)), build)


def _prepare_hps(*, checkpoint: str | None, model: str, device: str | None) -> None:
    check_path("hpsv2", "checkpoint", checkpoint, required=True)
    _load_hps(model, checkpoint, _device(device))


@register_reward("hpsv2", batched=True)
@with_prepare(_prepare_hps)
def hpsv2(
    samples: list[Sample],
    checkpoint: Annotated[
        str | None, "path of the HPS checkpoint (e.g. HPS_v2_compressed.pt); required"
    ] = None,
    model: Annotated[str, "open_clip model the checkpoint is loaded over"] = "ViT-H-14",
    device: _DEVICE = None,
) -> list[float]:
    """HPSv2-style score: cosine of open_clip ``model`` (ViT-H-14) features with the HPS
    checkpoint's weights (``checkpoint``: e.g. HPS_v2_compressed.pt) loaded over it."""
    if checkpoint is None:
        raise ValueError("hpsv2 needs args.checkpoint (path of the HPS checkpoint)")
    dev = _device(device)
    return _clip_cosine(_load_hps(model, checkpoint, dev), samples, dev).cpu().tolist()


# ----------------------------------------------------------------------- aesthetic


def _mlp_from_state(state: dict[str, Tensor]) -> torch.nn.Sequential:
    """The chain of Linear layers in ``state`` (LAION's aesthetic MLP: no activations)."""
    weights = sorted(
        {k.rsplit(".", 1)[0] for k in state if k.endswith(".weight")},
        key=lambda k: [int(p) if p.isdigit() else p for p in k.split(".")],
    )
    layers = []
    for name in weights:
        w = state[f"{name}.weight"]
        lin = torch.nn.Linear(w.shape[1], w.shape[0], bias=f"{name}.bias" in state)
        lin.weight.data.copy_(w)
        if lin.bias is not None:
            lin.bias.data.copy_(state[f"{name}.bias"])
        layers.append(lin)
    if not layers:
        raise ValueError("aesthetic MLP checkpoint holds no Linear weights")
    return torch.nn.Sequential(*layers).eval().requires_grad_(False)


def _load_mlp(path: str, device: torch.device) -> torch.nn.Sequential:
    def build():
        p = Path(path).expanduser()
        if p.suffix == ".safetensors":
            from safetensors.torch import load_file

            state = load_file(str(p))
        else:
            state = torch.load(p, map_location="cpu", weights_only=True)
            state = state.get("state_dict", state)
        return _mlp_from_state(state).to(device)

    return cached(("mlp", path, str(device)), build)


def _prepare_aesthetic(
    *, mlp: str | None, clip_model: str, clip_pretrained: str | None, device: str | None
) -> None:
    check_path("aesthetic", "mlp", mlp, required=True)
    _check_open_clip("aesthetic", clip_model, clip_pretrained)
    dev = _device(device)
    _open_clip(clip_model, clip_pretrained, dev)
    _load_mlp(mlp, dev)


@register_reward("aesthetic", batched=True)
@with_prepare(_prepare_aesthetic)
def aesthetic(
    samples: list[Sample],
    mlp: Annotated[
        str | None, "path of the MLP head's weights (LAION predictor layout); required"
    ] = None,
    clip_model: Annotated[str, "open_clip model whose image embedding the MLP reads"] = "ViT-L-14",
    clip_pretrained: Annotated[str | None, "open_clip checkpoint path or tag"] = "openai",
    device: _DEVICE = None,
) -> list[float]:
    """LAION-style aesthetic score: an MLP (weights from ``mlp``) on the normalised CLIP-L
    image embedding."""
    if mlp is None:
        raise ValueError("aesthetic needs args.mlp (path of the MLP weights)")
    dev = _device(device)
    net, preprocess, _ = _open_clip(clip_model, clip_pretrained, dev)
    head = _load_mlp(mlp, dev)
    with torch.no_grad():
        images = torch.stack([preprocess(to_pil(first_image(s))) for s in samples]).to(dev)
        emb = torch.nn.functional.normalize(net.encode_image(images).float(), dim=-1)
        return head(emb).squeeze(-1).cpu().tolist()


# ----------------------------------------------------------------------- PickScore


@functools.cache
def _hf_clip_loader():
    from transformers import AutoProcessor, CLIPModel

    return AutoProcessor, CLIPModel


def _load_pickscore(model: str, processor: str, device: torch.device):
    def build():
        proc_cls, model_cls = _hf_clip_loader()
        return (
            model_cls.from_pretrained(model).to(device).eval().requires_grad_(False),
            proc_cls.from_pretrained(processor),
        )

    return cached(("pickscore", model, processor, str(device)), build)


def _prepare_pickscore(
    *, model: str, processor: str, device: str | None, scale: float | None
) -> None:
    check_path("pickscore", "model", model)
    check_path("pickscore", "processor", processor)
    _load_pickscore(model, processor, _device(device))


@register_reward("pickscore", batched=True)
@with_prepare(_prepare_pickscore)
def pickscore(
    samples: list[Sample],
    model: Annotated[
        str, "transformers CLIPModel: local folder or hub id"
    ] = "yuvalkirstain/PickScore_v1",
    processor: Annotated[
        str, "its processor: local folder or hub id"
    ] = "laion/CLIP-ViT-H-14-laion2B-s32B-b79K",
    device: _DEVICE = None,
    scale: Annotated[
        float | None, "the score is scale x cosine (null: the model's logit scale)"
    ] = None,
) -> list[float]:
    """PickScore: a CLIP-H (``transformers`` CLIPModel) preference model; score =
    logit_scale x cosine(image, prompt), or ``scale`` x cosine when ``scale`` is given."""
    dev = _device(device)
    net, proc = _load_pickscore(model, processor, dev)
    with torch.no_grad():
        inputs = proc(
            images=[to_pil(first_image(s)) for s in samples],
            text=[s.prompt for s in samples],
            padding=True,
            truncation=True,
            return_tensors="pt",
        ).to(dev)
        img = net.get_image_features(pixel_values=inputs["pixel_values"])
        txt = net.get_text_features(
            input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"]
        )
        img = getattr(img, "pooler_output", img)
        txt = getattr(txt, "pooler_output", txt)
        cos = (
            torch.nn.functional.normalize(img.float(), dim=-1)
            * torch.nn.functional.normalize(txt.float(), dim=-1)
        ).sum(-1)
        factor = net.logit_scale.exp().float() if scale is None else torch.tensor(float(scale))
        return (factor * cos).cpu().tolist()


def prepare_rewards(terms) -> None:
    """Run each term's ``prepare`` (path checks, model loading) before any sampling."""
    from polyrl.core.rollout.rewards import resolve

    for term in terms:
        prep = getattr(resolve(term.name), "prepare", None)
        if prep is not None:
            prep(**term.args)
