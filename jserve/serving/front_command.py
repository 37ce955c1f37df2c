"""``jserve serve --data-parallel-size N`` (``-dp N``): the flags past one engine and the
command that starts the engines and the front end (``engines``, ``front``, ``front_grpc``).

Why these flags: vLLM spells data parallelism ``--data-parallel-size``, which jserve takes as
is. vLLM has no one command for prefill/decode disaggregation: its prefill and decode
servers start apart, each with ``--kv-transfer-config`` naming its role, and a proxy in
front. jserve's front end starts the engines itself, so it sets each one's
``--kv-transfer-config`` (jserve's connector, its role and its peers) and takes only how
many engines prefill (``--prefill-engines``) and who decides (``--disaggregation``). An
engine started on its own takes ``--kv-transfer-config`` in vLLM's JSON shape.
"""
from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys

from jserve.routing import MODES, ROUTERS

log = logging.getLogger(__name__)


def add_scale_out_args(s: argparse.ArgumentParser) -> None:
    g = s.add_argument_group("past one engine (docs/scale_out.md): N engine processes behind "
                             "one front end, and prefill/decode disaggregation")
    g.add_argument("--data-parallel-size", "-dp", type=int, default=1, metavar="N",
                   help="engines, each a process of its own with its own devices, behind "
                        "one front end (--port, --grpc-port) that places each request")
    g.add_argument("--prefill-engines", type=int, default=0, metavar="K",
                   help="of the N engines, K only prefill: the router may run a prompt on "
                        "one and hand its KV pages to a decode engine")
    g.add_argument("--disaggregation", choices=MODES, default="auto",
                   help="with --prefill-engines: per request by deadline (auto), or always, "
                        "or never (every prompt prefilled on its decode engine)")
    g.add_argument("--front-router", choices=ROUTERS, default="deadline",
                   help="how the front end picks an engine (jserve.routing)")
    g.add_argument("--engine-devices", type=int, default=None, metavar="K",
                   help="engine i sees accelerators [i*K, (i+1)*K) (CUDA_VISIBLE_DEVICES, "
                        "TPU_VISIBLE_CHIPS); default: every engine sees all")
    g.add_argument("--kv-transfer-config", default=None, metavar="JSON",
                   help='this engine\'s part in disaggregation, vLLM\'s shape: {"kv_connector": '
                        '"JServeConnector", "kv_role": "kv_producer"|"kv_consumer"|"kv_both", '
                        '"kv_connector_extra_config": {"peers": [URL, ...], "timeout_s": S}} '
                        "(set by the front end for its engines)")
    g.add_argument("--kv-transfer-timeout", type=float, default=30.0,
                   help="seconds a decode engine waits for a prompt's pages before computing "
                        "them itself")


def check_scale_out(a: argparse.Namespace) -> None:
    """What cannot go with N engines, refused before anything starts."""
    if a.data_parallel_size < 1:
        raise ValueError(f"--data-parallel-size must be >= 1, got {a.data_parallel_size}")
    if a.data_parallel_size == 1:
        if a.prefill_engines:
            raise ValueError("--prefill-engines needs --data-parallel-size of 2 or more")
        return
    clash = [f for f, on in (("--ray", a.ray), ("--coordinator", a.coordinator is not None),
                             ("--kv-transfer-config", a.kv_transfer_config is not None),
                             ("--enable-runtime-lora-updating",
                              getattr(a, "enable_runtime_lora_updating", False)),
                             ("--tls-cert", a.tls_cert is not None)) if on]
    if clash:
        raise ValueError(f"{clash[0]} is not supported with --data-parallel-size yet")
    from jserve.serving.engines import roles
    roles(a.data_parallel_size, a.prefill_engines)  # ValueError when no engine decodes


def serve_argv() -> list[str]:
    """This process's ``serve`` arguments (what each engine is started with)."""
    argv = sys.argv[1:]
    return argv[argv.index("serve") + 1:] if "serve" in argv else argv


def front_command(a: argparse.Namespace, server_config) -> int:
    """Starts the engines, waits for them, and serves the front end on ``--port`` until
    SIGTERM or SIGINT; then stops the engines (each drains)."""
    import uvicorn

    from jserve.serving import engines as eng
    from jserve.serving.front import Front, FrontConfig
    from jserve.serving.front_grpc import FrontGrpc
    from jserve.serving.route_prompt import model_tokenizer

    engine_roles = eng.roles(a.data_parallel_size, a.prefill_engines)
    engines = eng.launch(serve_argv(), engine_roles, transfer_timeout_s=a.kv_transfer_timeout,
                         devices_per_engine=a.engine_devices)
    try:
        eng.wait_ready(engines)
        info = eng.server_info(engines[0], server_config.auth_token)
        if a.prefill_engines and info["kv_transfer_unsupported"]:
            raise ValueError(f"--prefill-engines: these engines move no KV pages: "
                             f"{info['kv_transfer_unsupported']}")
        tokenizer = model_tokenizer(a.tokenizer or a.model)
        config = FrontConfig(router=a.front_router, disaggregation=a.disaggregation,
                             auth_token=server_config.auth_token, page_size=info["page_size"])
        front = Front(engines, tokenizer, config)
        port = 8000 if a.http_port < 0 else a.http_port
        server = uvicorn.Server(uvicorn.Config(front.app, host=a.host, port=port,
                                               log_level="warning", lifespan="off"))

        async def run() -> None:
            await front.start()
            grpc_front = FrontGrpc(front)
            grpc_port = await grpc_front.start(a.host, a.grpc_port)
            loop = asyncio.get_running_loop()
            for sig in (signal.SIGTERM, signal.SIGINT):
                loop.add_signal_handler(sig, lambda: setattr(server, "should_exit", True))
            task = asyncio.ensure_future(server.serve())
            while not server.started:
                if task.done():
                    return await task
                await asyncio.sleep(0.02)
            bound = server.servers[0].sockets[0].getsockname()[1]
            print(f"jserve: serving {server_config.model_name} on {a.host}:{grpc_port} with "
                  f"{len(engines)} engines ({', '.join(engine_roles)}; router "
                  f"{a.front_router}, disaggregation "
                  f"{a.disaggregation if a.prefill_engines else 'off'}); OpenAI API "
                  f"http://{a.host}:{bound}/v1", flush=True)
            await task
            await grpc_front.stop()
            await front.close()
        asyncio.run(run())
    finally:
        eng.stop(engines, a.grace_period + 5)
    sys.stdout.flush()
    os._exit(0)
