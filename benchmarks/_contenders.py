"""The benchmark contenders and the stop plans of ``variable_lengths.py``.

A stop plan gives each response row a length and EOS is forced there, by the same rule in
each engine (HF engine: around its sampler; vLLM: a v1 logits processor; TRL: a
transformers LogitsProcessor). ``CONTENDERS`` maps the kind a runner asks for to its class.
"""

from __future__ import annotations

import os
import tempfile
import time
from typing import Any

from _common import data_file, digit_share, read_rows, register_bench_reward

# ------------------------------------------------------------------------------ stop plans
# A stop plan gives each response row a length: the row's EOS is forced at that length
# (the benchmark models never emit EOS by themselves). Row k of a rollout is
# (prompt k // n, sample k % n), the order every engine here returns.


def stop_plan(
    rows: int, max_new_tokens: int, *, long_frac: float = 0.2, short_max: int = 4, seed: int = 0
) -> list[int]:
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
            hit = [
                i
                for i, (length, out) in self.rows.items()
                if i < logits.shape[0] and len(out) + 1 == length
            ]
            if hit:
                logits[hit] = float("-inf")
                logits[hit, self.EOS] = 0.0
            return logits

    _LP.append(StopPlanLP)
    return StopPlanLP


# ------------------------------------------------------------------------------ rewards

AGREE_PERCENT = 45  # share of prompts whose group agrees under the realistic reward
AGREE_NAME = "bench_agree"


def agrees(answer: Any) -> bool:
    """Whether a prompt's group all gets the same reward (a fixed ~45% of prompts)."""
    import zlib

    return zlib.crc32(str(answer).encode()) % 100 < AGREE_PERCENT


def agree_reward(sample) -> float:
    """The realistic workload's reward, the same function for every contender: 0 for every
    sample of ~45% of the prompts (a group an untrained model gets all wrong, as in math
    and code RL: no signal), ``digit_share`` (varies within the group) for the rest."""
    return 0.0 if agrees(sample.answer) else digit_share(sample)


def register_agree_reward() -> str:
    from polyrl.core.rollout.rewards import register_reward

    register_reward(AGREE_NAME)(agree_reward)
    return AGREE_NAME


REWARDS = {"digits": digit_share, "agree": agree_reward}


def agree_frac(rewards, n: int) -> float:
    """Share of groups (``n`` consecutive rows) whose rewards are all equal."""
    groups = rewards.view(-1, n)
    return float((groups == groups[:, :1]).all(-1).float().mean())


# ------------------------------------------------------------------------------ contenders


def now(device: str) -> float:
    """A timestamp after the device's queued work is done (GPU kernels run asynchronously)."""
    if device.startswith("cuda"):
        import torch

        torch.cuda.synchronize()
    return time.perf_counter()


# A contender is built once (model load, engine start-up) and then steps on request:
# ``step(**overrides) -> {"step_s": ..., ...}``. Runners interleave the contenders' steps
# (round-robin, rotating the order every round) so that a change in machine load hits
# every contender alike, which keeps the ratios meaningful on a shared machine.


class PolyRLStepper:
    """A PolyRL training step assembled from the real components, as core/loop.py runs it:
    SingleTurn rollout (engine.generate + text_record) -> rewards.score -> credit.assign
    -> select_policy -> trainer.update -> engine.sync. ``mode="rollout"``: the rollout only
    (generate + rollout record); ``mode="generate"``: ``engine.generate`` only.
    ``step(n=..., max_new_tokens=...)`` changes the group size / response length."""

    def __init__(
        self,
        model: str,
        engine: str,
        *,
        n: int = 8,
        prompts: int = 16,
        max_new_tokens: int = 64,
        lr: float = 1e-6,
        micro_batch_size: int = 128,
        total_steps: int = 1000,
        seed: int = 0,
        engine_args: dict | None = None,
        stop_plan_args: dict | None = None,
        mode: str = "step",
        device: str = "cpu",
        dtype: str = "float32",
        reward: str = "digits",
        shared_prefix: bool = True,
    ) -> None:
        from types import SimpleNamespace

        import torch

        from polyrl.core.registry import ENGINES
        from polyrl.core.rollout.data import DataConfig, PromptDataset, PromptSampler
        from polyrl.core.rollout.rewards import RewardConfig, RewardTerm
        from polyrl.core.rollout.workflow import Context, SingleTurn
        from polyrl.core.train.algorithms import AlgorithmConfig
        from polyrl.core.train.policy import CausalLMPolicy, OptimConfig, PolicyConfig

        self.n, self.max_new_tokens, self.mode = n, max_new_tokens, mode
        self.policy = CausalLMPolicy(
            "main",
            PolicyConfig(
                model=model,
                micro_batch_size=micro_batch_size,
                optim=OptimConfig(lr=lr),
                dtype=dtype,
                device=device,
                shared_prefix=shared_prefix,
            ),
            total_steps=total_steps,
            need_reference=False,
            device=device,
        )
        self.device = device
        engine_args = dict(engine_args or {})
        if engine == "vllm":
            import polyrl.core.rollout.vllm_engine  # noqa: F401  (registers "vllm")

            if stop_plan_args is not None:
                engine_args["logits_processors"] = [stop_plan_lp()]
        t0 = time.perf_counter()
        self.engine = ENGINES.get(engine)(self.policy, seed=seed, **engine_args)
        startup = time.perf_counter() - t0
        data = PromptDataset(
            DataConfig(path=data_file(), max_prompt_tokens=64, shuffle=False), self.policy.tokenizer
        )
        self.sampler = PromptSampler(data, prompts, seed, shuffle=False)
        rollout = SimpleNamespace(
            n=n, temperature=1.0, top_p=1.0, stop=[], max_new_tokens=max_new_tokens
        )
        self.ctx = Context(
            SimpleNamespace(rollout=rollout), {"main": self.policy}, {"main": self.engine}
        )
        self.workflow = SingleTurn(self.ctx)
        name = register_bench_reward() if reward == "digits" else register_agree_reward()
        self.reward_cfg = RewardConfig(terms=[RewardTerm(name)])
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

            import polyrl.core.rollout.engine as engine_mod

            # Row k of the decode batch is row live[k] of the rollout; the engine may drop
            # finished rows (Cache.batch_select_indices), so follow that to keep the map.
            state: dict = {"step": 0, "plan": [], "live": None}
            original, select = engine_mod.sample_next, Cache.batch_select_indices

            def sample_next(logits, params, gen):
                live = state["live"]
                if live is not None:
                    force_eos_(
                        logits,
                        [state["step"]] * logits.shape[0],
                        [state["plan"][int(r)] for r in live],
                        eos,
                    )
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
                state.update(
                    step=0, plan=self._plan(rows, params.max_new_tokens), live=torch.arange(rows)
                )
                try:
                    return inner(prompts, params)
                finally:
                    state["live"] = None
        else:
            from polyrl.core.rollout.vllm_engine import row_seed

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
        from polyrl.core.record import select_policy, valid_rows
        from polyrl.core.rollout import rewards
        from polyrl.core.train import trainer
        from polyrl.core.train.credit import assign

        n = n or self.n
        max_new_tokens = max_new_tokens or self.max_new_tokens
        if self.mode == "generate":  # the engine alone, no rollout record
            items = self.sampler.next_batch()
            params = self.ctx.sampling(n=n, max_new_tokens=max_new_tokens)
            t0 = time.perf_counter()
            outs = self.engine.generate([it.prompt_ids for it in items], params)
            dt = time.perf_counter() - t0
            lens = [len(o.token_ids) for o in outs]
            return {
                "step_s": dt,
                "tokens": sum(lens),
                "rows": len(lens),
                "mean_len": sum(lens) / len(lens),
            }
        t0 = now(self.device)
        record = self.rollout(n, max_new_tokens)
        t1 = now(self.device)
        out: dict[str, Any] = {"rollout_s": t1 - t0}
        if self.mode == "step":
            rewards.score(record, self.reward_cfg)
            out.update(assign(record, self.algo))
            batch = select_policy(valid_rows(record), "main")
            t2 = now(self.device)
            trainer.update(self.policy, batch, self.algo, temperature=1.0, generator=self.gen)
            t3 = now(self.device)
            self.engine.sync()
            t4 = now(self.device)
            out.update(reward_credit_s=t2 - t1, update_s=t3 - t2, sync_s=t4 - t3)
        out["step_s"] = now(self.device) - t0
        lengths = record["response_mask"].sum(-1)
        if self.mode == "step":
            out["agree_frac"] = agree_frac(record["reward"], n)
        out.update(
            prompt_tokens=int(record["prompt_mask"].sum()),
            tokens=int(lengths.sum()),
            rows=int(lengths.numel()),
            mean_len=float(lengths.float().mean()),
            short_frac=float((lengths <= 4).float().mean()),
        )
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

    def __init__(
        self,
        model: str,
        *,
        n: int = 8,
        prompts: int = 16,
        max_new_tokens: int = 64,
        total_steps: int = 1000,
        gradient_checkpointing: bool = False,
        stop_plan_args: dict | None = None,
        threaded: bool = True,
        device: str = "cpu",
        dtype: str = "float32",
        reward: str = "digits",
        trl_defaults: bool = False,
    ) -> None:
        import logging
        import queue
        import threading

        import datasets
        import torch
        import transformers
        from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
        from trl import GRPOConfig, GRPOTrainer

        from polyrl.core.rollout.rewards import Sample

        transformers.logging.set_verbosity_error()
        logging.getLogger("trl").setLevel(logging.ERROR)
        datasets.disable_progress_bars()
        rows = read_rows(data_file())
        ds = datasets.Dataset.from_list(
            [
                {"prompt": [{"role": "user", "content": r["prompt"]}], "answer": r["answer"]}
                for r in rows
            ]
        )

        score = REWARDS[reward]

        def reward_fn(prompts, completions, answer, **_):  # the function PolyRL scores with
            texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
            return [
                score(Sample(prompt="", response=t, answer=a, meta={}))
                for t, a in zip(texts, answer, strict=True)
            ]

        # What defines the workload (the same for PolyRL); with trl_defaults the rest is
        # TRL's documented defaults (gradient checkpointing on, its loss and clip).
        workload = dict(
            output_dir=tempfile.mkdtemp(prefix="trl-bench-"),
            num_generations=n,
            per_device_train_batch_size=n * prompts,
            gradient_accumulation_steps=1,
            max_completion_length=max_new_tokens,
            use_vllm=False,
            use_cpu=device == "cpu",
            report_to=[],
            logging_strategy="no",
            save_strategy="no",
            bf16=False,  # bf16 runs load bf16 weights, as PolyRL's policy does (no autocast)
            fp16=False,
            max_steps=total_steps + 1,
            shuffle_dataset=False,
            seed=0,
            disable_tqdm=True,
            dataloader_num_workers=0,
            log_completions=False,
        )
        matched = dict(
            beta=0.0,
            num_iterations=1,
            learning_rate=1e-6,
            temperature=1.0,
            top_p=1.0,
            mask_truncated_completions=False,
            max_grad_norm=1.0,
            gradient_checkpointing=gradient_checkpointing,
        )
        cfg = GRPOConfig(**workload, **({} if trl_defaults else matched))
        # max_steps is one past the last timed step: TRL never reaches its end-of-training
        # log, whose print from the training thread once landed on the same stdout line
        # as a step's reply and hid it from the runner (a deadlock at the last round).
        tok = AutoTokenizer.from_pretrained(model)
        net = AutoModelForCausalLM.from_pretrained(model, dtype=getattr(torch, dtype))
        self.trainer = GRPOTrainer(
            model=net, reward_funcs=reward_fn, args=cfg, train_dataset=ds, processing_class=tok
        )
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
                outer.t0 = now(device)

            def on_step_end(self, *a, **k):
                outer.done.put(now(device) - outer.t0)

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
        self.info = {
            "torch_threads": torch.get_num_threads(),
            "gradient_checkpointing": cfg.gradient_checkpointing,
        }

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

    def __init__(
        self,
        model: str,
        *,
        n: int = 8,
        prompts: int = 16,
        max_new_tokens: int = 64,
        kv_cache_gb: float = 0.25,
        max_model_len: int = 256,
    ) -> None:
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        import torch
        from vllm import LLM

        from polyrl.core.rollout.data import DataConfig, PromptDataset, PromptSampler

        self.n, self.max_new_tokens = n, max_new_tokens
        t0 = time.perf_counter()
        self.llm = LLM(
            model=model,
            dtype="float32",
            seed=0,
            max_model_len=max_model_len,
            logprobs_mode="processed_logprobs",
            generation_config="vllm",
            enforce_eager=True,
            kv_cache_memory_bytes=int(kv_cache_gb * 2**30),
        )
        self.tok = self.llm.get_tokenizer()
        self.calls = 0
        self._generate(n, 2)  # first-request warm-up, as PolyRL's engine does at start-up
        self.info = {
            "engine_startup_s": time.perf_counter() - t0,
            "torch_threads": torch.get_num_threads(),
        }
        data = PromptDataset(
            DataConfig(path=data_file(), max_prompt_tokens=64, shuffle=False), self.tok
        )
        self.sampler = PromptSampler(data, prompts, 0, shuffle=False)

    def _generate(self, n: int, max_new_tokens: int, items=None):
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        ids = [list(it.prompt_ids) for it in items] if items else [[self.tok.eos_token_id]]
        reqs = [TokensPrompt(prompt_token_ids=p) for p in ids for _ in range(n)]
        sps = [
            SamplingParams(
                n=1,
                temperature=1.0,
                top_p=1.0,
                max_tokens=max_new_tokens,
                stop_token_ids=[self.tok.eos_token_id],
                logprobs=0,
                seed=self.calls * 1_000_003 + k,
            )
            for k in range(len(reqs))
        ]
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

    def __init__(
        self, model: str, *, n: int = 8, prompts: int = 16, max_new_tokens: int = 64
    ) -> None:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

        from polyrl.core.rollout.data import DataConfig, PromptDataset, PromptSampler

        self.n, self.max_new_tokens = n, max_new_tokens
        self.tok = AutoTokenizer.from_pretrained(model)
        self.net = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
        data = PromptDataset(
            DataConfig(path=data_file(), max_prompt_tokens=64, shuffle=False), self.tok
        )
        self.sampler = PromptSampler(data, prompts, 0, shuffle=False)
        self.gen_cfg = lambda t: GenerationConfig(
            max_new_tokens=t,
            do_sample=True,
            temperature=1.0,
            top_k=0,
            top_p=1.0,
            pad_token_id=self.tok.pad_token_id,
            eos_token_id=[self.tok.eos_token_id],
        )
        self.info = {"torch_threads": torch.get_num_threads()}

    def step(self, n: int | None = None, max_new_tokens: int | None = None) -> dict[str, Any]:
        import torch

        from polyrl.core.record import pad_left

        items = self.sampler.next_batch()
        t0 = time.perf_counter()
        ids, mask = pad_left(
            [it.prompt_ids for it in items for _ in range(n or self.n)], self.tok.pad_token_id
        )
        with torch.no_grad():
            out = self.net.generate(
                input_ids=ids,
                attention_mask=mask,
                generation_config=self.gen_cfg(max_new_tokens or self.max_new_tokens),
            )
        dt = time.perf_counter() - t0
        return {"step_s": dt, "tokens": int(out[:, ids.shape[1] :].numel())}

    def close(self) -> None:
        pass


class UpdateStepper:
    """One RL update over a fixed batch of ``rows`` x (prompt_len + response_len) tokens.

    ``kind="polyrl"``: ``polyrl.core.train.trainer.update`` on a text record (advantages set, as
    after credit assignment). ``kind="bare"``: the floor for the same work in plain PyTorch:
    forward over the same tokens (logits only at response positions), the GRPO token loss
    written inline (token-mean of -A * exp(logp - logp.detach())), backward, clip, AdamW."""

    def __init__(
        self,
        model: str,
        *,
        kind: str,
        rows: int = 128,
        prompt_len: int = 13,
        response_len: int = 64,
        micro_batch_size: int = 128,
    ) -> None:
        import torch

        torch.manual_seed(0)
        self.kind, self.rows, self.mb = kind, rows, micro_batch_size
        self.prompt_len, self.response_len = prompt_len, response_len
        if kind == "polyrl":
            from polyrl.core.record import text_record
            from polyrl.core.train.algorithms import AlgorithmConfig
            from polyrl.core.train.policy import CausalLMPolicy, OptimConfig, PolicyConfig

            self.policy = CausalLMPolicy(
                "main",
                PolicyConfig(
                    model=model, micro_batch_size=micro_batch_size, optim=OptimConfig(lr=1e-6)
                ),
                total_steps=1000,
                need_reference=False,
            )
            vocab = self.policy.model.config.vocab_size
            ids = torch.randint(3, vocab, (rows, prompt_len + response_len))
            self.rec = text_record(
                prompt_ids=ids[:, :prompt_len].tolist(),
                response_ids=ids[:, prompt_len:].tolist(),
                rollout_logprobs=[[0.0] * response_len] * rows,
                policy=["main"] * rows,
                uid=[k // 8 for k in range(rows)],
                pad_id=self.policy.tokenizer.pad_token_id,
            )
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
            from polyrl.core.train import trainer

            trainer.update(self.policy, self.rec, self.algo, temperature=1.0, generator=self.gen)
        else:
            self._bare()
        return {"step_s": time.perf_counter() - t0}

    def _bare(self) -> None:
        import torch

        net, p, r = self.net, self.prompt_len, self.response_len
        net.train()
        for s in range(0, self.rows, self.mb):
            x = self.ids[s : s + self.mb]
            logits = net(input_ids=x, logits_to_keep=r + 1, use_cache=False).logits[:, :-1].float()
            logp = logits.log_softmax(-1).gather(-1, x[:, p:, None]).squeeze(-1)
            ratio = torch.exp(logp - logp.detach())
            loss = -(ratio * self.adv[s : s + self.mb]).sum() / (self.rows * r)
            loss.backward()
        torch.nn.utils.clip_grad_norm_(net.parameters(), 1.0)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        net.eval()

    def close(self) -> None:
        pass


def paint_team_stepper(recipe: str) -> Any:
    """``paint_team.py``'s contender: one of its four recipes (the team or a member alone)."""
    from paint_team import Stepper

    return Stepper(recipe)


CONTENDERS = {
    "paint_team": paint_team_stepper,
    "polyrl": PolyRLStepper,
    "trl": TRLStepper,
    "raw_vllm": RawVLLMStepper,
    "hf_generate": HFGenerateStepper,
    "update": UpdateStepper,
}
