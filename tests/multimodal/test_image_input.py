"""Image input a user can give a VL dataset that used to pass silently or fail late: a
truncated JPEG (found when the data loads, naming row and file; through the CLI, exit 2
before any model loads), 16-bit grey PNGs (scaled to 8 bits, not all white) and EXIF
orientation (turned as viewers show it). Images are made here with PIL."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import numpy as np
import pytest
import yaml
from PIL import Image

from polyrl.core.rollout.data import DataConfig, DataError
from polyrl.multimodal import vision
from polyrl.multimodal.data import VLDataset
from polyrl.multimodal.images import ImageRef, decode, probe

ARGS = {"min_pixels": 56 * 56, "max_pixels": 112 * 112}
PROMPT = "<image>What colour is the square?"


@pytest.fixture
def policy(make_policy):
    return make_policy()


def _rows(tmp_path: Path, images: list[str]) -> str:
    path = tmp_path / "data.jsonl"
    path.write_text(
        "".join(
            json.dumps({"prompt": PROMPT, "images": [i], "answer": "red"}) + "\n" for i in images
        )
    )
    return str(path)


def _load(tmp_path, policy, images: list[str]) -> VLDataset:
    cfg = DataConfig(kind="vl", path=_rows(tmp_path, images), args=ARGS)
    return VLDataset(cfg, policy.tokenizer, name="train")


def _cut_jpeg(tmp_path: Path) -> Path:
    """A 112x112 noise JPEG cut to two thirds: its header is intact, its data is not."""
    (tmp_path / "img").mkdir(exist_ok=True)
    path = tmp_path / "img" / "cut.jpg"
    Image.effect_noise((112, 112), 64).convert("RGB").save(path, quality=90)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) * 2 // 3])
    return path


def _whole_png(tmp_path: Path, name: str = "ok.png") -> Path:
    (tmp_path / "img").mkdir(exist_ok=True)
    path = tmp_path / "img" / name
    Image.new("RGB", (56, 56), (200, 30, 30)).save(path)
    return path


def test_a_truncated_jpeg_stops_the_cli_at_load_naming_row_and_file(tiny_vl_dir, tmp_path, capsys):
    from polyrl.core.runner.cli import main

    _whole_png(tmp_path)
    cut = _cut_jpeg(tmp_path)
    data = _rows(tmp_path, ["img/ok.png", "img/ok.png", "img/cut.jpg"])
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(
        yaml.safe_dump(
            {
                "run": {"dir": str(tmp_path / "run"), "progress": False},
                "policies": {
                    "main": {"kind": "qwen_vl", "model": tiny_vl_dir, "engine": {"name": "hf_vl"}}
                },
                "data": {"kind": "vl", "path": data, "args": ARGS, "max_prompt_tokens": 64},
                "rollout": {"workflow": "vl_single_turn", "n": 2, "prompts_per_step": 2},
                "train": {"steps": 1},
            }
        )
    )
    assert main(["train", str(recipe)]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert f"line 3, image 0 ({cut})" in err and "truncated or corrupt" in err


def test_whole_images_pass_the_load_check(tmp_path, policy):
    """A complete JPEG and PNG pass (from their end markers) and process as usual."""
    (tmp_path / "img").mkdir()
    Image.effect_noise((112, 112), 64).convert("RGB").save(tmp_path / "img" / "a.jpg")
    _whole_png(tmp_path)
    ds = _load(tmp_path, policy, ["img/a.jpg", "img/ok.png"])
    assert len(ds) == 2 and ds.stats["skipped_bad_image"] == 0
    _, images = vision.process(ds[1].vision, policy.processor.image_processor)
    assert images[0].getpixel((5, 5)) == (200, 30, 30)


def test_a_jpeg_with_bytes_after_its_end_marker_is_decoded_to_be_sure(tmp_path, policy):
    """Trailing bytes (a camera's trailer) hide the end marker: the image is decoded once,
    found whole, and loads."""
    (tmp_path / "img").mkdir()
    path = tmp_path / "img" / "trailer.jpg"
    Image.effect_noise((112, 112), 64).convert("RGB").save(path)
    path.write_bytes(path.read_bytes() + b"CAMERA-TRAILER-0123456789")
    assert len(_load(tmp_path, policy, ["img/trailer.jpg"])) == 1
    _cut_jpeg(tmp_path)
    with pytest.raises(DataError, match=r"line 2, image 0 .*cut\.jpg.*truncated or corrupt"):
        _load(tmp_path, policy, ["img/trailer.jpg", "img/cut.jpg"])


def test_16_bit_grey_is_scaled_to_8_bits_and_logged(tmp_path, policy, caplog):
    """A 16-bit grey ramp keeps its shades (value * 255 / 65535, computed here with numpy),
    where a plain conversion clips everything above 255 to white."""
    ramp = np.linspace(0, 65535, 56 * 56).round().astype(np.uint16).reshape(56, 56)
    (tmp_path / "img").mkdir()
    Image.fromarray(ramp).save(tmp_path / "img" / "deep.png")
    assert Image.open(tmp_path / "img" / "deep.png").mode.startswith("I;16")  # as PIL reads it
    with caplog.at_level(logging.WARNING, logger="polyrl.multimodal.data"):
        ds = _load(tmp_path, policy, ["img/deep.png"])
    assert ds.stats["scaled_16bit"] == 1
    assert any("16-bit grey: scaled to 8 bits" in r.getMessage() for r in caplog.records)
    rgb = np.asarray(decode(ds[0].vision.refs[0]))
    want = np.round(ramp.astype(np.float64) * 255 / 65535).astype(np.uint8)
    assert rgb.shape == (56, 56, 3)
    for c in range(3):
        assert np.abs(rgb[..., c].astype(int) - want.astype(int)).max() <= 1
    assert (rgb == 255).mean() < 0.01  # not all white


def test_exif_orientation_is_applied_as_viewers_do_and_logged(tmp_path, policy, caplog):
    """A 112x56 image stored with orientation 6 (viewers turn it 90 degrees clockwise) is
    56 wide and 112 high for the model: its token count and its pixels both say so."""
    stored = np.zeros((56, 112, 3), np.uint8)  # 56 high, 112 wide
    stored[:, :56] = (200, 30, 30)  # left half red, right half blue
    stored[:, 56:] = (30, 30, 200)
    img = Image.fromarray(stored)
    exif = img.getexif()
    exif[0x0112] = 6
    (tmp_path / "img").mkdir()
    img.save(tmp_path / "img" / "turned.jpg", exif=exif.tobytes(), quality=95)
    ref = ImageRef("path", str(tmp_path / "img" / "turned.jpg"), "row 1", "turned.jpg")
    header = probe(ref)
    assert (header.width, header.height, header.orientation) == (56, 112, 6)
    pixels = np.asarray(decode(ref)).astype(int)
    assert pixels.shape == (112, 56, 3)
    # turned clockwise, the stored left (red) half is now on top, the right (blue) below
    assert np.abs(pixels[20, 28] - (200, 30, 30)).max() < 40
    assert np.abs(pixels[90, 28] - (30, 30, 200)).max() < 40
    with caplog.at_level(logging.WARNING, logger="polyrl.multimodal.data"):
        ds = _load(tmp_path, policy, ["img/turned.jpg"])
    assert ds.stats["exif_transposed"] == 1
    assert any("EXIF orientation" in r.getMessage() for r in caplog.records)
    assert ds[0].vision.sizes == ((56, 112),)
    assert ds[0].vision.grids() == [(1, 112 // 14, 56 // 14)]  # rows of patches, then columns
    _, images = vision.process(ds[0].vision, policy.processor.image_processor)
    assert images[0].size == (56, 112)
