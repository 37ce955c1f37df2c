"""The device check's output: progress lines, and the markdown report of a results dict
(``docs/device/check.md``)."""
from __future__ import annotations

import json
import sys

from tqdm import tqdm


def say(msg: str) -> None:
    tqdm.write(msg)
    sys.stdout.flush()


def error_text(e: BaseException) -> str:
    first = str(e).strip().splitlines()
    return f"{type(e).__name__}: {first[0] if first else ''}"[:300]


def fmt_pct(x) -> str:
    return "n/a" if x is None else f"{100 * x:.1f}%"


def fmt(x, digits=3) -> str:
    if x is None:
        return "n/a"
    if isinstance(x, bool):
        return "yes" if x else "no"
    if isinstance(x, float):
        return f"{x:.{digits}g}"
    return str(x)


def md_table(headers: list[str], rows: list[list]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(fmt(c) if not isinstance(c, str) else c for c in r) + " |"
              for r in rows]
    return "\n".join(lines)


def render_markdown(res: dict) -> str:
    """The report of a device check's results (``docs/device/check.md``)."""
    out = _summary(res) + _kernel_sections(res) + _engine_section(res) + _timing_sections(res)
    errors = [c for c in res["checks"] if c["status"] == "fail"]
    if errors:
        out += ["", "## Failures", ""]
        out += [f"- {c['name']}: {c.get('detail')}" for c in errors]
    out.append("")
    return "\n".join(out)


def _summary(res: dict) -> list[str]:
    """The title, the run, the peak figures and the table of checks."""
    smoke = res["mode"] == "smoke"
    peaks = res["peaks"]
    out = [f"# Device check: {res['device_kind']}", ""]
    out.append(f"Written by `{res['command']}` on {res['date']} (jax {res['jax_version']}, "
               f"backend {res['backend']}, {res['mode']} mode, {res['wall_s']:.0f} s). "
               f"Overall: **{'PASS' if res['passed'] else 'FAIL'}**.")
    out.append("")
    if smoke:
        out.append("Smoke mode: tiny shapes, Pallas kernels interpreted on the CPU. The checks "
                   "are real; the times measure the interpreter and the CPU, not a kernel.")
        out.append("")
    out.append(f"Peak figures ({res['device_kind']}): "
               f"{fmt(peaks['tflops'])} TFLOP/s dense bf16, {fmt(peaks['tbps'])} TB/s"
               + (" (n/a: not in the script's table; pass --peak-tflops/--peak-tbps)."
                  if peaks["tflops"] is None or peaks["tbps"] is None else " (datasheet)."))
    out += ["", "## Checks", ""]
    out.append(md_table(["check", "status", "detail"],
                        [[c["name"], c["status"], c.get("detail") or ""] for c in res["checks"]]))
    return out


def _kernel_sections(res: dict) -> list[str]:
    """The kernels against the reference, the cache writes and the quantized pages."""
    out: list[str] = []
    if res.get("kernels"):
        s = res["shapes"]
        out += ["", "## Kernels against the reference", "",
                f"{s['hq']} query / {s['hkv']} KV heads, head_dim {s['d']}, {s['dtype']}, "
                f"{s['page']}-token pages scattered over the pool; pass: "
                f"`|kernel - reference| <= tol + tol * |reference|` on output and lse, rows "
                f"without keys 0 / -inf. Times: median of {res['reps']} calls. TB/s: K and V "
                f"of every live sequence read once, Q read and O written once; TFLOP/s: QK^T "
                f"and PV of every attended pair.", ""]
        out.append(md_table(
            ["impl", "batch", "context", "seqs", "tokens", "max abs err out",
             "max abs err lse", "tol", "status", "kernel ms", "reference ms", "speedup",
             "TB/s", "% peak BW", "TFLOP/s", "% peak FLOP/s"],
            [[r["impl"], r["kind"], r["context"], r.get("seqs"), r.get("tokens"),
              r.get("max_abs_err_out"), r.get("max_abs_err_lse"), r.get("tol"), r["status"],
              r.get("kernel_ms"), r.get("reference_ms"), r.get("speedup"), r.get("tbps"),
              fmt_pct(r.get("bw_of_peak")), r.get("tflops"), fmt_pct(r.get("flops_of_peak"))]
             for r in res["kernels"]]))
    if res.get("kv_write"):
        out += ["", "### Cache write (`write_kv`) against the reference scatter", "",
                "The mixed batch's new K rows written into its pool; equal outside the sink "
                "page 0. Times: the cache donated (in place, as in the engine), median of "
                f"{res['reps']} calls.", ""]
        out.append(md_table(["impl", "context", "tokens", "status", "kernel ms",
                             "reference ms"],
                            [[r["impl"], r["context"], r.get("tokens"), r["status"],
                              r.get("kernel_ms"), r.get("reference_ms")]
                             for r in res["kv_write"]]))
    if res.get("kernels_quantized"):
        out += ["", "### Quantized KV pages (docs/quantization.md)", "",
                "The mixed batch over pages stored int8 (per token and head scales) or "
                "fp8_e4m3: the kernel against the reference on the same stored pages, and its "
                "time against the same kernel over the full-precision pages.", ""]
        out.append(md_table(["impl", "kv cache", "context", "max abs err out", "tol",
                             "status", "kernel ms", "full-precision ms", "speedup"],
                            [[r["impl"], r.get("kv_cache_dtype"), r["context"],
                              r.get("max_abs_err_out"), r.get("tol"), r["status"],
                              r.get("kernel_ms"), r.get("full_precision_ms"),
                              r.get("speedup")] for r in res["kernels_quantized"]]))
    return out


def _engine_section(res: dict) -> list[str]:
    """The engine's greedy tokens, kernel against reference."""
    out: list[str] = []
    e = res.get("engine")
    if e:
        m = e.get("model", {})
        out += ["", "## Engine: greedy tokens, kernel vs reference", "",
                f"Random float32 model ({m.get('num_hidden_layers')} layers, hidden "
                f"{m.get('hidden_size')}, {m.get('num_attention_heads')}/"
                f"{m.get('num_key_value_heads')} heads, head_dim {m.get('head_dim')}); prompts "
                f"of {e.get('prompts')} tokens, {e.get('max_tokens')} greedy tokens each; "
                f"engine `{json.dumps(e.get('engine'))}`.", ""]
        out.append(md_table(["attention_impl", "tokens compared", "identical",
                             "first mismatch", "kernel run s", "reference run s"],
                            [[e.get("impl", "?"), e.get("tokens_compared"), e.get("identical"),
                              json.dumps(e.get("first_mismatch")) if e.get("first_mismatch")
                              else "none", e.get("kernel_s"), e.get("reference_s")]]))
    return out


def _timing_sections(res: dict) -> list[str]:
    """The engine timings: decode, prefill, small against large chunks."""
    out: list[str] = []
    t = res.get("timings")
    if t:
        out += ["", f"## Engine timings (attention_impl={t['impl']}, random weights)", "",
                "Step times from the engine's step log (device step plus token fetch), median "
                "over the steps where the whole batch decodes (burst > 1: decode bursts of "
                "that many steps, a burst's time over its steps). MBU = (weights read + KV read) "
                "per step / step time / peak bandwidth; MFU = model FLOPs (layer matmuls per "
                "token, causal attention, LM head once) / prefill time / peak FLOP/s.", "",
                "### Decode", ""]
        out.append(md_table(
            ["model", "batch", "burst", "prompt", "new tokens", "max_model_len",
             "mean context", "step ms", "tok/s", "weights GB", "KV GB/step", "TB/s", "MBU"],
            [[r["model"] + "".join(f" ({k} {r[k]})" for k in ("layer_loop", "xla_flags")
                                   if r.get(k)),
              r["batch"], r.get("burst", 1), r["prompt"], r["new_tokens"],
              r["max_model_len"],
              r["mean_context"], r["step_ms"], r["tok_s"], r["weight_gb"], r["kv_gb"],
              r["tbps"], fmt_pct(r["mbu"])] for r in t["decode"]]))
        out += ["", "### Prefill", ""]
        out.append(md_table(
            ["model", "prompt", "chunk", "steps", "seconds", "tok/s", "TFLOP/s", "MFU"],
            [[r["model"], r["prompt"], r["chunk"], r["steps"], r["seconds"], r["tok_s"],
              r["tflops"], fmt_pct(r["mfu"])] for r in t["prefill"]]))
        out += ["", "### Small vs large chunks at long context", ""]
        out.append(md_table(
            ["model", "context", "chunk", "seconds", "vs chunk", "seconds", "slowdown"],
            [[r["model"], r["context"], r["small_chunk"], r["small_s"], r["big_chunk"],
              r["big_s"], r["slowdown"]] for r in t["chunked"]]))
    return out
