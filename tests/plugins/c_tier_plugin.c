/*
 * A C-tier test plugin with a memory policy and a callback (C99, no LibTorch), for
 * tests/unit/trainer/c_tier_test.cpp: the host's adapters must carry plans, out-of-memory
 * replays, hooks, stop requests and callback state across the C boundary.
 *   memory 'c_halve':   halves the micro-batch (doubling accumulation) until it is at most `max`;
 *                       on running out of memory, halves it again. With `probe = true` it
 *                       measures each micro-batch on its way down first (the host's probe, which a
 *                       stop signal during set-up fails: then plan() returns at once).
 *   callback 'c_stop_at': asks the run to stop once step `step` has ended; counts its hooks and
 *                       keeps the counts as its state.
 *   dataset 'c_faulty': a dataset whose get_batch breaks the contract as `fault` says (a wrong
 *                       dtype or shape, a missing tensor, non-CPU memory, an old DLPack, an
 *                       error); the host must refuse each with one clear error and free what it got.
 */
#include <loom/sdk/c_plugin.h>

#include <ctype.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ---- c_halve ---- */

typedef struct halve {
  loom_c_memory_policy table;
  int64_t max;
  int probe;
  char line[128];
} halve;

static int32_t halve_plan(void* self, loom_c_plan_context* ctx, loom_error* error) {
  halve* h = (halve*)self;
  if (ctx->plan.micro_batch * ctx->plan.accumulation * ctx->plan.world_size != ctx->global_batch)
    return loom_c_error(error, "the plan it was given does not make the global batch");
  if (h->probe && ctx->probe != NULL) {
    int64_t b;
    for (b = ctx->plan.micro_batch; b > h->max && b % 2 == 0; b /= 2)
      if (ctx->probe(ctx->host, b, error) == -2) return 1; /* the host's reason is in `error` */
  }
  while (ctx->plan.micro_batch > h->max && ctx->plan.micro_batch % 2 == 0) {
    ctx->plan.micro_batch /= 2;
    ctx->plan.accumulation *= 2;
  }
  return 0;
}

static int32_t halve_on_oom(void* self, loom_c_oom_context* ctx, int32_t* handled, loom_error* error) {
  (void)self, (void)error;
  if (ctx->plan.micro_batch < 2 || ctx->plan.micro_batch % 2 != 0) return 0;
  ctx->plan.micro_batch /= 2;
  ctx->plan.accumulation *= 2;
  *handled = 1;
  return 0;
}

static const char* halve_describe(void* self) {
  halve* h = (halve*)self;
  snprintf(h->line, sizeof h->line, "c_halve: micro-batch at most %lld", (long long)h->max);
  return h->line;
}

/* A bool option as the host accepts it: true, yes, on or 1, in any case. */
static int is_true(const char* text) {
  char lower[8];
  size_t i;
  for (i = 0; text[i] != '\0' && i + 1 < sizeof lower; ++i) lower[i] = (char)tolower((unsigned char)text[i]);
  lower[i] = '\0';
  return text[i] == '\0' && (strcmp(lower, "true") == 0 || strcmp(lower, "yes") == 0 || strcmp(lower, "on") == 0 ||
                              strcmp(lower, "1") == 0);
}

static void* halve_create(const loom_create_args* args, loom_error* error) {
  halve* h = (halve*)calloc(1, sizeof(halve));
  const char* max = loom_c_option(args, "max");
  if (h == NULL) return loom_c_error(error, "out of memory"), (void*)NULL;
  const char* probe = loom_c_option(args, "probe");
  h->max = max ? atoll(max) : 8;
  h->probe = probe != NULL && is_true(probe);
  h->table.struct_size = sizeof(loom_c_memory_policy);
  h->table.self = h;
  h->table.plan = halve_plan;
  h->table.on_oom = halve_on_oom;
  h->table.describe = halve_describe;
  return &h->table;
}

/* ---- c_stop_at ---- */

typedef struct stop_at {
  loom_c_callback table;
  int64_t step;
  double steps_seen, logs, evaluations;
  const char* keys[3];
  double values[3];
  char line[128];
} stop_at;

static int32_t stop_on_step_end(void* self, const loom_c_run* run, const loom_c_step_report* report, loom_error* error) {
  stop_at* s = (stop_at*)self;
  if (report->step != run->step) return loom_c_error(error, "the report's step is not the run's");
  s->steps_seen += 1;
  if (report->step >= s->step) {
    char reason[96];
    snprintf(reason, sizeof reason, "c_stop_at: step %lld reached", (long long)s->step);
    run->request_stop(run->host, reason);
  }
  return 0;
}

static int32_t stop_on_log(void* self, const loom_c_run* run, int64_t step, const loom_c_values* values, loom_error* error) {
  stop_at* s = (stop_at*)self;
  uint32_t i;
  (void)run, (void)step;
  for (i = 0; i < values->count; ++i)
    if (values->keys[i] == NULL) return loom_c_error(error, "a logged value without a name");
  s->logs += 1;
  return 0;
}

static int32_t stop_on_evaluation_end(void* self, const loom_c_run* run, int32_t split, int64_t step,
                                      const loom_c_values* metrics, loom_error* error) {
  stop_at* s = (stop_at*)self;
  uint32_t i;
  int has_loss = 0;
  (void)run, (void)split, (void)step;
  for (i = 0; i < metrics->count; ++i)
    if (metrics->keys[i][0] == 'l' && metrics->keys[i][1] == 'o') has_loss = 1;
  if (!has_loss) return loom_c_error(error, "an evaluation without its loss");
  s->evaluations += 1;
  return 0;
}

static int32_t stop_save_state(void* self, loom_c_values* state, loom_error* error) {
  stop_at* s = (stop_at*)self;
  (void)error;
  s->keys[0] = "steps_seen", s->values[0] = s->steps_seen;
  s->keys[1] = "logs", s->values[1] = s->logs;
  s->keys[2] = "evaluations", s->values[2] = s->evaluations;
  state->count = 3;
  state->keys = s->keys;
  state->values = s->values;
  return 0;
}

static int32_t stop_load_state(void* self, const loom_c_values* state, loom_error* error) {
  stop_at* s = (stop_at*)self;
  uint32_t i;
  (void)error;
  for (i = 0; i < state->count; ++i) {
    const char* k = state->keys[i];
    if (k[0] == 's') s->steps_seen = state->values[i];
    else if (k[0] == 'l') s->logs = state->values[i];
    else if (k[0] == 'e') s->evaluations = state->values[i];
  }
  return 0;
}

static const char* stop_describe(void* self) {
  stop_at* s = (stop_at*)self;
  snprintf(s->line, sizeof s->line, "c_stop_at: stops after step %lld", (long long)s->step);
  return s->line;
}

static void* stop_create(const loom_create_args* args, loom_error* error) {
  stop_at* s = (stop_at*)calloc(1, sizeof(stop_at));
  const char* step = loom_c_option(args, "step");
  if (s == NULL) return loom_c_error(error, "out of memory"), (void*)NULL;
  s->step = step ? atoll(step) : 3;
  s->table.struct_size = sizeof(loom_c_callback);
  s->table.self = s;
  s->table.on_step_end = stop_on_step_end;
  s->table.on_log = stop_on_log;
  s->table.on_evaluation_end = stop_on_evaluation_end;
  s->table.save_state = stop_save_state;
  const char* no_load = loom_c_option(args, "no_load_state");
  s->table.load_state = no_load != NULL && is_true(no_load) ? NULL : stop_load_state;
  s->table.describe = stop_describe;
  return &s->table;
}

/* ---- c_faulty ---- */

typedef struct faulty {
  loom_c_dataset table;
  char fault[32];
  loom_c_field fields[2];
} faulty;

static int32_t faulty_setup(void* self, loom_error* error) {
  (void)self, (void)error;
  return 0;
}

static int is(const char* a, const char* b);

static int32_t faulty_spec(void* self, loom_c_data_spec* spec, loom_error* error) {
  faulty* f = (faulty*)self;
  (void)error;
  spec->field_count = 2;
  spec->fields = f->fields;
  spec->input_key = is(f->fault, "bad_key") ? "nope" : "x";
  spec->target_key = "y";
  spec->num_classes = 2;
  return 0;
}

static int64_t faulty_size(void* self, int32_t split) {
  (void)self;
  return split == LOOM_C_TRAIN ? 16 : 0;
}

static void free_tensor(DLManagedTensorVersioned* t) {
  free(t->dl_tensor.shape);
  free(t->dl_tensor.data);
  free(t);
}

static DLManagedTensorVersioned* make_tensor(uint8_t code, uint8_t bits, int32_t ndim, int64_t n, int64_t width) {
  DLManagedTensorVersioned* t = (DLManagedTensorVersioned*)calloc(1, sizeof *t);
  t->version.major = DLPACK_MAJOR_VERSION;
  t->version.minor = DLPACK_MINOR_VERSION;
  t->deleter = free_tensor;
  t->dl_tensor.device.device_type = kDLCPU;
  t->dl_tensor.ndim = ndim;
  t->dl_tensor.dtype.code = code, t->dl_tensor.dtype.bits = bits, t->dl_tensor.dtype.lanes = 1;
  t->dl_tensor.shape = (int64_t*)calloc(2, sizeof(int64_t));
  t->dl_tensor.shape[0] = n;
  if (ndim > 1) t->dl_tensor.shape[1] = width;
  t->dl_tensor.data = calloc((size_t)(n * (ndim > 1 ? width : 1)), bits / 8);
  return t;
}

static int is(const char* a, const char* b) {
  while (*a != '\0' && *a == *b) ++a, ++b;
  return *a == *b;
}

static int32_t faulty_get_batch(void* self, int32_t split, const int64_t* indices, int64_t count,
                                DLManagedTensorVersioned** out, loom_error* error) {
  faulty* f = (faulty*)self;
  (void)split, (void)indices;
  if (is(f->fault, "error")) return loom_c_error(error, "the disk is on fire");
  out[0] = make_tensor(kDLFloat, 32, 2, count, is(f->fault, "wrong_shape") ? 3 : 2);
  out[1] = is(f->fault, "missing") ? NULL : make_tensor(is(f->fault, "wrong_dtype") ? kDLFloat : kDLInt, 64, 1, count, 0);
  if (is(f->fault, "cuda_memory")) out[0]->dl_tensor.device.device_type = kDLCUDA;
  if (is(f->fault, "old_dlpack")) out[0]->version.major = 0;
  if (is(f->fault, "null_data")) {
    free(out[0]->dl_tensor.data);
    out[0]->dl_tensor.data = NULL;
  }
  return 0;
}

static void* faulty_create(const loom_create_args* args, loom_error* error) {
  faulty* f = (faulty*)calloc(1, sizeof(faulty));
  const char* fault = loom_c_option(args, "fault");
  if (f == NULL) return loom_c_error(error, "out of memory"), (void*)NULL;
  snprintf(f->fault, sizeof f->fault, "%s", fault ? fault : "none");
  f->fields[0].name = "x";
  f->fields[0].dtype.code = kDLFloat, f->fields[0].dtype.bits = 32, f->fields[0].dtype.lanes = 1;
  f->fields[0].ndim = 1;
  f->fields[0].shape[0] = 2;
  f->fields[1].name = "y";
  f->fields[1].dtype.code = kDLInt, f->fields[1].dtype.bits = 64, f->fields[1].dtype.lanes = 1;
  f->fields[1].ndim = 0;
  f->table.struct_size = sizeof(loom_c_dataset);
  f->table.self = f;
  f->table.setup = faulty_setup;
  f->table.spec = faulty_spec;
  f->table.size = faulty_size;
  f->table.get_batch = faulty_get_batch;
  return &f->table;
}

static void destroy(void* object) { free(object); } /* each table is its struct's first member */

static const loom_option_spec halve_options[] = {
    {sizeof(loom_option_spec), LOOM_OPTION_INT, "max", "8", "the largest micro-batch", "1.."},
    {sizeof(loom_option_spec), LOOM_OPTION_BOOL, "probe", "false", "measure each micro-batch on the way down", NULL},
};
static const loom_option_spec stop_options[] = {
    {sizeof(loom_option_spec), LOOM_OPTION_INT, "step", "3", "the step after which the run stops", "1.."},
    {sizeof(loom_option_spec), LOOM_OPTION_BOOL, "no_load_state", "false",
     "leave load_state out of the table (tests: a state saved that no resume gives back)", NULL},
};

static const loom_option_spec faulty_options[] = {
    {sizeof(loom_option_spec), LOOM_OPTION_ENUM, "fault", "none",
     "how get_batch breaks the contract", "none|error|wrong_shape|wrong_dtype|missing|cuda_memory|old_dlpack|null_data|bad_key"},
};

static const loom_component components[] = {
    LOOM_C_MEMORY_POLICY("c_halve", "halves the micro-batch until it fits a maximum (C tier)", halve_options, 2,
                         halve_create, destroy),
    LOOM_C_CALLBACK("c_stop_at", "stops the run after a given step (C tier)", stop_options, 2, stop_create, destroy),
    LOOM_C_DATASET("c_faulty", "a dataset that breaks the C tier's contract on purpose (tests)", faulty_options, 1,
                   faulty_create, destroy),
};

LOOM_C_PLUGIN("c_tier_test", "1.0.0", components)
