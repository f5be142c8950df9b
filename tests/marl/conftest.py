"""Fixtures for the marl tests: hand-built joint records, a tiny signaling model, and
workflows wired to real tiny policies with engines that count their generate calls."""

from __future__ import annotations

import random

import pytest
import torch


def _build(joints: list, agents: list, shuffle: int | None = None):
    from polyrl.core.record import concat, text_record
    from polyrl.marl.record import JOINT_POLICY

    jr = text_record(
        prompt_ids=[[] for _ in joints],
        response_ids=[[] for _ in joints],
        rollout_logprobs=[[] for _ in joints],
        policy=[JOINT_POLICY] * len(joints),
        uid=[j.uid for j in joints],
        pad_id=0,
        agent_id=[-1] * len(joints),
        turn=[j.turn for j in joints],
        node=[j.parent if j.tree else 0 for j in joints],
        meta=[
            {
                "joint": j.id,
                "parent": j.parent,
                "turn": j.turn,
                "scored": j.scored,
                "episode": j.episode,
            }
            for j in joints
        ],
    )
    jr["joint_id"] = torch.tensor([j.id for j in joints])
    jr["reward"] = torch.tensor([j.reward if j.scored else float("nan") for j in joints])
    jr["valid"] = torch.tensor([j.scored for j in joints])
    ar = text_record(
        prompt_ids=[[5, 6] for _ in agents],
        response_ids=[[7] * a.tokens for a in agents],
        rollout_logprobs=[[-1.0] * a.tokens for a in agents],
        policy=[a.policy for a in agents],
        uid=[a.uid for a in agents],
        pad_id=0,
        agent_id=[a.agent for a in agents],
        turn=[a.turn for a in agents],
        node=[a.node for a in agents],
        meta=[{"joints": list(a.joints), "episode": a.episode} for a in agents],
    )
    ar["joint_id"] = torch.full((len(agents),), -1)
    ar["valid"][:] = False
    rec = concat([jr, ar])
    if shuffle is not None:
        order = list(range(rec.batch_size[0]))
        random.Random(shuffle).shuffle(order)
        rec = rec[torch.tensor(order)]
    return rec


@pytest.fixture
def joint_record():
    """Build a scored multi-agent record: ``joint_record(joints, agents, shuffle=seed)``.

    Joint rows come first (as the runtime writes them) unless ``shuffle`` (a seed) permutes
    all rows; agent rows enter pending (not valid, no error) as the runtime leaves them.
    """
    return _build


@pytest.fixture
def algo():
    """An AlgorithmConfig factory (magrpo credit, mean baseline by default)."""
    from polyrl.core.train.algorithms import AlgorithmConfig

    def make(**kw):
        kw.setdefault("credit", "magrpo")
        kw.setdefault("advantage", "drgrpo")
        return AlgorithmConfig(**kw)

    return make


@pytest.fixture(scope="session")
def signaling_model_dir(tmp_path_factory) -> str:
    """A tiny Qwen2 whose tokenizer is trained on the signaling game's corpus."""
    from tests.helpers.models import SIGNALING, tiny_text_model

    return tiny_text_model(tmp_path_factory, "tiny-signaling", SIGNALING, plugin="polyrl.marl")


class CountingEngine:
    """Wraps an engine and records every generate call (prompt count, n)."""

    def __init__(self, inner, log: list, name: str) -> None:
        self.inner, self.log, self.name = inner, log, name

    def generate(self, prompts, params):
        self.log.append((self.name, len(prompts), params.n))
        return self.inner.generate(prompts, params)

    def sync(self):
        return self.inner.sync()

    def state_dict(self):
        return self.inner.state_dict()

    def load_state_dict(self, state):
        self.inner.load_state_dict(state)


@pytest.fixture
def marl_config(signaling_model_dir, tmp_path):
    """A signaling-game Config (two policies on the tiny model); pass key=value overrides."""
    from polyrl.core.config import load
    from polyrl.core.recipe import Config

    base = [
        f"run.dir={tmp_path}/run",
        "run.progress=false",
        "run.tensorboard=false",
        "run.export=false",
        "task.name=signaling",
        f"task.dir={tmp_path}/data",
        "task.args={n_train: 200, n_eval: 24, n_objects: 4, n_candidates: 3, n_symbols: 4}",
        f"policies.speaker.model={signaling_model_dir}",
        f"policies.listener.model={signaling_model_dir}",
        "rollout.workflow=signaling",
        "rollout.n=4",
        "rollout.prompts_per_step=4",
        "rollout.max_new_tokens=2",
        "algorithm.credit=magrpo",
        "algorithm.advantage=drgrpo",
        "reward.terms=[{name: exact_match}]",
        "data.max_prompt_tokens=64",
        "eval.data.shuffle=false",
        "train.steps=2",
    ]

    def make(*overrides: str) -> Config:
        import polyrl.core  # noqa: F401
        from polyrl.core.registry import load_plugins

        load_plugins()
        return load(Config, None, base + list(overrides))

    return make


@pytest.fixture
def build_workflow():
    """``build_workflow(cfg) -> (workflow, calls)``: real tiny policies and HF engines wrapped
    to count generate calls; no session, no data files."""
    from polyrl.core.registry import POLICIES, WORKFLOWS
    from polyrl.core.rollout.engine import HFEngine
    from polyrl.core.rollout.workflow import Context

    def make(cfg, policies=None):
        calls: list = []
        if policies is None:
            shared: dict = {}
            policies = {
                n: POLICIES.get(p.kind)(n, p, total_steps=1, need_reference=False, shared=shared)
                for n, p in cfg.policies.items()
            }
        engines = {
            n: CountingEngine(HFEngine(p, seed=i), calls, n)
            for i, (n, p) in enumerate(policies.items())
        }
        ctx = Context(cfg, policies, engines)
        return WORKFLOWS.get(cfg.rollout.workflow)(ctx, **cfg.rollout.args), calls

    return make


def items(rows: list[dict], prompt_field: str = "prompt"):
    from polyrl.core.rollout.data import PromptItem

    return [
        PromptItem(
            uid=i,
            prompt_ids=[],
            prompt_text=str(r.get(prompt_field, "")),
            answer=r.get("answer"),
            row=r,
        )
        for i, r in enumerate(rows)
    ]


@pytest.fixture
def make_items():
    """Dataset rows -> PromptItems (uid = position)."""
    return items
