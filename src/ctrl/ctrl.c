/*
 * The control plane: the listener and the control thread that watches
 * every link's control socket (the handshake: handshake.c; the link and
 * unlink calls: linking.c). The link table it fills is core state
 * (core/link.c). The plane sits above the core: llmdd_create registers
 * ctrl_plane with the instance, and the core starts, stops and wakes the
 * plane only through it (llmdd__plane_ops).
 *
 * One control thread per instance polls the listening socket, each link's
 * control socket, the accepted connections that have sent nothing yet and a
 * wake eventfd. A connection whose first bytes arrive goes to a short-lived
 * handshake thread (at most HANDSHAKE_MAX at once, each bounded by
 * HANDSHAKE_MS), in the order accepted, so a slow or hostile client delays
 * nobody else: idle connections (slowloris) hold no thread, and while
 * connections wait for one, the thread that has waited longest for the rest
 * of its HELLO is evicted. It is the only reader of link control sockets: it
 * answers UNLINK, records UNLINK_ACK, and drops a link whose peer closed.
 */
#include <arpa/inet.h>
#include <errno.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <sys/ioctl.h>
#include <time.h>
#include <sys/socket.h>
#include <unistd.h>

#include "ctrl/ctrl.h"

#define ACCEPT_BACKOFF_MIN_MS 10
#define ACCEPT_BACKOFF_MAX_MS 1000
/*
 * A link's share of one round of the control thread: what is read of it
 * before the thread moves on to the other links, the listener and the
 * heartbeats. A peer that sends more waits for the next round; its
 * frames stay in its socket, and TCP slows it down.
 */
#define ROUND_FRAMES 64
#define ROUND_BYTES (64 * 1024)
/*
 * A client sends heartbeats once its side of the link is set up (its first
 * the moment it is: handshake.c), after its transport's connections, which
 * in a link storm wait here behind other clients' handshakes. Until then
 * the server gives its silence this much more time.
 */
#define SETUP_GRACE_MS 10000
#define EVICT_IDLE_MS 500

_Static_assert(LLMDD_CTRL_FRAME_MAX == LLMDD_WIRE_HDR_LEN + CTRL_MSG_MAX,
               "a link's control buffer holds one whole frame");

/* ---- The control thread. ---- */

void
llmdd__ctrl_wake(llmdd *dd)
{
    uint64_t one = 1;

    if (dd->ctrl != NULL)
        (void)!write(dd->ctrl->wake_fd, &one, sizeof(one));
}

/*
 * Shuts down the handshake thread's connection that has waited longest for
 * the rest of its HELLO, EVICT_IDLE_MS or more (the thread then sees EOF and
 * exits), and frees its slot. A connection whose bytes wait unread is not
 * idle: its thread has not run yet; nor is one younger than that, whose
 * thread may have read its whole HELLO and not yet said so. dd->lock held; the
 * handshake thread leaves its slot under the lock before it closes the fd, so
 * the fd is still its own here. Returns false when no handshake is idle.
 */
static bool
ctrl_evict_idle(llmdd__ctrl *c)
{
    int64_t young = llmdd__now_ms() - EVICT_IDLE_MS;
    int oldest = -1, unread;

    for (int i = 0; i < HANDSHAKE_MAX; i++)
        if (c->waiting[i] >= 0 && c->waiting_since[i] <= young &&
            (oldest < 0 || c->waiting_since[i] < c->waiting_since[oldest]) &&
            ioctl(c->waiting[i], FIONREAD, &unread) == 0 && unread == 0)
            oldest = i;
    if (oldest < 0)
        return false;
    log_info("handshake: an idle connection evicted for one that waits");
    shutdown(c->waiting[oldest], SHUT_RDWR);
    c->waiting[oldest] = -1;
    return true;
}

void
llmdd__ctrl_hello_done(llmdd *dd, int fd)
{
    llmdd__ctrl *c = dd->ctrl;

    pthread_mutex_lock(&dd->lock);
    for (int i = 0; i < HANDSHAKE_MAX; i++)
        if (c->waiting[i] == fd)
            c->waiting[i] = -1;
    pthread_mutex_unlock(&dd->lock);
}

/*
 * A connection accepted past HANDSHAKE_PENDING, once its bytes arrived: a
 * control HELLO is answered LLM_LINK_BUSY, which its link call returns
 * (retryable); the connection is closed either way. The HELLO is read
 * first, so the close is a FIN, not a reset that could discard the reply at
 * the peer.
 */
static void
ctrl_refuse_busy(llmdd *dd, int fd)
{
    uint8_t buf[LLMDD_WIRE_HDR_LEN + 512];
    llmdd__hello_reply rep = {.status = LLM_LINK_BUSY};
    llmdd__hello h;
    llmdd__frame f;
    ssize_t n = recv(fd, buf, sizeof(buf), MSG_DONTWAIT);

    if (n >= LLMDD_WIRE_HDR_LEN && llmdd__wire_frame_decode(buf, &f) == 0 &&
        f.type == WMSG_HELLO && (size_t)n == LLMDD_WIRE_HDR_LEN + f.len &&
        llmdd__wire_hello_decode(buf + LLMDD_WIRE_HDR_LEN, f.len, &h) == 0 &&
        h.kind == CONN_CTRL) {
        uint8_t out[LLMDD_WIRE_HDR_LEN + 512];
        size_t len = llmdd__wire_hello_reply_encode(
            &rep, out + LLMDD_WIRE_HDR_LEN, sizeof(out) - LLMDD_WIRE_HDR_LEN);
        if (len > 0) {
            llmdd__wire_frame_encode(out, WMSG_HELLO_REPLY, (uint32_t)len);
            (void)!send(fd, out, LLMDD_WIRE_HDR_LEN + len,
                        MSG_DONTWAIT | MSG_NOSIGNAL);
        }
        log_info("handshake: cluster %llu answered LLM_LINK_BUSY: %d "
                 "connections wait for a handshake",
                 (unsigned long long)h.cluster_id, HANDSHAKE_PENDING);
    }
    (void)dd;
    close(fd);
}

static void
ctrl_accept(llmdd *dd, int lfd)
{
    llmdd__ctrl *c = dd->ctrl;

    for (;;) {
        int fd = accept4(lfd, NULL, NULL, SOCK_NONBLOCK | SOCK_CLOEXEC);
        if (fd < 0) {
            if (errno == EMFILE || errno == ENFILE || errno == ENOBUFS ||
                errno == ENOMEM) {
                /* The connection stays queued and the listener readable:
                 * retrying at once would spin a core until an fd frees. */
                c->accept_backoff_ms =
                    c->accept_backoff_ms == 0
                        ? ACCEPT_BACKOFF_MIN_MS
                        : (c->accept_backoff_ms * 2 > ACCEPT_BACKOFF_MAX_MS
                               ? ACCEPT_BACKOFF_MAX_MS
                               : c->accept_backoff_ms * 2);
                c->accept_resume = llmdd__now_ms() + c->accept_backoff_ms;
                if (c->accept_backoff_ms == ACCEPT_BACKOFF_MIN_MS)
                    log_warn("accept: %s; retrying in up to %d ms",
                             strerror(errno), ACCEPT_BACKOFF_MAX_MS);
            }
            return;
        }
        c->accept_backoff_ms = 0;
        if (c->npending == c->pending_cap &&
            c->pending_cap < HANDSHAKE_PENDING + HANDSHAKE_REFUSING) {
            size_t ncap = c->pending_cap ? 2 * c->pending_cap : 64;
            llmdd__ctrl_pending *np = realloc(c->pending, ncap * sizeof(*np));
            if (np != NULL) {
                c->pending = np;
                c->pending_cap = ncap;
            }
        }
        if (c->npending == c->pending_cap) {
            close(fd); /* even the refusals wait: no word for this one */
            continue;
        }
        c->pending[c->npending] = (llmdd__ctrl_pending){
            .fd = fd,
            .since = llmdd__now_ms(),
            .busy = c->npending >= HANDSHAKE_PENDING};
        c->npending++;
    }
}

/*
 * A pending connection that polled readable: bytes arrived (it waits for a
 * thread), or the peer closed it before sending any, which needs no thread
 * to learn (a slowloris that gives up, a client that was refused).
 */
static void
ctrl_pending_readable(llmdd__ctrl_pending *p)
{
    uint8_t b;
    ssize_t n = recv(p->fd, &b, 1, MSG_PEEK | MSG_DONTWAIT);

    if (n > 0 || (n < 0 && (errno == EAGAIN || errno == EINTR))) {
        p->ready = true;
        return;
    }
    close(p->fd);
    p->fd = -1; /* ctrl_pending_run drops it */
}

/*
 * Starts a handshake thread for a connection whose bytes arrived; false when
 * all HANDSHAKE_MAX are busy and none can be evicted (it waits). An evicted
 * thread takes a moment to exit: twice HANDSHAKE_MAX bounds them too.
 */
static bool
ctrl_handshake_start(llmdd *dd, int fd)
{
    llmdd__ctrl *c = dd->ctrl;
    int64_t now = llmdd__now_ms();

    pthread_mutex_lock(&dd->lock);
    bool room = c->handshakes < HANDSHAKE_MAX ||
                (c->handshakes < 2 * HANDSHAKE_MAX && ctrl_evict_idle(c));
    c->starved = !room; /* a thread that ends wakes this one */
    if (room) {
        c->handshakes++;
        /* A slot is free: fewer waiting than MAX, or one just evicted. */
        for (int i = 0; i < HANDSHAKE_MAX; i++) {
            if (c->waiting[i] < 0) {
                c->waiting[i] = fd;
                c->waiting_since[i] = now;
                break;
            }
        }
    }
    pthread_mutex_unlock(&dd->lock);
    if (!room)
        return false;
    struct llmdd__handshake_arg *a = malloc(sizeof(*a));
    if (a != NULL) {
        a->dd = dd;
        a->fd = fd;
        if (llmdd__spawn(dd, llmdd__handshake_main, a) == 0)
            return true;
        free(a);
    }
    log_warn("handshake: cannot start a thread; connection closed");
    llmdd__ctrl_hello_done(dd, fd);
    pthread_mutex_lock(&dd->lock);
    c->handshakes--;
    pthread_mutex_unlock(&dd->lock);
    close(fd);
    return true;
}

/*
 * The pending connections after a poll: those whose bytes arrived start
 * their handshakes in the order accepted, as threads allow; those silent
 * for HANDSHAKE_MS are closed. Returns the ms until the next one expires
 * (INT64_MAX: none).
 */
static int64_t
ctrl_pending_run(llmdd *dd, int64_t now)
{
    llmdd__ctrl *c = dd->ctrl;
    int64_t next = INT64_MAX;
    bool room = true;
    size_t keep = 0;

    for (size_t i = 0; i < c->npending; i++) {
        llmdd__ctrl_pending p = c->pending[i];
        if (p.fd < 0)
            continue; /* closed by its peer */
        if (p.ready && p.busy) {
            ctrl_refuse_busy(dd, p.fd);
            continue;
        }
        if (p.ready && room && (room = ctrl_handshake_start(dd, p.fd)))
            continue;
        if (!p.ready && now - p.since >= HANDSHAKE_MS) {
            log_info("handshake rejected: too slow");
            close(p.fd);
            continue;
        }
        if (!p.ready && p.since + HANDSHAKE_MS - now < next)
            next = p.since + HANDSHAKE_MS - now;
        c->pending[keep++] = p;
    }
    c->npending = keep;
    return next;
}

llmdd__ctrl_link *
llmdd__ctrl_link_new(void)
{
    llmdd__ctrl_link *cl = calloc(1, sizeof(*cl));

    if (cl != NULL) {
        cl->last_rx_ms = llmdd__now_ms();
        cl->drained_ms = cl->hb_at_ms = cl->last_rx_ms;
    }
    return cl;
}

static void *
reopen_main(void *arg)
{
    llmdd__link *link = arg;

    link->ops->reopen(link);
    pthread_mutex_lock(&link->dd->lock);
    ctrl_of(link)->reopening = false;
    pthread_mutex_unlock(&link->dd->lock);
    llmdd__link_put(link);
    return NULL;
}

int
llmdd__ctrl_rx_next(llmdd__link *link, uint16_t *type, uint8_t *buf,
                    size_t *len)
{
    llmdd__ctrl_link *cl = ctrl_of(link);
    llmdd__frame f;

    for (;;) {
        size_t have = cl->rx_len;
        if (have >= LLMDD_WIRE_HDR_LEN) {
            if (llmdd__wire_frame_decode(cl->rx, &f) != 0 ||
                f.len > CTRL_MSG_MAX)
                return -1;
            size_t whole = LLMDD_WIRE_HDR_LEN + f.len;
            if (have >= whole) {
                memcpy(buf, cl->rx + LLMDD_WIRE_HDR_LEN, f.len);
                memmove(cl->rx, cl->rx + whole, have - whole);
                cl->rx_len = have - whole;
                *type = f.type;
                *len = f.len;
                return 1;
            }
        }
        ssize_t n = recv(link->ctrl_fd, cl->rx + have, sizeof(cl->rx) - have,
                         MSG_DONTWAIT);
        if (n > 0) {
            cl->rx_len += (size_t)n;
            cl->last_rx_ms = llmdd__now_ms(); /* any byte is life */
            cl->heard = true;
            continue;
        }
        if (n < 0 && errno == EINTR)
            continue;
        if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK))
            return 0;
        return -1;
    }
}

/*
 * The peer unlinks (its llmdd_unlink_clusters): the link leaves the table
 * at once, so nothing new starts on it, and its transport is shut down, so
 * what runs fails fast; the UNLINK_ACK goes only once nothing of ours uses
 * the link any more (llmdd__link_quiesce): no transfer of ours still reads
 * or writes the peer's memory when its unlink returns. On its own thread:
 * the control thread never waits for that.
 */
static void *
unlink_serve_main(void *arg)
{
    llmdd__link *link = arg;
    llmdd *dd = link->dd;
    int64_t deadline = llmdd__now_ms() + llmdd__wait_ms(dd);

    if (llmdd__link_quiesce(link, false, deadline)) {
        (void)llmdd__link_send(link, WMSG_UNLINK_ACK, NULL, 0);
        (void)llmdd__link_flush_until(link, deadline);
        /* Crossed unlinks: our own unlink call waits for the peer's ACK,
         * which the control thread, done with this link, no longer reads. */
        pthread_mutex_lock(&dd->lock);
        ctrl_of(link)->peer_unlink = PEER_UNLINK_DECIDED;
        bool crossed = ctrl_of(link)->unlinking && !ctrl_of(link)->unlink_acked;
        pthread_mutex_unlock(&dd->lock);
        bool acked = crossed && llmdd__ctrl_read_ack(link, deadline);
        pthread_mutex_lock(&dd->lock);
        ctrl_of(link)->unlink_acked |= acked;
        pthread_mutex_unlock(&dd->lock);
    } else {
        log_warn("cluster %llu unlinked: our transfers on the link did not "
                 "end in time; not confirmed",
                 (unsigned long long)link->peer.cluster_id);
    }
    pthread_mutex_lock(&dd->lock);
    ctrl_of(link)->peer_unlink = PEER_UNLINK_DONE;
    pthread_cond_broadcast(&dd->cond);
    pthread_mutex_unlock(&dd->lock);
    llmdd__link_drop(link, "peer unlinked");
    llmdd__link_put(link);
    return NULL;
}

static void
unlink_serve(llmdd *dd, llmdd__link *link)
{
    pthread_mutex_lock(&dd->lock);
    ctrl_of(link)->peer_unlink = PEER_UNLINK_SERVING;
    link->refs++;
    pthread_mutex_unlock(&dd->lock);
    llmdd__link_retire(link, "peer unlinked");
    if (llmdd__spawn(dd, unlink_serve_main, link) != 0) {
        /* Unconfirmed, the peer's call reports LLM_UNLINK_FAILED. */
        pthread_mutex_lock(&dd->lock);
        ctrl_of(link)->peer_unlink = PEER_UNLINK_DONE;
        pthread_cond_broadcast(&dd->cond);
        pthread_mutex_unlock(&dd->lock);
        llmdd__link_drop(link, "peer unlinked");
        llmdd__link_put(link);
    }
}

/* PING: answered at once, by the control thread, never behind a transfer. */
static bool
ping_serve(llmdd__link *link, const uint8_t *buf, size_t len)
{
    int64_t seq;

    if (llmdd__wire_i64_decode(buf, len, &seq) != 0) {
        llmdd__link_breach(link, "malformed PING");
        return false;
    }
    return llmdd__link_send(link, WMSG_PONG, buf, len) == 0;
}

/* A reply someone awaits: found by the sequence number inside it. */
static bool
reply_deliver(llmdd__link *link, uint16_t type, const uint8_t *buf, size_t len)
{
    llmdd__layout_reply lr;
    llmdd__key_reply r;
    int64_t seq;
    int bad = type == WMSG_PONG ? llmdd__wire_i64_decode(buf, len, &seq)
              : type == WMSG_LAYOUT_REPLY
                  ? llmdd__wire_layout_reply_decode(buf, len, &lr)
                  : llmdd__wire_key_reply_decode(buf, len, &r);

    if (bad) {
        llmdd__link_breach(link, "malformed reply");
        return false;
    }
    if (!llmdd__link_answer(link, type,
                            type == WMSG_PONG           ? (uint64_t)seq
                            : type == WMSG_LAYOUT_REPLY ? lr.seq
                                                        : r.seq,
                            buf, len)) {
        llmdd__link_breach(link, "a reply to nothing asked");
        return false;
    }
    return true;
}

/*
 * The peer's heartbeats (docs/model.md, "Liveness"): at most two per
 * interval it announced, none when it announced 0. Each costs half that
 * interval of an allowance the clock tops up (hb_topup). While this side
 * reads the link to its end, the allowance is capped at two intervals;
 * while it has not (its process was stopped, or the link waits for its
 * share), it grows by the time since, so frames that queued up meanwhile,
 * read at once, are not taken for a flood.
 */
static void
hb_topup(llmdd__link *link, int64_t now)
{
    llmdd__ctrl_link *cl = ctrl_of(link);
    int64_t peer = link->terms.hb_ms;

    if (peer == 0)
        return;
    /* From the handshake on: a peer's heartbeats queue up until this side
     * has set its link up and reads it. */
    if (!cl->hb_started)
        cl->hb_credit_ms = 2 * peer;
    cl->hb_started = true;
    cl->hb_credit_ms += now - cl->hb_at_ms;
    cl->hb_at_ms = now;
    int64_t cap = now - cl->drained_ms + peer;
    if (cap < 2 * peer)
        cap = 2 * peer;
    if (cl->hb_credit_ms > cap)
        cl->hb_credit_ms = cap;
}

static bool
hb_take(llmdd__link *link)
{
    llmdd__ctrl_link *cl = ctrl_of(link);
    uint32_t peer = link->terms.hb_ms;

    if (peer == 0) {
        llmdd__link_breach(link, "a heartbeat from a peer that announced "
                                 "none");
        return false;
    }
    cl->hb_credit_ms -= peer / 2;
    if (cl->hb_credit_ms < 0) {
        char why[96];
        snprintf(why, sizeof(why),
                 "heartbeats faster than the two per %u ms it announced", peer);
        llmdd__link_breach(link, why);
        return false;
    }
    return true;
}

/*
 * Handles one control message of a link; false when the link was dropped
 * and no more of its messages are to be read.
 */
static bool
ctrl_link_msg(llmdd *dd, llmdd__link *link, uint16_t type, const uint8_t *buf,
              size_t len)
{
    switch (type) {
    case WMSG_UNLINK:
        unlink_serve(dd, link);
        return false;
    case WMSG_REOPEN:
        if (link->client && link->ops->reopen != NULL) {
            /* One reopen at a time: a peer repeating REOPEN cannot make us
             * spawn threads and connections without bound. */
            pthread_mutex_lock(&dd->lock);
            bool start = !ctrl_of(link)->reopening && !link->dead;
            if (start) {
                ctrl_of(link)->reopening = true;
                link->refs++;
            }
            pthread_mutex_unlock(&dd->lock);
            if (start && llmdd__spawn(dd, reopen_main, link) != 0) {
                pthread_mutex_lock(&dd->lock);
                ctrl_of(link)->reopening = false;
                pthread_mutex_unlock(&dd->lock);
                llmdd__link_put(link);
            }
        }
        return true;
    case WMSG_UNLINK_ACK: {
        pthread_mutex_lock(&dd->lock);
        bool asked = ctrl_of(link)->unlinking && !ctrl_of(link)->unlink_acked;
        ctrl_of(link)->unlink_acked = true;
        pthread_cond_broadcast(&dd->cond);
        pthread_mutex_unlock(&dd->lock);
        if (!asked)
            llmdd__link_breach(link, "UNLINK_ACK to no UNLINK");
        return asked;
    }
    case WMSG_NOTIFY:
    case WMSG_CREDIT:
        return llmdd__notify_on_msg(link, type, buf, len);
    case WMSG_KEY_QUERY:
        return llmdd__keys_serve(link, buf, len);
    case WMSG_LAYOUT_QUERY:
        return llmdd__layouts_serve(link, buf, len);
    case WMSG_KEY_REPLY:
    case WMSG_LAYOUT_REPLY:
    case WMSG_PONG:
        return reply_deliver(link, type, buf, len);
    case WMSG_PING:
        return ping_serve(link, buf, len);
    case WMSG_HEARTBEAT:
        return hb_take(link); /* its bytes were life already */
    default:
        llmdd__link_breach(link, "unexpected control message");
        return false;
    }
}

/*
 * The peer's UNLINK_ACK, read from the link's socket by an unlink once the
 * control thread no longer polls the link (it was retired or dropped). A
 * peer that honours our UNLINK sends the ACK and then closes its data
 * connections; a transfer of ours can see that close and drop the link
 * before the control thread has read the ACK, which then sits unread.
 */
bool
llmdd__ctrl_read_ack(llmdd__link *link, int64_t deadline)
{
    llmdd *dd = link->dd;
    llmdd__ctrl *c = dd->ctrl;
    uint8_t buf[CTRL_MSG_MAX];
    uint16_t type;
    size_t len;
    bool acked;
    int rc;

    pthread_mutex_lock(&dd->lock);
    uint64_t want = ++c->gen;
    pthread_mutex_unlock(&dd->lock);
    llmdd__ctrl_wake(dd);
    pthread_mutex_lock(&dd->lock);
    while (c->seen_gen < want && !c->stop)
        pthread_cond_wait(&dd->cond, &dd->lock);
    acked = ctrl_of(link)->unlink_acked;
    pthread_mutex_unlock(&dd->lock);
    /* After a drop the socket is shut down: this reads only what had
     * arrived, after what the control thread had read of a frame. */
    while (!acked) {
        rc = llmdd__ctrl_rx_next(link, &type, buf, &len);
        if (rc == 1)
            acked = type == WMSG_UNLINK_ACK;
        else if (rc < 0 || llmdd__wait_fd(dd->stop_fd, link->ctrl_fd, POLLIN,
                                          deadline) != 1)
            break;
    }
    return acked;
}

/*
 * Handles the messages that have arrived on a link's control socket, up to
 * the link's share of a round; cl->more tells whether some were left.
 */
static void
ctrl_link_readable(llmdd *dd, llmdd__link *link, int64_t now)
{
    llmdd__ctrl_link *cl = ctrl_of(link);
    uint8_t buf[CTRL_MSG_MAX];
    size_t frames = 0, bytes = 0;
    uint16_t type;
    size_t len;
    int rc = 1;

    cl->more = false;
    hb_topup(link, now);
    while (frames < ROUND_FRAMES && bytes < ROUND_BYTES) {
        rc = llmdd__ctrl_rx_next(link, &type, buf, &len);
        if (rc != 1)
            break;
        frames++;
        bytes += LLMDD_WIRE_HDR_LEN + len;
        if (!ctrl_link_msg(dd, link, type, buf, len))
            return;
    }
    if (rc == 0)
        cl->drained_ms = now;
    else if (rc < 0)
        llmdd__link_drop(link, "peer closed the control connection");
    else
        cl->more = true;
}

/*
 * Heartbeats (docs/model.md, "Liveness"): a heartbeat goes out when nothing
 * was queued on the link for our interval (hb_ms), and a peer silent for its
 * announced interval times our misses is dead.
 */
static int64_t
silence_limit(llmdd__link *link, uint32_t misses)
{
    bool setting_up = !link->client && !ctrl_of(link)->heard;

    return (int64_t)link->terms.hb_ms * misses +
           (setting_up ? SETUP_GRACE_MS : 0);
}

/*
 * The ms until this link next needs a look (INT64_MAX: never).
 */
static int64_t
ctrl_heartbeat_due(llmdd__link *link, uint32_t hb_ms, uint32_t misses,
                   int64_t now)
{
    int64_t next = INT64_MAX;

    if (hb_ms > 0) {
        int64_t due = llmdd__link_last_tx(link) + hb_ms - now;
        next = due > 0 ? due : 0;
    }
    if (link->terms.hb_ms > 0) {
        int64_t limit = silence_limit(link, misses);
        int64_t left = limit - (now - ctrl_of(link)->last_rx_ms) + 1;
        if (left < next)
            next = left > 0 ? left : 0;
    }
    return next;
}

/* Sends a heartbeat that is due, or drops a link whose peer is silent. */
static void
ctrl_heartbeat(llmdd *dd, llmdd__link *link, uint32_t hb_ms, uint32_t misses,
               int64_t now)
{
    uint32_t peer = link->terms.hb_ms;

    if (peer > 0) {
        int64_t limit = silence_limit(link, misses);
        int64_t silent = now - ctrl_of(link)->last_rx_ms;
        if (silent > limit) {
            pthread_mutex_lock(&dd->lock);
            bool live = !link->dead;
            pthread_mutex_unlock(&dd->lock);
            if (!live)
                return;
            llmdd__metrics_heartbeat_drop(dd);
            log_warn("heartbeat: link to cluster %llu dropped: nothing heard "
                     "for %lld ms (its interval %u ms x %u misses)",
                     (unsigned long long)link->peer.cluster_id,
                     (long long)silent, peer, misses);
            llmdd__link_drop(link, "heartbeats missed");
            return;
        }
    }
    if (hb_ms > 0 && now >= llmdd__link_last_tx(link) + hb_ms)
        (void)llmdd__link_send(link, WMSG_HEARTBEAT, NULL, 0);
}

static void *
ctrl_main(void *arg)
{
    llmdd *dd = arg;
    llmdd__ctrl *c = dd->ctrl;
    struct pollfd *pfd = NULL;
    llmdd__link **links = NULL;
    size_t cap = 0;

    for (;;) {
        size_t n = 0, nlinks = 0;
        int lfd;
        /* Before the poll set is made: it compacts the pending ones. */
        int64_t expiry = ctrl_pending_run(dd, llmdd__now_ms());

        pthread_mutex_lock(&dd->lock);
        if (c->stop) {
            pthread_mutex_unlock(&dd->lock);
            break;
        }
        c->seen_gen = c->gen;
        pthread_cond_broadcast(&dd->cond);
        uint32_t hb_ms = dd->opts.hb_ms, misses = dd->opts.hb_misses;
        for (llmdd__link *l = dd->links; l != NULL; l = l->next)
            nlinks++;
        if (nlinks + c->npending + 2 > cap) {
            size_t ncap = nlinks + c->npending + 16;
            struct pollfd *np = realloc(pfd, ncap * sizeof(*np));
            if (np != NULL)
                pfd = np;
            llmdd__link **nl = realloc(links, ncap * sizeof(*nl));
            if (nl != NULL)
                links = nl;
            if (np == NULL || nl == NULL) {
                pthread_mutex_unlock(&dd->lock);
                log_error("control thread: out of memory");
                usleep(100000);
                continue;
            }
            cap = ncap;
        }
        lfd = c->listen_fd;
        int64_t wait = INT64_MAX;
        int64_t pause = c->accept_resume - llmdd__now_ms();
        if (lfd >= 0 && pause > 0)
            wait = pause;
        pfd[n++] = (struct pollfd){.fd = c->wake_fd, .events = POLLIN};
        /* A negative fd is skipped by poll. */
        pfd[n++] =
            (struct pollfd){.fd = pause > 0 ? -1 : lfd, .events = POLLIN};
        nlinks = 0;
        for (llmdd__link *l = dd->links; l != NULL; l = l->next) {
            l->refs++;
            links[nlinks++] = l;
            pthread_mutex_lock(&l->out_lock);
            short ev = POLLIN | (l->out_len > 0 ? POLLOUT : 0);
            pthread_mutex_unlock(&l->out_lock);
            pfd[n++] = (struct pollfd){.fd = l->ctrl_fd, .events = ev};
        }
        pthread_mutex_unlock(&dd->lock);
        /* The pending connections; those ready wait for a thread, not for
         * bytes (a negative fd is skipped). */
        size_t npend = c->npending;
        for (size_t i = 0; i < npend; i++)
            pfd[n++] = (struct pollfd){
                .fd = c->pending[i].ready ? -1 : c->pending[i].fd,
                .events = POLLIN};

        /* How long until a link needs a heartbeat sent or its peer's
         * silence judged (ctrl_heartbeat after the poll does both); no
         * wait while a link has frames left from its last share. */
        int64_t now = llmdd__now_ms();
        if (expiry < wait)
            wait = expiry;
        for (size_t i = 0; i < nlinks; i++) {
            int64_t next =
                ctrl_of(links[i])->more
                    ? 0
                    : ctrl_heartbeat_due(links[i], hb_ms, misses, now);
            if (next < wait)
                wait = next;
        }
        int timeout = wait == INT64_MAX ? -1 : wait > 60000 ? 60000 : (int)wait;
        int ready = poll(pfd, n, timeout);
        now = llmdd__now_ms();
        if (ready > 0) {
            if (pfd[0].revents & POLLIN) {
                uint64_t v;
                (void)!read(c->wake_fd, &v, sizeof(v));
            }
            /* Before the accept: it appends to the pending connections. */
            for (size_t i = 0; i < npend; i++)
                if (pfd[2 + nlinks + i].revents & (POLLIN | POLLHUP | POLLERR))
                    ctrl_pending_readable(&c->pending[i]);
            if (lfd >= 0 && (pfd[1].revents & POLLIN))
                ctrl_accept(dd, lfd);
        }
        for (size_t i = 0; i < nlinks; i++) {
            short re = ready > 0 ? pfd[2 + i].revents : 0;
            if (re & POLLOUT)
                (void)llmdd__link_flush(links[i]);
            if ((re & (POLLIN | POLLHUP | POLLERR)) || ctrl_of(links[i])->more)
                ctrl_link_readable(dd, links[i], now);
        }
        /* After reading what arrived: a process resumed after a stop first
         * finds its peer's frames waiting, not a silence. */
        now = llmdd__now_ms();
        for (size_t i = 0; i < nlinks; i++)
            ctrl_heartbeat(dd, links[i], hb_ms, misses, now);
        for (size_t i = 0; i < nlinks; i++)
            llmdd__link_put(links[i]);
    }
    free(pfd);
    free(links);
    return NULL;
}

static llmdd_status
ctrl_start(llmdd *dd)
{
    llmdd__ctrl *c = calloc(1, sizeof(*c));

    if (c == NULL)
        return LLM_OUT_OF_MEMORY;
    c->listen_fd = -1;
    for (int i = 0; i < HANDSHAKE_MAX; i++)
        c->waiting[i] = -1;
    c->wake_fd = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
    if (c->wake_fd < 0)
        goto err_free;
    llmdd_status st = llmdd__disc_open(dd, c);
    if (st != LLM_SUCCESS)
        goto err_disc;
    dd->ctrl = c;
    if (pthread_create(&c->thread, NULL, ctrl_main, dd) != 0)
        goto err_wake;
    return LLM_SUCCESS;
err_wake:
    dd->ctrl = NULL;
    llmdd__disc_close(c);
    st = LLM_FAILED;
err_disc:
    close(c->wake_fd);
    free(c->pending);
    free(c);
    return st;
err_free:
    free(c);
    log_error("cannot start the control thread");
    return LLM_FAILED;
}

static void
ctrl_stop(llmdd *dd)
{
    llmdd__ctrl *c = dd->ctrl;

    if (c == NULL)
        return;
    llmdd__disc_close(c); /* its callback finds links: before they go */
    pthread_mutex_lock(&dd->lock);
    c->stop = true;
    pthread_mutex_unlock(&dd->lock);
    llmdd__ctrl_wake(dd);
    pthread_join(c->thread, NULL);
    /* Handshake threads count in nthreads and use c: wait for them. */
    pthread_mutex_lock(&dd->lock);
    while (c->handshakes > 0)
        pthread_cond_wait(&dd->cond, &dd->lock);
    dd->ctrl = NULL;
    pthread_mutex_unlock(&dd->lock);
    for (size_t i = 0; i < c->npending; i++)
        close(c->pending[i].fd);
    close(c->wake_fd);
    free(c->pending);
    free(c);
}

static llmdd_status
listen_start(llmdd *dd)
{
    const llmdd__sockaddr *a = &dd->opts.listen_addr;
    char name[80];
    int fd, one = 1;
    llmdd_status st = llmdd__disc_check_listen(dd);

    if (st != LLM_SUCCESS)
        return st;
    llmdd__sockaddr_str(a, name, sizeof(name));
    fd = socket(a->addr.ss_family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC,
                0);
    if (fd < 0)
        goto err;
    setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
    llmdd__sockaddr bound = {.len = sizeof(bound.addr)};
    /* The kernel's largest backlog (net.core.somaxconn caps it): a fleet's
     * decoders relinking at once open a control connection and their data
     * lanes each, and a full queue drops their SYNs for a 1 s retransmit. */
    if (bind(fd, (const struct sockaddr *)&a->addr, a->len) != 0 ||
        listen(fd, SOMAXCONN) != 0 ||
        getsockname(fd, (struct sockaddr *)&bound.addr, &bound.len) != 0)
        goto err_close;
    llmdd__sockaddr_str(&bound, name, sizeof(name)); /* port 0: the real one */
    /* Published before peers can find it, removed before it closes. */
    if ((st = llmdd__disc_publish(dd, &bound)) != LLM_SUCCESS) {
        close(fd);
        return st;
    }
    pthread_mutex_lock(&dd->lock);
    dd->ctrl->listen_fd = fd;
    dd->ctrl->bound = bound;
    pthread_mutex_unlock(&dd->lock);
    llmdd__ctrl_wake(dd);
    log_info("listening on %s", name);
    return LLM_SUCCESS;
err_close:
    close(fd);
err:
    log_error("listen on %s: %s", name, strerror(errno));
    return LLM_FAILED;
}

static void
listen_stop(llmdd *dd)
{
    llmdd__ctrl *c = dd->ctrl;
    uint64_t want;
    int fd;

    if (c == NULL)
        return;
    pthread_mutex_lock(&dd->lock);
    bool listening = c->listen_fd >= 0;
    pthread_mutex_unlock(&dd->lock);
    if (listening)
        llmdd__disc_unpublish(dd);
    pthread_mutex_lock(&dd->lock);
    fd = c->listen_fd;
    c->listen_fd = -1;
    want = ++c->gen;
    pthread_mutex_unlock(&dd->lock);
    if (fd < 0)
        return;
    /* Close only once the control thread no longer polls the fd. */
    llmdd__ctrl_wake(dd);
    pthread_mutex_lock(&dd->lock);
    while (c->seen_gen < want && !c->stop)
        pthread_cond_wait(&dd->cond, &dd->lock);
    pthread_mutex_unlock(&dd->lock);
    close(fd);
}

llmdd_status
llmdd_listen_address(llmdd *dd, llmdd_ip_info *out)
{
    llmdd__sockaddr a;
    bool listening;

    if (dd == NULL || out == NULL)
        return LLM_PARAM_INVALID;
    pthread_mutex_lock(&dd->lock);
    listening = dd->initialized && dd->ctrl != NULL && dd->ctrl->listen_fd >= 0;
    if (listening)
        a = dd->ctrl->bound;
    pthread_mutex_unlock(&dd->lock);
    if (!listening)
        return LLM_FAILED;
    memset(out, 0, sizeof(*out));
    if (a.addr.ss_family == AF_INET6) {
        const struct sockaddr_in6 *v6 = (const struct sockaddr_in6 *)&a.addr;
        inet_ntop(AF_INET6, &v6->sin6_addr, out->ip, sizeof(out->ip));
        out->port = ntohs(v6->sin6_port);
    } else {
        const struct sockaddr_in *v4 = (const struct sockaddr_in *)&a.addr;
        inet_ntop(AF_INET, &v4->sin_addr, out->ip, sizeof(out->ip));
        out->port = ntohs(v4->sin_port);
    }
    return LLM_SUCCESS;
}

/* ---- The plane as the core sees it. ---- */

static const llmdd__plane_ops ctrl_plane = {
    .start = ctrl_start,
    .stop = ctrl_stop,
    .listen_start = listen_start,
    .listen_stop = listen_stop,
    .wake = llmdd__ctrl_wake,
};

llmdd_status
llmdd_create(uint64_t cluster_id, llmdd_role role, llmdd **dd_out)
{
    return llmdd__instance_new(cluster_id, role, &ctrl_plane, dd_out);
}
