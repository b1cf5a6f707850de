/*
 * inferd_backend.h - the C ABI of an inferd native backend plugin.
 *
 * A native backend is a shared object named lib<name>_backend.so placed in a
 * backends directory (default /usr/lib/inferd/backends). It exports exactly two
 * symbols, both prefixed inferd_backend_:
 *
 *   uint32_t inferd_backend_api_version(void);
 *       INFERD_BACKEND_API_VERSION as the plugin was compiled. The daemon calls
 *       this first and nothing else unless the major equals its own and the
 *       minor is not greater than its own.
 *
 *   const inferd_backend *inferd_backend_get(void);
 *       The plugin's table of functions. Static storage; never NULL.
 *
 * Everything else in the plugin should be static (or hidden with
 * -fvisibility=hidden), so two plugins never clash.
 *
 * Conventions:
 *   - Functions returning int32_t return INFERD_OK (0) on success and a
 *     non-zero INFERD_ERR_* code on failure; the failure's message is then
 *     available from last_error() on the same thread until the next call.
 *   - probe() and supports() return 1 (yes) or 0 (no, with the reason in
 *     last_error()).
 *   - Strings are UTF-8, NUL-terminated, owned by the plugin.
 *   - run() may be called from several threads at once, also on one model;
 *     it must be reentrant. last_error() must therefore be thread-local.
 *   - A plugin must never call exit(), abort() or print to stdout.
 *
 * Version rule: a minor version only appends members to the end of
 * inferd_backend; the daemon reads the table's `size` to know which members
 * exist. A major version may change anything.
 */
#ifndef INFERD_BACKEND_H
#define INFERD_BACKEND_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define INFERD_BACKEND_API_MAJOR 1
#define INFERD_BACKEND_API_MINOR 0
#define INFERD_BACKEND_API_VERSION \
    (((uint32_t)INFERD_BACKEND_API_MAJOR << 16) | (uint32_t)INFERD_BACKEND_API_MINOR)

/* Device kinds, as in inferd.libbackends.contract.DeviceKind. */
enum {
    INFERD_KIND_CPU = 0,
    INFERD_KIND_GPU = 1,
    INFERD_KIND_NPU = 2
};

/* Return codes; each maps to one inferd wire error code. */
enum {
    INFERD_OK = 0,
    INFERD_ERR_INVALID_ARGUMENT = 1, /* the request's tensors are wrong      */
    INFERD_ERR_NOT_FOUND = 2,        /* the model file is missing            */
    INFERD_ERR_UNSUPPORTED = 3,      /* the model uses something not handled */
    INFERD_ERR_UNAVAILABLE = 4,      /* the device is gone or busy           */
    INFERD_ERR_RESOURCE_EXHAUSTED = 5,
    INFERD_ERR_INTERNAL = 6
};

/* Element types: the numbers of ONNX's TensorProto.DataType (no strings). */
enum {
    INFERD_DTYPE_FLOAT32 = 1,
    INFERD_DTYPE_UINT8 = 2,
    INFERD_DTYPE_INT8 = 3,
    INFERD_DTYPE_UINT16 = 4,
    INFERD_DTYPE_INT16 = 5,
    INFERD_DTYPE_INT32 = 6,
    INFERD_DTYPE_INT64 = 7,
    INFERD_DTYPE_BOOL = 9,
    INFERD_DTYPE_FLOAT16 = 10,
    INFERD_DTYPE_FLOAT64 = 11,
    INFERD_DTYPE_UINT32 = 12,
    INFERD_DTYPE_UINT64 = 13
};

#define INFERD_MAX_DIMS 8

/*
 * A tensor: its description (name, dtype, shape) and, when it carries data,
 * a dense C-order buffer of nbytes bytes. In a model's input/output
 * description data is NULL and a dimension that is not fixed is -1.
 */
typedef struct inferd_tensor {
    const char *name;
    int32_t dtype;
    int32_t ndim;
    int64_t shape[INFERD_MAX_DIMS];
    void *data;
    uint64_t nbytes;
} inferd_tensor;

/* A loaded model: opaque to the daemon, defined by the plugin. */
typedef struct inferd_model inferd_model;

typedef struct inferd_backend {
    /* sizeof(inferd_backend) as the plugin was compiled. */
    uint32_t size;

    /* Identity: unique id (e.g. "elementwise-c"), the plugin's own version. */
    const char *(*id)(void);
    const char *(*version)(void);
    /* One of INFERD_KIND_*. */
    int32_t (*device_kind)(void);

    /* Is the device really there? 1: yes, and a comma-separated list of the
     * devices seen is written to devices (at most len bytes with the NUL).
     * 0: no, reason in last_error(). Must be cheap and must not hang. */
    int32_t (*probe)(char *devices, size_t len);

    /* Can this backend run the model file? 1: yes. 0: no, reason in
     * last_error(). */
    int32_t (*supports)(const char *model_path);

    /* Load a model; threads is a hint (0: the plugin decides). */
    int32_t (*load)(const char *model_path, int32_t threads, inferd_model **out);

    /* The model's inputs (is_output == 0) or outputs (is_output == 1): an
     * array owned by the model, valid until unload(). */
    int32_t (*describe)(const inferd_model *model, int32_t is_output,
                        const inferd_tensor **tensors, size_t *count);

    /* Run one batch. inputs are in the order describe() gave, already checked
     * by the daemon against dtype, rank and fixed dimensions. On success
     * *outputs is an array of *n_outputs tensors in describe() order, allocated
     * by the plugin and released by the daemon with free(). */
    int32_t (*run)(inferd_model *model, const inferd_tensor *inputs, size_t n_inputs,
                   inferd_tensor **outputs, size_t *n_outputs);

    /* Release the outputs of one run() (the array and each tensor's data). */
    void (*free)(inferd_tensor *outputs, size_t n_outputs);

    /* Release a model. Called once, after its last run() returned. */
    void (*unload)(inferd_model *model);

    /* The message of this thread's last failure ("" if none). */
    const char *(*last_error)(void);
} inferd_backend;

/* The two exported symbols. Mark their definitions INFERD_BACKEND_EXPORT so
 * they stay visible when the plugin is built with -fvisibility=hidden. */
#if defined(__GNUC__)
#define INFERD_BACKEND_EXPORT __attribute__((visibility("default")))
#else
#define INFERD_BACKEND_EXPORT
#endif

INFERD_BACKEND_EXPORT uint32_t inferd_backend_api_version(void);
INFERD_BACKEND_EXPORT const inferd_backend *inferd_backend_get(void);

#ifdef __cplusplus
}
#endif

#endif /* INFERD_BACKEND_H */
