"""The shared training core: record, registries, config, policies, engines, trainer, runs.

Importing it registers the core's built-in parts (engines, workflows, rewards, ...).
"""

import os

# Our progress bar is the one to watch; silence the hub's download/shard bars.
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")

from polyrl.core import (  # noqa: E402, F401, I001
    algorithms,
    backend,
    credit,
    data,
    engine,
    policy,
    ray_backend,
    rewards,
    tasks,
    tiny,
    vllm_engine,
    workflow,
)
from polyrl.core.registry import load_plugins  # noqa: E402, F401
