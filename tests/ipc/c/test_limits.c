/* The daemon's per-client limit seen through libinferd, and the retry of
 * RESOURCE_EXHAUSTED (INFERD_OPT_RETRY_EXHAUSTED), against a daemon started with
 * [server] max_requests_per_client = 2 and the `slow` model (a 400 ms sleep step).
 *
 *   test_limits ENDPOINT */
#include "testkit.h"

static inferd_call *slow(inferd_client *c, const float *image)
{
    inferd_call *call = cls_call(c, "slow", image);
    CHECK_CODE(INFERD_OK, inferd_submit(call), inferd_client_error(c));
    return call;
}

int main(int argc, char **argv)
{
    CHECK(argc == 2);
    inferd_client *c = connect_or_die(argv[1]);
    float *image = calloc(CLS_ELEMS, sizeof *image);
    CHECK(image != NULL);
    const inferd_tensor x = {"x", INFERD_FLOAT32, 4, CLS_SHAPE, image, CLS_ELEMS * sizeof(float),
                             NULL, NULL};

    /* a third call while two run: refused at once, naming the limit */
    inferd_call *a = slow(c, image), *b = slow(c, image), *third = slow(c, image);
    CHECK_CODE(INFERD_RESOURCE_EXHAUSTED, inferd_wait(third, -1), inferd_call_message(third));
    CHECK_CONTAINS(inferd_call_message(third), "max_requests_per_client = 2");
    printf("exhausted %s\n", inferd_call_message(third));
    CHECK(inferd_call_code(a) == INFERD_AGAIN || inferd_call_code(a) == INFERD_OK);
    inferd_call *call;
    CHECK_CODE(INFERD_RESOURCE_EXHAUSTED, inferd_infer(c, "slow", &x, 1, &call),
               inferd_call_message(call));
    inferd_call_free(call);
    CHECK_CODE(INFERD_OK, inferd_wait(a, -1), inferd_call_message(a));
    CHECK_CODE(INFERD_OK, inferd_wait(b, -1), inferd_call_message(b));
    inferd_call_free(a);
    inferd_call_free(b);
    inferd_call_free(third);

    /* with retries, the same call waits its turn: sent again until a slot frees */
    CHECK_CODE(INFERD_OK, inferd_client_set(c, INFERD_OPT_RETRY_EXHAUSTED, 1), "retry");
    a = slow(c, image);
    b = slow(c, image);
    CHECK_CODE(INFERD_OK, inferd_infer(c, "slow", &x, 1, &call), inferd_call_message(call));
    CHECK(inferd_output_count(call) == 1);
    inferd_call_free(call);
    /* the pauses kept the client's other calls moving: they completed meanwhile */
    CHECK(inferd_call_code(a) == INFERD_OK);
    inferd_call *done;
    CHECK_CODE(INFERD_OK, inferd_wait_any(c, -1, &done), "wait_any");
    CHECK(done == a || done == b);
    CHECK_CODE(INFERD_OK, inferd_wait(b, -1), inferd_call_message(b));
    inferd_call_free(a);
    inferd_call_free(b);
    free(image);
    inferd_client_free(c);
    printf("ok\n");
    return 0;
}
