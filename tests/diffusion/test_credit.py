"""Per-prompt advantages (Flow-GRPO statistics) against a hand computation, and the options
that reach them from a recipe: global std, no std, clipping."""

from __future__ import annotations

import math

import pytest
import torch

from polyrl.diffusion.credit import per_prompt_advantages

# two prompts: A has rewards 1, 3 (mean 2, population std 1); B has 0, 0, 6 (mean 2, std √8)
REWARDS = torch.tensor([1.0, 3.0, 0.0, 0.0, 6.0])
GROUPS = torch.tensor([0, 0, 1, 1, 1])


def test_per_prompt_mean_and_std():
    adv = per_prompt_advantages(REWARDS, GROUPS, eps=0.0)
    s8 = math.sqrt(8)
    assert adv.tolist() == pytest.approx([-1.0, 1.0, -2 / s8, -2 / s8, 4 / s8], abs=1e-6)


def test_global_std_divides_every_prompt_by_the_batch_std():
    adv = per_prompt_advantages(REWARDS, GROUPS, global_std=True, eps=0.0)
    batch_std = math.sqrt(sum((r - 2.0) ** 2 for r in REWARDS.tolist()) / 5)  # mean is 2
    expected = [(r - 2.0) / batch_std for r in REWARDS.tolist()]  # both prompts' mean is 2
    assert adv.tolist() == pytest.approx(expected, abs=1e-6)


def test_without_std_only_the_prompt_mean_is_removed():
    adv = per_prompt_advantages(REWARDS, GROUPS, norm_by_std=False)
    assert adv.tolist() == pytest.approx([-1.0, 1.0, -2.0, -2.0, 4.0], abs=1e-6)


def test_clipping_bounds_the_advantages_and_leaves_the_rest():
    adv = per_prompt_advantages(REWARDS, GROUPS, norm_by_std=False, clip=1.5)
    assert adv.tolist() == pytest.approx([-1.0, 1.0, -1.5, -1.5, 1.5], abs=1e-6)
    assert per_prompt_advantages(
        REWARDS, GROUPS, norm_by_std=False, clip=0
    ).tolist() == pytest.approx([-1.0, 1.0, -2.0, -2.0, 4.0], abs=1e-6)  # 0: no clipping


def test_recipe_options_reach_the_credit(diffusion_config):
    """algorithm.credit_args.adv_clip / global_std reach the ``per_prompt`` credit as its
    keyword options (nothing travels on the record)."""
    from polyrl.core.record import strings
    from polyrl.core.rollout import rewards
    from polyrl.core.runner.session import Session
    from polyrl.core.train.credit import assign

    s = Session.open(diffusion_config("algorithm.credit_args={adv_clip: 0.5, global_std: true}"))
    record = s.workflow.rollout(s.sampler.next_batch(), s.ctx.sampling())
    rewards.score(record, s.cfg.reward)
    assign(record, s.cfg.algorithm)
    adv, mask = record["advantages"], record["loss_mask"].bool()
    row = torch.where(mask.any(1), adv.sum(1) / mask.sum(1).clamp(min=1), torch.zeros(()))
    texts = strings(record, "prompt_text")
    ids = torch.tensor([sorted(set(texts)).index(t) for t in texts])
    expected = per_prompt_advantages(
        record["reward"], ids, global_std=True, eps=s.cfg.algorithm.epsilon, clip=0.5
    )
    assert torch.allclose(row, expected, atol=1e-6)
    assert row.abs().max() <= 0.5 + 1e-6
    s.finish({})


def test_a_negative_clip_is_refused_at_load_naming_the_key():
    from polyrl.core.config import ConfigError
    from polyrl.core.registry import CREDIT

    with pytest.raises(ConfigError, match=r"algorithm.credit_args.adv_clip=-1.0 in r.yaml"):
        CREDIT.bind("per_prompt", {"adv_clip": -1.0}, "algorithm.credit_args", "r.yaml")
