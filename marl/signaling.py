"""The Lewis signaling game: the demo task and its workflow (a template for your own).

A *speaker* sees a target object and sends a one-symbol message; a *listener* sees only
the message and ``K`` shuffled candidates (the target among them) and names the target.
Both get the joint reward 1 when the listener is right. The symbols mean nothing at the
start, so success starts near ``1/K``; the two policies must agree on a convention.

The task (registered in ``TASKS`` as ``"signaling"``) writes train/eval episodes with
disjoint (target, candidates) pairs, the corpus the offline tokenizer is trained on, and
format-only SFT rows: the speaker learns to answer with *some* symbol and the listener with
*some* candidate, drawn at random, so the warm start teaches the format and no convention.
"""

from __future__ import annotations

import itertools
import random
import sys
from collections.abc import Iterable
from pathlib import Path

from polyrl.core.registry import RECIPES, TASKS
from polyrl.core.tasks.common import Rows, Split, chat_text, split_task
from polyrl.marl.runtime import workflow

OBJECTS = ("apple", "ball", "cat", "dog", "egg", "fish", "hat", "key")
SYMBOLS = ("Q", "X", "Z", "J", "V", "W", "Y", "R")
SPEAKER_ROLE = "You are the speaker. Send one symbol for the target."
LISTENER_ROLE = "You are the listener. Name the target."


def speaker_prompt(target: str) -> str:
    """What the speaker observes: the target only."""
    return f"Target:\n{target}"


def listener_prompt(message: str, candidates: Iterable[str]) -> str:
    """What the listener observes: the message and the candidates, never the target.

    One word per line: the pre-tokenizer then gives each object and symbol the same token
    here as in an answer (which starts a line too), so naming a candidate is a copy. The
    message comes last, next to where the answer starts: a tiny model reads it more easily.
    """
    return "Candidates:\n{}\nMessage:\n{}".format("\n".join(candidates), message)


def _check(n_objects: int, n_candidates: int, n_symbols: int) -> None:
    if not 2 <= n_objects <= len(OBJECTS):
        raise ValueError(f"n_objects must be in 2..{len(OBJECTS)}, got {n_objects}")
    if not 2 <= n_candidates <= n_objects:
        raise ValueError(f"n_candidates must be in 2..n_objects={n_objects}, got {n_candidates}")
    if not 1 <= n_symbols <= len(SYMBOLS):
        raise ValueError(f"n_symbols must be in 1..{len(SYMBOLS)}, got {n_symbols}")


def episodes(n_objects: int = 6, n_candidates: int = 3) -> list[tuple[str, tuple[str, ...]]]:
    """Every (target, ordered candidates) pair; the target is always a candidate."""
    objs = OBJECTS[:n_objects]
    out = []
    for target in objs:
        others = [o for o in objs if o != target]
        for rest in itertools.combinations(others, n_candidates - 1):
            for order in itertools.permutations((target, *rest)):
                out.append((target, order))
    return out


def make_row(
    target: str, candidates: Iterable[str], symbols: Iterable[str], habits: dict | None = None
) -> dict:
    cands = list(candidates)
    row = {
        "prompt": speaker_prompt(target),
        "target": target,
        "candidates": cands,
        "symbols": list(symbols),
        "answer": target,
        "uid": f"{target}|{','.join(cands)}",
    }
    if habits is not None:
        row["habits"] = habits
    return row


def speaker_habits(rng: random.Random, objects: list[str], symbols: list[str]) -> dict:
    """An arbitrary one-to-one code, target -> favourite symbol, drawn with the task seed.

    It stands in for what a randomly initialised network has: input-dependent preferences
    that mean nothing yet. The listener gets none, so success starts at 1/K and the
    convention exists only once the listener has learned to read the speaker (and the
    speaker has kept to what is read) -- which the swap test checks.
    """
    return dict(zip(objects, rng.sample(symbols, len(objects)), strict=True))


@split_task(2000, 100, "episodes")
def write_dataset(
    split: Split,
    n_objects: int = 4,
    n_candidates: int = 4,
    n_symbols: int = 6,
    speaker_bias: float = 0.75,
) -> Rows:
    """train.jsonl and eval.jsonl: eval episodes are distinct and never appear in train.

    Train rows are drawn with replacement from the remaining episodes (``n_train`` rows).
    ``speaker_bias``: the share of the speaker's warm-start rows that follow its arbitrary
    code (:func:`speaker_habits`); the rest name a uniformly random symbol. 0: a
    target-blind speaker, which RL must first break symmetry for (slow for tiny models).
    """
    _check(n_objects, n_candidates, n_symbols)
    if not 0.0 <= speaker_bias <= 1.0:
        raise ValueError(f"speaker_bias must be in [0, 1], got {speaker_bias}")
    if n_symbols < n_objects:
        raise ValueError(f"n_symbols={n_symbols} < n_objects={n_objects}: no one-to-one code")
    pool = episodes(n_objects, n_candidates)
    if split.n_eval >= len(pool):
        raise ValueError(
            f"n_eval={split.n_eval} leaves no training episodes (only {len(pool)} exist)"
        )
    rng = random.Random(split.seed)
    rng.shuffle(pool)
    symbols = list(SYMBOLS[:n_symbols])
    code = speaker_habits(rng, list(OBJECTS[:n_objects]), symbols)
    held_out, train = pool[: split.n_eval], pool[split.n_eval :]
    eval_rows = [make_row(t, c, symbols) for t, c in held_out]
    train_rows = []
    for _ in range(split.n_train):
        t, c = train[rng.randrange(len(train))]
        train_rows.append(make_row(t, c, symbols, {"symbol": code[t], "bias": speaker_bias}))
    return train_rows, eval_rows


def sft_rows(rows: Iterable[dict]) -> list[dict]:
    """Format-only warm-start rows for both roles (chat prompts with the default roles).

    The speaker answers its target with its habitual symbol (a ``bias`` share of rows) or
    any symbol; the listener answers a random message with a uniformly random candidate:
    the warm start teaches what an answer looks like and no shared convention. Every
    trained policy sees both roles' rows (the role prompts tell them apart).
    """
    out = []
    for i, row in enumerate(rows):
        rng = random.Random(f"{row['uid']}#{i}")
        symbols, cands = row["symbols"], row["candidates"]
        habit = row.get("habits") or {}
        speaks = habit.get("symbol") if rng.random() < habit.get("bias", 0.0) else None
        out.append(
            {
                "prompt": [
                    {"role": "system", "content": SPEAKER_ROLE},
                    {"role": "user", "content": speaker_prompt(row["target"])},
                ],
                "response": speaks or rng.choice(symbols),
            }
        )
        out.append(
            {
                "prompt": [
                    {"role": "system", "content": LISTENER_ROLE},
                    {"role": "user", "content": listener_prompt(rng.choice(symbols), cands)},
                ],
                "response": rng.choice(cands),
            }
        )
    return out


def corpus() -> list[str]:
    """Every string the game produces, in chat form, for the offline tokenizer."""
    texts = []
    rng = random.Random(0)
    for target in OBJECTS:
        for sym in SYMBOLS:
            speaker = (("system", SPEAKER_ROLE), ("user", speaker_prompt(target)))
            texts.append(chat_text(*speaker, ("assistant", sym)))
            cands = rng.sample(OBJECTS, 4)
            listener = (("system", LISTENER_ROLE), ("user", listener_prompt(sym, cands)))
            texts.append(chat_text(*listener, ("assistant", target)))
    return texts


TASKS.register("signaling", sys.modules[__name__])
# The README's main demo: `polyrl train signaling` (the recipe ships inside the package).
RECIPES.register("signaling", Path(__file__).parent / "recipes" / "signaling_magrpo.yaml")


@workflow("signaling", agents={"speaker": SPEAKER_ROLE, "listener": LISTENER_ROLE}, multi_turn=True)
async def signaling(ep, team):
    """Speaker -> listener. CTDE: the speaker's context holds the target only; the listener's
    holds the candidates and the message, passed explicitly here. The listener's answer is
    what the recipe's reward terms (e.g. ``exact_match``) score against the target.

    ``rollout.args.tree: true`` (the demo): each of the G messages is a turn-0 joint action
    without a reward of its own, and the listener answers it G times as its turn-1
    children. The listener's groups are then per message (G answers to the same input),
    and a message's return is the mean success of the answers it got (``algorithm.gamma``
    1): the speaker is credited with how decodable its message is. Otherwise aligned: the
    g-th message gets one answer, joint g.
    """
    row = ep.row
    messages = await team["speaker"].act(speaker_prompt(row["target"]), n=ep.G)
    if ep.tree:
        answers = await ep.gather(
            team["listener"].act(listener_prompt(m.text.strip(), row["candidates"]), n=ep.G)
            for m in messages
        )
        for m, group in zip(messages, answers, strict=True):
            said = ep.joint([m], final=m.text.strip(), score=False)
            for a in group:
                ep.joint([a], final=a.text.strip(), parent=said)
        return
    answers = await ep.gather(
        team["listener"].act(listener_prompt(m.text.strip(), row["candidates"])) for m in messages
    )
    for m, a in zip(messages, answers, strict=True):
        ep.joint([m, a], final=a.text.strip())
