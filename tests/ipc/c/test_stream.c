/* Streams through libinferd against a real daemon (tests/ipc/test_libinferd.py: the kit's
 * repository, whose vad has the demo model.toml's [stream]): a whole stream of chunks,
 * each output written for the test to compare with the Python client's stream bit for
 * bit; a chunk of the wrong length refused with the stream kept; a stream the daemon
 * does not hold; a stream whose model is unloaded under it (state lost, then started
 * again); a reset; a model without [stream]; the library's own checks; a stream that
 * outlives its client.
 *
 *   test_stream ENDPOINT AUDIO PROBS
 *
 * AUDIO: float32 samples, a multiple of 512; PROBS: one float32 per chunk, written. */
#include <stdint.h>

#include "testkit.h"

#define CHUNK 512

static int64_t chunk_shape[2] = {1, CHUNK};

static inferd_tensor chunk_of(const float *samples)
{
    inferd_tensor t = {"input", INFERD_FLOAT32, 2, chunk_shape, samples, CHUNK * sizeof(float),
                       NULL, NULL};
    return t;
}

/* The stream's output of CALL (one float: Silero's speech probability), checking that
 * nothing of its state came back. */
static float probability(inferd_call *call)
{
    CHECK(inferd_output_count(call) == 1);
    const inferd_tensor *y = inferd_output_by_name(call, "output");
    CHECK(y != NULL && y->dtype == INFERD_FLOAT32 && y->size == sizeof(float));
    float p;
    memcpy(&p, y->data, sizeof p);
    return p;
}

/* sr = 16000 as an int64 scalar the library takes over (freed with inferd_free). */
static inferd_tensor owned_sr(void)
{
    int64_t *sr = malloc(sizeof *sr);
    CHECK(sr != NULL);
    *sr = 16000;
    inferd_tensor t = {"sr", INFERD_INT64, 0, NULL, sr, sizeof *sr, inferd_free_release, NULL};
    return t;
}

static void whole_stream(inferd_client *c, const float *audio, size_t n_chunks,
                         const char *probs_path)
{
    inferd_tensor sr = owned_sr();
    inferd_stream *s;
    CHECK_CODE(INFERD_OK, inferd_stream_open(c, "vad", NULL, &sr, 1, &s),
               inferd_client_error(c));
    const char *id = inferd_stream_id(s);
    CHECK(strlen(id) > 0 && strlen(id) <= INFERD_STREAM_ID_MAX);
    FILE *out = fopen(probs_path, "wb");
    CHECK(out != NULL);
    for (size_t i = 0; i < n_chunks; i++) {
        if (i == 3) {  /* a chunk of the wrong length: refused, the stream goes on */
            int64_t short_shape[2] = {1, 100};
            inferd_tensor bad = {"input", INFERD_FLOAT32, 2, short_shape, audio,
                                 100 * sizeof(float), NULL, NULL};
            inferd_call *call;
            CHECK_CODE(INFERD_INVALID_ARGUMENT, inferd_stream_infer(s, &bad, 1, &call),
                       inferd_call_message(call));
            printf("short chunk: %s\n", inferd_call_message(call));
            inferd_call_free(call);
        }
        inferd_tensor x = chunk_of(audio + i * CHUNK);
        inferd_call *call;
        CHECK_CODE(INFERD_OK, inferd_stream_infer(s, &x, 1, &call), inferd_call_message(call));
        float p = probability(call);
        CHECK(fwrite(&p, sizeof p, 1, out) == 1);
        inferd_call_free(call);
    }
    CHECK(fclose(out) == 0);
    printf("stream: %s, %zu chunks\n", id, n_chunks);
    CHECK_CODE(INFERD_OK, inferd_stream_close(s), inferd_client_error(c));
}

static void not_held_lost_and_reset(inferd_client *c, const float *audio)
{
    /* a call naming a stream the daemon does not hold, without start */
    inferd_call *call = inferd_call_new(c, INFERD_OP_INFER, "vad");
    CHECK(call != NULL);
    CHECK_CODE(INFERD_OK, inferd_call_set_stream(call, "never-started", 0, 0),
               inferd_client_error(c));
    inferd_tensor x = chunk_of(audio);
    CHECK_CODE(INFERD_OK, inferd_call_add_input(call, &x), inferd_client_error(c));
    CHECK_CODE(INFERD_OK, inferd_submit(call), inferd_call_message(call));
    CHECK_CODE(INFERD_FAILED_PRECONDITION, inferd_wait(call, -1), inferd_call_message(call));
    CHECK_CONTAINS(inferd_call_message(call), "never-started");
    printf("not held: %s\n", inferd_call_message(call));
    inferd_call_free(call);

    int64_t sr_value = 16000;
    inferd_tensor sr = {"sr", INFERD_INT64, 0, NULL, &sr_value, sizeof sr_value, NULL, NULL};
    inferd_stream *s;
    CHECK_CODE(INFERD_OK, inferd_stream_open(c, "vad", "c-restart.1", &sr, 1, &s),
               inferd_client_error(c));
    CHECK(strcmp(inferd_stream_id(s), "c-restart.1") == 0);
    float first[3], again;
    for (int i = 0; i < 3; i++) {
        x = chunk_of(audio + i * CHUNK);
        CHECK_CODE(INFERD_OK, inferd_stream_infer(s, &x, 1, &call), inferd_call_message(call));
        first[i] = probability(call);
        inferd_call_free(call);
    }
    /* the model unloaded under the stream: its state is lost, said once; the next call
     * starts it again (the first chunk's answer again: the state is back to zeros) */
    CHECK_CODE(INFERD_OK, inferd_control(c, INFERD_OP_UNLOAD, "vad", &call),
               inferd_call_message(call));
    inferd_call_free(call);
    x = chunk_of(audio + 3 * CHUNK);
    CHECK_CODE(INFERD_FAILED_PRECONDITION, inferd_stream_infer(s, &x, 1, &call),
               inferd_call_message(call));
    CHECK_CONTAINS(inferd_call_message(call), "start the stream again");
    printf("lost: %s\n", inferd_call_message(call));
    inferd_call_free(call);
    x = chunk_of(audio);
    CHECK_CODE(INFERD_OK, inferd_stream_infer(s, &x, 1, &call), inferd_call_message(call));
    again = probability(call);
    inferd_call_free(call);
    CHECK(memcmp(&again, &first[0], sizeof again) == 0);
    /* a reset does the same at once */
    x = chunk_of(audio + CHUNK);
    CHECK_CODE(INFERD_OK, inferd_stream_infer(s, &x, 1, &call), inferd_call_message(call));
    CHECK(probability(call) == first[1]);
    inferd_call_free(call);
    inferd_stream_reset(s);
    x = chunk_of(audio);
    CHECK_CODE(INFERD_OK, inferd_stream_infer(s, &x, 1, &call), inferd_call_message(call));
    again = probability(call);
    inferd_call_free(call);
    CHECK(memcmp(&again, &first[0], sizeof again) == 0);
    CHECK_CODE(INFERD_OK, inferd_stream_close(s), inferd_client_error(c));
}

static void refusals(inferd_client *c, const float *audio)
{
    inferd_stream *s = (inferd_stream *)1;
    int64_t sr_value = 16000;
    inferd_tensor sr = {"sr", INFERD_INT64, 0, NULL, &sr_value, sizeof sr_value, NULL, NULL};
    CHECK_CODE(INFERD_INVALID_ARGUMENT, inferd_stream_open(c, "vad", "bad id!", &sr, 1, &s),
               "a bad id");
    CHECK(s == NULL);
    CHECK_CONTAINS(inferd_client_error(c), "[A-Za-z0-9._-]");
    char long_id[INFERD_STREAM_ID_MAX + 2];
    memset(long_id, 'a', sizeof long_id - 1);
    long_id[sizeof long_id - 1] = '\0';
    CHECK_CODE(INFERD_INVALID_ARGUMENT, inferd_stream_open(c, "vad", long_id, &sr, 1, &s),
               "a long id");
    inferd_tensor wrong = sr;
    wrong.size = 4;  /* int64 scalar in 4 bytes; owned: released even though refused */
    wrong.data = malloc(4);
    wrong.release = inferd_free_release;
    CHECK_CODE(INFERD_INVALID_ARGUMENT, inferd_stream_open(c, "vad", NULL, &wrong, 1, &s),
               "a constant of the wrong size");

    inferd_call *call = inferd_call_new(c, INFERD_OP_INFER, "vad");
    CHECK_CODE(INFERD_INVALID_ARGUMENT, inferd_call_set_param(call, "stream", "{}"), "param");
    CHECK_CONTAINS(inferd_client_error(c), "own setter");
    inferd_call_free(call);
    call = inferd_call_new(c, INFERD_OP_PING, NULL);
    CHECK_CODE(INFERD_INVALID_ARGUMENT, inferd_call_set_stream(call, "x", 1, 0), "ping");
    inferd_call_free(call);

    /* a model without [stream]: the daemon refuses the start */
    CHECK_CODE(INFERD_OK, inferd_stream_open(c, "ocr-cls", "cls", NULL, 0, &s),
               inferd_client_error(c));
    int64_t shape[4] = {1, 3, 48, 192};
    static float image[3 * 48 * 192];
    inferd_tensor x = {"x", INFERD_FLOAT32, 4, shape, image, sizeof image, NULL, NULL};
    CHECK_CODE(INFERD_INVALID_ARGUMENT, inferd_stream_infer(s, &x, 1, &call),
               inferd_call_message(call));
    printf("no [stream]: %s\n", inferd_call_message(call));
    inferd_call_free(call);
    CHECK_CODE(INFERD_OK, inferd_stream_close(s), inferd_client_error(c));  /* never started */
    (void)audio;
}

/* A stream whose client is freed first: its calls end CANCELLED, close frees it. */
static void outlives_client(const char *endpoint, const float *audio)
{
    inferd_client *c = connect_or_die(endpoint);
    inferd_tensor sr = owned_sr();
    inferd_stream *s;
    CHECK_CODE(INFERD_OK, inferd_stream_open(c, "vad", NULL, &sr, 1, &s),
               inferd_client_error(c));
    inferd_tensor x = chunk_of(audio);
    inferd_call *call;
    CHECK_CODE(INFERD_OK, inferd_stream_infer(s, &x, 1, &call), inferd_call_message(call));
    inferd_call_free(call);
    inferd_client_free(c);
    CHECK_CODE(INFERD_CANCELLED, inferd_stream_infer(s, &x, 1, &call), "client gone");
    CHECK(call == NULL);
    CHECK_CODE(INFERD_OK, inferd_stream_close(s), "close after the client");
}

int main(int argc, char **argv)
{
    if (argc != 4) {
        fprintf(stderr, "usage: test_stream ENDPOINT AUDIO PROBS\n");
        return 2;
    }
    size_t size;
    float *audio = read_file(argv[2], &size);
    CHECK(size % (CHUNK * sizeof(float)) == 0 && size >= 4 * CHUNK * sizeof(float));
    size_t n_chunks = size / (CHUNK * sizeof(float));
    inferd_client *c = connect_or_die(argv[1]);
    CHECK(strcmp(inferd_code_name(INFERD_FAILED_PRECONDITION), "FAILED_PRECONDITION") == 0);
    whole_stream(c, audio, n_chunks, argv[3]);
    not_held_lost_and_reset(c, audio);
    refusals(c, audio);
    inferd_client_free(c);
    outlives_client(argv[1], audio);
    free(audio);
    printf("ok\n");
    return 0;
}
