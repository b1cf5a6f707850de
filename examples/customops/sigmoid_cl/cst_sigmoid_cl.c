/*
 * cst_sigmoid_cl.c - a native GPU (OpenCL) custom op for inferd:
 * y = 1 / (1 + exp(-alpha * x)), op type cstSigmoid, attribute alpha (default 1.0).
 *
 * The daemon gives init() its OpenCL context, device and in-order queue; init()
 * builds the kernel once. For each compute() the daemon has written the input
 * into a device buffer (inputs[0].data is its cl_mem) and reads the output buffer
 * back after the queue is done: compute() only sets the arguments and enqueues.
 * Built by `make` in examples/customops into build/gpu/libinferdcst_sigmoid_cl.so
 * (links libOpenCL; Debian: ocl-icd-opencl-dev, and a driver such as pocl-opencl-icd).
 */
#define CL_TARGET_OPENCL_VERSION 120
#include <CL/cl.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "inferd_customop.h"

static const char *source =
    "__kernel void cst_sigmoid(__global const float *x, __global float *y,\n"
    "                          const float alpha, const unsigned long n) {\n"
    "    size_t i = get_global_id(0);\n"
    "    if (i < n) y[i] = 1.0f / (1.0f + exp(-alpha * x[i]));\n"
    "}\n";

static __thread char last_error_buf[512];

static int32_t fail(int32_t code, const char *what, cl_int err) {
    snprintf(last_error_buf, sizeof last_error_buf, "%s (OpenCL error %d)", what, (int)err);
    return code;
}

static const char *last_error(void) { return last_error_buf; }

typedef struct {
    float alpha;
    cl_command_queue queue;
    cl_program program;
    cl_kernel kernel;
    pthread_mutex_t lock; /* clSetKernelArg + enqueue on one kernel object */
} state_t;

static void destroy(void *p) {
    state_t *s = p;
    if (!s)
        return;
    if (s->kernel)
        clReleaseKernel(s->kernel);
    if (s->program)
        clReleaseProgram(s->program);
    pthread_mutex_destroy(&s->lock);
    free(s);
}

static int32_t init(const inferd_cst_context *ctx, void **out) {
    if (!ctx->cl_context || !ctx->cl_queue)
        return fail(INFERD_ERR_UNAVAILABLE, "no OpenCL context given", 0);
    state_t *s = calloc(1, sizeof *s);
    if (!s)
        return fail(INFERD_ERR_RESOURCE_EXHAUSTED, "out of memory", 0);
    pthread_mutex_init(&s->lock, NULL);
    s->alpha = 1.0f;
    ctx->attrs->get_float(ctx->attrs->node, "alpha", &s->alpha);
    s->queue = (cl_command_queue)ctx->cl_queue;
    cl_device_id device = (cl_device_id)ctx->cl_device;
    cl_int err;
    s->program = clCreateProgramWithSource((cl_context)ctx->cl_context, 1, &source, NULL, &err);
    if (err != CL_SUCCESS) {
        destroy(s);
        return fail(INFERD_ERR_INTERNAL, "clCreateProgramWithSource failed", err);
    }
    err = clBuildProgram(s->program, 1, &device, "", NULL, NULL);
    if (err != CL_SUCCESS) {
        char log[256] = "";
        clGetProgramBuildInfo(s->program, device, CL_PROGRAM_BUILD_LOG, sizeof log - 1, log, NULL);
        snprintf(last_error_buf, sizeof last_error_buf, "clBuildProgram failed (%d): %s",
                 (int)err, log);
        destroy(s);
        return INFERD_ERR_INTERNAL;
    }
    s->kernel = clCreateKernel(s->program, "cst_sigmoid", &err);
    if (err != CL_SUCCESS) {
        destroy(s);
        return fail(INFERD_ERR_INTERNAL, "clCreateKernel failed", err);
    }
    *out = s;
    return INFERD_OK;
}

static int32_t prepare(void *state, const inferd_tensor *in, size_t n_in,
                       inferd_tensor *out, size_t n_out) {
    (void)state;
    if (n_in != 1 || n_out != 1)
        return fail(INFERD_ERR_INVALID_ARGUMENT, "cstSigmoid takes one input, gives one output", 0);
    if (in[0].dtype != INFERD_DTYPE_FLOAT32)
        return fail(INFERD_ERR_UNSUPPORTED, "cstSigmoid takes float32 only", 0);
    out[0].dtype = INFERD_DTYPE_FLOAT32;
    out[0].ndim = in[0].ndim;
    memcpy(out[0].shape, in[0].shape, sizeof out[0].shape);
    return INFERD_OK;
}

static int32_t compute(void *state, const inferd_tensor *in, size_t n_in, inferd_tensor *out,
                       size_t n_out, const inferd_cst_window *w) {
    (void)n_in; (void)n_out; (void)w; /* a GPU op gets the whole tensor */
    state_t *s = state;
    cl_ulong n = out[0].nbytes / sizeof(float);
    if (n == 0)
        return INFERD_OK;
    cl_mem x = (cl_mem)in[0].data, y = (cl_mem)out[0].data;
    size_t global = (size_t)n;
    pthread_mutex_lock(&s->lock);
    cl_int err = clSetKernelArg(s->kernel, 0, sizeof x, &x);
    err |= clSetKernelArg(s->kernel, 1, sizeof y, &y);
    err |= clSetKernelArg(s->kernel, 2, sizeof s->alpha, &s->alpha);
    err |= clSetKernelArg(s->kernel, 3, sizeof n, &n);
    if (err == CL_SUCCESS)
        err = clEnqueueNDRangeKernel(s->queue, s->kernel, 1, NULL, &global, NULL, 0, NULL, NULL);
    pthread_mutex_unlock(&s->lock);
    if (err != CL_SUCCESS)
        return fail(INFERD_ERR_INTERNAL, "enqueueing cst_sigmoid failed", err);
    return INFERD_OK;
}

static const inferd_cst_kernel kernels[] = {{"opencl", "", compute}};

static const inferd_customop op = {
    .api_version = INFERD_CUSTOMOP_API_VERSION,
    .size = sizeof(inferd_customop),
    .op_type = "cstSigmoid",
    .domain = NULL,
    .target = INFERD_CST_TARGET_GPU,
    .split_dim = -1,
    .split_step = 1,
    .kernels = kernels,
    .n_kernels = 1,
    .init = init,
    .prepare = prepare,
    .destroy = destroy,
    .last_error = last_error,
};

INFERD_CUSTOMOP_EXPORT const inferd_customop *inferd_customop_get(void) { return &op; }
