"""The shared training core: record, registries, config, policies, engines, trainer, runs.

Importing it registers the core's built-in parts (engines, workflows, rewards, ...).
"""

from polyrl.core import algorithms, credit, engine, policy, rewards, tasks, tiny, workflow  # noqa: F401
from polyrl.core.registry import load_plugins  # noqa: F401
