"""Qwen2-VL, Qwen2.5-VL and Qwen3-VL through PolyRL: loader, ``hf_vl`` engine, policy, update.

One tiny model of each family (the real processor and model classes, built offline) per
module: the VL loader's prompt ids equal the real processor's, the engine's recorded
log-probs equal the policy's recomputed ones, and one update changes the weights (the
vision tower only when it is not frozen).
"""

from __future__ import annotations

import pytest
import torch

from polyrl.core.record import set_strings, text_record
from polyrl.core.rollout.engine import Request, SamplingParams
from polyrl.multimodal import forward, vision

FAMILIES = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl")
TINY = {
    "corpus": "vl_shapes",
    "hidden_size": 64,
    "num_layers": 1,
    "num_heads": 2,
    "vision_depth": 1,
    "vision_hidden_size": 32,
    "seed": 0,
}


@pytest.fixture(scope="module", params=FAMILIES)
def family_dir(request, tmp_path_factory) -> tuple[str, str]:
    """(family, path) of a tiny model of each family, built once per module."""
    import polyrl.multimodal  # noqa: F401
    from polyrl.multimodal.tiny import tiny_qwen_vl

    path = tmp_path_factory.mktemp("families") / request.param
    tiny_qwen_vl(path, family=request.param, **TINY)
    return request.param, str(path)


def _policy(path: str, **overrides):
    from polyrl.core.config import from_dict
    from polyrl.core.train.policy import PolicyConfig
    from polyrl.multimodal.policy import QwenVLPolicy

    cfg = from_dict(PolicyConfig, {"model": path, "kind": "qwen_vl", **overrides})
    return QwenVLPolicy("main", cfg, total_steps=10, need_reference=False)


def _dataset(policy, rows):
    from polyrl.core.rollout.data import DataConfig
    from polyrl.multimodal.data import VLDataset

    cfg = DataConfig(kind="vl", args={"min_pixels": 56 * 56, "max_pixels": 112 * 112})
    return VLDataset(cfg, policy.tokenizer, name="t", rows=rows)


def _rollout(policy, items, n: int = 3, max_new_tokens: int = 4):
    """The ``hf_vl`` engine's samples as a record (each row with its prompt's images)."""
    from polyrl.multimodal.engine import VLEngine

    proc = policy.processor
    visions = [
        vision.process(it.vision, proc.image_processor)[0] if it.vision else None for it in items
    ]
    done = VLEngine(policy, seed=0).generate(
        [Request(list(it.prompt_ids), vision=v) for it, v in zip(items, visions, strict=True)],
        SamplingParams(n=n, max_new_tokens=max_new_tokens),
    )
    record = text_record(
        prompt_ids=[items[c.prompt_index].prompt_ids for c in done],
        response_ids=[c.token_ids for c in done],
        rollout_logprobs=[c.logprobs for c in done],
        policy=["main"] * len(done),
        uid=[items[c.prompt_index].uid for c in done],
        pad_id=policy.tokenizer.pad_token_id,
    )
    set_strings(record, "vision", [visions[c.prompt_index] for c in done])
    return record


def test_loader_prompt_ids_equal_the_real_processors(family_dir, vl_rows, one_thread):
    family, path = family_dir
    policy = _policy(path)
    proc = policy.processor
    assert (
        type(proc).__name__
        == {
            "qwen2_vl": "Qwen2VLProcessor",
            "qwen2_5_vl": "Qwen2_5_VLProcessor",
            "qwen3_vl": "Qwen3VLProcessor",
        }[family]
    )
    assert forward.parts(policy.model).deepstack == (family == "qwen3_vl")
    ds = _dataset(policy, vl_rows)
    assert ds.rule.patch_size == (16 if family == "qwen3_vl" else 14)
    for item in ds:
        if item.vision is None:
            assert proc.image_token_id not in item.prompt_ids
            continue
        v, images = vision.process(item.vision, proc.image_processor)
        text = item.prompt_text
        for ref in item.vision.refs:
            text = text.replace(f"<image: {ref.name}>", proc.image_token, 1)
        want = proc(text=[text], images=images, do_resize=False)
        assert list(want["input_ids"][0]) == item.prompt_ids
        assert torch.equal(torch.as_tensor(want["image_grid_thw"]), v.image_grid_thw)


def test_engine_logprobs_equal_the_policys(family_dir, vl_rows, one_thread):
    _, path = family_dir
    policy = _policy(path)
    items = list(_dataset(policy, vl_rows))
    record = _rollout(policy, items)
    assert record.batch_size[0] == 3 * len(items)
    with torch.no_grad():
        logp, _ = policy.logprobs(record)
    m = record["response_mask"].bool()
    diff = (logp[m] - record["rollout_logprobs"][m]).abs()
    assert float(diff.mean()) <= 1e-5 and float(diff.max()) <= 1e-4, diff.max()
    # and the policy's log-probs equal the family's own forward on the real processor's
    # inputs (ids, pixels, grids; Qwen3-VL's deepstack inside), for the two-image prompt
    item = items[1]
    _, images = vision.process(item.vision, policy.processor.image_processor)
    text = item.prompt_text
    for ref in item.vision.refs:
        text = text.replace(f"<image: {ref.name}>", policy.processor.image_token, 1)
    inputs = policy.processor(
        text=[text],
        images=images,
        do_resize=False,
        return_tensors="pt",
        return_mm_token_type_ids=True,
    )
    row = 3  # the first sample of prompt 1
    response = record["response_ids"][row][m[row]]
    ids = torch.cat([inputs["input_ids"][0], response])[None]
    types = torch.cat([inputs["mm_token_type_ids"][0], torch.zeros_like(response)])[None]
    with torch.no_grad():
        logits = policy.model(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            pixel_values=inputs["pixel_values"],
            image_grid_thw=inputs["image_grid_thw"],
            mm_token_type_ids=types,
        ).logits[0, -len(response) - 1 : -1]
    theirs = torch.log_softmax(logits.float(), -1).gather(-1, response[:, None])[:, 0]
    assert torch.allclose(logp[row][m[row]], theirs, atol=1e-5)


def test_engine_top_logprobs_are_the_models_likeliest(family_dir, vl_rows, one_thread):
    """``top_logprobs`` on ``hf_vl`` (the gateway's VL models): per sampled token, the k
    likeliest ids and log-probs of a whole-sequence forward at that position."""
    from polyrl.multimodal.engine import VLEngine

    _, path = family_dir
    policy = _policy(path)
    item = next(it for it in _dataset(policy, vl_rows) if it.vision is not None)
    v = vision.process(item.vision, policy.processor.image_processor)[0]
    (out,) = VLEngine(policy, seed=0).generate(
        [Request(list(item.prompt_ids), vision=v)],
        SamplingParams(max_new_tokens=4, top_logprobs=3),
    )
    assert out.tokens.top is not None and len(out.tokens.top) == len(out.token_ids)
    ids = torch.tensor([list(item.prompt_ids) + out.token_ids])
    with torch.no_grad():
        logits = forward.vl_forward(
            policy.model, ids, torch.ones_like(ids), [v], logits_to_keep=len(out.token_ids) + 1
        )[0]
    want = torch.log_softmax(logits[0, :-1].float(), -1).topk(3, -1)
    for k, (top_ids, top_lps) in enumerate(out.tokens.top):
        assert torch.allclose(torch.tensor(top_lps), want.values[k], atol=1e-4)
        if float((want.values[k][:-1] - want.values[k][1:]).min()) > 1e-3:  # no near-ties
            assert top_ids == want.indices[k].tolist()
        if out.token_ids[k] in top_ids:  # the sampled token's entry is its recorded log-prob
            assert abs(top_lps[top_ids.index(out.token_ids[k])] - out.logprobs[k]) < 1e-5


@pytest.mark.parametrize("freeze", [False, True], ids=["trainable", "frozen"])
def test_one_update_changes_the_weights(family_dir, vl_rows, freeze, one_thread):
    from polyrl.core.train.algorithms import AlgorithmConfig
    from polyrl.core.train.trainer import update

    _, path = family_dir
    policy = _policy(path, args={"freeze_vision": freeze}, optim={"lr": 1e-3, "warmup_steps": 0})
    items = [it for it in _dataset(policy, vl_rows) if it.vision is not None]
    record = _rollout(policy, items, n=2, max_new_tokens=3)
    sign = torch.tensor([1.0, -1.0]).repeat(len(items))[:, None]
    record["advantages"] = sign * record["loss_mask"].float()
    p = forward.parts(policy.model)
    before = {
        "visual": [t.detach().clone() for t in p.visual.parameters()],
        "lm": [t.detach().clone() for t in p.language_model.parameters()],
    }
    out = update(policy, record, AlgorithmConfig())
    assert out["skipped_nonfinite"] == 0.0 and out["grad_norm"] > 0
    changed = {
        k: any(
            not torch.equal(a, b)
            for a, b in zip(
                before[k],
                (p.visual if k == "visual" else p.language_model).parameters(),
                strict=True,
            )
        )
        for k in before
    }
    assert changed["lm"]
    assert changed["visual"] == (not freeze)


def test_videos_match_the_processor_and_the_families_forward(family_dir, one_thread):
    """A video (5 frames at 1 fps: an odd count, padded) and an image in one prompt: the
    loader's ids equal the real processor's (Qwen3-VL: a ``<t seconds>`` text stamp and a
    start/end pair per temporal step, from the frames' times), and the policy's log-probs
    of sampled responses equal the engine's and the family's own forward on the
    processor's inputs (Qwen3-VL: image and video deepstack features joined)."""
    from PIL import Image
    from transformers.video_utils import VideoMetadata

    from polyrl.multimodal.engine import VLEngine

    family, path = family_dir
    policy = _policy(path)
    proc = policy.processor
    frames = [Image.new("RGB", (56, 84), (40 * k, 200 - 30 * k, 60)) for k in range(5)]
    image = Image.new("RGB", (84, 56), (30, 30, 200))
    rows = [
        {
            "prompt": "<image>Then <video>What moves?",
            "images": [image],
            "videos": [frames],
            "video_fps": 1,
            "answer": "a",
        }
    ]
    item = _dataset(policy, rows)[0]
    grid = item.vision.video_grids()[0]
    assert grid[0] == 3  # 5 frames: padded to 3 temporal steps
    text = proc.apply_chat_template(
        [
            {
                "role": "user",
                "content": [
                    {"type": "image"},
                    {"type": "text", "text": "Then "},
                    {"type": "video"},
                    {"type": "text", "text": "What moves?"},
                ],
            }
        ],
        tokenize=False,
        add_generation_prompt=True,
    )
    # the processor gets the frames and image as the loader resized them (its own video
    # resizing differs by family: Qwen3-VL's budgets pixels over all frames)
    v, images, videos = vision.process_frames(
        item.vision, proc.image_processor, proc.video_processor
    )
    meta = VideoMetadata(total_num_frames=5, fps=1.0, frames_indices=list(range(5)))
    ref = proc(
        text=[text],
        images=images,
        videos=videos,
        return_tensors="pt",
        images_kwargs={"do_resize": False},
        videos_kwargs={
            "video_metadata": [meta],
            "do_sample_frames": False,
            "fps": 1.0,
            "do_resize": False,
        },
        return_mm_token_type_ids=True,
    )
    assert ref["input_ids"][0].tolist() == item.prompt_ids
    shown = policy.tokenizer.decode(item.prompt_ids)
    assert ("<0.5 seconds>" in shown and "<4.0 seconds>" in shown) == (family == "qwen3_vl")
    assert torch.equal(v.video_grid_thw, ref["video_grid_thw"])
    outs = VLEngine(policy, seed=0).generate(
        [Request(list(item.prompt_ids), vision=v)], SamplingParams(n=2, max_new_tokens=4)
    )
    record = text_record(
        prompt_ids=[item.prompt_ids] * 2,
        response_ids=[o.token_ids for o in outs],
        rollout_logprobs=[o.logprobs for o in outs],
        policy=["main"] * 2,
        uid=[0, 0],
        pad_id=policy.tokenizer.pad_token_id,
    )
    set_strings(record, "vision", [v, v])
    with torch.no_grad():
        logp, _ = policy.logprobs(record)
    m = record["response_mask"].bool()
    assert float((logp[m] - record["rollout_logprobs"][m]).abs().max()) <= 1e-4
    response = record["response_ids"][0][m[0]]
    ids = torch.cat([ref["input_ids"][0], response])[None]
    types = torch.cat([ref["mm_token_type_ids"][0], torch.zeros_like(response)])[None]
    extra = (
        {"second_per_grid_ts": torch.tensor(item.vision.second_per_grid())}
        if family == "qwen2_5_vl"
        else {}
    )
    with torch.no_grad():
        full = policy.model(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            pixel_values=ref["pixel_values"],
            image_grid_thw=ref["image_grid_thw"],
            pixel_values_videos=ref["pixel_values_videos"],
            video_grid_thw=ref["video_grid_thw"],
            mm_token_type_ids=types,
            **extra,
        ).logits[0]
        mine, _, _ = forward.vl_forward(
            policy.model, ids, torch.ones_like(ids), [v], logits_to_keep=ids.shape[1]
        )
    # every position, the vision ones too (with one LM layer, deepstack shows only there)
    assert torch.allclose(mine[0], full, atol=1e-5), (mine[0] - full).abs().max()
    theirs = torch.log_softmax(full[-len(response) - 1 : -1].float(), -1)
    theirs = theirs.gather(-1, response[:, None])[:, 0]
    assert torch.allclose(logp[0][m[0]], theirs, atol=1e-5), (logp[0][m[0]] - theirs).abs().max()
