"""Gateway demo 1 through the other APIs: the same calculator task and recipe
(``examples/gateway_calculator.yaml``), its agent written as an OpenAI Agents SDK agent
(Responses API) or an ``anthropic`` tool loop (Messages API), from
``examples/gateway_calculator_apis.py``. Held-out greedy success (per episode) rises past
the warm start, three seeds per API, under ``seeds`` (CI skips it: the API adapters' rows
are checked token for token in test_gateway_apis.py, and the learning run itself is CI's
in test_gateway_demos.py through the Chat API).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers.examples import example_for_spawned_workers

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
AGENTS = {  # an override is not looked up beside the recipe: the full path
    "agents_sdk": f"{EXAMPLES}/gateway_calculator_apis.py:solve_agents_sdk",
    "messages": f"{EXAMPLES}/gateway_calculator_apis.py:solve_messages",
}


@pytest.fixture(scope="module")
def demos():
    """``examples/gateway_demos.py``, importable by name in the spawned workers too."""
    with example_for_spawned_workers("gateway_demos") as module:
        yield module


def overrides(out: Path, api: str, seed: int) -> list[str]:
    """Demo 1's recipe with the agent swapped."""
    return [
        f"seed={seed}",
        f"run.dir={out}/{api}-seed{seed}",
        f"task.dir={out}/{api}-data-seed{seed}",
        f"policies.main.model={out}/model",
        "eval.every=0",
        f"rollout.args.agent={AGENTS[api]}",
    ]


@pytest.mark.learning
@pytest.mark.seeds
@pytest.mark.parametrize("api", sorted(AGENTS))
def test_an_agent_on_another_api_three_seeds(api, demos, tmp_path):
    from concurrent.futures import ProcessPoolExecutor
    from multiprocessing import get_context

    with ProcessPoolExecutor(2, mp_context=get_context("spawn")) as pool:
        jobs = [
            pool.submit(demos.run_recipe, str(demos.DEMO1), overrides(tmp_path, api, s))
            for s in (0, 1, 2)
        ]
        results = [j.result() for j in jobs]
    starts = [r["curve"][0][1] for r in results]
    ends = [r["curve"][-1][1] for r in results]
    for seed, (s, e) in enumerate(zip(starts, ends, strict=True)):
        print(f"demo 1 via {api}, seed {seed}: held-out success {s:.3f} -> {e:.3f}")
    gain = sum(ends) / 3 - sum(starts) / 3
    print(f"demo 1 via {api}: mean gain {gain:+.3f}")
    assert gain >= 0.15
