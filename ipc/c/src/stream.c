/* Streams (docs/streams.md): a handle naming a stream of a model on a client, with the
 * constant inputs it sends when the stream starts; its calls are infer calls whose header
 * carries "stream" {id, start, end}, built here on the waited infer of ops.c. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "internal.h"

static void free_constants(inferd_tensor *t, size_t n)
{
    for (size_t i = 0; t && i < n; i++) {
        free((void *)t[i].name);
        free((void *)t[i].shape);
        free((void *)t[i].data);
    }
    free(t);
}

static void stream_free(inferd_stream *s)
{
    inferd_client *c = s->client;
    if (c) {
        if (s->prev)
            s->prev->next = s->next;
        else if (c->streams == s)
            c->streams = s->next;
        if (s->next)
            s->next->prev = s->prev;
    }
    free_constants(s->constants, s->n_constants);
    free(s->model);
    free(s);
}

/* Copies T (name, shape, data) into *OUT; 0 when out of memory. */
static int copy_tensor(const inferd_tensor *t, inferd_tensor *out)
{
    *out = (inferd_tensor){0};
    out->dtype = t->dtype;
    out->rank = t->rank;
    out->size = t->size;
    char *name = strdup(t->name);
    int64_t *shape = malloc((t->rank ? t->rank : 1) * sizeof *shape);
    void *data = malloc(t->size ? t->size : 1);
    out->name = name;
    out->shape = shape;
    out->data = data;
    if (!name || !shape || !data)
        return 0;
    if (t->rank)
        memcpy(shape, t->shape, t->rank * sizeof *shape);
    if (t->size)
        memcpy(data, t->data, t->size);
    return 1;
}

inferd_code inferd_stream_open(inferd_client *c, const char *model, const char *id,
                               const inferd_tensor *constants, size_t n_constants,
                               inferd_stream **out)
{
    inferd_code rc = INFERD_OK;
    inferd_stream *s = NULL;
    if (out == NULL || c == NULL || model == NULL || *model == '\0' ||
        (n_constants > 0 && constants == NULL)) {
        rc = c ? ifd_fail(c, INFERD_INVALID_ARGUMENT, "a stream needs a client, a model and "
                          "somewhere to put it") : INFERD_INVALID_ARGUMENT;
        goto done;
    }
    if (id != NULL && !ifd_stream_id_valid(id)) {
        rc = ifd_fail(c, INFERD_INVALID_ARGUMENT, "a stream id is 1 to %d characters of "
                      "[A-Za-z0-9._-], not '%.80s'", INFERD_STREAM_ID_MAX, id);
        goto done;
    }
    for (size_t i = 0; i < n_constants; i++) {
        const inferd_tensor *t = &constants[i];
        uint64_t count, expected;
        if (t->name == NULL || *t->name == '\0' || t->dtype == INFERD_STRING ||
            inferd_dtype_name(t->dtype) == NULL || t->dtype == INFERD_DTYPE_INVALID ||
            inferd_shape_elements(t->shape, t->rank, &count) != INFERD_OK ||
            inferd_frame_size(t->dtype, count, &expected) != INFERD_OK ||
            t->size != expected || (t->size > 0 && t->data == NULL)) {
            rc = ifd_fail(c, INFERD_INVALID_ARGUMENT, "stream constant %zu ('%s') needs a "
                          "name, a numeric dtype and as many bytes as its dtype and shape "
                          "make", i, t->name ? t->name : "");
            goto done;
        }
    }
    s = calloc(1, sizeof *s);
    if (s == NULL || (s->model = strdup(model)) == NULL ||
        (n_constants && (s->constants = calloc(n_constants, sizeof *s->constants)) == NULL)) {
        rc = ifd_fail(c, INFERD_NO_MEMORY, "out of memory for a stream");
        goto done;
    }
    s->n_constants = n_constants;
    for (size_t i = 0; i < n_constants; i++)
        if (!copy_tensor(&constants[i], &s->constants[i])) {
            rc = ifd_fail(c, INFERD_NO_MEMORY, "out of memory for a stream's constants");
            goto done;
        }
    if (id != NULL)
        snprintf(s->id, sizeof s->id, "%s", id);
    else
        snprintf(s->id, sizeof s->id, "%s-s%llu", c->prefix,
                 (unsigned long long)++c->next_stream);
    s->client = c;
    s->next = c->streams;
    if (c->streams)
        c->streams->prev = s;
    c->streams = s;
done:
    /* the constants are copied (or refused): the library is done with them */
    for (size_t i = 0; constants && i < n_constants; i++)
        if (constants[i].release)
            constants[i].release((void *)constants[i].data, constants[i].hint);
    if (rc != INFERD_OK && s != NULL) {
        s->client = NULL;  /* not linked yet */
        stream_free(s);
        s = NULL;
    }
    if (out)
        *out = s;
    return rc;
}

const char *inferd_stream_id(const inferd_stream *s)
{
    return s ? s->id : "";
}

void inferd_stream_reset(inferd_stream *s)
{
    if (s)
        s->started = 0;
}

/* The stream's constants added to CALL as copies the call releases (the stream may be
 * closed before libzmq is done with a call's frames). */
static inferd_code add_constants(inferd_stream *s, inferd_call *call)
{
    for (size_t i = 0; i < s->n_constants; i++) {
        inferd_tensor t = s->constants[i];
        void *copy = malloc(t.size ? t.size : 1);
        if (copy == NULL)
            return ifd_fail(s->client, INFERD_NO_MEMORY, "out of memory for a constant");
        memcpy(copy, t.data, t.size);
        t.data = copy;
        t.release = inferd_free_release;
        t.hint = NULL;
        inferd_code rc = inferd_call_add_input(call, &t);
        if (rc != INFERD_OK) {
            free(copy);
            return rc;
        }
    }
    return INFERD_OK;
}

inferd_code inferd_stream_infer(inferd_stream *s, const inferd_tensor *inputs, size_t n_inputs,
                                inferd_call **out)
{
    if (out == NULL)
        return INFERD_INVALID_ARGUMENT;
    *out = NULL;
    inferd_code rc = INFERD_INVALID_ARGUMENT;
    if (s == NULL || s->client == NULL || (n_inputs > 0 && inputs == NULL)) {
        if (s && s->client == NULL)
            rc = INFERD_CANCELLED;  /* its client was freed */
        goto release;
    }
    inferd_client *c = s->client;
    int start = !s->started;
    inferd_call *call = inferd_call_new(c, INFERD_OP_INFER, s->model);
    if (call == NULL) {
        rc = ifd_fail(c, INFERD_NO_MEMORY, "out of memory for a call");
        goto release;
    }
    rc = inferd_call_set_stream(call, s->id, start, 0);
    if (rc == INFERD_OK && start)
        rc = add_constants(s, call);
    if (rc != INFERD_OK) {
        inferd_call_free(call);
        goto release;
    }
    rc = ifd_add_inputs(call, inputs, n_inputs);  /* frees the call on failure */
    if (rc != INFERD_OK)
        return rc;
    *out = call;
    rc = ifd_run(call);
    if (rc == INFERD_OK)
        s->started = 1;
    else if (rc == INFERD_FAILED_PRECONDITION)
        s->started = 0;  /* reported now; the next call starts it again */
    return rc;
release:  /* the inputs were not taken: released as inferd_infer does */
    for (size_t k = 0; inputs && k < n_inputs; k++)
        if (inputs[k].release)
            inputs[k].release((void *)inputs[k].data, inputs[k].hint);
    return rc;
}

inferd_code inferd_stream_close(inferd_stream *s)
{
    if (s == NULL)
        return INFERD_INVALID_ARGUMENT;
    inferd_client *c = s->client;
    inferd_code rc = INFERD_OK;
    if (c != NULL && s->started) {
        inferd_call *call = inferd_call_new(c, INFERD_OP_INFER, s->model);
        if (call == NULL) {
            rc = ifd_fail(c, INFERD_NO_MEMORY, "out of memory for a call");
        } else {
            rc = inferd_call_set_stream(call, s->id, 0, 1);
            if (rc == INFERD_OK)
                rc = ifd_run(call);
            if (rc == INFERD_FAILED_PRECONDITION)
                rc = INFERD_OK;  /* the daemon holds it no more: what closing asks */
            else if (rc != INFERD_OK && inferd_call_code(call) == rc)
                ifd_fail(c, rc, "closing stream %s of %s: %s", s->id, s->model,
                         inferd_call_message(call));
            inferd_call_free(call);
        }
    }
    stream_free(s);
    return rc;
}
