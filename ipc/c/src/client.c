/* The connection: one DEALER socket and a monitor of it, the calls in flight (matched
 * to replies by id), flow control, deadlines, and what happens to the inputs libzmq
 * still holds when a call ends. */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "internal.h"

int64_t ifd_now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

inferd_code ifd_fail(inferd_client *c, inferd_code code, const char *fmt, ...)
{
    if (c == NULL)  /* a call whose client was freed: the code alone */
        return code;
    va_list ap;
    va_start(ap, fmt);
    ifd_text_vset(&c->error, fmt, ap);
    va_end(ap);
    return code;
}

static uint64_t next_random(inferd_client *c)
{
    /* xorshift64*: jitter for the backoff, per client (no global state) */
    c->rng ^= c->rng >> 12;
    c->rng ^= c->rng << 25;
    c->rng ^= c->rng >> 27;
    return c->rng * UINT64_C(2685821657736338717);
}

int64_t ifd_backoff_ms(inferd_client *c, int attempt)
{
    int64_t ms = IFD_BACKOFF_FIRST_MS;
    for (int i = 0; i < attempt && ms < IFD_BACKOFF_MAX_MS; i++)
        ms *= 2;
    if (ms > IFD_BACKOFF_MAX_MS)
        ms = IFD_BACKOFF_MAX_MS;
    /* uniform in [ms/2, ms], as ipc/client.py's backoff() */
    return ms / 2 + (int64_t)(next_random(c) % (uint64_t)(ms / 2 + 1));
}

/* ------------------------------------------------------------------ holds */

void ifd_hold_unref(ifd_hold *h)
{
    if (atomic_fetch_sub(&h->refs, 1) != 1)
        return;
    for (size_t i = 0; i < h->n; i++)
        if (h->items[i].release)
            h->items[i].release(h->items[i].data, h->items[i].hint);
    pthread_mutex_destroy(&h->mu);
    pthread_cond_destroy(&h->cv);
    free(h->items);
    free(h);
}

/* libzmq's free callback for an input frame (any thread). */
void ifd_zmq_released(void *data, void *hint)
{
    (void)data;
    ifd_hold *h = hint;
    pthread_mutex_lock(&h->mu);
    if (--h->in_zmq == 0)
        pthread_cond_broadcast(&h->cv);
    pthread_mutex_unlock(&h->mu);
    ifd_hold_unref(h);
}

/* Waits until libzmq holds none of H's frames, up to DEADLINE_NS (< 0: no bound).
 * Returns whether it holds none. */
static int hold_settle(ifd_hold *h, int64_t deadline_ns)
{
    pthread_mutex_lock(&h->mu);
    while (h->in_zmq > 0) {
        if (deadline_ns < 0) {
            pthread_cond_wait(&h->cv, &h->mu);
            continue;
        }
        int64_t left = deadline_ns - ifd_now_ns();
        if (left <= 0)
            break;
        /* the condition variable waits on CLOCK_REALTIME: wait in slices of it */
        struct timespec ts;
        clock_gettime(CLOCK_REALTIME, &ts);
        int64_t ns = ts.tv_nsec + (left < 10000000 ? left : 10000000);
        ts.tv_sec += ns / 1000000000;
        ts.tv_nsec = ns % 1000000000;
        pthread_cond_timedwait(&h->cv, &h->mu, &ts);
    }
    int settled = h->in_zmq == 0;
    pthread_mutex_unlock(&h->mu);
    return settled;
}

/* ------------------------------------------------------------------ sockets */

static inferd_code open_socket(inferd_client *c)
{
    char addr[96];
    int zero = 0, events = ZMQ_EVENT_DISCONNECTED | ZMQ_EVENT_HANDSHAKE_SUCCEEDED;
    /* unique in a context the application may share with other clients */
    snprintf(addr, sizeof addr, "inproc://libinferd-monitor-%s-%p-%u", c->prefix, (void *)c,
             c->generation++);
    c->sock = zmq_socket(c->ctx, ZMQ_DEALER);
    if (c->sock == NULL)
        return ifd_fail(c, INFERD_SYSTEM_ERROR, "zmq_socket: %s", zmq_strerror(zmq_errno()));
    zmq_setsockopt(c->sock, ZMQ_LINGER, &zero, sizeof zero);
    if (zmq_socket_monitor(c->sock, addr, events) != 0)
        return ifd_fail(c, INFERD_SYSTEM_ERROR, "zmq_socket_monitor: %s",
                        zmq_strerror(zmq_errno()));
    c->mon = zmq_socket(c->ctx, ZMQ_PAIR);
    if (c->mon == NULL || zmq_setsockopt(c->mon, ZMQ_LINGER, &zero, sizeof zero) != 0 ||
        zmq_connect(c->mon, addr) != 0)
        return ifd_fail(c, INFERD_SYSTEM_ERROR, "monitor socket: %s",
                        zmq_strerror(zmq_errno()));
    if (zmq_connect(c->sock, c->endpoint) != 0)
        return ifd_fail(c, INFERD_INVALID_ARGUMENT, "cannot connect to %s: %s", c->endpoint,
                        zmq_strerror(zmq_errno()));
    return INFERD_OK;
}

static void close_socket(inferd_client *c)
{
    c->connected = 0;
    if (c->sock) {
        zmq_socket_monitor(c->sock, NULL, 0);
        zmq_close(c->sock);
    }
    if (c->mon)
        zmq_close(c->mon);
    c->sock = c->mon = NULL;
}

/* Fails every call in flight with CODE and WHY, drops what libzmq queued (closing the
 * socket releases every input frame it held) and connects again. */
void ifd_reset(inferd_client *c, inferd_code code, const char *why)
{
    close_socket(c);
    while (c->n_flight > 0)
        ifd_complete(c->flight[c->n_flight - 1], code, "%s", why);
    if (open_socket(c) != INFERD_OK)
        close_socket(c);  /* calls fail with the client's error until it can connect */
}

/* Whether the ipc:// path of ENDPOINT can be reached; the Python client's check. */
static inferd_code check_reachable(inferd_client *c)
{
    const char *prefix = "ipc://";
    if (strncmp(c->endpoint, prefix, strlen(prefix)) != 0)
        return INFERD_OK;
    const char *path = c->endpoint + strlen(prefix);
    struct stat st;
    if (stat(path, &st) != 0) {
        if (errno == EACCES)  /* /run/inferd is 0750: outsiders cannot look inside */
            return INFERD_OK;
        return ifd_fail(c, INFERD_UNAVAILABLE, "no inferd socket at %s: is the daemon running? "
                        "(set $INFERD_SOCKET for another endpoint)", path);
    }
    if (access(path, R_OK | W_OK) != 0)
        return ifd_fail(c, INFERD_UNAVAILABLE, "permission denied on %s: the user needs to be "
                        "in the socket's group (usually 'inferd')", path);
    return INFERD_OK;
}

inferd_code inferd_client_new(inferd_client **out, const char *endpoint, void *zmq_context)
{
    if (out == NULL)
        return INFERD_INVALID_ARGUMENT;
    inferd_client *c = calloc(1, sizeof *c);
    *out = c;
    if (c == NULL)
        return INFERD_NO_MEMORY;
    c->timeout_ms = IFD_DEFAULT_TIMEOUT_MS;
    c->max_in_flight = IFD_DEFAULT_MAX_IN_FLIGHT;
    c->max_inline = IFD_DEFAULT_MAX_INLINE;
    c->shm_fd = -1;
    if (endpoint == NULL || *endpoint == '\0')
        endpoint = getenv(INFERD_SOCKET_ENV);
    if (endpoint == NULL || *endpoint == '\0')
        endpoint = INFERD_DEFAULT_ENDPOINT;
    c->endpoint = strdup(endpoint);
    if (c->endpoint == NULL)
        return ifd_fail(c, INFERD_NO_MEMORY, "out of memory");
    unsigned char seed[16];
    if (getrandom(seed, sizeof seed, 0) != (ssize_t)sizeof seed) {
        uint64_t fallback = (uint64_t)ifd_now_ns() ^ (uint64_t)getpid() << 32 ^ (uintptr_t)c;
        memcpy(seed, &fallback, 8);
        memcpy(seed + 8, &fallback, 8);
    }
    memcpy(&c->rng, seed + 8, sizeof c->rng);
    c->rng |= 1;
    for (int i = 0; i < 8; i++)
        snprintf(c->prefix + 2 * i, 3, "%02x", seed[i]);
    c->prefix[8] = '\0';  /* 8 hex digits, as the Python client's uuid prefix */
    if (zmq_context) {
        c->ctx = zmq_context;
    } else {
        c->ctx = zmq_ctx_new();
        c->own_ctx = 1;
        if (c->ctx == NULL)
            return ifd_fail(c, INFERD_SYSTEM_ERROR, "zmq_ctx_new: %s", zmq_strerror(zmq_errno()));
    }
    inferd_code rc = check_reachable(c);
    if (rc != INFERD_OK)
        return rc;
    return open_socket(c);
}

void inferd_client_free(inferd_client *c)
{
    if (c == NULL)
        return;
    close_socket(c);  /* libzmq drops what it queued and releases every input frame */
    while (c->n_flight > 0)
        ifd_complete(c->flight[c->n_flight - 1], INFERD_CANCELLED, "the client was closed");
    for (inferd_call *call = c->calls; call; call = call->next_call) {
        ifd_settle_call(call);
        call->client = NULL;  /* the calls stay the caller's, completed */
        call->in_done_list = 0;
        call->next_done = NULL;
    }
    for (inferd_stream *s = c->streams; s; s = s->next)
        s->client = NULL;  /* the streams stay the caller's, to close */
    ifd_regions_free(c);
    if (c->own_ctx && c->ctx)
        zmq_ctx_term(c->ctx);
    free(c->flight);
    free(c->endpoint);
    ifd_text_free(&c->last_unreadable);
    ifd_text_free(&c->error);
    free(c);
}

const char *inferd_client_error(const inferd_client *c)
{
    return c ? ifd_text_get(&c->error) : "no client";
}

int inferd_client_connected(inferd_client *c)
{
    if (c == NULL || c->mon == NULL)
        return 0;
    ifd_read_monitor(c);
    return c->connected;
}

const char *inferd_client_endpoint(const inferd_client *c)
{
    return c ? c->endpoint : NULL;
}

inferd_code inferd_client_set(inferd_client *c, inferd_option option, int64_t value)
{
    if (c == NULL)
        return INFERD_INVALID_ARGUMENT;
    switch (option) {
    case INFERD_OPT_TIMEOUT_MS:
        if (value < 1 || value > (INT64_C(1) << 53))
            return ifd_fail(c, INFERD_INVALID_ARGUMENT, "timeout must be 1 ms to 2^53 ms, "
                            "got %lld", (long long)value);
        c->timeout_ms = value;
        return INFERD_OK;
    case INFERD_OPT_MAX_IN_FLIGHT:
        if (value < 1 || value > 1000000)
            return ifd_fail(c, INFERD_INVALID_ARGUMENT, "max_in_flight must be at least 1 "
                            "(and at most 1000000), got %lld", (long long)value);
        c->max_in_flight = value;
        return INFERD_OK;
    case INFERD_OPT_RETRY_EXHAUSTED:
        c->retry_exhausted = value != 0;
        return INFERD_OK;
    case INFERD_OPT_MAX_INLINE_BYTES:
        if (value < 0)
            return ifd_fail(c, INFERD_INVALID_ARGUMENT, "max_inline_bytes must be 0 (always "
                            "frames) or more, got %lld", (long long)value);
        c->max_inline = value;
        return INFERD_OK;
    }
    return ifd_fail(c, INFERD_INVALID_ARGUMENT, "unknown option %d", (int)option);
}

/* ------------------------------------------------------------------ completion */

static void flight_remove(inferd_client *c, inferd_call *call)
{
    for (size_t i = 0; i < c->n_flight; i++)
        if (c->flight[i] == call) {
            c->flight[i] = c->flight[--c->n_flight];
            return;
        }
}

void ifd_done_remove(inferd_client *c, inferd_call *call)
{
    if (!call->in_done_list)
        return;
    inferd_call **p = &c->done_head, *prev = NULL;
    while (*p && *p != call) {
        prev = *p;
        p = &(*p)->next_done;
    }
    if (*p) {
        *p = call->next_done;
        if (c->done_tail == call)
            c->done_tail = prev;
    }
    call->next_done = NULL;
    call->in_done_list = 0;
}

void ifd_complete(inferd_call *call, inferd_code code, const char *fmt, ...)
{
    inferd_client *c = call->client;
    flight_remove(c, call);
    ifd_unstage(call, 0);  /* not answered: the daemon may read its staging region yet */
    call->state = IFD_DONE;
    call->code = code;
    va_list ap;
    va_start(ap, fmt);
    ifd_text_vset(&call->message, fmt, ap);
    va_end(ap);
    if (!call->collected && !call->in_done_list) {
        call->in_done_list = 1;
        call->next_done = NULL;
        if (c->done_tail)
            c->done_tail->next_done = call;
        else
            c->done_head = call;
        c->done_tail = call;
    }
}

/* Before a completed call goes back to its caller: its borrowed inputs must be out of
 * libzmq's hands. After a reply they are (the daemon read them all; libzmq lets go of
 * the frame a moment later); after a timeout or a lost connection libzmq may still
 * queue them: then the connection is reset, which drops them. */
void ifd_settle_call(inferd_call *call)
{
    if (!call->borrowed || call->hold == NULL)
        return;
    inferd_client *c = call->client;
    int64_t grace = call->frames != NULL ? 1000000000 : 0;
    if (hold_settle(call->hold, c && c->sock ? ifd_now_ns() + grace : -1))
        return;
    ifd_reset(c, INFERD_UNAVAILABLE, "the connection was reset: a call ended while libzmq still "
              "held its inputs (the daemon did not read them)");
    hold_settle(call->hold, -1);
}

/* ------------------------------------------------------------------ replies */

static inferd_call *find_call(inferd_client *c, const char *id)
{
    size_t plen = strlen(c->prefix);
    if (id == NULL || strncmp(id, c->prefix, plen) != 0 || id[plen] != '-')
        return NULL;
    char *end;
    errno = 0;
    unsigned long long seq = strtoull(id + plen + 1, &end, 10);
    if (errno || *end != '\0')
        return NULL;
    for (size_t i = 0; i < c->n_flight; i++)
        if (c->flight[i]->seq == seq && strcmp(c->flight[i]->id, id) == 0)
            return c->flight[i];
    return NULL;
}

void ifd_close_frames(zmq_msg_t *frames, size_t n)
{
    for (size_t i = 0; i < n; i++)
        zmq_msg_close(&frames[i]);
    free(frames);
}

/* One reply's frames: to its call, or dropped (a late reply of an abandoned call). */
static void deliver(inferd_client *c, zmq_msg_t *frames, size_t n)
{
    ifd_frame stack[16], *views = n <= 16 ? stack : malloc(n * sizeof *views);
    if (views == NULL) {
        ifd_close_frames(frames, n);
        return;
    }
    for (size_t i = 0; i < n; i++) {
        views[i].data = zmq_msg_data(&frames[i]);
        views[i].size = zmq_msg_size(&frames[i]);
    }
    ifd_reply r;
    inferd_code code = ifd_reply_parse(views, n, ifd_region_bytes, c, &r);
    if (views != stack)
        free(views);
    inferd_call *call = find_call(c, r.id);
    if (call == NULL) {
        if (r.id == NULL) {
            c->unreadable++;
            ifd_text_set(&c->last_unreadable, "%s", r.message ? r.message : "");
        }
        ifd_reply_clear(&r);
        ifd_close_frames(frames, n);
        return;
    }
    call->reply = r;
    call->frames = frames;
    call->n_frames = n;
    ifd_unstage(call, 1);  /* answered: its staging region is free for another call */
    ifd_complete(call, code, "%s", r.message ? r.message : "");
}

/* Receives the rest of a message whose frames cannot be kept, and drops it. */
static void skip_message(inferd_client *c)
{
    zmq_msg_t skip;
    zmq_msg_init(&skip);
    while (zmq_msg_recv(&skip, c->sock, 0) >= 0 && zmq_msg_more(&skip))
        ;
    zmq_msg_close(&skip);
}

/* Receives every reply already queued; returns how many. */
static size_t receive_replies(inferd_client *c)
{
    size_t got = 0;
    for (;;) {
        size_t n = 0, cap = 4;
        zmq_msg_t *frames = malloc(cap * sizeof *frames);
        zmq_msg_t first;
        zmq_msg_init(&first);
        if (zmq_msg_recv(&first, c->sock, ZMQ_DONTWAIT) < 0) {
            zmq_msg_close(&first);  /* EAGAIN: nothing queued */
            free(frames);
            return got;
        }
        got++;
        if (frames == NULL) {
            if (zmq_msg_more(&first))
                skip_message(c);
            zmq_msg_close(&first);
            continue;
        }
        frames[n++] = first;
        /* a multipart message arrives whole: its other frames are there */
        while (zmq_msg_more(&frames[n - 1])) {
            if (n == cap) {
                zmq_msg_t *more = realloc(frames, 2 * cap * sizeof *frames);
                if (more == NULL)
                    break;
                frames = more;
                cap *= 2;
            }
            zmq_msg_init(&frames[n]);
            if (zmq_msg_recv(&frames[n], c->sock, 0) < 0) {
                zmq_msg_close(&frames[n]);
                break;
            }
            n++;
        }
        if (zmq_msg_more(&frames[n - 1])) {  /* out of memory or a closed context */
            skip_message(c);
            ifd_close_frames(frames, n);
            continue;
        }
        deliver(c, frames, n);
    }
}

/* Reads the monitor; a lost connection with calls in flight resets it. */
void ifd_read_monitor(inferd_client *c)
{
    int lost = 0;
    for (;;) {
        zmq_msg_t event, where;
        zmq_msg_init(&event);
        if (zmq_msg_recv(&event, c->mon, ZMQ_DONTWAIT) < 0) {
            zmq_msg_close(&event);
            break;
        }
        if (zmq_msg_size(&event) >= 2) {
            uint16_t id;
            memcpy(&id, zmq_msg_data(&event), sizeof id);
            if (id == ZMQ_EVENT_DISCONNECTED) {
                lost = 1;
                c->connected = 0;
            } else if (id == ZMQ_EVENT_HANDSHAKE_SUCCEEDED) {
                c->connected = 1;
            }
        }
        int more = zmq_msg_more(&event);
        zmq_msg_close(&event);
        while (more) {
            zmq_msg_init(&where);
            if (zmq_msg_recv(&where, c->mon, 0) < 0) {
                zmq_msg_close(&where);
                break;
            }
            more = zmq_msg_more(&where);
            zmq_msg_close(&where);
        }
    }
    if (lost && c->n_flight > 0) {
        receive_replies(c);  /* what the old daemon answered before it went */
        if (c->n_flight > 0) {
            char why[512];
            snprintf(why, sizeof why, "the connection to the daemon at %s was lost (it "
                     "stopped or restarted) while the call was in flight; the client "
                     "connects again by itself", c->endpoint);
            ifd_reset(c, INFERD_UNAVAILABLE, why);
        }
    }
}

static void expire(inferd_client *c, int64_t now)
{
    for (size_t i = 0; i < c->n_flight;) {
        inferd_call *call = c->flight[i];
        if (call->give_up_ns > now) {
            i++;
            continue;
        }
        if (c->unreadable)
            ifd_complete(call, INFERD_DEADLINE_EXCEEDED, "no reply from %s within the client "
                         "timeout (%u replies could not be read, the last: %s)", c->endpoint,
                         c->unreadable, ifd_text_get(&c->last_unreadable));
        else
            ifd_complete(call, INFERD_DEADLINE_EXCEEDED, "no reply from %s within the client "
                         "timeout", c->endpoint);
    }
}

void ifd_pump(inferd_client *c, int64_t deadline_ns)
{
    if (c->sock == NULL) {  /* a reset could not connect again: try now */
        if (open_socket(c) != INFERD_OK) {
            close_socket(c);
            while (c->n_flight > 0)
                ifd_complete(c->flight[c->n_flight - 1], INFERD_UNAVAILABLE, "%s",
                             ifd_text_get(&c->error));
            return;
        }
    }
    int64_t now = ifd_now_ns(), until = deadline_ns;
    for (size_t i = 0; i < c->n_flight; i++)
        if (c->flight[i]->give_up_ns < until)
            until = c->flight[i]->give_up_ns;
    long timeout_ms = until <= now ? 0 : (long)((until - now + 999999) / 1000000);
    zmq_pollitem_t items[2] = {{c->sock, 0, ZMQ_POLLIN, 0}, {c->mon, 0, ZMQ_POLLIN, 0}};
    int n = zmq_poll(items, 2, timeout_ms);
    if (n > 0 && (items[0].revents & ZMQ_POLLIN))
        receive_replies(c);
    if (n > 0 && (items[1].revents & ZMQ_POLLIN))
        ifd_read_monitor(c);
    expire(c, ifd_now_ns());
}

/* ------------------------------------------------------------------ waiting */

static inferd_code collect(inferd_call *call)
{
    ifd_settle_call(call);
    call->collected = 1;
    if (call->client)
        ifd_done_remove(call->client, call);
    return call->code;
}

inferd_code inferd_wait(inferd_call *call, int64_t timeout_ms)
{
    if (call == NULL)
        return INFERD_INVALID_ARGUMENT;
    if (call->state == IFD_BUILDING)
        return INFERD_INVALID_ARGUMENT;
    inferd_client *c = call->client;
    int64_t deadline = timeout_ms < 0 ? INT64_MAX : ifd_now_ns() + timeout_ms * 1000000;
    while (call->state != IFD_DONE) {
        if (c == NULL)
            return INFERD_CANCELLED;
        int64_t until = deadline < call->give_up_ns ? deadline : call->give_up_ns;
        ifd_pump(c, until);
        if (call->state != IFD_DONE && ifd_now_ns() >= deadline)
            return INFERD_AGAIN;
    }
    return collect(call);
}

inferd_code inferd_wait_any(inferd_client *c, int64_t timeout_ms, inferd_call **out)
{
    if (c == NULL || out == NULL)
        return INFERD_INVALID_ARGUMENT;
    *out = NULL;
    int64_t deadline = timeout_ms < 0 ? INT64_MAX : ifd_now_ns() + timeout_ms * 1000000;
    while (c->done_head == NULL) {
        if (c->n_flight == 0 || ifd_now_ns() >= deadline)
            return INFERD_AGAIN;
        ifd_pump(c, deadline);
    }
    *out = c->done_head;
    collect(*out);
    return INFERD_OK;
}

