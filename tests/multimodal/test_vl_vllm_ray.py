"""``vllm_vl`` on a Ray engine actor: the recipe check admits it, the actor samples with
images what the FSDP worker scores, and a sync after an update moves it (vision tower
included) to the trained weights. vLLM starts inside the actor's process."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytest.importorskip("vllm")

from polyrl.core.rollout.engine import SamplingParams  # noqa: E402
from polyrl.core.train.algorithms import AlgorithmConfig  # noqa: E402
from polyrl.core.train.credit import group_credit  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.ray]

RECIPE = Path(__file__).resolve().parents[2] / "examples" / "vl_shapes_grpo.yaml"


def test_vllm_vl_engine_actor_matches_the_trainer_and_follows_sync(
    ray_cluster, tiny_vl_dir, vl_rows, tmp_path, logprob_gaps, update_both
):
    import polyrl.multimodal  # noqa: F401
    from polyrl.core.config import load
    from polyrl.core.distributed.backend import LocalBackend
    from polyrl.core.distributed.ray_backend import RayBackend
    from polyrl.core.recipe import Config
    from polyrl.core.rollout.data import DataConfig
    from polyrl.core.rollout.workflow import Context
    from polyrl.multimodal.data import VLDataset
    from polyrl.multimodal.workflow import VLSingleTurn

    cfg = load(
        Config,
        RECIPE,
        [
            f"run.dir={tmp_path}/run",
            f"policies.main.model={tiny_vl_dir}",
            "policies.main.engine.name=vllm_vl",
            "policies.main.optim.lr=1e-2",
            "policies.main.engine.args={max_model_len: 256, kv_cache_gb: 0.0625}",
            "distributed.backend=ray",
            "distributed.args={workers_per_policy: 1}",
        ],
    )
    backend = RayBackend(cfg)
    try:
        pcfg = cfg.policies["main"]
        remote = backend.make_policy("main", pcfg, total_steps=10, need_reference=False, shared={})
        engine = backend.make_engine("main", remote, pcfg, seed=0)
        local = LocalBackend(cfg).make_policy(
            "main", pcfg, total_steps=10, need_reference=False, shared={}
        )
        old = LocalBackend(cfg).make_policy(
            "main", pcfg, total_steps=10, need_reference=False, shared={}
        )
        assert engine.caps.needs_images  # the workflow hands the actor the resized images
        items = list(
            VLDataset(
                DataConfig(kind="vl", args={"min_pixels": 56 * 56, "max_pixels": 112 * 112}),
                local.tokenizer,
                name="t",
                rows=vl_rows,
            )
        )
        wf = VLSingleTurn(Context(cfg=None, policies={"main": local}, engines={"main": engine}))
        params = SamplingParams(n=4, max_new_tokens=6)

        rec = wf.rollout(items, params)
        (first,) = logprob_gaps(rec, local)
        print(f"vllm_vl actor vs trainer: mean |diff| {first.mean():.2e}, max {first.max():.2e}")
        assert first.mean() <= 1e-3, first

        rec["reward"] = torch.arange(rec.batch_size[0]).remainder(2).float()
        group_credit(rec, AlgorithmConfig())
        update_both(backend, remote, local, rec)
        engine.sync()
        new, stale = logprob_gaps(wf.rollout(items, params), local, old)
        print(
            f"after sync: mean |diff| to the trained weights {new.mean():.2e}, "
            f"to the old ones {stale.mean():.2e}"
        )
        assert new.mean() <= 1e-3, new
        assert stale.mean() > 10 * new.mean() + 1e-3, (stale.mean(), new.mean())
    finally:
        backend.shutdown()
