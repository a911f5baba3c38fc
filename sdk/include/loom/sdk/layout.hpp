// The layout of the SDK's value types (the structs that the Tier-1 interfaces pass by value or
// by reference: DataSpec, PlanContext, StepReport, ...) as one hash, part of the build fingerprint.
// A plugin compiled against other layouts would read and write the host's objects at the wrong
// offsets, so the host refuses it (Note [Value types] in docs/abi.md). Any change to a member
// listed here, or to the size of a standard or LibTorch type they hold, changes the hash.
//
// A member added to a value type is added here too. Each type's size is in the hash, so a member
// that is forgotten here still changes the hash whenever it changes the size of its type.
#pragma once

#include <loom/sdk/callback.hpp>
#include <loom/sdk/memory_policy.hpp>
#include <loom/sdk/model.hpp>
#include <loom/sdk/optimizer.hpp>
#include <loom/sdk/types.hpp>

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <functional>
#include <initializer_list>
#include <optional>

namespace loom::sdk {
namespace detail {

constexpr uint64_t fnv1a(std::initializer_list<uint64_t> values, uint64_t h = 1469598103934665603ull) {
  for (uint64_t v : values)
    for (int byte = 0; byte < 8; ++byte, v >>= 8) h = (h ^ (v & 0xFF)) * 1099511628211ull;
  return h;
}

using NumberMap = std::map<std::string, double>;  // a macro argument cannot hold the comma

}  // namespace detail

// offsetof of a type that is not standard-layout (it holds std::string) is conditionally
// supported; GCC and Clang support it, and their answer is the Itanium C++ ABI's layout.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Winvalid-offsetof"
#define LOOM_LAYOUT_TYPE(T) sizeof(T), alignof(T)
#define LOOM_LAYOUT_MEMBER(T, m) offsetof(T, m), sizeof(T::m)

/// Sizes, alignments, offsets and member sizes of every value type, one hash.
inline constexpr uint64_t kLayoutHash = detail::fnv1a({
    // What the value types are made of.
    LOOM_LAYOUT_TYPE(at::Tensor), LOOM_LAYOUT_TYPE(std::string), LOOM_LAYOUT_TYPE(Batch),
    LOOM_LAYOUT_TYPE(TextMap), LOOM_LAYOUT_TYPE(std::vector<int64_t>), LOOM_LAYOUT_TYPE(c10::Device),
    LOOM_LAYOUT_TYPE(std::function<int64_t(int64_t)>), LOOM_LAYOUT_TYPE(std::optional<double>),
    LOOM_LAYOUT_TYPE(std::filesystem::path), LOOM_LAYOUT_TYPE(detail::NumberMap),
    // types.hpp
    LOOM_LAYOUT_TYPE(State), LOOM_LAYOUT_MEMBER(State, tensors), LOOM_LAYOUT_MEMBER(State, text),
    LOOM_LAYOUT_TYPE(FieldSpec), LOOM_LAYOUT_MEMBER(FieldSpec, shape), LOOM_LAYOUT_MEMBER(FieldSpec, dtype),
    LOOM_LAYOUT_TYPE(DataSpec), LOOM_LAYOUT_MEMBER(DataSpec, fields), LOOM_LAYOUT_MEMBER(DataSpec, input_key),
    LOOM_LAYOUT_MEMBER(DataSpec, target_key), LOOM_LAYOUT_MEMBER(DataSpec, num_classes),
    LOOM_LAYOUT_MEMBER(DataSpec, attributes),
    LOOM_LAYOUT_TYPE(MetricSpec), LOOM_LAYOUT_MEMBER(MetricSpec, name), LOOM_LAYOUT_MEMBER(MetricSpec, display_name),
    LOOM_LAYOUT_MEMBER(MetricSpec, direction), LOOM_LAYOUT_MEMBER(MetricSpec, percent),
    LOOM_LAYOUT_TYPE(BatchPlan), LOOM_LAYOUT_MEMBER(BatchPlan, micro_batch), LOOM_LAYOUT_MEMBER(BatchPlan, accumulation),
    LOOM_LAYOUT_MEMBER(BatchPlan, world_size),
    LOOM_LAYOUT_TYPE(MemoryStats), LOOM_LAYOUT_MEMBER(MemoryStats, total), LOOM_LAYOUT_MEMBER(MemoryStats, free),
    LOOM_LAYOUT_MEMBER(MemoryStats, allocated), LOOM_LAYOUT_MEMBER(MemoryStats, reserved),
    LOOM_LAYOUT_MEMBER(MemoryStats, peak), LOOM_LAYOUT_MEMBER(MemoryStats, limit),
    LOOM_LAYOUT_MEMBER(MemoryStats, alloc_retries), LOOM_LAYOUT_MEMBER(MemoryStats, ooms),
    // model.hpp, optimizer.hpp
    LOOM_LAYOUT_TYPE(MetricValue), LOOM_LAYOUT_MEMBER(MetricValue, sum), LOOM_LAYOUT_MEMBER(MetricValue, count),
    LOOM_LAYOUT_TYPE(ModelOutput), LOOM_LAYOUT_MEMBER(ModelOutput, loss_sum), LOOM_LAYOUT_MEMBER(ModelOutput, count),
    LOOM_LAYOUT_MEMBER(ModelOutput, metrics),
    LOOM_LAYOUT_TYPE(ParameterGroup), LOOM_LAYOUT_MEMBER(ParameterGroup, name), LOOM_LAYOUT_MEMBER(ParameterGroup, names),
    LOOM_LAYOUT_MEMBER(ParameterGroup, params), LOOM_LAYOUT_MEMBER(ParameterGroup, lr_scale),
    LOOM_LAYOUT_MEMBER(ParameterGroup, weight_decay), LOOM_LAYOUT_MEMBER(ParameterGroup, frozen),
    // memory_policy.hpp
    LOOM_LAYOUT_TYPE(PlanContext), LOOM_LAYOUT_MEMBER(PlanContext, memory), LOOM_LAYOUT_MEMBER(PlanContext, plan),
    LOOM_LAYOUT_MEMBER(PlanContext, global_batch), LOOM_LAYOUT_MEMBER(PlanContext, global_batch_given),
    LOOM_LAYOUT_MEMBER(PlanContext, probe), LOOM_LAYOUT_MEMBER(PlanContext, config_key),
    LOOM_LAYOUT_MEMBER(PlanContext, device_name), LOOM_LAYOUT_MEMBER(PlanContext, max_micro_batch),
    LOOM_LAYOUT_TYPE(OomContext), LOOM_LAYOUT_MEMBER(OomContext, memory), LOOM_LAYOUT_MEMBER(OomContext, plan),
    LOOM_LAYOUT_MEMBER(OomContext, message), LOOM_LAYOUT_MEMBER(OomContext, step),
    LOOM_LAYOUT_MEMBER(OomContext, evaluation),
    // callback.hpp
    LOOM_LAYOUT_TYPE(StepReport), LOOM_LAYOUT_MEMBER(StepReport, step), LOOM_LAYOUT_MEMBER(StepReport, total_steps),
    LOOM_LAYOUT_MEMBER(StepReport, epoch), LOOM_LAYOUT_MEMBER(StepReport, loss), LOOM_LAYOUT_MEMBER(StepReport, metrics),
    LOOM_LAYOUT_MEMBER(StepReport, lr), LOOM_LAYOUT_MEMBER(StepReport, grad_norm), LOOM_LAYOUT_MEMBER(StepReport, skipped),
    LOOM_LAYOUT_MEMBER(StepReport, samples), LOOM_LAYOUT_MEMBER(StepReport, seconds), LOOM_LAYOUT_MEMBER(StepReport, plan),
    LOOM_LAYOUT_MEMBER(StepReport, memory), LOOM_LAYOUT_MEMBER(StepReport, evaluated), LOOM_LAYOUT_MEMBER(StepReport, last),
    LOOM_LAYOUT_TYPE(EvalReport), LOOM_LAYOUT_MEMBER(EvalReport, split), LOOM_LAYOUT_MEMBER(EvalReport, step),
    LOOM_LAYOUT_MEMBER(EvalReport, loss), LOOM_LAYOUT_MEMBER(EvalReport, metrics), LOOM_LAYOUT_MEMBER(EvalReport, samples),
    LOOM_LAYOUT_MEMBER(EvalReport, seconds),
    LOOM_LAYOUT_TYPE(RunReport), LOOM_LAYOUT_MEMBER(RunReport, first_step), LOOM_LAYOUT_MEMBER(RunReport, steps),
    LOOM_LAYOUT_MEMBER(RunReport, seconds), LOOM_LAYOUT_MEMBER(RunReport, samples_per_second),
    LOOM_LAYOUT_MEMBER(RunReport, plan), LOOM_LAYOUT_MEMBER(RunReport, peak_memory),
    LOOM_LAYOUT_MEMBER(RunReport, predicted_peak), LOOM_LAYOUT_MEMBER(RunReport, oom_recoveries),
    LOOM_LAYOUT_MEMBER(RunReport, stop_reason),
});

#undef LOOM_LAYOUT_MEMBER
#undef LOOM_LAYOUT_TYPE
#pragma GCC diagnostic pop

}  // namespace loom::sdk
