"""KV-cache parallel attention: the token-range layout helpers, the LSE merge, and (in a
subprocess with 8 forced host devices) sharded attention against the unsharded reference."""
from __future__ import annotations

import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from devices import run_on_devices
from jserve.kernels.kv_parallel import (
    group_write_slots,
    local_kv_len,
    local_page_table,
    merge_partials,
    owner_group,
)


def test_owner_group_and_local_kv_len_split_a_sequence_by_token_range():
    L = 16
    assert [int(owner_group(p, L)) for p in (0, 15, 16, 31, 32, 47)] == [0, 0, 1, 1, 2, 2]
    # kv_len 5 lives only in group 0; 40 fills groups 0 and 1 and 8 tokens of group 2.
    lens = np.array([0, 5, 16, 40])
    assert [local_kv_len(lens, g, L).tolist() for g in range(4)] == [
        [0, 5, 16, 16], [0, 0, 0, 16], [0, 0, 0, 8], [0, 0, 0, 0]]
    table = np.arange(24).reshape(2, 12)
    np.testing.assert_array_equal(local_page_table(table, 1, 4), table[:, 4:8])


def test_write_slots_store_every_live_token_once_in_its_owning_group():
    L, S = 8, 4                                          # 2 local pages per group, kvp=3
    kv_lens = np.array([19, 3, 0], np.int32)             # spans 3 groups; group 0 only; padding
    tables = [np.array([[1, 2], [3, 0], [0, 0]]), np.array([[2, 1], [0, 0], [0, 0]]),
              np.array([[1, 0], [0, 0], [0, 0]])]
    positions = np.array([*range(19), 0, 1, 2, 0, 0], np.int32)
    token_seq = np.array([0] * 19 + [1, 1, 1, 2, 3], np.int32)  # a padding row, a padding token
    slots = np.stack([np.asarray(group_write_slots(positions, token_seq, kv_lens, tables[g], g,
                                                   L, S)) for g in range(3)])
    owner = [0] * 8 + [1] * 8 + [2] * 3 + [0, 0, 0]
    for t, g in enumerate(owner):
        seq, local = token_seq[t], positions[t] - g * L
        assert slots[g, t] == tables[g][seq, local // S] * S + local % S
        assert all(slots[h, t] == 0 for h in range(3) if h != g)  # non-owners hit the sink
    assert np.all(slots[:, -2:] == 0)                    # padding row and token: sink only
    assert len({(g, s) for g in range(3) for s in slots[g] if s}) == 22  # no slot shared


def test_merge_guards_groups_and_rows_without_keys():
    """Group partials merged over a vmapped axis: a group with lse -inf gets weight 0 and a
    row no group sees comes out zero with lse -inf."""
    rng = np.random.default_rng(0)
    out = rng.normal(size=(3, 4, 2, 5)).astype(np.float32)  # [groups, T, H, D]
    lse = rng.normal(size=(3, 4, 2)).astype(np.float32)
    lse[1, 1] = -np.inf                                    # row 1: group 1 empty
    lse[:, 2] = -np.inf                                    # row 2: empty everywhere
    out[:, 2] = 0.0
    got_out, got_lse = jax.vmap(lambda o, l: merge_partials(o, l, "g"), axis_name="g")(
        jnp.asarray(out), jnp.asarray(lse))
    got_out, got_lse = np.asarray(got_out), np.asarray(got_lse)
    w = np.exp(np.where(np.isfinite(lse), lse, -np.inf))    # exp(-inf) = 0
    live = [0, 1, 3]
    ref_out = (out * w[..., None]).sum(0)[live] / w.sum(0)[live][..., None]
    for g in range(3):                                     # replicated over the axis
        np.testing.assert_allclose(got_out[g][live], ref_out, atol=1e-6, rtol=1e-5)
        np.testing.assert_allclose(got_lse[g][live], np.log(w.sum(0)[live]), atol=1e-6)
        assert np.all(got_out[g][2] == 0) and np.all(np.isneginf(got_lse[g][2]))
    assert not np.isnan(got_out).any() and not np.isnan(got_lse).any()


_KVP_SCRIPT = textwrap.dedent("""
    import dataclasses, functools, json, sys
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import PartitionSpec as P
    sys.path.insert(0, "tests")
    from ragged import ragged_case
    from jserve.kernels.kv_write import write_kv
    from jserve.kernels.reference import ragged_paged_attention
    from jserve.kernels.kv_parallel import group_write_slots, kvp_attention
    from sharding.kv_parallel import KV_PAGES_SPEC, metadata_specs
    from sharding.mesh import MeshConfig, make_mesh

    S, WIDTH, HQ, HKV, D = 4, 8, 4, 2, 16          # every case fits 32 tokens per sequence
    # Decodes: 32 tokens (every group at kvp=2 and 4), 9, 3 and a padding row. Prefill chunks:
    # short in group 0; crossing the kvp=4 boundary at 8; crossing 16 (both meshes); crossing
    # 24 while reading a context that spans groups. ragged_case adds 3 padding tokens.
    DECODES, PREFILLS = [32, 9, 3, 0], [(0, 5), (5, 7), (12, 6), (20, 12)]

    def kvp_layout(kvp, kv_lens, dense):
        # Group-local page tables (logical page order) and pools filled through the write slots.
        w = WIDTH // kvp
        rows = len(kv_lens)
        tables = np.zeros((kvp, rows, w), np.int32)
        for g in range(kvp):
            used = [(i, j) for i in range(rows) for j in range(w) if (g * w + j) * S < kv_lens[i]]
            for n, (i, j) in enumerate(used):
                tables[g, i, j] = n + 1                 # page 0 is the group's sink
        pool = 1 + max(int(t.max()) for t in tables)
        pos = np.concatenate([np.arange(len(k)) for _, k, _, _ in dense] + [[0]]).astype(np.int32)
        seq = np.concatenate([np.full(len(k), i) for i, (_, k, _, _) in enumerate(dense)]
                             + [[rows]]).astype(np.int32)   # plus one padding token
        ks = np.concatenate([k for _, k, _, _ in dense] + [np.ones((1, HKV, D))]).astype(np.float32)
        vs = np.concatenate([v for _, _, v, _ in dense] + [np.ones((1, HKV, D))]).astype(np.float32)
        kp, vp = [], []
        for g in range(kvp):
            slots = group_write_slots(pos, seq, kv_lens, tables[g], g, w * S, S)
            empty = jnp.zeros((HKV, pool, S, D), jnp.float32)
            kp.append(write_kv(empty, slots, ks))
            vp.append(write_kv(empty, slots, vs))
        return (jnp.concatenate(kp, axis=1), jnp.concatenate(vp, axis=1),
                jnp.asarray(np.concatenate(list(tables), axis=1)))

    rng = np.random.default_rng(7)
    q, kp, vp, meta, dense = ragged_case(rng, DECODES, PREFILLS, HQ, HKV, D, page_size=S,
                                         width=WIDTH)
    ref_out, ref_lse = map(np.asarray, ragged_paged_attention(jnp.asarray(q), jnp.asarray(kp),
                                                              jnp.asarray(vp), meta))
    result = {}
    # The Pallas kernels run in interpret mode here; they must take the shifted positions too.
    for kvp, tp, impl in ((2, 1, "reference"), (4, 1, "reference"), (2, 2, "reference"),
                          (4, 1, "pallas_gpu"), (4, 1, "pallas_tpu")):
        mesh = make_mesh(MeshConfig(kvp=kvp, tp=tp))
        k_pages, v_pages, table = kvp_layout(kvp, np.asarray(meta.kv_lens), dense)
        m = dataclasses.replace(meta, page_table=table)
        qs = P(None, "tp")
        # check_vma off as in tp_forward: the reference's loop carries start invariant.
        f = jax.jit(jax.shard_map(functools.partial(kvp_attention, impl=impl), mesh=mesh,
                                  in_specs=(qs, KV_PAGES_SPEC, KV_PAGES_SPEC, metadata_specs(m)),
                                  out_specs=(qs, qs), check_vma=False))
        out, lse = map(np.asarray, f(jnp.asarray(q), k_pages, v_pages, m))
        pad = np.isneginf(ref_lse)
        result[f"kvp={kvp},tp={tp},{impl}"] = {
            "out_err": float(np.abs(out - ref_out).max()),
            "lse_err": float(np.abs(lse[~pad] - ref_lse[~pad]).max()),
            "padding_ok": bool(np.all(np.isneginf(lse[pad])) and np.all(out[pad.any(-1)] == 0)),
            "nan": bool(np.isnan(out).any() or np.isnan(lse).any()),
            "padding_rows": int(pad.any(-1).sum())}
    print(json.dumps(result))
""")


@pytest.mark.slow
def test_kvp_attention_matches_unsharded_reference():
    """Decodes whose context spans every group, prefill chunks short, long and crossing group
    boundaries, padding rows and tokens: kvp=2, kvp=4 and kvp=2 x tp=2 (and the Pallas
    kernels at kvp=4) give the unsharded reference's output and lse to float32 rounding, with
    zeros and -inf (no NaN) for rows that have no keys."""
    result = run_on_devices(_KVP_SCRIPT, timeout=300).result
    assert sorted(result) == ["kvp=2,tp=1,reference", "kvp=2,tp=2,reference",
                              "kvp=4,tp=1,pallas_gpu", "kvp=4,tp=1,pallas_tpu",
                              "kvp=4,tp=1,reference"]
    for mesh, r in result.items():
        assert r["out_err"] < 1e-5 and r["lse_err"] < 1e-5, (mesh, r)
        assert r["padding_ok"] and not r["nan"], (mesh, r)
        assert r["padding_rows"] == 4, (mesh, r)  # the padding decode row and 3 padding tokens


def test_row_offsets_place_each_rows_range_from_its_start_group():
    """A sequence starting in group s keeps logical chunk (g - s) % kvp in group g: with
    kvp=3, L=8 a row starting in group 2 has tokens 0..7 in group 2, 8..15 in group 0; the
    write slots and local kv_lens follow the per-row offsets."""
    from jserve.kernels.kv_parallel import row_offsets
    L, S = 8, 4
    start = np.array([0, 2], np.int32)
    assert [row_offsets(start, g, 3, L).tolist() for g in range(3)] == [[0, 8], [8, 16],
                                                                         [16, 0]]
    kv_lens = np.array([3, 12], np.int32)
    positions = np.array([0, 1, 2, *range(12)], np.int32)
    token_seq = np.array([0, 0, 0] + [1] * 12, np.int32)
    tables = [np.array([[1, 0], [2, 0]]), np.array([[0, 0], [0, 0]]), np.array([[0, 0], [1, 3]])]
    slots = [np.asarray(group_write_slots(positions, token_seq, kv_lens, tables[g], g, L, S,
                                          offsets=row_offsets(start, g, 3, L)))
             for g in range(3)]
    # row 0 (start 0): group 0 page 1; row 1: tokens 0..7 in group 2 (pages 1, 3), 8..11 in
    # group 0 (page 2); group 1 holds nothing.
    assert slots[0].tolist() == [4, 5, 6] + [0] * 8 + [8, 9, 10, 11]
    assert slots[1].tolist() == [0] * 15
    assert slots[2].tolist() == [0, 0, 0] + [4, 5, 6, 7, 12, 13, 14, 15] + [0] * 4
