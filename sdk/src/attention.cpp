// nn::attention: see <loom/sdk/nn.hpp> and Note [cuDNN's attention on Hopper] below.
#include <loom/sdk/log.hpp>
#include <loom/sdk/nn.hpp>

#include "rtc.hpp"

#include <ATen/core/grad_mode.h>
#include <ATen/ops/scaled_dot_product_attention.h>
#if LOOM_TORCH_CUDA
#include "first_use_check.hpp"

#include <ATen/cuda/CUDAContextLight.h>
#include <ATen/native/transformers/cuda/sdp_utils.h>
#include <ATen/ops/_scaled_dot_product_cudnn_attention.h>
#include <ATen/ops/arange.h>
#include <ATen/ops/empty_strided.h>
#include <c10/core/InferenceMode.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/csrc/autograd/autograd.h>

#include <mutex>
#include <set>
#endif

#include <sstream>
#include <tuple>
#include <utility>

namespace loom::sdk::nn {

// Note [cuDNN's attention on Hopper]
// at::scaled_dot_product_attention takes the first backend of its priority order that accepts the
// inputs, and the order LibTorch 2.11 to 2.15 ship (ATen/Context.h) puts FlashAttention-2 first
// and cuDNN's fused attention last. FlashAttention-2 was written for the A100; on Hopper its
// kernels do not use the tensor cores' asynchronous path (TMA, warpgroup MMA), and for GPT-2 124M
// on an H200 its forward and backward took 2.3 ms of a 17.4 ms step (docs/gpu.md, "The seventh
// run"). cuDNN 9 has attention kernels for Hopper of its own; llm.c trains GPT-2 with them (the
// 38 % MFU on an H100 the GPU issue measures Loom against), and PyTorch 2.5 briefly made them its
// first choice on the H100. Here, on compute capability 9.0 and later, bf16 or fp16 inputs and no
// dropout, nn::attention calls cuDNN's attention directly where PyTorch's own checks accept it
// for these inputs (sdp::can_use_cudnn_attention: cuDNN's version, head sizes, layouts, the
// user's setCuDNNSDP switch), and SDPA's choice everywhere else. ATen's op carries its autograd
// formula (the backward is cuDNN's too) and its cuDNN graphs are built once per shape and layout.
// At first use for each shape, layout and dtype, a check runs both on fixed inputs laid out as
// the real ones and compares the output and the three gradients with SDPA's (relative norm of the
// difference within 1e-2: two bf16 kernels that accumulate in float32 agree to a few 1e-3; a lost
// causal mask or scale is off by 10 % or more); a cuDNN that fails or disagrees turns the path
// off with a warning, and SDPA serves. LOOM_FUSED_KERNELS without "attention" turns it off.
// Inputs whose shapes change from batch to batch would pay a cuDNN graph and a check for each:
// past kMaxShapes shapes in a process, new ones go to SDPA (one line in the log says so).

namespace {

#if LOOM_TORCH_CUDA
constexpr size_t kMaxShapes = 16;

std::string shape_key(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, bool causal) {
  std::ostringstream key;
  key << "cuda:" << static_cast<int>(q.get_device()) << " for " << c10::toString(q.scalar_type()) << " q" << q.sizes()
      << q.strides() << " k" << k.sizes() << k.strides() << " v" << v.sizes() << v.strides()
      << (causal ? " causal" : "");
  return key.str();
}

at::Tensor cudnn_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, bool causal) {
  const bool lse = at::GradMode::is_enabled() && (q.requires_grad() || k.requires_grad() || v.requires_grad());
  return std::get<0>(at::_scaled_dot_product_cudnn_attention(q, k, v, /*attn_bias=*/std::nullopt, lse, /*dropout_p=*/0.0,
                                                             causal, /*return_debug_mask=*/false));
}

// The first-use check: cuDNN's attention and SDPA's on fixed values in tensors of the real ones'
// sizes and strides (cuDNN builds a graph per layout), forward and backward.
bool checked(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, bool causal, const std::string& key) {
  const auto check = [&]() -> std::string {
    const c10::InferenceMode normal_tensors(false);  // the check takes gradients, also from a caller in inference mode
    const at::AutoGradMode grad(true);
    const c10::cuda::CUDAGuard guard(q.device());
    // fixed values, not the generator's (a check that drew random numbers would move the run's
    // random stream by a different amount in a resumed run than in the original one)
    const auto values = [](const at::Tensor& like, double frequency) {
      const at::Tensor out = at::empty_strided(like.sizes(), like.strides(), like.options());
      out.copy_(at::arange(like.numel(), like.options().dtype(at::kFloat)).mul(frequency).sin().view(like.sizes()));
      return out;
    };
    const at::Tensor q0 = values(q, 0.37), k0 = values(k, 0.71), v0 = values(v, 0.53);
    std::vector<at::Tensor> results[2];
    for (const bool cudnn : {true, false}) {
      const at::Tensor qi = q0.detach().requires_grad_(true), ki = k0.detach().requires_grad_(true),
                       vi = v0.detach().requires_grad_(true);
      const at::Tensor out = cudnn ? cudnn_attention(qi, ki, vi, causal)
                                   : at::scaled_dot_product_attention(qi, ki, vi, {}, 0.0, causal);
      const at::Tensor dout = at::arange(out.numel(), out.options().dtype(at::kFloat)).mul(0.29).cos().view(out.sizes());
      auto grads = torch::autograd::grad({out}, {qi, ki, vi}, {dout.to(out.scalar_type())});
      results[cudnn ? 0 : 1] = {out.detach(), grads[0], grads[1], grads[2]};
    }
    const char* names[] = {"output", "dq", "dk", "dv"};
    for (size_t i = 0; i < 4; ++i) {
      const at::Tensor a = results[0][i].to(at::kFloat), b = results[1][i].to(at::kFloat);
      const double relative = a.sub(b).norm().item<double>() / b.norm().item<double>();
      if (!(relative <= 1e-2))  // a NaN fails too
        return std::string("its ") + names[i] + " differs from SDPA's by " + std::to_string(relative) + " of its norm";
    }
    log::info("nn::attention: cuDNN's fused attention on ", key);
    return "";
  };
  return checked_at_first_use("nn::attention: cuDNN's fused attention", key, check,
                              "attention runs as at::scaled_dot_product_attention chooses");
}
#endif

}  // namespace

std::string fused_attention_unavailable(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, double dropout,
                                        bool is_causal) {
  if (std::string off = rtc::disabled_by_environment("attention"); !off.empty()) return off;
  if (!q.is_cuda()) return "not a CUDA tensor";
#if LOOM_TORCH_CUDA
  if (q.scalar_type() != at::kBFloat16 && q.scalar_type() != at::kHalf) return "not bf16 or fp16";
  if (k.scalar_type() != q.scalar_type() || v.scalar_type() != q.scalar_type()) return "q, k and v differ in dtype";
  if (dropout > 0.0) return "dropout (SDPA's flash kernel has it)";
  if (q.dim() != 4 || k.dim() != 4 || v.dim() != 4) return "not [batch, heads, tokens, head size]";
  if (at::cuda::getDeviceProperties(q.get_device())->major < 9)
    return "a GPU before Hopper (there FlashAttention-2, SDPA's first choice, is as fast)";
  if (!sdp::can_use_cudnn_attention(sdp::sdp_params{q, k, v, std::nullopt, 0.0, is_causal, false}, /*debug=*/false))
    return "PyTorch's checks refuse cuDNN's attention for these inputs (sdp::can_use_cudnn_attention)";
  const std::string key = shape_key(q, k, v, is_causal);
  {
    static std::mutex mutex;
    static std::set<std::string> shapes;
    const std::lock_guard<std::mutex> lock(mutex);
    if (!shapes.count(key)) {
      if (shapes.size() >= kMaxShapes) {
        static bool told = false;
        if (!std::exchange(told, true))
          log::info("nn::attention: inputs in more than ", kMaxShapes, " shapes; new ones go to SDPA (cuDNN builds a "
                    "graph per shape)");
        return "more than " + std::to_string(kMaxShapes) + " shapes of inputs (cuDNN builds a graph per shape)";
      }
      shapes.insert(key);
    }
  }
  return checked(q, k, v, is_causal, key) ? "" : "cuDNN's attention failed its check on this device";
#else
  (void)k, (void)v, (void)dropout, (void)is_causal;
  return "LibTorch without CUDA";
#endif
}

at::Tensor attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, double dropout, bool is_causal) {
#if LOOM_TORCH_CUDA
  if (q.is_cuda() && fused_attention_unavailable(q, k, v, dropout, is_causal).empty())
    return cudnn_attention(q, k, v, is_causal);
#endif
  return at::scaled_dot_product_attention(q, k, v, /*attn_mask=*/{}, dropout, is_causal);
}

}  // namespace loom::sdk::nn
