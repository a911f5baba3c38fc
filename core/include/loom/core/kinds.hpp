// The plugin kinds, described once. Everything that depends on a kind (its name in messages, the
// configuration key that selects its components, the section that holds their options, the
// host's interface version the loader compares) reads this table; adding a kind is one row.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace loom::core {

struct KindInfo {
  uint32_t id;                   ///< loom_kind
  std::string_view name;         ///< "model", "memory": what `loom plugins` prints
  std::string_view noun;         ///< "memory policy": for sentences ("memory policy 'auto_batch'")
  std::string_view select_key;   ///< the key that chooses the components: "model.name", "memory.policies"
  bool many;                     ///< select_key is an ordered list (memory policies), else one name
  std::string_view section;      ///< where the options of component NAME live: [<section>.NAME], and
                                 ///< [<section>] itself as a shorthand (see Note [Component sections])
  uint32_t interface_major;      ///< the host's Tier-1 interface version of the kind
  uint32_t interface_minor;
  uint32_t c_interface_major = 0;  ///< the host's C-tier interface of the kind (c_plugin.h); 0: none
  uint32_t c_interface_minor = 0;
};

/// Every kind, in loom_kind order.
const std::vector<KindInfo>& kinds();
/// The kind with this loom_kind id, or nullptr.
const KindInfo* find_kind(uint32_t id);
/// The kind with this name ("model"), or nullptr.
const KindInfo* find_kind(std::string_view name);

/// "model", "dataset", ... for a loom_kind; "kind <n>" for an unknown one.
std::string kind_name(uint32_t kind);

}  // namespace loom::core
