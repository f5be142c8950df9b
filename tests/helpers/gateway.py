"""The gateway tests' spy engine, record lookups, a grid-world agent and recipe.

``HERE`` names this module, so a recipe or workflow can name ``grid_agent`` as
``f"{HERE}:grid_agent"`` (the gateway imports agents by module path)."""

from __future__ import annotations

from pathlib import Path

from polyrl.core.record import strings
from polyrl.core.rollout.engine import as_requests

HERE = "tests.helpers.gateway"
GRID_AGENT = f"{HERE}:grid_agent"


class SpyEngine:
    """The real engine, keeping every (prompt, completion) it served."""

    def __init__(self, engine):
        self.engine, self.log = engine, []

    def generate(self, prompts, params):
        outs = self.engine.generate(prompts, params)
        requests = as_requests(prompts)
        self.log += [(requests[o.prompt_index].prompt, o) for o in outs]
        return outs


def rows(*prompts, **extra):
    """Task rows, one per prompt, each with the ``extra`` fields."""
    return [{"prompt": p, **extra} for p in prompts]


def first(messages, tokenizer):
    """The ids the chat template gives ``messages`` with the generation prompt."""
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return tokenizer.encode(text, add_special_tokens=False)


def by_episode(rec):
    """Episode -> the record rows it wrote, in order."""
    out: dict[int, list[int]] = {}
    for i, m in enumerate(strings(rec, "meta")):
        out.setdefault(m["episode"], []).append(i)
    return out


def ids(rec, key, i):
    """Row ``i``'s prompt ids (unpadded) or its ``key`` ids where the loss mask is set."""
    mask = rec["loss_mask"][i].bool()
    if key == "prompt_ids":
        return rec["prompt_ids"][i][rec["prompt_mask"][i].bool()].tolist()
    return rec[key][i][mask].tolist()


def grid_agent(row, ep):
    """Walks the grid by asking the model for moves; the reward is the share of its
    replies that start with a lowercase letter (dense enough that an untrained model's
    episodes differ, so the batch has a gradient)."""
    client = ep.openai()
    msgs = [{"role": "user", "content": row["prompt"]}]
    named = 0
    for _ in range(2):
        r = client.chat.completions.create(model=ep.model, messages=msgs)
        text = r.choices[0].message.content
        named += text[:1].islower()
        msgs += [{"role": "assistant", "content": text}, {"role": "user", "content": "go on"}]
    return named / 2


def gateway_recipe(tmp_path, agent: str) -> str:
    """The grid-world GiGPO example with its workflow swapped for the gateway."""
    import yaml

    example = Path(__file__).resolve().parents[2] / "examples" / "gridworld_gigpo.yaml"
    recipe = yaml.safe_load(example.read_text())
    recipe["rollout"]["workflow"] = "gateway"
    recipe["rollout"]["args"] = {"agent": agent, "episode_timeout": 60.0}
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe))
    return str(path)


def small_grid(tmp_path, model_dir: str) -> list[str]:
    """Overrides for a quick grid-world run: its own data folder, no warm start, eight
    3x3 training maps, the tiny model ``model_dir`` as it is."""
    return [
        f"task.dir={tmp_path}/data",
        "sft.steps=0",
        "task.args={n_train: 8, n_eval: 4, size: 3, holes: 1, min_dist: 2}",
        f"policies.main.model={model_dir}",
        "policies.main.build=null",
        "policies.main.build_args=null",
    ]


def spied_models(model_dir: str, spy=SpyEngine, names=("main", "checker")):
    """Tiny policies (by default "main" and "checker") on ``model_dir``, each with an HF
    engine wrapped in ``spy`` (it keeps every prompt and completion it served)."""
    from polyrl.core.rollout.engine import HFEngine
    from polyrl.core.train.policy import CausalLMPolicy, PolicyConfig

    policies, engines = {}, {}
    for seed, name in enumerate(names):
        policies[name] = CausalLMPolicy(
            name, PolicyConfig(model=model_dir), total_steps=1, need_reference=False
        )
        engines[name] = spy(HFEngine(policies[name], seed=seed))
    return policies, engines
