// interactions: MovieLens as users download it (https://grouplens.org/datasets/movielens/), read
// from data.root without network: ml-100k (u.data tab-separated; u.item pipe-separated, Latin-1,
// 19 genre flags; u.genre), ml-1m (ratings.dat and movies.dat, "::"-separated, Latin-1) and
// ml-latest / ml-latest-small (ratings.csv, movies.csv with quoted titles, tags.csv if present).
// Every row is checked: a malformed one is one error naming file:line and the field.
#include "datasets.hpp"

#include <loom/sdk/files.hpp>
#include <loom/sdk/log.hpp>

#include <algorithm>
#include <array>
#include <cctype>
#include <cerrno>
#include <charconv>
#include <cstdio>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <map>
#include <string_view>
#include <unordered_map>

#include <unistd.h>

namespace fs = std::filesystem;

namespace loom::plugins::recommender {

namespace {

/// The largest file read: MovieLens's largest, ml-32m's ratings.csv, is 0.9 GB.
constexpr int64_t kMostBytes = int64_t{8} << 30;
constexpr size_t kChunk = size_t{1} << 20;         // (read a part at a time)
constexpr size_t kLongestLine = size_t{64} << 20;  // (MovieLens's lines are under a kilobyte)
constexpr size_t kLongestRecord = size_t{1} << 20;  // (a CSV record of several lines: a tag, a title)

/// The rows of a file with their line numbers, for messages that name file:line. The file is read
/// a part at a time and parsed as it comes: a damaged one is refused at its first bad line without
/// the rest in memory (a 3 GiB file bad at line 241 took 3.5 GB and 5 s to refuse; probe L). A
/// FIFO, a device or a folder is an error, never a blocking read, and a file larger than any
/// MovieLens (a sparse file, a disk image) is refused before it is read.
class Rows {
 public:
  explicit Rows(const fs::path& path) : path_(path) {
    fd_ = sdk::open_regular_file(path, kMostBytes, "interactions: ", "a MovieLens folder as unpacked has it",
                                 "point data.root at a MovieLens folder as unpacked");
    try {
      fill();
    } catch (...) {
      ::close(fd_);  // (no destructor for a constructor that throws)
      throw;
    }
    // A first line of NUL bytes (a sparse or damaged file, a disk image) or UTF-16 text: refused
    // at once (a NUL further on is its row's error).
    const std::string_view first = std::string_view(buffer_).substr(0, 4096);
    if (first.substr(0, first.find('\n')).find('\0') != std::string_view::npos || first.starts_with("\xFF\xFE") ||
        first.starts_with("\xFE\xFF")) {
      if (fd_ >= 0) ::close(fd_);
      throw sdk::Error("interactions: " + path.string() +
                       ":1: the file is UTF-16 (or holds NUL bytes); save it as UTF-8, e.g. iconv -f UTF-16 -t UTF-8");
    }
    // A UTF-8 byte-order mark (a spreadsheet's "CSV UTF-8") is no part of the first field.
    if (first.starts_with("\xEF\xBB\xBF")) pos_ = 3;
  }
  ~Rows() {
    if (fd_ >= 0) ::close(fd_);
  }
  Rows(const Rows&) = delete;
  Rows& operator=(const Rows&) = delete;

  /// The next line with more than blanks (without its line ending), valid until the next call;
  /// false at the end. (A line of spaces was "1 fields, expected 4" where an empty one is passed over.)
  bool next(std::string_view& line) {
    while (next_line(line))
      if (line.find_first_not_of(blanks_) != std::string_view::npos) return true;
    return false;
  }

  /// The next CSV record: its line, or its lines joined by newlines where a quoted field holds line
  /// breaks (RFC 4180; a tag or a title of free text), valid until the next call; false at the end.
  /// Errors name the record's lines ("tags.csv:12-14"). A quote left open (a stray one) is an
  /// error at the line that opened it once the record passes kLongestRecord or the file ends, not
  /// the rest of the file joined into one field.
  bool next_record(std::string_view& line) {
    if (!next(line)) return false;
    if (std::count(line.begin(), line.end(), '"') % 2 == 0) return true;  // (quotes close in pairs: "" is one inside)
    const int64_t start = number_;
    record_.assign(line);
    size_t quotes = 1;
    for (std::string_view more; quotes % 2 == 1;) {
      // (both errors name the line that opened the quote, the one to fix; the reader stops there)
      if (!next_line(more)) {
        const int64_t later = number_ - start;
        first_ = number_ = start;
        throw error("a quoted field is not closed (the file ends " +
                    (later == 0 ? std::string("on that line") : std::to_string(later) + (later == 1 ? " line later" : " lines later")) +
                    "): a stray quote (\") or a file cut short; inside a quoted field a quote is written twice (\"\")");
      }
      quotes += static_cast<size_t>(std::count(more.begin(), more.end(), '"'));
      record_.append("\n").append(more);
      if (record_.size() > kLongestRecord) {
        first_ = number_ = start;
        throw error("a quoted field is not closed within " + std::to_string(kLongestRecord >> 10) +
                    " KiB: a stray quote (\"); inside a quoted field a quote is written twice (\"\")");
      }
    }
    first_ = start;
    line = record_;
    return true;
  }

 private:
  /// The next line, empty or not (without its line ending), valid until the next call; false at the end.
  bool next_line(std::string_view& line) {
    for (;;) {
      size_t end, from = pos_;
      while ((end = buffer_.find('\n', from)) == std::string::npos && !ended_) {
        const size_t searched = buffer_.size() - pos_;
        if (searched > kLongestLine)
          throw sdk::Error("interactions: " + path_.string() + ":" + std::to_string(number_ + 1) + ": a line of more than " +
                           std::to_string(kLongestLine >> 20) + " MiB: the file is damaged or not MovieLens" +
                           (buffer_.find('\r', pos_) != std::string::npos
                                ? std::string(" (or its lines end in a carriage return alone, old Mac line endings: "
                                              "convert them to newlines, e.g. tr '\\r' '\\n')")
                                : std::string()));
        fill();  // (what was parsed goes: pos_ is 0 after it)
        from = searched;
      }
      if (end == std::string::npos) {
        if (pos_ >= buffer_.size()) return false;
        end = buffer_.size();
      }
      line = std::string_view(buffer_).substr(pos_, end - pos_);
      pos_ = end + 1;
      ++number_;
      if (!line.empty() && line.back() == '\r') line.remove_suffix(1);
      // (a carriage return inside a line of a file without newlines: old Mac line endings, the
      // whole file one line of thousands of fields, which was all its error said; probe M. One in a
      // quoted field of a file of newlines is the field's.)
      first_ = number_;
      if (!lines_ && line.find('\r') != std::string_view::npos)
        throw error("the file's lines end in a carriage return alone (old Mac line endings); convert them to newlines, "
                    "e.g. tr '\\r' '\\n'");
      return true;
    }
  }

 public:

  /// "interactions: /data/ml-1m/ratings.dat:17: <what>".
  sdk::Error error(const std::string& what) const {
    // The row's own bytes are quoted in `what`: a NUL or a control character among them would cut
    // the message short or garble the terminal, so each is shown as \xNN.
    std::string shown;
    for (const char c : what) {
      const auto byte = static_cast<unsigned char>(c);
      if (byte >= 0x20 && byte != 0x7f) {
        shown += c;
      } else {
        char code[8];
        std::snprintf(code, sizeof code, "\\x%02x", byte);
        shown += code;
      }
    }
    return sdk::Error("interactions: " + path_.string() + ":" + std::to_string(first_) +
                      (first_ < number_ ? "-" + std::to_string(number_) : std::string()) + ": " + shown);
  }

  const fs::path& path() const { return path_; }
  /// A tab-separated file: a line of tabs is a row of empty fields (damage), not a blank line.
  void tabs_are_fields() { blanks_ = " "; }
  int64_t line_number() const { return number_; }

 private:
  /// Drops what was parsed, and reads the next part of the file after what is left.
  void fill() {
    buffer_.erase(0, std::min(pos_, buffer_.size()));
    pos_ = 0;
    const size_t had = buffer_.size();
    buffer_.resize(had + kChunk);
    ssize_t got;
    do {
      got = ::read(fd_, buffer_.data() + had, kChunk);
    } while (got < 0 && errno == EINTR);
    if (got < 0) {
      const int error = errno;
      buffer_.resize(had);
      throw sdk::Error("interactions: reading " + path_.string() + " failed: " + std::strerror(error));
    }
    buffer_.resize(had + static_cast<size_t>(got));
    read_ += got;
    if (read_ > kMostBytes)  // (a file that grows while it is read)
      throw sdk::Error("interactions: " + path_.string() + " holds more than " + std::to_string(kMostBytes) +
                       " bytes, more than such a file has: it is damaged or another file");
    if (got > 0) {
      last_ = buffer_.back();
      lines_ = lines_ || std::memchr(buffer_.data() + had, '\n', static_cast<size_t>(got)) != nullptr;
      return;
    }
    ended_ = true;
    ::close(fd_);
    fd_ = -1;
    // MovieLens's files end with a line ending: a last line without one may be a row cut short (a
    // copy or a download interrupted), read as it stands; said, since it may not be. (A file of
    // carriage returns alone is named as such where its header is read, without this.)
    if (read_ > 0 && last_ != '\n' && !(last_ == '\r' && !lines_))
      sdk::log::warn("interactions: ", path_.string(), " does not end with a line ending: its last line may be cut short ",
                     "(an interrupted copy or download); it is read as it stands");
  }

  fs::path path_;
  int fd_ = -1;
  std::string buffer_;                  // (the part of the file not yet parsed, and the current line)
  size_t pos_ = 0;                      // (where the next line starts in it)
  bool ended_ = false, lines_ = false;  // (the end reached; a newline seen)
  char last_ = 0;                       // (the last byte read)
  int64_t read_ = 0;                    // (bytes read)
  int64_t number_ = 0;                  // (the current line's number)
  std::string_view blanks_ = " \t";  // (what a line of nothing else is passed over as)
  int64_t first_ = 0;                   // (the current record's first line: number_ but in a record of lines)
  std::string record_;                  // (a record of several lines, joined)
};

std::vector<std::string_view> split_on(std::string_view line, std::string_view sep) {
  std::vector<std::string_view> out;
  size_t start = 0;
  while (true) {
    const size_t at = line.find(sep, start);
    if (at == std::string_view::npos) {
      out.push_back(line.substr(start));
      return out;
    }
    out.push_back(line.substr(start, at - start));
    start = at + sep.size();
  }
}

/// One CSV row (RFC 4180: fields in double quotes may hold commas, "" is a quote).
std::vector<std::string> csv_fields(std::string_view line, const Rows& rows) {
  std::vector<std::string> out(1);
  bool quoted = false;
  for (size_t i = 0; i < line.size(); ++i) {
    const char c = line[i];
    if (quoted) {
      if (c == '"' && i + 1 < line.size() && line[i + 1] == '"') out.back() += '"', ++i;
      else if (c == '"') quoted = false;
      else out.back() += c;
    } else if (c == '"') {
      quoted = true;
    } else if (c == ',') {
      out.emplace_back();
    } else {
      out.back() += c;
    }
  }
  if (quoted) throw rows.error("a quoted field is not closed");
  return out;
}

std::string trimmed(std::string_view s) {
  while (!s.empty() && (s.front() == ' ' || s.front() == '\t')) s.remove_prefix(1);
  while (!s.empty() && (s.back() == ' ' || s.back() == '\t')) s.remove_suffix(1);
  return std::string(s);
}

/// A field as an error shows it: its first 40 bytes where it is longer (a 10 MB field was the
/// whole of its error's line; Rows::error escapes control bytes).
std::string shown(const std::string& field) {
  return field.size() > 40 ? field.substr(0, 40) + "... (" + std::to_string(field.size()) + " bytes)" : field;
}

int64_t integer(std::string_view text, const char* field, const Rows& rows) {
  const std::string t = trimmed(text);
  int64_t value = 0;
  const auto [end, ec] = std::from_chars(t.data(), t.data() + t.size(), value);
  if (ec == std::errc::result_out_of_range && end == t.data() + t.size())
    throw rows.error(std::string(field) + " " + shown(t) + " is outside the 64-bit integers (-9223372036854775808 to " +
                     "9223372036854775807)");
  if (t.empty() || ec != std::errc() || end != t.data() + t.size())
    throw rows.error(std::string(field) + " '" + shown(t) + "' is not an integer");
  return value;
}

float number(std::string_view text, const char* field, const Rows& rows) {
  const std::string t = trimmed(text);
  double value = 0;
  const auto [end, ec] = std::from_chars(t.data(), t.data() + t.size(), value);
  // A number past a double's range (1e309, 1e-400: "is not a number", a probe) is 0 here, outside
  // every rating scale, which rating() says with the text as written.
  if (!t.empty() && ec == std::errc::result_out_of_range && end == t.data() + t.size()) return 0.0f;
  if (t.empty() || ec != std::errc() || end != t.data() + t.size() || !std::isfinite(value))
    throw rows.error(std::string(field) + " '" + shown(t) + "' is not a number");
  return static_cast<float>(value);
}

/// A rating on MovieLens's scale: 1 to 5 stars (ml-100k, ml-1m), 0.5 to 5 in half stars (ml-latest).
/// Anything else is a damaged row or not MovieLens: it would train the model to predict it.
float rating(std::string_view text, const char* field, const Rows& rows) {
  const float value = number(text, field, rows);
  if (value < 0.5f || value > 5.0f)
    throw rows.error(std::string(field) + " " + shown(trimmed(text)) + " is outside MovieLens's scale (0.5 to 5 stars); " +
                     "mend the row (a file of another scale is not MovieLens: a dataset plugin of its own reads it)");
  return value;
}

/// Builds RawData row by row: the catalogue first, then the interactions (users in order of
/// first appearance).
class Reader {
 public:
  void add_item(Item item, const Rows& rows) {
    if (!item_index_.emplace(item.id, static_cast<int64_t>(data_.items.size())).second)
      throw rows.error("item id " + shown(item.id) + " appears twice");
    item.title = to_utf8_line(item.title);
    item.genres = to_utf8_line(item.genres);
    data_.items.push_back(std::move(item));
  }

  void add_tag(const std::string& item_id, const std::string& tag, size_t max_tags) {
    auto it = item_index_.find(item_id);
    if (it == item_index_.end()) return;  // tags of movies not in the catalogue carry nothing
    auto& tags = tags_[it->second];
    const std::string clean = trimmed(to_utf8_line(tag));  // (a tag's line breaks are spaces: trimmed after)
    if (clean.empty()) return;
    if (tags.size() < max_tags && std::find(tags.begin(), tags.end(), clean) == tags.end()) tags.push_back(clean);
  }

  void add_interaction(const std::string& user_id, const std::string& item_id, float rating, int64_t time,
                       const Rows& rows, const std::string& catalogue) {
    auto item = item_index_.find(item_id);
    if (item == item_index_.end())
      throw rows.error("item id " + shown(item_id) + " is not in " + catalogue +
                       (item_index_.empty() ? ", which holds no items (an empty or cut copy: unpack the folder again)" : ""));
    auto [user, added] = user_index_.emplace(user_id, static_cast<int64_t>(data_.user_ids.size()));
    if (added) data_.user_ids.push_back(user_id);
    data_.user.push_back(user->second);
    data_.item.push_back(item->second);
    data_.rating.push_back(rating);
    data_.time.push_back(time);
  }

  /// After the last interaction of `file`: a user who rates one item twice is a damaged file
  /// (or one joined twice); MovieLens has one rating per user and item. Split by time, the copy
  /// would be both a training and a test interaction: the test would score what was trained on.
  void refuse_repeats(const fs::path& file) const {
    std::vector<uint64_t> pairs(data_.user.size());
    for (size_t i = 0; i < pairs.size(); ++i)
      pairs[i] = static_cast<uint64_t>(data_.user[i]) << 32 | static_cast<uint64_t>(data_.item[i]);
    std::sort(pairs.begin(), pairs.end());
    const auto twice = std::adjacent_find(pairs.begin(), pairs.end());
    if (twice == pairs.end()) return;
    const auto repeats = static_cast<int64_t>(pairs.size()) -
                         static_cast<int64_t>(std::distance(pairs.begin(), std::unique(pairs.begin(), pairs.end())));
    throw sdk::Error("interactions: " + file.string() + ": user " + data_.user_ids[*twice >> 32] + " rates item " +
                     data_.items[*twice & 0xffffffffu].id + " more than once (" + std::to_string(repeats) +
                     (repeats == 1 ? " repeated rating" : " repeated ratings") + " in all); MovieLens has one rating per user and item: the file is damaged or joined "
                     "twice. Keep each user's last rating of an item");
  }

  RawData take() {
    for (auto& [index, tags] : tags_) {
      std::string joined;
      for (const auto& t : tags) joined += (joined.empty() ? "" : ", ") + t;
      data_.items[index].tags = joined;
    }
    return std::move(data_);
  }

 private:
  RawData data_;
  std::unordered_map<std::string, int64_t> item_index_, user_index_;
  std::map<int64_t, std::vector<std::string>> tags_;
};

const char* const kMl100kGenres[] = {"unknown", "Action", "Adventure", "Animation", "Children's", "Comedy", "Crime",
                                      "Documentary", "Drama", "Fantasy", "Film-Noir", "Horror", "Musical", "Mystery",
                                      "Romance", "Sci-Fi", "Thriller", "War", "Western"};

/// A ratings row's fields read in their order, so that the first wrong one is named (a function's
/// arguments are evaluated in any order: a header line was "timestamp 'timestamp' is not an integer").
void add_rating_row(Reader& reader, const std::vector<std::string_view>& f, const std::array<const char*, 4>& names,
                    const Rows& rows, const char* items_file) {
  const int64_t user = integer(f[0], names[0], rows);
  const int64_t item = integer(f[1], names[1], rows);
  const float value = rating(f[2], names[2], rows);
  const int64_t time = integer(f[3], names[3], rows);
  reader.add_interaction(std::to_string(user), std::to_string(item), value, time, rows, items_file);
}

RawData read_ml100k(const fs::path& root) {
  Reader reader;
  std::vector<std::string> genres(std::begin(kMl100kGenres), std::end(kMl100kGenres));
  std::string_view line;
  bool genre_file = false;  // (u.genre sets the flags' count: an empty one was blamed on u.item's lines)
  // (symlink_status: a link to nothing is read, and named, not skipped in silence)
  if (std::error_code ec; fs::exists(fs::symlink_status(root / "u.genre", ec))) {
    genre_file = true;
    genres.clear();
    Rows rows(root / "u.genre");
    while (rows.next(line)) {
      const auto f = split_on(line, "|");
      if (f.size() != 2) throw rows.error("expected name|index");
      const int64_t index = integer(f[1], "genre index", rows);
      if (index != static_cast<int64_t>(genres.size())) throw rows.error("genre index " + std::to_string(index) + " out of order");
      genres.push_back(to_utf8_line(std::string(f[0])));
    }
  }
  {
    Rows rows(root / "u.item");
    while (rows.next(line)) {
      const auto f = split_on(line, "|");
      if (f.size() != 5 + genres.size())
        throw rows.error(std::to_string(f.size()) + " fields, expected " + std::to_string(5 + genres.size()) +
                         " (movie id|title|release date|video release date|IMDb URL|one flag per genre" +
                         (genre_file && genres.size() != std::size(kMl100kGenres)
                              ? ": u.genre names " + std::to_string(genres.size()) + ", not MovieLens's 19; is it whole?"
                              : std::string()) +
                         ")");
      Item item;
      item.id = std::to_string(integer(f[0], "movie id", rows));
      item.title = std::string(f[1]);
      for (size_t g = 0; g < genres.size(); ++g) {
        const int64_t flag = integer(f[5 + g], "genre flag", rows);
        if (flag != 0 && flag != 1) throw rows.error("genre flag " + std::to_string(g + 1) + " is " + std::to_string(flag) + ", not 0 or 1");
        if (flag == 1 && genres[g] != "unknown") item.genres += (item.genres.empty() ? "" : ", ") + genres[g];
      }
      reader.add_item(std::move(item), rows);
    }
  }
  Rows rows(root / "u.data");
  rows.tabs_are_fields();
  for (bool first = true; rows.next(line); first = false) {
    const auto f = split_on(line, "\t");
    if (f.size() != 4) throw rows.error(std::to_string(f.size()) + " fields, expected 4 (user id, item id, rating, timestamp; tab-separated)");
    // (ml-100k's u.data has no header: a first row of words is said as one, if it is one)
    const auto word = [](std::string_view v) { return !v.empty() && std::isalpha(static_cast<unsigned char>(v[0])); };
    if (first && word(f[0]) && word(f[1]) && word(f[2]) && word(f[3]))
      throw rows.error("'" + std::string(line) + "' is no rating: ml-100k's u.data has no header line; if this is one, remove it");
    add_rating_row(reader, f, {"user id", "item id", "rating", "timestamp"}, rows, "u.item");
  }
  reader.refuse_repeats(root / "u.data");
  return reader.take();
}

RawData read_ml1m(const fs::path& root) {
  Reader reader;
  std::string_view line;
  {
    Rows rows(root / "movies.dat");
    while (rows.next(line)) {
      // The id before the first "::", the genres after the last: a title ending in ':' ("Bar:::Comedy")
      // was the title "Bar" of the genre ":Comedy"; one with "::" in it is the title whole.
      const size_t first = line.find("::"), last = line.rfind("::");
      if (first == std::string_view::npos || last < first + 2)  // ("1:::Comedy": two fields, the "::" overlap)
        throw rows.error(std::to_string(first == std::string_view::npos ? 1 : 2) +
                         " fields, expected 3 (MovieID::Title::Genres)");
      Item item;
      item.id = std::to_string(integer(line.substr(0, first), "MovieID", rows));
      item.title = std::string(line.substr(first + 2, last - first - 2));
      for (auto g : split_on(line.substr(last + 2), "|")) item.genres += (item.genres.empty() ? "" : ", ") + std::string(g);
      reader.add_item(std::move(item), rows);
    }
  }
  Rows rows(root / "ratings.dat");
  while (rows.next(line)) {
    const auto f = split_on(line, "::");
    if (f.size() != 4) throw rows.error(std::to_string(f.size()) + " fields, expected 4 (UserID::MovieID::Rating::Timestamp)");
    add_rating_row(reader, f, {"UserID", "MovieID", "Rating", "Timestamp"}, rows, "movies.dat");
  }
  reader.refuse_repeats(root / "ratings.dat");
  return reader.take();
}

RawData read_ml_latest(const fs::path& root, size_t max_tags) {
  Reader reader;
  std::string_view line;
  auto header = [&](Rows& rows, const char* expected) {
    if (!rows.next(line))  // (no line to name: "movies.csv:0:")
      throw sdk::Error("interactions: " + rows.path().string() + " is empty; expected the header " + std::string(expected));
    // A file in another encoding or with old Mac line endings reads as one line that begins with
    // the header, or as bytes: named, with the fix, not as a file without rows or an odd header.
    if (line.size() >= 2 && ((line[0] == '\xFF' && line[1] == '\xFE') || (line[0] == '\xFE' && line[1] == '\xFF') ||
                             line.find('\0') != std::string_view::npos))
      throw rows.error("the file is UTF-16 (or holds NUL bytes); save it as UTF-8, e.g. iconv -f UTF-16 -t UTF-8");
    if (line.find('\r') != std::string_view::npos)
      throw rows.error("the file's lines end in a carriage return alone (old Mac line endings); convert them to "
                       "newlines, e.g. tr '\\r' '\\n'");
    std::string fields;  // (an exporter that quotes every field quotes the header's too)
    for (const auto& f : csv_fields(line, rows)) fields += (fields.empty() ? "" : ",") + trimmed(f);
    if (trimmed(line) != expected && fields != expected)
      throw rows.error("the header is '" + shown(std::string(line)) + "', expected " + expected);
  };
  {
    Rows rows(root / "movies.csv");
    header(rows, "movieId,title,genres");
    while (rows.next_record(line)) {
      const auto f = csv_fields(line, rows);
      if (f.size() != 3) throw rows.error(std::to_string(f.size()) + " fields, expected 3 (movieId,title,genres; quote a title with commas)");
      Item item;
      item.id = std::to_string(integer(f[0], "movieId", rows));
      item.title = trimmed(to_utf8_line(f[1]));  // (a line break in it is a space: trimmed after)
      if (f[2] != "(no genres listed)")
        for (auto g : split_on(f[2], "|")) item.genres += (item.genres.empty() ? "" : ", ") + std::string(g);
      reader.add_item(std::move(item), rows);
    }
  }
  if (std::error_code ec; fs::exists(fs::symlink_status(root / "tags.csv", ec)) && max_tags > 0) {
    Rows rows(root / "tags.csv");
    header(rows, "userId,movieId,tag,timestamp");
    while (rows.next_record(line)) {
      const auto f = csv_fields(line, rows);
      if (f.size() != 4) throw rows.error(std::to_string(f.size()) + " fields, expected 4 (userId,movieId,tag,timestamp)");
      reader.add_tag(std::to_string(integer(f[1], "movieId", rows)), trimmed(f[2]), max_tags);
    }
  }
  Rows rows(root / "ratings.csv");
  header(rows, "userId,movieId,rating,timestamp");
  std::vector<std::string> unquoted;
  while (rows.next(line)) {
    // (fields in quotes, as some exporters write every field: read as CSV; the plain split is the fast path)
    std::vector<std::string_view> f;
    if (line.find('"') == std::string::npos) {
      f = split_on(line, ",");
    } else {
      unquoted = csv_fields(line, rows);
      f.assign(unquoted.begin(), unquoted.end());
    }
    if (f.size() != 4) throw rows.error(std::to_string(f.size()) + " fields, expected 4 (userId,movieId,rating,timestamp)");
    add_rating_row(reader, f, {"userId", "movieId", "rating", "timestamp"}, rows, "movies.csv");
  }
  reader.refuse_repeats(root / "ratings.csv");
  return reader.take();
}

}  // namespace

Interactions::Interactions(const sdk::Options& o)
    : InteractionDataset("interactions"), root_(o.get_string("root")), format_(o.get_string("format")),
      max_tags_(o.get_int("max_tags")), split_(SplitOptions::from(o)) {
  if (root_.empty())
    throw sdk::Error("interactions: data.root is not set; point it at a MovieLens folder as downloaded (ml-100k, ml-1m, "
                     "ml-latest-small or ml-latest from https://grouplens.org/datasets/movielens/)");
}

void Interactions::setup() {
  const fs::path root = root_;
  std::error_code ec;
  if (!fs::is_directory(root, ec)) {  // (a loop of links, a file, nothing: said as what it is)
    const std::string what = sdk::what_is_at(root);
    throw sdk::Error("interactions: data.root " + root.string() +
                     (what.rfind("cannot", 0) == 0 ? " " + what
                      : what == "no such file"     ? " does not exist"
                                                   : " is " + (what.empty() ? std::string("a file") : what) + ", not a folder") +
                     "; point it at a MovieLens folder (a run's `loom eval` or `loom recommend` after its data moved "
                     "takes --set data.root=NEW_FOLDER)");
  }
  std::string format = format_;
  if (format == "auto") {
    std::vector<std::string> found;  // (a folder holding two formats is read as the first, and said)
    // (a link to nothing is there too: reading it says so, not "holds no MovieLens ratings")
    const auto there = [&](const char* file) { return fs::exists(fs::symlink_status(root / file, ec)); };
    for (const char* file : {"u.data", "ratings.dat", "ratings.csv"})
      if (there(file)) found.emplace_back(file);
    if (found.size() > 1)
      sdk::log::warn("interactions: ", root.string(), " holds the ratings of several MovieLens formats (", found[0], ", ",
                     found[1], "); reading ", found[0], ". Set data.format (ml-100k, ml-1m, ml-latest) to choose");
    if (there("u.data")) format = "ml-100k";
    else if (there("ratings.dat")) format = "ml-1m";
    else if (there("ratings.csv")) format = "ml-latest";
    else
      throw sdk::Error("interactions: " + root.string() + " holds no MovieLens ratings (u.data for ml-100k, ratings.dat "
                       "for ml-1m, ratings.csv for ml-latest); set data.root to the unpacked folder");
  } else if (const char* ratings = format == "ml-100k" ? "u.data" : format == "ml-1m" ? "ratings.dat" : "ratings.csv";
             !fs::exists(fs::symlink_status(root / ratings, ec))) {  // (a file that is there but wrong: Rows says what)
    throw sdk::Error("interactions: data.format = " + format + " reads " + (root / ratings).string() + ", which is not there; " +
                     "set data.format to the folder's format, or auto to find it");
  }
  RawData data = format == "ml-100k" ? read_ml100k(root)
                 : format == "ml-1m" ? read_ml1m(root)
                                     : read_ml_latest(root, static_cast<size_t>(max_tags_));
  if (data.user.empty()) throw sdk::Error("interactions: " + root.string() + " (" + format + ") has no ratings");
  build(std::move(data), split_, format + " at " + root.string());
}

}  // namespace loom::plugins::recommender
