"""The 3-turn image conversation that the VL multi-turn tests share (HF engine, vLLM engine,
gateway): the tiny VL models' settings, the ``LookTwice`` environment (registered as
``test_look_twice``), and the real processor's ids for the whole conversation to check
a row against."""

from __future__ import annotations

import torch
from PIL import Image

from polyrl.agents.env import Environment, StepResult
from polyrl.core.record import strings
from polyrl.core.registry import ENVIRONMENTS

FAMILIES = ("qwen2_5_vl", "qwen3_vl")
TINY = {
    "corpus": "vl_shapes",
    "hidden_size": 64,
    "num_layers": 1,
    "num_heads": 2,
    "vision_depth": 1,
    "vision_hidden_size": 32,
    "seed": 0,
}


def image(w: int, h: int, seed: int) -> Image.Image:
    """A ``w`` x ``h`` image of random pixels drawn from ``seed``."""
    g = torch.Generator().manual_seed(seed)
    pixels = torch.randint(0, 256, (h, w, 3), generator=g, dtype=torch.uint8)
    return Image.fromarray(pixels.numpy())


IMAGE_1, IMAGE_2 = image(70, 50, 1), image(40, 90, 2)  # resized by the processor
QUESTION = "What colour is the square?"


class LookTwice(Environment):
    """Turn 1: an image and a question; turn 2: a tool message with an image; turn 3: text."""

    max_turns = 3

    def reset(self, task):
        self.t = 0
        return [IMAGE_1, QUESTION]

    def step(self, action):
        self.t += 1
        if self.t == 1:
            obs = {"role": "tool", "name": "zoom", "content": [IMAGE_2, "zoomed in"]}
            return StepResult(obs)
        if self.t == 2:
            return StepResult("Answer now.")
        return StepResult("bye", 1.0, True)


if "test_look_twice" not in ENVIRONMENTS:
    ENVIRONMENTS.register("test_look_twice", LookTwice)


def row_ids(record, i: int) -> list[int]:
    """Row ``i``'s prompt and response ids, padding left out."""
    p = record["prompt_ids"][i][record["prompt_mask"][i].bool()].tolist()
    r = record["response_ids"][i][record["response_mask"][i].bool()].tolist()
    return p + r


def actions(record, i: int) -> list[list[int]]:
    """Row ``i``'s sampled actions, one id list per assistant turn."""
    meta = strings(record, "meta")[i]
    resp = record["response_ids"][i].tolist()
    return [resp[a:b] for _, a, b in meta["spans"]]


def processor_ids(processor, actions: list[list[int]]):
    """The real processor on the whole conversation, the sampled actions in the assistant
    turns: rendered with empty assistant contents, then each action's ids put where its
    content goes (sampled ids are kept, never decoded and re-encoded); the last action
    ends the row."""
    tok = processor.tokenizer
    eos = tok.eos_token_id
    messages = [
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": QUESTION}]},
        {"role": "assistant", "content": ""},
        {"role": "tool", "content": [{"type": "image"}, {"type": "text", "text": "zoomed in"}]},
        {"role": "assistant", "content": ""},
        {"role": "user", "content": "Answer now."},
    ]
    text = processor.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    out = processor(
        text=[text], images=[IMAGE_1, IMAGE_2], return_tensors="pt", return_mm_token_type_ids=True
    )
    ids = out["input_ids"][0].tolist()
    types = out["mm_token_type_ids"][0].tolist()
    header = tok.encode("<|im_start|>assistant\n", add_special_tokens=False)
    at = [
        i + len(header)
        for i in range(len(ids) - len(header) + 1)
        if ids[i : i + len(header)] == header
    ]
    assert len(at) == 3 and at[-1] == len(ids)  # two closed assistant turns, then the header
    for where, action in reversed(list(zip(at[:2], actions[:2], strict=True))):
        assert ids[where] == eos  # the empty content: the template closes the turn at once
        body = action[:-1] if action[-1] == eos else action  # the policy's own end token
        ids[where:where] = body
        types[where:where] = [0] * len(body)
    ids += actions[2]
    types += [0] * len(actions[2])
    return ids, torch.tensor([types]), out


def check_logprobs(policy, record) -> None:
    """The trainer's log-probs equal the engine's on every trained token (1e-5, float32)."""
    with torch.no_grad():
        lp, _ = policy.logprobs(record)
    m = record["loss_mask"].bool() & record["response_mask"].bool()
    assert int(m.sum()) > 0
    torch.testing.assert_close(lp[m], record["rollout_logprobs"][m], atol=1e-5, rtol=0)
