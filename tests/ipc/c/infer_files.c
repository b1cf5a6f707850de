/* Runs the calls of a spec file, all in flight at once, and writes each reply to files,
 * so that the test can compare them with the Python client's bit for bit.
 *
 *   infer_files ENDPOINT SPEC OUTDIR
 *
 * SPEC, one item per line:
 *   call TAG MODEL            a new infer call
 *   in NAME DTYPE RANK DIMS... FILE borrowed|owned
 *                             an input read from FILE; borrowed (release NULL) or owned
 *                             (inferd_free_release)
 *   out NAME                  only this output
 *   param KEY JSON            another header key
 *
 * OUTDIR/TAG.txt: "CODE MESSAGE", then "output NAME DTYPE RANK DIMS... SIZE ALIGNED" per
 * output; OUTDIR/TAG.K.bin the output's frame; for strings OUTDIR/TAG.K.strings holds
 * each element (uint32 LE length, bytes) as inferd_output_string gave it. Prints
 * "done TAG" in the order the calls completed. */
#include <stdint.h>

#include "testkit.h"

#define MAX_CALLS 256

static struct {
    char tag[64];
    inferd_call *call;
} calls[MAX_CALLS];
static int n_calls;
#define MAX_BORROWED 1024
static void *borrowed[MAX_BORROWED];
static int n_borrowed;

static void write_reply(const char *dir, const char *tag, inferd_call *call)
{
    char path[8192];  /* DIR is a short temporary folder */
    snprintf(path, sizeof path, "%s/%s.txt", dir, tag);
    FILE *f = fopen(path, "w");
    CHECK(f != NULL);
    inferd_code code = inferd_call_code(call);
    fprintf(f, "%s %s\n", inferd_code_name(code), inferd_call_message(call));
    for (size_t k = 0; k < inferd_output_count(call); k++) {
        const inferd_tensor *t = inferd_output(call, k);
        CHECK(inferd_output_by_name(call, t->name) == t);
        const void *aligned = inferd_output_aligned(call, k);
        int is_aligned = 0;
        if (t->dtype != INFERD_STRING) {
            CHECK(aligned != NULL || t->size == 0);
            CHECK(t->size == 0 || memcmp(aligned, t->data, t->size) == 0);
            size_t align = inferd_dtype_size(t->dtype);  /* 0: the 4-bit types, bytes */
            is_aligned = t->size == 0 || align <= 1 || (uintptr_t)aligned % align == 0;
        }
        fprintf(f, "output %s %s %zu", t->name, inferd_dtype_name(t->dtype), t->rank);
        for (size_t d = 0; d < t->rank; d++)
            fprintf(f, " %lld", (long long)t->shape[d]);
        fprintf(f, " %zu %d\n", t->size, is_aligned);
        snprintf(path, sizeof path, "%s/%s.%zu.bin", dir, tag, k);
        FILE *b = fopen(path, "wb");
        CHECK(b != NULL);
        CHECK(t->size == 0 || fwrite(t->data, 1, t->size, b) == t->size);
        fclose(b);
        if (t->dtype != INFERD_STRING)
            continue;
        uint64_t count;
        CHECK_CODE(INFERD_OK, inferd_shape_elements(t->shape, t->rank, &count), "shape");
        snprintf(path, sizeof path, "%s/%s.%zu.strings", dir, tag, k);
        FILE *s = fopen(path, "wb");
        CHECK(s != NULL);
        for (uint64_t e = 0; e < count; e++) {
            const char *data;
            size_t len;
            CHECK_CODE(INFERD_OK, inferd_output_string(call, k, e, &data, &len), "string");
            uint32_t l = (uint32_t)len;
            unsigned char le[4] = {(unsigned char)l, (unsigned char)(l >> 8),
                                   (unsigned char)(l >> 16), (unsigned char)(l >> 24)};
            CHECK(fwrite(le, 1, 4, s) == 4);
            CHECK(len == 0 || fwrite(data, 1, len, s) == len);
        }
        const char *data;
        size_t len;
        CHECK(inferd_output_string(call, k, count, &data, &len) == INFERD_INVALID_ARGUMENT);
        fclose(s);
    }
    CHECK(inferd_output(call, inferd_output_count(call)) == NULL);
    fclose(f);
}

int main(int argc, char **argv)
{
    CHECK(argc == 4);
    inferd_client *c = connect_or_die(argv[1]);
    FILE *spec = fopen(argv[2], "r");
    CHECK(spec != NULL);
    char word[64], a[4096], b[4096];
    inferd_call *call = NULL;
    while (fscanf(spec, "%63s", word) == 1) {
        if (strcmp(word, "call") == 0) {
            CHECK(n_calls < MAX_CALLS);
            CHECK(fscanf(spec, "%63s %4095s", calls[n_calls].tag, a) == 2);
            call = calls[n_calls++].call = inferd_call_new(c, INFERD_OP_INFER, a);
            CHECK(call != NULL);
        } else if (strcmp(word, "in") == 0) {
            char name[256], dtype[32], mode[16];
            size_t rank;
            int64_t shape[32];
            CHECK(fscanf(spec, "%255s %31s %zu", name, dtype, &rank) == 3 && rank <= 32);
            for (size_t d = 0; d < rank; d++)
                CHECK(fscanf(spec, "%lld", (long long *)&shape[d]) == 1);
            CHECK(fscanf(spec, "%4095s %15s", a, mode) == 2);
            size_t size;
            void *data = read_file(a, &size);
            int owned = strcmp(mode, "owned") == 0;
            inferd_tensor t = {name, inferd_dtype_from_name(dtype, strlen(dtype)), rank, shape,
                               data, size, owned ? inferd_free_release : NULL, NULL};
            CHECK_CODE(INFERD_OK, inferd_call_add_input(call, &t), inferd_client_error(c));
            if (!owned) {  /* borrowed: valid until its call completes, freed at the end */
                CHECK(n_borrowed < MAX_BORROWED);
                borrowed[n_borrowed++] = data;
            }
        } else if (strcmp(word, "out") == 0) {
            CHECK(fscanf(spec, "%4095s", a) == 1);
            CHECK_CODE(INFERD_OK, inferd_call_add_output(call, a), inferd_client_error(c));
        } else if (strcmp(word, "param") == 0) {
            CHECK(fscanf(spec, "%4095s %4095s", a, b) == 2);
            CHECK_CODE(INFERD_OK, inferd_call_set_param(call, a, b), inferd_client_error(c));
        } else {
            fprintf(stderr, "spec: unknown item %s\n", word);
            return 1;
        }
    }
    fclose(spec);
    for (int i = 0; i < n_calls; i++) {
        inferd_code rc = inferd_submit(calls[i].call);
        CHECK(rc == INFERD_OK || inferd_call_code(calls[i].call) == rc);
    }
    for (int done = 0; done < n_calls; done++) {
        inferd_call *got = NULL;
        CHECK_CODE(INFERD_OK, inferd_wait_any(c, -1, &got), "wait_any");
        for (int i = 0; i < n_calls; i++)
            if (calls[i].call == got) {
                write_reply(argv[3], calls[i].tag, got);
                printf("done %s\n", calls[i].tag);
            }
    }
    inferd_call *none = (inferd_call *)1;
    CHECK(inferd_wait_any(c, 0, &none) == INFERD_AGAIN && none == NULL);
    for (int i = 0; i < n_calls; i++)
        inferd_call_free(calls[i].call);
    for (int i = 0; i < n_borrowed; i++)
        free(borrowed[i]);
    inferd_client_free(c);
    return 0;
}
