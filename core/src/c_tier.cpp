// The host's adapters for C-tier components (sdk/include/loom/sdk/c_plugin.h): each implements
// the kind's Tier-1 interface by calling the C table the plugin made, turning an error value into
// an sdk::Error that names the component, and tensors from DLPack into LibTorch's (the plugin's
// deleter runs when the host's tensor is freed). The adapter owns the table and hands it back to
// the plugin's destroy; the component's plugin stays loaded as long as the adapter lives.
#include <loom/core/kinds.hpp>
#include <loom/core/plugin_registry.hpp>
#include <loom/core/stop_signals.hpp>
#include <loom/sdk/c_plugin.h>
#include <loom/sdk/callback.hpp>
#include <loom/sdk/dataset.hpp>
#include <loom/sdk/memory_policy.hpp>

#include <ATen/DLConvertor.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstring>

namespace loom::core {

namespace {

/// What every adapter holds: the table, who made it, and how to give it back.
class CObject {
 public:
  CObject(const ComponentInfo& info, void* table)
      : what_(kind_name(info.kind) + " '" + info.name + "'"), plugin_(info.plugin), destroy_(info.raw->destroy),
        table_(table) {}
  ~CObject() {
    if (table_ != nullptr) destroy_(table_);
  }
  CObject(const CObject&) = delete;
  CObject& operator=(const CObject&) = delete;

 protected:
  /// Runs a C function that reports errors as values; throws sdk::Error naming the component.
  template <class F>
  void call(const char* function, F&& f) const {
    loom_error error{};
    error.struct_size = sizeof(loom_error);
    error.capacity = LOOM_ERROR_CAPACITY;
    if (f(&error) != 0) fail(function, error);
  }
  [[noreturn]] void fail(const char* function, loom_error& error) const {
    error.message[LOOM_ERROR_CAPACITY - 1] = '\0';
    throw sdk::Error(what_ + ": " + function + " failed: " + (error.message[0] ? error.message : "no reason given"));
  }
  /// A table must be at least as large as its interface 1.0 and say so.
  void require_size(uint32_t size, uint32_t needed) const {
    if (size < needed)
      throw ContractBroken(what_ + ": its factory returned a table of " + std::to_string(size) + " bytes, smaller than " +
                       std::to_string(needed) + "; rebuild it against this Loom's c_plugin.h");
  }

  std::string what_;

 private:
  std::shared_ptr<LoadedPlugin> plugin_;  // keeps the library loaded
  void (*destroy_)(void*);
  void* table_;
};

std::string text_of(const char* s, size_t max = LOOM_MAX_TEXT) {
  if (s == nullptr) return {};
  return std::string(s, ::strnlen(s, max));
}

// ---- dataset -------------------------------------------------------------------------------

class CDataset final : public sdk::Dataset, CObject {
 public:
  CDataset(const ComponentInfo& info, loom_c_dataset* table) : CObject(info, table), t_(table) {
    if (t_ == nullptr) throw ContractBroken(what_ + ": its factory returned no table");
    require_size(t_->struct_size, sizeof(loom_c_dataset));
    if (!t_->setup || !t_->spec || !t_->size || !t_->get_batch)
      throw ContractBroken(what_ + ": its table lacks setup, spec, size or get_batch");
  }

  void setup() override {
    call("setup", [&](loom_error* e) { return t_->setup(t_->self, e); });
    spec_ = {};
    order_.clear();
    loom_c_data_spec c{};
    c.struct_size = sizeof(c);
    call("spec", [&](loom_error* e) { return t_->spec(t_->self, &c, e); });
    if (c.field_count == 0 || c.field_count > 64 || c.fields == nullptr)
      throw sdk::Error(what_ + ": its spec " + (c.fields == nullptr && c.field_count != 0
                                                    ? "gives no fields array (a null pointer) for " + std::to_string(c.field_count) + " fields"
                                                    : "has " + std::to_string(c.field_count) + " fields (1 to 64)"));
    for (uint32_t i = 0; i < c.field_count; ++i) {
      const loom_c_field& f = c.fields[i];
      const std::string name = text_of(f.name, LOOM_MAX_NAME);
      if (name.empty() || spec_.fields.count(name)) throw sdk::Error(what_ + ": field #" + std::to_string(i) + " has no name, or a name twice");
      if (f.ndim < 0 || f.ndim > LOOM_C_MAX_DIMS) throw sdk::Error(what_ + ": field '" + name + "' has " + std::to_string(f.ndim) + " dimensions");
      sdk::FieldSpec field;
      field.shape.assign(f.shape, f.shape + f.ndim);
      for (const int64_t size : field.shape)
        if (size < 0) throw sdk::Error(what_ + ": field '" + name + "' has a dimension of size " + std::to_string(size));
      try {
        field.dtype = at::toScalarType(f.dtype);
      } catch (const c10::Error& e) {
        throw sdk::Error(what_ + ": field '" + name + "' has a dtype LibTorch does not know: " + e.what_without_backtrace());
      }
      spec_.fields[name] = field;
      order_.push_back(name);
    }
    spec_.input_key = text_of(c.input_key, LOOM_MAX_NAME);
    spec_.target_key = text_of(c.target_key, LOOM_MAX_NAME);
    spec_.num_classes = c.num_classes;
    if (c.attribute_count > 0 && (c.attribute_keys == nullptr || c.attribute_values == nullptr))
      throw sdk::Error(what_ + ": its spec names attributes without their keys or values");
    if (c.attribute_count > 1024)
      throw sdk::Error(what_ + ": its spec has " + std::to_string(c.attribute_count) + " attributes (at most 1024)");
    for (uint32_t i = 0; i < c.attribute_count; ++i) {
      const std::string key = text_of(c.attribute_keys[i], LOOM_MAX_NAME + 1);
      if (key.empty() || key.size() > LOOM_MAX_NAME || spec_.attributes.count(key))
        throw sdk::Error(what_ + ": its spec's attribute #" + std::to_string(i) + " has no key, one longer than " +
                         std::to_string(LOOM_MAX_NAME) + " bytes, or one another has ('" + key.substr(0, 64) + "')");
      spec_.attributes[key] = text_of(c.attribute_values[i]);
    }
  }

  sdk::DataSpec spec() const override { return spec_; }

  int64_t size(sdk::Split split) const override {
    const int64_t n = t_->size(t_->self, static_cast<int32_t>(split));
    if (n < 0) throw sdk::Error(what_ + ": size(" + sdk::split_name(split) + ") failed");
    return n;
  }

  sdk::Batch get_batch(sdk::Split split, const std::vector<int64_t>& indices) const override {
    const int64_t count = static_cast<int64_t>(indices.size());
    std::vector<DLManagedTensorVersioned*> raw(order_.size(), nullptr);
    call("get_batch", [&](loom_error* e) {
      return t_->get_batch(t_->self, static_cast<int32_t>(split), indices.data(), count, raw.data(), e);
    });
    // From here on every tensor is the host's: whatever is not turned into a LibTorch tensor is
    // freed through its deleter, also when one of them is refused.
    struct Release {
      std::vector<DLManagedTensorVersioned*>& raw;
      ~Release() {
        for (auto* t : raw)
          if (t != nullptr && t->deleter != nullptr) t->deleter(t);
      }
    } release{raw};
    sdk::Batch batch;
    for (size_t i = 0; i < order_.size(); ++i) {
      const std::string& name = order_[i];
      DLManagedTensorVersioned* t = raw[i];
      const sdk::FieldSpec& field = spec_.fields.at(name);
      const std::string where = what_ + ": get_batch's tensor for field '" + name + "'";
      if (t == nullptr) throw sdk::Error(where + " is missing");
      if (t->version.major != DLPACK_MAJOR_VERSION)
        throw sdk::Error(where + " is DLPack " + std::to_string(t->version.major) + ".x, the host reads " +
                         std::to_string(DLPACK_MAJOR_VERSION) + ".x");
      const DLTensor& d = t->dl_tensor;
      if (d.device.device_type != kDLCPU) throw sdk::Error(where + " is not in CPU memory");
      if (d.data == nullptr && count > 0 && std::find(field.shape.begin(), field.shape.end(), 0) == field.shape.end())
        throw sdk::Error(where + " has no data (a null pointer)");
      if (d.ndim != static_cast<int32_t>(field.shape.size()) + 1 || d.shape == nullptr || d.shape[0] != count ||
          !std::equal(field.shape.begin(), field.shape.end(), d.shape + 1))
        throw sdk::Error(where + " does not have the shape [" + std::to_string(count) + ", <the field's shape>]");
      bool same_dtype = false;
      try {
        same_dtype = at::toScalarType(d.dtype) == field.dtype;
      } catch (const c10::Error&) {
      }
      if (!same_dtype) throw sdk::Error(where + " does not have the field's dtype");
      raw[i] = nullptr;  // fromDLPackVersioned owns it now, also if it throws
      at::Tensor tensor = at::fromDLPackVersioned(t);
      if (!tensor.is_contiguous()) throw sdk::Error(where + " is not contiguous");
      batch.emplace(name, std::move(tensor));
    }
    return batch;
  }

 private:
  loom_c_dataset* t_;
  sdk::DataSpec spec_;
  std::vector<std::string> order_;  // the fields in the plugin's order
};

// ---- memory policy -------------------------------------------------------------------------

loom_c_memory_stats c_stats(const sdk::MemoryStats& s) {
  return {s.total, s.free, s.allocated, s.reserved, s.peak, s.limit, s.alloc_retries, s.ooms};
}

/// The host's DeviceMemory as the C table loom_c_device.
struct CDevice {
  explicit CDevice(sdk::DeviceMemory& memory) : memory(memory), name(memory.device().str()) {
    table.struct_size = sizeof(table);
    table.device_type = memory.device().is_cuda() ? kDLCUDA : kDLCPU;
    table.name = name.c_str();
    table.host = &memory;
    table.stats = [](void* host, loom_c_memory_stats* out) {
      try {
        *out = c_stats(static_cast<sdk::DeviceMemory*>(host)->stats());
      } catch (...) {
        *out = c_stats(sdk::MemoryStats{});
      }
    };
    table.set_limit = [](void* host, int64_t bytes) {
      try {
        static_cast<sdk::DeviceMemory*>(host)->set_limit(bytes);
      } catch (...) {
      }
    };
    table.empty_cache = [](void* host) {
      try {
        static_cast<sdk::DeviceMemory*>(host)->empty_cache();
      } catch (...) {
      }
    };
  }
  sdk::DeviceMemory& memory;
  std::string name;
  loom_c_device table{};
};

loom_c_plan c_plan(const sdk::BatchPlan& p) { return {p.micro_batch, p.accumulation, p.world_size}; }
sdk::BatchPlan plan_of(const loom_c_plan& p) { return {p.micro_batch, p.accumulation, p.world_size}; }

class CMemoryPolicy final : public sdk::MemoryPolicy, CObject {
 public:
  CMemoryPolicy(const ComponentInfo& info, loom_c_memory_policy* table) : CObject(info, table), t_(table) {
    if (t_ == nullptr) throw ContractBroken(what_ + ": its factory returned no table");
    require_size(t_->struct_size, sizeof(loom_c_memory_policy));
  }

  void setup(sdk::DeviceMemory& memory) override {
    if (!t_->setup) return;
    CDevice device(memory);
    call("setup", [&](loom_error* e) { return t_->setup(t_->self, &device.table, e); });
  }

  void plan(sdk::PlanContext& context) override {
    if (!t_->plan) return;
    std::optional<CDevice> device;
    if (context.memory != nullptr) device.emplace(*context.memory);
    loom_c_plan_context c{};
    c.struct_size = sizeof(c);
    c.global_batch_given = context.global_batch_given ? 1 : 0;
    c.device = device ? &device->table : nullptr;
    c.plan = c_plan(context.plan);
    c.global_batch = context.global_batch;
    c.max_micro_batch = context.max_micro_batch;
    c.config_key = context.config_key.c_str();
    // A stop signal during a probe ends set-up: the C plugin sees a failed probe (-2), and the
    // stop is thrown again here when its plan returns, whatever the plugin made of the -2.
    struct Host {
      sdk::PlanContext* context;
      std::exception_ptr stopped;
    } host{&context, nullptr};
    c.host = &host;
    c.probe = [](void* opaque, int64_t b, loom_error* error) -> int64_t {
      auto* h = static_cast<Host*>(opaque);
      try {
        if (!h->context->probe) return loom_c_error(error, "this run cannot probe"), -2;
        return h->context->probe(b);
      } catch (const c10::OutOfMemoryError&) {
        return -1;
      } catch (const StoppedBySignal& e) {
        h->stopped = std::current_exception();
        loom_c_error(error, e.what());
        return -2;
      } catch (const std::exception& e) {
        loom_c_error(error, e.what());
        return -2;
      }
    };
    try {
      call("plan", [&](loom_error* e) { return t_->plan(t_->self, &c, e); });
    } catch (...) {
      if (host.stopped) std::rethrow_exception(host.stopped);
      throw;
    }
    if (host.stopped) std::rethrow_exception(host.stopped);
    context.plan = plan_of(c.plan);
  }

  bool on_oom(sdk::OomContext& context) override {
    if (!t_->on_oom) return false;
    std::optional<CDevice> device;
    if (context.memory != nullptr) device.emplace(*context.memory);
    loom_c_oom_context c{};
    c.struct_size = sizeof(c);
    c.evaluation = context.evaluation ? 1 : 0;
    c.device = device ? &device->table : nullptr;
    c.plan = c_plan(context.plan);
    c.step = context.step;
    c.message = context.message.c_str();
    int32_t handled = 0;
    call("on_oom", [&](loom_error* e) { return t_->on_oom(t_->self, &c, &handled, e); });
    if (handled) context.plan = plan_of(c.plan);
    return handled != 0;
  }

  std::string describe() const override { return t_->describe ? text_of(t_->describe(t_->self)) : std::string(); }

 private:
  loom_c_memory_policy* t_;
};

// ---- callback ------------------------------------------------------------------------------

/// The run as the C table loom_c_run, for one hook.
struct CRun {
  explicit CRun(sdk::RunContext& run) : dir(run.run_dir().string()) {
    table.struct_size = sizeof(table);
    table.is_main = run.is_main() ? 1 : 0;
    table.run_dir = dir.c_str();
    table.step = run.step();
    table.total_steps = run.total_steps();
    table.host = &run;
    table.request_stop = [](void* host, const char* reason) {
      try {
        static_cast<sdk::RunContext*>(host)->request_stop(text_of(reason));
      } catch (...) {
      }
    };
  }
  std::string dir;
  loom_c_run table{};
};

/// Named numbers as loom_c_values, borrowed from `source` for one call.
struct CValues {
  explicit CValues(const std::map<std::string, double>& source) {
    for (const auto& [key, value] : source) {
      keys.push_back(key.c_str());
      values.push_back(value);
    }
    table = {static_cast<uint32_t>(keys.size()), 0, keys.data(), values.data()};
  }
  std::vector<const char*> keys;
  std::vector<double> values;
  loom_c_values table{};
};

class CCallback final : public sdk::Callback, CObject {
 public:
  CCallback(const ComponentInfo& info, loom_c_callback* table) : CObject(info, table), t_(table) {
    if (t_ == nullptr) throw ContractBroken(what_ + ": its factory returned no table");
    require_size(t_->struct_size, sizeof(loom_c_callback));
    // A state saved in every checkpoint that no resume gives back: the check found it only as
    // "its text state differs after load_state_dict(state_dict())", words of the C++ tier.
    if (t_->save_state != nullptr && t_->load_state == nullptr)
      throw ContractBroken(what_ + ": its table has save_state without load_state: a resumed run would not get its state "
                           "back; give both, or neither");
  }

  void on_run_begin(sdk::RunContext& run) override {
    if (!t_->on_run_begin) return;
    CRun r(run);
    call("on_run_begin", [&](loom_error* e) { return t_->on_run_begin(t_->self, &r.table, e); });
  }

  bool reads_every_step() const override { return t_->on_step_end != nullptr; }  // the C tier gets the loss
  bool reads_gradients() const override { return false; }  // the C tier has no gradient hooks

  void on_step_end(sdk::RunContext& run, const sdk::StepReport& report) override {
    if (!t_->on_step_end) return;
    CRun r(run);
    loom_c_step_report c{};
    c.struct_size = sizeof(c);
    c.skipped = report.skipped;
    c.step = report.step;
    c.total_steps = report.total_steps;
    c.epoch = report.epoch;
    c.loss = report.loss;
    c.lr = report.lr;
    c.grad_norm = report.grad_norm;
    c.samples = report.samples;
    c.seconds = report.seconds;
    c.plan = c_plan(report.plan);
    c.memory = c_stats(report.memory);
    c.evaluated = report.evaluated;
    c.last = report.last;
    call("on_step_end", [&](loom_error* e) { return t_->on_step_end(t_->self, &r.table, &c, e); });
  }

  void on_log(sdk::RunContext& run, int64_t step, const std::map<std::string, double>& values) override {
    if (!t_->on_log) return;
    CRun r(run);
    CValues v(values);
    call("on_log", [&](loom_error* e) { return t_->on_log(t_->self, &r.table, step, &v.table, e); });
  }

  void on_evaluation_end(sdk::RunContext& run, const sdk::EvalReport& report) override {
    if (!t_->on_evaluation_end) return;
    CRun r(run);
    std::map<std::string, double> metrics = report.metrics;
    metrics["loss"] = report.loss;
    CValues v(metrics);
    call("on_evaluation_end", [&](loom_error* e) {
      return t_->on_evaluation_end(t_->self, &r.table, static_cast<int32_t>(report.split), report.step, &v.table, e);
    });
  }

  void on_run_end(sdk::RunContext& run, const sdk::RunReport&) override {
    if (!t_->on_run_end) return;
    CRun r(run);
    call("on_run_end", [&](loom_error* e) { return t_->on_run_end(t_->self, &r.table, e); });
  }

  // The state crosses as numbers by name and is kept as text in the checkpoint (exact: %.17g).
  sdk::State state_dict() const override {
    sdk::State state;
    if (!t_->save_state) return state;
    loom_c_values c{};
    call("save_state", [&](loom_error* e) { return t_->save_state(t_->self, &c, e); });
    if (c.count > 0 && (c.keys == nullptr || c.values == nullptr)) throw sdk::Error(what_ + ": save_state gave counts without values");
    // Cut or merged in silence, a state would resume as another one: refused instead.
    if (c.count > 4096) throw sdk::Error(what_ + ": save_state gave " + std::to_string(c.count) + " values (at most 4096)");
    for (uint32_t i = 0; i < c.count; ++i) {
      const std::string key = text_of(c.keys[i], LOOM_MAX_NAME + 1);
      if (key.empty() || key.size() > LOOM_MAX_NAME || state.text.count(key))
        throw sdk::Error(what_ + ": save_state's value #" + std::to_string(i) + " has no key, one longer than " +
                         std::to_string(LOOM_MAX_NAME) + " bytes, or one another has ('" + key.substr(0, 64) + "')");
      char text[32];
      std::snprintf(text, sizeof(text), "%.17g", c.values[i]);
      state.text[key] = text;
    }
    return state;
  }

  void load_state_dict(const sdk::State& state) override {
    if (!t_->load_state) return;
    std::map<std::string, double> numbers;
    for (const auto& [key, text] : state.text) {
      char* end = nullptr;
      const double v = std::strtod(text.c_str(), &end);
      if (end == text.c_str() || *end != '\0') throw sdk::Error(what_ + ": its saved state '" + key + "' = '" + text + "' is not a number");
      numbers[key] = v;
    }
    CValues v(numbers);
    call("load_state", [&](loom_error* e) { return t_->load_state(t_->self, &v.table, e); });
  }

  std::string describe() const override { return t_->describe ? text_of(t_->describe(t_->self)) : std::string(); }

 private:
  loom_c_callback* t_;
};

}  // namespace

std::shared_ptr<void> adapt_c_tier(const ComponentInfo& info, void* object) {
  // The adapter owns the table as soon as its CObject base is built: a table that its own checks
  // refuse is handed back to the plugin by that base's destructor.
  switch (info.kind) {
    case LOOM_KIND_DATASET:
      return std::shared_ptr<sdk::Dataset>(new CDataset(info, static_cast<loom_c_dataset*>(object)));
    case LOOM_KIND_MEMORY:
      return std::shared_ptr<sdk::MemoryPolicy>(new CMemoryPolicy(info, static_cast<loom_c_memory_policy*>(object)));
    case LOOM_KIND_CALLBACK:
      return std::shared_ptr<sdk::Callback>(new CCallback(info, static_cast<loom_c_callback*>(object)));
    default:
      if (object != nullptr) info.raw->destroy(object);
      throw sdk::Error(kind_name(info.kind) + " '" + info.name + "': this Loom has no C tier for " + kind_name(info.kind) + "s");
  }
}

}  // namespace loom::core
