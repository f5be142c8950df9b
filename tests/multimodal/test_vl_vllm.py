"""The ``vllm_vl`` engine (CPU, float32): vLLM with images samples what the trainer scores.

Records are built by the ``vl_single_turn`` workflow itself, so the engine sees exactly the
prompt ids, resized images and grouping a training run gives it. One engine serves the
module (vLLM's state is process-global; start-up is the slow part).
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

pytest.importorskip("vllm")

from polyrl.core.record import set_strings, strings  # noqa: E402
from polyrl.core.rollout.engine import Request, SamplingParams  # noqa: E402
from polyrl.core.rollout.workflow import Context  # noqa: E402
from polyrl.multimodal.engine import VLEngine  # noqa: E402
from polyrl.multimodal.vision import process  # noqa: E402
from polyrl.multimodal.vllm_engine import VLLMVLEngine, collapse_image_pads  # noqa: E402
from polyrl.multimodal.workflow import VLSingleTurn  # noqa: E402

pytestmark = pytest.mark.vllm


def _rows() -> list[dict]:
    """One image, two images of other sizes, text only, and a second 56x56 image (the
    first row's image size, in another colour)."""
    from PIL import Image, ImageDraw

    def img(w: int, h: int, colour: tuple, mark: tuple) -> Image.Image:
        im = Image.new("RGB", (w, h), colour)
        ImageDraw.Draw(im).ellipse((w // 4, h // 4, 3 * w // 4, 3 * h // 4), fill=mark)
        return im

    return [
        {
            "prompt": "<image>What colour is the square?",
            "images": [img(56, 56, (200, 30, 30), (10, 10, 250))],
            "answer": "red",
        },
        {
            "prompt": "Compare <image> and <image>. How many circles?",
            "images": [
                img(84, 112, (30, 30, 200), (250, 250, 0)),
                img(112, 56, (30, 160, 40), (0, 0, 0)),
            ],
            "answer": "2",
        },
        {"prompt": "How many circles?", "images": [], "answer": "0"},
        {
            "prompt": "<image>What colour is the square?",
            "images": [img(56, 56, (20, 220, 60), (250, 250, 250))],
            "answer": "green",
        },
    ]


@pytest.fixture(scope="module")
def policy(tiny_vl_dir):
    from polyrl.core.config import from_dict
    from polyrl.core.train.policy import PolicyConfig
    from polyrl.multimodal.policy import QwenVLPolicy

    cfg = from_dict(PolicyConfig, {"model": tiny_vl_dir, "kind": "qwen_vl"})
    return QwenVLPolicy("main", cfg, total_steps=1, need_reference=False)


@pytest.fixture(scope="module")
def items(policy) -> list:
    from polyrl.core.rollout.data import DataConfig
    from polyrl.multimodal.data import VLDataset

    cfg = DataConfig(kind="vl", args={"min_pixels": 56 * 56, "max_pixels": 112 * 112})
    return list(VLDataset(cfg, policy.tokenizer, name="t", rows=_rows()))


@pytest.fixture(scope="module")
def engine(policy):
    eng = VLLMVLEngine(policy, seed=0, max_model_len=256, kv_cache_gb=0.0625)
    print(f"vllm_vl engine start-up: {eng.startup_s:.1f} s")
    yield eng
    eng.close()


def rollout(policy, engine, items, params: SamplingParams):
    ctx = Context(cfg=None, policies={"main": policy}, engines={"main": engine})
    return VLSingleTurn(ctx).rollout(items, params)


def trainer_vs_engine(policy, record, temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(trainer's recomputed log-probs, engine's log-probs) over the response tokens."""
    with torch.no_grad():
        lp, _ = policy.logprobs(record, temperature)
    m = record["response_mask"].bool()
    return lp[m], record["rollout_logprobs"][m]


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_logprobs_with_images_match_the_trainer(policy, engine, items, temperature):
    n = 4
    record = rollout(
        policy, engine, items, SamplingParams(n=n, temperature=temperature, max_new_tokens=8)
    )
    assert record["uid"].tolist() == [it.uid for it in items for _ in range(n)]
    trainer, rollout_lp = trainer_vs_engine(policy, record, temperature)
    diff = (trainer - rollout_lp).abs()
    print(
        f"T={temperature}: |vllm_vl - trainer| mean {diff.mean():.2e}, max {diff.max():.2e} "
        f"over {diff.numel()} tokens"
    )
    assert diff.mean() <= 1e-3 and diff.max() <= 1e-2

    # The match is not vacuous: scored under another image of the same size (prompt 3's),
    # prompt 0's samples get clearly other log-probs.
    visions = list(strings(record, "vision"))
    set_strings(record, "vision", [visions[3 * n] if k < n else v for k, v in enumerate(visions)])
    other, _ = trainer_vs_engine(policy, record, temperature)
    rows0 = record["response_mask"][:n].bool().sum()
    wrong = (other[:rows0] - rollout_lp[:rows0]).abs().mean()
    print(f"T={temperature}: prompt 0 scored under the wrong image: mean |dlogp| {wrong:.2e}")
    assert wrong > 20 * diff.mean() and wrong > 1e-3


def test_greedy_equals_hf_vl(policy, engine, items):
    """Both engines process the same prompts (ids, images, M-RoPE positions) the same way:
    greedy answers are equal, and so are the log-probs each reports for them."""
    greedy = SamplingParams(n=2, temperature=0.0, max_new_tokens=10)
    vl = rollout(policy, engine, items, greedy)
    hf = rollout(policy, VLEngine(policy), items, greedy)
    assert torch.equal(vl["response_ids"], hf["response_ids"])
    m = hf["response_mask"].bool()
    diff = (vl["rollout_logprobs"][m] - hf["rollout_logprobs"][m]).abs()
    print(
        f"greedy: |vllm_vl - hf_vl| log-probs mean {diff.mean():.2e}, max {diff.max():.2e} "
        f"over {diff.numel()} tokens"
    )
    assert diff.max() <= 1e-3


def test_text_only_prompts(policy, engine, items):
    text = [it for it in items if it.vision is None]
    assert len(text) == 1
    params = SamplingParams(n=3, max_new_tokens=6)
    outs = engine.generate([Request(list(text[0].prompt_ids))], params)  # no images at all
    assert [o.prompt_index for o in outs] == [0, 0, 0]
    assert all(len(o.token_ids) == len(o.logprobs) >= 1 for o in outs)
    record = rollout(policy, engine, text, params)
    trainer, rollout_lp = trainer_vs_engine(policy, record, 1.0)
    assert (trainer - rollout_lp).abs().mean() <= 1e-3
    assert len(engine.generate([text[0].prompt_ids], params)) == 3  # the plain text interface


def test_mismatched_inputs_are_errors_not_guesses(policy, engine, items):
    with_image = items[0]
    vision, images = process(with_image.vision, policy.processor.image_processor)
    params = SamplingParams(max_new_tokens=1)
    with pytest.raises(ValueError, match="needs the resized images"):
        engine.generate([Request(list(with_image.prompt_ids), vision=vision, images=[])], params)
    # no images given: the engine recovers them from the pixel values (as multi-turn
    # workflows call it), and samples exactly what it samples with the images themselves
    greedy = SamplingParams(max_new_tokens=6, temperature=0.0)
    ids = list(with_image.prompt_ids)
    given = engine.generate([Request(ids, vision=vision, images=images)], greedy)
    recovered = engine.generate([Request(ids, vision=vision)], greedy)
    assert recovered[0].token_ids == given[0].token_ids
    assert recovered[0].logprobs == given[0].logprobs
    with pytest.raises(ValueError, match="image-pad tokens .* beyond its 0 image"):
        engine.generate([Request(ids)], params)
    pad = engine.image_token_id
    assert collapse_image_pads([1, pad, pad, pad, pad, 2, pad, 3], pad, [4, 1]) == [
        1,
        pad,
        2,
        pad,
        3,
    ]
    assert collapse_image_pads([pad, pad, pad], pad, [1, 2]) == [pad, pad]  # touching runs
    with pytest.raises(
        ValueError, match="image 0 needs 4 image-pad tokens at position 0, the prompt has 2"
    ):
        collapse_image_pads([pad, pad, 5], pad, [4])
    with pytest.raises(ValueError, match="for 1 image.* but 2 were given"):
        collapse_image_pads([pad, 5], pad, [1, 1])


def test_sync_pushes_the_vision_tower_and_the_language_model(policy, engine, items):
    """After a change of the vision tower alone, then of every weight, and ``sync()``,
    vLLM's log-probs follow the trainer's again (its cached image features are dropped)."""
    params = SamplingParams(n=3, max_new_tokens=6)
    original = {k: v.clone() for k, v in policy.model.state_dict().items()}
    image_rows = torch.tensor([it.vision is not None for it in items for _ in range(params.n)])
    gen = torch.Generator().manual_seed(0)
    try:
        for scope, scale in (("model.visual.", 0.5), ("", 0.05)):
            rollout(policy, engine, items, params)  # image features of the old weights cached
            with torch.no_grad():
                for name, p in policy.model.named_parameters():
                    if name.startswith(scope):
                        p.add_(scale * torch.randn(p.shape, generator=gen))
            stale = rollout(policy, engine, items, params)
            m = stale["response_mask"].bool() & image_rows[:, None]
            with torch.no_grad():
                lp, _ = policy.logprobs(stale)
            moved = (lp[m] - stale["rollout_logprobs"][m]).abs().mean()
            engine.sync()
            fresh = rollout(policy, engine, items, params)
            new, rollout_lp = trainer_vs_engine(policy, fresh, 1.0)
            follow = (new - rollout_lp).abs()
            print(
                f"sync ({scope or 'all weights'}, {engine.last_sync_s * 1e3:.0f} ms): before "
                f"sync |vLLM - trainer| on image rows {moved:.3f}; after: mean "
                f"{follow.mean():.2e}, max {follow.max():.2e}"
            )
            assert moved > 0.02  # the change is visible ...
            assert follow.mean() <= 1e-3  # ... and vLLM follows it
    finally:
        policy.model.load_state_dict(original)
        engine.sync()


def test_importing_multimodal_does_not_import_vllm():
    code = (
        "import sys, polyrl.multimodal; from polyrl.core.registry import ENGINES; "
        "assert ENGINES.get('vllm_vl').__name__ == 'VLLMVLEngine'; "
        "assert 'vllm' not in sys.modules, 'vllm was imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=300)
