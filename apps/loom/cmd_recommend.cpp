// `loom recommend`: a recommender checkpoint's top items for one user. The model scores every item
// (Model::predict: {"user"} -> {"scores"}); the items the user already has in the data (the
// dataset's seen table: training and validation, and the test split's rows) are left out; the
// data's own ids and titles come from the dataset's attributes (users.ids, items.ids,
// items.title), as interaction datasets give them.
#include "cli.hpp"

#include <loom/core/error.hpp>
#include <loom/core/log.hpp>
#include <loom/core/text.hpp>
#include <loom/core/trainer.hpp>
#include <loom/sdk/attributes.hpp>
#include <loom/sdk/dataset.hpp>
#include <loom/sdk/options.hpp>

#include <ATen/ops/isfinite.h>
#include <ATen/ops/logical_not.h>
#include <ATen/ops/masked_select.h>
#include <ATen/ops/max.h>
#include <ATen/ops/min.h>
#include <ATen/ops/sum.h>
#include <ATen/ops/tensor.h>
#include <ATen/ops/topk.h>

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <iostream>
#include <set>

namespace fs = std::filesystem;

namespace loom::cli {

namespace {

/// The items of `user` in the test split's rows: the interactions datasets' seen table holds every
/// split's, but a dataset's table of training and validation items alone (Dataset 1.2) is left
/// with the user's test items recommended.
void add_test_items(sdk::Dataset& data, int64_t user, std::set<int64_t>& known) {
  const int64_t n = data.size(sdk::Split::kTest);
  for (int64_t start = 0; start < n; start += 4096) {
    std::vector<int64_t> indices;
    for (int64_t i = start; i < std::min(n, start + 4096); ++i) indices.push_back(i);
    const sdk::Batch rows = data.get_batch(sdk::Split::kTest, indices);
    const at::Tensor users = rows.at("user").to(at::kLong), items = rows.at("item").to(at::kLong);
    for (int64_t i = 0; i < users.size(0); ++i)
      if (users[i].item<int64_t>() == user) known.insert(items[i].item<int64_t>());
  }
}

}  // namespace

int cmd_recommend(const Invocation& invocation) {
  if (!invocation.options.count("user")) throw Error("loom recommend needs --user ID (the data's own user id)");
  std::string user_id = invocation.options["user"].as<std::string>();
  // (spaces around a pasted id are dropped: " 42" is user 42)
  user_id.erase(0, user_id.find_first_not_of(" \t"));
  user_id.erase(user_id.find_last_not_of(" \t") + 1);
  if (user_id.empty()) throw Error("--user is empty; give the data's own user id, e.g. --user 42");
  // (a 100 KB id was echoed whole in its error, and control characters reach the terminal)
  const auto control = [](char c) { return static_cast<unsigned char>(c) < 0x20 || c == 0x7f; };
  if (user_id.size() > 256 || std::any_of(user_id.begin(), user_id.end(), control)) {
    std::string shown = user_id.substr(0, 40);
    std::replace_if(shown.begin(), shown.end(), control, '?');
    throw Error("--user '" + shown + (user_id.size() > 40 ? "...' (" + std::to_string(user_id.size()) + " bytes)" : "'") +
                " is no user id: ids are at most 256 characters of text; give the data's own user id, e.g. --user 42");
  }
  const int64_t top = invocation.options["top"].as<int64_t>();
  if (top < 1) throw Error("--top must be at least 1");
  const fs::path checkpoint = checkpoint_path(invocation);
  core::PluginRegistry registry;
  scan_plugins(registry, invocation.options);
  std::vector<std::string> changed;
  const core::Config config = checkpoint_config(invocation, checkpoint, registry, changed);
  core::Trainer trainer(core::resolve_run(config, registry), registry);
  trainer.setup_for_evaluation();
  load_weights(trainer, checkpoint, changed);

  const auto& attributes = trainer.data_spec().attributes;
  for (const char* key : {"users.ids", "items.ids", "items.title"})
    if (!attributes.count(key))
      throw Error("loom recommend needs a dataset of users and items (interactions, synthetic_interactions); data.name = " +
                  config.get("data.name").value_or("?") + " gives no " + key);
  const std::vector<std::string> users = sdk::attribute_lines(attributes.at("users.ids"));
  const std::vector<std::string> item_ids = sdk::attribute_lines(attributes.at("items.ids"));
  const std::vector<std::string> titles = sdk::attribute_lines(attributes.at("items.title"));
  auto found = std::find(users.begin(), users.end(), user_id);
  // Not an id as the data writes it, but a number (07, +7): the data's one id of that number.
  const auto digits = [](const std::string& s) {
    const size_t from = s.rfind('+', 0) == 0 ? 1 : 0;
    return s.size() > from && s.find_first_not_of("0123456789", from) == std::string::npos;
  };
  if (found == users.end() && digits(user_id)) {
    const auto number = sdk::parse_int(user_id);
    std::vector<std::string> same;
    for (const auto& id : users)
      if (digits(id) && number && sdk::parse_int(id) == number) same.push_back(id);
    if (same.size() > 1)
      throw Error("user " + user_id + " is no id of the data, and several are that number (" + core::join(same, ", ") +
                  "); give the id as the data writes it");
    if (same.size() == 1) {
      found = std::find(users.begin(), users.end(), same.front());
      user_id = same.front() + " (given as " + user_id + ")";
    }
  }
  if (found == users.end()) {
    // (numbers: their range, not the data's first and last, which read "ids 1 ... -30")
    std::optional<int64_t> low, high;
    bool numbers = true;
    for (const auto& id : users) {
      const auto n = sdk::parse_int(id);
      if (!n) { numbers = false; break; }
      low = std::min(low.value_or(*n), *n);
      high = std::max(high.value_or(*n), *n);
    }
    const bool every = numbers && low && static_cast<double>(*high) - static_cast<double>(*low) + 1 == static_cast<double>(users.size());
    const std::string ids = every ? "ids " + std::to_string(*low) + " to " + std::to_string(*high)
                            : numbers && low ? "ids between " + std::to_string(*low) + " and " + std::to_string(*high) + ", not every number"
                                             : "ids " + core::printable(users.front(), 64) + " ... " +
                                                   core::printable(users.back(), 64) + " in the data's order";
    throw Error("user " + core::printable(user_id, 256) + " is not in the data (" + std::to_string(users.size()) + " users, " + ids +
                "; users with fewer than data.min_interactions interactions are left out)");
  }
  const int64_t user = found - users.begin();

  std::set<int64_t> known;
  const sdk::TensorMap tables = trainer.dataset_tables();
  if (tables.count("seen.indptr") && tables.count("seen.items")) {
    const at::Tensor indptr = tables.at("seen.indptr"), items = tables.at("seen.items");
    for (int64_t k = indptr[user].item<int64_t>(); k < indptr[user + 1].item<int64_t>(); ++k) known.insert(items[k].item<int64_t>());
  }
  add_test_items(trainer.dataset(), user, known);

  const sdk::Batch out = trainer.predict({{"user", at::tensor(std::vector<int64_t>{user}, at::kLong)}});
  auto scores_it = out.find("scores");
  if (scores_it == out.end() || scores_it->second.dim() != 2 ||
      scores_it->second.size(1) != static_cast<int64_t>(item_ids.size()))
    throw Error("model '" + config.get("model.name").value_or("?") + "' does not predict one score per item ({\"scores\": [1, " +
                std::to_string(item_ids.size()) + "]})");
  at::Tensor scores = scores_it->second[0].to(at::kFloat).clone();
  // A model whose scores are not finite ranks nothing: its top items were printed as "inf" or
  // "-nan", exit 0 (probe), where `loom eval` of the same file refuses it.
  const int64_t not_finite = scores.isfinite().logical_not().sum().item<int64_t>();
  if (not_finite > 0)
    throw Error("the model of " + checkpoint.string() + " gives " + std::to_string(not_finite) + " of its " +
                std::to_string(scores.numel()) + " scores for user " + core::printable(user_id, 256) +
                " as NaN or infinite, so it ranks nothing: its training diverged or its weights are damaged; "
                "`loom eval` on it says more, and an earlier checkpoint of the run may be sound");
  for (int64_t item : known) scores[item].fill_(-std::numeric_limits<float>::infinity());
  const int64_t n = std::min<int64_t>(top, static_cast<int64_t>(item_ids.size() - known.size()));
  if (n < 1) {
    std::cout << "user " << user_id << " knows every item of the catalogue: nothing to recommend\n";
    return 0;
  }
  const auto [values, indices] = at::topk(scores, n);
  {
    // Every item the user does not know scored alike: the order printed is the sort's, not the model's.
    const at::Tensor candidates = scores.masked_select(scores.isfinite());
    if (candidates.numel() > 1 && candidates.max().item<float>() == candidates.min().item<float>())
      core::log::warn("every item user ", core::printable(user_id, 256), " does not know scores ", candidates.max().item<float>(),
                ": the ranking below is arbitrary (the model has collapsed to one output); evaluate the checkpoint, or "
                "use an earlier one");
  }
  // (the model's task where the run set it: rating data ranked by --set model.task=ranking printed raw scores as "rating")
  const std::string model_task = config.get("model.task").value_or("auto");
  const bool rating = model_task != "auto" ? model_task == "rating" : attributes.count("task") && attributes.at("task") == "rating";
  std::cout << "top " << n << " for user " << user_id << " (" << known.size() << " items they know left out) from "
            << checkpoint.string() << ":\n";
  std::printf("  %4s  %-10s  %10s  %s\n", "rank", "item", rating ? "rating" : "score", "title");
  for (int64_t i = 0; i < n; ++i) {
    const int64_t item = indices[i].item<int64_t>();
    // (a title's text as text on the terminal: no control, no bidirectional override reordering the line)
    std::printf("  %4lld  %-10s  %10.4f  %s\n", static_cast<long long>(i + 1), core::printable(item_ids[item], 256).c_str(),
                values[i].item<double>(), core::printable(titles[item], 1 << 16).c_str());
  }
  return 0;
}

}  // namespace loom::cli
