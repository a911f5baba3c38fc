// cross_entropy_sum: see <loom/sdk/cross_entropy.hpp>; the kernels are compiled at run time
// (Note [Kernels compiled at run time], rtc.cpp).
#include <loom/sdk/cross_entropy.hpp>

#include "rtc.hpp"

#include <ATen/ops/argmax.h>
#include <ATen/ops/cross_entropy_loss.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/sum.h>
#include <torch/csrc/autograd/custom_function.h>

#include <limits>
#if LOOM_TORCH_CUDA
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#endif


namespace loom::sdk::nn {

namespace {

// One block per row. Forward: each thread keeps an online maximum m and sum s of exp(x - m) over
// its vectors of the row, and its first arg-max; the block combines them (warp shuffles, then one
// warp over the warps' values) into lse = m + log s, the row's loss lse - x[target] and whether
// the arg-max is the target. Backward: (exp(x - lse) - [j == target]) * the loss's gradient,
// written in the logits' dtype. Rows of a width divisible by the vector (8 half-precision or 4
// float values, 16 bytes) read whole vectors; others one value at a time.
constexpr const char* kSource = R"CUDA(
#define NEG_INF (__int_as_float(0xff800000))
#define NO_INDEX 0x7fffffff

__device__ __forceinline__ void merge(float& m, float& s, float m2, float s2) {
  const float top = fmaxf(m, m2);
  if (top == NEG_INF) { s = s + s2; return; }
  s = (s == 0.f ? 0.f : s * expf(m - top)) + (s2 == 0.f ? 0.f : s2 * expf(m2 - top));
  m = top;
}
__device__ __forceinline__ void pick(float& best, int& at, float best2, int at2) {
  if (best2 > best || (best2 == best && at2 < at)) { best = best2; at = at2; }
}

// 2^(x log2 e) in one instruction (ex2.approx, relative error about 2^-22): the forward is
// bound by its arithmetic otherwise (accurate expf and a 64-bit arg-max per value: 0.52 ms for
// GPT-2's [8192, 50304] bf16 logits on an H200, where reading them takes 0.2).
__device__ __forceinline__ float fast_exp(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x * 1.4426950408889634f));
  return y;
}

template <typename T, int N>
__device__ void ce_forward(const T* __restrict__ logits, const long long* __restrict__ target, long long width,
                           long long ignore_index, float* __restrict__ loss, float* __restrict__ lse_out,
                           int* __restrict__ correct) {
  const long long row = blockIdx.x;
  const T* x = logits + row * width;
  const Vec<T, N>* xv = reinterpret_cast<const Vec<T, N>*>(x);
  // m is the running maximum and the arg-max's value: a thread's indices grow, so the first
  // vector with a new maximum holds its first index (a strict >), and only then is s rescaled.
  float m = NEG_INF, s = 0.f;
  int at = NO_INDEX;
  const int chunks = (int)(width / N);
  for (int k = threadIdx.x; k < chunks; k += blockDim.x) {
    const Vec<T, N> chunk = xv[k];
    float f[N];
    float top = NEG_INF;
#pragma unroll
    for (int e = 0; e < N; ++e) { f[e] = to_f(chunk.v[e]); top = fmaxf(top, f[e]); }
    if (top > m) {
#pragma unroll
      for (int e = N - 1; e >= 0; --e) if (f[e] == top) at = k * N + e;
      s = s == 0.f ? 0.f : s * fast_exp(m - top);
      m = top;
    }
#pragma unroll
    for (int e = 0; e < N; ++e) s += f[e] == NEG_INF ? 0.f : fast_exp(f[e] - m);  // a NaN or +inf logit makes s NaN
  }
  float best = m;
  for (int offset = 16; offset > 0; offset >>= 1) {
    merge(m, s, __shfl_xor_sync(0xffffffffu, m, offset), __shfl_xor_sync(0xffffffffu, s, offset));
    pick(best, at, __shfl_xor_sync(0xffffffffu, best, offset), __shfl_xor_sync(0xffffffffu, at, offset));
  }
  __shared__ float warp_m[32], warp_s[32], warp_best[32];
  __shared__ int warp_at[32];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  if (lane == 0) { warp_m[warp] = m; warp_s[warp] = s; warp_best[warp] = best; warp_at[warp] = at; }
  __syncthreads();
  if (warp != 0) return;
  const int warps = blockDim.x >> 5;
  m = lane < warps ? warp_m[lane] : NEG_INF;
  s = lane < warps ? warp_s[lane] : 0.f;
  best = lane < warps ? warp_best[lane] : NEG_INF;
  at = lane < warps ? warp_at[lane] : NO_INDEX;
  for (int offset = 16; offset > 0; offset >>= 1) {
    merge(m, s, __shfl_xor_sync(0xffffffffu, m, offset), __shfl_xor_sync(0xffffffffu, s, offset));
    pick(best, at, __shfl_xor_sync(0xffffffffu, best, offset), __shfl_xor_sync(0xffffffffu, at, offset));
  }
  if (lane != 0) return;
  const float lse = m + logf(s);
  const long long t = target[row];
  lse_out[row] = lse;
  if (t == ignore_index) { loss[row] = 0.f; correct[row] = 0; }
  else if (t < 0 || t >= width) { loss[row] = __int_as_float(0x7fc00000); correct[row] = 0; }
  else { loss[row] = lse - to_f(x[t]); correct[row] = at == t ? 1 : 0; }
}

template <typename T, int N>
__device__ void ce_backward(const T* __restrict__ logits, const long long* __restrict__ target,
                            const float* __restrict__ lse, const float* __restrict__ grad, long long width,
                            long long ignore_index, T* __restrict__ out) {
  const long long row = blockIdx.x;
  const Vec<T, N>* xv = reinterpret_cast<const Vec<T, N>*>(logits + row * width);
  Vec<T, N>* ov = reinterpret_cast<Vec<T, N>*>(out + row * width);
  const long long t = target[row];
  const bool ignored = t == ignore_index;
  const float g = *grad, l = lse[row];
  for (long long k = threadIdx.x; k < width / N; k += blockDim.x) {
    const Vec<T, N> chunk = xv[k];
    Vec<T, N> o;
#pragma unroll
    for (int e = 0; e < N; ++e) {
      const float p = expf(to_f(chunk.v[e]) - l) - (k * N + e == t ? 1.f : 0.f);
      from_f(ignored ? 0.f : p * g, o.v[e]);
    }
    ov[k] = o;
  }
}

#define LOOM_CE(T, NAME, N)                                                                               \
  extern "C" __global__ void __launch_bounds__(512) loom_ce_forward_##NAME##_##N(                          \
      const T* logits, const long long* target, long long width, long long ignore_index, float* loss,       \
      float* lse, int* correct) {                                                                           \
    ce_forward<T, N>(logits, target, width, ignore_index, loss, lse, correct);                              \
  }                                                                                                         \
  extern "C" __global__ void __launch_bounds__(512) loom_ce_backward_##NAME##_##N(                         \
      const T* logits, const long long* target, const float* lse, const float* grad, long long width,      \
      long long ignore_index, T* out) {                                                                     \
    ce_backward<T, N>(logits, target, lse, grad, width, ignore_index, out);                                 \
  }
LOOM_CE(float, f32, 1)
LOOM_CE(float, f32, 4)
LOOM_CE(bf16_t, bf16, 1)
LOOM_CE(bf16_t, bf16, 8)
LOOM_CE(half_t, f16, 1)
LOOM_CE(half_t, f16, 8)
)CUDA";

std::vector<std::string> kernel_names() {
  std::vector<std::string> out;
  for (const char* dir : {"forward", "backward"})
    for (const char* type : {"f32_1", "f32_4", "bf16_1", "bf16_8", "f16_1", "f16_8"})
      out.push_back(std::string("loom_ce_") + dir + "_" + type);
  return out;
}

rtc::Kernels& kernels() {
  static rtc::Kernels k(kSource, "loom_cross_entropy.cu", kernel_names());
  return k;
}

CrossEntropySums reference(const at::Tensor& logits, const at::Tensor& target, int64_t ignore_index) {
  return {at::cross_entropy_loss(logits.to(at::kFloat), target, /*weight=*/{}, at::Reduction::Sum, ignore_index),
          at::argmax(logits, 1).eq(target).sum()};
}

#if LOOM_TORCH_CUDA
// The kernel's name for these logits, and the vector width it reads.
std::string kernel_for(const char* direction, const at::Tensor& logits, int& threads) {
  const char* type = logits.scalar_type() == at::kFloat ? "f32" : logits.scalar_type() == at::kBFloat16 ? "bf16" : "f16";
  const int64_t width = logits.size(1);
  const int vector = logits.element_size() == 4 ? 4 : 8;
  const bool whole = width % vector == 0 && reinterpret_cast<uintptr_t>(logits.data_ptr()) % 16 == 0;
  const int64_t chunks = whole ? width / vector : width;
  threads = 32;
  while (threads < 512 && threads < chunks) threads *= 2;
  return std::string("loom_ce_") + direction + "_" + type + "_" + std::to_string(whole ? vector : 1);
}

class FusedCrossEntropy : public torch::autograd::Function<FusedCrossEntropy> {
 public:
  static torch::autograd::variable_list forward(torch::autograd::AutogradContext* ctx, const at::Tensor& logits,
                                                const at::Tensor& target, int64_t ignore_index) {
    const c10::cuda::CUDAGuard guard(logits.device());
    const int64_t rows = logits.size(0);
    at::Tensor loss = at::empty({rows}, logits.options().dtype(at::kFloat));
    at::Tensor lse = at::empty({rows}, logits.options().dtype(at::kFloat));
    at::Tensor correct = at::empty({rows}, logits.options().dtype(at::kInt));
    if (rows > 0) {
      int threads = 0;
      void* f = kernels().function(logits.get_device(), kernel_for("forward", logits, threads));
      const void* x = logits.data_ptr();
      const void* t = target.data_ptr();
      int64_t width = logits.size(1);
      void* l = loss.data_ptr();
      void* e = lse.data_ptr();
      void* c = correct.data_ptr();
      void* args[] = {&x, &t, &width, &ignore_index, &l, &e, &c};
      rtc::Kernels::launch(f, static_cast<unsigned>(rows), static_cast<unsigned>(threads),
                           c10::cuda::getCurrentCUDAStream(logits.get_device()).stream(), args);
    }
    ctx->save_for_backward({logits, target, lse});
    ctx->saved_data["ignore_index"] = ignore_index;
    at::Tensor correct_sum = at::sum(correct, at::kLong);
    ctx->mark_non_differentiable({correct_sum});
    return {at::sum(loss), correct_sum};
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const at::Tensor& logits = saved[0];
    const c10::cuda::CUDAGuard guard(logits.device());
    at::Tensor grad_logits = at::empty_like(logits, at::MemoryFormat::Contiguous);
    const at::Tensor scale = grads[0].to(at::kFloat).contiguous();
    if (logits.size(0) > 0) {
      int threads = 0;
      void* f = kernels().function(logits.get_device(), kernel_for("backward", logits, threads));
      const void* x = logits.data_ptr();
      const void* t = saved[1].data_ptr();
      const void* e = saved[2].data_ptr();
      const void* g = scale.data_ptr();
      int64_t width = logits.size(1);
      int64_t ignore_index = ctx->saved_data["ignore_index"].toInt();
      void* o = grad_logits.data_ptr();
      void* args[] = {&x, &t, &e, &g, &width, &ignore_index, &o};
      rtc::Kernels::launch(f, static_cast<unsigned>(logits.size(0)), static_cast<unsigned>(threads),
                           c10::cuda::getCurrentCUDAStream(logits.get_device()).stream(), args);
    }
    return {grad_logits, at::Tensor(), at::Tensor()};
  }
};
#endif

}  // namespace

std::string fused_cross_entropy_unavailable(const at::Tensor& logits) {
  if (std::string off = rtc::disabled_by_environment("cross_entropy"); !off.empty()) return off;
  if (!logits.is_cuda()) return "not a CUDA tensor";
#if LOOM_TORCH_CUDA
  if (logits.dim() != 2) return "logits are not [rows, classes]";
  if (logits.size(1) >= std::numeric_limits<int>::max()) return "more classes than an int counts";
  const auto type = logits.scalar_type();
  if (type != at::kFloat && type != at::kBFloat16 && type != at::kHalf)
    return std::string("logits of dtype ") + c10::toString(type);
  const c10::cuda::CUDAGuard guard(logits.device());
  int threads = 0;
  return kernels().unavailable(logits.get_device(), kernel_for("forward", logits, threads));
#else
  return "LibTorch without CUDA";
#endif
}

CrossEntropySums cross_entropy_sum(const at::Tensor& logits, const at::Tensor& target, int64_t ignore_index) {
  if (logits.dim() != 2 || target.dim() != 1 || target.size(0) != logits.size(0))
    throw Error("cross_entropy_sum: logits must be [rows, classes] and target [rows]; got " +
                std::to_string(logits.dim()) + " and " + std::to_string(target.dim()) + " dimensions");
  if (target.device() != logits.device())
    throw Error("cross_entropy_sum: target is on " + target.device().str() + ", logits on " + logits.device().str());
  if (target.scalar_type() != at::kLong)
    throw Error(std::string("cross_entropy_sum: target must be int64, not ") + c10::toString(target.scalar_type()));
#if LOOM_TORCH_CUDA
  if (fused_cross_entropy_unavailable(logits).empty()) {
    const auto out = FusedCrossEntropy::apply(logits.contiguous(), target.contiguous(), ignore_index);
    return {out[0], out[1]};
  }
#endif
  return reference(logits, target, ignore_index);
}

std::string compile_fused_kernels(int major, int minor) { return kernels().compile_only(major, minor); }

std::string fused_kernels_compiler() {
  const std::string why = rtc::nvrtc_unavailable();
  return why.empty() ? rtc::nvrtc_path() : "unavailable: " + why;
}

}  // namespace loom::sdk::nn
