"""The multi-turn workflow: many episodes against environments, batched into engine calls.

Every step, each dataset row (a task) starts ``rollout.n`` episodes, each with its own
environment instance. With ``schedule: round`` episodes advance in rounds: one
engine call samples the next action of *every* active episode at once, then
all environments step concurrently (async environments are awaited together; sync ones run
inline or on a thread pool). With ``schedule: episode`` each episode goes back to the engine
when its own step is done (:class:`~polyrl.core.rollout.batching.Batcher`).
An episode ends when its environment says done, at the turn limit, or when its token
budget runs out (the last two mark it ``truncated``).

The record keeps the exact ids the engine sampled. Environment text is encoded on its own
(:class:`~polyrl.agents.chat.ChatFormat`) and spliced in with ``loss_mask`` 0. Two row
layouts, chosen per recipe with ``mode``:

- ``concat``: one row per episode: the first prompt, then action, environment reply,
  action, ... as the response (replies masked out of the loss). ``turn`` is 0.
- ``step``: one row per turn: the prompt is the conversation with at most ``history``
  earlier turns (0: only the current observation), the response is that turn's action;
  ``turn`` holds the turn index.

Rows are joined from token segments (:class:`~polyrl.core.segment.Tokens`): each turn's
sampled segment as the engine returned it, environment tokens as ``Tokens.given``, so
every per-token fact the engine records (weights versions, MoE routing, ...) reaches the
record. A concat row's tokens also take what a later call's prefill recorded of them
(``Tokens.fill``: an observation's MoE routing from the next turn's prompt).

Observations and tool results may carry images (:mod:`polyrl.agents.env`) when the acting
policy takes image turns (:class:`~polyrl.core.interfaces.TakesImageTurns`, e.g. a
``qwen_vl`` policy on the ``hf_vl`` engine): each turn is rendered with one placeholder per
image, the policy expands the placeholders once (the images are processed once), and the
conversation's ids grow by appending. Every row carries its images joined into one object
in the record's ``vision`` column. ``max_images`` and ``max_pixels`` bound an episode's
images; an image past them is replaced by a note and counted (``images_truncated``), and
an image part that is no image or alone exceeds ``max_pixels`` becomes an error the model
reads (``bad_images``); the episode goes on.

An environment that raises in ``reset`` or ``step`` ends that episode: its rows keep the
error text and are marked invalid (counted, left out of the update); the rest of the
batch trains. Each row's ``meta`` carries what rewards and credit need: the episode id,
per-turn rewards, anchor observations, the token spans of each turn in the response,
the return, success and why the episode ended.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextvars
import dataclasses
import inspect
import traceback
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal

from tensordict import TensorDict

from polyrl.agents.chat import ChatFormat
from polyrl.agents.env import (
    Message,
    as_messages,
    as_step_result,
    env_options,
    is_image,
    make_env_factory,
    observation_text,
)
from polyrl.core.config import ConfigError
from polyrl.core.interfaces import Phase, TakesImageTurns, splice_images, takes_images
from polyrl.core.observe.timeline import span
from polyrl.core.record import Row, build_rows
from polyrl.core.registry import ENVIRONMENTS, WORKFLOWS, UnknownNameError
from polyrl.core.rollout.batching import Batcher
from polyrl.core.rollout.data import PromptItem
from polyrl.core.rollout.engine import Request, SamplingParams
from polyrl.core.rollout.workflow import run_sync
from polyrl.core.segment import Tokens

MODES = ("concat", "step")


@dataclass
class Turn:
    prompt: Tokens  # what the engine was given for this turn (Completion.prompt)
    action: Tokens  # exactly what it sampled, with every fact recorded (Completion.tokens)
    action_text: str
    anchor: str  # the observation this action answered (GiGPO groups steps by it)
    finish: str  # "stop" or "length"
    reward: float = 0.0
    env_ids: list[int] = field(default_factory=list)  # env tokens spliced after the action
    info: dict = field(default_factory=dict)
    vision: Any = None  # the prompt's images, joined (TakesImageTurns); None: none
    env_vision: Any = None  # the images of env_ids (one per-turn handle)
    env_starts: list[int] = field(default_factory=list)  # each image's first token in env_ids


@dataclass
class Episode:
    id: int
    item: PromptItem
    sample: int
    env: Any
    observations: list[list[Message]] = field(default_factory=list)
    anchors: list[str] = field(default_factory=list)
    turns: list[Turn] = field(default_factory=list)
    first_ids: list[int] = field(default_factory=list)
    tokens: int = 0
    done: bool = False
    truncated: bool = False
    finish: str = ""  # done | max_turns | max_tokens | max_context | error
    error: str = ""
    success: bool | None = None
    final_observation: str = ""
    max_turns: int = 0
    tools: list[dict] | None = None  # tool schemas the env offers (rendered in first prompts)
    # per observation: (each kept image's placeholder ids, the turn's handle) or None
    obs_images: list[tuple[list[list[int]], Any] | None] = field(default_factory=list)
    first_vision: Any = None  # the images of first_ids
    first_starts: list[int] = field(default_factory=list)
    images: int = 0  # images kept so far
    pixels: int = 0  # their source pixels

    def end(self, finish: str, *, truncated: bool = False, error: str = "") -> None:
        self.done, self.finish, self.truncated = True, finish, truncated
        self.error = error


def _describe(exc: BaseException, where: str) -> str:
    tb = traceback.extract_tb(exc.__traceback__)
    loc = f" ({tb[-1].filename}:{tb[-1].lineno})" if tb else ""
    return f"environment {where} raised {type(exc).__name__}: {exc}{loc}"


class MultiTurn:
    """Episodes against an environment; registered as workflow ``multi_turn``.

    Its options (``rollout.args``) are the keyword parameters of ``__init__``; ``env_args``
    are the environment's own options, checked against the environment when the recipe
    loads (:meth:`validate_config`).
    """

    # What each transcript line adds (from the row's meta): a step-mode row is one turn, so
    # the line also says which episode and turn it is and how the whole episode went.
    transcript_keys = (
        "episode",
        "sample",
        "turn",
        "turns",
        "actions",
        "turn_rewards",
        "success",
        "finish",
        "final_observation",
    )

    def __init__(
        self,
        ctx,
        env: Annotated[
            str, "environment: a registered name, package.module:Class or ./file.py:Class"
        ] = "gridworld",
        env_args: Annotated[
            dict[str, Any] | None,
            "the environment's options (its constructor's keyword parameters)",
        ] = None,
        mode: Annotated[
            Literal["concat", "step"],
            "row layout: concat (one row per episode) or step (one row per turn)",
        ] = "concat",
        history: Annotated[
            int | None,
            "step mode: earlier turns kept in each prompt (0: the current observation "
            "only; null: all)",
        ] = 0,
        max_turns: Annotated[int, "turns per episode (an environment's max_turns may cut it)"] = 8,
        max_tokens: Annotated[int | None, "sampled tokens per episode (null: no limit)"] = None,
        max_turn_tokens: Annotated[
            int | None, "sampled tokens per turn (null: rollout.max_new_tokens)"
        ] = None,
        max_context: Annotated[
            int | None, "longest prompt + action of one turn, in tokens (null: no limit)"
        ] = None,
        system_prompt: Annotated[
            str | None, "system message before the first observation (null: none)"
        ] = None,
        env_workers: Annotated[int, "threads stepping sync environments (1: inline)"] = 1,
        policy: Annotated[str | None, "the acting policy (null: the first)"] = None,
        schedule: Annotated[
            Literal["round", "episode"],
            "round: all active episodes act in lock-step, one engine call per turn round "
            "(reproducible whatever the environments' timing); episode: each episode goes "
            "back to the engine as soon as its own step is done and the engine serves "
            "whatever waits (faster with slow tools; batches then depend on timing)",
        ] = "round",
        max_images: Annotated[
            int, "images kept per episode (a VL policy); later ones are replaced by a note"
        ] = 16,
        max_pixels: Annotated[
            int,
            "source pixels (width * height, summed) kept per episode; an image that alone "
            "exceeds it is an error the model reads",
        ] = 4096 * 4096,
    ) -> None:
        name = policy or next(iter(ctx.policies))
        if name not in ctx.policies:
            raise KeyError(f"multi_turn: unknown policy {name!r}; have {sorted(ctx.policies)}")
        self._check_args(
            mode=mode,
            history=history,
            max_turns=max_turns,
            max_tokens=max_tokens,
            max_turn_tokens=max_turn_tokens,
            max_context=max_context,
            env_workers=env_workers,
            max_images=max_images,
            max_pixels=max_pixels,
        )
        self.name, self.engine = name, ctx.engines[name]
        policy_obj = ctx.policies[name]
        self.vision = policy_obj if isinstance(policy_obj, TakesImageTurns) else None
        self.max_images, self.max_pixels = max_images, max_pixels
        self.image_counts = {"images_kept": 0, "images_truncated": 0, "bad_images": 0}
        self._rollouts = 0
        self.tokenizer = ctx.policies[name].tokenizer
        self.chat = ChatFormat(self.tokenizer, system_prompt)
        self.make_env = make_env_factory(env, env_args)
        self.env_name = env
        self.mode, self.history = mode, history
        self.max_turns, self.max_tokens = max_turns, max_tokens
        self.max_turn_tokens, self.max_context = max_turn_tokens, max_context
        self.env_workers = env_workers
        self.schedule = schedule
        self.generate_calls = 0  # engine calls so far (one per turn round or flush)
        self.flush_sizes: list[int] = []  # schedule episode: requests per engine call

    # ------------------------------------------------------------------ config checks
    @staticmethod
    def _check_args(
        *,
        mode,
        history,
        max_turns,
        max_tokens,
        max_turn_tokens,
        max_context,
        env_workers,
        max_images=0,
        max_pixels=1,
    ) -> None:
        if mode not in MODES:
            raise ConfigError(f"rollout.args.mode={mode!r}: use one of {', '.join(MODES)}")
        if history is not None and history < 0:
            raise ConfigError(f"rollout.args.history must be >= 0 or null, got {history}")
        if max_turns < 1:
            raise ConfigError(f"rollout.args.max_turns must be >= 1, got {max_turns}")
        for key, value in (
            ("max_tokens", max_tokens),
            ("max_turn_tokens", max_turn_tokens),
            ("max_context", max_context),
        ):
            if value is not None and value < 1:
                raise ConfigError(f"rollout.args.{key} must be >= 1 or null, got {value}")
        if env_workers < 1:
            raise ConfigError(f"rollout.args.env_workers must be >= 1, got {env_workers}")
        if max_images < 0:
            raise ConfigError(f"rollout.args.max_images must be >= 0, got {max_images}")
        if max_pixels < 1:
            raise ConfigError(f"rollout.args.max_pixels must be >= 1, got {max_pixels}")

    @classmethod
    def validate_config(cls, cfg) -> None:
        """At config time, before any model loads: the ranges of ``rollout.args`` (typed by
        the recipe), the acting policy, and the environment's own options, which become
        typed in place (``rollout.args.env_args``)."""
        args = cfg.rollout.args
        cls._check_args(
            mode=args.mode,
            history=args.history,
            max_turns=args.max_turns,
            max_tokens=args.max_tokens,
            max_turn_tokens=args.max_turn_tokens,
            max_context=args.max_context,
            env_workers=args.env_workers,
            max_images=args.max_images,
            max_pixels=args.max_pixels,
        )
        if args.policy is not None and args.policy not in cfg.policies:
            raise ConfigError(
                f"rollout.args.policy={args.policy!r} is not one of the recipe's policies "
                f"{sorted(cfg.policies)}"
            )
        try:
            ENVIRONMENTS.check(args.env)
        except UnknownNameError as e:
            raise ConfigError(f"rollout.args.env: {e}") from None
        args.env_args = env_options(args.env, args.env_args, "rollout.args.env_args", "the recipe")

    # ------------------------------------------------------------------ rollout
    def rollout(
        self, items: list[PromptItem], params: SamplingParams, phase: Phase = "train"
    ) -> TensorDict:
        return run_sync(self.arollout(items, params))

    def rollout_metrics(self) -> dict[str, float]:
        """The last rollout's image counts (when the policy takes images or any came)."""
        if self.vision is None and not any(self.image_counts.values()):
            return {}
        return {k: float(v) for k, v in self.image_counts.items()}

    async def arollout(self, items: list[PromptItem], params: SamplingParams) -> TensorDict:
        self._rollouts += 1
        self.image_counts = dict.fromkeys(self.image_counts, 0)
        pairs = [(item, g) for item in items for g in range(params.n)]
        episodes = [Episode(k, item, g, None) for k, (item, g) in enumerate(pairs)]
        pool = (
            concurrent.futures.ThreadPoolExecutor(self.env_workers)
            if self.env_workers > 1
            else None
        )
        try:
            await asyncio.gather(*(self._reset(ep, pool) for ep in episodes))
            batcher = Batcher({self.name: self.engine})
            if self.schedule == "episode":
                await batcher.drive([self._episode(ep, params, batcher, pool) for ep in episodes])
            else:  # lock-step rounds: every active episode's turn, then the next round
                while active := [ep for ep in episodes if not ep.done]:
                    await batcher.drive([self._turn(ep, params, batcher, pool) for ep in active])
            self.generate_calls += batcher.calls[self.name]
            self.flush_sizes = batcher.sizes
            await asyncio.gather(*(self._close(ep, pool) for ep in episodes))
        finally:
            if pool is not None:
                pool.shutdown(wait=False, cancel_futures=True)
        return self._record(episodes)

    async def _call(self, fn, pool, *args) -> Any:
        if inspect.iscoroutinefunction(fn) or pool is None:
            result = fn(*args)
        else:  # in this context: the environment's own spans find the step's trace
            run = contextvars.copy_context().run
            result = await asyncio.get_running_loop().run_in_executor(pool, run, fn, *args)
        return await result if inspect.isawaitable(result) else result

    async def _reset(self, ep: Episode, pool) -> None:
        try:
            ep.env = self.make_env()
            with span("env_reset", lane=f"episode {ep.id}", episode=ep.id):
                obs = await self._call(ep.env.reset, pool, ep.item.row)
            messages = as_messages(obs, "reset")
        except Exception as e:
            ep.end("error", error=_describe(e, "reset"))
            return
        ep.anchors.append(observation_text(messages))
        messages, images = self._images(ep, messages)
        ep.observations.append(messages)
        schemas = getattr(ep.env, "tool_schemas", None)
        ep.tools = schemas() if callable(schemas) else None
        ep.first_ids, ep.first_starts = self._splice(
            self.chat.first_prompt(messages, ep.tools), images, "reset"
        )
        ep.first_vision = images[1] if images else None
        ep.obs_images.append(images)
        env_limit = getattr(ep.env, "max_turns", None)
        ep.max_turns = min(self.max_turns, env_limit) if env_limit else self.max_turns

    async def _close(self, ep: Episode, pool) -> None:
        close = getattr(ep.env, "close", None)
        if close is None:
            return
        try:
            with span("env_close", lane=f"episode {ep.id}", episode=ep.id):
                await self._call(close, pool)
        except Exception as e:  # the trajectory is complete; keep the note, not the row out
            ep.final_observation += f"\n[close failed: {type(e).__name__}: {e}]"

    # ------------------------------------------------------------------ images
    def _images(
        self, ep: Episode, messages: list[Message]
    ) -> tuple[list[Message], tuple[list[list[int]], Any] | None]:
        """The messages as the chat template renders them (an image part without its
        pixels) and the kept images encoded by the policy (None: none); episode limits and
        bad images applied and counted."""
        notes: dict[int, str] = {}  # per image part (by id): why it is not shown; "" kept
        out, kept = self._keep_images(ep, messages, notes)
        if not kept:
            return out, None
        if self.vision is None:
            raise TypeError(
                f"multi_turn: the environment {self.env_name!r} returned an image but "
                f"policy {self.name!r} ({type(self.engine).__name__} engine) cannot take "
                "images; use a vision-language policy (policies.<name>.kind=qwen_vl with "
                "engine.name=hf_vl) or an environment without images"
            )
        if not takes_images(self.engine):
            raise TypeError(
                f"multi_turn: the engine of policy {self.name!r} "
                f"({type(self.engine).__name__}) takes no images; set "
                f"policies.{self.name}.engine.name=hf_vl"
            )
        try:
            return out, self.vision.encode_images([image for _, image in kept])
        except ValueError:
            pass  # an image the policy's processor refuses (e.g. its aspect ratio): find it
        for key, image in kept:
            try:
                self.vision.encode_images([image])
            except ValueError as e:
                notes[key] = f"Error: the model cannot take this image ({e}); it was not shown"
                ep.images -= 1
                ep.pixels -= image.width * image.height
                self.image_counts["images_kept"] -= 1
                self.image_counts["bad_images"] += 1
        out, kept = self._keep_images(ep, messages, notes)
        return out, (self.vision.encode_images([im for _, im in kept]) if kept else None)

    def _keep_images(
        self, ep: Episode, messages: list[Message], notes: dict[int, str]
    ) -> tuple[list[Message], list[tuple[int, Any]]]:
        """The messages with each image part kept (a placeholder part) or replaced by a note
        the model reads, and the kept images (with their part's id). ``notes`` holds each
        part's decision once made (limits counted once); a later pass reuses them."""
        out, kept = [], []
        for m in messages:
            content = m["content"]
            if isinstance(content, str):
                out.append(m)
                continue
            parts = []
            for part in content:
                if part["type"] != "image":
                    parts.append(part)
                    continue
                key = id(part)
                if key not in notes:
                    notes[key] = self._image_note(ep, part["image"])
                if notes[key]:
                    parts.append({"type": "text", "text": notes[key]})
                else:
                    parts.append({"type": "image"})
                    kept.append((key, part["image"]))
            if all(p["type"] == "text" for p in parts):  # text only: a plain string
                out.append({**m, "content": "".join(p["text"] for p in parts)})
            else:
                out.append({**m, "content": parts})
        return out, kept

    def _image_note(self, ep: Episode, image: Any) -> str:
        """Why ``image`` is not shown (counted), or "" when it is kept (and counted)."""
        if not is_image(image):
            self.image_counts["bad_images"] += 1
            return f"Error: expected an image, got a {type(image).__name__}; nothing was shown"
        pixels = image.width * image.height
        if pixels > self.max_pixels:
            self.image_counts["bad_images"] += 1
            return (
                f"Error: the image is {image.width}x{image.height} ({pixels} pixels), over "
                f"the limit of {self.max_pixels} pixels; it was not shown"
            )
        if ep.images >= self.max_images or ep.pixels + pixels > self.max_pixels:
            self.image_counts["images_truncated"] += 1
            what = "images" if ep.images >= self.max_images else "pixels"
            limit = self.max_images if what == "images" else self.max_pixels
            return f"[image not shown: the episode's limit of {limit} {what} is reached]"
        ep.images += 1
        ep.pixels += pixels
        self.image_counts["images_kept"] += 1
        return ""

    def _splice(
        self, ids: list[int], images: tuple[list[list[int]], Any] | None, where: str
    ) -> tuple[list[int], list[int]]:
        """``ids`` with each image placeholder replaced by the image's tokens, and where
        each image's tokens start."""
        if images is None:
            return ids, []
        return splice_images(ids, self.vision.image_token_id, images[0], f"multi_turn ({where})")

    def _join(self, handles: list, starts: list[int], key: str) -> Any:
        if self.vision is None or not starts:
            return None
        return self.vision.join_images(handles, starts, f"{self._rollouts}:{key}")

    def _prompt(self, ep: Episode) -> tuple[list[int], Any]:
        """The next turn's prompt ids and its images joined (None: no image)."""
        t = len(ep.turns)
        start = 0 if self.mode == "concat" or self.history is None else max(0, t - self.history)
        if start == 0:
            ids, starts, handles = list(ep.first_ids), list(ep.first_starts), [ep.first_vision]
        else:
            images = ep.obs_images[start]
            ids, starts = self._splice(
                self.chat.first_prompt(ep.observations[start], ep.tools), images, "history"
            )
            handles = [images[1] if images else None]
        for turn in ep.turns[start:]:
            ids += turn.action.ids
            starts += [len(ids) + s for s in turn.env_starts]
            handles.append(turn.env_vision)
            ids += turn.env_ids
        return ids, self._join(handles, starts, f"{ep.id}:{t}")

    def _budget(self, ep: Episode, per_turn: int) -> tuple[list[int], int, str, Any] | None:
        """The next turn's prompt, token allowance, bound and images, or None (and the
        episode ended) when a budget leaves no room for it."""
        prompt, vision = self._prompt(ep)
        allowed, bound = per_turn, "turn"
        if self.max_tokens is not None and self.max_tokens - ep.tokens < allowed:
            allowed, bound = self.max_tokens - ep.tokens, "max_tokens"
        if self.max_context is not None and self.max_context - len(prompt) < allowed:
            allowed, bound = self.max_context - len(prompt), "max_context"
            if allowed <= 0 and not ep.turns:  # no episode could ever act: not a truncation
                raise ConfigError(
                    f"rollout.args.max_context={self.max_context}: the first prompt of an "
                    f"episode (row {ep.item.uid}) is already {len(prompt)} tokens, leaving no "
                    "room for an action; raise max_context above the longest first prompt "
                    "plus an action (or shorten the observation / system prompt)"
                )
        if allowed <= 0:
            ep.end(bound, truncated=True)
            return None
        return prompt, allowed, bound, vision

    def _take(
        self, ep: Episode, prompt: list[int], allowed: int, bound: str, vision: Any, out
    ) -> bool:
        """Append the sampled action as a turn; True when the environment should step it."""
        finish = out.finish_reason
        text = self.tokenizer.decode(out.tokens.ids, skip_special_tokens=True)
        anchor = ep.anchors[len(ep.turns)]
        ep.turns.append(Turn(out.prompt, out.tokens, text, anchor, finish, vision=vision))
        ep.tokens += len(out.tokens)
        if finish == "length" and bound != "turn":
            ep.end(bound, truncated=True)  # cut mid-action by the budget: do not act on it
            return False
        return True

    @staticmethod
    def _call_params(params: SamplingParams) -> SamplingParams:
        return dataclasses.replace(
            params, n=1, stop=list(params.stop), stop_token_ids=list(params.stop_token_ids)
        )

    async def _turn(self, ep: Episode, params: SamplingParams, batcher: Batcher, pool) -> bool:
        """One turn: the next action from the engine, then the environment's step; False
        when the episode ended before acting (a budget left no room)."""
        per_turn = self.max_turn_tokens or params.max_new_tokens
        b = self._budget(ep, per_turn)
        if b is None:
            return False
        prompt, allowed, _, vision = b
        request = Request(prompt, max_new_tokens=allowed, vision=vision)
        params = self._call_params(params)
        (out,) = await batcher.generate(self.name, request, params, key=ep.id)
        if self._take(ep, *b, out):
            await self._step(ep, pool)
        return True

    async def _episode(self, ep: Episode, params: SamplingParams, batcher: Batcher, pool) -> None:
        """``schedule: episode``: this episode's turns, each sent to the engine as soon as
        its previous step is done."""
        while not ep.done and await self._turn(ep, params, batcher, pool):
            pass

    async def _step(self, ep: Episode, pool) -> None:
        turn = ep.turns[-1]
        try:
            # on the episode's track: its tool calls (ToolEnv) nest inside
            with span("env_step", lane=f"episode {ep.id}", episode=ep.id, turn=len(ep.turns) - 1):
                stepped = await self._call(ep.env.step, pool, turn.action_text)
            result = as_step_result(stepped, "step")
            messages = as_messages(result.observation, "step")
        except Exception as e:
            ep.end("error", error=_describe(e, f"step (turn {len(ep.turns) - 1})"))
            return
        turn.reward, turn.info = result.reward, dict(result.info)
        if "success" in result.info:
            ep.success = bool(result.info["success"])
        text = observation_text(messages)
        if result.done:
            ep.final_observation = text
            ep.end("done")
            return
        if len(ep.turns) >= ep.max_turns:
            ep.final_observation = text
            ep.end("max_turns", truncated=True)
            return
        if self.max_tokens is not None and ep.tokens >= self.max_tokens:
            ep.final_observation = text
            ep.end("max_tokens", truncated=True)
            return
        ended_with_eos = bool(turn.action.ids) and turn.action.ids[-1] == self.chat.eos_id
        messages, images = self._images(ep, messages)
        turn.env_ids, turn.env_starts = self._splice(
            self.chat.env_turn(messages, ended_with_eos), images, f"turn {len(ep.turns) - 1}"
        )
        turn.env_vision = images[1] if images else None
        ep.obs_images.append(images)
        ep.observations.append(messages)
        ep.anchors.append(str(result.info.get("anchor", text)))

    # ------------------------------------------------------------------ record
    def _record(self, episodes: list[Episode]) -> TensorDict:
        rows: list[Row] = []
        row_episode: list[Episode] = []
        decode = self.tokenizer.decode

        def add(ep: Episode, prompt: Tokens, response: Tokens, turn, text, spans, vision):
            row_episode.append(ep)
            rows.append(
                Row(
                    prompt,
                    response,
                    self.name,
                    ep.item.uid,
                    turn=turn,
                    prompt_text=decode(prompt.ids, skip_special_tokens=False),
                    response_text=text,
                    meta={"spans": spans, "turn": turn},
                    truncated=ep.truncated,
                    vision=vision,
                    error=ep.error,
                )
            )

        for ep in episodes:
            if not ep.turns:  # reset failed (or a budget of zero): one empty row keeps the count
                vision = self._join([ep.first_vision], ep.first_starts, f"{ep.id}:row")
                prompt = Tokens.given(ep.first_ids or ep.item.prompt_ids)
                add(ep, prompt, Tokens.given([]), 0, "", [], vision)
            elif self.mode == "step":
                for t, turn in enumerate(ep.turns):
                    n = len(turn.action)
                    spans = [[t, 0, n]]
                    add(ep, turn.prompt, turn.action, t, turn.action_text, spans, turn.vision)
            else:
                parts, spans, length = [], [], 0
                handles, starts = [ep.first_vision], list(ep.first_starts)
                for t, turn in enumerate(ep.turns):
                    parts.append(turn.action)
                    spans.append([t, length, length + len(turn.action)])
                    length += len(turn.action)
                    if t == len(ep.turns) - 1:
                        break  # no action follows the last reply: leave it out of the row
                    starts += [len(ep.first_ids) + length + s for s in turn.env_starts]
                    handles.append(turn.env_vision)
                    parts.append(Tokens.given(turn.env_ids))
                    length += len(turn.env_ids)
                # each token keeps what the first call that saw it recorded: a later turn's
                # prompt (the whole trajectory so far) was prefilled by its call
                whole = Tokens.cat([ep.turns[0].prompt, *parts])
                for turn in ep.turns[1:]:
                    whole = whole.fill(turn.prompt)
                cut = len(ep.turns[0].prompt)
                response = whole[cut:]
                add(
                    ep,
                    whole[:cut],
                    response,
                    0,
                    decode(response.ids, skip_special_tokens=False),
                    spans,
                    self._join(handles, starts, f"{ep.id}:row"),
                )

        # Per-episode facts, shared by all of an episode's rows.
        counts: dict[int, int] = {}
        for ep in row_episode:
            counts[ep.id] = counts.get(ep.id, 0) + 1
        valid_rows = sum(1 for ep in row_episode if not ep.error)
        valid_eps = sum(1 for ep in episodes if not ep.error)
        for row, ep in zip(rows, row_episode, strict=True):
            rewards = [t.reward for t in ep.turns]
            ret = float(sum(rewards))
            success = ep.success if ep.success is not None else ret > 0
            weight = valid_rows / (valid_eps * counts[ep.id]) if valid_eps and not ep.error else 0.0
            row.meta.update(
                {
                    "answer": ep.item.answer,
                    "row": ep.item.row,
                    "episode": ep.id,
                    "sample": ep.sample,
                    "turn_rewards": rewards,
                    "anchors": ep.anchors[: len(ep.turns)],
                    "actions": [t.action_text for t in ep.turns],
                    "return": ret,
                    "success": bool(success),
                    "turns": len(ep.turns),
                    "finish": ep.finish,
                    "final_observation": ep.final_observation,
                    "episode_rows": counts[ep.id],
                    "episode_weight": weight,
                    "env": self.env_name,
                    "mode": self.mode,
                }
            )
        return build_rows(rows, self.tokenizer.pad_token_id)


WORKFLOWS.register("multi_turn", MultiTurn)
