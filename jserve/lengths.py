"""How long a request may run: the one length rule. Output processing, decode bursts,
speculation, the scheduler, the simulator and the HTTP chat default all ask it, so no two
of them can disagree by a token. Pure Python, no imports: every layer may use it."""
from __future__ import annotations


def length_room(max_tokens: int, prompt_tokens: int, output_tokens: int,
                max_model_len: int | float) -> int:
    """How many more tokens a request may generate before it ends by length: what both
    ``max_tokens`` and the context leave (0 or less: it has ended)."""
    return min(max_tokens - output_tokens, max_model_len - prompt_tokens - output_tokens)


def context_room(prompt_tokens: int, max_model_len: int) -> int:
    """What the context leaves a prompt: the output length of a request that sets no
    ``max_tokens`` (an HTTP chat's default, as vLLM's)."""
    return max_model_len - prompt_tokens
