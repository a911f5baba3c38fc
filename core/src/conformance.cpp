// Conformance suites (conformance.hpp): the runner, and the suites of the kinds that feed the
// step (model, dataset). The other kinds' suites: conformance_kinds.cpp.
#include <loom/core/conformance.hpp>
#include <loom/core/crash_report.hpp>
#include <loom/core/data_loader.hpp>
#include <loom/core/kinds.hpp>
#include <loom/core/parameters.hpp>
#include <loom/core/text.hpp>
#include "conformance_internal.hpp"

#include <loom/sdk/dataset.hpp>
#include <loom/sdk/model.hpp>

#include <ATen/ops/allclose.h>
#include <ATen/ops/equal.h>
#include <ATen/ops/isfinite.h>
#include <torch/nn/module.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <set>
#include <thread>

namespace loom::core {

bool ConformanceReport::passed() const {
  return std::none_of(checks.begin(), checks.end(),
                      [](const ConformanceCheck& c) { return c.outcome == ConformanceCheck::Outcome::kFail; });
}

namespace conformance {

void Suite::run(const std::string& name, const std::function<std::string()>& check) {
  ConformanceCheck c{name, ConformanceCheck::Outcome::kPass, {}};
  if (hooks_ != nullptr && hooks_->on_check_begin) hooks_->on_check_begin(report_, name);
  if (!blocked_.empty()) {
    c.outcome = ConformanceCheck::Outcome::kSkip;
    c.reason = blocked_;
  } else {
    try {
      const CrashContext checking(("running the conformance check '" + name + "' of " + report_.kind + " '" +
                                   report_.component + "'").c_str());
      c.reason = check();
      if (!c.reason.empty()) c.outcome = ConformanceCheck::Outcome::kFail;
    } catch (const Skip& s) {
      c.outcome = ConformanceCheck::Outcome::kSkip;
      c.reason = s.what();
    } catch (const PassWithNote& note) {
      c.reason = note.what();  // (its outcome stays kPass)
    } catch (const c10::Error& e) {
      c.outcome = ConformanceCheck::Outcome::kFail;
      c.reason = std::string("threw: ") + e.what_without_backtrace();
    } catch (const std::exception& e) {
      c.outcome = ConformanceCheck::Outcome::kFail;
      c.reason = std::string("threw: ") + e.what();
    } catch (...) {  // (`throw 42;`: it ended the check's process, said as "exit() in the plugin's code?")
      c.outcome = ConformanceCheck::Outcome::kFail;
      c.reason = "threw a value that is not an exception (not derived from std::exception); a plugin reports a failure "
                 "by throwing loom::sdk::Error";
    }
  }
  report_.checks.push_back(c);
  if (hooks_ != nullptr && hooks_->on_check_end) hooks_->on_check_end(report_);
}

void Suite::require(const std::string& name, const std::function<std::string()>& check) {
  run(name, check);
  const ConformanceCheck& c = report_.checks.back();
  if (blocked_.empty() && c.outcome != ConformanceCheck::Outcome::kPass)
    blocked_ = (c.outcome == ConformanceCheck::Outcome::kSkip ? "" : "needs check '" + name + "'; ") + c.reason;
}

std::map<std::string, std::string> Suite::options_of(const std::string& component) const {
  if (hooks_ == nullptr) return {};
  const auto it = hooks_->options.find(component);
  return it == hooks_->options.end() ? std::map<std::string, std::string>() : it->second;
}

}  // namespace conformance

namespace {

using conformance::Suite;

std::string shape_text(at::IntArrayRef shape) { return c10::str(shape); }

/// A number for a message: 6 significant digits ("1.50256", "4").
std::string num(double v) {
  char text[32];
  std::snprintf(text, sizeof text, "%.6g", v);
  return text;
}

/// The first `n` indices of a split, spread over it.
std::vector<int64_t> indices(int64_t size, int64_t n) {
  std::vector<int64_t> out;
  if (size <= 0) return out;  // (a dataset whose setup failed: the checks after it are blocked)
  for (int64_t i = 0; i < n; ++i) out.push_back(size <= n ? i % size : i * (size / n));
  return out;
}

void check_dataset(Suite& s, const PluginRegistry& registry, const ComponentInfo& c, const ConformanceOptions& o) {
  Created<sdk::Dataset> d;
  sdk::DataSpec spec;
  s.require("create", [&] {
    try {
      d = registry.create<sdk::Dataset>(c.name, s.options_of(c.name));
    } catch (const ContractBroken&) {
      throw;  // (a table without its functions is no question of options: it failed)
    } catch (const std::exception& e) {
      // A dataset of the user's files (a folder to read) cannot be made without them; one that
      // has no options cannot be made at all.
      if (!o.options.count(c.name) && !c.options.empty())
        throw conformance::Skip(std::string("cannot be created with its default options (") + e.what() +
                                "); check it with its options (loom plugins check FILE --set data." + c.name + ".<option>=VALUE)");
      throw;
    }
    return std::string();
  });
  s.require("setup_and_spec", [&]() -> std::string {
    d->setup();
    spec = d->spec();
    for (const std::string* key : {&spec.input_key, &spec.target_key})
      if (!spec.fields.count(*key)) return "spec() names field '" + *key + "' as input or target, but has no such field";
    return {};
  });
  s.require("sizes", [&]() -> std::string {
    if (d->size(sdk::Split::kTrain) < 2) return "size(kTrain) is " + std::to_string(d->size(sdk::Split::kTrain)) + "; training needs at least 2 samples";
    if (d->size(sdk::Split::kTest) < 0) return "size(kTest) is negative";
    if (d.implements(1) && d->size(sdk::Split::kValidation) < 0) return "size(kValidation) is negative (0 means none)";
    return {};
  });
  const auto idx = indices(d ? d->size(sdk::Split::kTrain) : 0, 4);
  s.run("batch_matches_spec", [&]() -> std::string {
    const sdk::Batch b = d->get_batch(sdk::Split::kTrain, idx);
    for (const auto& [name, field] : spec.fields) {
      auto it = b.find(name);
      if (it == b.end()) return "the batch has no field '" + name + "' that spec() describes";
      std::vector<int64_t> want{static_cast<int64_t>(idx.size())};
      want.insert(want.end(), field.shape.begin(), field.shape.end());
      if (it->second.sizes().vec() != want)
        return "field '" + name + "' of a batch of 4 has shape " + shape_text(it->second.sizes()) + ", spec() says " + shape_text(want);
      if (it->second.scalar_type() != field.dtype)
        return "field '" + name + "' is " + std::string(c10::toString(it->second.scalar_type())) + ", spec() says " +
               c10::toString(field.dtype);
      if (!it->second.device().is_cpu())  // (the host moves batches to the device; a meta tensor passed)
        return "field '" + name + "' is on " + it->second.device().str() + "; a batch is on the CPU";
    }
    for (const auto& [name, tensor] : b)
      if (!spec.fields.count(name)) return "the batch has a field '" + name + "' that spec() does not describe";
    return {};
  });
  s.run("targets_are_classes", [&]() -> std::string {
    // A classifier's loss indexes its logits by the target: one outside 0..num_classes-1 fails
    // in the model, far from the dataset that gave it.
    if (spec.num_classes < 0) return "spec().num_classes is " + std::to_string(spec.num_classes) + " (0: not a classification)";
    const auto target = spec.fields.find(spec.target_key);
    if (spec.num_classes == 0 || target == spec.fields.end() || !at::isIntegralType(target->second.dtype, false))
      return {};  // (not a classification with integer targets: nothing to check)
    const int64_t n = d->size(sdk::Split::kTrain);
    const sdk::Batch b = d->get_batch(sdk::Split::kTrain, indices(n, std::min<int64_t>(n, 256)));
    const at::Tensor all = b.at(spec.target_key);
    if (all.masked_select(all.ne(-100)).numel() == 0)
      throw conformance::Skip("every target read is -100, the index the loss ignores");
    return targets_outside_classes(spec, b);
  });
  s.run("deterministic", [&]() -> std::string {
    const sdk::Batch a = d->get_batch(sdk::Split::kTrain, idx), b = d->get_batch(sdk::Split::kTrain, idx);
    for (const auto& [name, t] : a)
      if (!b.count(name) || !at::equal(t, b.at(name))) return "two reads of the same indices differ in field '" + name + "'";
    return {};
  });
  s.run("get_batch_into_matches_get_batch", [&]() -> std::string {
    // Dataset 1.3: the loader's reused buffer, filled with a batch, another, then a smaller one
    // (an epoch's tail): each time what get_batch gives for the same indices.
    if (!d.implements(3)) throw conformance::Skip("built against Dataset 1.2 or older: no get_batch_into");
    const int64_t n = d->size(sdk::Split::kTrain);
    sdk::Batch buffer;
    for (const auto& want : {idx, std::vector<int64_t>{n - 1, 0, 1, n / 2}, std::vector<int64_t>{1, 0}}) {
      d->get_batch_into(sdk::Split::kTrain, want, buffer);
      const sdk::Batch fresh = d->get_batch(sdk::Split::kTrain, want);
      if (buffer.size() != fresh.size())
        return "get_batch_into gave " + std::to_string(buffer.size()) + " fields, get_batch " + std::to_string(fresh.size());
      for (const auto& [name, t] : fresh)
        if (!buffer.count(name) || !at::equal(t, buffer.at(name)))
          return "get_batch_into's field '" + name + "' differs from get_batch's for the same indices";
    }
    return {};
  });
  s.run("thread_safe", [&]() -> std::string {
    // The loader's threads read concurrently: each thread's batches equal the serial ones.
    const int64_t n = d->size(sdk::Split::kTrain);
    std::vector<std::vector<int64_t>> parts{indices(n, 3), {n - 1, 0}};
    std::vector<sdk::Batch> serial, parallel(parts.size());
    for (const auto& p : parts) serial.push_back(d->get_batch(sdk::Split::kTrain, p));
    std::vector<std::string> errors(parts.size());
    std::vector<std::thread> threads;
    for (size_t i = 0; i < parts.size(); ++i)
      threads.emplace_back([&, i] {
        try {
          for (int round = 0; round < 20; ++round) parallel[i] = d->get_batch(sdk::Split::kTrain, parts[i]);
        } catch (const std::exception& e) {
          errors[i] = e.what();
        }
      });
    for (auto& t : threads) t.join();
    for (size_t i = 0; i < parts.size(); ++i) {
      if (!errors[i].empty()) return "get_batch threw on a loader thread: " + errors[i];
      for (const auto& [name, t] : serial[i])
        if (!at::equal(t, parallel[i].at(name))) return "concurrent reads gave other values in field '" + name + "'";
    }
    return {};
  });
}

/// The datasets a model may be checked with, in order: the option alone, else those of the
/// model's own plugin, else the fallbacks the registry has. The first that sets up with its
/// defaults and whose data the model's setup accepts is used (a language model refuses image-like
/// data with a clear error; a dataset that needs a folder cannot set up without one).
std::vector<std::string> datasets_for(const PluginRegistry& registry, const ComponentInfo& model,
                                      const ConformanceOptions& o) {
  if (!o.dataset.empty()) return {o.dataset};
  std::vector<std::string> own;
  for (const auto& c : registry.components())
    if (c.kind == LOOM_KIND_DATASET && c.plugin == model.plugin) own.push_back(c.name);
  if (!own.empty()) return own;
  std::vector<std::string> out;
  for (const auto& name : o.fallback_datasets)
    if (registry.find(LOOM_KIND_DATASET, name)) out.push_back(name);
  return out;
}

void check_model(Suite& s, const PluginRegistry& registry, const ComponentInfo& c, const ConformanceOptions& o) {
  const std::vector<std::string> datasets = datasets_for(registry, c, o);
  s.report().context = "with dataset " + (datasets.empty() ? std::string("(none)") : datasets.front());
  Created<sdk::Model> m;
  Created<sdk::Dataset> d;
  sdk::Batch four;
  s.require("create", [&] {
    m = registry.create<sdk::Model>(c.name, s.options_of(c.name));
    return std::string();
  });
  s.require("setup", [&]() -> std::string {
    if (datasets.empty()) throw conformance::Skip("no dataset to shape the model to: pass --dataset NAME");
    std::string passed_over;  // (said: the model is checked with another dataset than the one named first)
    for (size_t i = 0;; ++i) {
      try {
        d = registry.create<sdk::Dataset>(datasets[i], s.options_of(datasets[i]));
        d->setup();
        m->setup(d->spec());
        if (d.implements(2) && m.implements(1)) {  // the shared tables, as the trainer hands them over
          const sdk::TensorMap tables = d->tables();
          if (!tables.empty()) m->use_tables(tables);
        }
        s.report().context = "with dataset " + datasets[i] + passed_over;
        break;
      } catch (const std::exception& e) {
        if (i + 1 == datasets.size()) throw;  // the last one's refusal is the report's
        std::string why = e.what();
        why = why.substr(0, why.find('\n'));
        if (why.size() > 160) why = why.substr(0, 157) + "...";
        passed_over += "; not " + datasets[i] + ": " + why;
        m = registry.create<sdk::Model>(c.name, s.options_of(c.name));  // a fresh instance for the next data
      }
    }
    if (m->module().parameters().empty()) return "module() has no parameters after setup()";
    four = d->get_batch(sdk::Split::kTrain, indices(d->size(sdk::Split::kTrain), 4));
    return {};
  });
  std::set<std::string> declared;
  s.run("metrics_declared", [&]() -> std::string {
    for (const auto& spec : m->metrics()) {
      const bool well_formed = !spec.name.empty() && spec.name.size() <= 64 &&
                               std::all_of(spec.name.begin(), spec.name.end(), [](char ch) {
                                 return (ch >= 'a' && ch <= 'z') || (ch >= '0' && ch <= '9') || ch == '_';
                               });
      if (!well_formed) return "metric name '" + spec.name + "' is not lower_snake_case (a-z, 0-9, _), at most 64 characters";
      if (spec.name == "loss" || !declared.insert(spec.name).second)
        return "metric '" + spec.name + "' is declared twice or named like the host's \"loss\"";
    }
    return {};
  });
  s.run("flops_declared", [&]() -> std::string {  // Model 2.2 (Note [Model FLOPs in the log])
    if (!m.implements(2)) throw conformance::Skip("built against Model 2.1 or older: declares no FLOPs");
    const double f = m->flops_per_loss_term();
    if (!std::isfinite(f) || f < 0)
      return "flops_per_loss_term() is " + num(f) + ": return 0 (not declared) or the forward and backward's FLOPs "
             "per loss term";
    if (f == 0)  // (allowed, so no failure; but "pass" read as "declared")
      throw conformance::PassWithNote("not declared (flops_per_loss_term() is 0): the log shows no TFLOP/s or MFU for it");
    return {};
  });
  auto forward = [&](const sdk::Batch& b, bool train) { return m->forward(b, train); };
  s.require("forward", [&]() -> std::string {
    m->module().eval();
    const sdk::ModelOutput out = forward(four, false);
    if (!out.loss_sum.defined() || out.loss_sum.numel() != 1) return "loss_sum is not a scalar";
    if (!out.count.defined() || out.count.numel() != 1) return "count is not a scalar";
    if (!std::isfinite(out.loss_sum.item<double>())) return "loss_sum is not finite on a batch of 4";
    if (!(out.count.item<double>() > 0)) return "count is " + num(out.count.item<double>()) + " on a batch of 4";
    for (const auto& [name, v] : out.metrics) {
      if (!declared.count(name)) return "forward() reports metric '" + name + "' that metrics() does not declare";
      if (!v.sum.defined() || v.sum.numel() != 1) return "metric '" + name + "': sum is not a scalar";
      if (v.count.defined() && v.count.numel() != 1) return "metric '" + name + "': count is not a scalar";
    }
    return {};
  });
  s.run("loss_is_a_sum", [&]() -> std::string {
    // The host divides by the global count once per step, so gradient accumulation is exact only
    // when a model sums: two halves must add up to the whole (evaluation mode: no dropout).
    at::NoGradGuard no_grad;
    sdk::Batch front, back;
    for (const auto& [k, t] : four) {
      front[k] = t.slice(0, 0, 2);
      back[k] = t.slice(0, 2, 4);
    }
    const auto whole = forward(four, false), a = forward(front, false), b = forward(back, false);
    const double w = whole.loss_sum.item<double>(), parts = a.loss_sum.item<double>() + b.loss_sum.item<double>();
    const double wc = whole.count.item<double>(), pc = a.count.item<double>() + b.count.item<double>();
    if (std::abs(w - parts) > 1e-4 * std::max(1.0, std::abs(w)) || std::abs(wc - pc) > 1e-6 * std::max(1.0, wc))
      return "loss_sum of 4 samples is " + num(w) + " (count " + num(wc) + "), its two halves add up to " + num(parts) +
             " (count " + num(pc) +
             "): return the loss summed over samples with its count, not a mean (the host divides once per step)";
    return {};
  });
  s.run("eval_deterministic", [&]() -> std::string {
    at::NoGradGuard no_grad;
    const double a = forward(four, false).loss_sum.item<double>(), b = forward(four, false).loss_sum.item<double>();
    if (a != b) return "two evaluation forwards of the same batch gave " + num(a) + " and " + num(b) + " (dropout in evaluation?)";
    return {};
  });
  s.run("gradients", [&]() -> std::string {
    m->module().train();
    for (auto& p : m->module().parameters()) p.mutable_grad() = at::Tensor();
    forward(four, true).loss_sum.backward();
    std::vector<std::string> missing, non_finite;
    for (const auto& item : m->module().named_parameters()) {
      if (!item.value().requires_grad()) continue;
      const at::Tensor g = item.value().grad();
      if (!g.defined()) missing.push_back(item.key());
      else if (!at::isfinite(g).all().item<bool>()) non_finite.push_back(item.key());
    }
    auto first = [](std::vector<std::string> v) {
      if (v.size() > 3) v.resize(3), v.push_back("...");
      return join(v, ", ");
    };
    if (!missing.empty()) return "no gradient reaches " + first(missing) + " (unused parameters: freeze them in parameter_groups())";
    if (!non_finite.empty()) return "non-finite gradients in " + first(non_finite);
    return {};
  });
  s.run("parameter_groups", [&]() -> std::string {
    std::set<std::string> names, seen;
    for (const auto& item : m->module().named_parameters()) names.insert(item.key());
    for (const auto& g : m->parameter_groups()) {
      if (g.names.size() != g.params.size()) return "group '" + g.name + "' has " + std::to_string(g.names.size()) + " names for " + std::to_string(g.params.size()) + " parameters";
      for (const auto& n : g.names) {
        if (!names.count(n)) return "group '" + g.name + "' names '" + n + "', which is not a parameter of module()";
        if (!seen.insert(n).second) return "parameter '" + n + "' is in two groups";
      }
    }
    // ... and what a run refuses of them (a tensor not its name's, a NaN weight decay, a trainable
    // parameter that is not contiguous): `loom plugins check` passed models `loom train` refused
    try {
      (void)Parameters::of(*m);
    } catch (const std::exception& e) {
      return e.what();
    }
    return {};
  });
}

}  // namespace

ConformanceReport check_component(const PluginRegistry& registry, const ComponentInfo& component,
                                  const ConformanceOptions& options) {
  Suite s(kind_name(component.kind), component.name, &options);
  switch (component.kind) {
    case LOOM_KIND_MODEL: check_model(s, registry, component, options); break;
    case LOOM_KIND_DATASET: check_dataset(s, registry, component, options); break;
    default: conformance::check_other_kind(s, registry, component); break;
  }
  return s.report();
}

std::vector<ConformanceReport> check_plugin(const PluginRegistry& registry, const std::filesystem::path& file,
                                            const ConformanceOptions& options) {
  std::error_code ec;
  const auto canonical = std::filesystem::weakly_canonical(file, ec);
  std::vector<ConformanceReport> out;
  for (const auto& c : registry.components())
    if (c.plugin && std::filesystem::weakly_canonical(c.plugin->file, ec) == canonical) {
      out.push_back(check_component(registry, c, options));
      if (options.on_report) options.on_report(out.back());
    }
  return out;
}

}  // namespace loom::core
