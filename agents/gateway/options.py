"""The gateway's one options type: ``rollout.args`` of the ``gateway`` workflow.

The workflow, the server, the API parsers and the budgets all read this one object: what
runs the agents (``agent`` or ``command``), how the server batches and waits, and what one
request, one episode and one rollout may cost (see :mod:`polyrl.agents.gateway.limits`).
"""

from __future__ import annotations

from dataclasses import dataclass

from polyrl.core.config import ConfigError, doc
from polyrl.core.options import Options

MIB = 1024 * 1024

# (option, lowest value) of the integer limits
_AT_LEAST = (
    ("concurrency", 1),
    ("max_images", 0),
    ("max_pixels", 1),
    ("max_body_bytes", 1024),
    ("max_messages", 1),
    ("max_stop", 0),
    ("max_stop_chars", 1),
    ("max_episode_bytes", 1024),
    ("max_rollout_bytes", 1024),
    ("max_episode_requests", 1),
    ("max_episode_rows", 1),
    ("max_episode_tokens", 1),
)


@dataclass
class GatewayOptions(Options):
    """How the gateway runs agents, and what one request, episode and rollout may cost.

    Past a limit a request is refused before it costs the run memory or engine time.
    Code that builds the workflow itself may give ``agent`` as the function."""

    agent: str | None = doc(
        None, "the agent: package.module:function or ./file.py:function, sync or async"
    )
    command: list[str] | None = doc(
        None,
        "instead of agent: a program (argv) run once per episode with OPENAI_BASE_URL, "
        "OPENAI_API_KEY, POLYRL_MODEL and POLYRL_TASK (the row as JSON) set; its last stdout "
        "line (JSON: a number, {reward, success} or null) is its return",
    )
    concurrency: int = doc(64, "episodes running at once")
    request_timeout: float = doc(60.0, "seconds a request may wait for the engine")
    episode_timeout: float = doc(300.0, "seconds an episode may run")
    batch_wait: float = doc(
        0.02,
        "an engine call starts when every open episode has a request waiting, or when no "
        "request arrived for this many seconds (not before half the last engine call's time "
        "has passed: agents answered together come back one by one)",
    )
    reproducible: bool = doc(
        False,
        "serve each request in an engine call of its own, sampled from a stream of the run's "
        "seed, its episode and its place in the episode: the same run gives the same rows "
        "whatever order and timing the agents' requests arrive in (and --resume continues "
        "exactly), at the cost of batching requests across episodes",
    )
    host: str = doc("127.0.0.1", "the address the server binds (keep 127.0.0.1 unless needed)")
    policy: str | None = doc(None, "the default model for agents (null: the first)")
    max_images: int = doc(16, "images one request may carry (image_url data URLs; a VLM policy)")
    max_pixels: int = doc(
        4096 * 4096, "source pixels (width * height) one request's images may sum to"
    )
    max_body_bytes: int = doc(
        32 * MIB, "bytes one request's body may have (413 past it, checked before parsing)"
    )
    max_messages: int = doc(1024, "messages (or input items) one request may carry")
    max_stop: int = doc(4, "stop strings one request may give")
    max_stop_chars: int = doc(64, "characters one stop string may have")
    max_episode_bytes: int = doc(
        128 * MIB,
        "bytes one episode may hold: every request's body, stored history it continues, "
        "images (3 bytes a pixel), 8 a token id (413 past it)",
    )
    max_rollout_bytes: int = doc(
        4096 * MIB, "bytes all episodes of one rollout may hold together (413 past it)"
    )
    max_episode_requests: int = doc(512, "completion requests one episode may make (429 past it)")
    max_episode_rows: int = doc(
        1024, "record rows (choices, n per request) one episode may make (429 past it)"
    )
    max_episode_tokens: int = doc(
        262144, "tokens the engine may sample for one episode (429 once reached)"
    )
    body_timeout: float = doc(
        30.0, "seconds a request's body may take to arrive (408 and closed past it)"
    )
    reward_posts: bool = doc(
        True,
        "take rewards agents post (POST <base_url>/rewards); false: only their return value "
        "(403 to a post)",
    )
    isolate_commands: bool = doc(
        True,
        "run each command agent in its own user and PID namespace (unshare), so it cannot "
        "read other episodes' keys or the trainer's memory; a warning where the machine "
        "offers none",
    )

    def check(self, where: str = "rollout.args", source: str = "<config>") -> None:
        """The ranges and the agent/command choice (a ``ConfigError`` naming the option),
        at load time and when the workflow is built."""
        for key, lo in _AT_LEAST:
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int) or value < lo:
                raise ConfigError(f"{where}.{key} must be an integer >= {lo}, got {value!r}")
        for key in ("request_timeout", "episode_timeout", "body_timeout"):
            t = getattr(self, key)
            if isinstance(t, bool) or not isinstance(t, (int, float)) or not 0 < t < float("inf"):
                raise ConfigError(f"{where}.{key} must be a number > 0 (seconds), got {t!r}")
        if not self.batch_wait >= 0:
            raise ConfigError(f"{where}.batch_wait must be >= 0, got {self.batch_wait}")
        if (self.agent is None) == (not self.command):
            raise ConfigError(
                f"{where}: give exactly one of agent (a Python function) and command (an "
                f"external program's argv); got agent={self.agent!r}, command={self.command!r}"
            )
        if self.command and not all(isinstance(a, str) and a for a in self.command):
            raise ConfigError(f"{where}.command must be a list of strings, got {self.command}")
