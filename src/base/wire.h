/*
 * The wire protocol (docs/protocol.md): every message is a 12-byte frame
 * header (magic, version, type, payload length; little-endian) and a payload
 * whose fields are encoded one by one. Decoders take untrusted bytes and check
 * every length against the bytes present and against a hard limit; they are
 * pure functions over their arguments, thread-safe, and fuzzed.
 */
#ifndef LLMDD_CTRL_WIRE_H
#define LLMDD_CTRL_WIRE_H

#include <llmdd/llmdd.h>

#define LLMDD_WIRE_MAGIC 0x44444c4cu /* "LLDD" on the wire */
/* 2: llmdd 0.3 (heartbeats, KV layouts); 1: llmdd 0.1 and 0.2. */
#define LLMDD_WIRE_VERSION 3
#define LLMDD__XSTR(x) #x
#define LLMDD__STR(x) LLMDD__XSTR(x)
#define LLMDD_WIRE_HDR_LEN 12
#define LLMDD_WIRE_MAX_PAYLOAD (1u << 20)
/* Runs in one READ or WRITE request: keeps a request under the payload cap
 * (a run is 16 bytes, or 32 with a stride). */
#define LLMDD_WIRE_MAX_RUNS ((LLMDD_WIRE_MAX_PAYLOAD - 64) / 16)
/* A run's length with this bit set is followed by its count and stride. */
#define LLMDD_WIRE_RUN_STRIDED (UINT64_C(1) << 63)
#define LLMDD_WIRE_MAC_LEN 32
#define LLMDD_WIRE_NONCE_LEN 16
#define LLMDD_WIRE_NAME_MAX 15

/*
 * Frame types. Each owner has its own range and defines its numbers in its
 * own header; the frame decoder accepts 1..WMSG_TYPE_MAX-1 and the owner
 * rejects what it does not expect in its state:
 *   1..19   the control plane (ctrl/), below
 *   20..39  the stream data plane (transport/stream), below
 *   40..49  the ucx transport's exchange (transport/ucx/ucx_wire.h)
 *   50..63  free, for another transport's exchange
 * shm's Unix-domain socket carries its own header and numbers
 * (transport/shm), not this frame.
 */
#define WMSG_UCX_FIRST 40
#define WMSG_UCX_LAST 49

enum llmdd__msg_type {
    WMSG_HELLO = 1,
    WMSG_HELLO_REPLY = 2,
    WMSG_CONFIRM = 3,
    WMSG_RESULT = 4,
    WMSG_DATA_REPLY = 5,
    WMSG_LAYOUT_QUERY = 6, /* control connection: a cache's KV layout */
    WMSG_LAYOUT_REPLY = 7,
    WMSG_UNLINK = 10,
    WMSG_UNLINK_ACK = 11,
    WMSG_REOPEN = 12,
    WMSG_KEY_QUERY = 13, /* control connection: a cache key lookup */
    WMSG_KEY_REPLY = 14,
    WMSG_NOTIFY = 15, /* control connection: raw bytes, 0..LLMDD_NOTIFY_MAX */
    WMSG_PING = 16,      /* u64 sequence: answered at once by a PONG */
    WMSG_PONG = 17,      /* the PING's sequence */
    WMSG_HEARTBEAT = 18, /* empty: the sender is alive */
    WMSG_CREDIT = 19,    /* u32: notifications the receiver took */
    WMSG_QUERY = 20,
    WMSG_QUERY_REPLY = 21,
    WMSG_READ = 22,
    WMSG_READ_REPLY = 23,
    WMSG_WRITE = 24,
    WMSG_WRITE_REPLY = 25,
    WMSG_TYPE_MAX = 64,
};
_Static_assert(WMSG_UCX_LAST < WMSG_TYPE_MAX, "the ucx range is too high");

enum llmdd__conn_kind { CONN_CTRL = 1, CONN_DATA = 2 };

/*
 * What each side of a control connection announces in its HELLO or
 * HELLO_REPLY (since protocol version 2), checked by the decoders: the interval
 * it sends heartbeats at (0: none), how many notifications it takes from
 * the peer before it returns credit, and (the server's only) how many data
 * connections each way it serves a link.
 */
#define LLMDD_WIRE_HB_MIN_MS 100
#define LLMDD_WIRE_HB_MAX_MS 60000
#define LLMDD_WIRE_WINDOW_MAX 4096
#define LLMDD_WIRE_CONNS_MAX 17 /* the stream data plane's pool */
typedef struct {
    uint32_t hb_ms;
    uint32_t notify_window; /* 1..LLMDD_WIRE_WINDOW_MAX */
    uint32_t conns_max;     /* 2..LLMDD_WIRE_CONNS_MAX; the client sends 0 */
} llmdd__link_terms;

typedef struct {
    uint16_t type;
    uint32_t len;
} llmdd__frame;

/* Decodes a frame header: magic, version, a known type, len <= the cap. */
int llmdd__wire_frame_decode(const uint8_t *buf, llmdd__frame *out);
/* Whether a header that failed to decode is llmdd's, of another protocol
 * version (*version): the one case worth a log line naming both. */
bool llmdd__wire_frame_foreign(const uint8_t *buf, uint16_t *version);
void llmdd__wire_frame_encode(uint8_t *buf, uint16_t type, uint32_t len);

typedef struct {
    uint8_t kind; /* enum llmdd__conn_kind */
    /* CONN_CTRL */
    uint64_t cluster_id;
    uint32_t role;
    uint32_t pid;
    uint8_t boot_id[16];
    uint64_t nonce;
    uint8_t auth;
    uint8_t cnonce[LLMDD_WIRE_NONCE_LEN];
    char transport[LLMDD_WIRE_NAME_MAX + 1];
    llmdd__link_terms terms;
    /* CONN_DATA */
    uint8_t token[16];
    uint32_t flags;
} llmdd__hello;

typedef struct {
    uint32_t status;
    uint64_t cluster_id;
    uint32_t role;
    uint32_t pid;
    uint8_t boot_id[16];
    uint64_t nonce;
    uint8_t auth;
    uint8_t snonce[LLMDD_WIRE_NONCE_LEN];
    uint8_t mac[LLMDD_WIRE_MAC_LEN];
    char transport[LLMDD_WIRE_NAME_MAX + 1];
    llmdd__link_terms terms;
} llmdd__hello_reply;

typedef struct {
    char transport[LLMDD_WIRE_NAME_MAX + 1];
    uint8_t mac[LLMDD_WIRE_MAC_LEN];
} llmdd__confirm;

typedef struct {
    uint32_t status;
    uint8_t token[16];
} llmdd__result;

/*
 * READ and WRITE requests. Run i is cnts[i] elements of lens[i] bytes, the
 * k-th at offs[i] + k * strides[i] in each tensor; the data is the elements
 * in order, tensor after tensor.
 */
typedef struct {
    int64_t cache_id;
    uint32_t first;
    uint32_t count;
    uint32_t nruns;
    uint64_t *offs; /* nruns entries, caller-provided */
    uint64_t *lens;
    uint64_t *cnts;    /* NULL to encode: every run one element */
    uint64_t *strides; /* meaningful where cnts[i] > 1 */
    uint64_t total;    /* count * sum(cnts * lens), checked for overflow */
} llmdd__rw_req;

/* KEY_QUERY: which (cache id, batch index) a key of the peer's names. */
#define LLMDD_WIRE_KEY_MAX 128 /* LLMDD_KEY_MAX */
typedef struct {
    uint64_t seq;
    uint32_t key_len; /* 1..LLMDD_WIRE_KEY_MAX */
    uint8_t key[LLMDD_WIRE_KEY_MAX];
} llmdd__key_query;

typedef struct {
    uint64_t seq;
    uint32_t status; /* LLM_SUCCESS or LLM_KV_CACHE_NOT_EXIST */
    int64_t cache_id;
    uint32_t batch_index;
} llmdd__key_reply;

/* Encoders return the payload length, or 0 when buf (cap bytes) is short. */
size_t llmdd__wire_hello_encode(const llmdd__hello *m, uint8_t *buf,
                                size_t cap);
int llmdd__wire_hello_decode(const uint8_t *buf, size_t len,
                             llmdd__hello *out);
size_t llmdd__wire_hello_reply_encode(const llmdd__hello_reply *m,
                                      uint8_t *buf, size_t cap);
int llmdd__wire_hello_reply_decode(const uint8_t *buf, size_t len,
                                   llmdd__hello_reply *out);
size_t llmdd__wire_confirm_encode(const llmdd__confirm *m, uint8_t *buf,
                                  size_t cap);
int llmdd__wire_confirm_decode(const uint8_t *buf, size_t len,
                               llmdd__confirm *out);
size_t llmdd__wire_result_encode(const llmdd__result *m, uint8_t *buf,
                                 size_t cap);
int llmdd__wire_result_decode(const uint8_t *buf, size_t len,
                              llmdd__result *out);

/*
 * LAYOUT_QUERY: seq, cache id. LAYOUT_REPLY: seq, status (LLM_SUCCESS with
 * the layout; LLM_KV_CACHE_NOT_EXIST; LLM_CACHE_INCOMPATIBLE: no layout),
 * and the layout's fields (zero unless LLM_SUCCESS). The decoder checks
 * only the encoding (num_dims 4 or 5, dims 1..5): the requester checks the
 * layout itself (core/slices.h) and against the cache's description.
 */
typedef struct {
    uint64_t seq;
    int64_t cache_id;
} llmdd__layout_query;
typedef struct {
    uint64_t seq;
    uint32_t status;
    llmdd_kv_layout layout;
} llmdd__layout_reply;
#define LLMDD_WIRE_LAYOUT_REPLY_LEN 50
size_t llmdd__wire_layout_query_encode(const llmdd__layout_query *m,
                                       uint8_t *buf, size_t cap);
int llmdd__wire_layout_query_decode(const uint8_t *buf, size_t len,
                                    llmdd__layout_query *out);
size_t llmdd__wire_layout_reply_encode(const llmdd__layout_reply *m,
                                       uint8_t *buf, size_t cap);
int llmdd__wire_layout_reply_decode(const uint8_t *buf, size_t len,
                                    llmdd__layout_reply *out);

size_t llmdd__wire_key_query_encode(const llmdd__key_query *m, uint8_t *buf,
                                    size_t cap);
int llmdd__wire_key_query_decode(const uint8_t *buf, size_t len,
                                 llmdd__key_query *out);
size_t llmdd__wire_key_reply_encode(const llmdd__key_reply *m, uint8_t *buf,
                                    size_t cap);
int llmdd__wire_key_reply_decode(const uint8_t *buf, size_t len,
                                 llmdd__key_reply *out);

size_t llmdd__wire_u32_encode(uint32_t v, uint8_t *buf, size_t cap);
int llmdd__wire_u32_decode(const uint8_t *buf, size_t len, uint32_t *out);
size_t llmdd__wire_i64_encode(int64_t v, uint8_t *buf, size_t cap);
int llmdd__wire_i64_decode(const uint8_t *buf, size_t len, int64_t *out);

/* QUERY_REPLY: status, then the desc and its batch dimension when status
 * is LLM_SUCCESS (base/codec.h). */
size_t llmdd__wire_desc_encode(uint32_t status, const llmdd_cache_desc *d,
                               uint32_t batch_dim, uint8_t *buf, size_t cap);
int llmdd__wire_desc_decode(const uint8_t *buf, size_t len, uint32_t *status,
                            llmdd_cache_desc *out, uint32_t *batch_dim);

/* READ_REPLY: status and the number of data bytes that follow. */
size_t llmdd__wire_read_reply_encode(uint32_t status, uint64_t total,
                                     uint8_t *buf, size_t cap);
int llmdd__wire_read_reply_decode(const uint8_t *buf, size_t len,
                                  uint32_t *status, uint64_t *total);

size_t llmdd__wire_rw_encode(const llmdd__rw_req *m, uint8_t *buf,
                             size_t cap);
/*
 * Decodes a request into *out; out->offs, lens, cnts and strides must have
 * room for LLMDD_WIRE_MAX_RUNS entries. Rejects nruns of 0 or above the cap,
 * count of 0, a length of 0, a strided run of fewer than 2 elements, and a
 * total that overflows. Where the elements lie is checked against the cache
 * (llmdd__cache_get_span).
 */
int llmdd__wire_rw_decode(const uint8_t *buf, size_t len, llmdd__rw_req *out);

#endif
