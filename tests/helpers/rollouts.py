"""Parts for the async-rollout tests: an engine slower than the trainer and a reward that
makes the trainer the slower side, registered once (importing this module registers them)."""

from __future__ import annotations

import time

from polyrl.core.registry import ENGINES, REWARDS
from polyrl.core.rollout.engine import HFEngine

# A reward an untrained model earns about half the time: responses with a digit 0-4.
LOW_DIGIT = "{name: regex_format, args: {pattern: '[0-4]', mode: search}}"


class SlowEngine(HFEngine):
    """The HF engine, slowed down: stands in for an engine slower than the trainer."""

    def generate(self, prompts, params):
        time.sleep(0.3)
        return super().generate(prompts, params)


def slow_reward(sample) -> float:
    """Scored on the trainer's side: makes the trainer the slower one."""
    time.sleep(0.05)
    return 1.0 if any(c in "01234" for c in sample.response) else 0.0


if "test_slow_hf" not in ENGINES:
    ENGINES.register("test_slow_hf", SlowEngine)
if "test_slow_low_digit" not in REWARDS:
    REWARDS.register("test_slow_low_digit", slow_reward)
