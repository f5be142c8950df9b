"""A centralized critic: the value of a joint state, read from the whole joint transcript.

CTDE's "centralized training" half for PPO-style advantages. Each agent acts on its own
observation (its prompt never changes), but the critic reads the *joint* state in which
the agent acted: the task row's prompt plus every message of the joint actions above the
agent's node, whoever sent them. In the signaling game the listener sees only the message;
the critic sees the target too, so ``V(target, message)`` is how often that message is
understood for that target -- a baseline the listener alone could not compute.

How a step uses it (``rollout.args.critic.model`` set):

1. rollout: the workflow puts each agent row's state text in ``meta["critic_state"]`` and
   the critic's value of it in the record's ``baseline`` column (before any update, so the
   baseline never saw this batch's returns);
2. credit (``magrpo``): an agent row's advantage is ``return - baseline`` (then optional
   per-agent normalisation), and its return goes to the ``returns`` column;
3. ``workflow.learn(record)`` (called by the loop after credit): regress the critic on the
   (state, return) pairs of the valid agent rows, mean squared error, ``epochs`` passes.

The critic is a causal LM's backbone with a scalar head on the last prompt token's hidden
state (head initialised to zero: the first baseline is 0). It trains in the driver process
in local and Ray mode alike; its weights and optimizer are checkpointed with the workflow.
"""

from __future__ import annotations

from typing import Any

import torch

from polyrl.core.runner.builds import ensure_model


class CentralCritic:
    """``V(state text) -> float``: a backbone, a linear head, and their optimizer."""

    def __init__(self, opts: Any, device: str | torch.device = "cpu") -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        path = ensure_model(opts.model, opts.build, opts.build_args)
        self.opts, self.device = opts, torch.device(device)
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        if self.tokenizer.pad_token_id is None:
            raise ValueError(f"critic model {opts.model!r}: its tokenizer has no pad token")
        lm = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        self.backbone = lm.get_decoder().to(self.device)
        self.head = torch.nn.Linear(lm.config.hidden_size, 1).to(self.device)
        torch.nn.init.zeros_(self.head.weight)
        torch.nn.init.zeros_(self.head.bias)
        params = [*self.backbone.parameters(), *self.head.parameters()]
        self.optimizer = torch.optim.AdamW(params, lr=opts.lr)

    def _forward(self, texts: list[str]) -> torch.Tensor:
        enc = self.tokenizer(
            texts, return_tensors="pt", padding=True, padding_side="left", add_special_tokens=False
        ).to(self.device)
        hidden = self.backbone(
            input_ids=enc["input_ids"], attention_mask=enc["attention_mask"]
        ).last_hidden_state
        return self.head(hidden[:, -1]).squeeze(-1)  # left padding: the last token is real

    @torch.no_grad()
    def values(self, texts: list[str]) -> torch.Tensor:
        """Values of ``texts`` (float32, CPU), in micro-batches."""
        self.backbone.train(False)
        mb = self.opts.micro_batch_size
        out = [self._forward(texts[i : i + mb]) for i in range(0, len(texts), mb)]
        return torch.cat(out).float().cpu() if out else torch.zeros(0)

    def fit(
        self,
        texts: list[str],
        returns: torch.Tensor,
        baseline: torch.Tensor | None = None,
        generator: torch.Generator | None = None,
    ) -> dict[str, float]:
        """Regress the values of ``texts`` on ``returns`` (MSE); one optimizer step per
        micro-batch, ``epochs`` shuffled passes. ``baseline``: the values the rollout already
        computed for these texts, reported as the error before the fit (no extra pass)."""
        if not texts:
            return {}
        targets = returns.float().to(self.device)
        self.backbone.train(True)
        params = [p for g in self.optimizer.param_groups for p in g["params"]]
        mb = self.opts.micro_batch_size
        losses = []
        for _ in range(self.opts.epochs):
            order = torch.randperm(len(texts), generator=generator).tolist()
            for i in range(0, len(order), mb):
                idx = order[i : i + mb]
                pred = self._forward([texts[k] for k in idx])
                loss = ((pred - targets[idx]) ** 2).mean()
                loss.backward()
                if self.opts.max_grad_norm:
                    torch.nn.utils.clip_grad_norm_(params, self.opts.max_grad_norm)
                self.optimizer.step()
                self.optimizer.zero_grad(set_to_none=True)
                losses.append(float(loss.detach()) * len(idx))
        self.backbone.train(False)
        out = {
            "critic/fit_mse": sum(losses) / (len(texts) * self.opts.epochs),
            "critic/states": float(len(texts)),
        }
        if baseline is not None:
            out["critic/mse_before"] = float(((baseline.float() - returns.float()) ** 2).mean())
        return out

    def state_dict(self) -> dict[str, Any]:
        return {
            "backbone": {
                k: v.detach().cpu().clone() for k, v in self.backbone.state_dict().items()
            },
            "head": {k: v.detach().cpu().clone() for k, v in self.head.state_dict().items()},
            "optimizer": self.optimizer.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.backbone.load_state_dict(state["backbone"])
        self.head.load_state_dict(state["head"])
        self.optimizer.load_state_dict(state["optimizer"])


def joint_state(task: str, path_lines: list[str], turn: int, agent: str) -> str:
    """The text the critic reads for an agent acting at ``turn``: the task, what every agent
    said in the joint actions above it (one line each), and who acts now."""
    return "\n".join([f"Task: {task}", *path_lines, f"[t{turn} {agent}] acts"])
