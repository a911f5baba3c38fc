// nn::mlp_gelu_tanh: see <loom/sdk/nn.hpp> and Note [GELU in the product's epilogue] below.
#include <loom/sdk/log.hpp>
#include <loom/sdk/nn.hpp>

#include "gradients.hpp"
#include "rtc.hpp"

#include <ATen/autocast_mode.h>
#include <ATen/core/grad_mode.h>
#include <ATen/ops/addmm.h>
#include <ATen/ops/arange.h>
#include <ATen/ops/allclose.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/gelu.h>
#include <ATen/ops/gelu_backward.h>
#include <ATen/ops/mm.h>
#include <ATen/ops/ones.h>
#include <torch/csrc/autograd/custom_function.h>
#if LOOM_TORCH_CUDA
#include "first_use_check.hpp"

#include <ATen/cuda/CUDAContextLight.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cublasLt.h>
#include <dlfcn.h>
#endif

#include <map>
#include <mutex>
#include <tuple>

namespace loom::sdk::nn {

namespace {

// Note [GELU in the product's epilogue]
// GPT-2's MLP is c_proj(gelu_tanh(c_fc(x))). Apart, the GELU reads c_fc's output and writes its
// own (forward, 0.38 ms per step for GPT-2 124M on an H200), and its backward reads the gradient
// and c_fc's output and writes another (0.47 ms). cuBLASLt computes both in the products'
// epilogues: c_fc with CUBLASLT_EPILOGUE_GELU_AUX_BIAS writes the GELU's output and, beside it,
// its input (the "aux" matrix, which backward needs); c_proj's input gradient with
// CUBLASLT_EPILOGUE_DGELU reads the aux matrix and writes the gradient of the GELU's input
// directly. ATen exposes neither epilogue with its aux matrix, so Loom calls cuBLASLt itself, on
// LibTorch's cuBLASLt handle and workspace, its functions found in the process (LibTorch's CUDA
// library loaded libcublasLt; nothing is linked). The weights' and biases' gradients come in
// float32 as nn::linear's do (product_gradient). Under bf16 or fp16 autocast only, with widths that
// are multiples of 8. Checked once per device at first use against the composition it replaces
// (ATen's addmm, gelu and gelu_backward) on a small problem: a cuBLASLt that errs or disagrees
// turns it off for the process with a warning. Any cuBLASLt error later falls back per call.

#if LOOM_TORCH_CUDA
struct Lt {
  decltype(&cublasLtMatmulDescCreate) desc_create = nullptr;
  decltype(&cublasLtMatmulDescDestroy) desc_destroy = nullptr;
  decltype(&cublasLtMatmulDescSetAttribute) desc_set = nullptr;
  decltype(&cublasLtMatrixLayoutCreate) layout_create = nullptr;
  decltype(&cublasLtMatrixLayoutDestroy) layout_destroy = nullptr;
  decltype(&cublasLtMatmulPreferenceCreate) pref_create = nullptr;
  decltype(&cublasLtMatmulPreferenceDestroy) pref_destroy = nullptr;
  decltype(&cublasLtMatmulPreferenceSetAttribute) pref_set = nullptr;
  decltype(&cublasLtMatmulAlgoGetHeuristic) heuristic = nullptr;
  decltype(&cublasLtMatmul) matmul = nullptr;
  std::string why_not;
};

const Lt& lt() {
  static const Lt api = [] {
    Lt a;
    std::string missing;
    const auto bind = [&](const char* name, auto& slot) {
      slot = reinterpret_cast<std::remove_reference_t<decltype(slot)>>(::dlsym(RTLD_DEFAULT, name));
      if (slot == nullptr) missing += std::string(missing.empty() ? "" : ", ") + name;
    };
    bind("cublasLtMatmulDescCreate", a.desc_create);
    bind("cublasLtMatmulDescDestroy", a.desc_destroy);
    bind("cublasLtMatmulDescSetAttribute", a.desc_set);
    bind("cublasLtMatrixLayoutCreate", a.layout_create);
    bind("cublasLtMatrixLayoutDestroy", a.layout_destroy);
    bind("cublasLtMatmulPreferenceCreate", a.pref_create);
    bind("cublasLtMatmulPreferenceDestroy", a.pref_destroy);
    bind("cublasLtMatmulPreferenceSetAttribute", a.pref_set);
    bind("cublasLtMatmulAlgoGetHeuristic", a.heuristic);
    bind("cublasLtMatmul", a.matmul);
    if (!missing.empty()) a.why_not = "cuBLASLt is not in the process (" + missing + ")";
    return a;
  }();
  return api;
}

// D = epilogue(op(A) op(B)) in cuBLASLt's column-major terms: D is m x n (ld m), op(A) m x k,
// op(B) k x n; `aux` m x n (ld m); `bias` of length m (or null). Returns false on any cuBLASLt
// error (nothing is thrown: the caller falls back).
bool lt_matmul(cublasLtEpilogue_t epilogue, cublasOperation_t transa, const void* a, int64_t lda,
               cublasOperation_t transb, const void* b, int64_t ldb, void* d, int64_t m, int64_t n, int64_t k,
               const void* bias, void* aux, cudaDataType_t type, int device) {
  const Lt& api = lt();
  if (!api.why_not.empty()) return false;
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(device).stream();
  cublasLtHandle_t handle = at::cuda::getCurrentCUDABlasLtHandle();
  void* workspace = at::cuda::getCUDABlasLtWorkspace();
  const uint64_t workspace_bytes = at::cuda::getCUDABlasLtWorkspaceSize();
  cublasLtMatmulDesc_t desc = nullptr;
  cublasLtMatrixLayout_t la = nullptr, lb = nullptr, ld = nullptr;
  cublasLtMatmulPreference_t pref = nullptr;
  bool ok = api.desc_create(&desc, CUBLAS_COMPUTE_32F, CUDA_R_32F) == CUBLAS_STATUS_SUCCESS;
  const auto set = [&](cublasLtMatmulDescAttributes_t attribute, const void* value, size_t size) {
    ok = ok && api.desc_set(desc, attribute, value, size) == CUBLAS_STATUS_SUCCESS;
  };
  const int32_t ta = transa, tb = transb;
  set(CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof ta);
  set(CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof tb);
  const int32_t ep = epilogue;
  set(CUBLASLT_MATMUL_DESC_EPILOGUE, &ep, sizeof ep);
  if (bias != nullptr) set(CUBLASLT_MATMUL_DESC_BIAS_POINTER, &bias, sizeof bias);
  const int64_t aux_ld = m;
  set(CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER, &aux, sizeof aux);
  set(CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD, &aux_ld, sizeof aux_ld);
  const bool ta_t = transa == CUBLAS_OP_T, tb_t = transb == CUBLAS_OP_T;
  ok = ok && api.layout_create(&la, type, ta_t ? k : m, ta_t ? m : k, lda) == CUBLAS_STATUS_SUCCESS;
  ok = ok && api.layout_create(&lb, type, tb_t ? n : k, tb_t ? k : n, ldb) == CUBLAS_STATUS_SUCCESS;
  ok = ok && api.layout_create(&ld, type, m, n, m) == CUBLAS_STATUS_SUCCESS;
  ok = ok && api.pref_create(&pref) == CUBLAS_STATUS_SUCCESS;
  ok = ok && api.pref_set(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &workspace_bytes, sizeof workspace_bytes) ==
                 CUBLAS_STATUS_SUCCESS;
  // The heuristic's choice, once per problem (asking costs the host tens of microseconds)
  static std::mutex mutex;
  static std::map<std::tuple<int, int, int64_t, int64_t, int64_t, int, uint64_t>, cublasLtMatmulAlgo_t> algos;
  const auto key = std::make_tuple(device, static_cast<int>(epilogue), m, n, k, static_cast<int>(type), workspace_bytes);
  cublasLtMatmulAlgo_t algo{};
  if (ok) {
    const std::lock_guard<std::mutex> lock(mutex);
    if (auto it = algos.find(key); it != algos.end()) {
      algo = it->second;
    } else {
      cublasLtMatmulHeuristicResult_t result{};
      int found = 0;
      ok = api.heuristic(handle, desc, la, lb, ld, ld, pref, 1, &result, &found) == CUBLAS_STATUS_SUCCESS && found > 0;
      if (ok) algos[key] = algo = result.algo;
    }
  }
  const float one = 1.f, zero = 0.f;
  ok = ok && api.matmul(handle, desc, &one, a, la, b, lb, &zero, d, ld, d, ld, &algo, workspace, workspace_bytes,
                        stream) == CUBLAS_STATUS_SUCCESS;
  if (pref != nullptr) api.pref_destroy(pref);
  for (cublasLtMatrixLayout_t l : {la, lb, ld})
    if (l != nullptr) api.layout_destroy(l);
  if (desc != nullptr) api.desc_destroy(desc);
  return ok;
}

cudaDataType_t cuda_type(at::ScalarType t) { return t == at::kBFloat16 ? CUDA_R_16BF : CUDA_R_16F; }

// h = gelu_tanh(x w^T + b) and pre = x w^T + b, x [rows, in], w [out, in], all of one 16-bit dtype.
bool gelu_forward(const at::Tensor& x, const at::Tensor& w, const at::Tensor& b, at::Tensor& h, at::Tensor& pre) {
  const int64_t rows = x.size(0), in = x.size(1), out = w.size(0);
  // column-major: h^T [out, rows] = (w as [in, out])^T x^T [in, rows]
  return lt_matmul(CUBLASLT_EPILOGUE_GELU_AUX_BIAS, CUBLAS_OP_T, w.data_ptr(), in, CUBLAS_OP_N, x.data_ptr(), in,
                   h.data_ptr(), out, rows, in, b.data_ptr(), pre.data_ptr(), cuda_type(x.scalar_type()),
                   x.get_device());
}

// dpre = (dy w) * gelu_tanh'(pre), dy [rows, out], w [out, hidden], pre [rows, hidden].
bool gelu_backward(const at::Tensor& dy, const at::Tensor& w, const at::Tensor& pre, at::Tensor& dpre) {
  const int64_t rows = dy.size(0), out = w.size(0), hidden = w.size(1);
  // column-major: dpre^T [hidden, rows] = (w as [hidden, out]) dy^T [out, rows]
  return lt_matmul(CUBLASLT_EPILOGUE_DGELU, CUBLAS_OP_N, w.data_ptr(), hidden, CUBLAS_OP_N, dy.data_ptr(), out,
                   dpre.data_ptr(), hidden, rows, out, nullptr, const_cast<void*>(pre.data_ptr()),
                   cuda_type(dy.scalar_type()), dy.get_device());
}

// The composition it replaces, for the fallback and the check.
void reference_forward(const at::Tensor& x, const at::Tensor& w, const at::Tensor& b, at::Tensor& h, at::Tensor& pre) {
  pre = at::addmm(b, x, w.t());
  h = at::gelu(pre, "tanh");
}
at::Tensor reference_backward(const at::Tensor& dy, const at::Tensor& w, const at::Tensor& pre) {
  return at::gelu_backward(at::mm(dy, w), pre, "tanh");
}

// Whether cuBLASLt's epilogues give what the composition gives on `device` (once per device and type).
bool checked(int device, at::ScalarType type) {
  const auto check = [&]() -> std::string {
    const at::NoGradGuard no_grad;
    const c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device));
    const auto o = at::TensorOptions().device(c10::Device(c10::kCUDA, static_cast<c10::DeviceIndex>(device)));
    // fixed values, not the generator's: a check that drew random numbers would move the run's
    // random stream (dropout) by a different amount in a resumed run than in the original one
    const auto values = [&](int64_t rows, int64_t cols, double frequency, double scale) {
      return at::arange(rows * cols, o.dtype(at::kFloat)).mul(frequency).sin().mul(scale).reshape({rows, cols}).to(type);
    };
    const at::Tensor x = values(96, 64, 0.37, 1.5), w1 = values(256, 64, 0.71, 0.3), b1 = values(1, 256, 1.3, 1.0).view({256}),
                     w2 = values(72, 256, 0.53, 0.15), dy = values(96, 72, 0.29, 1.0);
    at::Tensor h = at::empty({96, 256}, x.options()), pre = at::empty({96, 256}, x.options()),
               dpre = at::empty({96, 256}, x.options()), rh, rpre;
    reference_forward(x, w1, b1, rh, rpre);
    if (!gelu_forward(x, w1, b1, h, pre)) return "a cuBLASLt call failed";
    if (!gelu_backward(dy, w2, rpre, dpre)) return "a cuBLASLt call failed (DGELU)";
    const at::Tensor rdpre = reference_backward(dy, w2, rpre);
    // Whole tensors, not elements: the epilogue's GELU reads the float32 sum where ATen's reads
    // it rounded to bf16, and DGELU multiplies the float32 product, so a fair share of elements
    // differ by an ulp (0.3 % of the norm at these values, in a CPU emulation of the rounding);
    // a wrong layout, bias or derivative, or a scale 10 % off, moves it by 10 % or more. A NaN
    // fails the comparison.
    const auto close = [](const at::Tensor& a, const at::Tensor& b) {
      const at::Tensor af = a.to(at::kFloat), bf = b.to(at::kFloat);
      return af.sub(bf).norm().item<double>() <= 2e-2 * bf.norm().item<double>();
    };
    return close(pre, rpre) && close(h, rh) && close(dpre, rdpre) ? ""
                                                                    : "its results differ from ATen's addmm, gelu and gelu_backward";
  };
  return checked_at_first_use("nn::mlp_gelu_tanh: GELU in cuBLASLt's epilogue",
                              "cuda:" + std::to_string(device) + " for " + c10::toString(type), check,
                              "the MLP runs as addmm, gelu and gelu_backward");
}

class MlpGelu : public torch::autograd::Function<MlpGelu> {
 public:
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x, const at::Tensor& w1,
                            const at::Tensor& b1, const at::Tensor& w2, const at::Tensor& b2) {
    const at::ScalarType dtype = at::autocast::get_autocast_dtype(at::kCUDA);
    const c10::cuda::CUDAGuard guard(x.device());
    const int64_t in = x.size(-1), hidden = w1.size(0), out = w2.size(0);
    const at::Tensor xc = x.to(dtype).reshape({-1, in}).contiguous();
    // contiguous: where a weight already has the autocast type, .to() returns it as it is, and
    // cuBLASLt reads it with the leading dimension of a dense matrix
    const at::Tensor w1c = w1.to(dtype).contiguous(), b1c = b1.to(dtype).contiguous(),
                     w2c = w2.to(dtype).contiguous(), b2c = b2.to(dtype).contiguous();
    at::Tensor h = at::empty({xc.size(0), hidden}, xc.options()), pre = at::empty({xc.size(0), hidden}, xc.options());
    if (xc.size(0) == 0 || !gelu_forward(xc, w1c, b1c, h, pre)) reference_forward(xc, w1c, b1c, h, pre);
    const at::Tensor y = at::addmm(b2c, h, w2c.t());
    ctx->save_for_backward({xc, w1c, pre, h, w2c, w1, b1, w2, b2});
    ctx->saved_data["x_dtype"] = x.scalar_type();
    std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
    shape.back() = out;
    return y.view(shape);
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto s = ctx->get_saved_variables();
    const at::Tensor &xc = s[0], &w1c = s[1], &pre = s[2], &h = s[3], &w2c = s[4];
    const c10::cuda::CUDAGuard guard(xc.device());
    const at::Tensor dy = grads[0].to(w2c.scalar_type()).reshape({-1, w2c.size(0)}).contiguous();
    at::Tensor dw2, db2, dw1, db1, dx;
    if (ctx->needs_input_grad(3)) product_gradient(dy.t(), h, s[7], dw2);
    if (ctx->needs_input_grad(4)) product_gradient(at::ones({1, dy.size(0)}, dy.options()), dy, s[8], db2);
    at::Tensor dpre = at::empty(pre.sizes(), pre.options());
    if (dy.size(0) == 0 || !gelu_backward(dy, w2c, pre, dpre)) dpre = reference_backward(dy, w2c, pre);
    if (ctx->needs_input_grad(1)) product_gradient(dpre.t(), xc, s[5], dw1);
    if (ctx->needs_input_grad(2)) product_gradient(at::ones({1, dpre.size(0)}, dpre.options()), dpre, s[6], db1);
    if (ctx->needs_input_grad(0)) {
      std::vector<int64_t> shape(grads[0].sizes().begin(), grads[0].sizes().end());
      shape.back() = w1c.size(1);
      dx = at::mm(dpre, w1c).view(shape).to(ctx->saved_data["x_dtype"].toScalarType());
    }
    return {dx, dw1, db1, dw2, db2};
  }
};
#endif

}  // namespace

std::string fused_mlp_unavailable(const at::Tensor& x, const at::Tensor& w1, const at::Tensor& b1, const at::Tensor& w2,
                                  const at::Tensor& b2) {
  if (std::string off = rtc::disabled_by_environment("mlp"); !off.empty()) return off;
  if (!x.is_cuda()) return "not a CUDA tensor";
#if LOOM_TORCH_CUDA
  if (!at::autocast::is_autocast_enabled(at::kCUDA)) return "not under autocast (the epilogues run in bf16 or fp16)";
  const at::ScalarType dtype = at::autocast::get_autocast_dtype(at::kCUDA);
  if (dtype != at::kBFloat16 && dtype != at::kHalf) return "autocast's dtype is not bf16 or fp16";
  if (!w1.defined() || !b1.defined() || !w2.defined() || !b2.defined() || w1.dim() != 2 || w2.dim() != 2 ||
      x.dim() < 2 || x.size(-1) != w1.size(1) || w2.size(1) != w1.size(0) || b1.numel() != w1.size(0) ||
      b2.numel() != w2.size(0))
    return "the weights and biases do not fit x -> hidden -> out";
  if (x.size(-1) % 8 != 0 || w1.size(0) % 8 != 0 || w2.size(0) % 8 != 0)
    return "widths that are not multiples of 8";
  if (std::string why = lt().why_not; !why.empty()) return why;
  return checked(x.get_device(), dtype) ? "" : "cuBLASLt's GELU epilogue failed its check on this device";
#else
  return "LibTorch without CUDA";
#endif
}

at::Tensor mlp_gelu_tanh(const at::Tensor& x, const at::Tensor& w1, const at::Tensor& b1, const at::Tensor& w2,
                         const at::Tensor& b2) {
#if LOOM_TORCH_CUDA
  if (at::GradMode::is_enabled() && fused_mlp_unavailable(x, w1, b1, w2, b2).empty())
    return MlpGelu::apply(x, w1, b1, w2, b2);
#endif
  return linear(at::gelu(linear(x, w1, b1), "tanh"), w2, b2);
}

}  // namespace loom::sdk::nn
