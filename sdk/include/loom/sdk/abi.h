/*
 * Tier 0 of the Loom plugin ABI: the stable C handshake between the host and a plugin.
 *
 * A plugin is a shared library that exports one symbol, `loom_plugin_entry_v1`, a function
 * returning a pointer to a constant `loom_plugin_descriptor`. The function lives in the ELF
 * section `loom`, so the host can find it with a static read of the file before loading it.
 * The descriptor names the plugin, carries the fingerprint of the toolchain it was built with
 * and lists its components (a model, a dataset, a precision strategy, a memory policy, a
 * parallel strategy, an optimizer, a learning-rate schedule or a callback), each with its options schema
 * and a factory.
 *
 * This header is C, uses fixed-width types only, and is the part of the SDK that never
 * breaks within an ABI major version. See docs/abi.md for the evolution rules; in short:
 *   - structs only grow at the end; every struct starts with `struct_size`, and readers
 *     honour it (a field beyond a struct's size is absent);
 *   - the host accepts a plugin whose ABI major equals its own and whose ABI minor is not
 *     newer than its own;
 *   - Tier 1 (the C++ interfaces in the other SDK headers) is used only when the build
 *     fingerprint equals the host's, because C++ types are only as stable as the toolchain.
 *
 * Nothing here allocates across the boundary: strings are borrowed, errors are written into
 * a caller-owned fixed buffer.
 */
#ifndef LOOM_SDK_ABI_H
#define LOOM_SDK_ABI_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* 'LOOM' read as a little-endian 32-bit word. */
#define LOOM_ABI_MAGIC 0x4D4F4F4Cu
#define LOOM_ABI_MAJOR 1
#define LOOM_ABI_MINOR 4

/* The entry symbol's name and the ELF section it lives in. */
#define LOOM_ENTRY_SYMBOL "loom_plugin_entry_v1"
#define LOOM_ENTRY_SECTION "loom"

/* Since ABI 1.4 a plugin carries its build fingerprint as an ELF note, which the host reads from
 * the file before it loads it (no code of the plugin runs before the fingerprint is accepted):
 * section LOOM_NOTE_SECTION, owner LOOM_NOTE_NAME, type LOOM_NOTE_FINGERPRINT, and as its
 * description NUL-terminated text of "key=value" lines (docs/abi.md, Note [Fingerprint]).
 * LOOM_PLUGIN (C++) and LOOM_C_PLUGIN (C, loom/sdk/c_plugin.h) emit it. */
#define LOOM_NOTE_SECTION ".note.loom"
#define LOOM_NOTE_NAME "Loom"
#define LOOM_NOTE_FINGERPRINT 1
#define LOOM_NOTE_CAPACITY 1024 /* bytes of the description, the NUL included */

/* Component flags (loom_component.flags, since ABI 1.4). */
#define LOOM_COMPONENT_C_TIER 1u /* `create` returns a C-tier object (loom/sdk/c_plugin.h), not a
                                    Tier-1 C++ one; the plugin needs no LibTorch */

/* The size of each struct that crosses the boundary, by the ABI minor that last grew it: the host
 * refuses a struct smaller than the size of the plugin's own minor and reads a field added in a
 * later minor only when struct_size covers it. LOOM_MIN_SIZE(loom_component, 4) is the size an
 * ABI 1.4 plugin must declare. None has grown since 1.0; a struct that grows in 1.k gets
 * "(minor) >= k ? <new size> : <old size>" here, and its new fields a "since ABI 1.k" comment. */
#define LOOM_MIN_SIZE(type, minor) LOOM_MIN_SIZE_##type(minor)
#define LOOM_MIN_SIZE_loom_error(minor) 1032u
#define LOOM_MIN_SIZE_loom_option_spec(minor) 40u
#define LOOM_MIN_SIZE_loom_create_args(minor) 16u
#define LOOM_MIN_SIZE_loom_component(minor) 64u
#define LOOM_MIN_SIZE_loom_build_fingerprint(minor) 48u
#define LOOM_MIN_SIZE_loom_host_api(minor) 24u
#define LOOM_MIN_SIZE_loom_plugin_descriptor(minor) 56u

/* Bounds the host enforces when it reads a descriptor (a longer string is refused). */
#define LOOM_MAX_NAME 64
#define LOOM_MAX_TEXT 1024
#define LOOM_MAX_COMPONENTS 64
#define LOOM_MAX_OPTIONS 128
#define LOOM_ERROR_CAPACITY 1024

/* Component kinds. A kind unknown to the host refuses the whole plugin (a plugin of a newer ABI
 * minor, the only one that could know more kinds, is refused before its components are read). */
typedef enum loom_kind {
  LOOM_KIND_MODEL = 1,
  LOOM_KIND_DATASET = 2,
  LOOM_KIND_PRECISION = 3,
  LOOM_KIND_MEMORY = 4,
  LOOM_KIND_PARALLEL = 5,
  LOOM_KIND_OPTIMIZER = 6, /* since ABI 1.1 */
  LOOM_KIND_SCHEDULE = 7,  /* since ABI 1.1 */
  LOOM_KIND_CALLBACK = 8   /* since ABI 1.2 */
} loom_kind;

/* Types of option values. Values always travel as text; the type says how the host validates
 * the text before the plugin ever sees it. */
typedef enum loom_option_type {
  LOOM_OPTION_BOOL = 1,   /* true/false, yes/no, on/off, 1/0 */
  LOOM_OPTION_INT = 2,    /* a signed 64-bit integer */
  LOOM_OPTION_FLOAT = 3,  /* a finite double */
  LOOM_OPTION_STRING = 4, /* any text */
  LOOM_OPTION_BYTES = 5,  /* a size: 512MiB, 2GiB, 1.5GB, 4096 */
  LOOM_OPTION_ENUM = 6,   /* one of `choices`, a '|'-separated list */
  LOOM_OPTION_LIST = 7    /* a comma-separated list of words */
} loom_option_type;

/* Log levels of host_api.log, the same order as the host's logger. */
typedef enum loom_log_level {
  LOOM_LOG_TRACE = 0,
  LOOM_LOG_DEBUG = 1,
  LOOM_LOG_INFO = 2,
  LOOM_LOG_WARN = 3,
  LOOM_LOG_ERROR = 4
} loom_log_level;

/* An error a plugin reports to the host: a caller-owned buffer the plugin writes a
 * NUL-terminated message into. */
typedef struct loom_error {
  uint32_t struct_size;
  uint32_t capacity; /* bytes in `message`, at least 1 */
  char message[LOOM_ERROR_CAPACITY];
} loom_error;

/* One key of a component's options schema. */
typedef struct loom_option_spec {
  uint32_t struct_size;
  uint32_t type;             /* loom_option_type */
  const char* key;           /* lower_snake_case, unique within the component */
  const char* default_value; /* text valid for `type`; "" (or NULL): no default, the key is required,
                                but for STRING and LIST, where "" is the default: the empty text or list */
  const char* help;          /* one line, shown by `loom plugins inspect` and in errors about the option */
  const char* choices;       /* LOOM_OPTION_ENUM: "a|b|c". Since ABI 1.3, LOOM_OPTION_INT and
                                LOOM_OPTION_FLOAT: NULL, or the valid range "lo..hi", inclusive
                                (either side may be empty: "1..", "..0.5"). Otherwise NULL. */
} loom_option_spec;

/* One configured value handed to a factory. Every key of the schema is present, with the
 * user's value or the default, already validated against the key's type. */
typedef struct loom_option_value {
  const char* key;
  const char* value;
} loom_option_value;

/* What a factory receives. Borrowed for the duration of the call. */
typedef struct loom_create_args {
  uint32_t struct_size;
  uint32_t value_count;
  const loom_option_value* values;
} loom_create_args;

/* A component: one constructible thing of one kind. `create` returns a pointer to the Tier-1
 * object (for example a `loom::sdk::Model*`), owned by the caller until it passes it back to
 * `destroy`. On failure `create` returns NULL and writes the reason into `error`. Neither
 * function may let an exception escape. Called on the host's main thread. */
typedef struct loom_component {
  uint32_t struct_size;
  uint32_t kind;              /* loom_kind */
  const char* name;           /* unique per kind across all loaded plugins, lower_snake_case */
  const char* summary;        /* one line */
  uint32_t interface_major;   /* version of the Tier-1 interface of `kind` it implements */
  uint32_t interface_minor;
  const loom_option_spec* options;
  uint32_t option_count;
  uint32_t flags;             /* since ABI 1.4: LOOM_COMPONENT_* bits; 0 before (was reserved0) */
  void* (*create)(const loom_create_args* args, loom_error* error);
  void (*destroy)(void* object);
} loom_component;

/* How the plugin was built. Tier 1 passes C++ objects across the boundary, so the host uses it
 * only when every field here equals the host's own (see docs/abi.md, "Fingerprint"). */
typedef struct loom_build_fingerprint {
  uint32_t struct_size;
  uint32_t torch_major;
  uint32_t torch_minor;
  uint32_t torch_patch;
  uint32_t torch_cuda;    /* 1: built against a CUDA build of LibTorch, 0: a CPU build */
  uint32_t cxx11_abi;     /* the value of _GLIBCXX_USE_CXX11_ABI, or 2 for a non-libstdc++ library */
  uint32_t cxx_standard;  /* __cplusplus / 100, e.g. 2020 */
  uint32_t reserved0;
  const char* compiler;   /* "gcc 12", "clang 17": family and major version */
  const char* sdk_version; /* the Loom SDK the plugin was built with, "0.1.0" */
} loom_build_fingerprint;

/* Host services, handed to a plugin's `init`. Valid until the process ends. */
typedef struct loom_host_api {
  uint32_t struct_size;
  uint16_t abi_major;
  uint16_t abi_minor;
  void* context; /* pass back as the first argument of every function below */
  /* Logs one line as the plugin `plugin`. Thread-safe. */
  void (*log)(void* context, uint32_t level, const char* plugin, const char* message);
} loom_host_api;

/* The plugin descriptor. Constant; lives as long as the library is loaded. */
typedef struct loom_plugin_descriptor {
  uint32_t magic;       /* LOOM_ABI_MAGIC */
  uint32_t struct_size; /* sizeof(loom_plugin_descriptor) as the plugin saw it */
  uint16_t abi_major;   /* LOOM_ABI_MAJOR as the plugin saw it */
  uint16_t abi_minor;
  uint32_t component_count;
  const char* name;     /* the plugin's name, lower_snake_case */
  const char* version;  /* the plugin's own version, free text */
  const loom_build_fingerprint* fingerprint;
  const loom_component* components;
  /* Optional (may be NULL). Called once, after the descriptor and fingerprint checks passed and
   * before any component is created. Returns 0 on success; otherwise writes the reason into
   * `error` and the host refuses the plugin. Must not throw. */
  int32_t (*init)(const loom_host_api* host, loom_error* error);
} loom_plugin_descriptor;

/* The entry point's type and name. */
typedef const loom_plugin_descriptor* (*loom_plugin_entry_fn)(void);

#ifdef __cplusplus
} /* extern "C" */
#endif

/* Layout pins: the ABI of x86-64 and aarch64 Linux (LP64). A change here is an ABI break. */
#if defined(__LP64__)
#ifdef __cplusplus
#define LOOM_STATIC_ASSERT(c, m) static_assert(c, m)
#else
#define LOOM_STATIC_ASSERT(c, m) _Static_assert(c, m)
#endif
LOOM_STATIC_ASSERT(sizeof(loom_error) == 8 + LOOM_ERROR_CAPACITY, "loom_error layout");
LOOM_STATIC_ASSERT(offsetof(loom_error, message) == 8, "loom_error layout");
LOOM_STATIC_ASSERT(sizeof(loom_option_spec) == 40, "loom_option_spec layout");
LOOM_STATIC_ASSERT(offsetof(loom_option_spec, key) == 8, "loom_option_spec layout");
LOOM_STATIC_ASSERT(offsetof(loom_option_spec, choices) == 32, "loom_option_spec layout");
LOOM_STATIC_ASSERT(sizeof(loom_option_value) == 16, "loom_option_value layout");
LOOM_STATIC_ASSERT(sizeof(loom_create_args) == 16, "loom_create_args layout");
LOOM_STATIC_ASSERT(offsetof(loom_create_args, values) == 8, "loom_create_args layout");
LOOM_STATIC_ASSERT(sizeof(loom_component) == 64, "loom_component layout");
LOOM_STATIC_ASSERT(offsetof(loom_component, name) == 8, "loom_component layout");
LOOM_STATIC_ASSERT(offsetof(loom_component, interface_major) == 24, "loom_component layout");
LOOM_STATIC_ASSERT(offsetof(loom_component, options) == 32, "loom_component layout");
LOOM_STATIC_ASSERT(offsetof(loom_component, create) == 48, "loom_component layout");
LOOM_STATIC_ASSERT(offsetof(loom_component, destroy) == 56, "loom_component layout");
LOOM_STATIC_ASSERT(sizeof(loom_build_fingerprint) == 48, "loom_build_fingerprint layout");
LOOM_STATIC_ASSERT(offsetof(loom_build_fingerprint, compiler) == 32, "loom_build_fingerprint layout");
LOOM_STATIC_ASSERT(sizeof(loom_host_api) == 24, "loom_host_api layout");
LOOM_STATIC_ASSERT(offsetof(loom_host_api, log) == 16, "loom_host_api layout");
LOOM_STATIC_ASSERT(sizeof(loom_plugin_descriptor) == 56, "loom_plugin_descriptor layout");
LOOM_STATIC_ASSERT(offsetof(loom_plugin_descriptor, name) == 16, "loom_plugin_descriptor layout");
LOOM_STATIC_ASSERT(offsetof(loom_plugin_descriptor, fingerprint) == 32, "loom_plugin_descriptor layout");
LOOM_STATIC_ASSERT(offsetof(loom_plugin_descriptor, init) == 48, "loom_plugin_descriptor layout");
/* The current layouts are the newest minor's sizes (a grown struct changes both lines). */
LOOM_STATIC_ASSERT(sizeof(loom_error) == LOOM_MIN_SIZE(loom_error, LOOM_ABI_MINOR), "size table");
LOOM_STATIC_ASSERT(sizeof(loom_option_spec) == LOOM_MIN_SIZE(loom_option_spec, LOOM_ABI_MINOR), "size table");
LOOM_STATIC_ASSERT(sizeof(loom_create_args) == LOOM_MIN_SIZE(loom_create_args, LOOM_ABI_MINOR), "size table");
LOOM_STATIC_ASSERT(sizeof(loom_component) == LOOM_MIN_SIZE(loom_component, LOOM_ABI_MINOR), "size table");
LOOM_STATIC_ASSERT(sizeof(loom_build_fingerprint) == LOOM_MIN_SIZE(loom_build_fingerprint, LOOM_ABI_MINOR), "size table");
LOOM_STATIC_ASSERT(sizeof(loom_host_api) == LOOM_MIN_SIZE(loom_host_api, LOOM_ABI_MINOR), "size table");
LOOM_STATIC_ASSERT(sizeof(loom_plugin_descriptor) == LOOM_MIN_SIZE(loom_plugin_descriptor, LOOM_ABI_MINOR), "size table");
#undef LOOM_STATIC_ASSERT
#endif

#endif /* LOOM_SDK_ABI_H */
