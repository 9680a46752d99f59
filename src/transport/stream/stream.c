/*
 * The socket data plane (stream.h): one-sided reads and writes served from
 * registered memory over dedicated data connections.
 *
 * Each link has data connections beside its control connection, all opened
 * by the client (the side that linked): FWD connections carry the client's
 * requests, REV connections the server's, so both sides can pull and push
 * although only one listens. A requester takes an idle connection from its
 * pool for a whole transfer; a serving thread per connection answers
 * requests in order. READ data goes out with writev straight from the cache
 * and lands with readv straight in the destination: no copy in user space.
 *
 * A connection whose transfer failed midway is closed (its stream position is
 * unknown); the client opens a new FWD connection on demand; the server asks
 * the client for a new REV connection (llmdd__link_ask_reopen, answered by
 * llmdd__stream_reopen). Thread-safe: the pool is guarded by
 * llmdd__stream.lock.
 *
 * Striping (llmdd__stream_set_lanes): a transfer of at least
 * STREAM_STRIPE_MIN bytes is cut into contiguous byte ranges of its plan,
 * one per connection ("lane"), moved at once: the calling thread drives the
 * first lane and the data plane's lane threads the others, so that the
 * receive copies, which cost a core per flow at 25-100 GbE, run on several
 * cores; every lane lands its bytes in place. A lane whose connection fails
 * cuts the others and the transfer fails; it returns only after every lane
 * has stopped.
 *
 * Waiting: where a reply is due, the requester blocks in recvmsg itself
 * rather than in poll and then recvmsg, and an idle serving thread blocks
 * in recv for the next request: one wake-up and one system call fewer per
 * wait (a 4 KiB pull: 4 system calls, as a raw round trip; it was 7; see
 * BENCHMARKS.md). Data connections are in blocking mode
 * (llmdd__stream_conn_mode; every other call passes MSG_DONTWAIT). What
 * would have woken the poll cuts the socket instead: the link's shutdown
 * (stream_shutdown), a cache's removal, a cancel (the socket is armed,
 * llmdd__cancel_arm). A requester's blocking wait lasts at
 * most STREAM_SLICE_MS (the socket's receive timeout) and starts only with
 * more time than that left, so it never outlives the deadline; the rest of
 * a long wait is a poll up to the deadline.
 */
#include "base/codec.h"
#include "transport/stream/stream_int.h"

#include <sys/ioctl.h>

#define STREAM_IOV_MAX 512
#define STREAM_STALL_MS 5000 /* a serving side gives up on a peer this silent */
/*
 * The slowest a peer may take a reply or send a WRITE's data: a serving side
 * allows each one STREAM_STALL_MS plus its size at this rate, so a peer that
 * moves a byte now and then, never silent for a whole stall, still cannot
 * hold the cache for longer than its request is worth. 1 MiB/s (8 Mbit/s) is
 * far below any network a KV cache moves over; a slower one sees its
 * transfers cut.
 */
#define STREAM_FLOOR_BPS (1u << 20)
#define STREAM_SLICE_MS 50 /* a requester's longest blocking recvmsg */

void
llmdd__stream_conn_mode(int fd, bool requester)
{
    int off = 0;
    struct timeval tv = {.tv_usec = STREAM_SLICE_MS * 1000};

    /* Should either fail, the waits below fall back to poll. */
    (void)ioctl(fd, FIONBIO, &off);
    if (requester)
        (void)setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
}

/*
 * A requester's recvmsg that waits for data: blocked in the call for up to
 * a slice when more than that is left (cut by a cancel, the link's
 * shutdown), then in llmdd__wait_fd up to the deadline. Returns the bytes
 * received, 0 at end of stream, -1 on error, timeout, stop or cancel.
 */
static ssize_t
recv_wait(llmdd *dd, int fd, struct msghdr *mh, int64_t deadline)
{
    for (;;) {
        if (deadline - llmdd__now_ms() > STREAM_SLICE_MS) {
            llmdd__armed a;
            int arm = llmdd__cancel_arm(&a, fd);
            if (arm == LLMDD__CANCEL_FIRED)
                return -1;
            ssize_t k = recvmsg(fd, mh, 0);
            int err = errno;
            if (arm == LLMDD__CANCEL_ARMED && llmdd__cancel_disarm(&a))
                return -1; /* cancelled: the socket is cut */
            if (k >= 0)
                return k;
            if (err != EAGAIN && err != EWOULDBLOCK && err != EINTR)
                return -1;
            /* A slice without data, or a socket that is not in blocking
             * mode after all: the rest of the wait polls. */
        }
        if (llmdd__wait_fd(dd->stop_fd, fd, POLLIN, deadline) != 1)
            return -1;
        ssize_t k = recvmsg(fd, mh, MSG_DONTWAIT);
        if (k >= 0)
            return k;
        if (errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR)
            return -1;
    }
}

/* ---- Scatter/gather over (tensor, run, element) segments. ---- */

/*
 * Elements shorter than this go through a bounce buffer of STREAM_BOUNCE
 * bytes, gathered or scattered with memcpy, when at least STREAM_BOUNCE_MIN
 * bytes of them come in a row: the kernel's cost per iovec entry makes
 * 256-byte entries move at a third of one large one over loopback, and the
 * copy through a buffer costs less (BENCHMARKS.md, the KV layouts
 * section). Larger elements go straight from and to memory. 1 MiB, not the
 * 64 KiB it was: a call per 64 KiB cost an NHD head slice of 256-byte
 * elements a fifth of its speed over loopback. The allocation is per call
 * and glibc keeps such a block in its heap once one was freed.
 */
#define STREAM_BOUNCE_ELEM 512u
#define STREAM_BOUNCE_MIN 2048u
#define STREAM_BOUNCE (1u << 20)

static inline uint64_t
seg_cnt(const seg_iter *it, size_t r)
{
    return it->cnts != NULL ? it->cnts[r * it->step] : 1;
}

static inline uint8_t *
seg_at(const seg_iter *it, uint32_t t, size_t r, uint64_t e)
{
    size_t k = r * it->step;
    uint64_t off = it->offs[k] + (e > 0 ? e * it->strides[k] : 0);
    return it->bases[t] + off;
}

/* Steps (t, r, e) to the next element. */
static inline void
seg_next(const seg_iter *it, uint32_t *t, size_t *r, uint64_t *e)
{
    if (++*e < seg_cnt(it, *r))
        return;
    *e = 0;
    if (++*r == it->nruns) {
        *r = 0;
        ++*t;
    }
}

static size_t
seg_fill(const seg_iter *it, struct iovec *iov, size_t max)
{
    uint32_t t = it->t;
    size_t r = it->r, n = 0;
    uint64_t e = it->e, done = it->done;

    while (n < max && t < it->count) {
        iov[n].iov_base = seg_at(it, t, r, e) + done;
        iov[n].iov_len = (size_t)(it->lens[r * it->step] - done);
        n++;
        done = 0;
        seg_next(it, &t, &r, &e);
    }
    return n;
}

static void
seg_advance(seg_iter *it, size_t bytes)
{
    while (bytes > 0 && it->t < it->count) {
        uint64_t left = it->lens[it->r * it->step] - it->done;
        if (bytes < left) {
            it->done += bytes;
            return;
        }
        bytes -= (size_t)left;
        it->done = 0;
        seg_next(it, &it->t, &it->r, &it->e);
    }
}

/* Copies n bytes into the segments from it on (they hold at least n). */
static void
seg_put(seg_iter *it, const uint8_t *src, size_t n)
{
    struct iovec iov;

    while (n > 0 && seg_fill(it, &iov, 1) == 1) {
        size_t take = n < iov.iov_len ? n : iov.iov_len;
        memcpy(iov.iov_base, src, take);
        seg_advance(it, take);
        src += take;
        n -= take;
    }
}

/*
 * The bytes of the short elements from it on, up to cap, copied into out
 * unless it is NULL; it does not move. 0 when they are fewer than
 * STREAM_BOUNCE_MIN (or the next element is not short).
 */
static size_t
seg_gather(const seg_iter *it, uint8_t *out, size_t cap)
{
    uint32_t t = it->t;
    size_t r = it->r, n = 0;
    uint64_t e = it->e, done = it->done;

    while (n < cap && t < it->count) {
        uint64_t len = it->lens[r * it->step];
        if (len >= STREAM_BOUNCE_ELEM)
            break;
        size_t take = (size_t)(len - done);
        if (take > cap - n)
            take = cap - n;
        if (out != NULL)
            memcpy(out + n, seg_at(it, t, r, e) + done, take);
        n += take;
        done = 0;
        seg_next(it, &t, &r, &e);
    }
    return n >= STREAM_BOUNCE_MIN ? n : 0;
}

/*
 * Moves every segment through fd by the deadline. With stall_ms > 0 (a
 * serving side) it also gives up once the peer moved nothing for stall_ms.
 * A sender may put npre buffers first (a frame that announces the data),
 * consumed in place: header and data then leave in one sendmsg, so that a
 * small transfer is one segment and wakes its receiver once, not twice.
 * Runs of short elements pass through a bounce buffer (STREAM_BOUNCE_ELEM).
 */
int
llmdd__stream_seg_io(llmdd *dd, int fd, seg_iter *it, bool send,
                     int64_t deadline, int stall_ms, struct iovec *pre,
                     size_t npre)
{
    struct iovec iov[STREAM_IOV_MAX];
    int64_t stall = stall_ms > 0 ? llmdd__now_ms() + stall_ms : deadline;
    uint8_t *bounce = NULL;
    size_t blen = 0, boff = 0; /* a send's gathered bytes, and those sent */
    int rc = 0;

    for (;;) {
        size_t np = 0;
        for (size_t i = 0; i < npre; i++)
            if (pre[i].iov_len > 0)
                iov[np++] = pre[i];
        if (np == 0 && it->t >= it->count)
            break;
        size_t n = np, want = boff < blen ? blen - boff : 0;
        if (want == 0 && it->t < it->count)
            want = seg_gather(it, NULL, STREAM_BOUNCE);
        if (want > 0 && bounce == NULL &&
            (bounce = malloc(STREAM_BOUNCE)) == NULL) {
            rc = -1;
            break;
        }
        if (want > 0 && send && boff == blen) {
            blen = seg_gather(it, bounce, STREAM_BOUNCE);
            boff = 0;
        }
        if (want > 0)
            iov[n++] = (struct iovec){bounce + (send ? boff : 0), want};
        else
            n += seg_fill(it, iov + np, STREAM_IOV_MAX - np);
        struct msghdr mh = {.msg_iov = iov, .msg_iovlen = n};
        ssize_t k = send ? sendmsg(fd, &mh, MSG_DONTWAIT | MSG_NOSIGNAL)
                         : recvmsg(fd, &mh, MSG_DONTWAIT);
        if (k > 0) {
            size_t left = (size_t)k;
            for (size_t i = 0; i < npre && left > 0; i++) {
                size_t take = left < pre[i].iov_len ? left : pre[i].iov_len;
                pre[i].iov_base = (uint8_t *)pre[i].iov_base + take;
                pre[i].iov_len -= take;
                left -= take;
            }
            if (want > 0 && !send) {
                seg_put(it, bounce, left);
            } else {
                boff += want > 0 ? left : 0;
                seg_advance(it, left);
            }
            if (stall_ms > 0)
                stall = llmdd__now_ms() + stall_ms;
            continue;
        }
        if (k == 0 && !send) {
            rc = -1;
            break;
        }
        if (k < 0 && errno == EINTR)
            continue;
        if ((k < 0 && errno != EAGAIN && errno != EWOULDBLOCK) ||
            llmdd__wait_fd(dd->stop_fd, fd, send ? POLLOUT : POLLIN,
                           stall < deadline ? stall : deadline) != 1) {
            rc = -1;
            break;
        }
    }
    free(bounce);
    return rc;
}

/*
 * Requester side of a reply: receives the reply frame into *rv and, in the
 * same recvmsg, as much of a READ's data as came with it (the server sends
 * both in one go; it is an empty iterator for other replies). Only a reply
 * without data can fall short of the data (a refusal, which is all the peer
 * sends), so no byte lands before the reply is complete that the reply did
 * not announce; a peer that lies about it is a protocol error caught by the
 * caller.
 */
int
llmdd__stream_recv_reply(llmdd *dd, int fd, struct iovec *rv, seg_iter *it,
                         int64_t deadline)
{
    struct iovec iov[STREAM_IOV_MAX];

    while (rv->iov_len > 0) {
        iov[0] = *rv;
        size_t n = 1 + seg_fill(it, iov + 1, STREAM_IOV_MAX - 1);
        struct msghdr mh = {.msg_iov = iov, .msg_iovlen = n};
        ssize_t k = recv_wait(dd, fd, &mh, deadline);
        if (k <= 0)
            return -1;
        size_t take = (size_t)k < rv->iov_len ? (size_t)k : rv->iov_len;
        rv->iov_base = (uint8_t *)rv->iov_base + take;
        rv->iov_len -= take;
        seg_advance(it, (size_t)k - take);
    }
    return 0;
}

/* Reads and throws away len bytes (a refused WRITE's payload). */
static int
drain(llmdd *dd, int fd, uint64_t len)
{
    uint8_t buf[65536];

    while (len > 0) {
        size_t n = len < sizeof(buf) ? (size_t)len : sizeof(buf);
        int64_t stall = llmdd__now_ms() + STREAM_STALL_MS;
        if (llmdd__read_full(dd->stop_fd, fd, buf, n, stall) != 0)
            return -1;
        len -= n;
    }
    return 0;
}

/* ---- Serving side. ---- */

static int
serve_query(llmdd *dd, int fd, const uint8_t *buf, size_t len)
{
    uint8_t out[4 + LLMDD__DESC_MAX];
    llmdd__cache *c = NULL;
    uint32_t st = LLM_KV_CACHE_NOT_EXIST;
    int64_t id;
    size_t n;

    if (llmdd__wire_i64_decode(buf, len, &id) != 0)
        return -1;
    c = llmdd__cache_get(dd, id);
    if (c != NULL)
        st = LLM_SUCCESS;
    n = llmdd__wire_desc_encode(st, c != NULL ? &c->desc : NULL,
                                c != NULL ? c->slot.batch_dim : 0, out,
                                sizeof(out));
    llmdd__cache_put(dd, c);
    return llmdd__send_msg(dd->stop_fd, fd, WMSG_QUERY_REPLY, out, n,
                           llmdd__now_ms() + STREAM_STALL_MS);
}

/*
 * Says which cache the request on fd moves (0: none), for cache_removed.
 * Set before the cache is looked up, so that a removal either happens first
 * (the lookup fails) or finds the mark.
 */
static void
serve_mark(llmdd__stream *s, int fd, int64_t cache_id)
{
    pthread_mutex_lock(&s->lock);
    for (int i = 0; i < s->serve.n; i++)
        if (s->serve.conn[i].fd == fd)
            s->serve.conn[i].cache_id = cache_id;
    if (cache_id == 0)
        pthread_cond_broadcast(&s->cond);
    pthread_mutex_unlock(&s->lock);
}

/*
 * A request may move at most one tensor's worth of bytes per tensor: our
 * requester never asks for more in one request (llmdd__stream_xfer splits
 * larger plans), and without the bound one request of 1 MiB naming the
 * same tensor 65,532 times asks for terabytes and pins the cache meanwhile.
 * total is count * the run lengths' sum, checked for overflow by the decoder.
 */
static bool
serve_bounded(const llmdd__cache *c, const llmdd__rw_req *req)
{
    return req->total / req->count <= c->tensor_size;
}

/* The decoded runs of one request: LLMDD_WIRE_MAX_RUNS entries each. */
typedef struct {
    uint64_t *offs, *lens, *cnts, *strides;
} serve_runs;

static int
serve_rw(llmdd__stream *s, int fd, uint16_t type, const uint8_t *buf,
         size_t len, const uint8_t *extra, size_t nextra, const serve_runs *sr)
{
    llmdd *dd = s->link->dd;
    llmdd__rw_req req = {.offs = sr->offs,
                         .lens = sr->lens,
                         .cnts = sr->cnts,
                         .strides = sr->strides};
    llmdd__cache *c = NULL;
    uint8_t out[16];
    llmdd_status st;
    size_t n;
    int rc = 0;

    if (llmdd__wire_rw_decode(buf, len, &req) != 0)
        return -1;
    serve_mark(s, fd, req.cache_id);
    st = llmdd__cache_get_span(dd, req.cache_id, req.first, req.count, req.offs,
                               req.lens, req.cnts, req.strides, req.nruns, &c);
    if (st == LLM_SUCCESS && !serve_bounded(c, &req)) {
        log_error("cluster %llu asked for %llu bytes of cache %lld in one "
                  "request, more than its tensors hold; refused",
                  (unsigned long long)s->link->peer.cluster_id,
                  (unsigned long long)req.total, (long long)req.cache_id);
        llmdd__cache_put(dd, c);
        c = NULL;
        st = LLM_PARAM_INVALID;
        /* Draining such a WRITE's payload would cost more than the cache. */
        if (type == WMSG_WRITE)
            rc = -1;
    }
    uint8_t *bases[1];
    seg_iter it = {.offs = req.offs,
                   .lens = req.lens,
                   .cnts = req.cnts,
                   .strides = req.strides,
                   .step = 1,
                   .nruns = req.nruns};
    uint8_t **tb = NULL;
    if (st == LLM_SUCCESS) {
        tb = req.count == 1 ? bases : malloc(req.count * sizeof(*tb));
        if (tb == NULL) {
            st = LLM_OUT_OF_MEMORY;
        } else {
            for (uint32_t t = 0; t < req.count; t++)
                tb[t] = (uint8_t *)(uintptr_t)c->addrs[req.first + t];
            it.bases = tb;
            it.count = req.count;
        }
    }
    int64_t now = llmdd__now_ms(), stall = now + STREAM_STALL_MS;
    /* The data's deadline: the stall limit plus its size at the floor. */
    int64_t data = stall + (int64_t)(req.total / (STREAM_FLOOR_BPS / 1000));
    if (rc != 0) {
        /* Refused above; no byte moves. */
    } else if (type == WMSG_READ) {
        uint8_t hdr[LLMDD_WIRE_HDR_LEN];
        n = llmdd__wire_read_reply_encode(st, st == LLM_SUCCESS ? req.total : 0,
                                          out, sizeof(out));
        llmdd__wire_frame_encode(hdr, WMSG_READ_REPLY, (uint32_t)n);
        struct iovec pre[2] = {{hdr, sizeof(hdr)}, {out, n}};
        /* The reply and its data in one go; a refusal has no data. */
        rc = llmdd__stream_seg_io(dd, fd, &it, true,
                                  st == LLM_SUCCESS ? data : stall,
                                  STREAM_STALL_MS, pre, 2);
    } else if (nextra > req.total) {
        rc = -1; /* more than its data: the peer is out of step */
    } else {
        /* The data; the request's read may have taken its start. */
        if (st == LLM_SUCCESS) {
            seg_put(&it, extra, nextra);
            rc = llmdd__stream_seg_io(dd, fd, &it, false, data,
                                      STREAM_STALL_MS, NULL, 0);
        } else {
            rc = drain(dd, fd, req.total - nextra);
        }
        if (rc == 0) {
            n = llmdd__wire_u32_encode(st, out, sizeof(out));
            rc = llmdd__send_msg(dd->stop_fd, fd, WMSG_WRITE_REPLY, out, n,
                                 llmdd__now_ms() + STREAM_STALL_MS);
        }
    }
    if (tb != bases)
        free(tb);
    llmdd__metrics_served(dd, s->link->ops, type == WMSG_WRITE,
                          rc != 0 && st == LLM_SUCCESS ? LLM_FAILED : st,
                          req.total);
    serve_mark(s, fd, 0);
    llmdd__cache_put(dd, c);
    return rc;
}

/*
 * Receives the next request into buf (LLMDD_WIRE_HDR_LEN + the largest
 * payload): *body is its payload, *len the payload's length. An idle
 * connection waits for as long as the link lives, blocked in recv until the
 * request begins or the socket is cut (the link's shutdown); the rest of
 * the request then has STREAM_STALL_MS. The first recv takes up to
 * LLMDD__STREAM_SERVE_FIRST bytes, a small request whole; what came after
 * the request (the start of a WRITE's data) is at *body + *len, *extra
 * bytes of it.
 */
int
llmdd__stream_serve_next(llmdd *dd, int fd, uint8_t *buf, uint16_t *type,
                         const uint8_t **body, size_t *len, size_t *extra)
{
    llmdd__frame f;
    ssize_t k;

    do
        k = recv(fd, buf, LLMDD__STREAM_SERVE_FIRST, 0);
    while (k < 0 && errno == EINTR);
    if (k == 0)
        return -1; /* the peer closed, or the socket was cut */
    if (k < 0) {
        if (errno != EAGAIN && errno != EWOULDBLOCK)
            return -1;
        /* Not in blocking mode after all (llmdd__stream_conn_mode). */
        if (llmdd__wait_fd(dd->stop_fd, fd, POLLIN, INT64_MAX) != 1)
            return -1;
        k = 0;
    }
    size_t got = (size_t)k;
    int64_t stall = llmdd__now_ms() + STREAM_STALL_MS;
    if (got < LLMDD_WIRE_HDR_LEN) {
        if (llmdd__read_full(dd->stop_fd, fd, buf + got,
                             LLMDD_WIRE_HDR_LEN - got, stall) != 0)
            return -1;
        got = LLMDD_WIRE_HDR_LEN;
    }
    if (llmdd__wire_frame_decode(buf, &f) != 0 ||
        f.len > LLMDD_WIRE_MAX_PAYLOAD)
        return -1;
    size_t need = LLMDD_WIRE_HDR_LEN + f.len;
    if (got < need &&
        llmdd__read_full(dd->stop_fd, fd, buf + got, need - got, stall) != 0)
        return -1;
    *type = f.type;
    *body = buf + LLMDD_WIRE_HDR_LEN;
    *len = f.len;
    *extra = got > need ? got - need : 0;
    return 0;
}

/* Answers requests on fd until the peer closes or the link goes down. */
static void
serve_conn(llmdd__stream *s, int fd)
{
    llmdd *dd = s->link->dd;
    uint8_t *buf = malloc(LLMDD_WIRE_HDR_LEN + LLMDD_WIRE_MAX_PAYLOAD);
    uint64_t *offs = malloc(4 * LLMDD_WIRE_MAX_RUNS * sizeof(*offs));
    serve_runs sr = {offs, offs + LLMDD_WIRE_MAX_RUNS,
                     offs + 2 * LLMDD_WIRE_MAX_RUNS,
                     offs + 3 * LLMDD_WIRE_MAX_RUNS};

    if (buf == NULL || offs == NULL ||
        !llmdd__serve_track(&s->serve, fd, true))
        goto out;
    llmdd__stream_conn_mode(fd, false);
    for (;;) {
        const uint8_t *body;
        uint16_t type;
        size_t len, extra;

        if (llmdd__stream_serve_next(dd, fd, buf, &type, &body, &len,
                                     &extra) != 0)
            break;
        int rc = -1;
        /* Only a WRITE's data may follow a request before its reply. */
        if (type == WMSG_QUERY && extra == 0)
            rc = serve_query(dd, fd, body, len);
        else if (type == WMSG_READ && extra == 0)
            rc = serve_rw(s, fd, type, body, len, NULL, 0, &sr);
        else if (type == WMSG_WRITE)
            rc = serve_rw(s, fd, type, body, len, body + len, extra, &sr);
        if (rc != 0)
            break;
    }
    llmdd__serve_track(&s->serve, fd, false);
out:
    free(offs);
    free(buf);
    close(fd);
}

/* ---- Setup and teardown. ---- */

static void
serve_fn(void *s, int fd)
{
    serve_conn(s, fd);
}

/* The pool arrays have room for LLMDD__STREAM_CONNS_MAX connections. */
static int
conns_clamp(int n)
{
    if (n < 1)
        return 1;
    return n > LLMDD__STREAM_CONNS_MAX ? LLMDD__STREAM_CONNS_MAX : n;
}

llmdd__stream *
llmdd__stream_new(llmdd__link *link, int nfwd, int nrev, int serve_max)
{
    llmdd__stream *s = calloc(1, sizeof(*s));

    if (s == NULL)
        return NULL;
    s->link = link;
    s->nfwd = conns_clamp(nfwd);
    s->nrev = conns_clamp(nrev);
    s->lanes = 1;
    pthread_mutex_init(&s->lock, NULL);
    llmdd__cond_init(&s->cond);
    llmdd__serve_init(&s->serve, &s->lock, &s->cond, &s->down, serve_max);
    llmdd__stream_lanes_init(s);
    return s;
}

void
llmdd__stream_set_lanes(llmdd__stream *s, int lanes)
{
    s->lanes = conns_clamp(lanes);
}

/* Client side: opens a REV connection and serves the peer's requests. */
static int
rev_open(llmdd__stream *s, int64_t deadline)
{
    llmdd__link *link = s->link;
    int fd = llmdd__data_connect(link, LLMDD__STREAM_FLAG_REV, deadline);

    return llmdd__serve_spawn(link, serve_fn, s, fd);
}

/*
 * Why a data connection of the link could not be opened: the link call's
 * deadline passed (a connect or handshake that never finished), or the peer
 * failed or refused it.
 */
static llmdd_status
connect_status(const llmdd__link *link)
{
    return llmdd__now_ms() >= link->deadline_ms ? LLM_TIMEOUT
                                                : LLM_LINK_FAILED;
}

llmdd_status
llmdd__stream_connect(llmdd__stream *s)
{
    llmdd__link *link = s->link;

    /* FWD connections for our requests; REV ones we serve for the peer. */
    for (int i = 0; i < s->nfwd; i++) {
        int fd = llmdd__data_connect(link, 0, link->deadline_ms);
        if (fd < 0)
            return connect_status(link);
        llmdd__stream_conn_mode(fd, true);
        pthread_mutex_lock(&s->lock);
        s->nconns++;
        s->idle[s->nidle++] = fd;
        pthread_mutex_unlock(&s->lock);
    }
    for (int i = 0; i < s->nrev; i++)
        if (rev_open(s, link->deadline_ms) != 0)
            return connect_status(link);
    return LLM_SUCCESS;
}

void
llmdd__stream_reopen(llmdd__stream *s)
{
    pthread_mutex_lock(&s->lock);
    bool down = s->down;
    pthread_mutex_unlock(&s->lock);
    if (!down && rev_open(s, llmdd__now_ms() + STREAM_STALL_MS) != 0)
        log_warn("cluster %llu asked for a data connection; none opened",
                 (unsigned long long)s->link->peer.cluster_id);
}

void
llmdd__stream_accept(llmdd__stream *s, int fd, uint32_t flags)
{
    if (flags & LLMDD__STREAM_FLAG_REV) {
        pthread_mutex_lock(&s->lock);
        bool room = !s->down && s->nconns < s->nrev;
        if (room)
            s->nconns++;
        pthread_mutex_unlock(&s->lock);
        if (room) {
            llmdd__stream_conn_mode(fd, true);
            llmdd__stream_pool_put_idle(s, fd);
        } else
            close(fd);
        return;
    }
    serve_conn(s, fd); /* in this (counted) thread until it closes */
}

void
llmdd__stream_shutdown(llmdd__stream *s)
{
    if (s == NULL)
        return;
    pthread_mutex_lock(&s->lock);
    s->down = true;
    llmdd__serve_shutdown(&s->serve);
    for (int i = 0; i < s->nbusy; i++)
        shutdown(s->busy[i], SHUT_RDWR);
    for (int i = 0; i < s->nidle; i++)
        close(s->idle[i]);
    s->nconns -= s->nidle;
    s->nidle = 0;
    pthread_cond_broadcast(&s->cond);
    pthread_mutex_unlock(&s->lock);
}

bool
llmdd__stream_quiesce(llmdd__stream *s, int64_t deadline_ms)
{
    return s == NULL || llmdd__serve_wait_idle(&s->serve, deadline_ms);
}

/* Whether a request on one of our serving connections moves cache_id. */
static bool
serving(const llmdd__stream *s, int64_t cache_id)
{
    for (int i = 0; i < s->serve.n; i++)
        if (s->serve.conn[i].cache_id == cache_id)
            return true;
    return false;
}

void
llmdd__stream_cache_removed(llmdd__stream *s, const llmdd__cache *cache)
{
    uint32_t wait_ms = s->link->opts.wait_ms;
    int64_t deadline = llmdd__now_ms() + wait_ms;

    pthread_mutex_lock(&s->lock);
    while (serving(s, cache->id) && llmdd__now_ms() < deadline)
        llmdd__cond_wait_until(&s->cond, &s->lock, deadline);
    /* Cut what is still at it: the serving thread fails out of its I/O and
     * lets go of the cache, which the owner is waiting for. */
    for (int i = 0; i < s->serve.n; i++) {
        if (s->serve.conn[i].cache_id != cache->id)
            continue;
        log_warn("cluster %llu still moving cache %lld %u ms after it was "
                 "removed; its data connection is cut",
                 (unsigned long long)s->link->peer.cluster_id,
                 (long long)cache->id, (unsigned)wait_ms);
        shutdown(s->serve.conn[i].fd, SHUT_RDWR);
    }
    pthread_mutex_unlock(&s->lock);
}

void
llmdd__stream_free(llmdd__stream *s)
{
    if (s == NULL)
        return;
    /* Serving threads hold link references: none is left by now, and
     * neither is a transfer (it holds one too). */
    llmdd__stream_lanes_fini(s);
    for (int i = 0; i < s->nidle; i++)
        close(s->idle[i]);
    pthread_cond_destroy(&s->cond);
    pthread_mutex_destroy(&s->lock);
    free(s);
}
