"""Tokens per second and model FLOPs utilisation (MFU) of each step, per policy and overall.

Generated tokens are the tokens a row's policy sampled: its response tokens under
``loss_mask`` (a multi-turn row's environment, tool and other agents' tokens spliced into
its response are not generated, though they run forward); trained tokens are the prompt
and response tokens of the valid rows the update runs (not those a zero advantage leaves
out, ``algorithm.skip_zero_advantage``), counted once per PPO epoch (each epoch runs them
forward and backward). ``perf/<policy>/gen_tokens_per_s`` divides by the step's wall time
(what the run delivers, whatever overlaps), ``train_tokens_per_s`` by the policy's update
time.

FLOPs per row follow the usual dense-transformer count (Kaplan et al. 2020; the PaLM
paper's appendix for attention), read off the model's Hugging Face config:

- a forward pass costs ``2 * N`` per token, ``N`` the weights a token multiplies (every
  layer's attention and MLP projections and the LM head; not the embedding lookup; for a
  mixture of experts only the ``num_experts_per_tok`` routed experts, the shared expert
  and the router), plus causal attention: at position ``t`` a layer spends
  ``4 * t * heads * head_dim`` (scores and weighted sum), so a row of ``L`` tokens spends
  ``2 * L * (L + 1) * heads * head_dim`` per layer;
- generating a row costs one forward over it (the KV cache computes each position once);
- training costs three forwards (backward = 2x forward) per epoch, plus one forward over
  every valid row for each of the old and reference log-prob passes the update runs.

A VL policy (``CountsVisionFlops``) adds its vision tower's FLOPs over each row's images
(``polyrl.multimodal.flops``: its patches through the tower's projections, the merger,
attention per image or window): once per row sampled, per epoch as trained (forward and
backward, or the forward alone when the tower takes no gradient), once per old /
reference pass (a VL policy on Ray workers: its language model only, the tower being on
the workers).

A policy whose rows are images (``MakesImages``: diffusion) reports
``perf/<policy>/images`` and ``images_per_s`` (per second of the step) instead of tokens,
and its FLOPs from its own count of a denoising step (e.g. ``polyrl.diffusion.flops``):
every step of a row as sampled, every trained step of the rows the update runs as trained
(once per epoch), and the trained steps of every valid row once per old / reference pass.

MFU = the step's model FLOPs (generation and training) / (step seconds x the device's
peak). The peak is the dense bf16 tensor-core figure for known GPUs (:data:`PEAK_TFLOPS`)
and, on a CPU, a float32 matrix product measured once per process.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from tensordict import TensorDict

from polyrl.core.interfaces import ConfigOnDriver, CountsVisionFlops, MakesImages
from polyrl.core.record import strings

# dense (no sparsity) bf16 tensor-core TFLOP/s per device, from the vendors' data sheets;
# matched against torch.cuda.get_device_name, longest key first
PEAK_TFLOPS: dict[str, float] = {
    "H200": 989.4,
    "H100 PCIe": 756.0,
    "H100": 989.4,
    "A100": 312.0,
    "L40S": 362.0,
    "RTX 4090": 165.2,
    "L4": 121.0,
    "A10G": 70.0,
}


@dataclass(frozen=True)
class ModelFlops:
    """What a forward pass costs per token: matmul weights and attention width."""

    matmul_params: int  # weights a token multiplies (active experts only)
    layers: int
    attn_width: int  # heads * head_dim of the queries

    def forward(self, length: int) -> float:
        """FLOPs of one causal forward over a row of ``length`` tokens."""
        dense = 2.0 * self.matmul_params * length
        attention = 2.0 * self.layers * self.attn_width * length * (length + 1)
        return dense + attention


def model_flops(config: Any) -> ModelFlops | None:
    """The per-token cost of a decoder-only LM from its HF config; None when the config is
    not one (a diffusion model, a value head): such a policy reports tokens/s only."""
    text = getattr(config, "text_config", None) or config  # a VLM: its language model
    need = ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size")
    if not all(isinstance(getattr(text, k, None), int) for k in need):
        return None
    h, layers = text.hidden_size, text.num_hidden_layers
    heads = text.num_attention_heads
    head_dim = getattr(text, "head_dim", None) or h // heads
    kv = getattr(text, "num_key_value_heads", None) or heads
    attn = h * heads * head_dim * 2 + h * kv * head_dim * 2  # q and o; k and v
    experts = getattr(text, "num_experts", None) or getattr(text, "n_routed_experts", None)
    if experts:
        per = 3 * h * text.moe_intermediate_size  # gate, up, down of one expert
        active = text.num_experts_per_tok * per + h * experts  # routed experts, router
        shared = getattr(text, "shared_expert_intermediate_size", None) or 0
        mlp = active + 3 * h * shared
    else:
        mlp = 3 * h * text.intermediate_size  # gated MLP: gate, up, down
    head = h * text.vocab_size
    return ModelFlops(layers * (attn + mlp) + head, layers, heads * head_dim)


@functools.cache
def measured_cpu_peak(size: int = 512, repeats: int = 5) -> float:
    """FLOP/s of the best of a few float32 ``size``-square matrix products on this CPU
    (measured once per process). Constant operands: drawing them would move the run's
    random stream, and a resumed run measures at another point than the run it continues."""
    a, b = torch.full((size, size), 0.5), torch.full((size, size), 0.25)
    a @ b  # warm-up
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - t0)
    return 2.0 * size**3 / best


def device_peak(device: torch.device | str) -> tuple[float, str]:
    """(peak FLOP/s, where the figure comes from) of ``device``; an unknown GPU: NaN."""
    device = torch.device(device)
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        for key in sorted(PEAK_TFLOPS, key=len, reverse=True):
            if key in name:
                return PEAK_TFLOPS[key] * 1e12, f"{name}: {PEAK_TFLOPS[key]} TFLOP/s bf16 dense"
        return float("nan"), f"{name}: not in polyrl.core.observe.throughput.PEAK_TFLOPS"
    return measured_cpu_peak(), "cpu: measured float32 GEMM"


def row_lengths(record: TensorDict) -> tuple[torch.Tensor, torch.Tensor]:
    """(prompt + response tokens, generated tokens) of each row: generated are the response
    tokens the row's policy sampled (``loss_mask``), not those a multi-turn workflow spliced
    in (observations, tool results, other agents' turns)."""
    real = record["response_mask"] != 0
    response = real.sum(-1).long()
    keys = set(record.keys())
    generated = (
        (real & (record["loss_mask"] != 0)).sum(-1).long() if "loss_mask" in keys else response
    )
    prompt = record["prompt_mask"].sum(-1).long() if "prompt_mask" in keys else 0
    return response + prompt, generated


def row_tokens(record: TensorDict) -> list[dict[str, int]]:
    """Each text row's ``prompt_tokens``, ``response_tokens`` and ``generated_tokens`` (what
    a transcript in ``samples/`` shows); a record of other rows (diffusion): empty dicts."""
    if "prompt_mask" not in set(record.keys()):
        return [{} for _ in range(record.batch_size[0])]
    total, generated = row_lengths(record)
    prompt = record["prompt_mask"].sum(-1).long()
    return [
        {"prompt_tokens": int(p), "response_tokens": int(t - p), "generated_tokens": int(g)}
        for p, t, g in zip(prompt.tolist(), total.tolist(), generated.tolist(), strict=True)
    ]


class Throughput:
    """Each step's tokens/s and MFU; the FLOP counts of the policies are read once."""

    def __init__(
        self, policies: Mapping[str, Any], algo: Any, device: Any = None, peak: float | None = None
    ) -> None:
        """``device``: whose peak (None: the GPU if any, else the CPU); ``peak``: FLOP/s to
        use instead of looking it up (a device missing from the table)."""
        self.flops: dict[str, ModelFlops | None] = {}
        self.painters = {n: p for n, p in policies.items() if isinstance(p, MakesImages)}
        self.seers = {n: p for n, p in policies.items() if isinstance(p, CountsVisionFlops)}
        for name, p in policies.items():
            if isinstance(p, ConfigOnDriver):  # Ray: the model is on the workers
                config = p.model_config()
            else:
                config = getattr(getattr(p, "model", None), "config", None)
            self.flops[name] = model_flops(config) if config is not None else None
        # forward passes over a policy's valid rows before its epochs: old log-probs
        # (several epochs or mini-batches) and reference log-probs (KL)
        reuse = algo.ppo_epochs == 1 and algo.minibatches == 1
        self.extra_passes = (0 if reuse else 1) + (algo.kl_coef > 0)
        self.epochs = algo.ppo_epochs
        self.skips_zero = algo.skips_zero_advantage()  # such rows never run forward
        self.device = device
        self.peak = peak

    def _peak(self) -> float:
        if self.peak is None:
            device = self.device or ("cuda" if torch.cuda.is_available() else "cpu")
            self.peak = device_peak(device)[0]
        return self.peak

    def step(
        self, record: TensorDict, step_s: float, update_s: Mapping[str, float]
    ) -> dict[str, float]:
        """``perf/*`` metrics of a step from its record, its wall time and each trained
        policy's update seconds."""
        total, generated = row_lengths(record)
        names = strings(record, "policy")
        valid = record["valid"].bool()
        signal = valid
        if self.skips_zero and "advantages" in record.keys():  # noqa: SIM118 (TensorDict)
            moves = (record["advantages"] != 0) & (record["loss_mask"] != 0)
            signal = valid & moves.any(-1)
        out: dict[str, float] = {}
        gen_all = train_all = images_all = 0
        flops_all, counted, token_update_s = 0.0, True, 0.0
        for name in dict.fromkeys(names):
            if name not in self.flops:  # rows no policy sampled (marl's joint-action rows)
                continue
            rows = [i for i, n in enumerate(names) if n == name]
            mine = [i for i in rows if bool(valid[i])] if name in update_s else []
            # the rows the epochs run (one at least: the optimizer steps on zero gradients)
            run = [i for i in mine if bool(signal[i])] or mine[:1]
            if name in self.painters:
                figures, flops = self._images(name, record, rows, mine, run, step_s, update_s)
                out |= figures
                images_all += len(rows)
                counted = counted and flops is not None
                flops_all += flops or 0.0
                continue
            gen = int(generated[rows].sum())
            trained = int(total[run].sum()) * self.epochs
            key = f"perf/{name}"
            out[f"{key}/gen_tokens"] = float(gen)
            out[f"{key}/gen_tokens_per_s"] = gen / step_s
            gen_all += gen
            if name in update_s:
                out[f"{key}/train_tokens"] = float(trained)
                out[f"{key}/train_tokens_per_s"] = trained / max(update_s[name], 1e-9)
                train_all += trained
                token_update_s += update_s[name]
            cost = self.flops.get(name)
            if cost is None:
                counted = False
                continue
            gen_flops = sum(cost.forward(int(total[i])) for i in rows)
            train_flops = 3 * self.epochs * sum(cost.forward(int(total[i])) for i in run)
            train_flops += self.extra_passes * sum(cost.forward(int(total[i])) for i in mine)
            if name in self.seers:  # a VL model: its vision tower encodes the rows' images
                once, trained_pass = self.seers[name].vision_flops(record)
                gen_flops += float(once[rows].sum())
                train_flops += self.epochs * float(trained_pass[run].sum())
                train_flops += self.extra_passes * float(once[mine].sum())
            flops_all += gen_flops + train_flops
            if name in update_s:
                out[f"{key}/mfu"] = train_flops / (max(update_s[name], 1e-9) * self._peak())
        if len(self.painters) < len(self.flops) or not self.painters:  # token policies
            out["perf/gen_tokens_per_s"] = gen_all / step_s
            if token_update_s:
                out["perf/train_tokens_per_s"] = train_all / max(token_update_s, 1e-9)
        if self.painters:
            out["perf/images_per_s"] = images_all / step_s
        if counted:
            out["perf/tflops"] = flops_all / 1e12
            out["perf/mfu"] = flops_all / (step_s * self._peak())
        return out

    def _images(
        self,
        name: str,
        record: TensorDict,
        rows: list[int],
        mine: list[int],
        run: list[int],
        step_s: float,
        update_s: Mapping[str, float],
    ) -> tuple[dict[str, float], float | None]:
        """An image policy's figures and its FLOPs this step (None: its count is unknown)."""
        key = f"perf/{name}"
        out = {f"{key}/images": float(len(rows)), f"{key}/images_per_s": len(rows) / step_s}
        costs = self.painters[name].step_flops(record)
        if costs is None:
            return out, None
        sample, trained, passes = (c.double().cpu() for c in costs)
        steps = record["response_mask"].sum(-1).double().cpu()  # each row's denoising steps
        learn = record["loss_mask"].sum(-1).double().cpu()  # and those trained
        gen_flops = float((steps[rows] * sample[rows]).sum())
        train_flops = self.epochs * float((learn[run] * trained[run]).sum())
        train_flops += self.extra_passes * float((learn[mine] * passes[mine]).sum())
        if name in update_s:
            out[f"{key}/mfu"] = train_flops / (max(update_s[name], 1e-9) * self._peak())
        return out, gen_flops + train_flops
