// Configuration: INI inheritance, precedence, cycles, unknown-key suggestions, type errors.
#include <loom/core/config.hpp>
#include <loom/core/error.hpp>
#include <loom/core/files.hpp>
#include <loom/core/log.hpp>
#include <loom/core/plugin_registry.hpp>
#include <loom/core/text.hpp>

#include "trainer_testing.hpp"

#include <gtest/gtest.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <regex>

namespace fs = std::filesystem;
using namespace loom::core;

namespace {

class ConfigTest : public testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() / ("loom_config_test_" + std::to_string(::getpid()) + "_" +
                                        testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(dir_);
    fs::create_directories(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }

  fs::path write(const std::string& name, const std::string& text) {
    const fs::path p = dir_ / name;
    fs::create_directories(p.parent_path());
    std::ofstream(p) << text;
    return p;
  }

  static std::string error_of(const std::function<void()>& f) {
    try {
      f();
    } catch (const loom::Error& e) {
      return e.what();
    }
    return "(no error)";
  }

  fs::path dir_;
};

TEST_F(ConfigTest, ChildOverridesItsBaseAndRemembersWhereEachValueCameFrom) {
  write("base.ini", "# shared defaults\n[trainer]\nbatch_size = 64\nlr = 0.1\n");
  const auto child = write("exp/child.ini", "base = ../base.ini\n\n[trainer]\nbatch_size = 32  # smaller\n");
  Config config;
  config.load_file(child);
  EXPECT_EQ(config.get("trainer.batch_size"), "32");
  EXPECT_EQ(config.get("trainer.lr"), "0.1");
  EXPECT_EQ(config.find("trainer.batch_size")->origin.line, 4);
  EXPECT_EQ(config.find("trainer.lr")->origin.line, 4);
  EXPECT_EQ(config.find("trainer.lr")->origin.file.filename(), "base.ini");
  EXPECT_CONTAINS(config.find("trainer.batch_size")->origin.describe(), "child.ini:4");
  ASSERT_EQ(config.files().size(), 2u);
  EXPECT_EQ(config.files()[0].filename(), "child.ini");
  EXPECT_EQ(config.files()[1].filename(), "base.ini");
}

TEST_F(ConfigTest, SeveralBasesApplyInOrderAndBasesChain) {
  write("a.ini", "[trainer]\nlr = 1\nseed = 1\n");
  write("b.ini", "base = a.ini\n[trainer]\nlr = 2\n");
  write("c.ini", "[trainer]\nepochs = 3\nlr = 3\n");
  const auto top = write("top.ini", "base = b.ini, c.ini\n[trainer]\nseed = 4\n");
  Config config;
  config.load_file(top);
  EXPECT_EQ(config.get("trainer.lr"), "3");      // c after b
  EXPECT_EQ(config.get("trainer.seed"), "4");    // the file itself after its bases
  EXPECT_EQ(config.get("trainer.epochs"), "3");
  // One file whose name holds a comma is that file (it was read as bases 'b' and 'c.ini').
  write("b,c.ini", "[trainer]\nlr = 5\n");
  Config comma;
  comma.load_file(write("comma.ini", "base = b,c.ini\n"));
  EXPECT_EQ(comma.get("trainer.lr"), "5");
}

TEST_F(ConfigTest, LaterFilesThenAliasesThenSetWin) {
  const auto one = write("one.ini", "[trainer]\nbatch_size = 8\nlr = 0.5\nseed = 1\n");
  const auto two = write("two.ini", "[trainer]\nbatch_size = 16\n");
  Config config;
  config.load_file(one);
  config.load_file(two);
  EXPECT_EQ(config.get("trainer.batch_size"), "16");
  config.set("trainer.batch_size", "64", Origin{"--batch-size", {}, 0});
  config.set_assignment("trainer.batch_size=128");
  EXPECT_EQ(config.get("trainer.batch_size"), "128");
  EXPECT_EQ(config.find("trainer.batch_size")->origin.describe(), "--set");
  EXPECT_EQ(config.get("trainer.lr"), "0.5");
}

TEST_F(ConfigTest, InheritanceCycleIsReportedWithTheChain) {
  write("a.ini", "base = b.ini\n[trainer]\nlr = 1\n");
  write("b.ini", "base = a.ini\n");
  Config config;
  const std::string message = error_of([&] { config.load_file(dir_ / "a.ini"); });
  EXPECT_CONTAINS(message, "config inheritance cycle");
  EXPECT_CONTAINS(message, "a.ini -> ");
  EXPECT_CONTAINS(message, "b.ini -> ");
  const auto self = write("self.ini", "base = self.ini\n");
  EXPECT_CONTAINS(error_of([&] { Config c; c.load_file(self); }), "self.ini names itself as its base; name another file");
  // A debug.ini of the user's own that extends Loom's debug by its bare name: that one, not itself
  // (it was "config inheritance cycle: debug.ini -> debug.ini").
  const auto mine = write("debug.ini", "base = debug\n[trainer]\nmax_steps = 9\n");
  Config c;
  c.load_file(mine);
  EXPECT_EQ(c.find("trainer.max_steps")->value, "9");
  EXPECT_EQ(c.find("model.flavour")->value, "debug") << "Loom's debug.ini read as the base";
}

TEST_F(ConfigTest, AHugeKeyIsRefusedShortAndAKeyRepeatedManyTimesIsSaidAScreenfulOnly) {
  const auto huge = write("huge.ini", "[trainer]\n" + std::string(100000, 'x') + " = 1\n");
  const std::string m = error_of([&] { Config c; c.load_file(huge); });
  EXPECT_CONTAINS(m, "huge.ini:2: a key of 100008 characters (trainer.xxx");
  EXPECT_CONTAINS(m, "xxx...); keys are at most 256");
  EXPECT_LT(m.size(), 400u);
  std::string text = "[trainer]\n";
  for (int i = 0; i < 50; ++i) text += "lr = 0." + std::to_string(i + 1) + "\n";
  const auto repeated = write("repeated.ini", text);
  log::Capture capture(LOOM_LOG_WARN);
  Config c;
  c.load_file(repeated);
  EXPECT_EQ(c.find("trainer.lr")->value, "0.50");
  const auto lines = capture.lines();
  EXPECT_EQ(std::count_if(lines.begin(), lines.end(), [](const std::string& l) { return l.find(" is set again ") != std::string::npos; }), 20);
  EXPECT_TRUE(capture.contains("repeated.ini: 29 more lines set a key again after those said; the last line of each key is used"));
}

TEST_F(ConfigTest, MissingBaseNamesTheLineThatAskedForIt) {
  const auto child = write("child.ini", "\nbase = nowhere.ini\n");
  const std::string message = error_of([&] { Config c; c.load_file(child); });
  EXPECT_CONTAINS(message, "nowhere.ini not found");
  EXPECT_CONTAINS(message, "child.ini:2");
  // A bare name that is not beside the file is one of Loom's configurations, as for -c; a URL is
  // named as one (it was read as the path "https:/...").
  const auto shipped = write("shipped.ini", "base = debug\n[trainer]\nlr = 1\n");
  Config from_shipped;
  from_shipped.load_file(shipped);
  EXPECT_TRUE(std::any_of(from_shipped.files().begin(), from_shipped.files().end(),
                          [](const fs::path& f) { return f.filename() == "debug.ini"; }));
  write("debug.ini", "[trainer]\nlr = 7\n");  // a debug.ini of the user's own beside it is the one meant
  Config own;
  own.load_file(shipped);
  EXPECT_EQ(own.get("trainer.lr"), "1");
  ASSERT_EQ(own.files().size(), 2u);  // the file, then its base: the one beside it, not Loom's (with its own base)
  EXPECT_EQ(own.files()[1], shipped.parent_path() / "debug.ini");
  // A folder beside it with the bare name (a run's outputs, say) is not the file meant: the .ini is,
  // and with none, Loom's own (it was "cannot read .../debug: not a regular file (a folder)").
  fs::create_directories(dir_ / "debug");
  Config beside_folder;
  beside_folder.load_file(shipped);
  EXPECT_EQ(beside_folder.files().at(1), shipped.parent_path() / "debug.ini");
  fs::remove(dir_ / "debug.ini");
  Config folder_only;
  folder_only.load_file(shipped);
  EXPECT_NE(folder_only.files().at(1).parent_path(), dir_);
  EXPECT_EQ(folder_only.get("data.name"), "synthetic");
  const auto url = write("url.ini", "base = https://example.com/x.ini\n");
  EXPECT_CONTAINS(error_of([&] { Config c; c.load_file(url); }), "url.ini:1: base = https://example.com/x.ini is a URL");
  // An empty base is a line left half-written, not "no base": named, not passed over.
  const auto empty = write("empty.ini", "base =\n[trainer]\nlr = 1\n");
  EXPECT_CONTAINS(error_of([&] { Config c; c.load_file(empty); }), "empty.ini:1: base is empty; name the file");
  // Two `base =` lines are not last-wins (both would be read, mixing two jobs): one error that
  // shows the one line that lists both.
  write("one.ini", "[trainer]\nlr = 1\n");
  write("two.ini", "[trainer]\nlr = 2\n");
  const auto twice = write("twice.ini", "base = one.ini\nbase = two.ini\n[trainer]\nseed = 1\n");
  EXPECT_CONTAINS(error_of([&] { Config c; c.load_file(twice); }),
                  "twice.ini:2: base is set again (line 1: one.ini); list every base on one line, base = one.ini, two.ini");
}

TEST_F(ConfigTest, ABaseReadForALaterFileThatOverridesAnEarlierFileIsSaid) {
  // -c mine.ini -c other.ini, other.ini building on common.ini: common.ini is read after mine.ini,
  // so its lr replaces mine's. That is the order (each file after its bases), and it is said.
  write("common.ini", "[trainer]\nlr = 0.002\nseed = 5\n");
  const auto mine = write("mine.ini", "[trainer]\nlr = 0.01\nseed = 5\n");
  const auto other = write("other.ini", "base = common.ini\n[trainer]\nepochs = 2\n");
  // The files loaded in order (as -c gives them): the value of trainer.lr, and the warnings.
  const auto load = [](std::initializer_list<fs::path> files, const std::string& set = "") {
    Config c;
    for (const auto& f : files) c.load_file(f);
    if (!set.empty()) c.set_assignment(set);
    return std::pair{*c.get("trainer.lr"), join(c.base_override_warnings(), "\n")};
  };
  const auto [lr, said] = load({mine, other});
  EXPECT_EQ(lr, "0.002");
  EXPECT_CONTAINS(said, "common.ini:2: trainer.lr = 0.002 replaces 0.01 from ");
  EXPECT_CONTAINS(said, "mine.ini:2, read before ");
  // (the fix names no edit of the file that names the base: it may be one of Loom's own)
  EXPECT_CONTAINS(said, "If 0.01 is meant, give --set trainer.lr=0.01 or set it in a -c file after ");
  // (a value of several words, quoted for the shell)
  const auto listed = write("listed.ini", "[trainer]\ncallbacks = progress, jsonl\n");
  const auto listing = write("listing.ini", "base = callbacks.ini\n");
  write("callbacks.ini", "[trainer]\ncallbacks = progress, checkpoint\n");
  Config lists;
  lists.load_file(listed);
  lists.load_file(listing);
  EXPECT_CONTAINS(join(lists.base_override_warnings(), "\n"), "give --set 'trainer.callbacks=progress, jsonl' or set it");
  EXPECT_EQ(said.find("seed"), std::string::npos) << "the same value replaces nothing: " << said;
  // A later file that sets the key itself, a -c file after it, or --set: the base's value does not
  // stay, and nothing is said; nor where it is the earlier value written otherwise (1e-2 and 0.01).
  const auto [own_lr, own_said] = load({mine, write("own.ini", "base = common.ini\n[trainer]\nlr = 0.5\n")});
  EXPECT_EQ(own_lr, "0.5");
  EXPECT_EQ(own_said, "");
  EXPECT_EQ(load({mine, other, write("last.ini", "[trainer]\nlr = 0.3\n")}).second, "");
  EXPECT_EQ(load({mine, other}, "trainer.lr=0.3").second, "");
  write("same.ini", "[trainer]\nlr = 1e-2\n");
  EXPECT_EQ(load({mine, write("other2.ini", "base = same.ini\n")}).second, "");

  // A file's own bases, later overriding earlier (base = b, c), and a later -c file overriding
  // an earlier one: the order meant, said by nobody.
  write("b.ini", "[trainer]\nlr = 1\n");
  write("c.ini", "[trainer]\nlr = 2\n");
  const auto [meant, quiet] = load({write("top.ini", "base = b.ini, c.ini\n[trainer]\nseed = 4\n"),
                                    write("later.ini", "[trainer]\nlr = 3\n")});
  EXPECT_EQ(meant, "3");
  EXPECT_EQ(quiet, "");

  // The same option written another way later (a component's shorthand over the base's full key):
  // that value is in force, nothing is said; without it the base's full key is said.
  Schema schema = core_schema();
  schema.add("memory.tiny", "memory policy 'tiny'", {OptionSpec{"margin", LOOM_OPTION_FLOAT, "0.1", "", "", {}, {}}});
  schema.add_shorthand("memory.margin", "memory.tiny.margin");
  write("full.ini", "[memory.tiny]\nmargin = 0.3\n");
  const auto first = write("first.ini", "[memory.tiny]\nmargin = 0.2\n");
  Config by_base;
  by_base.load_file(first);
  by_base.load_file(write("by_base.ini", "base = full.ini\n"));
  EXPECT_CONTAINS(join(by_base.base_override_warnings(&schema), "\n"), "memory.tiny.margin = 0.3 replaces 0.2");
  Config by_shorthand;
  by_shorthand.load_file(first);
  by_shorthand.load_file(write("shorthand.ini", "base = full.ini\n[memory]\nmargin = 0.4\n"));
  EXPECT_EQ(join(by_shorthand.base_override_warnings(&schema), "\n"), "");
}

TEST_F(ConfigTest, ResolveRunSaysABasesOverrideOfTheValuesAsGivenAndNotOneAShorthandReplaced) {
  // What loom train and loom config show call: the same warnings, with the run's shorthands, of
  // the values as the files give them (precision.name = auto, which resolve_run then replaces).
  write("amp.ini", "[precision]\nname = auto\n[model.lightweight_transformer]\nd_model = 64\n");
  const auto mine = write("mine_run.ini", "[precision]\nname = fp32\n[model.lightweight_transformer]\nd_model = 32\n"
                                          "[model]\nname = lightweight_transformer\n[data]\nname = synthetic\n"
                                          "[trainer]\ndevice = cpu\n");
  const auto said = [&](const fs::path& later) {
    Config c;
    c.load_file(mine);
    c.load_file(later);
    loom::core::log::Capture capture(LOOM_LOG_WARN);
    resolve_run(c, loom::testing::registry());
    return join(capture.lines(), "\n");
  };
  const std::string both = said(write("later_run.ini", "base = amp.ini\n"));
  EXPECT_CONTAINS(both, "precision.name = auto replaces fp32");
  EXPECT_CONTAINS(both, "model.lightweight_transformer.d_model = 64 replaces 32");
  const std::string one = said(write("later_short.ini", "base = amp.ini\n[model]\nd_model = 48\n"));
  EXPECT_CONTAINS(one, "precision.name = auto replaces fp32");
  EXPECT_EQ(one.find("d_model = 64 replaces"), std::string::npos) << one;  // (validate says the two spellings)
  // And before an error the value caused: the warning that explains it comes first.
  write("cuda.ini", "[trainer]\ndevice = cuda:99\n");
  Config c;
  c.load_file(mine);
  c.load_file(write("later_cuda.ini", "base = cuda.ini\n"));
  loom::core::log::Capture capture(LOOM_LOG_WARN);
  EXPECT_THROW(resolve_run(c, loom::testing::registry()), std::exception);
  EXPECT_TRUE(capture.contains("trainer.device = cuda:99 replaces cpu")) << join(capture.lines(), "\n");
}

TEST_F(ConfigTest, NoAmpBesideAMixedPrecisionByNameIsRefused) {
  // --no-amp asks for float32; precision.name = bf16_amp would win without a word.
  Config c;
  for (const char* kv : {"model.name=lightweight_transformer", "data.name=synthetic", "trainer.device=cpu",
                         "precision.name=bf16_amp"})
    c.set_assignment(kv);
  c.set("precision.amp", "false", Origin{"--no-amp", {}, 0});
  std::string m = "(no error)";
  try {
    resolve_run(c, loom::testing::registry());
  } catch (const std::exception& e) {
    m = e.what();
  }
  EXPECT_CONTAINS(m, "precision.name = bf16_amp (--set) trains with autocast, but precision.amp = false (--no-amp) asks "
                     "for float32: drop one of the two (precision.name = auto with --no-amp trains in fp32)");
  c.set_assignment("precision.name=auto");  // the seeds' way: float32
  EXPECT_NO_THROW(resolve_run(c, loom::testing::registry()));
}

TEST_F(ConfigTest, AShortKeyOfSeveralUnselectedComponentsNamesThemAll) {
  // model.vocab_size is an option of both GPT-2 models; a run of the lightweight transformer
  // ignores it, and says whose it is, not the first model's only.
  Config c;
  for (const char* kv : {"model.name=lightweight_transformer", "data.name=synthetic", "trainer.device=cpu",
                         "model.vocab_size=5"})
    c.set_assignment(kv);
  loom::core::log::Capture capture(LOOM_LOG_WARN);
  resolve_run(c, loom::testing::registry());
  const std::string said = join(capture.lines(), "\n");
  EXPECT_CONTAINS(said, "model.vocab_size is an option of model 'gpt2_");
  EXPECT_CONTAINS(said, "model 'gpt2_lm'");
  EXPECT_CONTAINS(said, "model 'gpt2_recommender'");
  EXPECT_CONTAINS(said, ", neither of which this run selects (model.name = lightweight_transformer); ignored");
}

TEST_F(ConfigTest, BasesNamedTwiceTooDeepOrReadTooOftenAreOneError) {
  write("x.ini", "[trainer]\nlr = 1\n");
  const auto twice = write("twice.ini", "base = x.ini, x.ini\n");
  EXPECT_CONTAINS(error_of([&] { Config c; c.load_file(twice); }), "twice.ini:1: base names x.ini twice; name it once");
  // The same file written two ways: its path, and the two ways the user wrote.
  const auto two_ways = write("two_ways.ini", "base = x.ini, ./x.ini\n");
  EXPECT_CONTAINS(error_of([&] { Config c; c.load_file(two_ways); }), "x.ini twice (x.ini, ./x.ini); name it once");
  // 40 files, each the base of the one before.
  for (int i = 0; i < 40; ++i)
    write("deep" + std::to_string(i) + ".ini", i == 39 ? "[trainer]\nlr = 1\n" : "base = deep" + std::to_string(i + 1) + ".ini\n");
  EXPECT_CONTAINS(error_of([&] { Config c; c.load_file(dir_ / "deep0.ini"); }), "bases 32 deep");
  // Twelve levels of diamonds: 2^12 reads of the last file, refused after 512 (it took minutes).
  // (built with append: GCC 12 warned -Wrestrict, falsely, on these names built with +)
  const auto ini = [](const char* prefix, int i) { return std::string(prefix).append(std::to_string(i)).append(".ini"); };
  for (int i = 0; i < 12; ++i) {
    const std::string next = ini("d", i + 1);
    write(ini("d", i), "base = " + ini("l", i) + ", " + ini("r", i) + "\n");
    write("l" + std::to_string(i) + ".ini", "base = " + next + "\n");
    write("r" + std::to_string(i) + ".ini", "base = " + next + "\n");
  }
  write("d12.ini", "[trainer]\nlr = 1\n");
  EXPECT_CONTAINS(error_of([&] { Config c; c.load_file(dir_ / "d0.ini"); }), "more than 512 configuration files read");
  // Ten files naming one base of 8 MiB: within both counts, 80 MiB read (250 such files took
  // minutes, six 16 MiB files in a chain held 4 GB): refused past 64 MiB.
  std::string big = "[trainer]\n";
  while (big.size() < (8u << 20)) big += "lr = 0.01\n";
  write("big.ini", big);
  std::string many = "base = ";
  for (int i = 0; i < 10; ++i) {
    write(ini("m", i), "base = big.ini\n");
    many += (i ? ", " : "") + ini("m", i);
  }
  const auto top = write("many.ini", many + "\n");
  EXPECT_CONTAINS(error_of([&] { Config c; c.load_file(top); }), "the configuration files read come to more than 64 MiB");
  Config seven;
  seven.load_file(dir_ / "m0.ini");  // (8 MiB once is a configuration, if an odd one)
  EXPECT_EQ(seven.find("trainer.lr")->value, "0.01");
}

TEST_F(ConfigTest, MalformedLinesAndKeysOutsideSectionsAreErrors) {
  const auto bad = write("bad.ini", "[trainer]\nlr = 1\nthis line has no equals sign\n");
  EXPECT_CONTAINS(error_of([&] { Config c; c.load_file(bad); }), "bad.ini:3: not a `key = value`");
  const auto loose = write("loose.ini", "lr = 1\n[trainer]\n");
  EXPECT_CONTAINS(error_of([&] { Config c; c.load_file(loose); }), "loose.ini:1: key 'lr' is outside any section");
  // A key ending in a vertical tab or a form feed: its errors named line 0 (the line finder trimmed
  // what Program_options keeps).
  const auto control = write("control.ini", "[trainer]\nlr = 1\nmax_steps\v= 3\n");
  EXPECT_CONTAINS(error_of([&] { Config c; c.load_file(control); }), "control.ini:3: the key 'trainer.max_steps");
  EXPECT_CONTAINS(error_of([&] { Config c; c.load_file(control); }), "holds a control character (byte 0x0b)");
  Config config;
  EXPECT_CONTAINS(error_of([&] { config.set_assignment("batch_size=3"); }), "expected section.key=value");
  EXPECT_CONTAINS(error_of([&] { config.set_assignment("trainer.lr"); }), "expected section.key=value");
}

TEST_F(ConfigTest, AHashRightAfterAValueAndCarriageReturnOnlyLinesAreRefusedNotReadAsSomethingElse) {
  // `work_dir = exp#2` wrote the run to exp, and `root = set#2` trained on another folder, in
  // silence; a '#' after a space is a comment, as before.
  const auto hash = write("hash.ini", "[trainer]\nlr = 0.5 # the peak\nwork_dir = exp#2\n");
  EXPECT_CONTAINS(error_of([&] { Config c; c.load_file(hash); }),
                  "hash.ini:3: '#' starts a comment, even inside a value, so `work_dir = exp` would be all of it. Put a "
                  "space before a comment's '#'; a value with '#' in it goes on the command line (--set KEY=VALUE)");
  const auto fine = write("fine.ini", "# a note\n[trainer] # the trainer\nlr = 0.5 # the peak\nname =# none\n");
  Config c;
  c.load_file(fine);
  EXPECT_EQ(c.find("trainer.lr")->value, "0.5");
  Config given;
  given.set_assignment("trainer.work_dir=exp#2");
  EXPECT_EQ(given.find("trainer.work_dir")->value, "exp#2");
  // Lines ended by a carriage return alone read as one line, and the error named a file of the
  // whole text ("config file debug[trainer]max_steps = 3 not found").
  const auto mac = write("mac.ini", "base = debug\r[trainer]\rmax_steps = 3\r");
  EXPECT_CONTAINS(error_of([&] { Config m; m.load_file(mac); }),
                  "mac.ini ends its lines with a carriage return alone (classic Mac OS), which reads as one line");
  // A value in quotes kept them: a folder named "my runs" with its quotes, in silence.
  const auto quoted = write("quoted.ini", "[trainer]\n# a \"note\" = x\nwork_dir = \"my runs\"\n");
  EXPECT_CONTAINS(error_of([&] { Config q; q.load_file(quoted); }),
                  "quoted.ini:3: `work_dir = \"my runs\"`: a value is read as written, quotes and all (INI takes none); "
                  "write it without them: work_dir = my runs");
  // Windows' "Unicode" (UTF-16) was "line 2: not a `key = value` line".
  const auto utf16 = write("utf16.ini", std::string("\xFF\xFE[\0t\0]\0\n\0", 10));
  EXPECT_CONTAINS(error_of([&] { Config u; u.load_file(utf16); }), "utf16.ini is UTF-16 text (Windows' \"Unicode\"); save it as UTF-8");
  // A run's config.json given to -c was "config.json:1: not a `key = value` ... line".
  fs::create_directories(dir_ / "runs" / "r1");
  const fs::path record = dir_ / "runs" / "r1" / "config.json";
  std::ofstream(record) << "{\n  \"trainer.lr\": {\"value\": \"0.1\", \"origin\": \"--set\"}\n}\n";
  EXPECT_CONTAINS(error_of([&] { Config r; r.load_file(record); }),
                  "config.json is JSON, not INI: a run's record of its configuration. Continue that run with: loom train "
                  "--resume auto --set trainer.work_dir=" + (dir_ / "runs").string() + " --set trainer.name=r1; or save its "
                  "settings as INI, for a new run like it: loom config show --resume auto --set trainer.work_dir=" +
                      (dir_ / "runs").string() + " --set trainer.name=r1 > run.ini, then loom train -c run.ini --set "
                                                 "trainer.name=NEW_NAME");
  // In a base, the error names the file whose `base =` read it (the user ran -c run.ini).
  const auto run = write("run.ini", "# mine\nbase = quoted.ini\n");
  EXPECT_CONTAINS(error_of([&] { Config r; r.load_file(run); }),
                  "write it without them: work_dir = my runs (named by `base` at ");
  EXPECT_CONTAINS(error_of([&] { Config r; r.load_file(run); }), "run.ini:2)");
}

TEST_F(ConfigTest, AValueIsOneLineOfTextOfSensibleLength) {
  // A NUL cut the message at the value; a 10 MB value was echoed whole; a byte order mark made
  // the first line "not a key = value line".
  const auto nul = write("nul.ini", std::string("[trainer]\nmax_steps = 5\0abc\n", 28));
  EXPECT_CONTAINS(error_of([&] { Config c; c.load_file(nul); }),
                  "nul.ini:2: trainer.max_steps holds a control character (byte 0x00 at position 2); a value is one line of text");
  const auto huge = write("huge.ini", "[data]\npath = " + std::string(10 << 20, 'x') + "\n");
  const std::string m = error_of([&] { Config c; c.load_file(huge); });
  EXPECT_CONTAINS(m, "huge.ini:2: data.path has a value of 10485760 bytes; values are at most 65536");
  EXPECT_LT(m.size(), 300u);
  Config c;
  EXPECT_CONTAINS(error_of([&] { c.set_assignment("trainer.name=a\x1b[2Jb"); }),
                  "--set: trainer.name holds a control character (byte 0x1b at position 2)");
  // A key's escape sequence reached the terminal in its "unknown key" error (it set the title).
  const std::string key_error = error_of([&] { c.set_assignment("trainer.ma\x1b]0;pwned\ax=1"); });
  EXPECT_CONTAINS(key_error, "--set: a key holds a control character (byte 0x1b at position 11)");
  EXPECT_EQ(key_error.find('\x1b'), std::string::npos) << "the escape is not echoed";
  // A value need not be UTF-8 (a path named in Latin-1, for `loom eval`); a run that records it
  // refuses it (RunFolderTest). A key must be.
  EXPECT_NO_THROW(c.set_assignment("data.root=/data/caf\xe9"));
  EXPECT_CONTAINS(error_of([&] { c.set_assignment("trainer.caf\xe9=1"); }), "--set: a key that is not UTF-8 text");
  // A --set key had no limit, as a file's has: a 120 KB one was echoed whole.
  const std::string long_key = error_of([&] { c.set_assignment(std::string("trainer.").append(120000, 'x').append("=1")); });
  EXPECT_CONTAINS(long_key, "--set: a key of 120008 characters (trainer.xxxx");
  EXPECT_LT(long_key.size(), 300u);
  const auto bom = write("bom.ini", "\xEF\xBB\xBF[trainer]\nmax_steps = 7\n");
  Config with_bom;
  with_bom.load_file(bom);
  EXPECT_EQ(with_bom.get("trainer.max_steps"), "7");
  // A file whose size the kernel gives as 0 is read to its end: /proc/self/status is no config
  // (it was read as an empty one), and says so at its first line.
  if (fs::exists("/proc/self/status")) {
    EXPECT_CONTAINS(error_of([&] { Config p; p.load_file("/proc/self/status"); }), "status:1: not a `key = value`");
  }
}

TEST_F(ConfigTest, ThousandsOfProblemsAreTwentyLinesAndACount) {
  // Another kind of file given as a configuration: the first 20 problems, then how many more.
  std::string text = "[trainer]\n";
  for (int i = 0; i < 1000; ++i) text.append("k").append(std::to_string(i)).append(" = 1\n");  // (GCC 12's -Wrestrict misreads "k" + ...)
  const std::string message = error_of([&] {
    Config c;
    c.load_file(write("many.ini", text));
    validate(c, core_schema());
  });
  EXPECT_CONTAINS(message, "\n  ... and 980 more; is this the configuration file meant?");
  EXPECT_EQ(std::count(message.begin(), message.end(), '\n'), 21) << message.substr(0, 2000);
}

TEST_F(ConfigTest, UnknownKeyNamesItsFileLineAndTheClosestValidKey) {
  const auto file = write("run.ini", "[trainer]\nlr = 0.1\n\nbatch_szie = 32\n");
  Config config;
  config.load_file(file);
  const std::string message = error_of([&] { validate(config, core_schema()); });
  EXPECT_CONTAINS(message, "run.ini:4: unknown key 'trainer.batch_szie'; did you mean 'trainer.batch_size'?");
  // `base` written under a section is that section's key: said where it belongs.
  const auto late = write("late.ini", "[trainer]\nlr = 0.1\nbase = run.ini\n");
  Config late_base;
  late_base.load_file(late);
  EXPECT_CONTAINS(error_of([&] { validate(late_base, core_schema()); }),
                  "late.ini:3: unknown key 'trainer.base'; `base = ...` names the files this one builds on, on a line "
                  "before the first [section]");
  // Case aside, and the keys a flag sets: trainer.MAX_STEPS and memory.fractoin named no key.
  Config typos;
  typos.set_assignment("trainer.MAX_STEPS=3");
  typos.set_assignment("memory.fractoin=0.5");
  const std::string said = error_of([&] { validate(typos, core_schema()); });
  EXPECT_CONTAINS(said, "unknown key 'trainer.MAX_STEPS'; did you mean 'trainer.max_steps'?");
  EXPECT_CONTAINS(said, "unknown key 'memory.fractoin'; did you mean 'memory.fraction'?");
  // Another framework's name for an option is no typo of Loom's, but it is that option.
  Config theirs;
  theirs.set_assignment("trainer.learning_rate=3e-4");
  theirs.set_assignment("trainer.max_epochs=3");
  const std::string named = error_of([&] { validate(theirs, core_schema()); });
  EXPECT_CONTAINS(named, "unknown key 'trainer.learning_rate'; did you mean 'trainer.lr'?");
  EXPECT_CONTAINS(named, "unknown key 'trainer.max_epochs'; did you mean 'trainer.epochs'?");
  Config hf;
  hf.set_assignment("precision.name=fp32");
  hf.set_assignment("trainer.schedule=constant");
  hf.set_assignment("trainer.save_steps=10");
  hf.set_assignment("trainer.warmup_steps=10");
  hf.set_assignment("model.lightweight_transformer.zzzzqqqq=1");
  const std::string hf_said = error_of([&] { validate(hf, run_schema(hf, loom::testing::registry())); });
  EXPECT_CONTAINS(hf_said, "unknown key 'trainer.save_steps'; did you mean 'trainer.checkpoint_every'?");
  // (warmup_steps is no typo of max_steps; a long section's name made any key of it "close")
  EXPECT_EQ(hf_said.find("'trainer.warmup_steps'; did you mean"), std::string::npos) << hf_said;
  EXPECT_EQ(hf_said.find("'model.lightweight_transformer.zzzzqqqq'; did you mean"), std::string::npos) << hf_said;
  // A key in the wrong section: the section that has it (its shorthand), whatever its case.
  Config misplaced;
  misplaced.set_assignment("precision.name=fp32");
  misplaced.set_assignment("trainer.schedule=constant");
  misplaced.set_assignment("trainer.weight_decay=0.1");
  misplaced.set_assignment("model.lr=0.1");
  misplaced.set_assignment("optimizer.LEARNING_RATE=0.1");
  misplaced.set_assignment("training.lr=0.1");
  misplaced.set_assignment("model.batch_size=4");
  misplaced.set_assignment("trainer.wd=0.1");
  const std::string where = error_of([&] { validate(misplaced, run_schema(misplaced, loom::testing::registry())); });
  EXPECT_CONTAINS(where, "unknown key 'trainer.weight_decay'; did you mean 'optimizer.weight_decay'? ([trainer] has no weight_decay)");
  EXPECT_CONTAINS(where, "unknown key 'model.lr'; did you mean 'trainer.lr'? ([model] has no lr)");
  EXPECT_CONTAINS(where, "unknown key 'optimizer.LEARNING_RATE'; did you mean 'trainer.lr'?");
  EXPECT_CONTAINS(where, "unknown section [training] (key 'training.lr'); did you mean 'trainer.lr'?");
  // (the same name in another section beats a typo in this one: model.batch_size is not patch_size)
  EXPECT_CONTAINS(where, "unknown key 'model.batch_size'; did you mean 'trainer.batch_size'?");
  EXPECT_CONTAINS(where, "unknown key 'trainer.wd'; did you mean 'optimizer.weight_decay'?");
  // A plugin's text printed as one line: no line break, no terminal escape, bounded.
  EXPECT_EQ(loom::core::printable("a\nb\x1b[31mc", 300), "a b [31mc");
  EXPECT_EQ(loom::core::printable("Evil \u202eTITLE \u2066x\u2069 \u00e9\u2028", 300), "Evil  TITLE  x  \u00e9 ");  // (a title's reordering)
  EXPECT_EQ(loom::core::printable(std::string(5000, 'x'), 300).size(), 300u);
  // Nothing close: the section's keys, each once (those a flag sets were listed twice).
  Config far;
  far.set_assignment("trainer.zzzzzzzzzzzz=1");
  const std::string listed = error_of([&] { validate(far, core_schema()); });
  EXPECT_CONTAINS(listed, "unknown key 'trainer.zzzzzzzzzzzz'; [trainer] has ");
  for (const char* key : {"trainer.batch_size", "trainer.work_dir", "trainer.gradient_accumulation_steps"}) {
    const auto first = listed.find(key);
    EXPECT_NE(first, std::string::npos) << key << " in " << listed;
    EXPECT_EQ(listed.find(key, first + 1), std::string::npos) << key << " listed twice: " << listed;
  }
}

TEST_F(ConfigTest, UnknownSectionSuggestsTheClosestSection) {
  Config config;
  config.set_assignment("trainr.lr=0.1");
  EXPECT_CONTAINS(error_of([&] { validate(config, core_schema()); }),
                  "--set: unknown section [trainr] (key 'trainr.lr'); did you mean [trainer]?");
}

TEST_F(ConfigTest, FarOffKeyListsTheSectionsKeys) {
  Config config;
  config.set_assignment("parallel.zzzzzzzz=1");
  EXPECT_CONTAINS(error_of([&] { validate(config, core_schema()); }), "[parallel] has parallel.bucket_mb, parallel.name");
}

TEST_F(ConfigTest, BadValuesNameTheKeyTheValueAndWhatWasExpected) {
  const auto file = write("run.ini",
                          "[trainer]\nbatch_size = big\nresume = later\nuse_scheduler = maybe\nlr = 1e-3\n"
                          "keep_last = 99999999999999999999\n[memory]\ndevice_memory_limit = 2 GiB\n"
                          "policies = auto_batch,,oom_recovery\n[trainer]\nclip_grad_norm = 0x10\ncallbacks = ,\nseed = 3 ; tuned\n");
  Config config;
  config.load_file(file);
  const std::string message = error_of([&] { validate(config, core_schema()); });
  // All problems at once, each with its place.
  EXPECT_CONTAINS(message, "run.ini:2: trainer.batch_size = 'big' is not valid: expected an integer in [1, 16777216]");
  // an integer past 64 bits is not parsed at all: the message still gives the range
  EXPECT_CONTAINS(message, "run.ini:6: trainer.keep_last = '99999999999999999999' is not valid: expected an integer in [0, 1000000]");
  EXPECT_CONTAINS(message, "run.ini:3: trainer.resume = 'later' is not valid: expected one of none, auto");
  EXPECT_CONTAINS(message, "run.ini:4: trainer.use_scheduler = 'maybe' is not valid: expected a boolean");
  // (INI files elsewhere, Python's configparser among them, may take "; ..." for a comment)
  EXPECT_CONTAINS(message, "run.ini:13: trainer.seed = '3 ; tuned' is not valid: expected an integer in [0, ");
  EXPECT_CONTAINS(message, "(';' starts no comment in a value: '#' does)");
  // a stray comma would drop an item in silence; a hexadecimal number is not a setting's number
  EXPECT_CONTAINS(message, "run.ini:9: memory.policies = 'auto_batch,,oom_recovery' has an empty item (a stray comma); "
                           "write the items with one comma between each, e.g. 'auto_batch, oom_recovery'");
  EXPECT_CONTAINS(message, "run.ini:11: trainer.clip_grad_norm = '0x10' is not valid: expected a finite number");
  // (an empty list's advice was "e.g. ''")
  EXPECT_CONTAINS(message, "run.ini:12: trainer.callbacks = ',' has an empty item (a stray comma); an empty list is "
                           "written with nothing after the =, e.g. trainer.callbacks =");
  EXPECT_EQ(message.find("trainer.lr"), std::string::npos) << message;
  EXPECT_EQ(message.find("device_memory_limit"), std::string::npos) << message;
}

TEST_F(ConfigTest, ResolvedConfigurationHasEveryKeyWithItsOrigin) {
  const auto file = write("run.ini", "[trainer]\nmax_steps = 300\n");
  Config config;
  config.load_file(file);
  config.set("trainer.batch_size", "64", Origin{"--batch-size", {}, 0});
  const Schema schema = core_schema();
  const Resolved resolved = validate(config, schema);
  EXPECT_EQ(resolved.size(), schema.keys().size());
  EXPECT_EQ(resolved.at("trainer.max_steps").value, "300");
  EXPECT_EQ(resolved.at("trainer.lr").origin.describe(), "default");
  const std::string shown = format_resolved(resolved, schema);
  EXPECT_CONTAINS(shown, "[trainer]");
  EXPECT_CONTAINS(shown, "batch_size = 64");
  EXPECT_CONTAINS(shown, "# --batch-size");
  EXPECT_CONTAINS(shown, "run.ini:2");
  // A value with '#' read back from the file was cut at it, in silence (a comment starts there).
  config.set("trainer.work_dir", "my runs #2", Origin{"--set", {}, 0});
  const std::string hashed = format_resolved(validate(config, schema), schema);
  EXPECT_CONTAINS(hashed, "# work_dir = my runs #2");
  EXPECT_CONTAINS(hashed, "# --set, a value with '#': give it with --set");
  // One that starts with a quote is refused read back ("quotes and all"): commented out alike.
  config.set("trainer.work_dir", "\"q\"", Origin{"--set", {}, 0});
  const std::string quoted = format_resolved(validate(config, schema), schema);
  EXPECT_CONTAINS(quoted, "# work_dir = \"q\"");
  EXPECT_CONTAINS(quoted, "# --set, a value that starts with a quote: give it with --set");
  // A choice Loom made for auto is written as auto, the choice beside it (read back on a GPU, the
  // file trained in the CPU's fp32); --resume, which run to continue, is no setting of a run.
  config.set("trainer.work_dir", "runs", Origin{"--set", {}, 0});
  config.set("trainer.schedule", "warmup_cosine", Origin{"auto (trainer.use_scheduler = true)", {}, 0});
  config.set("trainer.resume", "auto", Origin{"--resume", {}, 0});
  config.set("memory.policies", "fraction_cap", Origin{"auto (memory.fraction is set)", {}, 0});  // (set again when read)
  const std::string chosen = format_resolved(validate(config, schema), schema);
  EXPECT_TRUE(std::regex_search(chosen, std::regex("\nschedule = auto +# warmup_cosine here: auto \\(trainer.use_scheduler = true\\)\n")))
      << chosen;
  EXPECT_TRUE(std::regex_search(chosen, std::regex("\n# resume = auto +# --resume: which run this command continues, left out of a file")))
      << chosen;
  Config back;
  back.load_file(write("shown.ini", chosen));
  EXPECT_EQ(back.get("trainer.schedule"), "auto");
  EXPECT_FALSE(back.get("trainer.resume").has_value());
  EXPECT_FALSE(back.get("memory.policies").has_value()) << chosen;
}

TEST_F(ConfigTest, ComponentKeysComeFromThePluginsSchema) {
  PluginRegistry registry;
  registry.load(fs::path(LOOM_TEST_PLUGIN_DIR) / "libloom_dataset_basic_counting.so");
  const auto* counting = registry.find(LOOM_KIND_DATASET, "counting");
  ASSERT_NE(counting, nullptr);
  Schema schema = core_schema();
  schema.add("data", "dataset 'counting'", counting->options);

  Config config;
  config.set_assignment("data.name=counting");
  config.set_assignment("data.size=12");
  config.set_assignment("data.layout=square");
  const Resolved resolved = validate(config, schema);
  EXPECT_EQ(section_values(resolved, "data", counting->options).at("size"), "12");
  EXPECT_EQ(section_values(resolved, "data", counting->options).at("budget"), "1MiB");

  config.set_assignment("data.siz=3");
  config.set_assignment("data.layout=round");
  const std::string message = error_of([&] { validate(config, schema); });
  EXPECT_CONTAINS(message, "unknown key 'data.siz'; did you mean 'data.size'?");
  EXPECT_CONTAINS(message, "data.layout = 'round' is not valid: expected one of flat, square");
}

TEST_F(ConfigTest, RunSchemaSaysWhichComponentIsMissing) {
  PluginRegistry registry;
  Config config;
  config.set_assignment("model.name=vit_giant");
  EXPECT_CONTAINS(error_of([&] { run_schema(config, registry); }), "no model 'vit_giant'");
}

TEST_F(ConfigTest, SeedFlagsAreAliasesOfKeys) {
  std::map<std::string, std::string> keys;
  for (const auto& alias : aliases()) keys[alias.flag] = alias.key;
  EXPECT_EQ(keys["batch-size"], "trainer.batch_size");
  EXPECT_EQ(keys["memory-fraction"], "memory.fraction");
  EXPECT_EQ(keys["allow-tf32"], "precision.allow_tf32");
  EXPECT_EQ(keys["no-amp"], "precision.amp");
  EXPECT_EQ(keys["gradient-accumulation-steps"], "trainer.gradient_accumulation_steps");
  EXPECT_EQ(keys["image-size"], "model.image_size");
  EXPECT_EQ(keys["num-layers"], "model.num_layers");
  EXPECT_EQ(keys["d-model"], "model.d_model");
  EXPECT_EQ(keys["use-scheduler"], "trainer.use_scheduler");
  EXPECT_EQ(keys["work-dir"], "trainer.work_dir");
  EXPECT_EQ(keys["resume-from"], "trainer.resume_from");
}

// ---- component sections (Note [Component sections]) ---------------------------------------------

TEST_F(ConfigTest, TwoComponentsWithTheSameOptionEachHaveTheirOwnSection) {
  const auto file = write("two.ini",
                          "[memory]\npolicies = auto_batch, record_oom\n"
                          "[memory.auto_batch]\nmargin = 0.1\n[memory.record_oom]\nmargin = 0.2\n");
  Config config;
  config.load_file(file);
  config.set_assignment("precision.name=fp32");  // what resolve_run makes of `auto` here
  config.set_assignment("trainer.schedule=constant");
  const Resolved r = validate(config, run_schema(config, loom::testing::registry()));
  EXPECT_EQ(r.at("memory.auto_batch.margin").value, "0.1");
  EXPECT_EQ(r.at("memory.record_oom.margin").value, "0.2");
  EXPECT_CONTAINS(r.at("memory.auto_batch.margin").origin.describe(), "two.ini:4");

  // The kind's section as a shorthand is ambiguous here, and the error names both sections.
  config.set_assignment("memory.margin=0.3");
  EXPECT_CONTAINS(error_of([&] { validate(config, run_schema(config, loom::testing::registry())); }),
                  "'memory.margin' is an option of several selected components; set it in the section of the one "
                  "you mean: [memory.auto_batch] or [memory.record_oom]");
}

TEST_F(ConfigTest, TheKindsSectionIsAShorthandForTheOneSelectedComponent) {
  Config config;
  config.set_assignment("precision.name=fp32");
  config.set_assignment("trainer.schedule=constant");
  config.set_assignment("memory.policies=oom_recovery");
  config.set_assignment("memory.max_replans=4");
  config.set_assignment("model.d_model=48");
  const Resolved r = validate(config, run_schema(config, loom::testing::registry()));
  EXPECT_EQ(r.at("memory.oom_recovery.max_replans").value, "4");
  EXPECT_EQ(r.at("model.lightweight_transformer.d_model").value, "48");
  config.set_assignment("memory.max_replan=4");
  EXPECT_CONTAINS(error_of([&] { validate(config, run_schema(config, loom::testing::registry())); }),
                  "unknown key 'memory.max_replan'; did you mean 'memory.max_replans'?");
}

TEST_F(ConfigTest, AnOptionWrittenBothWaysTakesTheLaterSettingAndSaysSo) {
  // A file's [model.lightweight_transformer] d_model, then --set model.d_model: the --set wins, as
  // it does over the file's own spelling (it was silently the file's).
  const auto file = write("long.ini", "[model.lightweight_transformer]\nd_model = 128\n");
  Config config;
  config.load_file(file);
  config.set_assignment("precision.name=fp32");
  config.set_assignment("trainer.schedule=constant");
  config.set_assignment("model.d_model=64");
  {
    log::Capture log(LOOM_LOG_WARN);
    const Resolved r = validate(config, run_schema(config, loom::testing::registry()));
    EXPECT_EQ(r.at("model.lightweight_transformer.d_model").value, "64");
    EXPECT_CONTAINS(join(log.lines(), "\n"), "model.d_model (--set: 64) and model.lightweight_transformer.d_model (");
    EXPECT_CONTAINS(join(log.lines(), "\n"), "are one option written two ways; the later, 64 (--set), is used");
  }
  // And the other way round: the long form set later wins.
  config.set_assignment("model.lightweight_transformer.d_model=96");
  EXPECT_EQ(validate(config, run_schema(config, loom::testing::registry())).at("model.lightweight_transformer.d_model").value,
            "96");
}

TEST_F(ConfigTest, KeysOfComponentsTheRunDoesNotSelectAreIgnoredWithAWarningThatSaysWhy) {
  // One file for several policies; the command line picks one.
  const auto file = write("many.ini",
                          "[memory]\npolicies = vram_tiers, auto_batch\ntiers = 8GB:64, 0:16\n"
                          "[memory.auto_batch]\ncache = off\n[model]\nnum_heads = 4\n");
  Config config;
  config.load_file(file);
  config.set_assignment("precision.name=fp32");
  config.set_assignment("trainer.schedule=constant");
  config.set_assignment("memory.policies=oom_recovery");
  config.set_assignment("model.name=mlp_classifier");
  log::Capture log(LOOM_LOG_WARN);
  const Resolved r = validate(config, run_schema(config, loom::testing::registry()));
  EXPECT_EQ(r.count("memory.auto_batch.cache"), 0u);
  const std::string lines = join(log.lines(), "\n");
  EXPECT_CONTAINS(lines, "many.ini:5: memory.auto_batch.cache is an option of memory policy 'auto_batch', which this "
                         "run does not select (memory.policies = oom_recovery); ignored");
  EXPECT_CONTAINS(lines, "many.ini:3: memory.tiers is an option of memory policy 'vram_tiers'");
  EXPECT_CONTAINS(lines, "many.ini:7: model.num_heads is an option of model 'lightweight_transformer', which this run "
                         "does not select (model.name = mlp_classifier); ignored");
  // A typo there is that component's, with its closest key (it was "unknown section
  // [memory.auto_batch]; did you mean [memory]?"); a component no plugin gives is said so.
  config.set_assignment("memory.auto_batch.max_batchx=3");
  config.set_assignment("model.lightweight_transformr.num_heads=4");
  const std::string typo = error_of([&] { validate(config, run_schema(config, loom::testing::registry())); });
  EXPECT_CONTAINS(typo, "unknown key 'memory.auto_batch.max_batchx' of memory policy 'auto_batch', which this run does "
                        "not select (memory.policies = oom_recovery); did you mean 'memory.auto_batch.max_batch'?");
  EXPECT_CONTAINS(typo, "[model.lightweight_transformr] (key 'model.lightweight_transformr.num_heads') is the section of "
                        "model 'lightweight_transformr', which no loaded plugin gives; did you mean "
                        "[model.lightweight_transformer]?");
}

TEST_F(ConfigTest, APathsLeadingTildeIsTheHomeFolderAsTheShellWouldHaveIt) {
  // `--set trainer.work_dir=~/runs` reaches Loom with its ~ (the shell expands none after "key="),
  // and the run went to a folder named "~" in the current one.
  const char* home = std::getenv("HOME");
  ASSERT_NE(home, nullptr);
  const auto file = write("home.ini", "[trainer]\nwork_dir = ~/runs\n");
  Config config;
  config.load_file(file);
  config.set_assignment("precision.name=fp32");
  config.set_assignment("trainer.schedule=constant");
  config.set_assignment("trainer.name=~");
  Resolved r = validate(config, run_schema(config, loom::testing::registry()));
  EXPECT_EQ(r.at("trainer.work_dir").value, std::string(home) + "/runs");
  EXPECT_EQ(r.at("trainer.name").value, "~") << "a ~ alone may be a text option's value";
  config.set_assignment("trainer.work_dir=~");  // (--work-dir=~ made a folder named ~ here)
  EXPECT_EQ(validate(config, run_schema(config, loom::testing::registry())).at("trainer.work_dir").value, std::string(home));
  // Only a leading "~/": another user's ~name, and a ~ further on, are left as they are.
  config.set_assignment("trainer.work_dir=~other/runs");
  config.set_assignment("trainer.name=a~/b");
  r = validate(config, run_schema(config, loom::testing::registry()));
  EXPECT_EQ(r.at("trainer.work_dir").value, "~other/runs");
  EXPECT_EQ(r.at("trainer.name").value, "a~/b");
  EXPECT_EQ(loom::core::home_expanded("~"), "~");
  EXPECT_EQ(loom::core::home_expanded("~/"), std::string(home) + "/");
  EXPECT_EQ(loom::core::home_expanded(""), "");
}

}  // namespace

TEST_F(ConfigTest, AConfigurationIsFoundByNameFromAnyFolder) {
  // Loom's own configurations sit in <exe>/../share/loom/configs, in the build tree as installed.
  const fs::path debug = find_config("debug");
  EXPECT_EQ(debug.filename(), "debug.ini");
  EXPECT_EQ(debug.parent_path().filename(), "configs");
  Config c;
  c.load_file(debug);
  EXPECT_EQ(c.get("data.name"), "synthetic");
  // A file in the current folder, or any path, is taken as it is; a path without its .ini where
  // only the .ini is there is that file (as `base = named` finds it; it was a bare "not found").
  EXPECT_EQ(find_config("configs/debug.ini"), fs::path("configs/debug.ini"));
  write("named.ini", "[trainer]\nmax_steps = 3\n");
  EXPECT_EQ(find_config((dir_ / "named").string()), dir_ / "named.ini");
  fs::create_directories(dir_ / "named");  // a folder of that name beside it is no configuration
  EXPECT_EQ(find_config((dir_ / "named").string()), dir_ / "named.ini");
  // A debug.ini in the current folder is not what `-c debug` names: said.
  write("debug.ini", "[trainer]\nmax_steps = 3\n");
  const fs::path before = fs::current_path();
  fs::current_path(dir_);
  {
    const log::Capture capture(LOOM_LOG_WARN);
    EXPECT_EQ(find_config("debug"), debug);
    EXPECT_TRUE(capture.contains("config 'debug' is Loom's " + debug.string() + ", not debug.ini here; give -c ./debug.ini"))
        << ::testing::PrintToString(capture.lines());
  }
  fs::current_path(before);
  // LOOM_CONFIG_PATH comes first.
  write("mine.ini", "[trainer]\nmax_steps = 3\n");
  ::setenv("LOOM_CONFIG_PATH", dir_.c_str(), 1);
  EXPECT_EQ(find_config("mine"), dir_ / "mine.ini");
  // An entry that is no folder is said, and passed over (it was listed among those "searched").
  ::setenv("LOOM_CONFIG_PATH", ("/dev/zero:" + (dir_ / "no_such").string() + ":" + dir_.string()).c_str(), 1);
  {
    const log::Capture capture(LOOM_LOG_WARN);
    EXPECT_EQ(find_config("mine"), dir_ / "mine.ini");
    EXPECT_TRUE(capture.contains("LOOM_CONFIG_PATH's /dev/zero is a character device, not a folder of configurations; it "
                                 "is passed over"));
    EXPECT_TRUE(capture.contains("LOOM_CONFIG_PATH's " + (dir_ / "no_such").string() + ": no such folder; it is passed over"))
        << ::testing::PrintToString(capture.lines());
  }
  ::unsetenv("LOOM_CONFIG_PATH");
  // A name that is nowhere: what was searched, what there is, and the closest.
  const std::string m = error_of([] { find_config("debg"); });
  EXPECT_CONTAINS(m, "config file 'debg' not found");
  EXPECT_CONTAINS(m, "(debug, fashion_mnist, gpt2_recommender, gpt2_recommender_debug)");
  EXPECT_CONTAINS(m, "Did you mean 'debug'?");
}

TEST(FileSystemErrors, APermissionRefusedIsSaidAsTheReadOrWriteItWas) {
  // (a read refused was said as "choose a path this user may write", probe)
  const auto denied = std::make_error_code(std::errc::permission_denied);
  const std::string read = loom::explained(fs::filesystem_error("status", fs::path("/r/checkpoints"), denied));
  EXPECT_NE(read.find("status /r/checkpoints: Permission denied (this user may not read there"), std::string::npos) << read;
  const std::string write = loom::explained(fs::filesystem_error("cannot create directories", fs::path("/r/x"), denied));
  EXPECT_NE(write.find("(choose a path this user may write"), std::string::npos) << write;
}

TEST(OptionRanges, AnIntegerIsComparedWithItsRangeAsAnInteger) {
  // Through a double, 2^53 + 1 passed a range ending at 2^53 (probe: a plugin's default and --set).
  OptionSpec o{"n", LOOM_OPTION_INT, "0", "", "..9007199254740992", std::nullopt, 9007199254740992.0};
  EXPECT_FALSE(out_of_range(o, "9007199254740992").has_value());
  EXPECT_TRUE(out_of_range(o, "9007199254740993").has_value());
  // The core's keys give min and max alone; a plugin's fractional bounds are the whole numbers within.
  OptionSpec core{"k", LOOM_OPTION_INT, "1", "", "", 1.0, 9223372036854775807.0};
  EXPECT_TRUE(out_of_range(core, "0").has_value());
  EXPECT_FALSE(out_of_range(core, "9223372036854775807").has_value());
  OptionSpec fractional{"f", LOOM_OPTION_INT, "1", "", "0.5..2.5", 1.0, 2.0};
  EXPECT_TRUE(out_of_range(fractional, "0").has_value());
  EXPECT_FALSE(out_of_range(fractional, "2").has_value());
  EXPECT_TRUE(out_of_range(fractional, "3").has_value());
}
