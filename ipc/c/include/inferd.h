/* libinferd: the C client library of inferd (wire protocol v1, docs/protocol.md).
 *
 * A client is one DEALER connection to the daemon. Requests ("calls") may be many in
 * flight; replies are matched to them by id, in whatever order they come. Input
 * tensors are sent without a copy and output tensors are read in place, in the frames
 * libzmq received.
 *
 * Threads: a client and its calls belong to one thread at a time; give each thread its
 * own client (they may share one ZeroMQ context), or guard a shared one with your own
 * lock. The library has no global state: every object is reached from the handle you
 * hold, and nothing it allocates outlives inferd_client_free / inferd_call_free.
 *
 * Errors: every function that can fail returns an inferd_code; the message that goes
 * with it is inferd_call_message() for a call and inferd_client_error() for the
 * client's own steps (valid until the next call on that client).
 *
 * ABI: SONAME libinferd.so.0; every exported symbol starts with inferd_; enum values
 * and struct layouts below never change within SONAME 0 (new ones are only added).
 * docs/libinferd.md is the guide; examples/c-client/ the example.
 */
#ifndef INFERD_H
#define INFERD_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define INFERD_VERSION_MAJOR 0
#define INFERD_VERSION_MINOR 2
#define INFERD_VERSION_PATCH 0

/* The first frame of every message: the protocol's name and major version. */
#define INFERD_PROTOCOL_TAG "INFERD/1"
/* The endpoint used when none is given and $INFERD_SOCKET is unset. */
#define INFERD_DEFAULT_ENDPOINT "ipc:///run/inferd/inferd.sock"
#define INFERD_SOCKET_ENV "INFERD_SOCKET"

/* Why a function failed. 1-10 are the wire's codes (docs/protocol.md, "Error codes"),
 * from the daemon's reply or, for DEADLINE_EXCEEDED and UNAVAILABLE, also the client's
 * own timeout or a lost connection; 100 and up are this library's. */
typedef enum inferd_code {
    INFERD_OK = 0,
    INFERD_INVALID_ARGUMENT = 1,
    INFERD_NOT_FOUND = 2,
    INFERD_UNAVAILABLE = 3,
    INFERD_PERMISSION_DENIED = 4,
    INFERD_RESOURCE_EXHAUSTED = 5,
    INFERD_DEADLINE_EXCEEDED = 6,
    INFERD_UNSUPPORTED = 7,
    INFERD_CANCELLED = 8,
    INFERD_INTERNAL = 9,
    INFERD_FAILED_PRECONDITION = 10, /* a stream the daemon does not hold (never started, or
                                        its state lost): start it again (since 0.2) */
    INFERD_PROTOCOL_ERROR = 100, /* a reply that breaks the protocol */
    INFERD_NO_MEMORY = 101,
    INFERD_SYSTEM_ERROR = 102,   /* libzmq or the system failed; errno's text is in the message */
    INFERD_AGAIN = 103           /* inferd_wait with a timeout: the call is still in flight */
} inferd_code;

/* "OK", "NOT_FOUND", ...: the wire's spelling; "PROTOCOL_ERROR" and so on for the
 * library's own; "UNKNOWN" for anything else. */
const char *inferd_code_name(inferd_code code);

/* Element types on the wire (docs/protocol.md, "Tensor frames"). */
typedef enum inferd_dtype {
    INFERD_DTYPE_INVALID = 0,
    INFERD_BOOL = 1,    /* one byte, 0 or 1 */
    INFERD_INT8 = 2,
    INFERD_UINT8 = 3,
    INFERD_INT16 = 4,
    INFERD_UINT16 = 5,
    INFERD_INT32 = 6,
    INFERD_UINT32 = 7,
    INFERD_INT64 = 8,
    INFERD_UINT64 = 9,
    INFERD_FLOAT16 = 10,
    INFERD_FLOAT32 = 11,
    INFERD_FLOAT64 = 12,
    INFERD_STRING = 13,          /* per element: uint32 LE byte length, then its UTF-8 bytes */
    INFERD_BFLOAT16 = 14,        /* the high half of a float32 */
    INFERD_FLOAT8_E4M3FN = 15,   /* the ONNX float8 types, one byte each */
    INFERD_FLOAT8_E4M3FNUZ = 16,
    INFERD_FLOAT8_E5M2 = 17,
    INFERD_FLOAT8_E5M2FNUZ = 18,
    INFERD_INT4 = 19,            /* 4 bits, two per byte, the first element in the low nibble */
    INFERD_UINT4 = 20,
    INFERD_FLOAT8_E8M0FNU = 21,  /* a power of two: 8 exponent bits, one byte each */
    INFERD_FLOAT4_E2M1FN = 22,   /* 4 bits, two per byte, like INFERD_INT4 */
    INFERD_INT2 = 23,            /* 2 bits, four per byte, the first element in the lowest bits */
    INFERD_UINT2 = 24
} inferd_dtype;

/* The wire name ("float32", "float8_e4m3fn"), or NULL for a value that is no dtype. */
const char *inferd_dtype_name(inferd_dtype dtype);
/* The dtype named NAME (LEN bytes, no terminator needed), or INFERD_DTYPE_INVALID. */
inferd_dtype inferd_dtype_from_name(const char *name, size_t len);
/* Bytes per element of a numeric dtype; 0 for INFERD_STRING, for the 2- and 4-bit types (a
 * quarter or half a byte: see inferd_frame_size) and for invalid values. */
size_t inferd_dtype_size(inferd_dtype dtype);
/* *BYTES = the frame size of ELEMENTS elements of numeric DTYPE: elements x size,
 * ceil(elements / 2) for INFERD_INT4, INFERD_UINT4 and INFERD_FLOAT4_E2M1FN (an odd count
 * leaves the last byte's high nibble 0), ceil(elements / 4) for INFERD_INT2 and
 * INFERD_UINT2 (the last byte's unused high bits 0). INFERD_INVALID_ARGUMENT for strings
 * and invalid dtypes. */
inferd_code inferd_frame_size(inferd_dtype dtype, uint64_t elements, uint64_t *bytes);

/* The library's version, "0.2.0". */
const char *inferd_version(void);

/* ----------------------------------------------------------------- tensors */

/* Releases an input's memory once the library (libzmq) is done with it; called exactly
 * once, from any thread, possibly after the call that sent it has completed. */
typedef void inferd_release_fn(void *data, void *hint);

/* A tensor: an input you describe, or an output the library describes.
 *
 * data holds the frame's bytes: for a numeric dtype, product(shape) elements in C
 * order, little-endian, no padding; for INFERD_STRING the wire's encoding (see
 * inferd_strings_pack and inferd_output_string).
 *
 * Inputs are sent without a copy (zmq_msg_init_data). With release == NULL the memory is
 * borrowed: keep it valid and unchanged until the call completes (inferd_wait returns
 * it, or inferd_call_free). With a release function the memory is handed over: the
 * library calls release(data, hint) when libzmq is done with it.
 *
 * Outputs point into the received frame, valid until inferd_call_free. The frame is
 * NOT aligned (libzmq hands out frames at any address): read elements with memcpy, or
 * ask inferd_output_aligned for an aligned view. */
typedef struct inferd_tensor {
    const char *name;           /* NUL-terminated UTF-8 */
    inferd_dtype dtype;
    size_t rank;                /* 0 for a scalar */
    const int64_t *shape;       /* rank dimensions, each >= 0 */
    const void *data;
    size_t size;                /* bytes of data */
    inferd_release_fn *release; /* inputs only: NULL = borrowed until the call completes */
    void *hint;                 /* passed to release */
} inferd_tensor;

/* Elements of a shape: the product of its dimensions (1 for rank 0). INFERD_OK, or
 * INFERD_INVALID_ARGUMENT when a dimension is negative or the product passes 2^48. */
inferd_code inferd_shape_elements(const int64_t *shape, size_t rank, uint64_t *elements);

/* Encodes N strings (strings[i] of lengths[i] bytes, or strlen when lengths is NULL) in
 * the wire's string encoding into one malloc'd buffer (*data, *size), for an
 * INFERD_STRING input; release it with inferd_free (or pass inferd_free_release as
 * the input's release function). */
inferd_code inferd_strings_pack(const char *const *strings, const size_t *lengths, size_t n,
                                void **data, size_t *size);
/* free() for what the library allocated for you. */
void inferd_free(void *ptr);
/* inferd_free as an inferd_release_fn (hint unused). */
void inferd_free_release(void *data, void *hint);

/* ----------------------------------------------------------------- client */

typedef struct inferd_client inferd_client;
typedef struct inferd_call inferd_call;

/* Connects to ENDPOINT (NULL: $INFERD_SOCKET, else INFERD_DEFAULT_ENDPOINT). ZMQ_CONTEXT
 * is a ZeroMQ context to use (it must outlive the client), or NULL for a context of
 * the client's own.
 *
 * Like sqlite3_open, *client is set on failure too (NULL only on INFERD_NO_MEMORY), so
 * that inferd_client_error says why; free it with inferd_client_free either way. An
 * ipc:// endpoint whose file is missing or not readable and writable fails at once
 * with INFERD_UNAVAILABLE (libzmq itself would queue forever without a word). */
inferd_code inferd_client_new(inferd_client **client, const char *endpoint, void *zmq_context);
/* Closes the connection. Calls still in flight complete with INFERD_CANCELLED
 * (their borrowed inputs are released before this returns); calls must still be
 * freed, before or after. */
void inferd_client_free(inferd_client *client);
/* The message of the client's last failure ("" if none); valid until the next call. */
const char *inferd_client_error(const inferd_client *client);
/* The endpoint in use. */
const char *inferd_client_endpoint(const inferd_client *client);
/* 1 while the connection to the daemon is up (libzmq completed its handshake and has
 * not reported it lost since), else 0. libzmq connects, and connects again after the
 * daemon restarts, by itself: calls made meanwhile wait for it. When the library sees
 * the connection lost (at a submit or a wait), the calls then in flight complete with
 * INFERD_UNAVAILABLE: their replies can no longer come. */
int inferd_client_connected(inferd_client *client);

typedef enum inferd_option {
    /* Default deadline of a call in ms (sent as timeout_ms; the client waits 1000 ms
     * more for the daemon's own DEADLINE_EXCEEDED). Default 30000. */
    INFERD_OPT_TIMEOUT_MS = 1,
    /* Calls in flight at once; one more waits in inferd_submit (receiving replies)
     * until a reply frees a slot or its deadline passes. Default 64. */
    INFERD_OPT_MAX_IN_FLIGHT = 2,
    /* Nonzero: inferd_infer sends again after RESOURCE_EXHAUSTED, backing off from
     * 5 ms doubling to 0.5 s with jitter, until its deadline. Default 0. */
    INFERD_OPT_RETRY_EXHAUSTED = 3,
    /* A call whose frames (tag, header and inputs) would pass this many bytes has its
     * largest inputs copied into a shared-memory region of the library's own and sent
     * by reference (docs/protocol.md, "Inline limit"; these regions count among the
     * client's 64). Default 32768, the least the daemon takes inline; 0: always frames
     * (the daemon refuses a call over its server.max_message_bytes). ipc:// only. */
    INFERD_OPT_MAX_INLINE_BYTES = 4
} inferd_option;

inferd_code inferd_client_set(inferd_client *client, inferd_option option, int64_t value);

/* ----------------------------------------------------------------- calls */

typedef enum inferd_op {
    INFERD_OP_INFER = 1,
    INFERD_OP_MODELS = 2,
    INFERD_OP_STATUS = 3,
    INFERD_OP_LOAD = 4,
    INFERD_OP_UNLOAD = 5,
    INFERD_OP_PING = 6,
    INFERD_OP_BACKENDS = 7,
    INFERD_OP_RELOAD = 8,
    INFERD_OP_METRICS = 9
} inferd_op;

/* A request being built, then in flight, then completed with its reply. MODEL may be
 * NULL for ops that take none. NULL only when out of memory. */
inferd_call *inferd_call_new(inferd_client *client, inferd_op op, const char *model);
/* Frees the call and its reply. A call still in flight is abandoned (its reply, if
 * one comes, is dropped); see inferd_tensor about borrowed inputs. */
void inferd_call_free(inferd_call *call);

/* Adds an input (infer); T and what it points to are read now, the data itself is sent
 * in place at inferd_submit. INFERD_INVALID_ARGUMENT when the byte count does not match
 * dtype x shape, the dtype is unknown or the name is empty. */
inferd_code inferd_call_add_input(inferd_call *call, const inferd_tensor *t);
/* Asks for output NAME only (repeatable; default every output). */
inferd_code inferd_call_add_output(inferd_call *call, const char *name);
/* A model version (default: the highest present). */
inferd_code inferd_call_set_version(inferd_call *call, int64_t version);
/* This call's deadline in ms (default the client's INFERD_OPT_TIMEOUT_MS). */
inferd_code inferd_call_set_timeout(inferd_call *call, int64_t timeout_ms);
/* Any other header key, with JSON_VALUE its value as JSON text ("true", "30", "\"x\""),
 * e.g. ("verbose", "true") for models, ("keep_alive", "60") for infer. */
inferd_code inferd_call_set_param(inferd_call *call, const char *key, const char *json_value);

/* Sends the call; it is in flight until it completes. Waits first while
 * INFERD_OPT_MAX_IN_FLIGHT calls are in flight (until the call's deadline: then it
 * completes with INFERD_DEADLINE_EXCEEDED). Returns the call's code so far: INFERD_OK
 * when sent. */
inferd_code inferd_submit(inferd_call *call);
/* Waits until CALL completes, for at most TIMEOUT_MS (< 0: as long as its deadline
 * allows). Returns the call's code (INFERD_OK for a successful reply), or INFERD_AGAIN
 * when TIMEOUT_MS passed first. Replies to other calls that arrive meanwhile complete
 * those. */
inferd_code inferd_wait(inferd_call *call, int64_t timeout_ms);
/* Waits for the next completed call of CLIENT not yet returned by inferd_wait or
 * inferd_wait_any, for at most TIMEOUT_MS (< 0: until the last deadline of the calls in
 * flight). *CALL is that call, or NULL with INFERD_AGAIN (none completed in time or none
 * in flight). */
inferd_code inferd_wait_any(inferd_client *client, int64_t timeout_ms, inferd_call **call);

/* The client the call belongs to (NULL once that client was freed). */
inferd_client *inferd_call_client(const inferd_call *call);
/* The call's id on the wire ("" before inferd_submit). */
const char *inferd_call_id(const inferd_call *call);
/* INFERD_AGAIN while in flight (or not sent), then the final code. */
inferd_code inferd_call_code(const inferd_call *call);
/* The message of a failed call (the daemon's, or the library's), "" otherwise. */
const char *inferd_call_message(const inferd_call *call);
/* The reply's "result" as compact JSON text (control ops), NULL if it has none. */
const char *inferd_call_result(const inferd_call *call);

/* Outputs of a completed infer call, in the reply's order. */
size_t inferd_output_count(const inferd_call *call);
/* Output INDEX, or NULL past the end. The tensor and what it points to belong to the
 * call. */
const inferd_tensor *inferd_output(const inferd_call *call, size_t index);
/* The output named NAME, or NULL. */
const inferd_tensor *inferd_output_by_name(const inferd_call *call, const char *name);
/* The data of output INDEX at an address aligned for its element type: the frame
 * itself when it is aligned, else a copy made once and owned by the call. NULL past the
 * end, for strings, or out of memory. */
const void *inferd_output_aligned(inferd_call *call, size_t index);
/* Element ELEM of a string output: *data (not NUL-terminated) and *len bytes of UTF-8,
 * in place in the frame (validated when the reply arrived). */
inferd_code inferd_output_string(const inferd_call *call, size_t index, uint64_t elem,
                                 const char **data, size_t *len);

/* Names the stream CALL belongs to (docs/streams.md; the header's "stream" field): ID is
 * 1 to 64 characters of [A-Za-z0-9._-]; START begins the stream (or begins it again: its
 * state back to the model's initial value) and then carries its constant inputs; END frees
 * it once this call has run (an END call may carry no inputs). Nonzero is true. Most
 * programs use inferd_stream_open instead, which keeps these flags right. (since 0.2) */
inferd_code inferd_call_set_stream(inferd_call *call, const char *id, int start, int end);

/* ----------------------------------------------------------------- shared memory */

/* A shared-memory region (docs/protocol.md, "Shared memory"): a memfd sealed against
 * shrinking and growing, mapped here and registered with the daemon over the
 * registration socket beside the client's ipc:// endpoint (its path + ".shm"; one
 * connection per client, opened with the first region). Input tensors whose bytes lie
 * in it travel by reference: the socket carries only the header (string tensors
 * excepted). Place float inputs at 64-byte offsets: the daemon copies one that is not.
 * Do not write bytes a call in flight uses. The library registers the region again by
 * itself when the daemon has restarted (a restart forgets every region). */
typedef struct inferd_region inferd_region;

/* A region of SIZE bytes (1 byte to 4 GiB; at most 64 per client). INFERD_UNSUPPORTED
 * for an endpoint that is not ipc://; the daemon's code otherwise (PERMISSION_DENIED,
 * RESOURCE_EXHAUSTED), with the message in inferd_client_error. */
inferd_code inferd_region_new(inferd_client *client, size_t size, inferd_region **region);
/* Its memory (page-aligned) and size. */
void *inferd_region_data(const inferd_region *region);
size_t inferd_region_size(const inferd_region *region);
/* Unregisters and unmaps it; no call in flight may use it, and outputs read from it are
 * gone. inferd_client_free frees the regions left. */
void inferd_region_free(inferd_region *region);
/* The daemon writes CALL's numeric outputs into SIZE bytes of REGION from OFFSET, each at
 * the next 64-byte boundary, and they come back as outputs pointing there (string and
 * 4-bit outputs still come as frames). A slot too small for them is answered
 * INFERD_RESOURCE_EXHAUSTED. */
inferd_code inferd_call_set_outputs_into(inferd_call *call, inferd_region *region,
                                         uint64_t offset, uint64_t size);

/* ----------------------------------------------------------------- one call, waited */

/* Runs MODEL on N_INPUTS inputs and waits: *CALL is the completed call (its outputs, or
 * its message on failure); free it. With INFERD_OPT_RETRY_EXHAUSTED, a
 * RESOURCE_EXHAUSTED reply is retried until the deadline. Returns the call's code. */
inferd_code inferd_infer(inferd_client *client, const char *model, const inferd_tensor *inputs,
                         size_t n_inputs, inferd_call **call);
/* Any other op (MODEL may be NULL), waited: the result is inferd_call_result(*CALL). */
inferd_code inferd_control(inferd_client *client, inferd_op op, const char *model,
                           inferd_call **call);
/* ping: *READY is the daemon's readiness. */
inferd_code inferd_ping(inferd_client *client, int *ready);

/* ----------------------------------------------------------------- streams (since 0.2) */

/* A stream (docs/streams.md): a model whose state the daemon carries from one call to the
 * next (Silero VAD's LSTM state and its last 64 samples of audio), so that each call sends
 * only the next chunk. A stream belongs to its client: no other client can name it; its
 * calls run in the order they are made, one at a time. */
typedef struct inferd_stream inferd_stream;

/* The longest stream id, in characters of [A-Za-z0-9._-]. */
#define INFERD_STREAM_ID_MAX 64

/* A stream of MODEL on CLIENT, named ID (NULL: a name the library makes, unique for the
 * client: "<client prefix>-s<n>"). CONSTANTS are the inputs that stay the same for the
 * whole stream (Silero VAD's "sr"): copied now (an input's release function, if it has
 * one, runs before this returns) and sent with the stream's first call and with the first
 * call after inferd_stream_reset. Nothing is sent here: the model, the id and the
 * constants are checked by the daemon at the first inferd_stream_infer. *STREAM is NULL on
 * failure, with the reason in inferd_client_error. */
inferd_code inferd_stream_open(inferd_client *client, const char *model, const char *id,
                               const inferd_tensor *constants, size_t n_constants,
                               inferd_stream **stream);
/* The stream's id, as sent. */
const char *inferd_stream_id(const inferd_stream *stream);
/* Runs the stream's next chunk: N_INPUTS inputs (Silero VAD's "input" [1, 512]; the
 * state and the context are the daemon's), as inferd_infer runs a call (the same
 * ownership of inputs, the same retry of RESOURCE_EXHAUSTED with
 * INFERD_OPT_RETRY_EXHAUSTED). The stream's first call, and the first after
 * inferd_stream_reset, starts it. *CALL is the completed call: its outputs are the
 * model's other than its state; free it. Returns the call's code:
 * INFERD_FAILED_PRECONDITION when the daemon no longer holds the stream's state (its
 * worker restarted, its model was unloaded or reloaded, it was idle too long; the message
 * says which): this chunk was not run, and the next call starts the stream again from
 * the model's initial state (as the Python client's Stream does: the loss is reported
 * once, never hidden). A call that fails otherwise (INVALID_ARGUMENT for a chunk of the
 * wrong shape) leaves the stream as it was. */
inferd_code inferd_stream_infer(inferd_stream *stream, const inferd_tensor *inputs,
                                size_t n_inputs, inferd_call **call);
/* The next inferd_stream_infer starts the stream again, with its constants: its state
 * back to the model's initial value (to begin a new utterance; the Python client's
 * Stream.reset). Sends nothing. */
void inferd_stream_reset(inferd_stream *stream);
/* Frees the stream in the daemon (a call with END and no inputs, waited; sent only while
 * the stream is started: its last start succeeded and no loss was reported since) and
 * then the handle, whatever the answer. INFERD_OK also when the daemon had lost the
 * stream already; otherwise the call's code, with its message in
 * inferd_client_error. After inferd_client_free only the handle is freed. */
inferd_code inferd_stream_close(inferd_stream *stream);

/* ----------------------------------------------------------------- models */

/* A dimension of a model's tensor as the daemon describes it: a size, or (value -1) a
 * symbolic name ("N", or NULL when it has none). */
typedef struct inferd_dim {
    int64_t value;
    const char *symbol;
} inferd_dim;

typedef struct inferd_tensor_info {
    const char *name;
    inferd_dtype dtype;         /* INFERD_DTYPE_INVALID for a type this library does not know */
    const char *dtype_name;     /* as the daemon wrote it */
    size_t rank;
    const inferd_dim *dims;
} inferd_tensor_info;

/* One row of the models op (one per model version in memory, one per graph). Strings
 * are NULL where the daemon sent none; version -1 when it sent none. */
typedef struct inferd_model_info {
    const char *name;
    const char *state;          /* unloaded, loading, ready, failed, draining */
    const char *kind;           /* NULL for a model, "graph" for a graph */
    int64_t version;
    const char *backend;
    const char *error;
    size_t n_inputs;
    const inferd_tensor_info *inputs;
    size_t n_outputs;
    const inferd_tensor_info *outputs;
} inferd_model_info;

typedef struct inferd_models inferd_models;

/* The models op, parsed; VERBOSE asks for the placement too (see inferd_control for
 * the whole JSON). Free *MODELS with inferd_models_free. */
inferd_code inferd_models_get(inferd_client *client, int verbose, inferd_models **models);
size_t inferd_models_count(const inferd_models *models);
const inferd_model_info *inferd_models_at(const inferd_models *models, size_t index);
/* The first row named NAME (the default version's when there are several), or NULL. */
const inferd_model_info *inferd_models_find(const inferd_models *models, const char *name);
void inferd_models_free(inferd_models *models);

/* ----------------------------------------------------------------- status */

typedef struct inferd_status {
    const char *version;        /* the daemon's version */
    int64_t pid;
    double uptime_s;
    int ready;
    const char *endpoint;
    const char *repository;
    size_t n_loaded;
    const char *const *loaded_models;
    const char *json;           /* the whole result */
} inferd_status;

/* The status op, parsed; free *STATUS with inferd_status_free. */
inferd_code inferd_status_get(inferd_client *client, inferd_status **status);
void inferd_status_free(inferd_status *status);

#ifdef __cplusplus
}
#endif

#endif /* INFERD_H */
