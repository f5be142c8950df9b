"""The agent gateway: train agents written against the OpenAI or Anthropic clients,
unchanged (the ``gateway`` workflow; :mod:`~polyrl.agents.gateway.workflow` says how).

The package, from the bottom up:

- ``errors``, ``options``: the error answer (:class:`RequestError`) and the one options
  type (:class:`GatewayOptions`, ``rollout.args``);
- ``images``, ``requests``, ``limits``, ``prompts``, ``tokens``: a request's images, its
  body checked into a :class:`~polyrl.agents.gateway.requests.Request`, the budgets, the
  prompt checks and cache, per-token views;
- ``episodes``: what an episode files (calls, choices) and spends;
- ``api``: the one interface of a wire API (:class:`WireAPI`, :class:`ApiContext`,
  :class:`StreamEvents`); ``stream``: live tokens and the one streaming driver;
- ``chat``, ``responses``, ``messages``: the three wire APIs;
- ``server``: the HTTP server, its table of APIs (``APIS``) and the sampling;
- ``workflow``: the ``gateway`` workflow that runs the agents and builds the record.
"""

from polyrl.agents.gateway.api import ApiContext, StreamEvents, WireAPI
from polyrl.agents.gateway.errors import RequestError
from polyrl.agents.gateway.options import GatewayOptions
from polyrl.agents.gateway.server import APIS, GatewayServer
from polyrl.agents.gateway.workflow import Endpoint, Gateway, inside_call, isolation

__all__ = [
    "APIS",
    "ApiContext",
    "Endpoint",
    "Gateway",
    "GatewayOptions",
    "GatewayServer",
    "RequestError",
    "StreamEvents",
    "WireAPI",
    "inside_call",
    "isolation",
]
