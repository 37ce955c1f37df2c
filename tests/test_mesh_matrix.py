"""The 3D-parallel equality matrix: every mesh in {1,2}^3 over (spp, kvp, tp), plus tp=4,
kvp=4 and spp=4, runs one mixed workload (multi-chunk prefills beside decodes, a prompt
spanning every KV-cache-parallel group, and preemptions from a small KV pool) and must give
the 1-device engine's greedy tokens, with top logprobs within float32 reduction-order noise.
Every mesh runs with async scheduling (the default); the reference and the mesh of all three
axes run synchronously too ("<mesh>|sync"; one axis at a time synchronously was dropped for
the suite's time: async against sync on one device is tests/test_async_scheduling.py's, and
the three-axis mesh holds each axis's sync path), and one runs its layers unrolled
over slices of the stacked weights, as on a GPU ("<mesh>|sliced").

Two subprocesses with 8 forced host devices each run half of the meshes side by side (XLA
compiles on one core, and compiling dominates), so the rest of the suite keeps one CPU
device."""
from __future__ import annotations

import json
import textwrap
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from devices import run_on_devices
from sharding.mesh import MeshConfig

pytestmark = pytest.mark.slow

MESHES = [f"spp={s},kvp={k},tp={t}" for s in (1, 2) for k in (1, 2) for t in (1, 2)]
MESHES += ["tp=4", "kvp=4", "spp=4"]
MESHES += [f"{m}|sync" for m in ("tp=1", "spp=2,kvp=2,tp=2")]
MESHES += ["spp=1,kvp=2,tp=2|sliced"]

_SCRIPT = textwrap.dedent("""
    import json, sys
    from jserve import LLM, SamplingParams
    from harness.evaluate import release_executables
    from sharding.mesh import MeshConfig
    meshes = json.loads(sys.argv[1])
    settings = json.loads(sys.argv[2])
    # 150 tokens: three prefill chunks, and with max_model_len 256 it spans every kvp=4
    # group (64 tokens each) and grows across a boundary while decoding.
    # Prompts share no leading page (prefix caching stays on but cannot relieve the pool).
    prompts = [[3 + (7 * i + j) % 300 for j in range(n)]
               for i, n in enumerate((150, 9, 40, 3, 70))]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=2)
    result = {}
    for run in meshes:
        mesh, _, mode = run.partition("|")
        mc = MeshConfig.parse(mesh)
        # The same 16 usable pages on every mesh (a kvp group's pool holds 16/kvp of them plus
        # its sink): a small pool, so every mesh preempts.
        llm = LLM("default", mesh=mesh, num_kv_pages=16 // mc.kvp + 1,
                  async_scheduling=mode != "sync",
                  layer_loop=mode if mode in ("sliced", "indexed") else "auto", **settings)
        outs = llm.generate(prompts, params)
        eng = llm.engine
        eng.allocator.check()
        result[run] = {
            "tokens": [o.token_ids for o in outs],
            "top": [[[lp for _, lp in t.top] for t in o.logprobs] for o in outs],
            "preemptions": eng.scheduler.num_preemptions,
            "leaked": eng.allocator.num_allocated,
            "pages": eng.allocator.total,
            "devices": len(eng.runner.kv_cache[0].sharding.device_set)}
        del llm, eng, outs
        release_executables()
    print(json.dumps(result))
""")


def run_meshes(halves: list[list[str]]) -> dict:
    """``_SCRIPT``'s results for the runs ("<mesh>[|sync|sliced|indexed]") of each list, the
    lists in two processes side by side."""
    settings = dict(max_num_seqs=4, max_num_batched_tokens=64, max_prefill_seqs=2,
                    max_model_len=256, warmup=False, page_size=16)
    with ThreadPoolExecutor(len(halves)) as pool:
        runs = pool.map(lambda meshes: run_on_devices(_SCRIPT, json.dumps(meshes),
                                                      json.dumps(settings), timeout=1200), halves)
        return {mesh: r for run in runs for mesh, r in run.result.items()}


def check_against_one_device(result: dict, meshes: list[str], base: str = "tp=1|sync"):
    """Every run of ``meshes`` gave ``base``'s (one device) greedy tokens and top logprobs,
    preempted, and leaked no page."""
    base = result[base]
    assert base["devices"] == 1 and base["preemptions"] > 0 and base["pages"] == 16
    assert all(len(t) == 12 for t in base["tokens"])
    for mesh in meshes:
        got = result[mesh]
        size = MeshConfig.parse(mesh.partition("|")[0]).size
        assert got["devices"] == size and got["pages"] == 16, mesh
        assert got["tokens"] == base["tokens"], mesh
        assert got["preemptions"] > 0 and got["leaked"] == 0, (mesh, got["preemptions"])
        np.testing.assert_allclose(np.array(got["top"]), np.array(base["top"]), atol=2e-4,
                                   rtol=0, err_msg=mesh)


def test_every_mesh_matches_one_device():
    result = run_meshes([["tp=1|sync"] + MESHES[0::2], MESHES[1::2]])
    check_against_one_device(result, MESHES)
