"""Fixtures for the agents tests: a tiny grid-world model and a scripted engine."""

from __future__ import annotations

import pytest

from tests.helpers.agents import FakePolicy, ScriptedEngine


@pytest.fixture(scope="session")
def grid_model_dir(tmp_path_factory) -> str:
    """A tiny Qwen2 + tokenizer trained on the grid-world corpus, built once per session."""
    from tests.helpers.models import GRIDWORLD, tiny_text_model

    return tiny_text_model(tmp_path_factory, "tiny-grid", GRIDWORLD, plugin="polyrl.agents")


@pytest.fixture(scope="session")
def grid_tokenizer(grid_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(grid_model_dir)


@pytest.fixture
def make_workflow(grid_tokenizer):
    """Build a MultiTurn workflow over a ScriptedEngine: make_workflow(script, **args)."""
    from polyrl.agents.workflow import MultiTurn
    from polyrl.core.rollout.workflow import Context

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
    from polyrl.core.rollout.data import PromptItem

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
