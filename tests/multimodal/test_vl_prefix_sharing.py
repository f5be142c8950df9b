"""Images in the shared prefix: a VL micro-batch's rows that share a prompt and its image
compute them once (:func:`polyrl.multimodal.forward.shared_logprobs`).

The reference is today's padded VL pass (every row's prompt, image features placed per
row): values, entropies and gradients (full fine-tune and LoRA) must equal it for
Qwen2.5-VL and Qwen3-VL (deepstack features), sdpa and eager. Tiny models built from
their configs, once per module.
"""

from __future__ import annotations

import copy

import pytest
import torch

from polyrl.core.record import pad_left, pad_right
from polyrl.multimodal import forward, vision
from polyrl.multimodal.policy import ResponseScorer

VOCAB, IMG, VID, START, END = 64, 60, 61, 62, 63
TEXT = {
    "vocab_size": VOCAB,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 2,
}
TOKENS = dict(
    image_token_id=IMG, video_token_id=VID, vision_start_token_id=START, vision_end_token_id=END
)


def _qwen2_5_vl(attn):
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    cfg = Qwen2_5_VLConfig(
        text_config={
            **TEXT,
            "rope_parameters": {
                "rope_type": "default",
                "rope_theta": 10000.0,
                "mrope_section": [4, 6, 6],
            },
        },
        vision_config={
            "depth": 2,
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_heads": 2,
            "out_hidden_size": 64,
            "fullatt_block_indexes": [1],
            "window_size": 56,
        },
        **TOKENS,
    )
    cfg._attn_implementation = attn
    return Qwen2_5_VLForConditionalGeneration(cfg), 14


def _qwen3_vl(attn):
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

    cfg = Qwen3VLConfig(
        text_config={
            **TEXT,
            "head_dim": 32,
            "rope_parameters": {
                "rope_type": "default",
                "rope_theta": 10000.0,
                "mrope_section": [6, 5, 5],
                "mrope_interleaved": True,
            },
        },
        vision_config={
            "depth": 2,
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_heads": 2,
            "out_hidden_size": 64,
            "deepstack_visual_indexes": [0],
            "num_position_embeddings": 64,
            "patch_size": 16,
        },
        **TOKENS,
    )
    cfg._attn_implementation = attn
    return Qwen3VLForConditionalGeneration(cfg), 16


BUILDERS = {"qwen2.5-vl": _qwen2_5_vl, "qwen3-vl": _qwen3_vl}
CASES = [("qwen2.5-vl", "sdpa"), ("qwen3-vl", "sdpa"), ("qwen3-vl", "eager")]


@pytest.fixture(scope="module")
def models():
    """One tiny model per (family, attention), with its patch size; built on first use."""
    built = {}

    def get(family, attn):
        if (family, attn) not in built:
            torch.manual_seed(0)
            model, patch = BUILDERS[family](attn)
            built[family, attn] = model.eval(), patch
        return built[family, attn]

    return get


GRIDS = {  # c has a's grid (same token ids in the prompt) but other pixels
    "a": torch.tensor([[1, 8, 8]]),
    "b": torch.tensor([[1, 4, 4], [1, 4, 8]]),
    "c": torch.tensor([[1, 8, 8]]),
}


def _prompt(key):
    ids = [1, 2, 3, 4, 5, START]
    for t, h, w in GRIDS[key].tolist():
        ids += [IMG] * (t * h * w // 4) + [END, 3]
    return ids + [4, 5, 6, 7, 8]


def vl_batch(patch, seed=0):
    """A group of 4 rows on image a, a group of 3 on the two images b, one row on c, a
    text-only row (all start with the same 5 tokens), and a row whose response holds a
    sampled image-token id (text, not an image)."""
    gen = torch.Generator().manual_seed(seed)
    dim = 3 * 2 * patch * patch
    inputs = {
        k: vision.VisionInputs(k, torch.randn(int(g.prod(-1).sum()), dim, generator=gen), g)
        for k, g in GRIDS.items()
    }
    keys = ["a"] * 4 + ["b"] * 3 + ["c", None]
    prompts = [_prompt(k) if k else list(range(1, 21)) for k in keys]
    responses = [
        torch.randint(1, 60, (int(torch.randint(1, 9, (1,), generator=gen)),), generator=gen)
        for _ in keys
    ]
    responses[1][0] = IMG
    prompt_ids, prompt_mask = pad_left(prompts, 0)
    response_ids = pad_right([r.tolist() for r in responses], 0, torch.long)
    response_mask = pad_right([[1] * len(r) for r in responses], 0, torch.long)
    batch = {
        "prompt_ids": prompt_ids,
        "prompt_mask": prompt_mask,
        "response_ids": response_ids,
        "response_mask": response_mask,
    }
    return batch, [inputs[k] if k else None for k in keys]


def _loss_and_grads(model, scorer, batch, rows, weights):
    """Log-probs, entropies and the gradients of a loss over both, per trainable weight."""
    model.zero_grad(set_to_none=True)
    logp, ent = scorer(batch, rows, 0.8, True)
    m = batch["response_mask"].float()
    ((logp * weights + 0.1 * ent) * m).sum().backward()
    grads = {n: w.grad.clone() for n, w in model.named_parameters() if w.grad is not None}
    return logp.detach() * m, ent.detach() * m, grads


def _takes_the_tree_pass(model, batch, rows, min_shared=4) -> bool:
    """Whether :func:`forward.shared_logprobs` runs (rather than leaving it to the padded
    pass) on ``batch``."""
    ids = torch.cat([batch["prompt_ids"], batch["response_ids"]], 1)
    mask = torch.cat([batch["prompt_mask"], batch["response_mask"]], 1)
    placed = forward.row_positions(
        forward.parts(model), batch["prompt_ids"], batch["prompt_mask"], ids, mask, rows
    )
    with torch.no_grad():
        out = forward.shared_logprobs(model, batch, rows, placed, min_shared=min_shared)
    return out is not None


def _assert_same(shared, padded):
    (lp_s, ent_s, g_s), (lp_p, ent_p, g_p) = shared, padded
    assert torch.allclose(lp_s, lp_p, atol=2e-5), (lp_s - lp_p).abs().max()
    assert torch.allclose(ent_s, ent_p, atol=2e-5), (ent_s - ent_p).abs().max()
    assert g_s.keys() == g_p.keys() and g_p
    for name, g in g_p.items():
        scale = g.abs().max().clamp(min=1e-3)
        err = (g_s[name] - g).abs().max() / scale
        assert err < 1e-4, (name, float(err))


@pytest.mark.parametrize(("family", "attn"), CASES, ids=[f"{f}-{a}" for f, a in CASES])
def test_shared_vl_pass_equals_the_padded_pass(models, family, attn, one_thread):
    """Values, entropies and every weight's gradient (vision tower included) equal the
    padded pass; the shared pass really shares (fewer distinct tokens than real ones) and
    runs the vision tower once, on each distinct image once."""
    model, patch = models(family, attn)
    batch, rows = vl_batch(patch)
    weights = torch.randn(batch["response_ids"].shape, generator=torch.Generator().manual_seed(1))
    ids = torch.cat([batch["prompt_ids"], batch["response_ids"]], 1)
    mask = torch.cat([batch["prompt_mask"], batch["response_mask"]], 1)
    p = forward.parts(model)
    _, image_mask, video_mask = forward.row_positions(
        p, batch["prompt_ids"], batch["prompt_mask"], ids, mask, rows
    )
    marked, _ = forward.mark_media(p, ids, rows, image_mask, video_mask)
    plan = forward.shared_units(
        model, marked, batch["prompt_mask"], batch["response_mask"], min_shared=4
    )
    assert plan is not None
    units, _, lengths = plan
    repeated = 3 * len(_prompt("a")) + 2 * len(_prompt("b"))  # prompts of a, b once each
    assert sum(u.distinct for u in units) <= int(lengths.sum()) - repeated
    before = {k: vision.COUNTERS[k] for k in ("vision_passes", "vision_images")}
    shared = _loss_and_grads(model, ResponseScorer(model, True, 4), batch, rows, weights)
    assert vision.COUNTERS["vision_passes"] == before["vision_passes"] + 1
    assert vision.COUNTERS["vision_images"] == before["vision_images"] + 4  # a, b (2), c
    padded = _loss_and_grads(model, ResponseScorer(model, False), batch, rows, weights)
    _assert_same(shared, padded)


@pytest.mark.parametrize("family", list(BUILDERS))
def test_shared_vl_pass_lora_gradients_equal_the_padded_pass(models, family, one_thread):
    """LoRA adapters on the language model and the vision tower: the adapters' gradients
    and the values equal the padded pass; so do the reference values (adapter off)."""
    from peft import LoraConfig, get_peft_model

    base, patch = models(family, "sdpa")
    model = get_peft_model(
        copy.deepcopy(base),
        LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "qkv"]),
    )
    for name, w in model.named_parameters():  # B starts at 0: give the adapters an effect
        if "lora_B" in name:
            torch.nn.init.normal_(w, std=0.02)
    batch, rows = vl_batch(patch, seed=1)
    assert _takes_the_tree_pass(model, batch, rows)  # through the PEFT wrapper too
    weights = torch.randn(batch["response_ids"].shape, generator=torch.Generator().manual_seed(2))
    shared = _loss_and_grads(model, ResponseScorer(model, True, 4), batch, rows, weights)
    padded = _loss_and_grads(model, ResponseScorer(model, False), batch, rows, weights)
    assert any("visual" in n for n in padded[2]) and all("lora_" in n for n in padded[2])
    _assert_same(shared, padded)
    with torch.no_grad(), model.disable_adapter():
        ref_s = ResponseScorer(model, True, 4)(batch, rows, 1.0, False)[0]
        ref_p = ResponseScorer(model, False)(batch, rows, 1.0, False)[0]
    m = batch["response_mask"].bool()
    assert torch.allclose(ref_s[m], ref_p[m], atol=2e-5)


def test_images_are_told_apart_by_their_inputs_not_their_token_ids(models, one_thread):
    """Rows on images a and c have the same prompt ids; their marks agree up to the first
    image token and differ at every image token after it; rows of one image agree; each
    distinct image goes to the vision tower once."""
    model, patch = models("qwen2.5-vl", "sdpa")
    batch, rows = vl_batch(patch)
    p = forward.parts(model)
    ids = torch.cat([batch["prompt_ids"], batch["response_ids"]], 1)
    image_mask = torch.cat(
        [forward.token_mask(p, batch["prompt_ids"]), torch.zeros_like(batch["response_ids"]) > 0],
        1,
    )
    marked, (images, videos) = forward.mark_media(p, ids, rows, image_mask, image_mask & False)
    plen = batch["prompt_ids"].shape[1]
    a, c = marked[0, :plen], marked[7, :plen]
    assert torch.equal(batch["prompt_ids"][0], batch["prompt_ids"][7])
    assert torch.equal(marked[0, :plen], marked[3, :plen])
    img = image_mask[0, :plen]
    assert torch.equal(a[~img], c[~img]) and bool((a[img] != c[img]).all())
    assert bool((a[img] < 0).all()) and len(set(a[img].tolist())) == int(img.sum())
    assert int(marked[1, plen]) == IMG  # a sampled image-token id stays text
    grids = [g.tolist() for _, g in images]  # a, b's two, c: each once, in row order
    assert grids == [[1, 8, 8], [1, 4, 4], [1, 4, 8], [1, 8, 8]] and videos == []
    assert torch.equal(images[3][0], rows[7].pixel_values)


def test_rows_that_share_too_little_keep_the_padded_pass(models, one_thread):
    """Prompts that share under ``min_shared`` tokens: no plan, the padded pass's values."""
    model, patch = models("qwen2.5-vl", "sdpa")
    batch, rows = vl_batch(patch)
    keep = [0, 4, 8]  # one row of a, of b, and the text row: 5 tokens in common
    batch = {k: v[keep] for k, v in batch.items()}
    rows = [rows[i] for i in keep]
    assert not _takes_the_tree_pass(model, batch, rows, min_shared=16)
    with torch.no_grad():
        got = ResponseScorer(model, True)(batch, rows, 1.0, False)[0]
        want = ResponseScorer(model, False)(batch, rows, 1.0, False)[0]
    assert torch.equal(got, want)


def episode_batch(patch, seed=0):
    """``step`` rows of one episode: turn t's prompt is turn t-1's prompt, response and an
    observation; image A in the first prompt, image B in turn 1's observation. Each row
    has its own key and its own VisionInputs (all its images so far, placed by
    ``image_starts``), as multi-turn workflows write them; turn 1 is sampled twice."""
    gen = torch.Generator().manual_seed(seed)
    dim = 3 * 2 * patch * patch
    grid_a, grid_b = [1, 8, 8], [1, 4, 8]
    pix_a = torch.randn(64, dim, generator=gen)
    pix_b = torch.randn(32, dim, generator=gen)

    def text(n):
        return torch.randint(1, 60, (n,), generator=gen).tolist()

    prompt = [1, 2, 3, 4, 5, START] + [IMG] * 16 + [END] + text(6)
    starts = [6]
    prompts, responses, rows = [], [], []
    for t in range(3):
        images = 1 if t == 0 else 2
        v = vision.VisionInputs(
            f"episode-turn-{t}",
            torch.cat([pix_a, pix_b][:images]),
            torch.tensor([grid_a, grid_b][:images]),
            image_starts=tuple(starts),
        )
        for _ in range(2 if t == 1 else 1):
            prompts.append(list(prompt))
            responses.append(text(int(torch.randint(2, 7, (1,), generator=gen))))
            rows.append(v)
        obs = [9, START] + [IMG] * 8 + [END, 10] if t == 0 else text(3)
        if t == 0:
            starts.append(len(prompt) + len(responses[-1]) + 2)
        prompt = prompt + responses[-1] + obs
    prompt_ids, prompt_mask = pad_left(prompts, 0)
    batch = {
        "prompt_ids": prompt_ids,
        "prompt_mask": prompt_mask,
        "response_ids": pad_right(responses, 0, torch.long),
        "response_mask": pad_right([[1] * len(r) for r in responses], 0, torch.long),
    }
    return batch, rows


@pytest.mark.parametrize("family", list(BUILDERS))
def test_multi_turn_rows_share_their_history_and_its_images(models, family, one_thread):
    """Step rows whose VisionInputs differ (keys, objects, image counts) share the history
    and its image A: the tower sees A and B once each (the padded pass: A three times), and
    values, entropies and gradients equal the padded pass."""
    model, patch = models(family, "sdpa")
    batch, rows = episode_batch(patch)
    weights = torch.randn(batch["response_ids"].shape, generator=torch.Generator().manual_seed(3))
    before = vision.COUNTERS["vision_images"]
    shared = _loss_and_grads(model, ResponseScorer(model, True, 4), batch, rows, weights)
    assert vision.COUNTERS["vision_images"] == before + 2
    padded = _loss_and_grads(model, ResponseScorer(model, False), batch, rows, weights)
    assert vision.COUNTERS["vision_images"] == before + 2 + 5  # keys: A, A+B, A+B
    _assert_same(shared, padded)
