"""The ``hf_vl`` engine decodes through the core's loop (``HFEngine.decode``) with the
Qwen-VL family's prefill and step: its tokens and log-probs are checked against references
computed without PolyRL's VL code (transformers' own ``generate`` and forward, images
included), and the core loop's finished-row dropping against decoding the whole chunk."""

from __future__ import annotations

import pytest
import torch

from polyrl.core.rollout.engine import Request, SamplingParams
from polyrl.multimodal import vision
from polyrl.multimodal.engine import VLEngine


@pytest.fixture
def requests(vl_dataset):
    policy, ds = vl_dataset
    out = []
    for item in ds:
        v = (
            vision.process(item.vision, policy.processor.image_processor)[0]
            if item.vision
            else None
        )
        out.append(Request(list(item.prompt_ids), vision=v))
    return policy, out


def _model_inputs(model, request: Request) -> dict:
    """One prompt as transformers' Qwen-VL forward and ``generate`` take it (the image
    placeholders marked as such: ``mm_token_type_ids``)."""
    ids = torch.tensor([request.prompt])
    extra = {}
    if request.vision is not None:
        extra = {
            "pixel_values": request.vision.pixel_values,
            "image_grid_thw": request.vision.image_grid_thw,
        }
    kinds = (ids == model.config.image_token_id).int()
    return {
        "input_ids": ids,
        "attention_mask": torch.ones_like(ids),
        "mm_token_type_ids": kinds,
        **extra,
    }


def test_greedy_tokens_equal_transformers_generate(requests, one_thread):
    """Greedy, prompts with one image, two images and none, decoded in one batch (left
    padding, shared KV cache): each row's tokens are those transformers' ``generate``
    gives for its prompt alone."""
    policy, reqs = requests
    tok = policy.tokenizer
    outs = VLEngine(policy, seed=0).generate(reqs, SamplingParams(temperature=0, max_new_tokens=8))
    assert len(outs) == len(reqs)
    for c, r in zip(outs, reqs, strict=True):
        with torch.no_grad():
            want = policy.model.generate(
                **_model_inputs(policy.model, r),
                max_new_tokens=8,
                do_sample=False,
                eos_token_id=tok.eos_token_id,
                pad_token_id=tok.pad_token_id,
            )[0, len(r.prompt) :]
        assert c.token_ids == want.tolist()[: len(c.token_ids)]
        assert len(c.token_ids) == len(want)  # both stop on eos or run the full budget


def test_sampled_logprobs_equal_a_full_forward(requests, one_thread):
    """Sampled at temperature 0.7 with n=2: each token's recorded log-prob is its log-prob
    under the model's own forward over prompt + response (images included), at 0.7."""
    policy, reqs = requests
    params = SamplingParams(n=2, temperature=0.7, max_new_tokens=6, seed=3)
    outs = VLEngine(policy, seed=0).generate(reqs, params)
    assert len(outs) == 2 * len(reqs)
    for c in outs:
        r = reqs[c.prompt_index]
        inputs = _model_inputs(policy.model, Request(r.prompt + c.token_ids, vision=r.vision))
        with torch.no_grad():
            logits = policy.model(**inputs).logits[0, len(r.prompt) - 1 : -1]
        logp = torch.log_softmax(logits.float() / 0.7, -1)
        want = logp.gather(-1, torch.tensor(c.token_ids)[:, None]).squeeze(-1)
        assert torch.allclose(torch.tensor(c.logprobs), want, atol=1e-4)


def test_finished_rows_leaving_the_batch_change_no_sample(requests, one_thread):
    """Per-request budgets of 1 to 7 tokens end rows early, so the core loop drops them
    from the decode batch: the samples equal decoding the whole chunk to its end
    (``drop_finished: false``), because a chunk draws one number per row per step either
    way; and the budgets hold."""
    policy, reqs = requests
    budgets = [1, 3, 5, 7]
    asks = [
        Request(r.prompt, vision=r.vision, max_new_tokens=b)
        for r, b in zip(reqs, budgets, strict=True)
    ]
    params = SamplingParams(n=3, temperature=1.0, max_new_tokens=7)
    dropping = VLEngine(policy, seed=5).generate(asks, params)
    whole = VLEngine(policy, seed=5, drop_finished=False).generate(asks, params)
    assert [c.token_ids for c in dropping] == [c.token_ids for c in whole]
    for a, b in zip(dropping, whole, strict=True):
        assert torch.allclose(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-5)
        assert len(a.token_ids) <= budgets[a.prompt_index]


def test_merged_calls_are_refused(requests):
    """A VL engine serves no merged multi-policy call: the batcher never groups it
    (no mix key), and a direct call says why."""
    policy, reqs = requests
    engine = VLEngine(policy)
    assert engine.mix_key() is None
    with pytest.raises(TypeError, match="no merged calls"):
        engine.generate_mixed([(engine, reqs)], SamplingParams())
