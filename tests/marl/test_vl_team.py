"""A team with a vision-language agent (issue 21, part 3), exact on tiny real models.

A tiny Qwen2.5-VL "looker" sees an image and writes a message; a text-only tiny Qwen2
"solver" reads it and answers. Both act through the marl runtime (one generate per policy
per round, with images for the looker):

- the looker's row ids equal the real processor's on its conversation (role prompt, image,
  question), and its row carries the image in the ``vision`` column; the solver's has none;
- the trainer's log-probs equal the engines' (1e-5, float32) for both policies;
- the magrpo credit treats the rows as in a text team (hand-computed advantages);
- an image for a text-only agent is an episode error naming the agent and its policy.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from PIL import Image

from polyrl.core.interfaces import EngineCaps
from polyrl.core.record import select_policy, set_strings, strings
from polyrl.core.registry import WORKFLOWS
from polyrl.core.rollout.data import PromptItem
from polyrl.core.rollout.engine import SamplingParams, as_requests
from polyrl.marl import JOINT_POLICY, workflow

LOOKER_ROLE = "Describe the image."
QUESTION = "What colour is the square?"


def _image(w: int, h: int, seed: int) -> Image.Image:
    g = torch.Generator().manual_seed(seed)
    pixels = torch.randint(0, 256, (h, w, 3), generator=g, dtype=torch.uint8)
    return Image.fromarray(pixels.numpy())


IMAGE = _image(70, 50, 1)  # resized by the processor

if "test_vl_look_and_solve" not in WORKFLOWS:

    @workflow("test_vl_look_and_solve", agents={"looker": LOOKER_ROLE, "solver": "Answer."})
    async def look_and_solve(ep, team):
        looks = await team["looker"].act([IMAGE, QUESTION], n=ep.G)
        answers = await ep.gather(team["solver"].act(f"The looker says: {m.text}") for m in looks)
        for m, a in zip(looks, answers, strict=True):
            ep.joint([m, a], final=a.text)

    @workflow("test_vl_blind_solver", agents={"looker": LOOKER_ROLE, "solver": "Answer."})
    async def blind_solver(ep, team):
        look = await team["looker"].act([IMAGE, QUESTION])
        answer = await team["solver"].act([{"role": "user", "content": [IMAGE, "Colour?"]}])
        ep.joint([look, answer], final=answer.text)


class Recorder:
    """Keeps each engine call's prompts, to compare with the record's rows."""

    def __init__(self, inner) -> None:
        self.inner, self.calls = inner, []

    caps = EngineCaps(takes_images=True)

    def generate(self, prompts, params):
        requests = as_requests(prompts)
        images = any(not r.text_only for r in requests)
        self.calls.append(("images" if images else "text", [r.prompt for r in requests]))
        return self.inner.generate(requests, params)


@pytest.fixture(scope="module")
def team(tmp_path_factory):
    import polyrl.multimodal  # noqa: F401
    from polyrl.core.config import from_dict
    from polyrl.core.demo.tiny import tiny_qwen2
    from polyrl.core.rollout.engine import HFEngine
    from polyrl.core.train.policy import CausalLMPolicy, PolicyConfig
    from polyrl.multimodal.engine import VLEngine
    from polyrl.multimodal.policy import QwenVLPolicy
    from polyrl.multimodal.tiny import tiny_qwen_vl

    root = tmp_path_factory.mktemp("vl-team")
    tiny_qwen_vl(
        root / "looker",
        family="qwen2_5_vl",
        corpus="vl_shapes",
        hidden_size=64,
        num_layers=1,
        num_heads=2,
        vision_depth=1,
        vision_hidden_size=32,
        seed=0,
    )
    tiny_qwen2(root / "solver", corpus="vl_shapes", hidden_size=32, num_layers=1, num_heads=1)
    cfgs = {
        "looker": from_dict(PolicyConfig, {"model": str(root / "looker"), "kind": "qwen_vl"}),
        "solver": from_dict(PolicyConfig, {"model": str(root / "solver")}),
    }
    policies = {
        "looker": QwenVLPolicy("looker", cfgs["looker"], total_steps=1, need_reference=False),
        "solver": CausalLMPolicy("solver", cfgs["solver"], total_steps=1, need_reference=False),
    }
    engines = {
        "looker": Recorder(VLEngine(policies["looker"], seed=0)),
        "solver": Recorder(HFEngine(policies["solver"], seed=1)),
    }
    cfg = SimpleNamespace(policies=cfgs, data=SimpleNamespace(prompt_field="prompt"), seed=0)
    return cfg, policies, engines


def _rollout(team, name: str, n: int = 3):
    from polyrl.core.rollout.workflow import Context

    cfg, policies, engines = team
    for e in engines.values():
        e.calls.clear()
    wf = WORKFLOWS.get(name)(Context(cfg, policies, engines))
    items = [
        PromptItem(uid=i, prompt_ids=[], prompt_text="", answer="red", row={}) for i in range(2)
    ]
    torch.manual_seed(0)
    rec = wf.rollout(items, SamplingParams(n=n, temperature=1.0, max_new_tokens=4))
    return wf, rec


def _prompt(rec, i: int) -> list[int]:
    return rec["prompt_ids"][i][rec["prompt_mask"][i].bool()].tolist()


def _check_logprobs(policy, rec) -> None:
    with torch.no_grad():
        lp, _ = policy.logprobs(rec)
    m = rec["loss_mask"].bool() & rec["response_mask"].bool()
    assert int(m.sum()) > 0
    torch.testing.assert_close(lp[m], rec["rollout_logprobs"][m], atol=1e-5, rtol=0)


def test_a_vl_looker_and_a_text_solver_are_exact(team, one_thread):
    _, policies, engines = team
    wf, rec = _rollout(team, "test_vl_look_and_solve")
    policy = strings(rec, "policy")
    visions = strings(rec, "vision")
    errors = strings(rec, "error")
    assert not any(errors)
    # one call per policy per round, the looker's with images
    assert [c[0] for c in engines["looker"].calls] == ["images"]
    assert [c[0] for c in engines["solver"].calls] == ["text"]
    assert wf.rollout_metrics()["marl/generate_rounds"] == 2

    processor = policies["looker"].processor
    messages = [
        {"role": "system", "content": LOOKER_ROLE},
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": QUESTION}]},
    ]
    text = processor.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    ref = processor(text=[text], images=[IMAGE], return_tensors="pt")
    ref_ids = ref["input_ids"][0].tolist()
    image_token = policies["looker"].image_token_id
    lookers = [i for i, p in enumerate(policy) if p == "looker"]
    solvers = [i for i, p in enumerate(policy) if p == "solver"]
    assert len(lookers) == len(solvers) == 6  # 2 episodes x n=3
    for i in lookers:
        assert _prompt(rec, i) == ref_ids
        v = visions[i]
        assert v.num_images == 1 and v.image_starts == (ref_ids.index(image_token),)
        assert torch.equal(v.image_grid_thw, ref["image_grid_thw"])
        assert torch.allclose(v.pixel_values, ref["pixel_values"])
    for i in solvers:
        assert visions[i] is None
        assert "The looker says:" in strings(rec, "prompt_text")[i]
    assert all(visions[i] is None for i, p in enumerate(policy) if p == JOINT_POLICY)
    # the solver read what the looker wrote (aligned: the g-th answer reads the g-th look)
    texts = strings(rec, "response_text")
    for k, i in enumerate(lookers):
        assert f"The looker says: {texts[i]}" in strings(rec, "prompt_text")[solvers[k]]

    looker = select_policy(rec, "looker")
    _check_logprobs(policies["looker"], looker)
    _check_logprobs(policies["solver"], select_policy(rec, "solver"))
    # the log-prob pass takes the images from the vision column: without it, it refuses
    blind = looker.clone()
    set_strings(blind, "vision", [None] * blind.batch_size[0])
    with torch.no_grad(), pytest.raises(ValueError, match="no vision inputs"):
        policies["looker"].logprobs(blind)


def test_the_credit_is_that_of_a_text_team(team, one_thread):
    from polyrl.core.train.algorithms import AlgorithmConfig
    from polyrl.core.train.credit import assign

    _, rec = _rollout(team, "test_vl_look_and_solve")
    policy = strings(rec, "policy")
    metas = strings(rec, "meta")
    joints = [i for i, p in enumerate(policy) if p == JOINT_POLICY]
    reward = {int(rec["joint_id"][i]): float(k % 3 == 0) for k, i in enumerate(joints)}
    rec["reward"] = torch.tensor(
        [
            reward[int(rec["joint_id"][i])] if i in joints else float("nan")
            for i in range(len(policy))
        ]
    )
    assign(rec, AlgorithmConfig(credit="magrpo", advantage="drgrpo"))
    uids = rec["uid"].tolist()
    for i, p in enumerate(policy):
        if p == JOINT_POLICY:
            continue
        assert bool(rec["valid"][i])
        # aligned, one turn: the agent's value is its joint's reward; the baseline is the
        # mean over the same agent's samples of that prompt (Dr. GRPO: no std division)
        mine = reward[metas[i]["joints"][0]]
        group = [
            reward[metas[j]["joints"][0]]
            for j, q in enumerate(policy)
            if q == p and uids[j] == uids[i]
        ]
        want = mine - sum(group) / len(group)
        got = rec["advantages"][i][rec["response_mask"][i].bool()]
        assert torch.allclose(got, torch.full_like(got, want), atol=1e-6)


def test_an_image_for_a_text_only_agent_is_an_episode_error(team, one_thread):
    wf, rec = _rollout(team, "test_vl_blind_solver", n=1)
    errors = strings(rec, "error")
    assert all(errors)  # every row of the failed episodes leaves the update
    assert all("agent 'solver'" in e and "policy 'solver' cannot take images" in e for e in errors)
    assert wf.rollout_metrics()["marl/episode_errors"] == 2
    assert not bool(rec["valid"].any())


def test_look_and_answer_reads_the_row_image_from_its_path(team, one_thread, tmp_path):
    """The built-in workflow: the looker sees the row's image file, the solver the looker's
    text and the question only; a missing file is an episode error naming its path."""
    from polyrl.core.rollout.workflow import Context

    cfg, policies, engines = team
    (tmp_path / "images").mkdir()
    IMAGE.save(tmp_path / "images" / "a.png")
    wf = WORKFLOWS.get("look_and_answer")(Context(cfg, policies, engines), image_root=str(tmp_path))
    rows = [
        {"prompt": f"<image>{QUESTION}", "images": ["images/a.png"]},
        {"prompt": f"<image>{QUESTION}", "images": ["images/missing.png"]},
    ]
    items = [
        PromptItem(uid=i, prompt_ids=[], prompt_text=r["prompt"], answer="red", row=r)
        for i, r in enumerate(rows)
    ]
    torch.manual_seed(0)
    rec = wf.rollout(items, SamplingParams(n=2, temperature=1.0, max_new_tokens=3))
    policy, errors = strings(rec, "policy"), strings(rec, "error")
    uids, visions, texts = rec["uid"].tolist(), strings(rec, "vision"), strings(rec, "prompt_text")
    ref = policies["looker"].processor.image_processor(images=[IMAGE], return_tensors="pt")
    lookers = [i for i, p in enumerate(policy) if p == "looker"]
    solvers = [i for i, p in enumerate(policy) if p == "solver"]
    assert len(lookers) == len(solvers) == 2  # episode 1 failed before any act
    for i in lookers:
        assert uids[i] == 0 and not errors[i]
        assert torch.allclose(visions[i].pixel_values, ref["pixel_values"])
    for k, i in enumerate(solvers):
        look = strings(rec, "response_text")[lookers[k]].strip()
        assert texts[i].endswith(
            f"{QUESTION}\nThe looker says: {look}<|im_end|>\n<|im_start|>assistant\n"
        )
        assert "<image>" not in texts[i] and visions[i] is None
    failed = [i for i in range(len(policy)) if uids[i] == 1]
    assert failed and all("images/missing.png" in errors[i] for i in failed)
    _check_logprobs(policies["looker"], select_policy(rec, "looker"))


def test_every_observation_form_renders_the_same_prompt(team):
    """An image, a list of strings and images, typed parts, or chat messages: one rendering,
    one placeholder per image; a text policy's agent refuses any of them."""
    from polyrl.core.interfaces import TakesImageTurns
    from polyrl.marl.api import AgentInfo

    _, policies, _ = team
    assert isinstance(policies["looker"], TakesImageTurns)
    assert not isinstance(policies["solver"], TakesImageTurns)
    looker = AgentInfo(
        "looker",
        0,
        "looker",
        LOOKER_ROLE,
        True,
        policies["looker"].tokenizer,
        None,
        None,
        policies["looker"],
    )
    forms = [
        [IMAGE, QUESTION],
        [{"type": "image", "image": IMAGE}, {"type": "text", "text": QUESTION}],
        [{"role": "user", "content": [IMAGE, QUESTION]}],
    ]
    rendered = [looker.render_images(f) for f in forms]
    text, observation, images = rendered[0]
    assert all(r == (text, observation, [IMAGE]) for r in rendered)
    assert observation == f"<image>{QUESTION}" and images == [IMAGE]
    assert text.count("<|image_pad|>") == 1
    only, _, imgs = looker.render_images(IMAGE)
    assert imgs == [IMAGE] and only.count("<|image_pad|>") == 1 and QUESTION not in only
    with pytest.raises(TypeError, match="agent 'looker': a content part of act"):
        looker.render_images([IMAGE, {"type": "audio"}])
    solver = AgentInfo("solver", 1, "solver", "", True, policies["solver"].tokenizer)
    with pytest.raises(TypeError, match="agent 'solver': act\\(\\) got 1 image.*policy 'solver'"):
        solver.render_images([IMAGE, QUESTION])
    assert solver.render_images(QUESTION)[2] == []
