#pragma once
// The build fingerprint of a plugin file and whether the host can use what the file's code makes
// (Note [Fingerprint] in docs/abi.md). Since ABI 1.4 the fingerprint is an ELF note that is read
// from the file with libelf before the file is loaded; older plugins carry it in the descriptor
// only, which is read after loading.

#include "plugin_descriptor.hpp"

#include <loom/sdk/abi.h>

#include <filesystem>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <utility>

namespace loom::core {

using Fingerprint = std::map<std::string, std::string>;

/// The fix a refusal names for a plugin built against another SDK, or no SDK.
inline constexpr const char* kRebuildHint = "rebuild the plugin against this Loom's SDK (find_package(LoomSDK))";

/// The description of the file's fingerprint note (LOOM_NOTE_SECTION, owner LOOM_NOTE_NAME), or
/// nullopt when it has none. Reads the file with libelf, without loading it. Throws PluginRefused
/// (stage "static-check") for a file libelf cannot read as ELF, or a note that is malformed.
std::optional<std::string> read_fingerprint_note(const std::filesystem::path& file);

/// Where the file's symbol tables (.symtab and .dynsym, read with libelf, bounds checked: Boost's
/// reader trusted every offset, and one damaged byte crashed every command) put the plugin's
/// entry symbol: in section LOOM_ENTRY_SECTION, elsewhere, nowhere among the symbols the file
/// defines (absent_program: and the file is a program, not a library), or the file defines
/// none. Throws PluginRefused (stage "static-check") for a file that is no readable ELF file.
enum class EntrySymbol { in_section, elsewhere, absent, absent_program, no_symbols };
EntrySymbol find_entry_symbol(const std::filesystem::path& file);

/// Why `file` is no shared library, for a refusal: by what it starts with ("not an ELF file", "it
/// holds 0 bytes: an empty or truncated file"), else `library_error`.
std::string why_not_a_library(const std::filesystem::path& file, const std::string& library_error);

/// Why dlopen refused `file`, out of Boost.DLL's wrapping of dlerror's text, and the hint that
/// fits it: {reason, hint} (an undefined symbol: another LibTorch; a program: not a plugin).
std::pair<std::string, std::string> why_not_loaded(const std::filesystem::path& file, const std::string& library_error);

/// "key=value" lines into a map. Throws PluginRefused (stage "fingerprint") for text that is not
/// such lines (a key twice, an empty key, a line without '=', a value over LOOM_MAX_TEXT).
Fingerprint parse_fingerprint(std::string_view text);

/// Whether a plugin with fingerprint `plugin` may be used by this host; throws PluginRefused
/// (stage "fingerprint") naming the first field that decides against it, both values and the fix.
void check_fingerprint(const Fingerprint& plugin);

/// The same for a plugin older than ABI 1.4, from the fingerprint in its descriptor (LibTorch
/// version, CPU or CUDA build, string ABI) and the layouts of this host's value types.
void check_legacy_fingerprint(const loom_build_fingerprint* fingerprint);

/// The descriptor's fingerprint of a plugin older than ABI 1.4 as fields, for reports.
Fingerprint legacy_fingerprint_fields(const loom_build_fingerprint& f);

}  // namespace loom::core
