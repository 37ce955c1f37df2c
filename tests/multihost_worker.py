"""One process of the multi-host test: ``python -m tests.multihost_worker COORD N I DEVICES MESH
OUT KV_CACHE_DTYPE MODEL``. Process 0 generates greedy outputs for fixed prompts and writes
them (JSON) to OUT; the others follow. ``N=1`` runs the same engine in one process, the
reference. MODEL: ``default`` (the built-in random Llama) or a checkpoint directory."""
from __future__ import annotations

import faulthandler
import json
import sys

import jax

CONSTRAINT = r"[0-9]{3}-[a-z]{2,4}"
TIMEOUT = 300  # seconds the test waits for every worker


def main(coordinator: str, num_processes: int, process_id: int, devices: int, mesh: str,
         out: str, kv_cache_dtype: str, model: str) -> None:
    from sharding import distributed
    if num_processes > 1:
        distributed.initialize(coordinator, num_processes, process_id, devices)
    else:
        jax.config.update("jax_num_cpu_devices", devices)
    from jserve import LLM, SamplingParams
    from jserve.sampling.structured import StructuredOutput
    from tests.llm_helpers import SMALL

    llm = LLM(model, mesh=mesh, kv_cache_dtype=kv_cache_dtype, **SMALL)
    if not distributed.is_leader():
        distributed.follow(llm.engine.runner)
        return
    masked = []  # per broadcast step: whether a structured-output bitmask followed
    broadcast = distributed.leader_execute

    def counted(runner, shape, ibuf, fbuf, masks=None, *args):
        masked.append(masks is not None)
        return broadcast(runner, shape, ibuf, fbuf, masks, *args)
    distributed.leader_execute = counted
    prompts = [[1, 2, 3, 4, 5], list(range(10, 50)), [7] * 3, list(range(100, 119))]
    try:
        params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
        outs = llm.generate(prompts, params)
        # Then one request alone: under spp its batches are lone passes.
        outs += llm.generate([[11, 12, 13]], params)
        # A constrained request beside a free one: its steps send their bitmask too.
        shaped = llm.generate([[5, 6, 7], [20, 21, 22, 23]], [SamplingParams(
            temperature=0.0, max_tokens=16, structured_output=StructuredOutput(
                regex=CONSTRAINT)), params])
    finally:
        if num_processes > 1:
            distributed.stop_followers()
    with open(out, "w") as f:
        json.dump({"tokens": [o.token_ids for o in outs], "processes": jax.process_count(),
                   "devices": jax.device_count(),
                   # spp: batches that ran alone as one pass (the followers ran them too)
                   "passes": sum(llm.engine.runner.passed.values()),
                   "constrained": [o.token_ids for o in shaped], "text": shaped[0].text,
                   "masked_steps": sum(masked)}, f)


if __name__ == "__main__":
    # A worker still running near the test's timeout prints every thread's stack (the test
    # reports the tail of its output): a hang says where it is.
    faulthandler.dump_traceback_later(TIMEOUT - 30, exit=False)
    c, n, i, d, m, o, kv, model = sys.argv[1:]
    main(c, int(n), int(i), int(d), m, o, kv, model)
