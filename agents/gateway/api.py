"""The gateway's one API interface: every wire API it serves (OpenAI Chat Completions,
OpenAI Responses, Anthropic Messages) is a :class:`WireAPI` object in the server's table
(:data:`polyrl.agents.gateway.server.APIS`).

An API turns a body into the gateway's :class:`~polyrl.agents.gateway.requests.Request`
(reading only an :class:`ApiContext`, never the server), shapes the answer from the
:class:`~polyrl.agents.gateway.episodes.Call` the server sampled, its errors, and, for a
streamed request, its events (:class:`StreamEvents`, driven token by token by the one
streaming driver, :func:`polyrl.agents.gateway.stream.drive`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

from polyrl.agents.gateway.episodes import Call, EpisodeState
from polyrl.agents.gateway.errors import RequestError
from polyrl.agents.gateway.options import GatewayOptions
from polyrl.agents.gateway.requests import Request
from polyrl.core.rollout.engine import SamplingParams


@dataclass(frozen=True)
class ApiContext:
    """What an API reads to parse a body: the models served, the rollout's sampling
    settings (the defaults a request may narrow) and the gateway's limits."""

    models: list[str]
    defaults: SamplingParams
    limits: GatewayOptions


class StreamEvents(Protocol):
    """One streamed answer in its API's events. The driver calls :meth:`opening`, then
    :meth:`token` per sampled token (as the engine samples; an engine that cannot stream
    gives them all once the call ends), then :meth:`closing` with the finished call, or
    :meth:`failed` when the call failed after the stream began."""

    def opening(self) -> list[bytes]: ...

    def token(self, choice: int, token: int, logprob: float, top: Any) -> list[bytes]: ...

    def closing(self, call: Call) -> list[bytes]: ...

    def failed(self, error: RequestError) -> list[bytes]: ...


class WireAPI(Protocol):
    """One wire API of the gateway: its routes, parser, answer, stream and error shape."""

    paths: tuple[str, ...]  # routes under an episode's base URL (``/ep/<token>/v1``)

    def parse(self, body: Any, ctx: ApiContext, ep: EpisodeState) -> Request: ...

    def answer(self, req: Request, call: Call, tok: Any, ep: EpisodeState) -> dict[str, Any]: ...

    def stream(self, req: Request, tok: Any, ep: EpisodeState, prompt_len: int) -> StreamEvents:
        """The events of a streamed answer; ``prompt_len``: the prompt's tokens."""
        ...

    def error_body(self, e: RequestError) -> dict[str, Any]: ...
