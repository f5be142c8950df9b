"""Images through the gateway: an agent written against the ``openai`` client sends
``image_url`` data URLs to a VLM policy (issue 21 meets the gateway).

The agent has the 3-turn conversation of ``tests/multimodal/test_vl_turns.py`` (an image
with the question, a tool message with a second image, then "Answer now."), sent the way
OpenAI clients send images. On tiny Qwen2.5-VL and Qwen3-VL with the real ``hf_vl``
engine: the turns are stitched, the last row's ids equal the real processor's on the
whole conversation, its images sit at the processor's places, and the trainer's log-probs
equal the engine's (1e-5, float32). Bad image parts get a 400 that says what to send.
"""

from __future__ import annotations

import base64
import io

import openai
import pytest
import torch

from polyrl.core.record import strings
from polyrl.core.rollout.engine import SamplingParams
from tests.helpers import vl_turns as REF

RESULTS: dict = {}
HERE = "tests.agents.test_gateway_images"


def data_url(img) -> str:
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def image_part(img) -> dict:
    return {"type": "image_url", "image_url": {"url": data_url(img)}}


# --------------------------------------------------------------------------- agents


def look_twice_agent(row, endpoint):
    """The conversation of test_vl_turns' LookTwice environment, as an OpenAI client."""
    client = endpoint.openai()
    messages = [
        {"role": "user", "content": [image_part(REF.IMAGE_1), {"type": "text", "text": REF.QUESTION}]},
    ]  # fmt: skip
    follow = [
        {"role": "tool", "content": [image_part(REF.IMAGE_2), {"type": "text", "text": "zoomed in"}]},
        {"role": "user", "content": "Answer now."},
    ]  # fmt: skip
    for turn in range(2):
        reply = client.chat.completions.create(
            model=endpoint.model, messages=messages, max_tokens=3
        )
        messages += [{"role": "assistant", "content": reply.choices[0].message.content}]
        messages += [follow[turn]]
    text, logprobs = "", []  # the last turn streamed: hf_vl hands each token on as sampled
    for chunk in client.chat.completions.create(
        model=endpoint.model, messages=messages, max_tokens=3, stream=True, logprobs=True
    ):
        for c in chunk.choices:
            text += c.delta.content or ""
            logprobs += [e.logprob for e in (c.logprobs.content if c.logprobs else None) or []]
    RESULTS[("streamed", endpoint.episode)] = (text, logprobs)
    return 1.0


def bad_images_agent(row, endpoint):
    client = endpoint.openai()
    big = REF.image(300, 300, 7)
    cases = {
        "http": [{"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}}],
        "base64": [{"type": "image_url", "image_url": {"url": "data:image/png;base64,@@@"}}],
        "not_image": [
            {
                "type": "image_url",
                "image_url": {"url": "data:image/png;base64," + base64.b64encode(b"hi").decode()},
            }
        ],
        "big": [image_part(big)],
        "thin": [image_part(REF.image(3000, 10, 8))],  # the processor's aspect-ratio limit
        "many": [image_part(REF.IMAGE_1)] * 3,
        "audio": [{"type": "input_audio", "input_audio": {"data": "", "format": "wav"}}],
    }
    seen = {}
    for case, content in cases.items():
        try:
            client.chat.completions.create(
                model=endpoint.model, messages=[{"role": "user", "content": content}], max_tokens=2
            )
            seen[case] = (200, "")
        except openai.APIStatusError as e:
            seen[case] = (e.status_code, e.body["message"] if isinstance(e.body, dict) else str(e))
    try:
        client.chat.completions.create(
            model="text",
            messages=[{"role": "user", "content": [image_part(REF.IMAGE_1)]}],
            max_tokens=2,
        )
        seen["text_model"] = (200, "")
    except openai.APIStatusError as e:
        seen["text_model"] = (e.status_code, e.body["message"])
    reply = client.chat.completions.create(  # the episode goes on after the errors
        model=endpoint.model,
        messages=[{"role": "user", "content": [image_part(REF.IMAGE_1), {"type": "text", "text": "ok?"}]}],
        max_tokens=2,
    )  # fmt: skip
    RESULTS[("bad", endpoint.episode)] = (seen, reply.choices[0].message.content)
    return 0.0


# --------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module", params=REF.FAMILIES)
def vl_policy(request, tmp_path_factory):
    import polyrl.multimodal  # noqa: F401
    from polyrl.core.config import from_dict
    from polyrl.core.train.policy import PolicyConfig
    from polyrl.multimodal.policy import QwenVLPolicy
    from polyrl.multimodal.tiny import tiny_qwen_vl

    path = tmp_path_factory.mktemp("gw-vl") / request.param
    tiny_qwen_vl(path, family=request.param, **REF.TINY)
    cfg = from_dict(PolicyConfig, {"model": str(path), "kind": "qwen_vl"})
    return QwenVLPolicy("main", cfg, total_steps=1, need_reference=False)


def _gateway(policies: dict, agent: str, main_engine=None, **args):
    from polyrl.agents.gateway import Gateway
    from polyrl.core.rollout.engine import HFEngine
    from polyrl.core.rollout.workflow import Context
    from polyrl.multimodal.engine import VLEngine

    engines = {
        name: (VLEngine(p, seed=0) if name == "main" else HFEngine(p, seed=0))
        for name, p in policies.items()
    }
    if main_engine is not None:
        engines["main"] = main_engine
    return Gateway(Context(None, policies, engines), agent=f"{HERE}:{agent}", **args)


# --------------------------------------------------------------------------- tests


def _response(rec, i: int) -> list[int]:
    return rec["response_ids"][i][rec["response_mask"][i].bool()].tolist()


def test_image_turns_through_the_openai_client_are_exact(vl_policy, items):
    _check_look_twice(vl_policy, items, None)


@pytest.mark.vllm
def test_image_turns_through_the_gateway_on_vllm(vl_policy, items):
    """The same on ``vllm_vl``: vLLM gets each prompt's images recovered from the
    joined pixel values; the trainer's log-probs still equal the engine's within 1e-5."""
    pytest.importorskip("vllm")
    from polyrl.multimodal.vllm_engine import VLLMVLEngine

    engine = VLLMVLEngine(vl_policy, seed=0, max_model_len=512, kv_cache_gb=0.0625)
    try:
        _check_look_twice(vl_policy, items, engine)
    finally:
        engine.close()


def _check_look_twice(policy, items, engine) -> None:
    wf = _gateway({"main": policy}, "look_twice_agent", main_engine=engine)
    try:
        rec = wf.rollout(items([{"prompt": "look"}]), SamplingParams(n=2, max_new_tokens=3))
    finally:
        wf.close()
    assert rec["valid"].all() and rec.batch_size[0] == 6  # 2 episodes x 3 turns
    metas, visions = strings(rec, "meta"), strings(rec, "vision")
    for i, (m, v) in enumerate(zip(metas, visions, strict=True)):
        assert v.num_images == (1 if m["turn"] == 0 else 2)
        assert m["stitched"] == (m["turn"] > 0), (i, m)
    for ep in {m["episode"] for m in metas}:
        rows = sorted((m["turn"], i) for i, m in enumerate(metas) if m["episode"] == ep)
        actions = [_response(rec, i) for _, i in rows]
        last = rows[-1][1]
        text, logprobs = RESULTS[("streamed", ep)]  # the streamed turn is the record's row
        assert text == strings(rec, "response_text")[last]
        want = rec["rollout_logprobs"][last][: len(actions[-1])]
        assert torch.allclose(torch.tensor(logprobs), want, atol=1e-6)
        ref_ids, types, ref = REF.processor_ids(policy.processor, actions)
        assert REF.row_ids(rec, last) == ref_ids
        v = visions[last]
        assert torch.equal(v.image_grid_thw, ref["image_grid_thw"])
        assert torch.allclose(v.pixel_values, ref["pixel_values"])
        types = types[0].tolist()  # 1: the processor's image tokens, in the spliced row
        for start, g in zip(v.image_starts, v.image_grid_thw, strict=True):
            n = int(g.prod()) // 4
            assert types[start : start + n] == [1] * n and types[start - 1] == 0
    REF.check_logprobs(policy, rec)


def test_bad_image_parts_are_told_and_the_episode_goes_on(vl_policy, items, grid_model_dir):
    from polyrl.core.train.policy import CausalLMPolicy, PolicyConfig

    text = CausalLMPolicy(
        "text", PolicyConfig(model=grid_model_dir), total_steps=1, need_reference=False
    )
    wf = _gateway(
        {"main": vl_policy, "text": text},
        "bad_images_agent",
        max_images=2,
        max_pixels=200 * 200,
    )
    try:
        rec = wf.rollout(items([{"prompt": "x"}]), SamplingParams(n=1, max_new_tokens=2))
    finally:
        wf.close()
    seen, reply = RESULTS[("bad", strings(rec, "meta")[0]["episode"])]
    expect = {
        "http": "not a base64 data URL",
        "base64": "does not decode",
        "not_image": "no image PIL can read",
        "big": "300x300 image exceeds the request's pixel limit",
        "thin": "cannot take an image of the request: absolute aspect ratio",
        "many": "more than rollout.args.max_images=2",
        "audio": "'input_audio' is not supported",
        "text_model": "takes no images",
    }
    for case, needle in expect.items():
        status, msg = seen[case]
        assert status == 400 and needle in msg, (case, status, msg)
    assert rec["valid"].all() and rec.batch_size[0] == 1  # only the good request is a row
    assert strings(rec, "vision")[0].num_images == 1 and isinstance(reply, str)
