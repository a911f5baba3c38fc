// Fuzz target: the descriptor a plugin's entry point returns, as the loader's stage 4 reads it
// (every field chosen by the input: sizes, versions, counts, kinds, option types, strings that are
// null, empty, unterminated within their bound, or not identifiers). Pointers are the one thing a
// plugin cannot be checked for, so tables have the length their count says. Expected outcome for
// a bad descriptor: PluginRefused at stage "descriptor".
#include "plugin_descriptor.hpp"

#include <loom/core/error.hpp>
#include <loom/sdk/abi.h>

#include <fuzzer/FuzzedDataProvider.h>

#include <deque>
#include <string>
#include <vector>

namespace {

struct Builder {
  explicit Builder(FuzzedDataProvider& in) : in(in) {}

  const char* text() {
    static const char* const kKnown[] = {"model", "lightweight_transformer", "d_model", "a|b|c", "1", "0.5",
                                         "true", "x", "", "Bad-Name", "a||b", "|", "1e400", "-3"};
    switch (in.ConsumeIntegralInRange<int>(0, 4)) {
      case 0: return nullptr;
      case 1: return kKnown[in.ConsumeIntegralInRange<size_t>(0, std::size(kKnown) - 1)];
      case 2: strings.emplace_back(static_cast<size_t>(LOOM_MAX_TEXT + 8), 'a'); return strings.back().c_str();
      default: strings.push_back(in.ConsumeRandomLengthString(96)); return strings.back().c_str();
    }
  }
  template <class T>
  T small_or_any(T usual) {
    return in.ConsumeBool() ? usual : in.ConsumeIntegral<T>();
  }

  FuzzedDataProvider& in;
  std::deque<std::string> strings;
  std::deque<std::vector<loom_option_spec>> option_tables;
};

void* create(const loom_create_args*, loom_error*) { return nullptr; }
void destroy(void*) {}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  FuzzedDataProvider in(data, size);
  Builder b(in);

  loom_build_fingerprint fingerprint{};
  fingerprint.struct_size = b.small_or_any<uint32_t>(sizeof(loom_build_fingerprint));
  fingerprint.torch_major = in.ConsumeIntegral<uint32_t>();
  fingerprint.compiler = b.text();
  fingerprint.sdk_version = b.text();

  const uint32_t count = in.ConsumeIntegralInRange<uint32_t>(0, 5);
  std::vector<loom_component> components(count);
  for (auto& c : components) {
    c.struct_size = b.small_or_any<uint32_t>(sizeof(loom_component));
    c.kind = in.ConsumeIntegralInRange<uint32_t>(0, 12);
    c.name = b.text();
    c.summary = b.text();
    c.interface_major = in.ConsumeIntegralInRange<uint32_t>(0, 3);
    c.interface_minor = in.ConsumeIntegralInRange<uint32_t>(0, 3);
    c.flags = in.ConsumeIntegralInRange<uint32_t>(0, 3);
    c.create = in.ConsumeBool() ? &create : nullptr;
    c.destroy = in.ConsumeBool() ? &destroy : nullptr;
    const uint32_t options = in.ConsumeIntegralInRange<uint32_t>(0, 6);
    auto& table = b.option_tables.emplace_back(options);
    for (auto& o : table) {
      o.struct_size = b.small_or_any<uint32_t>(sizeof(loom_option_spec));
      o.type = in.ConsumeIntegralInRange<uint32_t>(0, 8);
      o.key = b.text();
      o.default_value = b.text();
      o.help = b.text();
      o.choices = b.text();
    }
    c.options = options == 0 && in.ConsumeBool() ? nullptr : table.data();
    // A count the table does not have is only ever claimed for an empty (null) table: the loader
    // must refuse it before reading.
    c.option_count = c.options == nullptr ? in.ConsumeIntegral<uint32_t>() : options;
  }

  loom_plugin_descriptor d{};
  d.magic = b.small_or_any<uint32_t>(LOOM_ABI_MAGIC);
  d.struct_size = b.small_or_any<uint32_t>(sizeof(loom_plugin_descriptor));
  d.abi_major = b.small_or_any<uint16_t>(LOOM_ABI_MAJOR);
  d.abi_minor = b.small_or_any<uint16_t>(LOOM_ABI_MINOR);
  d.name = b.text();
  d.version = b.text();
  d.fingerprint = in.ConsumeBool() ? &fingerprint : nullptr;
  d.components = count == 0 && in.ConsumeBool() ? nullptr : components.data();
  d.component_count = d.components == nullptr ? in.ConsumeIntegral<uint32_t>() : count;

  try {
    loom::core::LoadReport report;
    loom::core::read_descriptor(&d, report);
  } catch (const loom::core::PluginRefused&) {
  }
  return 0;
}
