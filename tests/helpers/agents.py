"""The agents tests' scripted engine, fake policy and grid-world rows."""

from __future__ import annotations

from dataclasses import dataclass, field

from polyrl.core.rollout.engine import Completion, as_requests
from polyrl.core.segment import Tokens

GRID = ["S.H", "...", "H.G"]  # start top-left, goal bottom-right


def gw_rows(k: int = 2) -> list[dict]:
    """``k`` grid-world task rows (at most 3), each prompt the grid with the agent at the start."""
    from polyrl.agents.gridworld import render

    grids = [GRID, ["S..", ".H.", "..G"], ["G..", ".H.", "..S"]]
    return [{"prompt": render(g, (0, 0)), "grid": g, "answer": "4"} for g in grids[:k]]


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
                        i,
                        Tokens.given(request.prompt),
                        Tokens.sampled(ids, logps),
                        reason,
                        self.tokenizer.decode(ids, skip_special_tokens=True),
                    )
                )
        self.calls.append(([r.prompt for r in requests], params, outs))
        return outs

    def sync(self):
        return None


@dataclass
class FakePolicy:
    tokenizer: object
