"""``engine.name: vllm_lora``: one vLLM engine serves every ``lora_agent`` adapter.

With ``engine.name: vllm`` each ``lora_agent`` policy would start its own ``vllm.LLM`` and
push the whole base with its adapter merged in after every update. Here all ``lora_agent``
policies on one base share a single LLM started with LoRA enabled on the (frozen) base
weights: each policy's engine is a thin handle whose ``generate`` sends its rows with that
policy's ``LoRARequest``, and whose ``sync`` serves the adapter's current weights. Only the
adapter moves (a few MB instead of the full model), and one KV cache serves every agent.

    policies:
      speaker:  {model: ..., kind: lora_agent, lora: {r: 8}, engine: {name: vllm_lora}}
      listener: {model: ..., kind: lora_agent, lora: {r: 8}, engine: {name: vllm_lora}}

Sampling is ``VLLMEngine``'s (per-row seeds, processed log-probs, stop rules, state_dict):
the handle is a ``VLLMEngine`` whose ``llm`` is the shared one and whose ``lora_request``
routes each of its requests through its adapter.

``sync`` writes the adapter with PEFT's ``save_pretrained`` into a fresh directory and
registers it under a fresh ``lora_int_id`` (the old one is removed first, so the other
adapters are never evicted). vLLM 0.31 loads adapters only from a directory
(``LoRARequest.lora_path``, read by ``WorkerLoRAManager._load_adapter``); there is no
in-memory path. The fresh id and path also give the adapter new prefix-cache keys (vLLM
hashes the LoRA name and path into each block), so no stale KV is reused.

Requests of several handles waiting at once (a marl team's acts, a gateway's models) take
one ``llm.generate`` with each prompt's own ``LoRARequest`` (``MixedCalls``: the batcher
merges them); each handle's rows keep the seeds its own call would have given them.

One LLM per process: vLLM keeps its distributed state in module globals, so the shared LLM
lives in a module-level registry, started by the first handle with ``max_loras`` = the
number of adapters on the shared PEFT model (the session builds every policy before any
engine) and closed with the last handle. Policies on a second base in the same process are
refused with an error; give them ``engine.name: vllm`` or ``hf``.

Engine options (``policies.<name>.engine.args``, declared by the constructor's keyword
parameters): ``max_model_len``, ``kv_cache_gb``, ``gpu_memory_utilization`` and ``dtype``
as for ``engine.name: vllm``, ``max_lora_rank`` (default: the smallest rank vLLM accepts
that holds the largest adapter) and ``llm_args`` (any other ``vllm.LLM`` keyword). They
are read from the first policy's engine (the one that starts the LLM); sleep mode is
refused (one policy's sleep would take the engine from the others).
"""

from __future__ import annotations

import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any

from polyrl.core.registry import ENGINES
from polyrl.core.rollout.engine import Completion, SamplingParams, text_requests
from polyrl.core.rollout.vllm_engine import VLLMEngine
from polyrl.core.runner.builds import ensure_model
from polyrl.core.segment import Tokens

# vLLM's allowed values of max_lora_rank (vllm.config.lora.MaxLoRARanks).
_VLLM_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


@dataclass
class _LoraServer:
    """The process's one LoRA-enabled LLM (a base-only ``VLLMEngine``) and its bookkeeping."""

    engine: VLLMEngine
    base: str
    max_loras: int
    handles: set[str] = field(default_factory=set)
    next_id: int = 1

    def fresh_id(self) -> int:
        """A LoRA id never used before in this LLM, so vLLM loads the adapter anew."""
        self.next_id += 1
        return self.next_id - 1


_SERVER: _LoraServer | None = None


def base_key(policy: Any) -> str:
    """The resolved base-model path that decides which policies can share the LLM."""
    cfg = policy.cfg
    return str(Path(ensure_model(cfg.model, cfg.build, cfg.build_args)).expanduser().resolve())


def vllm_rank(rank: int, policy: str) -> int:
    """The smallest ``max_lora_rank`` vLLM accepts that holds ``rank``."""
    for r in _VLLM_RANKS:
        if r >= rank:
            return r
    raise ValueError(
        f"policy {policy!r}: lora.r={rank} is above vLLM's largest max_lora_rank "
        f"({_VLLM_RANKS[-1]})"
    )


def shared_server(policy: Any, seed: int, engine_args: dict[str, Any]) -> _LoraServer:
    """The LoRA-enabled LLM for ``policy``'s base: started on first use, then reused."""
    global _SERVER
    base = base_key(policy)
    if _SERVER is not None:
        if _SERVER.base != base:
            raise RuntimeError(
                f"policy {policy.name!r}: engine vllm_lora already serves base {_SERVER.base} in "
                f"this process, and vLLM allows one LLM per process; give policies on base "
                f"{base} engine.name: vllm or hf"
            )
        return _SERVER
    if engine_args.get("enable_sleep_mode"):
        raise ValueError(
            f"policy {policy.name!r}: engine vllm_lora does not support "
            f"enable_sleep_mode (the LLM is shared by every adapter)"
        )
    configs = policy.model.peft_config  # every adapter on the shared base, built already
    rank = max(c.r for c in configs.values())
    max_loras = len(configs)
    args = {
        "max_lora_rank": vllm_rank(rank, policy.name),
        "max_loras": max_loras,
        **{k: v for k, v in engine_args.items() if v is not None},
        "enable_lora": True,
    }
    _SERVER = _LoraServer(VLLMEngine(policy, seed=seed, **args), base, max_loras)
    return _SERVER


class VLLMLoraEngine(VLLMEngine):
    """One ``lora_agent`` policy's view of the shared LLM: its adapter, seeds and call count.

    It reuses ``VLLMEngine``'s ``generate``/``_generate_rows``/``state_dict`` unchanged and
    does not run its constructor, which would start an LLM of its own.
    """

    def __init__(
        self,
        policy: Any,
        *,
        seed: int = 0,
        max_model_len: Annotated[
            int | None, "prompt + response tokens of the shared LLM (default: the model's)"
        ] = None,
        kv_cache_gb: Annotated[
            float | None,
            "KV cache of the shared LLM in GiB (CPU default 1; on GPU "
            "gpu_memory_utilization decides unless given)",
        ] = None,
        gpu_memory_utilization: Annotated[
            float, "share of the GPU's memory the shared LLM may take"
        ] = 0.5,
        dtype: Annotated[
            str | None, "vLLM dtype (default float32, or bfloat16 for a bfloat16 base on GPU)"
        ] = None,
        max_lora_rank: Annotated[
            int | None,
            "vLLM's max_lora_rank (default: the smallest vLLM accepts that holds the "
            "largest adapter's lora.r)",
        ] = None,
        llm_args: Annotated[
            dict | None, "other vllm.LLM keyword arguments (sleep mode is refused)"
        ] = None,
    ) -> None:
        engine_args = {
            "max_model_len": max_model_len,
            "kv_cache_gb": kv_cache_gb,
            "gpu_memory_utilization": gpu_memory_utilization,
            "dtype": dtype,
            "max_lora_rank": max_lora_rank,
            **(llm_args or {}),
        }
        if not hasattr(policy, "save_adapter"):
            raise TypeError(
                f"policy {policy.name!r}: engine vllm_lora serves kind lora_agent "
                f"policies only (got {type(policy).__name__}); use engine vllm"
            )
        self.policy, self.tokenizer = policy, policy.tokenizer
        self.seed, self.calls = int(seed), 0
        self.sleep_enabled, self.sleeping, self._stale = False, False, False
        self._warned_top_p = False
        self._capture = None  # VLLMEngine's MoE expert capture: none through LoRA handles
        self.last_sync_s = float("nan")
        t0 = time.perf_counter()
        self.server = shared_server(policy, seed, engine_args)
        if policy.name in self.server.handles:
            raise RuntimeError(f"policy {policy.name!r}: already has a vllm_lora engine")
        if len(self.server.handles) >= self.server.max_loras:
            raise RuntimeError(
                f"policy {policy.name!r}: the shared vllm_lora engine was started "
                f"for {self.server.max_loras} adapters; build every lora_agent "
                f"policy before the first engine"
            )
        self.server.handles.add(policy.name)
        self.lora_request: Any = None
        self._dir: tempfile.TemporaryDirectory | None = None
        self.llm = self.server.engine.llm
        self.sync()
        self.startup_s = time.perf_counter() - t0

    def mix_key(self) -> Any:
        """interfaces.MixedCalls: every handle on this process's LLM serves the others'
        requests (not in partial mode, whose refresh is per policy)."""
        server = self.__dict__.get("server")
        return None if server is None or self._refresh is not None else ("vllm_lora", id(server))

    def generate_mixed(
        self, calls: Sequence[tuple[Any, Sequence[Any]]], params: SamplingParams
    ) -> list[list[Completion]]:
        """interfaces.MixedCalls: one ``llm.generate`` over the requests of several handles,
        each prompt through its handle's adapter with the seeds its own call would draw."""
        key = self.mix_key()
        rows: list[list[int]] = []
        seeds: list[int] = []
        caps: list[int] = []
        loras: list[Any] = []
        index: list[list[int]] = []
        for engine, prompts in calls:
            if not isinstance(engine, VLLMLoraEngine) or engine.mix_key() != key:
                raise TypeError(
                    f"engine vllm_lora of policy {self.policy.name!r} cannot serve the "
                    f"requests of {type(engine).__name__} in its call (another LLM or mode)"
                )
            requests = text_requests(engine, prompts)
            idx = [i for i in range(len(requests)) for _ in range(params.n)]
            rows += [requests[i].prompt for i in idx]
            caps += [requests[i].budget(params) for i in idx]
            seeds += engine._row_seeds(len(idx), params)
            loras += [engine.lora_request] * len(idx)
            index.append(idx)
        outs = self._generate_rows(rows, params, seeds, caps, loras=loras)
        decode, answers, start = self.tokenizer.decode, [], 0
        for idx in index:
            got = outs[start : start + len(idx)]
            prompts = rows[start : start + len(idx)]
            start += len(idx)
            answers.append(
                [
                    Completion(
                        i,
                        Tokens.given(prompt),
                        Tokens.sampled(ids, lps),
                        reason,
                        decode(ids, skip_special_tokens=True),
                    )
                    for i, prompt, (ids, lps, reason) in zip(idx, prompts, got, strict=True)
                ]
            )
        return answers

    def sync(self) -> None:
        """Serve the adapter's current weights: write it, then swap it in under a fresh id."""
        from vllm.lora.request import LoRARequest

        t0 = time.perf_counter()
        out = tempfile.TemporaryDirectory(prefix=f"polyrl-lora-{self.policy.name}-")
        self.policy.save_adapter(out.name)
        lora_id = self.server.fresh_id()
        request = LoRARequest(
            lora_name=f"{self.policy.name}#{lora_id}", lora_int_id=lora_id, lora_path=out.name
        )
        engine = self.server.engine.llm.llm_engine
        self._drop_adapter()  # first, so the cache never exceeds max_loras (no eviction)
        if not engine.add_lora(request):
            raise RuntimeError(f"policy {self.policy.name!r}: vLLM did not load adapter {out.name}")
        self.lora_request, self._dir = request, out
        self.last_sync_s = time.perf_counter() - t0

    def close(self) -> None:
        """Drop this adapter; the last handle to close shuts the shared LLM down."""
        global _SERVER
        server = self.__dict__.get("server")
        if server is None:
            return
        self._drop_adapter()
        del self.server
        server.handles.discard(self.policy.name)
        if not server.handles:
            server.engine.close()
            if _SERVER is server:
                _SERVER = None

    def _drop_adapter(self) -> None:
        """Unload the served adapter (if any) and delete its directory."""
        if self.lora_request is not None:
            self.server.engine.llm.llm_engine.remove_lora(self.lora_request.lora_int_id)
            self.lora_request = None
        if self._dir is not None:
            self._dir.cleanup()
            self._dir = None


ENGINES.register("vllm_lora", VLLMLoraEngine)
