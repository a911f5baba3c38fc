// Loom's fused operations, cross_entropy_sum (<loom/sdk/cross_entropy.hpp>) and layer_norm
// (<loom/sdk/layer_norm.hpp>), on CPU, and their CUDA kernels compiled by NVRTC without a GPU. The
// kernels' results on a GPU: tests/gpu/precision_gpu_test.cpp.
#include <loom/sdk/cross_entropy.hpp>
#include <loom/sdk/layer_norm.hpp>
#include <loom/sdk/optimizer.hpp>

#include <ATen/ops/argmax.h>
#include <ATen/ops/cross_entropy_loss.h>
#include <ATen/ops/equal.h>
#include <ATen/ops/full.h>
#include <ATen/ops/layer_norm.h>
#include <ATen/ops/randn.h>
#include <ATen/ops/tensor.h>
#include <ATen/ops/zeros.h>
#include <gtest/gtest.h>
#include <torch/autograd.h>

#include <cstdlib>
#include <string>

namespace {

using loom::sdk::nn::cross_entropy_sum;

TEST(CrossEntropySum, EqualsAtenOnCpuWithIgnoredRowsAndTies) {
  at::manual_seed(3);
  const at::Tensor start = at::randn({6, 11});
  start[4][2] = 9.0;  // a tie for the arg-max: the first index counts, as at::argmax
  start[4][7] = 9.0;
  const at::Tensor target = at::tensor(std::vector<int64_t>{3, -100, 0, 10, 7, 5});
  const at::Tensor a = start.clone().requires_grad_(true);
  const at::Tensor b = start.clone().requires_grad_(true);
  const auto sums = cross_entropy_sum(a, target);
  const at::Tensor expected = at::cross_entropy_loss(b, target, {}, at::Reduction::Sum);
  EXPECT_NEAR(sums.loss_sum.item<double>(), expected.item<double>(), 1e-5);
  EXPECT_EQ(sums.correct.scalar_type(), at::kLong);
  EXPECT_EQ(sums.correct.item<int64_t>(), at::argmax(start, 1).eq(target).sum().item<int64_t>());
  EXPECT_FALSE(sums.correct.requires_grad());
  sums.loss_sum.mul(0.5).backward();
  expected.mul(0.5).backward();
  EXPECT_TRUE(at::allclose(a.grad(), b.grad(), 1e-6, 1e-7));
  EXPECT_EQ(a.grad()[1].abs().sum().item<double>(), 0.0);  // the ignored row
}

TEST(CrossEntropySum, RefusesLogitsThatAreNotRowsOfClasses) {
  const at::Tensor target = at::tensor(std::vector<int64_t>{1, 2});
  try {
    cross_entropy_sum(at::randn({2, 3, 4}), target);
    FAIL() << "3-D logits accepted";
  } catch (const loom::sdk::Error& e) {
    EXPECT_NE(std::string(e.what()).find("logits must be [rows, classes]"), std::string::npos) << e.what();
  }
  EXPECT_THROW(cross_entropy_sum(at::randn({2, 3}), target.to(at::kInt)), loom::sdk::Error);
  try {
    cross_entropy_sum(at::randn({2, 0}), target);
    ADD_FAILURE() << "logits of no classes accepted";
  } catch (const loom::sdk::Error& e) {
    EXPECT_NE(std::string(e.what()).find("logits of no classes ([2, 0])"), std::string::npos) << e.what();
  }
  EXPECT_EQ(loom::sdk::nn::fused_cross_entropy_unavailable(at::randn({2, 3})), "not a CUDA tensor");
  EXPECT_EQ(loom::sdk::nn::fused_cross_entropy_gradient_unavailable(at::randn({2, 3})), "not a CUDA tensor");
}

// LOOM_FUSED_KERNELS names the fused operations to use; a name Loom does not know is an error that
// lists the ones it does, not a silent fallback.
TEST(FusedKernels, LoomFusedKernelsPicksOperationsAndRefusesUnknownNames) {
  const at::Tensor logits = at::randn({2, 3});
  ::setenv("LOOM_FUSED_KERNELS", "layer_norm,linear", 1);
  EXPECT_EQ(loom::sdk::nn::fused_cross_entropy_unavailable(logits), "LOOM_FUSED_KERNELS=layer_norm,linear");
  EXPECT_EQ(loom::sdk::nn::fused_cross_entropy_gradient_unavailable(logits), "LOOM_FUSED_KERNELS=layer_norm,linear");
  ::setenv("LOOM_FUSED_KERNELS", "cross_entropy,layernorm", 1);
  try {
    cross_entropy_sum(logits, at::tensor(std::vector<int64_t>{0, 2}));
    ADD_FAILURE() << "an unknown name accepted";
  } catch (const loom::sdk::Error& e) {
    EXPECT_NE(std::string(e.what()).find("no fused operation 'layernorm' (there are cross_entropy, embedding, layer_norm, linear and mlp"),
              std::string::npos) << e.what();
  }
  ::unsetenv("LOOM_FUSED_KERNELS");
  EXPECT_EQ(loom::sdk::nn::fused_cross_entropy_unavailable(logits), "not a CUDA tensor");
}

// The CUDA source is compiled here by the wheel's own NVRTC, for the GPUs Loom is measured on, so
// that a mistake in it fails CI and not the next (rare) GPU run.
TEST(FusedKernels, CompileWithNvrtcForAmpereAndHopper) {
  for (const auto& [major, minor] : {std::pair{8, 0}, std::pair{9, 0}}) {
    const std::string why = loom::sdk::nn::compile_fused_kernels(major, minor);
    if (why.rfind("libnvrtc not found", 0) == 0) GTEST_SKIP() << why;  // a CPU-only LibTorch
    EXPECT_EQ(why, "") << "cross-entropy, sm_" << major << minor;
    EXPECT_EQ(loom::sdk::nn::compile_layer_norm_kernels(major, minor), "") << "layer norm, sm_" << major << minor;
  }
}

TEST(LayerNorm, EqualsAtenOnCpu) {
  at::manual_seed(5);
  const at::Tensor x = at::randn({3, 5, 12}).requires_grad_(true);
  const at::Tensor weight = at::randn({12}).requires_grad_(true);
  const at::Tensor bias = at::randn({12}).requires_grad_(true);
  const at::Tensor y = loom::sdk::nn::layer_norm(x, weight, bias, 1e-5);
  EXPECT_TRUE(at::allclose(y, at::layer_norm(x, {12}, weight, bias, 1e-5)));
  EXPECT_TRUE(y.requires_grad());
  EXPECT_EQ(loom::sdk::nn::fused_layer_norm_unavailable(x, weight, bias), "not a CUDA tensor");
}

// The residual add in the LayerNorm: on CPU the add, then layer_norm; no branch, no add.
TEST(LayerNorm, AddLayerNormIsTheSumAndItsLayerNormOnCpu) {
  at::manual_seed(6);
  const at::Tensor x = at::randn({3, 5, 12}), branch = at::randn({3, 5, 12});
  const at::Tensor weight = at::randn({12}), bias = at::randn({12});
  const auto [sum, y] = loom::sdk::nn::add_layer_norm(x, branch, weight, bias, 1e-5);
  EXPECT_TRUE(at::equal(sum, x + branch));
  EXPECT_TRUE(at::allclose(y, at::layer_norm(x + branch, {12}, weight, bias, 1e-5)));
  const auto [same, normalized] = loom::sdk::nn::add_layer_norm(x, at::Tensor(), weight, bias, 1e-5);
  EXPECT_TRUE(same.is_same(x));
  EXPECT_TRUE(at::allclose(normalized, at::layer_norm(x, {12}, weight, bias, 1e-5)));
  EXPECT_EQ(loom::sdk::nn::fused_add_layer_norm_unavailable(x, branch, weight, bias), "not a CUDA tensor");
}

}  // namespace

namespace {

/// An optimizer as the docs describe the least one: step() only (plain SGD on the gradients).
class StepOnly final : public loom::sdk::Optimizer {
 public:
  void setup(const std::vector<loom::sdk::ParameterGroup>& groups) override { groups_ = groups; }
  void materialize() override {}
  void step(double lr) override {
    for (auto& g : groups_)
      for (auto& p : g.params) p.sub_(p.grad() * lr);
  }
  int64_t state_bytes(const at::Tensor&) const override { return 0; }
  loom::sdk::State state_dict() const override { return {}; }
  void load_state_dict(const loom::sdk::State&) override {}

 private:
  std::vector<loom::sdk::ParameterGroup> groups_;
};

}  // namespace

TEST(OptimizerDefaults, StepOnDeviceDividingDividesByTheHostsDivisorOfShapeOne) {
  // The host hands the divisor as a float tensor of shape [1]: the default once threw "scalar
  // tensor expected to be 0 dim" at the first step of any optimizer that implements step() only.
  at::Tensor p = at::tensor({1.0f, 2.0f});
  p.mutable_grad() = at::tensor({4.0f, 8.0f});
  StepOnly optimizer;
  loom::sdk::ParameterGroup group;
  group.params = {p};
  optimizer.setup({group});
  optimizer.step_on_device_dividing(at::tensor(0.5), at::zeros({1}), at::full({1}, 4.0f), {p.grad()});
  EXPECT_TRUE(at::equal(p.grad(), at::tensor({1.0f, 2.0f})));
  EXPECT_TRUE(at::equal(p, at::tensor({0.5f, 1.0f})));  // 1 - 0.5 x 1, 2 - 0.5 x 2
}
