/* The client side of the fake-ROUTER tests (tests/ipc/test_libinferd_fuzz.py plays the
 * daemon with a Python ROUTER and decides every reply).
 *
 *   router_peer ENDPOINT fuzz N    N pings, one at a time; the router answers each with
 *                                  a generated or mutated reply, then a sentinel reply
 *                                  of the same id. One JSON line per case: what the
 *                                  library made of the reply.
 *   router_peer ENDPOINT order N   N infer calls in flight at once, each with a one-byte
 *                                  uint8 input (its index); the router answers them in a
 *                                  shuffled order, echoing the input as output y; each
 *                                  call must get its own. Waited in submission order.
 *   router_peer ENDPOINT flow N K  N pings with INFERD_OPT_MAX_IN_FLIGHT K; the router
 *                                  checks that never more than K are in flight.
 *   router_peer ENDPOINT shm       a region registered with the router's registration
 *                                  socket; an input in it goes by reference, the outputs
 *                                  come back in it (reversed by the router); then a reply
 *                                  naming a region the client does not have. */
#include <jansson.h>
#include <stdint.h>

#include "testkit.h"

static uint64_t fnv1a(const void *data, size_t size)
{
    const unsigned char *p = data;
    uint64_t h = UINT64_C(14695981039346656037);
    for (size_t i = 0; i < size; i++)
        h = (h ^ p[i]) * UINT64_C(1099511628211);
    return h;
}

/* The verdict on one fuzz case, as a JSON line. */
static void verdict(int i, inferd_call *call)
{
    json_t *v = json_pack("{si}", "case", i);
    inferd_code code = inferd_call_code(call);
    const char *result = inferd_call_result(call);
    json_t *parsed = result ? json_loads(result, JSON_DECODE_ANY, NULL) : NULL;
    CHECK(result == NULL || parsed != NULL);
    if (code == INFERD_OK && json_is_object(parsed) && json_object_get(parsed, "sentinel")) {
        json_object_set_new(v, "verdict", json_string("dropped"));
    } else if (code == INFERD_OK) {
        json_t *outputs = json_array();
        for (size_t k = 0; k < inferd_output_count(call); k++) {
            const inferd_tensor *t = inferd_output(call, k);
            json_t *shape = json_array();
            for (size_t d = 0; d < t->rank; d++)
                json_array_append_new(shape, json_integer(t->shape[d]));
            char hash[17];
            snprintf(hash, sizeof hash, "%016llx", (unsigned long long)fnv1a(t->data, t->size));
            json_array_append_new(outputs, json_pack("{ss ss so ss}", "name", t->name, "dtype",
                                                     inferd_dtype_name(t->dtype), "shape", shape,
                                                     "hash", hash));
            if (t->dtype == INFERD_STRING) {  /* every element reachable */
                uint64_t count;
                CHECK(inferd_shape_elements(t->shape, t->rank, &count) == INFERD_OK);
                for (uint64_t e = 0; e < count; e++) {
                    const char *data;
                    size_t len;
                    CHECK(inferd_output_string(call, k, e, &data, &len) == INFERD_OK);
                    CHECK(data >= (const char *)t->data &&
                          data + len <= (const char *)t->data + t->size);
                }
            } else {
                const void *aligned = inferd_output_aligned(call, k);
                CHECK(t->size == 0 || memcmp(aligned, t->data, t->size) == 0);
            }
        }
        json_object_set_new(v, "verdict", json_string("ok"));
        json_object_set_new(v, "outputs", outputs);
        json_object_set_new(v, "result", parsed ? json_incref(parsed) : json_null());
    } else if (code == INFERD_PROTOCOL_ERROR) {
        json_object_set_new(v, "verdict", json_string("protocol"));
        json_object_set_new(v, "message", json_string(inferd_call_message(call)));
    } else {
        json_object_set_new(v, "verdict", json_string("error"));
        json_object_set_new(v, "code", json_string(inferd_code_name(code)));
        json_object_set_new(v, "message", json_string(inferd_call_message(call)));
    }
    json_decref(parsed);
    char *line = json_dumps(v, JSON_COMPACT | JSON_ENSURE_ASCII);
    CHECK(line != NULL);
    printf("%s\n", line);
    free(line);
    json_decref(v);
}

static void fuzz(inferd_client *c, int n)
{
    for (int i = 0; i < n; i++) {
        inferd_call *call = inferd_call_new(c, INFERD_OP_PING, NULL);
        CHECK(call != NULL);
        CHECK_CODE(INFERD_OK, inferd_submit(call), inferd_client_error(c));
        inferd_code code = inferd_wait(call, -1);
        CHECK(code != INFERD_AGAIN);
        verdict(i, call);
        inferd_call_free(call);
    }
}

static void order(inferd_client *c, int n)
{
    inferd_call **calls = calloc((size_t)n, sizeof *calls);
    unsigned char *bytes = malloc((size_t)n);
    CHECK(calls && bytes);
    for (int i = 0; i < n; i++) {
        calls[i] = inferd_call_new(c, INFERD_OP_INFER, "echo");
        unsigned char *owned = malloc(1);
        CHECK(calls[i] && owned);
        bytes[i] = *owned = (unsigned char)i;
        int64_t shape[1] = {1};
        inferd_tensor x = {"x", INFERD_UINT8, 1, shape, i % 2 ? (void *)owned : &bytes[i], 1,
                           i % 2 ? inferd_free_release : NULL, NULL};
        if (i % 2 == 0)
            free(owned);
        CHECK_CODE(INFERD_OK, inferd_call_add_input(calls[i], &x), inferd_client_error(c));
        CHECK_CODE(INFERD_OK, inferd_submit(calls[i]), inferd_client_error(c));
    }
    for (int i = 0; i < n; i++) {
        CHECK_CODE(INFERD_OK, inferd_wait(calls[i], -1), inferd_call_message(calls[i]));
        const inferd_tensor *y = inferd_output_by_name(calls[i], "y");
        CHECK(y && y->dtype == INFERD_UINT8 && y->size == 1);
        CHECK(*(const unsigned char *)y->data == (unsigned char)i);
        inferd_call_free(calls[i]);
    }
    printf("order ok %d\n", n);
    free(calls);
    free(bytes);
}

static void flow(inferd_client *c, int n, int k)
{
    CHECK_CODE(INFERD_OK, inferd_client_set(c, INFERD_OPT_MAX_IN_FLIGHT, k), "max_in_flight");
    CHECK_CODE(INFERD_INVALID_ARGUMENT, inferd_client_set(c, INFERD_OPT_MAX_IN_FLIGHT, 0), "0");
    inferd_call **calls = calloc((size_t)n, sizeof *calls);
    CHECK(calls);
    for (int i = 0; i < n; i++) {
        calls[i] = inferd_call_new(c, INFERD_OP_PING, NULL);
        CHECK_CODE(INFERD_OK, inferd_submit(calls[i]), inferd_client_error(c));
        /* a slot was free: at most K-1 of the earlier calls are still in flight */
        int in_flight = 0;
        for (int j = 0; j < i; j++)
            in_flight += inferd_call_code(calls[j]) == INFERD_AGAIN;
        CHECK(in_flight <= k - 1);
    }
    int got = 0;
    inferd_call *done;
    while (inferd_wait_any(c, -1, &done) == INFERD_OK) {
        CHECK(inferd_call_code(done) == INFERD_OK);
        got++;
    }
    CHECK(got == n);
    for (int i = 0; i < n; i++)
        inferd_call_free(calls[i]);
    free(calls);
    printf("flow ok %d %d\n", n, k);
}

static void shm(inferd_client *c)
{
    inferd_region *region;
    CHECK_CODE(INFERD_OK, inferd_region_new(c, 1 << 16, &region), inferd_client_error(c));
    unsigned char *base = inferd_region_data(region);
    for (int i = 0; i < 16; i++)
        base[64 + i] = (unsigned char)(i * 3);
    int64_t shape[1] = {16};
    inferd_tensor x = {"x", INFERD_UINT8, 1, shape, base + 64, 16, NULL, NULL};
    for (int round = 0; round < 2; round++) {
        inferd_call *call = inferd_call_new(c, INFERD_OP_INFER, "echo");
        CHECK_CODE(INFERD_OK, inferd_call_add_input(call, &x), inferd_client_error(c));
        CHECK_CODE(INFERD_OK, inferd_call_set_outputs_into(call, region, 4096, 1024), "into");
        CHECK_CODE(INFERD_OK, inferd_submit(call), inferd_client_error(c));
        inferd_code code = inferd_wait(call, -1);
        if (round == 0) {
            CHECK_CODE(INFERD_OK, code, inferd_call_message(call));
            const inferd_tensor *y = inferd_output(call, 0);
            CHECK(y->data == base + 4096 && y->size == 16);
            for (int i = 0; i < 16; i++)
                CHECK(((const unsigned char *)y->data)[i] == (unsigned char)((15 - i) * 3));
        } else {
            CHECK_CODE(INFERD_PROTOCOL_ERROR, code, "unknown region");
            CHECK_CONTAINS(inferd_call_message(call), "which this client has not registered");
        }
        inferd_call_free(call);
    }
    inferd_region_free(region);
    printf("shm ok\n");
}

int main(int argc, char **argv)
{
    CHECK(argc >= 3);
    inferd_client *c = NULL;
    CHECK_CODE(INFERD_OK, inferd_client_new(&c, argv[1], NULL), inferd_client_error(c));
    CHECK_CODE(INFERD_OK, inferd_client_set(c, INFERD_OPT_TIMEOUT_MS, 20000), "timeout");
    int n = argc > 3 ? atoi(argv[3]) : 0;
    if (strcmp(argv[2], "shm") == 0)
        shm(c);
    else if (strcmp(argv[2], "fuzz") == 0)
        fuzz(c, n);
    else if (strcmp(argv[2], "order") == 0)
        order(c, n);
    else if (strcmp(argv[2], "flow") == 0 && argc == 5)
        flow(c, n, atoi(argv[4]));
    else
        return 2;
    inferd_client_free(c);
    return 0;
}
