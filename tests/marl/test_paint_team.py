"""A team of three model kinds (issue 40): an LLM writer, a diffusion painter, a VLM judge.

- each member's update on the team's record equals its plugin's own update on the same
  rows (losses and the gradients the optimizer steps with): the painter against the
  ``text_to_image`` record of the same trajectories, a text member against its rows
  alone, the judge against the multimodal plugin's ``vl_single_turn`` record of the same
  pictures and question;
- one version ahead, partial or not, every member's rows are within the staleness bound;
  partial, the painter samples each pass with the newest weights and records that version
  on every step;
- recipes that send a member what its policy cannot take fail at load, naming the agent.

The demo's learning runs are tests/marl/test_paint_team_learning.py.
"""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import yaml

from tests.helpers.paint_team import (
    check_one_ahead,
    check_row_versions,
    keep_records,
    one_ahead,
)
from tests.helpers.trainer import grads_at_step, make_policy, sampled_record

EXAMPLE = Path(__file__).parents[2] / "examples" / "paint_team.yaml"
PROMPTS = ("a red blob", "green")


@pytest.fixture(scope="module")
def sd3_dir(tmp_path_factory) -> str:
    from polyrl.diffusion.tiny import tiny_sd3

    path = tmp_path_factory.mktemp("models") / "tiny-sd3"
    tiny_sd3(path, image_size=16, vae_patch=2, layers=1, heads=2, head_dim=16, seed=0)
    return str(path)


def painter(sd3_dir: str):
    """A LoRA painter and its engine, built the same way each call (same LoRA init)."""
    import polyrl.diffusion  # noqa: F401
    from polyrl.core.config import from_dict
    from polyrl.core.train.policy import PolicyConfig
    from polyrl.diffusion.engine import DiffusionEngine, sampling_options
    from polyrl.diffusion.policy import DiffusionPolicy

    args = {
        "height": 16,
        "width": 16,
        "steps": 4,
        "guidance_scale": 1.0,
        "train_steps": {"mode": "window", "window_start": 0, "window_size": 2},
    }
    cfg = from_dict(
        PolicyConfig,
        {
            "kind": "diffusion",
            "model": sd3_dir,
            "lora": {"r": 4, "alpha": 8},
            "args": {"max_sequence_length": 1},
            "optim": {"lr": 1e-3},
            "engine": {"name": "diffusion", "args": args},
        },
    )
    torch.manual_seed(0)
    policy = DiffusionPolicy("painter", cfg, total_steps=10, need_reference=False, device="cpu")
    return policy, DiffusionEngine(policy, seed=0, **sampling_options(cfg))


def team_record(paintings_by_prompt, writer_rows=None):
    """The marl record of one episode per prompt: a writer message (the prompt) and the
    painter's paintings of it, one joint action per painting."""
    from polyrl.core.segment import Tokens
    from polyrl.marl.api import AgentInfo, Episode, Message
    from polyrl.marl.record import build_record

    ids = iter(range(1, 10_000))
    agents = {
        "writer": AgentInfo("writer", 0, "writer", "", True, None),
        "painter": AgentInfo("painter", 1, "painter", "", True, None, paints=True),
    }
    episodes = []
    for k, (prompt, pics) in enumerate(paintings_by_prompt):
        item = SimpleNamespace(uid=k, row={"prompt": "Goal"}, answer="red", prompt_text="Goal")
        ep = Episode(k, item, group_size=1, mode="aligned", tree=False, prompt_field="p", ids=ids)
        said = ep._add(
            Message(
                "writer", prompt, Tokens.sampled([5, 6], [-0.1, -0.2]), "stop",
                Tokens.given([1, 2, 3]), "Goal", "Goal", ep,
            )
        )  # fmt: skip
        for pic in pics:
            m = ep._add(
                Message(
                    "painter", prompt, Tokens.given([]), "stop", Tokens.given([]), prompt,
                    prompt, ep, painting=pic, group=("prompt", prompt),
                )
            )  # fmt: skip
            ep.joint([said, m], final=prompt)
        episodes.append(ep)
    return build_record(episodes, agents, ids)


def test_painter_update_on_team_rows_equals_text_to_image_update(sd3_dir, one_thread):
    """Same trajectories (seeded), same advantages: the update from the team record's
    painter rows (merged with text and joint rows, then selected) and from the
    ``text_to_image`` record give the same loss and the same gradients."""
    from polyrl.core.record import select_policy
    from polyrl.core.rollout.paint import ImageRequest, merge_records
    from polyrl.core.train.algorithms import AlgorithmConfig
    from polyrl.core.train.trainer import update
    from polyrl.diffusion.workflow import diffusion_record

    policy, engine = painter(sd3_dir)
    got = engine.paint([ImageRequest(p, n=3, seed=10 + i) for i, p in enumerate(PROMPTS)])
    alone = []
    for i, p in enumerate(PROMPTS):  # the plugin's own record of the same samples
        traj = engine.sample([p], n=3, generator=torch.Generator().manual_seed(10 + i))
        alone.append(diffusion_record(traj, policy="painter", uid=[i] * 3, prompt_text=[p] * 3,
                                      meta=[{}] * 3))  # fmt: skip
    alone_rec = merge_records(alone)
    team = team_record(list(zip(PROMPTS, got, strict=True)))
    rows = select_policy(team, "painter")
    assert torch.equal(rows["latents"], alone_rec["latents"])
    assert torch.equal(rows["rollout_logprobs"], alone_rec["rollout_logprobs"])
    adv = torch.tensor([1.0, -0.5, -0.5, 0.7, 0.3, -1.0])
    algo = AlgorithmConfig(clip_ratio_low=1e-4, clip_ratio_high=1e-4)
    results = []
    for batch in (rows, alone_rec):
        batch = batch.clone()
        batch["advantages"] = adv[:, None] * batch["loss_mask"].float()
        batch["valid"] = torch.ones(6, dtype=torch.bool)
        fresh, _ = painter(sd3_dir)
        seen = grads_at_step(fresh)
        out = update(fresh, batch, algo, generator=torch.Generator().manual_seed(0))
        results.append((out, seen[0]))
    (m_team, g_team), (m_alone, g_alone) = results
    assert m_team["loss"] == pytest.approx(m_alone["loss"], rel=1e-5, abs=1e-7)
    assert any(float(g.abs().sum()) > 0 for g in g_team)  # the test can fail
    for a, b in zip(g_team, g_alone, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)


def test_partial_painter_takes_the_newest_weights_at_each_sampling_pass(sd3_dir, one_thread):
    """``rollout.partial``: the painter's engine asks for the newest weights at the start of
    each sampling pass and samples the whole pass with them. A pass after a publish equals
    one sampled with the new weights from the start (same seed), every step of its
    trajectories records that version (``token_version``), the pass before it the old
    one; with no refresh set, nothing is recorded."""
    from polyrl.core.rollout.paint import ImageRequest

    policy, engine = painter(sd3_dir)
    trained = {k: p for k, p in policy.model.named_parameters() if p.requires_grad}
    old = {k: p.detach().clone() for k, p in trained.items()}
    gen = torch.Generator().manual_seed(5)
    new = {k: v + 0.5 * torch.randn(v.shape, generator=gen) for k, v in old.items()}

    def load(state) -> None:
        with torch.no_grad():
            for k, p in trained.items():
                p.copy_(state[k])

    calls: list[int] = []

    def refresh() -> int:  # the producer's: version 1 is published before the second pass
        calls.append(1)
        if len(calls) == 2:
            load(new)
        return int(len(calls) >= 2)

    def pass_(seed: int):
        (pics,) = engine.paint([ImageRequest("red", n=2, seed=seed)])
        return pics

    engine.set_refresh(refresh)
    before, after = pass_(1), pass_(2)
    engine.set_refresh(None)
    assert len(calls) == 2  # one refresh per sampling pass, not per step
    for pics, version in ((before, 0), (after, 1)):
        for pic in pics:
            assert pic.versions == [version] * 4
            assert pic.trajectory["token_version"].tolist() == [[version] * 4]
    # what each pass recorded is what those weights sample
    for pics, state, seed in ((before, old, 1), (after, new, 2)):
        load(state)
        for pic, ref in zip(pics, pass_(seed), strict=True):
            assert ref.versions == [] and "token_version" not in ref.trajectory.keys()  # noqa: SIM118
            assert torch.equal(pic.trajectory["latents"], ref.trajectory["latents"])
            assert torch.equal(
                pic.trajectory["rollout_logprobs"], ref.trajectory["rollout_logprobs"]
            )
    load(old)
    assert not torch.equal(pass_(2)[0].trajectory["latents"], after[0].trajectory["latents"])


def test_long_prompts_are_cut_and_counted(sd3_dir, one_thread):
    """The tiny text encoders take 8 tokens (start and end included): a longer prompt is
    cut, and its paintings say by how many tokens; a short one is not."""
    from polyrl.core.rollout.paint import ImageRequest

    _, engine = painter(sd3_dir)
    long = "a red blob a red blob a blue circle green"
    ids = engine.policy.tokenizer(long, truncation=False)["input_ids"]
    assert engine.prompt_limit() == 8 and len(ids) > 8
    got = engine.paint([ImageRequest(long, n=2), ImageRequest("red", n=1)])
    assert [p.cut_tokens for p in got[0]] == [len(ids) - 8] * 2
    assert got[1][0].cut_tokens == 0 and got[1][0].image.shape == (3, 16, 16)


def test_text_member_update_on_team_rows_equals_its_own(tiny_model_dir, one_thread):
    """A text member's (writer's or judge's) rows in a record with trajectory rows update
    exactly as the same rows alone."""
    from polyrl.core.record import select_policy
    from polyrl.core.rollout.paint import merge_records
    from polyrl.core.train.algorithms import AlgorithmConfig
    from polyrl.core.train.trainer import update

    own = sampled_record(make_policy(tiny_model_dir, name="writer"), name="writer")
    trajectories = _fake_trajectory_rows(4)
    rows = select_policy(merge_records([own, trajectories]), "writer")
    results = []
    for batch in (rows, own):
        torch.manual_seed(0)
        policy = make_policy(tiny_model_dir, name="writer")
        seen = grads_at_step(policy)
        out = update(policy, batch.clone(), AlgorithmConfig(), generator=torch.Generator())
        results.append((out, seen[0]))
    (m_team, g_team), (m_alone, g_alone) = results
    assert m_team["loss"] == pytest.approx(m_alone["loss"], rel=1e-5, abs=1e-7)
    assert any(float(g.abs().sum()) > 0 for g in g_team)
    for a, b in zip(g_team, g_alone, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)


@pytest.fixture(scope="module")
def judge_team(tmp_path_factory):
    """Tiny writer, painter and judge for the ``paint_team`` workflow. The painter paints
    56x56 pictures, the size the judge's processor takes them at: the team shows the judge
    the picture through the processor's own resize, the multimodal dataset resizes it first
    (qwen_vl_utils), and the two resamplings of a 16x16 picture differ by up to 0.015."""
    import polyrl.diffusion  # noqa: F401
    import polyrl.multimodal  # noqa: F401
    from polyrl.core.config import from_dict
    from polyrl.core.demo.tiny import tiny_qwen2
    from polyrl.core.train.policy import PolicyConfig
    from polyrl.diffusion.tiny import tiny_sd3
    from polyrl.multimodal.tiny import tiny_qwen2_5_vl

    root = tmp_path_factory.mktemp("judge-team")
    tiny_qwen2(root / "writer", corpus="paint_team", vocab_size=200, hidden_size=32,
               num_layers=1, num_heads=1)  # fmt: skip
    tiny_qwen2_5_vl(root / "judge", corpus="paint_team", hidden_size=64, num_layers=1,
                    num_heads=2, vision_depth=1, vision_hidden_size=32, seed=1)  # fmt: skip
    tiny_sd3(root / "sd3", image_size=56, vae_patch=4, layers=1, heads=2, head_dim=16, seed=0)
    args = {"height": 56, "width": 56, "steps": 2, "guidance_scale": 1.0}
    return {
        "writer": from_dict(PolicyConfig, {"model": str(root / "writer")}),
        "painter": from_dict(
            PolicyConfig,
            {
                "kind": "diffusion",
                "model": str(root / "sd3"),
                "args": {"max_sequence_length": 1},
                "engine": {"name": "diffusion", "args": args},
            },
        ),
        "judge": from_dict(
            PolicyConfig,
            {"kind": "qwen_vl", "model": str(root / "judge"), "engine": {"name": "hf_vl"}},
        ),
    }


def _judge(cfgs):
    from polyrl.multimodal.policy import QwenVLPolicy

    torch.manual_seed(0)
    return QwenVLPolicy("judge", cfgs["judge"], total_steps=10, need_reference=False)


def test_judge_update_on_team_rows_equals_vl_single_turn_update(judge_team, one_thread):
    """The judge's rows of a ``paint_team`` rollout (real writer, painter and judge) against
    the multimodal plugin's own ``vl_single_turn`` record of the same pictures and question
    (its dataset's chat prompt, an engine of the same seed): the same prompt ids, pixels,
    sampled tokens and log-probs; the team's magrpo advantages equal the plugin's GRPO
    group advantages on the same rewards and groups (a goal's pictures); the update gives
    the same loss and the same gradients."""
    from polyrl.core.record import select_policy, strings
    from polyrl.core.registry import POLICIES, WORKFLOWS
    from polyrl.core.rollout.data import DataConfig, PromptItem
    from polyrl.core.rollout.engine import HFEngine, SamplingParams
    from polyrl.core.rollout.workflow import Context
    from polyrl.core.train.algorithms import AlgorithmConfig
    from polyrl.core.train.credit import assign
    from polyrl.core.train.trainer import update
    from polyrl.diffusion.engine import DiffusionEngine, sampling_options
    from polyrl.marl import JOINT_POLICY, paint_team
    from polyrl.multimodal.data import VLDataset
    from polyrl.multimodal.engine import VLEngine
    from polyrl.multimodal.workflow import VLSingleTurn

    cfgs = judge_team
    policies = {
        n: POLICIES.get(cfgs[n].kind)(n, cfgs[n], total_steps=1, need_reference=False)
        for n in ("writer", "painter")
    }
    policies["judge"] = _judge(cfgs)
    engines = {
        "writer": HFEngine(policies["writer"], seed=0),
        "painter": DiffusionEngine(
            policies["painter"], seed=0, **sampling_options(cfgs["painter"])
        ),
        "judge": VLEngine(policies["judge"], seed=3),
    }
    ctx = Context(SimpleNamespace(policies=cfgs, seed=0), policies, engines)
    wf = WORKFLOWS.get("paint_team")(ctx, images=2)
    goals = [
        PromptItem(uid=k, prompt_ids=[], prompt_text=paint_team.goal_text(c), answer=c,
                   row={"prompt": paint_team.goal_text(c)})
        for k, c in enumerate(("red", "blue"))
    ]  # fmt: skip
    params = SamplingParams(n=2, temperature=1.0, max_new_tokens=2)
    team = wf.rollout(goals, params)
    policy = strings(team, "policy")
    joints = [i for i, p in enumerate(policy) if p == JOINT_POLICY]
    # joint rewards with spread in each goal's group
    reward = {int(team["joint_id"][i]): [1.0, 0.0, 0.5, 0.0][k % 4] for k, i in enumerate(joints)}
    team["reward"] = torch.tensor(
        [reward[int(team["joint_id"][i])] if p == JOINT_POLICY else float("nan")
         for i, p in enumerate(policy)]
    )  # fmt: skip
    assign(team, AlgorithmConfig(credit="magrpo", advantage="grpo"))
    rows = select_policy(team, "judge")
    b = rows.batch_size[0]
    assert b == 2 * 2 * 2 and bool(rows["valid"].all())  # goals x prompts x pictures

    # the plugin's own rollout of what the judge saw: each picture with the question
    pictures = [(ep.uid, m.to_pil()) for ep in wf.last_episodes for m in ep.messages
                if m.painting is not None]  # fmt: skip
    conversation = [
        {"role": "system", "content": paint_team.JUDGE_ROLE},
        {"role": "user", "content": "<image>" + paint_team.QUESTION},
    ]
    data = [{"prompt": conversation, "images": [pic], "answer": ""} for _, pic in pictures]
    judge = _judge(cfgs)
    items = VLDataset(DataConfig(kind="vl"), judge.tokenizer, name="judge", rows=data).items
    solo_ctx = Context(SimpleNamespace(policies={"judge": cfgs["judge"]}, seed=0),
                       {"judge": judge}, {"judge": VLEngine(judge, seed=3)})  # fmt: skip
    alone = VLSingleTurn(solo_ctx, policy="judge").rollout(items, replace(params, n=1))
    for key in ("prompt_ids", "prompt_mask", "response_ids", "response_mask", "loss_mask"):
        assert torch.equal(rows[key], alone[key]), key
    assert torch.equal(rows["rollout_logprobs"], alone["rollout_logprobs"])
    for mine, theirs in zip(strings(rows, "vision"), strings(alone, "vision"), strict=True):
        assert torch.equal(mine.pixel_values, theirs.pixel_values)
        assert torch.equal(mine.image_grid_thw, theirs.image_grid_thw)
    # the same rewards and groups: each row's joint reward, the goal's pictures a group
    alone["reward"] = torch.tensor([reward[m["joints"][0]] for m in strings(rows, "meta")])
    alone["uid"] = torch.tensor([uid for uid, _ in pictures])
    assign(alone, AlgorithmConfig(advantage="grpo"))
    torch.testing.assert_close(rows["advantages"], alone["advantages"], rtol=1e-6, atol=1e-7)
    assert float(rows["advantages"].abs().sum()) > 0

    results = []
    for batch in (rows, alone):
        fresh = _judge(cfgs)
        seen = grads_at_step(fresh)
        out = update(fresh, batch.clone(), AlgorithmConfig(), generator=torch.Generator())
        results.append((out, seen[0]))
    (m_team, g_team), (m_alone, g_alone) = results
    assert math.isfinite(m_team["loss"])
    assert m_team["loss"] == pytest.approx(m_alone["loss"], rel=1e-5, abs=1e-7)
    assert any(float(g.abs().sum()) > 0 for g in g_team)
    for a, c in zip(g_team, g_alone, strict=True):
        torch.testing.assert_close(a, c, rtol=1e-5, atol=1e-7)


def _fake_trajectory_rows(b: int):
    from tensordict import TensorDict

    from polyrl.core.record import set_strings

    td = TensorDict(
        {
            "latents": torch.randn((b, 5, 12, 8, 8)),
            "rollout_logprobs": torch.randn((b, 4)),
            "loss_mask": torch.ones((b, 4), dtype=torch.long),
            "response_mask": torch.ones((b, 4), dtype=torch.long),
            "advantages": torch.ones((b, 4)),
            "uid": torch.arange(b),
            "agent_id": torch.ones(b, dtype=torch.long),
            "turn": torch.zeros(b, dtype=torch.long),
            "node": torch.zeros(b, dtype=torch.long),
            "reward": torch.ones(b),
            "valid": torch.ones(b, dtype=torch.bool),
            "truncated": torch.zeros(b, dtype=torch.bool),
        },
        batch_size=[b],
    )
    for key, value in (("policy", "painter"), ("prompt_text", "red"), ("error", "")):
        set_strings(td, key, [value] * b)
    set_strings(td, "sampler", ["flow_sde"] * b)
    set_strings(td, "response_text", ["<image>"] * b)
    set_strings(td, "meta", [{}] * b)
    return td


# ------------------------------------------------------------------------- bad input


def _recipe(tmp_path, edit) -> Path:
    doc = yaml.safe_load(EXAMPLE.read_text())
    edit(doc)
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


def _agents(doc) -> dict:
    return {a["name"]: a for a in doc["rollout"]["args"]["agents"]}


BAD = {
    "painter on a text policy": (
        lambda d: _agents(d)["painter"].update(policy="writer"),
        "agent 'painter' .* asks it to paint images",
    ),
    "writer on the painter's policy": (
        lambda d: _agents(d)["writer"].update(policy="painter"),
        "agent 'writer' .* its policy paints images",
    ),
    "judge without a vision model": (
        lambda d: d["policies"]["judge"].update(kind="causal_lm", engine={"name": "hf"}),
        "agent 'judge' .* shows it images, which its engine does not take",
    ),
    "an unknown loss": (
        lambda d: _agents(d)["painter"]["loss"].update(policy_loss="ppo_clipp"),
        "loss.policy_loss='ppo_clipp' is not a policy loss",
    ),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_recipes_fail_at_load(case, tmp_path):
    """Loading the recipe (no model built) names the agent, the policy and the fix."""
    import polyrl.diffusion  # noqa: F401
    import polyrl.marl  # noqa: F401
    import polyrl.multimodal  # noqa: F401
    from polyrl.core.config import ConfigError, load
    from polyrl.core.recipe import Config

    edit, message = BAD[case]
    with pytest.raises(ConfigError, match=message):
        load(Config, _recipe(tmp_path, edit), [f"run.dir={tmp_path}/run"])


def test_member_loss_reaches_only_its_policy(tmp_path):
    """The painter's own clip range is what its update gets; the writer keeps the recipe's."""
    import polyrl.diffusion  # noqa: F401
    import polyrl.marl  # noqa: F401
    import polyrl.multimodal  # noqa: F401
    from polyrl.core.config import load
    from polyrl.core.recipe import Config
    from polyrl.core.registry import WORKFLOWS
    from polyrl.marl.config import resolve_agents

    cfg = load(Config, EXAMPLE, [f"run.dir={tmp_path}/run"])
    spec = WORKFLOWS.get("paint_team")
    agents = resolve_agents(
        cfg.rollout.args.agents, workflow="paint_team", roles=spec.roles,
        policies=cfg.policies, min_agents=1,
    )  # fmt: skip
    wf = SimpleNamespace(
        losses={a.policy: a.loss.overrides() for a in agents if a.loss.overrides()}
    )
    from polyrl.marl.runtime import MarlWorkflow

    painter_algo = MarlWorkflow.member_algorithm(wf, "painter", cfg.algorithm)
    writer_algo = MarlWorkflow.member_algorithm(wf, "writer", cfg.algorithm)
    assert (painter_algo.clip_ratio_low, painter_algo.clip_ratio_high) == (1e-4, 1e-4)
    assert writer_algo is cfg.algorithm and writer_algo.clip_ratio_low == 0.2


# ------------------------------------------------------------------------- the demo


def test_warm_start_rows_are_format_only(tmp_path):
    """The writer's rows name a uniformly random colour whatever its goal, except on the
    ``writer_hint`` share of rows, where they name it; the judge's prompts hold no picture:
    no warm start can solve the task."""
    from collections import Counter

    from polyrl.marl import paint_team

    def writer_hits(hint: float) -> float:
        out = tmp_path / f"hint{hint}"
        train, held = paint_team.write_dataset(
            out, seed=0, n_train=2000, per_colour_eval=2, writer_hint=hint
        )
        rows = [json.loads(x) for x in train.read_text().splitlines()]
        sft = paint_team.sft_rows(rows)
        writer = [r for r in sft if r["prompt"][0]["content"] == paint_team.WRITER_ROLE]
        judge = [r for r in sft if r["prompt"][0]["content"] == paint_team.JUDGE_ROLE]
        assert len(writer) == len(judge) == len(rows)
        assert {r["prompt"][1]["content"] for r in judge} == {paint_team.QUESTION}
        assert set(Counter(r["response"] for r in judge)) == set(paint_team.COLOURS)
        held_rows = [json.loads(x) for x in held.read_text().splitlines()]
        assert [r["answer"] for r in held_rows] == [c for c in paint_team.COLOURS for _ in (0, 1)]
        assert all(r["prompt"] == f"Goal: {r['answer']}" for r in held_rows)
        return sum(r["response"] in r["prompt"][1]["content"] for r in writer) / len(writer)

    chance = 1 / len(paint_team.COLOURS)
    assert writer_hits(0.0) == pytest.approx(chance, abs=0.03)
    assert writer_hits(0.3) == pytest.approx(0.3 + 0.7 * chance, abs=0.03)
    with pytest.raises(ValueError, match="writer_hint must be in"):
        paint_team.write_dataset(tmp_path / "bad", seed=0, writer_hint=1.5)


@pytest.mark.slow
def test_mixed_team_runs_one_version_ahead(tmp_path, one_thread):
    """``rollout.max_staleness: 1`` with the three kinds (tiny, untrained painter): every
    row, the painter's trajectories included, is at most one version old, none is dropped,
    and each member updates from its own rows."""
    from polyrl.core.loop import train

    run = train(one_ahead(tmp_path))
    check_one_ahead(run.path)


@pytest.mark.slow
def test_mixed_team_runs_partial_one_version_ahead(tmp_path, one_thread):
    """``rollout.partial: true`` with ``max_staleness: 1``: the text members' engines take
    newer weights between decoding steps, the painter's at the start of each sampling pass.
    Every member's rows carry the versions that sampled them (a painter row: one version on
    every denoising step), each row's ``policy_version`` is its oldest, within one of the
    weights it updates; the run's metrics hold the same bound."""
    from polyrl.core.loop import _steps
    from polyrl.core.runner.session import Session

    s = Session.open(one_ahead(tmp_path, "rollout.partial=true"))
    records = keep_records(s)  # the producer's batches, as the loop gets them
    with s.freed_on_error():
        _steps(s.cfg, s).check(f"{s.run.path}/samples/")
    check_one_ahead(s.run.path)
    check_row_versions(records)
