"""The agent gateway: train agents written against the OpenAI client, unchanged.

The ``gateway`` workflow starts a real HTTP server (Starlette on uvicorn, on 127.0.0.1, a
random port and a random per-run API key) serving the OpenAI Chat Completions API in front
of the run's engines, then runs the user's agent once per task row and group sample,
concurrently. ``model`` in a request names a policy, so one program can call several
trainable models. Every completion an agent asked for becomes rows of the record (one per
choice, step-style), with the exact prompt ids the engine was given, the ids it sampled
with every per-token fact the engine recorded (log-probs, weights versions, a
mixture-of-experts policy's experts for routing replay: the completion's token segments);
``meta`` carries the episode id and turn so credit can group them.

Each episode gets its own base URL (``/ep/<token>/v1``), which is how the gateway knows
which episode a request belongs to. Concurrent requests wait in one queue; the engine
serves whatever waits in one ``generate`` per flush (requests with the same sampling
settings share a call), on a worker thread, so the server keeps accepting requests while
the engine runs.

Multi-turn stitching: a request whose messages are an earlier completion's messages, then
that completion's reply exactly as the gateway returned it, then new messages, is given
that completion's prompt ids + sampled ids + the new messages rendered on their own
(:class:`~polyrl.agents.chat.ChatFormat`). No sampled token is ever decoded and encoded
again. An agent that edits its history (changes an earlier message, rewrites or drops a
reply, reorders) gets the conversation rendered afresh by the chat template: that row is
still exact (its prompt is what the engine saw) but its earlier replies are re-tokenised
text, and ``meta["stitched"]`` is false.

Images: a VLM policy takes OpenAI ``image_url`` parts (data URLs only, see
:mod:`polyrl.agents.gateway.images`); their ids are spliced in once, stitching keeps the
earlier turns' images in place, and the rows carry them in the record's ``vision`` column.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import inspect
import json
import logging
import math
import os
import secrets
import subprocess
import traceback
from collections.abc import Awaitable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, overload

from tensordict import TensorDict

from polyrl.agents.agent_loop import AgentLoop
from polyrl.agents.agent_process import AgentExited, finish
from polyrl.agents.gateway.episodes import EpisodeState
from polyrl.agents.gateway.options import GatewayOptions
from polyrl.agents.gateway.prompts import context_length
from polyrl.agents.gateway.server import GatewayServer
from polyrl.core.config import ConfigError
from polyrl.core.interfaces import Phase, TakesImageTurns
from polyrl.core.observe import timeline
from polyrl.core.record import Row, build_rows
from polyrl.core.registry import WORKFLOWS, import_path
from polyrl.core.rollout.data import PromptItem
from polyrl.core.rollout.engine import SamplingParams
from polyrl.core.segment import Tokens

if TYPE_CHECKING:
    from openai import AsyncOpenAI, OpenAI

# --------------------------------------------------------------------------- the workflow


@dataclass
class Endpoint:
    """What an agent gets besides its task row: where the gateway is and how to call it."""

    base_url: str
    api_key: str
    model: str  # the default policy
    models: list[str]
    episode: int
    sample: int
    timeout: float

    def openai(self) -> OpenAI:
        """A synchronous ``openai.OpenAI`` client for this episode (no retries). Its HTTP
        client skips TLS setup (plain HTTP to 127.0.0.1): loading the CA store costs ~40 ms
        per client, more than an engine call on a small model."""
        return self._client(asynchronous=False)

    def async_openai(self) -> AsyncOpenAI:
        """An ``openai.AsyncOpenAI`` client for this episode (no retries, no TLS setup)."""
        return self._client(asynchronous=True)

    @overload
    def _client(self, *, asynchronous: Literal[False]) -> OpenAI: ...

    @overload
    def _client(self, *, asynchronous: Literal[True]) -> AsyncOpenAI: ...

    def _client(self, *, asynchronous: bool) -> OpenAI | AsyncOpenAI:
        import httpx
        import openai

        client, http = (
            (openai.AsyncOpenAI, httpx.AsyncClient)
            if asynchronous
            else (openai.OpenAI, httpx.Client)
        )
        return client(
            base_url=self.base_url,
            api_key=self.api_key,
            max_retries=0,
            timeout=self.timeout,
            # openai types http_client as httpx2's client; it takes httpx's as well
            http_client=http(verify=False, timeout=self.timeout),  # type: ignore[arg-type]
        )

    def reward(self, value: float, turn: int | None = None) -> None:
        """Post a reward for one turn (default: the latest completion); rewards add up
        with each other and with the agent's return value (see the README)."""
        import httpx

        body = {"reward": value} if turn is None else {"reward": value, "turn": turn}
        r = httpx.post(
            self.base_url + "/rewards",
            json=body,
            headers={"Authorization": f"Bearer {self.api_key}"},
            timeout=self.timeout,
        )
        if r.status_code != 200:
            raise RuntimeError(f"the gateway refused the reward: {r.json()['error']['message']}")


def _describe(exc: BaseException) -> str:
    if isinstance(exc, AgentExited):  # a command agent's end: its own words say it all
        return str(exc)
    tb = traceback.extract_tb(exc.__traceback__)
    loc = f" ({tb[-1].filename}:{tb[-1].lineno})" if tb else ""
    return f"the agent raised {type(exc).__name__}: {exc}{loc}"


def _as_result(value: Any) -> tuple[float | None, bool | None]:
    """An agent's return: a number (the episode's reward), None (a recipe reward scores
    the rows), or a mapping with ``reward`` and optionally ``success``."""
    success = None
    if isinstance(value, dict):
        if "reward" not in value:
            raise TypeError(f"the agent returned a mapping without 'reward': {sorted(value)}")
        success = None if value.get("success") is None else bool(value["success"])
        value = value["reward"]
    if value is None:
        return None, success
    if isinstance(value, (bool, int, float)):
        reward = float(value)
        if math.isnan(reward):
            raise ValueError("the agent returned a NaN reward")
        return reward, success
    raise TypeError(
        f"the agent returned {type(value).__name__}; return a number, None or "
        "{'reward': ..., 'success': ...}"
    )


@functools.cache
def isolation() -> list[str]:
    """The ``unshare`` prefix that runs a command agent in a user, mount and PID namespace
    of its own (its /proc shows only its processes: no other episode's environment, which
    holds that episode's key, and no trainer memory to read), or [] where this machine
    allows none (a warning, once)."""
    for mapping in ("--map-current-user", "--map-root-user"):
        argv = ["unshare", mapping, "--pid", "--fork", "--mount-proc", "--kill-child", "--"]
        try:
            ok = subprocess.run([*argv, "true"], capture_output=True, timeout=30).returncode == 0
        except (OSError, subprocess.TimeoutExpired):
            ok = False
        if ok:
            return argv
    logging.getLogger(__name__).warning(
        "the gateway cannot run command agents in namespaces of their own here (unshare "
        "with a user namespace failed): each agent can read the others' keys through /proc; "
        "run only agents you trust (metric gateway/isolated=0)"
    )
    return []


def check_host(host: str) -> None:
    """``rollout.args.host`` must be an IPv4 address (or name) of this machine: bound here
    and released, as the server binds it at start, so a typo fails at load, not mid-run."""
    import socket

    try:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind((host, 0))
    except (OSError, UnicodeError, TypeError) as e:
        raise ConfigError(
            f"rollout.args.host={host!r} cannot be bound by the gateway ({e}); give an IPv4 "
            "address of this machine: 127.0.0.1 (the default: agents on this machine) or "
            "0.0.0.0 (every interface)"
        ) from None


class Gateway:
    """Runs a user's agent against an OpenAI-compatible gateway; registered as ``gateway``.

    The agent is ``agent(row, endpoint)``, sync or async: ``row`` is the task row,
    ``endpoint`` an :class:`Endpoint` (``base_url``, ``api_key``, ``model``, ``openai()``).
    It returns the episode's reward (a number, broadcast to its rows as ``meta["return"]``
    for the ``env_return`` reward), a mapping ``{"reward", "success"}``, or None when a
    recipe reward scores the rows. An agent that raises or runs past ``episode_timeout``
    marks its episode's rows invalid (counted, left out of the update), never reward 0.
    """

    transcript_keys = ("episode", "sample", "turn", "choice", "model", "stitched", "return")

    def __init__(self, ctx: Any, **options: Any) -> None:
        """``options``: the fields of :class:`GatewayOptions` (``rollout.args``, bound and
        checked at load; checked again here for a workflow built in code)."""
        self.options = o = GatewayOptions(**options)
        o.check()
        self.agent = self._check(o, list(ctx.policies))
        self.command = list(o.command) if o.command else None
        self.isolate = o.isolate_commands
        self.name = o.policy or next(iter(ctx.policies))
        self.concurrency = o.concurrency
        self.request_timeout, self.episode_timeout = o.request_timeout, o.episode_timeout
        self.server = GatewayServer(
            dict(ctx.engines),
            {name: p.tokenizer for name, p in ctx.policies.items()},
            o,
            visions={
                name: p if isinstance(p, TakesImageTurns) else None
                for name, p in ctx.policies.items()
            },
            contexts={name: context_length(p) for name, p in ctx.policies.items()},
            seed=ctx.cfg.seed if ctx.cfg is not None else 0,
        )
        self.pad_id = ctx.policies[self.name].tokenizer.pad_token_id
        self.decoders = {name: p.tokenizer for name, p in ctx.policies.items()}
        self._next_episode = 0
        self.failed_episodes = 0  # over the run
        self.tool_call_cut = 0  # the last rollout's completions cut inside a tool call
        self._warned_cut = False  # that warning: once per run
        # every rollout on one loop: agents' cached async clients outlive a step
        self.loop = AgentLoop("polyrl-gateway-agents")
        self._refused: dict[str, int] = {}  # the last rollout's budget refusals
        self._isolated = 1.0  # the last rollout's command agents ran in namespaces

    @staticmethod
    def _check(o: GatewayOptions, names: list[str]) -> Any:
        """The policy name and the agent (the ranges are :meth:`GatewayOptions.check`'s);
        returns the agent callable (None for a command)."""
        if o.policy is not None and o.policy not in names:
            raise ConfigError(
                f"rollout.args.policy={o.policy!r} is not one of the policies {sorted(names)}"
            )
        if o.command:
            return None
        agent = o.agent
        try:
            fn = import_path(agent) if isinstance(agent, str) else agent
        except Exception as e:
            raise ConfigError(
                f"rollout.args.agent={agent!r} cannot be imported ({type(e).__name__}: {e}); "
                "give package.module:function or ./file.py:function"
            ) from None
        if not callable(fn):
            raise ConfigError(f"rollout.args.agent={agent!r} is not callable")
        return fn

    @classmethod
    def validate_config(cls, cfg: Any) -> None:
        """At config time, before any model loads: the policy, the agent and the host (the
        options' ranges were checked when ``rollout.args`` was bound)."""
        o = cfg.rollout.args
        cls._check(o, list(cfg.policies))
        check_host(o.host)

    def close(self) -> None:
        """Close the agents' loop (their clients close first) and stop the server (the
        run's end; daemon threads otherwise)."""
        self.loop.close()
        self.server.close()

    def state_dict(self) -> dict:
        """``core.Stateful``: the episodes numbered so far (a resumed run numbers, and with
        ``reproducible`` seeds, its episodes as the uninterrupted run did)."""
        return {"next_episode": self._next_episode}

    def load_state_dict(self, state: dict) -> None:
        self._next_episode = int(state["next_episode"])

    def rollout_metrics(self) -> dict[str, float]:
        """The last rollout's requests refused by a budget (``core.ReportsRollout``), and
        for command agents whether they ran isolated (1) or not (0)."""
        out = {
            f"gateway/refused_{what}": float(self._refused.get(what, 0))
            for what in ("requests", "rows", "tokens", "bytes")
        }
        out["rollout/tool_call_cut"] = float(self.tool_call_cut)
        if self.command:
            out["gateway/isolated"] = self._isolated
        return out

    def rollout(
        self, items: list[PromptItem], params: SamplingParams, phase: Phase = "train"
    ) -> TensorDict:
        return self.loop.run(self.arollout(items, params))

    async def arollout(self, items: list[PromptItem], params: SamplingParams) -> TensorDict:
        if self.server.port == 0:
            self.server.start()
        self.server.defaults = params
        self.server.new_rollout()
        episodes = []
        for item in items:
            for g in range(params.n):
                episodes.append(
                    EpisodeState(
                        self._next_episode,
                        secrets.token_urlsafe(12),
                        item,
                        g,
                        tracer=timeline.recording(),
                    )
                )
                self._next_episode += 1
        gate = asyncio.Semaphore(self.concurrency)
        pool = concurrent.futures.ThreadPoolExecutor(self.concurrency, "polyrl-agent")
        try:
            await asyncio.gather(*(self._episode(ep, gate, pool) for ep in episodes))
        finally:
            pool.shutdown(wait=False, cancel_futures=True)
        # Every episode is closed now, so no new engine call starts; wait for one still
        # running (a timed-out agent's request) before the trainer touches the weights.
        while self.server.batcher.flushing:
            await asyncio.sleep(0.005)
        self._refused = dict(self.server.refusals.counts)
        return self._record(episodes)

    async def _episode(
        self, ep: EpisodeState, gate: asyncio.Semaphore, pool: concurrent.futures.Executor
    ) -> None:
        async with gate:
            endpoint = Endpoint(
                self.server.open_episode(ep),
                ep.key,
                self.name,
                list(self.server.engines),
                ep.id,
                ep.sample,
                self.request_timeout,
            )
            run: Awaitable[Any]
            try:
                if self.command:
                    run = self._run_command(self.command, ep.item.row, endpoint)
                elif inspect.iscoroutinefunction(self.agent):
                    run = self.agent(ep.item.row, endpoint)
                else:
                    run = asyncio.get_running_loop().run_in_executor(
                        pool, self.agent, ep.item.row, endpoint
                    )
                value = await asyncio.wait_for(run, self.episode_timeout)
                if inspect.isawaitable(value):
                    value = await asyncio.wait_for(value, self.episode_timeout)
                ep.result = _as_result(value)
            except TimeoutError:
                ep.error = f"the agent ran past episode_timeout={self.episode_timeout} s"
            except Exception as e:
                ep.error = _describe(e)
            finally:
                self.server.close_episode(ep)
            if not ep.error and not ep.calls:
                ep.error = "the agent returned without asking the gateway for a completion"

    async def _run_command(self, command: list[str], row: dict, endpoint: Endpoint) -> Any:
        """One episode of the external agent: its environment names the endpoint; a
        timeout cancels this and kills the process."""
        env = dict(
            os.environ,
            OPENAI_BASE_URL=endpoint.base_url,
            OPENAI_API_KEY=endpoint.api_key,
            POLYRL_MODEL=endpoint.model,
            POLYRL_TASK=json.dumps(row),
            POLYRL_EPISODE=str(endpoint.episode),
        )
        wrap = isolation() if self.isolate else []
        self._isolated = float(bool(wrap))
        proc = await asyncio.create_subprocess_exec(
            *wrap,
            *command,
            env=env,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
        out = await finish(proc, command[0])  # AgentExited names a status or signal
        lines = out.decode(errors="replace").strip().splitlines()
        if not lines:
            return None
        try:
            return json.loads(lines[-1])
        except json.JSONDecodeError:
            raise ValueError(
                f"{command[0]}'s last stdout line {lines[-1][:80]!r} is not JSON; print "
                'the return last: a number, {"reward": r, "success": s} or null'
            ) from None

    def _row(
        self,
        ep: EpisodeState,
        base: dict[str, Any],
        prompt: Tokens,
        response: Tokens,
        policy: str,
        turn: int,
        text: str,
        extra: dict[str, Any],
    ) -> Row:
        decode = self.decoders[policy].decode
        return Row(
            prompt,
            response,
            policy,
            ep.item.uid,
            turn=turn,
            prompt_text=decode(prompt.ids, skip_special_tokens=False),
            response_text=text,
            meta={**base, **extra},
            error=ep.error,
        )

    def _note_cut(self, cut: list[int], completions: int) -> None:
        """Count the completions cut inside a tool call (``rollout/tool_call_cut``) and say
        so once: a framework sees no call at all (the Agents SDK logs a bare ``Error
        getting response``), so the episode fails and RL unlearns the tool."""
        self.tool_call_cut = len(cut)
        if not cut or self._warned_cut:
            return
        self._warned_cut = True
        limit = self.server.defaults.max_new_tokens  # this rollout's (train or eval)
        logging.getLogger(__name__).warning(
            "%d of %d completions ended inside a tool call (<tool_call> opened, never "
            "closed: cut at %d tokens, the length limit; rollout.max_new_tokens=%s), so the "
            "agent saw no call. Raise rollout.max_new_tokens (or the max_tokens the agent "
            "asks for) above the longest tool call the model writes. Warned once; "
            "rollout/tool_call_cut counts them every step.",
            len(cut),
            completions,
            max(cut),
            limit,
        )

    def _record(self, episodes: list[EpisodeState]) -> TensorDict:
        rows: list[Row] = []
        cut: list[int] = []  # lengths of the completions cut inside a tool call
        valid_eps = sum(1 for ep in episodes if not ep.error)
        rows_of = {ep.id: max(1, sum(len(c.choices) for c in ep.calls)) for ep in episodes}
        valid_rows = sum(rows_of[ep.id] for ep in episodes if not ep.error)
        for ep in episodes:
            reward, success = ep.result if ep.result is not None else (None, None)
            turns = len(ep.calls)
            turn_rewards = [ep.posted.get(t, 0.0) for t in range(turns)]
            if reward is not None and turns:
                turn_rewards[-1] += reward  # the agent's return, credited at the last turn
            if ep.posted and turns:  # the return is the sum of what was credited
                success = success if success is not None else sum(turn_rewards) > 0
                reward = sum(turn_rewards)
            base = {
                "answer": ep.item.answer,
                "row": ep.item.row,
                "episode": ep.id,
                "sample": ep.sample,
                "turns": turns,
                "anchors": [c.anchor for c in ep.calls],
                "turn_rewards": turn_rewards,
                "episode_rows": rows_of[ep.id],
                "episode_weight": (
                    valid_rows / (valid_eps * rows_of[ep.id]) if valid_eps and not ep.error else 0.0
                ),
                "finish": "error" if ep.error else "done",
            }
            if reward is not None:
                base["return"] = reward
                base["success"] = bool(success if success is not None else reward > 0)
            elif success is not None:
                base["success"] = success

            if not ep.calls:
                prompt = Tokens.given(ep.item.prompt_ids)
                extra = {"turn": 0, "spans": []}
                rows.append(self._row(ep, base, prompt, Tokens.given([]), self.name, 0, "", extra))
            for t, call in enumerate(ep.calls):
                for j, c in enumerate(call.choices):
                    extra = {
                        "turn": t,
                        "choice": j,
                        "model": call.model,
                        "stitched": call.stitched,
                        "temperature": call.temperature,
                        "completion_finish": c.finish,
                        "spans": [[t, 0, len(c.ids)]],
                    }
                    text = self.decoders[call.model].decode(c.ids, skip_special_tokens=True)
                    if c.finish == "length" and call.tools_key != "null" and inside_call(text):
                        cut.append(len(c.ids))
                    row = self._row(ep, base, c.prompt, c.tokens, call.model, t, text, extra)
                    row.vision = call.images.joined if call.images is not None else None
                    row.truncated = c.finish == "length"
                    rows.append(row)
        self._note_cut(cut, len(rows))
        failed = {ep.id for ep in episodes if ep.error}
        self.failed_episodes += len(failed)
        return build_rows(rows, self.pad_id)


def inside_call(text: str) -> bool:
    """The text ends inside a Hermes tool call: ``<tool_call>`` opened, not closed."""
    return text.rfind("<tool_call>") > text.rfind("</tool_call>")


WORKFLOWS.register("gateway", Gateway, options=GatewayOptions)
