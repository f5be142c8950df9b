"""``rollout.partial`` through the gateway: an agent written against the ``openai`` client
trains with engines that take newer weights mid-call; every completion row records its
tokens' versions and the staleness bound holds."""

from __future__ import annotations

from pathlib import Path

from tests.helpers.partial import check_partial_run

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def test_gateway_partial_rollouts_keep_the_staleness_bound(tmp_path):
    import polyrl.core  # noqa: F401
    from polyrl.core.config import load
    from polyrl.core.loop import train
    from polyrl.core.recipe import Config

    cfg = load(
        Config,
        str(EXAMPLES / "gateway_calculator.yaml"),
        [
            f"run.dir={tmp_path}/run",
            "run.progress=false",
            "run.tensorboard=false",
            "run.save_every=0",
            "run.export=false",
            f"task.dir={tmp_path}/data",
            "task.args={n_train: 32, n_eval: 4, lo: 10, hi: 49}",
            f"policies.main.model={tmp_path}/model",
            "policies.main.engine.name=tests.helpers.crawling_engine:CrawlingEngine",
            "sft.steps=20",
            "rollout.n=4",
            "rollout.prompts_per_step=4",
            "rollout.max_staleness=1",
            "rollout.partial=true",
            "train.steps=4",
            "eval.every=0",
        ],
    )
    run = train(cfg)
    steps = check_partial_run(run.path, 4, every=False)  # agents start batches late
    assert all(r["rollout/valid_frac"] > 0 for r in steps.values())
