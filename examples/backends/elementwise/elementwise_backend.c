/*
 * elementwise_backend.c - an example inferd native backend (id "elementwise-c").
 *
 * What it really runs: ONNX models whose graph is a chain of unary, attribute-
 * free, elementwise float32 operators from one input to one output, e.g.
 * x -> Relu -> Sigmoid -> y. Supported ops: Identity, Relu, Neg, Abs, Sigmoid,
 * Tanh, Exp, Log, Sqrt, Floor, Ceil, Reciprocal, Sin, Cos. It reads the .onnx
 * file with a small protobuf reader of its own (no libonnx, no protobuf
 * library), and says exactly why any other model is not supported.
 *
 * It is a complete example of the ABI in libbackends/include/inferd_backend.h,
 * not a useful engine: anything with weights (Conv, MatMul...) is refused.
 *
 * Build: make -C examples/backends   (gives build/libelementwise_backend.so)
 */
#include <errno.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "inferd_backend.h"

#define EXAMPLE_VERSION "1.0.0"
#define MAX_NODES 64
#define MAX_NAME 128
#define MAX_FILE (64L * 1024 * 1024)

/* ------------------------------------------------------------------ errors */

static _Thread_local char last_error_buf[512];

static int32_t fail(int32_t code, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(last_error_buf, sizeof last_error_buf, fmt, ap);
    va_end(ap);
    return code;
}

static const char *last_error(void) { return last_error_buf; }

/* ------------------------------------------------------------------ ops */

enum op { OP_IDENTITY, OP_RELU, OP_NEG, OP_ABS, OP_SIGMOID, OP_TANH, OP_EXP, OP_LOG,
          OP_SQRT, OP_FLOOR, OP_CEIL, OP_RECIPROCAL, OP_SIN, OP_COS, OP_COUNT };

static const char *const op_names[OP_COUNT] = {
    "Identity", "Relu", "Neg", "Abs", "Sigmoid", "Tanh", "Exp", "Log",
    "Sqrt", "Floor", "Ceil", "Reciprocal", "Sin", "Cos"};

static int op_lookup(const char *name)
{
    for (int i = 0; i < OP_COUNT; i++)
        if (strcmp(name, op_names[i]) == 0)
            return i;
    return -1;
}

static float apply(int op, float x)
{
    switch (op) {
    case OP_RELU: return x > 0.0f ? x : 0.0f;
    case OP_NEG: return -x;
    case OP_ABS: return fabsf(x);
    case OP_SIGMOID: return 1.0f / (1.0f + expf(-x));
    case OP_TANH: return tanhf(x);
    case OP_EXP: return expf(x);
    case OP_LOG: return logf(x);
    case OP_SQRT: return sqrtf(x);
    case OP_FLOOR: return floorf(x);
    case OP_CEIL: return ceilf(x);
    case OP_RECIPROCAL: return 1.0f / x;
    case OP_SIN: return sinf(x);
    case OP_COS: return cosf(x);
    default: return x;
    }
}

/* ------------------------------------------------------------------ protobuf */

typedef struct { const uint8_t *p, *end; } buf;

static int read_varint(buf *b, uint64_t *v)
{
    uint64_t r = 0;
    for (int shift = 0; b->p < b->end && shift < 64; shift += 7) {
        uint8_t c = *b->p++;
        r |= (uint64_t)(c & 0x7f) << shift;
        if (!(c & 0x80)) {
            *v = r;
            return 0;
        }
    }
    return -1;
}

/* One field: its number, wire type, a varint's value or a LEN field's bytes. */
static int read_field(buf *b, uint32_t *num, uint32_t *wire, uint64_t *val, buf *sub)
{
    uint64_t key, n;
    if (read_varint(b, &key))
        return -1;
    *num = (uint32_t)(key >> 3);
    *wire = (uint32_t)(key & 7);
    switch (*wire) {
    case 0: return read_varint(b, val);
    case 1: if (b->end - b->p < 8) return -1; b->p += 8; return 0;
    case 5: if (b->end - b->p < 4) return -1; b->p += 4; return 0;
    case 2:
        if (read_varint(b, &n) || n > (uint64_t)(b->end - b->p))
            return -1;
        sub->p = b->p;
        sub->end = b->p + n;
        b->p += n;
        return 0;
    default: return -1;
    }
}

static int copy_string(const buf *s, char *out, size_t cap)
{
    size_t n = (size_t)(s->end - s->p);
    if (n >= cap)
        return -1;
    memcpy(out, s->p, n);
    out[n] = '\0';
    return 0;
}

typedef struct {
    char name[MAX_NAME];
    int32_t elem;
    int32_t ndim;
    int64_t shape[INFERD_MAX_DIMS];
} value_info;

typedef struct {
    char op[32], domain[32], in[MAX_NAME], out[MAX_NAME];
    int n_in, n_out, n_attr;
} node;

typedef struct {
    node nodes[MAX_NODES];
    int n_nodes;
    value_info in, out;
    int n_in, n_out, n_init;
} graph;

/* TensorShapeProto.Dimension: dim_value (1) or dim_param (2). */
static int parse_dim(buf b, int64_t *d)
{
    uint32_t num, wire;
    uint64_t v = 0;
    buf sub;
    *d = -1;
    while (b.p < b.end) {
        if (read_field(&b, &num, &wire, &v, &sub))
            return -1;
        if (num == 1 && wire == 0)
            *d = (int64_t)v;
    }
    return 0;
}

/* ValueInfoProto: name (1), type (2) -> tensor_type (1) -> elem_type (1), shape (2). */
static int parse_value_info(buf b, value_info *vi)
{
    uint32_t num, wire, n2, w2, n3, w3, n4, w4;
    uint64_t v;
    buf sub, t, tt, sh;
    memset(vi, 0, sizeof *vi);
    while (b.p < b.end) {
        if (read_field(&b, &num, &wire, &v, &sub))
            return -1;
        if (num == 1 && wire == 2 && copy_string(&sub, vi->name, sizeof vi->name))
            return -1;
        if (num != 2 || wire != 2)
            continue;
        while (sub.p < sub.end) {          /* TypeProto */
            if (read_field(&sub, &n2, &w2, &v, &t))
                return -1;
            if (n2 != 1 || w2 != 2)
                continue;
            while (t.p < t.end) {          /* TypeProto.Tensor */
                if (read_field(&t, &n3, &w3, &v, &tt))
                    return -1;
                if (n3 == 1 && w3 == 0)
                    vi->elem = (int32_t)v;
                if (n3 != 2 || w3 != 2)
                    continue;
                while (tt.p < tt.end) {    /* TensorShapeProto */
                    if (read_field(&tt, &n4, &w4, &v, &sh))
                        return -1;
                    if (n4 != 1 || w4 != 2)
                        continue;
                    if (vi->ndim >= INFERD_MAX_DIMS)
                        return -1;
                    if (parse_dim(sh, &vi->shape[vi->ndim++]))
                        return -1;
                }
            }
        }
    }
    return 0;
}

/* NodeProto: input (1), output (2), op_type (4), attribute (5), domain (7). */
static int parse_node(buf b, node *n)
{
    uint32_t num, wire;
    uint64_t v;
    buf sub;
    memset(n, 0, sizeof *n);
    while (b.p < b.end) {
        if (read_field(&b, &num, &wire, &v, &sub))
            return -1;
        if (wire != 2)
            continue;
        if (num == 1 && n->n_in++ == 0 && copy_string(&sub, n->in, sizeof n->in))
            return -1;
        if (num == 2 && n->n_out++ == 0 && copy_string(&sub, n->out, sizeof n->out))
            return -1;
        if (num == 4 && copy_string(&sub, n->op, sizeof n->op))
            return -1;
        if (num == 5)
            n->n_attr++;
        if (num == 7 && copy_string(&sub, n->domain, sizeof n->domain))
            return -1;
    }
    return 0;
}

/* GraphProto: node (1), initializer (5), input (11), output (12), sparse init (15). */
static int parse_graph(buf b, graph *g)
{
    uint32_t num, wire;
    uint64_t v;
    buf sub;
    while (b.p < b.end) {
        if (read_field(&b, &num, &wire, &v, &sub))
            return -1;
        if (wire != 2)
            continue;
        if (num == 1) {
            /* Nodes past MAX_NODES are counted, not kept: the first ones decide. */
            if (g->n_nodes < MAX_NODES && parse_node(sub, &g->nodes[g->n_nodes]))
                return -1;
            g->n_nodes++;
        } else if (num == 5 || num == 15) {
            g->n_init++;
        } else if (num == 11 && g->n_in++ == 0) {
            if (parse_value_info(sub, &g->in))
                return -1;
        } else if (num == 12 && g->n_out++ == 0) {
            if (parse_value_info(sub, &g->out))
                return -1;
        }
    }
    return 0;
}

/* ------------------------------------------------------------------ models */

struct inferd_model {
    char in_name[MAX_NAME], out_name[MAX_NAME];
    inferd_tensor io[2]; /* [0]: the input, [1]: the output (descriptions) */
    int n_ops;
    int ops[MAX_NODES];
};

/* Read and check a model file; on success fill *m (if not NULL). */
static int32_t examine(const char *path, struct inferd_model *m)
{
    FILE *f = fopen(path, "rb");
    if (!f)
        return fail(INFERD_ERR_NOT_FOUND, "cannot open %s: %s", path, strerror(errno));
    uint8_t *data = NULL;
    long size = -1;
    if (fseek(f, 0, SEEK_END) == 0)
        size = ftell(f);
    if (size < 0 || size > MAX_FILE || fseek(f, 0, SEEK_SET) != 0) {
        fclose(f);
        return fail(INFERD_ERR_UNSUPPORTED, "%s: unreadable or larger than %ld bytes",
                    path, MAX_FILE);
    }
    data = malloc((size_t)size + 1);
    if (!data || fread(data, 1, (size_t)size, f) != (size_t)size) {
        free(data);
        fclose(f);
        return fail(INFERD_ERR_INTERNAL, "cannot read %s", path);
    }
    fclose(f);

    graph *g = calloc(1, sizeof *g);
    buf b = {data, data + size}, sub;
    uint32_t num, wire;
    uint64_t v;
    int32_t rc = INFERD_OK, have_graph = 0;
    last_error_buf[0] = '\0';
    while (g && rc == INFERD_OK && b.p < b.end) {
        if (read_field(&b, &num, &wire, &v, &sub)) {
            rc = fail(INFERD_ERR_UNSUPPORTED, "%s is not an ONNX (protobuf) file", path);
        } else if (num == 7 && wire == 2) { /* ModelProto.graph */
            have_graph = 1;
            if (parse_graph(sub, g))
                rc = last_error_buf[0] ? INFERD_ERR_UNSUPPORTED
                    : fail(INFERD_ERR_UNSUPPORTED, "%s: malformed ONNX graph", path);
        }
    }
    free(data);
    if (!g)
        return fail(INFERD_ERR_RESOURCE_EXHAUSTED, "out of memory");
    if (rc == INFERD_OK && !have_graph)
        rc = fail(INFERD_ERR_UNSUPPORTED, "%s has no ONNX graph", path);
    if (rc == INFERD_OK && (g->n_in != 1 || g->n_out != 1))
        rc = fail(INFERD_ERR_UNSUPPORTED, "the graph has %d inputs and %d outputs; "
                  "only 1 and 1 are supported", g->n_in, g->n_out);
    if (rc == INFERD_OK && g->n_init)
        rc = fail(INFERD_ERR_UNSUPPORTED, "the graph has %d initializers (weights); "
                  "only weightless elementwise chains are supported", g->n_init);
    if (rc == INFERD_OK && (g->in.elem != INFERD_DTYPE_FLOAT32
                            || g->out.elem != INFERD_DTYPE_FLOAT32))
        rc = fail(INFERD_ERR_UNSUPPORTED, "input and output must be float32 "
                  "(ONNX type 1), got %d and %d", g->in.elem, g->out.elem);
    if (rc == INFERD_OK && g->n_nodes == 0)
        rc = fail(INFERD_ERR_UNSUPPORTED, "the graph has no nodes");
    const char *current = g->in.name;
    for (int i = 0; rc == INFERD_OK && i < g->n_nodes && i < MAX_NODES; i++) {
        node *n = &g->nodes[i];
        int op = op_lookup(n->op);
        if (op < 0 || n->n_attr || (n->domain[0] && strcmp(n->domain, "ai.onnx")))
            rc = fail(INFERD_ERR_UNSUPPORTED, "node %d (%s%s%s) is not one of the "
                      "attribute-free unary elementwise ops this example runs", i,
                      n->domain[0] ? n->domain : "", n->domain[0] ? "." : "", n->op);
        else if (n->n_in != 1 || n->n_out != 1 || strcmp(n->in, current))
            rc = fail(INFERD_ERR_UNSUPPORTED, "node %d (%s) does not continue a single "
                      "chain from input %s", i, n->op, g->in.name);
        else if (m)
            m->ops[i] = op;
        current = n->out;
    }
    if (rc == INFERD_OK && g->n_nodes > MAX_NODES)
        rc = fail(INFERD_ERR_UNSUPPORTED, "the graph has %d nodes; at most %d are "
                  "supported", g->n_nodes, MAX_NODES);
    if (rc == INFERD_OK && strcmp(current, g->out.name))
        rc = fail(INFERD_ERR_UNSUPPORTED, "the chain ends in %s, not in the graph "
                  "output %s", current, g->out.name);
    if (rc == INFERD_OK && m) {
        m->n_ops = g->n_nodes;
        strcpy(m->in_name, g->in.name);
        strcpy(m->out_name, g->out.name);
        for (int k = 0; k < 2; k++) {
            value_info *vi = k ? &g->out : &g->in;
            inferd_tensor *t = &m->io[k];
            t->name = k ? m->out_name : m->in_name;
            t->dtype = INFERD_DTYPE_FLOAT32;
            t->ndim = vi->ndim;
            memcpy(t->shape, vi->shape, sizeof t->shape);
        }
    }
    free(g);
    return rc;
}

/* ------------------------------------------------------------------ the table */

static const char *id(void) { return "elementwise-c"; }
static const char *version(void) { return EXAMPLE_VERSION; }
static int32_t device_kind(void) { return INFERD_KIND_CPU; }

static int32_t probe(char *devices, size_t len)
{
    /* A real backend opens its device here; the CPU is always there. */
    snprintf(devices, len, "cpu");
    return 1;
}

static int32_t supports(const char *path)
{
    return examine(path, NULL) == INFERD_OK ? 1 : 0;
}

static int32_t load(const char *path, int32_t threads, inferd_model **out)
{
    (void)threads; /* one thread per run is plenty for elementwise work */
    struct inferd_model *m = calloc(1, sizeof *m);
    if (!m)
        return fail(INFERD_ERR_RESOURCE_EXHAUSTED, "out of memory");
    int32_t rc = examine(path, m);
    if (rc != INFERD_OK) {
        free(m);
        return rc;
    }
    *out = m;
    return INFERD_OK;
}

static int32_t describe(const inferd_model *m, int32_t is_output,
                        const inferd_tensor **tensors, size_t *count)
{
    *tensors = &m->io[is_output ? 1 : 0];
    *count = 1;
    return INFERD_OK;
}

static int32_t run(inferd_model *m, const inferd_tensor *inputs, size_t n_inputs,
                   inferd_tensor **outputs, size_t *n_outputs)
{
    if (n_inputs != 1 || inputs[0].dtype != INFERD_DTYPE_FLOAT32)
        return fail(INFERD_ERR_INVALID_ARGUMENT, "expected one float32 input");
    const inferd_tensor *in = &inputs[0];
    size_t count = (size_t)(in->nbytes / sizeof(float));
    inferd_tensor *out = calloc(1, sizeof *out);
    float *y = malloc(in->nbytes ? in->nbytes : 1);
    if (!out || !y) {
        free(out);
        free(y);
        return fail(INFERD_ERR_RESOURCE_EXHAUSTED, "out of memory for %llu bytes",
                    (unsigned long long)in->nbytes);
    }
    const float *x = in->data;
    for (size_t i = 0; i < count; i++) {
        float v = x[i];
        for (int k = 0; k < m->n_ops; k++)
            v = apply(m->ops[k], v);
        y[i] = v;
    }
    out->name = m->out_name;
    out->dtype = INFERD_DTYPE_FLOAT32;
    out->ndim = in->ndim;
    memcpy(out->shape, in->shape, sizeof out->shape);
    out->data = y;
    out->nbytes = in->nbytes;
    *outputs = out;
    *n_outputs = 1;
    return INFERD_OK;
}

static void free_outputs(inferd_tensor *outputs, size_t n)
{
    for (size_t i = 0; i < n; i++)
        free(outputs[i].data);
    free(outputs);
}

static void unload(inferd_model *m) { free(m); }

static const inferd_backend table = {
    .size = sizeof(inferd_backend),
    .id = id,
    .version = version,
    .device_kind = device_kind,
    .probe = probe,
    .supports = supports,
    .load = load,
    .describe = describe,
    .run = run,
    .free = free_outputs,
    .unload = unload,
    .last_error = last_error,
};

INFERD_BACKEND_EXPORT uint32_t inferd_backend_api_version(void)
{
    return INFERD_BACKEND_API_VERSION;
}

INFERD_BACKEND_EXPORT const inferd_backend *inferd_backend_get(void) { return &table; }
