"""``jserve serve`` and ``jserve generate --server``: the CLI side of the gRPC service (kept
here so ``jserve/cli.py`` only wires them in). Like the CLI's, each command imports the
server, the client, the model loader or the fake engine inside its own function, so building
the parser loads none of them (JAX and gRPC stay off ``jserve --help``'s path)."""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import re
import sys
from typing import Callable

from jserve.engine.config import EngineConfig
from jserve.fields import MAX_TOKEN_LOGPROBS
from jserve.flags.vllm_names import VLLM_REFUSED, check_tokenizer
from jserve.log_setup import configure_logging
from jserve.lora.config import lora_module_bases
from jserve.sampling.generation_config import describe, generation_defaults
from jserve.scheduler import ENGINE_POLICIES
from jserve.serving.front_command import add_scale_out_args, check_scale_out, front_command
from jserve.serving.kv_params import parse_kv_transfer_config
from jserve.serving.limits import ClientLimits
from jserve.serving.reasoning import FORMATS as REASONING
from jserve.serving.tool_formats import DEFAULT_FORMAT, TOOL_FORMATS

TOKEN_ENV = "JSERVE_AUTH_TOKEN"
PRIORITY_TOKEN_ENV = "JSERVE_PRIORITY_TOKEN"

TOOL_CALL_PARSERS = tuple(TOOL_FORMATS)  # the formats jserve.serving.tool_formats reads
_NUMBER = re.compile(r"-\d+(\.\d*)?")  # a negative value, not a flag


def add_remote_args(g: argparse.ArgumentParser) -> None:
    """``jserve generate`` flags for talking to a server instead of loading a model."""
    g.add_argument("--server", default=None, metavar="HOST:PORT",
                   help="stream from a running `jserve serve` instead of loading the model")
    g.add_argument("--auth-token", default=None,
                   help=f"bearer token for --server (default: ${TOKEN_ENV})")
    g.add_argument("--tls-ca", default=None, metavar="PEM",
                   help="use TLS to --server, trusting this CA certificate")
    g.add_argument("--timeout", type=float, default=None, help="gRPC deadline in seconds")


def add_multihost_args(p: argparse.ArgumentParser) -> None:
    """Flags of a multi-process launch (docs/multihost.md): every process runs the same
    command with its own ``--process-id``."""
    g = p.add_argument_group("multi-host (one process per host, see docs/multihost.md)")
    g.add_argument("--coordinator", default=None, metavar="HOST:PORT",
                   help="process 0's address, the same for every process")
    g.add_argument("--num-processes", type=int, default=1,
                   help="processes serving one engine (multi-host; docs/multihost.md)")
    g.add_argument("--process-id", type=int, default=0,
                   help="0 serves (or generates); the others run the steps it broadcasts")
    g.add_argument("--local-devices", type=int, default=None,
                   help="CPU devices of this process (testing multi-host on one machine)")


def join_processes(a: argparse.Namespace) -> None:
    """Starts JAX's distributed runtime when ``--coordinator`` is given; before any JAX work."""
    if a.coordinator is not None:
        from sharding import distributed  # JAX: only multi-host runs load it here
        distributed.initialize(a.coordinator, a.num_processes, a.process_id, a.local_devices)


@contextlib.contextmanager
def leading(a: argparse.Namespace, engine):
    """Yields True on the process that does the work (process 0, or the only one); on the
    others runs the leader's steps until it stops and yields False. The leader releases its
    followers when its block ends, however it ends."""
    if a.coordinator is None:
        yield True
        return
    from sharding import distributed  # JAX: only multi-host runs load it here
    if not distributed.is_leader():
        distributed.follow(engine.runner)
        yield False
        return
    try:
        yield True
    finally:
        distributed.stop_followers()


def refused_vllm_flags(unrecognized: list[str]) -> list[str]:
    """Lines saying why each well-known vLLM flag among argparse's unrecognized arguments is
    refused (and naming the other unknown flags); empty when none of them is one."""
    names = dict.fromkeys(t.split("=", 1)[0] for t in unrecognized
                          if t.startswith("-") and not _NUMBER.fullmatch(t))
    lines = [f"{n}: vLLM's flag is not supported by jserve: {VLLM_REFUSED[n]}" for n in names
             if n in VLLM_REFUSED]
    others = [n for n in names if n not in VLLM_REFUSED]
    if lines and others:
        lines.append("unrecognized arguments: " + " ".join(others))
    return lines


def max_logprobs(text: str) -> int:
    """``--max-logprobs``'s type: at most jserve's fixed ``MAX_TOKEN_LOGPROBS``."""
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if not 0 <= n <= MAX_TOKEN_LOGPROBS:
        raise argparse.ArgumentTypeError(
            f"jserve returns at most {MAX_TOKEN_LOGPROBS} logprobs a token (a fixed limit), "
            f"got {n}{' (vLLM: the whole vocabulary)' if n == -1 else ''}")
    return n


def tool_call_parser(text: str) -> str:
    if text not in TOOL_CALL_PARSERS:
        known = "; ".join(f"{f.name} ({f.summary})" for f in TOOL_FORMATS.values())
        raise argparse.ArgumentTypeError(f"{text!r} is not supported yet: jserve reads tool "
                                         f"calls in these formats: {known}")
    return text


def reasoning_parser(text: str) -> str:
    if text not in REASONING:
        raise argparse.ArgumentTypeError(f"{text!r} is not supported yet: jserve reads "
                                         f"reasoning in the formats {', '.join(REASONING)}")
    return text


def add_serve_parser(sub, add_engine_args: Callable, engine_kwargs: Callable) -> None:
    s = sub.add_parser("serve", help="serve the jserve.v1.Generation gRPC service and the "
                                     "OpenAI-compatible HTTP API from one engine")
    s.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                   help="the model, as --model takes it (vLLM's spelling: `jserve serve DIR`); "
                        "None: --model's")
    add_engine_args(s, warmup="all")
    add_multihost_args(s)
    s.add_argument("--served-model-name", nargs="+", default=None, metavar="NAME",
                   help="names requests may give as `model` (the first is the one /v1/models "
                        "and GetModelInfo report); default: --model's value for the built-in "
                        "models, the directory's name for a checkpoint directory")
    s.add_argument("--scheduler", choices=ENGINE_POLICIES, default="sarathi",
                   help="the scheduling policy (docs/scheduler.md)")
    s.add_argument("--length-probe", default=None,
                   help="output-length probe .npz (sprpt; default: the model's shipped one)")
    s.add_argument("--sprpt-c", type=float, default=0.8,
                   help="sprpt preempts a request only while generated <= c x first prediction")
    add_edge_args(s)
    add_limit_args(s)
    s.add_argument("--grace-period", type=float, default=30.0,
                   help="seconds in-flight requests get to finish after SIGTERM")
    s.add_argument("--drain-notice", type=float, default=0.0,
                   help="seconds after SIGTERM during which /health (and the gRPC health "
                        "check) fail while requests are still served, so a router stops "
                        "sending before the drain refuses anything")
    s.add_argument("--tls-cert", "--ssl-certfile", dest="tls_cert", default=None,
                   help="PEM certificate chain (with --tls-key): TLS on gRPC and HTTP")
    s.add_argument("--tls-key", "--ssl-keyfile", dest="tls_key", default=None,
                   help="PEM private key (with --tls-cert)")
    s.add_argument("--auth-token", "--api-key", dest="auth_token", default=None,
                   help="require 'authorization: Bearer TOKEN' on gRPC and HTTP (--api-key: "
                        f"vLLM's name) (default: ${TOKEN_ENV})")
    s.add_argument("--metrics-open", action="store_true",
                   help="serve /metrics without the bearer token even with --auth-token")
    s.add_argument("--fake-engine", action="store_true",
                   help="serve jserve.serving.fake_engine's scripted tokens instead of the "
                        "model (with a checkpoint directory's tokenizer; no JAX): for testing "
                        "clients, routers and the edge")
    s.add_argument("--engine-process", action="store_true",
                   help="run the engine core in a process of its own: the front end's "
                        "Python (HTTP, SSE, tokenization) shares no GIL with its steps "
                        "(docs/server.md: on a 2-core CPU it changes nothing measurable)")
    s.add_argument("--log-level", default="INFO",
                   help="jserve's log level (other libraries log from WARNING up; DEBUG: all)")
    add_vllm_args(s)
    add_scale_out_args(s)
    g = s.add_argument_group("Ray Serve (docs/scale_out.md): replicas of this engine behind a "
                             "router, the OpenAI API on --port (no gRPC)")
    g.add_argument("--ray", action="store_true", help="serve as a Ray Serve application")
    g.add_argument("--replicas", type=int, default=2, help="engines (one per Ray replica)")
    g.add_argument("--router", default="deadline",
                   choices=("round_robin", "least_load", "prefix", "deadline"),
                   help="how the ingress picks a replica (jserve.routing)")
    g.add_argument("--autoscale", default=None, metavar="MIN,MAX",
                   help="replicas follow queue depth between MIN and MAX instead of --replicas")
    g.add_argument("--gpus-per-replica", type=float, default=0.0,
                   help="GPUs Ray reserves for each replica")
    g.add_argument("--ray-address", default=None, help="a running Ray cluster (default: local)")
    s.set_defaults(func=lambda a: serve_command(a, engine_kwargs(a)))


def add_edge_args(s: argparse.ArgumentParser) -> None:
    """Where the server listens and what its edge takes (docs/server.md, "Limits")."""
    s.add_argument("--host", default="127.0.0.1",
                   help="address of every endpoint (0.0.0.0: all interfaces; without "
                        "--auth-token the server then says loudly that it is open)")
    s.add_argument("--port", "--http-port", dest="http_port", type=int, default=8000,
                   help="the OpenAI-compatible HTTP API's port, as vLLM's --port "
                        "(/v1/completions, /v1/chat/completions, /v1/models, /health, "
                        "/metrics; 0: any free port; -1: off; --http-port: its name before)")
    s.add_argument("--grpc-port", type=int, default=50051,
                   help="gRPC port (0: any free port; --port was gRPC's before, it is the "
                        "OpenAI API's now)")
    s.add_argument("--metrics-port", type=int, default=9400,
                   help="Prometheus /metrics port (0: any free port; -1: off)")
    s.add_argument("--max-waiting", type=int, default=1024,
                   help="admission queue size; further requests get RESOURCE_EXHAUSTED")
    s.add_argument("--max-request-bytes", type=int, default=4 << 20,
                   help="larger requests get HTTP 413 / RESOURCE_EXHAUSTED, refused while "
                        "reading; the edge then reads and drops the rest for up to 30 s / "
                        "256 MiB so that the client sees the 413")
    s.add_argument("--responses-store-mib", type=float, default=64,
                   help="memory for the Responses API's stored responses (for "
                        "previous_response_id and GET /v1/responses/{id}), least recently "
                        "used dropped first; 0: none kept")
    s.add_argument("--head-timeout", type=float, default=10.0,
                   help="seconds from accept (or a kept-alive connection's next request's "
                        "first byte) to the end of the request head on the HTTP ports; "
                        "later: closed")
    s.add_argument("--body-timeout", type=float, default=30.0,
                   help="seconds from the end of a request head to the end of its body on "
                        "the HTTP ports, in all (a body a byte a second is cut too); later: "
                        "408 and closed")
    s.add_argument("--max-head-bytes", type=int, default=64 << 10,
                   help="request line and headers at most (HTTP ports); larger: 431")
    s.add_argument("--max-connections", type=int, default=2048,
                   help="open connections per HTTP port (API, metrics); a request on one "
                        "more gets 503 and the connection is closed")


def add_vllm_args(s: argparse.ArgumentParser) -> None:
    """`vllm serve`'s flags that have no jserve flag to be an alias of (docs/compatibility.md;
    the aliases are beside jserve's flags)."""
    g = s.add_argument_group("vLLM's flags (docs/compatibility.md)")
    g.add_argument("--seed", type=int, default=EngineConfig.seed,
                   help="seeds the draws of requests that bring no seed of their own "
                        "(EngineConfig.seed)")
    g.add_argument("--max-logprobs", type=max_logprobs, default=MAX_TOKEN_LOGPROBS,
                   help=f"accepted up to jserve's fixed limit of {MAX_TOKEN_LOGPROBS} logprobs "
                        f"a token, refused above it; requests may ask up to "
                        f"{MAX_TOKEN_LOGPROBS} whatever the value")
    g.add_argument("--tokenizer", default=None, metavar="DIR",
                   help="read the tokenizer (tokenizer.json, tokenizer_config.json and its "
                        "chat template) from DIR instead of the model's directory; refused if "
                        "its vocabulary is larger than the model's embedding; None: the "
                        "model's")
    g.add_argument("--trust-remote-code", action="store_true",
                   help="accepted and changes nothing: jserve runs no code from a checkpoint "
                        "(chat templates render in a sandbox)")
    g.add_argument("--chat-template", default=None, metavar="FILE_OR_TEMPLATE",
                   help="a Jinja chat template (a file, or the template itself) instead of "
                        "the tokenizer's, for /v1/chat/completions (needs a tokenizer.json "
                        "model; not with --ray); None: the tokenizer's")
    g.add_argument("--tool-call-parser", type=tool_call_parser, default=DEFAULT_FORMAT,
                   help=f"the format the model writes tool calls in, one of "
                        f"{', '.join(TOOL_CALL_PARSERS)} (jserve.serving.tool_formats); any "
                        f"other is refused (default: {DEFAULT_FORMAT})")
    g.add_argument("--reasoning-parser", type=reasoning_parser, default=None,
                   help=f"how a thinking model's chat replies split into reasoning and answer "
                        f"(message.reasoning and .content): one of {', '.join(REASONING)} "
                        f"(jserve.serving.reasoning); any other is refused (default: none, "
                        f"replies are all content)")
    g.add_argument("--enable-auto-tool-choice", action="store_true",
                   help="accepted and changes nothing: tool_choice auto is always on "
                        "(calls read in --tool-call-parser's format)")


class _OldTpotSlo(argparse.Action):
    """Stores the value; says so on stderr when the old spelling was used."""

    def __call__(self, parser, namespace, values, option_string=None):
        if option_string == "--tpot-slo":
            print(f"jserve: {option_string} is deprecated; use {self.option_strings[0]}",
                  file=sys.stderr)
        setattr(namespace, self.dest, values)


def add_budget_arg(g, default: float) -> None:
    """``--iteration-budget`` (``--tpot-slo``, its name before, deprecated: a request's own
    ``tpot_slo`` is another thing)."""
    g.add_argument("--iteration-budget", "--tpot-slo", dest="iteration_budget", type=float,
                   default=default, action=_OldTpotSlo,
                   help="the deadline policies' time budget of one iteration (seconds; "
                        "--tpot-slo: deprecated)")


def add_limit_args(s: argparse.ArgumentParser) -> None:
    """What one client may ask for (jserve.serving.limits, docs/server.md "Limits")."""
    d = ClientLimits()
    g = s.add_argument_group("client limits (per-request fields are requests, not orders)")
    add_budget_arg(g, EngineConfig.iteration_budget)
    g.add_argument("--prefill-share", type=float, default=EngineConfig.prefill_share,
                   help="share of --iteration-budget that prefills keep in every iteration "
                        "however tight a request's own tpot_slo")
    g.add_argument("--min-tpot-slo", type=float, default=d.min_tpot_slo,
                   help="smallest tpot_slo a request may ask (seconds; raised to the "
                        "predicted time of a lone decode step)")
    g.add_argument("--min-ttft-slo", type=float, default=d.min_ttft_slo,
                   help="smallest ttft_slo a request may ask (seconds; raised to the "
                        "request's isolated prefill time)")
    g.add_argument("--priority-range", default="%d,%d" % d.priority_range, metavar="LO,HI",
                   help="priorities a request may carry (lower runs first; 0 is the default)")
    g.add_argument("--priority-token", default=None,
                   help="bearer token of clients that may set a priority below 0 (ahead of "
                        f"the default); also admits them (default: ${PRIORITY_TOKEN_ENV})")
    g.add_argument("--trust-client-priority", action="store_true",
                   help="every client may set a priority below 0")
    g.add_argument("--max-choices", type=int, default=d.max_choices,
                   help="prompts x n of one HTTP request at most")


def sampling_defaults(a: argparse.Namespace) -> dict:
    """The served requests' sampling defaults (``--generation-config``)."""
    from jserve.config import model_dir

    return generation_defaults(a.generation_config, model_dir(a.model),
                               a.override_generation_config)


def served_model_names(a: argparse.Namespace) -> tuple[str, ...]:
    """``--served-model-name``, or the default: a built-in model's name as given, a
    checkpoint directory's own name (not its path on the server's disk)."""
    from jserve.config import BUILTIN_MODELS

    if a.served_model_name:
        if not all(a.served_model_name):
            raise SystemExit("jserve: error: --served-model-name: a name may not be empty")
        return tuple(dict.fromkeys(a.served_model_name))
    if a.model == "default" or a.model in BUILTIN_MODELS:
        return (a.model,)
    return (os.path.basename(os.path.abspath(a.model)) or a.model,)


def client_limits(a: argparse.Namespace) -> ClientLimits:
    try:
        lo, hi = (int(x) for x in a.priority_range.split(","))
    except ValueError:
        raise SystemExit(f"jserve: error: --priority-range must be LO,HI, "
                         f"got {a.priority_range!r}") from None
    return ClientLimits(min_tpot_slo=a.min_tpot_slo, min_ttft_slo=a.min_ttft_slo,
                        priority_range=(lo, hi), trust_priority=a.trust_client_priority,
                        priority_token=a.priority_token or os.environ.get(PRIORITY_TOKEN_ENV)
                        or None, max_choices=a.max_choices)


def ray_command(a: argparse.Namespace, engine_kwargs: dict) -> int:
    from jserve.serving.ray_app import run  # Ray: only --ray loads it

    engine = dict(llm_kwargs(a, engine_kwargs), dtype=a.dtype)
    args = dict(model=a.model, replicas=a.replicas, router=a.router, engine=engine,
                server=dict(served_model_names=served_model_names(a),
                            max_waiting=a.max_waiting, max_request_bytes=a.max_request_bytes,
                            auth_token=a.auth_token or os.environ.get(TOKEN_ENV) or None,
                            metrics_open=a.metrics_open, limits=client_limits(a),
                            tool_call_parser=a.tool_call_parser,
                            reasoning_parser=a.reasoning_parser,
                            sampling_defaults=sampling_defaults(a)),
                num_gpus=a.gpus_per_replica, address=a.ray_address, grace_s=a.grace_period)
    if a.autoscale:
        args["autoscale"] = a.autoscale
    port = 8000 if a.http_port <= 0 else a.http_port
    return run(args, a.host, port, ready=lambda: print(
        f"jserve: serving {a.model} on Ray Serve, OpenAI API http://{a.host}:{port}/v1 "
        f"({a.autoscale or a.replicas} replicas behind {a.router})", flush=True))


def read_chat_template(arg: str) -> str:
    """``--chat-template``'s text: the file's, or ``arg`` itself when it is a template (as
    vLLM reads it); ValueError when it is neither or does not compile."""
    from jinja2 import TemplateSyntaxError

    from jserve.tokenizer import compile_chat_template

    if os.path.isfile(arg):
        with open(arg, encoding="utf-8") as f:
            text = f.read()
    elif "{" in arg or "\n" in arg:
        text = arg
    else:
        raise ValueError(f"--chat-template {arg!r}: no such file, nor a template")
    try:
        compile_chat_template(text)
    except TemplateSyntaxError as e:
        raise ValueError(f"--chat-template: not a Jinja template: {e}") from None
    return text


def _has_tokenizer_json(model: str) -> bool:
    from jserve.config import BUILTIN_MODELS

    return model != "default" and os.path.isfile(
        os.path.join(BUILTIN_MODELS.get(model, model), "tokenizer.json"))


def vllm_args(a: argparse.Namespace) -> str | None:
    """The vLLM spellings that need more than argparse, checked before anything loads: the
    positional model becomes ``a.model``; ``--tokenizer`` must hold a tokenizer.json;
    ``--chat-template`` is read. Returns the chat template's text (None: the tokenizer's)."""
    if a.model_tag is not None:
        if a.model not in ("default", a.model_tag):
            raise ValueError(f"the model is given twice: {a.model_tag!r} and --model {a.model!r}")
        a.model = a.model_tag
    check_tokenizer(a.tokenizer, a.model)
    if a.chat_template is None:
        return None
    if a.ray:
        raise ValueError("--chat-template is not supported with --ray yet")
    if not a.fake_engine and not _has_tokenizer_json(a.tokenizer or a.model):
        raise ValueError(f"--chat-template: model {a.model!r} has no tokenizer.json, so no "
                         "chat template to replace")
    return read_chat_template(a.chat_template)


def server_config(a: argparse.Namespace, sampling_defaults: dict):
    """The ``ServerConfig`` of ``jserve serve``'s flags."""
    from jserve.serving.app import ServerConfig

    return ServerConfig(
        host=a.host, port=a.grpc_port,
        metrics_port=None if a.metrics_port < 0 else a.metrics_port,
        http_port=None if a.http_port < 0 else a.http_port,
        max_waiting=a.max_waiting, max_request_bytes=a.max_request_bytes,
        head_timeout=a.head_timeout, body_timeout=a.body_timeout,
        max_head_bytes=a.max_head_bytes, max_connections=a.max_connections,
        grace_period=a.grace_period,
        drain_notice=a.drain_notice, tls_cert=a.tls_cert, tls_key=a.tls_key,
        auth_token=a.auth_token or os.environ.get(TOKEN_ENV) or None,
        metrics_open=a.metrics_open, served_model_names=served_model_names(a),
        limits=client_limits(a), tool_call_parser=a.tool_call_parser,
        reasoning_parser=a.reasoning_parser, sampling_defaults=sampling_defaults,
        responses_store_bytes=int(a.responses_store_mib * (1 << 20)),
        kv_transfer=None if a.kv_transfer_config is None
        else parse_kv_transfer_config(a.kv_transfer_config))


def check_lora_names(lora, names: tuple[str, ...], ray: bool = False,
                     bases: dict[str, str] | None = None) -> None:
    """``--lora-modules``' names are not the base model's (a request's ``model`` picks one
    or the other) and the base each names (vLLM's JSON form's ``base_model_name``) is this
    server's model; runtime loading needs one engine (under --ray a load would reach one
    replica)."""
    if lora is None:
        return
    wrong = {n: b for n, b in (bases or {}).items() if b not in names}
    if wrong:
        raise ValueError(f"--lora-modules: base_model_name {wrong} is not the model served "
                         f"({list(names)})")
    taken = sorted({n for n, _ in lora.modules} & set(names))
    if taken:
        raise ValueError(f"--lora-modules: {taken} also named the base model "
                         "(--served-model-name); give the adapters other names")
    if ray and lora.runtime_updating:
        raise ValueError("--enable-runtime-lora-updating is not supported with --ray yet (a "
                         "load would reach one replica); name the adapters in --lora-modules")


def lora_line(lora, info) -> str:
    """The start-up line of the adapters served."""
    names = ", ".join(f"{n} ({p})" for n, p in lora.modules) or "none yet"
    return (f"jserve: LoRA adapters: {names}; --max-loras {info.max_loras} on the device, "
            f"--max-lora-rank {info.max_lora_rank}; runtime loading "
            f"{'on (/v1/load_lora_adapter)' if info.runtime_lora_updating else 'off'}")


def llm_kwargs(a: argparse.Namespace, engine_kwargs: dict) -> dict:
    """The ``LLM(...)`` arguments of ``jserve serve``'s engine, whichever process or Ray
    replica builds it (``live_engine.EngineSpec``)."""
    return dict(quantization=a.quantization, scheduler=a.scheduler,
                length_probe=a.length_probe, sprpt_c=a.sprpt_c,
                iteration_budget=a.iteration_budget, prefill_share=a.prefill_share,
                tokenizer=a.tokenizer, generation_config=a.generation_config,
                override_generation_config=a.override_generation_config, **engine_kwargs)


def serve_engine(a: argparse.Namespace, engine_kwargs: dict):
    """The engine ``jserve serve`` serves (an ``LLMEngine``, a ``ProcessEngine`` or a
    ``FakeEngine``) and what the start-up line says of it."""
    # Imported here: the model loads JAX, which `jserve simulate` and `--help` never need.
    from jserve.serving.fake_engine import FakeEngine
    from jserve.serving.live_engine import EngineSpec, build_engine
    from jserve.serving.process_engine import ProcessEngine

    if a.fake_engine:
        return FakeEngine.for_model(a.tokenizer or a.model, max_model_len=a.max_model_len or 512,
                                    max_num_seqs=a.max_num_seqs or 8,
                                    lora=engine_kwargs.get("lora")), "fake (scripted tokens)"
    spec = EngineSpec(a.model, a.dtype, llm_kwargs(a, engine_kwargs),
                      max_waiting=a.max_waiting, log_level=a.log_level)
    if a.engine_process:  # its own interpreter builds it (and starts JAX there)
        engine = ProcessEngine(spec)
        return engine, f"{engine.startup_line} (engine core in process {engine.pid})"
    engine = build_engine(spec)  # after join_processes: starts JAX
    return engine, engine.startup.line()


def serve_command(a: argparse.Namespace, engine_kwargs: dict) -> int:
    chat_template = vllm_args(a)
    engine_kwargs = dict(engine_kwargs, seed=a.seed)
    lora = engine_kwargs.get("lora")
    check_lora_names(lora, served_model_names(a), a.ray,
                     lora_module_bases(getattr(a, "lora_modules", None)))
    check_scale_out(a)
    clash = [f for f, on in (("--ray", a.ray), ("--coordinator", a.coordinator is not None),
                             ("--fake-engine", a.fake_engine)) if on]
    if a.engine_process and clash:
        raise ValueError(f"--engine-process is not supported with {clash[0]}")
    if a.ray:
        return ray_command(a, engine_kwargs)
    if a.data_parallel_size > 1:
        configure_logging(a.log_level)
        return front_command(a, server_config(a, {}))

    # Imported here: the server loads gRPC, which `jserve simulate` and `--help` never need.
    from jserve.serving.app import serve

    configure_logging(a.log_level)
    defaults = sampling_defaults(a)
    config = server_config(a, defaults)
    join_processes(a)
    engine, startup = serve_engine(a, engine_kwargs)
    if chat_template is not None:
        if not hasattr(engine.tokenizer, "set_chat_template"):
            raise ValueError(f"--chat-template: model {a.model!r} has no tokenizer.json, so "
                             "no chat template to replace")
        engine.tokenizer.set_chat_template(chat_template)

    def ready(server) -> None:
        metrics = (f"http://{a.host}:{server.metrics_port}/metrics"
                   if server.metrics_port is not None else "off")
        http = (f"; OpenAI API http://{a.host}:{server.http_port}/v1"
                if server.http_port is not None else "")
        name = config.model_name if config.model_name == a.model else \
            f"{config.model_name} (--model {a.model})"
        print(f"jserve: serving {name} on {a.host}:{server.port} "
              f"({'TLS' if a.tls_cert else 'plaintext'}; metrics {metrics}{http}); engine "
              f"{startup}", flush=True)
        print(f"jserve: client limits: {server.gateway.limits.describe()}, requests <= "
              f"{config.max_request_bytes} bytes", flush=True)
        if lora is not None:
            print(lora_line(lora, server.engine.info), flush=True)
        if defaults:  # vLLM says so too: the model's creator changed the sampling defaults
            print(f"jserve: sampling defaults from the model's generation_config.json: "
                  f"{describe(defaults)} (--generation-config vllm: none)", flush=True)
        if config.open_to_the_network:
            print(f"jserve: WARNING: listening on {a.host} with no --auth-token: anyone who "
                  f"can reach this host can use the server", file=sys.stderr, flush=True)
    with leading(a, engine) as leader:
        if not leader:
            return 0
        try:
            rc = asyncio.run(serve(engine, config, ready=ready))
        except (OSError, RuntimeError) as e:  # a port in use, an unreadable certificate
            print(f"jserve: error: {e}", file=sys.stderr)
            return 1
    # The engine thread may still be finishing a step (or a compile) it cannot be stopped in,
    # and tearing JAX down takes a while: the drain is over, so leave now.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(rc)


def generate_remote(a: argparse.Namespace, params) -> int:
    # Imported here: gRPC, which the CLI's other commands never need.
    import grpc

    from jserve.client import Client
    from jserve.proto import generate_pb2 as pb

    if a.chat:
        print("jserve: error: --chat needs the local model's template; not with --server",
              file=sys.stderr)
        return 2
    prompt = [int(t) for t in a.prompt.replace(",", " ").split()] if a.token_ids else a.prompt
    ca = open(a.tls_ca, "rb").read() if a.tls_ca else None
    token = a.auth_token or os.environ.get(TOKEN_ENV)
    try:
        with Client(a.server, auth_token=token, root_certificates=ca) as c:
            n = 0
            for r in c.stream(prompt, params, timeout=a.timeout):
                sys.stdout.write(r.text)
                sys.stdout.flush()
                n += len(r.token_ids)
                if r.finish_reason:
                    sys.stdout.write("\n")
                    reason = "stop" if r.finish_reason == pb.FINISH_REASON_STOP else "length"
                    print(f"[{n} tokens, finish_reason={reason}]", file=sys.stderr)
    except grpc.RpcError as e:
        print(f"jserve: error: {e.code().name}: {e.details()}", file=sys.stderr)
        return 2 if e.code() == grpc.StatusCode.INVALID_ARGUMENT else 1
    return 0
