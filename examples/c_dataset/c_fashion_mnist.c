/*
 * c_fashion_mnist: the Fashion-MNIST images (28x28 grey, 10 classes) from their IDX files, gzipped
 * or not, as a C-tier dataset: C99 and zlib, no C++, no LibTorch. It yields what Loom's own
 * fashion_mnist (C++) yields, field for field, so a run with either trains to the same accuracy.
 *
 * Every file is checked (a regular file, magic number, counts, 28x28, labels 0 to 9, nothing
 * truncated, nothing trailing); a bad one is one error naming the file and what is wrong.
 */
#define _POSIX_C_SOURCE 200809L /* open(2) with O_CLOEXEC, stat(2) */
#include <loom/sdk/c_plugin.h>

#include <zlib.h>

#include <errno.h>
#include <fcntl.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#define IMAGE_MAGIC 2051u
#define LABEL_MAGIC 2049u
#define PIXELS (28 * 28)
#define CLASSES 10
#define MAX_IMAGES 1000000

typedef struct split_data {
  uint8_t* pixels; /* count x 784 */
  int64_t* labels; /* count */
  int64_t count;
} split_data;

typedef struct dataset {
  loom_c_dataset table; /* first: the host gets &table */
  char folder[4096];
  int64_t limit[2]; /* train, test */
  split_data split[2];
  loom_c_field fields[2];
  const char* attribute_keys[2];
  const char* attribute_values[2];
} dataset;

/* ---- reading IDX files ---------------------------------------------------------------------- */

static int fail(loom_error* error, const char* path, const char* what) {
  char message[LOOM_ERROR_CAPACITY];
  if (snprintf(message, sizeof message, "%s: %s", path, what) >= (int)sizeof message)
    message[sizeof message - 2] = '~'; /* a path too long for the message: cut, and marked so */
  return loom_c_error(error, message);
}

/* Opens `folder/stem.gz` or `folder/stem`: only a regular file, opened without blocking. */
static gzFile open_idx(const char* folder, const char* stem, char* path, size_t path_size, loom_error* error) {
  static const char* const suffixes[] = {".gz", ""};
  size_t i;
  for (i = 0; i < 2; ++i) {
    struct stat st;
    int fd;
    gzFile file;
    snprintf(path, path_size, "%s/%s%s", folder, stem, suffixes[i]);
    if (stat(path, &st) != 0) continue;
    if (!S_ISREG(st.st_mode)) {
      fail(error, path, "not a regular file; point data.path at the Fashion-MNIST files");
      return NULL;
    }
    fd = open(path, O_RDONLY | O_NONBLOCK | O_CLOEXEC);
    if (fd < 0) {
      fail(error, path, strerror(errno));
      return NULL;
    }
    file = gzdopen(fd, "rb");
    if (file == NULL) {
      close(fd);
      fail(error, path, "cannot be read");
    }
    return file;
  }
  snprintf(path, path_size, "%s/%s[.gz]", folder, stem);
  fail(error, path, "not found; install Debian's dataset-fashion-mnist package or set data.path to a folder with "
                    "the four IDX files");
  return NULL;
}

/* Reads exactly n bytes; 0 on success. */
static int read_exactly(gzFile file, void* out, int64_t n, const char* path, loom_error* error) {
  unsigned char* p = (unsigned char*)out;
  while (n > 0) {
    unsigned chunk = n > (1 << 30) ? (1u << 30) : (unsigned)n;
    int got = gzread(file, p, chunk);
    if (got < 0) return fail(error, path, "is corrupt (gzip error); download it again");
    if (got == 0) return fail(error, path, "is truncated: it holds less than its header says; download it again");
    p += got;
    n -= got;
  }
  return 0;
}

static int read_be32(gzFile file, uint32_t* out, const char* path, loom_error* error) {
  unsigned char b[4];
  if (read_exactly(file, b, 4, path, error) != 0) return 1;
  *out = ((uint32_t)b[0] << 24) | ((uint32_t)b[1] << 16) | ((uint32_t)b[2] << 8) | (uint32_t)b[3];
  return 0;
}

static int expect_end(gzFile file, const char* path, loom_error* error) {
  unsigned char extra[64];
  int got = gzread(file, extra, sizeof extra);
  if (got < 0) return fail(error, path, "is corrupt (gzip error); download it again");
  if (got > 0) return fail(error, path, "has bytes after its data: not an IDX file of the size its header says");
  return 0;
}

static int read_split(dataset* d, int which, const char* prefix, loom_error* error) {
  char stem[64], path[4200];
  uint32_t magic, count, rows, cols, label_count;
  int64_t i, keep;
  split_data* s = &d->split[which];
  gzFile images, labels;
  int rc = 1;
  uint8_t* raw_labels = NULL;

  snprintf(stem, sizeof stem, "%s-images-idx3-ubyte", prefix);
  images = open_idx(d->folder, stem, path, sizeof path, error);
  if (images == NULL) return 1;
  if (read_be32(images, &magic, path, error) || read_be32(images, &count, path, error) ||
      read_be32(images, &rows, path, error) || read_be32(images, &cols, path, error))
    goto close_images;
  if (magic != IMAGE_MAGIC) {
    fail(error, path, "is not an IDX image file (magic number)");
    goto close_images;
  }
  if (rows != 28 || cols != 28 || count == 0 || count > MAX_IMAGES) {
    fail(error, path, "its header does not say 1 to 1000000 images of 28x28");
    goto close_images;
  }
  s->pixels = (uint8_t*)malloc((size_t)count * PIXELS);
  if (s->pixels == NULL) {
    fail(error, path, "out of memory");
    goto close_images;
  }
  if (read_exactly(images, s->pixels, (int64_t)count * PIXELS, path, error) || expect_end(images, path, error))
    goto close_images;

  snprintf(stem, sizeof stem, "%s-labels-idx1-ubyte", prefix);
  labels = open_idx(d->folder, stem, path, sizeof path, error);
  if (labels == NULL) goto close_images;
  if (read_be32(labels, &magic, path, error) || read_be32(labels, &label_count, path, error)) goto close_labels;
  if (magic != LABEL_MAGIC) {
    fail(error, path, "is not an IDX label file (magic number)");
    goto close_labels;
  }
  if (label_count != count) {
    fail(error, path, "does not have as many labels as its image file has images");
    goto close_labels;
  }
  raw_labels = (uint8_t*)malloc(count);
  s->labels = (int64_t*)malloc((size_t)count * sizeof(int64_t));
  if (raw_labels == NULL || s->labels == NULL) {
    fail(error, path, "out of memory");
    goto close_labels;
  }
  if (read_exactly(labels, raw_labels, count, path, error) || expect_end(labels, path, error)) goto close_labels;
  for (i = 0; i < (int64_t)count; ++i) {
    if (raw_labels[i] >= CLASSES) {
      fail(error, path, "holds a label that is not a class (0 to 9)");
      goto close_labels;
    }
    s->labels[i] = raw_labels[i];
  }
  keep = d->limit[which] > 0 && d->limit[which] < (int64_t)count ? d->limit[which] : (int64_t)count;
  s->count = keep;
  rc = 0;
close_labels:
  free(raw_labels);
  gzclose(labels);
close_images:
  gzclose(images);
  return rc;
}

/* ---- the C-tier dataset ---------------------------------------------------------------------- */

static int32_t setup(void* self, loom_error* error) {
  dataset* d = (dataset*)self;
  char line[256];
  if (read_split(d, 0, "train", error) != 0 || read_split(d, 1, "t10k", error) != 0) return 1;
  if (snprintf(line, sizeof line, "Fashion-MNIST (C tier) from %s: %lld train, %lld test images", d->folder,
               (long long)d->split[0].count, (long long)d->split[1].count) >= (int)sizeof line)
    line[sizeof line - 2] = '~';
  loom_c_log(LOOM_LOG_INFO, "c_fashion_mnist", line);
  return 0;
}

static int32_t spec(void* self, loom_c_data_spec* out, loom_error* error) {
  dataset* d = (dataset*)self;
  (void)error;
  out->field_count = 2;
  out->fields = d->fields;
  out->input_key = "image";
  out->target_key = "label";
  out->num_classes = CLASSES;
  /* Pixel statistics of the training set, for models that normalize their input. */
  out->attribute_count = 2;
  out->attribute_keys = d->attribute_keys;
  out->attribute_values = d->attribute_values;
  return 0;
}

static int64_t size(void* self, int32_t split) {
  dataset* d = (dataset*)self;
  if (split == LOOM_C_TRAIN) return d->split[0].count;
  if (split == LOOM_C_TEST) return d->split[1].count;
  return 0; /* no validation split of its own: the host holds out part of train */
}

/* A DLPack tensor over memory this plugin allocated; its deleter frees both. */
typedef struct owned_tensor {
  DLManagedTensorVersioned managed;
  int64_t shape[4];
} owned_tensor;

static void free_tensor(DLManagedTensorVersioned* self) {
  free(self->dl_tensor.data);
  free(self);
}

static DLManagedTensorVersioned* new_tensor(DLDataType dtype, int32_t ndim, const int64_t* shape, size_t bytes) {
  owned_tensor* t = (owned_tensor*)calloc(1, sizeof(owned_tensor));
  int32_t i;
  if (t == NULL) return NULL;
  t->managed.dl_tensor.data = malloc(bytes > 0 ? bytes : 1);
  if (t->managed.dl_tensor.data == NULL) {
    free(t);
    return NULL;
  }
  for (i = 0; i < ndim; ++i) t->shape[i] = shape[i];
  t->managed.version.major = DLPACK_MAJOR_VERSION;
  t->managed.version.minor = DLPACK_MINOR_VERSION;
  t->managed.manager_ctx = NULL;
  t->managed.deleter = free_tensor;
  t->managed.flags = 0;
  t->managed.dl_tensor.device.device_type = kDLCPU;
  t->managed.dl_tensor.device.device_id = 0;
  t->managed.dl_tensor.ndim = ndim;
  t->managed.dl_tensor.dtype = dtype;
  t->managed.dl_tensor.shape = t->shape;
  t->managed.dl_tensor.strides = NULL; /* compact, row-major */
  t->managed.dl_tensor.byte_offset = 0;
  return &t->managed;
}

static int32_t get_batch(void* self, int32_t split, const int64_t* indices, int64_t count,
                         DLManagedTensorVersioned** out, loom_error* error) {
  const dataset* d = (const dataset*)self;
  const split_data* s;
  int64_t image_shape[4], label_shape[1], i;
  DLManagedTensorVersioned *images, *labels;
  uint8_t* pixels;
  int64_t* targets;
  if (split != LOOM_C_TRAIN && split != LOOM_C_TEST) return loom_c_error(error, "c_fashion_mnist has no such split");
  s = &d->split[split == LOOM_C_TRAIN ? 0 : 1];
  for (i = 0; i < count; ++i)
    if (indices[i] < 0 || indices[i] >= s->count) return loom_c_error(error, "c_fashion_mnist: a sample index is out of range");
  image_shape[0] = count, image_shape[1] = 1, image_shape[2] = 28, image_shape[3] = 28;
  label_shape[0] = count;
  images = new_tensor(d->fields[0].dtype, 4, image_shape, (size_t)count * PIXELS);
  labels = new_tensor(d->fields[1].dtype, 1, label_shape, (size_t)count * sizeof(int64_t));
  if (images == NULL || labels == NULL) {
    if (images != NULL) images->deleter(images);
    if (labels != NULL) labels->deleter(labels);
    return loom_c_error(error, "c_fashion_mnist: out of memory");
  }
  pixels = (uint8_t*)images->dl_tensor.data;
  targets = (int64_t*)labels->dl_tensor.data;
  for (i = 0; i < count; ++i) {
    memcpy(pixels + i * PIXELS, s->pixels + indices[i] * PIXELS, PIXELS);
    targets[i] = s->labels[indices[i]];
  }
  out[0] = images;
  out[1] = labels;
  return 0;
}

/* ---- the component ------------------------------------------------------------------------- */

static const loom_option_spec options[] = {
    {sizeof(loom_option_spec), LOOM_OPTION_STRING, "path", "/usr/share/datasets/fashion-mnist",
     "folder with train-images-idx3-ubyte[.gz] and the three other IDX files", NULL},
    {sizeof(loom_option_spec), LOOM_OPTION_INT, "limit_train", "0", "use only the first N training images (0: all)",
     "0.."},
    {sizeof(loom_option_spec), LOOM_OPTION_INT, "limit_test", "0", "use only the first N test images (0: all)", "0.."},
};

static void* create(const loom_create_args* args, loom_error* error) {
  dataset* d = (dataset*)calloc(1, sizeof(dataset));
  const char* path = loom_c_option(args, "path");
  if (d == NULL) {
    loom_c_error(error, "out of memory");
    return NULL;
  }
  if (path == NULL || strlen(path) >= sizeof d->folder) {
    free(d);
    loom_c_error(error, "c_fashion_mnist: path is missing or too long");
    return NULL;
  }
  strcpy(d->folder, path);
  /* The host hands every key, its text checked against the option's type and range. */
  d->limit[0] = loom_c_option(args, "limit_train") ? atoll(loom_c_option(args, "limit_train")) : 0;
  d->limit[1] = loom_c_option(args, "limit_test") ? atoll(loom_c_option(args, "limit_test")) : 0;
  d->fields[0].name = "image";
  d->fields[0].dtype.code = kDLUInt, d->fields[0].dtype.bits = 8, d->fields[0].dtype.lanes = 1;
  d->fields[0].ndim = 3;
  d->fields[0].shape[0] = 1, d->fields[0].shape[1] = 28, d->fields[0].shape[2] = 28;
  d->fields[1].name = "label";
  d->fields[1].dtype.code = kDLInt, d->fields[1].dtype.bits = 64, d->fields[1].dtype.lanes = 1;
  d->fields[1].ndim = 0;
  d->attribute_keys[0] = "mean", d->attribute_values[0] = "0.2860";
  d->attribute_keys[1] = "std", d->attribute_values[1] = "0.3530";
  d->table.struct_size = sizeof(loom_c_dataset);
  d->table.self = d;
  d->table.setup = setup;
  d->table.spec = spec;
  d->table.size = size;
  d->table.get_batch = get_batch;
  return &d->table;
}

static void destroy(void* object) {
  dataset* d = (dataset*)object; /* the table is the struct's first member */
  int i;
  if (d == NULL) return;
  for (i = 0; i < 2; ++i) {
    free(d->split[i].pixels);
    free(d->split[i].labels);
  }
  free(d);
}

static const loom_component components[] = {
    LOOM_C_DATASET("c_fashion_mnist", "Fashion-MNIST images from IDX files, in C (the C tier: no LibTorch)", options,
                   3, create, destroy),
};

LOOM_C_PLUGIN("c_fashion_mnist", "1.0.0", components)
