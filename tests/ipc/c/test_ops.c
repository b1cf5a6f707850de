/* Every op through libinferd against a real daemon (tests/ipc/test_libinferd.py starts
 * it with libinferd_kit's repository, ocr-cls and slow preloaded), the errors a caller
 * meets, and the deadlines. Prints "ok" and a few figures the test checks against the
 * Python client.
 *
 *   test_ops ENDPOINT */
#include <stdint.h>
#include <time.h>
#include <unistd.h>

#include "testkit.h"

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + ts.tv_nsec / 1e9;
}

static void check_vocabulary(void)
{
    CHECK(strcmp(inferd_code_name(INFERD_NOT_FOUND), "NOT_FOUND") == 0);
    CHECK(strcmp(inferd_code_name((inferd_code)77), "UNKNOWN") == 0);
    CHECK(inferd_dtype_from_name("float16", 7) == INFERD_FLOAT16);
    CHECK(inferd_dtype_from_name("float1", 6) == INFERD_DTYPE_INVALID);
    CHECK(inferd_dtype_from_name("float32x", 7) == INFERD_FLOAT32);  /* LEN bytes only */
    CHECK(inferd_dtype_size(INFERD_UINT64) == 8 && inferd_dtype_size(INFERD_STRING) == 0);
    CHECK(inferd_dtype_name((inferd_dtype)99) == NULL);
    CHECK(inferd_dtype_from_name("float8_e5m2fnuz", 15) == INFERD_FLOAT8_E5M2FNUZ);
    CHECK(inferd_dtype_size(INFERD_BFLOAT16) == 2 && inferd_dtype_size(INFERD_INT4) == 0);
    uint64_t bytes;
    CHECK(inferd_frame_size(INFERD_UINT4, 7, &bytes) == INFERD_OK && bytes == 4);
    CHECK(inferd_frame_size(INFERD_INT4, 0, &bytes) == INFERD_OK && bytes == 0);
    /* issue 31, item 13: the 2-bit types four per byte, float4e2m1 two, e8m0 one */
    CHECK(inferd_frame_size(INFERD_INT2, 5, &bytes) == INFERD_OK && bytes == 2);
    CHECK(inferd_frame_size(INFERD_UINT2, 8, &bytes) == INFERD_OK && bytes == 2);
    CHECK(inferd_frame_size(INFERD_FLOAT4_E2M1FN, 3, &bytes) == INFERD_OK && bytes == 2);
    CHECK(inferd_frame_size(INFERD_FLOAT8_E8M0FNU, 3, &bytes) == INFERD_OK && bytes == 3);
    CHECK(inferd_dtype_from_name("uint2", 5) == INFERD_UINT2);
    CHECK(strcmp(inferd_dtype_name(INFERD_FLOAT4_E2M1FN), "float4_e2m1fn") == 0);
    CHECK(inferd_frame_size(INFERD_FLOAT64, 3, &bytes) == INFERD_OK && bytes == 24);
    CHECK(inferd_frame_size(INFERD_STRING, 3, &bytes) == INFERD_INVALID_ARGUMENT);
    CHECK(strcmp(inferd_version(), "0.2.0") == 0);
    uint64_t n;
    int64_t shape[3] = {2, 0, 5};
    CHECK(inferd_shape_elements(shape, 3, &n) == INFERD_OK && n == 0);
    int64_t big[2] = {INT64_C(1) << 40, INT64_C(1) << 9};
    CHECK(inferd_shape_elements(big, 2, &n) == INFERD_INVALID_ARGUMENT);
    CHECK(inferd_shape_elements(NULL, 0, &n) == INFERD_OK && n == 1);
    const char *words[] = {"Hi", "", "Z\xc3\xbcrich"};
    void *packed;
    size_t size;
    CHECK(inferd_strings_pack(words, NULL, 3, &packed, &size) == INFERD_OK && size == 21);
    CHECK(memcmp(packed, "\x02\0\0\0Hi\0\0\0\0\x07\0\0\0Z\xc3\xbcrich", 21) == 0);
    inferd_free(packed);
    const char *bad[] = {"\xff"};
    CHECK(inferd_strings_pack(bad, NULL, 1, &packed, &size) == INFERD_INVALID_ARGUMENT);
}

static void check_control_ops(inferd_client *c)
{
    int ready = 0;
    CHECK_CODE(INFERD_OK, inferd_ping(c, &ready), inferd_client_error(c));
    CHECK(ready == 1);

    inferd_status *st;
    CHECK_CODE(INFERD_OK, inferd_status_get(c, &st), inferd_client_error(c));
    CHECK(st->ready == 1 && st->pid > 0 && st->version != NULL && st->uptime_s > 0);
    CHECK(st->n_loaded >= 2);
    int has_cls = 0;
    for (size_t i = 0; i < st->n_loaded; i++)
        has_cls |= strcmp(st->loaded_models[i], "ocr-cls") == 0;
    CHECK(has_cls && st->loaded_models[st->n_loaded] == NULL);
    CHECK_CONTAINS(st->json, "\"backends\"");
    printf("status pid %lld version %s\n", (long long)st->pid, st->version);
    inferd_status_free(st);

    /* another test of the same daemon may have loaded it */
    inferd_call *call;
    CHECK_CODE(INFERD_OK, inferd_control(c, INFERD_OP_UNLOAD, "id-uint16", &call),
               inferd_call_message(call));
    inferd_call_free(call);
    inferd_models *m;
    CHECK_CODE(INFERD_OK, inferd_models_get(c, 0, &m), inferd_client_error(c));
    const inferd_model_info *cls = inferd_models_find(m, "ocr-cls");
    CHECK(cls && strcmp(cls->state, "ready") == 0 && cls->version == 1 && cls->kind == NULL);
    CHECK(cls->n_inputs == 1 && strcmp(cls->inputs[0].name, "x") == 0);
    CHECK(cls->inputs[0].dtype == INFERD_FLOAT32 && cls->inputs[0].rank == 4);
    CHECK(cls->inputs[0].dims[1].value == 3 && cls->inputs[0].dims[2].value == -1);
    CHECK(cls->n_outputs == 1 && cls->outputs[0].dtype == INFERD_FLOAT32);
    const inferd_model_info *id = inferd_models_find(m, "id-uint16");
    CHECK(id && strcmp(id->state, "unloaded") == 0);
    CHECK(inferd_models_find(m, "no-such") == NULL && inferd_models_at(m, 1000) == NULL);
    for (size_t i = 0; i < inferd_models_count(m); i++)
        printf("model %s %s\n", inferd_models_at(m, i)->name, inferd_models_at(m, i)->state);
    inferd_models_free(m);

    /* load gives the entry; models then shows the dims, symbolic ones by name */
    CHECK_CODE(INFERD_OK, inferd_control(c, INFERD_OP_LOAD, "id-uint16", &call),
               inferd_call_message(call));
    CHECK_CONTAINS(inferd_call_result(call), "\"state\":\"ready\"");
    inferd_call_free(call);
    CHECK_CODE(INFERD_OK, inferd_models_get(c, 1, &m), inferd_client_error(c));
    id = inferd_models_find(m, "id-uint16");
    CHECK(id && strcmp(id->state, "ready") == 0 && id->inputs[0].dtype == INFERD_UINT16);
    CHECK(id->inputs[0].rank == 2 && id->inputs[0].dims[0].value == -1);
    CHECK(strcmp(id->inputs[0].dims[0].symbol, "N") == 0);
    CHECK(strcmp(id->inputs[0].dtype_name, "uint16") == 0);
    inferd_models_free(m);
    CHECK_CODE(INFERD_OK, inferd_control(c, INFERD_OP_UNLOAD, "id-uint16", &call),
               inferd_call_message(call));
    CHECK_CONTAINS(inferd_call_result(call), "\"state\":\"unloaded\"");
    inferd_call_free(call);

    CHECK_CODE(INFERD_OK, inferd_control(c, INFERD_OP_RELOAD, NULL, &call),
               inferd_call_message(call));
    CHECK_CONTAINS(inferd_call_result(call), "\"added\"");
    inferd_call_free(call);
    CHECK_CODE(INFERD_OK, inferd_control(c, INFERD_OP_BACKENDS, NULL, &call),
               inferd_call_message(call));
    CHECK_CONTAINS(inferd_call_result(call), "\"candidates\"");
    inferd_call_free(call);
    CHECK_CODE(INFERD_OK, inferd_control(c, INFERD_OP_METRICS, NULL, &call),
               inferd_call_message(call));
    CHECK_CONTAINS(inferd_call_result(call), "inferd_requests_total");
    inferd_call_free(call);
    /* a control op with a parameter: models with verbose shows placements */
    call = inferd_call_new(c, INFERD_OP_MODELS, NULL);
    CHECK_CODE(INFERD_OK, inferd_call_set_param(call, "verbose", "true"), "param");
    CHECK_CODE(INFERD_INVALID_ARGUMENT, inferd_call_set_param(call, "id", "\"x\""), "reserved");
    CHECK_CODE(INFERD_INVALID_ARGUMENT, inferd_call_set_param(call, "k", "{bad"), "json");
    CHECK_CODE(INFERD_OK, inferd_submit(call), inferd_client_error(c));
    CHECK_CODE(INFERD_OK, inferd_wait(call, -1), inferd_call_message(call));
    CHECK_CONTAINS(inferd_call_result(call), "\"placement\"");
    inferd_call_free(call);
}

static void check_errors(inferd_client *c, const float *image)
{
    inferd_call *call;
    /* the daemon's errors: code and message */
    CHECK_CODE(INFERD_NOT_FOUND, inferd_control(c, INFERD_OP_LOAD, "no-such-model", &call),
               inferd_call_message(call));
    CHECK_CONTAINS(inferd_call_message(call), "model 'no-such-model' not found");
    CHECK(inferd_call_result(call) == NULL && inferd_output_count(call) == 0);
    printf("not-found %s\n", inferd_call_message(call));
    inferd_call_free(call);
    CHECK_CODE(INFERD_INVALID_ARGUMENT, inferd_control(c, INFERD_OP_LOAD, "../etc", &call),
               inferd_call_message(call));
    inferd_call_free(call);
    call = inferd_call_new(c, INFERD_OP_INFER, "ocr-cls");
    int64_t shape[4] = {1, 3, 48, 100};
    inferd_tensor x = {"x", INFERD_FLOAT32, 4, shape, image, 1 * 3 * 48 * 100 * sizeof(float),
                       NULL, NULL};
    CHECK_CODE(INFERD_OK, inferd_call_add_input(call, &x), inferd_client_error(c));
    inferd_tensor extra = {"bogus", INFERD_INT8, 0, NULL, image, 1, NULL, NULL};
    CHECK_CODE(INFERD_OK, inferd_call_add_input(call, &extra), inferd_client_error(c));
    CHECK_CODE(INFERD_OK, inferd_submit(call), inferd_client_error(c));
    CHECK_CODE(INFERD_INVALID_ARGUMENT, inferd_wait(call, -1), inferd_call_message(call));
    CHECK_CONTAINS(inferd_call_message(call), "bogus");
    printf("invalid %s\n", inferd_call_message(call));
    inferd_call_free(call);
    call = cls_call(c, "ocr-cls", image);
    CHECK_CODE(INFERD_OK, inferd_call_set_version(call, 7), "version");
    CHECK_CODE(INFERD_OK, inferd_submit(call), inferd_client_error(c));
    CHECK_CODE(INFERD_NOT_FOUND, inferd_wait(call, -1), inferd_call_message(call));
    inferd_call_free(call);

    /* the library's own checks, before anything is sent */
    call = inferd_call_new(c, INFERD_OP_INFER, "ocr-cls");
    inferd_tensor wrong = {"x", INFERD_FLOAT32, 4, CLS_SHAPE, image, 12, NULL, NULL};
    CHECK_CODE(INFERD_INVALID_ARGUMENT, inferd_call_add_input(call, &wrong), "size");
    CHECK_CONTAINS(inferd_client_error(c), "but its data has 12");
    inferd_tensor nodtype = {"x", (inferd_dtype)42, 0, NULL, image, 4, NULL, NULL};
    CHECK_CODE(INFERD_INVALID_ARGUMENT, inferd_call_add_input(call, &nodtype), "dtype");
    int64_t negative[1] = {-1};
    inferd_tensor neg = {"x", INFERD_UINT8, 1, negative, image, 0, NULL, NULL};
    CHECK_CODE(INFERD_INVALID_ARGUMENT, inferd_call_add_input(call, &neg), "shape");
    inferd_tensor ok = {"x", INFERD_FLOAT32, 4, CLS_SHAPE, image, CLS_ELEMS * 4, NULL, NULL};
    CHECK_CODE(INFERD_OK, inferd_call_add_input(call, &ok), "ok");
    CHECK_CODE(INFERD_INVALID_ARGUMENT, inferd_call_add_input(call, &ok), "twice");
    CHECK_CODE(INFERD_INVALID_ARGUMENT, inferd_call_set_version(call, 0), "version 0");
    CHECK_CODE(INFERD_INVALID_ARGUMENT, inferd_wait(call, 0), "not submitted");
    CHECK(inferd_call_code(call) == INFERD_AGAIN && strcmp(inferd_call_id(call), "") == 0);
    CHECK_CODE(INFERD_OK, inferd_submit(call), inferd_client_error(c));
    CHECK_CODE(INFERD_INVALID_ARGUMENT, inferd_submit(call), "twice");
    CHECK_CODE(INFERD_OK, inferd_wait(call, -1), inferd_call_message(call));
    CHECK(strncmp(inferd_call_id(call), "", 1) != 0 && inferd_output_count(call) == 1);
    inferd_call_free(call);
    CHECK(inferd_call_new(c, (inferd_op)0, NULL) == NULL);

    /* an endpoint without a daemon fails at once, with the reason */
    inferd_client *none = NULL;
    CHECK_CODE(INFERD_UNAVAILABLE, inferd_client_new(&none, "ipc:///nonexistent/inferd.sock",
                                                     NULL), "no socket");
    CHECK_CONTAINS(inferd_client_error(none), "no inferd socket at /nonexistent/inferd.sock");
    inferd_client_free(none);
}

static void check_deadlines(inferd_client *c, const float *image)
{
    /* the daemon's deadline: a call queued behind a slow one past its timeout_ms */
    inferd_call *first = cls_call(c, "slow", image), *late = cls_call(c, "slow", image);
    CHECK_CODE(INFERD_OK, inferd_call_set_timeout(late, 50), "timeout");
    CHECK_CODE(INFERD_OK, inferd_submit(first), inferd_client_error(c));
    CHECK_CODE(INFERD_OK, inferd_submit(late), inferd_client_error(c));
    CHECK_CODE(INFERD_DEADLINE_EXCEEDED, inferd_wait(late, -1), inferd_call_message(late));
    printf("deadline %s\n", inferd_call_message(late));
    CHECK_CODE(INFERD_OK, inferd_wait(first, -1), inferd_call_message(first));
    inferd_call_free(first);
    inferd_call_free(late);

    /* inferd_wait with a timeout: AGAIN while in flight, then the reply */
    inferd_call *call = cls_call(c, "slow", image);
    CHECK_CODE(INFERD_OK, inferd_submit(call), inferd_client_error(c));
    CHECK_CODE(INFERD_AGAIN, inferd_wait(call, 0), "in flight");
    CHECK(inferd_call_code(call) == INFERD_AGAIN && inferd_output_count(call) == 0);
    CHECK_CODE(INFERD_AGAIN, inferd_wait(call, 20), "in flight");
    CHECK_CODE(INFERD_OK, inferd_wait(call, -1), inferd_call_message(call));
    inferd_call_free(call);

    /* the client's own deadline: an endpoint nobody serves (a plain file: libzmq's
     * connect fails and retries, and queues the call meanwhile) */
    char path[] = "/tmp/libinferd-silent-XXXXXX";
    int fd = mkstemp(path);
    CHECK(fd >= 0);
    close(fd);
    char endpoint[64];
    snprintf(endpoint, sizeof endpoint, "ipc://%s", path);
    inferd_client *silent;
    CHECK_CODE(INFERD_OK, inferd_client_new(&silent, endpoint, NULL), inferd_client_error(silent));
    CHECK_CODE(INFERD_OK, inferd_client_set(silent, INFERD_OPT_TIMEOUT_MS, 100), "timeout");
    CHECK_CODE(INFERD_INVALID_ARGUMENT, inferd_client_set(silent, INFERD_OPT_TIMEOUT_MS, 0), "0");
    double t0 = now_s();
    /* a borrowed input libzmq still queues when the call ends: the library resets the
     * connection before handing the call back, so the buffer is free to go */
    float *borrowed = calloc(CLS_ELEMS, sizeof *borrowed);
    inferd_call *lost = cls_call(silent, "ocr-cls", borrowed);
    inferd_call *other = inferd_call_new(silent, INFERD_OP_PING, NULL);
    CHECK_CODE(INFERD_OK, inferd_call_set_timeout(other, 60000), "timeout");
    CHECK_CODE(INFERD_OK, inferd_submit(lost), inferd_client_error(silent));
    CHECK_CODE(INFERD_OK, inferd_submit(other), inferd_client_error(silent));
    CHECK_CODE(INFERD_DEADLINE_EXCEEDED, inferd_wait(lost, -1), inferd_call_message(lost));
    double waited = now_s() - t0;
    CHECK_CONTAINS(inferd_call_message(lost), "within the client timeout");
    printf("client-deadline %.3f %s\n", waited, inferd_call_message(lost));
    CHECK(waited >= 1.1);  /* timeout + the 1 s grace for the daemon's own reply */
    /* the reset ended the other call in flight, with the reason */
    CHECK_CODE(INFERD_UNAVAILABLE, inferd_wait(other, 0), inferd_call_message(other));
    CHECK_CONTAINS(inferd_call_message(other), "the connection was reset");
    inferd_call_free(lost);
    inferd_call_free(other);
    free(borrowed);

    /* calls outlive their client: in flight they end CANCELLED, unsent they refuse */
    inferd_call *pending = inferd_call_new(silent, INFERD_OP_PING, NULL);
    inferd_call *unsent = inferd_call_new(silent, INFERD_OP_INFER, "ocr-cls");
    CHECK_CODE(INFERD_OK, inferd_submit(pending), inferd_client_error(silent));
    inferd_client_free(silent);
    CHECK(inferd_call_client(pending) == NULL && inferd_call_client(unsent) == NULL);
    CHECK_CODE(INFERD_CANCELLED, inferd_wait(pending, -1), inferd_call_message(pending));
    CHECK_CONTAINS(inferd_call_message(pending), "the client was closed");
    inferd_tensor bad = {"x", INFERD_FLOAT32, 0, NULL, image, 3, NULL, NULL};
    CHECK_CODE(INFERD_INVALID_ARGUMENT, inferd_call_add_input(unsent, &bad), "no client");
    CHECK_CODE(INFERD_CANCELLED, inferd_submit(unsent), "no client");
    inferd_call_free(pending);
    inferd_call_free(unsent);
    unlink(path);
}

int main(int argc, char **argv)
{
    CHECK(argc == 2);
    check_vocabulary();
    inferd_client *c = connect_or_die(argv[1]);
    CHECK(strcmp(inferd_client_endpoint(c), argv[1]) == 0);
    float *image = calloc(CLS_ELEMS, sizeof *image);
    check_control_ops(c);
    check_errors(c, image);
    check_deadlines(c, image);
    free(image);
    inferd_client_free(c);
    printf("ok\n");
    return 0;
}
