"""Image-aware rewards: IoU under each box convention, CLIP score, combining with weights."""

from __future__ import annotations

import json

import pytest
import torch
from PIL import Image

from polyrl.core.record import text_record
from polyrl.core.rollout.rewards import RewardConfig, Sample, score
from polyrl.multimodal.rewards import clip_score, grounding_iou, iou, parse_box, to_fractions

# a 200x100 source image the model saw resized to 112x56
META = {"image_sizes": [(200, 100)], "resized_sizes": [(112, 56)]}


def sample(response: str, answer, **meta) -> Sample:
    return Sample(prompt="", response=response, answer=answer, meta={**META, **meta})


def test_iou_by_hand():
    assert iou((0, 0, 2, 2), (1, 1, 3, 3)) == pytest.approx(1 / 7)
    assert iou((0, 0, 1, 1), (2, 2, 3, 3)) == 0.0
    assert iou((0, 0, 4, 2), (0, 0, 4, 2)) == 1.0
    assert iou((0, 0, 0, 0), (0, 0, 0, 0)) == 0.0


@pytest.mark.parametrize(
    ("convention", "box", "fractions"),
    [
        ("qwen2.5", (28, 0, 84, 28), (0.25, 0.0, 0.75, 0.5)),  # resized pixels
        ("resized_pixels", (28, 0, 84, 28), (0.25, 0.0, 0.75, 0.5)),
        ("qwen2", (250, 0, 750, 500), (0.25, 0.0, 0.75, 0.5)),  # 0-1000
        ("qwen3", (250, 0, 750, 500), (0.25, 0.0, 0.75, 0.5)),
        ("source_pixels", (50, 0, 150, 50), (0.25, 0.0, 0.75, 0.5)),
        ("normalized", (0.25, 0.0, 0.75, 0.5), (0.25, 0.0, 0.75, 0.5)),
    ],
)
def test_each_convention_maps_to_the_same_fractions(convention, box, fractions):
    assert to_fractions(box, convention, (200, 100), (112, 56)) == pytest.approx(fractions)


def test_grounding_iou_under_each_convention():
    # ground truth: the left half-height quarter, written in source pixels
    gold = [0, 0, 100, 50]  # -> fractions (0, 0, 0.5, 0.5)
    # Qwen2.5-VL writes resized pixels: [28,0,84,28] -> (0.25,0,0.75,0.5): IoU 1/3 by hand
    s = sample("<answer>[28,0,84,28]</answer>", gold)
    assert grounding_iou(s, "qwen2.5", "source_pixels") == pytest.approx(1 / 3)
    # the same box read as 0-1000 (Qwen2-VL) is tiny: (0.028, 0, 0.084, 0.028)
    tiny = (0.056 * 0.028) / (0.5 * 0.5)  # inside gold: IoU = its area / gold area
    assert grounding_iou(s, "qwen2", "source_pixels") == pytest.approx(tiny)
    # Qwen2-VL / Qwen3-VL box on the 0-1000 grid
    assert grounding_iou(sample("[0,0,500,500]", gold), "qwen3", "source_pixels") == 1.0
    assert grounding_iou(
        sample("(250,0),(750,500)", gold), "qwen2", "source_pixels"
    ) == pytest.approx(1 / 3)
    # answer in the model's own convention (the default), and from a row field
    assert grounding_iou(sample("[0,0,56,28]", "[0,0,56,28]"), "qwen2.5") == 1.0
    row_meta = {"row": {"bbox": [0, 0, 0.5, 0.5]}}
    assert (
        grounding_iou(
            sample("[0,0,56,28]", None, **row_meta), "qwen2.5", "normalized", answer_field="bbox"
        )
        == 1.0
    )


def test_grounding_iou_failures_and_malformed_boxes():
    assert grounding_iou(sample("no box here", [0, 0, 1, 1]), "qwen2") == 0.0
    assert grounding_iou(sample("[88,,,8,8,,88", [0, 0, 1, 1]), "qwen2") == 0.0
    assert parse_box("[[1,2],[3,4]]") == (1, 2, 3, 4)
    assert parse_box("[3,4,1,2]") == (1, 2, 3, 4)
    with pytest.raises(ValueError, match="resized image size"):
        grounding_iou(Sample("", "[1,2,3,4]", "[1,2,3,4]", {}), "qwen2.5")
    with pytest.raises(ValueError, match="unknown box convention"):
        grounding_iou(sample("[1,2,3,4]", "[1,2,3,4]"), "qwen4")


def test_rewards_combine_with_weights():
    """IoU + the core's <think>/<answer> format reward, weighted, on one record."""
    responses = [
        "<think>left</think><answer>[0,0,56,28]</answer>",
        "[0,0,56,28]",
        "<think>x</think><answer>nothing</answer>",
    ]
    td = text_record(
        prompt_ids=[[1]] * 3,
        response_ids=[[2]] * 3,
        rollout_logprobs=[[0.0]] * 3,
        policy=["main"] * 3,
        uid=[0, 0, 0],
        pad_id=0,
        response_text=responses,
        meta=[{"answer": [0, 0, 100, 50], **META} for _ in responses],
    )
    cfg = RewardConfig(
        terms=[
            {
                "name": "grounding_iou",
                "args": {"pred_convention": "qwen2.5", "answer_convention": "source_pixels"},
            },
            {"name": "regex_format", "weight": 0.5},
        ]
    )
    cfg.validate()
    metrics = score(td, cfg)
    assert td["reward"].tolist() == pytest.approx([1.5, 1.0, 0.5])
    assert metrics["reward/errors"] == 0.0


# --------------------------------------------------------------------------- CLIP

COLOURS = {
    "red": (220, 30, 30),
    "green": (30, 170, 50),
    "blue": (35, 70, 230),
    "yellow": (250, 225, 20),
}


def _square(colour, seed: int) -> Image.Image:
    g = torch.Generator().manual_seed(seed)
    img = Image.new("RGB", (32, 32), (245, 245, 245))
    x, y = (int(v) for v in torch.randint(0, 12, (2,), generator=g))
    img.paste(Image.new("RGB", (20, 20), COLOURS[colour]), (x, y))
    return img


@pytest.fixture(scope="module")
def tiny_clip(tmp_path_factory):
    """A tiny open_clip CLIP whose towers were trained (contrastively, a few seconds) to
    agree on 'a <colour> square' captions: an honest stand-in for a pretrained CLIP."""
    open_clip = pytest.importorskip("open_clip")
    root = tmp_path_factory.mktemp("clip")
    name = "polyrl-tiny-clip-test"
    (root / f"{name}.json").write_text(
        json.dumps(
            {
                "embed_dim": 32,
                "vision_cfg": {
                    "image_size": 32,
                    "layers": 1,
                    "width": 32,
                    "patch_size": 8,
                    "head_width": 16,
                },
                "text_cfg": {
                    "context_length": 16,
                    "vocab_size": 49408,
                    "width": 32,
                    "heads": 2,
                    "layers": 1,
                },
            }
        )
    )
    open_clip.add_model_config(root / f"{name}.json")
    torch.manual_seed(0)
    model, _, preprocess = open_clip.create_model_and_transforms(name)
    tokenizer = open_clip.get_tokenizer(name)
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    names = list(COLOURS)
    texts = tokenizer([f"a {c} square" for c in names])
    with torch.random.fork_rng():
        for step in range(80):
            images = torch.stack(
                [preprocess(_square(c, 1000 * step + k)) for k, c in enumerate(names)]
            )
            img_f = torch.nn.functional.normalize(model.encode_image(images), dim=-1)
            txt_f = torch.nn.functional.normalize(model.encode_text(texts), dim=-1)
            logits = model.logit_scale.exp() * img_f @ txt_f.T
            target = torch.arange(len(names))
            loss = (
                torch.nn.functional.cross_entropy(logits, target)
                + torch.nn.functional.cross_entropy(logits.T, target)
            ) / 2
            opt.zero_grad()
            loss.backward()
            opt.step()
    path = root / "tiny_clip.pt"
    torch.save(model.state_dict(), path)
    return name, str(path)


def test_clip_score_ranks_the_matching_caption_first(tiny_clip, one_thread):
    name, ckpt = tiny_clip
    samples = []
    for k, colour in enumerate(COLOURS):
        img = _square(colour, 10_000 + k)  # held-out positions
        for caption in COLOURS:
            samples.append(
                Sample(
                    prompt="",
                    response=f"<answer>{caption}</answer>",
                    answer=colour,
                    meta={},
                    images=[img],
                    index=len(samples),
                )
            )
    scores = clip_score(samples, model=name, pretrained=ckpt, template="a {} square")
    n = len(COLOURS)
    for k, colour in enumerate(COLOURS):
        row = scores[k * n : (k + 1) * n]
        assert max(range(n), key=row.__getitem__) == k, (colour, row)
    # the ground-truth caption scores the same as a matching response
    by_answer = clip_score(
        samples[:1], model=name, pretrained=ckpt, text="answer", template="a {} square"
    )
    assert by_answer[0] == pytest.approx(scores[0], abs=1e-5)


def test_clip_score_through_the_reward_config(tiny_clip):
    name, ckpt = tiny_clip
    img = _square("blue", 5)
    td = text_record(
        prompt_ids=[[1]] * 2,
        response_ids=[[2]] * 2,
        rollout_logprobs=[[0.0]] * 2,
        policy=["main"] * 2,
        uid=[0, 0],
        pad_id=0,
        response_text=["blue", "red"],
        meta=[{"answer": "blue", "images": [img]}] * 2,
    )
    cfg = RewardConfig(
        terms=[
            {
                "name": "clip_score",
                "weight": 2.0,
                "args": {"model": name, "pretrained": ckpt, "template": "a {} square"},
            }
        ]
    )
    cfg.validate()
    score(td, cfg)
    assert td["reward"][0] > td["reward"][1]
    assert bool(td["valid"].all())


@pytest.mark.ray
def test_clip_score_on_its_own_ray_actor_scores_like_the_driver(
    tiny_clip, ray_cluster, tiny_model_dir
):
    """``reward.terms[].actor``: the CLIP term runs in another process, which learns the
    tiny architecture from its config file (``model: <name>.json``), not from this one."""
    import os
    from pathlib import Path

    from polyrl.core.config import load
    from polyrl.core.distributed.ray_backend import RayBackend
    from polyrl.core.recipe import Config

    name, ckpt = tiny_clip
    config = Path(ckpt).parent / f"{name}.json"
    term = (
        f"{{name: clip_score, actor: {{num_cpus: 0.5}}, args: {{model: '{config}', "
        f"pretrained: '{ckpt}', template: 'a {{}} square'}}}}"
    )
    cfg = load(
        Config,
        None,
        [
            f"policies.main.model={tiny_model_dir}",
            "distributed.backend=ray",
            "distributed.args={workers_per_policy: 1}",
            f"reward.terms=[{term}]",
        ],
    )
    images = [_square(c, 20 + k) for k, c in enumerate(COLOURS)]
    td = text_record(
        prompt_ids=[[1]] * 8,
        response_ids=[[2]] * 8,
        rollout_logprobs=[[0.0]] * 8,
        policy=["main"] * 8,
        uid=[k // 2 for k in range(8)],
        pad_id=0,
        response_text=[c for c in COLOURS for _ in range(2)][::-1],
        meta=[{"images": [images[k // 2]]} for k in range(8)],
    )
    backend = RayBackend(cfg)
    try:
        runners = backend.reward_runners(cfg.reward)
        assert list(runners) == ["clip_score"]
        remote, local = td.clone(), td.clone()
        metrics = score(remote, cfg.reward, runners=runners)
        want = score(local, cfg.reward)
        torch.testing.assert_close(
            remote["reward_terms/clip_score"],
            local["reward_terms/clip_score"],
            atol=1e-5,
            rtol=1e-5,
        )
        assert metrics.keys() == want.keys()
        assert bool(remote["valid"].all()) and remote["reward_terms/clip_score"].std() > 0.01
        assert ray_cluster.get(backend.reward_actors[0].pid.remote()) != os.getpid()
    finally:
        backend.shutdown()
