"""The text-to-image workflow through the core's session and loop; bad input fails early."""

from __future__ import annotations

import json

import pytest
import torch

from polyrl.core.config import ConfigError
from polyrl.core.record import strings
from polyrl.core.rollout import rewards
from polyrl.core.train.credit import assign


def test_two_training_steps_write_metrics_grids_checkpoint_and_export(diffusion_config):
    from polyrl.core.loop import train

    cfg = diffusion_config("algorithm.kl_coef=0.01", "algorithm.kl_estimator=gaussian_mean")
    run = train(cfg)
    lines = [json.loads(x) for x in (run.path / "metrics.jsonl").read_text().splitlines()]
    steps = [x for x in lines if "main/loss" in x]
    assert len(steps) == 2 and all(x["rollout/rows"] == 12 for x in steps)
    assert all(x["main/kl"] is not None and x["main/kl"] >= 0 for x in steps)
    assert any("eval/accuracy" in x for x in lines)
    assert (run.path / "grid_before.png").is_file() and (run.path / "grid_after.png").is_file()
    assert list((run.path / "samples").glob("eval_rollout_*.png"))
    assert (run.path / "checkpoints" / "step_000002" / "COMPLETE").is_file()
    assert (run.path / "export" / "main" / "pytorch_lora_weights.safetensors").is_file()


def test_resume_continues_the_engine_state(diffusion_config):
    from polyrl.core.loop import train
    from polyrl.core.runner.session import Session

    train(diffusion_config("train.steps=1", "run.export=false"))
    cfg = diffusion_config("train.steps=1", "run.resume=true")
    s = Session.open(cfg, record=False)
    assert s.step == 1 and s.engines["main"].rollouts == 1


def test_record_rewards_and_credit(diffusion_config):
    from polyrl.core.runner.session import Session

    s = Session.open(diffusion_config())
    record = s.workflow.rollout(s.sampler.next_batch(), s.ctx.sampling())
    n = record.batch_size[0]
    assert n == 12 and record["latents"].shape == (12, 5, 12, 8, 8)
    assert record["rollout_logprobs"].dtype == torch.float32
    assert (record["loss_mask"].sum(1) == 2).all()  # round(0.5 * 3) steps of 4, not the last
    assert all(len(m["images"]) == 1 for m in strings(record, "meta"))
    metrics = rewards.score(record, s.cfg.reward)
    assert torch.isfinite(record["reward"]).all() and metrics["reward/errors"] == 0
    assign(record, s.cfg.algorithm)
    adv = record["advantages"]
    assert adv.shape == record["loss_mask"].shape
    assert (adv[record["loss_mask"] == 0] == 0).all()
    # per-prompt groups: advantages of one prompt sum to ~0
    texts = strings(record, "prompt_text")
    for t in set(texts):
        rows = [i for i, x in enumerate(texts) if x == t]
        assert abs(float(adv[rows].sum(1).sum())) < 1e-3
    s.finish({})


def test_nan_row_is_left_out_and_the_rest_trains(diffusion_config):
    from polyrl.core.record import select_policy
    from polyrl.core.runner.session import Session

    s = Session.open(diffusion_config())
    policy = s.policies["main"]
    velocity = policy.velocity

    def poison(x, *a, **k):
        v = velocity(x, *a, **k)
        if not torch.is_grad_enabled() and x.shape[0] == 12:  # sampling, not training
            v = v.clone()
            v[5] = float("nan")
        return v

    policy.velocity = poison
    record = s.workflow.rollout(s.sampler.next_batch(), s.ctx.sampling())
    policy.velocity = velocity
    errors = strings(record, "error")
    assert "NaN" in errors[5] and not record["valid"][5]
    assert sum(bool(e) for e in errors) == 1
    rewards.score(record, s.cfg.reward)
    assign(record, s.cfg.algorithm)
    assert torch.isnan(record["reward"][5]) and record["valid"].sum() == 11
    out = s.update("main", select_policy(record[record["valid"]], "main"))
    assert out["skipped_nonfinite"] == 0 and torch.isfinite(torch.tensor(out["loss"]))
    s.finish({})


BAD_SETTINGS = [
    ("policies.main.engine.args.sampler=flow_sdee", "did you mean 'flow_sde'"),
    ("policies.main.engine.args.samplr=cps", "did you mean policies.main.engine.args.sampler"),
    ("policies.main.engine.args.sampler=ode", "without noise"),
    ("policies.main.engine.name=hf", "engine 'hf' has no option 'height'"),
    ("policies.main.engine.args.train_steps.mode=windw", "did you mean 'window'"),
    ("policies.main.args.text_encoder=false", "did you mean policies.main.args.text_encoder_3"),
    ("policies.main.args.max_sequence_length=0", "max_sequence_length must be in"),
    ("policies.main.engine.args.steps=1", "steps must be >= 2"),
    ("rollout.args.grid_scal=2", "did you mean rollout.args.grid_scale"),
    ("algorithm.credit_args.adv_clp=3", "did you mean algorithm.credit_args.adv_clip"),
    ("rollout.args.adv_clip=3", "workflow 'text_to_image' has no option 'adv_clip'"),
    ("sft.steps=3", "sft.steps"),
]


@pytest.mark.parametrize("override,match", BAD_SETTINGS)
def test_bad_settings_fail_at_config_time(diffusion_config, override, match, monkeypatch):
    from polyrl.diffusion import models

    def no_load(*a, **k):  # nothing may load before the settings are checked
        raise AssertionError("a model was loaded before the settings were checked")

    monkeypatch.setattr(models.SD3Family, "__init__", no_load)
    with pytest.raises(ConfigError, match=match):
        diffusion_config(override)  # load(Config, ...) itself


def test_a_diffusion_policy_needs_the_diffusion_engine(diffusion_config):
    with pytest.raises(ConfigError, match="set engine.name: diffusion"):
        diffusion_config("policies.main.engine.name=hf", "policies.main.engine.args={}")


def test_sampler_settings_are_checked_again_before_models_load(diffusion_config, monkeypatch):
    """A config built in code (not through load) still fails before any model loads."""
    from polyrl.core.runner.session import Session
    from polyrl.diffusion import models

    cfg = diffusion_config()
    cfg.policies["main"].engine.args.sampler = "cpss"
    monkeypatch.setattr(models.SD3Family, "__init__", lambda *a, **k: 1 / 0)
    with pytest.raises(ConfigError, match="did you mean 'cps'"):
        Session.open(cfg)


def test_missing_reward_model_fails_before_sampling(diffusion_config, monkeypatch):
    from polyrl.core.runner.session import Session
    from polyrl.diffusion.engine import DiffusionEngine

    def no_sampling(*a, **k):
        raise AssertionError("sampled before the reward model was checked")

    monkeypatch.setattr(DiffusionEngine, "sample", no_sampling)
    cfg = diffusion_config(
        "reward.terms=[{name: t2i_clip_score, args: {pretrained: /nonexistent/open_clip.bin}}]"
    )
    with pytest.raises(FileNotFoundError, match="/nonexistent/open_clip.bin"):
        Session.open(cfg)


MY_REWARD = '''
from typing import Annotated

import numpy as np


def redness(sample, *, channel: Annotated[int, "0 red, 1 green, 2 blue"] = 0) -> float:
    """Mean of one colour channel of the row's image, in [0, 1]."""
    image = np.asarray(sample.images[0], dtype=np.float32) / 255.0  # a PIL RGB image
    return float(image[..., channel].mean())
'''

MY_TASK = """
import json
from pathlib import Path
from typing import Annotated


class Prompts:
    @staticmethod
    def write_dataset(
        out_dir, seed: int, *, subject: Annotated[str, "what every prompt asks for"] = "red"
    ):
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        paths = []
        for split, rows in (("train", 16), ("eval", 2)):
            path = out / f"{split}.jsonl"
            lines = [json.dumps({"prompt": f"a {subject} blob"}) for _ in range(rows)]
            path.write_text("\\n".join(lines) + "\\n")
            paths.append(path)
        return tuple(paths)
"""


def test_your_own_reward_and_task_from_files(diffusion_config, tmp_path):
    """The README's "your own reward / task": files named in the recipe, options checked
    against their keyword parameters, the reward sees the decoded image."""
    import numpy as np

    from polyrl.core.runner.session import Session

    (tmp_path / "my_reward.py").write_text(MY_REWARD)
    (tmp_path / "my_task.py").write_text(MY_TASK)
    reward = f"{tmp_path}/my_reward.py:redness"
    overrides = [
        f"task.name={tmp_path}/my_task.py:Prompts",
        "task.args={subject: blue}",
        "data.answer_field=null",
        "eval.data.answer_field=null",
        "eval.accuracy_term=null",
        f"reward.terms=[{{name: '{reward}', args: {{channel: 2}}}}]",
    ]
    with pytest.raises(ConfigError, match="did you mean reward.terms.0..args.channel"):
        diffusion_config(
            *overrides[:-1], f"reward.terms=[{{name: '{reward}', args: {{chanel: 2}}}}]"
        )
    s = Session.open(diffusion_config(*overrides))
    record = s.workflow.rollout(s.sampler.next_batch(), s.ctx.sampling())
    assert set(strings(record, "prompt_text")) == {"a blue blob"}
    rewards.score(record, s.cfg.reward)
    blue = [float(np.asarray(m["images"][0])[..., 2].mean()) / 255 for m in strings(record, "meta")]
    assert record["reward"].tolist() == pytest.approx(blue, rel=1e-6)
    s.finish({})
