"""The Ray actors behind :mod:`polyrl.core.distributed.ray_backend` and how the driver calls them.

``PolicyWorker`` is one FSDP2 rank of a policy's trainer group, ``EngineWorker`` holds a
policy's rollout engine, ``RewardWorker`` scores one reward term on its own resources.
``wait`` collects actor results and turns a failure into an :class:`ActorError` that
names the role. The backend module (placement, groups, the driver-side proxies) says
what runs where; Ray is imported only when these are used. An actor's process imports
this module, and with it ``polyrl.core`` (its package), which registers the core's parts.
"""

from __future__ import annotations

import copy
import dataclasses
import os
import socket
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any, cast

import torch
from tensordict import TensorDict

from polyrl.core.dependencies import require
from polyrl.core.interfaces import (
    ExportsWeights,
    HasProcessor,
    LoadsTrainableState,
    Policy,
    ShardsItsRoot,
    engine_caps,
)
from polyrl.core.registry import ENGINES, POLICIES
from polyrl.core.runner.checkpoint import load_policy, save_policy, uses_lora

if TYPE_CHECKING:
    from peft import PeftModel
    from ray.actor import ActorHandle
    from torch.distributed.checkpoint.state_dict import StateDictOptions
    from torch.distributed.device_mesh import DeviceMesh

    from polyrl.core.rollout.engine import Prompt, SamplingParams
    from polyrl.core.rollout.rewards import Runner


class ActorError(RuntimeError):
    """A worker or engine actor died or failed; the message names its role."""


def require_ray() -> ModuleType:
    return require("ray", "distributed.backend=ray", "Ray")


def resources_of(cpus: float, gpus: float) -> dict[str, float]:
    return {"CPU": cpus, **({"GPU": gpus} if gpus else {})}


# ---------------------------------------------------------------------------------- actors


def _shard(
    model: torch.nn.Module,
    mesh: DeviceMesh,
    root: torch.nn.Module | None = None,
    offload: bool = False,
) -> None:
    """FSDP2: each decoder layer (the model's ``_no_split_modules``) is a unit, then the root.

    ``root`` (default: the model) is the module whose forward runs the model in training. A
    policy whose pass calls the model's parts one by one (a VLM's embeddings, vision tower,
    language model and head) names a wrapper module holding the model (``fsdp_root``): the
    root unit's parameters are gathered, and their gradients reduced, around *its* forward.
    """
    from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy, fully_shard

    policy = CPUOffloadPolicy() if offload else OffloadPolicy()
    names = set(getattr(model, "_no_split_modules", None) or [])
    layers = [m for m in model.modules() if type(m).__name__ in names]
    if not layers:
        raise RuntimeError(
            f"cannot find the decoder layers of {type(model).__name__} to shard "
            "(it declares no _no_split_modules)"
        )
    for layer in layers:
        fully_shard(layer, mesh=mesh, offload_policy=policy)
    fully_shard(model if root is None else root, mesh=mesh, offload_policy=policy)


def _fsdp_root(policy: Policy, model: torch.nn.Module) -> torch.nn.Module | None:
    """The policy's FSDP root for ``model`` (its ``fsdp_root``), or None: the model itself."""
    return policy.fsdp_root(model) if isinstance(policy, ShardsItsRoot) else None


def _param_names(model: torch.nn.Module) -> dict[int, str]:
    return {id(p): n for n, p in model.named_parameters()}


def _rebind_optimizer(policy: Policy, names: dict[int, str]) -> None:
    """Sharding replaced the parameters (same names, now DTensors): point the optimizer's
    groups at the new ones. It has no state yet, and its schedule stays attached."""
    if policy.optimizer is None:
        return
    new = dict(policy.model.named_parameters())
    for group in policy.optimizer.param_groups:
        group["params"] = [new[names[id(p)]] for p in group["params"]]


def _optim_by_index(optim: dict[str, Any]) -> dict[str, Any]:
    """A full optimizer state keyed by parameter name -> keyed by position, as
    ``torch.optim.Optimizer.state_dict()`` writes it in a single process."""
    order = [n for g in optim["param_groups"] for n in g["params"]]
    index = {n: i for i, n in enumerate(order)}
    return {
        "state": {index[n]: v for n, v in optim["state"].items()},
        "param_groups": [
            {**g, "params": [index[n] for n in g["params"]]} for g in optim["param_groups"]
        ],
    }


def _optim_by_name(optim: dict[str, Any], order: list[str]) -> dict[str, Any]:
    """The inverse of :func:`_optim_by_index`, given the parameter names in group order."""
    if len(order) != sum(len(g["params"]) for g in optim["param_groups"]):
        raise ValueError(
            "the checkpoint's optimizer holds a different number of parameters "
            "than this policy; was it written for another model or LoRA setting?"
        )
    return {
        "state": {order[i]: v for i, v in optim["state"].items()},
        "param_groups": [
            {**g, "params": [order[i] for i in g["params"]]} for g in optim["param_groups"]
        ],
    }


def _broadcast_trainable(model: torch.nn.Module) -> None:
    """Give every rank rank 0's trainable (adapter) weights: PEFT initializes them at random,
    and FSDP would otherwise stitch together shards of different initializations."""
    import torch.distributed as dist

    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                dist.broadcast(p.data, src=0)


def _full_tensor(t: torch.Tensor) -> torch.Tensor:
    """A gathered, detached CPU copy of a (possibly sharded) tensor; a collective for a
    DTensor, so every rank calls it in the same order."""
    from torch.distributed.tensor import DTensor

    if isinstance(t, DTensor):
        t = t.full_tensor()
    return t.detach().to("cpu", copy=True)


def _local_bytes(t: Any) -> int:
    from torch.distributed.tensor import DTensor

    if not isinstance(t, torch.Tensor):
        return 0
    if isinstance(t, DTensor):
        t = t.to_local()
    return t.numel() * t.element_size()


def memory_report(policy: Policy) -> dict[str, int]:
    """Peak (``VmHWM``) and current (``VmRSS``) resident bytes of this process, and the
    bytes this process holds of the policy's parameters, gradients (during a step) and
    optimizer state: its shards under FSDP, everything in local mode."""
    status = Path("/proc/self/status").read_text().splitlines()
    kib = {ln.split(":")[0]: int(ln.split()[1]) for ln in status if ln.startswith("Vm")}
    params = list(policy.model.parameters())
    optim = policy.optimizer.state.values() if policy.optimizer is not None else []
    return {
        "peak_rss": kib.get("VmHWM", 0) * 1024,
        "rss": kib.get("VmRSS", 0) * 1024,
        "params": sum(_local_bytes(p) for p in params),
        # what backward allocates (the update frees them again): one per trainable weight
        "grads": sum(_local_bytes(p) for p in params if p.requires_grad),
        "optimizer": sum(_local_bytes(v) for st in optim for v in st.values()),
    }


@dataclass
class LoraFactors:
    """A LoRA policy's engine sync: per adapted linear layer, the name of its weight in
    the plain base model, the factors A (r x in) and B (out x r), and the scale
    (alpha / r), so the engine computes ``W0 + scale * B @ A`` itself."""

    factors: list[tuple[str, torch.Tensor, torch.Tensor, float]]


@torch.no_grad()
def lora_factors(name: str, model: torch.nn.Module) -> LoraFactors:
    """The active adapter's factors of a (sharded) PEFT model; every rank must call it."""
    from peft.tuners.lora import Linear as LoraLinear
    from peft.tuners.lora import LoraLayer

    factors = []
    base = cast("PeftModel", model).get_base_model()  # nn.Module types attributes loosely
    for path, module in base.named_modules():
        if not isinstance(module, LoraLayer):
            continue
        if (
            not isinstance(module, LoraLinear)
            or module.fan_in_fan_out
            or any(module.use_dora.values())
        ):
            raise RuntimeError(
                f"policy {name!r}: the adapter on {path!r} ({type(module).__name__})"
                " is not a plain LoRA linear layer; only those can be merged into "
                "the engine's weights under distributed.backend=ray"
            )
        for adapter in module.active_adapters:
            factors.append(
                (
                    f"{path}.weight",
                    _full_tensor(cast(torch.nn.Linear, module.lora_A[adapter]).weight),
                    _full_tensor(cast(torch.nn.Linear, module.lora_B[adapter]).weight),
                    float(module.scaling[adapter]),
                )
            )
    if not factors:
        raise RuntimeError(f"policy {name!r}: found no LoRA layer to sync to the engine")
    return LoraFactors(factors)


class PolicyWorker:
    """One FSDP rank of a policy (a Ray actor)."""

    def __init__(self, rank: int, world: int, threads: int) -> None:
        torch.set_num_threads(threads)
        self.rank, self.world = rank, world
        self.policy: Any = None
        self._sft: Any = None

    def rendezvous(self) -> tuple[str, int]:
        """(ip, free port) on this actor's node; rank 0's is the group's address."""
        with socket.socket() as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
        return require_ray().util.get_node_ip_address(), port

    def node_id(self) -> str:
        return require_ray().get_runtime_context().get_node_id()

    def setup(
        self,
        name: str,
        cfg: Any,
        where: tuple[str, int],
        *,
        total_steps: int,
        need_reference: bool,
        gpu: bool,
        timeout_s: float,
        rng: torch.Tensor,
        cpu_offload: bool = False,
    ) -> None:
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh

        if gpu:
            torch.cuda.set_device(0)  # Ray shows this actor its own GPU(s) only
        addr, port = where
        dist.init_process_group(
            "nccl" if gpu else "gloo",
            init_method=f"tcp://{addr}:{port}",
            rank=self.rank,
            world_size=self.world,
            timeout=timedelta(seconds=timeout_s),
        )
        mesh = init_device_mesh("cuda" if gpu else "cpu", (self.world,))
        kwargs = {"device": "cuda"} if gpu else {}
        torch.set_rng_state(rng)  # the driver's: a LoRA adapter starts as in local mode
        self.name, self.lora = name, uses_lora(cfg)
        self.policy = POLICIES.get(cfg.kind)(
            name, cfg, total_steps=total_steps, need_reference=need_reference, shared={}, **kwargs
        )
        if self.lora:
            _broadcast_trainable(self.policy.model)
        names = _param_names(self.policy.model)
        root = _fsdp_root(self.policy, self.policy.model)
        _shard(self.policy.model, mesh, root, offload=cpu_offload)
        if self.policy.reference is not None:
            _shard(self.policy.reference, mesh, _fsdp_root(self.policy, self.policy.reference))
        _rebind_optimizer(self.policy, names)

    def update(
        self,
        batch: TensorDict,
        algo: Any,
        temperature: float,
        gen_state: torch.Tensor,
        correction: str | None = None,
    ) -> tuple[dict[str, float], torch.Tensor]:
        from polyrl.core.train import trainer

        gen = torch.Generator()
        gen.set_state(gen_state)
        out = trainer.update(
            self.policy,
            batch,
            algo,
            temperature=temperature,
            generator=gen,
            dp=(self.rank, self.world),
            correction=correction,
        )
        return out, gen.get_state()

    def sft_update(self, batch: TensorDict) -> dict[str, float]:
        from polyrl.core.train import trainer

        return trainer.sft_update(self.policy, batch, dp=(self.rank, self.world))

    def enter_sft(self, lr: float | None) -> None:
        self._sft = self.policy.sft_optimizer(lr)
        self._sft.__enter__()

    def exit_sft(self) -> None:
        ctx, self._sft = self._sft, None
        if ctx is not None:
            ctx.__exit__(None, None, None)

    def _full(self, trainable_only: bool = False) -> StateDictOptions:
        from torch.distributed.checkpoint.state_dict import StateDictOptions

        return StateDictOptions(
            full_state_dict=True, cpu_offload=True, ignore_frozen_params=trainable_only
        )

    def state_dict(self) -> dict[str, Any] | None:
        """Full weights (the trainable adapter alone under LoRA), optimizer and schedule on
        rank 0, laid out as in local mode (so a checkpoint resumes under either backend)."""
        from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict

        p = self.policy
        opts = self._full(trainable_only=self.lora)
        stepped = p.optimizer is not None and bool(p.optimizer.state)
        optim: dict[str, Any] | None
        if stepped:
            weights, optim = get_state_dict(p.model, p.optimizer, options=opts)
        else:  # no step yet: the empty state is the local one (and DCP would create it
            # with a zero-gradient step that advances Adam's step count)
            weights = get_model_state_dict(p.model, options=opts)
            optim = p.optimizer.state_dict() if p.optimizer is not None else None
        # a warm start set the reference (see policy.warm_start_optimizer): keep it too
        warmed = p.reference_warmed
        reference = get_model_state_dict(p.reference, options=self._full()) if warmed else None
        if self.rank != 0:
            return None
        if self.lora:  # ignore_frozen_params keeps a frozen weight tied to another (lm_head)
            trainable = self._trainable_names()
            weights = {k: v for k, v in weights.items() if k in trainable}
        state = {
            "weights": weights,
            "optimizer": _optim_by_index(optim) if stepped and optim is not None else optim,
            "scheduler": p.scheduler.state_dict() if p.scheduler is not None else None,
        }
        return state | ({"reference": reference} if warmed else {})

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Every rank reads the full state and keeps its own shards."""
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            set_model_state_dict,
            set_state_dict,
        )

        p = self.policy
        opts = StateDictOptions(full_state_dict=True)
        if self.lora:
            self._check_adapter_keys(state["weights"])
        if "reference" in state:
            set_model_state_dict(p.reference, state["reference"], options=opts)
            p.reference_warmed = True
        if p.optimizer is None or not state["optimizer"]["state"]:
            set_model_state_dict(p.model, state["weights"], options=opts)
            if p.optimizer is not None:  # no moments yet: nothing to shard (see state_dict)
                p.optimizer.load_state_dict(state["optimizer"])
                p.scheduler.load_state_dict(state["scheduler"])
            return
        names = _param_names(p.model)
        order = [names[id(q)] for g in p.optimizer.param_groups for q in g["params"]]
        set_state_dict(
            p.model,
            p.optimizer,
            model_state_dict=state["weights"],
            optim_state_dict=_optim_by_name(state["optimizer"], order),
            options=opts,
        )
        p.scheduler.load_state_dict(state["scheduler"])

    def save_sharded(self, path: str) -> None:
        """Write this rank's shards into ``path`` (DCP; a collective): no full gather."""
        save_policy(self.policy, Path(path), lora=self.lora, rank=self.rank)

    def load_sharded(self, path: str) -> None:
        """Read this rank's shards from a sharded checkpoint of any world size."""
        load_policy(self.policy, Path(path), lora=self.lora, name=self.name)

    def memory(self) -> dict[str, int]:
        """This rank's peak and current resident memory and the bytes of its shards of
        the parameters, gradients and optimizer state (see :func:`memory_report`)."""
        return memory_report(self.policy)

    def reset_peak_memory(self) -> None:
        """Start a new peak: ``VmHWM`` drops to the current resident size (Linux)."""
        Path("/proc/self/clear_refs").write_text("5")

    def _trainable_names(self) -> set[str]:
        return {n for n, q in self.policy.model.named_parameters() if q.requires_grad}

    def _check_adapter_keys(self, weights: dict[str, torch.Tensor]) -> None:
        """As local mode's ``load_weights``: a LoRA checkpoint may hold adapter weights only."""
        unexpected = sorted(set(weights) - self._trainable_names())
        if unexpected:
            raise RuntimeError(
                f"policy {self.name!r}: checkpoint does not match the LoRA "
                f"adapter (unexpected {unexpected[:3]}); was it written for "
                "another model or LoRA setting?"
            )

    def full_weights(self) -> list | None:
        """What the engine needs, gathered; rank 0 returns ``[ObjectRef]`` (kept off the
        driver): the full weights, or under LoRA the adapter factors alone."""
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        if self.lora:
            weights: Any = lora_factors(self.name, self.policy.model)
        else:
            weights = get_model_state_dict(self.policy.model, options=self._full())
        return [require_ray().put(weights)] if self.rank == 0 else None

    def export(self, out_dir: str) -> None:
        """Rank 0 writes the Hugging Face folder from the gathered weights (under LoRA,
        PEFT's ``save_pretrained`` keeps the adapter alone, as in local mode). A policy kind
        with its own export format (``export_weights(out_dir, weights)``, e.g. diffusers')
        writes it from the gathered weights instead: its own module holds only a shard."""
        import torch.distributed as dist
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        weights = get_model_state_dict(self.policy.model, options=self._full())
        if self.rank == 0:
            out = Path(out_dir)
            if isinstance(self.policy, ExportsWeights):  # a model's state: tensors only
                self.policy.export_weights(out, cast("dict[str, torch.Tensor]", weights))
            else:
                self.policy.model.save_pretrained(out, state_dict=weights)
                # a VLM's processor (tokenizer, image processor, chat template) if it has one
                p = self.policy
                (p.processor if isinstance(p, HasProcessor) else p.tokenizer).save_pretrained(out)
        dist.barrier()

    def close(self) -> None:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


class EngineWorker:
    """A policy's rollout engine on its own actor, over its own copy of the model."""

    def __init__(self, threads: int) -> None:
        torch.set_num_threads(threads)
        self.policy: Any = None
        self.engine: Any = None
        self.base: dict[str, torch.Tensor] = {}  # LoRA: W0 of each adapted layer, on the CPU
        self.staged: dict[str, Any] = {}  # async: a version sent ahead of its load, by object id
        self.calls = 0  # calls that changed the engine's state: orders the states returned
        self.current: str | None = None  # the object id of the version the weights are
        # partial rollouts: the newest version offered while a call runs (the "offers"
        # concurrency group delivers it on its own thread), and the one the weights are
        self.offered: tuple[int, str, Any] | None = None
        self.offer_lock = threading.Lock()
        self.version = 0

    def node(self) -> str:
        return require_ray().get_runtime_context().get_node_id()

    def setup(self, name: str, cfg: Any, *, seed: int, gpu: bool) -> None:
        local = copy.deepcopy(cfg)
        local.train = False  # weights only: no optimizer, no reference
        if uses_lora(local):  # a plain base model; sync merges the adapter into it
            local.lora = dataclasses.replace(local.lora, r=0)
        kwargs = {"device": "cuda"} if gpu else {}
        self.policy = POLICIES.get(cfg.kind)(
            name, local, total_steps=1, need_reference=False, shared={}, **kwargs
        )
        self.engine = ENGINES.get(cfg.engine.name)(self.policy, seed=seed, **cfg.engine.args)

    def _changed(self) -> tuple[int, dict]:
        """This call's number and the engine's state after it. The driver keeps the
        newest, so capturing the state before a batch (resume needs it) costs no call."""
        self.calls += 1
        return self.calls, self.engine.state_dict()

    def generate(
        self, prompts: Sequence[Prompt], params: SamplingParams
    ) -> tuple[list, tuple[int, dict]]:
        return self.engine.generate(prompts, params), self._changed()

    def call(self, method: str, *args: Any, **kwargs: Any) -> tuple[Any, tuple[int, dict]]:
        """A method the engine's class declares in ``caps.remote_methods`` (EngineCaps): the
        engine's own interface beyond ``generate`` (images in, whole trajectories out);
        with the engine's state after it, as :meth:`generate`."""
        declared = engine_caps(self.engine).remote_methods
        if method not in declared:
            raise AttributeError(
                f"engine {type(self.engine).__name__} declares no remote method {method!r} "
                f"(remote_methods: {declared})"
            )
        return getattr(self.engine, method)(*args, **kwargs), self._changed()

    def stage(self, key: str, weights: dict[str, torch.Tensor] | LoraFactors) -> None:
        """Async rollouts: keep a version for a later :meth:`load_version`. Sent while an
        earlier batch generates, so Ray fetches the weights during that call, not in the
        load (this actor runs its calls one at a time, but resolves their arguments ahead)."""
        self.staged[key] = weights

    def load_version(self, boxed: list) -> None:
        """Load the version ``boxed[0]`` (an ObjectRef, in a list so that Ray passes it
        unresolved): its staged copy if it was sent ahead, else fetched now; nothing when
        the weights already are that version (a partial call took it mid-call)."""
        (ref,) = boxed
        weights = self.staged.pop(ref.hex(), None)
        self.staged.clear()  # only the next load is sent ahead: the rest would never be used
        if ref.hex() != self.current:
            self.sync(require_ray().get(ref) if weights is None else weights)
        self.current = ref.hex()

    def offer(self, version: int, key: str, weights: Any) -> None:
        """Partial rollouts: version ``version`` (object id ``key``) was published; a call
        in flight takes it at its next decoding step. Runs in the "offers" concurrency
        group, beside the call, so Ray fetches the weights while the engine generates."""
        with self.offer_lock:
            if self.offered is None or version > self.offered[0]:
                self.offered = (version, key, weights)

    def partial(self, start: int | None) -> None:
        """Partial rollouts on (the weights are version ``start``): the engine's calls take
        offered versions between decoding steps; None: off, and offers are dropped."""
        if start is None:
            self.engine.set_refresh(None)
            with self.offer_lock:
                self.offered = None
            return
        self.version = start
        self.engine.set_refresh(self._refresh)

    def _refresh(self) -> int:
        """The engine's hook before each decoding step: the newest offered version, loaded
        if newer than the weights; returns the weights' version."""
        with self.offer_lock:
            offered, self.offered = self.offered, None
        if offered is not None and offered[0] > self.version:
            version, key, weights = offered
            self.sync(weights)
            self.version, self.current = version, key
        return self.version

    def sync(self, weights: dict[str, torch.Tensor] | LoraFactors) -> None:
        self.current = None  # load_version and _refresh name the version after this
        if isinstance(weights, LoraFactors):
            self._merge(weights)
        elif isinstance(self.policy, LoadsTrainableState):
            self.policy.load_trainable_state(weights)
        else:
            self.policy.model.load_state_dict(weights)
        self.engine.sync()

    @torch.no_grad()
    def _merge(self, update: LoraFactors) -> None:
        """``W = W0 + scale * B @ A`` into the plain model, from the pristine ``W0`` (kept
        on the first sync), so no rounding accumulates over syncs."""
        params = dict(self.policy.model.named_parameters())
        for name, a, b, scale in update.factors:
            if name not in params:
                raise RuntimeError(
                    f"policy {self.policy.name!r}: the engine's model has no "
                    f"weight {name!r} for the adapter on it"
                )
            w = params[name]
            w0 = self.base.setdefault(name, w.detach().to("cpu", copy=True))
            f32 = {"device": w.device, "dtype": torch.float32}
            delta = (b.to(**f32) @ a.to(**f32)) * scale
            w.copy_((w0.to(**f32) + delta).to(w.dtype))

    def state_dict(self) -> tuple[int, dict]:
        return self.calls, self.engine.state_dict()

    def load_state_dict(self, state: dict) -> tuple[int, dict]:
        self.engine.load_state_dict(state)
        return self._changed()


class RewardWorker:
    """One reward term on its own actor: a reward model loads here once and stays loaded."""

    def __init__(self, term: Any, threads: int) -> None:
        torch.set_num_threads(threads)
        self.term = term

    def score(self, samples: list, concurrency: int) -> list:
        import asyncio

        from polyrl.core.rollout.rewards import run_term

        return asyncio.run(run_term(self.term, samples, concurrency))

    def pid(self) -> int:
        return os.getpid()


def reward_actor(term: Any, concurrency: int) -> tuple[ActorHandle[RewardWorker], Runner]:
    """(actor, async runner) for a reward term with ``actor`` resources."""
    opts = {
        "num_cpus": float(term.actor.get("num_cpus", 1.0)),
        "num_gpus": float(term.actor.get("num_gpus", 0.0)),
    }
    actor = (
        require_ray()
        .remote(RewardWorker)
        .options(**opts)
        .remote(term, int(term.actor.get("threads", 1)))
    )
    label = f"reward {term.key!r} actor"

    async def run(samples: list) -> list:
        import asyncio

        ref = actor.score.remote(samples, concurrency)
        return await asyncio.to_thread(lambda: wait([ref], [label])[0])

    return actor, run


# --------------------------------------------------------------------------- calling actors


def wait(refs: list, labels: list[str], on_failure: Callable[[], None] | None = None) -> list:
    """Results of ``refs`` in order. The first failure raises an error naming its role; if
    another actor of the same call died, that one is named (a rank's collective fails when
    a peer dies, and the dead peer is the news)."""
    ray = require_ray()
    from ray.exceptions import RayActorError, RayError

    results: list = [None] * len(refs)
    pending = dict(zip(refs, range(len(refs)), strict=True))
    while pending:
        ready, _ = ray.wait(list(pending), num_returns=1)
        i = pending.pop(ready[0])
        try:
            results[i] = ray.get(ready[0])
        except RayError as err:
            failures = [(i, err)]
            if pending and not isinstance(err, RayActorError):
                done, _ = ray.wait(list(pending), num_returns=len(pending), timeout=10)
                for r in done:
                    try:
                        ray.get(r)
                    except RayError as other:
                        failures.append((pending[r], other))
            dead = [(j, e) for j, e in failures if isinstance(e, RayActorError)]
            j, e = (dead or failures)[0]
            if on_failure is not None:
                on_failure()
            what = "died" if dead else "failed"
            raise ActorError(
                f"{labels[j]} {what}: {e}\nThe run cannot continue in this process; resume it "
                "from its last checkpoint (run.resume=true, or polyrl train --resume)."
            ) from e
    return results
