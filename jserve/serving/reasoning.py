"""Reasoning output (vLLM's ``--reasoning-parser``): a thinking model's chat reply split into
its reasoning, written between ``<think>`` and ``</think>``, and its answer, the rest. The
chat endpoint returns the reasoning as ``reasoning`` (vLLM's name) and ``reasoning_content``
(DeepSeek's API and older vLLM), the answer as ``content``, whole or as they stream.

Where a reply starts decides how it is read: inside a thinking block when the prompt left one
open (the chat template ended with ``<think>``, as DeepSeek-R1's and QwQ's do) or the reply
opens one first thing; otherwise as the format says (``deepseek_r1``: reasoning, the model
always thinks first; ``qwen3``: the answer, thinking switched off). Inside the block,
everything up to ``</think>`` is reasoning (a reply cut short there is reasoning alone);
everything after it is the answer. ``ReasoningStream`` reads a reply in pieces and holds back
only what could still be the start of a tag, so the pieces it returns add up to what it
returns for the whole reply in one piece.

A constrained reply (a structured output, or calls a tool choice forces) may think first,
as the format lets it, and its constraint holds from ``</think>`` on (``thinking_first``:
the grammar is the structured output's behind a free thinking block).
"""
from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from jserve.sampling.structured import THINK_END, THINK_START, StructuredOutput
from jserve.serving.harmony import HarmonyStream
from jserve.serving.tool_calls import partial_mark

# How many prompt tokens to read back for an open thinking block: templates open it at the
# very end of the generation prompt ("<think>\n", or "<think>\n\n</think>\n\n" closed).
PROMPT_TAIL_TOKENS = 16


@dataclasses.dataclass(frozen=True)
class ReasoningFormat:
    name: str
    thinks_by_default: bool  # a reply that opens no block is reasoning (else the answer)
    # a constrained reply's block (``StructuredOutput.think``) unless opened; None: the
    # constraint holds from the first token
    think: str | None
    # what marks the reasoning: ``<think>`` blocks, or gpt-oss's harmony channels
    # (``jserve.serving.harmony``), whose markers are special tokens kept in the text
    markup: str = "think"

    @property
    def keeps_special_tokens(self) -> bool:
        """Whether replies are decoded with their special tokens (the parser reads them)."""
        return self.markup == "harmony"

    def reader(self, thinking: bool = False) -> ReplyReader:
        """A reader of one reply (``feed``/``finish``/``answering``); ``thinking``: the
        prompt left a block open."""
        return HarmonyStream() if self.markup == "harmony" else ReasoningStream(self, thinking)


FORMATS = {f.name: f for f in (ReasoningFormat("deepseek_r1", True, "first"),
                               ReasoningFormat("qwen3", False, "optional"),
                               ReasoningFormat("openai_gptoss", False, None, "harmony"))}


def prompt_leaves_open(tail: str) -> bool:
    """Whether a prompt ending in ``tail`` leaves a thinking block open."""
    return tail.rfind(THINK_START) > tail.rfind(THINK_END)


def opens_thinking(tokenizer, prompt_ids: Sequence[int]) -> bool:
    """Whether the prompt ``prompt_ids`` (its last tokens) leaves a thinking block open."""
    return tokenizer is not None and prompt_leaves_open(
        tokenizer.decode(list(prompt_ids[-PROMPT_TAIL_TOKENS:])))


def thinking_first(fmt: ReasoningFormat, so: StructuredOutput, opened: bool
                   ) -> StructuredOutput:
    """``so`` held only after the reply's thinking block: one the prompt ``opened``, else
    the block the format lets the reply open."""
    return dataclasses.replace(so, think="open" if opened else fmt.think)


class ReasoningStream:
    """One reply read piece by piece: ``feed`` returns the (reasoning, content) text each
    piece adds, ``finish`` what was held back. ``thinking``: the prompt left a block open."""

    def __init__(self, fmt: ReasoningFormat, thinking: bool = False):
        self.fmt = fmt
        self._phase = "reasoning" if thinking else "start"
        self._held = ""

    def feed(self, text: str) -> tuple[str, str]:
        text, self._held = self._held + text, ""
        reasoning = content = ""
        if self._phase == "start":
            lead = text.lstrip()
            if lead.startswith(THINK_START):
                self._phase, text = "reasoning", lead[len(THINK_START):]
            elif THINK_START.startswith(lead):  # nothing yet, or a tag arriving
                self._held = text
                return "", ""
            else:
                self._phase = "reasoning" if self.fmt.thinks_by_default else "content"
        if self._phase == "reasoning":
            before, tag, after = text.partition(THINK_END)
            if tag:
                reasoning, self._phase, text = before, "content", after
            else:
                keep = partial_mark(text, (THINK_END,))
                self._held = text[len(text) - keep:] if keep else ""
                return text[:len(text) - keep], ""
        content = text
        return reasoning, content

    def finish(self) -> tuple[str, str]:
        """What was held back, as what it turned out to be (the reply ended)."""
        held, self._held = self._held, ""
        if self._phase == "start":
            self._phase = "reasoning" if self.fmt.thinks_by_default else "content"
        return (held, "") if self._phase == "reasoning" else ("", held)

    @property
    def answering(self) -> bool:
        """Whether the reply has reached its answer."""
        return self._phase == "content"


def split(fmt: ReasoningFormat, text: str, thinking: bool = False
          ) -> tuple[str | None, str | None]:
    """A whole reply as (reasoning, content), None for a part that is empty."""
    s = fmt.reader(thinking)
    r, c = s.feed(text)
    r2, c2 = s.finish()
    return (r + r2) or None, (c + c2) or None


ReplyReader = ReasoningStream | HarmonyStream  # what ``ReasoningFormat.reader`` gives
