"""The diffusion SFT warm start (flow matching on given images) and no-CFG training."""

from __future__ import annotations

import json

import pytest
import torch

from polyrl.core.config import ConfigError
from polyrl.diffusion.sft import load_pairs, warm_start

RED, BLUE = (0.9, 0.1, 0.1), (0.1, 0.2, 0.9)


def _flat(colour, size=16) -> torch.Tensor:
    return torch.tensor(colour).reshape(3, 1, 1).expand(3, size, size).clone()


def _write_pairs(tmp_path):
    from polyrl.diffusion.rewards import to_pil

    rows = []
    for name, colour in (("red", RED), ("blue", BLUE)):
        to_pil(_flat(colour)).save(tmp_path / f"{name}.png")
        rows.append({"prompt": f"a {name} blob", "image": f"{name}.png"})
    path = tmp_path / "pairs.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return path


def _distance_to_targets(engine, prompts, targets) -> float:
    traj = engine.sample(prompts, n=2, deterministic=True)
    images = engine.decode(traj.latents[:, -1])
    want = targets[traj.prompt_index]
    return float(((images - want) ** 2).mean().sqrt())


def test_warm_start_fits_the_given_images(make_policy, tmp_path):
    """40 flow-matching steps on two flat images: the loss falls and the deterministic
    samples of those prompts move toward their images."""
    prompts, images = load_pairs(_write_pairs(tmp_path))
    assert prompts == ["a red blob", "a blue blob"] and images.shape == (2, 3, 16, 16)
    torch.testing.assert_close(images[0], _flat(RED), atol=1 / 255, rtol=0)
    policy, engine = make_policy(lr=3e-3, steps=6, guidance_scale=1.0)
    before = _distance_to_targets(engine, prompts, images)
    losses = warm_start(policy, prompts, images, steps=40, batch_size=8, lr=5e-3, seed=0)
    after = _distance_to_targets(engine, prompts, images)
    first, last = sum(losses[:4]) / 4, sum(losses[-4:]) / 4
    print(f"SFT loss {first:.3f} -> {last:.3f}; RMS to targets {before:.3f} -> {after:.3f}")
    assert last < 0.7 * first, losses
    assert after < 0.7 * before, (before, after)


def test_warm_start_data_errors_name_the_row(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"prompt": "x", "image": "missing.png"}) + "\n")
    with pytest.raises(ConfigError, match=r"bad.jsonl:1: image .*missing.png"):
        load_pairs(bad)
    with pytest.raises(ConfigError, match="no such file"):
        load_pairs(tmp_path / "none.jsonl")


def test_recipe_warm_start_runs_before_the_first_rollout(diffusion_config, tmp_path):
    """rollout.args.sft_steps/sft_data: the workflow warms the policy up when it starts."""
    from polyrl.core.runner.session import Session

    path = _write_pairs(tmp_path)
    cfg = diffusion_config(f"rollout.args={{sft_data: {path}, sft_steps: 3, sft_batch_size: 2}}")
    s = Session.open(cfg)
    losses = s.workflow.sft_losses
    assert len(losses) == 3 and all(x > 0 for x in losses)
    assert (tmp_path / "run" / "sft_warm_start.json").is_file()
    s.finish({})


def test_no_cfg_training_recomputes_with_the_conditional_velocity(make_policy, record_of):
    """train_cfg: false -- sampled with guidance 3, the recomputed log-prob is that of the
    conditional velocity alone: equal to a policy given the same rows with guidance 1."""
    guided, engine = make_policy(cfg_batch=False, guidance_scale=3.0)
    free, _ = make_policy(cfg_batch=False, guidance_scale=3.0, policy_args={"train_cfg": False})
    free.model.load_state_dict(guided.model.state_dict())
    _, rec = record_of(guided, engine)
    mask = rec["loss_mask"].bool()
    with_cfg, _ = guided.logprobs(rec)
    assert torch.equal(with_cfg[mask], rec["rollout_logprobs"][mask])
    without, _ = free.logprobs(rec)
    cond = rec.clone()
    cond["guidance"] = torch.ones_like(rec["guidance"])
    reference, _ = guided.logprobs(cond)
    assert torch.equal(without[mask], reference[mask])
    assert not torch.allclose(without[mask], with_cfg[mask])
    # gradients reach the LoRA-free transformer through the conditional branch alone
    without[mask].sum().backward()
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in free.model.parameters())
