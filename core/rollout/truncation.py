"""A console warning, once per run, when too many responses hit the length limit.

A response cut at ``rollout.max_new_tokens`` looks like a wrong answer (or, to an agent
framework, like no tool call at all: the call's closing tag never came), so it scores
low and RL learns to avoid what was cut, e.g. a tool call longer than the limit. Only
``rollout/truncated_frac`` in metrics.jsonl showed it; :class:`TruncationWatch` says it on
the console the first time a step's share passes ``rollout.warn_truncated``, with the
recipe key, its value, the lengths and the fix.
"""

from __future__ import annotations

import statistics
import sys
from collections.abc import Mapping
from typing import TextIO

from tensordict import TensorDict

# A workflow that can tell a cut tool call from a cut answer reports how many rows ended
# inside one under this metric (the gateway does); the warning then says so.
TOOL_CALL_CUT = "rollout/tool_call_cut"


class TruncationWatch:
    """Watches each step's record; warns once (see the module doc)."""

    def __init__(self, max_new_tokens: int, threshold: float, out: TextIO | None = None) -> None:
        self.max_new_tokens = max_new_tokens
        self.threshold = threshold
        self.out = out
        self.warned = False

    def step(self, step: int, record: TensorDict, metrics: Mapping[str, float]) -> bool:
        """Warn (the first time only) when ``step``'s truncated share passes the threshold;
        returns whether it warned now."""
        if self.warned or self.threshold >= 1 or record.batch_size[0] == 0:
            return False
        cut = record["truncated"].bool()
        n, k = record.batch_size[0], int(cut.sum())
        if k / n <= self.threshold:
            return False
        lengths = record["response_mask"].sum(-1)
        cut_len = statistics.median(lengths[cut].tolist())
        done = lengths[~cut].tolist()
        rest = f", the others' {statistics.median(done):g}" if done else ""
        calls = int(metrics.get(TOOL_CALL_CUT, 0))
        tools = f"; {calls} of them ended inside a tool call ({TOOL_CALL_CUT})" if calls else ""
        print(
            f"warning: step {step}: {k} of {n} responses ({k / n:.0%}) were cut at the length "
            f"limit, rollout.max_new_tokens={self.max_new_tokens} (median length of the cut "
            f"ones {cut_len:g} tokens{rest}){tools}. A cut answer or tool call scores as a "
            "failure, so RL learns to avoid it: raise rollout.max_new_tokens (or the "
            "max_tokens your agent asks for), or shorten what the model must write. "
            f"Warned once (rollout.warn_truncated={self.threshold}); metrics.jsonl has "
            "rollout/truncated_frac for every step.",
            file=self.out or sys.stderr,
            flush=True,
        )
        self.warned = True
        return True
