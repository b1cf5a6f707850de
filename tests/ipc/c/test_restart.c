/* A daemon restart under a connected client. The test drives it through stdin and
 * stdout: the program prints "stop-daemon" and waits for a line, then (daemon gone)
 * submits a call, prints "start-daemon" and waits for a line again.
 *
 *   test_restart ENDPOINT
 *
 * A call in flight when the daemon stops completes once, at once: with the daemon's
 * reply (it answers what it holds at shutdown) or, if none came, UNAVAILABLE for the
 * lost connection. A call made while no daemon runs waits in libzmq and reaches the new
 * one; the client reconnects by itself. Prints "slow CODE", "queued CODE", then "ok". */
#include <time.h>

#include "testkit.h"

static void handshake(const char *say)
{
    char line[64];
    printf("%s\n", say);
    fflush(stdout);
    CHECK(fgets(line, sizeof line, stdin) != NULL);
}

int main(int argc, char **argv)
{
    CHECK(argc == 2);
    inferd_client *c = connect_or_die(argv[1]);
    float *image = calloc(CLS_ELEMS, sizeof *image);
    const inferd_tensor x = {"x", INFERD_FLOAT32, 4, CLS_SHAPE, image, CLS_ELEMS * sizeof(float),
                             NULL, NULL};
    inferd_call *call;
    CHECK_CODE(INFERD_OK, inferd_infer(c, "ocr-cls", &x, 1, &call), inferd_call_message(call));
    inferd_call_free(call);
    CHECK(inferd_client_connected(c) == 1);
    /* a shared-memory region: the restarted daemon knows it no more */
    inferd_region *region;
    CHECK_CODE(INFERD_OK, inferd_region_new(c, 1 << 18, &region), inferd_client_error(c));
    float *shared = inferd_region_data(region);
    inferd_call *before = cls_call(c, "ocr-cls", shared);
    CHECK_CODE(INFERD_OK, inferd_call_set_outputs_into(before, region, 1 << 17, 4096), "into");
    CHECK_CODE(INFERD_OK, inferd_submit(before), inferd_client_error(c));
    CHECK_CODE(INFERD_OK, inferd_wait(before, -1), inferd_call_message(before));

    inferd_call *slow = cls_call(c, "slow", image);
    CHECK_CODE(INFERD_OK, inferd_submit(slow), inferd_client_error(c));
    handshake("stop-daemon");

    /* the daemon's own reply at shutdown, or UNAVAILABLE for the lost connection: no
     * waiting out the call's 30 s deadline */
    inferd_code code = inferd_wait(slow, -1);
    printf("slow %s %s\n", inferd_code_name(code), inferd_call_message(slow));
    CHECK(code == INFERD_OK || code == INFERD_UNAVAILABLE);
    for (int i = 0; inferd_client_connected(c); i++) {  /* libzmq's report may lag */
        CHECK(i < 60000);
        struct timespec ms = {0, 1000000};
        nanosleep(&ms, NULL);
    }
    inferd_call *queued = inferd_call_new(c, INFERD_OP_PING, NULL);
    CHECK_CODE(INFERD_OK, inferd_call_set_timeout(queued, 120000), "timeout");
    CHECK_CODE(INFERD_OK, inferd_submit(queued), inferd_client_error(c));
    handshake("start-daemon");

    code = inferd_wait(queued, -1);
    printf("queued %s %s\n", inferd_code_name(code), inferd_call_message(queued));
    CHECK_CONTAINS(inferd_call_result(queued), "\"pong\":true");
    inferd_call_free(slow);
    inferd_call_free(queued);
    CHECK_CODE(INFERD_OK, inferd_infer(c, "ocr-cls", &x, 1, &call), inferd_call_message(call));
    inferd_call_free(call);
    /* the region is registered again by itself: the same call, the same bits */
    inferd_call *after = cls_call(c, "ocr-cls", shared);
    CHECK_CODE(INFERD_OK, inferd_call_set_outputs_into(after, region, 1 << 16, 4096), "into");
    CHECK_CODE(INFERD_OK, inferd_submit(after), inferd_client_error(c));
    CHECK_CODE(INFERD_OK, inferd_wait(after, -1), inferd_call_message(after));
    const inferd_tensor *y0 = inferd_output(before, 0), *y1 = inferd_output(after, 0);
    CHECK(y1->size == y0->size && memcmp(y0->data, y1->data, y0->size) == 0);
    CHECK((const char *)y1->data >= (const char *)shared + (1 << 16));
    printf("region registered again\n");
    inferd_call_free(before);
    inferd_call_free(after);
    inferd_region_free(region);
    int ready = 0;
    CHECK_CODE(INFERD_OK, inferd_ping(c, &ready), inferd_client_error(c));
    CHECK(ready && inferd_client_connected(c) == 1);
    free(image);
    inferd_client_free(c);
    printf("ok\n");
    return 0;
}
