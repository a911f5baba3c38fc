// cross_entropy_sum: see <loom/sdk/cross_entropy.hpp>; the kernels are compiled at run time
// (Note [Kernels compiled at run time], rtc.cpp).
#include <loom/sdk/cross_entropy.hpp>

#include "rtc.hpp"

#include <ATen/core/grad_mode.h>
#include <ATen/ops/arange.h>
#include <ATen/ops/argmax.h>
#include <ATen/ops/cross_entropy_loss.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/equal.h>
#include <ATen/ops/full.h>
#include <ATen/ops/sum.h>
#include <ATen/ops/zeros.h>
#include <torch/csrc/autograd/custom_function.h>

#include <algorithm>
#include <limits>
#if LOOM_TORCH_CUDA
#include "first_use_check.hpp"

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

// Adds one vector of a row (its first index k * N) to a thread's running maximum m, sum s of
// exp(x - m) and first arg-max: a thread's indices grow, so the first vector with a new maximum
// holds its first index (a strict >), and only then is s rescaled.
template <typename T, int N>
__device__ __forceinline__ void absorb(const Vec<T, N> chunk, int k, float& m, float& s, int& at) {
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

// Combines the block's (m, s) and arg-max (the value `best` at index `at`): warp shuffles, then
// one warp over the warps' values. Thread 0 ends with the row's; the others with partial values.
__device__ __forceinline__ void block_combine(float& m, float& s, float& best, int& at) {
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
}

// Thread 0 writes the row's results: log-sum-exp, loss and whether the arg-max is the target.
template <typename T>
__device__ __forceinline__ float finish_row(const T* __restrict__ x, long long t, long long width, long long ignore_index, float m,
                                            float s, int at, float* loss, float* lse_out, int* correct) {
  const long long row = blockIdx.x;
  const float lse = m + logf(s);
  lse_out[row] = lse;
  if (t == ignore_index) { loss[row] = 0.f; correct[row] = 0; }
  else if (t < 0 || t >= width) { loss[row] = __int_as_float(0x7fc00000); correct[row] = 0; }
  else { loss[row] = lse - to_f(x[t]); correct[row] = at == t ? 1 : 0; }
  return lse;
}

template <typename T, int N>
__device__ void ce_forward(const T* __restrict__ logits, const long long* __restrict__ target, long long width,
                           long long ignore_index, float* __restrict__ loss, float* __restrict__ lse_out,
                           int* __restrict__ correct) {
  const T* x = logits + (long long)blockIdx.x * width;
  const Vec<T, N>* xv = reinterpret_cast<const Vec<T, N>*>(x);
  float m = NEG_INF, s = 0.f;  // m is also the arg-max's value
  int at = NO_INDEX;
  const int chunks = (int)(width / N);
  for (int k = threadIdx.x; k < chunks; k += blockDim.x) {
    const Vec<T, N> chunk = xv[k];  // one 16-byte load (passed as xv[k], NVVM reads it value by value)
    absorb<T, N>(chunk, k, m, s, at);
  }
  float best = m;
  block_combine(m, s, best, at);
  if (threadIdx.x != 0) return;
  finish_row(x, target[blockIdx.x], width, ignore_index, m, s, at, loss, lse_out, correct);
}

// The forward of a step that will take the gradient (Note [The gradient in the forward]): each
// thread holds its vectors of the row (at most MAXV) in registers, and once the block knows the
// row's log-sum-exp writes exp(x - lse) - [j == target] from them: the logits are read once.
template <typename T, int N, int MAXV>
__device__ void ce_forward_gradient(const T* __restrict__ logits, const long long* __restrict__ target,
                                    long long width, long long ignore_index, float* __restrict__ loss,
                                    float* __restrict__ lse_out, int* __restrict__ correct, T* __restrict__ gradient) {
  const long long row = blockIdx.x;
  const T* x = logits + row * width;
  const Vec<T, N>* xv = reinterpret_cast<const Vec<T, N>*>(x);
  Vec<T, N>* gv = reinterpret_cast<Vec<T, N>*>(gradient + row * width);
  const int chunks = (int)(width / N);
  Vec<T, N> held[MAXV];
#pragma unroll
  for (int i = 0; i < MAXV; ++i) {
    const int k = threadIdx.x + i * blockDim.x;
    if (k < chunks) held[i] = xv[k];
  }
  float m = NEG_INF, s = 0.f;
  int at = NO_INDEX;
#pragma unroll
  for (int i = 0; i < MAXV; ++i) {
    const int k = threadIdx.x + i * blockDim.x;
    if (k < chunks) absorb<T, N>(held[i], k, m, s, at);
  }
  float best = m;
  block_combine(m, s, best, at);
  __shared__ float row_lse;
  const long long t = target[row];
  if (threadIdx.x == 0) row_lse = finish_row(x, t, width, ignore_index, m, s, at, loss, lse_out, correct);
  __syncthreads();
  const float l = row_lse;
  const bool ignored = t == ignore_index;
  // Kept as the 16-bit values: the compiler would otherwise keep every value converted to float
  // from the first loop (twice the registers, and spills).
#pragma unroll
  for (int i = 0; i < MAXV; ++i) {
    unsigned* words = reinterpret_cast<unsigned*>(&held[i]);
#pragma unroll
    for (int j = 0; j < (int)(sizeof(Vec<T, N>) / 4); ++j) asm volatile("" : "+r"(words[j]));
  }
#pragma unroll
  for (int i = 0; i < MAXV; ++i) {
    const int k = threadIdx.x + i * blockDim.x;
    if (k >= chunks) continue;
    Vec<T, N> o;
#pragma unroll
    for (int e = 0; e < N; ++e) {
      const float p = fast_exp(to_f(held[i].v[e]) - l) - ((long long)k * N + e == t ? 1.f : 0.f);
      from_f(ignored ? 0.f : p, o.v[e]);
    }
    gv[k] = o;
  }
}

// The backward of ce_forward_gradient: the gradient times the loss's gradient, in place, where
// that is not 1 (a device value: no block reads or writes the gradient when it is 1).
template <typename T, int N>
__device__ void ce_scale(T* __restrict__ gradient, const float* __restrict__ grad, long long vectors) {
  const float g = *grad;
  if (g == 1.f) return;
  Vec<T, N>* v = reinterpret_cast<Vec<T, N>*>(gradient);
  for (long long k = (long long)blockIdx.x * blockDim.x + threadIdx.x; k < vectors; k += (long long)gridDim.x * blockDim.x) {
    Vec<T, N> o = v[k];
#pragma unroll
    for (int e = 0; e < N; ++e) from_f(to_f(o.v[e]) * g, o.v[e]);
    v[k] = o;
  }
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
// 16 vectors a thread, 512 threads: rows up to 65536 bf16 or 32768 float32 values (ptxas, sm_90:
// 110 and 98 registers of the 128 that 512 threads leave, no spills)
#define LOOM_CE_GRADIENT(T, NAME, N, MAXV)                                                                      \
  extern "C" __global__ void __launch_bounds__(512) loom_ce_forward_gradient_##NAME##_##N(                 \
      const T* logits, const long long* target, long long width, long long ignore_index, float* loss,       \
      float* lse, int* correct, T* gradient) {                                                              \
    ce_forward_gradient<T, N, MAXV>(logits, target, width, ignore_index, loss, lse, correct, gradient);       \
  }                                                                                                         \
  extern "C" __global__ void __launch_bounds__(256) loom_ce_scale_##NAME##_##N(T* gradient, const float* grad, \
                                                                               long long vectors) {         \
    ce_scale<T, N>(gradient, grad, vectors);                                                                \
  }
LOOM_CE(float, f32, 1)
LOOM_CE(float, f32, 4)
LOOM_CE(bf16_t, bf16, 1)
LOOM_CE(bf16_t, bf16, 8)
LOOM_CE(half_t, f16, 1)
LOOM_CE(half_t, f16, 8)
LOOM_CE_GRADIENT(float, f32, 4, 16)
LOOM_CE_GRADIENT(bf16_t, bf16, 8, 16)
)CUDA";

std::vector<std::string> kernel_names() {
  std::vector<std::string> out;
  for (const char* dir : {"forward", "backward"})
    for (const char* type : {"f32_1", "f32_4", "bf16_1", "bf16_8", "f16_1", "f16_8"})
      out.push_back(std::string("loom_ce_") + dir + "_" + type);
  for (const char* dir : {"forward_gradient", "scale"})
    for (const char* type : {"f32_4", "bf16_8"}) out.push_back(std::string("loom_ce_") + dir + "_" + type);
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
// Note [The gradient in the forward]
// A training step's forward is always followed by its backward, and the logits' gradient,
// (exp(x - lse) - [j == target]) times the loss's gradient, needs nothing of the row beyond its
// log-sum-exp. Where the step will take it (grad mode, logits that require a gradient) and a row
// fits the registers (bf16 up to 65536 classes, float32 up to 32768, whole 16-byte vectors), the
// forward kernel holds each row in registers and writes that gradient, for a loss gradient of 1,
// once the block knows the row's log-sum-exp: the logits are read once instead of twice, and not
// kept for the backward (GPT-2's [8192, 50304] bf16 logits, 824 MB, are freed with the forward's
// last reference). The backward multiplies the gradient in place by the loss's gradient, a device
// value; where it is 1 (the loss sum's own gradient, bf16 and float32 training) the kernel's
// blocks return at once, and no host read decides it. Not for fp16 logits: a gradient under fp16's
// smallest value before the loss scale multiplies it would be lost, which is what scaling the loss
// is for. One backward per forward: a second one through the same graph (retain_graph) is refused,
// as the in-place scaling would apply twice. The results are the two-kernel path's up to rounding
// (exp by ex2.approx, 2^-22 relative; a loss gradient other than 1 multiplies the rounded value),
// and a check at first use compares the two on this device (gradient_path_checked).

// The two paths' kernels for these logits, and the block size (at most 512 threads; a power of 2
// of at least a warp and of the row's vectors where fewer).
struct Launch {
  std::string forward, backward, forward_gradient, scale;
  int threads = 32;
  bool gradient_fits = false;  // Note [The gradient in the forward]
};

Launch kernels_for(const at::Tensor& logits) {
  const auto dtype = logits.scalar_type();
  const char* type = dtype == at::kFloat ? "f32" : dtype == at::kBFloat16 ? "bf16" : "f16";
  const int64_t width = logits.size(1);
  const int vector = logits.element_size() == 4 ? 4 : 8;
  const bool whole = width % vector == 0 && reinterpret_cast<uintptr_t>(logits.data_ptr()) % 16 == 0;
  const int64_t chunks = whole ? width / vector : width;
  Launch l;
  while (l.threads < 512 && l.threads < chunks) l.threads *= 2;
  const std::string suffix = std::string(type) + "_" + std::to_string(whole ? vector : 1);
  l.forward = "loom_ce_forward_" + suffix;
  l.backward = "loom_ce_backward_" + suffix;
  l.forward_gradient = "loom_ce_forward_gradient_" + suffix;
  l.scale = "loom_ce_scale_" + suffix;
  l.gradient_fits = whole && dtype != at::kHalf && chunks > 0 && chunks <= int64_t{512} * 16;
  return l;
}

struct Sums {
  at::Tensor loss, lse, correct;  // per row
};

Sums empty_sums(const at::Tensor& logits) {
  const int64_t rows = logits.size(0);
  return {at::empty({rows}, logits.options().dtype(at::kFloat)), at::empty({rows}, logits.options().dtype(at::kFloat)),
          at::empty({rows}, logits.options().dtype(at::kInt))};
}

void* stream_of(const at::Tensor& t) { return c10::cuda::getCurrentCUDAStream(t.get_device()).stream(); }

// The forward kernel; with `gradient` defined, the one that also writes the gradient into it.
void launch_forward(const Launch& l, const at::Tensor& logits, const at::Tensor& target, int64_t ignore_index,
                    const Sums& out, const at::Tensor& gradient) {
  if (logits.size(0) == 0) return;
  const bool with_gradient = gradient.defined();
  void* f = kernels().function(logits.get_device(), with_gradient ? l.forward_gradient : l.forward);
  const void* x = logits.data_ptr();
  const void* t = target.data_ptr();
  int64_t width = logits.size(1);
  void* loss = out.loss.data_ptr();
  void* lse = out.lse.data_ptr();
  void* correct = out.correct.data_ptr();
  void* g = with_gradient ? gradient.data_ptr() : nullptr;
  void* args[] = {&x, &t, &width, &ignore_index, &loss, &lse, &correct, &g};
  rtc::Kernels::launch(f, static_cast<unsigned>(logits.size(0)), static_cast<unsigned>(l.threads), stream_of(logits), args);
}

// The backward kernel: `out` = (exp(logits - lse) - [j == target]) * grad.
void launch_backward(const Launch& l, const at::Tensor& logits, const at::Tensor& target, const at::Tensor& lse,
                     const at::Tensor& grad, int64_t ignore_index, const at::Tensor& out) {
  if (logits.size(0) == 0) return;
  void* f = kernels().function(logits.get_device(), l.backward);
  const void* x = logits.data_ptr();
  const void* t = target.data_ptr();
  const void* e = lse.data_ptr();
  const void* g = grad.data_ptr();
  int64_t width = logits.size(1);
  void* o = out.data_ptr();
  void* args[] = {&x, &t, &e, &g, &width, &ignore_index, &o};
  rtc::Kernels::launch(f, static_cast<unsigned>(logits.size(0)), static_cast<unsigned>(l.threads), stream_of(logits), args);
}

// gradient *= grad[0] in place, on the device (nothing where grad is 1).
void launch_scale(const Launch& l, const at::Tensor& gradient, const at::Tensor& grad) {
  int64_t vectors = gradient.numel() / (gradient.element_size() == 4 ? 4 : 8);
  if (vectors == 0) return;
  void* f = kernels().function(gradient.get_device(), l.scale);
  void* g = gradient.data_ptr();
  const void* s = grad.data_ptr();
  void* args[] = {&g, &s, &vectors};
  const int64_t blocks = std::min<int64_t>((vectors + 255) / 256, 4096);
  rtc::Kernels::launch(f, static_cast<unsigned>(blocks), 256, stream_of(gradient), args);
}

// Whether the gradient-in-the-forward path gives the two-kernel path's results on this device, for
// logits of this dtype and width (Note [The gradient in the forward]).
bool gradient_path_checked(const at::Tensor& logits) {
  const c10::cuda::CUDAGuard guard(logits.device());
  const auto check = [&]() -> std::string {
    const at::NoGradGuard no_grad;
    const int64_t rows = 6, width = logits.size(1);
    // fixed values, not the generator's (a check must not move the run's random stream)
    const at::Tensor x = at::arange(rows * width, logits.options().dtype(at::kFloat))
                             .mul(0.37).sin().mul(4.0).reshape({rows, width}).to(logits.scalar_type());
    const at::Tensor target = at::arange(rows, logits.options().dtype(at::kLong)).mul(width / 7 + 1).remainder(width);
    target[2] = -100;  // an ignored row
    const Launch l = kernels_for(x);
    const at::Tensor half = at::full({1}, 0.5, logits.options().dtype(at::kFloat));
    const Sums two = empty_sums(x), one = empty_sums(x);
    const at::Tensor expected = at::empty_like(x), gradient = at::empty_like(x);
    launch_forward(l, x, target, -100, two, at::Tensor());
    launch_backward(l, x, target, two.lse, half, -100, expected);
    launch_forward(l, x, target, -100, one, gradient);
    launch_scale(l, gradient, half);
    // The gradients' softmax parts (the one-hot term added back): at 50304 classes the one-hot is
    // 99 % of the gradient's norm, and a kernel that wrote only it, or used a log-sum-exp off by
    // log 2, would be within 1 % of the whole (a CPU emulation of both kernels); the correct one
    // is within 3e-6 of the two kernels there, those are off by 50 % or more.
    const at::Tensor onehot = at::zeros(x.sizes(), x.options().dtype(at::kFloat))
                                  .scatter_(1, target.clamp_min(0).unsqueeze(1), 0.5);
    onehot[2].zero_();
    const auto norm_close = [](const at::Tensor& a, const at::Tensor& b, double tolerance) {
      return a.sub(b).norm().item<double>() <= tolerance * b.norm().item<double>();
    };
    const bool good = norm_close(one.loss, two.loss, 1e-6) && at::equal(one.correct, two.correct) &&
                      norm_close(gradient.to(at::kFloat).add(onehot), expected.to(at::kFloat).add(onehot), 1e-3) &&
                      gradient[2].abs().sum().item<double>() == 0.0;
    return good ? "" : "its results differ from the forward and backward kernels'";
  };
  return checked_at_first_use(
      "nn::cross_entropy_sum: the gradient in the forward",
      "cuda:" + std::to_string(logits.get_device()) + " for " + c10::toString(logits.scalar_type()) + " rows of " +
          std::to_string(logits.size(1)),
      check, "the forward and backward take a kernel each");
}

class FusedCrossEntropy : public torch::autograd::Function<FusedCrossEntropy> {
 public:
  static torch::autograd::variable_list forward(torch::autograd::AutogradContext* ctx, const at::Tensor& logits,
                                                const at::Tensor& target, int64_t ignore_index, bool gradient_in_forward) {
    const c10::cuda::CUDAGuard guard(logits.device());
    const Launch l = kernels_for(logits);
    const Sums sums = empty_sums(logits);
    if (gradient_in_forward) {
      at::Tensor gradient = at::empty_like(logits, at::MemoryFormat::Contiguous);
      launch_forward(l, logits, target, ignore_index, sums, gradient);
      ctx->save_for_backward({gradient});
    } else {
      launch_forward(l, logits, target, ignore_index, sums, at::Tensor());
      ctx->save_for_backward({logits, target, sums.lse});
      ctx->saved_data["ignore_index"] = ignore_index;
    }
    ctx->saved_data["gradient_in_forward"] = gradient_in_forward;
    at::Tensor correct_sum = at::sum(sums.correct, at::kLong);
    ctx->mark_non_differentiable({correct_sum});
    return {at::sum(sums.loss), correct_sum};
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const c10::cuda::CUDAGuard guard(saved[0].device());
    const at::Tensor scale = grads[0].to(at::kFloat).contiguous();
    const Launch l = kernels_for(saved[0]);
    if (ctx->saved_data["gradient_in_forward"].toBool()) {
      if (ctx->saved_data.count("backward_done"))
        throw Error("cross_entropy_sum: a second backward through the same forward (retain_graph) is not supported "
                    "where the forward wrote the gradient (Note [The gradient in the forward]); run the forward again, "
                    "or LOOM_FUSED_KERNELS without cross_entropy");
      ctx->saved_data["backward_done"] = true;
      launch_scale(l, saved[0], scale);
      return {saved[0], at::Tensor(), at::Tensor(), at::Tensor()};
    }
    const at::Tensor& logits = saved[0];
    at::Tensor grad_logits = at::empty_like(logits, at::MemoryFormat::Contiguous);
    launch_backward(l, logits, saved[1], saved[2], scale, ctx->saved_data["ignore_index"].toInt(), grad_logits);
    return {grad_logits, at::Tensor(), at::Tensor(), at::Tensor()};
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
  return kernels().unavailable(logits.get_device(), kernels_for(logits).forward);
#else
  return "LibTorch without CUDA";
#endif
}

std::string fused_cross_entropy_gradient_unavailable(const at::Tensor& logits) {
  if (std::string why = fused_cross_entropy_unavailable(logits); !why.empty()) return why;
#if LOOM_TORCH_CUDA
  const at::Tensor x = logits.contiguous();
  const Launch l = kernels_for(x);
  if (l.gradient_fits) return gradient_path_checked(x) ? "" : "its check at first use failed on this device (logged)";
  if (x.scalar_type() == at::kHalf) return "fp16 logits (the gradient is written after the loss scale multiplies it)";
  return "rows of " + std::to_string(x.size(1)) + " " + c10::toString(x.scalar_type()) +
         " values (it holds whole 16-byte vectors, up to 65536 bf16 or 32768 float32 values a row)";
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
  if (logits.size(1) == 0) throw Error("cross_entropy_sum: logits of no classes ([" + std::to_string(logits.size(0)) + ", 0])");
#if LOOM_TORCH_CUDA
  if (fused_cross_entropy_unavailable(logits).empty()) {
    const at::Tensor x = logits.contiguous();
    const bool gradient_in_forward =
        at::GradMode::is_enabled() && x.requires_grad() && kernels_for(x).gradient_fits && gradient_path_checked(x);
    const auto out = FusedCrossEntropy::apply(x, target.contiguous(), ignore_index, gradient_in_forward);
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
