"""Images across the turns of a multi-turn episode, exact (issue 21, part 1).

A 3-turn conversation with an image in the first observation and a tool-returned image in
the second, on tiny Qwen2.5-VL and Qwen3-VL (the real processor and model classes, built
offline), sampled by the real ``hf_vl`` engine through agents' ``multi_turn`` workflow:

- each row's ids equal the real processor's on the whole conversation (its own resize,
  placeholder expansion and chat template; the sampled actions as the assistant turns);
- the trainer's M-RoPE positions equal the model's own ``get_rope_index`` on those ids;
- the trainer's log-probs equal the engine's (1e-5, float32), concat and step rows.
"""

from __future__ import annotations

import pytest
import torch
from PIL import Image

from polyrl.agents.env import Environment, StepResult
from polyrl.agents.tools import ToolCall, ToolEnv, tool, tool_message
from polyrl.core.record import strings
from polyrl.core.registry import ENVIRONMENTS
from polyrl.core.rollout.data import PromptItem
from polyrl.core.rollout.engine import Request, SamplingParams
from polyrl.core.rollout.workflow import Context
from tests.helpers.vl_turns import (
    FAMILIES,
    IMAGE_1,
    IMAGE_2,
    QUESTION,
    TINY,
    actions,
    check_logprobs,
    image,
    processor_ids,
    row_ids,
)


@pytest.fixture(scope="module", params=FAMILIES)
def family_policy(request, tmp_path_factory):
    import polyrl.multimodal  # noqa: F401
    from polyrl.core.config import from_dict
    from polyrl.core.train.policy import PolicyConfig
    from polyrl.multimodal.policy import QwenVLPolicy
    from polyrl.multimodal.tiny import tiny_qwen_vl

    path = tmp_path_factory.mktemp("turns") / request.param
    tiny_qwen_vl(path, family=request.param, **TINY)
    cfg = from_dict(PolicyConfig, {"model": str(path), "kind": "qwen_vl"})
    return QwenVLPolicy("main", cfg, total_steps=10, need_reference=False)


def _rollout(policy, mode: str, seed: int = 0, n: int = 2, **args):
    from polyrl.agents.workflow import MultiTurn
    from polyrl.multimodal.engine import VLEngine

    torch.manual_seed(seed)
    engine = VLEngine(policy, seed=seed)
    ctx = Context(None, {"main": policy}, {"main": engine})
    wf = MultiTurn(ctx, env="test_look_twice", mode=mode, max_turns=3, history=None, **args)
    item = PromptItem(uid=0, prompt_ids=[], prompt_text="", answer=None, row={})
    record = wf.rollout([item], SamplingParams(n=n, temperature=1.0, max_new_tokens=3))
    return wf, record


def test_concat_rows_equal_the_processor_rope_index_and_engine(family_policy, one_thread):
    from polyrl.multimodal import forward

    policy = family_policy
    wf, record = _rollout(policy, "concat")
    visions = list(strings(record, "vision"))
    assert wf.rollout_metrics() == {"images_kept": 4.0, "images_truncated": 0.0, "bad_images": 0.0}
    p = forward.parts(policy.model)
    for i in range(record.batch_size[0]):
        meta = strings(record, "meta")[i]
        assert meta["turns"] == 3 and meta["finish"] == "done"
        v = visions[i]
        assert v.num_images == 2 and v.image_starts is not None
        sampled = [list(a) for a in actions(record, i)]
        ref_ids, types, ref = processor_ids(policy.processor, sampled)
        ids = row_ids(record, i)
        assert ids == ref_ids
        assert torch.equal(v.image_grid_thw, ref["image_grid_thw"])
        assert torch.allclose(v.pixel_values, ref["pixel_values"])
        # positions: the trainer's against the model's own get_rope_index on the processor's ids
        full = torch.tensor([ids])
        own, _ = p.inner.get_rope_index(
            input_ids=full,
            image_grid_thw=ref["image_grid_thw"],
            attention_mask=torch.ones_like(full),
            mm_token_type_ids=types,
        )
        plen = int(record["prompt_mask"][i].sum())
        pos, image_mask, _ = forward.row_positions(
            p,
            full[:, :plen],
            torch.ones(1, plen, dtype=torch.long),
            full,
            torch.ones_like(full),
            [v],
        )
        assert torch.equal(pos, own)
        assert torch.equal(image_mask[0], types[0] == 1)
    check_logprobs(policy, record)


def test_step_rows_keep_every_image_and_match_the_engine(family_policy, one_thread):
    policy = family_policy
    _, record = _rollout(policy, "step", seed=1)
    visions = list(strings(record, "vision"))
    turns = record["turn"].tolist()
    assert sorted(set(turns)) == [0, 1, 2]
    for t, v in zip(turns, visions, strict=True):
        assert v.num_images == (1 if t == 0 else 2)  # turn 2's prompt keeps both images
    check_logprobs(policy, record)


class BadImages(ToolEnv):
    """Tools that return images, run whatever the action: one that returns text where an
    image is declared, one whose image is too large, one returning two images of which the
    episode's image limit keeps one."""

    max_turns = 3

    def __init__(self) -> None:
        def not_image() -> Image.Image:
            """Declared to return an image; returns text."""
            return "no picture today"

        def big() -> Image.Image:
            """An image over the episode's pixel limit."""
            return image(200, 200, 3)

        def two() -> list:
            """Two small images."""
            return ["two views", image(40, 90, 4), image(40, 90, 5)]

        super().__init__([tool(not_image), tool(big), tool(two)])
        self.t = 0

    def reset(self, task):
        return [IMAGE_1, QUESTION]

    async def step(self, action):
        self.t += 1
        if self.t == 1:
            results = [await self.run_call(ToolCall(n, {})) for n in ("not_image", "big")]
            self.tool_errors += sum(not ok for _, ok in results)
            return StepResult(
                [
                    tool_message(n, r)
                    for n, (r, _) in zip(("not_image", "big"), results, strict=True)
                ],
                0.0,
                False,
                {"tool_errors": sum(not ok for _, ok in results)},
            )  # noqa: E501
        if self.t == 2:
            text, ok = await self.run_call(ToolCall("two", {}))
            return StepResult(tool_message("two", text), 0.0, False, {"tool_errors": int(not ok)})
        return StepResult("bye", 1.0, True)


if "test_bad_images" not in ENVIRONMENTS:
    ENVIRONMENTS.register("test_bad_images", BadImages)


def test_bad_and_surplus_images_are_told_counted_and_the_episode_goes_on(family_policy, one_thread):
    from polyrl.agents.workflow import MultiTurn
    from polyrl.multimodal.engine import VLEngine

    policy = family_policy
    ctx = Context(None, {"main": policy}, {"main": VLEngine(policy, seed=0)})
    wf = MultiTurn(ctx, env="test_bad_images", max_turns=3, max_images=2, max_pixels=150 * 150)
    item = PromptItem(uid=0, prompt_ids=[], prompt_text="", answer=None, row={})
    record = wf.rollout([item], SamplingParams(n=2, temperature=1.0, max_new_tokens=3))
    assert wf.rollout_metrics() == {"images_kept": 4.0, "images_truncated": 2.0, "bad_images": 2.0}
    metas = strings(record, "meta")
    for i, v in enumerate(strings(record, "vision")):
        assert metas[i]["finish"] == "done" and metas[i]["turns"] == 3
        assert v.num_images == 2  # the first observation's and the first of the two
        text = policy.tokenizer.decode(row_ids(record, i))
        assert "Error: tool 'not_image' should return an image but returned a str" in text
        assert "Error: the image is 200x200 (40000 pixels), over the limit of 22500" in text
        assert "[image not shown: the episode's limit of 2 images is reached]" in text
    check_logprobs(policy, record)


def test_an_image_for_a_text_only_policy_is_a_clear_error(tmp_path, one_thread):
    from polyrl.agents.workflow import MultiTurn
    from polyrl.core.config import from_dict
    from polyrl.core.demo.tiny import tiny_qwen2
    from polyrl.core.rollout.engine import HFEngine
    from polyrl.core.train.policy import CausalLMPolicy, PolicyConfig

    tiny_qwen2(tmp_path / "m", corpus="vl_shapes", hidden_size=32, num_layers=1, num_heads=1)
    cfg = from_dict(PolicyConfig, {"model": str(tmp_path / "m")})
    policy = CausalLMPolicy("main", cfg, total_steps=1, need_reference=False)
    ctx = Context(None, {"main": policy}, {"main": HFEngine(policy, seed=0)})
    wf = MultiTurn(ctx, env="test_look_twice")
    item = PromptItem(uid=0, prompt_ids=[], prompt_text="", answer=None, row={})
    with pytest.raises(TypeError, match="returned an image but policy 'main'.*cannot take images"):
        wf.rollout([item], SamplingParams(n=1, max_new_tokens=2))


def test_a_sampled_vision_token_in_an_earlier_turn_stays_text(family_policy, one_thread):
    """Text tokens of an earlier turn that hold the image and video placeholder ids (as a
    policy may sample them): the engine continues from that prompt, the trainer's
    positions equal get_rope_index with those tokens typed as text, and the engine's and
    the trainer's log-probs agree."""
    from polyrl.core.record import set_strings, text_record
    from polyrl.multimodal import forward
    from polyrl.multimodal.engine import VLEngine

    policy = family_policy
    _, record = _rollout(policy, "step", n=1)
    p = forward.parts(policy.model)
    visions = list(strings(record, "vision"))
    last = max(range(record.batch_size[0]), key=lambda i: int(record["turn"][i]))
    prompt = record["prompt_ids"][last][record["prompt_mask"][last].bool()].tolist()
    v = visions[last]
    # two text tokens between the images (after the first action) become placeholder ids
    at = v.image_starts[1] - 4
    prompt[at], prompt[at + 1] = p.image_token_id, p.video_token_id
    engine = VLEngine(policy, seed=0)
    torch.manual_seed(0)
    params = SamplingParams(n=2, temperature=1.0, max_new_tokens=3)
    out = engine.generate([Request(prompt, vision=v)], params)
    rec = text_record(
        prompt_ids=[prompt] * 2,
        response_ids=[o.token_ids for o in out],
        rollout_logprobs=[o.logprobs for o in out],
        policy=["main"] * 2,
        uid=[0, 0],
        pad_id=policy.tokenizer.pad_token_id,
    )
    set_strings(rec, "vision", [v, v])
    check_logprobs(policy, rec)
    full = torch.tensor([prompt])
    types = torch.zeros_like(full, dtype=torch.int32)
    for s, g in zip(v.image_starts, v.image_grid_thw, strict=True):
        types[0, s : s + int(g.prod()) // 4] = 1
    own, _ = p.inner.get_rope_index(
        input_ids=full,
        image_grid_thw=v.image_grid_thw,
        attention_mask=torch.ones_like(full),
        mm_token_type_ids=types,
    )
    pos, image_mask, video_mask = forward.row_positions(
        p, full, torch.ones_like(full), full, torch.ones_like(full), [v]
    )
    assert torch.equal(pos, own)
    assert not bool(image_mask[0, at]) and not bool(video_mask.any())


def test_images_are_recovered_exactly_from_their_pixel_values(family_policy):
    """What vllm_vl hands vLLM for a multi-turn row: the processor's own resized 8-bit
    images, recovered from the pixel values; processed again without resizing they give
    the same pixel values bit for bit. Pixels that are not 8-bit images are an error."""
    import dataclasses

    from polyrl.multimodal.images import ImageError
    from polyrl.multimodal.vision import recover_images

    policy = family_policy
    _, inputs = policy.encode_images([IMAGE_1, IMAGE_2])
    images = recover_images(inputs, policy.processor.image_processor)
    assert [im.size for im in images] == list(inputs.resized)
    again = policy.processor.image_processor(images=images, do_resize=False, return_tensors="pt")
    assert torch.equal(again["pixel_values"], inputs.pixel_values)
    assert torch.equal(again["image_grid_thw"], inputs.image_grid_thw)
    noisy = dataclasses.replace(inputs, pixel_values=inputs.pixel_values + 0.01)
    with pytest.raises(ImageError, match="image 0's pixel values do not come from 8-bit"):
        recover_images(noisy, policy.processor.image_processor)
    half = dataclasses.replace(inputs, pixel_values=inputs.pixel_values.bfloat16())
    with pytest.raises(ImageError, match="float32 pixel values"):
        recover_images(half, policy.processor.image_processor)


def test_vllm_prompts_place_images_by_position():
    """A multi-turn row's pads are collapsed where ``image_starts`` puts them; a pad id the
    policy sampled after the last image stays text, one before an image is refused (vLLM
    would take it for that image)."""
    from polyrl.multimodal.vllm_engine import collapse_image_pads

    P = 9
    row = [1, P, P, P, 2, P, P, 3]
    assert collapse_image_pads(row, P, [3, 2], starts=[1, 5]) == [1, P, 2, P, 3]
    assert collapse_image_pads(row + [P], P, [3, 2], starts=[1, 5]) == [1, P, 2, P, 3, P]
    with pytest.raises(ValueError, match="image-pad id as text at position 1, before image 0"):
        collapse_image_pads([1, P, 2, P, P, P, 3], P, [3], starts=[3])
    with pytest.raises(ValueError, match="image 1 needs 2 image-pad tokens at position 4"):
        collapse_image_pads(row, P, [3, 2], starts=[1, 4])


def test_schedule_episode_carries_images_as_round_does(family_policy, one_thread):
    """With environments that step inline, ``schedule: episode`` makes the calls a round
    makes: the same rows, images and samples, and the engine's log-probs still match."""
    policy = family_policy
    _, by_round = _rollout(policy, "concat", seed=2)
    wf, by_episode = _rollout(policy, "concat", seed=2, schedule="episode")
    assert wf.flush_sizes == [2, 2, 2]  # three turns, both episodes per call
    assert torch.equal(by_episode["response_ids"], by_round["response_ids"])
    assert torch.equal(by_episode["prompt_ids"], by_round["prompt_ids"])
    for a, b in zip(strings(by_episode, "vision"), strings(by_round, "vision"), strict=True):
        assert a.image_starts == b.image_starts and torch.equal(a.pixel_values, b.pixel_values)
    check_logprobs(policy, by_episode)


class ThinImage(Environment):
    """Turn 2's tool returns an image the processor refuses (aspect ratio over 200) beside
    a good one."""

    max_turns = 2

    def reset(self, task):
        return [IMAGE_1, QUESTION]

    def step(self, action):
        if not hasattr(self, "stepped"):
            self.stepped = True
            thin = image(3000, 10, 9)
            return StepResult({"role": "tool", "content": [thin, IMAGE_2, "two views"]})
        return StepResult("bye", 1.0, True)


if "test_thin_image" not in ENVIRONMENTS:
    ENVIRONMENTS.register("test_thin_image", ThinImage)


def test_an_image_the_processor_refuses_is_told_counted_and_the_episode_goes_on(
    family_policy, one_thread
):
    from polyrl.agents.workflow import MultiTurn
    from polyrl.multimodal.engine import VLEngine

    policy = family_policy
    ctx = Context(None, {"main": policy}, {"main": VLEngine(policy, seed=0)})
    wf = MultiTurn(ctx, env="test_thin_image", mode="concat", max_turns=2)
    item = PromptItem(uid=0, prompt_ids=[], prompt_text="", answer=None, row={})
    record = wf.rollout([item], SamplingParams(n=2, max_new_tokens=2))
    assert wf.rollout_metrics() == {"images_kept": 4.0, "images_truncated": 0.0, "bad_images": 2.0}
    for i, (meta, v) in enumerate(
        zip(strings(record, "meta"), strings(record, "vision"), strict=True)
    ):
        assert meta["finish"] == "done" and v.num_images == 2  # the first view, then IMAGE_2
        text = policy.tokenizer.decode(row_ids(record, i))
        assert "Error: the model cannot take this image" in text and "aspect ratio" in text
    check_logprobs(policy, record)
