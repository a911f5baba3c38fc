// Precision plugins on a CUDA device: autocast dtypes, TF32 switches, and a short training run
// per plugin; Loom's fused cross-entropy, LayerNorm and linear against ATen. Label `gpu`; skipped where no CUDA device is visible.
#include <loom/core/config.hpp>
#include <loom/core/plugin_registry.hpp>
#include <loom/core/trainer.hpp>
#include <loom/sdk/cross_entropy.hpp>
#include <loom/sdk/layer_norm.hpp>
#include <loom/sdk/nn.hpp>

#include "trainer_testing.hpp"

#include <ATen/Context.h>
#include <ATen/autocast_mode.h>
#include <ATen/ops/allclose.h>
#include <ATen/ops/argmax.h>
#include <ATen/ops/cross_entropy_loss.h>
#include <ATen/ops/embedding.h>
#include <ATen/ops/equal.h>
#include <ATen/ops/gelu.h>
#include <ATen/ops/layer_norm.h>
#include <ATen/ops/linear.h>
#include <ATen/ops/randint.h>
#include <ATen/ops/randn.h>
#include <ATen/ops/zeros.h>
#include <gtest/gtest.h>
#include <torch/cuda.h>

#include <cmath>
#include <filesystem>

namespace fs = std::filesystem;
using namespace loom::core;

namespace {

using loom::testing::registry;

TEST(PrecisionGpu, AutocastDtypesOnCuda) {
  LOOM_REQUIRE_CUDA();
  const c10::Device cuda(c10::kCUDA, 0);
  const at::Tensor x = at::randn({64, 64}, at::TensorOptions().device(cuda));
  for (const auto& [name, dtype] : std::vector<std::pair<std::string, at::ScalarType>>{
           {"fp16_amp", at::kHalf}, {"bf16_amp", at::kBFloat16}, {"fp32", at::kFloat}, {"tf32", at::kFloat}}) {
    auto p = registry().create<loom::sdk::PrecisionStrategy>(name);
    try {
      p->setup(cuda);
    } catch (const loom::Error& e) {
      ASSERT_EQ(name, "bf16_amp") << e.what();  // an older GPU without bfloat16
      continue;
    }
    auto guard = p->forward_guard();
    EXPECT_EQ(at::linear(x, x).scalar_type(), dtype) << name;
  }
}

TEST(PrecisionGpu, Tf32SwitchesFollowThePlugin) {
  LOOM_REQUIRE_CUDA();
  const c10::Device cuda(c10::kCUDA, 0);
  registry().create<loom::sdk::PrecisionStrategy>("tf32")->setup(cuda);
  EXPECT_TRUE(at::globalContext().allowTF32CuBLAS());
  EXPECT_TRUE(at::globalContext().allowTF32CuDNN());
  registry().create<loom::sdk::PrecisionStrategy>("fp32")->setup(cuda);
  EXPECT_FALSE(at::globalContext().allowTF32CuBLAS());
  EXPECT_FALSE(at::globalContext().allowTF32CuDNN());
  registry().create<loom::sdk::PrecisionStrategy>("fp16_amp", {{"tf32", "true"}})->setup(cuda);
  EXPECT_TRUE(at::globalContext().allowTF32CuBLAS());
}

TEST(PrecisionGpu, EveryPrecisionTrainsOnCuda) {
  LOOM_REQUIRE_CUDA();
  const fs::path dir = fs::temp_directory_path() / ("loom_precision_gpu_" + std::to_string(::getpid()));
  for (const std::string name : {"fp32", "tf32", "fp16_amp", "bf16_amp"}) {
    Config c;
    for (const auto& kv : {"model.name=lightweight_transformer", "model.flavour=debug", "data.name=synthetic",
                           "data.train_size=2048", "trainer.batch_size=64", "trainer.max_steps=60",
                           "trainer.device=cuda", "trainer.lr=0.003"})
      c.set_assignment(kv);
    c.set_assignment("precision.name=" + name);
    c.set_assignment("trainer.work_dir=" + dir.string());
    c.set_assignment("trainer.name=" + name);
    std::unique_ptr<Trainer> t;
    try {
      t = loom::testing::make_trainer(c);
    } catch (const loom::Error& e) {
      ASSERT_EQ(name, "bf16_amp") << e.what();
      continue;
    }
    double first = 0, last = 0;
    for (int i = 0; i < 60; ++i) {
      const double loss = t->train_step().loss;
      if (i < 5) first += loss / 5;
      if (i >= 55) last += loss / 5;
    }
    EXPECT_LT(last, 0.8 * first) << name;
  }
  fs::remove_all(dir);
}

// Loom's fused cross-entropy kernel (<loom/sdk/cross_entropy.hpp>) against ATen's operators, in the
// three dtypes, at GPT-2's padded vocabulary (whole 16-byte vectors), a width of whole vectors and
// one of single values; with a tied arg-max, an ignored row, and an upstream gradient of 0.5.
// Both paths of the fused cross-entropy (Note [The gradient in the forward], cross_entropy.cpp): bf16
// at 50304 and 1000 classes and float32 at 1000 write the gradient in the forward, float32 at 50304
// (wider than the registers hold), 997 classes (not whole vectors) and fp16 take a kernel each
// way; the loss's gradient 1 (the step's) and 0.3 (scaled in place on the first path, rounded twice).
TEST(PrecisionGpu, FusedCrossEntropyMatchesAten) {
  LOOM_REQUIRE_CUDA();
  const c10::Device cuda(c10::kCUDA, 0);
  for (const at::ScalarType dtype : {at::kFloat, at::kBFloat16, at::kHalf}) {
    for (const int64_t width : {50304, 1000, 997}) {
      for (const double g : {1.0, 0.3}) {
        SCOPED_TRACE(std::string(c10::toString(dtype)) + ", " + std::to_string(width) + " classes, loss gradient " +
                     std::to_string(g));
        at::manual_seed(width);
        at::Tensor start = at::randn({64, width}, at::TensorOptions().device(cuda)).mul(3).to(dtype);
        start[0][5] = 20.0;  // a tie: at::argmax takes the first
        start[0][9] = 20.0;
        at::Tensor target = at::randint(width, {64}, at::TensorOptions().device(cuda).dtype(at::kLong));
        target[0] = 9;
        target[1] = at::argmax(start[1], 0);
        target[2] = -100;
        ASSERT_EQ(loom::sdk::nn::fused_cross_entropy_unavailable(start), "");
        const bool in_forward = dtype != at::kHalf && width != 997 && !(dtype == at::kFloat && width == 50304);
        EXPECT_EQ(loom::sdk::nn::fused_cross_entropy_gradient_unavailable(start).empty(), in_forward)
            << loom::sdk::nn::fused_cross_entropy_gradient_unavailable(start);
        const at::Tensor a = start.clone().requires_grad_(true);
        const at::Tensor b = start.clone().requires_grad_(true);
        const auto fused = loom::sdk::nn::cross_entropy_sum(a, target);
        const at::Tensor expected = at::cross_entropy_loss(b.to(at::kFloat), target, {}, at::Reduction::Sum);
        const double want = expected.item<double>();
        EXPECT_NEAR(fused.loss_sum.item<double>(), want, 2e-6 * std::abs(want));
        EXPECT_EQ(fused.correct.item<int64_t>(), at::argmax(start, 1).eq(target).sum().item<int64_t>());
        fused.loss_sum.mul(g).backward();
        expected.mul(g).backward();
        ASSERT_EQ(a.grad().scalar_type(), dtype);
        const double tolerance = dtype == at::kFloat ? 1e-6 : dtype == at::kHalf ? 5e-4 : 4e-3;
        EXPECT_LE(a.grad().to(at::kFloat).sub(b.grad().to(at::kFloat)).abs().max().item<double>(), tolerance);
        EXPECT_EQ(a.grad()[2].abs().sum().item<double>(), 0.0);  // the ignored row
      }
    }
  }
  // Where the forward wrote the gradient, a second backward through it would scale it twice.
  const at::Tensor logits = at::randn({4, 1000}, at::TensorOptions().device(cuda)).to(at::kBFloat16).requires_grad_(true);
  const auto sums = loom::sdk::nn::cross_entropy_sum(logits, at::zeros({4}, at::TensorOptions().device(cuda).dtype(at::kLong)));
  sums.loss_sum.mul(2.0).backward({}, /*retain_graph=*/true);
  try {
    sums.loss_sum.mul(2.0).backward();
    ADD_FAILURE() << "a second backward through the fused cross-entropy went through";
  } catch (const std::exception& e) {
    EXPECT_NE(std::string(e.what()).find("a second backward through the same forward"), std::string::npos) << e.what();
  }
}

// Loom's LayerNorm kernels (<loom/sdk/layer_norm.hpp>) against at::layer_norm: float32 in and out;
// float32 in, bf16 out under autocast (the output in the dtype the next product takes); bf16 in
// and out. Widths of whole vectors (768), with a part-filled last vector per lane (1600), and
// small (64); gradients of x, weight and bias for an upstream gradient in the output's dtype.
TEST(PrecisionGpu, FusedLayerNormMatchesAten) {
  LOOM_REQUIRE_CUDA();
  const c10::Device cuda(c10::kCUDA, 0);
  struct Case {
    at::ScalarType in;
    bool autocast;
    at::ScalarType out;
  };
  for (const Case c : {Case{at::kFloat, false, at::kFloat}, Case{at::kFloat, true, at::kBFloat16},
                       Case{at::kBFloat16, false, at::kBFloat16}}) {
    for (const int64_t width : {768, 1600, 64}) {
      SCOPED_TRACE(std::string(c10::toString(c.in)) + " -> " + c10::toString(c.out) + ", width " + std::to_string(width));
      at::manual_seed(width);
      const auto f32 = at::TensorOptions().device(cuda);
      const at::Tensor x0 = at::randn({4, 37, width}, f32).mul(2).add(0.5).to(c.in);
      const at::Tensor w0 = at::randn({width}, f32), b0 = at::randn({width}, f32);
      const at::Tensor dy = at::randn({4, 37, width}, f32).to(c.out);
      ASSERT_EQ(loom::sdk::nn::fused_layer_norm_unavailable(x0, w0, b0), "");
      const at::Tensor x = x0.clone().requires_grad_(true), w = w0.clone().requires_grad_(true),
                       b = b0.clone().requires_grad_(true);
      at::autocast::set_autocast_dtype(at::kCUDA, at::kBFloat16);
      at::autocast::set_autocast_enabled(at::kCUDA, c.autocast);
      const at::Tensor y = loom::sdk::nn::layer_norm(x, w, b, 1e-5);
      at::autocast::set_autocast_enabled(at::kCUDA, false);
      ASSERT_EQ(y.scalar_type(), c.out);
      y.backward(dy);
      const at::Tensor rx = x0.to(at::kFloat).requires_grad_(true), rw = w0.clone().requires_grad_(true),
                       rb = b0.clone().requires_grad_(true);
      const at::Tensor ry = at::layer_norm(rx, {width}, rw, rb, 1e-5);
      ry.backward(dy.to(at::kFloat));
      const bool half = c.out != at::kFloat || c.in != at::kFloat;
      const double rtol = half ? 2e-2 : 1e-4, atol = half ? 2e-2 : 1e-4;
      EXPECT_TRUE(at::allclose(y.to(at::kFloat), ry.to(c.out).to(at::kFloat), rtol, atol)) << "output";
      EXPECT_TRUE(at::allclose(x.grad().to(at::kFloat), rx.grad().to(c.in).to(at::kFloat), rtol, atol)) << "dx";
      // summed over 148 rows: relative to the sum's size
      EXPECT_TRUE(at::allclose(w.grad(), rw.grad(), rtol, atol * 10)) << "dweight";
      EXPECT_TRUE(at::allclose(b.grad(), rb.grad(), rtol, atol * 10)) << "dbias";
    }
  }
}

// nn::add_layer_norm (Note [The residual add in the LayerNorm]) against x + branch and
// at::layer_norm in float32: the float32 stream with a float32 branch, and with a bf16 branch
// under bf16 autocast (GPT-2's case); the sum used further on (its gradient joins dx) and unused
// (the model's last LayerNorm). The sum is exactly x + branch; the branch's gradient comes in its
// dtype.
TEST(PrecisionGpu, FusedAddLayerNormMatchesTheAddThenLayerNorm) {
  LOOM_REQUIRE_CUDA();
  const c10::Device cuda(c10::kCUDA, 0);
  for (const bool autocast : {false, true}) {
    for (const bool sum_used : {true, false}) {
      for (const int64_t width : {768, 1600, 64}) {
        SCOPED_TRACE(std::string(autocast ? "bf16 branch" : "float32 branch") + (sum_used ? ", sum used" : ", sum unused") +
                     ", width " + std::to_string(width));
        at::manual_seed(width);
        const auto f32 = at::TensorOptions().device(cuda);
        const at::ScalarType out = autocast ? at::kBFloat16 : at::kFloat;
        const at::Tensor x0 = at::randn({4, 37, width}, f32).mul(2).add(0.5);
        const at::Tensor r0 = at::randn({4, 37, width}, f32).to(out);
        const at::Tensor w0 = at::randn({width}, f32), b0 = at::randn({width}, f32);
        const at::Tensor dy = at::randn({4, 37, width}, f32).to(out), ds = at::randn({4, 37, width}, f32);
        at::autocast::set_autocast_dtype(at::kCUDA, at::kBFloat16);
        at::autocast::set_autocast_enabled(at::kCUDA, autocast);
        ASSERT_EQ(loom::sdk::nn::fused_add_layer_norm_unavailable(x0, r0, w0, b0), "");
        const at::Tensor x = x0.clone().requires_grad_(true), r = r0.clone().requires_grad_(true),
                         w = w0.clone().requires_grad_(true), b = b0.clone().requires_grad_(true);
        const auto [sum, y] = loom::sdk::nn::add_layer_norm(x, r, w, b, 1e-5);
        at::autocast::set_autocast_enabled(at::kCUDA, false);
        ASSERT_EQ(y.scalar_type(), out);
        ASSERT_EQ(sum.scalar_type(), at::kFloat);
        EXPECT_TRUE(at::equal(sum, x0 + r0)) << "the sum";
        at::Tensor loss = y.to(at::kFloat).mul(dy.to(at::kFloat)).sum();
        if (sum_used) loss = loss + sum.mul(ds).sum();
        loss.backward();
        const at::Tensor rx = x0.clone().requires_grad_(true), rr = r0.to(at::kFloat).requires_grad_(true),
                         rw = w0.clone().requires_grad_(true), rb = b0.clone().requires_grad_(true);
        const at::Tensor rsum = rx + rr;
        const at::Tensor ry = at::layer_norm(rsum, {width}, rw, rb, 1e-5);
        at::Tensor rloss = ry.mul(dy.to(at::kFloat)).sum();
        if (sum_used) rloss = rloss + rsum.mul(ds).sum();
        rloss.backward();
        const double rtol = autocast ? 2e-2 : 1e-4, atol = autocast ? 2e-2 : 1e-4;
        EXPECT_TRUE(at::allclose(y.to(at::kFloat), ry.to(out).to(at::kFloat), rtol, atol)) << "output";
        EXPECT_TRUE(at::allclose(x.grad(), rx.grad(), rtol, atol)) << "dx";
        ASSERT_EQ(r.grad().scalar_type(), out);
        EXPECT_TRUE(at::allclose(r.grad().to(at::kFloat), rr.grad().to(out).to(at::kFloat), rtol, atol)) << "dbranch";
        EXPECT_TRUE(at::allclose(w.grad(), rw.grad(), rtol, atol * 10)) << "dweight";
        EXPECT_TRUE(at::allclose(b.grad(), rb.grad(), rtol, atol * 10)) << "dbias";
      }
    }
  }
}

// loom::sdk::nn::linear on CUDA (Note [A linear layer's gradients in float32]) against at::linear:
// in float32 and under bf16 autocast, with and without a bias; the output and the gradients of
// x, weight and bias (float32 parameters get float32 gradients, as under ATen's autocast), after
// two backward passes: the first returns the parameters' gradients, the second adds into them.
TEST(PrecisionGpu, LinearMatchesAten) {
  LOOM_REQUIRE_CUDA();
  const auto f32 = at::TensorOptions().device(c10::Device(c10::kCUDA, 0));
  for (const bool autocast : {false, true}) {
    for (const bool with_bias : {true, false}) {
      SCOPED_TRACE(std::string(autocast ? "bf16 autocast" : "float32") + (with_bias ? ", bias" : ", no bias"));
      at::manual_seed(11);
      const at::Tensor x0 = at::randn({4, 37, 96}, f32), w0 = at::randn({80, 96}, f32).mul(0.1),
                       b0 = at::randn({80}, f32);
      const at::Tensor dy = at::randn({4, 37, 80}, f32);
      std::vector<at::Tensor> got, want;
      for (const bool loom : {true, false}) {
        const at::Tensor x = x0.clone().requires_grad_(true), w = w0.clone().requires_grad_(true),
                         b = with_bias ? b0.clone().requires_grad_(true) : at::Tensor();
        at::Tensor y;
        for (int round = 0; round < 2; ++round) {  // the second adds into the gradients the first made
          at::autocast::set_autocast_dtype(at::kCUDA, at::kBFloat16);
          at::autocast::set_autocast_enabled(at::kCUDA, autocast);
          y = loom ? loom::sdk::nn::linear(x, w, b) : at::linear(x, w, b);
          at::autocast::set_autocast_enabled(at::kCUDA, false);
          at::autocast::clear_cache();
          ASSERT_EQ(y.scalar_type(), autocast ? at::kBFloat16 : at::kFloat);
          y.backward(dy.to(y.scalar_type()));
        }
        ASSERT_EQ(w.grad().scalar_type(), at::kFloat);
        auto& out = loom ? got : want;
        out = {y.to(at::kFloat), x.grad(), w.grad()};
        if (with_bias) out.push_back(b.grad());
      }
      const double tolerance = autocast ? 3e-2 : 1e-4;
      const char* names[] = {"output", "dx", "dweight", "dbias"};
      for (size_t i = 0; i < got.size(); ++i)
        EXPECT_TRUE(at::allclose(got[i], want[i], tolerance, tolerance))
            << names[i] << ": largest difference " << got[i].sub(want[i]).abs().max().item<double>();
    }
  }
}

// nn::mlp_gelu_tanh on CUDA (Note [GELU in the product's epilogue]) against the composition it
// replaces (nn::linear, at::gelu tanh, nn::linear) under bf16 autocast: the output and the
// gradients of x and of both layers' weights and biases, over two backward passes (the second
// adding into the float32 gradients). The epilogues must be on for the card (the check at first
// use passed), or the test says why not.
TEST(PrecisionGpu, MlpGeluMatchesTheComposition) {
  LOOM_REQUIRE_CUDA();
  const auto f32 = at::TensorOptions().device(c10::Device(c10::kCUDA, 0));
  at::manual_seed(13);
  const at::Tensor x0 = at::randn({4, 37, 96}, f32).to(at::kBFloat16), w10 = at::randn({384, 96}, f32).mul(0.1),
                   b10 = at::randn({384}, f32).mul(0.1), w20 = at::randn({96, 384}, f32).mul(0.05),
                   b20 = at::randn({96}, f32).mul(0.1);
  const at::Tensor dy = at::randn({4, 37, 96}, f32).to(at::kBFloat16);
  const at::ScalarType autocast_dtype = at::autocast::get_autocast_dtype(at::kCUDA);  // restored at the end
  at::autocast::set_autocast_dtype(at::kCUDA, at::kBFloat16);
  at::autocast::set_autocast_enabled(at::kCUDA, true);
  EXPECT_EQ(loom::sdk::nn::fused_mlp_unavailable(x0, w10, b10, w20, b20), "");
  at::autocast::set_autocast_enabled(at::kCUDA, false);
  std::vector<std::vector<at::Tensor>> results;
  for (const bool fused : {true, false}) {
    const at::Tensor x = x0.clone().requires_grad_(true), w1 = w10.clone().requires_grad_(true),
                     b1 = b10.clone().requires_grad_(true), w2 = w20.clone().requires_grad_(true),
                     b2 = b20.clone().requires_grad_(true);
    at::Tensor y;
    for (int round = 0; round < 2; ++round) {
      at::autocast::set_autocast_enabled(at::kCUDA, true);
      y = fused ? loom::sdk::nn::mlp_gelu_tanh(x, w1, b1, w2, b2)
                : loom::sdk::nn::linear(at::gelu(loom::sdk::nn::linear(x, w1, b1), "tanh"), w2, b2);
      at::autocast::set_autocast_enabled(at::kCUDA, false);
      at::autocast::clear_cache();
      ASSERT_EQ(y.scalar_type(), at::kBFloat16);
      y.backward(dy);
    }
    ASSERT_EQ(w1.grad().scalar_type(), at::kFloat);
    results.push_back({y.to(at::kFloat), x.grad().to(at::kFloat), w1.grad(), b1.grad(), w2.grad(), b2.grad()});
  }
  // Whole tensors, not elements: the epilogue computes the GELU from the float32 sum and DGELU
  // from the float32 product where the composition rounds both to bf16 first, so about a quarter
  // of h's elements differ by an ulp, and the weight gradients, sums over 148 rows, differ by up
  // to 0.25 in places; over the whole tensor that is 0.25-0.4 % (a CPU emulation of the rounding,
  // three seeds). A wrong layout, bias or derivative is off by 10 % or more.
  const char* names[] = {"output", "dx", "dw1", "db1", "dw2", "db2"};
  for (size_t i = 0; i < results[0].size(); ++i) {
    const double relative = results[0][i].sub(results[1][i]).norm().item<double>() / results[1][i].norm().item<double>();
    EXPECT_LE(relative, 1e-2) << names[i] << ": |fused - composition| / |composition| = " << relative
                              << ", largest difference " << results[0][i].sub(results[1][i]).abs().max().item<double>();
  }
  at::autocast::set_autocast_dtype(at::kCUDA, autocast_dtype);
}

// nn::embedding on CUDA (Note [An embedding's gradient into the buffer]) against at::embedding:
// repeated indices, two backward passes (the first where the weight has no gradient yet: the
// dense gradient returned; the second adding into it), the weight also used by a product as
// GPT-2's tied head uses it.
TEST(PrecisionGpu, EmbeddingMatchesAten) {
  LOOM_REQUIRE_CUDA();
  const auto f32 = at::TensorOptions().device(c10::Device(c10::kCUDA, 0));
  at::manual_seed(12);
  const at::Tensor w0 = at::randn({97, 24}, f32);
  const at::Tensor indices = at::randint(97, {5, 33}, f32.dtype(at::kLong));
  indices[0][0] = 3;  // repeated rows add up
  indices[1][7] = 3;
  const at::Tensor dy = at::randn({5, 33, 24}, f32), dz = at::randn({5, 33, 97}, f32);
  std::vector<at::Tensor> grads;
  for (const bool loom : {true, false}) {
    const at::Tensor w = w0.clone().requires_grad_(true);
    for (int round = 0; round < 2; ++round) {
      const at::Tensor e = loom ? loom::sdk::nn::embedding(w, indices) : at::embedding(w, indices);
      ASSERT_TRUE(at::equal(e.detach(), at::embedding(w0, indices)));
      const at::Tensor logits = at::linear(e, w);  // the tied head
      (e.mul(dy).sum() + logits.mul(dz).sum()).backward();
    }
    grads.push_back(w.grad().clone());
  }
  EXPECT_TRUE(at::allclose(grads[0], grads[1], 1e-5, 1e-5))
      << "largest difference " << grads[0].sub(grads[1]).abs().max().item<double>();
}

}  // namespace
