/*
 * A C-tier test plugin with a memory policy and a callback (C99, no LibTorch), for
 * tests/unit/trainer/c_tier_test.cpp: the host's adapters must carry plans, out-of-memory
 * replays, hooks, stop requests and callback state across the C boundary.
 *   memory 'c_halve':   halves the micro-batch (doubling accumulation) until it is at most `max`;
 *                       on running out of memory, halves it again.
 *   callback 'c_stop_at': asks the run to stop once step `step` has ended; counts its hooks and
 *                       keeps the counts as its state.
 */
#include <loom/sdk/c_plugin.h>

#include <stdio.h>
#include <stdlib.h>

/* ---- c_halve ---- */

typedef struct halve {
  loom_c_memory_policy table;
  int64_t max;
  char line[128];
} halve;

static int32_t halve_plan(void* self, loom_c_plan_context* ctx, loom_error* error) {
  halve* h = (halve*)self;
  if (ctx->plan.micro_batch * ctx->plan.accumulation * ctx->plan.world_size != ctx->global_batch)
    return loom_c_error(error, "the plan it was given does not make the global batch");
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

static void* halve_create(const loom_create_args* args, loom_error* error) {
  halve* h = (halve*)calloc(1, sizeof(halve));
  const char* max = loom_c_option(args, "max");
  if (h == NULL) return loom_c_error(error, "out of memory"), (void*)NULL;
  h->max = max ? atoll(max) : 8;
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
  s->table.load_state = stop_load_state;
  s->table.describe = stop_describe;
  return &s->table;
}

static void destroy(void* object) { free(object); } /* each table is its struct's first member */

static const loom_option_spec halve_options[] = {
    {sizeof(loom_option_spec), LOOM_OPTION_INT, "max", "8", "the largest micro-batch", "1.."},
};
static const loom_option_spec stop_options[] = {
    {sizeof(loom_option_spec), LOOM_OPTION_INT, "step", "3", "the step after which the run stops", "1.."},
};

static const loom_component components[] = {
    LOOM_C_MEMORY_POLICY("c_halve", "halves the micro-batch until it fits a maximum (C tier)", halve_options, 1,
                         halve_create, destroy),
    LOOM_C_CALLBACK("c_stop_at", "stops the run after a given step (C tier)", stop_options, 1, stop_create, destroy),
};

LOOM_C_PLUGIN("c_tier_test", "1.0.0", components)
