"""The tool-call formats a server reads model output in, by vLLM's ``--tool-call-parser``
names: each says how text becomes calls (its streaming reader, which reads whole outputs too,
so a stream's deltas add up to the non-streamed answer) and what ``tool_choice: required`` or
a named function holds the output to. The chat template (the checkpoint's, or
``--chat-template``) decides what the model is told; a format only reads what it writes.

``openai`` reads what ``harmony.HarmonyStream`` (``--reasoning-parser openai_gptoss``) leaves
of a gpt-oss reply, so it needs that reasoning parser (``ServerConfig`` says so).

vLLM's other parsers write other formats (``qwen3_coder`` and ``qwen3_xml``: XML parameters,
``pythonic``: Python calls, ...): none is an alias of these three.
"""
from __future__ import annotations

import dataclasses
from typing import Callable

from jserve.sampling.structured import StructuredOutput
from jserve.serving.harmony import HarmonyCallParser, harmony_constraint
from jserve.serving.hermes_tools import HermesCallParser, hermes_constraint
from jserve.serving.mistral_tools import MistralCallParser, mistral_constraint
from jserve.serving.tool_calls import (
    ToolCallParser,
    ToolChoice,
    read_tool_calls,
    tool_constraint,
)


@dataclasses.dataclass(frozen=True)
class ToolFormat:
    name: str
    summary: str  # what the model writes, for --help and errors
    parser: type[ToolCallParser]  # feed(text) / finish() -> (content, deltas); .calls
    # (tools, choice, the engine's tokenizer) -> the constraint of required / named
    constraint: Callable[[list[dict], ToolChoice, object], StructuredOutput | None]


TOOL_FORMATS = {f.name: f for f in (
    ToolFormat("llama3_json", "Llama 3.1's JSON: {\"name\": ..., \"parameters\": ...}, ';' "
                              "between calls", ToolCallParser,
               lambda tools, choice, tokenizer: tool_constraint(tools, choice)),
    ToolFormat("hermes", "<tool_call>{\"name\": ..., \"arguments\": ...}</tool_call> blocks "
                         "(Qwen2.5, Qwen3, Hermes)", HermesCallParser, hermes_constraint),
    ToolFormat("mistral", "[TOOL_CALLS] [{\"name\": ..., \"arguments\": ...}] (Mistral 7B "
                          "v0.3, Nemo, Small 24B)", MistralCallParser, mistral_constraint),
    ToolFormat("openai", "gpt-oss's harmony: a commentary message to=functions.NAME "
                         "(with --reasoning-parser openai_gptoss)", HarmonyCallParser,
               harmony_constraint),
)}
DEFAULT_FORMAT = "llama3_json"


def constraint(tools: list[dict], choice: ToolChoice, tokenizer=None
               ) -> StructuredOutput | None:
    """The output constraint of ``required`` and of a named function in the choice's format
    (for the engine's ``tokenizer``: a tag may be one token of it); None otherwise."""
    return TOOL_FORMATS[choice.format].constraint(tools, choice, tokenizer)


def call_parser(choice: ToolChoice) -> ToolCallParser:
    """A streaming reader of one choice's output."""
    return TOOL_FORMATS[choice.format].parser(choice)


def read_calls(choice: ToolChoice, text: str) -> tuple[str | None, list[dict]]:
    """A whole output as (content, calls)."""
    return read_tool_calls(choice, text, TOOL_FORMATS[choice.format].parser)
