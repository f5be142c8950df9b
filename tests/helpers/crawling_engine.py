"""An HF engine that makes every partial rollout span an update, whatever the machine's
load: used by name in local mode and by file path on a Ray engine actor."""

from __future__ import annotations

import time

from polyrl.core.rollout.engine import HFEngine


class CrawlingEngine(HFEngine):
    """The HF engine, waiting before the second decoding step of each partial call after
    the first until the trainer publishes newer weights (at most 30 s): every batch after
    the first spans an update, whatever the machine's load."""

    _producer = None
    partial_calls = 0

    def set_refresh(self, fn):
        self._producer, self._steps, self._start = fn, 0, None
        self.partial_calls += fn is not None
        super().set_refresh(None if fn is None else self._waiting_refresh)

    def _waiting_refresh(self) -> int:
        version = self._producer()
        self._steps += 1
        self._start = version if self._start is None else self._start
        if self.partial_calls > 1 and self._steps == 2:
            deadline = time.monotonic() + 30
            while version == self._start and time.monotonic() < deadline:
                time.sleep(0.05)
                version = self._producer()
        return version


class ResumableCrawler(CrawlingEngine):
    """The crawling engine with its count of partial calls in its state, so that a
    resumed run's engine waits for the publish where the killed run's did. (The crawler
    polls ``refresh`` while it waits; the producer replays by refresh call, so a resumed
    crawler that did not wait would take the replayed older version at that step.)"""

    def state_dict(self) -> dict:
        return super().state_dict() | {"partial_calls": self.partial_calls}

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        self.partial_calls = state["partial_calls"]
