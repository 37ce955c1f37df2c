"""``jserve bench serve`` (``serve_bench``: vLLM's ``bench serve`` against a running server),
its request sets (``datasets``), live runs in process or over gRPC and HTTP (``replay``) and
latency metrics for live and simulated records alike (``metrics``, which the simulator reads
too). The benchmarks, profilers, device checks and paper reproductions built on these live
outside the package, in ``scripts/harness``."""
