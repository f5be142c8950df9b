"""The gateway's server: its wire APIs (:data:`APIS`) over the run's engines.

:class:`GatewayServer` runs Starlette on uvicorn on its own thread and event loop, files
requests under their episode (its own base URL), builds each prompt (stitched onto an
earlier completion when the messages extend it) and answers from the core's episode
runtime (:class:`~polyrl.core.rollout.batching.Batcher`, serving mode), which serves whatever
waits in one engine call per model and sampling setting. The workflow that
runs agents against it is :class:`polyrl.agents.gateway.workflow.Gateway`.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import itertools
import json
import math
import socket
import threading
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

import orjson

from polyrl.agents.chat import ChatFormat
from polyrl.agents.gateway import images as gateway_images
from polyrl.agents.gateway.api import ApiContext, WireAPI
from polyrl.agents.gateway.chat import ChatAPI
from polyrl.agents.gateway.episodes import Call, Choice, EpisodeState, Images
from polyrl.agents.gateway.errors import RequestError, failure
from polyrl.agents.gateway.limits import Refusals, admit, charge, read_body, refund
from polyrl.agents.gateway.messages import MessagesAPI
from polyrl.agents.gateway.options import GatewayOptions
from polyrl.agents.gateway.prompts import LengthCheck, RenderCache
from polyrl.agents.gateway.requests import Request, fold_calls, tool_calls_key
from polyrl.agents.gateway.responses import ResponsesAPI
from polyrl.agents.gateway.stream import Live, drive
from polyrl.agents.tools import parse_hermes
from polyrl.core.interfaces import (
    TakesImageTurns,
    engine_caps,
    splice_images,
    streams_tokens,
    takes_images,
)
from polyrl.core.observe import timeline
from polyrl.core.rollout.batching import Batcher, EpisodeClosed
from polyrl.core.rollout.engine import Request as EngineRequest
from polyrl.core.rollout.engine import SamplingParams

if TYPE_CHECKING:
    import uvicorn
    from starlette.applications import Starlette
    from starlette.requests import Request as HttpRequest
    from starlette.responses import Response

    Endpoint = Callable[[HttpRequest], Awaitable[Response]]

# The wire APIs the gateway serves, each under every episode's base URL (its ``paths``).
APIS: dict[str, WireAPI] = {
    "chat": ChatAPI(),
    "responses": ResponsesAPI(),
    "messages": MessagesAPI(),
}


def orjson_loads(raw: bytes) -> Any:
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError:
        raise RequestError(400, "the request body is not valid JSON") from None


class GatewayServer:
    """The wire APIs over the run's engines, on its own thread and event loop."""

    def __init__(
        self,
        engines: dict[str, Any],
        tokenizers: dict[str, Any],
        options: GatewayOptions | None = None,
        *,
        visions: dict[str, TakesImageTurns | None] | None = None,
        contexts: dict[str, int | None] | None = None,
        seed: int = 0,
    ) -> None:
        options = options if options is not None else GatewayOptions()
        self.seed = seed  # the run's: with options.reproducible, each request's stream
        self.engines, self.tokenizers = engines, tokenizers
        self.options = self.limits = options
        # per model: the positions it takes (prompt + completion); None: not checked
        self.contexts = contexts or {}
        self.visions = visions or {}  # per model: how its policy takes images (None: it cannot)
        self.refusals = Refusals()  # budget refusals and the rollout's bytes held
        self.reward_posts = options.reward_posts  # False: POST /rewards is refused (403)
        self._lengths = LengthCheck(tokenizers, self.contexts)  # before tokenising
        self._joined = itertools.count(1)  # names each request's joined images
        self.chats = {name: ChatFormat(tok) for name, tok in tokenizers.items()}
        # Templates that never mention tool_calls would drop an assistant's calls when a
        # conversation is rendered afresh; those get the calls as Hermes text instead.
        self.fold_calls = {
            name: "tool_calls" not in str(getattr(tok, "chat_template", None) or "")
            for name, tok in tokenizers.items()
        }
        # Rendered prompts by their normalised messages: the samples of a group send the
        # same first messages, and many episodes the same tool or user turns.
        self._renders = RenderCache(4096)
        self.host = options.host
        self.request_timeout = options.request_timeout
        self.batcher = Batcher(engines)
        self.batch_wait = options.batch_wait
        self.defaults = SamplingParams()
        self.episodes: dict[str, EpisodeState] = {}
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._server: uvicorn.Server | None = None
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
        server = self._server = uvicorn.Server(config)
        failed: list[BaseException] = []

        def serve() -> None:
            try:
                asyncio.run(self._serve(server, sock))
            except BaseException as e:  # reported by start()
                failed.append(e)

        self._thread = threading.Thread(target=serve, name="polyrl-gateway", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + 30
        while not server.started:
            if failed or not self._thread.is_alive():
                raise RuntimeError(f"the gateway server did not start: {failed}")
            if time.monotonic() > deadline:
                raise RuntimeError("the gateway server did not start within 30 s")
            time.sleep(0.01)

    async def _serve(self, server: uvicorn.Server, sock: socket.socket) -> None:
        serving = self.batcher.serve(self.batch_wait, lambda: len(self.episodes))
        try:
            await server.serve(sockets=[sock])
        finally:
            serving.cancel()

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

    def new_rollout(self) -> Refusals:
        """Start a rollout's budgets afresh; returns the last rollout's refusals."""
        last, self.refusals = self.refusals, Refusals()
        return last

    def close_episode(self, ep: EpisodeState) -> None:
        with ep.lock:
            ep.open = False
        with self._lock:
            self.episodes.pop(ep.token, None)

    # ---------------------------------------------------------------- http
    def app(self) -> Starlette:
        """The ASGI app: Starlette (FastAPI's core). Each API (Chat Completions, Responses,
        Messages) parses its body into a :class:`Request`, the server samples it
        (:meth:`_generate`) and the API shapes the answer and its errors."""
        from starlette.applications import Starlette
        from starlette.responses import JSONResponse, Response, StreamingResponse
        from starlette.routing import Route

        def episode(request: HttpRequest) -> EpisodeState:
            """The request's episode: its URL token names it, and the request must carry
            that episode's own key (another episode's key, or the token alone, is a 401)."""
            with self._lock:
                ep = self.episodes.get(request.path_params["token"])
            if ep is None:
                raise RequestError(
                    404, "unknown or finished episode: use the base_url the run gave this agent"
                )
            auth = request.headers.get("authorization", "")
            given = auth[7:] if auth.lower().startswith("bearer ") else ""
            given = given or request.headers.get("x-api-key", "")  # Anthropic clients
            if not hmac.compare_digest(given.encode(), ep.key.encode()):
                raise RequestError(
                    401,
                    "Incorrect API key provided (use the key the run gave this episode's agent)",
                    code="invalid_api_key",
                )
            return ep

        def guarded(
            handler: Endpoint,
            shape: Callable[[RequestError], dict[str, Any]] = RequestError.body,
        ) -> Endpoint:
            """``handler`` with every failure answered in its API's error shape: a
            :class:`RequestError` as given, a timeout 504, anything else 500."""

            async def endpoint(request: HttpRequest) -> Response:
                try:
                    return await handler(request)
                except Exception as e:
                    err = failure(e, self.request_timeout)
                # a body that never arrived in time: the connection is not kept
                close = {"connection": "close"} if err.status == 408 else None
                return JSONResponse(shape(err), status_code=err.status, headers=close)

            return endpoint

        async def models(request: HttpRequest) -> Response:
            episode(request)
            data = [{"id": m, "object": "model", "owned_by": "polyrl"} for m in self.engines]
            return JSONResponse({"object": "list", "data": data})

        def route(api: WireAPI) -> Endpoint:
            """The endpoint of one wire API: parse, sample, answer (or stream)."""

            async def handler(request: HttpRequest) -> Response:
                ep = episode(request)
                body = await read_body(request, self.limits)
                # parsing (JSON, images) and rendering run on a worker thread: a large
                # request never stalls the other episodes' requests
                req, held = await asyncio.to_thread(self._parse, api, body, ep)
                tok = self.tokenizers[req.model]
                if req.stream:  # events as the engine samples (gateway.stream)
                    live = Live(self.request_timeout)
                    live.start(self._generate(ep, req, live, held))
                    await live.first()  # an error before the first token: an HTTP error
                    events = drive(live, api.stream(req, tok, ep, live.prompt_len))
                    return StreamingResponse(events, media_type="text/event-stream")
                call = await self._generate(ep, req, held=held)
                answer = api.answer(req, call, tok, ep)
                return Response(orjson.dumps(answer), media_type="application/json")

            return guarded(handler, api.error_body)

        async def rewards(request: HttpRequest) -> Response:
            ep = episode(request)
            if not self.reward_posts:
                raise RequestError(
                    403,
                    "this run takes no rewards from agents (rollout.args.reward_posts=false): "
                    "return the episode's reward instead",
                    code="rewards_not_accepted",
                )
            return JSONResponse(
                self._post_reward(ep, orjson_loads(await read_body(request, self.limits)))
            )

        async def other(request: HttpRequest) -> Response:
            served = ", ".join(
                f"POST <base_url>{p}" for api in APIS.values() for p in api.paths[:1]
            )
            raise RequestError(
                404,
                f"{request.url.path} is not served; the gateway serves {served}, POST "
                "<base_url>/rewards and GET <base_url>/models",
            )

        methods = ["GET", "POST", "PUT", "DELETE", "PATCH"]
        apis = [
            Route(f"/ep/{{token}}/v1{path}", route(api), methods=["POST"])
            for api in APIS.values()
            for path in api.paths
        ]
        return Starlette(
            routes=[
                *apis,
                Route("/ep/{token}/v1/models", guarded(models), methods=["GET"]),
                Route("/ep/{token}/v1/rewards", guarded(rewards), methods=["POST"]),
                Route("/{path:path}", guarded(other), methods=methods),
            ]
        )

    def _parse(self, api: WireAPI, body: bytes, ep: EpisodeState) -> tuple[Request, int]:
        """The API's :class:`Request` of ``body`` and the bytes it will hold once
        filed (its body, the stored history it continues, its images), charged to the
        episode and the rollout now: past a budget it is refused before it is rendered."""
        ctx = ApiContext(list(self.engines), self.defaults, self.limits)
        req = api.parse(orjson_loads(body), ctx, ep)
        held = len(body) + int(req.api.get("history_bytes", 0))
        held += sum(3 * im.width * im.height for im in req.images)
        with ep.lock:
            admit(ep.spent, self.refusals, self.limits, req.n, held)
        return req, held

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
            head = call.prompt_ids + choice.ids
            if rest is None:
                try:
                    text = chat.env_turn_text(req.messages[start:], ended)
                except ValueError:
                    rest = False  # the template cannot splice: render afresh
                else:
                    self._lengths.check(req.model, text, len(head))
                    rest = chat.encode(text)
                nbytes = sum(len(str(k)) for k in key[3]) + 8 * len(rest or ())
                self._renders.put(key, rest, nbytes)
            if rest is not False:
                seen = gateway_images.count(req.messages[:start])
                rest, images = self._place(req, rest, req.images[seen:], len(head), call.images)
                return head + rest, True, images
        key = ("first", req.model, tools_key, tuple(req.keys))
        ids = self._renders.get(key)
        if ids is None:
            messages = req.messages
            if self.fold_calls[req.model]:
                messages = [fold_calls(m) for m in messages]
            text = chat.render(messages, generation_prompt=True, tools=req.tools)
            self._lengths.check(req.model, text, 0)
            ids = chat.encode(text)
            self._renders.put(key, ids, len(text) + len(tools_key) + 8 * len(ids))
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
        if not takes_images(self.engines[model]):
            raise RequestError(
                400,
                f"model {model!r}: its engine takes no images; set "
                f"policies.{model}.engine.name=hf_vl (or vllm_vl)",
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
        vision = self.visions[req.model]
        assert vision is not None  # _check_images let the request in
        try:
            expansions, handle = vision.encode_images(new)
        except ValueError as e:  # the policy's processor refuses one (e.g. its aspect ratio)
            raise RequestError(
                400, f"model {req.model!r} cannot take an image of the request: {e}", "messages"
            ) from None
        try:
            ids, starts = splice_images(ids, vision.image_token_id, expansions, "the request")
        except ValueError as e:
            raise RequestError(400, str(e), param="messages") from None
        handles = (before.handles if before else []) + [handle]
        starts = (before.starts if before else []) + [offset + s for s in starts]
        joined = next(self._joined)  # atomic: long prompts are placed on worker threads
        return ids, Images(handles, starts, vision.join_images(handles, starts, f"gw:{joined}"))

    def _fit(self, req: Request, prompt: list[int]) -> int:
        """The request's token budget within its model's context: a prompt that leaves no
        room, or an explicit ``max_tokens`` past it, is a 400 naming the lengths; the
        default budget is shortened to what is left."""
        context = self.contexts.get(req.model)
        if not context:
            return req.max_tokens
        room = context - len(prompt)
        if room < 1 or (req.max_tokens_given and req.max_tokens > room):
            asked = f" + {req.max_tokens} completion tokens" if req.max_tokens_given else ""
            raise RequestError(
                400,
                f"model {req.model!r} takes {context} tokens (its context length); this "
                f"request's prompt is {len(prompt)} tokens{asked}; send a shorter "
                "conversation" + (" or fewer max tokens" if req.max_tokens_given else ""),
                code="context_length_exceeded",
                param="messages",
            )
        return min(req.max_tokens, room)

    async def _generate(
        self, ep: EpisodeState, req: Request, live: Live | None = None, held: int = 0
    ) -> Call:
        """Sample the request's ``n`` choices and file them under the episode (the rows of
        the record); every API answers from the :class:`Call` this returns. ``live``: a
        streamed request, given each token as it is sampled (engines that stream);
        ``held``: the bytes its admission charged (:meth:`_parse`), given back with its
        rows when it fails before it is filed."""
        try:
            # the server's thread does not share the rollout's context: the episode carries it
            with (
                timeline.recording_with(ep.tracer),
                timeline.span("gateway_request", lane=f"episode {ep.id}", episode=ep.id, n=req.n),
            ):
                return await self._sample(ep, req, live, held)
        except BaseException:
            with ep.lock:
                refund(ep.spent, self.refusals, req.n, held)
            raise

    async def _sample(self, ep: EpisodeState, req: Request, live: Live | None, held: int) -> Call:
        if req.top_logprobs and not engine_caps(self.engines[req.model]).gives_top_logprobs:
            raise RequestError(
                400,
                f"model {req.model!r}: its engine ({type(self.engines[req.model]).__name__}) "
                "gives no top_logprobs; leave top_logprobs out or use the hf engine",
                param="top_logprobs",
            )
        # off the event loop: rendering and tokenising a long prompt takes a while
        prompt, stitched, images = await asyncio.to_thread(self.prompt_ids, ep, req)
        req.max_tokens = self._fit(req, prompt)
        # a streamed request whose engine streams: it gets each token as it is sampled
        streamed = live if live is not None and streams_tokens(self.engines[req.model]) else None
        if live is not None:
            live.prompt_len = len(prompt)
        vision = images.joined if images is not None else None
        with ep.lock:  # the request's place in its episode (arrival order within it)
            seq, ep.asked = ep.asked, ep.asked + 1
        # reproducible: the request's place in the run fixes its stream and its call ids
        place = f"{self.seed}:{ep.id}:{seq}" if self.options.reproducible else None
        seed = req.seed
        if seed is None and place is not None:
            seed = request_seed(place)
        params = SamplingParams(
            n=1,
            temperature=req.temperature,
            top_p=req.top_p,
            max_new_tokens=req.max_tokens,
            stop=req.stop,
            seed=seed,  # shared by the n calls below: the batcher keeps them together
            top_logprobs=req.top_logprobs,
        )
        requests = [
            EngineRequest(
                prompt, vision=vision, on_token=streamed.sink(i) if streamed is not None else None
            )
            for i in range(req.n)
        ]
        try:
            grouped = await asyncio.wait_for(
                asyncio.gather(
                    *(
                        self.batcher.generate(
                            req.model,
                            request,
                            params,
                            # a flush serves its requests in episode order, not arrival order
                            key=(ep.id, seq, i),
                            episode=ep,
                            alive=lambda: ep.open,
                        )
                        for i, request in enumerate(requests)
                    )
                ),
                self.request_timeout,
            )
        except EpisodeClosed:
            raise RequestError(404, "the episode is over (it timed out)") from None
        outs = [o for (o,) in grouped]  # n=1 per engine request
        tok = self.tokenizers[req.model]
        choices = []
        for j, out in enumerate(outs):
            tokens, finish = out.tokens, out.finish_reason
            if len(tokens) > req.max_tokens:  # a longer call in the same flush
                tokens, finish = tokens[: req.max_tokens], "length"
            text = tok.decode(tokens.ids, skip_special_tokens=True)
            hit = None
            if req.stop:  # the answer leaves the stop sequence out, as OpenAI's does
                cuts = [(text.find(s), s) for s in req.stop if s in text]
                if cuts:
                    cut, hit = min(cuts)
                    text, finish = text[:cut], "stop"
            message: dict[str, Any] = {"role": "assistant", "content": text}
            if req.tools:
                parsed = parse_hermes(text)
                if parsed.calls:
                    message["content"] = parsed.text or None
                    message["tool_calls"] = [
                        {
                            "id": "call_" + call_id(place, j, k),
                            "type": "function",
                            "function": {"name": c.name, "arguments": json.dumps(c.arguments)},
                        }
                        for k, c in enumerate(parsed.calls)
                    ]
                    finish = "tool_calls"
            key = (
                "assistant",
                message["content"] or "",
                tool_calls_key(message.get("tool_calls"), "reply"),
                "",
            )
            choices.append(Choice(out.prompt, tokens, finish, message, key, hit))
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
        sampled = sum(len(c.ids) for c in choices)
        call.held = held + 8 * (len(prompt) + sampled)
        with ep.lock:
            if not ep.open:
                raise RequestError(409, "the episode is over (it ended or timed out)")
            ep.calls.append(call)
            charge(ep.spent, self.refusals, 8 * (len(prompt) + sampled), sampled)
        return call


def request_seed(place: str) -> int:
    """The sampling seed of a request (``reproducible``) at ``place`` ("run seed:episode:
    request number in the episode"): fixed by where it is in the run, not by when it
    arrived or what it was batched with."""
    digest = hashlib.blake2b(place.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") >> 1  # < 2**63: torch's manual_seed takes it


def call_id(place: str | None, choice: int, index: int) -> str:
    """A tool call's id: random, or one the request's ``place`` fixes (``reproducible``:
    the id goes back into the conversation the agent sends, so a rerun must see it again)."""
    if place is None:
        return uuid.uuid4().hex[:24]
    return hashlib.blake2b(f"{place}:{choice}:{index}".encode(), digest_size=12).hexdigest()
