/* The wire's vocabulary in C: error codes, dtypes and their sizes, string tensors'
 * encoding, UTF-8 checks, and the heap message buffers of clients and calls. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "internal.h"

#define STR2(x) #x
#define STR(x) STR2(x)

const char *inferd_version(void)
{
    return STR(INFERD_VERSION_MAJOR) "." STR(INFERD_VERSION_MINOR) "." STR(INFERD_VERSION_PATCH);
}

/* ------------------------------------------------------------------ codes */

static const struct {
    inferd_code code;
    const char *name;
} CODES[] = {
    {INFERD_OK, "OK"},
    {INFERD_INVALID_ARGUMENT, "INVALID_ARGUMENT"},
    {INFERD_NOT_FOUND, "NOT_FOUND"},
    {INFERD_UNAVAILABLE, "UNAVAILABLE"},
    {INFERD_PERMISSION_DENIED, "PERMISSION_DENIED"},
    {INFERD_RESOURCE_EXHAUSTED, "RESOURCE_EXHAUSTED"},
    {INFERD_DEADLINE_EXCEEDED, "DEADLINE_EXCEEDED"},
    {INFERD_UNSUPPORTED, "UNSUPPORTED"},
    {INFERD_CANCELLED, "CANCELLED"},
    {INFERD_INTERNAL, "INTERNAL"},
    {INFERD_FAILED_PRECONDITION, "FAILED_PRECONDITION"},
    {INFERD_PROTOCOL_ERROR, "PROTOCOL_ERROR"},
    {INFERD_NO_MEMORY, "NO_MEMORY"},
    {INFERD_SYSTEM_ERROR, "SYSTEM_ERROR"},
    {INFERD_AGAIN, "AGAIN"},
};

const char *inferd_code_name(inferd_code code)
{
    for (size_t i = 0; i < sizeof CODES / sizeof CODES[0]; i++)
        if (CODES[i].code == code)
            return CODES[i].name;
    return "UNKNOWN";
}

inferd_code ifd_code_from_name(const char *name)
{
    /* only the wire's codes, 1-10: a reply naming another is INTERNAL (as in Python) */
    for (size_t i = 0; i < sizeof CODES / sizeof CODES[0]; i++)
        if (CODES[i].code >= INFERD_INVALID_ARGUMENT &&
            CODES[i].code <= INFERD_FAILED_PRECONDITION &&
            strcmp(CODES[i].name, name) == 0)
            return CODES[i].code;
    return INFERD_OK;
}

/* ------------------------------------------------------------------ dtypes */

static const struct {
    const char *name;
    size_t size;
} DTYPES[] = {
    [INFERD_BOOL] = {"bool", 1},       [INFERD_INT8] = {"int8", 1},
    [INFERD_UINT8] = {"uint8", 1},     [INFERD_INT16] = {"int16", 2},
    [INFERD_UINT16] = {"uint16", 2},   [INFERD_INT32] = {"int32", 4},
    [INFERD_UINT32] = {"uint32", 4},   [INFERD_INT64] = {"int64", 8},
    [INFERD_UINT64] = {"uint64", 8},   [INFERD_FLOAT16] = {"float16", 2},
    [INFERD_FLOAT32] = {"float32", 4}, [INFERD_FLOAT64] = {"float64", 8},
    [INFERD_STRING] = {"string", 0},   [INFERD_BFLOAT16] = {"bfloat16", 2},
    [INFERD_FLOAT8_E4M3FN] = {"float8_e4m3fn", 1},
    [INFERD_FLOAT8_E4M3FNUZ] = {"float8_e4m3fnuz", 1},
    [INFERD_FLOAT8_E5M2] = {"float8_e5m2", 1},
    [INFERD_FLOAT8_E5M2FNUZ] = {"float8_e5m2fnuz", 1},
    [INFERD_INT4] = {"int4", 0},       [INFERD_UINT4] = {"uint4", 0},
    [INFERD_FLOAT8_E8M0FNU] = {"float8_e8m0fnu", 1},
    [INFERD_FLOAT4_E2M1FN] = {"float4_e2m1fn", 0},
    [INFERD_INT2] = {"int2", 0},       [INFERD_UINT2] = {"uint2", 0},
};
#define N_DTYPES (sizeof DTYPES / sizeof DTYPES[0])

const char *inferd_dtype_name(inferd_dtype dtype)
{
    return (unsigned)dtype < N_DTYPES ? DTYPES[dtype].name : NULL;
}

inferd_dtype inferd_dtype_from_name(const char *name, size_t len)
{
    if (name == NULL)
        return INFERD_DTYPE_INVALID;
    for (size_t i = 1; i < N_DTYPES; i++)
        if (DTYPES[i].name && strlen(DTYPES[i].name) == len && memcmp(DTYPES[i].name, name, len) == 0)
            return (inferd_dtype)i;
    return INFERD_DTYPE_INVALID;
}

size_t inferd_dtype_size(inferd_dtype dtype)
{
    return (unsigned)dtype < N_DTYPES ? DTYPES[dtype].size : 0;
}

inferd_code inferd_frame_size(inferd_dtype dtype, uint64_t elements, uint64_t *bytes)
{
    if (dtype == INFERD_INT4 || dtype == INFERD_UINT4 || dtype == INFERD_FLOAT4_E2M1FN) {
        *bytes = elements / 2 + elements % 2;
        return INFERD_OK;
    }
    if (dtype == INFERD_INT2 || dtype == INFERD_UINT2) {
        *bytes = elements / 4 + (elements % 4 != 0);
        return INFERD_OK;
    }
    size_t size = inferd_dtype_size(dtype);
    if (size == 0 || elements > UINT64_MAX / size)
        return INFERD_INVALID_ARGUMENT;
    *bytes = elements * size;
    return INFERD_OK;
}

const char *ifd_packing(inferd_dtype dtype)
{
    if (dtype == INFERD_INT4 || dtype == INFERD_UINT4 || dtype == INFERD_FLOAT4_E2M1FN)
        return " (two elements per byte)";
    if (dtype == INFERD_INT2 || dtype == INFERD_UINT2)
        return " (four elements per byte)";
    return "";
}

inferd_code inferd_shape_elements(const int64_t *shape, size_t rank, uint64_t *elements)
{
    /* protocol.md: at most 2^48 elements, counting the non-zero dimensions */
    uint64_t bounded = 1, count = 1;
    if (rank > 0 && shape == NULL)
        return INFERD_INVALID_ARGUMENT;
    for (size_t i = 0; i < rank; i++) {
        if (shape[i] < 0)
            return INFERD_INVALID_ARGUMENT;
        uint64_t d = (uint64_t)shape[i];
        if (d > IFD_MAX_ELEMENTS)
            return INFERD_INVALID_ARGUMENT;
        if (d > 0) {
            bounded *= d;  /* both <= 2^48 before: no overflow of 64 bits */
            if (bounded > IFD_MAX_ELEMENTS)
                return INFERD_INVALID_ARGUMENT;
        }
        count = d == 0 ? 0 : count * d;
    }
    if (elements)
        *elements = count;
    return INFERD_OK;
}

/* ------------------------------------------------------------------ strings */

inferd_code inferd_strings_pack(const char *const *strings, const size_t *lengths, size_t n,
                                void **data, size_t *size)
{
    if (data == NULL || size == NULL || (n > 0 && strings == NULL))
        return INFERD_INVALID_ARGUMENT;
    *data = NULL;
    *size = 0;
    size_t total = 0;
    for (size_t i = 0; i < n; i++) {
        if (strings[i] == NULL)
            return INFERD_INVALID_ARGUMENT;
        size_t len = lengths ? lengths[i] : strlen(strings[i]);
        if (len > UINT32_MAX || total > SIZE_MAX - 4 - len)
            return INFERD_INVALID_ARGUMENT;
        if (!ifd_utf8_valid((const unsigned char *)strings[i], len))
            return INFERD_INVALID_ARGUMENT;
        total += 4 + len;
    }
    unsigned char *out = malloc(total ? total : 1);
    if (out == NULL)
        return INFERD_NO_MEMORY;
    unsigned char *p = out;
    for (size_t i = 0; i < n; i++) {
        size_t len = lengths ? lengths[i] : strlen(strings[i]);
        uint32_t l = (uint32_t)len;
        p[0] = (unsigned char)l;
        p[1] = (unsigned char)(l >> 8);
        p[2] = (unsigned char)(l >> 16);
        p[3] = (unsigned char)(l >> 24);
        if (len)
            memcpy(p + 4, strings[i], len);
        p += 4 + len;
    }
    *data = out;
    *size = total;
    return INFERD_OK;
}

void inferd_free(void *ptr)
{
    free(ptr);
}

void inferd_free_release(void *data, void *hint)
{
    (void)hint;
    free(data);
}

/* ------------------------------------------------------------------ UTF-8 */

int ifd_utf8_valid(const unsigned char *s, size_t n)
{
    /* strict UTF-8 as Python's decoder: no overlong forms, no surrogates, <= U+10FFFF */
    size_t i = 0;
    while (i < n) {
        unsigned char c = s[i];
        if (c < 0x80) {
            i++;
            continue;
        }
        size_t need;
        uint32_t cp, min;
        if (c >= 0xC2 && c <= 0xDF) {
            need = 1, cp = c & 0x1F, min = 0x80;
        } else if (c >= 0xE0 && c <= 0xEF) {
            need = 2, cp = c & 0x0F, min = 0x800;
        } else if (c >= 0xF0 && c <= 0xF4) {
            need = 3, cp = c & 0x07, min = 0x10000;
        } else {
            return 0;
        }
        if (n - i - 1 < need)
            return 0;
        for (size_t k = 1; k <= need; k++) {
            if ((s[i + k] & 0xC0) != 0x80)
                return 0;
            cp = (cp << 6) | (s[i + k] & 0x3F);
        }
        if (cp < min || cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF))
            return 0;
        i += need + 1;
    }
    return 1;
}

size_t ifd_utf8_chars(const char *s, size_t n)
{
    size_t chars = 0;
    for (size_t i = 0; i < n; i++)
        chars += ((unsigned char)s[i] & 0xC0) != 0x80;
    return chars;
}

/* ------------------------------------------------------------------ messages */

void ifd_text_vset(ifd_text *t, const char *fmt, va_list ap)
{
    va_list again;
    va_copy(again, ap);
    int n = vsnprintf(NULL, 0, fmt, ap);
    char *buf = n >= 0 ? malloc((size_t)n + 1) : NULL;
    if (buf != NULL)
        vsnprintf(buf, (size_t)n + 1, fmt, again);
    va_end(again);
    free(t->text);
    t->text = buf;  /* NULL (reads as "") only when out of memory for the message */
}

void ifd_text_set(ifd_text *t, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    ifd_text_vset(t, fmt, ap);
    va_end(ap);
}

const char *ifd_text_get(const ifd_text *t)
{
    return t->text ? t->text : "";
}

void ifd_text_free(ifd_text *t)
{
    free(t->text);
    t->text = NULL;
}
