"""The HTTP routes the official ``tinker`` client calls (``/api/v1/...``), over :class:`Service`.

Requests are parsed with the client's own request types, so a malformed one is refused
with 400 and a message naming the field before anything runs; a request that is well
formed but wrong for the model (an unknown loss, a datum whose inputs do not line up)
fails its future with category ``user``, which the client raises as ``RequestFailedError``.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import Any

import pydantic
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from tinker import types

from polyrl.marl.tinker_api.service import Future, Job, Service
from polyrl.marl.tinker_api.wire import BadRequest, decode_fwdbwd

PROTO = "application/x-protobuf"
POLL_S = 20.0  # a retrieve_future waits this long for its result before "try again"


def _bad(message: str, status: int = 400) -> JSONResponse:
    return JSONResponse({"error": message, "category": "user", "detail": message}, status)


def make_app(service: Service) -> Starlette:
    sessions: dict[str, dict[str, Any]] = {}

    async def parse(request: Request, cls: Any) -> Any:
        try:
            return cls.model_validate(await request.json())
        except (pydantic.ValidationError, ValueError) as e:
            raise BadRequest(f"{request.url.path}: not a valid {cls.__name__}: {e}") from None

    def future(fn, key: Any = None) -> JSONResponse:
        return JSONResponse({"request_id": service.call(fn, key)})

    def guarded(handler):
        async def endpoint(request: Request) -> Response:
            try:
                return await handler(request)
            except BadRequest as e:
                return _bad(str(e), 404 if str(e).startswith("unknown model_id") else 400)

        return endpoint

    def routes_of(handlers: dict[str, Any], methods=("POST",)) -> list[Route]:
        return [Route(p, guarded(h), methods=list(methods)) for p, h in handlers.items()]

    # --- session plumbing -----------------------------------------------------------
    async def client_config(request: Request) -> Response:
        # API keys only, no JWT exchange; plain JSON forward/backward bodies for other
        # clients; the per-request retrieve_future path (no session poller)
        return JSONResponse(types.ClientConfigResponse().model_dump(mode="json"))

    async def dynamic_config(request: Request) -> Response:
        return JSONResponse(types.ClientDynamicConfigResponse().model_dump(mode="json"))

    async def create_session(request: Request) -> Response:
        req = await parse(request, types.CreateSessionRequest)
        sid = f"session-{uuid.uuid4().hex[:12]}"
        sessions[sid] = {"tags": req.tags, "started": time.time()}
        return JSONResponse({"type": "create_session", "session_id": sid})

    async def heartbeat(request: Request) -> Response:
        return JSONResponse({"type": "session_heartbeat"})

    async def telemetry(request: Request) -> Response:
        return JSONResponse({"status": "accepted"})

    async def health(request: Request) -> Response:
        return JSONResponse({"status": "ok"})

    async def capabilities(request: Request) -> Response:
        return JSONResponse(
            {
                "supported_models": [
                    {"model_name": n, "trainable": True, "sampleable": True}
                    for n in sorted(service.cfg.models)
                ]
            }
        )

    async def finish_session(request: Request) -> Response:
        session = request.path_params["session_id"]
        sessions.pop(session, None)
        await asyncio.to_thread(service.finish_session, session)
        return JSONResponse({})

    # --- training -------------------------------------------------------------------
    async def create_model(request: Request) -> Response:
        req = await parse(request, types.CreateModelRequest)
        if req.optimizer_config.type != "adamw":
            raise BadRequest(f"optimizer {req.optimizer_config.type!r}: only adamw is served")
        service.base  # noqa: B018  (names are checked on the worker, with the load)

        def run() -> dict:
            mid = service.create_model(
                req.session_id, req.model_seq_id, req.base_model, req.lora_config
            )
            return {"model_id": mid, "type": "create_model"}

        return future(run)

    async def get_info(request: Request) -> Response:
        req = await parse(request, types.GetInfoRequest)
        client = service.client(req.model_id)
        base = service.bases[service.client_base[req.model_id]]
        arch = type(base.model).__name__
        return JSONResponse(
            {
                "type": "get_info",
                "model_id": req.model_id,
                "model_data": {"arch": arch, "model_name": base.name, "tokenizer_id": base.path},
                "is_lora": True,
                "lora_rank": client.rank,
                "model_name": base.name,
            }
        )

    async def forward_backward(request: Request) -> Response:
        body = await request.body()
        if request.headers.get("content-encoding") == "zstd":
            import zstandard

            body = zstandard.ZstdDecompressor().decompress(body)
        if PROTO not in request.headers.get("content-type", ""):
            raise BadRequest("forward_backward: send the protobuf body (application/x-protobuf)")
        req = decode_fwdbwd(body)
        base = service.check_fwdbwd(req)
        kind = "fwd" if req.forward_only else "fwdbwd"
        rid = service.submit(Job(kind, req.model_id, Future(), payload=req, base=base))
        return JSONResponse({"request_id": rid, "model_id": req.model_id})

    async def optim_step(request: Request) -> Response:
        req = await parse(request, types.OptimStepRequest)
        client = service.client(req.model_id)
        adam = req.optim_params
        if not isinstance(adam, types.AdamParams):
            raise BadRequest("optim_step: only Adam parameters (AdamParams) are served")
        if adam.learning_rate < 0 or not (0 <= adam.beta1 < 1 and 0 <= adam.beta2 < 1):
            raise BadRequest(
                f"optim_step: learning_rate must be >= 0 and betas in [0, 1); got "
                f"{adam.learning_rate}, ({adam.beta1}, {adam.beta2})"
            )
        base = service.bases[service.client_base[req.model_id]]
        return future(
            lambda: {"metrics": base.optim_step(client, adam), "type": "optim_step"},
            req.model_id,
        )

    async def save_weights(request: Request) -> Response:
        req = await parse(request, types.SaveWeightsRequest)
        service.client(req.model_id)
        name = req.path or f"state-{uuid.uuid4().hex[:8]}"
        return future(
            lambda: {
                "path": service.save(req.model_id, name, "weights", True),
                "type": "save_weights",
            },
            req.model_id,
        )

    async def load_weights(request: Request) -> Response:
        req = await parse(request, types.LoadWeightsRequest)
        if req.model_id is None:  # create_training_client_from_state: a new client
            if req.session_id is None or req.model_seq_id is None:
                raise BadRequest("load_weights: give model_id, or session_id and model_seq_id")
            info = service.checkpoint_info(req.path)

            def create() -> dict:
                mid = service.create_model(
                    req.session_id,
                    req.model_seq_id,
                    req.base_model or info["base_model"],
                    service.lora_of(info),
                )
                service.load(mid, req.path, req.optimizer)
                return {"path": req.path, "model_id": mid, "type": "load_weights"}

            return future(create)
        service.client(req.model_id)
        service.resolve(req.path)

        def run() -> dict:
            service.load(req.model_id, req.path, req.optimizer)
            return {"path": req.path, "model_id": req.model_id, "type": "load_weights"}

        return future(run, req.model_id)

    async def save_for_sampler(request: Request) -> Response:
        req = await parse(request, types.SaveWeightsForSamplerRequest)
        service.client(req.model_id)
        base = service.client_base[req.model_id]

        def run() -> dict:
            if req.path is not None:
                return {
                    "path": service.save(req.model_id, req.path, "sampler_weights", False),
                    "type": "save_weights_for_sampler",
                }
            session = req.model_id.split(":train:")[0]
            inflight = req.kind == "inflight"
            sid = service.new_sampler(req.model_id, base, None, session, inflight)
            return {"sampling_session_id": sid, "type": "save_weights_for_sampler"}

        return future(run, req.model_id)

    # --- sampling -------------------------------------------------------------------
    def base_of(req: Any, missing: str) -> str:
        """The base model a sampler is asked for: its checkpoint's (``model_path``), else
        ``base_model``; neither given is refused with ``missing``."""
        if req.model_path is not None:
            return service.checkpoint_info(req.model_path)["base_model"]
        if req.base_model is not None:
            return req.base_model
        raise BadRequest(missing)

    async def create_sampling_session(request: Request) -> Response:
        req = await parse(request, types.CreateSamplingSessionRequest)
        base = base_of(req, "create_sampling_session: give model_path or base_model")
        service.base(base)  # a clear error for an unserved name, before any load
        sid = await asyncio.to_thread(
            service.new_sampler, None, base, req.model_path, req.session_id
        )
        return JSONResponse({"type": "create_sampling_session", "sampling_session_id": sid})

    async def get_sampler(request: Request) -> Response:
        try:
            s = service.sampler(request.path_params["sampler_id"])
        except BadRequest as e:
            return _bad(str(e), 404)
        return JSONResponse(
            {"sampler_id": s.sampler_id, "base_model": s.base, "model_path": s.model_path}
        )

    async def asample(request: Request) -> Response:
        req = await parse(request, types.SampleRequest)
        if req.sampling_session_id is not None:
            sampler = service.sampler(req.sampling_session_id)
        else:  # a one-off sample: the checkpoint's shared adapter, or the base's own
            base_name = base_of(req, "sample: give sampling_session_id, model_path or base_model")
            sid = await asyncio.to_thread(
                service.new_sampler, None, base_name, req.model_path, None
            )
            sampler = service.sampler(sid)
        unsupported = {
            "topk_prompt_logprobs": req.topk_prompt_logprobs,
            "topk_sample_logprobs": req.topk_sample_logprobs,
            "prompt_alt_tokens_k": req.prompt_alt_tokens_k,
        }
        asked = [k for k, v in unsupported.items() if v]
        if asked or req.target_prompt_logprobs is not None or req.prompt_logprobs_last_n:
            raise BadRequest(f"sample: {asked or ['target/last_n prompt logprobs']} not served")
        if req.num_samples < 1:
            raise BadRequest(f"num_samples must be >= 1, got {req.num_samples}")
        try:
            prompt = req.prompt.to_ints()
        except ValueError as e:
            raise BadRequest(f"sample: {e}") from None
        base = service.base(sampler.base)
        if not prompt or any(t < 0 or t >= base.vocab for t in prompt):
            raise BadRequest(f"sample: the prompt is empty or has ids outside [0, {base.vocab})")
        params = service.sampling_params(req.sampling_params)
        payload = (sampler, params, prompt, req.num_samples, bool(req.prompt_logprobs))
        rid = service.submit(Job("sample", None, Future(), payload=payload, base=sampler.base))
        seqs = [f"{rid}-{i}" for i in range(req.num_samples)]
        return JSONResponse({"request_id": rid, "sample_sequence_ids": seqs})

    # --- futures --------------------------------------------------------------------
    async def retrieve_future(request: Request) -> Response:
        req = await parse(request, types.FutureRetrieveRequest)
        fut = service.futures.get(req.request_id)
        if fut is None:
            return _bad(f"unknown request_id {req.request_id!r}", 404)
        deadline = time.monotonic() + POLL_S
        while not fut.done.is_set() and time.monotonic() < deadline:
            await asyncio.sleep(0.002)
        if not fut.done.is_set():
            return JSONResponse(
                {"type": "try_again", "request_id": req.request_id, "queue_state": "active"}
            )
        if fut.error is not None:
            return JSONResponse({"error": fut.error[0], "category": fut.error[1]})
        result = fut.result
        if isinstance(result, tuple) and result[0] == "proto":
            return Response(result[1], media_type=PROTO)
        return JSONResponse(result)

    post = {
        "/api/v1/client/config": client_config,
        "/api/v1/client/dynamic_config": dynamic_config,
        "/api/v1/create_session": create_session,
        "/api/v1/session_heartbeat": heartbeat,
        "/api/v1/telemetry": telemetry,
        "/api/v1/create_model": create_model,
        "/api/v1/get_info": get_info,
        "/api/v1/forward_backward": forward_backward,
        "/api/v1/optim_step": optim_step,
        "/api/v1/save_weights": save_weights,
        "/api/v1/load_weights": load_weights,
        "/api/v1/save_weights_for_sampler": save_for_sampler,
        "/api/v1/create_sampling_session": create_sampling_session,
        "/api/v1/asample": asample,
        "/api/v1/retrieve_future": retrieve_future,
        "/api/v1/sessions/{session_id}/finish": finish_session,
    }
    get = {
        "/api/v1/healthz": health,
        "/api/v1/get_server_capabilities": capabilities,
        "/api/v1/samplers/{sampler_id}": get_sampler,
    }
    return Starlette(routes=routes_of(post) + routes_of(get, methods=("GET",)))
