/*
 * inferd_customop.h - the C ABI of an inferd native custom operator.
 *
 * A native custom op is a shared object named libinferdcst_<name>.so placed in a
 * custom ops directory (default /usr/lib/inferd/customops) or in a model's own
 * <repository>/<model>/customops/ folder. It exports exactly one symbol:
 *
 *   const inferd_customop *inferd_customop_get(void);
 *       The op's table. Static storage; never NULL. Its first member is the API
 *       version the op was compiled against: the daemon reads it first and
 *       nothing else unless the major equals its own and the minor is not
 *       greater than its own.
 *
 * The library is first opened, checked and its init()/destroy() called in a
 * short-lived child process (a crash or hang there skips the op, never the
 * daemon), then opened in the daemon.
 *
 * Life of an op on one node of one model:
 *   init(ctx, &state)       once, when the model loads: read the node's attributes
 *                           through ctx->attrs (valid during init only), build
 *                           kernels (GPU: on ctx->cl_context).
 *   prepare(state, ...)     output dtypes and shapes from the input ones; once at load
 *                           (data NULL, a free dimension is -1) and before every
 *                           compute (real shapes).
 *   compute(state, ...)     CPU: fill the outputs' buffers, allocated by the daemon,
 *                           for the window [start, end) along split_dim of output 0;
 *                           called from several threads at once on disjoint windows.
 *                           GPU: data members are cl_mem buffers (inputs already
 *                           written, outputs read back by the daemon); enqueue the
 *                           kernel on ctx->cl_queue; the daemon waits for the queue.
 *   destroy(state)          once, at unload.
 *
 * Conventions as in inferd_backend.h: int32_t functions return INFERD_OK or an
 * INFERD_ERR_* code with the message in last_error() (thread-local); never exit(),
 * abort() or print to stdout.
 *
 * Version rule: a minor version only appends members to inferd_customop; the daemon
 * reads `size` to know which exist. A major version may change anything.
 */
#ifndef INFERD_CUSTOMOP_H
#define INFERD_CUSTOMOP_H

#include <stddef.h>
#include <stdint.h>

#include "inferd_backend.h" /* inferd_tensor, INFERD_DTYPE_*, INFERD_OK, INFERD_ERR_* */

#ifdef __cplusplus
extern "C" {
#endif

#define INFERD_CUSTOMOP_API_MAJOR 1
#define INFERD_CUSTOMOP_API_MINOR 0
#define INFERD_CUSTOMOP_API_VERSION \
    (((uint32_t)INFERD_CUSTOMOP_API_MAJOR << 16) | (uint32_t)INFERD_CUSTOMOP_API_MINOR)

/* Where compute runs. */
enum {
    INFERD_CST_TARGET_CPU = 0,
    INFERD_CST_TARGET_GPU = 1 /* OpenCL: the daemon gives the context and queue */
};

/* The node's attributes, read by name. Each getter returns 1 when the attribute
 * exists with that type (the value written to *out), 0 otherwise (*out untouched,
 * so initialise it with the default first). Valid during init() only. */
typedef struct inferd_cst_attrs {
    const void *node; /* opaque: pass it back as the first argument */
    int32_t (*get_float)(const void *node, const char *name, float *out);
    int32_t (*get_int)(const void *node, const char *name, int64_t *out);
    /* NUL-terminated, truncated to len - 1 bytes */
    int32_t (*get_string)(const void *node, const char *name, char *out, size_t len);
    /* at most cap values written; *count is the attribute's full length */
    int32_t (*get_floats)(const void *node, const char *name, float *out, size_t cap,
                          size_t *count);
    int32_t (*get_ints)(const void *node, const char *name, int64_t *out, size_t cap,
                        size_t *count);
} inferd_cst_attrs;

/* What init() receives. */
typedef struct inferd_cst_context {
    const inferd_cst_attrs *attrs;
    int32_t threads;     /* the model's threads; windows are split over them */
    void *cl_context;    /* GPU target: cl_context, owned by the daemon; else NULL */
    void *cl_device;     /* GPU target: cl_device_id */
    void *cl_queue;      /* GPU target: cl_command_queue (in order) */
} inferd_cst_context;

/* A window: [start, end) along the op's split_dim of output 0. The whole
 * dimension when the op has no split_dim (-1: start 0, end 1). */
typedef struct inferd_cst_window {
    int64_t start;
    int64_t end;
} inferd_cst_window;

typedef int32_t (*inferd_cst_compute_fn)(void *state, const inferd_tensor *inputs,
                                         size_t n_inputs, inferd_tensor *outputs,
                                         size_t n_outputs, const inferd_cst_window *window);

/* One kernel variant (Arm Compute Library's way): the daemon takes the first one
 * whose features the CPU has all of. */
typedef struct inferd_cst_kernel {
    const char *name;     /* shown in the plan, e.g. "avx2" */
    const char *features; /* comma-separated, e.g. "avx2,fma" or "neon,dotprod"; "" none */
    inferd_cst_compute_fn compute;
} inferd_cst_kernel;

typedef struct inferd_customop {
    uint32_t api_version; /* INFERD_CUSTOMOP_API_VERSION as compiled: read first */
    uint32_t size;        /* sizeof(inferd_customop) as compiled */

    const char *op_type;  /* the ONNX op type, e.g. "cstSigmoid" */
    const char *domain;   /* NULL or "": nodes of any domain */
    int32_t target;       /* INFERD_CST_TARGET_* */

    /* Windows (CPU): the dimension of output 0 that compute() may be split along,
     * or -1 for none; sub-window boundaries are multiples of split_step (>= 1). */
    int32_t split_dim;
    int64_t split_step;

    /* Kernel variants, best first; at least one. A GPU op has one, features "". */
    const inferd_cst_kernel *kernels;
    size_t n_kernels;

    int32_t (*init)(const inferd_cst_context *ctx, void **state);
    /* outputs: n_outputs tensors whose dtype, ndim and shape prepare() fills */
    int32_t (*prepare)(void *state, const inferd_tensor *inputs, size_t n_inputs,
                       inferd_tensor *outputs, size_t n_outputs);
    void (*destroy)(void *state);
    const char *(*last_error)(void);
} inferd_customop;

#if defined(__GNUC__)
#define INFERD_CUSTOMOP_EXPORT __attribute__((visibility("default")))
#else
#define INFERD_CUSTOMOP_EXPORT
#endif

INFERD_CUSTOMOP_EXPORT const inferd_customop *inferd_customop_get(void);

#ifdef __cplusplus
}
#endif

#endif /* INFERD_CUSTOMOP_H */
