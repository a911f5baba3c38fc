// synthetic_interactions: a catalogue and users whose best achievable metric is known, for the
// recommender's quality checks. Each item has one genre, named in its text ("The Silver Harbor |
// comedy"); each user prefers one genre, hidden. A user's items are drawn one after another
// without replacement, an item of the preferred genre `w` times as likely as another, w chosen
// so that the first draw is from the preferred genre with probability `affinity`; the order of
// the draws is the user's history. Ratings are 3 + the item's quality + 1 (preferred genre) or
// -0.5 (another) + Gaussian noise of standard deviation `noise`.
//
// The best achievable metrics, from the generator (attributes optimum.hr_at_10, optimum.rmse):
// the next draw favours the preferred genre, so the Bayes-optimal ranking puts a user's unseen
// items of that genre first (in any order among themselves). With M such candidates and K others
// for a user whose test item is t, its expected HR@10 is min(1, 10 / M) when t is of the
// preferred genre and min(1, max(0, 10 - M) / K) otherwise; the optimum is the mean over users. For
// ratings the conditional mean is the best predictor, and its RMSE is the noise's deviation.
#include "datasets.hpp"

#include <loom/sdk/log.hpp>
#include <loom/sdk/stop.hpp>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <numeric>
#include <random>

namespace loom::plugins::recommender {

namespace {

const char* const kGenreWords[] = {"action",  "comedy",  "drama",   "horror", "romance",     "western",
                                   "mystery", "musical", "fantasy", "war",    "documentary", "thriller",
                                   "crime",   "sports",  "history", "animation"};
const char* const kAdjectives[] = {"Silver", "Hidden", "Last", "Broken", "Golden", "Quiet", "Red", "Lost",
                                   "Northern", "Endless", "Little", "Burning", "Secret", "Wild", "Frozen", "Distant"};
const char* const kNouns[] = {"Harbor", "Garden", "River", "Kingdom", "Letter", "Train", "Mountain", "Promise",
                              "Island", "Winter", "Road", "Mirror", "Station", "Forest", "Song", "Bridge"};

/// Uniform in (0, 1) and Gaussian draws from one engine, the same on every platform (the
/// standard distributions' algorithms are the library's choice).
struct Random {
  explicit Random(uint64_t seed) : engine(seed) {}
  double uniform() { return (static_cast<double>(engine() >> 11) + 0.5) * 0x1.0p-53; }
  double normal() { return std::sqrt(-2.0 * std::log(uniform())) * std::cos(2.0 * M_PI * uniform()); }
  std::mt19937_64 engine;
};

}  // namespace

SyntheticInteractions::SyntheticInteractions(const sdk::Options& o)
    : InteractionDataset("synthetic_interactions"), users_(o.get_int("users")), items_(o.get_int("items")),
      genres_(o.get_int("genres")), per_user_(o.get_int("per_user")), affinity_(o.get_float("affinity")),
      noise_(o.get_float("noise")), split_(SplitOptions::from(o)) {
  if (per_user_ > items_)
    throw sdk::Error("synthetic_interactions: per_user " + std::to_string(per_user_) + " is more than the " +
                     std::to_string(items_) + " items; a user meets an item once");
  if (genres_ > items_) throw sdk::Error("synthetic_interactions: more genres than items");
  if (static_cast<double>(users_) * static_cast<double>(items_) > 2e9)
    throw sdk::Error("synthetic_interactions: users x items above 2e9 would take minutes to generate; make them smaller");
  // Each interaction is held about four times while it is generated and split (some 70 bytes): a
  // bound on them, as on users x items, so that an absurd size is refused, not an out-of-memory.
  if (const double interactions = static_cast<double>(users_) * static_cast<double>(per_user_); interactions > 1e8)
    throw sdk::Error("synthetic_interactions: users x per_user = " + std::to_string(std::llround(interactions)) +
                     " interactions, more than 100000000 (some 7 GB of memory to generate and split; MovieLens's largest "
                     "has 32 million); make data.users or data.per_user smaller");
  if (!(affinity_ > 0 && affinity_ < 1)) throw sdk::Error("synthetic_interactions: affinity must be in (0, 1)");
}

void SyntheticInteractions::setup() {
  Random random(split_.seed);
  RawData data;
  std::vector<int64_t> genre_of(items_);
  std::vector<double> quality(items_);
  std::vector<int64_t> genre_size(genres_, 0);
  for (int64_t i = 0; i < items_; ++i) {
    genre_of[i] = i % genres_;
    ++genre_size[genre_of[i]];
    quality[i] = 0.3 * random.normal();
    Item item;
    item.id = std::to_string(i + 1);
    item.title = std::string("The ") + kAdjectives[i % 16] + " " + kNouns[(i / 16) % 16];  // says nothing of the genre
    if (i >= 256) item.title += " " + std::to_string(i / 256 + 1);
    const int64_t g = genre_of[i];
    item.genres = g < 16 ? kGenreWords[g] : "genre " + std::to_string(g + 1);
    data.items.push_back(std::move(item));
  }
  double optimum_hr = 0;
  std::vector<std::pair<double, int64_t>> keys(items_);
  std::vector<char> seen(items_);
  // (a catalogue of millions takes minutes: said every 15 s, and a stop asked for is acted on, not
  // after every user; a probe waited 37 s in silence for 5 million items)
  const auto began = std::chrono::steady_clock::now();
  auto said = began;
  const auto seconds = [](auto from) { return std::chrono::duration<double>(std::chrono::steady_clock::now() - from).count(); };
  for (int64_t u = 0; u < users_; ++u) {
    if (sdk::stop_requested())
      throw sdk::Error("synthetic_interactions: stopped while generating the users' interactions, " + std::to_string(u) + " of " +
                       std::to_string(users_) + " users done");
    if (seconds(said) > 15) {
      said = std::chrono::steady_clock::now();
      sdk::log::info("synthetic_interactions: generating the users' interactions: ", u, " of ", users_, " users in ",
                     static_cast<int64_t>(seconds(began)), " s");
    }
    const int64_t preferred = static_cast<int64_t>(random.uniform() * static_cast<double>(genres_)) % genres_;
    const double in = static_cast<double>(genre_size[preferred]), out = static_cast<double>(items_) - in;
    // P(first draw preferred) = w in / (w in + out) = affinity.
    const double w = out > 0 ? affinity_ * out / ((1 - affinity_) * in) : 1.0;
    // Efraimidis-Spirakis: sorting by u^(1 / weight), descending, is sequential weighted sampling
    // without replacement, in draw order.
    for (int64_t i = 0; i < items_; ++i)
      keys[i] = {std::log(random.uniform()) / (genre_of[i] == preferred ? w : 1.0), i};
    std::partial_sort(keys.begin(), keys.begin() + per_user_, keys.end(),
                      [](const auto& a, const auto& b) { return a.first > b.first; });
    data.user_ids.push_back(std::to_string(u + 1));
    std::fill(seen.begin(), seen.end(), 0);
    for (int64_t k = 0; k < per_user_; ++k) {
      const int64_t i = keys[k].second;
      data.user.push_back(u);
      data.item.push_back(i);
      data.time.push_back(k);
      const double mean = 3.0 + quality[i] + (genre_of[i] == preferred ? 1.0 : -0.5);
      data.rating.push_back(static_cast<float>(mean + noise_ * random.normal()));
      if (k + 1 < per_user_) seen[i] = 1;  // training and validation items
    }
    const int64_t test = keys[per_user_ - 1].second;
    int64_t m = 0, other = 0;
    for (int64_t i = 0; i < items_; ++i)
      if (!seen[i]) (genre_of[i] == preferred ? m : other) += 1;
    optimum_hr += genre_of[test] == preferred ? std::min(1.0, 10.0 / static_cast<double>(m))
                                              : (other > 0 ? std::min(1.0, std::max<double>(0, 10 - m) / static_cast<double>(other))
                                                           : 0.0);  // (at most 1: 35 items made it 1.67)
  }
  if (split_.min_interactions > per_user_)
    throw sdk::Error("synthetic_interactions: data.min_interactions " + std::to_string(split_.min_interactions) +
                     " is more than per_user " + std::to_string(per_user_) + ": every user would be left out");
  char source[128];
  std::snprintf(source, sizeof source, "generated (%lld genres, affinity %.2f, rating noise %.2f)",
                static_cast<long long>(genres_), affinity_, noise_);
  build(std::move(data), split_, source);
  // Every user is kept (per_user >= min_interactions), so the split is the generator's order.
  const bool leave_last_out = split_.leave_last_out();
  const double best_hr = optimum_hr / static_cast<double>(users_);
  if (leave_last_out) set_attribute("optimum.hr_at_10", std::to_string(best_hr));
  set_attribute("optimum.rmse", std::to_string(noise_));
  if (split_.task == Task::kRanking && leave_last_out)
    sdk::log::info("synthetic_interactions: the expected test HR@10 of the Bayes-optimal ranking is ", best_hr,
                   " (an expectation over the sampled held-out items: a model may beat it by chance, by a little)");
  else if (split_.task == Task::kRating)
    sdk::log::info("synthetic_interactions: the best achievable RMSE is ", noise_, " (the noise's deviation)");
}

}  // namespace loom::plugins::recommender
