// The table of plugin kinds (kinds.hpp).
#include <loom/core/kinds.hpp>

#include <loom/sdk/abi.h>
#include <loom/sdk/c_plugin.h>
#include <loom/sdk/callback.hpp>
#include <loom/sdk/dataset.hpp>
#include <loom/sdk/memory_policy.hpp>
#include <loom/sdk/model.hpp>
#include <loom/sdk/optimizer.hpp>
#include <loom/sdk/parallel.hpp>
#include <loom/sdk/precision.hpp>

namespace loom::core {

namespace {

template <class Interface>
KindInfo row(std::string_view name, std::string_view noun, std::string_view select_key, bool many,
             std::string_view section, uint32_t c_major = 0, uint32_t c_minor = 0) {
  return KindInfo{Interface::kKind, name, noun, select_key, many, section, Interface::kInterfaceMajor,
                  Interface::kInterfaceMinor, c_major, c_minor};
}

}  // namespace

const std::vector<KindInfo>& kinds() {
  static const std::vector<KindInfo> table = {
      row<sdk::Model>("model", "model", "model.name", false, "model"),
      row<sdk::Dataset>("dataset", "dataset", "data.name", false, "data", LOOM_C_DATASET_MAJOR, LOOM_C_DATASET_MINOR),
      row<sdk::PrecisionStrategy>("precision", "precision", "precision.name", false, "precision"),
      row<sdk::MemoryPolicy>("memory", "memory policy", "memory.policies", true, "memory", LOOM_C_MEMORY_MAJOR,
                             LOOM_C_MEMORY_MINOR),
      row<sdk::ParallelStrategy>("parallel", "parallel strategy", "parallel.name", false, "parallel"),
      row<sdk::Optimizer>("optimizer", "optimizer", "trainer.optimizer", false, "optimizer"),
      row<sdk::Schedule>("schedule", "learning-rate schedule", "trainer.schedule", false, "schedule"),
      row<sdk::Callback>("callback", "callback", "trainer.callbacks", true, "callback", LOOM_C_CALLBACK_MAJOR,
                         LOOM_C_CALLBACK_MINOR),
  };
  return table;
}

const KindInfo* find_kind(uint32_t id) {
  for (const auto& k : kinds())
    if (k.id == id) return &k;
  return nullptr;
}

const KindInfo* find_kind(std::string_view name) {
  for (const auto& k : kinds())
    if (k.name == name) return &k;
  return nullptr;
}

std::string kind_name(uint32_t kind) {
  const KindInfo* k = find_kind(kind);
  return k ? std::string(k->name) : "kind " + std::to_string(kind);
}

}  // namespace loom::core
