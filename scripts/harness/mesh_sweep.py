"""Mesh-shape sweep: TTFT and TBT of one request alone in the engine, per mesh x chunk size x
context length, plus a digest of the greedy output so layouts can be checked for equal tokens.

Meshes are taken as strings and handed to the engine as they are (``"1"`` is the one-device
label, sent as ``""``); a mesh the engine rejects with ValueError (or a device failure) becomes
an error row, so axes the engine gains later need no change here. ``scripts/mesh_experiment.py``
is the CLI."""
from __future__ import annotations

import csv
import dataclasses
import hashlib
import json
import math
import statistics
import time
from pathlib import Path
from typing import Sequence

import numpy as np

FIELDS = ("mesh", "devices", "chunk", "context", "ttft_s", "tbt_s", "tokens_digest", "status",
          "error")


@dataclasses.dataclass(frozen=True)
class SweepSettings:
    model: str = "default"
    meshes: tuple[str, ...] = ("1", "tp=2", "kvp=2", "spp=2", "tp=2,kvp=2,spp=2")
    contexts: tuple[int, ...] = (256, 1024, 4096)
    chunks: tuple[int, ...] = (64, 256)
    decode_tokens: int = 16
    repeats: int = 3
    seed: int = 0
    page_size: int = 16
    attention_impl: str = "reference"

    def __post_init__(self) -> None:
        if not self.meshes:
            raise ValueError("no meshes given")
        if not self.contexts or min(self.contexts) < 1:
            raise ValueError(f"contexts must be >= 1 tokens, got {self.contexts}")
        if not self.chunks or min(self.chunks) < 1:
            raise ValueError(f"chunk sizes must be >= 1, got {self.chunks}")
        if self.decode_tokens < 2:
            raise ValueError(f"decode_tokens must be >= 2 (TBT needs two tokens), "
                             f"got {self.decode_tokens}")
        if self.repeats < 1:
            raise ValueError(f"repeats must be >= 1, got {self.repeats}")

    @property
    def max_model_len(self) -> int:
        return max(self.contexts) + self.decode_tokens


def parse_list(text: str, sep: str, kind=str) -> tuple:
    """``"256,1024"`` -> (256, 1024); empty entries are dropped."""
    items = [p.strip() for p in text.split(sep) if p.strip()]
    try:
        return tuple(kind(p) for p in items)
    except ValueError:
        raise ValueError(f"bad list {text!r}: every entry must be {kind.__name__}") from None


def engine_mesh(label: str) -> str:
    """The engine's mesh string for a label: ``"1"`` means one device."""
    return "" if label.strip() == "1" else label


def mesh_devices(label: str) -> int | None:
    """Devices the mesh spans, or None when the string does not parse."""
    from sharding.mesh import MeshConfig
    try:
        return MeshConfig.parse(engine_mesh(label)).size
    except ValueError:
        return None


def make_prompt(context: int, vocab_size: int, seed: int) -> list[int]:
    """Random token ids, the same for every mesh and chunk size (seeded by context too)."""
    rng = np.random.default_rng([seed, context])
    return rng.integers(0, vocab_size, size=context).tolist()


def digest(token_ids: Sequence[int]) -> str:
    return hashlib.sha1(",".join(map(str, token_ids)).encode()).hexdigest()[:16]


class RequestFailed(RuntimeError):
    """The engine finished the request with an error (``RequestOutput.error``)."""


def _sweep_errors() -> tuple[type[Exception], ...]:
    """What becomes an error row instead of ending the sweep: settings the engine rejects,
    device failures such as running out of memory, and requests the engine failed."""
    import jax
    return ValueError, jax.errors.JaxRuntimeError, RequestFailed


def _reason(e: Exception) -> str:
    return str(e) if isinstance(e, ValueError) else f"{type(e).__name__}: {e}"


def run_alone(engine, prompt: list[int], decode_tokens: int) -> tuple[float, float, list[int]]:
    """One greedy request with nothing else in the engine: (TTFT, median TBT, output ids)."""
    from jserve.sampling.params import SamplingParams
    if engine.has_unfinished():
        raise RuntimeError("engine is not empty")
    params = SamplingParams(max_tokens=decode_tokens, temperature=0.0, ignore_eos=True)
    rid = engine.add_request(prompt, params)
    out = None
    while engine.has_unfinished():
        for o in engine.step():
            if o.request_id == rid and o.finished:
                out = o
    if out is None:
        raise RuntimeError("request did not finish")
    if out.error:
        raise RequestFailed(f"engine failed the request: {out.error}")
    m = out.metrics
    gaps = [b - a for a, b in zip(m.token_times, m.token_times[1:])]
    return m.first_token_time - m.arrival_time, statistics.median(gaps), list(out.token_ids)


def _row(label, devices, chunk, context, **kw) -> dict:
    return {"mesh": label, "devices": devices if devices is not None else "", "chunk": chunk,
            "context": context, "ttft_s": "", "tbt_s": "", "tokens_digest": "",
            "status": "ok", "error": "", **kw}


def sweep(s: SweepSettings, *, log=print) -> list[dict]:
    """Every mesh x chunk x context as a CSV row (error rows name the reason)."""
    from harness.evaluate import release_executables
    from jserve.cache.pool import kv_bytes_per_page
    from jserve.model.weights import load_model

    cfg, params, tokenizer = load_model(s.model)
    prompts = {c: make_prompt(c, cfg.vocab_size, s.seed) for c in s.contexts}
    # A fixed KV budget, the same for every mesh: one sequence at full length plus the
    # reserved page, so no layout gets more cache from having more device memory.
    pages = -(-s.max_model_len // s.page_size) + 1
    kv_bytes = pages * kv_bytes_per_page(cfg, s.page_size)
    rows = []
    catch = _sweep_errors()
    for label in s.meshes:
        devices = mesh_devices(label)
        for chunk in s.chunks:
            try:
                _measure_engine(s, label, devices, chunk, cfg, params, tokenizer, prompts,
                                kv_bytes, rows, log)
            except catch as e:
                log(f"mesh {label!r} chunk {chunk}: {_reason(e)}")
                done = {r["context"] for r in rows if r["mesh"] == label and r["chunk"] == chunk}
                rows += [_row(label, devices, chunk, c, status="error", error=_reason(e))
                         for c in s.contexts if c not in done]
            finally:
                release_executables()
    return rows


def _measure_engine(s: SweepSettings, label: str, devices: int | None, chunk: int, cfg, params,
                    tokenizer, prompts: dict, kv_bytes: int, rows: list, log) -> None:
    """One engine: warm-up, then every context timed. Appends to ``rows`` as it goes so a
    failure part way keeps the contexts already measured. No decode bursts: they run on
    some meshes only (not under kvp or spp), and they hand several tokens over at once, so
    the time between tokens would compare the bursts, not the meshes."""
    from jserve.engine.config import EngineConfig
    from jserve.engine.engine import LLMEngine

    ec = EngineConfig(max_num_seqs=1, max_prefill_seqs=1, max_num_batched_tokens=chunk,
                      max_model_len=s.max_model_len, page_size=s.page_size,
                      kv_cache_bytes=kv_bytes, attention_impl=s.attention_impl,
                      mesh=engine_mesh(label), scheduler="sarathi", warmup=False, seed=s.seed,
                      decode_burst=1)
    engine = LLMEngine(cfg, params, tokenizer, ec)
    # Warm-up: each context once, untimed, compiles exactly the shapes timed below.
    t0 = time.perf_counter()
    for c in s.contexts:
        run_alone(engine, prompts[c], s.decode_tokens)
    log(f"mesh {label!r} chunk {chunk}: warmed up in {time.perf_counter() - t0:.1f}s")
    for c in s.contexts:
        runs = [run_alone(engine, prompts[c], s.decode_tokens) for _ in range(s.repeats)]
        row = _row(label, devices, chunk, c, ttft_s=statistics.median(r[0] for r in runs),
                   tbt_s=statistics.median(r[1] for r in runs), tokens_digest=digest(runs[0][2]))
        if len({digest(r[2]) for r in runs}) > 1:
            row.update(status="error", error="outputs differ between repeats")
        rows.append(row)
        log(f"mesh {label!r} chunk {chunk} context {c}: ttft {row['ttft_s'] * 1e3:.1f} ms"
            f" tbt {row['tbt_s'] * 1e3:.2f} ms digest {row['tokens_digest']}")


def compare_outputs(rows: Sequence[dict]) -> dict:
    """Per mesh: does every (chunk, context) digest equal the one-device mesh's? None when a
    mesh has no successful rows or there is no one-device reference."""
    ok = [r for r in rows if r["status"] == "ok"]
    ref_label = next((r["mesh"] for r in ok if str(r["devices"]) == "1"), None)
    ref = {(r["chunk"], r["context"]): r["tokens_digest"] for r in ok if r["mesh"] == ref_label}
    result = {}
    for label in dict.fromkeys(r["mesh"] for r in rows):
        mine = [r for r in ok if r["mesh"] == label]
        if ref_label is None or not mine:
            result[label] = None
            continue
        result[label] = all(ref.get((r["chunk"], r["context"])) == r["tokens_digest"]
                            for r in mine)
    return {"reference": ref_label, "same_as_reference": result}


def write_csv(rows: Sequence[dict], path: Path) -> None:
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, FIELDS)
        w.writeheader()
        w.writerows(rows)


def plot(rows: Sequence[dict], path: Path, *, title: str) -> None:
    """Rows: TTFT and TBT against context; one column per chunk size, one line per mesh."""
    from harness.plots import _pyplot
    plt = _pyplot()
    chunks = sorted({int(r["chunk"]) for r in rows})
    meshes = list(dict.fromkeys(r["mesh"] for r in rows))
    fig, axes = plt.subplots(2, len(chunks), figsize=(5 * len(chunks), 7.5), squeeze=False,
                             sharex=True)
    for j, chunk in enumerate(chunks):
        for i, (key, name) in enumerate((("ttft_s", "TTFT (ms)"), ("tbt_s", "TBT (ms)"))):
            ax = axes[i][j]
            for label in meshes:
                pts = sorted((int(r["context"]), float(r[key]) * 1e3) for r in rows
                             if r["mesh"] == label and int(r["chunk"]) == chunk
                             and r["status"] == "ok")
                if pts:
                    ax.plot(*zip(*pts), marker="o", label=label)
            ax.set_xscale("log", base=2)
            ax.set_ylabel(name)
            ax.grid(True, which="both", alpha=0.3)
            if i == 0:
                ax.set_title(f"chunk {chunk} tokens")
            else:
                ax.set_xlabel("context (prompt tokens)")
            if ax.get_legend_handles_labels()[0]:
                ax.legend(fontsize=8)
    failed = [m for m in meshes if not any(r["mesh"] == m and r["status"] == "ok" for r in rows)]
    if failed:
        title += "\nnot run (see the CSV for the reason): " + ", ".join(failed)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def device_info() -> dict:
    import jax
    d = jax.devices()[0]
    return {"platform": jax.default_backend(), "device_kind": d.device_kind,
            "device_count": jax.device_count(), "jax_version": jax.__version__}


def run(s: SweepSettings, out_dir: Path, *, log=print) -> dict:
    """Sweep, then write mesh_experiment.csv, mesh_experiment.png and summary.json."""
    out_dir.mkdir(parents=True, exist_ok=True)
    info = device_info()
    log(f"devices: {info['device_count']} x {info['device_kind']} ({info['platform']})")
    t0 = time.perf_counter()
    rows = sweep(s, log=log)
    write_csv(rows, out_dir / "mesh_experiment.csv")
    plot(rows, out_dir / "mesh_experiment.png",
         title=f"{s.model} on {info['device_count']} x {info['device_kind']}: one request alone, "
               f"{s.decode_tokens} greedy tokens, median of {s.repeats}")
    log(markdown_table(rows))
    cmp = compare_outputs(rows)
    summary = {"settings": dataclasses.asdict(s), "max_model_len": s.max_model_len, **info,
               **cmp, "errors": {f"{r['mesh']} chunk {r['chunk']}": r["error"] for r in rows
                            if r["status"] != "ok"},
               "wall_s": time.perf_counter() - t0}
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    if cmp["reference"] is None:
        log("no one-device mesh ran: outputs not compared")
    else:
        for label, same in cmp["same_as_reference"].items():
            verdict = ("no successful runs to compare" if same is None else
                       f"same tokens as {cmp['reference']!r}" if same
                       else f"DIFFERENT tokens from {cmp['reference']!r}")
            log(f"mesh {label!r}: {verdict}")
        compared = [v for v in cmp["same_as_reference"].values() if v is not None]
        log("every mesh that ran produced the same tokens as the one-device run"
            if all(compared) else
            "NOT every mesh that ran produced the same tokens as the one-device run")
    return summary


def _ms(v) -> str:
    if v in ("", None) or math.isnan(float(v)):
        return ""
    return f"{float(v) * 1e3:.1f}"


def markdown_table(rows: Sequence[dict]) -> str:
    """The CSV as a markdown table (times in ms), for docs."""
    lines = ["| mesh | devices | chunk | context | TTFT (ms) | TBT (ms) | digest | status |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        status = r["status"] if r["status"] == "ok" else f"{r['status']}: {r['error']}"
        lines.append(f"| {r['mesh']} | {r['devices']} | {r['chunk']} | {r['context']} | "
                     f"{_ms(r['ttft_s'])} | {_ms(r['tbt_s'])} | {r['tokens_digest']} | {status} |")
    return "\n".join(lines)
