"""The zoom tool and the ``vl_zoom`` environment (issue 21, part 2).

The crop is checked against hand-made images; the environment's base view against the
scene's mean colour (it must not tell which colour is where) and its turns against the
dots' colours. The learning demo (Demo A) does not reach its bar yet: see
multimodal/README.md, "The zoom tool and Demo A".
"""

from __future__ import annotations

import random

import numpy as np
import pytest
from PIL import Image

from polyrl.multimodal import zoom


def _quadrant_image() -> Image.Image:
    """A 4x4 image whose four 2x2 quadrants are solid red, green, blue, white."""
    a = np.zeros((4, 4, 3), dtype=np.uint8)
    a[:2, :2], a[:2, 2:], a[2:, :2], a[2:, 2:] = (255, 0, 0), (0, 255, 0), (0, 0, 255), 255
    return Image.fromarray(a)


def test_crop_returns_the_named_quadrant_or_box_at_the_asked_size():
    img = _quadrant_image()
    for k, colour in ((1, (255, 0, 0)), (2, (0, 255, 0)), (3, (0, 0, 255)), (4, (255, 255, 255))):
        out = zoom.crop(img, k, 8)
        assert out.size == (8, 8)
        assert {tuple(p) for p in np.asarray(out).reshape(-1, 3).tolist()} == {colour}
    # the left half: red above blue, each half of the output
    half = np.asarray(zoom.crop(img, (0.0, 0.0, 0.5, 1.0), 4))
    assert (half[:2] == (255, 0, 0)).all() and (half[2:] == (0, 0, 255)).all()
    # box filter: the middle 2x2 pixels average the four colours
    mid = np.asarray(zoom.crop(img, (0.25, 0.25, 0.75, 0.75), 1))[0, 0]
    assert np.allclose(
        mid, np.array([255 + 0 + 0 + 255, 0 + 255 + 0 + 255, 0 + 0 + 255 + 255]) / 4, atol=1
    )
    with pytest.raises(ValueError, match="quadrant must be 1-4"):
        zoom.crop(img, 5, 8)
    with pytest.raises(ValueError, match="0 <= x0 < x1 <= 1"):
        zoom.crop(img, (0.5, 0.0, 0.5, 1.0), 8)


def test_the_base_view_hides_which_colour_is_where_and_a_zoom_shows_it():
    scene, colours = zoom.draw_scene(random.Random(7))
    k = 2
    task = {"scene_seed": 7, "answer": colours[k - 1], "prompt": "q"}
    env = zoom.ZoomEnv()
    base, text = env.reset(task)
    assert text == "q" and base.size == (56, 56)
    # a 1x1 thumbnail blown up: every pixel is the scene's mean colour
    view = np.asarray(base).reshape(-1, 3).astype(float)
    assert np.abs(view - np.asarray(scene).reshape(-1, 3).mean(0)).max() <= 1
    # the same scene with the colours in another order: the same base view (+-1 rounding)
    other, _ = zoom.draw_scene(random.Random(7), order=colours[::-1])
    assert (
        np.abs(
            np.asarray(zoom.base_view(other, env.thumb, 56)).astype(float) - np.asarray(base)
        ).max()
        <= 1
    )

    def pixels_of(img, colour: str) -> int:
        rgb = np.asarray(img).reshape(-1, 3).astype(int)
        return int((np.abs(rgb - np.array(zoom.COLOURS[colour])).sum(-1) < 10).sum())

    assert all(pixels_of(base, c) == 0 for c in colours)
    obs, reward, done, info = env.step(f"zoom {k}")
    assert obs[0] == f"zoom {k}:" and not done and reward == 0.0 and info == {"zoomed": True}
    assert pixels_of(obs[1], colours[k - 1]) > 1500  # its dot, 50 pixels across: ~1960
    assert all(pixels_of(obs[1], c) == 0 for c in colours if c != colours[k - 1])
    assert env.step(colours[k - 1]) == ("right", 1.0, True, {"success": True})
    env.reset(task)
    env.step("zoom 3")
    assert env.step(colours[2]) == ("wrong", 0.0, True, {"success": False})  # quadrant 3's dot
    off = zoom.ZoomEnv(tool=False)
    off.reset(task)
    assert off.step(f"zoom {k}") == (zoom.NO_TOOL, 0.0, False, {"zoomed": False})
    assert off.step(f"zoom {k}")[1:3] == (0.0, True)  # a second zoom is a wrong answer


def test_each_scene_is_asked_about_every_quadrant_and_the_warm_start_zooms_uniformly(tmp_path):
    """Four consecutive rows per scene, one per quadrant (a step's batch of 16 holds four
    whole scenes), and the warm start's first turn names every k once per question, so it
    does not favour a quadrant; its second turn reads the asked quadrant's dot."""
    rows = zoom.make_rows(3, seed=0, out=tmp_path, split="train")
    assert len(rows) == 12
    for i in range(3):
        scene = rows[4 * i : 4 * i + 4]
        assert len({r["scene_seed"] for r in scene}) == 1
        assert [r["quadrant"] for r in scene] == [1, 2, 3, 4]
        assert [r["answer"] for r in scene] == scene[0]["colours"]
        assert all(r["prompt"].endswith(f"quadrant {r['quadrant']}") for r in scene)
    sft = zoom.sft_rows(rows)
    assert len(sft) == 5 * len(rows)
    for r, group in zip(rows, (sft[5 * j : 5 * j + 5] for j in range(len(rows))), strict=True):
        assert [g["response"] for g in group[:4]] == ["zoom 1", "zoom 2", "zoom 3", "zoom 4"]
        read = group[4]
        assert read["response"] == r["answer"]
        assert read["prompt"][1]["content"] == f"zoom {r['quadrant']}"
        # the zoom image shown in the reading row is the asked quadrant of this scene
        scene, _ = zoom.draw_scene(random.Random(r["scene_seed"]))
        shown = np.asarray(Image.open(read["images"][1])).astype(int)
        assert (shown == np.asarray(zoom.crop(scene, r["quadrant"], 56)).astype(int)).all()
