// The filter, the splits and the spec of interaction_data.hpp.
#include "interaction_data.hpp"

#include <loom/sdk/log.hpp>

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/core/Generator.h>
#include <ATen/ops/from_blob.h>
#include <ATen/ops/randperm.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <numeric>
#include <sstream>
#include <utility>

namespace loom::plugins::recommender {

std::string Item::text() const {
  std::string out = title;
  if (!genres.empty()) out += " | " + genres;
  if (!tags.empty()) out += " | " + tags;
  return out;
}

Task parse_task(const std::string& name) {
  if (name == "rating") return Task::kRating;
  if (name == "ranking") return Task::kRanking;
  throw sdk::Error("task '" + name + "' is neither rating (explicit ratings, MSE) nor ranking (implicit feedback)");
}

const char* task_name(Task task) { return task == Task::kRating ? "rating" : "ranking"; }

SplitOptions SplitOptions::from(const sdk::Options& o) {
  SplitOptions s;
  s.task = parse_task(o.get_string("task"));
  s.split = o.get_string("split");
  s.min_interactions = o.get_int("min_interactions");
  s.holdout = o.get_float("holdout");
  s.seed = static_cast<uint64_t>(o.get_int("seed"));
  return s;
}

std::string to_utf8_line(const std::string& text) {
  // Valid UTF-8: well-formed sequences, no overlong forms, no surrogates, <= U+10FFFF.
  auto valid = [&] {
    for (size_t i = 0; i < text.size();) {
      const auto c = static_cast<unsigned char>(text[i]);
      size_t n = c < 0x80 ? 1 : (c >> 5) == 0x6 ? 2 : (c >> 4) == 0xe ? 3 : (c >> 3) == 0x1e ? 4 : 0;
      if (n == 0 || i + n > text.size()) return false;
      uint32_t cp = n == 1 ? c : n == 2 ? (c & 0x1f) : n == 3 ? (c & 0x0f) : (c & 0x07);
      for (size_t k = 1; k < n; ++k) {
        const auto d = static_cast<unsigned char>(text[i + k]);
        if ((d >> 6) != 0x2) return false;
        cp = (cp << 6) | (d & 0x3f);
      }
      static constexpr uint32_t kMin[] = {0, 0, 0x80, 0x800, 0x10000};
      if (cp < kMin[n] || cp > 0x10ffff || (cp >= 0xd800 && cp <= 0xdfff)) return false;
      i += n;
    }
    return true;
  };
  std::string out;
  if (valid()) {
    out = text;
  } else {
    for (char ch : text) {
      const auto c = static_cast<unsigned char>(ch);
      if (c < 0x80) {
        out.push_back(ch);
      } else {
        out.push_back(static_cast<char>(0xc0 | (c >> 6)));
        out.push_back(static_cast<char>(0x80 | (c & 0x3f)));
      }
    }
  }
  // (a NUL, in a damaged file, cut the title short where the text was read as a C string; the
  // other control characters garble a terminal that shows it)
  for (char& ch : out)
    if (static_cast<unsigned char>(ch) < 0x20 || ch == '\x7f') ch = ' ';
  // (and U+0080 to U+009F, C1 controls: Latin-1's 0x9B is a terminal's CSI)
  for (size_t i = 0; i + 1 < out.size(); ++i)
    if (out[i] == '\xC2' && static_cast<unsigned char>(out[i + 1]) >= 0x80 && static_cast<unsigned char>(out[i + 1]) <= 0x9F)
      out.replace(i, 2, " ");
  return out;
}

namespace {

uint64_t mixed(uint64_t x) {  // (SplitMix64's finalizer: each bit of x moves half of the result's)
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}

uint64_t hashed(const std::string& text) {  // (FNV-1a: the same on every machine and build)
  uint64_t h = 0xcbf29ce484222325ULL;
  for (const char c : text) h = (h ^ static_cast<unsigned char>(c)) * 0x100000001b3ULL;
  return mixed(h);
}

at::Tensor longs(const std::vector<int64_t>& v) {
  return at::from_blob(const_cast<int64_t*>(v.data()), {static_cast<int64_t>(v.size())}, at::kLong).clone();
}

at::Tensor floats(const std::vector<float>& v) {
  return at::from_blob(const_cast<float*>(v.data()), {static_cast<int64_t>(v.size())}, at::kFloat).clone();
}

std::string joined(const std::vector<std::string>& lines) {
  std::string out;
  for (size_t i = 0; i < lines.size(); ++i) out += (i ? "\n" : "") + lines[i];
  return out;
}

}  // namespace

void InteractionDataset::build(RawData data, const SplitOptions& o, const std::string& source) {
  const size_t n = data.user.size();
  if (data.item.size() != n || data.rating.size() != n || data.time.size() != n)
    throw sdk::Error(name_ + ": interactions of unequal lengths (a bug in the reader)");
  const bool leave_last_out = o.leave_last_out();
  if (!leave_last_out && o.split != "random" && o.split != "auto")
    throw sdk::Error(name_ + ": data.split '" + o.split + "' is not auto, leave_last_out or random");
  if (leave_last_out && o.min_interactions < 3)
    throw sdk::Error(name_ + ": the leave-last-out split needs data.min_interactions >= 3 (a training, a validation and a "
                     "test item per user); it is " + std::to_string(o.min_interactions));
  if (!leave_last_out && !(o.holdout > 0 && o.holdout < 0.5))
    throw sdk::Error(name_ + ": a random split needs data.holdout above 0 (the test share, and the validation share; at most "
                     "0.49)");

  // The filter, and users re-indexed densely in their order of first appearance.
  const int64_t users_before = static_cast<int64_t>(data.user_ids.size());
  std::vector<int64_t> per_user(users_before, 0);
  for (int64_t u : data.user) ++per_user[u];
  std::vector<int64_t> new_index(users_before, -1);
  std::vector<std::string> user_ids;
  for (int64_t u = 0; u < users_before; ++u)
    if (per_user[u] >= o.min_interactions) {
      new_index[u] = static_cast<int64_t>(user_ids.size());
      user_ids.push_back(data.user_ids[u]);
    }
  const int64_t users = static_cast<int64_t>(user_ids.size());
  const int64_t items = static_cast<int64_t>(data.items.size());
  if (users == 0)
    throw sdk::Error(name_ + ": no user of " + source + " has data.min_interactions = " + std::to_string(o.min_interactions) +
                     " interactions or more (" + std::to_string(users_before) + " users, " + std::to_string(n) +
                     " interactions); lower it");
  std::vector<size_t> kept;  // interaction indices of kept users, in the file's order
  kept.reserve(n);
  for (size_t i = 0; i < n; ++i)
    if (new_index[data.user[i]] >= 0) kept.push_back(i);
  // Note [A split the file's order does not choose]: which interactions are held out depends on
  // the data, never on the order of the files' lines: a user's interactions of one second (MovieLens
  // has many) are ordered by item id, and the random split permutes them ordered by user and item id (a
  // user who sorted the ratings file got another test set, and `loom eval` of a run scored items
  // the model had trained on; probe L). The held-out pairs' fingerprint (splits.fingerprint) goes
  // into each checkpoint, and evaluating on other held-out interactions is said.
  // (users and items by their ids: their indices follow the order in which the files name them)
  const auto rank_by_id = [](const auto& count, const auto& id_of) {
    std::vector<int64_t> by_id(static_cast<size_t>(count)), rank(static_cast<size_t>(count));
    std::iota(by_id.begin(), by_id.end(), 0);
    // (by length, then text: whole-number ids, MovieLens's, in their numeric order, 9 before 10)
    std::sort(by_id.begin(), by_id.end(), [&](int64_t a, int64_t b) {
      const std::string &x = id_of(a), &y = id_of(b);
      return x.size() != y.size() ? x.size() < y.size() : x < y;
    });
    for (size_t r = 0; r < by_id.size(); ++r) rank[static_cast<size_t>(by_id[r])] = static_cast<int64_t>(r);
    return rank;
  };
  const std::vector<int64_t> id_rank = rank_by_id(users_before, [&](int64_t u) -> const std::string& { return data.user_ids[u]; });
  const std::vector<int64_t> item_rank =
      rank_by_id(static_cast<int64_t>(data.items.size()), [&](int64_t i) -> const std::string& { return data.items[i].id; });

  // Split: 0 train, 1 validation, 2 test.
  std::vector<int8_t> split(n, 0);
  if (leave_last_out) {
    std::vector<std::vector<size_t>> by_user(users);
    for (size_t i : kept) by_user[new_index[data.user[i]]].push_back(i);
    for (auto& list : by_user) {
      std::sort(list.begin(), list.end(), [&](size_t a, size_t b) {
        return std::pair(data.time[a], item_rank[data.item[a]]) < std::pair(data.time[b], item_rank[data.item[b]]);
      });
      split[list[list.size() - 1]] = 2;
      split[list[list.size() - 2]] = 1;
    }
  } else {
    // (by user id, then item: a bucket per user, each sorted; a sort of every interaction by the
    // two, indirectly, took seconds on ml-32m's 32 million)
    std::vector<size_t> ordered(kept.size()), start(static_cast<size_t>(users_before) + 1, 0);
    for (size_t i : kept) ++start[static_cast<size_t>(id_rank[data.user[i]]) + 1];
    std::partial_sum(start.begin(), start.end(), start.begin());
    std::vector<size_t> next(start.begin(), start.end() - 1);
    for (size_t i : kept) ordered[next[static_cast<size_t>(id_rank[data.user[i]])]++] = i;
    for (size_t r = 0; r + 1 < start.size(); ++r)
      std::sort(ordered.begin() + static_cast<std::ptrdiff_t>(start[r]), ordered.begin() + static_cast<std::ptrdiff_t>(start[r + 1]),
                [&](size_t a, size_t b) { return item_rank[data.item[a]] < item_rank[data.item[b]]; });
    at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(o.seed);
    const at::Tensor perm = at::randperm(static_cast<int64_t>(kept.size()), gen, at::TensorOptions().dtype(at::kLong));
    const int64_t* p = perm.data_ptr<int64_t>();
    const auto held = static_cast<int64_t>(o.holdout * static_cast<double>(kept.size()));
    if (held == 0) {
      const double least = std::ceil(1e4 / static_cast<double>(kept.size())) / 1e4;  // (rounded up: that share holds one out)
      std::ostringstream share, raise;
      share << o.holdout;
      raise << least;
      throw sdk::Error(name_ + ": data.holdout = " + share.str() + " of " + std::to_string(kept.size()) +
                       " interactions holds out none: the test and validation splits would be empty; " +
                       (least <= 0.49 ? "raise data.holdout to " + raise.str() + " or more"
                                      : std::string("too few interactions for a random split (data.split = leave_last_out "
                                                    "holds out each user's last two)")));
    }
    for (int64_t k = 0; k < static_cast<int64_t>(kept.size()); ++k)
      split[ordered[p[k]]] = k < held ? 2 : k < 2 * held ? 1 : 0;
  }

  struct Part {
    std::vector<int64_t> user, item;
    std::vector<float> rating;
  };
  Part parts[3];
  double rating_sum = 0;
  float rating_min = 0, rating_max = 0;
  int64_t rated = 0;
  std::vector<std::vector<int64_t>> seen(users);
  uint64_t fingerprint = 0;  // (a sum: the same whatever the order of the lines)
  // The rating task's values, every split's: the same pairs rated otherwise in place change what a
  // checkpoint predicts (its mean is the training split's, rating.mean) and its RMSE, and nothing said so.
  uint64_t ratings_fingerprint = 0;
  for (size_t i : kept) {
    Part& part = parts[split[i]];
    const int64_t u = new_index[data.user[i]];
    if (split[i] != 0)  // (of the ids: the indices are checked by the model)
      fingerprint += mixed(hashed(user_ids[u]) ^ mixed(hashed(data.items[data.item[i]].id) + static_cast<uint64_t>(split[i])));
    part.user.push_back(u);
    part.item.push_back(data.item[i]);
    part.rating.push_back(o.task == Task::kRanking ? 1.0f : data.rating[i]);
    if (o.task == Task::kRating) {
      uint32_t bits = 0;
      std::memcpy(&bits, &data.rating[i], sizeof bits);
      ratings_fingerprint += mixed(hashed(user_ids[u]) ^ mixed(hashed(data.items[data.item[i]].id) ^ mixed(bits)));
    }
    // (every split's: ranking one held-out item, the user's others are masked too; a random split's
    // other test items competed with it, while its other validation items were masked, so the
    // validation and test figures were not of one measure; probe)
    seen[u].push_back(data.item[i]);
    if (split[i] == 0) {
      rating_min = rated == 0 ? data.rating[i] : std::min(rating_min, data.rating[i]);
      rating_max = rated == 0 ? data.rating[i] : std::max(rating_max, data.rating[i]);
      rating_sum += data.rating[i];
      ++rated;
    }
  }
  const sdk::Split splits[3] = {sdk::Split::kTrain, sdk::Split::kValidation, sdk::Split::kTest};
  for (int s = 0; s < 3; ++s)
    set_split(splits[s], {{"user", longs(parts[s].user)}, {"item", longs(parts[s].item)}, {"rating", floats(parts[s].rating)}});

  std::vector<int64_t> indptr{0}, seen_items;
  for (auto& list : seen) {
    std::sort(list.begin(), list.end());
    list.erase(std::unique(list.begin(), list.end()), list.end());
    seen_items.insert(seen_items.end(), list.begin(), list.end());
    indptr.push_back(static_cast<int64_t>(seen_items.size()));
  }
  tables_ = {{"seen.indptr", longs(indptr)}, {"seen.items", longs(seen_items)}};

  spec_ = {};
  spec_.fields["user"] = {{}, c10::ScalarType::Long};
  spec_.fields["item"] = {{}, c10::ScalarType::Long};
  spec_.fields["rating"] = {{}, c10::ScalarType::Float};
  spec_.input_key = "user";
  spec_.target_key = "rating";
  std::vector<std::string> text, titles, item_ids;
  for (const Item& item : data.items) {
    text.push_back(item.text());
    titles.push_back(item.title);
    item_ids.push_back(item.id);
  }
  auto& a = spec_.attributes;
  a["task"] = task_name(o.task);
  a["users.count"] = std::to_string(users);
  a["items.count"] = std::to_string(items);
  a["users.ids"] = joined(user_ids);
  a["items.ids"] = joined(item_ids);
  a["items.title"] = joined(titles);
  a["items.text"] = joined(text);
  a["rating.mean"] = std::to_string(rated ? rating_sum / static_cast<double>(rated) : 0.0);
  a["rating.min"] = std::to_string(rating_min);
  a["rating.max"] = std::to_string(rating_max);
  a["source"] = source;
  char hex[17];
  std::snprintf(hex, sizeof hex, "%016llx", static_cast<unsigned long long>(fingerprint));
  a["splits.fingerprint"] = hex;
  // What the model reads of each item, in the items' order: a title or tag edited in place is said
  // at a resume or an evaluation (docs/recommender.md), as other held-out samples are.
  uint64_t text_fingerprint = 0;
  for (size_t i = 0; i < text.size(); ++i) text_fingerprint = mixed(text_fingerprint ^ hashed(text[i]) ^ mixed(i));
  std::snprintf(hex, sizeof hex, "%016llx", static_cast<unsigned long long>(text_fingerprint));
  a["items.text.fingerprint"] = hex;
  if (o.task == Task::kRating) {
    std::snprintf(hex, sizeof hex, "%016llx", static_cast<unsigned long long>(ratings_fingerprint));
    a["ratings.fingerprint"] = hex;
  }
  sdk::log::info(name_, ": ", source, ": ", users, " users (", users_before - users, " with fewer than ", o.min_interactions,
                 " interactions left out), ", items, " items; ", parts[0].user.size(), " training, ", parts[1].user.size(),
                 " validation, ", parts[2].user.size(), " test interactions (", task_name(o.task), ", ",
                 leave_last_out ? "each user's last two held out" : "random split", ")");
}

}  // namespace loom::plugins::recommender
