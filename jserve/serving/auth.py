"""Bearer tokens, checked the same way on every port (gRPC metadata, HTTP headers, /metrics)."""
from __future__ import annotations

import hmac


def bearer_matches(header: str | bytes | None, *tokens: str) -> bool:
    """``Bearer <token>`` with one of ``tokens`` (the scheme in any case), compared in
    constant time."""
    if isinstance(header, bytes):
        header = header.decode("latin-1")
    scheme, _, value = (header or "").strip().partition(" ")
    given = value.strip().encode()
    return scheme.lower() == "bearer" and any(hmac.compare_digest(given, t.encode())
                                              for t in tokens)
