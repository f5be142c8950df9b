"""Image turns under the Ray backend (issue 21): Demo A's recipe, local and on Ray.

Both runs start from one warm start (made once, locally, and exported), so the engine
actor holds the local engine's weights and seed: its multi-turn episodes (a 56x56 view,
then, after ``zoom k``, the tool's crop) must be the local ones, and the sharded update of
rows whose images sit at two places in the row must give the local loss, KL and grad norm.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.ray, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
RAY = [
    "distributed.backend=ray",
    "distributed.args={workers_per_policy: 2, collective_timeout_s: 120}",
]
KEYS = ("main/loss", "main/kl", "main/grad_norm")


def _recipe(run_dir: Path, model: Path, *extra: str):
    import polyrl.multimodal  # noqa: F401
    from polyrl.core.config import load
    from polyrl.core.recipe import Config

    return load(
        Config,
        ROOT / "examples" / "vl_zoom.yaml",
        [
            f"run.dir={run_dir}",
            f"policies.main.model={model}",
            "run.progress=false",
            "run.tensorboard=false",
            "eval.every=0",
            f"task.dir={run_dir.parent}/data",
            "task.args.n_train=8",
            "task.args.n_eval=2",
            "rollout.prompts_per_step=4",
            "rollout.n=4",
            "algorithm.ppo_epochs=1",
            "policies.main.micro_batch_size=8",
            *extra,
        ],
    )


def _metrics(run_dir: Path, step: int) -> dict:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {k: v for r in rows if r.get("step") == step for k, v in r.items()}


def _samples(run_dir: Path, step: int) -> list[tuple]:
    text = (run_dir / "samples" / f"train_step_{step:06d}.jsonl").read_text().splitlines()
    return [(r["response"], r["reward"]) for r in map(json.loads, text)]


def test_image_turns_on_ray_match_local_mode(ray_cluster, tmp_path):
    from polyrl.core.loop import train

    torch.set_num_threads(1)
    warm = train(
        _recipe(tmp_path / "warm", tmp_path / "tiny", "sft.steps=40", "train.steps=0")
    ).path
    model = warm / "export" / "main"
    local, remote = tmp_path / "local", tmp_path / "ray"
    common = (f"policies.main.model={model}", "sft.steps=0", "train.steps=2", "run.export=false")
    train(_recipe(local, model, *common))
    train(_recipe(remote, model, *common, *RAY))
    for step in (1, 2):  # step 2 samples from the synced weights of the first update
        ml, mr = _metrics(local, step), _metrics(remote, step)
        print(step, {k: (ml[k], mr[k]) for k in ("images_kept", *KEYS)})
        # some episodes zoomed: more images than the 16 first views
        assert ml["images_kept"] > 16
        assert _samples(remote, step) == _samples(local, step)
        assert mr["images_kept"] == ml["images_kept"]
        for key in KEYS:
            assert mr[key] == pytest.approx(ml[key], rel=1e-4, abs=1e-7), key


@pytest.mark.vllm
def test_image_turns_on_a_vllm_engine_actor_match_the_trainer(ray_cluster, tmp_path):
    """The same recipe with ``vllm_vl`` on the Ray engine actor: the driver's workflow
    sends the joined image turns to the actor, vLLM samples them, and the sharded
    trainer's log-probs equal vLLM's, before and after the first weight push."""
    pytest.importorskip("vllm")
    from polyrl.core.loop import train

    torch.set_num_threads(1)
    run = tmp_path / "vllm"
    train(
        _recipe(
            run,
            tmp_path / "tiny",
            "sft.steps=40",
            "train.steps=2",
            "run.export=false",
            "policies.main.engine.name=vllm_vl",
            "policies.main.engine.args={max_model_len: 256, kv_cache_gb: 0.0625}",
            *RAY,
        )
    )
    for step in (1, 2):
        m = _metrics(run, step)
        print(step, m["images_kept"], m["main/mismatch/logp_abs_max"])
        assert m["images_kept"] > 16
        assert m["main/mismatch/logp_abs_max"] <= 1e-5
        assert m["main/mismatch/logp_abs_mean"] > 0
