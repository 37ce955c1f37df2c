// Page elements as float32, for the native CPU kernels: float32 and bfloat16 (its bits the
// high half of a float32's), read from the cache's own buffers.
#ifndef JSERVE_KERNELS_NATIVE_ELEMENTS_H_
#define JSERVE_KERNELS_NATIVE_ELEMENTS_H_

#include <cstdint>
#include <cstring>

namespace jserve_native {

inline float load(const float* p) { return *p; }
inline float load(const uint16_t* p) {
  uint32_t bits = static_cast<uint32_t>(*p) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}
inline float load(const int8_t* p) { return static_cast<float>(*p); }

}  // namespace jserve_native

#endif  // JSERVE_KERNELS_NATIVE_ELEMENTS_H_
