"""The vl dataset kind: sources, lazy loading, cheap length filter and every kind of bad input."""

from __future__ import annotations

import io
import json
import struct
import zlib
from pathlib import Path

import pytest
from PIL import Image

from polyrl.core.config import ConfigError
from polyrl.core.rollout.data import DataConfig, DataError
from polyrl.multimodal import vision
from polyrl.multimodal.data import VLDataset
from polyrl.multimodal.images import ImageError

ARGS = {"min_pixels": 56 * 56, "max_pixels": 112 * 112}


@pytest.fixture
def policy(make_policy):
    return make_policy()


def write_rows(tmp_path: Path, rows: list[dict], name: str = "data.jsonl") -> str:
    path = tmp_path / name
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def save(tmp_path: Path, name: str, size=(56, 56), mode="RGB", colour=None) -> str:
    colour = (
        colour
        if colour is not None
        else {"RGB": (200, 30, 30), "L": 90, "RGBA": (0, 0, 255, 0), "P": 3, "1": 1}[mode]
    )
    (tmp_path / "img").mkdir(exist_ok=True)
    Image.new(mode, size, colour).save(tmp_path / "img" / name)
    return f"img/{name}"


def load(tmp_path, policy, rows, name="data.jsonl", **args) -> VLDataset:
    cfg = DataConfig(kind="vl", path=write_rows(tmp_path, rows, name), args={**ARGS, **args})
    return VLDataset(cfg, policy.tokenizer, name="train")


def png_header_only(width: int, height: int) -> bytes:
    """A PNG whose header claims width x height (no pixel data follows)."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return (
            struct.pack(">I", len(data))
            + kind
            + data
            + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)
        )

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IEND", b"")


# --------------------------------------------------------------------------- good input


def test_paths_relative_to_the_data_file_and_multi_image(tmp_path, policy):
    rows = [
        {
            "prompt": "<image>What colour is the square?",
            "images": [save(tmp_path, "a.png")],
            "answer": "red",
        },
        {
            "prompt": "<image> then <image>: how many circles?",
            "images": [save(tmp_path, "b.png", (84, 56)), save(tmp_path, "c.png", (56, 112))],
            "answer": "2",
        },
        {"prompt": "How many circles?", "answer": "0"},
    ]
    ds = load(tmp_path, policy, rows)
    assert ds.stats["kept"] == 3 and ds.stats["images"] == 3 and ds.stats["text_only"] == 1
    two = ds[1]
    assert [r.kind for r in two.vision.refs] == ["path", "path"]
    assert two.prompt_text.index("b.png") < two.prompt_text.index("c.png")
    assert two.vision.grids() == [(1, 4, 6), (1, 8, 4)]
    assert ds[2].vision is None and ds[2].row["images"] == []


def test_loading_decodes_nothing_and_never_runs_the_processor(tmp_path, policy, monkeypatch):
    """Lazy: only headers are read; the length filter uses grid sizes, not the processor."""
    rows = [
        {
            "prompt": "<image>What colour is the square?",
            "images": [save(tmp_path, f"{i}.png", (56 + 28 * (i % 3), 56))],
            "answer": "red",
        }
        for i in range(6)
    ]
    path = write_rows(tmp_path, rows, "lazy.jsonl")

    def forbidden(*a, **k):
        raise AssertionError("pixels were decoded or processed at load time")

    monkeypatch.setattr(type(policy.processor.image_processor), "__call__", forbidden)
    monkeypatch.setattr(Image.Image, "load", forbidden)
    ds = VLDataset(DataConfig(kind="vl", path=path, args=ARGS), policy.tokenizer)
    assert len(ds) == 6 and ds.stats["images"] == 6
    # 56x56 -> 4 image tokens, 84x56 -> 6, 112x56 -> 8: the filter drops the longest two
    base = len(ds[0].prompt_ids) - 4
    short = VLDataset(
        DataConfig(kind="vl", path=path, args=ARGS, max_prompt_tokens=base + 6), policy.tokenizer
    )
    assert short.stats["filtered_overlong"] == 2 and len(short) == 4
    with pytest.raises(DataError, match=r"line 3: prompt is .* \(8 of them image tokens\)"):
        VLDataset(
            DataConfig(
                kind="vl", path=path, args=ARGS, max_prompt_tokens=base + 6, overlong="error"
            ),
            policy.tokenizer,
        )
    monkeypatch.undo()
    assert all(it.vision.refs[0].kind == "path" for it in ds)  # references, not pixels


def test_in_memory_rows_with_pil_and_bytes(policy):
    buf = io.BytesIO()
    Image.new("RGB", (56, 56), (0, 0, 200)).save(buf, format="PNG")
    rows = [
        {
            "prompt": "<image>What colour is the square?",
            "images": Image.new("RGB", (56, 56), (200, 0, 0)),
            "answer": "red",
        },
        {
            "prompt": "<image>What colour is the square?",
            "images": [buf.getvalue()],
            "answer": "blue",
        },
    ]
    ds = VLDataset(DataConfig(kind="vl", args=ARGS), policy.tokenizer, rows=rows)
    assert [it.vision.refs[0].kind for it in ds] == ["pil", "bytes"]
    v, images = vision.process(ds[1].vision, policy.processor.image_processor)
    assert images[0].getpixel((10, 10)) == (0, 0, 200)


def test_parquet_with_embedded_images_stays_in_the_arrow_table(tmp_path, policy):
    datasets = pytest.importorskip("datasets")
    buf = io.BytesIO()
    Image.new("RGB", (56, 56), (0, 150, 0)).save(buf, format="PNG")
    table = datasets.Dataset.from_dict(
        {
            "prompt": ["<image>What colour is the square?"] * 3,
            "images": [[{"bytes": buf.getvalue(), "path": None}]] * 3,
            "answer": ["green"] * 3,
        },
        features=datasets.Features(
            {
                "prompt": datasets.Value("string"),
                "images": datasets.Sequence(datasets.Image()),
                "answer": datasets.Value("string"),
            }
        ),
    )
    table.to_parquet(str(tmp_path / "rows.parquet"))
    ds = VLDataset(
        DataConfig(kind="vl", path=str(tmp_path / "rows.parquet"), args=ARGS), policy.tokenizer
    )
    assert len(ds) == 3 and ds[0].vision.refs[0].kind == "arrow"
    assert "images" in ds[0].row and not isinstance(ds[0].row["images"][0], bytes)
    _, images = vision.process(ds[2].vision, policy.processor.image_processor)
    assert images[0].getpixel((5, 5)) == (0, 150, 0)


# --------------------------------------------------------------------------- bad input


def test_missing_image_file_names_row_and_path(tmp_path, policy):
    rows = [
        {"prompt": "<image>What colour is the square?", "images": ["img/nope.png"], "answer": "red"}
    ]
    (tmp_path / "img").mkdir()
    with pytest.raises(DataError, match=r"line 1, image 0.*img/nope\.png.*does not exist"):
        load(tmp_path, policy, rows)
    ok = {
        "prompt": "<image>What colour is the square?",
        "images": [save(tmp_path, "a.png")],
        "answer": "red",
    }
    ds = load(tmp_path, policy, rows + [ok], bad_images="skip")
    assert ds.stats["skipped_bad_image"] == 1 and len(ds) == 1


def test_corrupt_image_names_the_file(tmp_path, policy):
    (tmp_path / "img").mkdir()
    (tmp_path / "img" / "bad.png").write_bytes(b"this is not a png at all")
    rows = [
        {"prompt": "<image>What colour is the square?", "images": ["img/bad.png"], "answer": "red"}
    ]
    with pytest.raises(DataError, match=r"bad\.png.*not a readable image"):
        load(tmp_path, policy, rows)


def test_truncated_image_fails_at_decode_naming_the_file(tmp_path, policy):
    """An image cut short after the load-time check (the file changed under the run) is
    refused when a rollout decodes it, naming the file, before anything reaches the model."""
    (tmp_path / "img").mkdir()
    noisy = Image.effect_noise((56, 56), 64).convert("RGB")  # noise: no tiny compressed file
    noisy.save(tmp_path / "img" / "t.png")
    rows = [
        {"prompt": "<image>What colour is the square?", "images": ["img/t.png"], "answer": "red"}
    ]
    ds = load(tmp_path, policy, rows)
    data = (tmp_path / "img" / "t.png").read_bytes()
    (tmp_path / "img" / "t.png").write_bytes(data[: len(data) // 2])
    with pytest.raises(ImageError, match=r"line 1, image 0.*t\.png.*truncated or corrupt"):
        vision.process(ds[0].vision, policy.processor.image_processor)


def test_truncated_jpeg_is_skipped_and_counted_in_skip_mode(tmp_path, policy):
    """With bad_images: skip, a JPEG whose header is fine but whose data is cut short is
    found at load (its pixels decoded once) and its row dropped and counted, so no rollout
    meets it; the other rows load and process as usual."""
    (tmp_path / "img").mkdir()
    noisy = Image.effect_noise((112, 112), 64).convert("RGB")
    noisy.save(tmp_path / "img" / "cut.jpg", quality=90)
    data = (tmp_path / "img" / "cut.jpg").read_bytes()
    (tmp_path / "img" / "cut.jpg").write_bytes(data[: len(data) * 2 // 3])
    rows = [
        {"prompt": "<image>What colour is the square?", "images": ["img/cut.jpg"], "answer": "x"},
        {
            "prompt": "<image>What colour is the square?",
            "images": [save(tmp_path, "a.png")],
            "answer": "red",
        },
    ]
    ds = load(tmp_path, policy, rows, bad_images="skip")
    assert len(ds) == 1 and ds.stats["skipped_bad_image"] == 1
    assert ds[0].row["images"] == [str(tmp_path / "img" / "a.png")]
    _, images = vision.process(ds[0].vision, policy.processor.image_processor)
    assert images[0].getpixel((5, 5)) == (200, 30, 30)
    # without skip, the load itself names the row and the file
    with pytest.raises(DataError, match=r"line 1, image 0.*cut\.jpg.*truncated or corrupt"):
        load(tmp_path, policy, rows)


def png_bytes(colour, size=(56, 56)) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", size, colour).save(buf, "PNG")
    return buf.getvalue()


def test_data_uri_images_are_decoded(tmp_path, policy):
    import base64
    import urllib.parse

    red, green = png_bytes((200, 30, 30)), png_bytes((30, 160, 40), (84, 56))
    rows = [
        {
            "prompt": "<image>What colour is the square?",
            "images": ["data:image/png;base64," + base64.b64encode(red).decode()],
            "answer": "red",
        },
        {  # percent-encoded instead of base64
            "prompt": "<image>What colour is the square?",
            "images": ["data:image/png," + urllib.parse.quote_from_bytes(green)],
            "answer": "green",
        },
    ]
    ds = load(tmp_path, policy, rows)
    assert [it.vision.refs[0].kind for it in ds] == ["bytes", "bytes"]
    assert [it.vision.sizes[0] for it in ds] == [(56, 56), (84, 56)]
    _, images = vision.process(ds[0].vision, policy.processor.image_processor)
    assert images[0].getpixel((5, 5)) == (200, 30, 30)
    _, images = vision.process(ds[1].vision, policy.processor.image_processor)
    assert images[0].getpixel((5, 5)) == (30, 160, 40)
    wrapped = base64.encodebytes(red).decode()  # 76-character lines
    ds = load(tmp_path, policy, [{**rows[0], "images": ["data:image/png;base64," + wrapped]}])
    assert ds[0].vision.sizes[0] == (56, 56)
    for uri, message in (
        ("data:text/plain;base64,aGVsbG8=", "URI holds 'text/plain', not an image"),
        ("data:image/png;base64,not*base64", "URI's base64 data is invalid"),
        ("data:image/png;base64", "URI 'data:image/png;base64'... has no ','"),
    ):
        with pytest.raises(DataError, match=rf"line 1, image 0: the data: {message}"):
            load(tmp_path, policy, [{**rows[0], "images": [uri]}])


@pytest.mark.parametrize("mode", ["L", "RGBA", "P", "1"])
def test_grayscale_palette_and_alpha_images_become_rgb(tmp_path, policy, mode):
    rows = [
        {
            "prompt": "<image>What colour is the square?",
            "images": [save(tmp_path, f"{mode}.png", mode=mode)],
            "answer": "red",
        }
    ]
    ds = load(tmp_path, policy, rows)
    assert ds.stats["converted_rgb"] == 1
    v, images = vision.process(ds[0].vision, policy.processor.image_processor)
    assert images[0].mode == "RGB" and v.pixel_values.shape == (16, 1176)
    if mode == "RGBA":  # fully transparent: composited over white
        assert images[0].getpixel((3, 3)) == (255, 255, 255)


def test_one_pixel_image_is_upscaled_and_counted(tmp_path, policy):
    rows = [
        {
            "prompt": "<image>What colour is the square?",
            "images": [save(tmp_path, "dot.png", (1, 1))],
            "answer": "red",
        }
    ]
    ds = load(tmp_path, policy, rows)
    assert ds.stats["upscaled"] == 1 and ds[0].vision.grids() == [(1, 4, 4)]
    v, images = vision.process(ds[0].vision, policy.processor.image_processor)
    assert images[0].size == (56, 56) and v.image_grid_thw.tolist() == [[1, 4, 4]]


def test_image_over_max_pixels_is_downscaled_and_counted(tmp_path, policy):
    rows = [
        {
            "prompt": "<image>What colour is the square?",
            "images": [save(tmp_path, "big.png", (560, 280))],
            "answer": "red",
        }
    ]
    ds = load(tmp_path, policy, rows)
    assert ds.stats["downscaled"] == 1
    ((w, h),) = [ds.rule.resized(560, 280)]
    assert w * h <= 112 * 112 and w % 28 == 0 and h % 28 == 0
    v, images = vision.process(ds[0].vision, policy.processor.image_processor)
    assert images[0].size == (w, h)
    assert (
        sum(t == policy.processor.image_token_id for t in ds[0].prompt_ids)
        == int(v.image_grid_thw.prod()) // 4
    )


def test_huge_image_is_an_error_not_a_memory_blow_up(tmp_path, policy):
    """20000x20000: refused from the header alone (1.2 GB as RGB), naming file and limit."""
    (tmp_path / "img").mkdir()
    (tmp_path / "img" / "huge.png").write_bytes(png_header_only(20000, 20000))
    rows = [
        {"prompt": "<image>What colour is the square?", "images": ["img/huge.png"], "answer": "red"}
    ]
    with pytest.raises(DataError, match=r"huge\.png.*too large|huge\.png.*max_source_pixels"):
        load(tmp_path, policy, rows)
    # below PIL's own bomb limit but over ours: our message, with the knob to turn
    rows[0]["images"] = [save(tmp_path, "mid.png", (300, 300))]
    with pytest.raises(DataError, match=r"mid\.png.*300x300.*max_source_pixels=50,000"):
        load(tmp_path, policy, rows, max_source_pixels=50_000)


def test_more_or_fewer_markers_than_images(tmp_path, policy):
    a, b = save(tmp_path, "a.png"), save(tmp_path, "b.png")
    more = [{"prompt": "<image> and <image>?", "images": [a], "answer": "x"}]
    with pytest.raises(DataError, match=r"line 1.*2 '<image>' markers.*1 images.*more"):
        load(tmp_path, policy, more)
    fewer = [{"prompt": "<image> which one?", "images": [a, b], "answer": "x"}]
    with pytest.raises(DataError, match=r"line 1.*1 '<image>' markers.*2 images.*fewer"):
        load(tmp_path, policy, fewer)
    none = [{"prompt": "What colour is the square?", "images": [a, b], "answer": "x"}]
    ds = load(tmp_path, policy, none)
    assert ds.stats["placeholders_added"] == 1
    assert ds[0].prompt_text.index("b.png") < ds[0].prompt_text.index("What colour")
    with pytest.raises(DataError, match="0 '<image>' markers"):
        load(tmp_path, policy, none, missing_placeholders="error")
    text_marker = [{"prompt": "<image> what?", "answer": "x"}]
    with pytest.raises(DataError, match="1 '<image>' markers but the row has 0 images"):
        load(tmp_path, policy, text_marker)


def test_raw_image_token_in_the_prompt_text_is_named(tmp_path, policy):
    """A prompt that spells the model's own image token would give the model more image
    tokens than features (a crash deep in the forward): refused at load, naming the row."""
    rows = [
        {
            "prompt": "<image>What colour is <|image_pad|> the square?",
            "images": [save(tmp_path, "a.png")],
            "answer": "red",
        }
    ]
    with pytest.raises(DataError, match=r"line 1: the prompt text contains .*<\|image_pad\|>"):
        load(tmp_path, policy, rows)


def test_chat_messages_with_image_parts(tmp_path, policy):
    a = save(tmp_path, "a.png")
    rows = [
        {
            "prompt": [
                {"role": "system", "content": "Answer with one word."},
                {
                    "role": "user",
                    "content": [{"type": "image"}, {"type": "text", "text": "What colour?"}],
                },
            ],
            "images": [a],
            "answer": "red",
        }
    ]
    ds = load(tmp_path, policy, rows)
    assert ds[0].prompt_text.startswith("<|im_start|>system\nAnswer with one word.")
    assert sum(t == policy.processor.image_token_id for t in ds[0].prompt_ids) == 4


def test_bad_options_and_fields_are_named(tmp_path, policy):
    rows = [{"prompt": "<image>x", "images": [save(tmp_path, "a.png")], "answer": "red"}]
    with pytest.raises(ConfigError, match=r"train data.args.max_pixel .*did you mean .*max_pixels"):
        load(tmp_path, policy, rows, max_pixel=100)
    with pytest.raises(
        ConfigError, match=r"bad_images='drop' .* is not one of \['error', 'skip'\]"
    ):
        load(tmp_path, policy, rows, bad_images="drop")
    with pytest.raises(ConfigError, match="min_pixels .* must be an integer"):
        load(tmp_path, policy, rows, min_pixels="many")
    cfg = DataConfig(kind="vl", path=write_rows(tmp_path, rows), answer_field="anwser", args=ARGS)
    with pytest.raises(DataError, match="Did you mean 'answer'"):
        VLDataset(cfg, policy.tokenizer)
    with pytest.raises(DataError, match="URL"):
        VLDataset(
            DataConfig(kind="vl", args=ARGS),
            policy.tokenizer,
            rows=[{"prompt": "<image>x", "images": ["https://x/y.png"], "answer": "1"}],
        )


def test_text_kind_rejects_dataset_args(tmp_path, tiny_model_dir):
    from transformers import AutoTokenizer

    from polyrl.core.rollout.data import PromptDataset

    path = write_rows(tmp_path, [{"prompt": "1+1=", "answer": "2"}])
    with pytest.raises(DataError, match="takes no options"):
        PromptDataset(
            DataConfig(path=path, args={"image_root": "x"}),
            AutoTokenizer.from_pretrained(tiny_model_dir),
        )
