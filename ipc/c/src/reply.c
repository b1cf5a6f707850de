/* Parsing a reply from its frames: pure, no sockets (the fuzz test drives it through a
 * fake ROUTER, tests/ipc/c/fuzz_replies.c). It checks what ipc/protocol.py's
 * decode_reply checks, in the same order: the tag, the header (UTF-8 JSON object,
 * nesting, an id), then either the error or every output tensor's description and
 * byte count; string tensors are validated element by element. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "internal.h"

static inferd_code protocol_error(ifd_reply *r, const char *fmt, ...)
    __attribute__((format(printf, 2, 3)));

static inferd_code protocol_error(ifd_reply *r, const char *fmt, ...)
{
    ifd_text t = {NULL};
    va_list ap;
    va_start(ap, fmt);
    ifd_text_vset(&t, fmt, ap);
    va_end(ap);
    free(r->message);
    r->message = t.text;
    r->code = INFERD_PROTOCOL_ERROR;
    return r->code;
}

size_t ifd_json_depth(const char *s, size_t n)
{
    size_t level = 0, deepest = 0;
    int in_string = 0;
    for (size_t i = 0; i < n; i++) {
        char c = s[i];
        if (in_string) {
            if (c == '\\')
                i++;
            else if (c == '"')
                in_string = 0;
        } else if (c == '"') {
            in_string = 1;
        } else if (c == '[' || c == '{') {
            if (++level > deepest)
                deepest = level;
        } else if ((c == ']' || c == '}') && level > 0) {
            level--;
        }
    }
    return deepest;
}

void ifd_reply_clear(ifd_reply *r)
{
    if (r->string_offsets) {
        for (size_t i = 0; i < r->n_outputs; i++)
            free(r->string_offsets[i]);
        free(r->string_offsets);
    }
    free(r->outputs);
    free(r->dims);
    free(r->message);
    free(r->result);
    if (r->header)
        json_decref(r->header);
    memset(r, 0, sizeof *r);
}

static char *dump(const json_t *value)
{
    return json_dumps(value, JSON_COMPACT | JSON_ENCODE_ANY);
}

/* A short rendering of VALUE for messages. */
static void shortly(const json_t *value, char *buf, size_t size)
{
    char *text = value ? dump(value) : NULL;
    snprintf(buf, size, "%s", text ? text : "(missing)");
    if (text && strlen(text) >= size && size > 4)
        memcpy(buf + size - 4, "...", 4);
    free(text);
}

/* Checks one output's description (protocol.py's _check_spec); fills T. */
static inferd_code check_spec(ifd_reply *r, const json_t *spec, inferd_tensor *t,
                              int64_t *dims)
{
    char what[96];
    if (!json_is_object(spec))
        return protocol_error(r, "reply outputs: each tensor description must be an object");
    const json_t *name = json_object_get(spec, "name");
    const json_t *dtype = json_object_get(spec, "dtype");
    const json_t *shape = json_object_get(spec, "shape");
    if (!json_is_string(name) || json_string_length(name) == 0)
        return protocol_error(r, "reply outputs: tensor 'name' must be a non-empty string");
    const char *n = json_string_value(name);
    size_t nlen = json_string_length(name);
    if (ifd_utf8_chars(n, nlen) > IFD_MAX_NAME_CHARS)
        return protocol_error(r, "reply outputs: tensor name is over %d characters",
                              IFD_MAX_NAME_CHARS);
    inferd_dtype dt = json_is_string(dtype)
        ? inferd_dtype_from_name(json_string_value(dtype), json_string_length(dtype))
        : INFERD_DTYPE_INVALID;
    if (dt == INFERD_DTYPE_INVALID) {
        shortly(dtype, what, sizeof what);
        return protocol_error(r, "reply outputs: tensor '%s' has dtype %s, which this "
                              "library does not know", n, what);
    }
    if (!json_is_array(shape)) {
        shortly(shape, what, sizeof what);
        return protocol_error(r, "reply outputs: tensor '%s' shape must be a list of "
                              "non-negative integers, got %s", n, what);
    }
    size_t rank = json_array_size(shape);
    for (size_t i = 0; i < rank; i++) {
        const json_t *d = json_array_get(shape, i);
        if (!json_is_integer(d) || json_integer_value(d) < 0) {
            shortly(shape, what, sizeof what);
            return protocol_error(r, "reply outputs: tensor '%s' shape must be a list of "
                                  "non-negative integers, got %s", n, what);
        }
    }
    if (rank > IFD_MAX_RANK)
        return protocol_error(r, "reply outputs: tensor '%s' has rank %zu; at most %d "
                              "dimensions are allowed", n, rank, IFD_MAX_RANK);
    for (size_t i = 0; i < rank; i++)
        dims[i] = (int64_t)json_integer_value(json_array_get(shape, i));
    if (inferd_shape_elements(dims, rank, NULL) != INFERD_OK)
        return protocol_error(r, "reply outputs: tensor '%s' has more than 2^48 elements", n);
    t->name = n;
    t->dtype = dt;
    t->rank = rank;
    t->shape = dims;
    return INFERD_OK;
}

/* Indexes the elements of a string frame: offsets[i] is where element i's bytes start
 * (its length is the uint32 before them). */
static inferd_code index_strings(ifd_reply *r, const inferd_tensor *t, uint64_t count,
                                 uint64_t **out)
{
    const unsigned char *p = t->data;
    size_t size = t->size, pos = 0;
    /* each element takes at least its 4-byte length: refuse before allocating */
    if (count > size / 4)
        return protocol_error(r, "reply outputs: tensor '%s' declares %llu strings but its "
                              "frame has only %zu bytes (at least 4 per string)", t->name,
                              (unsigned long long)count, size);
    uint64_t *offsets = malloc((count ? count : 1) * sizeof *offsets);
    if (offsets == NULL)
        return protocol_error(r, "out of memory for tensor '%s'", t->name);
    for (uint64_t i = 0; i < count; i++) {
        if (size - pos < 4) {
            free(offsets);
            return protocol_error(r, "tensor '%s': string frame ends inside element %llu",
                                  t->name, (unsigned long long)i);
        }
        uint32_t len = (uint32_t)p[pos] | (uint32_t)p[pos + 1] << 8 |
                       (uint32_t)p[pos + 2] << 16 | (uint32_t)p[pos + 3] << 24;
        pos += 4;
        if (len > size - pos) {
            free(offsets);
            return protocol_error(r, "tensor '%s': string element %llu claims %u bytes, frame "
                                  "has %zu left", t->name, (unsigned long long)i, len,
                                  size - pos);
        }
        if (!ifd_utf8_valid(p + pos, len)) {
            free(offsets);
            return protocol_error(r, "tensor '%s': string element %llu is not UTF-8", t->name,
                                  (unsigned long long)i);
        }
        offsets[i] = pos;
        pos += len;
    }
    if (pos != size) {
        free(offsets);
        return protocol_error(r, "tensor '%s': %zu bytes left over after %llu string elements",
                              t->name, size - pos, (unsigned long long)count);
    }
    *out = offsets;
    return INFERD_OK;
}

/* The bytes of an output described in a shared-memory region (protocol.py's
 * _in_region): *DATA and *AVAILABLE (what the region holds from the offset on). */
static inferd_code in_region(ifd_reply *r, const json_t *spec, const inferd_tensor *t,
                             ifd_resolver *resolve, void *ctx, const void **data,
                             size_t *available)
{
    char what[96];
    if (resolve == NULL)
        return protocol_error(r, "reply outputs: tensor '%s' names a shared-memory region, "
                              "which this connection cannot use", t->name);
    if (t->dtype == INFERD_STRING)
        return protocol_error(r, "reply outputs: tensor '%s': string tensors cannot live in "
                              "shared memory", t->name);
    const json_t *offset = json_object_get(spec, "offset");
    if (offset != NULL && (!json_is_integer(offset) || json_integer_value(offset) < 0)) {
        shortly(offset, what, sizeof what);
        return protocol_error(r, "reply outputs: tensor '%s': 'offset' must be a non-negative "
                              "integer, got %s", t->name, what);
    }
    const char *token = json_string_value(json_object_get(spec, "region"));
    size_t size = 0;
    const char *base = token ? resolve(ctx, token, &size) : NULL;
    if (base == NULL) {
        shortly(json_object_get(spec, "region"), what, sizeof what);
        return protocol_error(r, "reply outputs: tensor '%s' names region %s, which this "
                              "client has not registered", t->name, what);
    }
    uint64_t at = offset ? (uint64_t)json_integer_value(offset) : 0;
    *available = at < size ? size - (size_t)at : 0;
    *data = at < size ? base + at : base + size;
    return INFERD_OK;
}

static inferd_code parse_outputs(ifd_reply *r, const json_t *specs, const ifd_frame *frames,
                                 size_t n_frames, ifd_resolver *resolve, void *ctx)
{
    if (specs == NULL)
        specs = json_array();  /* a borrowed empty array would leak: handled below */
    else
        json_incref((json_t *)specs);
    inferd_code rc = INFERD_OK;
    if (!json_is_array(specs)) {
        rc = protocol_error(r, "reply outputs: expected a list of tensor descriptions");
        goto out;
    }
    size_t n = json_array_size(specs), framed = 0, next_frame = 0;
    for (size_t i = 0; i < n; i++) {
        const json_t *spec = json_array_get(specs, i);
        framed += !(json_is_object(spec) && json_object_get(spec, "region"));
    }
    if (framed != n_frames) {
        rc = protocol_error(r, "reply outputs: header describes %zu tensors%s but %zu tensor "
                            "frames follow", framed, framed != n ? " in frames" : "", n_frames);
        goto out;
    }
    if (n == 0)
        goto out;
    /* n <= the frames received, so these allocations are bounded by the message */
    r->outputs = calloc(n, sizeof *r->outputs);
    r->dims = calloc(n * IFD_MAX_RANK, sizeof *r->dims);
    r->string_offsets = calloc(n, sizeof *r->string_offsets);
    if (!r->outputs || !r->dims || !r->string_offsets) {
        rc = protocol_error(r, "out of memory for %zu outputs", n);
        goto out;
    }
    r->n_outputs = n;
    for (size_t i = 0; i < n; i++) {
        inferd_tensor *t = &r->outputs[i];
        rc = check_spec(r, json_array_get(specs, i), t, r->dims + i * IFD_MAX_RANK);
        if (rc != INFERD_OK)
            goto out;
        for (size_t k = 0; k < i; k++)
            if (strcmp(r->outputs[k].name, t->name) == 0) {
                rc = protocol_error(r, "reply outputs: tensor '%s' appears twice", t->name);
                goto out;
            }
        uint64_t count;
        inferd_shape_elements(t->shape, t->rank, &count);
        const json_t *spec = json_array_get(specs, i);
        if (json_object_get(spec, "region") != NULL) {  /* in shared memory, no frame */
            size_t available = 0;
            rc = in_region(r, spec, t, resolve, ctx, &t->data, &available);
            if (rc != INFERD_OK)
                goto out;
            uint64_t need;
            inferd_frame_size(t->dtype, count, &need);
            if (available < need) {
                rc = protocol_error(r, "reply outputs: tensor '%s' is %s with %llu elements, "
                                    "%llu bytes, past the end of its region", t->name,
                                    inferd_dtype_name(t->dtype), (unsigned long long)count,
                                    (unsigned long long)need);
                goto out;
            }
            t->size = (size_t)need;
            continue;
        }
        t->data = frames[next_frame].data;
        t->size = frames[next_frame].size;
        next_frame++;
        if (t->dtype == INFERD_STRING) {
            rc = index_strings(r, t, count, &r->string_offsets[i]);
            if (rc != INFERD_OK)
                goto out;
            continue;
        }
        uint64_t expected;
        inferd_frame_size(t->dtype, count, &expected);
        if (t->size != expected) {
            rc = protocol_error(r, "reply outputs: tensor '%s' is %s with %llu elements, which "
                                "is %llu bytes%s, but its frame has %zu", t->name,
                                inferd_dtype_name(t->dtype), (unsigned long long)count,
                                (unsigned long long)expected, ifd_packing(t->dtype), t->size);
            goto out;
        }
    }
out:
    json_decref((json_t *)specs);
    return rc;
}

inferd_code ifd_reply_parse(const ifd_frame *frames, size_t n, ifd_resolver *resolve,
                            void *ctx, ifd_reply *r)
{
    memset(r, 0, sizeof *r);
    r->code = INFERD_OK;
    if (n < 2)
        return protocol_error(r, "reply has %zu frames; expected at least 2 (protocol tag "
                              "and header)", n);
    if (frames[0].size != strlen(INFERD_PROTOCOL_TAG) ||
        memcmp(frames[0].data, INFERD_PROTOCOL_TAG, frames[0].size) != 0)
        return protocol_error(r, "reply starts with a protocol tag of %zu bytes that is not "
                              "%s", frames[0].size, INFERD_PROTOCOL_TAG);
    const char *raw = frames[1].data;
    size_t size = frames[1].size;
    size_t depth = ifd_json_depth(raw, size);
    if (depth > IFD_MAX_DEPTH)
        return protocol_error(r, "reply header nests %zu levels deep; at most %d are allowed",
                              depth, IFD_MAX_DEPTH);
    /* JSON text holds no NUL byte (a string escapes it); jansson's reader would skip it */
    const char *nul = memchr(raw, '\0', size);
    if (nul != NULL)
        return protocol_error(r, "reply header is not valid UTF-8 JSON: a NUL byte at byte %zu",
                              (size_t)(nul - raw));
    json_error_t err;
    r->header = json_loadb(raw, size, 0, &err);
    if (r->header == NULL)
        return protocol_error(r, "reply header is not valid UTF-8 JSON: %s (at byte %d)",
                              err.text, err.position);
    if (!json_is_object(r->header))
        return protocol_error(r, "reply header must be a JSON object");
    const json_t *id = json_object_get(r->header, "id");
    if (!json_is_string(id))
        return protocol_error(r, "reply header has no string 'id'");
    r->id = json_string_value(id);
    const json_t *status = json_object_get(r->header, "status");
    if (json_is_string(status) && strcmp(json_string_value(status), "error") == 0) {
        const json_t *e = json_object_get(r->header, "error");
        const json_t *code = json_is_object(e) ? json_object_get(e, "code") : NULL;
        const json_t *message = json_is_object(e) ? json_object_get(e, "message") : NULL;
        inferd_code c = json_is_string(code) ? ifd_code_from_name(json_string_value(code))
                                             : INFERD_OK;
        r->code = c == INFERD_OK ? INFERD_INTERNAL : c;
        if (message == NULL)
            r->message = strdup("");
        else if (json_is_string(message))
            r->message = strdup(json_string_value(message));
        else
            r->message = dump(message);
        if (r->message == NULL)
            return protocol_error(r, "out of memory for the error message");
        return r->code;
    }
    if (parse_outputs(r, json_object_get(r->header, "outputs"), frames + 2, n - 2, resolve,
                      ctx) != INFERD_OK)
        return r->code;
    const json_t *result = json_object_get(r->header, "result");
    if (result != NULL) {
        r->result = dump(result);
        if (r->result == NULL)
            return protocol_error(r, "out of memory for the result");
    }
    return r->code;
}
