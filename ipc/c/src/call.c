/* Building a call: its op, model, inputs (recorded, sent in place later), wanted
 * outputs, version, deadline and other header keys; and freeing it. */
#include <stdlib.h>
#include <string.h>

#include "internal.h"

inferd_call *inferd_call_new(inferd_client *c, inferd_op op, const char *model)
{
    if (c == NULL || op < INFERD_OP_INFER || op > INFERD_OP_METRICS)
        return NULL;
    inferd_call *call = calloc(1, sizeof *call);
    if (call == NULL)
        return NULL;
    call->client = c;
    call->op = op;
    call->code = INFERD_AGAIN;
    call->input_specs = json_array();
    call->params = json_object();
    call->hold = calloc(1, sizeof *call->hold);
    if (model)
        call->model = json_string(model);
    if (!call->input_specs || !call->params || !call->hold || (model && !call->model)) {
        free(call->hold);
        call->hold = NULL;
        inferd_call_free(call);
        return NULL;
    }
    atomic_init(&call->hold->refs, 1);
    pthread_mutex_init(&call->hold->mu, NULL);
    pthread_cond_init(&call->hold->cv, NULL);
    call->next_call = c->calls;
    if (c->calls)
        c->calls->prev_call = call;
    c->calls = call;
    return call;
}

void ifd_call_rearm(inferd_call *call)
{
    ifd_settle_call(call);
    if (call->client)
        ifd_done_remove(call->client, call);
    if (call->aligned) {
        for (size_t i = 0; i < call->reply.n_outputs; i++)
            free(call->aligned[i]);
        free(call->aligned);
        call->aligned = NULL;
    }
    ifd_reply_clear(&call->reply);
    if (call->frames)
        ifd_close_frames(call->frames, call->n_frames);
    call->frames = NULL;
    call->n_frames = 0;
    ifd_text_free(&call->message);
    call->state = IFD_BUILDING;
    call->code = INFERD_AGAIN;
    call->collected = 0;
}

void inferd_call_free(inferd_call *call)
{
    if (call == NULL)
        return;
    inferd_client *c = call->client;
    if (c && call->state == IFD_IN_FLIGHT)
        ifd_complete(call, INFERD_CANCELLED, "the call was freed while in flight");
    if (call->state == IFD_DONE)
        ifd_settle_call(call);
    if (c) {
        ifd_done_remove(c, call);
        if (call->prev_call)
            call->prev_call->next_call = call->next_call;
        else if (c->calls == call)
            c->calls = call->next_call;
        if (call->next_call)
            call->next_call->prev_call = call->prev_call;
    }
    if (call->aligned) {
        for (size_t i = 0; i < call->reply.n_outputs; i++)
            free(call->aligned[i]);
        free(call->aligned);
    }
    ifd_reply_clear(&call->reply);
    if (call->frames)
        ifd_close_frames(call->frames, call->n_frames);
    if (call->hold)
        ifd_hold_unref(call->hold);  /* runs the release functions once libzmq is done too */
    json_decref(call->model);
    json_decref(call->input_specs);
    json_decref(call->outputs_wanted);
    json_decref(call->params);
    free(call->inputs);
    ifd_text_free(&call->message);
    free(call);
}

inferd_code inferd_call_add_input(inferd_call *call, const inferd_tensor *t)
{
    if (call == NULL || t == NULL)
        return INFERD_INVALID_ARGUMENT;
    inferd_client *c = call->client;
    if (call->state != IFD_BUILDING || call->op != INFERD_OP_INFER)
        return ifd_fail(c, INFERD_INVALID_ARGUMENT, "inputs go to an infer call before it is "
                        "submitted");
    if (t->name == NULL || *t->name == '\0')
        return ifd_fail(c, INFERD_INVALID_ARGUMENT, "an input needs a name");
    const char *dtype = inferd_dtype_name(t->dtype);
    if (dtype == NULL || t->dtype == INFERD_DTYPE_INVALID)
        return ifd_fail(c, INFERD_INVALID_ARGUMENT, "input '%s' has no valid dtype (%d)",
                        t->name, (int)t->dtype);
    if (t->rank > IFD_MAX_RANK)
        return ifd_fail(c, INFERD_INVALID_ARGUMENT, "input '%s' has rank %zu; at most %d",
                        t->name, t->rank, IFD_MAX_RANK);
    uint64_t count;
    if (inferd_shape_elements(t->shape, t->rank, &count) != INFERD_OK)
        return ifd_fail(c, INFERD_INVALID_ARGUMENT, "input '%s' has a negative dimension or "
                        "more than 2^48 elements", t->name);
    uint64_t expected;
    if (t->dtype != INFERD_STRING && (inferd_frame_size(t->dtype, count, &expected),
                                      t->size != expected))
        return ifd_fail(c, INFERD_INVALID_ARGUMENT, "input '%s' is %s with %llu elements, "
                        "which is %llu bytes%s, but its data has %zu", t->name, dtype,
                        (unsigned long long)count, (unsigned long long)expected,
                        ifd_packing(t->dtype), t->size);
    if (t->size > 0 && t->data == NULL)
        return ifd_fail(c, INFERD_INVALID_ARGUMENT, "input '%s' has no data", t->name);
    if (!ifd_utf8_valid((const unsigned char *)t->name, strlen(t->name)))
        return ifd_fail(c, INFERD_INVALID_ARGUMENT, "input name is not UTF-8");
    for (size_t i = 0; i < json_array_size(call->input_specs); i++) {
        const char *other = json_string_value(
            json_object_get(json_array_get(call->input_specs, i), "name"));
        if (other && strcmp(other, t->name) == 0)
            return ifd_fail(c, INFERD_INVALID_ARGUMENT, "input '%s' is given twice", t->name);
    }
    json_t *shape = json_array();
    json_t *spec = json_object();
    int bad = shape == NULL || spec == NULL;
    for (size_t i = 0; !bad && i < t->rank; i++)
        bad |= json_array_append_new(shape, json_integer(t->shape[i]));
    if (!bad) {
        bad |= json_object_set_new(spec, "name", json_string(t->name));
        bad |= json_object_set_new(spec, "dtype", json_string(dtype));
        bad |= json_object_set(spec, "shape", shape);
    }
    struct ifd_release *items = NULL;
    if (!bad && call->n_inputs == call->cap_inputs) {
        size_t cap = call->cap_inputs ? 2 * call->cap_inputs : 4;
        ifd_input *more = realloc(call->inputs, cap * sizeof *more);
        items = more ? realloc(call->hold->items, cap * sizeof *items) : NULL;
        if (more)
            call->inputs = more;
        if (items)
            call->hold->items = items;
        if (more && items)
            call->cap_inputs = cap;
        bad = !more || !items;
    }
    if (!bad)
        bad = json_array_append(call->input_specs, spec) != 0;
    json_decref(shape);
    json_decref(spec);
    if (bad)
        return ifd_fail(c, INFERD_NO_MEMORY, "out of memory for input '%s'", t->name);
    ifd_input in = {t->data, t->size, t->release == NULL, NULL, 0, 0};
    if (t->dtype != INFERD_STRING)  /* bytes in a region of the client: by reference */
        in.region = ifd_region_of(c, t->data, t->size, &in.offset);
    call->inputs[call->n_inputs++] = in;
    call->hold->items[call->hold->n++] = (struct ifd_release){(void *)t->data, t->release,
                                                              t->hint};
    call->borrowed |= t->release == NULL;
    return INFERD_OK;
}

inferd_code inferd_call_add_output(inferd_call *call, const char *name)
{
    if (call == NULL || name == NULL || call->state != IFD_BUILDING)
        return INFERD_INVALID_ARGUMENT;
    if (call->outputs_wanted == NULL && (call->outputs_wanted = json_array()) == NULL)
        return ifd_fail(call->client, INFERD_NO_MEMORY, "out of memory");
    json_t *s = json_string(name);
    if (s == NULL)
        return ifd_fail(call->client, INFERD_INVALID_ARGUMENT, "output name is not UTF-8");
    if (json_array_append_new(call->outputs_wanted, s) != 0)
        return ifd_fail(call->client, INFERD_NO_MEMORY, "out of memory");
    return INFERD_OK;
}

inferd_code inferd_call_set_version(inferd_call *call, int64_t version)
{
    if (call == NULL || call->state != IFD_BUILDING || version < 1)
        return INFERD_INVALID_ARGUMENT;
    call->version = version;
    return INFERD_OK;
}

inferd_code inferd_call_set_timeout(inferd_call *call, int64_t timeout_ms)
{
    if (call == NULL || call->state != IFD_BUILDING || timeout_ms < 1 ||
        timeout_ms > (INT64_C(1) << 53))
        return INFERD_INVALID_ARGUMENT;
    call->timeout_ms = timeout_ms;
    return INFERD_OK;
}

inferd_code inferd_call_set_param(inferd_call *call, const char *key, const char *json_value)
{
    static const char *const RESERVED[] = {"id", "op", "model", "version", "inputs",
                                           "outputs", "timeout_ms", "stream"};
    if (call == NULL || key == NULL || json_value == NULL || call->state != IFD_BUILDING)
        return INFERD_INVALID_ARGUMENT;
    for (size_t i = 0; i < sizeof RESERVED / sizeof RESERVED[0]; i++)
        if (strcmp(key, RESERVED[i]) == 0)
            return ifd_fail(call->client, INFERD_INVALID_ARGUMENT, "'%s' has its own setter",
                            key);
    json_error_t err;
    json_t *value = json_loads(json_value, JSON_DECODE_ANY, &err);
    if (value == NULL)
        return ifd_fail(call->client, INFERD_INVALID_ARGUMENT, "param '%s' is not JSON: %s",
                        key, err.text);
    if (json_object_set_new(call->params, key, value) != 0)
        return ifd_fail(call->client, INFERD_INVALID_ARGUMENT, "param key '%s' is not UTF-8",
                        key);
    return INFERD_OK;
}

int ifd_stream_id_valid(const char *id)
{
    size_t n = id ? strlen(id) : 0;
    if (n == 0 || n > INFERD_STREAM_ID_MAX)
        return 0;
    for (size_t i = 0; i < n; i++) {
        char ch = id[i];
        if (!((ch >= 'A' && ch <= 'Z') || (ch >= 'a' && ch <= 'z') || (ch >= '0' && ch <= '9') ||
              ch == '.' || ch == '_' || ch == '-'))
            return 0;
    }
    return 1;
}

inferd_code inferd_call_set_stream(inferd_call *call, const char *id, int start, int end)
{
    if (call == NULL || id == NULL || call->state != IFD_BUILDING)
        return INFERD_INVALID_ARGUMENT;
    if (call->op != INFERD_OP_INFER)
        return ifd_fail(call->client, INFERD_INVALID_ARGUMENT, "only an infer call belongs to "
                        "a stream");
    if (!ifd_stream_id_valid(id))
        return ifd_fail(call->client, INFERD_INVALID_ARGUMENT, "a stream id is 1 to %d "
                        "characters of [A-Za-z0-9._-], not '%.80s'", INFERD_STREAM_ID_MAX, id);
    /* false flags left out, as the Python client does */
    json_t *stream = json_pack("{ss}", "id", id);
    int bad = stream == NULL;
    if (!bad && start)
        bad = json_object_set_new(stream, "start", json_true()) != 0;
    if (!bad && end)
        bad = json_object_set_new(stream, "end", json_true()) != 0;
    if (bad || json_object_set_new(call->params, "stream", stream) != 0) {
        json_decref(bad ? stream : NULL);
        return ifd_fail(call->client, INFERD_NO_MEMORY, "out of memory");
    }
    return INFERD_OK;
}
