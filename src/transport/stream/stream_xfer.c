/*
 * The socket data plane's requesting side (stream.c's opening comment has the
 * design): the connection pool, queries, transfers request by request, and
 * striping a large transfer over several connections.
 */
#include "base/codec.h"
#include "transport/stream/stream_int.h"

/*
 * Transfers from this size on are striped, and each lane gets at least
 * STREAM_LANE_MIN bytes. Handing a lane to a lane thread costs a wake-up;
 * 1 MiB takes about 800 us at the 10 Gbit/s a cloud allows one flow, so a
 * lane is worth it well before that, while a small transfer keeps its one
 * round trip on one connection.
 */
#define STREAM_STRIPE_MIN (4u << 20)
#define STREAM_LANE_MIN (1u << 20)
#define STREAM_LANE_ALIGN 4096u /* lane borders, for the copies' sake */

/* ---- Requesting side: the connection pool. ---- */

void
llmdd__stream_pool_put_idle(llmdd__stream *s, int fd)
{
    pthread_mutex_lock(&s->lock);
    if (s->down || s->nidle == LLMDD__STREAM_CONNS_MAX) {
        s->nconns--;
        close(fd);
    } else {
        s->idle[s->nidle++] = fd;
    }
    pthread_cond_broadcast(&s->cond);
    pthread_mutex_unlock(&s->lock);
}

/*
 * s->lock held. Opens one more requester connection (client side), counted
 * in nconns meanwhile, with the lock dropped for the connect. Returns the
 * fd, or -1 (and it is no longer counted).
 */
static int
pool_open(llmdd__stream *s, int64_t deadline)
{
    s->nconns++;
    pthread_mutex_unlock(&s->lock);
    int fd = llmdd__data_connect(s->link, 0, deadline);
    if (fd >= 0)
        llmdd__stream_conn_mode(fd, true);
    pthread_mutex_lock(&s->lock);
    if (fd < 0)
        s->nconns--;
    return fd;
}

/*
 * s->lock held (dropped meanwhile). A new connection to the peer's listener
 * failed: cancelled, or at the deadline, that is the request's own end;
 * otherwise the peer refused or is unreachable, and the link goes with it,
 * so that LLM_NOT_YET_LINK means what it says for every later call.
 */
static llmdd_status
open_failed(llmdd__stream *s, int64_t deadline)
{
    if (llmdd__cancelled()) /* the wait gave up: the peer did nothing */
        return LLM_FAILED;
    if (llmdd__now_ms() >= deadline)
        return LLM_TIMEOUT;
    pthread_mutex_unlock(&s->lock);
    llmdd__link_drop(s->link, "data connection failed");
    pthread_mutex_lock(&s->lock);
    return LLM_NOT_YET_LINK;
}

/*
 * Takes an idle requester connection, opening one (client side) when the
 * pool is short. Returns the fd or -1 with *st set.
 */
static int
pool_take(llmdd__stream *s, int64_t deadline, llmdd_status *st)
{
    llmdd__link *link = s->link;
    int fd = -1;

    pthread_mutex_lock(&s->lock);
    for (;;) {
        if (s->down) {
            *st = LLM_NOT_YET_LINK;
            break;
        }
        if (s->nidle > 0) {
            fd = s->idle[--s->nidle];
            break;
        }
        if (link->client && s->nconns < s->nfwd) {
            if ((fd = pool_open(s, deadline)) < 0)
                *st = open_failed(s, deadline);
            break;
        }
        if (llmdd__now_ms() >= deadline) {
            *st = LLM_TIMEOUT;
            break;
        }
        llmdd__cond_wait_until(&s->cond, &s->lock, deadline);
    }
    if (fd >= 0)
        s->busy[s->nbusy++] = fd;
    pthread_mutex_unlock(&s->lock);
    return fd;
}

/* Returns a connection; a failed one is closed, its stream state unknown. */
static void
pool_give(llmdd__stream *s, int fd, bool ok)
{

    pthread_mutex_lock(&s->lock);
    for (int i = 0; i < s->nbusy; i++) {
        if (s->busy[i] == fd) {
            s->busy[i] = s->busy[--s->nbusy];
            break;
        }
    }
    pthread_mutex_unlock(&s->lock);
    if (ok) {
        llmdd__stream_pool_put_idle(s, fd);
        return;
    }
    pthread_mutex_lock(&s->lock);
    s->nconns--;
    bool down = s->down;
    pthread_cond_broadcast(&s->cond);
    pthread_mutex_unlock(&s->lock);
    close(fd);
    /* Only the client opens connections: the server asks for a new one,
     * unless the link is going down (io_status drops it before this). */
    if (!s->link->client && !down)
        llmdd__link_ask_reopen(s->link);
}

/* The status for an I/O failure: the deadline, or a lost peer. */
static llmdd_status
io_status(llmdd__link *link, int64_t deadline)
{
    /* A cancelled request: the connection goes (its stream position is
     * unknown), the link stays. */
    if (llmdd__cancelled())
        return LLM_FAILED;
    if (llmdd__now_ms() >= deadline)
        return LLM_TIMEOUT;
    llmdd__link_drop(link, "data connection lost");
    return LLM_NOT_YET_LINK;
}

llmdd_status
llmdd__stream_query(llmdd__stream *s, int64_t id, int64_t deadline,
                    llmdd_cache_desc *desc, uint32_t *batch_dim)
{
    llmdd__link *link = s->link;
    llmdd *dd = link->dd;
    uint8_t buf[4 + LLMDD__DESC_MAX];
    llmdd_status st;
    uint32_t status;
    uint16_t type;
    size_t len;
    bool to;
    int fd = pool_take(s, deadline, &st);

    if (fd < 0)
        return st;
    len = llmdd__wire_i64_encode(id, buf, sizeof(buf));
    if (llmdd__send_msg(dd->stop_fd, fd, WMSG_QUERY, buf, len, deadline) != 0 ||
        llmdd__recv_msg(dd->stop_fd, fd, &type, buf, sizeof(buf), &len,
                        deadline, &to) != 0 ||
        type != WMSG_QUERY_REPLY ||
        llmdd__wire_desc_decode(buf, len, &status, desc, batch_dim) != 0) {
        /* Drop first (if the peer is lost): then no REV is asked for. */
        st = io_status(link, deadline);
        pool_give(s, fd, false);
        return st;
    }
    pool_give(s, fd, true);
    return status == LLM_SUCCESS ? LLM_SUCCESS : LLM_KV_CACHE_NOT_EXIST;
}

/*
 * The lanes of one striped transfer. The first lane to fail cuts the others'
 * connections (their stream positions become unknown with it) and its
 * status is the transfer's.
 */
typedef struct {
    atomic_bool aborted;
    llmdd_status why; /* written once, by the lane that set aborted */
    int fds[LLMDD__STREAM_CONNS_MAX];
    int nfds;
} stripe;

/*
 * io_status for a lane: a lane cut because another failed first reports
 * that quietly; the transfer's status is the other lane's.
 */
static llmdd_status
lane_io_status(llmdd__link *link, int64_t deadline, const stripe *sp)
{
    if (sp != NULL && atomic_load(&sp->aborted))
        return LLM_FAILED;
    return io_status(link, deadline);
}

/* Per-request scratch: the request's remote runs, chunk entries each. */
typedef struct {
    uint64_t *offs, *lens, *cnts, *strides;
    llmdd__run2 *runs; /* the request's runs, both sides */
    uint8_t *buf;      /* the encoded request */
    size_t cap;
} chunk_buf;

/* One request of at most LLMDD_WIRE_MAX_RUNS runs: cb->runs[0, nruns). */
static llmdd_status
xfer_chunk(llmdd__link *link, int fd, const llmdd__xfer *x, const chunk_buf *cb,
           size_t nruns, bool *conn_ok, const stripe *sp)
{
    llmdd *dd = link->dd;
    const llmdd__run2 *runs = cb->runs;
    llmdd__rw_req req = {.cache_id = x->remote->id,
                         .first = x->remote_first,
                         .count = x->count,
                         .nruns = (uint32_t)nruns,
                         .offs = cb->offs,
                         .lens = cb->lens,
                         .cnts = cb->cnts,
                         .strides = cb->strides};
    seg_iter it = {.bases = x->local,
                   .count = x->count,
                   .offs = x->write ? &runs[0].src_off : &runs[0].dst_off,
                   .lens = &runs[0].len,
                   .cnts = &runs[0].count,
                   .strides =
                       x->write ? &runs[0].src_stride : &runs[0].dst_stride,
                   .step = sizeof(llmdd__run2) / sizeof(uint64_t),
                   .nruns = nruns};
    uint64_t total = 0;
    uint32_t status;
    size_t len;

    *conn_ok = false;
    for (size_t i = 0; i < nruns; i++) {
        cb->offs[i] = x->write ? runs[i].dst_off : runs[i].src_off;
        cb->lens[i] = runs[i].len;
        cb->cnts[i] = runs[i].count;
        cb->strides[i] = x->write ? runs[i].dst_stride : runs[i].src_stride;
        total += runs[i].len * runs[i].count;
    }
    total *= x->count;
    len = llmdd__wire_rw_encode(&req, cb->buf, cb->cap);
    uint8_t hdr[LLMDD_WIRE_HDR_LEN];
    llmdd__wire_frame_encode(hdr, x->write ? WMSG_WRITE : WMSG_READ,
                             (uint32_t)len);
    struct iovec pre[2] = {{hdr, sizeof(hdr)}, {cb->buf, len}};
    seg_iter none = {.count = 0};
    if (llmdd__stream_seg_io(dd, fd, &none, true, x->deadline_ms, 0, pre,
                             2) != 0)
        return lane_io_status(link, x->deadline_ms, sp);
    if (x->write) {
        /*
         * The data after the request, not with it: a push cancelled in
         * between then moves nothing, where data sent along would still
         * land in the peer's cache after we returned.
         */
        uint8_t reply[LLMDD_WIRE_HDR_LEN + 4];
        struct iovec rv = {reply, sizeof(reply)};
        llmdd__frame f;
        if (llmdd__stream_seg_io(dd, fd, &it, true, x->deadline_ms, 0, NULL,
                                 0) != 0 ||
            llmdd__stream_recv_reply(dd, fd, &rv, &none, x->deadline_ms) != 0 ||
            llmdd__wire_frame_decode(reply, &f) != 0 ||
            f.type != WMSG_WRITE_REPLY || f.len != 4 ||
            llmdd__wire_u32_decode(reply + LLMDD_WIRE_HDR_LEN, f.len,
                                   &status) != 0)
            return lane_io_status(link, x->deadline_ms, sp);
        *conn_ok = true;
        return status == LLM_SUCCESS ? LLM_SUCCESS : LLM_KV_CACHE_NOT_EXIST;
    }
    /* The reply frame, and with it whatever data came along. */
    uint8_t reply[LLMDD_WIRE_HDR_LEN + 16];
    size_t rlen = LLMDD_WIRE_HDR_LEN +
                  llmdd__wire_read_reply_encode(0, 0, reply, sizeof(reply));
    struct iovec rv = {reply, rlen};
    llmdd__frame f;
    uint64_t got;
    if (llmdd__stream_recv_reply(dd, fd, &rv, &it, x->deadline_ms) != 0 ||
        llmdd__wire_frame_decode(reply, &f) != 0 ||
        f.type != WMSG_READ_REPLY || f.len != rlen - LLMDD_WIRE_HDR_LEN ||
        llmdd__wire_read_reply_decode(reply + LLMDD_WIRE_HDR_LEN, f.len,
                                      &status, &got) != 0)
        return lane_io_status(link, x->deadline_ms, sp);
    if (status != LLM_SUCCESS) {
        *conn_ok = true;
        return LLM_KV_CACHE_NOT_EXIST;
    }
    if (got != total) {
        log_error("cluster %llu answered %llu bytes for %llu",
                  (unsigned long long)link->peer.cluster_id,
                  (unsigned long long)got, (unsigned long long)total);
        return LLM_FAILED;
    }
    if (llmdd__stream_seg_io(dd, fd, &it, false, x->deadline_ms, 0, NULL,
                             0) != 0)
        return lane_io_status(link, x->deadline_ms, sp);
    *conn_ok = true;
    return LLM_SUCCESS;
}

/*
 * Moves a whole plan over fd, request after request: each request takes at
 * most LLMDD_WIRE_MAX_RUNS runs and at most one remote tensor's worth of
 * bytes (the serving side's bound), cutting a 2-D run between elements
 * where it must. Only a plan that reads one place twice needs more than one
 * request for the bound; every element lies inside the tensor, so each
 * request gets at least one. *ok: the connection's stream is still in step
 * (it may go back to the pool).
 */
static llmdd_status
xfer_plan(llmdd__link *link, int fd, const llmdd__xfer *x, bool *ok,
          const stripe *sp)
{
    size_t nruns = llmdd__xfer_nruns(x);
    size_t chunk = nruns < LLMDD_WIRE_MAX_RUNS ? nruns : LLMDD_WIRE_MAX_RUNS;
    size_t room_enc = LLMDD_WIRE_MAX_PAYLOAD - 64; /* for the runs */
    chunk_buf cb = {.cap =
                        32 + (chunk * 32 < room_enc ? chunk * 32 : room_enc)};
    uint64_t *arr = malloc(4 * chunk * sizeof(*arr));
    llmdd_status st = LLM_OUT_OF_MEMORY;

    cb.runs = malloc(chunk * sizeof(*cb.runs));
    cb.buf = malloc(cb.cap);
    *ok = true;
    if (arr == NULL || cb.runs == NULL || cb.buf == NULL)
        goto out;
    cb.offs = arr;
    cb.lens = arr + chunk;
    cb.cnts = arr + 2 * chunk;
    cb.strides = arr + 3 * chunk;
    st = LLM_SUCCESS;
    size_t i = 0;
    uint64_t e = 0; /* the next element of run i */
    while (i < nruns && st == LLM_SUCCESS && *ok) {
        size_t n = 0, enc = 0;
        uint64_t room = x->remote->tensor_size;
        while (i < nruns && n < chunk) {
            llmdd__run2 r = llmdd__xfer_run(x, i);
            uint64_t left = r.count - e, k = left, fit = room / r.len;
            size_t size = k > 1 ? 32 : 16; /* its encoding */
            if (fit == 0 || enc + size > room_enc)
                break;
            enc += size;
            if (k > fit)
                k = fit;
            r.src_off += e * r.src_stride;
            r.dst_off += e * r.dst_stride;
            r.count = k;
            cb.runs[n++] = r;
            room -= k * r.len;
            e += k;
            if (k < left)
                break; /* the bound: the rest in the next request */
            e = 0;
            i++;
        }
        if (n == 0) { /* an element longer than the tensor: not planned */
            st = LLM_FAILED;
            break;
        }
        st = xfer_chunk(link, fd, x, &cb, n, ok, sp);
    }
out:
    free(cb.buf);
    free(cb.runs);
    free(arr);
    return st;
}

/* ---- Striping. ---- */

/*
 * Whether the plan writes no place twice. Lanes run at once, so a plan that
 * does (a repeated destination block) would no longer end with the last
 * write: such a plan is not striped. A slice's 2-D plan never does (its
 * destination table may not repeat a block, core/slice_xfer.c); a plain one
 * qualifies when its destination runs are in ascending order.
 */
static bool
stripe_ordered(const llmdd__xfer *x)
{
    uint64_t end = 0;

    if (x->runs2 != NULL)
        return true;
    for (size_t i = 0; i < llmdd__xfer_nruns(x); i++) {
        llmdd__run2 r = llmdd__xfer_run(x, i);
        if (r.dst_off < end || (r.count > 1 && r.dst_stride < r.len))
            return false;
        end = r.dst_off + (r.count - 1) * r.dst_stride + r.len;
    }
    return true;
}

/* How many lanes a transfer of `total` bytes gets: 1 means no striping. */
static int
stripe_width(const llmdd__stream *s, const llmdd__xfer *x, uint64_t total)
{
    if (s->lanes <= 1 || total < STREAM_STRIPE_MIN || !stripe_ordered(x))
        return 1;
    uint64_t n = total / STREAM_LANE_MIN;
    return n < (uint64_t)s->lanes ? (int)n : s->lanes;
}

/*
 * Up to max more requester connections for a transfer that already holds
 * one, without waiting for busy ones (two striped transfers waiting on each
 * other's lanes would never finish); the client opens missing ones. Returns
 * how many it put in fds.
 */
static int
pool_take_more(llmdd__stream *s, int *fds, int max, int64_t deadline)
{
    llmdd__link *link = s->link;
    int n = 0;

    pthread_mutex_lock(&s->lock);
    while (n < max && !s->down) {
        int fd = -1;
        if (s->nidle > 0) {
            fd = s->idle[--s->nidle];
        } else if (link->client && s->nconns < s->nfwd) {
            if ((fd = pool_open(s, deadline)) < 0)
                break;
        } else {
            break;
        }
        s->busy[s->nbusy++] = fd;
        fds[n++] = fd;
    }
    pthread_mutex_unlock(&s->lock);
    return n;
}

/* A lane's place: queued for a lane thread, running on one, done. */
enum lane_state { LANE_INLINE, LANE_QUEUED, LANE_RUNNING, LANE_DONE };

typedef struct llmdd__lane {
    llmdd__stream *s;
    const llmdd__xfer *x;
    uint64_t per;        /* bytes per tensor in the plan */
    uint64_t lo, hi;     /* this lane's bytes, in plan order */
    llmdd__run2 *tmp;    /* 3 x its runs, for a part of one tensor */
    stripe *sp;
    int fd;
    llmdd__cancel *cancel; /* the caller's, for the lane's thread */
    llmdd_status st;
    bool ok;
    enum lane_state state; /* s->lane_lock */
    struct llmdd__lane *next;
} lane;

/* Appends the run of r's elements [e0, e1) to out; returns out's count. */
static size_t
run_elems(llmdd__run2 r, uint64_t e0, uint64_t e1, uint64_t skip, uint64_t len,
          llmdd__run2 *out, size_t n)
{
    if (e0 >= e1 || len == 0)
        return n;
    r.src_off += e0 * r.src_stride + skip;
    r.dst_off += e0 * r.dst_stride + skip;
    r.count = e1 - e0;
    r.len = len;
    out[n] = r;
    return n + 1;
}

/*
 * The runs that cover bytes [a, b) of one tensor's part of x, into out (at
 * most three per run of x: a part of an element, whole elements, a part).
 */
static size_t
runs_slice(const llmdd__xfer *x, uint64_t a, uint64_t b, llmdd__run2 *out)
{
    uint64_t pos = 0;
    size_t n = 0;

    for (size_t i = 0; i < llmdd__xfer_nruns(x) && pos < b; i++) {
        llmdd__run2 r = llmdd__xfer_run(x, i);
        uint64_t size = r.len * r.count;
        uint64_t lo = a > pos ? a - pos : 0;
        uint64_t hi = b < pos + size ? b - pos : size;
        pos += size;
        if (lo >= hi)
            continue;
        uint64_t e0 = lo / r.len, e1 = hi / r.len; /* whole: [e0', e1) */
        uint64_t in0 = lo % r.len, in1 = hi % r.len;
        if (e0 == e1) { /* inside one element */
            n = run_elems(r, e0, e0 + 1, in0, in1 - in0, out, n);
            continue;
        }
        if (in0 > 0) {
            n = run_elems(r, e0, e0 + 1, in0, r.len - in0, out, n);
            e0++;
        }
        n = run_elems(r, e0, e1, 0, r.len, out, n);
        n = run_elems(r, e1, e1 + 1, 0, in1, out, n);
    }
    return n;
}

/*
 * Moves the lane's bytes as at most three plans: the rest of a tensor begun
 * by the lane before, whole tensors, the start of one the next lane ends.
 */
static void
lane_run(lane *l)
{
    const llmdd__xfer *x = l->x;
    uint64_t lo = l->lo;

    l->st = LLM_SUCCESS;
    l->ok = true;
    while (lo < l->hi && l->st == LLM_SUCCESS && l->ok) {
        uint64_t t = lo / l->per, a = lo % l->per, left = l->hi - lo;
        llmdd__xfer part = *x;
        part.remote_first = x->remote_first + (uint32_t)t;
        part.local = x->local + t;
        if (a == 0 && left >= l->per) {
            part.count = (uint32_t)(left / l->per);
            lo += part.count * l->per;
        } else {
            uint64_t b = left < l->per - a ? a + left : l->per;
            part.count = 1;
            part.runs = NULL;
            part.nruns = 0;
            part.runs2 = l->tmp;
            part.nruns2 = runs_slice(x, a, b, l->tmp);
            lo += b - a;
        }
        l->st = xfer_plan(l->s->link, l->fd, &part, &l->ok, l->sp);
    }
    if (!l->ok && !atomic_exchange(&l->sp->aborted, true)) {
        l->sp->why = l->st;
        for (int i = 0; i < l->sp->nfds; i++)
            if (l->sp->fds[i] != l->fd)
                shutdown(l->sp->fds[i], SHUT_RDWR);
    }
}

/*
 * s->lane_lock held. Takes the ended lane threads' ids out for the caller
 * to join once it dropped the lock (they no longer take it): returns how
 * many it put in out.
 */
static int
lanes_gone_take(llmdd__stream *s, pthread_t *out)
{
    int n = s->nlane_gone;

    memcpy(out, s->lane_gone, (size_t)n * sizeof(*out));
    s->nlane_gone = 0;
    return n;
}

static void
lanes_join(const pthread_t *t, int n)
{
    for (int i = 0; i < n; i++)
        pthread_join(t[i], NULL);
}

/*
 * A lane thread: runs queued lanes, one at a time, until the data plane is
 * freed. Sleeps on lane_work in between; after LLMDD__STREAM_LANE_IDLE_MS
 * without a lane it ends, so a link that stopped striping holds no thread.
 */
static void *
lane_main(void *p)
{
    llmdd__stream *s = p;

    pthread_mutex_lock(&s->lane_lock);
    for (;;) {
        int64_t idle_end = llmdd__now_ms() + LLMDD__STREAM_LANE_IDLE_MS;
        while (s->lane_head == NULL && !s->lane_stop &&
               llmdd__now_ms() < idle_end) {
            s->lane_idle++;
            llmdd__cond_wait_until(&s->lane_work, &s->lane_lock, idle_end);
            s->lane_idle--;
        }
        if (s->lane_head == NULL) {
            if (s->lane_stop)
                break;
            /* Idle too long: leave, to be joined by the next start or
             * the end. */
            for (int i = 0; i < s->nlane_thr; i++) {
                if (pthread_equal(s->lane_thr[i], pthread_self())) {
                    s->lane_gone[s->nlane_gone++] = s->lane_thr[i];
                    s->lane_thr[i] = s->lane_thr[--s->nlane_thr];
                    break;
                }
            }
            break;
        }
        lane *l = s->lane_head;
        s->lane_nqueued--;
        s->lane_head = l->next;
        if (s->lane_head == NULL)
            s->lane_tail = NULL;
        l->state = LANE_RUNNING;
        pthread_mutex_unlock(&s->lane_lock);
        /* A cancelled request wakes this lane's waits too; a lane without
         * its eventfd is woken by its armed socket and the others' cut. */
        (void)llmdd__cancel_enter(l->cancel, l->cancel != NULL);
        lane_run(l);
        llmdd__cancel_leave();
        pthread_mutex_lock(&s->lane_lock);
        l->state = LANE_DONE;
        pthread_cond_broadcast(&s->lane_done);
    }
    pthread_mutex_unlock(&s->lane_lock);
    return NULL;
}

void
llmdd__stream_lanes_init(llmdd__stream *s)
{
    pthread_mutex_init(&s->lane_lock, NULL);
    llmdd__cond_init(&s->lane_work);
    pthread_cond_init(&s->lane_done, NULL);
}

void
llmdd__stream_lanes_fini(llmdd__stream *s)
{
    pthread_t gone[LLMDD__STREAM_CONNS_MAX];

    pthread_mutex_lock(&s->lane_lock);
    s->lane_stop = true;
    pthread_cond_broadcast(&s->lane_work);
    pthread_mutex_unlock(&s->lane_lock);
    /* No thread starts after lane_stop: the list stays as it is. */
    for (int i = 0; i < s->nlane_thr; i++)
        pthread_join(s->lane_thr[i], NULL);
    pthread_mutex_lock(&s->lane_lock);
    int n = lanes_gone_take(s, gone);
    pthread_mutex_unlock(&s->lane_lock);
    lanes_join(gone, n);
    pthread_cond_destroy(&s->lane_done);
    pthread_cond_destroy(&s->lane_work);
    pthread_mutex_destroy(&s->lane_lock);
}

/*
 * Queues a lane for a lane thread, starting one when none is idle (up to
 * LLMDD__STREAM_CONNS_MAX). Without any thread the caller runs it.
 */
static void
lane_post(llmdd__stream *s, lane *l)
{
    pthread_t gone[LLMDD__STREAM_CONNS_MAX];

    pthread_mutex_lock(&s->lane_lock);
    int ngone = lanes_gone_take(s, gone);
    l->state = LANE_INLINE;
    /* An idle thread signalled for an earlier lane counts as idle until it
     * wakes: a thread is added unless enough idle ones remain for every
     * lane queued, this one included. */
    if (s->lane_idle <= s->lane_nqueued &&
        s->nlane_thr < LLMDD__STREAM_CONNS_MAX &&
        pthread_create(&s->lane_thr[s->nlane_thr], NULL, lane_main, s) == 0)
        s->nlane_thr++;
    if (s->nlane_thr > 0) {
        l->state = LANE_QUEUED;
        l->next = NULL;
        if (s->lane_tail != NULL)
            s->lane_tail->next = l;
        else
            s->lane_head = l;
        s->lane_tail = l;
        s->lane_nqueued++;
        pthread_cond_signal(&s->lane_work);
    }
    pthread_mutex_unlock(&s->lane_lock);
    lanes_join(gone, ngone);
}

/*
 * After the caller's own lane: a lane no thread has taken yet is taken back
 * and run here (every lane thread may be busy with other transfers' lanes);
 * one that is running is waited for.
 */
static void
lane_finish(llmdd__stream *s, lane *l)
{
    pthread_mutex_lock(&s->lane_lock);
    if (l->state == LANE_QUEUED) {
        lane **p = &s->lane_head;
        lane *prev = NULL;
        while (*p != l) {
            prev = *p;
            p = &(*p)->next;
        }
        *p = l->next;
        if (s->lane_tail == l)
            s->lane_tail = prev;
        s->lane_nqueued--;
        l->state = LANE_INLINE;
    }
    while (l->state == LANE_RUNNING)
        pthread_cond_wait(&s->lane_done, &s->lane_lock);
    pthread_mutex_unlock(&s->lane_lock);
    if (l->state == LANE_INLINE)
        lane_run(l);
}

/*
 * Moves x over fds[0..n): lane i gets the i-th of n equal byte ranges,
 * rounded to STREAM_LANE_ALIGN. Gives every connection back.
 */
static llmdd_status
stripe_run(llmdd__stream *s, const llmdd__xfer *x, uint64_t total,
           const int *fds, int n)
{
    lane lanes[LLMDD__STREAM_CONNS_MAX];
    size_t per = 3 * llmdd__xfer_nruns(x);
    llmdd__run2 *tmp = malloc((size_t)n * per * sizeof(*tmp));
    stripe sp = {.nfds = n};
    llmdd_status st = LLM_SUCCESS;

    if (tmp == NULL) {
        for (int i = 0; i < n; i++)
            pool_give(s, fds[i], true);
        return LLM_OUT_OF_MEMORY;
    }
    atomic_init(&sp.aborted, false);
    memcpy(sp.fds, fds, (size_t)n * sizeof(*fds));
    for (int i = 0; i < n; i++) {
        uint64_t lo = total / (uint64_t)n * (uint64_t)i;
        uint64_t hi = total / (uint64_t)n * (uint64_t)(i + 1);
        lanes[i] =
            (lane){.s = s,
                   .x = x,
                   .per = total / x->count,
                   .lo = lo - lo % STREAM_LANE_ALIGN,
                   .hi = i == n - 1 ? total : hi - hi % STREAM_LANE_ALIGN,
                   .tmp = tmp + (size_t)i * per,
                   .sp = &sp,
                   .fd = fds[i],
                   .cancel = x->cancel};
    }
    for (int i = 1; i < n; i++)
        lane_post(s, &lanes[i]);
    lane_run(&lanes[0]);
    for (int i = 1; i < n; i++)
        lane_finish(s, &lanes[i]);
    bool aborted = atomic_load(&sp.aborted);
    for (int i = 0; i < n; i++) {
        if (st == LLM_SUCCESS)
            st = lanes[i].st;
        /* After a cut no lane's stream can be trusted. */
        pool_give(s, fds[i], lanes[i].ok && !aborted);
    }
    free(tmp);
    return aborted ? sp.why : st;
}

llmdd_status
llmdd__stream_xfer(llmdd__stream *s, const llmdd__xfer *x)
{
    uint64_t total = llmdd__xfer_bytes(x);
    int fds[LLMDD__STREAM_CONNS_MAX];
    llmdd_status st;
    bool ok;
    int n = stripe_width(s, x, total);

    if ((fds[0] = pool_take(s, x->deadline_ms, &st)) < 0)
        return st;
    if (n > 1)
        n = 1 + pool_take_more(s, fds + 1, n - 1, x->deadline_ms);
    if (n > 1)
        return stripe_run(s, x, total, fds, n);
    st = xfer_plan(s->link, fds[0], x, &ok, NULL);
    pool_give(s, fds[0], ok);
    return st;
}
