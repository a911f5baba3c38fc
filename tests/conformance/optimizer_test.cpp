// Conformance of every optimizer and every learning-rate schedule plugin that is loaded, against
// what the host relies on: an optimizer's state round-trips through state_dict and the run then
// continues bit for bit, it refuses another optimizer's state, its state_bytes match the state it
// keeps, it leaves parameters without a gradient alone and honours a group's lr_scale; a
// schedule's factor is finite and >= 0 at every step. Reference values for the built-ins.
#include <loom/core/plugin_registry.hpp>
#include <loom/sdk/optimizer.hpp>

#include "trainer_testing.hpp"

#include <ATen/core/grad_mode.h>
#include <ATen/ops/arange.h>
#include <ATen/ops/allclose.h>
#include <ATen/ops/equal.h>
#include <ATen/ops/full.h>
#include <gtest/gtest.h>

#include <cmath>
#include <map>

namespace {

using loom::testing::registry;

std::vector<std::string> names_of(uint32_t kind) {
  std::vector<std::string> names;
  for (const auto& c : registry().components())
    if (c.kind == kind) names.push_back(c.name);
  return names;
}

at::Tensor parameter(double offset = 0) {
  return (at::arange(6, at::TensorOptions().dtype(at::kFloat)).reshape({2, 3}) + offset).set_requires_grad(true);
}

loom::sdk::ParameterGroup group(const std::string& name, std::vector<at::Tensor> params, double lr_scale = 1.0) {
  loom::sdk::ParameterGroup g;
  g.name = name;
  for (size_t i = 0; i < params.size(); ++i) g.names.push_back(name + "." + std::to_string(i));
  g.params = std::move(params);
  g.lr_scale = lr_scale;
  return g;
}

void step(loom::sdk::Optimizer& o, std::vector<at::Tensor> params, double lr) {
  for (auto& p : params) p.mutable_grad() = p.detach().sin();
  o.step(lr);
}

class OptimizerConformance : public testing::TestWithParam<std::string> {
 protected:
  std::shared_ptr<loom::sdk::Optimizer> make() const { return registry().create<loom::sdk::Optimizer>(GetParam()); }
};

TEST_P(OptimizerConformance, StateRoundTripsAndTheRunContinuesIdentically) {
  at::Tensor p1 = parameter(), p2 = parameter();
  auto a = make();
  a->setup({group("w", {p1})});
  step(*a, {p1}, 0.1);
  step(*a, {p1}, 0.1);
  auto b = make();
  b->setup({group("w", {p2})});
  {
    at::NoGradGuard no_grad;
    p2.copy_(p1);
  }
  b->load_state_dict(a->state_dict());
  step(*a, {p1}, 0.1);
  step(*b, {p2}, 0.1);
  EXPECT_TRUE(at::equal(p1, p2)) << (p1 - p2).abs().max().item<double>();
}

TEST_P(OptimizerConformance, RefusesTheStateOfAnotherOptimizer) {
  for (const auto& other : names_of(LOOM_KIND_OPTIMIZER)) {
    if (other == GetParam()) continue;
    at::Tensor p = parameter();
    auto theirs = registry().create<loom::sdk::Optimizer>(other);
    theirs->setup({group("w", {p})});
    step(*theirs, {p}, 0.1);
    auto mine = make();
    mine->setup({group("w", {parameter()})});
    EXPECT_THROW(mine->load_state_dict(theirs->state_dict()), std::exception) << other;
  }
}

TEST_P(OptimizerConformance, StateBytesAreTheStateItKeeps) {
  at::Tensor p = parameter();
  auto o = make();
  o->setup({group("w", {p})});
  o->materialize();
  int64_t kept = 0;
  for (const auto& [name, t] : o->state_dict().tensors) kept += t.numel() * static_cast<int64_t>(t.element_size());
  EXPECT_EQ(o->state_bytes(p), kept);
}

TEST_P(OptimizerConformance, LeavesParametersWithoutAGradientAndAZeroScaledGroupAlone) {
  at::Tensor with_grad = parameter(), without = parameter(1), scaled = parameter(2);
  const at::Tensor before_without = without.detach().clone(), before_scaled = scaled.detach().clone();
  auto o = make();
  o->setup({group("main", {with_grad, without}), group("still", {scaled}, /*lr_scale=*/0.0)});
  with_grad.mutable_grad() = with_grad.detach().sin();
  scaled.mutable_grad() = scaled.detach().sin();
  o->step(0.1);
  EXPECT_FALSE(at::equal(with_grad, parameter())) << "the parameter with a gradient did not move";
  EXPECT_TRUE(at::equal(without, before_without));
  // lr_scale 0: no update (weight decay is scaled by the learning rate too).
  EXPECT_TRUE(at::equal(scaled, before_scaled));
}

// The device path as fp16_amp drives it: gradients 4x too large, divided by the kernels; the
// first call skipped for a non-finite gradient (nothing may change), then two updates taken.
// Against the same two updates on the host, on the gradients as they are: PyTorch's semantics
// (whose first update starts the optimizer's state, as SGD's momentum buffer at the gradient).
void expect_a_skipped_first_call_changes_nothing(const std::string& name,
                                                 const std::map<std::string, std::string>& options) {
  at::Tensor on_device = parameter(), on_host = parameter();
  auto a = registry().create<loom::sdk::Optimizer>(name, options);
  auto b = registry().create<loom::sdk::Optimizer>(name, options);
  a->setup({group("w", {on_device})});
  b->setup({group("w", {on_host})});
  const at::Tensor lr = at::full({}, 0.1, at::kDouble), divisor = at::full({1}, 4.0f);
  const auto device_call = [&](float found_non_finite) {
    on_device.mutable_grad() = on_device.detach().sin().mul(4);
    a->step_on_device_dividing(lr, at::full({1}, found_non_finite), divisor, {on_device.grad()});
  };
  device_call(1);
  EXPECT_TRUE(at::equal(on_device, parameter())) << name << ": the skipped call changed the parameter";
  for (int i = 0; i < 2; ++i) {
    device_call(0);
    step(*b, {on_host}, 0.1);
    EXPECT_TRUE(at::allclose(on_device, on_host, /*rtol=*/1e-6, /*atol=*/1e-7))
        << name << " update " << i + 1 << ": max difference " << (on_device - on_host).abs().max().item<double>();
  }
}

TEST_P(OptimizerConformance, ASkippedFirstCallOnTheDeviceChangesNothingAndTheNextStartsTheState) {
  expect_a_skipped_first_call_changes_nothing(GetParam(), {});
}

TEST(Optimizers, SgdWithDampeningStartsItsMomentumAtTheFirstUpdateTakenOnTheDevice) {
  // Once, the first update after a skipped call was (1 - dampening) times PyTorch's.
  expect_a_skipped_first_call_changes_nothing("sgd", {{"dampening", "0.5"}, {"weight_decay", "0.1"}});
  expect_a_skipped_first_call_changes_nothing("sgd", {{"dampening", "1"}, {"momentum", "0.5"}});
}

INSTANTIATE_TEST_SUITE_P(Plugins, OptimizerConformance, testing::ValuesIn(names_of(LOOM_KIND_OPTIMIZER)),
                         [](const auto& info) { return info.param; });

class ScheduleConformance : public testing::TestWithParam<std::string> {};

TEST_P(ScheduleConformance, FactorIsFiniteAndNonNegativeAtEveryStep) {
  auto s = registry().create<loom::sdk::Schedule>(GetParam());
  for (int64_t total : {1, 7, 100})
    for (int64_t step = 0; step < total; ++step) {  // (Schedule::factor's updates: 0 ... total - 1)
      const double f = s->factor(step, total);
      EXPECT_TRUE(std::isfinite(f) && f >= 0) << GetParam() << " step " << step << " of " << total << ": " << f;
    }
}

INSTANTIATE_TEST_SUITE_P(Plugins, ScheduleConformance, testing::ValuesIn(names_of(LOOM_KIND_SCHEDULE)),
                         [](const auto& info) { return info.param; });

TEST(Schedules, BuiltInsGiveTheirReferenceValues) {
  auto cosine = registry().create<loom::sdk::Schedule>("warmup_cosine", {{"warmup_ratio", "0.1"}});
  EXPECT_DOUBLE_EQ(cosine->factor(0, 100), 0.1);   // first warm-up step
  EXPECT_DOUBLE_EQ(cosine->factor(9, 100), 1.0);   // last warm-up step
  EXPECT_NEAR(cosine->factor(55, 100), 0.5, 1e-12);  // half-way through the cosine
  auto floor = registry().create<loom::sdk::Schedule>("warmup_cosine", {{"warmup_ratio", "0.1"}, {"min_lr_ratio", "0.1"}});
  EXPECT_NEAR(floor->factor(100, 100), 0.1, 1e-12);
  auto linear = registry().create<loom::sdk::Schedule>("warmup_linear", {{"warmup_ratio", "0.0"}});
  EXPECT_NEAR(linear->factor(50, 100), 0.5, 1e-12);
  auto constant = registry().create<loom::sdk::Schedule>("constant");
  EXPECT_DOUBLE_EQ(constant->factor(37, 100), 1.0);
  auto stepped = registry().create<loom::sdk::Schedule>("step", {{"step_size", "10"}, {"gamma", "0.5"}});
  EXPECT_DOUBLE_EQ(stepped->factor(9, 100), 1.0);
  EXPECT_DOUBLE_EQ(stepped->factor(10, 100), 0.5);
  EXPECT_DOUBLE_EQ(stepped->factor(25, 100), 0.25);
}

}  // namespace
