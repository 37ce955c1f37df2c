// Paged decode attention for XLA:CPU, called through the XLA FFI (jserve/kernels/cpu.py).
//
// One query token per sequence, grouped-query heads, KV pages read in place from the stacked
// cache [layers, Hkv, pages, page_size, D] at a run-time layer: no gather copy, one pass over
// each sequence's keys with an online softmax, page by page. Work items are (KV head,
// sequence) pairs spread over XLA's intra-op thread pool. q [Hkv, B, G, D] float32; pages
// float32 or bfloat16; returns out [Hkv, B, G, D] and the log-sum-exp [Hkv, B, G] of the
// scores scaled by ``scale`` (-inf, and a zero output, for a sequence with no keys), as the jnp reference
// (jserve/kernels/reference.py) does. kv_starts [B]: each row's first key position (a sliding
// window; 0 without one): its loop starts at that key's page, and page-table entries before
// it are never read (those pages may be freed).
#include <algorithm>
#include <cmath>
#include <cstdint>

#include "elements.h"
#include "pool.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int kMaxGroup = 16;   // query heads per KV head
constexpr int kMaxDim = 256;    // head_dim
constexpr int kMaxPage = 256;   // tokens per page

using jserve_native::load;

template <typename T>
inline float dot(const float* q, const T* k, int64_t d) {
  float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  int64_t i = 0;
  for (; i + 8 <= d; i += 8)
    for (int j = 0; j < 8; ++j) acc[j] += q[i + j] * load(k + i + j);
  for (; i < d; ++i) acc[0] += q[i] * load(k + i);
  return ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
}

template <typename T>
struct Problem {
  const float* q;
  const T* k;
  const T* v;
  const int32_t* kv_lens;
  const int32_t* kv_starts;
  const int32_t* page_table;
  float* out;
  float* lse;
  int64_t hkv, b, g, d, pages, page_size, width, layer;
  float scale;
};

template <typename T>
void attend(const Problem<T>& p, int64_t h, int64_t row) {
  const int64_t g_n = p.g, d = p.d, s_n = p.page_size;
  float m[kMaxGroup], l[kMaxGroup], s[kMaxGroup][kMaxPage];
  alignas(64) float acc[kMaxGroup][kMaxDim];
  for (int64_t g = 0; g < g_n; ++g) {
    m[g] = -INFINITY;
    l[g] = 0.0f;
    std::fill(acc[g], acc[g] + d, 0.0f);
  }
  const float* q = p.q + (h * p.b + row) * g_n * d;
  const int64_t len = std::min<int64_t>(p.kv_lens[row], p.width * s_n);
  const int64_t base = (p.layer * p.hkv + h) * p.pages * s_n * d;
  const int64_t lo = std::max<int64_t>(0, p.kv_starts[row]);
  for (int64_t t0 = lo / s_n * s_n; t0 < len; t0 += s_n) {
    const int64_t page = p.page_table[row * p.width + t0 / s_n];
    const T* kp = p.k + base + page * s_n * d;
    const T* vp = p.v + base + page * s_n * d;
    const int64_t n = std::min<int64_t>(s_n, len - t0);
    const int64_t t_lo = std::max<int64_t>(0, lo - t0);  // keys before the window: skipped
    for (int64_t g = 0; g < g_n; ++g) {
      float top = m[g];
      for (int64_t t = t_lo; t < n; ++t) {
        s[g][t] = dot(q + g * d, kp + t * d, d) * p.scale;
        top = std::max(top, s[g][t]);
      }
      const float alpha = std::exp(m[g] - top);
      l[g] *= alpha;
      for (int64_t i = 0; i < d; ++i) acc[g][i] *= alpha;
      for (int64_t t = t_lo; t < n; ++t) {
        const float w = std::exp(s[g][t] - top);
        l[g] += w;
        const T* vr = vp + t * d;
        for (int64_t i = 0; i < d; ++i) acc[g][i] += w * load(vr + i);
      }
      m[g] = top;
    }
  }
  for (int64_t g = 0; g < g_n; ++g) {
    const int64_t at = (h * p.b + row) * g_n + g;
    const float inv = l[g] > 0.0f ? 1.0f / l[g] : 0.0f;
    for (int64_t i = 0; i < d; ++i) p.out[at * d + i] = acc[g][i] * inv;
    p.lse[at] = l[g] > 0.0f ? m[g] + std::log(l[g]) : -INFINITY;
  }
}

template <typename T>
void run(ffi::ThreadPool& pool, const Problem<T>& p) {
  jserve_native::parallel_for(pool, p.hkv * p.b,
                              [&p](int64_t i) { attend(p, i / p.b, i % p.b); });
}

ffi::Error DecodeAttention(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::AnyBuffer k,
                           ffi::AnyBuffer v, ffi::Buffer<ffi::S32> layer,
                           ffi::Buffer<ffi::S32> kv_lens, ffi::Buffer<ffi::S32> kv_starts,
                           ffi::Buffer<ffi::S32> page_table,
                           float scale, ffi::ResultBuffer<ffi::F32> out,
                           ffi::ResultBuffer<ffi::F32> lse) {
  auto qd = q.dimensions();
  auto kd = k.dimensions();
  if (qd.size() != 4 || kd.size() != 5 || page_table.dimensions().size() != 2)
    return ffi::Error::InvalidArgument("q [Hkv, B, G, D], pages [L, Hkv, P, S, D] expected");
  if (qd[2] > kMaxGroup || qd[3] > kMaxDim || kd[3] > kMaxPage)
    return ffi::Error::InvalidArgument("group, head_dim or page size over the kernel's limits");
  if (k.element_type() != v.element_type())
    return ffi::Error::InvalidArgument("K and V pages differ in dtype");
  const int64_t at_layer = layer.typed_data()[0];
  if (at_layer < 0 || at_layer >= kd[0])
    return ffi::Error::InvalidArgument("layer out of range");
  auto make = [&](auto* kp, auto* vp) {
    using T = std::remove_const_t<std::remove_pointer_t<decltype(kp)>>;
    return Problem<T>{q.typed_data(), kp, vp, kv_lens.typed_data(), kv_starts.typed_data(),
                      page_table.typed_data(),
                      out->typed_data(), lse->typed_data(), qd[0], qd[1], qd[2], qd[3], kd[2],
                      kd[3], page_table.dimensions()[1], at_layer, scale};
  };
  switch (k.element_type()) {
    case ffi::DataType::F32:
      run(pool, make(static_cast<const float*>(k.untyped_data()),
                     static_cast<const float*>(v.untyped_data())));
      return ffi::Error::Success();
    case ffi::DataType::BF16:
      run(pool, make(static_cast<const uint16_t*>(k.untyped_data()),
                     static_cast<const uint16_t*>(v.untyped_data())));
      return ffi::Error::Success();
    default:
      return ffi::Error::InvalidArgument("pages must be float32 or bfloat16");
  }
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JserveCpuDecodeAttention, DecodeAttention,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Attr<float>("scale")
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
