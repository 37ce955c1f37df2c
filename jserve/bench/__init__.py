"""Offline evaluation: workloads (``workload``), live runs in process or over gRPC (``replay``),
latency metrics for live and simulated records alike (``metrics``) and plots (``plots``)."""
