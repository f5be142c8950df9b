"""``rollout.partial`` with images across turns: ``multi_turn`` on a tiny Qwen2.5-VL and the
``hf_vl`` engine, whose weights switch between two decoding steps of the first turn's call.

Each action token records the weights version that sampled it. Tokens sampled before the
switch come from the old weights alone, and turns that start after it from the new ones
alone, so those log-probs must equal the trainer's own pass (images included) under the
old or the new weights; a turn that spans the switch is the only one mixing both."""

from __future__ import annotations

import pytest
import torch
from PIL import Image

from polyrl.agents.env import Environment, StepResult
from polyrl.core.registry import ENVIRONMENTS
from polyrl.core.rollout.data import PromptItem
from polyrl.core.rollout.engine import SamplingParams
from polyrl.core.rollout.workflow import Context
from tests.helpers.partial import moved

SWITCH = 2  # tokens 0 and 1 of the first call come from the old weights


def _image(w: int, h: int, seed: int) -> Image.Image:
    g = torch.Generator().manual_seed(seed)
    return Image.fromarray(torch.randint(0, 256, (h, w, 3), generator=g, dtype=torch.uint8).numpy())


class ZoomOnce(Environment):
    """Turn 1: an image and a question; turn 2: a tool image; turn 3: text, then done."""

    max_turns = 3

    def reset(self, task):
        self.t = 0
        return [_image(70, 50, 1), "What colour is the square?"]

    def step(self, action):
        self.t += 1
        if self.t == 1:
            return StepResult({"role": "tool", "name": "zoom", "content": [_image(40, 90, 2)]})
        if self.t == 2:
            return StepResult("Answer now.")
        return StepResult("bye", 1.0, True)


if "test_vl_partial_zoom" not in ENVIRONMENTS:
    ENVIRONMENTS.register("test_vl_partial_zoom", ZoomOnce)


@pytest.fixture(scope="module")
def policy(tmp_path_factory):
    import polyrl.multimodal  # noqa: F401
    from polyrl.core.config import from_dict
    from polyrl.core.train.policy import PolicyConfig
    from polyrl.multimodal.policy import QwenVLPolicy
    from polyrl.multimodal.tiny import tiny_qwen_vl

    path = tmp_path_factory.mktemp("vl_partial") / "qwen2_5_vl"
    tiny_qwen_vl(
        path,
        family="qwen2_5_vl",
        corpus="vl_shapes",
        hidden_size=64,
        num_layers=1,
        num_heads=2,
        vision_depth=1,
        vision_hidden_size=32,
        seed=0,
    )
    cfg = from_dict(PolicyConfig, {"model": str(path), "kind": "qwen_vl"})
    return QwenVLPolicy("main", cfg, total_steps=10, need_reference=False)


def test_vl_turns_record_versions_equal_to_the_trainer_under_each_weights(policy, one_thread):
    from polyrl.agents.workflow import MultiTurn
    from polyrl.core.rollout.rollouts import shadow
    from polyrl.multimodal.engine import VLEngine

    twin = shadow(policy)
    old = {k: v.clone() for k, v in policy.model.state_dict().items()}
    new = moved(old, 0.05, seed=1)
    calls: list[int] = []

    def refresh() -> int:
        calls.append(1)
        if len(calls) == SWITCH + 1:
            twin.model.load_state_dict(new)
        return int(len(calls) > SWITCH)

    engine = VLEngine(twin, seed=0)
    engine.set_refresh(refresh)
    wf = MultiTurn(
        Context(None, {"main": twin}, {"main": engine}),
        env="test_vl_partial_zoom",
        mode="step",
        max_turns=3,
        history=None,
    )
    item = PromptItem(uid=0, prompt_ids=[], prompt_text="", answer=None, row={})
    record = wf.rollout([item], SamplingParams(n=2, temperature=1.0, max_new_tokens=3))

    versions, sampled = record["token_version"], record["loss_mask"].bool()
    assert bool((versions[sampled] >= 0).all())
    assert bool((versions[~sampled] == -1).all())
    with torch.no_grad():
        lp_old, _ = policy.logprobs(record)
        policy.model.load_state_dict(new)
        try:
            lp_new, _ = policy.logprobs(record)
        finally:
            policy.model.load_state_dict(old)
    engine_lp = record["rollout_logprobs"]
    before = sampled & (versions == 0)
    starts_new = (versions[:, :1] == 1) & sampled  # turns whose first token is new
    after = starts_new.any(1, keepdim=True) & sampled
    mixed = (before.any(1) & (sampled & (versions == 1)).any(1)).sum()
    assert int(before.sum()) > 0 and int(after.sum()) > 0 and int(mixed) > 0
    torch.testing.assert_close(lp_old[before], engine_lp[before], atol=1e-5, rtol=0)
    torch.testing.assert_close(lp_new[after], engine_lp[after], atol=1e-5, rtol=0)
    gap = (lp_old[after] - engine_lp[after]).abs().max()
    assert gap > 1e-3  # the new weights did change those tokens
