// layer_norm: see <loom/sdk/layer_norm.hpp>; the kernels are compiled at run time
// (Note [Kernels compiled at run time], rtc.cpp).
#include <loom/sdk/layer_norm.hpp>

#include "rtc.hpp"

#include <ATen/autocast_mode.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/layer_norm.h>
#include <ATen/ops/result_type.h>
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
// up, and the block writes them to a [blocks, 2, width] buffer that one ATen reduction sums into the weight's and
// the bias's gradients (a [warps, width] buffer cost GPT-2 0.44 ms per step to sum on an H200).
// V is 6 for widths up to 768 (GPT-2 124M's, BERT's and ViT-B's), 8 up to 1024, 16 up to 2048:
// the backward keeps 3 x 4 V floats per lane, and V = 8 for 768 reserved registers for two vectors
// it never used (137 registers, one block of 256 threads per SM; V = 6: 115, two; ptxas
// --resource-usage). It asks for a row's x, dy and the sum's gradient together, one trip to
// memory per row (GPT-2 124M ran its earlier two-trip form at 2.2 of the H200's 4.8 TB/s). With a branch (add_layer_norm) the
// forward normalizes x + branch and writes the sum; the backward adds the sum's own gradient
// into dx and writes the branch's (Note [The residual add in the LayerNorm]).
constexpr const char* kSource = R"CUDA(
template <typename TI, typename TO, int V>
__device__ void ln_forward(const TI* __restrict__ x, const TO* __restrict__ branch, const float* __restrict__ weight,
                           const float* __restrict__ bias, long long rows, int width, float eps, TI* __restrict__ sum_out,
                           TO* __restrict__ y, float* __restrict__ mean_out, float* __restrict__ rstd_out) {
  const long long row = (long long)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
  const int lane = threadIdx.x & 31;
  if (row >= rows) return;
  const TI* xr = x + row * width;
  float v[V][4];
  float sum = 0.f;
#pragma unroll
  for (int i = 0; i < V; ++i) {
    const int j = (i * 32 + lane) * 4;
    if (j < width) {
      load4(xr + j, v[i]);
      if (branch != nullptr) {  // the residual add: x + branch, written once, normalized from registers
        float r[4];
        load4(branch + row * width + j, r);
#pragma unroll
        for (int e = 0; e < 4; ++e) {  // rounded to x's dtype, as the add would (nothing for float32)
          TI t;
          from_f(v[i][e] + r[e], t);
          v[i][e] = to_f(t);
        }
        store4(sum_out + row * width + j, v[i]);
      }
      sum += (v[i][0] + v[i][1]) + (v[i][2] + v[i][3]);
    }
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
                            const float* __restrict__ rstd, const float* __restrict__ weight, const TI* __restrict__ dsum,
                            long long rows, int width, int rows_per_warp, TI* __restrict__ dx,
                            TO* __restrict__ dbranch, float* __restrict__ dweight_part, float* __restrict__ dbias_part) {
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
    // Everything the row needs from memory is asked for at once (x, dy, the sum's gradient): one
    // round trip per row. The second pass reads x and dy again from L1 and recomputes x^,
    // so that the sum's gradient, not x^, takes the registers (115 for V = 6: two blocks per SM).
    float acc[V][4];
    float sum_g = 0.f, sum_gx = 0.f;
#pragma unroll
    for (int i = 0; i < V; ++i) {
      const int j = (i * 32 + lane) * 4;
      if (j < width) {
        float xv[4], d[4], w[4];
        load4(x + row * width + j, xv);
        load4(dy + row * width + j, d);
        load4(weight + j, w);
        if (dsum != nullptr) load4(dsum + row * width + j, acc[i]);
        else {
#pragma unroll
          for (int e = 0; e < 4; ++e) acc[i][e] = 0.f;
        }
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const float xh = (xv[e] - mu) * rs;
          dw[i][e] += d[e] * xh;
          db[i][e] += d[e];
          const float g = d[e] * w[e];
          sum_g += g;
          sum_gx += g * xh;
        }
      }
    }
    const float mean_g = warp_sum(sum_g) / width, mean_gx = warp_sum(sum_gx) / width;
#pragma unroll
    for (int i = 0; i < V; ++i) {
      const int j = (i * 32 + lane) * 4;
      if (j < width) {
        float xv[4], d[4], w[4], o[4];
        load4(x + row * width + j, xv);  // again: the row is in L1 still
        load4(dy + row * width + j, d);
        load4(weight + j, w);
        // the sum's own gradient joins (what autograd's add would do); zeros without one
#pragma unroll
        for (int e = 0; e < 4; ++e) o[e] = rs * (d[e] * w[e] - mean_g - (xv[e] - mu) * rs * mean_gx) + acc[i][e];
        store4(dx + row * width + j, o);
        if (dbranch != nullptr) store4(dbranch + row * width + j, o);  // the branch's, in its dtype
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
    dweight_part[(long long)blockIdx.x * 2 * width + j] = block_dw[j];  // rows of [blocks, 2, width]
    dbias_part[(long long)blockIdx.x * 2 * width + j] = block_db[j];
  }
}

#define LOOM_LN(TI, TO, NAME, V)                                                                           \
  extern "C" __global__ void __launch_bounds__(256) loom_ln_forward_##NAME##_##V(                           \
      const TI* x, const TO* branch, const float* weight, const float* bias, long long rows, int width,     \
      float eps, TI* sum, TO* y, float* mean, float* rstd) {                                                \
    ln_forward<TI, TO, V>(x, branch, weight, bias, rows, width, eps, sum, y, mean, rstd);                   \
  }                                                                                                         \
  extern "C" __global__ void __launch_bounds__(256) loom_ln_backward_##NAME##_##V(                          \
      const TO* dy, const TI* x, const float* mean, const float* rstd, const float* weight, const TI* dsum, \
      long long rows, int width, int rows_per_warp, TI* dx, TO* dbranch, float* dweight_part,              \
      float* dbias_part) {                                                                                  \
    ln_backward<TI, TO, V>(dy, x, mean, rstd, weight, dsum, rows, width, rows_per_warp, dx, dbranch,       \
                           dweight_part, dbias_part);                                                       \
  }
#define LOOM_LN_WIDTHS(TI, TO, NAME) LOOM_LN(TI, TO, NAME, 6) LOOM_LN(TI, TO, NAME, 8) LOOM_LN(TI, TO, NAME, 16)
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
      for (const char* v : {"6", "8", "16"}) out.push_back(std::string("loom_ln_") + dir + "_" + types + "_" + v);
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
         (width <= 1024 ? (width > 512 && width <= 768 ? "6" : "8") : "16");
}

[[maybe_unused]] bool aligned(const at::Tensor& t) { return reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0; }

#if LOOM_TORCH_CUDA
struct Forward {
  at::Tensor sum, y, mean, rstd;
};

// y = LayerNorm(x [+ branch]) in out_dtype, and the sum where there is a branch.
Forward launch_forward(const at::Tensor& x, const at::Tensor* branch, const at::Tensor& weight, const at::Tensor& bias,
                       double eps, at::ScalarType out_dtype) {
  const c10::cuda::CUDAGuard guard(x.device());
  int width = static_cast<int>(x.size(-1));
  long long rows = x.numel() / width;
  Forward out;
  out.y = at::empty(x.sizes(), x.options().dtype(out_dtype));
  out.mean = at::empty({rows}, x.options().dtype(at::kFloat));
  out.rstd = at::empty({rows}, x.options().dtype(at::kFloat));
  if (branch != nullptr) out.sum = at::empty(x.sizes(), x.options());
  if (rows > 0) {
    void* f = kernels().function(x.get_device(), kernel_name("forward", x.scalar_type(), out_dtype, width));
    const void* xp = x.data_ptr();
    const void* br = branch != nullptr ? branch->data_ptr() : nullptr;
    const void* w = weight.data_ptr();
    const void* b = bias.data_ptr();
    float e = static_cast<float>(eps);
    void* sp = branch != nullptr ? out.sum.data_ptr() : nullptr;
    void* yp = out.y.data_ptr();
    void* m = out.mean.data_ptr();
    void* r = out.rstd.data_ptr();
    void* args[] = {&xp, &br, &w, &b, &rows, &width, &e, &sp, &yp, &m, &r};
    rtc::Kernels::launch(f, static_cast<unsigned>((rows + 7) / 8), 256,
                         c10::cuda::getCurrentCUDAStream(x.get_device()).stream(), args);
  }
  return out;
}

struct Backward {
  at::Tensor dx, dbranch, dweight, dbias;
};

// Gradients of y = LayerNorm(x) for dy (x: the sum where there was a branch), plus dsum (the
// sum's own gradient, where defined) in dx; the branch's gradient, dx in dy's dtype, where asked.
Backward launch_backward(const at::Tensor& dy_in, const at::Tensor& x, const at::Tensor& mean, const at::Tensor& rstd,
                         const at::Tensor& weight, const at::Tensor& dsum_in, bool want_branch) {
  const c10::cuda::CUDAGuard guard(x.device());
  const auto whole = [](const at::Tensor& t) {  // a view at an odd offset: the kernel reads 8 or 16 bytes at a time
    at::Tensor c = t.contiguous();
    return aligned(c) ? c : c.clone();
  };
  const at::Tensor dy = whole(dy_in);
  const at::Tensor dsum = dsum_in.defined() ? whole(dsum_in.to(x.scalar_type())) : at::Tensor();
  int width = static_cast<int>(x.size(-1));
  long long rows = x.numel() / width;
  int rows_per_warp = kRowsPerWarp;
  const long long warps = (rows + rows_per_warp - 1) / rows_per_warp;
  const long long blocks = (warps + 7) / 8;
  Backward out;
  out.dx = at::empty_like(x, at::MemoryFormat::Contiguous);
  if (want_branch) out.dbranch = at::empty(x.sizes(), x.options().dtype(dy.scalar_type()));
  // [blocks, 2, width]: the weight's and the bias's partial sums of each block side by side, so
  // that one reduction sums both (two cost GPT-2 0.35 ms per step for its 25 LayerNorms)
  at::Tensor parts = at::empty({blocks, 2, width}, x.options().dtype(at::kFloat));
  if (rows > 0) {
    void* f = kernels().function(x.get_device(), kernel_name("backward", x.scalar_type(), dy.scalar_type(), width));
    const void* d = dy.data_ptr();
    const void* xp = x.data_ptr();
    const void* m = mean.data_ptr();
    const void* r = rstd.data_ptr();
    const void* w = weight.data_ptr();
    const void* ds = dsum.defined() ? dsum.data_ptr() : nullptr;
    void* dxp = out.dx.data_ptr();
    void* dbr = want_branch ? out.dbranch.data_ptr() : nullptr;
    void* dw = parts.data_ptr();
    void* db = parts.select(1, 1).data_ptr();
    void* args[] = {&d, &xp, &m, &r, &w, &ds, &rows, &width, &rows_per_warp, &dxp, &dbr, &dw, &db};
    rtc::Kernels::launch(f, static_cast<unsigned>(blocks), 256,
                         c10::cuda::getCurrentCUDAStream(x.get_device()).stream(), args);
  }
  const at::Tensor sums = at::sum(parts, 0);
  out.dweight = sums[0];
  out.dbias = sums[1];
  return out;
}

class FusedLayerNorm : public torch::autograd::Function<FusedLayerNorm> {
 public:
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x, const at::Tensor& weight,
                            const at::Tensor& bias, double eps, at::ScalarType out_dtype) {
    Forward f = launch_forward(x, nullptr, weight, bias, eps, out_dtype);
    ctx->save_for_backward({x, weight, f.mean, f.rstd});
    return f.y;
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    Backward g = launch_backward(grads[0], saved[0], saved[2], saved[3], saved[1], at::Tensor(), false);
    return {g.dx, g.dweight, g.dbias, at::Tensor(), at::Tensor()};
  }
};

// Note [The residual add in the LayerNorm]
// GPT-2's blocks add each branch into the float32 residual stream (x = x + branch) and normalize
// the sum right after (the next LayerNorm). Apart, that is an add (read x and the branch, write
// the sum) and a LayerNorm that reads the sum again; in backward, autograd adds the sum's own
// gradient to the LayerNorm's dx (read two, write one) and casts it for the branch. Together
// (GPT-2 124M on an H200: the adds 0.59 ms, the backward's 0.69 ms per step), the forward reads
// x and the branch once and writes the sum and the output; the backward reads the sum's
// gradient where it writes dx, and writes the branch's gradient beside it in the branch's dtype.
class FusedAddLayerNorm : public torch::autograd::Function<FusedAddLayerNorm> {
 public:
  static torch::autograd::variable_list forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x,
                                                const at::Tensor& branch, const at::Tensor& weight,
                                                const at::Tensor& bias, double eps, at::ScalarType out_dtype) {
    Forward f = launch_forward(x, &branch, weight, bias, eps, out_dtype);
    ctx->save_for_backward({f.sum, weight, f.mean, f.rstd});
    ctx->saved_data["branch_dtype"] = branch.scalar_type();
    return {f.sum, f.y};
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const at::Tensor &dsum = grads[0], &dy = grads[1];
    if (!dy.defined()) {  // only the sum was used: the add's gradient
      if (!dsum.defined()) return {at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
      return {dsum, dsum.to(ctx->saved_data["branch_dtype"].toScalarType()), at::Tensor(), at::Tensor(), at::Tensor(),
              at::Tensor()};
    }
    Backward g = launch_backward(dy, saved[0], saved[2], saved[3], saved[1], dsum, ctx->needs_input_grad(1));
    return {g.dx, g.dbranch, g.dweight, g.dbias, at::Tensor(), at::Tensor()};
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

std::string fused_add_layer_norm_unavailable(const at::Tensor& x, const at::Tensor& branch, const at::Tensor& weight,
                                            const at::Tensor& bias) {
  if (std::string why = fused_layer_norm_unavailable(x, weight, bias); !why.empty()) return why;
  if (!branch.defined() || branch.sizes() != x.sizes() || branch.device() != x.device())
    return "the branch is not of x's shape on x's device";
  if (branch.scalar_type() != output_dtype(x) || at::result_type(x, branch) != x.scalar_type())
    return std::string("a branch of dtype ") + c10::toString(branch.scalar_type()) + " (the kernels take the output's, " +
           c10::toString(output_dtype(x)) + ", into x's " + c10::toString(x.scalar_type()) + ")";
  if (branch.is_contiguous() && !aligned(branch)) return "the branch starts at an odd offset";
  return {};
}

std::pair<at::Tensor, at::Tensor> add_layer_norm(const at::Tensor& x, const at::Tensor& branch, const at::Tensor& weight,
                                                 const at::Tensor& bias, double eps) {
  if (!branch.defined()) return {x, layer_norm(x, weight, bias, eps)};
#if LOOM_TORCH_CUDA
  if (fused_add_layer_norm_unavailable(x, branch, weight, bias).empty()) {
    at::Tensor b = branch.contiguous();
    if (!aligned(b)) b = b.clone();
    const auto out = FusedAddLayerNorm::apply(x.contiguous(), b, weight, bias, eps, output_dtype(x));
    return {out[0], out[1]};
  }
#endif
  const at::Tensor sum = x + branch;
  return {sum, layer_norm(sum, weight, bias, eps)};
}

std::string compile_layer_norm_kernels(int major, int minor) { return kernels().compile_only(major, minor); }

}  // namespace loom::sdk::nn
