// Kernels compiled at run time (internal to libloom_sdk). NVRTC and the CUDA driver API are opened
// with dlopen, never linked: libloom_sdk builds and loads on machines without either, and uses the
// libnvrtc that the CUDA LibTorch in the process ships (site-packages/nvidia/*/lib for a wheel).
// See Note [Kernels compiled at run time] in rtc.cpp.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace loom::sdk::rtc {

/// Device code every kernel source starts with: bf16_t and half_t (raw 16-bit values, converted
/// by hand: NVRTC is given no headers), to_f/from_f between them and float (round to nearest
/// even), Vec<T, N> (N values read or written as one aligned access), load4/store4 of four
/// consecutive values as floats, and warp_sum.
inline constexpr const char* kDeviceHelpers = R"CUDA(
struct bf16_t { unsigned short bits; };
struct half_t { unsigned short bits; };

__device__ __forceinline__ float to_f(float v) { return v; }
__device__ __forceinline__ float to_f(bf16_t v) { return __uint_as_float(((unsigned)v.bits) << 16); }
__device__ __forceinline__ float to_f(half_t v) {
  float f; asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(v.bits)); return f;
}
__device__ __forceinline__ void from_f(float v, float& out) { out = v; }
__device__ __forceinline__ void from_f(float v, bf16_t& out) {
  unsigned u = __float_as_uint(v);
  if ((u & 0x7fffffffu) > 0x7f800000u) { out.bits = 0x7fc0; return; }  // NaN
  u += 0x7fffu + ((u >> 16) & 1u);                                   // round to nearest even
  out.bits = (unsigned short)(u >> 16);
}
__device__ __forceinline__ void from_f(float v, half_t& out) {
  unsigned short h; asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(v)); out.bits = h;
}

template <typename T, int N> struct alignas(sizeof(T) * N) Vec { T v[N]; };

template <typename T> __device__ __forceinline__ void load4(const T* p, float (&out)[4]) {
  const Vec<T, 4> q = *reinterpret_cast<const Vec<T, 4>*>(p);
#pragma unroll
  for (int e = 0; e < 4; ++e) out[e] = to_f(q.v[e]);
}
template <typename T> __device__ __forceinline__ void store4(T* p, const float (&in)[4]) {
  Vec<T, 4> q;
#pragma unroll
  for (int e = 0; e < 4; ++e) from_f(in[e], q.v[e]);
  *reinterpret_cast<Vec<T, 4>*>(p) = q;
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(0xffffffffu, v, offset);
  return v;
}
)CUDA";

/// CUBIN of `source` for sm_<major><minor>; throws loom::sdk::Error naming NVRTC's problem or the
/// compiler's log.
std::string compile(const std::string& source, const std::string& program_name, int major, int minor);

/// "" when NVRTC can be opened, otherwise why not.
std::string nvrtc_unavailable();

/// The libnvrtc file opened ("" when none).
std::string nvrtc_path();

/// "" when the fused operation `op` ("cross_entropy", "embedding", "layer_norm", "linear", "mlp") may use its kernels, or
/// "LOOM_FUSED_KERNELS=<value>" when that variable turns it off: unset, "1" or "all": every one;
/// "0" or "none": none; otherwise the comma-separated names of those to use (to measure one
/// kernel's gain). A name Loom does not know is an Error.
std::string disabled_by_environment(const std::string& op);

/// The kernels of one compiled source, loaded on each device that asks for them.
class Kernels {
 public:
  /// `source` follows kDeviceHelpers in the program NVRTC compiles.
  Kernels(std::string source, std::string program_name, std::vector<std::string> names);

  /// Compiles the program for sm_<major><minor> without loading it: "" when it compiles, otherwise
  /// why not (for tests: no GPU needed).
  std::string compile_only(int major, int minor) const;

  /// "" when kernel `name` can run on `device` (compiled and loaded there now if it was not),
  /// otherwise why not.
  std::string unavailable(int device, const std::string& name);

  /// The kernel `name` (one of the constructor's names) on CUDA device `device`: compiled and
  /// loaded at first use (thread-safe). Throws loom::sdk::Error when that is not possible; it is
  /// not tried again for that device, and the same error is thrown again.
  void* function(int device, const std::string& name);

  /// cuLaunchKernel on `stream` (a cudaStream_t); throws loom::sdk::Error with the driver's message.
  static void launch(void* function, unsigned grid_x, unsigned block_x, void* stream, void** args);

 private:
  struct Loaded;
  std::string source_, program_name_;
  std::vector<std::string> names_;
  std::vector<Loaded*> devices_;  // by device index; never freed (modules live as long as the process)
};

}  // namespace loom::sdk::rtc
