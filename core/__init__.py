"""The shared training core: record, registries, config, policies, engines, trainer, runs.

Importing it registers the core's built-in parts (engines, workflows, rewards, ...).
"""

import os

# Our progress bar is the one to watch; silence the hub's download/shard bars.
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")

# imported for their registrations, in this order
from polyrl.core.train import algorithms  # noqa: E402, F401, I001
from polyrl.core.distributed import backend  # noqa: E402, F401, I001
from polyrl.core.train import credit  # noqa: E402, F401, I001
from polyrl.core.rollout import data  # noqa: E402, F401, I001
from polyrl.core.rollout import engine  # noqa: E402, F401, I001
from polyrl.core.train import policy  # noqa: E402, F401, I001
from polyrl.core.distributed import ray_backend  # noqa: E402, F401, I001
from polyrl.core.rollout import rewards  # noqa: E402, F401, I001
from polyrl.core import tasks  # noqa: E402, F401, I001
from polyrl.core.demo import tiny  # noqa: E402, F401, I001
from polyrl.core.rollout import vllm_engine  # noqa: E402, F401, I001
from polyrl.core.rollout import workflow  # noqa: E402, F401, I001
from polyrl.core.registry import load_plugins  # noqa: E402, F401
