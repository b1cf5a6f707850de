/* What the C test programs of libinferd share: checks that print where they failed and
 * exit 1, and reading a file whole. Each program is run by tests/ipc/test_libinferd.py
 * against a real daemon (or a fake ROUTER) and prints what the test compares. */
#ifndef TESTKIT_H
#define TESTKIT_H

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "inferd.h"

#define CHECK(cond)                                                                     \
    do {                                                                                \
        if (!(cond)) {                                                                  \
            fprintf(stderr, "%s:%d: check failed: %s\n", __FILE__, __LINE__, #cond);   \
            exit(1);                                                                    \
        }                                                                               \
    } while (0)

/* EXPR returns an inferd_code that must be WANT; the message is printed otherwise. */
#define CHECK_CODE(want, expr, message)                                                 \
    do {                                                                                \
        inferd_code got_ = (expr);                                                      \
        if (got_ != (want)) {                                                           \
            fprintf(stderr, "%s:%d: %s gave %s, expected %s: %s\n", __FILE__, __LINE__, \
                    #expr, inferd_code_name(got_), inferd_code_name(want), (message));  \
            exit(1);                                                                    \
        }                                                                               \
    } while (0)

#define CHECK_CONTAINS(text, needle)                                                    \
    do {                                                                                \
        const char *t_ = (text);                                                        \
        if (t_ == NULL || strstr(t_, (needle)) == NULL) {                               \
            fprintf(stderr, "%s:%d: '%s' does not contain '%s'\n", __FILE__, __LINE__,  \
                    t_ ? t_ : "(null)", (needle));                                      \
            exit(1);                                                                    \
        }                                                                               \
    } while (0)

static inline inferd_client *connect_or_die(const char *endpoint)
{
    inferd_client *c = NULL;
    inferd_code rc = inferd_client_new(&c, endpoint, NULL);
    if (rc != INFERD_OK) {
        fprintf(stderr, "connect %s: %s: %s\n", endpoint, inferd_code_name(rc),
                inferd_client_error(c));
        exit(1);
    }
    return c;
}

/* The whole file PATH in malloc'd memory (*size bytes). */
static inline void *read_file(const char *path, size_t *size)
{
    FILE *f = fopen(path, "rb");
    CHECK(f != NULL);
    CHECK(fseek(f, 0, SEEK_END) == 0);
    long n = ftell(f);
    CHECK(n >= 0);
    rewind(f);
    void *data = malloc((size_t)n ? (size_t)n : 1);
    CHECK(data != NULL);
    CHECK(fread(data, 1, (size_t)n, f) == (size_t)n);
    fclose(f);
    *size = (size_t)n;
    return data;
}

/* A zero float32 image for ocr-cls, 1x3x48x192. */
#define CLS_ELEMS (1 * 3 * 48 * 192)
static const int64_t CLS_SHAPE[4] = {1, 3, 48, 192};

static inline inferd_call *cls_call(inferd_client *c, const char *model, const float *image)
{
    inferd_call *call = inferd_call_new(c, INFERD_OP_INFER, model);
    CHECK(call != NULL);
    inferd_tensor x = {"x", INFERD_FLOAT32, 4, CLS_SHAPE, image, CLS_ELEMS * sizeof(float),
                       NULL, NULL};
    CHECK_CODE(INFERD_OK, inferd_call_add_input(call, &x), inferd_client_error(c));
    return call;
}

#endif
