// Fuzz target: an INI configuration file as `loom train -c FILE` reads it, then validated against
// the core's keys as `loom config show` does. Expected outcome for bad input: loom::Error.
#include "fuzz_support.hpp"

#include <loom/core/config.hpp>
#include <loom/core/error.hpp>

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static const loom::core::Schema schema = loom::core::core_schema();
  const auto path = loom::fuzz::write_input("run.ini", data, size);
  try {
    loom::core::Config config;
    config.load_file(path);
    (void)loom::core::validate(config, schema);
  } catch (const loom::Error&) {
  }
  return 0;
}
