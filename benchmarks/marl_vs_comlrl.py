"""PolyRL's marl plugin vs CoMLRL's MAGRPOTrainer: seconds per step and reward after N steps.

The task both libraries can express: a one-turn, two-agent team. Agents ``a`` and ``b`` are
two separately initialised tiny Qwen2s of the same size (offline, seeds 0 and 1, built like
the other benchmarks' models: they never emit EOS/PAD, so every response has exactly
``max_new_tokens`` tokens in both libraries). Both agents see the same arithmetic prompt
(core/tasks/arithmetic, chat-templated, no role prompt) and each writes a short answer.
Joint reward of the pair = the mean of the two responses' digit shares (``team_reward``): one
number per joint action, credited to both agents, varying within every group.

Matched settings: aligned joint actions (the g-th sample of each agent form joint g), group
size G, P prompts per step, T new tokens, temperature 1, top-p 1, no top-k, AdamW with the
same lr, no KL / reference model, no gradient clipping, fp32. (CoMLRL gets ``top_k=0``: its
``top_k=None`` leaves transformers 5's generate default, top-k 50, in force.) Advantage: per (prompt, agent)
group ``(R - mean) / std`` (PolyRL ``algorithm.advantage=grpo``; CoMLRL ``advantage_mode=mean``
with ``advantage_normalization=True``); loss: -A x (sum of the completion's token log-probs),
averaged over completions (PolyRL ``loss_agg=seq-mean-token-sum`` with ``ppo_clip``, one epoch,
on-policy so the ratio is 1; CoMLRL's REINFORCE-style loss).

What one step is:
- PolyRL: what ``core/loop.py`` runs once: the ``parallel`` marl workflow rolls out P prompts
  (all episodes at once; one ``engine.generate`` per policy for all P x G samples), rewards
  on the P x G joint rows, ``magrpo`` credit, then one optimizer step per policy over its
  P x G rows in one forward/backward (``micro_batch_size = P x G``), then engine sync.
- CoMLRL: ``trainer.train()`` over a dataset of the next P prompts, one epoch, with
  ``rollout_buffer_size = train_batch_size = P``: for each prompt, one HF ``generate`` per
  agent (``num_return_sequences = G``), then, once P prompts are buffered, one optimizer step
  per agent, whose loss runs one forward/backward per completion (P x G per agent).
So both sides do one optimizer step per agent over the same P x G samples per agent.

Each contender runs in its own fresh Python process with the same torch thread count; steps
of the contenders are interleaved round-robin (order rotated every round), warm-up steps
dropped, median seconds per timed step reported. Reward: the mean joint reward of a step's
rollouts (the policy after the previous steps' updates), for every step; "reward after N"
is the mean over the last two of N steps, averaged over seeds (same seeds for both sides).

    .venv/bin/python benchmarks/marl_vs_comlrl.py [--quick] [--seeds 0 1] [--threads N]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as c  # noqa: E402

TARGET = 3.0
POLY, COM = "PolyRL marl (parallel, HF engine)", "CoMLRL MAGRPOTrainer"
REWARD_NAME = "bench_team_digit_share"
AGENTS = ("a", "b")

# ------------------------------------------------------------------------------ task


def digit_share(text: str) -> float:
    return sum(ch.isdigit() for ch in text) / max(1, len(text))


def team_reward(texts: list[str]) -> float:
    """The joint reward: mean digit share of the agents' responses (same for both libraries)."""
    return sum(digit_share(t) for t in texts) / len(texts)


def polyrl_team_reward(sample) -> float:
    """PolyRL reward term: scores a joint-action row from its transcript (one entry per agent)."""
    turns = sample.meta["transcript"]
    if len(turns) != len(AGENTS):
        raise ValueError(
            f"joint row {sample.index}: expected {len(AGENTS)} agent turns, got {len(turns)}"
        )
    return team_reward([t["text"] for t in turns])


def build_agent_model(size: str, seed: int) -> str:
    """A benchmark model of ``size`` initialised with ``seed`` (built once, then cached)."""
    from polyrl.core.demo.tiny import (
        EOS_TOKEN,
        PAD_TOKEN,
        build_tiny_qwen2,
        build_tokenizer,
        is_complete,
    )
    from polyrl.core.tasks import arithmetic

    path = c.CACHE / f"qwen2-{size}-noeos-seed{seed}"
    if is_complete(path):
        return str(path)
    tok = build_tokenizer(arithmetic.corpus(), vocab_size=128)
    model = build_tiny_qwen2(tok, seed=seed, max_position_embeddings=1024, **c.SIZES[size])
    c.forbid_tokens(
        model, [tok.convert_tokens_to_ids(EOS_TOKEN), tok.convert_tokens_to_ids(PAD_TOKEN)]
    )
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


def seed_all(seed: int) -> None:
    import random

    import numpy as np
    import torch

    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


# ------------------------------------------------------------------------------ contenders


class PolyRLMarl:
    """PolyRL: a Session built from a recipe; ``step`` is the body of core/loop.py."""

    def __init__(
        self,
        models: list[str],
        data: str,
        G: int,
        P: int,
        T: int,
        lr: float,
        seed: int,
        total_steps: int,
    ) -> None:
        import polyrl.core  # noqa: F401
        import polyrl.marl  # noqa: F401  (registers the parallel workflow and magrpo credit)
        from polyrl.core.config import load
        from polyrl.core.recipe import Config
        from polyrl.core.registry import load_plugins
        from polyrl.core.rollout.rewards import register_reward
        from polyrl.core.runner.session import Session

        load_plugins()
        register_reward(REWARD_NAME)(polyrl_team_reward)
        self.tmp = tempfile.TemporaryDirectory(prefix="bench-marl-")
        agents = ", ".join(f"{{name: {n}, policy: {n}}}" for n in AGENTS)
        overrides = [
            f"seed={seed}",
            f"run.dir={self.tmp.name}/run",
            "run.progress=false",
            "run.tensorboard=false",
            "run.export=false",
            "run.save_every=0",
            f"data.path={data}",
            "data.shuffle=false",
            "data.max_prompt_tokens=64",
            "rollout.workflow=parallel",
            f"rollout.args={{agents: [{agents}], joint: aligned}}",
            f"rollout.n={G}",
            f"rollout.prompts_per_step={P}",
            f"rollout.max_new_tokens={T}",
            "rollout.temperature=1.0",
            "rollout.top_p=1.0",
            f"reward.terms=[{{name: {REWARD_NAME}}}]",
            "algorithm.credit=magrpo",
            "algorithm.advantage=grpo",
            "algorithm.policy_loss=ppo_clip",
            "algorithm.loss_agg=seq-mean-token-sum",
            "algorithm.kl_coef=0",
            "algorithm.ppo_epochs=1",
            f"train.steps={total_steps}",
        ]
        for name, model in zip(AGENTS, models, strict=True):
            overrides += [
                f"policies.{name}.model={model}",
                f"policies.{name}.optim.lr={lr}",
                f"policies.{name}.optim.max_grad_norm=0",
                f"policies.{name}.engine.name=hf",
                f"policies.{name}.micro_batch_size={P * G}",
            ]
        seed_all(seed)
        self.cfg = load(Config, None, overrides)
        self.s = Session.open(self.cfg)
        row = c.read_rows(data)[0]
        agent = self.s.workflow.agents[AGENTS[0]]
        text, _ = agent.render(row["prompt"])
        ids = agent.tokenizer(text, add_special_tokens=False)["input_ids"]
        self.info = {"first_prompt_ids": ids}

    def step(self) -> dict[str, Any]:
        from polyrl.core.record import select_policy, valid_rows
        from polyrl.core.train.credit import assign

        s = self.s
        t0 = time.perf_counter()
        record = s.workflow.rollout(s.sampler.next_batch(), s.ctx.sampling())
        s.score(record)
        assign(record, self.cfg.algorithm)
        valid = valid_rows(record)
        for name in s.trained:
            s.update(name, select_policy(valid, name))
            s.engines[name].sync()
        step_s = time.perf_counter() - t0
        joint = record["joint_id"] >= 0
        stats = s.workflow.last_stats
        lens = record["response_mask"][~joint].sum(-1).float()
        return {
            "step_s": step_s,
            "reward": float(record["reward"][joint].float().mean()),
            "n_joint": int(joint.sum()),
            "rollout_s": stats.get("marl/rollout_s", float("nan")),
            "generate_calls": sum(
                v for k, v in stats.items() if k.startswith("marl/generate_calls/")
            ),
            "mean_len": float(lens.mean()),
        }

    def close(self) -> None:
        self.tmp.cleanup()


class CoMLRLMarl:
    """CoMLRL: ``MAGRPOTrainer`` with two agent models; ``step`` = ``train()`` over P prompts."""

    def __init__(
        self,
        models: list[str],
        data: str,
        G: int,
        P: int,
        T: int,
        lr: float,
        seed: int,
        total_steps: int,
    ) -> None:
        from comlrl.trainers.reinforce.magrpo import MAGRPOConfig, MAGRPOTrainer
        from datasets import Dataset
        from transformers import AutoModelForCausalLM, AutoTokenizer

        seed_all(seed)
        self.Dataset = Dataset
        self.rows = [{"prompt": r["prompt"]} for r in c.read_rows(data)]
        self.P, self.pos = P, 0
        toks = [AutoTokenizer.from_pretrained(m) for m in models]
        agents = [AutoModelForCausalLM.from_pretrained(m) for m in models]

        def formatter(tok):
            def fmt(item: dict) -> str:  # the same chat-templated text PolyRL's agents get
                return tok.apply_chat_template(
                    [{"role": "user", "content": item["prompt"]}],
                    tokenize=False,
                    add_generation_prompt=True,
                )

            return fmt

        self.fmts = [formatter(t) for t in toks]
        args = MAGRPOConfig(
            num_train_epochs=1,
            agent_learning_rate=lr,
            logging_steps=1,
            num_agents=2,
            num_generations=G,
            max_new_tokens=T,
            temperature=1.0,
            top_p=1.0,
            top_k=0,
            num_turns=1,
            joint_mode="aligned",
            early_termination_threshold=None,
            eval_interval=0,
            eval_num_samples=0,
            rollout_buffer_size=P,
            train_batch_size=P,
            advantage_normalization=True,
            advantage_mode="mean",
            reference_kl_enabled=False,
        )
        self.rewards: list[float] = []
        self.trainer = MAGRPOTrainer(
            agents=agents,
            tokenizer=toks,
            reward_func=self._reward,
            formatters=self.fmts,
            train_dataset=self._next_rows(),
            args=args,
        )
        self.trainer.verbose = False
        self.pos = 0
        ids = toks[0](self.fmts[0]({"prompt": self.rows[0]["prompt"]}))["input_ids"]
        self.info = {"first_prompt_ids": list(ids)}

    def _reward(self, completions_a: list[str], completions_b: list[str]) -> list[float]:
        r = [team_reward([a, b]) for a, b in zip(completions_a, completions_b, strict=True)]
        self.rewards.extend(r)
        return r

    def _next_rows(self):
        rows = [self.rows[(self.pos + k) % len(self.rows)] for k in range(self.P)]
        self.pos += self.P
        return self.Dataset.from_list(rows)

    def step(self) -> dict[str, Any]:
        self.trainer.train_dataset = self._next_rows()
        self.rewards = []
        t0 = time.perf_counter()
        self.trainer.train()
        step_s = time.perf_counter() - t0
        return {
            "step_s": step_s,
            "reward": statistics.fmean(self.rewards),
            "n_joint": len(self.rewards),
            "generate_calls": 2 * self.P,
        }

    def close(self) -> None:
        pass


CONTENDERS = {"polyrl": PolyRLMarl, "comlrl": CoMLRLMarl}

# ------------------------------------------------------------------------------ workers


class Worker:
    """A contender in its own Python process; one JSON command per line, one tagged reply."""

    def __init__(self, name: str, kind: str, kwargs: dict, threads: int) -> None:
        self.name, self.error, self.info = name, None, {}
        env = dict(
            os.environ,
            OMP_NUM_THREADS=str(threads),
            MKL_NUM_THREADS=str(threads),
            TOKENIZERS_PARALLELISM="false",
            WANDB_MODE="disabled",
        )
        fd, self.log_path = tempfile.mkstemp(prefix=f"bench-marl-{kind}-", suffix=".log")
        self.log = os.fdopen(fd, "w")
        spec = json.dumps({"kind": kind, "kwargs": kwargs, "threads": threads})
        self.proc = subprocess.Popen(
            [sys.executable, __file__, "--serve", spec],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.log,
            text=True,
            env=env,
            bufsize=1,
        )
        self._ready = False

    def _read(self) -> dict | None:
        for line in self.proc.stdout:
            if line.startswith(c.RESULT_TAG):
                msg = json.loads(line[len(c.RESULT_TAG) :])
                if "error" in msg:
                    self.error = msg["error"]
                    return None
                return msg
        self.error = f"worker exited ({self.proc.wait()}): " + self._tail()
        return None

    def _tail(self) -> str:
        text = Path(self.log_path).read_text(errors="replace").strip()
        return "\n".join(text.splitlines()[-12:])

    def ready(self) -> None:
        if not self._ready and self.error is None:
            self.info = self._read() or {}
            self._ready = True

    def call(self, op: str) -> dict | None:
        self.ready()
        if self.error is not None:
            return None
        self.proc.stdin.write(json.dumps({"op": op}) + "\n")
        self.proc.stdin.flush()
        return self._read()

    def close(self) -> None:
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


def serve(spec: dict) -> None:
    c.set_threads(spec["threads"])
    try:
        obj = CONTENDERS[spec["kind"]](**spec["kwargs"])
        print(c.RESULT_TAG + json.dumps(obj.info), flush=True)
    except Exception as e:  # noqa: BLE001  (reported to the runner, which prints it)
        traceback.print_exc()
        print(c.RESULT_TAG + json.dumps({"error": f"{type(e).__name__}: {e}"}), flush=True)
        return
    for line in sys.stdin:
        op = json.loads(line)["op"]
        try:
            reply = obj.step() if op == "step" else {}
            if op == "quit":
                obj.close()
        except Exception as e:  # noqa: BLE001
            traceback.print_exc()
            reply = {"error": f"{type(e).__name__}: {e}"}
        print(c.RESULT_TAG + json.dumps(reply), flush=True)
        if op == "quit" or "error" in reply:
            break


# ------------------------------------------------------------------------------ runner


def run_seed(seed: int, kw: dict, threads: int, total: int, warmup: int) -> dict[str, list[dict]]:
    workers = {
        POLY: Worker(POLY, "polyrl", dict(kw, seed=seed), threads),
        COM: Worker(COM, "comlrl", dict(kw, seed=seed), threads),
    }
    try:
        for w in workers.values():
            w.ready()
        for w in workers.values():
            if w.error:
                raise RuntimeError(f"{w.name} failed to start: {w.error}")
        a, b = (workers[n].info["first_prompt_ids"] for n in (POLY, COM))
        if a != b:
            raise RuntimeError(f"the two sides tokenise the first prompt differently: {a} vs {b}")
        out: dict[str, list[dict]] = {n: [] for n in workers}
        names = list(workers)
        for rnd in range(total):
            order = names[rnd % 2 :] + names[: rnd % 2]
            for n in order:
                res = workers[n].call("step")
                if res is None:
                    raise RuntimeError(f"{n} failed at step {rnd + 1}: {workers[n].error}")
                out[n].append(res)
            print(
                f"  seed {seed}: step {rnd + 1}/{total} "
                + ("(warm-up)" if rnd < warmup else "")
                + "  "
                + "  ".join(
                    f"{n.split()[0]} {out[n][-1]['step_s']:.2f}s r={out[n][-1]['reward']:.3f}"
                    for n in names
                ),
                file=sys.stderr,
                flush=True,
            )
        return out
    finally:
        for w in workers.values():
            w.close()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="small smoke run")
    p.add_argument("--threads", type=int, default=None, help="torch threads per contender")
    p.add_argument("--size", default="0.3M", choices=list(c.SIZES))
    p.add_argument("--steps", type=int, default=None, help="N: training steps per contender")
    p.add_argument("--warmup", type=int, default=None, help="steps left out of the timing")
    p.add_argument("--seeds", type=int, nargs="+", default=None)
    p.add_argument("--group", type=int, default=8, help="G: samples per prompt per agent")
    p.add_argument("--prompts", type=int, default=None, help="P: prompts per step")
    p.add_argument("--max-new-tokens", type=int, default=8)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--json", default=None, help="also write all results to this JSON file")
    args = p.parse_args()
    threads, why = c.resolve_threads(args.threads)
    N = args.steps or (10 if args.quick else 30)
    warmup = args.warmup if args.warmup is not None else 1
    seeds = args.seeds or ([0, 1] if args.quick else [0, 1, 2])
    P = args.prompts or 8
    G, T = args.group, args.max_new_tokens
    if warmup >= N or N < 2:
        p.error("--steps must exceed --warmup and be >= 2")

    print(
        f"marl_vs_comlrl: two agents (separate {args.size} Qwen2s), {P} prompts x G={G} "
        f"per step, {T} new tokens, lr {args.lr}, {N} steps, seeds {seeds}\n"
    )
    info = c.print_machine(threads, why)
    from importlib.metadata import version

    print(f"  {'comlrl':>20}: {version('comlrl')}")
    models = [build_agent_model(args.size, s) for s in (0, 1)]
    kw = dict(models=models, data=c.data_file(), G=G, P=P, T=T, lr=args.lr, total_steps=N)
    results: dict = {
        "machine": info,
        "settings": dict(kw, N=N, warmup=warmup, seeds=seeds),
        "seeds": {},
    }
    for seed in seeds:
        print(f"\n[seed {seed}] starting both contenders ...", file=sys.stderr, flush=True)
        results["seeds"][seed] = run_seed(seed, kw, threads, N, warmup)

    rows, summary = [], {}
    for name in (POLY, COM):
        times = [r["step_s"] for s in seeds for r in results["seeds"][s][name][warmup:]]
        first = [results["seeds"][s][name][0]["reward"] for s in seeds]
        last = [
            statistics.fmean(r["reward"] for r in results["seeds"][s][name][-2:]) for s in seeds
        ]
        one = results["seeds"][seeds[0]][name][-1]
        summary[name] = {
            "median_s": statistics.median(times),
            "reward_first": statistics.fmean(first),
            "reward_last": statistics.fmean(last),
            "per_seed_last": last,
        }
        rows.append(
            [
                name,
                statistics.median(times),
                min(times),
                one["generate_calls"],
                one["n_joint"],
                one.get("mean_len", "n/a (=T: no EOS)"),
                statistics.fmean(first),
                statistics.fmean(last),
                " ".join(f"{x:.3f}" for x in last),
            ]
        )
    print()
    print(
        c.table(
            [
                "contender",
                "median s/step",
                "min s/step",
                "generate calls/step",
                "joint actions/step",
                "resp len",
                "reward step 1",
                f"reward after {N}",
                "per seed",
            ],
            rows,
        )
    )
    for s in seeds:
        print(f"\nreward curve, seed {s} (mean joint reward of each step's rollouts):")
        for name in (POLY, COM):
            curve = " ".join(f"{r['reward']:.2f}" for r in results["seeds"][s][name])
            print(f"  {name:<34} {curve}")
    speed = summary[COM]["median_s"] / summary[POLY]["median_s"]
    rp, rc = summary[POLY]["reward_last"], summary[COM]["reward_last"]
    print("\nRatios (measured in this run):")
    print(
        f"  CoMLRL s/step / PolyRL s/step = {speed:.2f}x   target >= {TARGET}x: "
        f"{'MET' if speed >= TARGET else 'NOT MET'}"
    )
    print(
        f"  reward after {N} steps: PolyRL {rp:.3f} vs CoMLRL {rc:.3f} "
        f"(PolyRL / CoMLRL = {rp / rc if rc else float('nan'):.2f}; "
        f"PolyRL - CoMLRL = {rp - rc:+.3f})   equal or better: {'YES' if rp >= rc - 0.02 else 'NO'}"
        " (2-point tolerance)"
    )
    results["summary"] = summary | {"speed_ratio": speed}
    c.write_json(args.json, results)


if __name__ == "__main__" and len(sys.argv) == 3 and sys.argv[1] == "--serve":
    serve(json.loads(sys.argv[2]))
elif __name__ == "__main__":
    main()
