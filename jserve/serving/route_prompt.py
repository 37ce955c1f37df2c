"""The prompt a router reads of an OpenAI request body: its token ids (through the model's
tokenizer; a chat through its template) and its ``ttft_slo``. For routing only: the engine
reads the body again and refuses what is wrong with it, so anything unreadable here is
None, never an error. Shared by the routers in front of several engines (Ray Serve's
ingress, ``jserve.serving.front``)."""
from __future__ import annotations

import json

from jserve.config import resolve_model_dir
from jserve.tokenizer import ByteTokenizer, chat_prompt_ids, load_tokenizer

ROUTED_PATHS = ("/v1/completions", "/v1/chat/completions")


def route_prompt(tokenizer, path: str, body: bytes | dict) -> tuple[list[int], float | None] | None:
    """(prompt ids, ttft_slo) of a completions or chat body (a batch: its first prompt);
    None for another path or a body that cannot be read."""
    if path not in ROUTED_PATHS:
        return None
    try:
        b = json.loads(body) if isinstance(body, (bytes, str)) else body
        slo = b.get("ttft_slo")
        if path.endswith("chat/completions"):
            ids = chat_prompt_ids(tokenizer, b["messages"], b.get("tools"))
        else:
            p = b["prompt"]
            p = p[0] if isinstance(p, list) and p and not isinstance(p[0], int) else p
            ids = list(p) if isinstance(p, list) else tokenizer.encode(p)
        return [int(t) for t in ids], float(slo) if isinstance(slo, (int, float)) else None
    except Exception:  # noqa: BLE001 - the engine answers a bad body with a 400
        return None


def model_tokenizer(model: str):
    """The tokenizer a router reads prompts with: the model's, or bytes for the built-in
    ``default`` and a model without one."""
    if model == "default":
        return ByteTokenizer()
    return load_tokenizer(resolve_model_dir(model)) or ByteTokenizer()
