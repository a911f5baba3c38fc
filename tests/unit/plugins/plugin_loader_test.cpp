// The plugin loader against real shared libraries: one good plugin and a suite of broken ones
// in the same folder. Every broken file is refused at its own stage with its own reason, the
// good plugin loads, and the process keeps running.
#include <loom/core/log.hpp>
#include <loom/core/plugin_registry.hpp>
#include <loom/sdk/callback.hpp>
#include <loom/sdk/dataset.hpp>

#include "plugin_fingerprint.hpp"

#include <gtest/gtest.h>

#include <elf.h>

#include <algorithm>
#include <filesystem>
#include <cstring>
#include <fstream>
#include <functional>
#include <string>
#include <sys/stat.h>
#include <unistd.h>

namespace fs = std::filesystem;
using loom::core::PluginRegistry;

namespace {

const fs::path kDir = LOOM_TEST_PLUGIN_DIR;

PluginRegistry& shared_registry() {
  static PluginRegistry* registry = [] {
    auto* r = new PluginRegistry();
    r->set_log_refusals(false);
    r->scan({kDir});
    return r;
  }();
  return *registry;
}

const loom::core::PluginRefusal* refusal_of(const std::string& file) {
  for (const auto& r : shared_registry().refusals())
    if (r.file.filename() == file) return &r;
  return nullptr;
}

struct BrokenCase {
  const char* file;
  const char* stage;
  std::string reason;  // a part of the reason
};

std::ostream& operator<<(std::ostream& out, const BrokenCase& c) { return out << c.file; }

class BrokenPlugin : public testing::TestWithParam<BrokenCase> {};

TEST_P(BrokenPlugin, IsRefusedWithItsOwnReason) {
  const BrokenCase& c = GetParam();
  ASSERT_TRUE(fs::exists(kDir / c.file)) << "test plugin not built: " << c.file;
  const auto* refusal = refusal_of(c.file);
  ASSERT_NE(refusal, nullptr) << c.file << " was not refused";
  EXPECT_EQ(refusal->stage, c.stage) << refusal->line();
  EXPECT_NE(refusal->reason.find(c.reason), std::string::npos) << refusal->line();
  EXPECT_FALSE(refusal->hint.empty()) << refusal->line();
  // One line, naming the file, the stage and the reason.
  const std::string line = refusal->line();
  EXPECT_EQ(line.find('\n'), std::string::npos);
  EXPECT_NE(line.find(c.file), std::string::npos);
  EXPECT_NE(line.find(std::string("[") + c.stage + "]"), std::string::npos);
}

INSTANTIATE_TEST_SUITE_P(
    PluginLoader, BrokenPlugin,
    testing::Values(
        BrokenCase{"libloom_dataset_broken_not_elf.so", "static-check", "not a shared library of this platform (not an ELF file)"},
        BrokenCase{"libloom_dataset_broken_no_entry.so", "static-check", "no entry symbol loom_plugin_entry_v1"},
        BrokenCase{"libloom_dataset_broken_null_entry.so", "descriptor", "returned no descriptor"},
        BrokenCase{"libloom_dataset_broken_bad_magic.so", "descriptor", "bad magic 0xdeadbeef"},
        BrokenCase{"libloom_dataset_broken_small_struct.so", "descriptor", "struct_size 24 is smaller than 56, its size in ABI 1.4"},
        BrokenCase{"libloom_dataset_broken_abi_major.so", "descriptor", "plugin ABI 2.4, host ABI 1.4: the major versions differ"},
        BrokenCase{"libloom_dataset_broken_abi_minor.so", "descriptor", "plugin ABI 1.5 is newer than the host's 1.4"},
        BrokenCase{"libloom_dataset_broken_torch_version.so", "fingerprint", "built against LibTorch 1.13.1, host has"},
        BrokenCase{"libloom_dataset_broken_cxx11_abi.so", "fingerprint", "built against the standard library ABI pre-cxx11, host has cxx11"},
        BrokenCase{"libloom_dataset_broken_newer_minor.so", "interface",  // the plugin declares the host's minor + 1
                   "dataset 'broken_newer_minor' implements dataset interface 1." +
                       std::to_string(loom::sdk::Dataset::kInterfaceMinor + 1) + ", host has 1." +
                       std::to_string(loom::sdk::Dataset::kInterfaceMinor) + ": the plugin is newer than this Loom"},
        BrokenCase{"libloom_dataset_broken_unknown_flags.so", "descriptor", "dataset 'broken_unknown_flags': unknown flags 16"},
        BrokenCase{"libloom_dataset_broken_no_note.so", "fingerprint", "an ABI 1.4 plugin without its fingerprint note (.note.loom)"},
        BrokenCase{"libloom_dataset_broken_duplicate.so", "register", "dataset 'counting' is already provided by"},
        BrokenCase{"libloom_dataset_broken_init_fails.so", "init", "init failed (code 7): the GPU this plugin was told to use does not exist"},
        BrokenCase{"libloom_dataset_broken_init_throws.so", "init", "init threw an exception: boom from init"},
        BrokenCase{"libloom_dataset_broken_bad_range.so", "descriptor", "option #0 'size': range '5..1' is not 'lo..hi'"},
        BrokenCase{"libloom_dataset_broken_default_out_of_range.so", "descriptor",
                   "option #0 'rate': default 2 is outside its range 0..1"},
        BrokenCase{"libloom_dataset_broken_long_default.so", "descriptor",
                   "option #0 'path': its default is longer than 1024 bytes (LOOM_MAX_TEXT)"},
        BrokenCase{"libloom_dataset_broken_control_version.so", "descriptor", "the plugin version has control characters"},
        BrokenCase{"libloom_dataset_broken_long_summary.so", "descriptor",
                   "dataset 'broken_long_summary': its summary is longer than 1024 bytes (LOOM_MAX_TEXT)"},
        BrokenCase{"libloom_dataset_broken_int64_range.so", "descriptor",
                   "option #0 'count': range '0.5..1e30' is not 'lo..hi' within the 64-bit integers"}),
    [](const testing::TestParamInfo<BrokenCase>& info) {
      std::string name = info.param.file;
      name = name.substr(std::string("libloom_dataset_broken_").size());
      return name.substr(0, name.size() - 3);
    });

TEST(PluginLoader, RefusesExactlyTheBrokenFilesAndLoadsTheRest) {
  auto& registry = shared_registry();
  EXPECT_EQ(registry.refusals().size(), 21u);
  std::vector<std::string> loaded;
  for (const auto& p : registry.plugins()) loaded.push_back(p->name);
  std::sort(loaded.begin(), loaded.end());
  // factory_throws is a well-formed plugin: its failure comes when its component is created.
  EXPECT_EQ(loaded, (std::vector<std::string>{"basic_counting", "broken_factory_throws", "broken_fraction_range",
                                              "broken_printed_text", "broken_repeated_choice", "broken_stray_comma"}));
}

TEST(PluginLoader, AnOptionTableIsReadAsItsValuesWillBe) {
  // Each was taken as written, then its own values refused or shown two ways: an int's range in
  // fractions was [0, 2] in one place and 0.5..2.5 in another (0 refused as outside [0, 2]); a list
  // default with stray commas was written by `loom config show` where no file may hold it; a
  // choice given twice was listed twice ("expected one of a, a, b"). Older plugins keep loading.
  const auto option = [](const char* component) {
    const auto* c = shared_registry().find(LOOM_KIND_DATASET, component);
    EXPECT_NE(c, nullptr) << component;
    return c == nullptr || c->options.empty() ? loom::core::OptionSpec{} : c->options[0];
  };
  const auto every = option("broken_fraction_range");
  EXPECT_EQ(every.choices, "1..2");
  EXPECT_EQ(every.min, 1.0);
  EXPECT_EQ(every.max, 2.0);
  EXPECT_EQ(option("broken_stray_comma").default_value, "a b");
  EXPECT_EQ(option("broken_repeated_choice").choices, "a|b");
}

TEST(PluginLoader, AnIntsRangeIsWithinTheSixtyFourBitIntegers) {
  // "0.5..1e30" was taken, and shown as "1..-9223372036854775808"; the whole int64 range stays valid.
  const auto range = [](const char* choices) {
    loom::core::OptionSpec spec;
    spec.type = LOOM_OPTION_INT;
    spec.choices = choices;
    return loom::core::set_range_from_choices(spec) ? spec.choices : std::string("refused");
  };
  EXPECT_EQ(range("0..1e30"), "refused");
  EXPECT_EQ(range("-1e19.."), "refused");
  EXPECT_EQ(range("0.5..1e30"), "refused");
  EXPECT_EQ(range("..9223372036854775807"), "..9223372036854775807");
  EXPECT_EQ(range("-0.5..9223372036854775807"), "0..9223372036854775807");
  EXPECT_EQ(range("-9223372036854775808..-0.5"), "-9223372036854775808..-1");
}

TEST(PluginLoader, APluginsTextIsPrintedWithoutItsControlCharactersAndABadOptionTableNamesTheSourceAsTheFix) {
  // `loom plugins` prints summaries and help: a line break, a carriage return or an escape in
  // them printed lines that looked like Loom's own ("[12:00:00 E] loom: ...").
  const auto* c = shared_registry().find(LOOM_KIND_DATASET, "broken_printed_text");
  ASSERT_NE(c, nullptr);
  EXPECT_EQ(c->summary, "ok [12:00:00 E] loom: forged [31m red ");
  ASSERT_EQ(c->options.size(), 1u);
  EXPECT_EQ(c->options[0].help, "a size [12:00:00 E] forged  [2K");
  // Rebuilding a plugin does not fix its option table: its source does.
  for (const auto& r : shared_registry().refusals())
    if (r.file.filename() == "libloom_dataset_broken_bad_range.so") {
      EXPECT_NE(r.hint.find("fix the component's option table in the plugin's source"), std::string::npos) << r.hint;
      return;
    }
  ADD_FAILURE() << "broken_bad_range was not refused";
}

TEST(PluginLoader, APluginBuiltForAnotherMachineIsNamedAsSuch) {
  // An aarch64 or 32-bit build was refused as "cannot open shared object file: No such file or
  // directory", with advice to run ldd, of a file that was there.
  const fs::path dir = fs::temp_directory_path() / ("loom_foreign_elf_" + std::to_string(::getpid()));
  fs::create_directories(dir);
  const auto patched = [&](const std::string& name, int offset, std::vector<unsigned char> bytes) {
    const fs::path file = dir / name;
    fs::copy_file(kDir / "libloom_dataset_basic_counting.so", file, fs::copy_options::overwrite_existing);
    std::fstream f(file, std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(offset);
    f.write(reinterpret_cast<const char*>(bytes.data()), static_cast<std::streamsize>(bytes.size()));
    return file;
  };
  loom::core::PluginRegistry registry;
  registry.set_log_refusals(false);
  for (const auto& [file, says] : std::vector<std::pair<fs::path, std::string>>{
#if defined(__aarch64__)
           {patched("libloom_dataset_other.so", 18, {62, 0}), "an ELF file built for x86-64, not for this machine ("},
#else
           {patched("libloom_dataset_other.so", 18, {183, 0}), "an ELF file built for aarch64, not for this machine ("},
#endif
           {patched("libloom_dataset_i386.so", 4, {1}), "an ELF file built for 32 bits, not for this machine ("}}) {
    const auto report = registry.load(file);
    ASSERT_TRUE(report.refusal.has_value()) << file;
    EXPECT_EQ(report.refusal->stage, "static-check");
    EXPECT_NE(report.refusal->reason.find(says), std::string::npos) << report.refusal->reason;
  }
  fs::remove_all(dir);
}

TEST(PluginLoader, GoodPluginDescribesItself) {
  const auto* c = shared_registry().find(LOOM_KIND_DATASET, "counting");
  ASSERT_NE(c, nullptr);
  EXPECT_EQ(c->plugin->name, "basic_counting");
  EXPECT_EQ(c->plugin->version, "1.2.3");
  EXPECT_EQ(c->summary, "samples [i, i+1, i+2], label i % 3");
  ASSERT_EQ(c->options.size(), 3u);
  EXPECT_EQ(c->options[0].key, "size");
  EXPECT_EQ(c->options[0].type, static_cast<uint32_t>(LOOM_OPTION_INT));
  EXPECT_EQ(c->options[0].default_value, "10");
  EXPECT_EQ(c->options[1].choices, "flat|square");
}

TEST(PluginLoader, EntryPointSitsInTheLoomSection) {
  EXPECT_EQ(loom::core::find_entry_symbol(kDir / "libloom_dataset_basic_counting.so"), loom::core::EntrySymbol::in_section);
  EXPECT_EQ(loom::core::find_entry_symbol(kDir / "libloom_dataset_broken_no_entry.so"), loom::core::EntrySymbol::absent);
}

TEST(PluginLoader, ADamagedSectionHeaderIsReadWithinTheFileAndTheOtherPluginsLoad) {
  // One byte of a section header pointing a name past the section names crashed every command
  // with SIGSEGV in the static check (Boost.DLL's reader trusted every offset), before the
  // scanner's isolation: the loader reads the file with libelf now, which checks them.
  const fs::path dir = fs::temp_directory_path() / ("loom_damaged_elf_" + std::to_string(::getpid()));
  fs::create_directories(dir);
  const auto damaged = [&](const std::string& name, const std::function<void(Elf64_Shdr&, const std::string&)>& edit) {
    const fs::path file = dir / name;
    fs::copy_file(kDir / "libloom_dataset_basic_counting.so", file, fs::copy_options::overwrite_existing);
    std::fstream f(file, std::ios::in | std::ios::out | std::ios::binary);
    Elf64_Ehdr header{};
    f.read(reinterpret_cast<char*>(&header), sizeof header);
    std::vector<Elf64_Shdr> sections(header.e_shnum);
    f.seekg(static_cast<std::streamoff>(header.e_shoff));
    f.read(reinterpret_cast<char*>(sections.data()), static_cast<std::streamsize>(sections.size() * sizeof(Elf64_Shdr)));
    std::string names(sections.at(header.e_shstrndx).sh_size, '\0');
    f.seekg(static_cast<std::streamoff>(sections[header.e_shstrndx].sh_offset));
    f.read(names.data(), static_cast<std::streamsize>(names.size()));
    for (auto& s : sections) edit(s, s.sh_name < names.size() ? std::string(names.c_str() + s.sh_name) : std::string());
    f.seekp(static_cast<std::streamoff>(header.e_shoff));
    f.write(reinterpret_cast<const char*>(sections.data()), static_cast<std::streamsize>(sections.size() * sizeof(Elf64_Shdr)));
    return file;
  };
  loom::core::PluginRegistry registry;
  registry.set_log_refusals(false);
  // The entry section's name 1 MB past the names: nothing the loader needs (the entry symbol is
  // in the dynamic symbols, the note under its own name), so the plugin loads.
  const auto renamed = registry.load(damaged("libloom_dataset_renamed.so", [](Elf64_Shdr& s, const std::string& name) {
    if (name == "loom") s.sh_name += 1 << 20;
  }));
  EXPECT_FALSE(renamed.refusal) << renamed.refusal->line();
  // The symbol tables past the file's end: refused by name as damaged.
  const auto moved = registry.load(damaged("libloom_dataset_moved.so", [](Elf64_Shdr& s, const std::string&) {
    if (s.sh_type == SHT_DYNSYM || s.sh_type == SHT_SYMTAB) s.sh_offset += uint64_t{1} << 40;
  }));
  ASSERT_TRUE(moved.refusal);
  EXPECT_EQ(moved.refusal->stage, "static-check");
  EXPECT_NE(moved.refusal->reason.find("not a shared library of this platform (a damaged ELF file: "), std::string::npos)
      << moved.refusal->line();
  // Cut short (a copy that stopped): its segments past the end. It passed, and mapping it ended in
  // SIGBUS (in the scanner, said as its initializers' crash; with the scanner off, the process's).
  const fs::path cut = dir / "libloom_dataset_cut.so";
  fs::copy_file(kDir / "libloom_dataset_basic_counting.so", cut, fs::copy_options::overwrite_existing);
  fs::resize_file(cut, fs::file_size(cut) / 2);
  const auto short_one = registry.load(cut);
  ASSERT_TRUE(short_one.refusal);
  EXPECT_EQ(short_one.refusal->stage, "static-check");
  EXPECT_NE(short_one.refusal->reason.find("(a damaged ELF file: it is cut short: libloom_dataset_cut.so has "), std::string::npos)
      << short_one.refusal->line();
  fs::remove_all(dir);
}

TEST(PluginLoader, APluginsLogLineReachesTheTerminalWithoutItsControlCharacters) {
  // (an escape in a plugin's line set the terminal's colours, a carriage return wrote over Loom's
  // own line; the line's breaks and tabs are kept, and so is the text around them)
  const loom_host_api* api = loom::core::host_api();
  ::testing::internal::CaptureStderr();
  api->log(nullptr, LOOM_LOG_WARN, "od\x1b" "d", "bad\x1b[31mRED\rover\x7f \xc2\x9b x\ttab\nnext");
  loom::core::log::warn("host \x1b[2J line");
  api->log(nullptr, LOOM_LOG_WARN, "od", "file \xe2\x80\xaegpj.exe\xe2\x80\xa8 end");  // (U+202E reversed the rest)
  loom::core::log::flush();
  const std::string err = ::testing::internal::GetCapturedStderr();
  EXPECT_NE(err.find("[od?d] bad?[31mRED?over? ? x\ttab\nnext"), std::string::npos) << err;
  EXPECT_NE(err.find("host ?[2J line"), std::string::npos) << err;
  EXPECT_NE(err.find("[od] file ?gpj.exe? end"), std::string::npos) << err;
}

TEST(PluginLoader, CreatesAComponentAndCallsItAcrossTheBoundary) {
  auto dataset = shared_registry().create<loom::sdk::Dataset>("counting", {{"size", "5"}});
  ASSERT_NE(dataset, nullptr);
  dataset->setup();
  EXPECT_EQ(dataset->size(loom::sdk::Split::kTrain), 5);
  const auto batch = dataset->get_batch(loom::sdk::Split::kTrain, {1, 4});
  ASSERT_EQ(batch.count("input"), 1u);
  EXPECT_EQ(batch.at("input").sizes(), (std::vector<int64_t>{2, 3}));
  EXPECT_EQ(batch.at("input")[1][2].item<float>(), 6.0f);
  EXPECT_EQ(batch.at("target")[0].item<int64_t>(), 1);
  EXPECT_EQ(batch.at("target")[1].item<int64_t>(), 1);
  // An exception a component throws reaches the host as what it is.
  EXPECT_THROW(dataset->get_batch(loom::sdk::Split::kTrain, {5}), loom::Error);
}

TEST(PluginLoader, FactoryErrorsBecomeOneClearError) {
  try {
    shared_registry().create<loom::sdk::Dataset>("exploding");
    FAIL() << "expected loom::Error";
  } catch (const loom::Error& e) {
    const std::string message = e.what();
    EXPECT_NE(message.find("dataset 'exploding' could not be created"), std::string::npos) << message;
    EXPECT_NE(message.find("the planted failure of this test plugin"), std::string::npos) << message;
    EXPECT_NE(message.find("libloom_dataset_broken_factory_throws.so"), std::string::npos) << message;
  }
  try {
    shared_registry().create<loom::sdk::Dataset>("counting", {{"size", "-1"}});
    FAIL() << "expected loom::Error";
  } catch (const loom::Error& e) {
    EXPECT_NE(std::string(e.what()).find("size must be positive, got -1"), std::string::npos) << e.what();
  }
  // The registry is unharmed.
  EXPECT_NE(shared_registry().create<loom::sdk::Dataset>("counting"), nullptr);
}

TEST(PluginLoader, UnknownOptionIsRefusedBeforeTheFactoryRuns) {
  EXPECT_THROW(shared_registry().create<loom::sdk::Dataset>("counting", {{"sise", "3"}}), loom::Error);
}

TEST(PluginLoader, NamingARefusedComponentSaysWhy) {
  try {
    shared_registry().require(LOOM_KIND_DATASET, "broken_torch_version");
    FAIL();
  } catch (const loom::Error& e) {
    const std::string message = e.what();
    EXPECT_NE(message.find("its plugin was refused"), std::string::npos) << message;
    EXPECT_NE(message.find("LibTorch 1.13.1"), std::string::npos) << message;
  }
  // A file refused before its descriptor could be read is found by its name.
  try {
    shared_registry().require(LOOM_KIND_DATASET, "broken_not_elf");
    FAIL();
  } catch (const loom::Error& e) {
    EXPECT_NE(std::string(e.what()).find("[static-check]"), std::string::npos) << e.what();
  }
}

TEST(PluginLoader, NamingAMissingComponentListsWhatThereIs) {
  try {
    shared_registry().require(LOOM_KIND_DATASET, "countin");
    FAIL();
  } catch (const loom::Error& e) {
    const std::string message = e.what();
    EXPECT_NE(message.find("Did you mean 'counting'?"), std::string::npos) << message;
    EXPECT_NE(message.find(kDir.string()), std::string::npos) << message;
  }
  try {
    shared_registry().require(LOOM_KIND_MODEL, "gpt5");
    FAIL();
  } catch (const loom::Error& e) {
    EXPECT_NE(std::string(e.what()).find("No model plugin is loaded"), std::string::npos) << e.what();
  }
}

TEST(PluginLoader, ComponentsKeepTheirLibraryAliveAfterTheRegistryIsGone) {
  std::shared_ptr<loom::sdk::Dataset> dataset;
  {
    PluginRegistry registry;
    registry.set_log_refusals(false);
    registry.load(kDir / "libloom_dataset_basic_counting.so");
    dataset = registry.create<loom::sdk::Dataset>("counting", {{"size", "3"}});
  }
  EXPECT_EQ(dataset->get_batch(loom::sdk::Split::kTrain, {2}).at("input")[0][0].item<float>(), 2.0f);
}

TEST(PluginLoader, LoadingAFileTwiceIsHarmless) {
  PluginRegistry registry;
  const auto first = registry.load(kDir / "libloom_dataset_basic_counting.so");
  const auto second = registry.load(kDir / "libloom_dataset_basic_counting.so");
  EXPECT_TRUE(first.accepted);
  EXPECT_TRUE(second.accepted);
  EXPECT_EQ(registry.components().size(), 1u);
  EXPECT_TRUE(registry.refusals().empty());
}

TEST(PluginLoader, SearchPathHasTheNamedFoldersFirstThenTheEnvironmentThenTheFolderBesideTheExecutable) {
  ::setenv("LOOM_PLUGIN_PATH", "/tmp/a:/tmp/b", 1);
  const auto dirs = PluginRegistry::search_path({"/tmp/c"});
  ::unsetenv("LOOM_PLUGIN_PATH");
  ASSERT_EQ(dirs.size(), 4u);
  EXPECT_EQ(dirs[0], "/tmp/c");
  EXPECT_EQ(dirs[1], "/tmp/a");
  EXPECT_EQ(dirs[2], "/tmp/b");
  EXPECT_EQ(dirs[3].filename(), "plugins");
  for (const auto& d : dirs) EXPECT_NE(d, fs::current_path());
}

TEST(PluginLoader, ThePluginInAnEarlierFolderIsUsedAndItsCopyLaterIsPassedOverNotRefused) {
  // A new build in --plugin-dir of a plugin also installed: the installed copy loaded first and
  // refused the new build, with a warning at every command, so the run used the old code.
  const fs::path dir = fs::temp_directory_path() / ("loom_shadowed_" + std::to_string(::getpid()));
  fs::create_directories(dir / "new");
  fs::create_directories(dir / "installed");
  for (const char* folder : {"new", "installed"})
    fs::copy_file(kDir / "libloom_dataset_basic_counting.so", dir / folder / "libloom_dataset_basic_counting.so",
                  fs::copy_options::overwrite_existing);
  {
    PluginRegistry registry;
    loom::core::log::Capture capture;
    registry.scan(PluginRegistry::search_path({dir / "new", dir / "installed"}));
    const auto* used = registry.find(LOOM_KIND_DATASET, "counting");
    ASSERT_NE(used, nullptr);
    EXPECT_EQ(used->plugin->file, fs::weakly_canonical(dir / "new" / "libloom_dataset_basic_counting.so"));
    for (const auto& r : registry.refusals()) ADD_FAILURE() << "refused: " << r.line();
    ASSERT_EQ(registry.passed_over().size(), 1u);
    const auto& passed = registry.passed_over().front();
    EXPECT_EQ(passed.file, fs::weakly_canonical(dir / "installed" / "libloom_dataset_basic_counting.so"));
    EXPECT_NE(passed.reason.find("dataset 'counting' comes from " + used->plugin->file.string() +
                                 ", found earlier in the search order"),
              std::string::npos)
        << passed.reason;
    EXPECT_TRUE(capture.contains("passed over: dataset 'counting' comes from"));
  }
  {
    // A user's `progress` callback found before Loom's standard callbacks: it is the one used, and
    // the standard plugin's other callbacks still load (refused whole, it took checkpoint, best and
    // the rest with it: every run with the default callbacks failed).
    const fs::path overriding = fs::path(LOOM_BINARY_DIR) / "tests" / "overriding";
    const fs::path standard = fs::path(LOOM_BINARY_DIR) / "lib" / "loom" / "plugins" / "libloom_callback_standard.so";
    ASSERT_TRUE(fs::exists(standard)) << standard;
    PluginRegistry registry;
    registry.scan({overriding, standard});
    for (const auto& r : registry.refusals()) ADD_FAILURE() << "refused: " << r.line();
    const auto* progress = registry.find(LOOM_KIND_CALLBACK, "progress");
    ASSERT_NE(progress, nullptr);
    EXPECT_EQ(progress->plugin->file.filename(), "libloom_callback_overriding_progress.so");
    for (const char* name : {"checkpoint", "best", "jsonl"}) {
      const auto* c = registry.find(LOOM_KIND_CALLBACK, name);
      ASSERT_NE(c, nullptr) << name;
      EXPECT_EQ(c->plugin->file, fs::weakly_canonical(standard)) << name;
    }
    ASSERT_EQ(registry.passed_over().size(), 1u);
    EXPECT_EQ(registry.passed_over().front().components,
              (std::vector<std::pair<uint32_t, std::string>>{{LOOM_KIND_CALLBACK, "progress"}}));
    EXPECT_NE(registry.passed_over().front().reason.find("callback 'progress' comes from "), std::string::npos);
    EXPECT_NE(registry.passed_over().front().reason.find("; the file's other components are used"), std::string::npos);
    EXPECT_NE(registry.create<loom::sdk::Callback>("checkpoint"), nullptr);  // (loads the standard file for what it still provides)
    EXPECT_NE(registry.create<loom::sdk::Callback>("progress"), nullptr);
  }
  {
    // Two files of one folder that provide one name are still a mistake to fix: the second is refused.
    fs::copy_file(kDir / "libloom_dataset_basic_counting.so", dir / "new" / "libloom_dataset_counting_copy.so",
                  fs::copy_options::overwrite_existing);
    PluginRegistry registry;
    registry.set_log_refusals(false);
    registry.scan({dir / "new"});
    ASSERT_EQ(registry.refusals().size(), 1u);
    EXPECT_EQ(registry.refusals().front().stage, "register");
    EXPECT_TRUE(registry.passed_over().empty());
  }
  fs::remove_all(dir);
}

TEST(PluginLoader, AProgramIsRefusedAsAProgramNotInBoostsWords) {
  // /bin/ls is an ELF file of this machine, but an executable: the refusal says so, without
  // Boost's wrapping of dlopen's ("load() failed (dlerror system message: ...): Bad file
  // descriptor") and without the LibTorch hint meant for undefined symbols.
  PluginRegistry registry;
  registry.set_log_refusals(false);
  const auto report = registry.load("/bin/ls");
  ASSERT_TRUE(report.refusal);
  EXPECT_EQ(report.refusal->stage, "static-check") << report.refusal->line();
  EXPECT_NE(report.refusal->reason.find("a program, not a shared library"), std::string::npos) << report.refusal->line();
  EXPECT_EQ(report.refusal->reason.find("boost::dll"), std::string::npos) << report.refusal->line();
  EXPECT_NE(report.refusal->hint.find("it is a program, not a plugin"), std::string::npos) << report.refusal->line();
}

TEST(PluginLoader, AnUndefinedSymbolIsBlamedOnLibTorchOnlyWhereItIsLibTorchs) {
  // A C-tier plugin links no LibTorch, and its undefined C function was said to mean "built
  // against another LibTorch" (probe).
  const auto dl = [](const std::string& symbol) {
    return "boost::dll::shared_library::load() failed (dlerror system message: /p/libx.so: undefined symbol: " + symbol +
           "): Bad file descriptor";
  };
  const auto [why, hint] = loom::core::why_not_loaded("/p/libx.so", dl("no_such_fn"));
  EXPECT_EQ(why, "/p/libx.so: undefined symbol: no_such_fn");
  EXPECT_EQ(hint.find("LibTorch"), std::string::npos) << hint;
  EXPECT_NE(hint.find("no library the plugin links defines no_such_fn: link the one that does, or define it (`nm -D "
                      "--undefined-only /p/libx.so`"),
            std::string::npos) << hint;
  for (const std::string symbol : {"_ZN3c1019UndefinedTensorImpl10_singletonE", "_ZNK2at10TensorBase8toStringB5cxx11Ev",
                                   "_ZN5torch8autograd12VariableInfoC1Ev"}) {
    const auto torch = loom::core::why_not_loaded("/p/libx.so", dl(symbol)).second;
    EXPECT_NE(torch.find("an undefined symbol of LibTorch's means the plugin was built against another LibTorch"), std::string::npos)
        << symbol << ": " << torch;
  }
  // (a name of the plugin's own whose mangling holds "c10": no LibTorch's)
  for (const std::string symbol : {"_ZN3foo4Spec10initializeEv", "_ZN3fmt6format3runEv"}) {  // (foo::Spec::initialize(), fmt::format::run())
    const auto own = loom::core::why_not_loaded("/p/libx.so", dl(symbol)).second;
    EXPECT_NE(own.find("no library the plugin links defines " + symbol), std::string::npos) << own;
  }
}

TEST(PluginLoader, APathThatIsNoPluginFileIsRefusedByName) {
  // A missing path says so (not "not a shared library (iostream error)"); a folder or a FIFO is
  // refused before anything opens it, so reading it cannot hang.
  const fs::path dir = fs::temp_directory_path() / ("loom_loader_paths_" + std::to_string(::getpid()));
  fs::create_directories(dir);
  const fs::path fifo = dir / "libloom_fifo.so";
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0);
  fs::create_symlink("/dev/zero", dir / "libloom_device.so");
  fs::create_symlink(dir / "libloom_loop.so", dir / "libloom_loop.so");
  fs::create_symlink(dir / "nowhere", dir / "libloom_dangling.so");
  fs::create_directory(dir / "libloom_folder.so");
  PluginRegistry registry;
  registry.set_log_refusals(false);
  for (const auto& [path, reason] : std::vector<std::pair<fs::path, std::string>>{
           {dir / "libloom_missing.so", "no such file"},
           {dir, "a folder, not a plugin file"},
           {fifo, "a FIFO, not a plugin file"},
           {dir / "libloom_device.so", "a character device, not a plugin file"},
           {dir / "libloom_loop.so", "cannot be read (Too many levels of symbolic links)"},
           {dir / "libloom_dangling.so", "a symbolic link to nothing"}}) {
    const auto report = registry.load(path);
    EXPECT_FALSE(report.accepted) << path;
    ASSERT_TRUE(report.refusal) << path;
    EXPECT_EQ(report.refusal->stage, "static-check") << report.refusal->line();
    EXPECT_EQ(report.refusal->reason, reason) << report.refusal->line();
    EXPECT_EQ(report.refusal->file, path) << "named by the path it was found by, not a link's target";
  }
  // A link to a library that is no plugin (libloom_x.so -> some system library): the target is
  // refused, and the link is named too, as the user put it in the folder.
  fs::create_directory(dir / "links");
  fs::create_symlink(kDir / "libloom_dataset_broken_no_entry.so", dir / "links" / "libloom_linked.so");
  const auto linked = registry.load(dir / "links" / "libloom_linked.so");
  ASSERT_TRUE(linked.refusal);
  EXPECT_NE(linked.refusal->line().find("no entry symbol"), std::string::npos) << linked.refusal->line();
  EXPECT_NE(linked.refusal->line().find("(found as " + (dir / "links" / "libloom_linked.so").string() + ")"), std::string::npos)
      << linked.refusal->line();
  // In a plugin folder, each of them is refused by name too, not passed over in silence (and the
  // scanner, which would block on the FIFO, opens none of them).
  PluginRegistry scanned;
  scanned.set_log_refusals(false);
  scanned.scan({dir});
  std::vector<std::string> refused;
  for (const auto& r : scanned.refusals()) refused.push_back(r.file.filename().string());
  std::sort(refused.begin(), refused.end());
  EXPECT_EQ(refused, (std::vector<std::string>{"libloom_dangling.so", "libloom_device.so", "libloom_fifo.so",
                                               "libloom_folder.so", "libloom_loop.so"}));
  fs::remove_all(dir);
}

}  // namespace
