/*
 * The C tier of the Loom plugin ABI: datasets, memory policies and callbacks written in C (or any
 * language with a C FFI), without LibTorch. Since ABI 1.4.
 *
 * A C-tier plugin uses Tier 0 (abi.h) as every plugin does: a descriptor, a component table, a
 * factory per component. Its components carry the flag LOOM_COMPONENT_C_TIER, and their `create`
 * returns one of the tables below (a loom_c_dataset*, loom_c_memory_policy* or loom_c_callback*)
 * instead of a C++ object; the host wraps it in the matching Tier-1 interface. Its fingerprint
 * names no LibTorch, no C++ library and no layout of C++ types: one build of a C-tier plugin
 * loads into any Loom of the same ABI major, whatever LibTorch that Loom was built with.
 *
 * Rules of the boundary:
 *   - Errors are values: a function returns 0 on success, or nonzero after writing the reason
 *     into the caller's loom_error (loom_c_error() does it). Nothing unwinds across it.
 *   - Memory is freed by whoever allocated it. The table `create` returns is the plugin's until
 *     the host hands it to the component's `destroy`. Strings and arrays the plugin returns stay
 *     the plugin's (valid until the next call on the same object, or until destroy for the
 *     spec). What the host passes is borrowed for the duration of the call.
 *   - Tensors cross as DLPack 1.x (DLManagedTensorVersioned): a dataset gives the host one per
 *     field, and the host calls its `deleter` once it no longer needs the memory (possibly much
 *     later, on another thread). A dataset that fails returns no tensors (it freed them).
 *   - Tables start with `struct_size` and grow at the end, as Tier 0 does; a function added in a
 *     later minor of a C interface is called only when struct_size covers it.
 *
 * Write the plugin with LOOM_C_PLUGIN (below) and build it with loom_add_plugin(... TIER c).
 * examples/c_dataset is a complete one.
 */
#ifndef LOOM_SDK_C_PLUGIN_H
#define LOOM_SDK_C_PLUGIN_H

#include <loom/sdk/abi.h>

#include <dlpack/dlpack.h>
#include <stdio.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Versions of the C interfaces (loom_component.interface_major/minor of a C-tier component). */
#define LOOM_C_DATASET_MAJOR 1
#define LOOM_C_DATASET_MINOR 0
#define LOOM_C_MEMORY_MAJOR 1
#define LOOM_C_MEMORY_MINOR 0
#define LOOM_C_CALLBACK_MAJOR 1
#define LOOM_C_CALLBACK_MINOR 0

#define LOOM_C_MAX_DIMS 8

/* Splits, as the C++ tier numbers them. */
typedef enum loom_c_split { LOOM_C_TRAIN = 0, LOOM_C_TEST = 1, LOOM_C_VALIDATION = 2 } loom_c_split;

/* ---- dataset ------------------------------------------------------------------------------ */

/* One field of a sample: its per-sample shape (without the batch dimension) and dtype. */
typedef struct loom_c_field {
  const char* name;
  DLDataType dtype; /* {kDLUInt, 8, 1}: uint8; {kDLInt, 64, 1}: int64; {kDLFloat, 32, 1}: float */
  int32_t ndim;     /* 0 to LOOM_C_MAX_DIMS */
  int64_t shape[LOOM_C_MAX_DIMS];
} loom_c_field;

/* What a dataset yields (the C++ tier's DataSpec). Arrays and strings belong to the dataset and
 * stay valid until it is destroyed. */
typedef struct loom_c_data_spec {
  uint32_t struct_size;
  uint32_t field_count;
  const loom_c_field* fields;
  const char* input_key;
  const char* target_key;
  int64_t num_classes; /* 0 when not a classification */
  uint32_t attribute_count;
  uint32_t reserved0;
  const char* const* attribute_keys; /* e.g. "mean", "std" for models that normalize */
  const char* const* attribute_values;
} loom_c_data_spec;

/* A dataset, interface 1.0: batched random access to samples; the host's loader owns the order. */
typedef struct loom_c_dataset {
  uint32_t struct_size;
  uint32_t reserved0;
  void* self; /* the plugin's state, passed back as the first argument */
  /* Opens and checks the data, once, before anything else. */
  int32_t (*setup)(void* self, loom_error* error);
  /* The spec; valid after setup. */
  int32_t (*spec)(void* self, loom_c_data_spec* spec, loom_error* error);
  /* Samples in a split, or 0 when it has none (LOOM_C_VALIDATION: the host then holds out part of
   * train). Negative: an error. */
  int64_t (*size)(void* self, int32_t split);
  /* The samples at indices[0..count) of `split`, one stacked tensor per field in spec order into
   * out[0..field_count): CPU memory, C-contiguous (strides NULL or compact), first dimension
   * `count`. The host owns each tensor from then on. Called from several loader threads at once. */
  int32_t (*get_batch)(void* self, int32_t split, const int64_t* indices, int64_t count,
                       DLManagedTensorVersioned** out, loom_error* error);
} loom_c_dataset;

/* ---- memory policy ------------------------------------------------------------------------ */

/* A batch plan: global batch = micro_batch x accumulation x world_size. */
typedef struct loom_c_plan {
  int64_t micro_batch;
  int64_t accumulation;
  int64_t world_size;
} loom_c_plan;

/* Device-memory figures in bytes; -1 where the device cannot say. */
typedef struct loom_c_memory_stats {
  int64_t total, free, allocated, reserved, peak, limit, alloc_retries, ooms;
} loom_c_memory_stats;

/* The host's view of the run's device, valid during the call it is passed to. */
typedef struct loom_c_device {
  uint32_t struct_size;
  int32_t device_type; /* DLDeviceType: kDLCPU, kDLCUDA */
  const char* name;    /* "NVIDIA H100 80GB HBM3", "cpu" */
  void* host;          /* pass back as the first argument of the functions below */
  void (*stats)(void* host, loom_c_memory_stats* out);
  /* Caps this process's allocations at `bytes` (-1: no cap). */
  void (*set_limit)(void* host, int64_t bytes);
  void (*empty_cache)(void* host);
} loom_c_device;

/* What plan() sees and may change (the C++ tier's PlanContext). */
typedef struct loom_c_plan_context {
  uint32_t struct_size;
  int32_t global_batch_given; /* 1 when the user chose the global batch */
  const loom_c_device* device;
  loom_c_plan plan;           /* in: the plan so far; out: this policy's plan */
  int64_t global_batch;       /* the configured global batch; a policy keeps it */
  int64_t max_micro_batch;    /* the most samples one micro-batch may take */
  const char* config_key;     /* equal keys give equal probes on equal devices */
  void* host;
  /* Peak bytes of forward and backward of a micro-batch of `b` samples, without side effects;
   * -1 when it ran out of memory, -2 on another error (written into `error`; a stop signal
   * is one: return from plan() soon, the host ends set-up then). */
  int64_t (*probe)(void* host, int64_t b, loom_error* error);
} loom_c_plan_context;

/* What on_oom() sees and may change (the C++ tier's OomContext). */
typedef struct loom_c_oom_context {
  uint32_t struct_size;
  int32_t evaluation;   /* 1: an evaluation ran out of memory */
  const loom_c_device* device;
  loom_c_plan plan;     /* in: the plan that ran out of memory; out: the plan to replay with */
  int64_t step;         /* 1-based, as the logs count */
  const char* message;  /* the allocator's message */
} loom_c_oom_context;

/* A memory policy, interface 1.0. Every function may be NULL (the policy does nothing there). */
typedef struct loom_c_memory_policy {
  uint32_t struct_size;
  uint32_t reserved0;
  void* self;
  int32_t (*setup)(void* self, const loom_c_device* device, loom_error* error);
  int32_t (*plan)(void* self, loom_c_plan_context* context, loom_error* error);
  /* Sets *handled to 1 when it changed context->plan and the step should be replayed. */
  int32_t (*on_oom)(void* self, loom_c_oom_context* context, int32_t* handled, loom_error* error);
  /* One line for the start-up report, or NULL. */
  const char* (*describe)(void* self);
} loom_c_memory_policy;

/* ---- callback ------------------------------------------------------------------------------ */

/* The run as a callback sees it, valid during a hook. */
typedef struct loom_c_run {
  uint32_t struct_size;
  int32_t is_main;      /* 1 in the process that writes the run's files */
  const char* run_dir;
  int64_t step;
  int64_t total_steps;
  void* host;
  /* Asks the run to stop after the current step; the first reason is kept. */
  void (*request_stop)(void* host, const char* reason);
} loom_c_run;

/* One optimizer step, as it ended (the C++ tier's StepReport, without the per-metric values). */
typedef struct loom_c_step_report {
  uint32_t struct_size;
  int32_t skipped;      /* 1: non-finite gradients, no update */
  int64_t step;
  int64_t total_steps;
  int64_t epoch;
  double loss;
  double lr;
  double grad_norm; /* before clipping; NaN for a skipped update (its norm was not finite) */
  int64_t samples;
  double seconds;
  loom_c_plan plan;
  loom_c_memory_stats memory;
  int32_t evaluated;
  int32_t last;
} loom_c_step_report;

/* Named values: a log record, an evaluation's metrics, a callback's state. Borrowed. */
typedef struct loom_c_values {
  uint32_t count;
  uint32_t reserved0;
  const char* const* keys;
  const double* values;
} loom_c_values;

/* A callback, interface 1.0. Every hook may be NULL, but save_state needs load_state: a table with
 * save_state alone is refused as it is made (a resumed run would not get its state back). */
typedef struct loom_c_callback {
  uint32_t struct_size;
  uint32_t reserved0;
  void* self;
  int32_t (*on_run_begin)(void* self, const loom_c_run* run, loom_error* error);
  int32_t (*on_step_end)(void* self, const loom_c_run* run, const loom_c_step_report* report, loom_error* error);
  /* The values recorded at `step` ("train/loss", "val/accuracy", ...). */
  int32_t (*on_log)(void* self, const loom_c_run* run, int64_t step, const loom_c_values* values, loom_error* error);
  /* An evaluation over `split`: "loss" and the model's metrics. */
  int32_t (*on_evaluation_end)(void* self, const loom_c_run* run, int32_t split, int64_t step,
                               const loom_c_values* metrics, loom_error* error);
  int32_t (*on_run_end)(void* self, const loom_c_run* run, loom_error* error);
  /* Its state, saved in every checkpoint and given back on resume: numbers by name. */
  int32_t (*save_state)(void* self, loom_c_values* state, loom_error* error);
  int32_t (*load_state)(void* self, const loom_c_values* state, loom_error* error);
  const char* (*describe)(void* self);
} loom_c_callback;

/* ---- writing a C-tier plugin -------------------------------------------------------------- */

/* Writes a reason into the host's error buffer and returns 1 (for `return loom_c_error(...)`). */
static inline int32_t loom_c_error(loom_error* error, const char* message) {
  if (error != NULL && error->capacity > 0) {
    size_t capacity = error->capacity < LOOM_ERROR_CAPACITY ? error->capacity : LOOM_ERROR_CAPACITY;
    snprintf(error->message, capacity, "%s", message);
  }
  return 1;
}

/* A C-tier component table entry. `create(args, error)` returns the table (loom_c_dataset* ...),
 * `destroy(object)` frees it and everything it owns. */
#define LOOM_C_COMPONENT(KIND, MAJOR, MINOR, NAME, SUMMARY, OPTIONS, OPTION_COUNT, CREATE, DESTROY) \
  {sizeof(loom_component), (KIND), (NAME), (SUMMARY), (MAJOR), (MINOR), (OPTIONS), (OPTION_COUNT),  \
   LOOM_COMPONENT_C_TIER, (CREATE), (DESTROY)}
#define LOOM_C_DATASET(NAME, SUMMARY, OPTIONS, OPTION_COUNT, CREATE, DESTROY)                      \
  LOOM_C_COMPONENT(LOOM_KIND_DATASET, LOOM_C_DATASET_MAJOR, LOOM_C_DATASET_MINOR, NAME, SUMMARY,  \
                   OPTIONS, OPTION_COUNT, CREATE, DESTROY)
#define LOOM_C_MEMORY_POLICY(NAME, SUMMARY, OPTIONS, OPTION_COUNT, CREATE, DESTROY)                \
  LOOM_C_COMPONENT(LOOM_KIND_MEMORY, LOOM_C_MEMORY_MAJOR, LOOM_C_MEMORY_MINOR, NAME, SUMMARY,     \
                   OPTIONS, OPTION_COUNT, CREATE, DESTROY)
#define LOOM_C_CALLBACK(NAME, SUMMARY, OPTIONS, OPTION_COUNT, CREATE, DESTROY)                     \
  LOOM_C_COMPONENT(LOOM_KIND_CALLBACK, LOOM_C_CALLBACK_MAJOR, LOOM_C_CALLBACK_MINOR, NAME, SUMMARY, \
                   OPTIONS, OPTION_COUNT, CREATE, DESTROY)

/* The value of option `key` in a factory's arguments, or NULL. */
static inline const char* loom_c_option(const loom_create_args* args, const char* key) {
  uint32_t i;
  for (i = 0; args != NULL && i < args->value_count; ++i) {
    const char* k = args->values[i].key;
    const char* a = key;
    while (*k != '\0' && *k == *a) ++k, ++a;
    if (*k == '\0' && *a == '\0') return args->values[i].value;
  }
  return NULL;
}

/* The host's services, set by the init that LOOM_C_PLUGIN emits (in the file that holds it). */
static const loom_host_api* loom_c_host_ = NULL;

/* Logs one line through the host (to stderr before init), from the file that holds LOOM_C_PLUGIN. */
static inline void loom_c_log(loom_log_level level, const char* plugin, const char* message) {
  if (loom_c_host_ != NULL && loom_c_host_->log != NULL)
    loom_c_host_->log(loom_c_host_->context, (uint32_t)level, plugin, message);
  else if (level >= LOOM_LOG_INFO)
    fprintf(stderr, "[%s] %s\n", plugin, message);
}

/* Sanitizers the plugin was built with (they decide whether it can load; see fingerprint.hpp). */
#if defined(__has_feature)
#if __has_feature(address_sanitizer)
#define LOOM_C_SANITIZERS_ "address"
#elif __has_feature(thread_sanitizer)
#define LOOM_C_SANITIZERS_ "thread"
#endif
#endif
#ifndef LOOM_C_SANITIZERS_
#if defined(__SANITIZE_ADDRESS__)
#define LOOM_C_SANITIZERS_ "address"
#elif defined(__SANITIZE_THREAD__)
#define LOOM_C_SANITIZERS_ "thread"
#else
#define LOOM_C_SANITIZERS_ "none"
#endif
#endif
#if defined(__clang__)
#define LOOM_C_COMPILER_ "clang " __clang_version__
#elif defined(__GNUC__)
#define LOOM_C_COMPILER_ "gcc " __VERSION__
#else
#define LOOM_C_COMPILER_ "unknown"
#endif

/* The fingerprint note of a C-tier plugin: no LibTorch, no C++ library, no layouts. */
typedef struct loom_c_fingerprint_note {
  uint32_t name_size, desc_size, type;
  char name[8];
  char desc[LOOM_NOTE_CAPACITY];
} loom_c_fingerprint_note;

/* Emits the descriptor of a C-tier plugin, its entry point and its fingerprint note. COMPONENTS
 * is a static array of LOOM_C_DATASET(...), LOOM_C_MEMORY_POLICY(...), LOOM_C_CALLBACK(...). */
/* In a C++ file the entry point must keep its C name (the loader looks it up by that name). */
#ifdef __cplusplus
#define LOOM_C_LINKAGE_ extern "C"
#else
#define LOOM_C_LINKAGE_
#endif

#define LOOM_C_PLUGIN(NAME, VERSION, COMPONENTS)                                                  \
  __attribute__((section(LOOM_NOTE_SECTION), used, aligned(4)))                                   \
  static const loom_c_fingerprint_note loom_plugin_fingerprint_note_ = {                          \
      sizeof(LOOM_NOTE_NAME), LOOM_NOTE_CAPACITY, LOOM_NOTE_FINGERPRINT, LOOM_NOTE_NAME,          \
      "format=1\ntier=c\nsanitizers=" LOOM_C_SANITIZERS_ "\ncompiler=" LOOM_C_COMPILER_           \
      "\nlanguage=C\n"};                                                                          \
  static int32_t loom_c_init_(const loom_host_api* host, loom_error* error) {                     \
    if (host == NULL || host->struct_size < LOOM_MIN_SIZE(loom_host_api, 0))                      \
      return loom_c_error(error, "the host passed no host_api table");                            \
    loom_c_host_ = host;                                                                          \
    return 0;                                                                                     \
  }                                                                                               \
  static const loom_plugin_descriptor loom_plugin_descriptor_ = {                                 \
      LOOM_ABI_MAGIC, sizeof(loom_plugin_descriptor), LOOM_ABI_MAJOR, LOOM_ABI_MINOR,             \
      (uint32_t)(sizeof(COMPONENTS) / sizeof((COMPONENTS)[0])), (NAME), (VERSION), NULL,           \
      (COMPONENTS), loom_c_init_};                                                                \
  LOOM_C_LINKAGE_ __attribute__((visibility("default"), used, section(LOOM_ENTRY_SECTION)))       \
  const loom_plugin_descriptor* loom_plugin_entry_v1(void) { return &loom_plugin_descriptor_; }

#ifdef __cplusplus
} /* extern "C" */
#endif

#endif /* LOOM_SDK_C_PLUGIN_H */
