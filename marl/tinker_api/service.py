"""The service's state and its one worker: sessions, training clients, samplers, futures.

Every request that runs on a model becomes a job on one queue, answered through a future
(the client polls ``retrieve_future``). The worker takes the oldest job and, when it is a
forward(_backward), every other waiting forward(_backward) of the same kind on the same
base whose client has no older job still waiting: they run as one pass. Waiting sample
jobs with equal sampling parameters likewise decode together. A client's own jobs always
run in the order it sent them."""

from __future__ import annotations

import itertools
import logging
import threading
import time
import traceback
import uuid
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from polyrl.core.config import ConfigError
from polyrl.core.rollout.engine import SamplingParams
from polyrl.marl.tinker_api.base import (
    ATTN,
    BASE_ADAPTER,
    MLP,
    BaseModel,
    FwdBwdJob,
    TrainingAdapter,
    atomic_dir,
)
from polyrl.marl.tinker_api.config import TinkerServeConfig
from polyrl.marl.tinker_api.losses import LOSSES
from polyrl.marl.tinker_api.wire import BadRequest, FwdBwdRequest

log = logging.getLogger(__name__)
SCHEME = "tinker://"


@dataclass
class Future:
    done: threading.Event = field(default_factory=threading.Event)
    result: Any = None  # a dict (JSON) or ("proto", bytes)
    error: tuple[str, str] | None = None  # (message, category)


@dataclass
class Job:
    kind: str  # "fwdbwd" | "fwd" | "optim" | "sample" | "call"
    key: Any  # what must run in order with it: a model id (None: nothing)
    future: Future
    run: Any = None  # for kind "call": the function to run
    payload: Any = None
    base: str | None = None


@dataclass
class Sampler:
    sampler_id: str
    base: str
    adapter: str
    model_path: str | None
    session: str | None  # the session that made it: finishing that session frees it


class Service:
    """Base models by name, clients by model id, samplers by id, futures by request id."""

    def __init__(self, cfg: TinkerServeConfig) -> None:
        for name, path in cfg.models.items():
            if not (Path(path).expanduser() / "config.json").is_file():
                raise ConfigError(
                    f"models.{name}: {path!r} is not a model directory (no config.json); give "
                    "a local checkpoint directory (nothing is downloaded)"
                )
        self.cfg = cfg
        self.bases: dict[str, BaseModel] = {}
        self.clients: dict[str, TrainingAdapter] = {}
        self.client_base: dict[str, str] = {}
        self.client_targets: dict[str, list[str]] = {}
        self.samplers: dict[str, Sampler] = {}
        self.snapshots: dict[
            str, deque[str]
        ] = {}  # model id -> its snapshot samplers, oldest first
        self.freed: dict[str, str] = {}  # sampler id -> why it is gone (the error a request gets)
        self._by_path: dict[tuple, str] = {}  # (base, checkpoint file, mtime) -> its adapter
        self.futures: dict[str, Future] = {}
        self.root = Path(cfg.checkpoint_dir).expanduser()
        self._ids = itertools.count(1)
        self._queue: deque[Job] = deque()
        self._cv = threading.Condition()
        self._lock = threading.RLock()  # the models: the worker's, and synchronous calls'
        self._stop = False
        self.passes: list[int] = []  # how many clients each pass served (for tests/benchmarks)
        self._worker = threading.Thread(target=self._loop, daemon=True, name="tinker-worker")
        self._worker.start()

    # --- models ---------------------------------------------------------------------
    def base(self, name: str) -> BaseModel:
        if name not in self.cfg.models:
            raise BadRequest(
                f"base model {name!r} is not served here; served: {sorted(self.cfg.models)} "
                "(add it under models: in the service config)"
            )
        with self._lock:
            if name not in self.bases:
                c = self.cfg
                self.bases[name] = BaseModel(
                    name,
                    c.models[name],
                    device=c.device,
                    dtype=c.dtype,
                    alpha=c.lora_alpha,
                    seed=c.seed,
                )
            return self.bases[name]

    def client(self, model_id: str) -> TrainingAdapter:
        if model_id not in self.clients:
            raise BadRequest(f"unknown model_id {model_id!r}; create a training client first")
        return self.clients[model_id]

    def create_model(self, session_id: str, seq: int, base_name: str, lora: Any) -> str:
        rank = 32 if lora is None else int(lora.rank)
        if rank <= 0:
            raise BadRequest(f"lora_config.rank must be positive, got {rank}")
        base = self.base(base_name)
        targets = (ATTN if lora is None or lora.train_attn else []) + (
            MLP if lora is None or lora.train_mlp else []
        )
        if lora is None or lora.train_unembed:
            targets.append(base.unembed)
        if not targets:
            raise BadRequest(
                "lora_config trains neither attention, MLP nor unembedding layers; enable one"
            )
        model_id = f"{session_id}:train:{seq}"
        adapter = f"c{next(self._ids)}"
        with self._lock:
            base.add_adapter(adapter, rank, targets, None if lora is None else lora.seed)
            params = base.adapter_params(adapter)
            for p in params:
                p.requires_grad_(True)
            opt = torch.optim.AdamW(params, lr=1e-4, betas=(0.9, 0.95), eps=1e-12, weight_decay=0)
            self.clients[model_id] = TrainingAdapter(model_id, adapter, rank, params, opt)
            self.client_base[model_id] = base_name
            self.client_targets[model_id] = targets
        return model_id

    # --- futures and the queue ------------------------------------------------------
    def submit(self, job: Job) -> str:
        rid = uuid.uuid4().hex
        self.futures[rid] = job.future
        with self._cv:
            self._queue.append(job)
            self._cv.notify()
        return rid

    def call(self, fn, key: Any = None) -> str:
        """Run ``fn()`` on the worker in order with ``key``'s jobs; its result is the future's."""
        return self.submit(Job("call", key, Future(), run=fn))

    def close(self) -> None:
        with self._cv:
            self._stop = True
            self._cv.notify()
        self._worker.join(timeout=10)

    def _take(self) -> list[Job] | None:
        with self._cv:
            while not self._queue and not self._stop:
                self._cv.wait()
            if self._stop:
                return None
            first = self._queue[0]
        if first.kind in ("fwdbwd", "fwd", "sample") and self.cfg.batch_window_ms > 0:
            time.sleep(self.cfg.batch_window_ms / 1000)  # let the other clients' calls arrive
        with self._cv:
            first = self._queue.popleft()
            batch, rows = [first], len(first.payload.data) if first.kind in ("fwdbwd", "fwd") else 0
            if first.kind not in ("fwdbwd", "fwd", "sample"):
                return batch
            blocked = {first.key}
            keep: deque[Job] = deque()
            for job in self._queue:
                same = job.kind == first.kind and job.base == first.base
                if first.kind == "sample":
                    same = same and job.payload[1] == first.payload[1]
                else:
                    same = same and rows + len(job.payload.data) <= self.cfg.max_batch_rows
                if same and (job.key is None or job.key not in blocked):
                    batch.append(job)
                    if first.kind != "sample":
                        rows += len(job.payload.data)
                else:
                    keep.append(job)
                if job.key is not None:
                    blocked.add(job.key)
            self._queue = keep
            return batch

    def _loop(self) -> None:
        while True:
            batch = self._take()
            if batch is None:
                return
            try:
                with self._lock:
                    self._run(batch)
            except BadRequest as e:
                for job in batch:
                    job.future.error = (str(e), "user")
            except Exception as e:  # a server fault: the client gets it, the service lives on
                log.error("tinker service: %s", traceback.format_exc())
                for job in batch:
                    job.future.error = (f"{type(e).__name__}: {e}", "server")
            for job in batch:
                job.future.done.set()

    def _run(self, batch: list[Job]) -> None:
        kind = batch[0].kind
        if kind == "call":
            batch[0].future.result = batch[0].run()
        elif kind in ("fwdbwd", "fwd"):
            self._fwdbwd(batch, backward=kind == "fwdbwd")
        elif kind == "sample":
            self._sample(batch)

    def _fwdbwd(self, batch: list[Job], backward: bool) -> None:
        from polyrl.marl.tinker_api.wire import encode_fwdbwd

        jobs, live = [], []
        for job in batch:  # a client freed (its session finished) while its request waited
            req: FwdBwdRequest = job.payload
            try:
                client = self.client(req.model_id)
            except BadRequest as e:
                job.future.error = (str(e), "user")
                continue
            jobs.append(FwdBwdJob(client, req.loss_fn, req.config, req.data))
            live.append(job)
        if not live:
            return
        self.bases[batch[0].base].forward_backward(jobs, backward)
        self.passes.append(len(live))
        for job, fj in zip(live, jobs, strict=True):
            job.future.result = ("proto", encode_fwdbwd(fj.outputs, fj.metrics))

    def _sample(self, batch: list[Job]) -> None:
        from polyrl.marl.tinker_api.wire import encode_sample

        base = self.bases[batch[0].base]
        params: SamplingParams = batch[0].payload[1]
        live = []
        for job in batch:  # a sampler freed while its request waited: that request fails
            try:
                self.sampler(job.payload[0].sampler_id)
                live.append(job)
            except BadRequest as e:
                job.future.error = (str(e), "user")
        if not live:
            return
        calls = [(job.payload[0].adapter, job.payload[2], job.payload[3]) for job in live]
        out = base.sample(calls, params)
        self.passes.append(len(live))
        for job, seqs in zip(live, out, strict=True):
            sampler, _, prompt, _, with_prompt = job.payload
            plp = base.prompt_logprobs(sampler.adapter, prompt) if with_prompt else None
            job.future.result = ("proto", encode_sample(seqs, plp))

    # --- validation before a job is queued -------------------------------------------
    def check_fwdbwd(self, req: FwdBwdRequest) -> str:
        """The request's base; a clear error for anything its pass would trip on."""
        client = self.client(req.model_id)
        if req.loss_fn not in LOSSES:
            raise BadRequest(
                f"loss_fn {req.loss_fn!r} is not supported here; use one of {sorted(LOSSES)} "
                "(or forward_backward_custom, which runs your loss client-side)"
            )
        if not req.data:
            raise BadRequest("forward_backward: no datums; send at least one")
        base = self.bases[self.client_base[client.model_id]]
        need = ("target_tokens", *LOSSES[req.loss_fn][1])
        for i, d in enumerate(req.data):
            n = len(d.tokens)
            if n == 0:
                raise BadRequest(f"datum {i}: model_input is empty")
            if base.context and n > base.context:
                raise BadRequest(f"datum {i}: {n} tokens, over the model's {base.context}")
            bad = [t for t in d.tokens if t < 0 or t >= base.vocab]
            if bad:
                raise BadRequest(f"datum {i}: token ids {bad[:5]} outside [0, {base.vocab})")
            for name in need:
                if name not in d.inputs:
                    raise BadRequest(
                        f"datum {i}: loss_fn {req.loss_fn!r} needs loss_fn_inputs[{name!r}]"
                    )
            for name, t in d.inputs.items():
                if t.numel() != n:
                    raise BadRequest(
                        f"datum {i}: loss_fn_inputs[{name!r}] has {t.numel()} values for "
                        f"{n} input tokens; give one per position (targets shifted by one)"
                    )
            tt = d.inputs["target_tokens"].long()
            if bool(((tt < 0) | (tt >= base.vocab)).any()):
                raise BadRequest(f"datum {i}: target_tokens outside [0, {base.vocab})")
        return base.name

    # --- checkpoints ---------------------------------------------------------------
    def checkpoint_path(self, model_id: str, kind: str, name: str) -> tuple[str, Path]:
        if not name or "/" in name or name.startswith("."):
            raise BadRequest(f"checkpoint name {name!r}: give a plain name (no '/')")
        return f"{SCHEME}{model_id}/{kind}/{name}", self.root / model_id / kind / name

    def resolve(self, path: str) -> Path:
        if not path.startswith(SCHEME):
            raise BadRequest(f"path {path!r} must start with {SCHEME}")
        local = self.root / path[len(SCHEME) :]
        if not (local / "COMPLETE").is_file():
            raise BadRequest(f"no checkpoint at {path!r} (nothing saved under that name)")
        return local

    def save(self, model_id: str, path: str, kind: str, optimizer: bool) -> str:
        client = self.client(model_id)
        base = self.bases[self.client_base[model_id]]
        uri, local = self.checkpoint_path(model_id, kind, path)
        state = {
            "adapter": base.adapter_state(client.adapter),
            "rank": client.rank,
            "targets": self.client_targets[model_id],
            "base_model": base.name,
            "steps": client.steps,
        }
        if optimizer:
            state["optimizer"] = client.optimizer.state_dict()

        def write(tmp: Path) -> None:
            torch.save(state, tmp / "state.pt")
            (tmp / "COMPLETE").write_text("ok\n")

        atomic_dir(local, write)
        return uri

    def load(self, model_id: str, path: str, optimizer: bool) -> None:
        client = self.client(model_id)
        state = torch.load(self.resolve(path) / "state.pt", weights_only=False)
        if state["base_model"] != self.client_base[model_id]:
            raise BadRequest(
                f"{path!r} was trained on {state['base_model']!r}, not this client's "
                f"{self.client_base[model_id]!r}"
            )
        base = self.bases[self.client_base[model_id]]
        base.load_adapter_state(client.adapter, state["adapter"])
        for p in client.params:
            p.grad = None
        if optimizer:
            if "optimizer" not in state:
                raise BadRequest(f"{path!r} holds no optimizer state (saved for a sampler)")
            client.optimizer.load_state_dict(state["optimizer"])
            client.steps = state["steps"]
        else:
            client.optimizer.state.clear()

    def checkpoint_info(self, path: str) -> dict:
        state = torch.load(self.resolve(path) / "state.pt", weights_only=False)
        return {
            "base_model": state["base_model"],
            "rank": state["rank"],
            "targets": state["targets"],
        }

    @staticmethod
    def lora_of(info: dict) -> Any:
        """The client's ``LoraConfig`` that makes a checkpoint's adapter (its layers)."""
        from tinker import types

        targets = info["targets"]
        return types.LoraConfig(
            rank=info["rank"],
            train_attn=ATTN[0] in targets,
            train_mlp=MLP[0] in targets,
            train_unembed=any(t not in ATTN + MLP for t in targets),
        )

    def new_sampler(
        self,
        model_id: str | None,
        base_name: str,
        path: str | None,
        session: str | None,
        inflight: bool = False,
    ) -> str:
        """A sampler: a frozen snapshot adapter of a training client now (each client keeps
        its last ``sampler_snapshots``; older ones are freed), or with ``inflight`` the
        client's one adapter that every inflight save overwrites (its samplers, old and
        new, then sample the newest weights, as Tinker's inflight kind allows), or the
        adapter of a saved checkpoint (one per checkpoint, shared by its samplers), or
        (neither) the base model itself (the base's own adapter)."""
        base = self.base(base_name)
        with self._lock:
            if model_id is not None and inflight:
                c = self.client(model_id)
                adapter = f"i{c.adapter}"
                if adapter not in base.peft.peft_config:
                    base.snapshot(c.adapter, adapter, c.rank, self.client_targets[model_id])
                else:
                    base.load_adapter_state(adapter, base.adapter_state(c.adapter))
            elif model_id is not None:
                c = self.client(model_id)
                adapter = f"s{next(self._ids)}"
                base.snapshot(c.adapter, adapter, c.rank, self.client_targets[model_id])
            elif path is not None:
                local = self.resolve(path) / "state.pt"
                key = (base_name, str(local), local.stat().st_mtime_ns)
                if key not in self._by_path:
                    state = torch.load(local, weights_only=False)
                    adapter = f"s{next(self._ids)}"
                    base.add_adapter(adapter, state["rank"], state["targets"], seed=None)
                    base.load_adapter_state(adapter, state["adapter"])
                    self._by_path[key] = adapter
                adapter = self._by_path[key]
            else:
                adapter = BASE_ADAPTER
            sid = f"sampler-{uuid.uuid4().hex[:12]}"
            self.samplers[sid] = Sampler(sid, base_name, adapter, path, session)
            if model_id is not None and not inflight:
                kept = self.snapshots.setdefault(model_id, deque())
                kept.append(sid)
                keep = self.cfg.sampler_snapshots
                while keep > 0 and len(kept) > keep:
                    self.free_sampler(
                        kept.popleft(),
                        f"the service keeps each training client's last {keep} snapshot "
                        "samplers (sampler_snapshots in its config) and this one is older; "
                        "take a new one with save_weights_and_get_sampling_client",
                    )
        return sid

    def sampler(self, sampler_id: str) -> Sampler:
        """A live sampler, or a clear error saying why it is gone."""
        s = self.samplers.get(sampler_id)
        if s is None:
            why = self.freed.get(sampler_id)
            if why is None:
                raise BadRequest(f"unknown sampler {sampler_id!r}")
            raise BadRequest(f"sampler {sampler_id!r} was freed: {why}")
        return s

    def free_sampler(self, sampler_id: str, why: str) -> None:
        """Forget a sampler; its adapter goes too when no other sampler shares it."""
        with self._lock:
            s = self.samplers.pop(sampler_id, None)
            if s is None:
                return
            self.freed[sampler_id] = why
            if any(o.adapter == s.adapter for o in self.samplers.values()):
                return
            self.bases[s.base].remove_adapter(s.adapter)
            self._by_path = {k: a for k, a in self._by_path.items() if a != s.adapter}

    def finish_session(self, session: str) -> None:
        """A finished session's clients and samplers are unreachable: free their adapters
        and Adam moments (checkpoints on disk stay)."""
        with self._lock:
            why = f"its session {session!r} finished"
            for sid in [k for k, s in self.samplers.items() if s.session == session]:
                self.free_sampler(sid, why)
            for mid in [m for m in self.clients if m.startswith(f"{session}:")]:
                client = self.clients.pop(mid)
                self.bases[self.client_base.pop(mid)].remove_adapter(client.adapter)
                self.client_targets.pop(mid, None)
                self.snapshots.pop(mid, None)

    def sampling_params(self, sp: Any) -> SamplingParams:
        if sp.top_k not in (-1, 0):
            raise BadRequest(f"sampling_params.top_k={sp.top_k} is not supported; use -1")
        stop = sp.stop
        if isinstance(stop, str):
            stop = [stop]
        stop = list(stop or [])
        return SamplingParams(
            n=1,
            temperature=float(sp.temperature),
            top_p=float(sp.top_p),
            max_new_tokens=int(sp.max_tokens or 16),
            stop=[s for s in stop if isinstance(s, str)],
            stop_token_ids=[int(s) for s in stop if not isinstance(s, str)],
            seed=sp.seed,
        )


def np_float(x: Any) -> np.ndarray:
    return np.asarray(x, dtype=np.float32)
