// Paged prefill attention for XLA:CPU, called through the XLA FFI (jserve/kernels/cpu.py).
//
// XLA:CPU runs the jnp reference's prefill attention as a loop of small batched dots over
// gathered KV blocks, one (query tile, KV block) pair an iteration, which leaves a core idle
// and runs the dots far under the matmul rate (docs/kernels.md). Here each work item is one
// KV head and a tile of up to kTileRows query rows (consecutive tokens of one sequence, all
// of their grouped heads); items are spread over XLA's intra-op thread pool. A tile reads
// its sequence's keys in blocks of kKeys positions straight from the stacked page pool
// [layers, Hkv, pages, page_size, D] at a run-time layer (float32, bfloat16, or int8 with one
// scale per token and head), stops at its last token's position (causal), and keeps an
// online softmax per row. Scores are 16-float vectors (GCC vector extensions: AVX-512,
// AVX2 or NEON, whatever -march=native gives), their exponentials a vector polynomial.
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
#include <vector>

#ifdef __AVX512F__
#include <immintrin.h>
#endif

#include "elements.h"
#include "pool.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int kKeys = 16;       // floats a vector
constexpr int kVecs = 4;        // vectors of key positions a block
constexpr int kBlock = kKeys * kVecs;
constexpr int kRows = 4;        // rows whose scores are computed together
constexpr int kTileRows = 64;   // query rows (tokens x group) a work item, at least one token
constexpr int kMaxDim = 256;    // head_dim (a multiple of kKeys)
typedef float v16 __attribute__((vector_size(kKeys * sizeof(float))));
typedef int32_t i16 __attribute__((vector_size(kKeys * sizeof(int32_t))));

using jserve_native::load;

// exp(x) for x <= 0 (scores minus their running maximum), to about 2 ulp: 2^n * p(r) with
// n = round(x / ln 2) and r = x - n ln 2 in two parts, p Taylor's to degree 6; below -87 it
// is 0 (the caller masks invalid keys separately).
constexpr v16 kZero = {};

inline v16 vexp(v16 x) {
  const v16 in_range = x < -87.0f ? kZero : kZero + 1.0f;
  x = x < -87.0f ? kZero - 87.0f : x;
  const v16 magic = kZero + 12582912.0f;  // 1.5 * 2^23: adding it rounds to an integer
  v16 n = (x * 1.44269504f + magic) - magic;
  v16 r = x - n * 0.693145752f;
  r = r - n * 1.42860677e-6f;
  v16 p = r * (1.0f / 720) + (1.0f / 120);
  p = p * r + (1.0f / 24);
  p = p * r + (1.0f / 6);
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  i16 bits = (__builtin_convertvector(n, i16) + 127) << 23;
  v16 scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return p * scale * in_range;
}

#ifdef __AVX512F__
inline float hmax(v16 x) { return _mm512_reduce_max_ps(reinterpret_cast<__m512>(x)); }
inline float hsum(v16 x) { return _mm512_reduce_add_ps(reinterpret_cast<__m512>(x)); }
#else
inline float hmax(v16 x) {
  float m = x[0];
  for (int j = 1; j < kKeys; ++j) m = std::max(m, x[j]);
  return m;
}

inline float hsum(v16 x) {
  float s = 0.0f;
  for (int j = 0; j < kKeys; ++j) s += x[j];
  return s;
}
#endif

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

// A block's keys, transposed ([D][kVecs] vectors: a row's scores are sum_d q[d] * kt[d]),
// and its values [kBlock][D]; positions past `n` are zero.
template <typename T>
void gather(const Problem<T>& p, int64_t h, int64_t seq, int64_t k0, int64_t n, v16* kt,
            float* vb) {
  const int64_t d = p.d, s_n = p.page_size;
  const int64_t base = (p.layer * p.hkv + h) * p.pages;
  std::memset(kt, 0, sizeof(v16) * d * kVecs);
  std::memset(vb, 0, sizeof(float) * kBlock * d);
  for (int64_t j = 0; j < n; ++j) {
    const int64_t at = k0 + j;
    const int64_t slot = (base + p.page_table[seq * p.width + at / s_n]) * s_n + at % s_n;
    const float ks = p.k_scale ? p.k_scale[slot] : 1.0f;
    const float vs = p.v_scale ? p.v_scale[slot] : 1.0f;
    const T* kr = p.k + slot * d;
    const T* vr = p.v + slot * d;
    v16* kcol = kt + j / kKeys;
    const int lane = static_cast<int>(j % kKeys);
    for (int64_t i = 0; i < d; ++i) {
      kcol[i * kVecs][lane] = load(kr + i) * ks;
      vb[j * d + i] = load(vr + i) * vs;
    }
  }
}

// Scores of kRows rows against a block: kRows x kVecs independent chains of vector FMAs,
// each key vector loaded once for all rows. Rows past `rows` repeat the last.
inline void scores(const float* q, int64_t d, int64_t rows, const v16* kt, v16 (*s)[kVecs]) {
  const float* qr[kRows];
  v16 a[kRows][kVecs];
  for (int r = 0; r < kRows; ++r) {
    qr[r] = q + std::min<int64_t>(r, rows - 1) * d;
    for (int v = 0; v < kVecs; ++v) a[r][v] = kZero;
  }
  for (int64_t i = 0; i < d; ++i) {
    const v16* k = kt + i * kVecs;
#pragma GCC unroll 4
    for (int r = 0; r < kRows; ++r) {
      const float x = qr[r][i];
#pragma GCC unroll 4
      for (int v = 0; v < kVecs; ++v) a[r][v] += x * k[v];
    }
  }
  for (int r = 0; r < kRows; ++r)
    for (int v = 0; v < kVecs; ++v) s[r][v] = a[r][v];
}

// One row's online-softmax step over a block: keys k0 + [0, n) at or after `first`, at or
// before `pos` are its own (some are).
inline void update(const v16* s, int32_t k0, int32_t first, int32_t pos, int64_t d, int64_t n,
                   const float* vb, float* m, float* l, float* acc) {
  i16 lane;
  for (int j = 0; j < kKeys; ++j) lane[j] = j;
  v16 w[kVecs];
  i16 valid[kVecs];
  v16 top_v = kZero - INFINITY;
  for (int v = 0; v < kVecs; ++v) {
    const i16 key = lane + (k0 + v * kKeys);
    valid[v] = (key <= pos) & (key >= first) & (key < static_cast<int32_t>(k0 + n));
    w[v] = valid[v] ? s[v] : kZero - INFINITY;
    top_v = top_v > w[v] ? top_v : w[v];
  }
  const float top = std::max(*m, hmax(top_v));
  v16 sum = kZero;
  for (int v = 0; v < kVecs; ++v) {
    w[v] = valid[v] ? vexp(w[v] - top) : kZero;
    sum += w[v];
  }
  const float alpha = std::exp(*m - top);
  *l = *l * alpha + hsum(sum);
  *m = top;
  // four output vectors at a time held in registers across the block's keys: four
  // independent chains of FMAs, and no store of the accumulator between keys
  const float* wf = reinterpret_cast<const float*>(w);
  v16* a = reinterpret_cast<v16*>(acc);
  const v16* vr = reinterpret_cast<const v16*>(vb);
  const int64_t chunks = d / kKeys;
  const int64_t j_lo = std::max<int64_t>(0, first - k0), j_hi = std::min<int64_t>(n, pos - k0 + 1);
  for (int64_t c = 0; c < chunks; c += 4) {
    const int64_t nc = std::min<int64_t>(4, chunks - c);
    v16 a0 = a[c] * alpha, a1 = nc > 1 ? a[c + 1] * alpha : kZero;
    v16 a2 = nc > 2 ? a[c + 2] * alpha : kZero, a3 = nc > 3 ? a[c + 3] * alpha : kZero;
    for (int64_t j = j_lo; j < j_hi; ++j) {
      const float wj = wf[j];
      const v16* row = vr + j * chunks + c;
      a0 += wj * row[0];
      if (nc > 1) a1 += wj * row[1];
      if (nc > 2) a2 += wj * row[2];
      if (nc > 3) a3 += wj * row[3];
    }
    a[c] = a0;
    if (nc > 1) a[c + 1] = a1;
    if (nc > 2) a[c + 2] = a2;
    if (nc > 3) a[c + 3] = a3;
  }
}

template <typename T>
void attend(const Problem<T>& p, int64_t h, const Tile& tile) {
  const int64_t g = p.g, d = p.d, rows = tile.tokens * g;
  // vectors, not floats, so that every row of them is aligned for vector loads
  thread_local std::vector<v16> kt_buf, vb_buf, acc_buf;
  thread_local std::vector<float> m, l;
  kt_buf.resize(d * kVecs);
  vb_buf.resize(d * kVecs);  // [kBlock][D] floats
  acc_buf.resize(rows * d / kKeys);
  float* vb = reinterpret_cast<float*>(vb_buf.data());
  m.assign(rows, -INFINITY);
  l.assign(rows, 0.0f);
  float* acc = reinterpret_cast<float*>(acc_buf.data());
  std::fill(acc, acc + rows * d, 0.0f);
  const float* q = p.q + (h * p.t + tile.start) * g * d;
  int64_t lo = INT64_MAX, hi = 0;
  for (int64_t i = 0; i < tile.tokens; ++i) {
    lo = std::min<int64_t>(lo, std::max<int32_t>(0, p.q_lo[tile.start + i]));
    hi = std::max<int64_t>(hi, p.q_pos[tile.start + i] + 1);
  }
  hi = std::min<int64_t>(hi, std::min<int64_t>(p.kv_lens[tile.seq], p.width * p.page_size));
  for (int64_t k0 = lo / kKeys * kKeys; k0 < hi; k0 += kBlock) {
    const int64_t n = std::min<int64_t>(kBlock, hi - k0);
    gather(p, h, tile.seq, k0, n, kt_buf.data(), vb);
    for (int64_t r0 = 0; r0 < rows; r0 += kRows) {
      const int64_t nr = std::min<int64_t>(kRows, rows - r0);
      v16 s[kRows][kVecs];
      scores(q + r0 * d, d, nr, kt_buf.data(), s);
      for (int64_t r = r0; r < r0 + nr; ++r) {
        const int64_t tok = tile.start + r / g;
        const int32_t pos = std::min<int32_t>(p.q_pos[tok], hi - 1);
        const int32_t first = std::max<int32_t>(0, p.q_lo[tok]);
        if (k0 <= pos && first < k0 + n)  // some key of the block is the row's
          update(s[r - r0], k0, first, pos, d, n, vb, &m[r], &l[r], acc + r * d);
      }
    }
  }
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t at = (h * p.t + tile.start) * g + r;
    const float inv = l[r] > 0.0f ? 1.0f / l[r] : 0.0f;
    for (int64_t i = 0; i < d; ++i) p.out[at * d + i] = acc[r * d + i] * inv;
    p.lse[at] = l[r] > 0.0f ? m[r] + std::log(l[r]) : -INFINITY;
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
  if (qd[3] > kMaxDim || qd[3] % kKeys != 0)
    return ffi::Error::InvalidArgument("head_dim must be a multiple of 16, at most 256");
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
