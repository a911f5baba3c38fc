// A C-tier plugin written in C++ (c_plugin.h's macros in a .cpp file): LOOM_C_PLUGIN must export
// the entry point under its C name there too (it was mangled, and the loader said the plugin had
// no entry point). tests/unit/trainer/c_tier_test.cpp loads it (libloom_c_tier_cxx.so).
#include <loom/sdk/c_plugin.h>

#include <cstdlib>

namespace {

struct Quiet {
  loom_c_callback table;
};

void* quiet_create(const loom_create_args*, loom_error* error) {
  auto* q = static_cast<Quiet*>(std::calloc(1, sizeof(Quiet)));
  if (q == nullptr) return loom_c_error(error, "out of memory"), nullptr;
  q->table.struct_size = sizeof(loom_c_callback);
  q->table.self = q;
  return &q->table;
}

void quiet_destroy(void* object) { std::free(static_cast<loom_c_callback*>(object)->self); }

const loom_component components[] = {
    LOOM_C_CALLBACK("c_from_cxx", "a C-tier callback built from a C++ file (test)", nullptr, 0, quiet_create, quiet_destroy),
};

}  // namespace

LOOM_C_PLUGIN("c_tier_cxx", "1.0.0", components)
