/* A complete inferd client in C with only libzmq: runs ocr-cls on an all-zero
 * 1x3x48x192 float32 image and prints the reply header and the two class scores.
 *
 *   gcc -O2 -Wall -o inferd_client inferd_client.c -lzmq
 *   ./inferd_client ipc:///run/inferd/inferd.sock
 *
 * Protocol: docs/protocol.md. Exit status 0 on an "ok" reply, 1 otherwise.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <zmq.h>

#define N (1 * 3 * 48 * 192)

/* Whether the size bytes at data contain needle. A received frame is not
 * NUL-terminated: never run strstr() or printf("%s") on it. */
static int contains(const char *data, size_t size, const char *needle)
{
    size_t n = strlen(needle);
    for (size_t i = 0; n <= size && i <= size - n; i++)
        if (memcmp(data + i, needle, n) == 0)
            return 1;
    return 0;
}

int main(int argc, char **argv)
{
    const char *endpoint = argc > 1 ? argv[1] : "ipc:///run/inferd/inferd.sock";
    void *ctx = zmq_ctx_new();
    void *sock = zmq_socket(ctx, ZMQ_DEALER);
    int timeout_ms = 10000, linger = 0;
    zmq_setsockopt(sock, ZMQ_RCVTIMEO, &timeout_ms, sizeof timeout_ms);
    zmq_setsockopt(sock, ZMQ_LINGER, &linger, sizeof linger);
    if (zmq_connect(sock, endpoint) != 0) {
        fprintf(stderr, "connect %s: %s\n", endpoint, zmq_strerror(zmq_errno()));
        return 1;
    }

    const char *tag = "INFERD/1";
    const char *header =
        "{\"id\":\"c-1\",\"op\":\"infer\",\"model\":\"ocr-cls\","
        "\"inputs\":[{\"name\":\"x\",\"dtype\":\"float32\",\"shape\":[1,3,48,192]}],"
        "\"timeout_ms\":10000}";
    float *image = calloc(N, sizeof *image);          /* little-endian float32, C order */
    zmq_send(sock, tag, strlen(tag), ZMQ_SNDMORE);      /* frame 0: protocol tag */
    zmq_send(sock, header, strlen(header), ZMQ_SNDMORE);/* frame 1: JSON header */
    zmq_send(sock, image, N * sizeof *image, 0);        /* frame 2: tensor x */
    free(image);

    /* Reply: tag, JSON header, then one frame per output tensor. */
    int frame = 0, ok = 0, more = 1;
    while (more) {
        zmq_msg_t msg;
        zmq_msg_init(&msg);
        if (zmq_msg_recv(&msg, sock, 0) < 0) {
            fprintf(stderr, "no reply: %s\n", zmq_strerror(zmq_errno()));
            return 1;
        }
        size_t size = zmq_msg_size(&msg);
        const char *data = zmq_msg_data(&msg);
        if (frame == 0 && (size != strlen(tag) || memcmp(data, tag, size) != 0)) {
            fprintf(stderr, "unexpected protocol tag\n");
            return 1;
        }
        if (frame == 1) {
            printf("header: %.*s\n", (int)size, data);
            /* The JSON is compact (no spaces), so this exact text marks success. */
            ok = contains(data, size, "\"status\":\"ok\"");
        }
        if (frame == 2 && size == 2 * sizeof(float)) {
            /* Frames are not aligned (one arrived at an address = 7 mod 8): copy the
             * bytes out instead of casting data to float *, which is undefined and
             * faults on strict-alignment CPUs. */
            float scores[2];
            memcpy(scores, data, sizeof scores);
            printf("scores: %.6f %.6f\n", scores[0], scores[1]);
        }
        more = zmq_msg_more(&msg);
        zmq_msg_close(&msg);
        frame++;
    }
    zmq_close(sock);
    zmq_ctx_term(ctx);
    return ok ? 0 : 1;
}
