"""Image rewards on tiny offline reward models; bad names and paths fail early."""

from __future__ import annotations

import json

import pytest
import torch

from polyrl.core.config import ConfigError, load
from polyrl.core.recipe import Config
from polyrl.core.rollout.rewards import RewardTerm, Sample
from polyrl.diffusion import rewards as R
from polyrl.diffusion.colour import BACKGROUND, PALETTE

TINY_CLIP = {
    "embed_dim": 16,
    "vision_cfg": {"image_size": 32, "layers": 1, "width": 32, "patch_size": 16, "head_width": 16},
    "text_cfg": {"context_length": 77, "vocab_size": 49408, "width": 32, "heads": 2, "layers": 1},
}


def _samples(images, prompts, answers=None):
    answers = answers or [None] * len(images)
    return [
        Sample(prompt=p, response="", answer=a, meta={}, images=[im], index=i)
        for i, (im, p, a) in enumerate(zip(images, prompts, answers, strict=True))
    ]


def _flat(rgb, size=16):
    return torch.tensor(rgb)[:, None, None].expand(3, size, size).clone()


@pytest.fixture(scope="module")
def tiny_clip_dir(tmp_path_factory):
    """A tiny open_clip CLIP saved in open_clip's local-dir format (config + weights)."""
    import open_clip
    from safetensors.torch import save_file

    path = tmp_path_factory.mktemp("clip")
    torch.manual_seed(0)
    model = open_clip.CLIP(**TINY_CLIP)
    (path / "open_clip_config.json").write_text(
        json.dumps(
            {"model_cfg": TINY_CLIP, "preprocess_cfg": {"mean": [0.5] * 3, "std": [0.5] * 3}}
        )
    )
    save_file(
        {k: v.contiguous() for k, v in model.state_dict().items()},
        str(path / "open_clip_model.safetensors"),
    )
    return path


def test_colour_reward_and_accuracy():
    red, blue = _flat(PALETTE["red"]), _flat(PALETTE["blue"])
    half = _flat(BACKGROUND)
    half[:, :8] = torch.tensor(PALETTE["red"])[:, None, None]
    s = _samples(
        [red, blue, half, red],
        ["a red blob", "a red blob", "red", "blue"],
        answers=["red", None, None, None],
    )
    assert R.colour(s) == [1.0, 0.0, 0.5, 0.0]
    assert R.colour_accuracy(s) == [1.0, 0.0, 1.0, 0.0]
    with pytest.raises(ValueError, match="names none of the colours"):
        R.colour(_samples([red], ["a purple blob"]))


def test_colour_named_reads_the_pixels_not_the_answer():
    """The judge's reward: its response against the picture's main colour (a quarter of the
    pixels blue, the rest background, is a blue picture), whatever the row's goal says; with
    ``goal``, only where that colour is also the goal (no pay for guessing a missed goal)."""
    red, background = _flat(PALETTE["red"]), _flat(BACKGROUND)
    quarter = background.clone()
    quarter[:, :4] = torch.tensor(PALETTE["blue"])[:, None, None]
    rows = [  # (picture, the judge's response, the row's goal)
        (red, "red", "red"),
        (red, "blue", "red"),
        (quarter, " blue. ", "green"),
        (quarter, "<answer>blue</answer>", "blue"),
        (background, "red", "red"),
        (red, "green", "green"),  # names the goal, which the picture misses
    ]
    s = [
        Sample(prompt="q", response=said, answer=goal, meta={}, images=[im], index=i)
        for i, (im, said, goal) in enumerate(rows)
    ]
    assert R.colour_named(s) == [1.0, 0.0, 1.0, 1.0, 0.0, 0.0]
    assert R.colour_named(s, goal=True) == [1.0, 0.0, 0.0, 1.0, 0.0, 0.0]
    assert R.colour_accuracy(s) == [1.0, 1.0, 0.0, 1.0, 0.0, 0.0]
    no_goal = [Sample(prompt="q", response="blue", answer=None, meta={}, images=[red], index=0)]
    with pytest.raises(ValueError, match="names none of the colours"):  # wrong answer or not
        R.colour_named(no_goal, goal=True)


def test_colour_reward_accepts_pil_images():
    pil = R.to_pil(_flat(PALETTE["green"]))
    assert R.colour(_samples([pil], ["a green circle"])) == [1.0]


def test_jpeg_rewards():
    flat = _flat((0.5, 0.5, 0.5), 64)
    noisy = torch.rand(3, 64, 64, generator=torch.Generator().manual_seed(0))
    s = _samples([flat, noisy], ["x", "y"])
    comp, incomp = R.jpeg_compressibility(s), R.jpeg_incompressibility(s)
    assert comp == [-v for v in incomp]
    assert incomp[1] > incomp[0] > 0


def test_t2i_clip_score_matches_a_direct_computation(tiny_clip_dir):
    import open_clip

    model = f"local-dir:{tiny_clip_dir}"
    imgs = [torch.rand(3, 16, 16, generator=torch.Generator().manual_seed(i)) for i in range(3)]
    s = _samples(imgs, ["a red blob", "a blue blob", "green"])
    R.clip_score.prepare(model=model)
    got = R.clip_score(s, model=model, scale=2.0)
    net, _, pre = open_clip.create_model_and_transforms(model)
    tok = open_clip.get_tokenizer(model)
    with torch.no_grad():
        f_i = net.encode_image(torch.stack([pre(R.to_pil(im)) for im in imgs]))
        f_t = net.encode_text(tok([x.prompt for x in s]))
    expected = 2.0 * torch.nn.functional.cosine_similarity(f_i, f_t)
    torch.testing.assert_close(torch.tensor(got), expected, rtol=1e-4, atol=1e-5)


def test_hpsv2_loads_the_checkpoint_over_the_architecture(tiny_clip_dir, tmp_path):
    import open_clip

    model = f"local-dir:{tiny_clip_dir}"
    torch.manual_seed(1)
    other = open_clip.CLIP(**TINY_CLIP)
    ckpt = tmp_path / "hps.pt"
    torch.save({"state_dict": other.state_dict()}, ckpt)
    img = torch.rand(3, 16, 16, generator=torch.Generator().manual_seed(0))
    s = _samples([img], ["a red blob"])
    R.hpsv2.prepare(checkpoint=str(ckpt), model=model)
    got = R.hpsv2(s, checkpoint=str(ckpt), model=model)
    _, _, pre = open_clip.create_model_and_transforms(model)
    with torch.no_grad():
        f_i = other.eval().encode_image(pre(R.to_pil(img))[None])
        f_t = other.encode_text(open_clip.get_tokenizer(model)(["a red blob"]))
    torch.testing.assert_close(
        torch.tensor(got), torch.nn.functional.cosine_similarity(f_i, f_t), rtol=1e-4, atol=1e-5
    )


def test_aesthetic_mlp_on_clip_embeddings(tiny_clip_dir, tmp_path):
    import open_clip

    model = f"local-dir:{tiny_clip_dir}"
    torch.manual_seed(0)
    mlp = torch.nn.Sequential(torch.nn.Linear(16, 8), torch.nn.Dropout(0.1), torch.nn.Linear(8, 1))
    path = tmp_path / "mlp.pt"
    torch.save({f"layers.{k}": v for k, v in mlp.state_dict().items()}, path)
    img = torch.rand(3, 16, 16, generator=torch.Generator().manual_seed(0))
    got = R.aesthetic(_samples([img], ["x"]), mlp=str(path), clip_model=model, clip_pretrained=None)
    net, _, pre = open_clip.create_model_and_transforms(model)
    with torch.no_grad():
        emb = torch.nn.functional.normalize(net.encode_image(pre(R.to_pil(img))[None]), dim=-1)
        expected = mlp.eval()(emb).squeeze(-1)
    torch.testing.assert_close(torch.tensor(got), expected, rtol=1e-4, atol=1e-5)


def test_pickscore_with_a_tiny_transformers_clip(tmp_path):
    from transformers import (
        CLIPConfig,
        CLIPImageProcessor,
        CLIPModel,
        CLIPProcessor,
        CLIPTextConfig,
        CLIPVisionConfig,
    )

    from polyrl.diffusion.tiny_parts import build_clip_tokenizer

    tok = build_clip_tokenizer(["a red blob", "a blue blob"], max_length=8)
    cfg = CLIPConfig(
        text_config=CLIPTextConfig(
            vocab_size=len(tok),
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=1,
            num_attention_heads=2,
            max_position_embeddings=8,
            bos_token_id=0,
            eos_token_id=1,
            pad_token_id=1,
        ),
        vision_config=CLIPVisionConfig(
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=1,
            num_attention_heads=2,
            image_size=32,
            patch_size=16,
        ),
        projection_dim=8,
    )
    torch.manual_seed(0)
    CLIPModel(cfg).save_pretrained(tmp_path / "model")
    proc = CLIPProcessor(
        image_processor=CLIPImageProcessor(
            size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32}
        ),
        tokenizer=tok,
    )
    proc.save_pretrained(tmp_path / "proc")
    img = torch.rand(3, 16, 16, generator=torch.Generator().manual_seed(0))
    s = _samples([img, img], ["a red blob", "a blue blob"])
    args = {"model": str(tmp_path / "model"), "processor": str(tmp_path / "proc")}
    R.pickscore.prepare(**args)
    got = torch.tensor(R.pickscore(s, **args))
    assert got.shape == (2,) and torch.isfinite(got).all() and got[0] != got[1]
    scaled = torch.tensor(R.pickscore(s, scale=1.0, **args))
    net = CLIPModel.from_pretrained(tmp_path / "model")
    torch.testing.assert_close(got, scaled * net.logit_scale.exp(), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize(
    "name,args,match",
    [
        ("t2i_clip_score", {"pretrained": "/nonexistent/clip.bin"}, "args.pretrained"),
        ("aesthetic", {"mlp": "/nonexistent/mlp.pth", "clip_pretrained": None}, "args.mlp"),
        ("hpsv2", {"checkpoint": "~/nope/HPS_v2_compressed.pt"}, "args.checkpoint"),
        ("pickscore", {"model": "./missing-pickscore"}, "args.model"),
    ],
)
def test_missing_reward_model_path_fails_in_prepare(name, args, match):
    with pytest.raises(FileNotFoundError, match=match):
        R.prepare_rewards([RewardTerm(name, args=args)])


def test_reward_model_args_are_required():
    with pytest.raises(ValueError, match="args.checkpoint"):
        R.prepare_rewards([RewardTerm("hpsv2")])


def test_unknown_reward_name_fails_at_config_time_naming_the_nearest():
    import polyrl.diffusion  # noqa: F401

    with pytest.raises(
        (ConfigError, KeyError, ValueError), match="did you mean 'jpeg_compressibility'"
    ):
        load(Config, None, ["policies.main.model=x", "reward.terms=[{name: jpeg_compresibility}]"])
