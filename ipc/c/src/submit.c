/* Sending a call: its header (keys in the Python client's order), its frames (inputs in
 * place, zmq_msg_init_data), and the wait for a slot when max_in_flight calls are in
 * flight. */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "internal.h"

/* The request header, keys in the Python client's order (id first: the daemon reads
 * the id of a header it cannot parse only when it is the first key). */
static char *encode_header(inferd_call *call, int64_t timeout_ms)
{
    json_t *h = json_object();
    if (h == NULL)
        return NULL;
    static const char *const OPS[] = {
        [INFERD_OP_INFER] = "infer",       [INFERD_OP_MODELS] = "models",
        [INFERD_OP_STATUS] = "status",     [INFERD_OP_LOAD] = "load",
        [INFERD_OP_UNLOAD] = "unload",     [INFERD_OP_PING] = "ping",
        [INFERD_OP_BACKENDS] = "backends", [INFERD_OP_RELOAD] = "reload",
        [INFERD_OP_METRICS] = "metrics",
    };
    int bad = json_object_set_new(h, "id", json_string(call->id));
    bad |= json_object_set_new(h, "op", json_string(OPS[call->op]));
    if (call->model)
        bad |= json_object_set(h, "model", call->model);
    if (call->version > 0)
        bad |= json_object_set_new(h, "version", json_integer(call->version));
    for (size_t i = 0; i < call->n_inputs; i++) {  /* by reference: region and offset */
        ifd_input *in = &call->inputs[i];
        json_t *spec = json_array_get(call->input_specs, i);
        if (in->region != NULL) {
            bad |= json_object_set_new(spec, "region", json_string(in->region->token));
            bad |= json_object_set_new(spec, "offset", json_integer((json_int_t)in->offset));
        }
    }
    if (json_array_size(call->input_specs) > 0)
        bad |= json_object_set(h, "inputs", call->input_specs);
    if (call->outputs_wanted)
        bad |= json_object_set(h, "outputs", call->outputs_wanted);
    bad |= json_object_set_new(h, "timeout_ms", json_integer(timeout_ms));
    if (call->into != NULL)
        bad |= json_object_set_new(h, "outputs_into", json_pack(
            "{ss sI sI}", "region", call->into->token, "offset", (json_int_t)call->into_offset,
            "size", (json_int_t)call->into_size));
    const char *key;
    json_t *value;
    json_object_foreach(call->params, key, value)
        bad |= json_object_set(h, key, value);
    char *text = bad ? NULL : json_dumps(h, JSON_COMPACT);
    json_decref(h);
    return text;
}

static void free_header(void *data, void *hint)
{
    (void)hint;
    free(data);
}

/* Sends the call's frames; on failure the call is completed with the reason. */
static inferd_code send_frames(inferd_call *call, int64_t timeout_ms)
{
    inferd_client *c = call->client;
    char *header = encode_header(call, timeout_ms);
    if (header == NULL) {
        ifd_complete(call, INFERD_NO_MEMORY, "out of memory for the request header");
        return call->code;
    }
    /* a DEALER blocks at its high-water mark: never past the call's deadline */
    int64_t left = (call->give_up_ns - ifd_now_ns()) / 1000000;
    int sndtimeo = left < 1 ? 1 : left > 2000000000 ? 2000000000 : (int)left;
    zmq_setsockopt(c->sock, ZMQ_SNDTIMEO, &sndtimeo, sizeof sndtimeo);
    if (zmq_send_const(c->sock, INFERD_PROTOCOL_TAG, strlen(INFERD_PROTOCOL_TAG), ZMQ_SNDMORE) < 0) {
        free(header);
        int e = zmq_errno();
        ifd_complete(call, e == EAGAIN ? INFERD_DEADLINE_EXCEEDED : INFERD_SYSTEM_ERROR,
                     "cannot send to %s: %s", c->endpoint,
                     e == EAGAIN ? "libzmq's queue stayed full until the deadline"
                                 : zmq_strerror(e));
        return call->code;
    }
    /* from here the message is committed: libzmq takes its other frames whole */
    zmq_msg_t msg;
    size_t hlen = strlen(header), framed = 0, sent = 0;
    for (size_t i = 0; i < call->n_inputs; i++)
        framed += call->inputs[i].region == NULL;
    zmq_msg_init_data(&msg, header, hlen, free_header, NULL);
    int more = framed > 0 ? ZMQ_SNDMORE : 0;
    int failed = zmq_msg_send(&msg, c->sock, more) < 0;
    if (failed)
        zmq_msg_close(&msg);
    for (size_t i = 0; i < call->n_inputs; i++) {
        ifd_input *in = &call->inputs[i];
        if (in->region != NULL)
            continue;  /* its bytes are in shared memory: no frame */
        more = ++sent < framed ? ZMQ_SNDMORE : 0;
        if (failed)
            break;
        if (in->size == 0) {
            zmq_msg_init(&msg);
        } else {
            atomic_fetch_add(&call->hold->refs, 1);
            pthread_mutex_lock(&call->hold->mu);
            call->hold->in_zmq++;
            pthread_mutex_unlock(&call->hold->mu);
            zmq_msg_init_data(&msg, (void *)in->data, in->size, ifd_zmq_released, call->hold);
        }
        if (zmq_msg_send(&msg, c->sock, more) < 0) {
            failed = 1;
            zmq_msg_close(&msg);  /* runs zmq_released for a data frame */
        }
    }
    if (failed) {
        char why[256];
        snprintf(why, sizeof why, "a request to %s could not be sent whole (%s): the "
                 "connection was reset", c->endpoint, zmq_strerror(zmq_errno()));
        ifd_reset(c, INFERD_SYSTEM_ERROR, why);
        if (call->state != IFD_DONE)
            ifd_complete(call, INFERD_SYSTEM_ERROR, "%s", why);
        return call->code;
    }
    return INFERD_OK;
}

inferd_code inferd_submit(inferd_call *call)
{
    if (call == NULL)
        return INFERD_INVALID_ARGUMENT;
    inferd_client *c = call->client;
    if (c == NULL)
        return INFERD_CANCELLED;
    if (call->state != IFD_BUILDING) {
        ifd_fail(c, INFERD_INVALID_ARGUMENT, "the call %s was submitted already", call->id);
        return INFERD_INVALID_ARGUMENT;
    }
    if (c->n_flight == c->cap_flight) {
        size_t cap = c->cap_flight ? 2 * c->cap_flight : 16;
        inferd_call **more = realloc(c->flight, cap * sizeof *more);
        if (more == NULL)
            return ifd_fail(c, INFERD_NO_MEMORY, "out of memory for the calls in flight");
        c->flight = more;
        c->cap_flight = cap;
    }
    if (c->mon)
        ifd_read_monitor(c);  /* a connection lost since the last look: reset before sending */
    int64_t timeout_ms = call->timeout_ms > 0 ? call->timeout_ms : c->timeout_ms;
    call->seq = ++c->next_seq;
    snprintf(call->id, sizeof call->id, "%s-%llu", c->prefix, (unsigned long long)call->seq);
    call->give_up_ns = ifd_now_ns() + (timeout_ms + IFD_REPLY_GRACE_MS) * 1000000;
    call->code = INFERD_AGAIN;
    call->collected = 0;
    /* flow control: wait for a slot, receiving replies, as the Python client does */
    while (c->n_flight >= (size_t)c->max_in_flight) {
        if (ifd_now_ns() >= call->give_up_ns) {
            call->state = IFD_IN_FLIGHT;
            c->flight[c->n_flight++] = call;
            ifd_complete(call, INFERD_DEADLINE_EXCEEDED, "no reply from %s within the client "
                         "timeout: %zu calls in flight (INFERD_OPT_MAX_IN_FLIGHT) left no room "
                         "to send", c->endpoint, c->n_flight - 1);
            return call->code;
        }
        ifd_pump(c, call->give_up_ns);
    }
    call->state = IFD_IN_FLIGHT;
    c->flight[c->n_flight++] = call;
    /* inputs too big to frame, into shared memory of the library's own */
    if (call->op == INFERD_OP_INFER && c->max_inline > 0) {
        char *header = encode_header(call, timeout_ms);
        if (header == NULL) {
            ifd_complete(call, INFERD_NO_MEMORY, "out of memory for the request header");
            return call->code;
        }
        inferd_code rc = ifd_stage(call, strlen(INFERD_PROTOCOL_TAG) + strlen(header));
        free(header);
        if (call->state != IFD_IN_FLIGHT)  /* its deadline passed while it waited */
            return call->code;
        if (rc != INFERD_OK) {
            ifd_complete(call, rc, "cannot move the call's inputs into shared memory: %s",
                         ifd_text_get(&c->error));
            return call->code;
        }
    }
    /* the regions it names, registered (again, after a daemon restart) */
    for (size_t i = 0; i <= call->n_inputs; i++) {
        inferd_region *r = i < call->n_inputs ? call->inputs[i].region : call->into;
        inferd_code rc = r != NULL ? ifd_region_ready(r) : INFERD_OK;
        if (rc != INFERD_OK) {
            ifd_complete(call, rc, "shared memory: %s", ifd_text_get(&c->error));
            return call->code;
        }
    }
    if (c->sock == NULL) {
        ifd_complete(call, INFERD_UNAVAILABLE, "%s", ifd_text_get(&c->error));
        return call->code;
    }
    return send_frames(call, timeout_ms);
}

