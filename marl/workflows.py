"""Built-in multi-agent workflows; each is a short template to copy for your own.

All take the recipe's agents in the order ``rollout.args.agents`` lists them, sample
``ep.G`` (``rollout.n``) lines per prompt, and declare one joint action per line (or per
combination, in cross mode) whose ``final`` text the recipe's reward terms score.

- ``parallel``: every agent answers the task at once, blind to the others.
- ``chain``: agents in order; each sees ``template`` filled with the task and the previous
  agent's output text.
- ``debate`` (multi-turn, ``tree``): N agents x R rounds; from round 2 each sees the others' last answers.
  One joint action per round (per-turn rewards), final = majority answer.
- ``aggregator``: mixture of agents; the proposers answer, the aggregator combines.
- ``look_and_answer``: a looker sees the row's image(s) and writes a message; a solver
  reads only that message and answers (the looker's policy must take image turns).
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Annotated, Any, Literal

from polyrl.core.rollout.rewards import extract_answer, normalize_answer
from polyrl.marl.runtime import workflow


def _task(ep) -> str:
    return ep.task if isinstance(ep.task, str) else str(ep.task)


def majority(texts: list[str]) -> str:
    """The most common extracted answer (ties: the earliest)."""
    answers = [normalize_answer(extract_answer(t)) for t in texts]
    counts = Counter(answers)
    best = max(counts.values())
    return next(a for a in answers if counts[a] == best)


@workflow("parallel", joints=("aligned", "cross"))
async def parallel(
    ep,
    team,
    final: Annotated[
        Literal["concat", "vote", "last"],
        "the joint action's output: concat (the agents' texts joined by separator), "
        "vote (the majority extracted answer) or last (the last agent's text)",
    ] = "concat",
    separator: Annotated[str, "what joins the agents' texts when final is concat"] = "\n",
):
    """Every agent answers the task independently (n=G each); joint actions are aligned or
    the cross product."""
    names = list(team)
    samples = await ep.gather(team[n].act(_task(ep), n=ep.G) for n in names)

    def combine(msgs):
        texts = [m.text for m in msgs]
        if final == "vote":
            return majority(texts)
        return texts[-1] if final == "last" else separator.join(texts)

    ep.combine(samples, combine)


@workflow("chain")
async def chain(
    ep,
    team,
    template: Annotated[
        str,
        "what each agent after the first sees: {task} is the row's prompt (as the first "
        "agent saw it), {previous} the previous agent's output text only (not its prompt "
        "or role); leave {task} out when later agents must not see it (a relay)",
    ] = "{task}\n\n{previous}",
):
    """Agents in order: the first samples G lines, each next agent continues each line
    once, seeing what ``template`` shows it. Final: the last output.

    Whatever the previous agent wrote reaches the next one verbatim (secrets included);
    the default template also repeats the task, so every agent sees the first one's
    prompt. A relay game that hides the task from later agents uses ``template:
    "{previous}"``."""
    names = list(team)
    lines = [[m] for m in await team[names[0]].act(_task(ep), n=ep.G)]
    for name in names[1:]:
        nxt = await ep.gather(
            team[name].act(template.format(task=_task(ep), previous=line[-1].text))
            for line in lines
        )
        for line, m in zip(lines, nxt, strict=True):
            line.append(m)
    for line in lines:
        ep.joint(line, final=line[-1].text)


@workflow("debate", min_agents=2, multi_turn=True)
async def debate(
    ep,
    team,
    rounds: Annotated[int, "debate rounds (>= 1); each round is one scored joint action"] = 2,
    template: Annotated[
        str,
        "what an agent sees from round 2: {task} the row's prompt, {others} the other "
        "agents' previous answers in its line, one '- name: answer' line each",
    ] = "{task}\n\nOther answers:\n{others}\n\nYour answer:",
):
    """N agents x R rounds. Round 1: each answers alone (G aligned lines). Later rounds:
    each agent sees the others' previous answers in its line. Every round is a joint action
    (scored: per-turn rewards) whose final text is the majority answer; the next round's
    joint is its child, so returns are r_t + gamma * R_{t+1}. With ``tree: true`` every
    line branches into G children per round (G^R leaves)."""
    if rounds < 1:
        raise ValueError(f"debate: rounds must be >= 1, got {rounds}")
    names = list(team)
    first = await ep.gather(team[n].act(_task(ep), n=ep.G) for n in names)
    frontier = ep.combine(first, lambda msgs: majority([m.text for m in msgs]))
    width = ep.G if ep.tree else 1

    async def next_round(parent):
        prev = {m.agent: m.text for m in parent.messages}

        def prompt(me):
            others = "\n".join(f"- {a}: {t.strip()}" for a, t in prev.items() if a != me)
            return template.format(task=_task(ep), others=others)

        acts = await ep.gather(team[n].act(prompt(n), n=width) for n in names)
        return ep.combine(acts, lambda msgs: majority([m.text for m in msgs]), parent=parent)

    for _ in range(rounds - 1):  # all lines of a round at once: one generate per policy
        frontier = [j for js in await ep.gather(next_round(p) for p in frontier) for j in js]


@workflow("aggregator", min_agents=2)
async def aggregator(
    ep,
    team,
    aggregator: Annotated[
        str, "the agent that combines the proposals (its name); empty: the last agent"
    ] = "",
    template: Annotated[
        str,
        "what the aggregator sees: {task} the row's prompt, {proposals} the other agents' "
        "answers in its line, one '- name: answer' line each",
    ] = "{task}\n\nProposals:\n{proposals}\n\nCombined answer:",
):
    """Mixture of agents: every proposer answers (G aligned lines); the aggregator reads
    each line's proposals and writes the final answer."""
    names = list(team)
    agg = aggregator or names[-1]
    if agg not in team:
        raise ValueError(f"aggregator: no agent {agg!r}; agents are {names}")
    proposers = [n for n in names if n != agg]
    props = await ep.gather(team[n].act(_task(ep), n=ep.G) for n in proposers)
    lines = list(zip(*props, strict=True))
    finals = await ep.gather(
        team[agg].act(
            template.format(
                task=_task(ep), proposals="\n".join(f"- {m.agent}: {m.text.strip()}" for m in line)
            )
        )
        for line in lines
    )
    for line, f in zip(lines, finals, strict=True):
        ep.joint([*line, f], final=f.text)


def row_images(row: dict, field: str, root: str) -> list[Any]:
    """The row's images: PIL images as they are, paths (relative ones under ``root``) opened."""
    from PIL import Image

    if field not in row:
        raise KeyError(
            f"look_and_answer: the row has no field {field!r} (rollout.args.image_field); "
            f"its fields: {', '.join(map(str, row))}"
        )
    values = row[field] if isinstance(row[field], list) else [row[field]]
    out = []
    for v in values:
        if isinstance(v, Image.Image):
            out.append(v)
            continue
        if not isinstance(v, str):
            raise TypeError(
                f"look_and_answer: row field {field!r} holds a {type(v).__name__}; "
                "give image paths or PIL images"
            )
        path = Path(v).expanduser()
        if not path.is_absolute():
            path = Path(root).expanduser() / path
        if not path.is_file():
            raise FileNotFoundError(
                f"look_and_answer: image {str(path)!r} (row field {field!r}) does not exist; "
                "set rollout.args.image_root to the directory its paths are relative to"
            )
        with Image.open(path) as img:
            img.load()
            out.append(img)
    return out


LOOKER_ROLE = "Say what you see in one word."
SOLVER_ROLE = "Answer in one word."


@workflow("look_and_answer", agents={"looker": LOOKER_ROLE, "solver": SOLVER_ROLE})
async def look_and_answer(
    ep,
    team,
    image_field: Annotated[str, "row field holding the image(s): a path, or a list of them"] = (
        "images"
    ),
    image_root: Annotated[
        str, "directory relative image paths are read from (empty: the working directory)"
    ] = "",
    marker: Annotated[str, "text of the task that stands for an image; removed"] = "<image>",
    template: Annotated[
        str,
        "what the solver sees: {message} the looker's text, {task} the row's prompt "
        "(without the image markers); leave {task} out for a pure relay",
    ] = "{task}\nThe looker says: {message}",
):
    """Looker -> solver: the looker sees the row's images and its prompt (G samples); each
    solver act reads one look's text only (never the image). Final: the solver's text."""
    images = row_images(ep.row, image_field, image_root)
    task = _task(ep).replace(marker, "").strip()
    looks = await team["looker"].act([*images, task], n=ep.G)
    answers = await ep.gather(
        team["solver"].act(template.format(task=task, message=m.text.strip())) for m in looks
    )
    for look, answer in zip(looks, answers, strict=True):
        ep.joint([look, answer], final=answer.text)
