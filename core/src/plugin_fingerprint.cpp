// The fingerprint stage of plugin loading (plugin_fingerprint.hpp).
#include "plugin_fingerprint.hpp"

#include <loom/sdk/fingerprint.hpp>

#include <gelf.h>
#include <libelf.h>

#include <algorithm>
#include <cctype>
#include <cstring>
#include <fcntl.h>
#include <fstream>
#include <cstdlib>
#include <cxxabi.h>
#include <limits>
#include <memory>
#include <set>
#include <sstream>
#include <sys/stat.h>
#include <unistd.h>

namespace loom::core {

namespace {

// Note [Legacy layouts]
// A plugin older than ABI 1.4 says nothing about the layouts of the value types it was compiled
// with; they were those of SDK 0.1 up to ABI 1.3, whose hash (libstdc++, LP64) is this. Such a
// plugin's C++ objects are used only while this host's value types still have those layouts; the
// day one of them changes, older plugins are refused with a message saying so.
constexpr uint64_t kLegacyLayoutHash = 0xb214ce647ab3dcf5ull;

[[noreturn]] void refuse(std::string stage, std::string reason, std::string hint) {
  throw PluginRefused{std::move(stage), std::move(reason), std::move(hint)};
}

struct ElfCloser {
  void operator()(Elf* e) const { elf_end(e); }
};

std::string value_or_unknown(const Fingerprint& f, const std::string& key) {
  auto it = f.find(key);
  return it == f.end() ? "(not said)" : it->second;
}

std::set<std::string> split_list(const std::string& text) {
  std::set<std::string> out;
  std::stringstream in(text);
  std::string item;
  while (std::getline(in, item, ','))
    if (!item.empty() && item != "none") out.insert(item);
  return out;
}

std::string sanitizer_names(const std::set<std::string>& names) {
  std::string out;
  for (const auto& n : names) {
    const std::string pretty = n == "address" ? "AddressSanitizer" : n == "thread" ? "ThreadSanitizer"
                               : n == "memory" ? "MemorySanitizer" : n;
    out += (out.empty() ? "" : " and ") + pretty;
  }
  return out;
}

constexpr const char* kOnlyPluginsHint =
    "only Loom plugins (ELF shared libraries built with loom_add_plugin) belong in a plugin folder";

/// An open ELF file, read by libelf (which checks every offset against the file's size).
struct ElfFile {
  explicit ElfFile(const std::filesystem::path& file) {
    if (elf_version(EV_CURRENT) == EV_NONE) refuse("static-check", "libelf is unusable", "");
    // The caller checked that this is a regular file; O_NONBLOCK all the same, so a file swapped
    // for a FIFO since then cannot block the open.
    fd.value = ::open(file.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);
    if (fd.value < 0) refuse("static-check", std::string("cannot open the file: ") + std::strerror(errno), "");
    elf.reset(elf_begin(fd.value, ELF_C_READ, nullptr));
    if (!elf || elf_kind(elf.get()) != ELF_K_ELF)
      refuse("static-check",
             "not a shared library of this platform (" + why_not_a_library(file, "an ELF header libelf cannot read") + ")",
             kOnlyPluginsHint);
    if (elf_getshdrstrndx(elf.get(), &names_index) != 0)
      refuse("static-check", std::string("not a shared library of this platform (a damaged ELF file: its section table is "
                                         "unreadable: ") + elf_errmsg(-1) + ")",
             kOnlyPluginsHint);
    check_whole(file);
  }

  // The segments the dynamic loader maps, and the section table, inside the file: a plugin cut
  // short (a copy that stopped) passed, and the loader's mapping of it ended in SIGBUS, said as
  // a crash of its static initializers (with the scanner off, `loom plugins` itself died).
  void check_whole(const std::filesystem::path& file) {
    struct stat st {};
    GElf_Ehdr header;
    if (::fstat(fd.value, &st) != 0 || gelf_getehdr(elf.get(), &header) == nullptr) return;  // (libelf's checks stand)
    const uint64_t size = static_cast<uint64_t>(st.st_size);
    uint64_t reach = 0;
    const auto within = [&](uint64_t offset, uint64_t bytes) {
      const uint64_t most = std::numeric_limits<uint64_t>::max();
      reach = std::max(reach, bytes > most - offset ? most : offset + bytes);
    };
    within(header.e_shoff, uint64_t{header.e_shnum} * header.e_shentsize);
    size_t segments = 0;
    if (elf_getphdrnum(elf.get(), &segments) == 0)
      for (size_t i = 0; i < segments; ++i)
        if (GElf_Phdr segment; gelf_getphdr(elf.get(), static_cast<int>(i), &segment) != nullptr && segment.p_type == PT_LOAD)
          within(segment.p_offset, segment.p_filesz);
    if (reach > size)
      refuse("static-check",
             "not a shared library of this platform (a damaged ELF file: it is cut short: " + file.filename().string() +
                 " has " + std::to_string(size) + " bytes, and its headers place its contents " +
                 (reach == std::numeric_limits<uint64_t>::max() ? std::string("past any size") : "up to byte " + std::to_string(reach)) +
                 "; copy or build it again)",
             kOnlyPluginsHint);
  }
  ElfFile(const ElfFile&) = delete;
  ElfFile& operator=(const ElfFile&) = delete;

  // (members, so that a refusal thrown by the constructor closes them too: the Elf, then the fd)
  struct Fd {
    int value = -1;
    ~Fd() {
      if (value >= 0) ::close(value);
    }
  } fd;
  std::unique_ptr<Elf, ElfCloser> elf;
  size_t names_index = 0;
};

}  // namespace

EntrySymbol find_entry_symbol(const std::filesystem::path& file) {
  ElfFile f(file);
  const auto damaged = [&](const std::string& what) {
    refuse("static-check", "not a shared library of this platform (a damaged ELF file: " + what + ")", kOnlyPluginsHint);
  };
  size_t entry_section = 0;  // (0: none; section 0 holds no symbol)
  for (Elf_Scn* section = elf_nextscn(f.elf.get(), nullptr); section != nullptr; section = elf_nextscn(f.elf.get(), section)) {
    GElf_Shdr header;
    if (gelf_getshdr(section, &header) == nullptr) damaged(std::string("a section header is unreadable: ") + elf_errmsg(-1));
    const char* name = elf_strptr(f.elf.get(), f.names_index, header.sh_name);
    if (name != nullptr && std::strcmp(name, LOOM_ENTRY_SECTION) == 0) entry_section = elf_ndxscn(section);
  }
  bool defines_any = false, elsewhere = false;
  for (Elf_Scn* section = elf_nextscn(f.elf.get(), nullptr); section != nullptr; section = elf_nextscn(f.elf.get(), section)) {
    GElf_Shdr header;
    if (gelf_getshdr(section, &header) == nullptr || (header.sh_type != SHT_SYMTAB && header.sh_type != SHT_DYNSYM)) continue;
    Elf_Data* data = elf_getdata(section, nullptr);
    if (data == nullptr) damaged(std::string("a symbol table is unreadable: ") + elf_errmsg(-1));
    const size_t count = header.sh_entsize == 0 ? 0 : header.sh_size / header.sh_entsize;
    for (size_t i = 1; i < count; ++i) {  // (symbol 0 is the null symbol)
      GElf_Sym symbol;
      if (gelf_getsym(data, static_cast<int>(i), &symbol) == nullptr) break;  // (past the data libelf read)
      if (GELF_ST_BIND(symbol.st_info) == STB_LOCAL || symbol.st_shndx == SHN_UNDEF) continue;
      defines_any = true;
      if (GELF_ST_VISIBILITY(symbol.st_other) != STV_DEFAULT && GELF_ST_VISIBILITY(symbol.st_other) != STV_PROTECTED) continue;
      const char* name = elf_strptr(f.elf.get(), header.sh_link, symbol.st_name);
      if (name == nullptr || std::strcmp(name, LOOM_ENTRY_SYMBOL) != 0) continue;
      if (entry_section != 0 && symbol.st_shndx == entry_section) return EntrySymbol::in_section;
      elsewhere = true;
    }
  }
  if (elsewhere) return EntrySymbol::elsewhere;
  if (!defines_any) return EntrySymbol::no_symbols;
  // A program (ET_EXEC, or a PIE: ET_DYN with an interpreter) is said to be one.
  GElf_Ehdr header;
  if (gelf_getehdr(f.elf.get(), &header) != nullptr && header.e_type == ET_EXEC) return EntrySymbol::absent_program;
  size_t segments = 0;
  if (elf_getphdrnum(f.elf.get(), &segments) == 0)
    for (size_t i = 0; i < segments; ++i) {
      GElf_Phdr segment;
      if (gelf_getphdr(f.elf.get(), static_cast<int>(i), &segment) != nullptr && segment.p_type == PT_INTERP)
        return EntrySymbol::absent_program;
    }
  return EntrySymbol::absent;
}

std::optional<std::string> read_fingerprint_note(const std::filesystem::path& file) {
  ElfFile f(file);
  Elf* const elf_handle = f.elf.get();
  const size_t names_index = f.names_index;
  for (Elf_Scn* section = elf_nextscn(elf_handle, nullptr); section != nullptr;
       section = elf_nextscn(elf_handle, section)) {
    GElf_Shdr header;
    if (gelf_getshdr(section, &header) == nullptr || header.sh_type != SHT_NOTE) continue;
    const char* name = elf_strptr(elf_handle, names_index, header.sh_name);
    if (name == nullptr || std::strcmp(name, LOOM_NOTE_SECTION) != 0) continue;
    Elf_Data* data = elf_getdata(section, nullptr);
    if (data == nullptr || data->d_buf == nullptr) refuse("static-check", "its " LOOM_NOTE_SECTION " section is unreadable", "");
    GElf_Nhdr note;
    size_t name_offset = 0, desc_offset = 0;
    for (size_t offset = 0; (offset = gelf_getnote(data, offset, &note, &name_offset, &desc_offset)) > 0;) {
      const char* bytes = static_cast<const char*>(data->d_buf);
      const bool ours = note.n_namesz == sizeof(LOOM_NOTE_NAME) &&
                        std::memcmp(bytes + name_offset, LOOM_NOTE_NAME, sizeof(LOOM_NOTE_NAME)) == 0 &&
                        note.n_type == LOOM_NOTE_FINGERPRINT;
      if (!ours) continue;
      // gelf_getnote checked that the description lies within the section.
      const size_t size = ::strnlen(bytes + desc_offset, note.n_descsz);
      if (size == note.n_descsz)
        refuse("static-check", "its fingerprint note is not NUL-terminated", kRebuildHint);
      return std::string(bytes + desc_offset, size);
    }
    refuse("static-check", "its " LOOM_NOTE_SECTION " section holds no Loom fingerprint", kRebuildHint);
  }
  return std::nullopt;
}

Fingerprint parse_fingerprint(std::string_view text) {
  Fingerprint out;
  size_t start = 0;
  while (start < text.size()) {
    size_t end = text.find('\n', start);
    if (end == std::string_view::npos) end = text.size();
    const std::string_view line = text.substr(start, end - start);
    start = end + 1;
    if (line.empty()) continue;
    const size_t eq = line.find('=');
    if (eq == 0 || eq == std::string_view::npos || line.size() - eq - 1 > LOOM_MAX_TEXT)
      refuse("fingerprint", "its fingerprint note has a malformed line '" + std::string(line.substr(0, 80)) + "'",
             kRebuildHint);
    if (!out.emplace(std::string(line.substr(0, eq)), std::string(line.substr(eq + 1))).second)
      refuse("fingerprint", "its fingerprint note says '" + std::string(line.substr(0, eq)) + "' twice", kRebuildHint);
  }
  return out;
}

const Fingerprint& host_fingerprint() {
  static const Fingerprint host = [] {
    const auto text = sdk::fingerprint_text();
    return parse_fingerprint(std::string_view(text.text, text.size));
  }();
  return host;
}

void check_fingerprint(const Fingerprint& plugin) {
  const Fingerprint& host = host_fingerprint();
  if (value_or_unknown(plugin, "format") != "1")
    refuse("fingerprint", "its fingerprint note has format '" + value_or_unknown(plugin, "format") + "', this host reads 1",
           "upgrade Loom, or " + std::string(kRebuildHint));
  const std::string tier = value_or_unknown(plugin, "tier");
  if (tier != "cxx" && tier != "c")
    refuse("fingerprint", "its fingerprint names tier '" + tier + "' (expected cxx or c)", kRebuildHint);

  // Sanitizers: a sanitized library needs its runtime loaded first in the process, so it loads
  // only into a host built with the same sanitizers; an unsanitized plugin loads into any host.
  const auto plugin_sanitizers = split_list(value_or_unknown(plugin, "sanitizers"));
  const auto host_sanitizers = split_list(host.at("sanitizers"));
  std::set<std::string> missing;
  for (const auto& s : plugin_sanitizers)
    if (!host_sanitizers.count(s)) missing.insert(s);
  if (!missing.empty())
    refuse("fingerprint",
           "built with " + sanitizer_names(missing) + ", which this Loom is not built with" +
               " (its runtime would have to be loaded before anything else in the process)",
           "load it into a Loom built with the same sanitizer (cmake --preset asan), or rebuild the plugin without it");
  if (tier == "c") return;  // a C-tier plugin passes no C++ object: nothing else matters

  struct Rule {
    const char* key;
    const char* what;
    const char* hint;
  };
  static const Rule rules[] = {
      {"libtorch", "LibTorch", kRebuildHint},
      {"libtorch_git", "the LibTorch commit", kRebuildHint},
      {"cuda", "LibTorch's CUDA version", kRebuildHint},
      {"stdlib", "the C++ standard library", "rebuild the plugin against the same standard library as Loom (libstdc++ with GCC and Clang on Linux)"},
      {"stdlib_abi", "the standard library ABI", "rebuild the plugin without overriding _GLIBCXX_USE_CXX11_ABI (LibTorch's setting comes with the SDK target)"},
      {"debug_containers", "debug containers (_GLIBCXX_DEBUG) set to", "rebuild the plugin without _GLIBCXX_DEBUG: it changes the layout of every standard container"},
      {"layout", "SDK value types of layout", "the plugin was built against another Loom SDK (its DataSpec, StepReport, ... differ): rebuild it with find_package(LoomSDK) of this Loom"},
  };
  for (const Rule& rule : rules) {
    const std::string mine = host.at(rule.key), theirs = value_or_unknown(plugin, rule.key);
    // A commit that either side could not learn is not held against the plugin; the version is.
    if (std::strcmp(rule.key, "libtorch_git") == 0 && (mine == "unknown" || theirs == "unknown")) continue;
    if (mine != theirs)
      refuse("fingerprint", std::string("built against ") + rule.what + " " + theirs + ", host has " + mine, rule.hint);
  }
}

Fingerprint legacy_fingerprint_fields(const loom_build_fingerprint& f) {
  auto bounded = [](const char* s) {
    if (s == nullptr) return std::string("?");
    const size_t n = ::strnlen(s, LOOM_MAX_NAME + 1);
    return n > LOOM_MAX_NAME ? std::string("?") : std::string(s, n);
  };
  return {{"libtorch", std::to_string(f.torch_major) + "." + std::to_string(f.torch_minor) + "." + std::to_string(f.torch_patch)},
          {"libtorch_build", f.torch_cuda ? "cuda" : "cpu"},
          {"cxx_abi", f.cxx11_abi == 2 ? std::string("not libstdc++") : "_GLIBCXX_USE_CXX11_ABI=" + std::to_string(f.cxx11_abi)},
          {"cxx_standard", std::to_string(f.cxx_standard)},
          {"compiler", bounded(f.compiler)},
          {"sdk", bounded(f.sdk_version)}};
}

void check_legacy_fingerprint(const loom_build_fingerprint* f) {
  const loom_build_fingerprint& host = sdk::kBuildFingerprint;
  if (f == nullptr) refuse("fingerprint", "the descriptor has no build fingerprint", kRebuildHint);
  if (f->struct_size < LOOM_MIN_SIZE(loom_build_fingerprint, 0))
    refuse("fingerprint",
           "the fingerprint's struct_size is " + std::to_string(f->struct_size) + ", smaller than ABI 1.0's " +
               std::to_string(LOOM_MIN_SIZE(loom_build_fingerprint, 0)),
           kRebuildHint);
  const Fingerprint theirs = legacy_fingerprint_fields(*f), mine = legacy_fingerprint_fields(host);
  if (theirs.at("libtorch") != mine.at("libtorch"))
    refuse("fingerprint", "built against LibTorch " + theirs.at("libtorch") + ", host has " + mine.at("libtorch"), kRebuildHint);
  if (f->torch_cuda != host.torch_cuda)
    refuse("fingerprint",
           std::string("built against a ") + (f->torch_cuda ? "CUDA" : "CPU") + " build of LibTorch, host uses a " +
               (host.torch_cuda ? "CUDA" : "CPU") + " build",
           kRebuildHint);
  if (f->cxx11_abi != host.cxx11_abi)
    refuse("fingerprint", "built with " + theirs.at("cxx_abi") + ", host uses " + mine.at("cxx_abi"),
           "rebuild the plugin without overriding _GLIBCXX_USE_CXX11_ABI (LibTorch's setting comes with the SDK target)");
  if (sdk::kLayoutHash != kLegacyLayoutHash)
    refuse("fingerprint",
           "built before ABI 1.4, when plugins did not record the layout of the SDK's value types, and this "
           "Loom's value types have changed since",
           kRebuildHint);
}

std::pair<std::string, std::string> why_not_loaded(const std::filesystem::path& file, const std::string& library_error) {
  // "boost::dll::shared_library::load() failed (dlerror system message: <it>): Bad file descriptor";
  // anything else was thrown by the plugin's own code as the file loaded (a global's constructor).
  if (library_error.find("shared_library") == std::string::npos && library_error.find("dlerror") == std::string::npos)
    return {"a static initializer threw as the file loaded: " + library_error,
            "a global object of the plugin throws in its constructor; build what it needs in the component's "
            "constructor or setup instead, where an error is reported as the component's"};
  std::string why = library_error;
  const std::string marker = "dlerror system message: ";
  if (const size_t at = why.find(marker); at != std::string::npos) {
    const size_t end = why.rfind("): ");
    why = why.substr(at + marker.size(), end != std::string::npos && end > at ? end - at - marker.size() : std::string::npos);
  }
  if (const size_t at = why.find("undefined symbol: "); at != std::string::npos) {
    // LibTorch's C++ symbols (mangled, naming c10, at or torch) differ between its versions; any
    // other (a C-tier plugin's, which links no LibTorch) is one no library the plugin links defines.
    const std::string symbol = why.substr(at + 18, why.find_first_of(" \t,(", at + 18) - (at + 18));
    // (demangled: "c10" inside another name's mangling, _ZN3foo4Spec10initializeEv, is no LibTorch;
    // a const member, _ZNK2at..., is)
    int status = -1;
    std::unique_ptr<char, void (*)(void*)> demangled(abi::__cxa_demangle(symbol.c_str(), nullptr, nullptr, &status), std::free);
    const std::string name = status == 0 && demangled ? demangled.get() : "";
    bool torch = false;
    for (const std::string space : {"at::", "c10::", "torch::", "caffe2::"})  // (whole names: not format::)
      for (size_t i = name.find(space); !torch && i != std::string::npos; i = name.find(space, i + 1))
        torch = i == 0 || !(std::isalnum(static_cast<unsigned char>(name[i - 1])) || name[i - 1] == '_');
    if (torch)
      return {why, "an undefined symbol of LibTorch's means the plugin was built against another LibTorch: " +
                       std::string(kRebuildHint)};
    return {why, "no library the plugin links defines " + symbol + ": link the one that does, or define it (`nm -D "
                 "--undefined-only " + file.string() + "` lists what the plugin expects others to define)"};
  }
  if (why.find("position-independent executable") != std::string::npos)
    return {why, "it is a program, not a plugin: give a plugin's .so (built with loom_add_plugin())"};
  return {why, "`ldd " + file.string() + "` shows whether a library it needs is missing"};
}

std::string why_not_a_library(const std::filesystem::path& file, const std::string& library_error) {
  char magic[4] = {};
  std::ifstream head(file, std::ios::binary);
  head.read(magic, sizeof magic);
  if (head.gcount() < static_cast<std::streamsize>(sizeof magic))
    return "it holds " + std::to_string(head.gcount()) + " bytes: an empty or truncated file";
  if (std::memcmp(magic, "\x7f" "ELF", 4) != 0) return "not an ELF file";
  return library_error;
}

}  // namespace loom::core
