// The routed experts of a mixture-of-experts MLP for XLA:CPU, called through the XLA FFI
// (jserve/kernels/cpu.py, jserve/model/moe.py's native way).
//
// XLA:CPU has no grouped matmul: its ragged_dot is a masked dot over every expert, so the
// XLA ways either run every expert (E/k times the FLOPs) or gather the chosen experts'
// matrices (a copy of them). Here the token-expert pairs are sorted by expert and each
// expert's rows are multiplied by its matrices read in place, at a run-time layer of the
// stacked weights: the FLOPs and the weight bytes of the chosen experts only. Pairs of
// weight 0 (another ep shard's experts) are skipped.
//
// x [T, H] float32; weights, experts [T, k] (local expert ids); gate_up [L, H, E * 2I]
// (each expert's gate then up columns in turn: the runtime we_gate_up), down [L, E, I, H],
// both float32, bfloat16, int8 or float8_e4m3fn, the last two with float32 scales per
// column, gate_up_scale [L, 1, E * 2I] and down_scale [L, E, 1, H] ([1] each, has_scales
// 0, otherwise), applied to the products; bias [L, 1, E * 2I] float32 or [1] (has_bias 0).
// Returns out
// [T, H] float32 (the router-weighted sum) and scratch [T * k, 2I], the sorted pairs' gate
// and up products (the activations written over the gate half), so XLA owns every buffer.
// Three passes over the intra-op pool: gate/up as (expert, column block) items, the gated
// activation per pair, down as column blocks of H that visit every expert (no two items
// write one output element).
#if defined(__FMA__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "elements.h"
#include "pool.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

typedef float v8 __attribute__((vector_size(32)));
typedef uint16_t u16x8 __attribute__((vector_size(16)));
typedef uint32_t u32x8 __attribute__((vector_size(32)));

constexpr int kRows = 6;            // rows of one register tile (6 x 16: 12 accumulators,
constexpr int kVecs = 2;            // 8-float vectors across one  two weights, a broadcast)
constexpr int kTile = 8 * kVecs;    // columns of one register tile
constexpr int kStream = 4;           // rows at most that stream a block row by row
constexpr int64_t kBlock = 8 * kTile;  // columns of one gate/up work item (at most)
constexpr int64_t kDownBlock = 4 * kTile;  // columns of H of one down work item
constexpr int64_t kAhead = 8;          // rows of weights prefetched ahead

inline v8 load8(const float* p) {
  v8 v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
inline v8 load8(const uint16_t* p) {  // bfloat16: the high half of a float32's bits
  u16x8 h;
  std::memcpy(&h, p, sizeof h);
  u32x8 w = __builtin_convertvector(h, u32x8) << 16;
  v8 v;
  std::memcpy(&v, &w, sizeof v);
  return v;
}
typedef int8_t i8x8 __attribute__((vector_size(8)));
typedef int32_t i32x8 __attribute__((vector_size(32)));
inline v8 load8(const int8_t* p) {  // int8 values (the scales are applied to the product)
  i8x8 q;
  std::memcpy(&q, p, sizeof q);
  return __builtin_convertvector(__builtin_convertvector(q, i32x8), v8);
}

struct F8 {  // float8_e4m3fn: sign, 4 exponent bits (bias 7), 3 mantissa bits; no infinities
  uint8_t bits;
};
struct F8Table {
  float value[256];
  F8Table() {
    for (int b = 0; b < 256; ++b) {
      const int e = (b >> 3) & 15, m = b & 7;
      float v = e == 0 ? std::ldexp(m / 8.0f, -6) : std::ldexp(1.0f + m / 8.0f, e - 7);
      if (e == 15 && m == 7) v = NAN;
      value[b] = b & 128 ? -v : v;
    }
  }
};
const F8Table kF8;
inline float load(const F8* p) { return kF8.value[p->bits]; }
inline v8 load8(const F8* p) {
  v8 v;
  for (int j = 0; j < 8; ++j) v[j] = kF8.value[p[j].bits];
  return v;
}

inline v8 fma8(v8 a, v8 b, v8 c) {
#ifdef __FMA__
  return _mm256_fmadd_ps(a, b, c);
#else
  return a * b + c;
#endif
}

using jserve_native::load;

// The cache lines of n weights from w on: rows of a stacked matrix lie far apart, beyond
// what the hardware prefetcher follows.
template <typename W>
inline void prefetch_row(const W* w, int64_t n) {
  const char* at = reinterpret_cast<const char*>(w);
  for (int64_t b = 0; b < n * int64_t(sizeof(W)); b += 64) __builtin_prefetch(at + b);
}

// Lanes [0, n) of v to p (n <= 8).
inline void store(float* p, v8 v, int64_t n) {
  if (n >= 8) {
    std::memcpy(p, &v, sizeof v);
    return;
  }
  for (int64_t j = 0; j < n; ++j) p[j] = v[j];
}
inline v8 load_n(const float* p, int64_t n) {  // lanes past n zero
  if (n >= 8) return load8(p);
  v8 v = {};
  for (int64_t j = 0; j < n; ++j) v[j] = p[j];
  return v;
}

inline v8 splat(float x) { return v8{x, x, x, x, x, x, x, x}; }

// One vector of a product's row to out (its first ``lanes`` <= 8): times the row's scale and
// the columns' (a quantized matrix's, or null), plus the bias (or null), added to what out
// holds when ``add``.
template <bool kAdd>
inline void finish(v8 y, float scale, const float* cols, const float* bias, float* out,
                   int64_t lanes) {
  y *= scale;
  if (cols) y *= load_n(cols, lanes);
  if (bias) y += load_n(bias, lanes);
  if (kAdd) y += load_n(out, lanes);
  store(out, y, lanes);
}

// out[r][0, n) = (sum_i rows[r][i] * w[i * ldw + 0, kTile)) as ``finish`` scales and adds
// it, for R rows in registers over a packed panel (ldw kTile); the columns past n < kTile
// are computed from its zeros and not stored.
template <int R, bool kAdd, typename W>
void tile(const float* const* rows, int64_t depth, const W* w, int64_t ldw, int64_t n,
          const float* scale, const float* cols, const float* bias, float* const* out) {
  v8 acc[R][kVecs] = {};
  for (int64_t i = 0; i < depth; ++i) {
    const W* wi = w + i * ldw;
    v8 wv[kVecs];
    for (int v = 0; v < kVecs; ++v) wv[v] = load8(wi + 8 * v);
    for (int r = 0; r < R; ++r) {
      const v8 xb = splat(rows[r][i]);
      for (int v = 0; v < kVecs; ++v) acc[r][v] = fma8(xb, wv[v], acc[r][v]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < kVecs && 8 * v < n; ++v)
      finish<kAdd>(acc[r][v], scale[r], cols ? cols + 8 * v : nullptr,
                   bias ? bias + 8 * v : nullptr, out[r] + 8 * v, n - 8 * v);
}

template <bool kAdd, typename W>
void rows_times_at(const float* const* rows, const float* scale, float* const* out,
                   int64_t count, int64_t depth, const W* w, int64_t ldw, int64_t n,
                   const float* cols, const float* bias) {
  int64_t r = 0;
  for (; r + kRows <= count; r += kRows)
    tile<kRows, kAdd>(rows + r, depth, w, ldw, n, scale + r, cols, bias, out + r);
  switch (count - r) {
    case 5: tile<5, kAdd>(rows + r, depth, w, ldw, n, scale + r, cols, bias, out + r); break;
    case 4: tile<4, kAdd>(rows + r, depth, w, ldw, n, scale + r, cols, bias, out + r); break;
    case 3: tile<3, kAdd>(rows + r, depth, w, ldw, n, scale + r, cols, bias, out + r); break;
    case 2: tile<2, kAdd>(rows + r, depth, w, ldw, n, scale + r, cols, bias, out + r); break;
    case 1: tile<1, kAdd>(rows + r, depth, w, ldw, n, scale + r, cols, bias, out + r); break;
    default: break;
  }
}

// R <= kStream rows (a decode step's expert) times a block of n <= kBlock columns, each
// weight row read whole (contiguous, so the hardware prefetcher streams it) and the
// accumulators in L1; register tiles would read 64 bytes a row, rows a power of two apart.
template <int R, bool kAdd, typename W>
void stream(const float* const* rows, const float* scale, float* const* out, int64_t depth,
            const W* w, int64_t ldw, int64_t n, const float* cols, const float* bias) {
  v8 acc[R][kBlock / 8] = {};
  const int64_t vecs = (n + 7) / 8, full = n / 8;
  for (int64_t i = 0; i < depth; ++i) {
    const W* wi = w + i * ldw;
    prefetch_row(wi + kAhead * ldw, n);
    float xs[R];
    for (int r = 0; r < R; ++r) xs[r] = rows[r][i];
    for (int64_t v = 0; v < full; ++v) {
      const v8 wv = load8(wi + 8 * v);
      for (int r = 0; r < R; ++r) acc[r][v] = fma8(splat(xs[r]), wv, acc[r][v]);
    }
    for (int64_t j = 8 * full; j < n; ++j)
      for (int r = 0; r < R; ++r) acc[r][full][j % 8] += xs[r] * load(wi + j);
  }
  for (int r = 0; r < R; ++r)
    for (int64_t v = 0; v < vecs; ++v)
      finish<kAdd>(acc[r][v], scale[r], cols ? cols + 8 * v : nullptr,
                   bias ? bias + 8 * v : nullptr, out[r] + 8 * v, n - 8 * v);
}

// The block w[0, depth) x [0, n) (n <= kBlock) as panels of kTile columns, panel t at
// dst + t * depth * kTile (row i of it at i * kTile), zero past n: one pass over the rows,
// each read whole.
template <typename W>
void pack(const W* w, int64_t ldw, int64_t depth, int64_t n, float* dst) {
  const int64_t panels = (n + kTile - 1) / kTile, full = n / kTile;
  for (int64_t i = 0; i < depth; ++i) {
    const W* wi = w + i * ldw;
    prefetch_row(wi + kAhead * ldw, n);
    for (int64_t t = 0; t < panels; ++t) {
      float* d = dst + (t * depth + i) * kTile;
      if (t < full) {
        for (int v = 0; v < kVecs; ++v) {
          const v8 x = load8(wi + t * kTile + 8 * v);
          std::memcpy(d + 8 * v, &x, sizeof x);
        }
        continue;
      }
      for (int64_t j = 0; j < kTile; ++j) d[j] = t * kTile + j < n ? load(wi + t * kTile + j) : 0.0f;
    }
  }
}

// Columns [0, n) (n <= kBlock) of ``count`` rows times w: few rows stream the block; more
// go through register tiles of kRows rows over the block packed into panels (several row
// tiles read each, and rows of a stacked matrix can lie a power of two apart, in one cache
// set).
template <bool kAdd, typename W>
void rows_times(const float* const* rows, const float* scale, float* const* out,
                int64_t count, int64_t depth, const W* w, int64_t ldw, int64_t n,
                const float* cols, const float* bias) {
  switch (count) {
    case 1: return stream<1, kAdd>(rows, scale, out, depth, w, ldw, n, cols, bias);
    case 2: return stream<2, kAdd>(rows, scale, out, depth, w, ldw, n, cols, bias);
    case 3: return stream<3, kAdd>(rows, scale, out, depth, w, ldw, n, cols, bias);
    case 4: return stream<4, kAdd>(rows, scale, out, depth, w, ldw, n, cols, bias);
    default: break;
  }
  thread_local std::vector<float> panels;
  panels.resize(depth * ((n + kTile - 1) / kTile) * kTile);
  pack(w, ldw, depth, n, panels.data());
  std::vector<float*> at(count);
  for (int64_t c = 0; c < n; c += kTile) {
    for (int64_t r = 0; r < count; ++r) at[r] = out[r] + c;
    rows_times_at<kAdd>(rows, scale, at.data(), count, depth, panels.data() + c * depth,
                        kTile, std::min<int64_t>(kTile, n - c), cols ? cols + c : nullptr,
                        bias ? bias + c : nullptr);
  }
}

struct Pairs {  // the nonzero pairs sorted by expert (stable: token order within one)
  std::vector<int64_t> start;  // [E + 1]: expert e's pairs are [start[e], start[e + 1])
  std::vector<int64_t> token;
  std::vector<float> weight;
};

Pairs sort_pairs(const float* weights, const int32_t* experts, int64_t pairs, int64_t n_exp) {
  Pairs p;
  p.start.assign(n_exp + 1, 0);
  for (int64_t i = 0; i < pairs; ++i)
    if (weights[i] != 0.0f) ++p.start[experts[i] + 1];
  for (int64_t e = 0; e < n_exp; ++e) p.start[e + 1] += p.start[e];
  std::vector<int64_t> at(p.start.begin(), p.start.end() - 1);
  p.token.resize(p.start[n_exp]);
  p.weight.resize(p.start[n_exp]);
  for (int64_t i = 0; i < pairs; ++i) {
    if (weights[i] == 0.0f) continue;
    const int64_t j = at[experts[i]]++;
    p.token[j] = i;  // the pair's index; its token is i / k
    p.weight[j] = weights[i];
  }
  return p;
}

// exp on 8 lanes: 2^n * e^r with |r| <= ln2 / 2, e^r by its Taylor polynomial to r^7
// (relative error near 1e-7, as std::exp's float), the input clamped to float's range.
inline v8 exp8(v8 x) {
  const v8 lo = v8{} - 87.0f, hi = v8{} + 88.0f;
  x = x < lo ? lo : x;
  x = x > hi ? hi : x;
  const float kRound = 12582912.0f;  // 1.5 * 2^23: adding it rounds to an integer
  v8 n = (x * 1.44269504f + kRound) - kRound;
  v8 r = x - n * 0.693145752f - n * 1.42860677e-6f;
  v8 p = v8{} + 1.0f / 5040;
  p = p * r + 1.0f / 720;
  p = p * r + 1.0f / 120;
  p = p * r + 1.0f / 24;
  p = p * r + 1.0f / 6;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  i32x8 bits = (__builtin_convertvector(n, i32x8) + 127) << 23;
  v8 scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return p * scale;
}

struct Glu {
  int kind;  // 0: SiLU(gate) * up; 1: gpt-oss's clamped SwiGLU
  float limit, alpha;
  float operator()(float g, float u) const {
    if (kind == 0) return g / (1.0f + std::exp(-g)) * u;
    g = std::min(g, limit);
    u = std::min(std::max(u, -limit), limit);
    return (u + 1.0f) * (g / (1.0f + std::exp(-alpha * g)));
  }
  v8 operator()(v8 g, v8 u) const {
    if (kind == 0) return g / (1.0f + exp8(-g)) * u;
    const v8 top = v8{} + limit, bottom = v8{} - limit;
    g = g > top ? top : g;
    u = u > top ? top : u;
    u = u < bottom ? bottom : u;
    return (u + 1.0f) * (g / (1.0f + exp8(-alpha * g)));
  }
  // row[0, n) = glu(row[0, n), row[n, 2n))
  void apply(float* row, int64_t n) const {
    int64_t c = 0;
    for (; c + 8 <= n; c += 8) {
      v8 y = (*this)(load8(row + c), load8(row + n + c));
      std::memcpy(row + c, &y, sizeof y);
    }
    for (; c < n; ++c) row[c] = (*this)(row[c], row[n + c]);
  }
};

template <typename W>
struct Experts {  // one layer's expert matrices, their column scales (null: unquantized)
  const W* gate_up;
  const W* down;
  const float* gate_up_scale;  // [E * 2I]
  const float* down_scale;     // [E, H]
  const float* bias;           // [E * 2I] or null
};

template <typename W>
void run(ffi::ThreadPool& pool, const float* x, const Pairs& p, const Experts<W>& m,
         int64_t k, int64_t h, int64_t n_exp, int64_t inter, int64_t t, Glu glu, float* out,
         float* scratch) {
  const int64_t n = p.token.size(), wide = 2 * inter, ldw = n_exp * wide;
  std::vector<const float*> x_rows(n), act_rows(n);
  std::vector<float*> s_rows(n), out_rows(n);
  const std::vector<float> ones(n, 1.0f);
  for (int64_t j = 0; j < n; ++j) {
    x_rows[j] = x + (p.token[j] / k) * h;
    s_rows[j] = scratch + j * wide;
    act_rows[j] = s_rows[j];
    out_rows[j] = out + (p.token[j] / k) * h;
  }
  // gate/up: items (expert, block of kBlock columns of its 2I)
  const int64_t blocks = (wide + kBlock - 1) / kBlock;
  std::vector<int64_t> busy;
  for (int64_t e = 0; e < n_exp; ++e)
    if (p.start[e + 1] > p.start[e]) busy.push_back(e);
  jserve_native::parallel_for(pool, busy.size() * blocks, [&](int64_t item) {
    const int64_t e = busy[item / blocks], c0 = (item % blocks) * kBlock;
    const int64_t lo = p.start[e], count = p.start[e + 1] - lo;
    std::vector<float*> dst(count);
    for (int64_t r = 0; r < count; ++r) dst[r] = s_rows[lo + r] + c0;
    const int64_t at = e * wide + c0;
    rows_times<false>(x_rows.data() + lo, ones.data(), dst.data(), count, h,
                      m.gate_up + at, ldw, std::min<int64_t>(kBlock, wide - c0),
                      m.gate_up_scale ? m.gate_up_scale + at : nullptr,
                      m.bias ? m.bias + at : nullptr);
  });
  // the gated activation, over the gate half of each pair's row
  jserve_native::parallel_for(pool, n, [&](int64_t j) {
    glu.apply(s_rows[j], inter);
  });
  // down: items (block of kDownBlock columns of H), every token's row zeroed first
  const int64_t tiles = (h + kDownBlock - 1) / kDownBlock;
  jserve_native::parallel_for(pool, tiles, [&](int64_t item) {
    const int64_t c = item * kDownBlock, width = std::min<int64_t>(kDownBlock, h - c);
    for (int64_t row = 0; row < t; ++row) std::fill_n(out + row * h + c, width, 0.0f);
    for (int64_t e = 0; e < n_exp; ++e) {
      const int64_t lo = p.start[e], count = p.start[e + 1] - lo;
      if (count == 0) continue;
      std::vector<float*> dst(count);
      for (int64_t r = 0; r < count; ++r) dst[r] = out_rows[lo + r] + c;
      rows_times<true>(act_rows.data() + lo, p.weight.data() + lo, dst.data(), count, inter,
                       m.down + e * inter * h + c, h, width,
                       m.down_scale ? m.down_scale + e * h + c : nullptr, nullptr);
    }
  });
}

ffi::Error MoeExperts(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x,
                      ffi::Buffer<ffi::F32> weights, ffi::Buffer<ffi::S32> experts,
                      ffi::AnyBuffer gate_up, ffi::AnyBuffer down,
                      ffi::Buffer<ffi::F32> gate_up_scale, ffi::Buffer<ffi::F32> down_scale,
                      ffi::Buffer<ffi::F32> bias, ffi::Buffer<ffi::S32> layer, int32_t act,
                      float limit, float alpha, int32_t has_scales, int32_t has_bias,
                      ffi::ResultBuffer<ffi::F32> out, ffi::ResultBuffer<ffi::F32> scratch) {
  auto xd = x.dimensions(), wd = weights.dimensions(), gd = gate_up.dimensions(),
       dd = down.dimensions();
  if (xd.size() != 2 || wd.size() != 2 || gd.size() != 3 || dd.size() != 4)
    return ffi::Error::InvalidArgument(
        "x [T, H], weights [T, k], gate_up [L, H, E * 2I], down [L, E, I, H] expected");
  const int64_t t = xd[0], h = xd[1], k = wd[1], n_exp = dd[1], inter = dd[2];
  const int64_t layers = gd[0], wide = n_exp * 2 * inter;
  if (wd[0] != t || experts.element_count() != t * k || gd[1] != h || dd[3] != h ||
      gd[2] != wide || dd[0] != layers)
    return ffi::Error::InvalidArgument("the experts' shapes disagree");
  if (gate_up.element_type() != down.element_type())
    return ffi::Error::InvalidArgument("gate_up and down differ in dtype");
  if (has_bias && bias.element_count() != layers * wide)
    return ffi::Error::InvalidArgument("bias [L, 1, E * 2I] expected");
  if (has_scales && (gate_up_scale.element_count() != layers * wide ||
                     down_scale.element_count() != layers * n_exp * h))
    return ffi::Error::InvalidArgument("scales [L, 1, E * 2I] and [L, E, 1, H] expected");
  const int64_t at = layer.typed_data()[0];
  if (at < 0 || at >= layers) return ffi::Error::InvalidArgument("layer out of range");
  const int32_t* ids = experts.typed_data();
  for (int64_t i = 0; i < t * k; ++i)
    if (ids[i] < 0 || ids[i] >= n_exp) return ffi::Error::InvalidArgument("expert out of range");
  const Pairs p = sort_pairs(weights.typed_data(), ids, t * k, n_exp);
  const Glu glu{act, limit, alpha};
  auto go = [&](auto* g, auto* d) {
    using W = std::remove_const_t<std::remove_pointer_t<decltype(g)>>;
    const Experts<W> m{g + at * h * wide, d + at * n_exp * inter * h,
                       has_scales ? gate_up_scale.typed_data() + at * wide : nullptr,
                       has_scales ? down_scale.typed_data() + at * n_exp * h : nullptr,
                       has_bias ? bias.typed_data() + at * wide : nullptr};
    run(pool, x.typed_data(), p, m, k, h, n_exp, inter, t, glu, out->typed_data(),
        scratch->typed_data());
    return ffi::Error::Success();
  };
  const bool quantized = gate_up.element_type() == ffi::DataType::S8 ||
                         gate_up.element_type() == ffi::DataType::F8E4M3FN;
  if (quantized != bool(has_scales))
    return ffi::Error::InvalidArgument("int8 and fp8 experts need their scales");
  switch (gate_up.element_type()) {
    case ffi::DataType::F32:
      return go(static_cast<const float*>(gate_up.untyped_data()),
                static_cast<const float*>(down.untyped_data()));
    case ffi::DataType::BF16:
      return go(static_cast<const uint16_t*>(gate_up.untyped_data()),
                static_cast<const uint16_t*>(down.untyped_data()));
    case ffi::DataType::S8:
      return go(static_cast<const int8_t*>(gate_up.untyped_data()),
                static_cast<const int8_t*>(down.untyped_data()));
    case ffi::DataType::F8E4M3FN:
      return go(static_cast<const F8*>(gate_up.untyped_data()),
                static_cast<const F8*>(down.untyped_data()));
    default:
      return ffi::Error::InvalidArgument(
          "expert weights must be float32, bfloat16, int8 or float8_e4m3fn");
  }
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JserveCpuMoeExperts, MoeExperts,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Attr<int32_t>("act")
                                  .Attr<float>("limit")
                                  .Attr<float>("alpha")
                                  .Attr<int32_t>("has_scales")
                                  .Attr<int32_t>("has_bias")
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
