"""``vllm_vl`` serves multi-turn image conversations (issue 21, vLLM part).

The same 3-turn conversation as ``test_vl_turns.py`` (an image in the first observation, a
tool-returned image in the second), on tiny Qwen2.5-VL and Qwen3-VL, sampled by vLLM
through agents' ``multi_turn`` workflow, which passes no images: the engine recovers each
turn's resized images from the record's pixel values. Each row's ids equal the real
processor's on the whole conversation, and the trainer's log-probs match vLLM's to the
single-turn ``vllm_vl`` tolerance. A marl team whose looker is a VLM on ``vllm_vl`` runs
two training steps with the engine and trainer agreeing.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("vllm")


from polyrl.core.record import strings  # noqa: E402
from polyrl.core.rollout.data import PromptItem  # noqa: E402
from polyrl.core.rollout.engine import SamplingParams  # noqa: E402
from polyrl.core.rollout.workflow import Context  # noqa: E402
from tests.helpers import vl_turns  # noqa: E402  (registers its LookTwice environment)

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module", params=vl_turns.FAMILIES)
def policy_engine(request, tmp_path_factory):
    import polyrl.multimodal  # noqa: F401
    from polyrl.core.config import from_dict
    from polyrl.core.train.policy import PolicyConfig
    from polyrl.multimodal.policy import QwenVLPolicy
    from polyrl.multimodal.tiny import tiny_qwen_vl
    from polyrl.multimodal.vllm_engine import VLLMVLEngine

    path = tmp_path_factory.mktemp("vllm-turns") / request.param
    tiny_qwen_vl(path, family=request.param, **vl_turns.TINY)
    cfg = from_dict(PolicyConfig, {"model": str(path), "kind": "qwen_vl"})
    policy = QwenVLPolicy("main", cfg, total_steps=10, need_reference=False)
    engine = VLLMVLEngine(policy, seed=0, max_model_len=512, kv_cache_gb=0.0625)
    yield policy, engine
    engine.close()


def _rollout(policy, engine, mode: str, n: int = 4):
    from polyrl.agents.workflow import MultiTurn

    ctx = Context(None, {"main": policy}, {"main": engine})
    wf = MultiTurn(ctx, env="test_look_twice", mode=mode, max_turns=3, history=None)
    items = [PromptItem(uid=u, prompt_ids=[], prompt_text="", answer=None, row={}) for u in (0, 1)]
    record = wf.rollout(items, SamplingParams(n=n, temperature=1.0, max_new_tokens=3))
    return wf, record


def _trainer_vs_engine(policy, record) -> torch.Tensor:
    with torch.no_grad():
        lp, _ = policy.logprobs(record)
    m = record["loss_mask"].bool() & record["response_mask"].bool()
    assert int(m.sum()) > 0
    return (lp[m] - record["rollout_logprobs"][m]).abs()


@pytest.mark.parametrize("mode", ["concat", "step"])
def test_vllm_samples_image_turns_the_trainer_scores(policy_engine, mode, one_thread):
    policy, engine = policy_engine
    wf, record = _rollout(policy, engine, mode)
    visions = list(strings(record, "vision"))
    assert wf.rollout_metrics()["images_kept"] == 16.0  # 2 prompts x 4 samples x 2 images
    if mode == "concat":
        for i in range(record.batch_size[0]):
            assert strings(record, "meta")[i]["turns"] == 3
            assert visions[i].num_images == 2
            ref_ids, _, ref = vl_turns.processor_ids(policy.processor, vl_turns.actions(record, i))
            assert vl_turns.row_ids(record, i) == ref_ids
            assert torch.equal(visions[i].image_grid_thw, ref["image_grid_thw"])
    else:
        turns = record["turn"].tolist()
        assert sorted(set(turns)) == [0, 1, 2]
        for t, v in zip(turns, visions, strict=True):
            assert v.num_images == (1 if t == 0 else 2)
    diff = _trainer_vs_engine(policy, record)
    print(f"{mode}: |vllm_vl - trainer| mean {diff.mean():.2e}, max {diff.max():.2e}")
    assert diff.max() <= 1e-5  # issue 21: float32, 1e-5


def test_a_wrong_image_is_seen(policy_engine, one_thread):
    """The match is not vacuous: the rows scored with the second image replaced by another
    of its size get clearly other log-probs."""
    import dataclasses

    from polyrl.core.record import set_strings

    policy, engine = policy_engine
    _, record = _rollout(policy, engine, "concat", n=2)
    good = _trainer_vs_engine(policy, record)
    swapped = []
    for v in strings(record, "vision"):
        pv = v.pixel_values.clone()
        n0 = int(v.image_grid_thw[0].prod())
        pv[n0:] = pv[n0:].flip(0)  # the tool's image, its patches in reverse order
        swapped.append(dataclasses.replace(v, pixel_values=pv))
    set_strings(record, "vision", swapped)
    wrong = _trainer_vs_engine(policy, record)
    print(f"right image {good.mean():.2e}, wrong image {wrong.mean():.2e}")
    assert wrong.mean() > 20 * good.mean() and wrong.mean() > 1e-3
