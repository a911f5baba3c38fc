// Run configuration: reading INI files (Boost.Program_options), inheritance, overrides and
// validation. See config.hpp.
#include <loom/core/config.hpp>
#include <loom/core/files.hpp>
#include <loom/core/kinds.hpp>
#include <loom/core/log.hpp>
#include <loom/core/text.hpp>

#include <loom/sdk/files.hpp>
#include "config_text.hpp"
#include "plugin_descriptor.hpp"
#include <loom/sdk/options.hpp>

#include <boost/program_options/options_description.hpp>
#include <boost/program_options/parsers.hpp>

#include <algorithm>
#include <cctype>
#include <cstring>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <set>
#include <sstream>

namespace fs = std::filesystem;
namespace po = boost::program_options;

namespace loom::core {

namespace {
/// The section of "trainer.lr" is "trainer"; of "memory.auto_batch.cache", "memory.auto_batch".
std::string section_of(const std::string& key) {
  const auto dot = key.rfind('.');
  return dot == std::string::npos ? std::string() : key.substr(0, dot);
}

/// A key of another section with `key`'s own name or one close to it (trainer.weight_decay:
/// optimizer.weight_decay; model.lr: trainer.lr), the shorthand where there is one; none where
/// the name is in no section. `exact_only`: the same name alone (what beats a typo in key's own section).
std::optional<std::string> same_name_elsewhere(const std::string& key, const std::vector<std::string>& keys,
                                               const std::vector<std::string>& shorthands, bool exact_only) {
  const auto lower = [](std::string_view v) {
    std::string out(v);
    for (char& ch : out) ch = static_cast<char>(std::tolower(static_cast<unsigned char>(ch)));
    return out;
  };
  const std::string name = lower(std::string_view(key).substr(key.rfind('.') + 1));
  std::optional<std::string> best;
  int best_rank = 0;
  for (const auto* list : {&shorthands, &keys})
    for (const auto& candidate : *list) {
      const std::string section = section_of(candidate);
      if (section == section_of(key) || !closest(section + "." + name, {candidate})) continue;
      const bool exact = lower(std::string_view(candidate).substr(candidate.rfind('.') + 1)) == name;
      if (exact_only && !exact) continue;
      const int rank = (exact ? 0 : 100) + static_cast<int>(std::count(candidate.begin(), candidate.end(), '.'));
      if (!best || rank < best_rank) {
        best = candidate;
        best_rank = rank;
      }
    }
  return best;
}

std::string display(const fs::path& p) {
  std::error_code ec;
  const fs::path rel = fs::relative(p, fs::current_path(ec), ec);
  if (!ec && !rel.empty() && rel != "." && rel.native().rfind("..", 0) != 0) return rel.string();  // (".": the folder itself)
  return p.string();
}


}  // namespace

std::string Origin::describe() const {
  if (source == "file") return display(file) + ":" + std::to_string(line);
  return source;
}

const std::vector<Alias>& aliases() {
  static const std::vector<Alias> table = {
      {"batch-size", "trainer.batch_size", nullptr, "global batch: samples per optimizer step"},
      {"gradient-accumulation-steps", "trainer.gradient_accumulation_steps", nullptr,
       "micro-batches per optimizer step"},
      {"memory-fraction", "memory.fraction", nullptr,
       "cap device memory at this fraction of the device (adds the fraction_cap policy)"},
      {"allow-tf32", "precision.allow_tf32", "true", "TF32 matmuls and convolutions on CUDA"},
      {"no-amp", "precision.amp", "false", "train in float32 (AMP is on by default on a GPU)"},
      {"image-size", "model.image_size", nullptr, "resize images to this side length"},
      {"num-layers", "model.num_layers", nullptr, "encoder layers"},
      {"d-model", "model.d_model", nullptr, "model width"},
      {"use-scheduler", "trainer.use_scheduler", "true", "linear warm-up then cosine decay"},
      {"work-dir", "trainer.work_dir", nullptr, "where runs are written"},
      {"resume-from", "trainer.resume_from", nullptr, "a checkpoint to resume from"},
      {"device-memory-limit", "memory.device_memory_limit", nullptr,
       "cap device memory at this size (on CPU: act as a device of that size), e.g. 2GiB"},
      {"memory-snapshot", "memory.snapshot", nullptr, "CUDA: write a memory snapshot for pytorch.org/memory_viz"},
      {"allow-precision-change", "precision.allow_precision_change", "true",
       "resume a checkpoint trained under another precision"},
  };
  return table;
}

// ---- Config ----------------------------------------------------------------------------------

namespace {

// Files are read each after its bases, so a base read for a later file overrides what a file read
// before that one set: `-c mine.ini -c debug` (debug's base, fashion_mnist.ini, sets trainer.lr
// over mine.ini's), or a base two files share (read again for the second). Said, as it is rarely meant.
std::string base_override(const Config& config, const std::string& key, const std::string& value, const fs::path& path,
                          int line, const std::vector<fs::path>& chain) {
  const ConfigValue* before = config.find(key);
  const auto& files = config.files();
  if (chain.size() < 2 || before == nullptr || before->origin.source != "file" || same_value(before->value, value)) return "";
  const auto latest = [&](const fs::path& f) { return std::find(files.rbegin(), files.rend(), f) - files.rbegin(); };
  const fs::path& named_by = chain[chain.size() - 2];  // the file whose base this one is
  if (latest(before->origin.file) <= latest(named_by)) return "";  // (distance from the end: read after it, or it)
  // (a value of several words, "progress, jsonl", is quoted for the shell: it was two arguments)
  const std::string assignment = key + "=" + before->value;
  const bool plain = std::all_of(assignment.begin(), assignment.end(),
                                 [](char c) { return std::isalnum(static_cast<unsigned char>(c)) || std::strchr("._,:/+-=", c); });
  return display(path) + ":" + std::to_string(line) + ": " + key + " = " + value + " replaces " + before->value + " from " +
         before->origin.describe() + ", read before " + display(named_by) + ", whose base this file is: a base's " +
         "values come before those of the file that names it. If " + before->value + " is meant, give --set " +
         (plain ? assignment : "'" + assignment + "'") + " or set it in a -c file after " + display(named_by);  // (not "in debug.ini": Loom's own)
}

}  // namespace

void Config::load_file(const fs::path& file) {
  std::vector<fs::path> chain;
  load_file(file, chain, "");
}

std::vector<std::string> Config::base_override_warnings(const Schema* schema) const {
  const auto option_of = [&](const std::string& key) {  // the option a key sets: a shorthand's canonical key
    if (schema == nullptr || schema->find(key) != nullptr) return key;
    const auto targets = schema->shorthand(key);
    return targets.size() == 1 ? targets.front() : key;
  };
  std::vector<std::string> out;
  for (const auto& o : base_overrides_) {  // (a base read again for several files: said once)
    const ConfigValue* now = find(o.key);
    if (!now || now->origin.source != "file" || now->origin.file != o.file || now->origin.line != o.line ||
        std::find(out.begin(), out.end(), o.warning) != out.end())
      continue;
    const std::string option = option_of(o.key);  // set later written another way: that setting is in force
    if (std::any_of(values_.begin(), values_.end(), [&](const auto& kv) {
          return kv.first != o.key && set_order(kv.first) > set_order(o.key) && option_of(kv.first) == option;
        }))
      continue;
    out.push_back(o.warning);
  }
  return out;
}

void Config::load_file(const fs::path& file, std::vector<fs::path>& chain,
                       const std::string& included_from) {
  std::error_code ec;
  const fs::path canonical = fs::weakly_canonical(file, ec);
  const fs::path path = ec ? file : canonical;
  if (std::find(chain.begin(), chain.end(), path) != chain.end()) {
    std::vector<std::string> names;
    for (const auto& p : chain) names.push_back(display(p));
    names.push_back(display(path));
    if (chain.size() == 1 && chain.front() == path)
      throw Error(display(path) + " names itself as its base; name another file (a path relative to it), or one of "
                  "Loom's configurations by its bare name (base = debug)");
    throw Error("config inheritance cycle: " + join(names, " -> ") +
                "; remove one of these `base =` lines");
  }
  const std::string named_by = included_from.empty() ? std::string() : " (named by `base` at " + included_from + ")";
  // A base named by several files is read for each (a diamond, -c a -c b sharing one): bounded, so
  // that 30 files naming the next one twice are an error, not 2^30 reads.
  if (chain.size() >= 32 || files_.size() >= 512)
    throw Error("config file " + display(file) + named_by + ": " +
                (chain.size() >= 32 ? "bases 32 deep" : "more than 512 configuration files read (a base is read again "
                                                        "for each file that names it)") +
                "; a configuration builds on a few files, not on this many");
  if (!fs::exists(path, ec)) {  // (a link to nothing, or a loop of links, is said as such)
    const std::string what = sdk::what_is_at(file);
    throw Error("config file " + display(file) + (what == "no such file" ? " not found" + shipped_hint(file) : ": " + what) +
                named_by);
  }
  std::string text;
  try {
    text = read_file(path, 16 << 20);  // a regular file of at most 16 MiB: a FIFO or a device is refused, not read
  } catch (const Error& e) {
    throw Error("config file " + display(file) + named_by + ": " + e.what());
  }
  // 250 files naming one 16 MiB base read it 250 times (minutes), and six such files in a chain of
  // bases held 4 GB (probe): what a run's configuration reads in all is bounded too.
  if (constexpr uint64_t kMostRead = 64 << 20; (bytes_read_ += text.size()) > kMostRead)
    throw Error("config file " + display(file) + named_by + ": the configuration files read come to more than 64 MiB (" +
                std::to_string(files_.size() + 1) + " files, a base read again for each file that names it); a "
                "configuration is a few files of a few hundred settings");
  if (text.rfind("\xEF\xBB\xBF", 0) == 0) text.erase(0, 3);  // a UTF-8 byte order mark, as some editors write
  // (a base's error names the file whose `base =` named it: the user may not know it is read)
  po::options_description nothing_registered;
  po::parsed_options parsed(&nothing_registered);
  std::vector<std::pair<std::string, int>> lines;
  try {
    check_config_text(text, display(path));
    lines = entry_lines(text);
    for (const auto& [key, line] : lines) {
      if (line < 0)
        throw Error(display(path) + ":" + std::to_string(-line) +
                    ": not a `key = value`, `[section]` or `# comment` line");
      if (const auto bad = std::find_if(key.begin(), key.end(), [](unsigned char c) { return c < 0x20 || c == 0x7f; });
          bad != key.end()) {
        char byte[8];
        std::snprintf(byte, sizeof byte, "0x%02x", static_cast<unsigned char>(*bad));
        throw Error(display(path) + ":" + std::to_string(line) + ": the key '" + printable(key, 60) +
                    "' holds a control character (byte " + byte + "); a key is letters, digits, '_' and '.'");
      }
      // (a 10 MB key was echoed whole in its "unknown key" error, after seconds of matching)
      if (constexpr size_t kMaxKey = 256; key.size() > kMaxKey)
        throw Error(display(path) + ":" + std::to_string(line) + ": a key of " + std::to_string(key.size()) +
                    " characters (" + key.substr(0, 40) + "...); keys are at most " + std::to_string(kMaxKey));
    }
    std::istringstream stream(text);
    try {
      parsed = po::parse_config_file(stream, nothing_registered, /*allow_unregistered=*/true);
    } catch (const po::error& e) {
      throw Error(display(path) + ": " + e.what());
    }
  } catch (const Error& e) {
    throw Error(e.what() + named_by);
  }

  chain.push_back(path);
  files_.push_back(path);
  struct Entry {
    std::string key, value;
    int line;
  };
  std::vector<Entry> entries;
  entries.reserve(parsed.options.size());
  for (size_t i = 0; i < parsed.options.size(); ++i) {
    auto& option = parsed.options[i];
    const int line = i < lines.size() && lines[i].first == option.string_key ? lines[i].second : 0;
    entries.push_back({std::move(option.string_key), option.value.empty() ? "" : std::move(option.value.front()), line});
  }
  // (the file's text and its parse are not needed while its bases load: a chain of bases held each)
  std::string().swap(text);
  decltype(parsed.options)().swap(parsed.options);
  std::vector<std::pair<std::string, int>>().swap(lines);
  const Entry* first_base = nullptr;  // `base =` twice: one line lists them all, in an order the reader sees
  for (const auto& e : entries) {
    if (e.key != "base") continue;
    if (first_base != nullptr)
      throw Error(display(path) + ":" + std::to_string(e.line) + ": base is set again (line " +
                  std::to_string(first_base->line) + ": " + first_base->value + "); list every base on one line, " +
                  "base = " + first_base->value + ", " + e.value + " (each overrides the ones before it), or remove one");
    first_base = &e;
    auto bases = sdk::parse_list(e.value);
    if (std::error_code ec; bases.size() > 1 && fs::is_regular_file(path.parent_path() / home_expanded(e.value), ec))
      bases = {e.value};  // (one file whose name holds a comma, `base = a,b.ini`, is that file)
    if (bases.empty())
      throw Error(display(path) + ":" + std::to_string(e.line) + ": base is empty; name the file this one builds on " +
                  "(base = other.ini, a path relative to this file) or remove the line");
    struct Base {
      std::string written;
      fs::path path, same;  // as named (relative to this file), and its canonical form
    };
    std::vector<Base> resolved;  // every base of the line, checked before any is read
    for (const auto& base : bases) {
      if (base.find("://") != std::string::npos)
        throw Error(display(path) + ":" + std::to_string(e.line) + ": base = " + base + " is a URL; a base is a file " +
                    "(a path relative to this file, or one of Loom's configurations by name): download it first");
      const fs::path named = home_expanded(base, /*alone_too=*/true);  // (base = ~/common.ini)
      fs::path base_path = named.is_absolute() ? named : path.parent_path() / named;
      // A bare name that is not beside this file is one of Loom's configurations, as for -c
      // (`base = debug`, or a copy of debug.ini whose `base = fashion_mnist.ini` stayed behind).
      std::error_code ec;
      // (a folder beside it with that name, `base = self2` beside self2/ and self2.ini, is no file meant)
      if (base.find('/') == std::string::npos &&
          (!fs::exists(fs::symlink_status(base_path, ec)) || fs::is_directory(base_path, ec))) {
        // `base = debug` beside a debug.ini of the user's own: that one, unless it is this file (a
        // debug.ini that extends Loom's debug: the name cannot mean the file itself).
        if (const fs::path beside = base_path.string() + ".ini";
            fs::exists(fs::symlink_status(beside, ec)) && !fs::equivalent(beside, path, ec))
          base_path = beside;
        else if (auto shipped = shipped_config(base)) {
          log::info(display(path), ":", e.line, ": base = ", base, " is not beside it: Loom's ", shipped->string());
          base_path = *shipped;
        }
      }
      // (`base = configs/debug.ini`, copied from README's command, beside no configs/ folder)
      if (const fs::path shipped_name = fs::path(base).filename(); base.find('/') != std::string::npos &&
          shipped_name.extension() == ".ini" && !fs::exists(fs::symlink_status(base_path, ec)))
        if (auto shipped = shipped_config(shipped_name.stem().string()))
          throw Error(display(path) + ":" + std::to_string(e.line) + ": base = " + base + ": " + display(base_path) +
                      " not found; Loom's own " + shipped_name.string() + " is " + shipped->string() +
                      ", which a bare name gives: base = " + shipped_name.stem().string());
      // The same file named twice, however it is written (bb.ini, ./bb.ini, bb, a link to it).
      fs::path same = fs::weakly_canonical(base_path, ec);
      if (ec) same = base_path;
      for (const Base& earlier : resolved)
        if (earlier.same == same)
          throw Error(display(path) + ":" + std::to_string(e.line) + ": base names " +
                      (earlier.written == base ? base + " twice"
                                               : display(same) + " twice (" + earlier.written + ", " + base + ")") +
                      "; name it once");
      resolved.push_back({base, base_path, same});
    }
    for (const Base& base : resolved) load_file(base.path, chain, display(path) + ":" + std::to_string(e.line));
  }
  std::map<std::string, const Entry*> here;  // a key written twice in one file: the later line wins, and is named
  int set_again = 0;                // (each said, up to a screenful: a generated file that repeats a key a
  constexpr int kSetAgainSaid = 20;  // million times printed 107 MB)
  for (const auto& e : entries) {
    if (e.key == "base") continue;
    if (section_of(e.key).empty())
      throw Error(display(path) + ":" + std::to_string(e.line) + ": key '" + e.key +
                  "' is outside any section; put it under [trainer], [model], [data], ... "
                  "(only `base` may come before the first section)");
    if (const auto [it, first] = here.emplace(e.key, &e); !first) {
      if (it->second->value != e.value && ++set_again <= kSetAgainSaid)
        log::warn(display(path), ":", e.line, ": ", e.key, " is set again (line ", it->second->line, ": ", it->second->value,
                  "); the later, ", e.value, ", is used");
      it->second = &e;
    }
    if (std::string warning = base_override(*this, e.key, e.value, path, e.line, chain); !warning.empty())
      base_overrides_.push_back({e.key, path, e.line, std::move(warning)});
    set(e.key, e.value, Origin{"file", path, e.line});
  }
  if (set_again > kSetAgainSaid)
    log::warn(display(path), ": ", set_again - kSetAgainSaid, " more lines set a key again after those said; the last line "
              "of each key is used");
  chain.pop_back();
}

void Config::set(const std::string& key, const std::string& value, Origin origin) {
  // A value is one line of text of sensible length: a NUL cut messages short, a newline or an
  // escape sequence would be written into logs and config.json, and a 10 MB value was echoed whole.
  constexpr size_t kMaxValue = 64 << 10;
  if (value.size() > kMaxValue)
    throw Error(origin.describe() + ": " + key + " has a value of " + std::to_string(value.size()) + " bytes; values are " +
                "at most " + std::to_string(kMaxValue) + " (a number, a name, a path, a list)");
  // (a key's escape sequence reached the terminal in its "unknown key" error: it set the window's title)
  for (const std::string* text : {&key, &value})
    for (size_t i = 0; i < text->size(); ++i) {
      const auto c = static_cast<unsigned char>((*text)[i]);
      if ((c >= 0x20 || c == '\t') && c != 0x7f) continue;
      char code[8];
      std::snprintf(code, sizeof code, "0x%02x", c);
      if (text == &key)
        throw Error(origin.describe() + ": a key holds a control character (byte " + code + " at position " +
                    std::to_string(i + 1) + "); keys are words of letters, digits and _ joined by dots");
      throw Error(origin.describe() + ": " + key + " holds a control character (byte " + code + " at position " +
                  std::to_string(i + 1) + "); a value is one line of text");
    }
  if (constexpr size_t kMaxKey = 256; key.size() > kMaxKey)  // (a 120 KB --set key was echoed whole)
    throw Error(origin.describe() + ": a key of " + std::to_string(key.size()) + " characters (" + key.substr(0, 40) +
                "...); keys are at most " + std::to_string(kMaxKey));
  if (invalid_utf8(key))  // (a value need not be, but where a run records it: check_record_values)
    throw Error(origin.describe() + ": a key that is not UTF-8 text; keys are words of letters, digits and _ joined by dots");
  values_[key] = ConfigValue{value, std::move(origin)};
  order_[key] = ++sets_;
}

uint64_t Config::set_order(const std::string& key) const {
  const auto it = order_.find(key);
  return it == order_.end() ? 0 : it->second;
}

std::vector<std::string> Config::keys_in_set_order() const {
  std::vector<std::pair<uint64_t, std::string>> by_order;
  for (const auto& [key, order] : order_) by_order.emplace_back(order, key);
  std::sort(by_order.begin(), by_order.end());
  std::vector<std::string> keys;
  for (auto& [order, key] : by_order) keys.push_back(std::move(key));
  return keys;
}

void Config::set_assignment(const std::string& assignment, const std::string& source) {
  const auto eq = assignment.find('=');
  const std::string key = eq == std::string::npos ? "" : std::string(sdk::trim(assignment.substr(0, eq)));
  if (eq == std::string::npos || key.find('.') == std::string::npos || key.front() == '.' ||
      key.back() == '.')
    throw Error(source + " '" + assignment + "': expected section.key=value, e.g. " + source +
                " trainer.max_steps=300");
  set(key, std::string(sdk::trim(assignment.substr(eq + 1))), Origin{source, {}, 0});
}

const ConfigValue* Config::find(const std::string& key) const {
  auto it = values_.find(key);
  return it == values_.end() ? nullptr : &it->second;
}

std::optional<std::string> Config::get(const std::string& key) const {
  if (const ConfigValue* v = find(key)) return v->value;
  return std::nullopt;
}

// ---- validation ------------------------------------------------------------------------------

std::optional<std::string> out_of_range(const OptionSpec& o, const std::string& text) {
  if (!o.min && !o.max) return std::nullopt;
  std::optional<double> v;
  if (o.type == LOOM_OPTION_INT) {
    if (auto i = sdk::parse_int(text))
      return int_outside_range(o.choices, o.min, o.max, *i) ? std::optional("is outside its range " + range_text(o))
                                                             : std::nullopt;
  } else if (o.type == LOOM_OPTION_FLOAT) {
    v = sdk::parse_float(text);
  }
  if (!v) return std::nullopt;
  if ((o.min && *v < *o.min) || (o.max && *v > *o.max)) return "is outside its range " + range_text(o);
  return std::nullopt;
}

std::string range_text(const OptionSpec& o) {
  auto number = [&](double x) {
    if (o.type == LOOM_OPTION_INT && std::abs(x) < 9.2e18) return std::to_string(static_cast<int64_t>(x));
    std::ostringstream out;
    out << x;
    return out.str();
  };
  // appended, not "[" + string&&: GCC 12's -Wrestrict misreads that insert at the front (GCC bug 105329)
  std::string text = "[";
  text += o.min ? number(*o.min) : std::string("-inf");
  text += ", ";
  text += o.max ? number(*o.max) : std::string("inf");
  return text + "]";
}

Resolved validate(const Config& config, const Schema& schema) {
  std::vector<std::string> problems;
  const auto sections = schema.sections();
  std::vector<std::string> all_keys;
  for (const auto& [key, spec] : schema.keys()) all_keys.push_back(key);
  for (const auto& alias : aliases()) all_keys.emplace_back(alias.key);  // (memory.fractoin named no memory.fraction)

  // Shorthand keys (Note [Component sections]) become their canonical key; of a key given both
  // ways, the later setting wins (a --set of model.d_model over a file's [model.<name>] d_model).
  Config canonical;
  std::map<std::string, std::string> written_as;  // canonical key -> the shorthand the user wrote
  for (const auto& [key, value] : config.values()) {
    const auto targets = schema.find(key) ? std::vector<std::string>{} : schema.shorthand(key);
    if (targets.size() > 1) {
      std::vector<std::string> sections;
      for (const auto& t : targets) sections.push_back(std::string("[").append(section_of(t)).append("]"));
      problems.push_back(value.origin.describe() + ": '" + key + "' is an option of several selected components; "
                         "set it in the section of the one you mean: " + join(sections, " or "));
    } else if (targets.size() == 1) {
      const ConfigValue* full = config.find(targets.front());
      const bool later = !full || config.set_order(key) > config.set_order(targets.front());
      if (full && full->value != value.value) {
        const ConfigValue& used = later ? value : *full;
        log::warn(key, " (", value.origin.describe(), ": ", value.value, ") and ", targets.front(), " (",
                  full->origin.describe(), ": ", full->value, ") are one option written two ways; the later, ",
                  used.value, " (", used.origin.describe(), "), is used");
      }
      if (later) {
        canonical.set(targets.front(), value.value, value.origin);
        written_as[targets.front()] = key;
      }
    } else if (const std::string* why = schema.foreign(key)) {
      log::warn(value.origin.describe(), ": ", key, " is an option of ", *why, "; ignored");
    } else if (!canonical.find(key)) {  // else a shorthand set later holds it
      canonical.set(key, value.value, value.origin);
    }
  }
  std::vector<std::string> shorthand_keys;
  for (const auto& [key, spec] : schema.keys())
    if (const auto dot = key.find('.'); dot != key.rfind('.'))
      shorthand_keys.push_back(key.substr(0, dot) + key.substr(key.rfind('.')));

  for (const auto& [key, value] : canonical.values()) {
    const std::string where = value.origin.describe();
    const KeySpec* spec = schema.find(key);
    if (spec == nullptr) {
      const std::string section = section_of(key);
      if (problems.size() >= 20) {  // (only 20 are shown: a file of 200000 unknown keys took a minute to suggest for each)
        problems.push_back(where + ": unknown key '" + key + "'");
        continue;
      }
      const auto shorthand_of_section = [&](const std::string& k) { return section_of(k) == section; };
      if (std::find(sections.begin(), sections.end(), section) == sections.end() &&
          std::none_of(shorthand_keys.begin(), shorthand_keys.end(), shorthand_of_section)) {  // ([optimizer]: adamw's)
        if (std::string problem = schema.foreign_section_problem(key); !problem.empty()) {
          problems.push_back(where + ": " + problem);  // (it said "unknown section [model.gpt2_lm]; did you mean [model]?")
          continue;
        }
        std::string message = where + ": unknown section [" + section + "] (key '" + key + "')";
        if (auto close = closest(section, sections)) message += "; did you mean [" + *close + "]?";
        else if (auto there = same_name_elsewhere(key, all_keys, shorthand_keys, false)) message += "; did you mean '" + *there + "'?";
        else message += "; sections are " + join(sections, ", ");
        problems.push_back(message);
        continue;
      }
      std::vector<std::string> in_section;
      for (const auto& k : all_keys)  // (an alias's key is a key's: listed once)
        if (section_of(k) == section && std::find(in_section.begin(), in_section.end(), k) == in_section.end())
          in_section.push_back(k);
      for (const auto& k : shorthand_keys)
        if (section_of(k) == section && std::find(in_section.begin(), in_section.end(), k) == in_section.end())
          in_section.push_back(k);
      std::string message = where + ": unknown key '" + key + "'";
      if (key.size() > 5 && key.compare(key.size() - 5, 5, ".base") == 0 && value.origin.source == "file")
        message += "; `base = ...` names the files this one builds on, on a line before the first [section]";
      else if (auto there = same_name_elsewhere(key, all_keys, shorthand_keys, /*exact=*/true))  // (model.batch_size: not patch_size)
        message += "; did you mean '" + *there + "'? ([" + section + "] has no " + key.substr(key.rfind('.') + 1) + ")";
      else if (auto close = closest(key, in_section)) message += "; did you mean '" + *close + "'?";
      else if (auto near = same_name_elsewhere(key, all_keys, shorthand_keys, /*exact=*/false))
        message += "; did you mean '" + *near + "'? ([" + section + "] has no " + key.substr(key.rfind('.') + 1) + ")";
      else message += "; [" + section + "] has " + join(in_section, ", ");
      problems.push_back(message);
      continue;
    }
    const OptionSpec& o = spec->option;
    const std::string shown = written_as.count(key) ? written_as.at(key) : key;
    if (o.type == LOOM_OPTION_LIST && sdk::list_has_empty_item(value.value)) {
      const auto items = sdk::parse_list(value.value);
      problems.push_back(where + ": " + shown + " = '" + value.value + "' has an empty item (a stray comma); " +
                         (items.empty() ? std::string("an empty list is written with nothing after the =, e.g. ") + shown + " ="
                                        : "write the items with one comma between each, e.g. '" + join(items, ", ") + "'"));
    } else if (!sdk::is_valid_value(o.type, value.value, o.choices.c_str())) {
      std::string expected = sdk::describe_type(o.type);
      if (o.type == LOOM_OPTION_ENUM) expected = "one of " + join(sdk::enum_choices(o.choices.c_str()), ", ");
      // a number too large to parse at all (99999999999999999999) is refused here, not by the range check
      if ((o.type == LOOM_OPTION_INT || o.type == LOOM_OPTION_FLOAT) && (o.min || o.max)) expected += " in " + range_text(o);
      problems.push_back(where + ": " + shown + " = '" + value.value + "' is not valid: expected " + expected +
                         (value.value.find(" ;") != std::string::npos ? " (';' starts no comment in a value: '#' does)" : ""));
    } else if (auto problem = out_of_range(o, value.value)) {
      problems.push_back(where + ": " + shown + " = " + value.value + " " + *problem + " (" + o.help + ")");
    }
  }

  Resolved resolved;
  for (const auto& [key, spec] : schema.keys()) {
    if (const ConfigValue* v = canonical.find(key)) {
      resolved[key] = *v;  // (a path's leading ~ is the home folder, as the shell would have made it: no folder "~")
      if (spec.option.type == LOOM_OPTION_STRING) resolved[key].value = home_expanded(v->value, key == "trainer.work_dir");
    } else {
      if (spec.option.required())
        problems.push_back("key '" + key + "' (" + spec.owner + ") needs a value: " + spec.option.help);
      resolved[key] = ConfigValue{spec.option.default_value, Origin{"default", {}, 0}};
    }
  }
  if (!problems.empty()) {
    std::string message = problems.size() == 1 ? "invalid configuration: " : "invalid configuration:";
    if (problems.size() == 1) message += problems.front();
    else
      for (size_t i = 0; i < problems.size() && i < 20; ++i) message += "\n  " + problems[i];
    if (problems.size() > 20)  // (a wrong file given as a configuration: not thousands of lines)
      message += "\n  ... and " + std::to_string(problems.size() - 20) + " more; is this the configuration file meant?";
    throw Error(message);
  }
  return resolved;
}

std::string format_resolved(const Resolved& resolved, const Schema& schema) {
  std::ostringstream out;
  std::string current;
  size_t width = 0;
  for (const auto& [key, value] : resolved)
    width = std::max(width, key.size() - section_of(key).size() - 1 + 3 + value.value.size());
  // By section ([memory] before [memory.auto_batch]), then by key.
  std::map<std::string, std::vector<std::pair<std::string, ConfigValue>>> by_section;
  for (const auto& [key, value] : resolved) by_section[section_of(key)].emplace_back(key, value);
  std::vector<std::pair<std::string, ConfigValue>> ordered;
  for (const auto& [section, entries] : by_section) ordered.insert(ordered.end(), entries.begin(), entries.end());
  for (const auto& [key, value] : ordered) {
    const std::string section = section_of(key);
    if (section != current) {
      if (!current.empty()) out << "\n";
      out << "[" << section << "]\n";
      current = section;
    }
    const ShownLine shown = shown_line(key, key.substr(section.size() + 1), value.value, value.origin);
    out << shown.line << std::string(width + 2 - std::min(width + 1, shown.line.size()), ' ') << "# " << shown.comment;
    if (const KeySpec* spec = schema.find(key); spec && spec->owner.find('\'') != std::string::npos)
      out << " (" << spec->owner << ")";
    out << "\n";
  }
  return out.str();
}

std::map<std::string, std::string> section_values(const Resolved& resolved, const std::string& section,
                                                  const std::vector<OptionSpec>& keys) {
  std::map<std::string, std::string> out;
  for (const auto& option : keys) {
    auto it = resolved.find(section + "." + option.key);
    out[option.key] = it != resolved.end() ? it->second.value : option.default_value;
  }
  return out;
}

}  // namespace loom::core
