/*
 * cst_sigmoid.c - a native CPU custom op for inferd: y = 1 / (1 + exp(-alpha * x)).
 *
 * Op type cstSigmoid (any domain), attribute alpha (float, default 1.0), one
 * float32 input, one float32 output of the same shape. Built by `make` in
 * examples/customops into build/cpu/libinferdcst_sigmoid.so.
 *
 * Kernel variants, best first (the daemon takes the first one the CPU has the
 * features of, see docs/customops.md): on x86-64 "avx2" (needs avx2 and fma: the
 * loop is vectorised with glibc's vector expf), then "generic" (any CPU).
 *
 * Windows: split_dim 0, step 1. compute() fills the rows [start, end) of
 * dimension 0 (a row is every element of the other dimensions); the daemon
 * calls it from several threads at once on disjoint windows.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "inferd_customop.h"

static __thread char last_error_buf[256];

static int32_t fail(int32_t code, const char *message) {
    snprintf(last_error_buf, sizeof last_error_buf, "%s", message);
    return code;
}

static const char *last_error(void) { return last_error_buf; }

typedef struct {
    float alpha;
} state_t;

static int32_t init(const inferd_cst_context *ctx, void **out) {
    state_t *s = malloc(sizeof *s);
    if (!s)
        return fail(INFERD_ERR_RESOURCE_EXHAUSTED, "out of memory");
    s->alpha = 1.0f; /* the default, kept when the node has no alpha */
    ctx->attrs->get_float(ctx->attrs->node, "alpha", &s->alpha);
    *out = s;
    return INFERD_OK;
}

static int32_t prepare(void *state, const inferd_tensor *in, size_t n_in,
                       inferd_tensor *out, size_t n_out) {
    (void)state;
    if (n_in != 1 || n_out != 1)
        return fail(INFERD_ERR_INVALID_ARGUMENT, "cstSigmoid takes one input, gives one output");
    if (in[0].dtype != INFERD_DTYPE_FLOAT32)
        return fail(INFERD_ERR_UNSUPPORTED, "cstSigmoid takes float32 only");
    out[0].dtype = INFERD_DTYPE_FLOAT32;
    out[0].ndim = in[0].ndim;
    memcpy(out[0].shape, in[0].shape, sizeof out[0].shape);
    return INFERD_OK;
}

/* The rows [start, end) of dimension 0 as an element range. */
static void rows(const inferd_tensor *t, const inferd_cst_window *w, size_t *first,
                 size_t *count) {
    size_t row = 1;
    for (int32_t d = 1; d < t->ndim; d++)
        row *= (size_t)t->shape[d];
    if (t->ndim == 0) { /* a scalar: one row of one element */
        *first = 0;
        *count = w->start == 0 && w->end > 0 ? 1 : 0;
        return;
    }
    *first = (size_t)w->start * row;
    *count = (size_t)(w->end - w->start) * row;
}

static int32_t compute_generic(void *state, const inferd_tensor *in, size_t n_in,
                               inferd_tensor *out, size_t n_out, const inferd_cst_window *w) {
    (void)n_in; (void)n_out;
    const float a = ((state_t *)state)->alpha;
    size_t first, count;
    rows(&out[0], w, &first, &count);
    const float *x = (const float *)in[0].data + first;
    float *y = (float *)out[0].data + first;
    for (size_t i = 0; i < count; i++)
        y[i] = 1.0f / (1.0f + expf(-a * x[i]));
    return INFERD_OK;
}

#if defined(__x86_64__)
__attribute__((target("avx2,fma")))
static int32_t compute_avx2(void *state, const inferd_tensor *in, size_t n_in,
                            inferd_tensor *out, size_t n_out, const inferd_cst_window *w) {
    (void)n_in; (void)n_out;
    const float a = ((state_t *)state)->alpha;
    size_t first, count;
    rows(&out[0], w, &first, &count);
    const float *restrict x = (const float *)in[0].data + first;
    float *restrict y = (float *)out[0].data + first;
#pragma omp simd
    for (size_t i = 0; i < count; i++)
        y[i] = 1.0f / (1.0f + expf(-a * x[i]));
    return INFERD_OK;
}
#endif

static void destroy(void *state) { free(state); }

static const inferd_cst_kernel kernels[] = {
#if defined(__x86_64__)
    {"avx2", "avx2,fma", compute_avx2},
#endif
    {"generic", "", compute_generic},
};

static const inferd_customop op = {
    .api_version = INFERD_CUSTOMOP_API_VERSION,
    .size = sizeof(inferd_customop),
    .op_type = "cstSigmoid",
    .domain = NULL,
    .target = INFERD_CST_TARGET_CPU,
    .split_dim = 0,
    .split_step = 1,
    .kernels = kernels,
    .n_kernels = sizeof kernels / sizeof kernels[0],
    .init = init,
    .prepare = prepare,
    .destroy = destroy,
    .last_error = last_error,
};

INFERD_CUSTOMOP_EXPORT const inferd_customop *inferd_customop_get(void) { return &op; }
