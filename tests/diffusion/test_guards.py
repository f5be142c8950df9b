"""Guards: GRPO-Guard's ratio normalisation and 1/|dt| step weights, per-term advantages,
the diversity metric and its guard -- each against a float64 or hand computation."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from tensordict import TensorDict

from polyrl.core.config import ConfigError
from polyrl.core.registry import CREDIT
from polyrl.core.train.algorithms import AlgorithmConfig
from polyrl.diffusion.credit import per_prompt_credit
from polyrl.diffusion.guards import (
    group_diversity,
    inverse_dt_weights,
    normalised_log_ratio,
    ratio_scale,
)
from polyrl.diffusion.samplers import gaussian_log_prob, neg_mse_log_prob


def _gaussian_step(seed: int, s: float, n: int = 4096):
    """float64: old and new means, the recorded sample x = mu_old + s·eps, and eps."""
    rng = np.random.default_rng(seed)
    mu_old = rng.normal(size=(1, n))
    delta = 0.05 * rng.normal(size=(1, n))
    eps = rng.normal(size=(1, n))
    return mu_old, mu_old + delta, mu_old + s * eps, eps, delta


@pytest.mark.parametrize("form", ["gaussian", "neg_mse"])
@pytest.mark.parametrize("s", [0.03, 0.4])
def test_normalised_log_ratio_is_mean_eps_delta(form, s):
    """log r̃ = c·(log r + b) = mean(ε·Δ) for both log-prob conventions (float64 by hand)."""
    mu_old, mu_new, x, eps, delta = _gaussian_step(0, s)
    lp = gaussian_log_prob if form == "gaussian" else neg_mse_log_prob
    t = [torch.from_numpy(a) for a in (x, mu_new, mu_old)]
    std = torch.tensor([s])
    logp, old = lp(t[0], t[1], std), lp(t[0], t[2], std)
    got = normalised_log_ratio(logp, old, t[1], t[2], std, form)
    expected = float((eps * delta).mean())
    assert got.item() == pytest.approx(expected, rel=2e-3, abs=1e-6)
    # by hand, the raw log-ratio of the Gaussian density: mean(εΔ)/s - mean(Δ²)/(2s²)
    if form == "gaussian":
        raw = (eps * delta).mean() / s - (delta**2).mean() / (2 * s * s)
        assert (logp - old).item() == pytest.approx(raw, rel=2e-3)


def test_normalised_ratios_have_one_spread_across_steps():
    """Raw log-ratios of two steps with the same mean shift but stds 0.03 and 0.4 are centred
    below 0 and spread 13x apart; normalised, both are centred at 0 with one spread."""
    rng = np.random.default_rng(1)
    n, draws = 64, 4000
    delta = 0.02 * rng.normal(size=(1, n))
    raw, norm = {}, {}
    for s in (0.03, 0.4):
        eps = rng.normal(size=(draws, n))
        mu_old = np.zeros((draws, n))
        mu_new = mu_old + delta
        x = mu_old + s * eps
        t = [torch.from_numpy(a) for a in (x, mu_new, mu_old)]
        std = torch.full((draws,), s)
        lp, lo = gaussian_log_prob(t[0], t[1], std), gaussian_log_prob(t[0], t[2], std)
        raw[s] = (lp - lo).double().numpy()
        norm[s] = normalised_log_ratio(lp, lo, t[1], t[2], std, "gaussian").double().numpy()
        b = float((delta**2).mean()) / (2 * s * s)
        assert raw[s].mean() == pytest.approx(-b, abs=4 * raw[s].std() / math.sqrt(draws))
        assert abs(norm[s].mean()) < 4 * norm[s].std() / math.sqrt(draws)
    assert raw[0.03].std() / raw[0.4].std() == pytest.approx(0.4 / 0.03, rel=0.1)
    assert norm[0.03].std() / norm[0.4].std() == pytest.approx(1.0, rel=0.1)


def test_ratio_scale_per_convention_and_zero_on_deterministic_steps():
    std = torch.tensor([0.5, 0.0, 0.25])
    assert ratio_scale(std, "gaussian").tolist() == [0.5, 0.0, 0.25]
    assert ratio_scale(std, "neg_mse").tolist() == [1.0, 0.0, 2.0]
    with pytest.raises(ValueError, match="not gaussian or neg_mse"):
        ratio_scale(std, "k3")


@pytest.mark.parametrize("sampler,form", [("flow_sde", "gaussian"), ("cps", "neg_mse")])
def test_policy_ratio_norm_scales_recomputed_logprobs(make_policy, record_of, sampler, form):
    """With ratio_norm the recomputed log-prob of every trained step is c(std) times the plain
    one, and the record scaled as the workflow scales it gives a first ratio of exactly 1."""
    plain, engine = make_policy(sampler=sampler, cfg_batch=False, logprob=form)
    guarded, _ = make_policy(
        sampler=sampler, cfg_batch=False, logprob=form, policy_args={"ratio_norm": True}
    )
    guarded.model.load_state_dict(plain.model.state_dict())
    traj, rec = record_of(plain, engine)
    mask = rec["loss_mask"].bool()
    c = ratio_scale(traj.stds, form)
    base, _ = plain.logprobs(rec)
    norm, _ = guarded.logprobs(rec)
    assert bool((c[mask] > 0).all())
    torch.testing.assert_close(norm[mask], (c * base)[mask], rtol=1e-6, atol=0)
    recorded = rec["rollout_logprobs"] * c  # what TextToImage.rollout records
    assert torch.equal(norm.detach()[mask], recorded[mask])


def test_inverse_dt_weights_by_hand():
    """σ 1 -> 0.8 -> 0.5 -> 0: |dt| 0.2, 0.3, 0.5; trained steps 0 and 1: 1/|dt| = 5, 10/3,
    mean 25/6, so the weights are 1.2 and 0.8 (step 2 untrained: 0)."""
    sigmas = torch.tensor([[1.0, 0.8, 0.5, 0.0]])
    w = inverse_dt_weights(sigmas, torch.tensor([[1, 1, 0]]))
    assert w.tolist()[0] == pytest.approx([1.2, 0.8, 0.0], abs=1e-6)


def _record(rewards, texts, terms=None, images=None, sigmas=None, mask=None):
    b = len(rewards)
    n = 3
    td = TensorDict(
        {
            "reward": torch.tensor(rewards, dtype=torch.float32),
            "valid": torch.ones(b, dtype=torch.bool),
            "agent_id": torch.zeros(b, dtype=torch.long),
            "loss_mask": mask if mask is not None else torch.ones((b, n), dtype=torch.long),
            "sigmas": sigmas if sigmas is not None else torch.linspace(1, 0, n + 1).expand(b, -1),
        },
        batch_size=[b],
    )
    for k, v in (terms or {}).items():
        td[f"reward_terms/{k}"] = torch.tensor(v, dtype=torch.float32)
    from tensordict import NonTensorData, NonTensorStack

    td["prompt_text"] = NonTensorStack(*[NonTensorData(t) for t in texts])
    metas = [{"images": [im]} if images is not None else {} for im in (images or [None] * b)]
    td["meta"] = NonTensorStack(*[NonTensorData(m) for m in metas])
    return td


def _credit(record, **options):
    bound = CREDIT.bind("per_prompt", options, "algorithm.credit_args", "test")
    return per_prompt_credit(record, AlgorithmConfig(epsilon=0.0), **bound)


def test_per_term_advantages_by_hand():
    """Two prompts; term a = [1, 3 | 0, 0, 6], term b = [4, 2 | 1, 2, 3], weights 1 and 0.5.
    Each term is normalised in its group (population std), then weighted and summed."""
    a = [1.0, 3.0, 0.0, 0.0, 6.0]
    bb = [4.0, 2.0, 1.0, 2.0, 3.0]
    texts = ["p", "p", "q", "q", "q"]
    rec = _record([0.0] * 5, texts, terms={"a": a, "b": bb})
    out = _credit(rec, terms={"a": 1.0, "b": 0.5}, adv_clip=0.0)
    s8, s23 = math.sqrt(8), math.sqrt(2 / 3)
    a_adv = [-1, 1, -2 / s8, -2 / s8, 4 / s8]
    b_adv = [1, -1, -1 / s23, 0, 1 / s23]
    expected = [x + 0.5 * y for x, y in zip(a_adv, b_adv, strict=True)]
    assert rec["advantages"][:, 0].tolist() == pytest.approx(expected, abs=1e-5)
    assert out["advantage/b/mean_abs"] == pytest.approx(np.mean(np.abs(b_adv)), abs=1e-5)
    # one combined reward of the same terms gives another advantage: the option matters
    combined = _record([x + 0.5 * y for x, y in zip(a, bb, strict=True)], texts)
    _credit(combined, adv_clip=0.0)
    assert not torch.allclose(combined["advantages"][:, 0], rec["advantages"][:, 0])


def test_per_term_credit_names_a_missing_term():
    rec = _record([0.0, 1.0], ["p", "p"], terms={"a": [0.0, 1.0]})
    with pytest.raises(ConfigError, match=r"terms names 'c'.*\['a'\]"):
        _credit(rec, terms={"c": 1.0})


def test_inv_dt_step_weights_reach_the_advantages():
    sigmas = torch.tensor([[1.0, 0.8, 0.5, 0.0]] * 2)
    mask = torch.tensor([[1, 1, 0]] * 2)
    rec = _record([0.0, 1.0], ["p", "p"], sigmas=sigmas, mask=mask)
    _credit(rec, step_weight="inv_dt")
    expected = torch.tensor([[-1.2, -0.8, 0.0], [1.2, 0.8, 0.0]])
    torch.testing.assert_close(rec["advantages"], expected, rtol=0, atol=1e-5)


def test_diversity_by_hand():
    """Three flat images at 0, 0.5 and 1: RMS distances 0.5, 1, 0.5; mean 2/3; each image's
    mean distance to the others 0.75, 0.5, 0.75."""
    ims = torch.stack([torch.full((3, 4, 4), v) for v in (0.0, 0.5, 1.0)])
    div, per = group_diversity(ims)
    assert div == pytest.approx(2 / 3)
    assert per.tolist() == pytest.approx([0.75, 0.5, 0.75])
    assert group_diversity(ims[:1])[0] == 0.0


def test_diversity_guard_fires_only_below_its_floor():
    """Group p (flat 0, 0.5, 1: diversity 2/3) and group q (three equal images: 0). With a
    floor of 0.5 only q is below it; q's images are all alike, so its term is 0, and p gets
    nothing: the advantages stay those of the reward. With a floor of 1 p fires too: its
    distinct images (0 and 1) gain weight·(0.75 - 2/3)/std, the middle one loses."""
    flat = [np.full((4, 4, 3), v, dtype=np.float32) for v in (0.0, 0.5, 1.0)]
    same = [np.full((4, 4, 3), 0.2, dtype=np.float32)] * 3
    texts = ["p"] * 3 + ["q"] * 3
    rewards = [0.0, 1.0, 2.0, 0.0, 1.0, 2.0]
    plain = _record(rewards, texts)
    _credit(plain, adv_clip=0.0)
    low = _record(rewards, texts, images=flat + same)
    out = _credit(low, adv_clip=0.0, diversity_floor=0.5, diversity_weight=2.0)
    assert out["diversity/mean"] == pytest.approx(1 / 3, abs=1e-6)
    assert out["diversity/min"] == pytest.approx(0.0, abs=1e-6)
    assert out["guard/fired_frac"] == 0.5
    torch.testing.assert_close(low["advantages"], plain["advantages"])
    high = _record(rewards, texts, images=flat + same)
    out = _credit(high, adv_clip=0.0, diversity_floor=1.0, diversity_weight=2.0)
    assert out["guard/fired_frac"] == 1.0
    per = np.array([0.75, 0.5, 0.75])
    term = 2.0 * (per - per.mean()) / (per - per.mean()).std()
    expected = plain["advantages"][:, 0].double().numpy()
    expected[:3] += term
    assert high["advantages"][:, 0].tolist() == pytest.approx(expected.tolist(), rel=1e-4)


def test_guard_options_are_checked_at_load():
    with pytest.raises(ConfigError, match=r"step_weight='dt'.*uniform, inv_dt"):
        CREDIT.bind("per_prompt", {"step_weight": "dt"}, "algorithm.credit_args", "r.yaml")
    with pytest.raises(ConfigError, match=r"diversity_floor and diversity_weight in r.yaml"):
        CREDIT.bind("per_prompt", {"diversity_floor": -1}, "algorithm.credit_args", "r.yaml")


def test_recipe_with_ratio_norm_records_what_the_policy_recomputes(diffusion_config):
    """Through the recipe: the workflow records GRPO-Guard's scaled log-probs, equal to the
    policy's recomputation, and an update with 1/|dt| step weights starts at ratio 1."""
    from polyrl.core.rollout import rewards
    from polyrl.core.runner.session import Session
    from polyrl.core.train.credit import assign

    cfg = diffusion_config(
        "policies.main.args={max_sequence_length: 1, ratio_norm: true}",
        "algorithm.credit_args={step_weight: inv_dt}",
    )
    s = Session.open(cfg)
    record = s.workflow.rollout(s.sampler.next_batch(), s.ctx.sampling())
    policy = s.policies["main"]
    mask = record["loss_mask"].bool()
    logp, _ = policy.logprobs(record)
    torch.testing.assert_close(logp[mask], record["rollout_logprobs"][mask], rtol=0, atol=1e-5)
    rewards.score(record, s.cfg.reward)
    assign(record, s.cfg.algorithm)
    out = s.update("main", record)
    assert out["ppo_kl"] == pytest.approx(0.0, abs=1e-6) and out["grad_norm"] > 0
    s.finish({})


@pytest.mark.parametrize(
    "overrides,match",
    [
        (
            (
                "policies.main.args={max_sequence_length: 1, ratio_norm: true}",
                "algorithm.kl_coef=0.01",
                "algorithm.kl_estimator=k3",
            ),
            r"ratio_norm.*kl_estimator='k3'.*gaussian_mean",
        ),
        (
            (
                "policies.main.kind=diffusion_nft",
                "policies.main.args={max_sequence_length: 1, ratio_norm: true}",
                "algorithm.policy_loss=diffusion_nft",
            ),
            r"ratio_norm: kind 'diffusion_nft' trains on the forward process",
        ),
        (
            ("algorithm.credit_args={terms: {colour: 1.0, jpeg: 1.0}}",),
            r"credit_args.terms names \['jpeg'\].*\['colour', 'colour_accuracy'\]",
        ),
    ],
)
def test_guard_options_that_cannot_work_fail_at_load(diffusion_config, overrides, match):
    from polyrl.core.recipe import Config

    with pytest.raises(ConfigError, match=match):
        Config.validate(diffusion_config(*overrides))


def test_pairwise_distances_match_a_direct_float64_computation():
    from polyrl.diffusion.guards import pairwise_distances

    ims = torch.rand(5, 3, 8, 8, generator=torch.Generator().manual_seed(0))
    a = ims.double().flatten(1).numpy()
    direct = np.sqrt(((a[:, None, :] - a[None, :, :]) ** 2).mean(-1))
    np.testing.assert_allclose(pairwise_distances(ims).numpy(), direct, rtol=1e-9, atol=1e-12)
