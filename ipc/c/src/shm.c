/* Shared-memory regions (docs/protocol.md, "Shared memory"): a sealed memfd, mapped here,
 * handed to the daemon once over the SOCK_SEQPACKET registration socket beside the ipc
 * one (SCM_RIGHTS); its token then names it in requests. The memfd stays open so that the
 * region can be registered again when the daemon restarts (its registration socket
 * closes then, and the daemon forgets every region). */
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include "internal.h"

#define MAX_REGION_BYTES (UINT64_C(4) << 30)

/* The registration socket's path: the ipc endpoint's path + ".shm". */
static int shm_path(inferd_client *c, struct sockaddr_un *addr)
{
    const char *prefix = "ipc://";
    if (strncmp(c->endpoint, prefix, strlen(prefix)) != 0)
        return -1;
    memset(addr, 0, sizeof *addr);
    addr->sun_family = AF_UNIX;
    int n = snprintf(addr->sun_path, sizeof addr->sun_path, "%s.shm",
                     c->endpoint + strlen(prefix));
    return n > 0 && (size_t)n < sizeof addr->sun_path ? 0 : -1;
}

/* Whether the registration socket is still connected (the daemon closes it when it
 * stops: it reads as end of file, or hangs up). */
static int shm_alive(inferd_client *c)
{
    if (c->shm_fd < 0)
        return 0;
    struct pollfd p = {c->shm_fd, POLLIN, 0};
    if (poll(&p, 1, 0) == 0)
        return 1;
    char byte;
    if (!(p.revents & (POLLHUP | POLLERR)) && recv(c->shm_fd, &byte, 1, MSG_PEEK | MSG_DONTWAIT) > 0)
        return 1;  /* a stray datagram: not ours to read here, but the line is up */
    close(c->shm_fd);
    c->shm_fd = -1;
    for (inferd_region *r = c->regions; r; r = r->next)
        r->token[0] = '\0';  /* the daemon forgot them */
    return 0;
}

static inferd_code shm_connect(inferd_client *c)
{
    struct sockaddr_un addr;
    if (shm_path(c, &addr) != 0)
        return ifd_fail(c, INFERD_UNSUPPORTED, "shared memory needs an ipc:// endpoint, not %s",
                        c->endpoint);
    int fd = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);
    if (fd < 0)
        return ifd_fail(c, INFERD_SYSTEM_ERROR, "socket: %s", strerror(errno));
    if (connect(fd, (struct sockaddr *)&addr, sizeof addr) != 0) {
        int e = errno;
        close(fd);
        return ifd_fail(c, INFERD_UNAVAILABLE, "cannot reach the daemon's registration socket "
                        "%s: %s", addr.sun_path, strerror(e));
    }
    c->shm_fd = fd;
    return INFERD_OK;
}

/* Sends MSG (with FD when >= 0) and reads the reply into *REPLY (a JSON object). */
static inferd_code shm_call(inferd_client *c, const char *msg, int fd, json_t **reply)
{
    struct iovec iov = {(void *)msg, strlen(msg)};
    union {
        struct cmsghdr h;
        char buf[CMSG_SPACE(sizeof(int))];
    } control;
    struct msghdr m = {0};
    m.msg_iov = &iov;
    m.msg_iovlen = 1;
    if (fd >= 0) {
        memset(&control, 0, sizeof control);
        m.msg_control = control.buf;
        m.msg_controllen = sizeof control.buf;
        struct cmsghdr *h = CMSG_FIRSTHDR(&m);
        h->cmsg_level = SOL_SOCKET;
        h->cmsg_type = SCM_RIGHTS;
        h->cmsg_len = CMSG_LEN(sizeof(int));
        memcpy(CMSG_DATA(h), &fd, sizeof fd);
    }
    if (sendmsg(c->shm_fd, &m, MSG_NOSIGNAL) < 0)
        return ifd_fail(c, INFERD_UNAVAILABLE, "registration socket: %s", strerror(errno));
    struct pollfd p = {c->shm_fd, POLLIN, 0};
    int64_t ms = c->timeout_ms < 2000000000 ? c->timeout_ms : 2000000000;
    int ready = poll(&p, 1, (int)ms);
    if (ready == 0)
        return ifd_fail(c, INFERD_DEADLINE_EXCEEDED, "no answer on the registration socket "
                        "within %lld ms", (long long)c->timeout_ms);
    char buf[4096];
    ssize_t n = ready > 0 ? recv(c->shm_fd, buf, sizeof buf, 0) : -1;
    if (n <= 0)
        return ifd_fail(c, INFERD_UNAVAILABLE, "the daemon closed the registration socket");
    json_error_t err;
    *reply = json_loadb(buf, (size_t)n, 0, &err);
    if (!json_is_object(*reply)) {
        json_decref(*reply);
        *reply = NULL;
        return ifd_fail(c, INFERD_PROTOCOL_ERROR, "the registration socket's answer is not "
                        "a JSON object");
    }
    const json_t *e = json_object_get(*reply, "error");
    if (e != NULL) {
        const char *code = json_string_value(json_object_get(e, "code"));
        inferd_code rc = code ? ifd_code_from_name(code) : INFERD_OK;
        const char *text = json_string_value(json_object_get(e, "message"));
        ifd_fail(c, rc == INFERD_OK ? INFERD_INTERNAL : rc, "%s", text ? text : "");
        json_decref(*reply);
        *reply = NULL;
        return rc == INFERD_OK ? INFERD_INTERNAL : rc;
    }
    return INFERD_OK;
}

inferd_code ifd_region_ready(inferd_region *r)
{
    inferd_client *c = r->client;
    if (c == NULL)
        return INFERD_CANCELLED;
    if (shm_alive(c) && r->token[0] != '\0')
        return INFERD_OK;
    if (c->shm_fd < 0) {
        inferd_code rc = shm_connect(c);
        if (rc != INFERD_OK)
            return rc;
    }
    json_t *reply;
    inferd_code rc = shm_call(c, "{\"op\":\"register\"}", r->fd, &reply);
    if (rc != INFERD_OK)
        return rc;
    const char *token = json_string_value(json_object_get(reply, "region"));
    if (token == NULL || strlen(token) >= sizeof r->token) {
        json_decref(reply);
        return ifd_fail(c, INFERD_PROTOCOL_ERROR, "the registration answer has no region");
    }
    snprintf(r->token, sizeof r->token, "%s", token);
    json_decref(reply);
    return INFERD_OK;
}

inferd_code inferd_region_new(inferd_client *c, size_t size, inferd_region **out)
{
    if (out == NULL)
        return INFERD_INVALID_ARGUMENT;
    *out = NULL;
    if (c == NULL)
        return INFERD_INVALID_ARGUMENT;
    struct sockaddr_un addr;
    if (shm_path(c, &addr) != 0)
        return ifd_fail(c, INFERD_UNSUPPORTED, "shared memory needs an ipc:// endpoint, not %s",
                        c->endpoint);
    if (size == 0 || size > MAX_REGION_BYTES)
        return ifd_fail(c, INFERD_INVALID_ARGUMENT, "a region is 1 byte to 4 GiB, not %zu",
                        size);
    inferd_region *r = calloc(1, sizeof *r);
    if (r == NULL)
        return ifd_fail(c, INFERD_NO_MEMORY, "out of memory");
    r->client = c;
    r->size = size;
    r->data = MAP_FAILED;
    r->fd = memfd_create("libinferd-region", MFD_CLOEXEC | MFD_ALLOW_SEALING);
    inferd_code rc = INFERD_SYSTEM_ERROR;
    if (r->fd < 0 || ftruncate(r->fd, (off_t)size) != 0 ||
        fcntl(r->fd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL) != 0 ||
        (r->data = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_SHARED, r->fd, 0)) == MAP_FAILED) {
        ifd_fail(c, rc, "cannot make a sealed memfd of %zu bytes: %s", size, strerror(errno));
        goto fail;
    }
    r->next = c->regions;
    c->regions = r;
    rc = ifd_region_ready(r);
    if (rc != INFERD_OK) {
        c->regions = r->next;
        goto fail;
    }
    *out = r;
    return INFERD_OK;
fail:
    if (r->data != MAP_FAILED)
        munmap(r->data, size);
    if (r->fd >= 0)
        close(r->fd);
    free(r);
    return rc;
}

void *inferd_region_data(const inferd_region *r)
{
    return r ? r->data : NULL;
}

size_t inferd_region_size(const inferd_region *r)
{
    return r ? r->size : 0;
}

static void region_release(inferd_region *r)
{
    munmap(r->data, r->size);
    close(r->fd);
    free(r);
}

void inferd_region_free(inferd_region *r)
{
    if (r == NULL)
        return;
    inferd_client *c = r->client;
    if (c != NULL) {
        for (inferd_region **p = &c->regions; *p; p = &(*p)->next)
            if (*p == r) {
                *p = r->next;
                break;
            }
        if (r->token[0] != '\0' && shm_alive(c)) {
            char msg[128];
            snprintf(msg, sizeof msg, "{\"op\":\"unregister\",\"region\":\"%s\"}", r->token);
            json_t *reply = NULL;
            if (shm_call(c, msg, -1, &reply) == INFERD_OK)
                json_decref(reply);
        }
        if (c->regions == NULL && c->shm_fd >= 0) {  /* the last one: hang up */
            close(c->shm_fd);
            c->shm_fd = -1;
        }
    }
    region_release(r);
}

void ifd_regions_free(inferd_client *c)
{
    if (c->shm_fd >= 0)
        close(c->shm_fd);  /* the daemon forgets every region of this connection */
    c->shm_fd = -1;
    while (c->regions) {
        inferd_region *r = c->regions;
        c->regions = r->next;
        region_release(r);
    }
}

inferd_region *ifd_region_of(inferd_client *c, const void *data, size_t size, uint64_t *offset)
{
    const char *p = data;
    for (inferd_region *r = c ? c->regions : NULL; r; r = r->next) {
        const char *base = r->data;
        if (size > 0 && p >= base && p < base + r->size && size <= r->size - (size_t)(p - base)) {
            *offset = (uint64_t)(p - base);
            return r;
        }
    }
    return NULL;
}

const void *ifd_region_bytes(void *ctx, const char *token, size_t *size)
{
    inferd_client *c = ctx;
    for (inferd_region *r = c->regions; r; r = r->next)
        if (r->token[0] != '\0' && strcmp(r->token, token) == 0) {
            *size = r->size;
            return r->data;
        }
    return NULL;
}

inferd_code inferd_call_set_outputs_into(inferd_call *call, inferd_region *region,
                                         uint64_t offset, uint64_t size)
{
    if (call == NULL || region == NULL || call->state != IFD_BUILDING)
        return INFERD_INVALID_ARGUMENT;
    if (region->client != call->client)
        return ifd_fail(call->client, INFERD_INVALID_ARGUMENT, "the region belongs to "
                        "another client");
    if (size == 0 || offset > region->size || size > region->size - offset)
        return ifd_fail(call->client, INFERD_INVALID_ARGUMENT, "outputs_into: %llu bytes at "
                        "offset %llu pass the end of the region (%zu bytes)",
                        (unsigned long long)size, (unsigned long long)offset, region->size);
    call->into = region;
    call->into_offset = offset;
    call->into_size = size;
    return INFERD_OK;
}

/* ------------------------------------------------------------------ staging */

/* Inputs too big to frame (docs/protocol.md, "Inline limit"): the daemon takes at most
 * server.max_message_bytes in frames, so that what libzmq holds before it reads a message
 * stays bounded; a bigger input is copied into a region of the library's own, one per
 * call in flight, kept for later calls once the daemon has answered. */

#define STAGING_MIN_BYTES ((size_t)1 << 20)
#define STAGING_HEADER_SLACK 256  /* what "region" and "offset" add to the header */

static int is_string(const inferd_call *call, size_t i)
{
    const char *dtype = json_string_value(json_object_get(
        json_array_get(call->input_specs, i), "dtype"));
    return dtype != NULL && strcmp(dtype, "string") == 0;
}

/* A free staging region of C of at least NEED bytes (the smallest), or NULL. */
static inferd_region *take_spare(inferd_client *c, size_t need)
{
    size_t best = c->n_spare;
    for (size_t i = 0; i < c->n_spare; i++)
        if (c->spare[i]->size >= need && (best == c->n_spare ||
                                          c->spare[i]->size < c->spare[best]->size))
            best = i;
    if (best == c->n_spare)
        return NULL;
    inferd_region *r = c->spare[best];
    c->spare[best] = c->spare[--c->n_spare];
    return r;
}

inferd_code ifd_stage(inferd_call *call, size_t header_bytes)
{
    inferd_client *c = call->client;
    struct sockaddr_un addr;
    if (call->staged != NULL || c->max_inline <= 0 || shm_path(c, &addr) != 0)
        return INFERD_OK;  /* tcp:// has no shared memory: frames, whatever the size */
    uint64_t total = header_bytes + STAGING_HEADER_SLACK;
    for (size_t i = 0; i < call->n_inputs; i++)
        if (call->inputs[i].region == NULL)
            total += call->inputs[i].size;
    if (total <= (uint64_t)c->max_inline)
        return INFERD_OK;
    /* the largest inputs first, until the rest fits (strings cannot move) */
    uint64_t over = total - (uint64_t)c->max_inline, moved = 0;
    size_t need = 0;
    while (moved < over) {
        size_t best = call->n_inputs;
        for (size_t i = 0; i < call->n_inputs; i++) {
            ifd_input *in = &call->inputs[i];
            if (in->region == NULL && !in->staged && in->size > 0 && !is_string(call, i) &&
                (best == call->n_inputs || in->size > call->inputs[best].size))
                best = i;
        }
        if (best == call->n_inputs)
            break;
        ifd_input *in = &call->inputs[best];
        in->staged = 1;  /* chosen; its region is set below */
        moved += in->size;
        need += in->size + 64;
    }
    if (need == 0)
        return INFERD_OK;
    inferd_region *r;
    while ((r = take_spare(c, need)) == NULL) {
        if (c->n_staging >= IFD_MAX_STAGING && c->n_spare > 0) {  /* too small: replace it */
            inferd_region_free(c->spare[--c->n_spare]);
            c->n_staging--;
        }
        if (c->n_staging < IFD_MAX_STAGING) {
            size_t size = STAGING_MIN_BYTES;
            while (size < need)
                size <<= 1;
            int reachable = c->shm_fd >= 0 || shm_connect(c) == INFERD_OK;
            inferd_code rc = reachable ? inferd_region_new(c, size, &r) : INFERD_OK;
            if (!reachable || rc != INFERD_OK) {
                for (size_t i = 0; i < call->n_inputs; i++)
                    call->inputs[i].staged = 0;
                /* no registration socket (nothing serves the endpoint, or not an inferd):
                 * frames, and whoever answers says what it takes */
                return rc;
            }
            c->n_staging++;
            break;
        }
        /* every staging region is lent to a call in flight: the next reply frees one */
        ifd_pump(c, call->give_up_ns);
        if (call->state != IFD_IN_FLIGHT) {  /* its own deadline came first */
            for (size_t i = 0; i < call->n_inputs; i++)
                call->inputs[i].staged = 0;
            return INFERD_OK;
        }
    }
    size_t at = 0;
    for (size_t i = 0; i < call->n_inputs; i++) {
        ifd_input *in = &call->inputs[i];
        if (!in->staged)
            continue;
        at += (64 - at % 64) % 64;  /* float inputs at 64-byte offsets, as the daemon likes */
        memcpy((char *)r->data + at, in->data, in->size);
        in->region = r;
        in->offset = at;
        at += in->size;
    }
    call->staged = r;
    return INFERD_OK;
}

void ifd_unstage(inferd_call *call, int reusable)
{
    inferd_region *r = call->staged;
    if (r == NULL)
        return;
    call->staged = NULL;
    for (size_t i = 0; i < call->n_inputs; i++) {
        ifd_input *in = &call->inputs[i];
        if (!in->staged)
            continue;
        in->staged = 0;
        in->region = NULL;
        in->offset = 0;
        json_t *spec = json_array_get(call->input_specs, i);  /* frames again on a retry */
        json_object_del(spec, "region");
        json_object_del(spec, "offset");
    }
    inferd_client *c = call->client;
    if (c != NULL && reusable && c->n_spare < IFD_KEEP_STAGING) {
        c->spare[c->n_spare++] = r;
        return;
    }
    if (c != NULL)
        c->n_staging--;
    inferd_region_free(r);
}
