"""A ``jserve serve`` subprocess on free loopback ports, for the tests and the benchmarks
that talk to a real server: ``Served(*flags)`` starts one (small engine unless the flags say
otherwise) and reads its gRPC target and HTTP URL from its first line. No JAX here."""
from __future__ import annotations

import re
import subprocess
import sys
import tempfile
from pathlib import Path

SERVE_FLAGS = ["--no-warmup", "--max-num-seqs", "4", "--max-num-batched-tokens", "32",
               "--max-model-len", "512", "--host", "127.0.0.1", "--grpc-port", "0",
               "--port", "0", "--metrics-port", "-1"]  # --port: the OpenAI API's


class Served:
    """A ``jserve serve`` subprocess (small engine, free loopback ports) and its addresses;
    ``warmup``: compile every step shape before serving (off: on first use)."""

    def __init__(self, *flags: str, warmup: bool = False):
        base = SERVE_FLAGS if not warmup else ["--warmup" if f == "--no-warmup" else f
                                               for f in SERVE_FLAGS]
        # stderr to a file: a pipe nobody reads blocks the server once it fills (64 KiB of
        # logged tracebacks).
        self.stderr = tempfile.TemporaryFile("w+")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "jserve.cli", "serve", *base, *flags],
            stdout=subprocess.PIPE, stderr=self.stderr, text=True,
            cwd=Path(__file__).resolve().parents[2])  # this jserve's checkout
        self.line = self.proc.stdout.readline()
        m = re.search(r"on ([\d.]+):(\d+) .*OpenAI API http://[\d.]+:(\d+)/v1", self.line)
        if m is None:
            self.proc.kill()
            self.proc.wait()
            self.stderr.seek(0)
            raise RuntimeError(f"jserve serve did not start: {self.line!r} "
                               f"{self.stderr.read()[-3000:]}")
        host = "127.0.0.1" if m.group(1) == "0.0.0.0" else m.group(1)
        self.target = f"{host}:{m.group(2)}"
        self.url = f"http://{host}:{m.group(3)}"

    def stop(self, timeout: float = 30.0) -> None:
        """Terminates the server, waits up to ``timeout`` seconds for it, then ``close``."""
        self.proc.terminate()
        try:
            self.proc.wait(timeout)
        finally:
            self.close()

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        for f in (self.proc.stdout, self.stderr):
            f.close()


def engine_tpot(url: str, name: str = "jserve_time_per_output_token_seconds"
                ) -> tuple[float, float]:
    """(sum, count) of the server's TPOT histogram ``name``, taken on the engine thread: by
    default one observation per step that gave a request tokens (the gap over its tokens);
    ``jserve_request_time_per_output_token_seconds``: one per finished request (its mean
    token gap)."""
    import httpx2 as httpx
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(url + "/metrics", timeout=30).text
    got = {s.name: s.value for fam in text_string_to_metric_families(text)
           for s in fam.samples if s.name.startswith(name + "_")}
    return got[name + "_sum"], got[name + "_count"]
