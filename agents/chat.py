"""Token-exact multi-turn chat: the policy's sampled ids are kept, only new text is encoded.

A multi-turn episode is a chain of segments: the first prompt, then for every turn the
ids the engine sampled (kept exactly, never decoded and re-encoded) followed by the
environment's reply, encoded on its own. :class:`ChatFormat` works out from the
tokenizer's own chat template which text closes an assistant turn and opens the next
one, by rendering a probe conversation and taking differences, so the spliced sequence
reads exactly like the template would render the conversation.
"""

from __future__ import annotations

from typing import Any

from polyrl.agents.env import Message

_PROBE_USER = "PROBE_USER_TEXT"
_PROBE_ASSISTANT = "PROBE_ASSISTANT_TEXT"


class ChatFormat:
    """Renders first prompts and environment turns as token ids for one tokenizer.

    - :meth:`first_prompt` ``(messages)``: ids of the opening prompt (system prompt
      prepended when given), ending with the assistant header.
    - :meth:`env_turn` ``(messages, ended_with_eos)``: ids that close the assistant turn
      just sampled (only what the policy did not emit itself) and add the environment's
      messages plus the next assistant header.
    """

    def __init__(self, tokenizer: Any, system_prompt: str | None = None) -> None:
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError(
                "the multi-turn workflow needs a tokenizer with a chat template "
                "(it renders each environment turn with it)"
            )
        self.tokenizer = tokenizer
        self.system_prompt = system_prompt
        probe = [
            {"role": "user", "content": _PROBE_USER},
            {"role": "assistant", "content": _PROBE_ASSISTANT},
        ]
        self._probe = self._with_system(probe)
        base = self.render(self._probe, generation_prompt=False)
        cut = base.rfind(_PROBE_ASSISTANT)
        if cut < 0:
            raise ValueError("the chat template does not render assistant messages verbatim")
        self._base = base
        # Text the template puts after an assistant message (e.g. "<|im_end|>\n").
        self._assistant_suffix = base[cut + len(_PROBE_ASSISTANT) :]
        self.eos_id = tokenizer.eos_token_id
        self._eos_text = (
            tokenizer.convert_ids_to_tokens(self.eos_id) if self.eos_id is not None else None
        )

    def _with_system(self, messages: list[Message]) -> list[Message]:
        if self.system_prompt and (not messages or messages[0]["role"] != "system"):
            return [{"role": "system", "content": self.system_prompt}, *messages]
        return list(messages)

    def render(
        self, messages: list[Message], *, generation_prompt: bool, tools: list[dict] | None = None
    ) -> str:
        kwargs = {"tools": tools} if tools else {}
        text = self.tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=generation_prompt, **kwargs
        )
        if isinstance(text, list):  # some versions wrap a single conversation
            text = text[0]
        return text

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def first_prompt(self, messages: list[Message], tools: list[dict] | None = None) -> list[int]:
        """Ids of the opening prompt, rendered like the core's prompt datasets render rows
        (``tools``: JSON schemas the template lists, for templates that support them)."""
        return self.encode(
            self.render(self._with_system(messages), generation_prompt=True, tools=tools)
        )

    def env_turn_text(self, messages: list[Message], ended_with_eos: bool) -> str:
        full = self.render(self._probe + list(messages), generation_prompt=True)
        if not full.startswith(self._base):
            raise ValueError(
                "the chat template renders earlier turns differently once more "
                "messages follow; the multi-turn workflow cannot splice turns"
            )
        close = self._assistant_suffix
        if ended_with_eos and self._eos_text and close.startswith(self._eos_text):
            close = close[len(self._eos_text) :]  # the policy already emitted the end token
        return close + full[len(self._base) :]

    def env_turn(self, messages: list[Message], ended_with_eos: bool) -> list[int]:
        return self.encode(self.env_turn_text(messages, ended_with_eos))

    def close_text(self, ended_with_eos: bool) -> str:
        """What closes an assistant turn that ends the episode (not spliced into rows)."""
        close = self._assistant_suffix
        if ended_with_eos and self._eos_text and close.startswith(self._eos_text):
            close = close[len(self._eos_text) :]
        return close
