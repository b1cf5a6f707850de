/* A client that keeps the daemon busy while `make deb-test-systemd` upgrades,
 * downgrades or restarts it (tests/packaging/check_systemd.py). Built against the
 * libinferd-dev package just built, run in the container against its libinferd0.
 *
 *   serving_client ENDPOINT       (until its stdin closes)
 *
 * Keeps IN_FLIGHT ocr-cls calls in flight, each sent again as it completes; after
 * UNAVAILABLE (the daemon is stopping, or the connection dropped) it waits 50 ms, as an
 * application would. Prints one line per completed call, "OK" or "CODE message", and
 * at the end "summary ok=N unavailable=N other=N different=N" (different: an OK whose
 * scores differ from the first OK's). */
#include <inferd.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#define IN_FLIGHT 4
#define N (1 * 3 * 48 * 192)

static float image[N];

static inferd_call *send_one(inferd_client *c)
{
    static const int64_t shape[4] = {1, 3, 48, 192};
    inferd_tensor x = {"x", INFERD_FLOAT32, 4, shape, image, sizeof image, NULL, NULL};
    inferd_call *call = inferd_call_new(c, INFERD_OP_INFER, "ocr-cls");
    if (call == NULL || inferd_call_add_input(call, &x) != INFERD_OK ||
        inferd_call_set_timeout(call, 20000) != INFERD_OK) {
        fprintf(stderr, "serving_client: %s\n", inferd_client_error(c));
        exit(1);
    }
    inferd_submit(call);  /* a failure completes the call: seen by inferd_wait_any */
    return call;
}

static int stdin_closed(void)
{
    struct pollfd p = {0, POLLIN, 0};
    char buf[64];
    return poll(&p, 1, 0) > 0 && read(0, buf, sizeof buf) <= 0;
}

int main(int argc, char **argv)
{
    if (argc != 2)
        return 2;
    inferd_client *c;
    if (inferd_client_new(&c, argv[1], NULL) != INFERD_OK) {
        fprintf(stderr, "serving_client: %s\n", inferd_client_error(c));
        return 1;
    }
    for (int i = 0; i < N; i++)
        image[i] = (float)(i % 97) / 97.0f;
    unsigned ok = 0, unavailable = 0, other = 0, different = 0;
    unsigned char first[64];
    size_t first_size = 0;
    int running = 1, in_flight = 0;
    for (int i = 0; i < IN_FLIGHT; i++, in_flight++)
        send_one(c);
    while (in_flight > 0) {
        inferd_call *done;
        if (inferd_wait_any(c, 100, &done) != INFERD_OK) {
            running = running && !stdin_closed();
            continue;
        }
        in_flight--;
        inferd_code code = inferd_call_code(done);
        if (code == INFERD_OK) {
            const inferd_tensor *y = inferd_output(done, 0);
            if (first_size == 0 && y->size <= sizeof first) {
                memcpy(first, y->data, y->size);
                first_size = y->size;
            }
            different += y->size != first_size || memcmp(first, y->data, first_size) != 0;
            ok++;
            printf("OK\n");
        } else {
            unavailable += code == INFERD_UNAVAILABLE;
            other += code != INFERD_UNAVAILABLE;
            printf("%s %s\n", inferd_code_name(code), inferd_call_message(done));
        }
        fflush(stdout);
        inferd_call_free(done);
        if (code == INFERD_UNAVAILABLE) {
            struct timespec pause = {0, 50000000};
            nanosleep(&pause, NULL);
        }
        running = running && !stdin_closed();
        if (running) {
            send_one(c);
            in_flight++;
        }
    }
    printf("summary ok=%u unavailable=%u other=%u different=%u\n", ok, unavailable, other,
           different);
    inferd_client_free(c);
    return 0;
}
