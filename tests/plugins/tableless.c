/* A C-tier dataset whose table lacks get_batch (a defect whatever its options): `loom plugins
 * check` fails its create check, where it once skipped it as "cannot be created with its default
 * options", as for a dataset that needs its files named. */
#include <loom/sdk/c_plugin.h>

#include <stdlib.h>

typedef struct tableless {
  loom_c_dataset table; /* first */
} tableless;

static int32_t setup(void* self, loom_error* error) {
  (void)self;
  (void)error;
  return 0;
}

static const loom_option_spec options[] = {
    {sizeof(loom_option_spec), LOOM_OPTION_STRING, "path", "/nowhere", "a folder it would read", NULL},
};

static void* create(const loom_create_args* args, loom_error* error) {
  (void)args;
  (void)error;
  tableless* d = (tableless*)calloc(1, sizeof *d);
  if (d == NULL) return NULL;
  d->table.struct_size = sizeof(loom_c_dataset);
  d->table.self = d;
  d->table.setup = setup; /* spec, size and get_batch forgotten */
  return &d->table;
}

static void destroy(void* object) { free(object); }

static const loom_component components[] = {
    LOOM_C_DATASET("tableless", "a table without its functions", options, 1, create, destroy)};
LOOM_C_PLUGIN("tableless", "1.0.0", components)
