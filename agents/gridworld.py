"""A FrozenLake-like text grid world: walk from the start to the goal without falling in a hole.

The map is rendered as text, one row per line, cells separated by spaces::

    P F H
    F F F
    H F G

``P`` is the player, ``G`` the goal, ``H`` a hole, ``F`` frozen ice (FrozenLake's
letters; letters keep every cell one token, where ``.`` would merge with a line break). The policy answers with one
word per turn: ``up``, ``down``, ``left`` or ``right``. Reaching the goal gives reward 1
and ends the episode (success); stepping into a hole ends it with 0; walking into the edge
leaves the player in place; any other answer is an invalid move: the player stays
(``invalid="stay"``) or, on slippery ice (``invalid="slip"``), slides one cell in a random
direction; either way ``invalid_reward`` is paid. With slipping, a model that has never
seen the game still walks (at random), so RL can start without any warm start. The observation after each move is the new map, which is
also the GiGPO anchor: the same map means the same state.

This module is also the ``gridworld`` task (``TASKS``): ``write_dataset`` writes train and
eval maps (disjoint), ``corpus`` covers every string the game and its prompts use (for
training a tiny tokenizer), and ``sft_rows`` gives a *format-only* warm start: random
states answered with uniformly random moves, which teaches the answer format and nothing
about the task.
"""

from __future__ import annotations

import random
import sys
from collections import deque
from collections.abc import Iterable
from typing import Annotated, Literal

from polyrl.agents.env import Environment, StepResult, register_env
from polyrl.core.registry import TASKS
from polyrl.core.tasks.common import Rows, Split, chat_text, held_out, split_task

MOVES = {"up": (-1, 0), "down": (1, 0), "left": (0, -1), "right": (0, 1)}
ACTIONS = tuple(MOVES)


def parse_grid(
    grid: list[str],
) -> tuple[tuple[int, int], tuple[int, int], set[tuple[int, int]], int, int]:
    """(start, goal, holes, rows, cols) of a map given as strings of S/G/H/. characters."""
    if not grid or not all(isinstance(r, str) for r in grid):
        raise ValueError(f"a grid is a non-empty list of strings, got {grid!r:.80}")
    cols = len(grid[0])
    if any(len(r) != cols for r in grid):
        raise ValueError(f"grid rows differ in length: {grid}")
    start = goal = None
    holes = set()
    for i, row in enumerate(grid):
        for j, c in enumerate(row):
            if c == "S":
                start = (i, j)
            elif c == "G":
                goal = (i, j)
            elif c == "H":
                holes.add((i, j))
            elif c != ".":
                raise ValueError(f"grid cell {c!r} at ({i},{j}) is not one of S, G, H, .")
    if start is None or goal is None:
        raise ValueError(f"grid needs one S (start) and one G (goal): {grid}")
    return start, goal, holes, len(grid), cols


def shortest_path(grid: list[str]) -> int | None:
    """Fewest moves from S to G avoiding holes (None: unreachable)."""
    start, goal, holes, rows, cols = parse_grid(grid)
    seen, queue = {start}, deque([(start, 0)])
    while queue:
        (i, j), d = queue.popleft()
        if (i, j) == goal:
            return d
        for di, dj in MOVES.values():
            n = (i + di, j + dj)
            if 0 <= n[0] < rows and 0 <= n[1] < cols and n not in holes and n not in seen:
                seen.add(n)
                queue.append((n, d + 1))
    return None


HINTS = ("none", "exits", "safe")
Hint = Literal["none", "exits", "safe"]


def moves_from(grid: list[str], pos: tuple[int, int], hint: str) -> list[str]:
    """The moves a hint lists: ``exits`` stay on the map, ``safe`` also avoid holes."""
    _, _, holes, rows, cols = parse_grid(grid)
    out = []
    for name, (di, dj) in MOVES.items():
        i, j = pos[0] + di, pos[1] + dj
        if 0 <= i < rows and 0 <= j < cols and (hint != "safe" or (i, j) not in holes):
            out.append(name)
    return out


def render(grid: list[str], pos: tuple[int, int], hint: str = "none") -> str:
    """The map as the policy sees it: P at ``pos``, ice (and the start) as F.

    With a ``hint`` a last line lists the admissible moves, as text games list their
    exits: ``exits`` names the moves that stay on the map, ``safe`` those that also do
    not step into a hole.
    """
    if hint not in HINTS:
        raise ValueError(f"hint must be one of {HINTS}, got {hint!r}")
    lines = []
    for i, row in enumerate(grid):
        cells = ["P" if (i, j) == pos else ("F" if c in "S." else c) for j, c in enumerate(row)]
        lines.append(" ".join(cells))
    if hint != "none":
        lines.append("moves: " + " ".join(moves_from(grid, pos, hint)))
    return "\n".join(lines)


@register_env("gridworld")
class GridWorld(Environment):
    """One episode on one map; the map comes from the task row's ``grid`` field.

    ``hint`` (none, exits, safe) adds the admissible-moves line; by default the task row's
    ``hint`` field decides, so the dataset and its SFT prompts agree with the env.
    """

    def __init__(
        self,
        invalid_reward: Annotated[float, "reward added for an answer that is not a move"] = 0.0,
        step_reward: Annotated[float, "reward of a move that neither wins nor ends"] = 0.0,
        goal_reward: Annotated[float, "reward for reaching the goal"] = 1.0,
        hint: Annotated[
            Hint | None,
            "admissible-moves line: none, exits (moves that stay on the map), safe (that "
            "also avoid holes); null: the task row's hint field",
        ] = None,
        invalid: Annotated[
            Literal["stay", "slip"],
            "an answer that is not a move: stay in place, or slip one cell at random",
        ] = "stay",
    ) -> None:
        if hint is not None and hint not in HINTS:
            raise ValueError(f"hint must be one of {HINTS}, got {hint!r}")
        if invalid not in ("stay", "slip"):
            raise ValueError(f"invalid must be 'stay' or 'slip', got {invalid!r}")
        self.invalid_reward, self.step_reward, self.goal_reward = (
            invalid_reward,
            step_reward,
            goal_reward,
        )
        self.invalid = invalid
        # Slips draw from the instance's own generator, seeded from the global one (which
        # the session seeds), so runs repeat exactly.
        self.rng = random.Random(random.getrandbits(64))
        self.hint_arg = hint
        self.hint = "none"
        self.grid: list[str] = []
        self.pos = (0, 0)
        self.done = True

    def reset(self, task: dict) -> str:
        if "grid" not in task:
            raise KeyError(f"gridworld needs a 'grid' field in the task row; got {sorted(task)}")
        self.grid = list(task["grid"])
        self.start, self.goal, self.holes, self.rows, self.cols = parse_grid(self.grid)
        self.hint = self.hint_arg or task.get("hint", "none")
        self.pos, self.done = self.start, False
        return self.render()

    def render(self) -> str:
        return render(self.grid, self.pos, self.hint)

    def step(self, action: str) -> StepResult:
        if self.done:
            raise RuntimeError("step() after the episode ended; call reset()")
        move = MOVES.get(action.strip().lower())
        info: dict = {}
        if move is None:
            if self.invalid == "stay":
                return StepResult(self.render(), self.invalid_reward, False, {"invalid": True})
            move = MOVES[self.rng.choice(ACTIONS)]  # slippery ice: an unclear order slides
            info = {"invalid": True, "slipped": True}
        i, j = self.pos[0] + move[0], self.pos[1] + move[1]
        if 0 <= i < self.rows and 0 <= j < self.cols:
            self.pos = (i, j)
        extra = self.invalid_reward if info else 0.0
        if self.pos == self.goal:
            self.done = True
            return StepResult(
                self.render(), self.goal_reward + extra, True, {**info, "success": True}
            )
        if self.pos in self.holes:
            self.done = True
            return StepResult(
                self.render(),
                self.step_reward + extra,
                True,
                {**info, "success": False, "hole": True},
            )
        return StepResult(self.render(), self.step_reward + extra, False, info)


# --------------------------------------------------------------------------- the task


def random_grid(
    rng: random.Random,
    size: int,
    holes: int,
    min_dist: int = 2,
    fixed_start: bool = False,
    fixed_goal: bool = False,
) -> list[str]:
    """A solvable ``size`` x ``size`` map whose shortest path is at least ``min_dist``.

    ``fixed_start`` puts the start in the top-left corner and ``fixed_goal`` the goal in
    the bottom-right one (FrozenLake's layout); otherwise they are drawn at random.
    """
    if size < 2 or holes < 0 or holes > size * size - 2:
        raise ValueError(f"cannot place {holes} holes on a {size}x{size} map")
    cells = [(i, j) for i in range(size) for j in range(size)]
    for _ in range(10_000):
        goal = (size - 1, size - 1) if fixed_goal else rng.choice(cells)
        start = (0, 0) if fixed_start else rng.choice(cells)
        if start == goal:
            continue
        rest = [c for c in cells if c not in (start, goal)]
        hole_set = set(rng.sample(rest, holes))
        grid = [
            "".join(
                "S"
                if (i, j) == start
                else "G"
                if (i, j) == goal
                else "H"
                if (i, j) in hole_set
                else "."
                for j in range(size)
            )
            for i in range(size)
        ]
        d = shortest_path(grid)
        if d is not None and d >= min_dist:
            return grid
    raise ValueError(
        f"no solvable {size}x{size} map with {holes} holes and a path of at least "
        f"{min_dist} moves; lower min_dist or holes"
    )


def make_rows(
    n: int,
    seed: int,
    size: int = 3,
    holes: int = 1,
    min_dist: int = 2,
    fixed_start: bool = False,
    fixed_goal: bool = False,
    hint: str = "none",
    exclude: Iterable[str] = (),
) -> list[dict]:
    """``n`` distinct task rows {prompt, answer, grid, hint, uid}.

    ``answer`` is the shortest path length (for reference; the env scores the episode);
    ``prompt`` is the first observation.
    """
    banned = set(exclude)
    rng = random.Random(seed)
    rows: list[dict] = []
    seen: set[str] = set()
    misses = 0
    while len(rows) < n and misses < 2000:
        grid = random_grid(rng, size, holes, min_dist, fixed_start, fixed_goal)
        uid = "/".join(grid)
        if uid in seen or uid in banned:
            misses += 1
            continue
        seen.add(uid)
        start = parse_grid(grid)[0]
        rows.append(
            {
                "prompt": render(grid, start, hint),
                "answer": str(shortest_path(grid)),
                "grid": grid,
                "hint": hint,
                "uid": uid,
            }
        )
    if len(rows) < n:
        raise ValueError(
            f"only {len(rows)} distinct {size}x{size} maps with {holes} holes "
            f"(min_dist {min_dist}) exist beyond the excluded ones; asked for {n}"
        )
    return rows


@split_task(64, 32, "maps")
def write_dataset(
    split: Split,
    size: Annotated[int, "maps are size x size cells"] = 3,
    holes: Annotated[int, "holes per map"] = 1,
    min_dist: Annotated[int, "fewest moves from start to goal"] = 2,
    fixed_start: Annotated[bool, "start in the top-left corner (else at random)"] = False,
    fixed_goal: Annotated[bool, "goal in the bottom-right corner (else at random)"] = False,
    hint: Annotated[Hint, "admissible-moves line under each map: none, exits or safe"] = "none",
) -> Rows:
    """train.jsonl and eval.jsonl under ``out_dir``; eval maps never appear in train."""
    maps = (size, holes, min_dist, fixed_start, fixed_goal, hint)  # make_rows' parameters
    return held_out(make_rows, split, split.seed + 10_007, *maps)


def random_states(grid: list[str], rng: random.Random, k: int) -> list[tuple[int, int]]:
    """Up to ``k`` non-terminal positions reached by a random walk from the start."""
    start, goal, holes, rows, cols = parse_grid(grid)
    pos, out = start, [start]
    for _ in range(4 * k):
        di, dj = rng.choice(list(MOVES.values()))
        n = (pos[0] + di, pos[1] + dj)
        if 0 <= n[0] < rows and 0 <= n[1] < cols and n not in holes and n != goal:
            pos = n
            out.append(pos)
    return list(dict.fromkeys(out))[:k]


def sft_rows(rows: Iterable[dict], states_per_map: int = 4, seed: int = 0) -> list[dict]:
    """Format-only warm start: random states answered with a uniformly random move (one of
    the listed moves when the rows carry a hint). Nothing about reaching the goal."""
    rng = random.Random(seed)
    out = []
    for row in rows:
        hint = row.get("hint", "none")
        for pos in random_states(row["grid"], rng, states_per_map):
            choices = moves_from(row["grid"], pos, hint) if hint != "none" else list(ACTIONS)
            out.append(
                {
                    "prompt": render(row["grid"], pos, hint),
                    "response": rng.choice(choices or list(ACTIONS)),
                }
            )
    return out


def corpus(sizes: Iterable[int] = (2, 3, 4, 5, 6), maps_per_size: int = 200) -> list[str]:
    """Chat-formatted maps and moves covering every string the game uses."""
    rng = random.Random(0)
    texts = []
    for size in sizes:
        for _ in range(maps_per_size):
            grid = random_grid(rng, size, rng.randint(0, max(0, size - 1)), min_dist=1)
            pos = random_states(grid, rng, 1)[0]
            user = render(grid, pos, rng.choice(HINTS))
            texts.append(chat_text(("user", user), ("assistant", rng.choice(ACTIONS))))
    texts.extend(chat_text((role, "")) for role in ("system", "user", "assistant"))
    return texts


TASKS.register("gridworld", sys.modules[__name__])
