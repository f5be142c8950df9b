"""The ``diffusion`` policy kind: a diffusers transformer trained on its own denoising steps.

The policy's "tokens" are denoising steps. ``logprobs(batch)`` recomputes, for every step a
row trains (``loss_mask``), the log-probability of the recorded transition x_t -> x_{t+1}
under the current transformer, with the sampler, σ's, noise level and guidance the record
carries, so the trainer's PPO losses apply unchanged. Computed step by step with the same
batch layout as the rollout, the recomputed log-prob of an unchanged model equals the
rollout's (the test checks it bit for bit).

Classifier-free guidance (SD3, Wan; Qwen-Image's true CFG adds its norm rescale):
``v = v_u + w·(v_c - v_u)`` where the unconditional branch ``v_u`` is computed without
gradient (as Flow-GRPO does). FLUX instead feeds ``w`` to its
guidance embedding: one transformer call per step, no unconditional branch. LoRA adapters
come from PEFT; the reference policy is the same network with the adapter disabled (no
second copy). With a full fine-tune and a KL term the reference is a frozen copy.

KL to the reference: with ``algorithm.kl_estimator: gaussian_mean`` (arXiv 2505.05470) the
policy owns its KL (:class:`polyrl.core.interfaces.OwnsKL`): the trainer stores
:meth:`DiffusionPolicy.reference_terms` (the reference's step means) and gets log-probs and
``mean((μθ - μref)²) / (2·c²)`` per step from one forward of
:meth:`DiffusionPolicy.logprobs_and_kl`. ``c`` is the step's std (``kl_form: step``, the
exact KL of the two Gaussian steps) or Flow-GRPO's ``std_dev_t`` (``kl_form: flow_grpo``:
the SDE's g before the √(-dt) factor, so that KL is the exact one times |dt|; CPS's std). The trainer passes the estimator to every call,
so the same holds in this process and on a Ray worker. With the core's log-prob
estimators (k1, k3, ...) ``ref_logprobs`` gives the reference log-probs of the recorded
transitions, as a text policy does.

Under ``distributed.backend: ray`` the transformer is sharded with FSDP2 over the ranks of
a worker group, and every call of a sharded model is a collective: the ranks agree on the
steps to run (see :meth:`DiffusionPolicy._steps_to_run`), so each calls it equally often.
"""

from __future__ import annotations

import contextlib
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar, Unpack

import torch
import torch.distributed as dist
from tensordict import TensorDict
from torch import Tensor

from polyrl.core.config import ConfigError, doc
from polyrl.core.interfaces import PolicyBuild, PolicyCaps
from polyrl.core.options import Options, bind
from polyrl.core.record import strings
from polyrl.core.registry import POLICIES
from polyrl.core.runner.builds import ensure_model
from polyrl.core.train.policy import (
    CausalLMPolicy,
    LoraConfig,
    PolicyConfig,
    prepare_for_training,
)
from polyrl.diffusion.credit import GAUSSIAN_MEAN, gaussian_mean_kl
from polyrl.diffusion.families import FAMILIES, detect_family
from polyrl.diffusion.flops import sd3_call_flops
from polyrl.diffusion.guards import ratio_scale
from polyrl.diffusion.samplers import get_sampler
from polyrl.diffusion.sampling import sampling_options

# gaussian_mean's divisor: the step's std, or Flow-GRPO's std_dev_t (see DiffusionPolicyOptions)
KL_FORMS = ("step", "flow_grpo")
# A tokenizer without a chat template gets this one: the prompt text itself.
PLAIN_TEMPLATE = (
    "{% for m in messages %}{% if not loop.first %} {% endif %}{{ m['content'] }}{% endfor %}"
)


@dataclass
class DiffusionPolicyOptions(Options):
    """Options of the diffusion policy kind (``policies.<name>.args``)."""

    text_encoder_3: bool = doc(
        True,
        "SD3: load the T5 text encoder (false: zeros instead, much less memory); FLUX needs "
        "its T5, Wan its UMT5, Qwen-Image its Qwen2.5-VL",
    )
    max_sequence_length: int = doc(
        256,
        "T5 tokens per prompt, in [1, 512] (SD3, FLUX; FLUX-dev's pipeline uses 512); "
        "Qwen-Image: text-encoder tokens after its template (longer prompts are cut), the "
        "width every prompt's embedding is padded to",
    )
    kl_form: str = doc(
        "step",
        "gaussian_mean KL's divisor: step (mean((mu - mu_ref)^2) / (2 std^2) with the step's "
        "std: the exact KL of the two Gaussian steps) or flow_grpo (/ (2 c^2) with "
        "Flow-GRPO's std_dev_t c: g = std / sqrt(-dt) for flow_sde and dance_sde, the std "
        "for cps; = step x |dt| for the SDEs, as Flow-GRPO's train_sd3.py kl_loss)",
    )
    ratio_norm: bool = doc(
        False,
        "GRPO-Guard's ratio normalisation: every step's log-prob (recomputed and recorded) "
        "times s (gaussian) or 1/(2s) (neg_mse), s the step's std, so log-ratios have one "
        "scale across steps (diffusion/guards.py); needs kl_estimator gaussian_mean for a KL",
    )
    train_cfg: bool = doc(
        True,
        "false: train without classifier-free guidance (the conditional velocity alone) "
        "while the engine samples with guidance_scale, as Flow-GRPO-Fast and DiffusionNFT",
    )

    def validate(self, where: str) -> None:
        if not 1 <= self.max_sequence_length <= 512:
            raise ConfigError(f"{where}.max_sequence_length must be in [1, 512]")
        if self.kl_form not in KL_FORMS:
            raise ConfigError(
                f"{where}.kl_form={self.kl_form!r} is not a KL form; use one of "
                f"{', '.join(KL_FORMS)}"
            )


def policy_options(cfg: PolicyConfig, name: str | None = None) -> DiffusionPolicyOptions:
    """``cfg.args`` as this kind's typed options (a recipe binds them when it loads; a
    config built in code may still hold a mapping), checked."""
    where = f"policies.{name}.args" if name else "args"
    options = DiffusionPolicyOptions
    if cfg.kind in POLICIES:  # a kind built on this one (diffusion_nft) extends its options
        declared = POLICIES.options(cfg.kind)
        if isinstance(declared, type) and issubclass(declared, DiffusionPolicyOptions):
            options = declared
    args = bind(options, cfg.args, where, "the recipe", f"policy kind {cfg.kind!r}")
    args.validate(where)
    return args


def _device(device: str | torch.device | None) -> torch.device:
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def _data_parallel() -> bool:
    """True on a rank of an FSDP worker group (the Ray backend), where ranks must agree on
    how often they call the sharded model."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


class DiffusionPolicy:
    """A diffusers text-to-image (SD3, FLUX, Qwen-Image) or text-to-video (Wan) model as a
    trainable policy."""

    # LoRA is one PEFT adapter on this policy's own transformer (plain linear layers), so
    # the Ray backend can gather its factors and merge them into the engine's weights.
    caps = PolicyCaps(ray_lora=True)
    # KL estimators this policy computes itself from its step means (core OwnsKL)
    kl_estimators: ClassVar[tuple[str, ...]] = (GAUSSIAN_MEAN,)
    # True: trained on the forward process (DiffusionNFT), not on the sampler's log-probs, so
    # the engine trains the selected steps of any sampler (the ODE too) and records seeds
    forward_process: ClassVar[bool] = False

    def __init__(self, name: str, cfg: PolicyConfig, **build: Unpack[PolicyBuild]) -> None:
        self.name, self.cfg, self.device = name, cfg, _device(build.get("device"))
        need_reference, total_steps = build["need_reference"], build["total_steps"]
        self.args = policy_options(cfg, name)
        # recomputed log-probs follow the engine's convention (engine.args.logprob)
        self.logprob_form = sampling_options(cfg, name).logprob
        path = ensure_model(cfg.model, cfg.build, cfg.build_args)
        self.path = path
        dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[cfg.dtype]
        family = FAMILIES.get(detect_family(path))(
            path,
            dtype=dtype,
            device=self.device,
            load_t5=self.args.text_encoder_3,
            max_sequence_length=self.args.max_sequence_length,
        )
        self.family = family
        self.tokenizer = self.load_tokenizer(cfg, validate=False)
        model = family.transformer
        self.transformer_class = type(model)  # export rebuilds a plain one (see export_weights)
        if cfg.gradient_checkpointing:
            model.enable_gradient_checkpointing()
        self.reference_warmed = False  # a warm start has not moved the reference yet
        targets = list(cfg.lora.target_modules)
        # PolicyConfig.lora's default targets a causal LM: use the family's attention
        # projections instead
        if targets == LoraConfig().target_modules:
            targets = list(family.lora_targets)
        self.need_reference = need_reference
        # LoRA (init_lora_weights default) or a frozen reference copy; the RL optimizer
        self.model, self.reference, self.optimizer, self.scheduler = prepare_for_training(
            model,
            cfg,
            need_reference=need_reference,
            total_steps=total_steps,
            lora_targets=targets,
        )
        self._emb_cache: dict[str, tuple[Tensor, Tensor]] = {}

    @staticmethod
    def load_tokenizer(cfg: PolicyConfig, validate: bool = True):
        """The first text encoder's tokenizer (for the prompt data), after checking this
        kind's options and the engine's -- so a bad sampler name fails before any model is
        built, also for a config built in code."""
        if validate:
            sampling_options(cfg)
            policy_options(cfg)
        path = ensure_model(cfg.model, cfg.build, cfg.build_args)
        tok = FAMILIES.get(detect_family(path)).load_tokenizer(path)
        if not getattr(tok, "chat_template", None):
            tok.chat_template = PLAIN_TEMPLATE  # prompts stay plain text
        return tok

    # --- prompts, velocity, images ------------------------------------------------------
    def encode(self, prompts: list[str]) -> tuple[Tensor, Tensor]:
        """Embeddings of each prompt, each distinct prompt encoded once per run (frozen)."""
        todo = [p for p in dict.fromkeys(prompts) if p not in self._emb_cache]
        if todo:
            emb, pooled = self.family.encode(todo)
            for i, p in enumerate(todo):
                self._emb_cache[p] = (emb[i], pooled[i])
        return (
            torch.stack([self._emb_cache[p][0] for p in prompts]),
            torch.stack([self._emb_cache[p][1] for p in prompts]),
        )

    def velocity(
        self,
        x: Tensor,
        timesteps: Tensor,
        emb: Tensor,
        pooled: Tensor,
        neg_emb: Tensor,
        neg_pooled: Tensor,
        guidance: Tensor,
        model: torch.nn.Module | None = None,
        batched: bool = False,
    ) -> Tensor:
        """The guided velocity (float32); the unconditional branch carries no gradient.

        ``batched`` (sampling only, no gradient): both branches in one transformer call on
        ``[uncond; cond]``, as diffusers' pipeline does; otherwise two calls, so the
        conditional one alone carries the gradient. A family without classifier-free
        guidance (FLUX) gets ``guidance`` as an input and ignores the negative prompt; a
        family's ``rescale_cfg`` (Qwen-Image's: back to the conditional norm) has the last
        word on the guided velocity."""
        model = self.model if model is None else model
        if not self.family.classifier_free:
            return self.family.velocity(model, x, timesteps, emb, pooled, guidance).float()
        guided = guidance > 1
        if not bool(guided.any()):
            return self.family.velocity(model, x, timesteps, emb, pooled).float()
        if batched and not torch.is_grad_enabled():
            both = self.family.velocity(
                model,
                torch.cat([x, x]),
                torch.cat([timesteps] * 2),
                torch.cat([neg_emb, emb]),
                torch.cat([neg_pooled, pooled]),
            ).float()
            v_u, v_c = both.chunk(2)
        else:
            v_c = self.family.velocity(model, x, timesteps, emb, pooled).float()
            with torch.no_grad():
                v_u = self.family.velocity(model, x, timesteps, neg_emb, neg_pooled).float()
        w = guidance.to(v_c).reshape(-1, *([1] * (v_c.dim() - 1)))
        v = self.family.rescale_cfg(v_u + w * (v_c - v_u), v_c)
        return torch.where(guided.reshape_as(w), v, v_c)

    # --- what throughput counts (core MakesImages) --------------------------------------
    def step_flops(self, record: TensorDict) -> tuple[Tensor, Tensor, Tensor] | None:
        """Per row: FLOPs of a denoising step as sampled, as trained and as a log-prob pass
        (``polyrl.diffusion.flops``: SD3 only; other families None, images/s alone)."""
        if self.family.name != "sd3":
            return None
        call = sd3_call_flops(
            self.family.transformer.config,
            tuple(record["latents"].shape[2:]),
            record["prompt_embeds"].shape[1],
        )
        guided = (record["guidance"] > 1).double()  # classifier-free: two calls a step
        passes = call * (1 + guided * self.args.train_cfg)  # the unconditional call as well
        trained = 3 * call + call * guided * self.args.train_cfg  # its backward: none
        return call * (1 + guided), trained, passes

    # --- what the trainer calls ---------------------------------------------------------
    def _transitions(
        self, batch: TensorDict, model: torch.nn.Module | None, want_means: bool
    ) -> tuple[Tensor, Tensor | None, Tensor]:
        """(log-probs [B,T], means [B,T,*L] or None, KL scales [B,T]) of the trained steps;
        the KL scale is the std the KL divides by (``kl_form``)."""
        batch = batch.to(self.device)
        mask = batch["loss_mask"].bool()
        b, n = mask.shape
        lat = batch["latents"]
        samplers = set(strings(batch, "sampler")) if b else set()
        if len(samplers) > 1:
            raise ValueError(f"one micro-batch mixes samplers {sorted(samplers)}")
        sampler = get_sampler(samplers.pop()) if samplers else None
        logp = torch.zeros((b, n), dtype=torch.float32, device=self.device)
        std = torch.zeros((b, n), dtype=torch.float32, device=self.device)
        means = (
            torch.zeros((b, n, *lat.shape[2:]), dtype=torch.float32, device=self.device)
            if want_means
            else None
        )
        run = self._steps_to_run(mask)
        for t in range(n):
            if not bool(run[t]):
                continue
            rows = mask[:, t].nonzero().squeeze(1)
            stand_in = rows.numel() == 0  # another rank trains step t: call the model too
            if stand_in:
                rows = torch.zeros(1, dtype=torch.long, device=self.device)
            guidance = batch["guidance"][rows]
            if not self.args.train_cfg and self.family.classifier_free:
                guidance = torch.ones_like(guidance)  # the conditional velocity alone
            v = self.velocity(
                lat[rows, t],
                batch["timesteps"][rows, t],
                batch["prompt_embeds"][rows],
                batch["pooled_prompt_embeds"][rows],
                batch["negative_prompt_embeds"][rows],
                batch["negative_pooled_prompt_embeds"][rows],
                guidance,
                model=model,
            )
            out = sampler.step(
                lat[rows, t],
                v,
                batch["sigmas"][rows, t],
                batch["sigmas"][rows, t + 1],
                noise_level=batch["noise_level"][rows],
                noise=True,
                prev_sample=lat[rows, t + 1],
                logprob=self.logprob_form,
            )
            if stand_in:  # weight zero, but in the graph: its backward is a collective too
                logp = logp + 0.0 * out.log_prob.sum()
                continue
            cols = torch.full_like(rows, t)
            lp = out.log_prob
            if self.args.ratio_norm:
                lp = lp * ratio_scale(out.std.detach(), self.logprob_form)
            logp = logp.index_put((rows, cols), lp)
            scale = out.std.detach()
            if self.args.kl_form == "flow_grpo":
                scale = sampler.noise_coefficient(
                    scale, batch["sigmas"][rows, t], batch["sigmas"][rows, t + 1]
                )
            std = std.index_put((rows, cols), scale)
            if means is not None:
                means = means.index_put((rows, cols), out.mean)
        return logp, means, std

    def _steps_to_run(self, mask: Tensor) -> Tensor:
        """[N] bool: the steps whose transformer call this micro-batch makes. In one process,
        the steps some row trains. On an FSDP rank, the steps some row of *any* rank trains
        (a rank without such a row runs a stand-in row weighted by zero), and step 0 when no
        rank trains any: each call of the sharded model gathers weights from every rank."""
        active = mask.any(0)
        if not _data_parallel():
            return active
        flags = active.to(torch.int32)
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        if not bool(flags.any()):
            flags[0] = 1  # every rank keeps a graph through the model for backward()
        return flags.bool()

    def _check_estimator(self, estimator: str) -> None:
        if estimator not in self.kl_estimators:
            raise ValueError(
                f"policy {self.name!r} computes the KL estimators {self.kl_estimators}, not "
                f"{estimator!r} (log-prob estimators go through ref_logprobs)"
            )

    def _with_graph(self, logp: Tensor) -> Tensor:
        """``logp``, with a (zero) graph through the trained parameters when no step of the
        micro-batch trains, so backward() still runs (and, under FSDP, its collectives)."""
        if not logp.requires_grad and torch.is_grad_enabled():
            params = [p for p in self.model.parameters() if p.requires_grad]
            if params:
                logp = logp + 0.0 * sum(p.reshape(-1)[0] for p in params)
        return logp

    def logprobs(
        self, batch: TensorDict, temperature: float = 1.0, with_entropy: bool = False
    ) -> tuple[Tensor, Tensor | None]:
        """Log-probs [B, T] of the recorded transitions of the trained steps (0 elsewhere).

        ``temperature`` does not apply to diffusion (the noise level is in the record);
        no entropy is returned.
        """
        logp, _, _ = self._transitions(batch, None, want_means=False)
        return self._with_graph(logp), None

    def logprobs_and_kl(
        self,
        batch: TensorDict,
        temperature: float = 1.0,
        *,
        with_entropy: bool = False,
        estimator: str,
        reference: Tensor,
    ) -> tuple[Tensor, Tensor | None, Tensor]:
        """(log-probs [B,T], None, KL [B,T]) from one forward: the KL of each trained step's
        Gaussian to the reference's, from ``reference`` (:meth:`reference_terms`)."""
        self._check_estimator(estimator)
        logp, means, std = self._transitions(batch, None, want_means=True)
        return self._with_graph(logp), None, gaussian_mean_kl(means, reference, std)

    @torch.no_grad()
    def reference_terms(self, batch: TensorDict, temperature: float, estimator: str) -> Tensor:
        """The reference's step means [B,T,*L] of the trained steps (0 elsewhere)."""
        self._check_estimator(estimator)
        with self._reference() as ref:
            _, means, _ = self._transitions(batch, ref, want_means=True)
        return means

    @contextlib.contextmanager
    def _reference(self):
        if self.reference is not None:
            yield self.reference
        elif self.cfg.lora.r > 0:
            with self.model.disable_adapter():
                yield self.model
        else:
            raise RuntimeError(
                f"policy {self.name!r} has no reference model (it was built "
                "without need_reference and without LoRA)"
            )

    @torch.no_grad()
    def ref_logprobs(self, batch: TensorDict, temperature: float = 1.0) -> Tensor:
        """Reference log-probs [B,T] of the recorded transitions (log-prob KL estimators)."""
        with self._reference() as ref:
            logp, _, _ = self._transitions(batch, ref, want_means=False)
        return logp

    # --- state: the causal-LM policy's, which reads the same name, cfg, model, optimizer
    # and scheduler attributes (a PEFT adapter on ``model`` for LoRA)
    trainable_state = CausalLMPolicy.trainable_state
    load_trainable_state = CausalLMPolicy.load_trainable_state
    state_dict = CausalLMPolicy.state_dict
    load_state_dict = CausalLMPolicy.load_state_dict
    sft_optimizer = CausalLMPolicy.sft_optimizer
    named_weights = CausalLMPolicy.named_weights

    def export(self, out_dir: str | Path) -> Path:
        """diffusers format: a LoRA as ``pytorch_lora_weights.safetensors`` (load it with
        ``pipe.load_lora_weights``), a full fine-tune as the checkpoint folder with the new
        ``transformer/`` (other components copied when the source is a local folder)."""
        return self.export_weights(out_dir, None)

    def export_weights(self, out_dir: str | Path, weights: dict[str, Tensor] | None) -> Path:
        """:meth:`export` from ``weights``, the model's full state dict: the Ray backend's
        rank 0 gathers it from the FSDP shards, since its own module holds only a shard.
        None: this process's (whole) model."""
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        if self.cfg.lora.r > 0:
            self._export_lora(out, weights)
        else:
            self._export_full(out, weights)
        return out

    def _export_lora(self, out: Path, weights: dict[str, Tensor] | None) -> None:
        from peft import get_peft_model_state_dict

        layers = {
            k.removeprefix("base_model.model."): v
            for k, v in get_peft_model_state_dict(self.model, state_dict=weights).items()
        }
        meta = self.model.peft_config["default"].to_dict()  # rank, alpha, targets
        self.family.pipeline_class().save_lora_weights(
            out, transformer_lora_layers=layers, transformer_lora_adapter_metadata=meta
        )

    def _export_full(self, out: Path, weights: dict[str, Tensor] | None) -> None:
        src = Path(self.path).expanduser()
        if src.is_dir():
            for item in src.iterdir():
                if item.name == "transformer":
                    continue
                dst = out / item.name
                if item.is_dir():
                    shutil.copytree(item, dst, dirs_exist_ok=True)
                else:
                    shutil.copy2(item, dst)
        model = self.model
        if weights is not None:  # a plain transformer around the gathered tensors (no copy)
            with torch.device("meta"):
                model = self.transformer_class.from_config(self.model.config)
            model.load_state_dict(weights, assign=True)
        model.save_pretrained(out / "transformer")


POLICIES.register("diffusion", DiffusionPolicy, options=DiffusionPolicyOptions)
