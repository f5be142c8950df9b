"""Two simulated Ray nodes (one CPU each) train one FSDP step of a 2-worker group.

Run in its own process by ``test_ray_backend.py`` (its cluster must not meet the test
session's). Prints one JSON line: the workers' node ids, the nodes and the update's loss.
Usage: python ray_multinode.py MODEL_DIR
"""

from __future__ import annotations

import json
import os
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import ray  # noqa: E402
import torch  # noqa: E402
from ray.cluster_utils import Cluster  # noqa: E402


def main(model_dir: str) -> None:
    torch.set_num_threads(1)
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1})
    cluster.add_node(num_cpus=1)
    ray.init(address=cluster.address, log_to_driver=False)
    cluster.wait_for_nodes()
    try:
        import polyrl.core  # noqa: F401
        from polyrl.core.config import load
        from polyrl.core.recipe import Config
        from polyrl.core.record import text_record
        from polyrl.core.registry import BACKENDS
        from polyrl.core.train.algorithms import AlgorithmConfig

        cfg = load(
            Config,
            None,
            [
                f"policies.main.model={model_dir}",
                "distributed.backend=ray",
                "distributed.args={workers_per_policy: 2, strategy: STRICT_SPREAD, "
                "placement_timeout_s: 60}",
            ],
        )
        backend = BACKENDS.get("ray")(cfg)
        policy = backend.make_policy(
            "main", cfg.policies["main"], total_steps=1, need_reference=False, shared={}
        )
        batch = text_record(
            prompt_ids=[[1, 2, 3], [4, 5], [6], [7, 8]],
            response_ids=[[9, 10], [11], [12, 13, 14], [15]],
            rollout_logprobs=[[0.0, 0.0], [0.0], [0.0] * 3, [0.0]],
            policy=["main"] * 4,
            uid=[0, 0, 1, 1],
            pad_id=0,
        )
        batch["advantages"] = torch.tensor([1.0, -1.0, 0.5, -0.5])[:, None] * batch["loss_mask"]
        out = backend.update(
            policy,
            batch,
            AlgorithmConfig(),
            temperature=1.0,
            generator=torch.Generator().manual_seed(0),
        )
        print(
            json.dumps(
                {
                    "workers": policy.group.nodes,
                    "nodes": sorted(n["NodeID"] for n in ray.nodes() if n["Alive"]),
                    "loss": out["loss"],
                    "grad_norm": out["grad_norm"],
                }
            ),
            flush=True,
        )
        backend.shutdown()
    finally:
        ray.shutdown()
        cluster.shutdown()


if __name__ == "__main__":
    main(sys.argv[1])
