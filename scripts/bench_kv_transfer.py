"""Moving a prompt's KV pages from one engine process to another, measured on this host
(docs/scale_out.md, "Moving KV pages between engines, measured").

Prefill/decode disaggregation pays for every prompt's pages once more on the way from the
prefill engine to the decode engine. This script puts a number on that trip by each way two
processes on one host can move the bytes, in one run:

1. ``http``: jserve's own path. A ``jserve serve`` producer (``kv_producer``, built-in
   ``default`` model) computes the prompt (a completion with ``max_tokens: 1``), then
   ``POST /v1/kv/export`` is timed end to end from the client, as the decode engine's
   connector sends it (with its client, aiohttp; ``http_httpx2``: the same request by
   httpx2's async client, which the connector used first). Its parts, in this process:
   ``export_pages`` (an engine like the server's: the pages read out of the KV cache and
   encoded), and ``encode``/``decode``
   (the wire format alone, on the same bytes). Once with the pages as float32 (``auto``)
   and once as ``int8``.
2. ``jax_transfer``: ``jax.experimental.transfer`` between two JAX processes on the CPU
   backend, pulling arrays of the pages' shapes and dtypes (or the error if it cannot).
3. ``tcp`` (a raw loopback socket, request then response) and ``shm``
   (``multiprocessing.shared_memory``: the producer copies into the segment, the consumer
   copies out): the floor of what the host does with the same number of bytes.

Each row is the median (and minimum) of ``--reps`` timed repetitions after one untimed.

    JAX_PLATFORMS=cpu python scripts/bench_kv_transfer.py [--sizes 256,1024,4096] \\
        [--reps 7] [--out docs/scale_out/kv_transfer.json]
"""
from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import multiprocessing as mp
import os
import platform
import socket
import statistics
import struct
import sys
import time
from multiprocessing import shared_memory

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "scripts"))

from harness.served import Served  # noqa: E402
from jserve import kv_wire  # noqa: E402

PAGE = 16  # the engine's default page size (tokens a page)
PRODUCER = json.dumps({"kv_connector": "JServeConnector", "kv_role": "kv_producer"})
_N = struct.Struct(">Q")     # the raw socket's request: bytes wanted


# -- timing ------------------------------------------------------------------------------

def timed(fn, reps: int) -> list[float]:
    """Seconds of ``reps`` calls of ``fn`` after one untimed call (connections, caches)."""
    fn()
    out = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def row(mechanism: str, case: dict, nbytes: int, times: list[float], **extra) -> dict:
    med = statistics.median(times)
    return {"mechanism": mechanism, "kv_cache_dtype": case["dtype"], "tokens": case["tokens"],
            "pages": case["pages"], "bytes": nbytes, "reps": len(times),
            "seconds_median": med, "seconds_min": min(times),
            "bytes_per_s": nbytes / med, **extra}


def machine() -> dict:
    model = platform.processor()
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    return {"nproc": os.cpu_count(), "sched_nproc": len(os.sched_getaffinity(0)),
            "cpu_model": model, "platform": platform.platform(),
            "python": platform.python_version()}


# -- 1. jserve's wire format over HTTP ------------------------------------------------------

def prompt(tokens: int, seed: int) -> list[int]:
    return np.random.default_rng(seed).integers(1, 250, tokens).tolist()


def producer(dtype: str, sizes: list[int]) -> Served:
    pool = max(8192 // PAGE, sum(-(-n // PAGE) + 1 for n in sizes)) + 16
    return Served("--kv-transfer-config", PRODUCER, "--kv-cache-dtype", dtype,
                  "--max-model-len", "8192", "--num-kv-pages", str(pool),
                  "--max-num-batched-tokens", "512", "--max-num-seqs", "2")


def http_case(client, url: str, dtype: str, tokens: int, reps: int):
    """The export of one computed prompt, timed with the connector's client (aiohttp) and
    with httpx2; (rows, the wire bytes)."""
    import aiohttp
    ids = prompt(tokens, tokens)
    r = client.post(url + "/v1/completions", json={"model": "default", "prompt": ids,
                                                   "max_tokens": 1, "temperature": 0})
    r.raise_for_status()
    body, got = {"token_ids": ids, "lora": None}, {}
    loop = asyncio.new_event_loop()
    session = loop.run_until_complete(_session(aiohttp))

    async def pull():
        async with session.post(url + "/v1/kv/export", json=body, raise_for_status=True) as r:
            got["wire"] = await r.read()

    import httpx2 as httpx
    async_client = httpx.AsyncClient(timeout=600)

    async def pull_httpx():
        r = await async_client.post(url + "/v1/kv/export", json=body)
        r.raise_for_status()

    try:
        times = timed(lambda: loop.run_until_complete(pull()), reps)
        times_httpx = timed(lambda: loop.run_until_complete(pull_httpx()), reps)
    finally:
        loop.run_until_complete(session.close())
        loop.run_until_complete(async_client.aclose())
        loop.close()
    wire = got["wire"]
    case = {"dtype": dtype, "tokens": tokens, "pages": header(wire)["pages"]}
    rows = [row("http", case, len(wire), times, expected_pages=(tokens - 1) // PAGE),
            row("http_httpx2", case, len(wire), times_httpx)]
    return rows, wire


async def _session(aiohttp):
    return aiohttp.ClientSession()


def header(wire: bytes) -> dict:
    return kv_wire.header(wire)[0]


def http_cases(dtype: str, sizes: list[int], reps: int):
    import httpx2 as httpx

    server = producer(dtype, sizes)
    try:
        with httpx.Client(timeout=600) as client:
            return [http_case(client, server.url, dtype, n, reps) for n in sizes]
    finally:
        server.stop()


def engine_rows(dtype: str, sizes: list[int], reps: int) -> list[dict]:
    """``export_pages`` in this process (an engine like the server's): reading the pages out
    of the KV cache and encoding them, the export's share of the HTTP rows."""
    from jserve import LLM, SamplingParams
    from jserve.engine.device import kv_transfer
    pool = max(8192 // PAGE, sum(-(-n // PAGE) + 1 for n in sizes)) + 16
    llm = LLM("default", max_model_len=8192, num_kv_pages=pool, max_num_batched_tokens=512,
              max_num_seqs=2, kv_cache_dtype=dtype)
    eng, rows = llm.engine, []
    for n in sizes:
        ids = prompt(n, n)
        eng.add_request(ids, SamplingParams(temperature=0.0, max_tokens=1))
        while eng.has_unfinished():
            eng.step()
        wire = kv_transfer.export_pages(eng, ids)
        case = {"dtype": dtype, "tokens": n, "pages": header(wire)["pages"]}
        rows.append(row("export_pages", case, len(wire),
                        timed(lambda ids=ids: kv_transfer.export_pages(eng, ids), reps)))
    return rows


def codec_rows(case: dict, wire: bytes, reps: int) -> list[dict]:
    """``decode`` then ``encode`` of the same bytes, in this process (no engine)."""
    from jserve.engine.device import kv_transfer
    h = header(wire)
    like = [np.zeros(s["shape"][:2] + [0] + s["shape"][3:], s["dtype"]) for s in h["leaves"]]
    data = kv_transfer.decode(wire, like, h["page_size"])
    again = kv_transfer.encode(h["page_size"], data)
    assert again == wire, "encode(decode(wire)) is not wire"
    return [row("decode", case, len(wire),
                timed(lambda: kv_transfer.decode(wire, like, h["page_size"]), reps)),
            row("encode", case, len(wire),
                timed(lambda: kv_transfer.encode(h["page_size"], data), reps))]


# -- 2. jax.experimental.transfer ------------------------------------------------------------

def leaves_of(spec: list[dict], seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(-100, 100, s["shape"]).astype(s["dtype"]) for s in spec]


def _start_server():
    import jax
    from jax.experimental import transfer

    return transfer.start_transfer_server(jax.devices()[0].client, "127.0.0.1:0",
                                          ["127.0.0.1:0"])


def jax_peer(conn, specs: list[list[dict]], reps: int) -> None:
    """The exporting process: every (case, repetition) offered under its own uuid."""
    try:
        import jax

        server = _start_server()
        arrays = [[jax.device_put(x) for x in leaves_of(s, i)] for i, s in enumerate(specs)]
        for i, xs in enumerate(arrays):
            for r in range(reps + 1):
                server.await_pull(i * 1000 + r, xs)
        sums = [float(sum(np.asarray(x, np.float64).sum() for x in xs)) for xs in arrays]
        conn.send(("ready", server.address(), sums))
    except Exception as e:  # noqa: BLE001 - the error is the result on this backend
        conn.send(("error", f"{type(e).__name__}: {e}", None))
    conn.recv()  # done


def jax_rows(cases: list[dict], specs: list[list[dict]], reps: int) -> tuple[list, dict]:
    import jax

    ctx = mp.get_context("spawn")
    mine, theirs = ctx.Pipe()
    peer = ctx.Process(target=jax_peer, args=(theirs, specs, reps))
    peer.start()
    try:
        return _pull_all(mine, cases, specs, reps, jax)
    except Exception as e:  # noqa: BLE001
        return [], {"works": False, "error": f"{type(e).__name__}: {e}"}
    finally:
        mine.send("done")
        peer.join(60)


def _pull_all(conn, cases, specs, reps, jax) -> tuple[list, dict]:
    if not conn.poll(300):
        raise TimeoutError("the transfer server's process never answered")
    status, address, sums = conn.recv()
    if status != "ready":
        return [], {"works": False, "error": address, "where": "server process"}
    link = _start_server().connect(address)
    rows = [_pull_case(link, i, case, spec, reps, sums[i], jax)
            for i, (case, spec) in enumerate(zip(cases, specs))]
    return rows, {"works": True, "backend": jax.default_backend()}


def _pull_case(link, i: int, case: dict, spec: list[dict], reps: int, want: float, jax):
    dev = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    shapes = [jax.ShapeDtypeStruct(s["shape"], np.dtype(s["dtype"]), sharding=dev)
              for s in spec]
    uuids, got = iter(range(i * 1000, i * 1000 + reps + 1)), {}

    def pull():
        got["xs"] = jax.block_until_ready(link.pull(next(uuids), shapes))

    times = timed(pull, reps)
    total = float(sum(np.asarray(x, np.float64).sum() for x in got["xs"]))
    return row("jax_transfer", case, sum(x.nbytes for x in got["xs"]), times,
               checksum_ok=total == want)


# -- 3. the host's floor: a raw socket and shared memory --------------------------------------

def tcp_peer(conn, most: int) -> None:
    payload = np.random.default_rng(0).integers(0, 256, most, np.uint8).tobytes()
    with socket.create_server(("127.0.0.1", 0)) as listener:
        conn.send(listener.getsockname()[1])
        sock, _ = listener.accept()
    with sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        view = memoryview(payload)
        while (n := _N.unpack(_recv_exact(sock, bytearray(_N.size)))[0]):
            sock.sendall(view[:n])


def _recv_exact(sock, buf) -> bytearray:
    view, got = memoryview(buf), 0
    while got < len(buf):
        k = sock.recv_into(view[got:])
        if not k:
            raise ConnectionError("the peer closed the socket")
        got += k
    return buf


def tcp_rows(cases: list[dict], sizes: list[int], reps: int) -> list[dict]:
    ctx = mp.get_context("spawn")
    mine, theirs = ctx.Pipe()
    peer = ctx.Process(target=tcp_peer, args=(theirs, max(sizes)))
    peer.start()
    rows = []
    with socket.create_connection(("127.0.0.1", mine.recv())) as sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        for case, n in zip(cases, sizes):
            buf = bytearray(n)

            def ask(n=n, buf=buf):
                sock.sendall(_N.pack(n))
                _recv_exact(sock, buf)

            rows.append(row("tcp", case, n, timed(ask, reps)))
        sock.sendall(_N.pack(0))
    peer.join(60)
    return rows


def shm_peer(conn, most: int) -> None:
    payload = np.random.default_rng(0).integers(0, 256, most, np.uint8)
    seg = shared_memory.SharedMemory(create=True, size=most)
    conn.send(seg.name)
    while (n := conn.recv()):
        seg.buf[:n] = payload[:n].data
        conn.send(True)
    seg.close()
    seg.unlink()


def shm_rows(cases: list[dict], sizes: list[int], reps: int) -> list[dict]:
    ctx = mp.get_context("spawn")
    mine, theirs = ctx.Pipe()
    peer = ctx.Process(target=shm_peer, args=(theirs, max(sizes)))
    peer.start()
    seg = shared_memory.SharedMemory(name=mine.recv())
    rows = []
    for case, n in zip(cases, sizes):
        out = bytearray(n)

        def move(n=n, out=out):
            mine.send(n)
            mine.recv()
            out[:] = seg.buf[:n]

        rows.append(row("shm", case, n, timed(move, reps)))
    seg.close()
    mine.send(0)
    peer.join(60)
    return rows


# -- the run ---------------------------------------------------------------------------------

def parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default="256,1024,4096", help="prompt lengths in tokens")
    p.add_argument("--reps", type=int, default=7, help="timed repetitions (>= 5)")
    p.add_argument("--dtypes", default="auto,int8", help="--kv-cache-dtype of the producer")
    p.add_argument("--out", default=os.path.join(ROOT, "docs/scale_out/kv_transfer.json"))
    a = p.parse_args(argv)
    a.sizes = [int(s) for s in a.sizes.split(",")]
    a.dtypes = a.dtypes.split(",")
    return a


def run(a) -> dict:
    rows, cases, wires = [], [], []
    for dtype in a.dtypes:
        for (r, *others), wire in http_cases(dtype, a.sizes, a.reps):
            rows += [r, *others]
            cases.append({k: r[k] for k in ("tokens", "pages")} | {"dtype": r["kv_cache_dtype"]})
            wires.append(wire)
    for dtype in a.dtypes:
        rows += engine_rows(dtype, a.sizes, a.reps)
    for case, wire in zip(cases, wires):
        rows += codec_rows(case, wire, a.reps)
    specs = [header(w)["leaves"] for w in wires]
    jax_rows_, jax_status = jax_rows(cases, specs, a.reps)
    sizes = [len(w) for w in wires]
    rows += jax_rows_ + tcp_rows(cases, sizes, a.reps) + shm_rows(cases, sizes, a.reps)
    return {"rows": rows, "jax_transfer": jax_status}


def table(rows: list[dict]) -> str:
    lines = ["| mechanism | kv dtype | tokens | pages | bytes | median s | min s | MB/s |",
             "|---|---|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['mechanism']} | {r['kv_cache_dtype']} | {r['tokens']} | "
                     f"{r['pages']} | {r['bytes']:,} | {r['seconds_median']:.6f} | "
                     f"{r['seconds_min']:.6f} | {r['bytes_per_s'] / 1e6:,.0f} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    a = parse(argv)
    t0 = time.perf_counter()
    res = run(a)
    out = {"command": "JAX_PLATFORMS=cpu python scripts/bench_kv_transfer.py "
                      + " ".join(sys.argv[1:] if argv is None else argv),
           "date": datetime.date.today().isoformat(), "machine": machine(),
           "sizes": a.sizes, "reps": a.reps, "seconds": time.perf_counter() - t0, **res}
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    with open(a.out, "w") as f:
        json.dump(out, f, indent=1)
        f.write("\n")
    print(table(res["rows"]))
    print("jax_transfer:", res["jax_transfer"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
