"""What prefill/decode disaggregation is told (pure data): an engine's
``--kv-transfer-config`` (vLLM's JSON shape, jserve's connector) and a request's
``kv_transfer_params`` (vLLM's field). ``kv_connector`` acts on them."""
from __future__ import annotations

import dataclasses
import json
from typing import Any

from jserve import fields
from jserve.fields import FieldError

CONNECTOR = "JServeConnector"
KV_ROLES = ("kv_producer", "kv_consumer", "kv_both")
TRANSFER_FIELDS = {"do_remote_decode", "do_remote_prefill", "remote_url"}
# What vLLM's proxies send and pass on for its own connectors (NIXL's, whose prefill
# response names the blocks, engine and side channel): accepted so that a proxy written for
# vLLM drives jserve's engines unchanged; only remote_host and remote_port are read (the
# producer's address when remote_url is not given).
VLLM_TRANSFER_FIELDS = {"remote_engine_id", "remote_block_ids", "remote_host", "remote_port",
                        "remote_request_id", "tp_size"}


@dataclasses.dataclass(frozen=True)
class KVTransferConfig:
    role: str
    peers: tuple[str, ...] = ()     # base URLs this engine may pull pages from
    timeout_s: float = 30.0         # a pull's whole time (connect, read), after which the
                                    # request is computed here

    @property
    def exports(self) -> bool:
        return self.role in ("kv_producer", "kv_both")

    @property
    def imports(self) -> bool:
        return self.role in ("kv_consumer", "kv_both")


def parse_kv_transfer_config(text: str) -> KVTransferConfig:
    """``--kv-transfer-config``'s JSON; ValueError naming what is wrong (another connector
    than jserve's is refused: jserve moves pages only with its own)."""
    try:
        d = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"--kv-transfer-config is not JSON: {e}") from None
    if not isinstance(d, dict):
        raise ValueError("--kv-transfer-config must be a JSON object")
    known = {"kv_connector", "kv_role", "kv_connector_extra_config", "kv_buffer_device"}
    extra = sorted(set(d) - known)
    if extra:
        raise ValueError(f"--kv-transfer-config: {extra[0]} is not supported by jserve")
    if d.get("kv_connector") != CONNECTOR:
        raise ValueError(f"--kv-transfer-config: kv_connector {d.get('kv_connector')!r} is "
                         f"not supported by jserve; it moves KV pages with {CONNECTOR!r} only")
    if d.get("kv_role") not in KV_ROLES:
        raise ValueError(f"--kv-transfer-config: kv_role must be one of {KV_ROLES}, got "
                         f"{d.get('kv_role')!r}")
    x = d.get("kv_connector_extra_config") or {}
    if not isinstance(x, dict) or set(x) - {"peers", "timeout_s"}:
        raise ValueError("--kv-transfer-config: kv_connector_extra_config takes peers (a "
                         "list of base URLs) and timeout_s")
    peers = x.get("peers", [])
    if not isinstance(peers, list) or not all(
            isinstance(p, str) and p.startswith(("http://", "https://")) for p in peers):
        raise ValueError("--kv-transfer-config: peers must be a list of http(s) base URLs")
    timeout = x.get("timeout_s", KVTransferConfig.timeout_s)
    if not isinstance(timeout, (int, float)) or isinstance(timeout, bool) or timeout <= 0:
        raise ValueError(f"--kv-transfer-config: timeout_s must be > 0, got {timeout!r}")
    return KVTransferConfig(d["kv_role"], tuple(p.rstrip("/") for p in peers), float(timeout))


@dataclasses.dataclass(frozen=True)
class TransferParams:
    """A request's ``kv_transfer_params``."""

    do_remote_decode: bool = False   # a prefill whose pages another engine will pull
    do_remote_prefill: bool = False  # pull the prompt's pages from ``remote_url`` first
    remote_url: str | None = None


def parse_transfer_params(value: Any) -> TransferParams:
    """``kv_transfer_params`` as a body gives it; ``FieldError`` naming the part that is
    wrong."""
    name = "kv_transfer_params"
    if not isinstance(value, dict):
        raise FieldError(name, f"{name} must be an object, got {fields.shown(value)}")
    extra = sorted(set(value) - TRANSFER_FIELDS - VLLM_TRANSFER_FIELDS)
    if extra:
        raise FieldError(f"{name}.{extra[0]}", f"{name}.{extra[0]} is not supported by jserve")
    for f in ("do_remote_decode", "do_remote_prefill"):
        if value.get(f) is not None and not isinstance(value[f], bool):
            raise FieldError(f"{name}.{f}", f"{name}.{f} must be a bool")
    url = value.get("remote_url")
    host, port = value.get("remote_host"), value.get("remote_port")
    if url is None and isinstance(host, str) and isinstance(port, int):
        url = f"http://{host}:{port}"
    if value.get("do_remote_prefill") and not isinstance(url, str):
        raise FieldError(f"{name}.remote_url", f"{name}.do_remote_prefill needs remote_url "
                                             "(or remote_host and remote_port), the prefill "
                                             "engine's address")
    return TransferParams(value.get("do_remote_decode") or False,
                          value.get("do_remote_prefill") or False, url)


def handoff(url: str) -> dict:
    """A prefill response's ``kv_transfer_params``: what the decode request sends (a vLLM
    proxy copies it there as is) to pull the pages from ``url``, this engine as the client
    reached it."""
    host, _, port = url.removeprefix("http://").removeprefix("https://").rpartition(":")
    return {"do_remote_prefill": True, "do_remote_decode": False, "remote_url": url,
            "remote_host": host, "remote_port": int(port) if port.isdigit() else None}
