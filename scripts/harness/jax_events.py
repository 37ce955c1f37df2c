"""JAX's compile events, recorded: trace, lowering and backend-compile time (the union of
each event's time spans, so nested traces are not counted twice) and the persistent cache's
hits and misses, from ``jax.monitoring`` listeners."""
from __future__ import annotations


class EventRecorder:
    """Collects JAX monitoring events: durations and time spans per event name (spans are
    merged so nested jit traces are not counted twice), plain event counts."""

    def __init__(self):
        import jax
        self.durations: dict[str, list[float]] = {}
        self.spans: dict[str, list[tuple[float, float, str]]] = {}
        self.counts: dict[str, int] = {}
        self.active = True
        mon = jax.monitoring
        mon.register_event_duration_secs_listener(self._duration)
        mon.register_event_listener(self._event)
        try:
            from jax._src import monitoring as _mon
            _mon.register_event_time_span_listener(self._span)
            self.has_spans = True
        except (ImportError, AttributeError):
            self.has_spans = False

    def _duration(self, event, secs, **kw):
        if self.active:
            self.durations.setdefault(event, []).append(float(secs))

    def _span(self, event, start, end, **kw):
        if self.active:
            self.spans.setdefault(event, []).append((float(start), float(end),
                                                     str(kw.get("fun_name", ""))))

    def _event(self, event, **kw):
        if self.active:
            self.counts[event] = self.counts.get(event, 0) + 1

    def reset(self):
        self.durations.clear()
        self.spans.clear()
        self.counts.clear()

    def covered(self, event: str, name_filter=None) -> float:
        """Wall seconds covered by the event's spans (union of intervals); falls back to the
        sum of durations without span listeners."""
        if not self.has_spans:
            return sum(self.durations.get(event, []))
        spans = sorted((s, e) for s, e, n in self.spans.get(event, [])
                       if name_filter is None or name_filter(n))
        total, cur_s, cur_e = 0.0, None, None
        for s, e in spans:
            if cur_e is None or s > cur_e:
                if cur_e is not None:
                    total += cur_e - cur_s
                cur_s, cur_e = s, e
            else:
                cur_e = max(cur_e, e)
        if cur_e is not None:
            total += cur_e - cur_s
        return total

    def summary(self) -> dict:
        from jax._src import dispatch
        trace = getattr(dispatch, "JAXPR_TRACE_EVENT", "/jax/core/compile/jaxpr_trace_duration")
        lower = getattr(dispatch, "JAXPR_TO_MLIR_MODULE_EVENT",
                        "/jax/core/compile/jaxpr_to_mlir_module_duration")
        backend = getattr(dispatch, "BACKEND_COMPILE_EVENT",
                          "/jax/core/compile/backend_compile_duration")
        is_step = lambda n: any(k in n for k in ("_step", "_tick", "_sample"))
        c = self.counts
        return {
            "trace_s": self.covered(trace),
            "lower_s": self.covered(lower),
            "backend_compile_s": self.covered(backend),
            "step_trace_s": self.covered(trace, is_step),
            "step_lower_s": self.covered(lower, is_step),
            "step_backend_compile_s": self.covered(backend, is_step),
            "n_traces": len(self.durations.get(trace, [])),
            "n_lowerings": len(self.durations.get(lower, [])),
            "n_backend_compiles": len(self.durations.get(backend, [])),
            "cache_requests": c.get("/jax/compilation_cache/compile_requests_use_cache", 0),
            "cache_hits": c.get("/jax/compilation_cache/cache_hits", 0),
            "cache_misses": c.get("/jax/compilation_cache/cache_misses", 0),
            "compile_time_saved_s": sum(
                self.durations.get("/jax/compilation_cache/compile_time_saved_sec", [])),
            "cache_retrieval_s": sum(
                self.durations.get("/jax/compilation_cache/cache_retrieval_time_sec", [])),
            "has_spans": self.has_spans,
        }
