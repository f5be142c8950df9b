"""Fixtures for the agents tests: a tiny grid-world model and a scripted engine."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from polyrl.core.engine import Completion, as_requests


@pytest.fixture(scope="session")
def grid_model_dir(tmp_path_factory) -> str:
    """A tiny Qwen2 + tokenizer trained on the grid-world corpus, built once per session."""
    import polyrl.agents  # noqa: F401  (registers the gridworld task)
    from polyrl.core.tiny import tiny_qwen2

    path = tmp_path_factory.mktemp("models") / "tiny-grid"
    tiny_qwen2(
        path,
        corpus="gridworld",
        vocab_size=128,
        hidden_size=64,
        num_layers=2,
        num_heads=1,
        head_dim=64,
        intermediate_size=256,
        seed=0,
    )
    return str(path)


@pytest.fixture(scope="session")
def grid_tokenizer(grid_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(grid_model_dir)


@dataclass
class ScriptedEngine:
    """An engine that answers from a script, with ids the tokenizer would *not* produce.

    ``script(prompt_text, call_index, row_index) -> (text, stop)``. The text is encoded one
    byte-level symbol per token (never the tokenizer's merges), so re-encoding the decoded
    text would give different ids; ``stop`` appends the eos id. Log-probs are distinct
    per token, so tests can check they land at the right places.
    """

    tokenizer: object
    script: object
    calls: list = field(default_factory=list)  # per call: (prompts, params, completions)

    def char_ids(self, text: str) -> list[int]:
        ids = []
        for piece in self.tokenizer.tokenize(text):  # byte-level symbols, merged
            for ch in piece:  # split every merge back into single symbols
                tid = self.tokenizer.convert_tokens_to_ids(ch)
                assert tid is not None and tid != self.tokenizer.unk_token_id, ch
                ids.append(tid)
        return ids

    def generate(self, prompts, params):
        outs = []
        requests = as_requests(prompts)
        for i, request in enumerate(requests):
            for _ in range(params.n):
                text = self.tokenizer.decode(request.prompt, skip_special_tokens=False)
                answer, stop = self.script(text, len(self.calls), i)
                ids = self.char_ids(answer) + ([self.tokenizer.eos_token_id] if stop else [])
                reason = "stop" if stop else "length"
                if len(ids) > request.budget(params):
                    ids, reason = ids[: request.budget(params)], "length"
                base = -0.001 * (len(self.calls) * 1000 + i * 50)
                logps = [base - 1e-6 * k for k in range(len(ids))]
                outs.append(
                    Completion(
                        i, ids, logps, reason, self.tokenizer.decode(ids, skip_special_tokens=True)
                    )
                )
        self.calls.append(([r.prompt for r in requests], params, outs))
        return outs

    def sync(self):
        return None


@dataclass
class FakePolicy:
    tokenizer: object


@pytest.fixture
def make_workflow(grid_tokenizer):
    """Build a MultiTurn workflow over a ScriptedEngine: make_workflow(script, **args)."""
    from polyrl.agents.workflow import MultiTurn
    from polyrl.core.workflow import Context

    def make(script, **args):
        engine = ScriptedEngine(grid_tokenizer, script)
        ctx = Context(
            cfg=None, policies={"main": FakePolicy(grid_tokenizer)}, engines={"main": engine}
        )
        return MultiTurn(ctx, **args), engine

    return make


@pytest.fixture
def items():
    """PromptItems for a list of task rows."""
    from polyrl.core.data import PromptItem

    def make(rows):
        return [
            PromptItem(
                uid=i,
                prompt_ids=[1],
                prompt_text=str(r.get("prompt", "")),
                answer=r.get("answer"),
                row=r,
            )
            for i, r in enumerate(rows)
        ]

    return make
