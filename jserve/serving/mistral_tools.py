"""Mistral's tool-call format (vLLM's ``--tool-call-parser mistral``: Mistral 7B Instruct v0.3,
Mistral Nemo, Mistral Small 24B and others of their tokenizers): the model answers with its
``[TOOL_CALLS]`` control token and a JSON array of calls::

    [TOOL_CALLS] [{"name": <function>, "arguments": <arguments>}, ...]

The control token is special, so the text jserve decodes starts at the array; where a
tokenizer keeps it as text, a leading ``[TOOL_CALLS]`` is dropped. The array is read as the
default format reads one (``tool_calls.ToolCallParser``: calls from the start of the output,
each streamed as it comes; ``"parameters"`` read as ``"arguments"``); the newer
``name[ARGS]{...}`` form of later Mistral tokenizers is not read. A call's id is nine
letters and digits: Mistral's chat templates refuse any other when the calls come back in
the conversation. ``tool_choice: required`` holds the output to the array (one call with
``parallel_tool_calls: false``), after an optional ``[TOOL_CALLS]``; a named function to its
arguments, as in the default format. No engine state, no JAX.
"""
from __future__ import annotations

import json
import secrets
import string

from jserve.sampling.structured import StructuredOutput, lark_literal
from jserve.serving.tool_calls import (
    WS,
    ToolCallParser,
    ToolChoice,
    call_array,
    call_schemas,
    tool_constraint,
)

MARK = "[TOOL_CALLS]"
_ID_CHARS = string.ascii_letters + string.digits


def mistral_call_id() -> str:
    """Nine letters and digits (what Mistral's templates check)."""
    return "".join(secrets.choice(_ID_CHARS) for _ in range(9))


def mistral_constraint(tools: list[dict], choice: ToolChoice, tokenizer=None
                       ) -> StructuredOutput | None:
    """``required``: an optional ``[TOOL_CALLS]`` (one token where ``tokenizer`` has it)
    then the array of ``{"name", "arguments"}`` calls, compact; a named function: its
    arguments (``tool_constraint``); None otherwise."""
    if choice.mode != "required":
        return tool_constraint(tools, choice)
    schema = {**call_array(call_schemas(list(enumerate(tools))), choice.parallel),
              "x-guidance": {"whitespace_flexible": False}}  # compact, as the others
    mark = lark_literal(tokenizer, MARK)
    return StructuredOutput(grammar=f'%llguidance {{}}\nstart: ({mark} " "?)? '
                                    f"%json {json.dumps(schema)}\n")


class MistralCallParser(ToolCallParser):
    """``ToolCallParser`` with Mistral's ids, after a leading ``[TOOL_CALLS]`` where the text
    holds one (held back while the output could still be starting with it)."""

    new_id = staticmethod(mistral_call_id)

    def __init__(self, choice: ToolChoice):
        super().__init__(choice)
        self._head: str | None = ""  # the output's start while it may be the mark; None after

    def feed(self, text: str) -> tuple[str, list[dict]]:
        if self._head is None or self.choice.mode in ("named", "none"):
            return super().feed(text)
        head = self._head + text
        lead = head.lstrip(WS)
        if len(lead) < len(MARK) and MARK.startswith(lead):
            self._head = head
            return "", []
        self._head = None
        return super().feed(lead[len(MARK):] if lead.startswith(MARK) else head)

    def finish(self) -> tuple[str, list[dict]]:
        if self._head:  # the output ended inside a would-be mark: text after all
            head, self._head = self._head, None
            content, deltas = super().feed(head)
            rest, more = super().finish()
            return content + rest, deltas + more
        return super().finish()
