"""A model's own default sampling settings: its ``generation_config.json`` (what transformers'
``generate`` reads, and vLLM's ``--generation-config auto``), for requests that leave them
unset. Qwen2.5's, say, asks for temperature 0.7, top_p 0.8, top_k 20 and a repetition
penalty of 1.05; a server that ignored them would sample the same model differently from
vLLM for every client that sends no sampling fields.

``generation_defaults(setting, model_dir, overrides)`` gives the defaults as ``SamplingParams``
fields: ``setting`` "auto" reads the model directory's file, "vllm" none (the API's own
defaults), any other value is a directory to read one from; ``overrides`` (vLLM's
``--override-generation-config``) are merged on top. ``max_new_tokens`` becomes
``max_tokens``, which serving also takes as a cap on every request (as vLLM). Every value is
checked as a request's would be, naming the file and key.
"""
from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from pathlib import Path

from jserve import fields
from jserve.sampling.params import SamplingParams

# generation_config.json keys -> the SamplingParams field each sets by default.
KEYS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
        "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}
SETTINGS = ("auto", "vllm")  # or a directory
FILE = "generation_config.json"


def _checked(values: Mapping, where: str) -> dict:
    out = {}
    for key, value in values.items():
        if key not in KEYS or value is None:
            continue
        field = KEYS[key]
        try:
            out[field] = fields.number(field, value, name=key)
        except ValueError as e:
            raise ValueError(f"{where}: {e}") from None
    return out


def read_generation_config(directory: str | Path) -> dict:
    """The sampling defaults in ``directory``'s generation_config.json ({} without one);
    keys other than ``KEYS`` (EOS ids, ``do_sample``, ...) are not sampling defaults."""
    path = Path(directory) / FILE
    if not path.is_file():
        return {}
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"{path}: not a JSON object ({e})") from None
    if not isinstance(config, dict):
        raise ValueError(f"{path}: not a JSON object")
    return _checked(config, str(path))


def generation_defaults(setting: str, model_dir: str | Path | None,
                        overrides: Mapping | None = None) -> dict:
    """The requests' default ``SamplingParams`` fields: from the model's directory
    ``model_dir`` ("auto"; None, the built-in random model, has none), from none ("vllm"),
    or from the directory ``setting``; then ``overrides`` (generation_config keys), checked
    the same way."""
    if setting == "vllm":
        found = {}
    elif setting == "auto":
        found = read_generation_config(model_dir) if model_dir is not None else {}
    elif Path(setting).is_dir():
        found = read_generation_config(setting)
    else:
        raise ValueError(f"generation_config must be 'auto', 'vllm' or a directory, got "
                         f"{setting!r}")
    overrides = dict(overrides or {})
    unknown = sorted(set(overrides) - set(KEYS))
    if unknown:
        raise ValueError(f"override_generation_config: {unknown[0]!r} is not one of the "
                         f"sampling keys jserve reads ({', '.join(KEYS)})")
    return {**found, **_checked(overrides, "override_generation_config")}


def capped(params: SamplingParams, defaults: Mapping | None) -> SamplingParams:
    """``params`` with ``max_tokens`` at most the defaults' (the model's ``max_new_tokens``:
    a cap on every served request, as vLLM's; a ``min_tokens`` above it wins)."""
    cap = (defaults or {}).get("max_tokens")
    if cap is None or params.max_tokens <= cap:
        return params
    return dataclasses.replace(params, max_tokens=max(cap, params.min_tokens))


def describe(defaults: Mapping) -> str:
    return ", ".join(f"{k}={v:g}" if isinstance(v, float) else f"{k}={v}"
                     for k, v in defaults.items())
