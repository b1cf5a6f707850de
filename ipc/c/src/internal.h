/* libinferd's private declarations: the objects behind the public handles and the
 * helpers the source files share (prefix ifd_, never exported: libinferd.map exports
 * inferd_* only). */
#ifndef IFD_INTERNAL_H
#define IFD_INTERNAL_H

#include <jansson.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <zmq.h>

#include "inferd.h"

#define IFD_MAX_RANK 32
#define IFD_MAX_ELEMENTS (UINT64_C(1) << 48)
#define IFD_MAX_NAME_CHARS 256
#define IFD_MAX_DEPTH 32
#define IFD_REPLY_GRACE_MS 1000
#define IFD_DEFAULT_TIMEOUT_MS 30000
#define IFD_DEFAULT_MAX_IN_FLIGHT 64
#define IFD_BACKOFF_FIRST_MS 5
#define IFD_BACKOFF_MAX_MS 500
#define IFD_DEFAULT_MAX_INLINE 32768  /* the least the daemon's "auto" limit gives */
#define IFD_KEEP_STAGING 4            /* free staging regions kept for later calls */
#define IFD_MAX_STAGING 16            /* staging regions of a client at once (of its 64) */

/* ------------------------------------------------------------------ errors */

/* A message buffer of the client or a call: a heap string, "" when clear. */
typedef struct ifd_text {
    char *text;
} ifd_text;

void ifd_text_set(ifd_text *t, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
void ifd_text_vset(ifd_text *t, const char *fmt, va_list ap);
const char *ifd_text_get(const ifd_text *t);
void ifd_text_free(ifd_text *t);

/* ------------------------------------------------------------------ dtypes, UTF-8 */

int ifd_utf8_valid(const unsigned char *s, size_t n);
size_t ifd_utf8_chars(const char *s, size_t n);
/* " (two elements per byte)" for the 4-bit dtypes, " (four ...)" for the 2-bit ones, else "". */
const char *ifd_packing(inferd_dtype dtype);

/* ------------------------------------------------------------------ replies (reply.c) */

/* A frame as the parser sees it: bytes and their count (tests give plain buffers,
 * the client zmq_msg_t data). */
typedef struct ifd_frame {
    const void *data;
    size_t size;
} ifd_frame;

/* A reply parsed from its frames. Output names point into header, data into frames. */
typedef struct ifd_reply {
    json_t *header;             /* owned */
    const char *id;             /* NULL when the id could not be read */
    inferd_code code;           /* INFERD_OK, a wire code, or INFERD_PROTOCOL_ERROR */
    char *message;              /* owned; NULL for success */
    char *result;               /* owned compact JSON of "result", or NULL */
    size_t n_outputs;
    inferd_tensor *outputs;     /* owned array */
    int64_t *dims;              /* owned: every output's shape, one block */
    uint64_t **string_offsets;  /* owned, per output: element starts, NULL for numeric */
} ifd_reply;

/* The bytes of the shared-memory region named TOKEN (*SIZE of them), or NULL when the
 * client has no such region. */
typedef const void *ifd_resolver(void *ctx, const char *token, size_t *size);

/* Parses a reply; outputs described in a shared-memory region are found through RESOLVE
 * (NULL: none can be). Always fills *R (free it with ifd_reply_clear); R->code is
 * INFERD_PROTOCOL_ERROR with R->message when the reply breaks the protocol, and R->id
 * is set whenever the header's id could be read. Returns R->code. */
inferd_code ifd_reply_parse(const ifd_frame *frames, size_t n, ifd_resolver *resolve,
                            void *ctx, ifd_reply *r);
void ifd_reply_clear(ifd_reply *r);
/* Deepest nesting of arrays and objects in JSON text (brackets in strings ignored). */
size_t ifd_json_depth(const char *s, size_t n);
/* The wire code named NAME, or 0 when it is none. */
inferd_code ifd_code_from_name(const char *name);

/* ------------------------------------------------------------------ calls (client.c) */

/* Inputs of a call waiting for libzmq: counts the frames libzmq still holds and runs
 * the inputs' release functions when the last reference goes (libzmq's free callbacks
 * and the call each hold one). */
typedef struct ifd_hold {
    atomic_int refs;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    int in_zmq;                 /* frames libzmq holds (under mu) */
    size_t n;
    struct ifd_release {
        void *data;
        inferd_release_fn *release;
        void *hint;
    } *items;
} ifd_hold;

typedef enum ifd_state {
    IFD_BUILDING = 0,
    IFD_IN_FLIGHT = 1,
    IFD_DONE = 2
} ifd_state;

typedef struct ifd_input {
    const void *data;
    size_t size;
    int borrowed;
    inferd_region *region;      /* by reference: no frame, its bytes in this region */
    uint64_t offset;
    int staged;                 /* copied into the call's staging region by the library */
} ifd_input;

struct inferd_call {
    inferd_client *client;
    inferd_op op;
    ifd_state state;
    int collected;              /* returned by inferd_wait / inferd_wait_any */
    int in_done_list;
    inferd_call *next_done;
    inferd_call *prev_call, *next_call;  /* every call of the client */

    /* the request */
    json_t *model;              /* a JSON string or NULL */
    json_t *input_specs;        /* array */
    json_t *outputs_wanted;     /* array or NULL */
    json_t *params;             /* object */
    int64_t version;            /* 0: none */
    int64_t timeout_ms;         /* 0: the client's */
    size_t n_inputs, cap_inputs;
    ifd_input *inputs;
    ifd_hold *hold;             /* the inputs' releases and libzmq's references */
    int borrowed;               /* some input has no release function */
    inferd_region *into;        /* outputs_into, or NULL */
    inferd_region *staged;      /* the library's region holding inputs too big to frame */
    uint64_t into_offset, into_size;

    /* in flight */
    uint64_t seq;
    char id[40];
    int64_t give_up_ns;         /* monotonic */

    /* the reply */
    inferd_code code;
    ifd_text message;
    zmq_msg_t *frames;
    size_t n_frames;
    ifd_reply reply;
    void **aligned;             /* per output, copies made by inferd_output_aligned */
};

struct inferd_client {
    void *ctx;
    int own_ctx;
    void *sock;
    void *mon;
    unsigned generation;        /* sockets made so far, for the monitor's inproc name */
    int connected;              /* the handshake with the daemon succeeded, no loss since */
    char *endpoint;
    int64_t timeout_ms;
    int64_t max_in_flight;
    int retry_exhausted;
    int64_t max_inline;         /* INFERD_OPT_MAX_INLINE_BYTES; 0: always frames */
    inferd_region *spare[IFD_KEEP_STAGING];  /* staging regions free for the next call */
    size_t n_spare;
    size_t n_staging;           /* staging regions alive: lent to calls, or spare */
    char prefix[17];
    uint64_t next_seq;
    uint64_t rng;
    inferd_call **flight;       /* calls in flight, unordered */
    size_t n_flight, cap_flight;
    inferd_call *done_head, *done_tail;
    inferd_call *calls;         /* every call not freed yet (they lose their client when
                                   it is freed first) */
    int shm_fd;                 /* the registration socket, -1 while closed */
    inferd_region *regions;     /* every region of the client */
    inferd_stream *streams;     /* every stream not closed yet (they lose their client when
                                   it is freed first) */
    uint64_t next_stream;       /* streams named by the library so far */
    unsigned unreadable;        /* replies dropped because their id could not be read */
    ifd_text last_unreadable;
    ifd_text error;
};

struct inferd_region {
    inferd_client *client;
    int fd;                     /* the memfd, kept to register it again after a restart */
    void *data;
    size_t size;
    char token[72];             /* the daemon's name for it, "" while not registered */
    inferd_region *next;
};

/* A stream (stream.c): its name, model and constants; whether the daemon holds it. */
struct inferd_stream {
    inferd_client *client;      /* NULL once the client was freed */
    inferd_stream *prev, *next; /* every stream of the client */
    char *model;
    char id[INFERD_STREAM_ID_MAX + 1];
    size_t n_constants;
    inferd_tensor *constants;   /* copies: name, shape and data owned (one block each) */
    int started;                /* a start succeeded, and no reset or loss since: the next
                                   call continues the stream */
};

/* ------------------------------------------------------------------ shared memory (shm.c) */

/* Registers R now if the daemon does not hold it (the first use, or after a restart). */
inferd_code ifd_region_ready(inferd_region *r);
/* The region of C holding SIZE bytes at DATA (*OFFSET into it), or NULL. */
inferd_region *ifd_region_of(inferd_client *c, const void *data, size_t size, uint64_t *offset);
/* ifd_resolver over the regions of the client CTX. */
const void *ifd_region_bytes(void *ctx, const char *token, size_t *size);
/* Moves CALL's largest framed inputs into a staging region of the library's own when its
 * frames (HEADER_BYTES of tag and header with them) would pass the client's
 * max_inline; the inputs are then sent by reference. With IFD_MAX_STAGING regions lent
 * to calls in flight it waits for a reply first (CALL, in flight, may complete
 * meanwhile: at its deadline). */
inferd_code ifd_stage(inferd_call *call, size_t header_bytes);
/* Puts CALL's staged inputs back to frames and its staging region back: kept for later
 * calls when REUSABLE (the daemon answered: it reads the region no more), else freed. */
void ifd_unstage(inferd_call *call, int reusable);
/* Frees every region of C and closes its registration socket. */
void ifd_regions_free(inferd_client *c);

int64_t ifd_now_ns(void);
/* Completes CALL (in flight) with CODE and a message. */
void ifd_complete(inferd_call *call, inferd_code code, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
/* Fails every call in flight with CODE and WHY, drops what libzmq queued and connects
 * again. */
void ifd_reset(inferd_client *c, inferd_code code, const char *why);
/* Reads the socket monitor; a lost connection with calls in flight resets it. */
void ifd_read_monitor(inferd_client *c);
/* libzmq's free callback of an input frame; HINT is the call's hold. */
void ifd_zmq_released(void *data, void *hint);
/* Waits until libzmq holds none of a completed call's borrowed inputs (resets the
 * connection when it still holds them after a second: the daemon never read them). */
void ifd_settle_call(inferd_call *call);
void ifd_done_remove(inferd_client *c, inferd_call *call);
void ifd_close_frames(zmq_msg_t *frames, size_t n);
void ifd_hold_unref(ifd_hold *h);
/* Puts a completed call back to building, for a retry (keeps its inputs). */
void ifd_call_rearm(inferd_call *call);
/* Waits until C has calls in flight or replies, up to DEADLINE_NS; processes replies,
 * a lost connection and expired calls. */
void ifd_pump(inferd_client *c, int64_t deadline_ns);
/* The backoff before retry ATTEMPT (0-based), in ms, with jitter. */
int64_t ifd_backoff_ms(inferd_client *c, int attempt);
/* Submits CALL and waits for it; with the client's retry_exhausted, sends it again after
 * RESOURCE_EXHAUSTED with a backoff until its deadline (infer only). Returns its code. */
inferd_code ifd_run(inferd_call *call);
/* Adds N inputs to CALL; on failure frees CALL (releasing the inputs it took), runs the
 * release functions of those it did not take, and returns the code. */
inferd_code ifd_add_inputs(inferd_call *call, const inferd_tensor *inputs, size_t n);
/* 1 when ID is a valid stream id: 1 to INFERD_STREAM_ID_MAX characters of [A-Za-z0-9._-]. */
int ifd_stream_id_valid(const char *id);
/* Sets the client's error message and returns CODE. */
inferd_code ifd_fail(inferd_client *c, inferd_code code, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

#endif
