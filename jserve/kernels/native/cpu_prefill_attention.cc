// Paged prefill attention for XLA:CPU, called through the XLA FFI (jserve/kernels/cpu.py).
//
// XLA:CPU runs the jnp reference's prefill attention as a loop of small batched dots over
// gathered KV blocks, one (query tile, KV block) pair an iteration, which leaves a core idle
// and runs the dots far under the matmul rate (docs/kernels.md). Here each work item is one
// KV head and a tile of up to kTileRows query rows (consecutive tokens of one sequence, all
// of their grouped heads); items are spread over XLA's intra-op thread pool. A tile reads
// its sequence's keys kBlock positions at a time straight from the stacked page pool
// [layers, Hkv, pages, page_size, D] at a run-time layer (float32, bfloat16, or int8 with one
// scale per token and head), stops at its last token's position (causal), and keeps an
// online softmax per row. Its queries are transposed once, so that the vectors (GCC vector
// extensions, one machine register wide: 16 floats with AVX-512, else 8) run over rows: a
// key element is one broadcast for all of them, and the softmax needs no horizontal
// reduction. Exponentials are a vector polynomial. The accumulators of the two inner loops
// are sized to the register file (32 vector registers with AVX-512, 16 with AVX2): 16-float
// vectors on an AVX2 host took two registers each and spilled, about 10x slower.
//
// q [Hkv, T, G, D] float32, already scaled; q_seq [T] each token's row of the page table
// (tokens of a row are contiguous; a token whose row is negative or not below num_seqs is
// padding); q_pos [T] its position; q_lo [T] its first key (a sliding window; 0 without).
// Returns out [Hkv, T, G, D] and the log-sum-exp [Hkv, T, G] (-inf, and a zero output, for a
// token with no keys), as the jnp reference (jserve/kernels/reference.py) does.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "elements.h"
#include "pool.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

#ifdef __AVX512F__
constexpr int kKeys = 16;       // floats a vector
constexpr int kGroup = 4;       // keys (scores) or dims (outputs) an inner loop accumulates
#else
constexpr int kKeys = 8;
constexpr int kGroup = 2;
#endif
constexpr int kBlock = 16;      // keys a block (a multiple of kGroup)
constexpr int kTileRows = 4 * kKeys;  // query rows (tokens x group) a work item: 4 vectors
constexpr int kMaxDim = 256;    // head_dim (a multiple of 16)
typedef float vf __attribute__((vector_size(kKeys * sizeof(float))));
typedef int32_t vi __attribute__((vector_size(kKeys * sizeof(int32_t))));

using jserve_native::load;

// exp(x) for x <= 0 (scores minus their running maximum), to about 2 ulp: 2^n * p(r) with
// n = round(x / ln 2) and r = x - n ln 2 in two parts, p Taylor's to degree 6; below -87 it
// is 0 (the caller masks invalid keys separately).
constexpr vf kZero = {};

inline vf vexp(vf x) {
  const vf in_range = x < -87.0f ? kZero : kZero + 1.0f;
  x = x < -87.0f ? kZero - 87.0f : x;
  const vf magic = kZero + 12582912.0f;  // 1.5 * 2^23: adding it rounds to an integer
  vf n = (x * 1.44269504f + magic) - magic;
  vf r = x - n * 0.693145752f;
  r = r - n * 1.42860677e-6f;
  vf p = r * (1.0f / 720) + (1.0f / 120);
  p = p * r + (1.0f / 24);
  p = p * r + (1.0f / 6);
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  vi bits = (__builtin_convertvector(n, vi) + 127) << 23;
  vf scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return p * scale * in_range;
}


struct Tile {
  int64_t start, tokens, seq;
};

template <typename T>
struct Problem {
  const float* q;
  const T* k;
  const T* v;
  const float* k_scale;  // int8 pages: [layers, Hkv, pages, page_size]; else null
  const float* v_scale;
  const int32_t* q_pos;
  const int32_t* q_lo;
  const int32_t* kv_lens;
  const int32_t* page_table;
  float* out;
  float* lse;
  int64_t hkv, t, g, d, pages, page_size, width, layer;
  std::vector<Tile> tiles;
};

// One work item: a tile's rows (RV vectors of kKeys rows; rows past the tile's are padding)
// against its keys, kBlock at a time. The tile's queries are transposed once ([D][RV]
// vectors), so a key's scores for every row are RV vectors, sum_d k[d] * qt[d]: each key
// element is one broadcast for all the rows and the K and V rows are read in place from
// their pages. The softmax runs down a block's kBlock keys for all rows at once (running max, sum and
// rescale are vectors over rows: no horizontal reduction), and the output accumulates
// transposed, ot[D][RV] += v[key][d] * w[key], then is written back per row.
template <typename T, int RV>
void attend_rows(const Problem<T>& p, int64_t h, const Tile& tile) {
  const int64_t g = p.g, d = p.d, rows = tile.tokens * g;
  thread_local std::vector<vf> qt_buf, ot_buf;
  qt_buf.assign(d * RV, kZero);
  ot_buf.assign(d * RV, kZero);
  vf* qt = qt_buf.data();
  vf* ot = ot_buf.data();
  const float* q = p.q + (h * p.t + tile.start) * g * d;
  vi pos[RV], first[RV];
  vf m[RV], l[RV];
  int64_t lo = INT64_MAX, hi = 0;
  for (int v = 0; v < RV; ++v) {
    for (int j = 0; j < kKeys; ++j) {
      const int64_t r = v * kKeys + j;
      if (r < rows) {
        const int64_t tok = tile.start + r / g;
        pos[v][j] = p.q_pos[tok];
        first[v][j] = std::max<int32_t>(0, p.q_lo[tok]);
        for (int64_t i = 0; i < d; ++i) qt[i * RV + v][j] = q[r * d + i];
        lo = std::min<int64_t>(lo, first[v][j]);
        hi = std::max<int64_t>(hi, pos[v][j] + 1);
      } else {
        pos[v][j] = -1;  // no key is a padding row's
        first[v][j] = 0;
      }
    }
    m[v] = kZero - INFINITY;
    l[v] = kZero;
  }
  hi = std::min<int64_t>(hi, std::min<int64_t>(p.kv_lens[tile.seq], p.width * p.page_size));
  const int64_t base = (p.layer * p.hkv + h) * p.pages;
  const T* kr[kBlock];
  const T* vr[kBlock];
  float ks[kBlock], vs[kBlock];
  vf s[kBlock][RV];
  const int32_t* table = p.page_table + tile.seq * p.width;
  for (int64_t k0 = lo; k0 < hi; k0 += kBlock) {
    const int64_t n = std::min<int64_t>(kBlock, hi - k0);
    int64_t page = k0 / p.page_size, off = k0 % p.page_size;
    int64_t row = (base + table[page]) * p.page_size;
    for (int64_t j = 0; j < kBlock; ++j) {  // keys past n repeat the last (weight 0)
      const int64_t slot = row + off;
      kr[j] = p.k + slot * d;
      vr[j] = p.v + slot * d;
      ks[j] = p.k_scale ? p.k_scale[slot] : 1.0f;
      vs[j] = p.v_scale ? p.v_scale[slot] : 1.0f;
      if (j + 1 < n && ++off == p.page_size) {
        off = 0;
        row = (base + table[++page]) * p.page_size;
      }
    }
    // scores, kGroup keys at a time: kGroup x RV independent chains of FMAs
    for (int j0 = 0; j0 < kBlock; j0 += kGroup) {
      vf a[kGroup][RV];
      for (int j = 0; j < kGroup; ++j)
        for (int v = 0; v < RV; ++v) a[j][v] = kZero;
      for (int64_t i = 0; i < d; ++i) {
        const vf* qi = qt + i * RV;
#pragma GCC unroll 4
        for (int j = 0; j < kGroup; ++j) {
          const float x = load(kr[j0 + j] + i);
#pragma GCC unroll 4
          for (int v = 0; v < RV; ++v) a[j][v] += x * qi[v];
        }
      }
      for (int j = 0; j < kGroup; ++j)
        for (int v = 0; v < RV; ++v) s[j0 + j][v] = a[j][v] * ks[j0 + j];
    }
    // the online softmax down the block's keys, every row at once
    vf alpha[RV];
    for (int v = 0; v < RV; ++v) {
      vf top = m[v];
      for (int j = 0; j < kBlock; ++j) {
        const int32_t key = static_cast<int32_t>(k0 + j);
        const vi own = (pos[v] >= key) & (first[v] <= key) & (j < n ? -1 : 0);
        s[j][v] = own ? s[j][v] : kZero - INFINITY;
        top = top > s[j][v] ? top : s[j][v];
      }
      const vi none = top == kZero - INFINITY;  // no key of the row yet
      vf sum = kZero;
      for (int j = 0; j < kBlock; ++j) {
        const vi own = s[j][v] != kZero - INFINITY;
        s[j][v] = own ? vexp(s[j][v] - top) : kZero;
        sum += s[j][v];
      }
      alpha[v] = none ? kZero + 1.0f : vexp(m[v] - top);
      l[v] = l[v] * alpha[v] + sum;
      m[v] = top;
    }
    // ot[D][RV] = ot * alpha + sum_j v[j][d] * w[j], kGroup dims at a time
    for (int64_t i0 = 0; i0 < d; i0 += kGroup) {
      vf a[kGroup][RV];
      for (int x = 0; x < kGroup; ++x)
        for (int v = 0; v < RV; ++v) a[x][v] = ot[(i0 + x) * RV + v] * alpha[v];
      for (int j = 0; j < kBlock; ++j) {
        const T* vj = vr[j] + i0;
        const float sc = vs[j];
#pragma GCC unroll 4
        for (int x = 0; x < kGroup; ++x) {
          const float y = load(vj + x) * sc;
#pragma GCC unroll 4
          for (int v = 0; v < RV; ++v) a[x][v] += y * s[j][v];
        }
      }
      for (int x = 0; x < kGroup; ++x)
        for (int v = 0; v < RV; ++v) ot[(i0 + x) * RV + v] = a[x][v];
    }
  }
  for (int v = 0; v < RV; ++v) {
    for (int j = 0; j < kKeys; ++j) {
      const int64_t r = v * kKeys + j;
      if (r >= rows) break;
      const int64_t at = (h * p.t + tile.start) * g + r;
      const float lr = l[v][j];
      const float inv = lr > 0.0f ? 1.0f / lr : 0.0f;
      for (int64_t i = 0; i < d; ++i) p.out[at * d + i] = ot[i * RV + v][j] * inv;
      p.lse[at] = lr > 0.0f ? m[v][j] + std::log(lr) : -INFINITY;
    }
  }
}

template <typename T>
void attend(const Problem<T>& p, int64_t h, const Tile& tile) {
  switch ((tile.tokens * p.g + kKeys - 1) / kKeys) {
    case 1: return attend_rows<T, 1>(p, h, tile);
    case 2: return attend_rows<T, 2>(p, h, tile);
    case 3: return attend_rows<T, 3>(p, h, tile);
    default: return attend_rows<T, 4>(p, h, tile);
  }
}

// Tiles of consecutive tokens of one row; padding tokens' outputs written here (0, -inf).
template <typename T>
void plan(Problem<T>& p, const int32_t* q_seq, int64_t num_seqs, int64_t table_rows) {
  const int64_t per_tile = std::max<int64_t>(1, kTileRows / p.g);
  for (int64_t i = 0; i < p.t;) {
    const int64_t seq = q_seq[i];
    int64_t j = i + 1;
    while (j < p.t && q_seq[j] == seq && j - i < per_tile) ++j;
    if (seq >= 0 && seq < std::min(num_seqs, table_rows) && p.kv_lens[seq] > 0) {
      p.tiles.push_back(Tile{i, j - i, seq});
    } else {
      for (int64_t h = 0; h < p.hkv; ++h) {
        const int64_t at = (h * p.t + i) * p.g;
        std::fill(p.out + at * p.d, p.out + (at + (j - i) * p.g) * p.d, 0.0f);
        std::fill(p.lse + at, p.lse + at + (j - i) * p.g, -INFINITY);
      }
    }
    i = j;
  }
}

template <typename T>
void run(ffi::ThreadPool& pool, Problem<T>& p, const int32_t* q_seq, int64_t num_seqs,
         int64_t table_rows) {
  plan(p, q_seq, num_seqs, table_rows);
  const int64_t tiles = static_cast<int64_t>(p.tiles.size());
  // the last tiles of long chunks see the most keys: they go first
  jserve_native::parallel_for(pool, p.hkv * tiles, [&p, tiles](int64_t i) {
    const int64_t tile = tiles - 1 - i / p.hkv;
    attend(p, i % p.hkv, p.tiles[tile]);
  });
}

ffi::Error PrefillAttention(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::AnyBuffer k,
                            ffi::AnyBuffer v, ffi::Buffer<ffi::F32> k_scale,
                            ffi::Buffer<ffi::F32> v_scale, ffi::Buffer<ffi::S32> layer,
                            ffi::Buffer<ffi::S32> q_seq, ffi::Buffer<ffi::S32> q_pos,
                            ffi::Buffer<ffi::S32> q_lo, ffi::Buffer<ffi::S32> kv_lens,
                            ffi::Buffer<ffi::S32> page_table, ffi::Buffer<ffi::S32> num_seqs,
                            ffi::ResultBuffer<ffi::F32> out, ffi::ResultBuffer<ffi::F32> lse) {
  auto qd = q.dimensions();
  auto kd = k.dimensions();
  auto td = page_table.dimensions();
  if (qd.size() != 4 || kd.size() != 5 || td.size() != 2)
    return ffi::Error::InvalidArgument("q [Hkv, T, G, D], pages [L, Hkv, P, S, D] expected");
  if (qd[3] > kMaxDim || qd[3] % 16 != 0)
    return ffi::Error::InvalidArgument("head_dim must be a multiple of 16, at most 256");
  if (qd[2] > kTileRows)
    return ffi::Error::InvalidArgument("at most " + std::to_string(kTileRows) +
                                       " query heads per KV head (a tile's rows)");
  if (k.element_type() != v.element_type())
    return ffi::Error::InvalidArgument("K and V pages differ in dtype");
  const bool scaled = k.element_type() == ffi::DataType::S8;
  if (scaled && (k_scale.element_count() != kd[0] * kd[1] * kd[2] * kd[3] ||
                 v_scale.element_count() != k_scale.element_count()))
    return ffi::Error::InvalidArgument("int8 pages need one scale per token and head");
  const int64_t at_layer = layer.typed_data()[0];
  if (at_layer < 0 || at_layer >= kd[0]) return ffi::Error::InvalidArgument("layer out of range");
  auto go = [&](auto* kp, auto* vp) {
    using T = std::remove_const_t<std::remove_pointer_t<decltype(kp)>>;
    Problem<T> p{q.typed_data(), kp, vp,
                 scaled ? k_scale.typed_data() : nullptr, scaled ? v_scale.typed_data() : nullptr,
                 q_pos.typed_data(), q_lo.typed_data(), kv_lens.typed_data(),
                 page_table.typed_data(), out->typed_data(), lse->typed_data(),
                 qd[0], qd[1], qd[2], qd[3], kd[2], kd[3], td[1], at_layer, {}};
    run(pool, p, q_seq.typed_data(), num_seqs.typed_data()[0], td[0]);
    return ffi::Error::Success();
  };
  switch (k.element_type()) {
    case ffi::DataType::F32:
      return go(static_cast<const float*>(k.untyped_data()),
                static_cast<const float*>(v.untyped_data()));
    case ffi::DataType::BF16:
      return go(static_cast<const uint16_t*>(k.untyped_data()),
                static_cast<const uint16_t*>(v.untyped_data()));
    case ffi::DataType::S8:
      return go(static_cast<const int8_t*>(k.untyped_data()),
                static_cast<const int8_t*>(v.untyped_data()));
    default:
      return ffi::Error::InvalidArgument("pages must be float32, bfloat16 or int8");
  }
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JserveCpuPrefillAttention, PrefillAttention,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
