"""The agent gateway: train agents written against the OpenAI client, unchanged.

The ``gateway`` workflow starts a real HTTP server (Starlette on uvicorn, on 127.0.0.1, a
random port and a random per-run API key) serving the OpenAI Chat Completions API in front
of the run's engines, then runs the user's agent once per task row and group sample,
concurrently. ``model`` in a request names a policy, so one program can call several
trainable models. Every completion an agent asked for becomes rows of the record (one per
choice, step-style), with the exact prompt ids the engine was given, the ids it sampled
and its log-probs; ``meta`` carries the episode id and turn so credit can group them.

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
:mod:`polyrl.agents.gateway_images`); their ids are spliced in once, stitching keeps the
earlier turns' images in place, and the rows carry them in the record's ``vision`` column.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import hmac
import inspect
import json
import math
import os
import secrets
import socket
import threading
import time
import traceback
import uuid
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Annotated, Any

import orjson
from tensordict import TensorDict

from polyrl.agents import gateway_images
from polyrl.agents.chat import ChatFormat
from polyrl.agents.gateway_images import Limits
from polyrl.agents.tools import parse_hermes
from polyrl.core.config import ConfigError
from polyrl.core.data import PromptItem
from polyrl.core.engine import SamplingParams
from polyrl.core.interfaces import TakesImageTurns, splice_images
from polyrl.core.record import mark_invalid, set_strings, text_record
from polyrl.core.registry import WORKFLOWS, import_path
from polyrl.core.workflow import run_sync

ROLES = ("system", "developer", "user", "assistant", "tool")
MAX_N = 16
MAX_STOP = 4


class RequestError(Exception):
    """An OpenAI-style error answer: HTTP status, message, type and code."""

    def __init__(self, status: int, message: str, code: str | None = None, param=None) -> None:
        super().__init__(message)
        self.status, self.message, self.code, self.param = status, message, code, param

    def body(self) -> dict:
        kind = {401: "authentication_error", 404: "invalid_request_error"}.get(
            self.status, "invalid_request_error" if self.status < 500 else "server_error"
        )
        return {
            "error": {
                "message": self.message,
                "type": kind,
                "param": self.param,
                "code": self.code,
            }
        }


# --------------------------------------------------------------------------- episodes


@dataclass
class Choice:
    ids: list[int]
    logprobs: list[float]
    finish: str  # stop | length | tool_calls
    message: dict  # what the gateway answered (role, content, tool_calls)
    key: tuple  # the normalised message, matched when the agent sends it back


@dataclass
class Images:
    """A prompt's images as a VLM policy took them (core ``TakesImageTurns``): the
    per-turn handles, where each image's ids start in the prompt, and all of them joined
    (what the engine and the record's ``vision`` column get)."""

    handles: list
    starts: list[int]
    joined: Any


@dataclass
class Call:
    """One chat completion request of an episode and what the engine answered."""

    model: str
    keys: list[tuple]  # the request's messages, normalised
    tools_key: str
    prompt_ids: list[int]
    choices: list[Choice]
    stitched: bool
    anchor: str  # the last non-assistant message (GiGPO-style grouping)
    temperature: float
    images: Images | None = None  # the prompt's images (a VLM's request); None: none


@dataclass
class EpisodeState:
    id: int
    token: str
    item: PromptItem
    sample: int
    calls: list[Call] = field(default_factory=list)
    open: bool = True
    error: str = ""
    result: Any = None
    posted: dict[int, float] = field(default_factory=dict)  # turn -> rewards the agent posted
    lock: threading.Lock = field(default_factory=threading.Lock)


def _tool_calls_key(calls: Any, where: str) -> tuple:
    if not calls:
        return ()
    if not isinstance(calls, list):
        raise RequestError(400, f"{where}.tool_calls must be a list", param=f"{where}.tool_calls")
    out = []
    for k, c in enumerate(calls):
        fn = c.get("function") if isinstance(c, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise RequestError(400, f"{where}.tool_calls[{k}] needs function.name")
        args = fn.get("arguments", "{}")
        try:
            parsed = json.loads(args) if isinstance(args, str) else args
        except json.JSONDecodeError:
            parsed = args
        out.append((fn["name"], json.dumps(parsed, sort_keys=True)))
    return tuple(out)


def normalise_messages(
    messages: Any, limits: Limits = Limits()
) -> tuple[list[dict], list[tuple], list]:
    """Messages as the chat template gets them, their comparison keys and their images
    (decoded, in order; see :mod:`polyrl.agents.gateway_images`)."""
    if not isinstance(messages, list) or not messages:
        raise RequestError(400, "messages must be a non-empty list", param="messages")
    rendered, keys, images = [], [], []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise RequestError(400, f"{where} must be an object", param="messages")
        role = m.get("role")
        if role not in ROLES:
            raise RequestError(
                400, f"{where}.role={role!r}: use one of {', '.join(ROLES)}", param="messages"
            )
        if role == "developer":
            role = "system"
        try:
            body, text = gateway_images.content(m.get("content"), where, limits, images)
        except gateway_images.ImagePartError as e:
            raise RequestError(400, str(e), param=f"{where}.content") from None
        calls = _tool_calls_key(m.get("tool_calls"), where) if role == "assistant" else ()
        msg = {"role": role, "content": body}
        if calls:
            msg["tool_calls"] = [
                {"type": "function", "function": {"name": n, "arguments": json.loads(a)}}
                for n, a in calls
            ]
        if role == "tool" and m.get("name"):
            msg["name"] = str(m["name"])
        rendered.append(msg)
        keys.append((role, text, calls, str(m.get("name") or "") if role == "tool" else ""))
    return rendered, keys, images


def _fold_calls(msg: dict) -> dict:
    """An assistant message's tool calls written into its content as Hermes blocks (the
    form the gateway parses replies in), for chat templates that ignore ``tool_calls``."""
    if not msg.get("tool_calls"):
        return msg
    blocks = [
        "<tool_call>"
        + json.dumps({"name": c["function"]["name"], "arguments": c["function"]["arguments"]})
        + "</tool_call>"
        for c in msg["tool_calls"]
    ]
    return {"role": msg["role"], "content": msg["content"] + "\n".join(blocks)}


# --------------------------------------------------------------------------- request checks


def _number(body: dict, key: str, default, lo: float, hi: float, *, integer=False):
    value = body.get(key)
    if value is None:
        return default
    ok = isinstance(value, int) if integer else isinstance(value, (int, float))
    if not ok or isinstance(value, bool) or not (lo <= value <= hi):
        kind = "an integer" if integer else "a number"
        raise RequestError(400, f"{key} must be {kind} in [{lo}, {hi}], got {value!r}", param=key)
    return value


@dataclass
class Request:
    model: str
    messages: list[dict]
    keys: list[tuple]
    temperature: float
    top_p: float
    max_tokens: int
    n: int
    stop: list[str]
    logprobs: bool
    tools: list[dict] | None
    stream: bool = False
    usage_chunk: bool = False  # stream_options.include_usage
    tools_key: str = "null"  # the tools as canonical JSON (stitching compares it)
    seed: int | None = None  # the request's own sampling stream (SamplingParams.seed)
    images: list = field(default_factory=list)  # the messages' images, decoded, in order


def parse_request(
    body: Any, models: list[str], defaults: SamplingParams, limits: Limits = Limits()
) -> Request:
    """Check a Chat Completions body; a :class:`RequestError` says what is wrong."""
    if not isinstance(body, dict):
        raise RequestError(400, "the request body must be a JSON object")
    stream = body.get("stream")
    if stream is not None and not isinstance(stream, bool):
        raise RequestError(400, "stream must be true or false", param="stream")
    options = body.get("stream_options")
    if options is not None and (not stream or not isinstance(options, dict)):
        raise RequestError(
            400, "stream_options needs stream: true and an object", param="stream_options"
        )
    model = body.get("model")
    if not isinstance(model, str):
        raise RequestError(400, "model is required (a policy name)", param="model")
    if model not in models:
        raise RequestError(
            404,
            f"The model {model!r} does not exist; this gateway serves: {', '.join(models)}",
            code="model_not_found",
            param="model",
        )
    messages, keys, images = normalise_messages(body.get("messages"), limits)
    cap = defaults.max_new_tokens
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    key = "max_completion_tokens" if "max_completion_tokens" in body else "max_tokens"
    max_tokens = _number({key: max_tokens}, key, cap, 1, cap, integer=True)
    stop = body.get("stop")
    if stop is None:
        stop = []
    elif isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
        raise RequestError(
            400, "stop must be a string or a list of non-empty strings", param="stop"
        )
    if len(stop) > MAX_STOP:
        raise RequestError(400, f"stop takes at most {MAX_STOP} sequences", param="stop")
    if body.get("top_logprobs"):
        raise RequestError(
            400,
            "top_logprobs is not supported (logprobs: true gives the sampled tokens')",
            param="top_logprobs",
        )
    logprobs = body.get("logprobs", False)
    if not isinstance(logprobs, bool):
        raise RequestError(400, "logprobs must be true or false", param="logprobs")
    seed = body.get("seed")
    if seed is not None and (not isinstance(seed, int) or isinstance(seed, bool)):
        raise RequestError(400, "seed must be an integer", param="seed")
    tools = body.get("tools")
    if tools is not None and (
        not isinstance(tools, list)
        or not all(
            isinstance(t, dict)
            and t.get("type") == "function"
            and isinstance(t.get("function"), dict)
            and isinstance(t["function"].get("name"), str)
            for t in tools
        )
    ):
        raise RequestError(
            400, "tools must be a list of {type: function, function: {name, ...}}", param="tools"
        )
    choice = body.get("tool_choice")
    if choice not in (None, "auto", "none"):
        raise RequestError(
            400, "tool_choice: only 'auto' and 'none' are supported", param="tool_choice"
        )
    if choice == "none":
        tools = None
    return Request(
        model=model,
        messages=messages,
        keys=keys,
        temperature=float(_number(body, "temperature", defaults.temperature, 0.0, 2.0)),
        top_p=float(_number(body, "top_p", defaults.top_p, 1e-9, 1.0)),
        max_tokens=int(max_tokens),
        n=int(_number(body, "n", 1, 1, MAX_N, integer=True)),
        stop=stop,
        logprobs=logprobs,
        tools=tools or None,
        stream=bool(stream),
        usage_chunk=bool((options or {}).get("include_usage")),
        tools_key=json.dumps(tools or None, sort_keys=True),
        seed=seed,
        images=images,
    )


class _Cache:
    """A bounded mapping that forgets the least recently used entry."""

    def __init__(self, size: int) -> None:
        self.size, self.data = size, OrderedDict()

    def get(self, key):
        value = self.data.get(key)
        if value is not None:
            self.data.move_to_end(key)
        return value

    def put(self, key, value) -> None:
        self.data[key] = value
        if len(self.data) > self.size:
            self.data.popitem(last=False)


# --------------------------------------------------------------------------- batching


@dataclass
class _Pending:
    model: str
    prompt: list[int]
    params: SamplingParams  # n=1; max_new_tokens is this request's own budget
    future: asyncio.Future
    episode: EpisodeState
    vision: Any = None  # the prompt's joined images; None: text only


class Batcher:
    """Requests wait in one queue; each flush serves all of them, one ``generate`` per
    (model, temperature, top_p, stop) group (a request with a ``seed``: its own call), on a
    worker thread; a group with images goes to the engine's ``generate_vl``. A flush starts
    when the
    engine is idle and either every open episode has a request waiting (nothing more can
    come) or no request arrived for ``wait`` seconds (the others are busy elsewhere).
    Requests of episodes that ended meanwhile (timed out) are dropped, never sent to the
    engine. ``open_episodes()`` counts the episodes that may still send requests."""

    def __init__(
        self, engines: dict[str, Any], wait: float, open_episodes: Callable[[], int]
    ) -> None:
        self.engines, self.wait, self.open_episodes = engines, wait, open_episodes
        self._arrived = 0  # requests so far (the quiet-time check compares it)
        self.pending: list[_Pending] = []
        self.sizes: list[int] = []  # requests per engine call
        self._wake: asyncio.Event | None = None
        self._task: asyncio.Task | None = None
        self.flushing = False  # read by the workflow's thread: an engine call may be running

    def start(self) -> None:
        self._wake = asyncio.Event()
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def generate(self, ep: EpisodeState, model: str, prompt: list[int], params, vision=None):
        fut = asyncio.get_running_loop().create_future()
        self.pending.append(_Pending(model, prompt, params, fut, ep, vision))
        self._arrived += 1
        self._wake.set()
        return await fut

    async def _run(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            await self._gather()
            self.flushing = True
            batch = self._take()
            try:
                await self._flush(batch)
            except Exception as e:  # a bug here must not leave requests waiting forever
                for p in batch:
                    if not p.future.done():
                        p.future.set_exception(e)
            finally:
                self.flushing = False
            if self.pending:
                self._wake.set()

    async def _gather(self) -> None:
        """Wait until every open episode has a request waiting, or ``wait`` seconds pass
        without a new one."""
        step = min(self.wait, 0.001)
        quiet, seen = 0.0, self._arrived
        while quiet < self.wait:
            if len({id(p.episode) for p in self.pending}) >= self.open_episodes():
                return
            await asyncio.sleep(step)
            quiet = 0.0 if self._arrived != seen else quiet + step
            seen = self._arrived

    def _take(self) -> list[_Pending]:
        """The waiting requests of episodes still open (the others are refused)."""
        batch = []
        for p in self.pending:
            if not p.episode.open and not p.future.done():
                p.future.set_exception(RequestError(404, "the episode is over (it timed out)"))
            elif not p.future.done():
                batch.append(p)
        self.pending = []
        return batch

    async def _flush(self, batch: list[_Pending]) -> None:
        groups: dict[tuple, list[_Pending]] = {}
        for p in batch:
            sp = p.params
            key = (p.model, sp.temperature, sp.top_p, tuple(sp.stop), sp.seed)
            if sp.seed is not None:  # a seeded request's n samples: a call of their own
                key += (id(sp),)
            groups.setdefault(key, []).append(p)
        for (model, temperature, top_p, stop, seed, *_), reqs in groups.items():
            params = SamplingParams(
                n=1,
                temperature=temperature,
                top_p=top_p,
                max_new_tokens=max(r.params.max_new_tokens for r in reqs),
                stop=list(stop),
                seed=seed,
            )
            self.sizes.append(len(reqs))
            engine, prompts = self.engines[model], [r.prompt for r in reqs]
            visions = [r.vision for r in reqs]
            try:
                if any(v is not None for v in visions):
                    outs = await asyncio.to_thread(engine.generate_vl, prompts, visions, params)
                else:
                    outs = await asyncio.to_thread(engine.generate, prompts, params)
                if len(outs) != len(reqs):
                    raise RuntimeError(
                        f"engine returned {len(outs)} completions for {len(reqs)} prompts"
                    )
            except Exception as e:  # every waiting request learns it (500), none hangs
                for r in reqs:
                    if not r.future.done():
                        r.future.set_exception(e)
                continue
            for out in outs:
                r = reqs[out.prompt_index]
                if not r.future.done():
                    r.future.set_result(out)


# --------------------------------------------------------------------------- server


class GatewayServer:
    """OpenAI Chat Completions over the run's engines, on its own thread and event loop."""

    def __init__(
        self,
        engines: dict[str, Any],
        tokenizers: dict[str, Any],
        *,
        host: str = "127.0.0.1",
        request_timeout: float = 60.0,
        batch_wait: float = 0.02,
        visions: dict[str, TakesImageTurns | None] | None = None,
        limits: Limits = Limits(),
    ) -> None:
        self.engines, self.tokenizers = engines, tokenizers
        self.visions = visions or {}  # per model: how its policy takes images (None: it cannot)
        self.limits = limits
        self._joined = 0  # names each request's joined images
        self.chats = {name: ChatFormat(tok) for name, tok in tokenizers.items()}
        # Templates that never mention tool_calls would drop an assistant's calls when a
        # conversation is rendered afresh; those get the calls as Hermes text instead.
        self.fold_calls = {
            name: "tool_calls" not in str(getattr(tok, "chat_template", None) or "")
            for name, tok in tokenizers.items()
        }
        # Rendered prompts by their normalised messages: the samples of a group send the
        # same first messages, and many episodes the same tool or user turns.
        self._renders = _Cache(4096)
        self.host = host
        self.api_key = "pk-" + secrets.token_urlsafe(24)
        self.request_timeout = request_timeout
        self.batcher = Batcher(engines, batch_wait, lambda: len(self.episodes))
        self.defaults = SamplingParams()
        self.episodes: dict[str, EpisodeState] = {}
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._server = None
        self.port = 0

    # ---------------------------------------------------------------- lifecycle
    def start(self) -> None:
        import uvicorn

        # proto IPPROTO_TCP: asyncio sets TCP_NODELAY only on such sockets; without it a
        # keep-alive response (headers, then body) waits ~40 ms for the client's delayed ACK.
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.bind((self.host, 0))
        self.port = sock.getsockname()[1]
        config = uvicorn.Config(
            self.app(), log_level="warning", access_log=False, lifespan="off", timeout_keep_alive=30
        )
        self._server = uvicorn.Server(config)
        failed: list[BaseException] = []

        def serve() -> None:
            try:
                asyncio.run(self._serve(sock))
            except BaseException as e:  # reported by start()
                failed.append(e)

        self._thread = threading.Thread(target=serve, name="polyrl-gateway", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + 30
        while not self._server.started:
            if failed or not self._thread.is_alive():
                raise RuntimeError(f"the gateway server did not start: {failed}")
            if time.monotonic() > deadline:
                raise RuntimeError("the gateway server did not start within 30 s")
            time.sleep(0.01)

    async def _serve(self, sock: socket.socket) -> None:
        self.batcher.start()
        await self._server.serve(sockets=[sock])

    def close(self) -> None:
        if self._server is not None:
            self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout=10)
        self._thread = self._server = None

    @property
    def base(self) -> str:
        return f"http://{self.host}:{self.port}"

    # ---------------------------------------------------------------- episodes
    def open_episode(self, ep: EpisodeState) -> str:
        with self._lock:
            self.episodes[ep.token] = ep
        return f"{self.base}/ep/{ep.token}/v1"

    def close_episode(self, ep: EpisodeState) -> None:
        with ep.lock:
            ep.open = False
        with self._lock:
            self.episodes.pop(ep.token, None)

    # ---------------------------------------------------------------- http
    def app(self):
        """The ASGI app: Starlette (FastAPI's core) with three routes."""
        from starlette.applications import Starlette
        from starlette.responses import JSONResponse, Response, StreamingResponse
        from starlette.routing import Route

        def error(e: RequestError) -> JSONResponse:
            return JSONResponse(e.body(), status_code=e.status)

        def check_key(request) -> None:
            auth = request.headers.get("authorization", "")
            given = auth[7:] if auth.lower().startswith("bearer ") else ""
            if not hmac.compare_digest(given.encode(), self.api_key.encode()):
                raise RequestError(
                    401,
                    "Incorrect API key provided (use the key the run gave the agent)",
                    code="invalid_api_key",
                )

        def episode(request) -> EpisodeState:
            with self._lock:
                ep = self.episodes.get(request.path_params["token"])
            if ep is None:
                raise RequestError(
                    404, "unknown or finished episode: use the base_url the run gave this agent"
                )
            return ep

        async def models(request):
            try:
                check_key(request)
                episode(request)
            except RequestError as e:
                return error(e)
            data = [{"id": m, "object": "model", "owned_by": "polyrl"} for m in self.engines]
            return JSONResponse({"object": "list", "data": data})

        async def chat(request):
            try:
                check_key(request)
                ep = episode(request)
                try:
                    body = orjson.loads(await request.body())
                except orjson.JSONDecodeError:
                    raise RequestError(400, "the request body is not valid JSON") from None
                req = parse_request(body, list(self.engines), self.defaults, self.limits)
                answer = await self._complete(ep, req)
                if req.stream:
                    return StreamingResponse(
                        _sse(answer, req.usage_chunk), media_type="text/event-stream"
                    )
                return Response(orjson.dumps(answer), media_type="application/json")
            except RequestError as e:
                return error(e)
            except TimeoutError:
                msg = f"the engine did not answer within {self.request_timeout} s"
                return error(RequestError(504, msg, code="timeout"))
            except Exception as e:
                msg = f"the engine failed: {type(e).__name__}: {e}"
                return error(RequestError(500, msg, code="engine_error"))

        async def rewards(request):
            try:
                check_key(request)
                ep = episode(request)
                try:
                    body = orjson.loads(await request.body())
                except orjson.JSONDecodeError:
                    raise RequestError(400, "the request body is not valid JSON") from None
                return JSONResponse(self._post_reward(ep, body))
            except RequestError as e:
                return error(e)

        async def other(request):
            return error(
                RequestError(
                    404,
                    f"{request.url.path} is not served; the gateway serves POST "
                    "<base_url>/chat/completions, POST <base_url>/rewards and GET "
                    "<base_url>/models",
                )
            )

        methods = ["GET", "POST", "PUT", "DELETE", "PATCH"]
        return Starlette(
            routes=[
                Route("/ep/{token}/v1/chat/completions", chat, methods=["POST"]),
                Route("/ep/{token}/v1/models", models, methods=["GET"]),
                Route("/ep/{token}/v1/rewards", rewards, methods=["POST"]),
                Route("/{path:path}", other, methods=methods),
            ]
        )

    @staticmethod
    def _post_reward(ep: EpisodeState, body: Any) -> dict:
        """``{"reward": r, "turn": t}``: r added to turn t's reward (default: the latest
        completion's turn); several posts to one turn add up."""
        if not isinstance(body, dict):
            raise RequestError(400, 'post {"reward": number, "turn": optional int}')
        reward, turn = body.get("reward"), body.get("turn")
        if isinstance(reward, bool) or not isinstance(reward, (int, float)):
            raise RequestError(400, "reward must be a number", param="reward")
        if not math.isfinite(reward):
            raise RequestError(400, "reward must be finite", param="reward")
        with ep.lock:
            if not ep.open:
                raise RequestError(409, "the episode is over (it ended or timed out)")
            turns = len(ep.calls)
            if turn is None:
                if not turns:
                    raise RequestError(
                        400, "no completion yet in this episode to credit the reward to", "turn"
                    )
                turn = turns - 1
            if isinstance(turn, bool) or not isinstance(turn, int) or not 0 <= turn < turns:
                raise RequestError(
                    400,
                    f"turn={turn!r}: give the index of one of this episode's {turns} "
                    "completions (0 is the first), or leave it out for the latest",
                    param="turn",
                )
            ep.posted[turn] = ep.posted.get(turn, 0.0) + float(reward)
        return {"object": "reward", "turn": turn, "reward": float(reward)}

    # ---------------------------------------------------------------- completion
    def prompt_ids(self, ep: EpisodeState, req: Request) -> tuple[list[int], bool, Images | None]:
        """The request's prompt: stitched onto an earlier completion when the messages
        extend it, else rendered afresh; with its images placed (None: none)."""
        if req.images:
            self._check_images(req.model)
        chat = self.chats[req.model]
        tools_key = req.tools_key
        best = None
        with ep.lock:
            calls = list(ep.calls)
        for call in calls:
            n = len(call.keys)
            if call.model != req.model or call.tools_key != tools_key or len(req.keys) <= n + 1:
                continue
            if best is not None and n <= len(best[0].keys):
                continue
            if req.keys[:n] != call.keys:
                continue
            for choice in call.choices:
                if choice.key == req.keys[n]:
                    best = (call, choice)
                    break
        if best is not None:
            call, choice = best
            ended = bool(choice.ids) and choice.ids[-1] == chat.eos_id
            start = len(call.keys) + 1
            key = ("turn", req.model, ended, tuple(req.keys[start:]))
            rest = self._renders.get(key)
            if rest is None:
                try:
                    rest = chat.env_turn(req.messages[start:], ended)
                except ValueError:
                    rest = False  # the template cannot splice: render afresh
                self._renders.put(key, rest)
            if rest is not False:
                head = call.prompt_ids + choice.ids
                seen = gateway_images.count(req.messages[:start])
                rest, images = self._place(req, rest, req.images[seen:], len(head), call.images)
                return head + rest, True, images
        key = ("first", req.model, tools_key, tuple(req.keys))
        ids = self._renders.get(key)
        if ids is None:
            messages = req.messages
            if self.fold_calls[req.model]:
                messages = [_fold_calls(m) for m in messages]
            ids = chat.first_prompt(messages, req.tools)
            self._renders.put(key, ids)
        ids, images = self._place(req, list(ids), req.images, 0, None)
        return ids, False, images

    def _check_images(self, model: str) -> None:
        if self.visions.get(model) is None:
            raise RequestError(
                400,
                f"model {model!r} takes no images (its policy is not a vision-language "
                "model); send text only",
                param="messages",
            )
        if not hasattr(self.engines[model], "generate_vl"):
            raise RequestError(
                400,
                f"model {model!r}: its engine has no generate_vl, so it cannot take "
                f"images; set policies.{model}.engine.name=hf_vl (or vllm_vl)",
                param="messages",
            )

    def _place(
        self, req: Request, ids: list[int], new: list, offset: int, before: Images | None
    ) -> tuple[list[int], Images | None]:
        """``ids`` (rendered with one placeholder per image) with the ``new`` images'
        ids spliced in, and the prompt's images: ``before`` (a stitched prompt's earlier
        ones) then these, their ids starting ``offset`` tokens into the prompt."""
        if not new:
            return ids, before
        vision = self.visions[req.model]  # _check_images let the request in
        expansions, handle = vision.encode_images(new)
        try:
            ids, starts = splice_images(ids, vision.image_token_id, expansions, "the request")
        except ValueError as e:
            raise RequestError(400, str(e), param="messages") from None
        handles = (before.handles if before else []) + [handle]
        starts = (before.starts if before else []) + [offset + s for s in starts]
        self._joined += 1
        return ids, Images(
            handles, starts, vision.join_images(handles, starts, f"gw:{self._joined}")
        )

    async def _complete(self, ep: EpisodeState, req: Request) -> dict:
        prompt, stitched, images = self.prompt_ids(ep, req)
        vision = images.joined if images is not None else None
        params = SamplingParams(
            n=1,
            temperature=req.temperature,
            top_p=req.top_p,
            max_new_tokens=req.max_tokens,
            stop=req.stop,
            seed=req.seed,  # shared by the n calls below: the batcher keeps them together
        )
        outs = await asyncio.wait_for(
            asyncio.gather(
                *(
                    self.batcher.generate(ep, req.model, prompt, params, vision)
                    for _ in range(req.n)
                )
            ),
            self.request_timeout,
        )
        tok = self.tokenizers[req.model]
        choices = []
        for out in outs:
            ids, logps, finish = list(out.token_ids), list(out.logprobs), out.finish_reason
            if len(ids) > req.max_tokens:  # a longer call in the same flush
                ids, logps, finish = ids[: req.max_tokens], logps[: req.max_tokens], "length"
            text = tok.decode(ids, skip_special_tokens=True)
            if req.stop:  # the answer leaves the stop sequence out, as OpenAI's does
                cuts = [text.find(s) for s in req.stop if s in text]
                if cuts:
                    text, finish = text[: min(cuts)], "stop"
            message: dict[str, Any] = {"role": "assistant", "content": text}
            if req.tools:
                parsed = parse_hermes(text)
                if parsed.calls:
                    message["content"] = parsed.text or None
                    message["tool_calls"] = [
                        {
                            "id": "call_" + uuid.uuid4().hex[:24],
                            "type": "function",
                            "function": {"name": c.name, "arguments": json.dumps(c.arguments)},
                        }
                        for c in parsed.calls
                    ]
                    finish = "tool_calls"
            key = (
                "assistant",
                message["content"] or "",
                _tool_calls_key(message.get("tool_calls"), "reply"),
                "",
            )
            choices.append(Choice(ids, logps, finish, message, key))
        anchor = next((k[1] for k in reversed(req.keys) if k[0] != "assistant"), "")
        call = Call(
            req.model,
            req.keys,
            req.tools_key,
            prompt,
            choices,
            stitched,
            anchor,
            req.temperature,
            images,
        )
        with ep.lock:
            if not ep.open:
                raise RequestError(409, "the episode is over (it ended or timed out)")
            ep.calls.append(call)
        return self._answer(req, call, tok)

    @staticmethod
    def _answer(req: Request, call: Call, tok) -> dict:
        choices = []
        for i, c in enumerate(call.choices):
            entry: dict[str, Any] = {
                "index": i,
                "message": c.message,
                "finish_reason": c.finish,
                "logprobs": None,
            }
            if req.logprobs:
                content = []
                for tid, lp in zip(c.ids, c.logprobs, strict=True):
                    piece = tok.decode([tid], skip_special_tokens=False)
                    content.append(
                        {
                            "token": piece,
                            "logprob": lp,
                            "bytes": list(piece.encode()),
                            "top_logprobs": [],
                        }
                    )
                entry["logprobs"] = {"content": content, "refusal": None}
            choices.append(entry)
        completion = sum(len(c.ids) for c in call.choices)
        return {
            "id": "chatcmpl-" + uuid.uuid4().hex,
            "object": "chat.completion",
            "created": int(time.time()),
            "model": req.model,
            "choices": choices,
            "usage": {
                "prompt_tokens": len(call.prompt_ids),
                "completion_tokens": completion,
                "total_tokens": len(call.prompt_ids) + completion,
            },
        }


def _sse(answer: dict, usage: bool):
    """A finished completion as Server-Sent Events ``chat.completion.chunk``s: per choice
    its whole message in one delta, then its finish reason; usage last if asked. The engine
    samples a call's tokens together, so there is nothing to send earlier."""
    head = {k: answer[k] for k in ("id", "created", "model")} | {"object": "chat.completion.chunk"}

    def event(choices: list, **extra) -> bytes:
        return b"data: " + orjson.dumps(head | {"choices": choices} | extra) + b"\n\n"

    for c in answer["choices"]:
        delta = {"role": "assistant", "content": c["message"]["content"]}
        if c["message"].get("tool_calls"):
            delta["tool_calls"] = [
                {"index": k} | call for k, call in enumerate(c["message"]["tool_calls"])
            ]
        yield event([{"index": c["index"], "delta": delta, "logprobs": c["logprobs"]}])
        yield event([{"index": c["index"], "delta": {}, "finish_reason": c["finish_reason"]}])
    if usage:
        yield event([], usage=answer["usage"])
    yield b"data: [DONE]\n\n"


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

    def openai(self):
        """A synchronous ``openai.OpenAI`` client for this episode (no retries). Its HTTP
        client skips TLS setup (plain HTTP to 127.0.0.1): loading the CA store costs ~40 ms
        per client, more than an engine call on a small model."""
        import httpx
        import openai

        return openai.OpenAI(
            base_url=self.base_url,
            api_key=self.api_key,
            max_retries=0,
            timeout=self.timeout,
            http_client=httpx.Client(verify=False, timeout=self.timeout),
        )

    def async_openai(self):
        """An ``openai.AsyncOpenAI`` client for this episode (no retries, no TLS setup)."""
        import httpx
        import openai

        return openai.AsyncOpenAI(
            base_url=self.base_url,
            api_key=self.api_key,
            max_retries=0,
            timeout=self.timeout,
            http_client=httpx.AsyncClient(verify=False, timeout=self.timeout),
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

    def __init__(
        self,
        ctx,
        agent: Annotated[
            str | None,
            "the agent: package.module:function or ./file.py:function, sync or async",
        ] = None,
        concurrency: Annotated[int, "episodes running at once"] = 64,
        request_timeout: Annotated[float, "seconds a request may wait for the engine"] = 60.0,
        episode_timeout: Annotated[float, "seconds an episode may run"] = 300.0,
        batch_wait: Annotated[
            float,
            "an engine call starts when every open episode has a request waiting, or when "
            "no request arrived for this many seconds",
        ] = 0.02,
        host: Annotated[str, "the address the server binds (keep 127.0.0.1 unless needed)"] = (
            "127.0.0.1"
        ),
        policy: Annotated[str | None, "the default model for agents (null: the first)"] = None,
        command: Annotated[
            list[str] | None,
            "instead of agent: a program (argv) run once per episode with OPENAI_BASE_URL, "
            "OPENAI_API_KEY, POLYRL_MODEL and POLYRL_TASK (the row as JSON) set; its last "
            "stdout line (JSON: a number, {reward, success} or null) is its return",
        ] = None,
        max_images: Annotated[
            int, "images one request may carry (image_url data URLs; a VLM policy)"
        ] = 16,
        max_pixels: Annotated[
            int, "source pixels (width * height) one request's images may sum to"
        ] = 4096 * 4096,
    ) -> None:
        self.agent = self._check(
            agent,
            concurrency,
            request_timeout,
            episode_timeout,
            batch_wait,
            policy,
            ctx.policies,
            command,
            max_images,
            max_pixels,
        )
        self.command = list(command) if command else None
        self.name = policy or next(iter(ctx.policies))
        self.concurrency = concurrency
        self.request_timeout, self.episode_timeout = request_timeout, episode_timeout
        self.server = GatewayServer(
            dict(ctx.engines),
            {name: p.tokenizer for name, p in ctx.policies.items()},
            host=host,
            request_timeout=request_timeout,
            batch_wait=batch_wait,
            visions={
                name: p if isinstance(p, TakesImageTurns) else None
                for name, p in ctx.policies.items()
            },
            limits=Limits(max_images, max_pixels),
        )
        self.pad_id = ctx.policies[self.name].tokenizer.pad_token_id
        self.decoders = {name: p.tokenizer for name, p in ctx.policies.items()}
        self._next_episode = 0
        self.failed_episodes = 0  # over the run

    @staticmethod
    def _check(
        agent,
        concurrency,
        request_timeout,
        episode_timeout,
        batch_wait,
        policy,
        names,
        command,
        max_images=16,
        max_pixels=4096 * 4096,
    ):
        """The options' ranges, the policy name and the agent; returns the agent callable
        (None for a command)."""
        if concurrency < 1:
            raise ConfigError(f"rollout.args.concurrency must be >= 1, got {concurrency}")
        if max_images < 0 or max_pixels < 1:
            raise ConfigError(
                f"rollout.args: max_images must be >= 0 and max_pixels >= 1, got "
                f"{max_images} and {max_pixels}"
            )
        for key, value in (
            ("request_timeout", request_timeout),
            ("episode_timeout", episode_timeout),
        ):
            if not value > 0:
                raise ConfigError(f"rollout.args.{key} must be > 0, got {value}")
        if batch_wait < 0:
            raise ConfigError(f"rollout.args.batch_wait must be >= 0, got {batch_wait}")
        if policy is not None and policy not in names:
            raise ConfigError(
                f"rollout.args.policy={policy!r} is not one of the policies {sorted(names)}"
            )
        if (agent is None) == (not command):
            raise ConfigError(
                "rollout.args: give exactly one of agent (a Python function) and command "
                f"(an external program's argv); got agent={agent!r}, command={command!r}"
            )
        if command:
            if not all(isinstance(a, str) and a for a in command):
                raise ConfigError(f"rollout.args.command must be a list of strings, got {command}")
            return None
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
    def validate_config(cls, cfg) -> None:
        """At config time, before any model loads: ranges, the policy and the agent."""
        a = cfg.rollout.args
        cls._check(
            a.agent,
            a.concurrency,
            a.request_timeout,
            a.episode_timeout,
            a.batch_wait,
            a.policy,
            list(cfg.policies),
            a.command,
            a.max_images,
            a.max_pixels,
        )

    def close(self) -> None:
        """Stop the server (the run's end; a daemon thread otherwise)."""
        self.server.close()

    def rollout(self, items: list[PromptItem], params: SamplingParams) -> TensorDict:
        return run_sync(self.arollout(items, params))

    async def arollout(self, items: list[PromptItem], params: SamplingParams) -> TensorDict:
        if self.server.port == 0:
            self.server.start()
        self.server.defaults = params
        episodes = []
        for item in items:
            for g in range(params.n):
                episodes.append(
                    EpisodeState(self._next_episode, secrets.token_urlsafe(12), item, g)
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
        return self._record(episodes)

    async def _episode(self, ep: EpisodeState, gate: asyncio.Semaphore, pool) -> None:
        async with gate:
            endpoint = Endpoint(
                self.server.open_episode(ep),
                self.server.api_key,
                self.name,
                list(self.server.engines),
                ep.id,
                ep.sample,
                self.request_timeout,
            )
            try:
                if self.command:
                    run = self._run_command(ep.item.row, endpoint)
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

    async def _run_command(self, row: dict, endpoint: Endpoint) -> Any:
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
        proc = await asyncio.create_subprocess_exec(
            *self.command,
            env=env,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
        try:
            out, err = await proc.communicate()
        except asyncio.CancelledError:
            proc.kill()
            await proc.wait()
            raise
        if proc.returncode != 0:
            tail = err.decode(errors="replace").strip()[-500:]
            raise RuntimeError(f"{self.command[0]} exited with status {proc.returncode}: {tail}")
        lines = out.decode(errors="replace").strip().splitlines()
        if not lines:
            return None
        try:
            return json.loads(lines[-1])
        except json.JSONDecodeError:
            raise ValueError(
                f"{self.command[0]}'s last stdout line {lines[-1][:80]!r} is not JSON; print "
                'the return last: a number, {"reward": r, "success": s} or null'
            ) from None

    def _add(
        self, cols, errors, ep, base, prompt, response, logps, policy, turn, text, vision=None
    ) -> None:
        if ep.error:
            errors.append((len(cols["uid"]), ep.error))
        cols["vision"].append(vision)
        cols["prompt_ids"].append(prompt)
        cols["response_ids"].append(response)
        cols["rollout_logprobs"].append(logps)
        cols["policy"].append(policy)
        cols["uid"].append(ep.item.uid)
        cols["turn"].append(turn)
        tok = self.decoders[policy]
        cols["prompt_text"].append(tok.decode(prompt, skip_special_tokens=False))
        cols["response_text"].append(text)
        cols["meta"].append(dict(base))

    def _record(self, episodes: list[EpisodeState]) -> TensorDict:
        cols: dict[str, list] = {
            k: []
            for k in (
                "prompt_ids",
                "response_ids",
                "rollout_logprobs",
                "policy",
                "uid",
                "turn",
                "prompt_text",
                "response_text",
                "meta",
                "truncated",
                "vision",
            )
        }
        errors: list[tuple[int, str]] = []
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

            def add(
                prompt, response, logps, policy, turn, text, extra, vision=None, ep=ep, base=base
            ):
                self._add(
                    cols, errors, ep, base, prompt, response, logps, policy, turn, text, vision
                )
                cols["meta"][-1].update(extra)

            if not ep.calls:
                add(list(ep.item.prompt_ids), [], [], self.name, 0, "", {"turn": 0, "spans": []})
            for t, call in enumerate(ep.calls):
                for j, c in enumerate(call.choices):
                    add(
                        call.prompt_ids,
                        c.ids,
                        c.logprobs,
                        call.model,
                        t,
                        self.decoders[call.model].decode(c.ids, skip_special_tokens=True),
                        {
                            "turn": t,
                            "choice": j,
                            "model": call.model,
                            "stitched": call.stitched,
                            "temperature": call.temperature,
                            "completion_finish": c.finish,
                            "spans": [[t, 0, len(c.ids)]],
                        },
                        call.images.joined if call.images is not None else None,
                    )
                    cols["truncated"].append(c.finish == "length")
            if not ep.calls:
                cols["truncated"].append(False)
        record = text_record(
            prompt_ids=cols["prompt_ids"],
            response_ids=cols["response_ids"],
            rollout_logprobs=cols["rollout_logprobs"],
            policy=cols["policy"],
            uid=cols["uid"],
            turn=cols["turn"],
            pad_id=self.pad_id,
            prompt_text=cols["prompt_text"],
            response_text=cols["response_text"],
            meta=cols["meta"],
            truncated=cols["truncated"],
        )
        if any(v is not None for v in cols["vision"]):
            set_strings(record, "vision", cols["vision"])
        failed = {ep.id for ep in episodes if ep.error}
        self.failed_episodes += len(failed)
        if errors:
            mark_invalid(record, [i for i, _ in errors], [e for _, e in errors])
        return record


WORKFLOWS.register("gateway", Gateway)
