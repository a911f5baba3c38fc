// layer_norm: see <loom/sdk/layer_norm.hpp>; the kernels are compiled at run time
// (Note [Kernels compiled at run time], rtc.cpp).
#include <loom/sdk/layer_norm.hpp>

#include "rtc.hpp"

#include <ATen/autocast_mode.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/layer_norm.h>
#include <ATen/ops/sum.h>
#include <torch/csrc/autograd/custom_function.h>
#if LOOM_TORCH_CUDA
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#endif


namespace loom::sdk::nn {

namespace {

// One warp per row; lane l holds the values (32 i + l) * 4 .. + 3 for i < V, in registers, so the
// row is read once. Forward: mean, then the variance around it (two sums over the registers), the
// output in its dtype, and mean and 1/std kept for backward. Backward (rows_per_warp rows per
// warp): with x^ = (x - mean) / std and g = dy * weight, dx = (g - mean(g) - x^ mean(g x^)) / std;
// each lane adds dy x^ and dy for its columns over its warp's rows, the block's warps add theirs
// up, and the block writes them to a [blocks, width] buffer that ATen sums into the weight's and
// the bias's gradients (a [warps, width] buffer cost GPT-2 0.44 ms per step to sum on an H200).
constexpr const char* kSource = R"CUDA(
template <typename TI, typename TO, int V>
__device__ void ln_forward(const TI* __restrict__ x, const float* __restrict__ weight, const float* __restrict__ bias,
                           long long rows, int width, float eps, TO* __restrict__ y, float* __restrict__ mean_out,
                           float* __restrict__ rstd_out) {
  const long long row = (long long)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
  const int lane = threadIdx.x & 31;
  if (row >= rows) return;
  const TI* xr = x + row * width;
  float v[V][4];
  float sum = 0.f;
#pragma unroll
  for (int i = 0; i < V; ++i) {
    const int j = (i * 32 + lane) * 4;
    if (j < width) { load4(xr + j, v[i]); sum += (v[i][0] + v[i][1]) + (v[i][2] + v[i][3]); }
  }
  const float mean = warp_sum(sum) / width;
  float squares = 0.f;
#pragma unroll
  for (int i = 0; i < V; ++i) {
    const int j = (i * 32 + lane) * 4;
    if (j < width) {
#pragma unroll
      for (int e = 0; e < 4; ++e) { const float d = v[i][e] - mean; squares += d * d; }
    }
  }
  const float rstd = rsqrtf(warp_sum(squares) / width + eps);
  TO* yr = y + row * width;
#pragma unroll
  for (int i = 0; i < V; ++i) {
    const int j = (i * 32 + lane) * 4;
    if (j < width) {
      float w[4], b[4], o[4];
      load4(weight + j, w);
      load4(bias + j, b);
#pragma unroll
      for (int e = 0; e < 4; ++e) o[e] = (v[i][e] - mean) * rstd * w[e] + b[e];
      store4(yr + j, o);
    }
  }
  if (lane == 0) { mean_out[row] = mean; rstd_out[row] = rstd; }
}

template <typename TI, typename TO, int V>
__device__ void ln_backward(const TO* __restrict__ dy, const TI* __restrict__ x, const float* __restrict__ mean,
                            const float* __restrict__ rstd, const float* __restrict__ weight, long long rows, int width,
                            int rows_per_warp, TI* __restrict__ dx, float* __restrict__ dweight_part,
                            float* __restrict__ dbias_part) {
  const long long warp = (long long)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
  const int lane = threadIdx.x & 31;
  float dw[V][4], db[V][4];
#pragma unroll
  for (int i = 0; i < V; ++i)
#pragma unroll
    for (int e = 0; e < 4; ++e) { dw[i][e] = 0.f; db[i][e] = 0.f; }
  const long long end = min(rows, (warp + 1) * rows_per_warp);
  for (long long row = warp * rows_per_warp; row < end; ++row) {
    const float mu = mean[row], rs = rstd[row];
    float xhat[V][4];
    float sum_g = 0.f, sum_gx = 0.f;
#pragma unroll
    for (int i = 0; i < V; ++i) {
      const int j = (i * 32 + lane) * 4;
      if (j < width) {
        float d[4], w[4];
        load4(x + row * width + j, xhat[i]);
        load4(dy + row * width + j, d);
        load4(weight + j, w);
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          xhat[i][e] = (xhat[i][e] - mu) * rs;
          dw[i][e] += d[e] * xhat[i][e];
          db[i][e] += d[e];
          const float g = d[e] * w[e];
          sum_g += g;
          sum_gx += g * xhat[i][e];
        }
      }
    }
    const float mean_g = warp_sum(sum_g) / width, mean_gx = warp_sum(sum_gx) / width;
#pragma unroll
    for (int i = 0; i < V; ++i) {
      const int j = (i * 32 + lane) * 4;
      if (j < width) {
        float d[4], w[4], o[4];
        load4(dy + row * width + j, d);  // again: the row is in L1 still
        load4(weight + j, w);
#pragma unroll
        for (int e = 0; e < 4; ++e) o[e] = rs * (d[e] * w[e] - mean_g - xhat[i][e] * mean_gx);
        store4(dx + row * width + j, o);
      }
    }
  }
  // The block's warps add their sums into shared memory one after another (a fixed order: the
  // result does not depend on timing), and the block writes one row of the partial sums.
  __shared__ float block_dw[2048], block_db[2048];
  const int warp_in_block = threadIdx.x >> 5;
  for (int w = 0; w < (blockDim.x >> 5); ++w) {
    if (warp_in_block == w) {
#pragma unroll
      for (int i = 0; i < V; ++i) {
        const int j = (i * 32 + lane) * 4;
        if (j < width) {
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            block_dw[j + e] = w == 0 ? dw[i][e] : block_dw[j + e] + dw[i][e];
            block_db[j + e] = w == 0 ? db[i][e] : block_db[j + e] + db[i][e];
          }
        }
      }
    }
    __syncthreads();
  }
  for (int j = threadIdx.x; j < width; j += blockDim.x) {
    dweight_part[(long long)blockIdx.x * width + j] = block_dw[j];
    dbias_part[(long long)blockIdx.x * width + j] = block_db[j];
  }
}

#define LOOM_LN(TI, TO, NAME, V)                                                                           \
  extern "C" __global__ void __launch_bounds__(256) loom_ln_forward_##NAME##_##V(                           \
      const TI* x, const float* weight, const float* bias, long long rows, int width, float eps, TO* y,     \
      float* mean, float* rstd) {                                                                           \
    ln_forward<TI, TO, V>(x, weight, bias, rows, width, eps, y, mean, rstd);                                \
  }                                                                                                         \
  extern "C" __global__ void __launch_bounds__(256) loom_ln_backward_##NAME##_##V(                          \
      const TO* dy, const TI* x, const float* mean, const float* rstd, const float* weight, long long rows, \
      int width, int rows_per_warp, TI* dx, float* dweight_part, float* dbias_part) {                      \
    ln_backward<TI, TO, V>(dy, x, mean, rstd, weight, rows, width, rows_per_warp, dx, dweight_part,        \
                           dbias_part);                                                                     \
  }
#define LOOM_LN_WIDTHS(TI, TO, NAME) LOOM_LN(TI, TO, NAME, 8) LOOM_LN(TI, TO, NAME, 16)
LOOM_LN_WIDTHS(float, float, f32_f32)
LOOM_LN_WIDTHS(float, bf16_t, f32_bf16)
LOOM_LN_WIDTHS(float, half_t, f32_f16)
LOOM_LN_WIDTHS(bf16_t, bf16_t, bf16_bf16)
LOOM_LN_WIDTHS(half_t, half_t, f16_f16)
)CUDA";

constexpr int kRowsPerWarp = 4;  // backward: 2048 warps, 256 blocks for GPT-2's 8192 rows
constexpr int kMaxWidth = 2048;  // 32 lanes x 16 vectors of 4

[[maybe_unused]] const char* short_name(at::ScalarType t) {
  return t == at::kFloat ? "f32" : t == at::kBFloat16 ? "bf16" : t == at::kHalf ? "f16" : nullptr;
}

std::vector<std::string> kernel_names() {
  std::vector<std::string> out;
  for (const char* dir : {"forward", "backward"})
    for (const char* types : {"f32_f32", "f32_bf16", "f32_f16", "bf16_bf16", "f16_f16"})
      for (const char* v : {"8", "16"}) out.push_back(std::string("loom_ln_") + dir + "_" + types + "_" + v);
  return out;
}

rtc::Kernels& kernels() {
  static rtc::Kernels k(kSource, "loom_layer_norm.cu", kernel_names());
  return k;
}

[[maybe_unused]] at::ScalarType output_dtype(const at::Tensor& x) {
  return at::autocast::is_autocast_enabled(x.device().type()) ? at::autocast::get_autocast_dtype(x.device().type())
                                                               : x.scalar_type();
}

[[maybe_unused]] std::string kernel_name(const char* direction, at::ScalarType in, at::ScalarType out, int64_t width) {
  return std::string("loom_ln_") + direction + "_" + short_name(in) + "_" + short_name(out) + "_" +
         (width <= 1024 ? "8" : "16");
}

[[maybe_unused]] bool aligned(const at::Tensor& t) { return reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0; }

#if LOOM_TORCH_CUDA
class FusedLayerNorm : public torch::autograd::Function<FusedLayerNorm> {
 public:
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x, const at::Tensor& weight,
                            const at::Tensor& bias, double eps, at::ScalarType out_dtype) {
    const c10::cuda::CUDAGuard guard(x.device());
    int width = static_cast<int>(x.size(-1));
    long long rows = x.numel() / width;
    at::Tensor y = at::empty(x.sizes(), x.options().dtype(out_dtype));
    at::Tensor mean = at::empty({rows}, x.options().dtype(at::kFloat));
    at::Tensor rstd = at::empty({rows}, x.options().dtype(at::kFloat));
    if (rows > 0) {
      void* f = kernels().function(x.get_device(), kernel_name("forward", x.scalar_type(), out_dtype, width));
      const void* xp = x.data_ptr();
      const void* w = weight.data_ptr();
      const void* b = bias.data_ptr();
      float e = static_cast<float>(eps);
      void* yp = y.data_ptr();
      void* m = mean.data_ptr();
      void* r = rstd.data_ptr();
      void* args[] = {&xp, &w, &b, &rows, &width, &e, &yp, &m, &r};
      rtc::Kernels::launch(f, static_cast<unsigned>((rows + 7) / 8), 256,
                           c10::cuda::getCurrentCUDAStream(x.get_device()).stream(), args);
    }
    ctx->save_for_backward({x, weight, mean, rstd});
    return y;
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const at::Tensor &x = saved[0], &weight = saved[1];
    const c10::cuda::CUDAGuard guard(x.device());
    at::Tensor dy = grads[0].contiguous();
    if (!aligned(dy)) dy = dy.clone();  // a view at an odd offset: the kernel reads 8 or 16 bytes at a time
    int width = static_cast<int>(x.size(-1));
    long long rows = x.numel() / width;
    int rows_per_warp = kRowsPerWarp;
    const long long warps = (rows + rows_per_warp - 1) / rows_per_warp;
    const long long blocks = (warps + 7) / 8;
    at::Tensor dx = at::empty_like(x, at::MemoryFormat::Contiguous);
    at::Tensor dweight_part = at::empty({blocks, width}, x.options().dtype(at::kFloat));
    at::Tensor dbias_part = at::empty({blocks, width}, x.options().dtype(at::kFloat));
    if (rows > 0) {
      void* f = kernels().function(x.get_device(), kernel_name("backward", x.scalar_type(), dy.scalar_type(), width));
      const void* d = dy.data_ptr();
      const void* xp = x.data_ptr();
      const void* m = saved[2].data_ptr();
      const void* r = saved[3].data_ptr();
      const void* w = weight.data_ptr();
      void* dxp = dx.data_ptr();
      void* dw = dweight_part.data_ptr();
      void* db = dbias_part.data_ptr();
      void* args[] = {&d, &xp, &m, &r, &w, &rows, &width, &rows_per_warp, &dxp, &dw, &db};
      rtc::Kernels::launch(f, static_cast<unsigned>(blocks), 256,
                           c10::cuda::getCurrentCUDAStream(x.get_device()).stream(), args);
    }
    return {dx, at::sum(dweight_part, 0), at::sum(dbias_part, 0), at::Tensor(), at::Tensor()};
  }
};
#endif

}  // namespace

std::string fused_layer_norm_unavailable(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias) {
  if (std::string off = rtc::disabled_by_environment("layer_norm"); !off.empty()) return off;
  if (!x.is_cuda()) return "not a CUDA tensor";
#if LOOM_TORCH_CUDA
  const int64_t width = x.dim() == 0 ? 0 : x.size(-1);
  if (width < 4 || width % 4 != 0 || width > kMaxWidth)
    return "width " + std::to_string(width) + " (the kernels take multiples of 4 up to " + std::to_string(kMaxWidth) + ")";
  if (!weight.defined() || !bias.defined() || weight.scalar_type() != at::kFloat || bias.scalar_type() != at::kFloat ||
      weight.numel() != width || bias.numel() != width || !weight.is_contiguous() || !bias.is_contiguous() ||
      weight.device() != x.device() || bias.device() != x.device() || !aligned(weight) || !aligned(bias))
    return "weight and bias are not contiguous, aligned float32 [width] on x's device";
  if (x.is_contiguous() && !aligned(x)) return "x starts at an odd offset";
  const at::ScalarType out = output_dtype(x);
  const char* in_name = short_name(x.scalar_type());
  const char* out_name = short_name(out);
  if (in_name == nullptr || out_name == nullptr || (x.scalar_type() != at::kFloat && out != x.scalar_type()))
    return std::string("x of dtype ") + c10::toString(x.scalar_type()) + " with output " + c10::toString(out);
  const c10::cuda::CUDAGuard guard(x.device());
  return kernels().unavailable(x.get_device(), kernel_name("forward", x.scalar_type(), out, width));
#else
  return "LibTorch without CUDA";
#endif
}

at::Tensor layer_norm(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias, double eps) {
#if LOOM_TORCH_CUDA
  if (fused_layer_norm_unavailable(x, weight, bias).empty())
    return FusedLayerNorm::apply(x.contiguous(), weight, bias, eps, output_dtype(x));
#endif
  return at::layer_norm(x, {x.size(-1)}, weight, bias, eps);
}

std::string compile_layer_norm_kernels(int major, int minor) { return kernels().compile_only(major, minor); }

}  // namespace loom::sdk::nn
