/* A user's own `progress` callback, in a C-tier plugin of its own: found before Loom's standard
 * callbacks (a folder earlier in the search), it is the one used, and Loom's other callbacks
 * still load from their file (tests/unit/plugins/plugin_loader_test.cpp). */
#include <loom/sdk/c_plugin.h>

#include <stdlib.h>

typedef struct quiet_progress {
  loom_c_callback table; /* first */
} quiet_progress;

static const char* describe(void* self) {
  (void)self;
  return "a user's progress line";
}

static void* create(const loom_create_args* args, loom_error* error) {
  (void)args;
  quiet_progress* c = (quiet_progress*)calloc(1, sizeof *c);
  if (c == NULL) {
    loom_c_error(error, "out of memory");
    return NULL;
  }
  c->table.struct_size = sizeof(loom_c_callback);
  c->table.self = c;
  c->table.describe = describe; /* every hook NULL: it does nothing */
  return &c->table;
}

static void destroy(void* object) { free(object); }

static const loom_component components[] = {
    LOOM_C_CALLBACK("progress", "a user's own progress callback (C tier)", NULL, 0, create, destroy)};
LOOM_C_PLUGIN("overriding_progress", "1.0.0", components)
