/* An inferd client in C with libinferd: describes a model's inputs from the daemon,
 * runs ocr-cls on an all-zero 1x3x48x192 float32 image, and prints its two class
 * scores; then sends a few images at once and collects the replies as they come.
 *
 *   make                        # cc inferd_client.c $(pkg-config --cflags --libs inferd)
 *   ./build/inferd_client [ENDPOINT]   # default $INFERD_SOCKET, else /run/inferd/inferd.sock
 *
 * The library: docs/libinferd.md (the wire itself: docs/protocol.md). Exit status 0
 * when every call succeeded, 1 otherwise. */
#include <inferd.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define MODEL "ocr-cls"
#define N (1 * 3 * 48 * 192)
#define BATCH 4

static int fail(const char *what, inferd_code code, const char *message)
{
    fprintf(stderr, "%s: %s: %s\n", what, inferd_code_name(code), message);
    return 1;
}

int main(int argc, char **argv)
{
    inferd_client *client;
    inferd_code rc = inferd_client_new(&client, argc > 1 ? argv[1] : NULL, NULL);
    if (rc != INFERD_OK) {
        fail("connect", rc, inferd_client_error(client));
        inferd_client_free(client);
        return 1;
    }

    /* What the model takes: the models op, parsed. */
    inferd_models *models;
    if ((rc = inferd_models_get(client, 0, &models)) != INFERD_OK)
        return fail("models", rc, inferd_client_error(client));
    const inferd_model_info *m = inferd_models_find(models, MODEL);
    if (m == NULL)
        return fail("models", INFERD_NOT_FOUND, "no model " MODEL " in the repository");
    for (size_t i = 0; i < m->n_inputs; i++) {
        printf("input %s: %s [", m->inputs[i].name, m->inputs[i].dtype_name);
        for (size_t d = 0; d < m->inputs[i].rank; d++)
            printf(d ? ", %lld" : "%lld", (long long)m->inputs[i].dims[d].value);  /* -1: free */
        printf("]\n");
    }
    inferd_models_free(models);

    /* One call, waited. The image is sent in place (no copy): it must stay valid until
     * the call completes, which inferd_infer waits for. */
    float *image = calloc(N, sizeof *image);
    int64_t shape[4] = {1, 3, 48, 192};
    inferd_tensor x = {"x", INFERD_FLOAT32, 4, shape, image, N * sizeof *image, NULL, NULL};
    inferd_call *call;
    rc = inferd_infer(client, MODEL, &x, 1, &call);
    if (rc != INFERD_OK)
        return fail("infer", rc, inferd_call_message(call));
    const inferd_tensor *y = inferd_output(call, 0);
    /* Output frames are not aligned: copy the bytes out, never cast y->data to float *. */
    float scores[2];
    if (y->dtype != INFERD_FLOAT32 || y->size != sizeof scores)
        return fail("infer", INFERD_PROTOCOL_ERROR, "unexpected output");
    memcpy(scores, y->data, sizeof scores);
    printf("scores: %.6f %.6f\n", scores[0], scores[1]);
    inferd_call_free(call);

    /* Several calls in flight; the replies come in any order. */
    inferd_call *calls[BATCH];
    for (int i = 0; i < BATCH; i++) {
        calls[i] = inferd_call_new(client, INFERD_OP_INFER, MODEL);
        if (calls[i] == NULL || inferd_call_add_input(calls[i], &x) != INFERD_OK ||
            inferd_submit(calls[i]) != INFERD_OK)
            return fail("submit", inferd_call_code(calls[i]), inferd_client_error(client));
    }
    int failed = 0;
    for (int done = 0; done < BATCH; done++) {
        inferd_call *c;
        inferd_wait_any(client, -1, &c);
        if (inferd_call_code(c) != INFERD_OK)
            failed |= fail("infer", inferd_call_code(c), inferd_call_message(c));
        else
            printf("reply %s: %zu output(s)\n", inferd_call_id(c), inferd_output_count(c));
    }
    for (int i = 0; i < BATCH; i++)
        inferd_call_free(calls[i]);
    free(image);  /* after the calls completed: they borrowed it */
    inferd_client_free(client);
    return failed;
}
