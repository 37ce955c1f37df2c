"""Where the compiled decode step spends its time, op by op, on XLA:CPU
(``scripts/profile_ops.py``): ``jax.profiler`` traces of the bench model's step executable
and sampling executable (``harness.decode_step``), each traced op joined with its
executable's optimized HLO and put in a group (matmul by weight, the attention loop and its
inner ops, KV write, layout ops, elementwise fusions)."""
from __future__ import annotations

import collections
import glob
import re
import tempfile
import time

import jax
from jax.profiler import ProfileData

from harness.decode_step import (
    DeviceStep,
    bench_engine,
    bench_model,
    bench_prompts,
    capture_decode,
)
from jserve import SamplingParams

LAYOUT_OPS = {"parameter", "bitcast", "copy", "transpose", "pad", "slice", "concatenate",
              "broadcast", "reshape", "constant", "dynamic-slice", "dynamic-update-slice",
              "iota", "convert"}


# "%name = shape op(" where a shape is one token or a tuple "(a, b, /*index=5*/c)".
_INSTRUCTION = r"^\s+(?:ROOT )?%([\w.\-]+) = (\([^()]*\)|\S+) ([\w\-]+)\("


class Hlo:
    """Instructions of an optimized HLO module: name -> (computation, line), and the op
    names inside each computation."""

    def __init__(self, text: str):
        self.inst: dict[str, tuple[str, str]] = {}
        self.ops: dict[str, list[str]] = collections.defaultdict(list)
        self.entry = None
        comp = None
        for line in text.splitlines():
            head = re.match(r"^(ENTRY )?%([\w.\-]+) .*\{$", line)
            if head:
                comp = head.group(2)
                self.entry = comp if head.group(1) else self.entry
                continue
            m = re.match(_INSTRUCTION, line)
            if m and comp is not None:
                self.inst[m.group(1)] = (comp, line)
                self.ops[comp].append(m.group(3))

    def body(self, line: str) -> set[str]:
        """Ops of the computation a fusion (or call) line calls, plus its own op."""
        own = re.match(_INSTRUCTION, line).group(3)
        called = re.search(r"calls=%([\w.\-]+)", line)
        return {own} | (set(self.ops[called.group(1)]) if called else set())

    def group(self, name: str) -> str | None:
        """The group of a top-level op, None for ops inside loops or not in this module."""
        if name not in self.inst:
            return None
        comp, line = self.inst[name]
        if comp != self.entry:
            return None
        ops = self.body(line)
        if "while" in ops:
            return "attention loop (while)"
        if "dot" in ops or "convolution" in ops:
            weight = re.search(r"%params__(?:layers___\d+___)?(\w+?)__", line)
            return f"matmul {weight.group(1) if weight else '(activations)'}"
        if "scatter" in ops:
            return "KV write / state scatter"
        if "gather" in ops:
            return "gather (embedding, rows)"
        if "conditional" in ops:
            return "conditional (penalty state)"
        if ops <= LAYOUT_OPS:
            return "layout: copy, transpose, pad, slice"
        return "elementwise fusions (norm, rope, silu, adds)"

    def inner_group(self, name: str) -> str | None:
        """The group of an op inside a loop body (the attention's inner ops)."""
        if name not in self.inst or self.inst[name][0] == self.entry:
            return None
        line = self.inst[name][1]
        ops = self.body(line)
        if "dot" in ops:
            return "dot QK" if "hbcd->hbgc" in line else "dot PV" if "->hbgd" in line else "dot"
        if "gather" in ops:
            return "gather pages (+ transpose)"
        if "scatter" in ops:
            return "scatter (softmax merge)"
        if "while" in ops:
            return "inner loop"
        return "elementwise / layout"


def trace(run, steps: int) -> tuple[ProfileData, float]:
    """Profile of ``steps`` calls of ``run`` and the wall time per call."""
    run(3)
    with tempfile.TemporaryDirectory() as d:
        jax.profiler.start_trace(d)
        t = time.perf_counter()
        run(steps)
        wall = (time.perf_counter() - t) / steps
        jax.profiler.stop_trace()
        return ProfileData.from_file(glob.glob(f"{d}/plugins/profile/*/*.xplane.pb")[0]), wall


def op_times(profile: ProfileData, hlo: Hlo, steps: int) -> dict[str, float]:
    """Seconds per step of every traced op of ``hlo``'s module."""
    times: collections.Counter = collections.Counter()
    for plane in profile.planes:
        for line in plane.lines:
            for ev in line.events:
                if ev.name in hlo.inst:
                    times[ev.name] += ev.duration_ns * 1e-9 / steps
    return times


def breakdown(title: str, hlo: Hlo, times: dict[str, float], wall: float, top: int) -> None:
    groups: collections.Counter = collections.Counter()
    inner: collections.Counter = collections.Counter()
    for name, t in times.items():
        g = hlo.group(name)
        if g is not None:
            groups[g] += t
        elif (ig := hlo.inner_group(name)) is not None:
            inner[ig] += t
    total = sum(groups.values())
    print(f"\n{title}: wall {1e3 * wall:.2f} ms per call; top-level ops sum {1e3 * total:.2f} ms")
    for g, t in groups.most_common():
        print(f"  {1e3 * t:8.3f} ms {100 * t / total:5.1f}%  {g}")
        if g.startswith("attention") and inner:
            for ig, it in inner.most_common():
                print(f"      {1e3 * it:8.3f} ms  {ig}")
    print(f"  top {top} ops:")
    for name, t in collections.Counter(times).most_common(top):
        comp, line = hlo.inst[name]
        shape = re.match(_INSTRUCTION, line).group(2)
        where = re.search(r'op_name="([^"]+)"', line)
        print(f"    {1e3 * t:7.3f} ms  {name:28s} {shape[:36]:36s} "
              f"{'' if comp == hlo.entry else '(in loop) '}{where.group(1)[-50:] if where else ''}")


def profile_ops(a) -> None:
    """Both executables traced ``a.steps`` calls each, their breakdowns printed; the step's
    HLO written to ``a.hlo_out`` if given. ``a``: ``scripts/profile_ops.py``'s flags."""
    eng = bench_engine(a.batch, model=bench_model(a.model))
    params = SamplingParams(temperature=0.0, max_tokens=a.new_tokens, ignore_eos=True)
    prompts = bench_prompts(a.batch, a.prompt_len, eng.runner.model_config.vocab_size)
    shape, packed = capture_decode(eng, prompts, params)
    step = DeviceStep(eng, packed, shape)
    step_hlo_text = step.exe.as_text()
    if a.hlo_out:
        with open(a.hlo_out, "w") as f:
            f.write(step_hlo_text)
    step_hlo = Hlo(step_hlo_text)

    profile, wall = trace(lambda n: step.time("one", calls=n), a.steps)
    breakdown(f"step executable, batch {a.batch}", step_hlo,
              op_times(profile, step_hlo, a.steps), wall, a.top)
    forward_hlo = Hlo(step.forward.as_text())  # the step without its sampling tail
    profile, wall = trace(lambda n: step.time("forward", calls=n), a.steps)
    breakdown("its forward alone", forward_hlo, op_times(profile, forward_hlo, a.steps),
              wall, a.top)
    sampler_hlo = Hlo(step.sample.as_text())
    r = eng.runner
    logits, r.kv_cache, r.state, _ = step.forward(r.params, r.kv_cache, r.state, step.ibuf,
                                                  step.fbuf)
    inputs = step.inputs(logits)

    def run_sampler(n):
        out = None
        for _ in range(n):
            out, r.state = step.sample(r.state, inputs)
        jax.block_until_ready(out)

    profile, wall = trace(run_sampler, a.steps)
    breakdown("sampling executable", sampler_hlo, op_times(profile, sampler_hlo, a.steps),
              wall, 10)
