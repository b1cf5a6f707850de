/* What a completed call gives back (its code, message, result and outputs), and the
 * waited calls built on submit + wait: infer (with the retry of RESOURCE_EXHAUSTED),
 * control ops, ping, and the models and status ops parsed into structs. */
#include <stdlib.h>
#include <string.h>

#include "internal.h"

/* ------------------------------------------------------------------ results */

inferd_client *inferd_call_client(const inferd_call *call)
{
    return call ? call->client : NULL;
}

const char *inferd_call_id(const inferd_call *call)
{
    return call ? call->id : "";
}

inferd_code inferd_call_code(const inferd_call *call)
{
    if (call == NULL)
        return INFERD_INVALID_ARGUMENT;
    return call->state == IFD_DONE ? call->code : INFERD_AGAIN;
}

const char *inferd_call_message(const inferd_call *call)
{
    if (call == NULL || call->state != IFD_DONE || call->code == INFERD_OK)
        return "";
    return ifd_text_get(&call->message);
}

const char *inferd_call_result(const inferd_call *call)
{
    return call && call->state == IFD_DONE ? call->reply.result : NULL;
}

size_t inferd_output_count(const inferd_call *call)
{
    return call && call->state == IFD_DONE && call->code == INFERD_OK ? call->reply.n_outputs : 0;
}

const inferd_tensor *inferd_output(const inferd_call *call, size_t index)
{
    if (index >= inferd_output_count(call))
        return NULL;
    return &call->reply.outputs[index];
}

const inferd_tensor *inferd_output_by_name(const inferd_call *call, const char *name)
{
    if (name == NULL)
        return NULL;
    for (size_t i = 0; i < inferd_output_count(call); i++)
        if (strcmp(call->reply.outputs[i].name, name) == 0)
            return &call->reply.outputs[i];
    return NULL;
}

const void *inferd_output_aligned(inferd_call *call, size_t index)
{
    const inferd_tensor *t = inferd_output(call, index);
    if (t == NULL || t->dtype == INFERD_STRING)
        return NULL;
    size_t align = inferd_dtype_size(t->dtype);  /* 0 for the 4-bit types: bytes */
    if (t->size == 0 || align <= 1 || ((uintptr_t)t->data % align) == 0)
        return t->data;
    if (call->aligned == NULL &&
        (call->aligned = calloc(call->reply.n_outputs, sizeof *call->aligned)) == NULL)
        return NULL;
    if (call->aligned[index] == NULL) {
        void *copy = malloc(t->size);  /* malloc's alignment suits every dtype */
        if (copy == NULL)
            return NULL;
        memcpy(copy, t->data, t->size);
        call->aligned[index] = copy;
    }
    return call->aligned[index];
}

inferd_code inferd_output_string(const inferd_call *call, size_t index, uint64_t elem,
                                 const char **data, size_t *len)
{
    const inferd_tensor *t = inferd_output(call, index);
    if (t == NULL || t->dtype != INFERD_STRING || data == NULL || len == NULL)
        return INFERD_INVALID_ARGUMENT;
    uint64_t count;
    inferd_shape_elements(t->shape, t->rank, &count);
    if (elem >= count)
        return INFERD_INVALID_ARGUMENT;
    const unsigned char *p = t->data;
    uint64_t at = call->reply.string_offsets[index][elem];
    *len = (size_t)p[at - 4] | (size_t)p[at - 3] << 8 | (size_t)p[at - 2] << 16 |
           (size_t)p[at - 1] << 24;
    *data = (const char *)p + at;
    return INFERD_OK;
}

/* ------------------------------------------------------------------ waited calls */

inferd_code ifd_run(inferd_call *call)
{
    inferd_client *c = call->client;
    int64_t timeout_ms = call->timeout_ms > 0 ? call->timeout_ms : c->timeout_ms;
    int64_t give_up = ifd_now_ns() + timeout_ms * 1000000;
    for (int attempt = 0;; attempt++) {
        inferd_code rc = inferd_submit(call);
        if (rc == INFERD_OK)
            rc = inferd_wait(call, -1);
        if (rc != INFERD_RESOURCE_EXHAUSTED || !c->retry_exhausted || call->op != INFERD_OP_INFER)
            return rc;
        int64_t pause = ifd_backoff_ms(c, attempt) * 1000000;
        int64_t now = ifd_now_ns();
        if (now + pause >= give_up)
            return rc;
        /* the pause keeps other calls of the client moving */
        while (ifd_now_ns() < now + pause)
            ifd_pump(c, now + pause);
        ifd_call_rearm(call);
        int64_t left = (give_up - ifd_now_ns()) / 1000000;
        call->timeout_ms = left < 1 ? 1 : left;
    }
}

inferd_code inferd_infer(inferd_client *c, const char *model, const inferd_tensor *inputs,
                         size_t n_inputs, inferd_call **out)
{
    if (out == NULL)
        return INFERD_INVALID_ARGUMENT;
    *out = NULL;
    if (c == NULL || model == NULL || (n_inputs > 0 && inputs == NULL))
        return INFERD_INVALID_ARGUMENT;
    inferd_call *call = inferd_call_new(c, INFERD_OP_INFER, model);
    if (call == NULL)
        return ifd_fail(c, INFERD_NO_MEMORY, "out of memory for a call");
    inferd_code rc = ifd_add_inputs(call, inputs, n_inputs);
    if (rc != INFERD_OK)
        return rc;
    *out = call;
    return ifd_run(call);
}

inferd_code ifd_add_inputs(inferd_call *call, const inferd_tensor *inputs, size_t n)
{
    for (size_t i = 0; i < n; i++) {
        inferd_code rc = inferd_call_add_input(call, &inputs[i]);
        if (rc != INFERD_OK) {
            inferd_call_free(call);  /* releases the inputs taken so far */
            for (size_t k = i; k < n; k++)  /* and those it did not take */
                if (inputs[k].release)
                    inputs[k].release((void *)inputs[k].data, inputs[k].hint);
            return rc;
        }
    }
    return INFERD_OK;
}

inferd_code inferd_control(inferd_client *c, inferd_op op, const char *model, inferd_call **out)
{
    if (out == NULL)
        return INFERD_INVALID_ARGUMENT;
    *out = NULL;
    if (c == NULL || op == INFERD_OP_INFER)
        return INFERD_INVALID_ARGUMENT;
    inferd_call *call = inferd_call_new(c, op, model);
    if (call == NULL)
        return ifd_fail(c, INFERD_INVALID_ARGUMENT, "no such op %d, or out of memory", (int)op);
    *out = call;
    return ifd_run(call);
}

/* Runs a control call and parses its result; on failure the call's message becomes
 * the client's error. */
static inferd_code run_parsed(inferd_client *c, inferd_call *call, json_t **result)
{
    *result = NULL;
    if (call == NULL)
        return ifd_fail(c, INFERD_NO_MEMORY, "out of memory for a call");
    inferd_code rc = ifd_run(call);
    if (rc != INFERD_OK) {
        ifd_fail(c, rc, "%s", inferd_call_message(call));
        inferd_call_free(call);
        return rc;
    }
    json_error_t err;
    const char *text = inferd_call_result(call);
    *result = text ? json_loads(text, JSON_DECODE_ANY, &err) : NULL;
    inferd_call_free(call);
    if (!json_is_object(*result)) {
        json_decref(*result);
        *result = NULL;
        return ifd_fail(c, INFERD_PROTOCOL_ERROR, "the reply's result is not a JSON object");
    }
    return INFERD_OK;
}

inferd_code inferd_ping(inferd_client *c, int *ready)
{
    if (c == NULL)
        return INFERD_INVALID_ARGUMENT;
    json_t *result;
    inferd_code rc = run_parsed(c, inferd_call_new(c, INFERD_OP_PING, NULL), &result);
    if (rc != INFERD_OK)
        return rc;
    if (ready)
        *ready = json_is_true(json_object_get(result, "ready"));
    json_decref(result);
    return INFERD_OK;
}

/* ------------------------------------------------------------------ models */

struct inferd_models {
    json_t *root;
    size_t n;
    inferd_model_info *rows;
    inferd_tensor_info *tensors;  /* every row's inputs and outputs, one block */
    inferd_dim *dims;             /* every tensor's dims, one block */
};

static const char *string_or_null(const json_t *o, const char *key)
{
    return json_string_value(json_object_get(o, key));  /* NULL unless a string */
}

static size_t count_tensors(const json_t *row, size_t *n_dims)
{
    size_t n = 0;
    const char *keys[] = {"inputs", "outputs"};
    for (int k = 0; k < 2; k++) {
        const json_t *list = json_object_get(row, keys[k]);
        for (size_t i = 0; i < json_array_size(list); i++) {
            n++;
            *n_dims += json_array_size(json_object_get(json_array_get(list, i), "shape"));
        }
    }
    return n;
}

static void fill_tensors(const json_t *list, inferd_tensor_info *t, inferd_dim **dims)
{
    for (size_t i = 0; i < json_array_size(list); i++) {
        const json_t *spec = json_array_get(list, i);
        const json_t *shape = json_object_get(spec, "shape");
        const char *dtype = string_or_null(spec, "dtype");
        t[i].name = string_or_null(spec, "name");
        t[i].dtype_name = dtype;
        t[i].dtype = dtype ? inferd_dtype_from_name(dtype, strlen(dtype)) : INFERD_DTYPE_INVALID;
        t[i].rank = json_array_size(shape);
        t[i].dims = *dims;
        for (size_t d = 0; d < t[i].rank; d++) {
            const json_t *dim = json_array_get(shape, d);
            (*dims)[d].value = json_is_integer(dim) ? (int64_t)json_integer_value(dim) : -1;
            (*dims)[d].symbol = json_string_value(dim);
        }
        *dims += t[i].rank;
    }
}

inferd_code inferd_models_get(inferd_client *c, int verbose, inferd_models **out)
{
    if (c == NULL || out == NULL)
        return INFERD_INVALID_ARGUMENT;
    *out = NULL;
    inferd_call *call = inferd_call_new(c, INFERD_OP_MODELS, NULL);
    if (call && verbose)
        inferd_call_set_param(call, "verbose", "true");
    json_t *result;
    inferd_code rc = run_parsed(c, call, &result);
    if (rc != INFERD_OK)
        return rc;
    const json_t *list = json_object_get(result, "models");
    if (!json_is_array(list)) {
        json_decref(result);
        return ifd_fail(c, INFERD_PROTOCOL_ERROR, "the models result has no list 'models'");
    }
    inferd_models *m = calloc(1, sizeof *m);
    size_t n = json_array_size(list), n_tensors = 0, n_dims = 0;
    for (size_t i = 0; i < n; i++)
        n_tensors += count_tensors(json_array_get(list, i), &n_dims);
    if (m) {
        m->root = result;
        m->n = n;
        m->rows = calloc(n ? n : 1, sizeof *m->rows);
        m->tensors = calloc(n_tensors ? n_tensors : 1, sizeof *m->tensors);
        m->dims = calloc(n_dims ? n_dims : 1, sizeof *m->dims);
    }
    if (!m || !m->rows || !m->tensors || !m->dims) {
        if (m)
            inferd_models_free(m);
        else
            json_decref(result);
        return ifd_fail(c, INFERD_NO_MEMORY, "out of memory for %zu models", n);
    }
    inferd_tensor_info *t = m->tensors;
    inferd_dim *dims = m->dims;
    for (size_t i = 0; i < n; i++) {
        const json_t *row = json_array_get(list, i);
        inferd_model_info *info = &m->rows[i];
        const json_t *version = json_object_get(row, "version");
        info->name = string_or_null(row, "name");
        info->state = string_or_null(row, "state");
        info->kind = string_or_null(row, "kind");
        info->backend = string_or_null(row, "backend");
        info->error = string_or_null(row, "error");
        info->version = json_is_integer(version) ? (int64_t)json_integer_value(version) : -1;
        const json_t *inputs = json_object_get(row, "inputs");
        const json_t *outputs = json_object_get(row, "outputs");
        info->n_inputs = json_array_size(inputs);
        info->inputs = t;
        fill_tensors(inputs, t, &dims);
        t += info->n_inputs;
        info->n_outputs = json_array_size(outputs);
        info->outputs = t;
        fill_tensors(outputs, t, &dims);
        t += info->n_outputs;
    }
    *out = m;
    return INFERD_OK;
}

size_t inferd_models_count(const inferd_models *m)
{
    return m ? m->n : 0;
}

const inferd_model_info *inferd_models_at(const inferd_models *m, size_t index)
{
    return m && index < m->n ? &m->rows[index] : NULL;
}

const inferd_model_info *inferd_models_find(const inferd_models *m, const char *name)
{
    const inferd_model_info *first = NULL;
    if (name == NULL)
        return NULL;
    for (size_t i = 0; i < inferd_models_count(m); i++) {
        if (m->rows[i].name == NULL || strcmp(m->rows[i].name, name) != 0)
            continue;
        if (json_is_true(json_object_get(json_array_get(json_object_get(m->root, "models"), i),
                                         "default")))
            return &m->rows[i];
        if (first == NULL)
            first = &m->rows[i];
    }
    return first;
}

void inferd_models_free(inferd_models *m)
{
    if (m == NULL)
        return;
    free(m->rows);
    free(m->tensors);
    free(m->dims);
    json_decref(m->root);
    free(m);
}

/* ------------------------------------------------------------------ status */

struct ifd_status {
    inferd_status pub;  /* first: the public pointer is this struct's */
    json_t *root;
    char *json;
    const char **loaded;
};

inferd_code inferd_status_get(inferd_client *c, inferd_status **out)
{
    if (c == NULL || out == NULL)
        return INFERD_INVALID_ARGUMENT;
    *out = NULL;
    json_t *result;
    inferd_code rc = run_parsed(c, inferd_call_new(c, INFERD_OP_STATUS, NULL), &result);
    if (rc != INFERD_OK)
        return rc;
    struct ifd_status *s = calloc(1, sizeof *s);
    const json_t *loaded = json_object_get(result, "loaded_models");
    size_t n = json_array_size(loaded);
    if (s) {
        s->root = result;
        s->json = json_dumps(result, JSON_COMPACT);
        s->loaded = calloc(n + 1, sizeof *s->loaded);
    }
    if (!s || !s->json || !s->loaded) {
        if (s)
            inferd_status_free(&s->pub);
        else
            json_decref(result);
        return ifd_fail(c, INFERD_NO_MEMORY, "out of memory for the status");
    }
    for (size_t i = 0; i < n; i++)
        s->loaded[i] = json_string_value(json_array_get(loaded, i));
    const json_t *pid = json_object_get(result, "pid");
    s->pub.version = string_or_null(result, "version");
    s->pub.pid = json_is_integer(pid) ? (int64_t)json_integer_value(pid) : -1;
    s->pub.uptime_s = json_number_value(json_object_get(result, "uptime_s"));
    s->pub.ready = json_is_true(json_object_get(result, "ready"));
    s->pub.endpoint = string_or_null(result, "endpoint");
    s->pub.repository = string_or_null(result, "repository");
    s->pub.n_loaded = n;
    s->pub.loaded_models = s->loaded;
    s->pub.json = s->json;
    *out = &s->pub;
    return INFERD_OK;
}

void inferd_status_free(inferd_status *status)
{
    if (status == NULL)
        return;
    struct ifd_status *s = (struct ifd_status *)status;
    free(s->loaded);
    free(s->json);
    json_decref(s->root);
    free(s);
}
