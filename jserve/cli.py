"""The ``jserve`` command: ``generate`` streams a completion, ``convert`` writes an orbax
checkpoint, ``plan`` prints a configuration's per-device memory before anything is
allocated.

Each command imports what it runs inside its own function: parsing flags, ``--help`` and
``jserve simulate`` load no JAX (``tests/test_jax_free.py``), and no command pays for another's
imports (JAX, gRPC, the simulator)."""
from __future__ import annotations

import argparse
import sys

from jserve.config import KV_CACHE_DTYPES, QUANTIZATIONS
from jserve.engine.config import EngineConfig
from jserve.flags.args import add_engine_args, engine_kwargs, kv_cache_dtype, llm_from_args
from jserve.log_setup import configure_logging
from jserve.routing import MODES


class _Parser(argparse.ArgumentParser):
    """Says why a well-known vLLM flag is refused (``VLLM_REFUSED``), beside argparse's own
    "unrecognized arguments" naming every other unknown flag."""

    def error(self, message: str):
        from jserve.serving.commands import refused_vllm_flags

        prefix = "unrecognized arguments: "
        if message.startswith(prefix):
            lines = refused_vllm_flags(message[len(prefix):].split(" "))
            if lines:
                self.print_usage(sys.stderr)
                self.exit(2, "".join(f"{self.prog}: error: {line}\n" for line in lines))
        super().error(message)


class _HelpWithDefaults(argparse.ArgumentDefaultsHelpFormatter):
    """``--help`` with every default but the tokens' (read from the environment, not shown)."""

    def _get_help_string(self, action):
        if action.dest.endswith("_token"):
            return action.help
        return super()._get_help_string(action)


def _generate(a: argparse.Namespace) -> int:
    from jserve import SamplingParams

    params = SamplingParams(max_tokens=a.max_tokens, temperature=a.temperature, top_p=a.top_p,
                            top_k=a.top_k, seed=a.seed, stop=a.stop or None,
                            ignore_eos=a.ignore_eos)
    if a.server:
        from jserve.serving.commands import generate_remote
        return generate_remote(a, params)
    from jserve.serving.commands import join_processes, leading
    join_processes(a)
    llm = llm_from_args(a)
    with leading(a, llm) as leader:
        return _stream(a, llm, params) if leader else 0


def _stream(a: argparse.Namespace, llm, params) -> int:
    prompt = llm.chat_prompt([{"role": "user", "content": a.prompt}]) if a.chat else a.prompt
    if a.token_ids:
        prompt = [int(t) for t in a.prompt.replace(",", " ").split()]
    eng = llm.engine
    rid = eng.add_request(prompt, params)
    shown = 0
    while True:
        for out in eng.step():
            if out.request_id != rid:
                continue
            sys.stdout.write(out.text[shown:])
            sys.stdout.flush()
            shown = len(out.text)
            if out.finished:
                sys.stdout.write("\n")
                print(f"[{len(out.token_ids)} tokens, finish_reason={out.finish_reason}]",
                      file=sys.stderr)
                return 0


def _convert(a: argparse.Namespace) -> int:
    from jserve.model.weights import load_model, save_orbax

    cfg, params, tokenizer = load_model(a.model, dtype=a.dtype, quantization=a.quantization)
    src = a.model if a.model != "default" else None
    save_orbax(a.out, cfg, params, tokenizer_dir=src, tokenizer=tokenizer)
    print(f"wrote orbax checkpoint to {a.out}")
    return 0


def _profile(a: argparse.Namespace) -> int:
    from jserve.engine.loop.profiler import fit_predictor, profile_samples
    from jserve.engine.loop.timing import default_predictor_path
    from jserve.scheduler.predictor import FEATURES

    llm = llm_from_args(a)
    samples = profile_samples(llm.engine, repeats=a.repeats)
    predictor, report = fit_predictor(llm.engine, samples)
    out = a.out or default_predictor_path(llm.engine.model_config, llm.engine.config)
    predictor.save(out)
    for name, c in zip(FEATURES, predictor.coef):
        print(f"  {name:18s} {c:.3e}")
    print(f"held-out median relative error {report['held_out_median_rel_error']:.1%}, "
          f"p90 {report['held_out_p90_rel_error']:.1%} over {report['held_out_steps']} steps "
          f"(trained on {report['train_steps']}); wrote {out}")
    return 0


def _add_plan_parser(sub) -> None:
    d = EngineConfig()
    s = sub.add_parser("plan", help="per-device memory of a configuration, compiled with "
                                    "abstract weights (nothing allocated, no weight read)",
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    s.add_argument("--model", default="default",
                   help='"default", a built-in model, an HF directory or a config.json path')
    s.add_argument("--mesh", default=d.mesh, help='e.g. "tp=8" or "tp=4,kvp=2" or "tp=4,spp=2"')
    s.add_argument("--device-memory", default=None,
                   help="memory of one device: 80GB, 80GiB or bytes; None: the first "
                        "device's, as the engine reads it")
    s.add_argument("--devices", type=int, default=None,
                   help="simulate N CPU devices, to plan a mesh of N devices on this machine")
    s.add_argument("--dtype", choices=["float32", "bfloat16"], default=None,
                   help="None: the model's")
    s.add_argument("--max-model-len", type=int, default=None,
                   help="None: min(the model's max positions, 8192)")
    s.add_argument("--max-num-seqs", type=int, default=d.max_num_seqs, help="decode rows")
    s.add_argument("--max-num-batched-tokens", type=int, default=d.max_num_batched_tokens,
                   help="token budget of one step")
    s.add_argument("--max-prefill-seqs", type=int, default=d.max_prefill_seqs,
                   help="prefill chunks in one step")
    s.add_argument("--page-size", type=int, default=d.page_size, help="tokens a KV page")
    s.add_argument("--memory-fraction", type=float, default=d.memory_fraction,
                   help="share of device memory for weights, activations and the KV cache")
    s.add_argument("--kv-cache-bytes", default=None,
                   help="explicit KV budget per device (e.g. 20GB) instead of what is left")
    s.add_argument("--num-kv-pages", type=int, default=None,
                   help="exact KV pool per device in pages")
    s.add_argument("--attention-impl", default=d.attention_impl, help="the step's kernels")
    s.add_argument("--kv-cache-dtype", type=kv_cache_dtype, choices=KV_CACHE_DTYPES,
                   default=d.kv_cache_dtype,
                   help="how KV pages are stored (fp8: vLLM's name of fp8_e4m3; the plan "
                        "also lists the other choices)")
    s.add_argument("--quantization", choices=QUANTIZATIONS, default="none",
                   help="weight-only quantization, none: as the checkpoint stores them (the "
                        "plan also lists the other choices)")
    s.set_defaults(func=_plan)


def _plan(a: argparse.Namespace) -> int:
    from pathlib import Path

    import jax

    if a.devices:  # before anything asks JAX for its devices
        try:
            jax.config.update("jax_platforms", "cpu")
            jax.config.update("jax_num_cpu_devices", a.devices)
        except RuntimeError:  # JAX already started in this process
            if len(jax.devices("cpu")) < a.devices:
                raise ValueError(f"--devices {a.devices}: JAX already started with "
                                 f"{len(jax.devices('cpu'))} CPU devices") from None
    from jserve.engine.build.memory_plan import parse_bytes, plan
    from jserve.model.families import read_config_file
    from jserve.model.weights import load_config

    q = None if a.quantization == "none" else a.quantization  # none: as stored
    if Path(a.model).is_file():
        cfg = read_config_file(a.model, dtype=a.dtype, quantization=q)
    else:
        cfg = load_config(a.model, dtype=a.dtype, quantization=q)
    config = EngineConfig(
        mesh=a.mesh, max_model_len=a.max_model_len, max_num_seqs=a.max_num_seqs,
        max_num_batched_tokens=a.max_num_batched_tokens, max_prefill_seqs=a.max_prefill_seqs,
        page_size=a.page_size, memory_fraction=a.memory_fraction,
        kv_cache_bytes=None if a.kv_cache_bytes is None else parse_bytes(a.kv_cache_bytes),
        num_kv_pages=a.num_kv_pages, attention_impl=a.attention_impl, warmup=False,
        kv_cache_dtype=a.kv_cache_dtype)
    memory = None if a.device_memory is None else parse_bytes(a.device_memory)
    p = plan(cfg, config, device_memory_bytes=memory, model_name=a.model)
    print(p.summary())
    return 0 if p.fits else 1


def _add_simulate_parser(sub) -> None:
    from jserve.routing import ROUTERS
    from jserve.scheduler.registry import SIMULATED_POLICIES
    from jserve.serving.commands import add_budget_arg
    from jserve.sim.policies import SimConfig

    d = SimConfig()
    s = sub.add_parser("simulate", help="replay a trace through a scheduling policy on the "
                                        "GPU time model (no GPU, no JAX)")
    s.add_argument("--trace", required=True,
                   help="a packaged trace (sharegpt4: lengths only, so with --qps; azure-conv: "
                   "with arrivals) or a CSV or JSONL file: num_prefill_tokens, "
                   "num_decode_tokens, arrived_at (unless --qps)")
    s.add_argument("--policy", required=True, choices=SIMULATED_POLICIES,
                   help="lars: LARS alone; lars-ss: LARS with space sharing")
    s.add_argument("--model", default=d.model,
                   help="the model whose per-op profile times the steps (jserve/data/profiles)")
    s.add_argument("--hardware", default=d.hardware, help="the GPU of the per-op profile")
    s.add_argument("--tp", type=int, default=d.tp, help="tensor-parallel GPUs per replica")
    s.add_argument("--spp", type=int, default=d.spp, help="stream-pipeline stages")
    s.add_argument("--kvp", type=int, default=d.kvp, help="KV-cache-parallel groups")
    s.add_argument("--qps", type=float, default=None, help="draw Poisson arrivals at this rate")
    s.add_argument("--seed", type=int, default=0, help="seed of the Poisson arrivals")
    s.add_argument("--max-requests", type=int, default=None, help="the trace's first N requests")
    add_budget_arg(s, d.iteration_budget)
    s.add_argument("--max-num-seqs", type=int, default=d.max_num_seqs,
                   help="sequences decoding at once")
    s.add_argument("--max-num-batched-tokens", type=int, default=d.max_num_batched_tokens,
                   help="tokens per iteration at most")
    s.add_argument("--horizon", type=float, default=None,
                   help="stop the virtual clock here (s); unfinished requests get null times")
    s.add_argument("--replicas", type=int, default=1,
                   help="replicas of this mesh behind --router (jserve.sim.cluster)")
    s.add_argument("--router", default="deadline", choices=ROUTERS,
                   help="how requests are routed to replicas (with --replicas > 1)")
    s.add_argument("--prefix-caching", action="store_true",
                   help="automatic prefix caching (trace prefix ids say what is shared)")
    s.add_argument("--prefill-replicas", type=int, default=0,
                   help="prefill-only replicas of this mesh beside the --replicas decode "
                   "replicas (jserve.sim.disagg); each request is then placed by "
                   "jserve.routing.disagg.place (the deadline router among the decode replicas "
                   "when colocated), and the decode replicas' prefix cache is on (the KV import "
                   "is found by it)")
    s.add_argument("--disaggregation", default="auto", choices=MODES,
                   help="with --prefill-replicas: per request by deadline, every request, or "
                   "none")
    s.add_argument("--transfer-gb-per-s", type=float, default=25.0,
                   help="with --prefill-replicas: each GPU's link to the other replica (GB/s; "
                   "25: one 200 Gb/s InfiniBand NIC per GPU), over which it sends its shard of "
                   "a prompt's KV")
    s.add_argument("--out", required=True, help="records JSONL")
    s.set_defaults(func=_simulate)


def _simulate(a: argparse.Namespace) -> int:
    from jserve.bench.metrics import format_summary, summarize
    from jserve.sim.policies import SimConfig, run
    from jserve.sim.trace import read_trace, write_records

    trace = read_trace(a.trace, qps=a.qps, seed=a.seed, max_requests=a.max_requests)
    cfg = SimConfig(model=a.model, hardware=a.hardware, tp=a.tp, spp=a.spp, kvp=a.kvp,
                    iteration_budget=a.iteration_budget, max_num_seqs=a.max_num_seqs,
                    max_num_batched_tokens=a.max_num_batched_tokens, horizon_s=a.horizon,
                    prefix_caching=a.prefix_caching)
    if a.prefill_replicas:
        from jserve.sim.disagg import run_disagg, transfer_cost
        records = run_disagg(trace, a.policy, a.prefill_replicas, a.replicas,
                             a.disaggregation, cfg, transfer_cost(cfg, a.transfer_gb_per_s))
        where = f"{a.prefill_replicas} prefill + {a.replicas} decode replicas of "
        behind = f" with disaggregation {a.disaggregation}"
    elif a.replicas == 1:
        records = run(trace, a.policy, cfg)
        where = behind = ""
    else:
        from jserve.sim.cluster import run_cluster
        records = run_cluster(trace, a.policy, a.router, a.replicas, cfg)
        where, behind = f"{a.replicas} replicas of ", f" behind {a.router}"
    write_records(a.out, records)
    print(f"{a.policy}: {len(records)} requests on {where}{a.model} {a.hardware} "
          f"tp={a.tp} spp={a.spp} kvp={a.kvp}{behind}; wrote {a.out}")
    print(format_summary(summarize(records)))
    return 0


def build_parser() -> argparse.ArgumentParser:
    """The ``jserve`` command line: every flag of every subcommand says what it does, and
    ``--help`` shows its default."""
    from jserve.bench.serve_bench import add_bench_parser
    from jserve.serving.commands import add_multihost_args, add_remote_args, add_serve_parser
    from jserve.targets.command import add_compile_parser

    parser = _Parser(prog="jserve", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", help="stream one completion to the terminal")
    add_engine_args(g)
    g.add_argument("prompt", help="the prompt text (or token ids with --token-ids)")
    g.add_argument("--token-ids", action="store_true", help="the prompt is a list of token ids")
    g.add_argument("--chat", action="store_true", help="apply the tokenizer's chat template")
    g.add_argument("--max-tokens", type=int, default=64, help="tokens to generate at most")
    g.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    g.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass")
    g.add_argument("--top-k", type=int, default=0, help="sample among the k likeliest (0: all)")
    g.add_argument("--seed", type=int, default=None, help="sampling seed (None: random)")
    g.add_argument("--stop", action="append", default=[],
                   help="a stop string (repeat the flag for several)")
    g.add_argument("--ignore-eos", action="store_true", help="keep going past EOS")
    add_remote_args(g)
    add_multihost_args(g)
    g.set_defaults(func=_generate)
    c = sub.add_parser("convert", help="save a model as an orbax checkpoint directory")
    c.add_argument("--model", default="default",
                   help='"default", "tiny-tasks", or an HF directory to convert')
    c.add_argument("--dtype", choices=["float32", "bfloat16"], default=None,
                   help="dtype to store (None: the model's own)")
    c.add_argument("--out", required=True, help="the checkpoint directory to write")
    c.add_argument("--quantization", choices=QUANTIZATIONS, default=None,
                   help="save the layer weights quantized (None: as the model is stored)")
    c.set_defaults(func=_convert)
    pr = sub.add_parser("profile", help="time the engine over a grid and fit the runtime "
                                        "predictor the deadline-aware scheduler uses")
    add_engine_args(pr)
    pr.add_argument("--repeats", type=int, default=2, help="timings per grid point")
    pr.add_argument("--out", default=None, help="default: ~/.cache/jserve/predictors/KEY.json")
    pr.set_defaults(func=_profile)
    add_serve_parser(sub, add_engine_args, engine_kwargs)
    _add_simulate_parser(sub)
    _add_plan_parser(sub)
    add_compile_parser(sub)  # jserve compile --target: jserve.targets.command
    add_bench_parser(sub)  # jserve bench serve: jserve.bench.serve_bench
    for p in sub.choices.values():  # every subcommand's --help shows its defaults
        p.formatter_class = _HelpWithDefaults
    return parser


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    configure_logging("INFO")
    try:
        return a.func(a)
    except (ValueError, FileNotFoundError) as e:
        print(f"jserve: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
