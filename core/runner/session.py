"""Everything a run holds between steps: built once from the recipe, saved and restored.

``Session.open`` checks the run directory before anything slow, prepares task data,
loads data and policies, starts engines, runs the optional SFT warm start and
restores the last checkpoint when resuming.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import json
import math
import random
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from tensordict import TensorDict

from polyrl.core.config import ConfigError, to_dict
from polyrl.core.interfaces import (
    Engine,
    HasSFTRows,
    Learns,
    Policy,
    Stateful,
    UpdatesTogether,
    UpdatesTogetherBackend,
    Workflow,
    WritesTranscriptKeys,
    engine_caps,
)
from polyrl.core.observe.throughput import row_tokens
from polyrl.core.recipe import Config
from polyrl.core.record import select_policy, strings, text_record
from polyrl.core.registry import BACKENDS, DATASETS, POLICIES, TASKS, WORKFLOWS
from polyrl.core.rollout import rewards
from polyrl.core.rollout.data import (
    DataConfig,
    PromptSampler,
    check_paths,
    load_rows,
    task_paths,
    write_jsonl,
)
from polyrl.core.rollout.paint import MemberAlgorithm, paints_images
from polyrl.core.rollout.rollouts import Ahead, InStep, Parts
from polyrl.core.rollout.workflow import Context
from polyrl.core.runner.checkpoint import load_part, policy_part, verify_checkpoint
from polyrl.core.runner.failures import failed_rows
from polyrl.core.runner.run import CKPT_RE, RunDir, rng_state, set_rng_state

if TYPE_CHECKING:
    from polyrl.core.distributed.backend import Backend


def resolve_run_dir(cfg: Config) -> Path:
    return Path(cfg.run.dir.format(name=cfg.run.name, time=time.strftime("%Y%m%d-%H%M%S")))


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


@dataclass(frozen=True)
class DataSources:
    """The data configs a run reads: the recipe's, with the paths a task wrote filled in.
    Derived here, so the config the user wrote stays as written."""

    train: DataConfig
    eval: DataConfig
    sft: DataConfig


def prepare_task(cfg: Config, run_dir: Path) -> DataSources:
    """Let a synthetic task write its data; empty data paths point at what it wrote."""
    sources = DataSources(cfg.data, cfg.eval.data, cfg.sft.data)
    if not cfg.task.name:
        return sources
    task = TASKS.get(cfg.task.name)
    out = Path(cfg.task.dir.format(run_dir=run_dir)).expanduser()
    reads = (
        not cfg.data.path or bool(cfg.sft.steps and not cfg.sft.data.path),
        not cfg.eval.data.path,
    )
    written = task.write_dataset(out, seed=cfg.seed, **cfg.task.args)
    train_path, eval_path = task_paths(cfg.task.name, written, reads)
    sft = cfg.sft.data
    if cfg.sft.steps and not sft.path:
        if not isinstance(task, HasSFTRows):
            raise ConfigError(
                f"sft.steps={cfg.sft.steps} with no sft.data.path, and task "
                f"{cfg.task.name!r} has no sft_rows() to make warm-start rows from; give "
                "sft.data.path"
            )
        sft_path = out / "sft.jsonl"
        write_jsonl(sft_path, task.sft_rows(load_rows(str(train_path))[0]))
        sft = dataclasses.replace(sft, path=str(sft_path), answer_field="response")
    return DataSources(
        dataclasses.replace(cfg.data, path=cfg.data.path or str(train_path)),
        dataclasses.replace(cfg.eval.data, path=cfg.eval.data.path or str(eval_path)),
        sft,
    )


def _part(state: dict[str, Any], key: str, step: int, why: str) -> Any:
    """A checkpoint part the run needs; a checkpoint without it is refused with ``why``."""
    if key not in state:
        raise ValueError(f"checkpoint of step {step} holds no {key} state, but {why}")
    return state[key]


@contextlib.contextmanager
def _freed_on_error(free: list[Callable[[], object]]) -> Iterator[None]:
    """If the block raises, call each of ``free`` (what the failed run holds: its loggers,
    the backend's actors and placement groups), then let the error go on unchanged; a
    failure while freeing is printed, not raised over the run's own error."""
    try:
        yield
    except BaseException:
        for f in free:
            try:
                f()
            except Exception as e:
                print(f"warning: freeing a failed run: {e!r}", file=sys.stderr)
        raise


@dataclass
class Session:
    cfg: Config
    run: RunDir
    backend: Backend
    policies: dict[str, Policy]
    engines: dict[str, Engine]
    ctx: Context
    workflow: Workflow
    sampler: PromptSampler
    eval_items: list
    trained: list[str]
    gen: torch.Generator
    reward_runners: dict  # terms scored on their own actors
    sources: DataSources  # the data configs read (task paths filled in)
    rollouts: InStep | Ahead  # where each step's batch comes from (polyrl.core.rollout.rollouts)
    correction: str  # the rollout-correction level in force for this run's engines
    step: int = 0
    history: dict[str, list] = field(default_factory=dict)

    @classmethod
    def open(cls, cfg: Config, *, record: bool = True) -> Session:
        """``record=False`` opens an existing run to evaluate or export it: its config.yaml,
        metrics and TensorBoard events are left as training wrote them."""
        run_dir = resolve_run_dir(cfg)
        ckpts = run_dir / "checkpoints"
        if (
            not cfg.run.resume
            and ckpts.is_dir()
            and any(CKPT_RE.match(p.name) and (p / "COMPLETE").is_file() for p in ckpts.iterdir())
        ):
            raise ConfigError(
                f"run directory {str(run_dir)!r} already has checkpoints; resume it "
                "(run.resume=true / --resume) or choose another run.dir"
            )
        saved = verify_checkpoint(cfg, run_dir)  # resuming: damaged or mismatched fails now
        run = RunDir(
            run_dir,
            to_dict(cfg) if record else None,
            tensorboard=cfg.run.tensorboard and record,
            loggers=cfg.run.loggers if record else (),
            prometheus_port=cfg.run.prometheus_port if record else None,
        )
        freed: list[Callable[[], object]] = [run.close]  # a failed start frees: the backend too
        with _freed_on_error(freed):
            seed_everything(cfg.seed)
            sources = prepare_task(cfg, run.path)
            named = [("train", sources.train), ("eval", sources.eval)]
            check_paths(named + ([("sft", sources.sft)] if cfg.sft.steps else []))
            # Data before weights: a bad path, row or prompt fails in seconds, before any model
            # loads. The first policy's tokenizer is loaded on its own for this.
            first = next(iter(cfg.policies.values()))
            tokenizer = POLICIES.get(first.kind).load_tokenizer(first)
            dataset = DATASETS.get(sources.train.kind)(sources.train, tokenizer, name="train")
            saved.check_data(len(dataset), sources.train.path)  # the saved data position fits
            eval_items = (
                list(DATASETS.get(sources.eval.kind)(sources.eval, tokenizer, name="eval"))
                if sources.eval.path
                else []
            )
            backend = BACKENDS.get(cfg.distributed.backend)(cfg)
            freed.append(backend.shutdown)
            shared: dict = {}  # lets policy kinds share a base model (one LoRA adapter per agent)
            # the schedule counts optimizer steps: one per minibatch per PPO epoch per RL step
            opt_steps = cfg.train.steps * cfg.algorithm.ppo_epochs * cfg.algorithm.minibatches
            policies = {
                name: backend.make_policy(
                    name,
                    p,
                    total_steps=opt_steps,
                    need_reference=cfg.algorithm.kl_coef > 0,
                    shared=shared,
                )
                for name, p in cfg.policies.items()
            }
            k = cfg.rollout.max_staleness
            # async: the engines generate on their own copy of each trained policy's weights
            versions = (
                {n: backend.versioned(policies[n]) for n in cfg.trained_policies()} if k else {}
            )
            engines = {
                name: backend.make_engine(
                    name,
                    versions[name].engine_policy if name in versions else policies[name],
                    p,
                    seed=cfg.seed + i,
                )
                for i, (name, p) in enumerate(cfg.policies.items())
            }
            sampler = PromptSampler(
                dataset, cfg.rollout.prompts_per_step, cfg.seed, shuffle=cfg.data.shuffle
            )
            ctx = Context(cfg, policies, engines, run_dir=run.path)
            workflow = WORKFLOWS.get(cfg.rollout.workflow)(ctx, **cfg.rollout.args)
            parts = Parts(workflow, engines, sampler, ctx.sampling, cfg.train.steps)
            exact = all(engine_caps(e).exact_logprobs for e in engines.values())
            s = cls(
                cfg,
                run,
                backend,
                policies,
                engines,
                ctx,
                workflow,
                sampler,
                eval_items,
                cfg.trained_policies(),
                torch.Generator().manual_seed(cfg.seed),
                reward_runners=backend.reward_runners(cfg.reward),
                sources=sources,
                rollouts=Ahead(parts, k, versions, cfg.rollout.partial) if k else InStep(parts),
                correction=cfg.algorithm.rollout_correction.resolved(exact, k),
            )
            if record:
                run.log(0, {f"data/{k}": v for k, v in dataset.stats.items()})
            latest = run.load_latest() if cfg.run.resume else None
            if latest is not None:
                print(f"resuming {run.path} from step {latest[0]}", file=sys.stderr)
                s.restore(*latest)
            else:
                if cfg.run.resume:
                    print(
                        f"run.resume: no complete checkpoint in {run.path}; starting a fresh run",
                        file=sys.stderr,
                    )
                if cfg.sft.steps:
                    s.warm_start()
            return s

    # --- SFT warm start -----------------------------------------------------------------
    def warm_start(self) -> None:
        """Supervised steps on prompt -> target rows, through the trainer's machinery."""
        cfg = self.cfg
        before = self.evaluate("eval_init")
        self.run.log(0, before)
        for name in self.trained:
            if paints_images(self.engines[name]):  # a painter's warm start is on images
                continue
            policy = self.policies[name]
            sft = self.sources.sft
            data = DATASETS.get(sft.kind)(sft, policy.tokenizer, name="sft")
            sampler = PromptSampler(data, cfg.sft.batch_size, cfg.seed + 1)
            with policy.sft_optimizer(cfg.sft.lr):
                self._sft(name, policy, sampler)
            self.rollouts.publish(name, 0)  # the warmed-up weights are version 0

    def _sft(self, name: str, policy: Policy, sampler: PromptSampler) -> None:
        tok = policy.tokenizer
        for k in range(self.cfg.sft.steps):
            items = sampler.next_batch()
            targets = [
                tok.encode(str(it.answer), add_special_tokens=False) + [tok.eos_token_id]
                for it in items
            ]
            batch = text_record(
                prompt_ids=[it.prompt_ids for it in items],
                response_ids=targets,
                rollout_logprobs=[[0.0] * len(t) for t in targets],
                policy=[name] * len(items),
                uid=[it.uid for it in items],
                pad_id=tok.pad_token_id,
                # as in a rollout record, so a policy kind can find per-row
                # inputs beyond token ids (a VLM's images) in the row
                meta=[{"answer": it.answer, "row": it.row} for it in items],
            )
            out = self.backend.sft_update(policy, batch)
            if k % 10 == 0 or k == self.cfg.sft.steps - 1:
                self.run.log(0, {f"sft/{name}/loss": out["sft_loss"], "sft/step": k})

    def update(self, name: str, rows: TensorDict) -> dict[str, float]:
        """One policy's RL update from its own rows, wherever the backend runs it, with
        the loss settings the workflow gives its member (``MemberAlgorithm``; else the
        recipe's ``algorithm``)."""
        algo = self.cfg.algorithm
        if isinstance(self.workflow, MemberAlgorithm):
            algo = self.workflow.member_algorithm(name, algo)
        return self.backend.update(
            self.policies[name],
            rows,
            algo,
            temperature=self.cfg.rollout.temperature,
            generator=self.gen,
            correction=self.correction,
        )

    def update_groups(self) -> list[list[str]]:
        """The trained policies in update order, those that update together in one list
        (kinds declaring UpdatesTogether with equal ``update_group()``, on a backend that
        offers ``update_together``), placed where the first of them stands."""
        together = isinstance(self.backend, UpdatesTogetherBackend)
        groups: dict = {}
        for name in self.trained:
            p = self.policies[name]
            key = p.update_group() if together and isinstance(p, UpdatesTogether) else None
            groups.setdefault(name if key is None else ("together", key), []).append(name)
        return list(groups.values())

    def update_group(self, names: list[str], record: TensorDict) -> dict[str, dict[str, float]]:
        """The RL update of the policies ``names`` (one of :meth:`update_groups`) from their
        rows of ``record``: one by one, or together in shared passes. Each one's metrics."""
        if len(names) == 1:
            return {names[0]: self.update(names[0], select_policy(record, names[0]))}
        assert isinstance(self.backend, UpdatesTogetherBackend)  # as update_groups found
        out = self.backend.update_together(
            [self.policies[n] for n in names],
            [select_policy(record, n) for n in names],
            self.cfg.algorithm,
            temperature=self.cfg.rollout.temperature,
            generator=self.gen,
            correction=self.correction,
        )
        return dict(zip(names, out, strict=True))

    def learn(self, record: TensorDict) -> dict[str, float]:
        """Let the workflow fit what it learns itself (e.g. a centralized critic) on the
        credited record; workflows without a ``learn`` method have nothing to fit."""
        return self.workflow.learn(record) if isinstance(self.workflow, Learns) else {}

    def score(self, record: TensorDict) -> dict[str, float]:
        """The reward terms on the record (remote terms on their actors)."""
        return rewards.score(record, self.cfg.reward, runners=self.reward_runners)

    # --- evaluation ---------------------------------------------------------------------
    @torch.no_grad()
    def evaluate(self, tag: str, step: int | None = None) -> dict[str, float]:
        """Greedy (by default) answers on held-out prompts, scored by the reward terms."""
        if not self.eval_items:
            return {}
        cfg = self.cfg
        params = self.ctx.sampling(
            n=cfg.eval.n, temperature=cfg.eval.temperature, max_new_tokens=cfg.eval.max_new_tokens
        )
        # async: the newest weights, the producer paused; eval never moves training RNG
        with self.rollouts.exclusive():
            saved = {n: e.state_dict() for n, e in self.engines.items()}
            record = self.workflow.rollout(self.eval_items, params, phase="eval")
            for n, e in self.engines.items():
                e.load_state_dict(saved[n])
        metrics = self.score(record)
        term = cfg.eval.accuracy_term or cfg.reward.terms[0].name
        values = record.get(f"reward_terms/{term}")
        valid = record["valid"]
        out = {
            f"{tag}/reward": metrics.get("reward/mean", float("nan")),
            f"{tag}/accuracy": float(values[valid].mean()) if bool(valid.any()) else float("nan"),
            f"{tag}/response_len": float(record["response_mask"].sum(-1).float().mean()),
            f"{tag}/errors": float(len(failed_rows(record))),  # workflow and reward errors
        }
        self.run.write_samples(
            self.step if step is None else step, self.transcripts(record, 32), tag=tag
        )
        return out

    # --- logging helpers ----------------------------------------------------------------
    def rollout_stats(self, record: TensorDict, own: dict[str, float]) -> dict[str, float]:
        """The record's lengths and validity, plus what the workflow reported of its rollout
        (``own``, taken when the record was made: an async producer may be further on) and
        the faults the backend survived so far (Ray engine restarts)."""
        lengths = record["response_mask"].sum(-1).float()
        return (
            {
                "rollout/response_len": float(lengths.mean()),
                "rollout/truncated_frac": float(record["truncated"].float().mean()),
                "rollout/valid_frac": float(record["valid"].float().mean()),
                "rollout/rows": float(record.batch_size[0]),
            }
            | own
            | self.backend.fault_metrics()
        )

    def transcripts(self, record: TensorDict, k: int) -> list[dict]:
        if 0 < k < record.batch_size[0]:
            record = record[:k]  # only the rows written out
        cols = {c: strings(record, c) for c in ("policy", "prompt_text", "response_text", "error")}
        meta = strings(record, "meta")
        rewards_ = [float(r) for r in record["reward"]]  # NaN (failed) -> null: valid JSON
        token_counts = row_tokens(record)  # prompt, response and generated tokens
        # a workflow's own row facts
        extra = (
            self.workflow.transcript_keys if isinstance(self.workflow, WritesTranscriptKeys) else ()
        )
        b = min(k, record.batch_size[0])
        return [
            {
                "policy": cols["policy"][i],
                "prompt": cols["prompt_text"][i],
                "response": cols["response_text"][i],
                "answer": meta[i].get("answer"),
                "reward": rewards_[i] if math.isfinite(rewards_[i]) else None,
                "error": cols["error"][i],
                "valid": bool(record["valid"][i]),
                **token_counts[i],
                **{key: meta[i].get(key) for key in extra},
            }
            for i in range(b)
        ]

    def write_samples(self, step: int, record: TensorDict) -> None:
        if self.cfg.run.samples_per_step:
            self.run.write_samples(step, self.transcripts(record, self.cfg.run.samples_per_step))

    # --- checkpoints --------------------------------------------------------------------
    def save(self, step: int) -> None:
        self.step = step
        state: dict[str, Any] = {
            "trainer": {
                "step": step,
                "sampler": self.sampler.state_dict(),
                "rng": rng_state(),
                "gen": self.gen.get_state(),
                "engines": {n: e.state_dict() for n, e in self.engines.items()},
            }
        }
        for name, p in self.policies.items():
            state[f"policy_{name}"] = policy_part(p)
        if isinstance(self.workflow, Stateful):  # e.g. a critic the workflow trains
            state["workflow"] = self.workflow.state_dict()
        if ahead := self.rollouts.state_dict(step):  # async: resume before the batches in flight
            state["rollouts"] = ahead
        self.run.save(step, state, keep=self.cfg.run.keep_checkpoints)

    def restore(self, step: int, state: dict[str, Any]) -> None:
        t = state["trainer"]
        for name, p in self.policies.items():
            load_part(p, state[f"policy_{name}"], name)
            self.engines[name].sync()
        for n, e in self.engines.items():
            e.load_state_dict(t["engines"][n])
        self.sampler.load_state_dict(t["sampler"])
        if isinstance(self.workflow, Stateful):
            workflow = self.cfg.rollout.workflow
            self.workflow.load_state_dict(
                _part(state, "workflow", step, f"workflow {workflow!r} keeps a state")
            )
        set_rng_state(t["rng"])
        self.gen.set_state(t["gen"])
        if isinstance(self.rollouts, Ahead):
            k = self.cfg.rollout.max_staleness
            why = f"it was written with rollout.max_staleness: 0; resume with 0, not {k}"
            self.rollouts.load_state_dict(_part(state, "rollouts", step, why), step)
        self.step = step

    @contextlib.contextmanager
    def freed_on_error(self) -> Iterator[None]:
        """A run that raises frees what it holds before the error goes on, unchanged: the
        loggers closed (a Prometheus port), the backend shut down (Ray: its actors killed,
        its placement groups removed) and the producer told to stop. A process that goes on
        (a notebook, a sweep, a retry with ``--resume``) gets its resources back."""
        with _freed_on_error(
            [self.run.close, self.backend.shutdown, lambda: self.rollouts.close(timeout=10)]
        ):
            yield

    def finish(self, final: dict[str, float], *, export: bool = True) -> None:
        """Close the producer, export (``run.export``, unless the run never trained) and
        plot."""
        from polyrl.core.observe.plot import plot_run

        self.rollouts.close()
        if self.cfg.run.export and export:
            for name, p in self.policies.items():
                p.export(self.run.path / "export" / name)
        if importlib.util.find_spec("matplotlib") is None:  # e.g. an offline GPU image
            print(
                f"plots skipped: matplotlib is not installed; draw them later with "
                f"`polyrl plot {self.run.path}` where it is",
                file=sys.stderr,
            )
        else:
            plot_run(self.run.path)
        (self.run.path / "summary.json").write_text(json.dumps(final, indent=2))
        self.run.close()
        self.backend.shutdown()
