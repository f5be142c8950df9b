"""Helpers shared by test modules, so that no test module imports another.

``tests`` is no package: pytest's importlib mode (pyproject.toml) registers it as a namespace
package while it imports the test files, so ``tests.helpers.<topic>`` imports like
``tests.core.crawling_engine`` does, in the test process and in what it loads by module path.

- ``models``: the tiny offline models the fixtures build (one builder, sizes as arguments).
- ``trainer``: tiny causal-LM policies, sampled records, gradients seen by the optimizer.
- ``packing``: the padded/packed log-prob passes compared by the packing tests.
- ``runs``: what a run directory holds (metrics by step, checkpoint parts), recipes.
- ``rollouts``: slowed engine and reward registered for the async-rollout tests.
- ``partial``: a refresh that switches weights at a known decoding step.
- ``agents``: the scripted engine and rows of the agents tests.
- ``gateway``: the spy engine, record lookups, agents and recipe of the gateway tests.
"""
