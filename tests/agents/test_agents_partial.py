"""``rollout.partial`` with ``multi_turn``: newer weights taken between decoding steps of a
turn, each action token's version recorded (environment tokens: -1), every log-prob equal
to an independent step-by-step reference that switches weights where the engine did, and
the staleness bound held through the core loop."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from polyrl.agents.env import Environment, StepResult, register_env
from polyrl.core.record import strings
from polyrl.core.rollout.engine import HFEngine, SamplingParams
from tests.helpers.partial import check_partial_run, mixed_logprobs, moved

RECIPE = Path(__file__).resolve().parents[2] / "examples" / "gridworld_gigpo.yaml"
SWITCH = 6  # the refresh loads the new weights at its 7th call (inside the first turn's call)


@register_env("test_agents_partial_echo")
class EchoEnv(Environment):
    """Ends after the row's ``turns``; each reply names the turn (inline, deterministic)."""

    def reset(self, task):
        self.turns, self.t = task["turns"], 0
        return task["prompt"]

    def step(self, action):
        self.t += 1
        return StepResult(f"turn {self.t} seen", 0.0, self.t >= self.turns, {})


def switching_refresh(model: torch.nn.Module, new_state: dict, calls: list[int]):
    def refresh() -> int:
        calls.append(1)
        if len(calls) == SWITCH + 1:
            model.load_state_dict(new_state)
        return int(len(calls) > SWITCH)

    return refresh


@pytest.mark.parametrize("mode", ["step", "concat"])
def test_multi_turn_records_token_versions_equal_to_a_switching_reference(
    grid_model_dir, items, mode
):
    from polyrl.agents.workflow import MultiTurn
    from polyrl.core.rollout.rollouts import shadow
    from polyrl.core.rollout.workflow import Context
    from polyrl.core.train.policy import CausalLMPolicy, PolicyConfig

    policy = CausalLMPolicy(
        "main", PolicyConfig(model=grid_model_dir), total_steps=1, need_reference=False
    )
    twin = shadow(policy)
    old = {k: v.clone() for k, v in twin.model.state_dict().items()}
    new = moved(old, 0.05, seed=1)
    engine = HFEngine(twin, seed=0)
    calls: list[int] = []
    engine.set_refresh(switching_refresh(twin.model, new, calls))
    wf = MultiTurn(
        Context(None, {"main": twin}, {"main": engine}),
        env="test_agents_partial_echo",
        mode=mode,
        max_turns=3,
        max_turn_tokens=4,
    )
    rows = [{"prompt": f"go {k}", "turns": t} for k, t in enumerate((3, 2))]
    rec = wf.rollout(items(rows), SamplingParams(n=2, max_new_tokens=4))
    assert len(calls) > SWITCH + 1  # the switch happened inside the rollout

    tv, mask = rec["token_version"], rec["loss_mask"]
    lengths = rec["response_mask"].sum(1)
    ref_model = shadow(policy).model
    seen = set()
    gaps = []
    metas = strings(rec, "meta")
    for i in range(rec.batch_size[0]):
        n = int(lengths[i])
        versions = tv[i, :n].tolist()
        sampled = mask[i, :n].bool().tolist()
        assert all((v >= 0) == s for v, s in zip(versions, sampled, strict=True))
        prompt = rec["prompt_ids"][i][rec["prompt_mask"][i].bool()].tolist()
        response = rec["response_ids"][i, :n].tolist()
        logps = rec["rollout_logprobs"][i, :n]
        for _turn, start, end in metas[i]["spans"]:  # each action on its own prompt
            if mode == "step":
                context, tokens = prompt, response[start:end]
            else:
                context, tokens = prompt + response[:start], response[start:end]
            vs = versions[start:end]
            seen.update(vs)
            assert vs == sorted(vs)  # a turn never goes back to older weights
            ref = mixed_logprobs(ref_model, {0: old, 1: new}, context, tokens, vs)
            gaps.append(float((ref - logps[start:end]).abs().max()) if tokens else 0.0)
    assert seen == {0, 1}
    assert max(gaps) < 1e-4


def test_multi_turn_partial_rollouts_keep_the_staleness_bound(grid_model_dir, tmp_path):
    import polyrl.core  # noqa: F401
    from polyrl.core.config import load
    from polyrl.core.loop import train
    from polyrl.core.recipe import Config

    cfg = load(
        Config,
        str(RECIPE),
        [
            f"run.dir={tmp_path}/run",
            "run.progress=false",
            "run.tensorboard=false",
            "run.save_every=0",
            f"task.dir={tmp_path}/data",
            "sft.steps=0",
            "task.args={n_train: 16, n_eval: 4, size: 3, holes: 1, min_dist: 2}",
            f"policies.main.model={grid_model_dir}",
            "policies.main.build=null",
            "policies.main.build_args=null",
            "policies.main.engine.name=tests.helpers.crawling_engine:CrawlingEngine",
            "rollout.args={env: gridworld, mode: step, history: 0, max_turns: 3,"
            " max_turn_tokens: 2}",
            "rollout.n=4",
            "rollout.prompts_per_step=4",
            "rollout.max_staleness=1",
            "rollout.partial=true",
            "train.steps=3",
            "eval.every=0",
        ],
    )
    run = train(cfg)
    check_partial_run(run.path, 3)
