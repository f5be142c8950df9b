"""Videos as lists of frames: placeholders, M-RoPE positions, shared vision passes, bad input."""

from __future__ import annotations

import json

import pytest
import torch
from PIL import Image

from polyrl.core.config import ConfigError
from polyrl.core.record import pad_left, strings
from polyrl.core.rollout.data import DataConfig, DataError
from polyrl.core.rollout.engine import SamplingParams
from polyrl.core.rollout.workflow import Context
from polyrl.multimodal import forward, vision
from polyrl.multimodal.data import VLDataset
from polyrl.multimodal.engine import VLEngine
from polyrl.multimodal.workflow import VLSingleTurn

ARGS = {"min_pixels": 56 * 56, "max_pixels": 112 * 112}


def frames(n: int, size=(56, 84), base=(200, 30, 30)) -> list[Image.Image]:
    """``n`` frames of one size whose colour changes over time."""
    return [
        Image.new("RGB", size, ((base[0] + 17 * i) % 256, base[1], (base[2] + 29 * i) % 256))
        for i in range(n)
    ]


@pytest.fixture
def video_rows():
    return [
        # one video, odd frame count (the processor repeats the last frame)
        {"prompt": "<video>What colour is the square?", "videos": [frames(3)], "answer": "red"},
        # an image and a video, markers in text order; 8 frames at 1 fps (temporal spacing)
        {
            "prompt": "Look at <image> and then <video>. How many circles?",
            "images": [Image.new("RGB", (84, 56), (30, 30, 200))],
            "videos": [frames(8, (112, 56), (30, 160, 40))],
            "video_fps": 1,
            "answer": "2",
        },
        # two videos, no markers: put before the text
        {
            "prompt": "Which one moves?",
            "videos": [frames(2, (56, 56)), frames(4, (84, 84))],
            "answer": "1",
        },
        {"prompt": "How many circles?", "answer": "0"},
    ]


@pytest.fixture
def video_data(make_policy, video_rows):
    policy = make_policy()
    ds = VLDataset(DataConfig(kind="vl", args=ARGS), policy.tokenizer, name="v", rows=video_rows)
    return policy, ds


def _collapse(ids: list[int], tokens: set[int]) -> list[int]:
    """One placeholder per run of vision tokens (what the processor's input text holds)."""
    out: list[int] = []
    for t in ids:
        if not (t in tokens and out and out[-1] == t):
            out.append(t)
    return out


def _source(row: dict) -> tuple[list, list]:
    return list(row.get("images") or []), list(row.get("videos") or [])


def test_video_placeholders_equal_the_processors_own(video_data, video_rows):
    """Prompt ids built from header sizes (ceil(T/2)*h*w/merge^2 per video) = the HF
    Qwen2.5-VL processor run on the same source frames, which resizes them itself."""
    policy, ds = video_data
    proc, tok = policy.processor, policy.tokenizer
    pads = {proc.image_token_id, proc.video_token_id}
    assert ds.stats["videos"] == 4 and ds.stats["video_frames"] == 17
    assert ds.stats["videos_padded"] == 1 and ds.stats["placeholders_added"] == 1
    assert ds.stats["text_only"] == 1
    for item, row in zip(ds, video_rows, strict=True):
        images, videos = _source(row)
        if item.vision is None:
            assert not videos
            continue
        text = tok.decode(_collapse(item.prompt_ids, pads), skip_special_tokens=False)
        ref = proc(text=[text], images=images or None, videos=videos or None, return_tensors="pt")
        assert ref["input_ids"][0].tolist() == item.prompt_ids
        v, _, got_frames = vision.process_frames(
            item.vision, proc.image_processor, proc.video_processor
        )
        assert torch.equal(v.video_grid_thw, ref["video_grid_thw"])
        assert item.vision.video_token_counts() == (ref["video_grid_thw"].prod(-1) // 4).tolist()
        # these frames need no resizing: the pixels equal the processor's too
        assert torch.allclose(v.pixel_values_videos, ref["pixel_values_videos"], atol=1e-6)
        assert [len(f) for f in got_frames] == [len(f) for f in videos]
    assert ds[0].vision.video_grids() == [(2, 6, 4)]  # 3 frames -> 2 temporal steps
    assert ds[1].prompt_text.index("<image:") < ds[1].prompt_text.index("<video: 8 frames")


def test_max_frames_and_fps(make_policy):
    """max_frames subsamples evenly (first and last kept, counted); the kept frames' rate
    sets second_per_grid_ts; video_min/max_pixels resize the frames, not the images."""
    policy = make_policy()
    rows = [
        {
            "prompt": "<video> and <image>?",
            "videos": [frames(9, (224, 224))],
            "images": [Image.new("RGB", (224, 224))],
            "answer": "x",
            "video_fps": 3,
        }
    ]
    args = {**ARGS, "max_frames": 4, "video_max_pixels": 56 * 56}
    ds = VLDataset(DataConfig(kind="vl", args=args), policy.tokenizer, rows=rows)
    spec = ds[0].vision
    assert [r.where.rsplit(" ", 1)[-1] for r in spec.videos[0].refs] == ["0", "3", "5", "8"]
    assert ds.stats["frames_dropped"] == 5 and ds.stats["video_frames"] == 4
    assert spec.videos[0].fps == pytest.approx(3 * 4 / 9)
    assert spec.second_per_grid() == [pytest.approx(2 / (3 * 4 / 9))]
    assert spec.video_grids() == [(2, 4, 4)] and spec.grids() == [(1, 8, 8)]
    v, _ = vision.process(spec, policy.processor.image_processor, policy.processor.video_processor)
    assert v.video_resized == ((56, 56),) and v.resized == ((112, 112),)
    assert v.second_per_grid_ts.tolist() == [pytest.approx(2 / (3 * 4 / 9))]


def test_positions_match_get_rope_index_with_videos(video_data, grouped_sequences):
    """Prompt + response positions (one get_rope_index per group, response continued) equal
    transformers' get_rope_index over the whole sequences, for video and image+video rows."""
    policy, ds = video_data
    proc = policy.processor
    items = list(ds)
    visions = [
        vision.process(it.vision, proc.image_processor, proc.video_processor)[0]
        if it.vision
        else None
        for it in items
    ]
    prompt_ids, prompt_mask, response_ids, response_mask, row_visions = grouped_sequences(
        items, visions, [7, proc.video_token_id, proc.image_token_id]
    )  # sampled: text
    p = forward.parts(policy.model)
    got = forward.sequence_positions(p, prompt_ids, prompt_mask, response_ids.shape[1], row_visions)
    ids = torch.cat([prompt_ids, response_ids], 1)
    mask = torch.cat([prompt_mask, response_mask], 1)
    none = torch.zeros_like(response_ids, dtype=torch.int32)
    types = torch.cat(
        [
            (prompt_ids == proc.image_token_id).int()
            + 2 * (prompt_ids == proc.video_token_id).int(),
            none,
        ],
        1,
    )
    grids = forward.batch_grids(row_visions)
    want, _ = p.inner.get_rope_index(
        input_ids=ids,
        mm_token_type_ids=types,
        image_grid_thw=grids.image,
        video_grid_thw=grids.video,
        second_per_grid_ts=grids.second_per_grid,
        attention_mask=mask,
    )
    keep = mask.bool()
    for axis in range(3):
        assert torch.equal(got[axis][keep], want[axis][keep]), axis
    # the 8-frame video at 1 fps spaces its temporal positions past the text after it: the
    # prompt's largest position is not where the response starts
    plen = prompt_ids.shape[1]
    row = 2  # item 1's first row (each item appears twice, in order)
    assert int(got[:, row, :plen].max()) > int(got[0, row, plen - 1])


def test_vl_forward_with_videos_equals_the_models_own(video_data, one_thread):
    """Logits from vl_forward (features once per prompt, positions from get_rope_index)
    equal Qwen2.5-VL's own forward with pixel_values_videos / video_grid_thw."""
    policy, ds = video_data
    proc = policy.processor
    items = [it for it in ds if it.vision is not None]
    visions = [
        vision.process(it.vision, proc.image_processor, proc.video_processor)[0] for it in items
    ]
    rows = [visions[0], visions[0], visions[1], visions[2]]
    ids, mask = pad_left(
        [
            items[0].prompt_ids,
            items[0].prompt_ids + [7, 8],
            items[1].prompt_ids,
            items[2].prompt_ids,
        ],
        0,
    )
    model = policy.model
    with torch.no_grad():
        mine, _, _ = forward.vl_forward(model, ids, mask, rows, logits_to_keep=ids.shape[1])
        grids = forward.batch_grids(rows)
        theirs = model(
            input_ids=ids,
            attention_mask=mask,
            pixel_values=torch.cat([v.pixel_values for v in rows if v.pixel_values is not None]),
            image_grid_thw=grids.image,
            pixel_values_videos=torch.cat([v.pixel_values_videos for v in rows]),
            video_grid_thw=grids.video,
            second_per_grid_ts=grids.second_per_grid,
            mm_token_type_ids=(ids == proc.image_token_id).int()
            + 2 * (ids == proc.video_token_id).int(),
        ).logits
    keep = mask.bool()
    assert torch.allclose(mine[keep], theirs[keep], atol=1e-5), (mine - theirs).abs().max()


def test_engine_logprobs_match_and_a_group_processes_its_video_once(video_data, one_thread):
    """hf_vl's recorded log-probs equal the trainer's (float32); each prompt's videos are
    decoded, processed and encoded once for its group of n, in the rollout and the update."""
    policy, ds = video_data
    items = list(ds)
    n_videos = sum(len(it.vision.videos) for it in items if it.vision)
    before = dict(vision.COUNTERS)
    wf = VLSingleTurn(
        Context(cfg=None, policies={"main": policy}, engines={"main": VLEngine(policy, seed=0)})
    )
    record = wf.rollout(items, SamplingParams(n=3, max_new_tokens=5))
    rolled = dict(vision.COUNTERS)
    assert rolled["videos_processed"] - before.get("videos_processed", 0) == n_videos
    assert rolled["vision_videos"] - before.get("vision_videos", 0) == n_videos
    shared = strings(record, "vision")
    assert all(shared[3 * k] is shared[3 * k + j] for k in range(len(items)) for j in range(3))
    metas = strings(record, "meta")
    assert [len(v) for v in metas[0]["videos"]] == [3] and metas[0]["images"] == []
    assert metas[3]["video_sizes"] == [(112, 56)] and len(metas[3]["images"]) == 1
    logp, _ = policy.logprobs(record)
    m = record["response_mask"].bool()
    assert float((logp[m] - record["rollout_logprobs"][m]).abs().mean().detach()) <= 1e-5
    logp.sum().backward()
    updated = dict(vision.COUNTERS)
    assert updated["video_passes"] - rolled["video_passes"] == 1
    assert updated["vision_videos"] - rolled["vision_videos"] == n_videos
    assert updated["videos_processed"] == rolled["videos_processed"]
    # without the vision column (the SFT warm start) the rows' references are processed
    with torch.no_grad():
        again, _ = policy.logprobs(record.exclude("vision"))
    assert torch.allclose(again, logp.detach(), atol=1e-6)
    assert vision.COUNTERS["videos_processed"] - updated["videos_processed"] == n_videos


# --------------------------------------------------------------------------- bad input


def _load(policy, rows, **args) -> VLDataset:
    return VLDataset(
        DataConfig(kind="vl", args={**ARGS, **args}), policy.tokenizer, name="b", rows=rows
    )


def test_video_markers_must_match(make_policy):
    policy = make_policy()
    two = [{"prompt": "<video> and <video>?", "videos": [frames(2)], "answer": "x"}]
    with pytest.raises(
        DataError,
        match=r"b rows, row 0.*2 '<video>' markers.*1 videos "
        r"\(field 'videos'\).*more",
    ):
        _load(policy, two)
    fewer = [{"prompt": "<video> which?", "videos": [frames(2), frames(2)], "answer": "x"}]
    with pytest.raises(DataError, match=r"row 0.*1 '<video>' markers.*2 videos.*fewer"):
        _load(policy, fewer)
    none = [{"prompt": "which?", "videos": [frames(2)], "answer": "x"}]
    with pytest.raises(DataError, match="0 '<video>' markers"):
        _load(policy, none, missing_placeholders="error")
    raw = [{"prompt": "<video> is <|video_pad|>?", "videos": [frames(2)], "answer": "x"}]
    with pytest.raises(DataError, match=r"row 0: the prompt text contains .*<\|video_pad\|>"):
        _load(policy, raw)


def test_bad_videos_are_named(make_policy, tmp_path):
    policy = make_policy()
    mixed = [{"prompt": "<video>?", "videos": [frames(2) + frames(1, (84, 56))], "answer": "x"}]
    with pytest.raises(
        DataError,
        match=r"row 0, video 0: frame 2 is 84x56 but frame 0 is "
        r"56x84 \(field 'videos'\)",
    ):
        _load(policy, mixed)
    empty = [{"prompt": "<video>?", "videos": [[]], "answer": "x"}]
    with pytest.raises(DataError, match=r"row 0, video 0: field 'videos' holds an empty video"):
        _load(policy, empty)
    flat = [{"prompt": "<video>?", "videos": frames(2), "answer": "x"}]
    with pytest.raises(DataError, match=r"row 0: field 'videos' must be a list of videos"):
        _load(policy, flat)
    fps = [{"prompt": "<video>?", "videos": [frames(2)], "video_fps": [1, 2], "answer": "x"}]
    with pytest.raises(DataError, match=r"row 0: field 'video_fps'"):
        _load(policy, fps)
    with pytest.raises(
        ConfigError, match="b data.args.max_frames=0 in .*must be a positive integer"
    ):
        _load(policy, empty, max_frames=0)
    # a missing frame file, from a JSONL file: named by line, video, frame and path
    (tmp_path / "f").mkdir()
    paths = []
    for i, img in enumerate(frames(2)):
        img.save(tmp_path / "f" / f"{i}.png")
        paths.append(f"f/{i}.png")
    rows = [
        {"prompt": "<video>?", "videos": [paths + ["f/gone.png"]], "answer": "x"},
        {"prompt": "<video>?", "videos": [paths], "answer": "y"},
    ]
    data = tmp_path / "v.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = DataConfig(kind="vl", path=str(data), args=ARGS)
    with pytest.raises(DataError, match=r"line 1, video 0, frame 2.*f/gone\.png.*does not exist"):
        VLDataset(cfg, policy.tokenizer)
    cfg.args = {**ARGS, "bad_images": "skip"}
    ds = VLDataset(cfg, policy.tokenizer)
    assert ds.stats["skipped_bad_image"] == 1 and len(ds) == 1
    assert [r.kind for r in ds[0].vision.videos[0].refs] == ["path", "path"]
    assert ds[0].row["videos"] == [[str(tmp_path / p) for p in paths]]


def test_parquet_video_frames_stay_in_the_arrow_table(make_policy, tmp_path):
    """Frames embedded in a Parquet file (a list of lists of images) are read lazily from
    the memory-mapped table, like images."""
    import io

    datasets = pytest.importorskip("datasets")
    policy = make_policy()

    def png(colour) -> dict:
        buf = io.BytesIO()
        Image.new("RGB", (56, 56), colour).save(buf, format="PNG")
        return {"bytes": buf.getvalue(), "path": None}

    video = [png((0, 150, 0)), png((0, 0, 150)), png((9, 9, 9))]
    table = datasets.Dataset.from_dict(
        {"prompt": ["<video>What changes?"] * 2, "videos": [[video]] * 2, "answer": ["c"] * 2},
        features=datasets.Features(
            {
                "prompt": datasets.Value("string"),
                "answer": datasets.Value("string"),
                "videos": datasets.Sequence(datasets.Sequence(datasets.Image())),
            }
        ),
    )
    table.to_parquet(str(tmp_path / "v.parquet"))
    ds = VLDataset(
        DataConfig(kind="vl", path=str(tmp_path / "v.parquet"), args=ARGS), policy.tokenizer
    )
    assert {r.kind for r in ds[1].vision.videos[0].refs} == {"arrow"}
    _, _, got = vision.process_frames(
        ds[1].vision, policy.processor.image_processor, policy.processor.video_processor
    )
    assert [f.getpixel((3, 3)) for f in got[0]] == [(0, 150, 0), (0, 0, 150), (9, 9, 9)]
