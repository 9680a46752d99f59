/*
 * Fuzz target: a byte stream as a listener or a requester receives it. The
 * input is written into a socketpair and read back frame by frame with the
 * real llmdd__recv_msg (net.c), each frame decoded by its type with the
 * decoder the control plane or a data connection would use, WRITE and
 * READ_REPLY data consumed as a serving or requesting side would. Handshake
 * frames get the control plane's small buffer; after a data-connection HELLO
 * the full payload cap applies and frames are read as a serving side reads
 * requests (llmdd__stream_serve_next, whose first recv may take the start
 * of a WRITE's data along).
 */
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "core/internal.h"
#include "base/net.h"
#include "base/wire.h"
#include "fuzz/fuzz.h"
#include "transport/stream/stream_int.h"

#define CTRL_CAP 256      /* ctrl/ctrl.h's CTRL_MSG_MAX */
#define INPUT_MAX 65536   /* fits in the socket buffer: no writer thread */
#define FRAMES_MAX 256

static llmdd *dd; /* never initialized: no stop fd, no threads */
static uint8_t *buf;  /* a frame's payload */
static uint8_t *sbuf; /* llmdd__stream_serve_next's: header and payload */
static uint64_t *offs;

int
LLVMFuzzerInitialize(int *argc, char ***argv)
{
    (void)argc;
    (void)argv;
    if (llmdd_create(1, LLMDD_ROLE_MIX, &dd) != LLM_SUCCESS)
        abort();
    buf = malloc(LLMDD_WIRE_MAX_PAYLOAD);
    sbuf = malloc(LLMDD_WIRE_HDR_LEN + LLMDD_WIRE_MAX_PAYLOAD);
    offs = malloc(4 * LLMDD_WIRE_MAX_RUNS * sizeof(*offs));
    if (buf == NULL || sbuf == NULL || offs == NULL)
        abort();
    return 0;
}

/* Reads and discards up to n bytes of transfer data; -1 at end of input. */
static int
consume(int fd, uint64_t n, int64_t deadline)
{
    while (n > 0) {
        size_t k = n < LLMDD_WIRE_MAX_PAYLOAD ? (size_t)n
                                              : LLMDD_WIRE_MAX_PAYLOAD;
        if (llmdd__read_full(dd->stop_fd, fd, buf, k, deadline) != 0)
            return -1;
        n -= k;
    }
    return 0;
}

/*
 * One frame, its payload in buf and `extra` bytes of what follows already
 * read (serving side only); returns -1 where the real receiver would drop
 * the stream.
 */
static int
frame(int fd, uint16_t type, size_t len, size_t extra, size_t *cap,
      int64_t deadline)
{
    llmdd__rw_req req = {.offs = offs,
                         .lens = offs + LLMDD_WIRE_MAX_RUNS,
                         .cnts = offs + 2 * LLMDD_WIRE_MAX_RUNS,
                         .strides = offs + 3 * LLMDD_WIRE_MAX_RUNS};
    llmdd__hello_reply rep;
    llmdd_cache_desc desc;
    llmdd__confirm conf;
    llmdd__result res;
    llmdd__hello h;
    uint64_t total;
    uint32_t u;
    int64_t id;

    switch (type) {
    case WMSG_HELLO:
        if (llmdd__wire_hello_decode(buf, len, &h) != 0)
            return -1;
        if (h.kind == CONN_DATA)
            *cap = LLMDD_WIRE_MAX_PAYLOAD;
        return 0;
    case WMSG_HELLO_REPLY:
        return llmdd__wire_hello_reply_decode(buf, len, &rep);
    case WMSG_CONFIRM:
        return llmdd__wire_confirm_decode(buf, len, &conf);
    case WMSG_RESULT:
        return llmdd__wire_result_decode(buf, len, &res);
    case WMSG_DATA_REPLY:
    case WMSG_WRITE_REPLY:
        return llmdd__wire_u32_decode(buf, len, &u);
    case WMSG_UNLINK:
    case WMSG_UNLINK_ACK:
    case WMSG_REOPEN:
        return 0; /* no payload; the control thread ignores any */
    case WMSG_QUERY:
        return llmdd__wire_i64_decode(buf, len, &id);
    case WMSG_QUERY_REPLY:
        return llmdd__wire_desc_decode(buf, len, &u, &desc, &u);
    case WMSG_READ:
        return llmdd__wire_rw_decode(buf, len, &req);
    case WMSG_WRITE:
        if (llmdd__wire_rw_decode(buf, len, &req) != 0 || extra > req.total)
            return -1;
        return consume(fd, req.total - extra, deadline);
    case WMSG_READ_REPLY:
        if (llmdd__wire_read_reply_decode(buf, len, &u, &total) != 0)
            return -1;
        return u == LLM_SUCCESS ? consume(fd, total, deadline) : 0;
    default:
        return -1;
    }
}

int
LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    int sv[2];

    if (size > INPUT_MAX)
        return 0;
    if (socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv) != 0)
        abort();
    int sndbuf = 2 * INPUT_MAX;
    setsockopt(sv[0], SOL_SOCKET, SO_SNDBUF, &sndbuf, sizeof(sndbuf));
    for (size_t off = 0; off < size;) {
        ssize_t n = write(sv[0], data + off, size - off);
        if (n <= 0)
            abort();
        off += (size_t)n;
    }
    shutdown(sv[0], SHUT_WR);

    /* Everything is buffered and EOF follows: no call ever waits. */
    int64_t deadline = llmdd__now_ms() + 5000;
    size_t cap = CTRL_CAP;
    for (int i = 0; i < FRAMES_MAX; i++) {
        uint16_t type = 0;
        size_t len = 0, extra = 0;
        bool to;
        if (cap == LLMDD_WIRE_MAX_PAYLOAD) {
            const uint8_t *body;
            if (llmdd__stream_serve_next(dd, sv[1], sbuf, &type, &body, &len,
                                         &extra) != 0)
                break;
            FUZZ_CHECK(body == sbuf + LLMDD_WIRE_HDR_LEN);
            FUZZ_CHECK(len <= LLMDD_WIRE_MAX_PAYLOAD);
            /* What came along came in the first recv. */
            FUZZ_CHECK(extra == 0 || LLMDD_WIRE_HDR_LEN + len + extra <=
                                         LLMDD__STREAM_SERVE_FIRST);
            /* Only a WRITE may have data after it (serve_conn). */
            if (extra > 0 && type != WMSG_WRITE)
                break;
            memcpy(buf, body, len);
        } else {
            if (llmdd__recv_msg(dd->stop_fd, sv[1], &type, buf, cap, &len,
                                deadline, &to) != 0)
                break;
            FUZZ_CHECK(!to);
            FUZZ_CHECK(len <= cap);
        }
        if (frame(sv[1], type, len, extra, &cap, deadline) != 0)
            break;
    }
    close(sv[0]);
    close(sv[1]);
    return 0;
}
