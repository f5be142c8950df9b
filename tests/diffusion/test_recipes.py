"""The GPU recipes load and validate with the core's config loader, without loading models."""

from __future__ import annotations

from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
RECIPES = {
    "sd35m_pickscore_lora.yaml": ("stabilityai/stable-diffusion-3.5-medium", "pickscore"),
    "flux1dev_hps_lora.yaml": ("black-forest-labs/FLUX.1-dev", "hpsv2"),
    "diffusion_sd35m_flow_grpo.yaml": ("stabilityai/stable-diffusion-3.5-medium", "pickscore"),
}


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_recipe_loads_and_validates_without_models(name, monkeypatch):
    import polyrl.core  # noqa: F401
    import polyrl.diffusion  # noqa: F401
    from polyrl.core.config import load
    from polyrl.core.recipe import Config
    from polyrl.diffusion import models
    from polyrl.diffusion.engine import sampling_options
    from polyrl.diffusion.policy import policy_options

    def no_load(*a, **k):
        raise AssertionError("a model was loaded while validating a recipe")

    for family in models.FAMILIES:
        monkeypatch.setattr(models.FAMILIES.get(family), "__init__", no_load)
    cfg = load(Config, EXAMPLES / name)  # runs Config.validate()
    cfg.validate()
    model, reward = RECIPES[name]
    main = cfg.policies["main"]
    assert main.kind == "diffusion" and main.model == model and main.lora.r > 0
    assert main.dtype == "bfloat16"
    sampling = sampling_options(main, "main")
    policy_options(main, "main")
    assert sampling.sampler == "flow_sde" and sampling.steps >= 2
    assert cfg.rollout.workflow == "text_to_image" and cfg.algorithm.credit == "per_prompt"
    assert [t.name for t in cfg.reward.terms] == [reward]


def test_hps_placeholder_path_fails_before_sampling():
    """The FLUX recipe's HPS checkpoint is a placeholder: preparing the reward (done before
    the first rollout) names it."""
    import polyrl.diffusion  # noqa: F401
    from polyrl.core.config import load
    from polyrl.core.recipe import Config
    from polyrl.diffusion.rewards import prepare_rewards

    cfg = load(Config, EXAMPLES / "flux1dev_hps_lora.yaml")
    placeholder = cfg.reward.terms[0].args["checkpoint"]
    if Path(placeholder).expanduser().exists():
        pytest.skip(f"{placeholder} exists on this machine: preparing would load ViT-H-14")
    with pytest.raises(FileNotFoundError, match=placeholder):
        prepare_rewards(cfg.reward.terms)


def test_flow_grpo_port_uses_flow_grpo_conventions_and_values():
    """The Flow-GRPO port (config/grpo.py pickscore_sd3) sets its KL form and log-prob
    convention, and its published values: beta 0.01, clip range 1e-4, adv clip 5, its
    advantage epsilon 1e-4 and no dual clip."""
    import polyrl.diffusion  # noqa: F401
    from polyrl.core.config import load
    from polyrl.core.recipe import Config
    from polyrl.diffusion.engine import sampling_options
    from polyrl.diffusion.policy import policy_options

    cfg = load(Config, EXAMPLES / "diffusion_sd35m_flow_grpo.yaml")
    main = cfg.policies["main"]
    assert policy_options(main, "main").kl_form == "flow_grpo"
    sampling = sampling_options(main, "main")
    assert (sampling.sampler, sampling.logprob, sampling.noise_level) == (
        "flow_sde",
        "gaussian",
        0.7,
    )
    assert (sampling.steps, sampling.guidance_scale, sampling.train_steps.mode) == (10, 4.5, "all")
    algo = cfg.algorithm
    assert (algo.kl_coef, algo.kl_estimator) == (0.01, "gaussian_mean")
    assert algo.clip_ratio_low == algo.clip_ratio_high == 1e-4
    assert algo.epsilon == 1e-4 and algo.clip_ratio_c == float("inf")  # std + 1e-4, no dual clip
    assert algo.credit_args.adv_clip == 5.0 and algo.credit_args.global_std
    assert (cfg.rollout.n, cfg.rollout.prompts_per_step, algo.minibatches) == (24, 48, 2)
