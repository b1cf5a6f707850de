/*
 * test_ops.c - native custom ops for the tests, one kind per -D flag:
 *   (none)         cstKernel: three kernel variants; each writes its number into
 *                  every element of the output (which one ran shows in the result).
 *                  KERNEL1_FEATURES / KERNEL2_FEATURES set what the first two need
 *                  (the third needs KERNEL3_FEATURES, "" by default).
 *   SEGV_IN_GET    inferd_customop_get() dereferences NULL
 *   HANG_IN_GET    inferd_customop_get() never returns
 *   NO_SYMBOL      exports inferd_customop_get_v2 instead
 *   WRONG_VERSION  table says API 2.0
 *   SEGV_IN_INIT   init() dereferences NULL
 *   NULL_COMPUTE   the kernel's compute is NULL
 *   RECORD         cstRecord: split_dim 0, step SPLIT_STEP; compute writes, for each
 *                  row of its window, the window's start into column 0 and its end
 *                  into column 1 (the test reads back the sub-windows).
 */
#include <stdio.h>
#include <string.h>
#include <unistd.h>

#include "inferd_customop.h"

#ifndef KERNEL1_FEATURES
#define KERNEL1_FEATURES "no_such_feature_a"
#endif
#ifndef KERNEL2_FEATURES
#define KERNEL2_FEATURES ""
#endif
#ifndef KERNEL3_FEATURES
#define KERNEL3_FEATURES ""
#endif
#ifndef SPLIT_STEP
#define SPLIT_STEP 1
#endif

static const char *last_error(void) { return "test op error"; }

static int32_t init(const inferd_cst_context *ctx, void **state) {
#ifdef SEGV_IN_INIT
    *(volatile int *)0 = ctx->threads;
#endif
    (void)ctx;
    *state = (void *)1;
    return INFERD_OK;
}

static int32_t prepare(void *state, const inferd_tensor *in, size_t n_in, inferd_tensor *out,
                       size_t n_out) {
    (void)state; (void)n_in; (void)n_out;
    out[0].dtype = INFERD_DTYPE_FLOAT32;
    out[0].ndim = in[0].ndim;
    memcpy(out[0].shape, in[0].shape, sizeof out[0].shape);
    return INFERD_OK;
}

static void destroy(void *state) { (void)state; }

static size_t count(const inferd_tensor *t) {
    size_t n = 1;
    for (int32_t d = 0; d < t->ndim; d++)
        n *= (size_t)t->shape[d];
    return n;
}

#define KERNEL(k)                                                                            \
    __attribute__((unused)) static int32_t compute##k(void *s, const inferd_tensor *in, size_t ni, inferd_tensor *out, \
                              size_t no, const inferd_cst_window *w) {                      \
        (void)s; (void)in; (void)ni; (void)no; (void)w;                                     \
        float *y = out[0].data;                                                              \
        for (size_t i = 0; i < count(&out[0]); i++)                                          \
            y[i] = (float)(k);                                                               \
        return INFERD_OK;                                                                    \
    }
KERNEL(1)
KERNEL(2)
KERNEL(3)

__attribute__((unused)) static int32_t record(void *s, const inferd_tensor *in, size_t ni, inferd_tensor *out,
                      size_t no, const inferd_cst_window *w) {
    (void)s; (void)in; (void)ni; (void)no;
    float *y = out[0].data;
    size_t row = (size_t)out[0].shape[1];
    for (int64_t r = w->start; r < w->end; r++) {
        y[r * row] = (float)w->start;
        y[r * row + 1] = (float)w->end;
    }
    usleep(1000); /* let the other sub-windows start on their threads */
    return INFERD_OK;
}

#ifdef RECORD
static const inferd_cst_kernel kernels[] = {{"record", "", record}};
#else
static const inferd_cst_kernel kernels[] = {
#ifdef NULL_COMPUTE
    {"first", KERNEL1_FEATURES, NULL},
#else
    {"first", KERNEL1_FEATURES, compute1},
#endif
    {"second", KERNEL2_FEATURES, compute2},
    {"third", KERNEL3_FEATURES, compute3},
};
#endif

static const inferd_customop op = {
#ifdef WRONG_VERSION
    .api_version = 2u << 16,
#else
    .api_version = INFERD_CUSTOMOP_API_VERSION,
#endif
    .size = sizeof(inferd_customop),
#ifdef RECORD
    .op_type = "cstRecord",
#else
    .op_type = "cstKernel",
#endif
    .domain = NULL,
    .target = INFERD_CST_TARGET_CPU,
    .split_dim = 0,
    .split_step = SPLIT_STEP,
    .kernels = kernels,
    .n_kernels = sizeof kernels / sizeof kernels[0],
    .init = init,
    .prepare = prepare,
    .destroy = destroy,
    .last_error = last_error,
};

#ifdef NO_SYMBOL
INFERD_CUSTOMOP_EXPORT const inferd_customop *inferd_customop_get_v2(void) { return &op; }
#else
INFERD_CUSTOMOP_EXPORT const inferd_customop *inferd_customop_get(void) {
#ifdef SEGV_IN_GET
    return *(const inferd_customop *volatile *)0;
#endif
#ifdef HANG_IN_GET
    for (;;)
        pause();
#endif
    return &op;
}
#endif
