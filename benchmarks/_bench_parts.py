"""Parts the async benchmark names in its recipe, importable by Ray's actors too (the
benchmark puts this directory on their PYTHONPATH)."""

from __future__ import annotations

import json
import os
import time
from typing import Annotated

from polyrl.core.rollout.engine import HFEngine


class BenchHF(HFEngine):
    """The HF engine with an injected latency per generate call (a sleep, which holds no
    core: an engine busy on its own device). Each call's duration is appended to the file
    named by ``POLYRL_BENCH_TIMES``, from whichever process the engine runs in."""

    def __init__(
        self,
        policy,
        *,
        seed: int = 0,
        latency_s: Annotated[float, "sleep per generate call"] = 0.0,
    ) -> None:
        super().__init__(policy, seed=seed)
        self.latency_s = latency_s

    def generate(self, prompts, params):
        t0 = time.perf_counter()
        if self.latency_s:
            time.sleep(self.latency_s)
        out = super().generate(prompts, params)
        if path := os.environ.get("POLYRL_BENCH_TIMES"):
            with open(path, "a") as f:
                f.write(json.dumps([time.perf_counter() - t0, time.time()]) + "\n")
        return out
