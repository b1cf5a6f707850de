/* Shared-memory tensors through libinferd against a real daemon: inputs that lie in a
 * registered region travel by reference, outputs_into has the outputs written into it,
 * inputs too big to frame go through a region of the library's own by themselves; the
 * results equal the same call's with frames, bit for bit. Prints the ocr-cls scores of
 * each way as hex for the test to compare with the Python client's, then "ok". The
 * daemon's server.max_message_bytes is 512 KiB.
 *
 *   test_shm ENDPOINT */
#include <stdint.h>
#include <unistd.h>

#include "testkit.h"

static void hex(const char *label, const inferd_tensor *t)
{
    printf("%s", label);
    for (size_t i = 0; i < t->size; i++)
        printf("%02x", ((const unsigned char *)t->data)[i]);
    printf("\n");
}

static inferd_call *run(inferd_client *c, inferd_call *call)
{
    CHECK_CODE(INFERD_OK, inferd_submit(call), inferd_client_error(c));
    CHECK_CODE(INFERD_OK, inferd_wait(call, -1), inferd_call_message(call));
    return call;
}

int main(int argc, char **argv)
{
    CHECK(argc == 2);
    inferd_client *c = connect_or_die(argv[1]);
    /* this client frames whatever the size: "framed" below is in frames */
    CHECK_CODE(INFERD_OK, inferd_client_set(c, INFERD_OPT_MAX_INLINE_BYTES, 0), "option");
    const size_t size = 1 << 20, slot = 256 << 10;
    inferd_region *region;
    CHECK_CODE(INFERD_OK, inferd_region_new(c, size, &region), inferd_client_error(c));
    char *base = inferd_region_data(region);
    CHECK(base != NULL && inferd_region_size(region) == size);
    CHECK((uintptr_t)base % (uintptr_t)sysconf(_SC_PAGESIZE) == 0);

    /* the same image in the region and on the heap */
    float *shared = (float *)base, *heap = malloc(CLS_ELEMS * sizeof *heap);
    for (int i = 0; i < CLS_ELEMS; i++)
        shared[i] = heap[i] = (float)((i * 7919) % 1000) / 1000.0f;
    inferd_call *framed = run(c, cls_call(c, "ocr-cls", heap));
    inferd_call *by_ref = run(c, cls_call(c, "ocr-cls", shared));
    const inferd_tensor *want = inferd_output(framed, 0), *got = inferd_output(by_ref, 0);
    CHECK(got->size == want->size && memcmp(got->data, want->data, want->size) == 0);
    hex("framed ", want);
    hex("shared ", got);

    /* outputs written into the region: at a 64-byte boundary of the slot */
    inferd_call *into = cls_call(c, "ocr-cls", shared);
    CHECK_CODE(INFERD_OK, inferd_call_set_outputs_into(into, region, slot, 4096), "into");
    run(c, into);
    const inferd_tensor *y = inferd_output(into, 0);
    const char *at = y->data;
    CHECK(at >= base + slot && at + y->size <= base + slot + 4096);
    CHECK((uintptr_t)(at - base) % 64 == 0);
    CHECK(y->size == want->size && memcmp(at, want->data, want->size) == 0);
    CHECK(inferd_output_aligned(into, 0) == y->data);  /* no copy: aligned in place */
    hex("into ", y);

    /* inputs over INFERD_OPT_MAX_INLINE_BYTES (default 32 KiB) go into a region of the
     * library's own by themselves, with the same result */
    inferd_client *st = connect_or_die(argv[1]);
    inferd_call *staged = run(st, cls_call(st, "ocr-cls", heap));
    const inferd_tensor *s0 = inferd_output(staged, 0);
    CHECK(s0->size == want->size && memcmp(s0->data, want->data, want->size) == 0);
    hex("staged ", s0);
    /* past the daemon's limit: in frames refused, naming shared memory; staged it runs */
    const size_t n = 200000;  /* 800,000 bytes: over 512 KiB, under twice it */
    float *big = malloc(n * sizeof *big);
    for (size_t i = 0; i < n; i++)
        big[i] = (float)i * 0.5f;
    int64_t bshape[2] = {1, (int64_t)n};
    inferd_tensor bx = {"x", INFERD_FLOAT32, 2, bshape, big, n * sizeof *big, NULL, NULL};
    inferd_call *bf = inferd_call_new(c, INFERD_OP_INFER, "id-float32");
    CHECK_CODE(INFERD_OK, inferd_call_add_input(bf, &bx), inferd_client_error(c));
    CHECK_CODE(INFERD_OK, inferd_submit(bf), inferd_client_error(c));
    CHECK_CODE(INFERD_RESOURCE_EXHAUSTED, inferd_wait(bf, -1), inferd_call_message(bf));
    CHECK_CONTAINS(inferd_call_message(bf), "through shared memory");
    printf("refused %s\n", inferd_call_message(bf));
    for (int round = 0; round < 3; round++) {  /* the region is kept and used again */
        inferd_call *bs = inferd_call_new(st, INFERD_OP_INFER, "id-float32");
        CHECK_CODE(INFERD_OK, inferd_call_add_input(bs, &bx), inferd_client_error(st));
        run(st, bs);
        CHECK(inferd_output(bs, 0)->size == bx.size);
        CHECK(memcmp(inferd_output(bs, 0)->data, big, bx.size) == 0);
        inferd_call_free(bs);
    }
    printf("big staged ok\n");
    /* more calls in flight than the library lends staging regions at once (16): a
     * submit waits for a reply to lend one again */
    enum { MANY = 40 };
    inferd_call *many[MANY];
    for (int i = 0; i < MANY; i++) {
        many[i] = inferd_call_new(st, INFERD_OP_INFER, "id-float32");
        CHECK_CODE(INFERD_OK, inferd_call_add_input(many[i], &bx), inferd_client_error(st));
        CHECK_CODE(INFERD_OK, inferd_submit(many[i]), inferd_client_error(st));
    }
    for (int i = 0; i < MANY; i++) {
        CHECK_CODE(INFERD_OK, inferd_wait(many[i], -1), inferd_call_message(many[i]));
        CHECK(memcmp(inferd_output(many[i], 0)->data, big, bx.size) == 0);
        inferd_call_free(many[i]);
    }
    printf("many staged ok\n");
    inferd_call_free(staged);
    inferd_call_free(bf);
    inferd_client_free(st);
    free(big);

    /* a slot too small: the daemon says so; one past the end: the library does */
    inferd_call *small = cls_call(c, "ocr-cls", shared);
    CHECK_CODE(INFERD_OK, inferd_call_set_outputs_into(small, region, slot, 4), "small");
    CHECK_CODE(INFERD_OK, inferd_submit(small), inferd_client_error(c));
    CHECK_CODE(INFERD_RESOURCE_EXHAUSTED, inferd_wait(small, -1), inferd_call_message(small));
    printf("small %s\n", inferd_call_message(small));
    inferd_call *past = cls_call(c, "ocr-cls", shared);
    CHECK_CODE(INFERD_INVALID_ARGUMENT, inferd_call_set_outputs_into(past, region, size - 8, 64),
               "past");
    CHECK_CONTAINS(inferd_client_error(c), "pass the end of the region");

    /* every other type too: 4-bit ones by reference (packed as on the wire), strings in
     * frames (they cannot live in shared memory) */
    unsigned char *nibbles = (unsigned char *)base + slot + 8192;
    for (int i = 0; i < 8; i++)
        nibbles[i] = (unsigned char)(0x10 * (i % 16) + (15 - i % 16));
    int64_t shape[2] = {2, 8};
    inferd_tensor x4 = {"x", INFERD_INT4, 2, shape, nibbles, 8, NULL, NULL};
    inferd_call *c4 = inferd_call_new(c, INFERD_OP_INFER, "id-int4");
    CHECK_CODE(INFERD_OK, inferd_call_add_input(c4, &x4), inferd_client_error(c));
    run(c, c4);
    CHECK(inferd_output(c4, 0)->size == 8 && memcmp(inferd_output(c4, 0)->data, nibbles, 8) == 0);
    const char *words[] = {"Z\xc3\xbcrich", ""};
    void *packed;
    size_t packed_size;
    CHECK(inferd_strings_pack(words, NULL, 2, &packed, &packed_size) == INFERD_OK);
    memcpy(base + slot + 16384, packed, packed_size);
    inferd_free(packed);
    int64_t sshape[2] = {1, 2};
    inferd_tensor xs = {"x", INFERD_STRING, 2, sshape, base + slot + 16384, packed_size, NULL, NULL};
    inferd_call *cs = inferd_call_new(c, INFERD_OP_INFER, "id-string");
    CHECK_CODE(INFERD_OK, inferd_call_add_input(cs, &xs), inferd_client_error(c));
    CHECK_CODE(INFERD_OK, inferd_call_set_outputs_into(cs, region, slot, 4096), "into");
    run(c, cs);
    const char *word;
    size_t len;
    CHECK(inferd_output_string(cs, 0, 0, &word, &len) == INFERD_OK && len == 7);
    CHECK(memcmp(word, "Z\xc3\xbcrich", 7) == 0);

    /* at most 64 regions per client: the daemon's limit, with its message */
    inferd_region *more[64];
    int made = 0;
    inferd_code rc;
    while ((rc = inferd_region_new(c, 4096, &more[made])) == INFERD_OK) {
        made++;
        CHECK(made < 64);
    }
    CHECK(made == 63 && rc == INFERD_RESOURCE_EXHAUSTED);
    CHECK_CONTAINS(inferd_client_error(c), "at most 64 regions");
    printf("regions %d more, then %s\n", made, inferd_client_error(c));
    for (int i = 0; i < made; i++)
        inferd_region_free(more[i]);
    CHECK_CODE(INFERD_OK, inferd_region_new(c, 4096, &more[0]), inferd_client_error(c));
    inferd_region_free(more[0]);

    /* a client that is not on an ipc:// endpoint has no shared memory */
    inferd_client *tcp = NULL;
    CHECK_CODE(INFERD_OK, inferd_client_new(&tcp, "tcp://127.0.0.1:9", NULL), "tcp");
    inferd_region *none = (inferd_region *)1;
    CHECK_CODE(INFERD_UNSUPPORTED, inferd_region_new(tcp, 4096, &none), "tcp");
    CHECK(none == NULL);
    inferd_client_free(tcp);

    inferd_call *calls[] = {framed, by_ref, into, small, past, c4, cs};
    for (size_t i = 0; i < sizeof calls / sizeof calls[0]; i++)
        inferd_call_free(calls[i]);
    free(heap);
    inferd_region_free(region);
    inferd_client_free(c);
    printf("ok\n");
    return 0;
}
