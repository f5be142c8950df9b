"""The synthetic shapes task, the tiny model builder's registration, and the VL recipes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from PIL import Image

import polyrl.multimodal  # noqa: F401  (registers the parts)
from polyrl.core.config import load
from polyrl.core.recipe import Config
from polyrl.core.registry import DATASETS, ENGINES, MODELS, POLICIES, REWARDS, TASKS, WORKFLOWS
from polyrl.multimodal import shapes

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def test_parts_are_registered():
    assert TASKS.get("vl_shapes") is shapes
    for registry, name in (
        (MODELS, "tiny_qwen2_5_vl"),
        (DATASETS, "vl"),
        (POLICIES, "qwen_vl"),
        (ENGINES, "hf_vl"),
        (WORKFLOWS, "vl_single_turn"),
        (REWARDS, "grounding_iou"),
        (REWARDS, "clip_score"),
    ):
        assert name in registry.names()


@pytest.mark.parametrize("question", ["colour", "count", "ground"])
def test_answers_match_the_pictures(tmp_path, question):
    train, evals = shapes.write_dataset(
        tmp_path, n_train=20, n_eval=5, seed=3, question=question, size=112, distractors=1
    )
    rows = [json.loads(line) for line in train.read_text().splitlines()]
    assert len(rows) == 20 and all(r["question"] == question for r in rows)
    for r in rows:
        assert r["prompt"].startswith("<image>") and len(r["images"]) == 1
        img = Image.open(tmp_path / r["images"][0]).convert("RGB")
        assert img.size == (112, 112)
        if question == "count":
            assert 1 <= int(r["answer"]) <= 4
            continue
        x1, y1, x2, y2 = r["box"]
        centre = img.getpixel(((x1 + x2) // 2, (y1 + y2) // 2))
        if question == "colour":
            assert centre == shapes.COLOURS[r["answer"]]
        else:
            assert json.loads(r["answer"]) == r["box"]  # qwen2.5: absolute pixels
    # held-out images differ from the training ones; writing again gives the same data
    assert (tmp_path / "images" / "eval" / "000000.png").is_file()
    again, _ = shapes.write_dataset(
        tmp_path / "again", n_train=20, n_eval=5, seed=3, question=question, size=112, distractors=1
    )
    assert again.read_text() == train.read_text()


def test_box_conventions_and_format_targets(tmp_path):
    rows = shapes.make_rows(
        30, 0, tmp_path, "train", question="ground", size=56, box_convention="qwen2"
    )
    for r in rows:
        box = json.loads(r["answer"])
        assert box == [round(c * 1000 / 56) for c in r["box"]]
        assert r["sft_response"].startswith("[")
    colour = shapes.make_rows(200, 0, tmp_path, "c", question="colour")
    agree = sum(r["sft_response"] == r["answer"] for r in colour) / len(colour)
    assert 0.1 < agree < 0.45  # format targets are random colours: chance agreement
    sft = shapes.sft_rows(colour[:3])
    assert set(sft[0]) == {"prompt", "images", "response"}
    with pytest.raises(ValueError, match="multiple of 28"):
        shapes.make_rows(1, 0, tmp_path, "x", size=50)


def test_gradient_background_and_cells(tmp_path):
    rows = shapes.make_rows(
        8, 0, tmp_path, "g", question="ground", size=112, cells=4, background="gradient"
    )
    for r in rows:
        x1, y1, x2, y2 = r["box"]
        assert x2 - x1 == 20 and x1 % 28 == 4 and y1 % 28 == 4
    img = Image.open(tmp_path / rows[0]["images"][0])
    assert img.getpixel((0, 0)) != img.getpixel((111, 111))


def test_outlined_square_shows_the_background_inside(tmp_path):
    """outline=k: the square's border is k pixels of its colour; its middle is background."""
    filled, framed = (
        shapes.make_rows(
            4,
            0,
            tmp_path / name,
            "g",
            question="ground",
            size=112,
            cells=2,
            background="gradient",
            outline=k,
        )
        for name, k in (("f", 0), ("o", 6))
    )
    for a, b in zip(filled, framed, strict=True):
        assert a["box"] == b["box"] and a["answer"] == b["answer"]
        x1, y1, x2, y2 = b["box"]
        full = Image.open(tmp_path / "f" / a["images"][0]).convert("RGB")
        ring = Image.open(tmp_path / "o" / b["images"][0]).convert("RGB")
        colour = shapes.COLOURS[a["prompt"].split()[-2]]
        centre = ((x1 + x2) // 2, (y1 + y2) // 2)
        assert full.getpixel(centre) == colour != ring.getpixel(centre)
        assert ring.getpixel((x1 + 2, centre[1])) == colour  # inside the 6-pixel border
        assert ring.getpixel((x1 + 8, centre[1])) != colour  # past it: the gradient
    with pytest.raises(ValueError, match="outline"):
        shapes.make_rows(1, 0, tmp_path, "x", question="ground", outline=-1)


@pytest.mark.parametrize("recipe", sorted(EXAMPLES.glob("*vl*.yaml")), ids=lambda p: p.name)
def test_vl_recipes_load_and_validate(recipe):
    cfg = load(Config, recipe, [])  # validates: options, engines, workflow checks
    vl = [p for p in cfg.policies.values() if p.kind == "qwen_vl"]
    # a team may add text agents; a VL policy samples on a VL engine
    assert vl and all(p.engine.name in ("hf_vl", "vllm_vl") for p in vl)
    if cfg.rollout.workflow == "vl_single_turn":
        assert cfg.data.kind == "vl" and len(vl) == len(cfg.policies)


def test_vl_workflow_checks_its_engine_at_config_time():
    from polyrl.core.config import ConfigError

    with pytest.raises(ConfigError, match="engine.name='hf'.*hf_vl"):
        load(Config, EXAMPLES / "vl_shapes_grpo.yaml", ["policies.main.engine.name=hf"])
    for engine in ("hf_vl", "vllm_vl"):  # both run on a Ray engine actor too
        cfg = load(
            Config,
            EXAMPLES / "vl_shapes_grpo.yaml",
            ["distributed.backend=ray", f"policies.main.engine.name={engine}"],
        )
        assert cfg.policies["main"].engine.name == engine
