/*
 * The control plane: the listener and the control thread that watches
 * every link's control socket (the handshake: handshake.c; the link and
 * unlink calls: linking.c). The link table it fills is core state
 * (core/link.c). The plane sits above the core: llmdd_create registers
 * ctrl_plane with the instance, and the core starts, stops and wakes the
 * plane only through it (llmdd__plane_ops).
 *
 * One control thread per instance polls the listening socket, each link's
 * control socket and a wake eventfd. It accepts connections and hands each to
 * a short-lived handshake thread (at most HANDSHAKE_MAX at once, each bounded
 * by HANDSHAKE_MS), so a slow or hostile client delays nobody else. When all
 * are busy, a new connection evicts the oldest one that has not yet sent its
 * HELLO, so idle connections (slowloris) cannot lock real peers out. It is the
 * only reader of link control sockets: it answers UNLINK, records
 * UNLINK_ACK, and drops a link whose peer closed.
 */
#include <arpa/inet.h>
#include <errno.h>
#include <poll.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <time.h>
#include <sys/socket.h>
#include <unistd.h>

#include "ctrl/ctrl.h"

#define ACCEPT_BACKOFF_MIN_MS 10
#define ACCEPT_BACKOFF_MAX_MS 1000

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
 * Shuts down the handshake that has waited longest for its HELLO (its thread
 * then sees EOF and exits) and frees its slot. dd->lock held; the handshake
 * thread leaves its slot under the lock before it closes the fd, so the fd is
 * still its own here. Returns false when every handshake is past its HELLO.
 */
static bool
ctrl_evict_idle(llmdd__ctrl *c)
{
    int oldest = -1;

    for (int i = 0; i < HANDSHAKE_MAX; i++)
        if (c->waiting[i] >= 0 &&
            (oldest < 0 || c->waiting_since[i] < c->waiting_since[oldest]))
            oldest = i;
    if (oldest < 0)
        return false;
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
        pthread_mutex_lock(&dd->lock);
        /* Evicted threads take a moment to exit: bound them too. */
        bool full = c->handshakes >= 2 * HANDSHAKE_MAX ||
                    (c->handshakes >= HANDSHAKE_MAX && !ctrl_evict_idle(c));
        if (!full) {
            c->handshakes++;
            /* A slot is free: fewer waiting than MAX, or one just evicted. */
            for (int i = 0; i < HANDSHAKE_MAX; i++) {
                if (c->waiting[i] < 0) {
                    c->waiting[i] = fd;
                    c->waiting_since[i] = llmdd__now_ms();
                    break;
                }
            }
        }
        pthread_mutex_unlock(&dd->lock);
        struct llmdd__handshake_arg *a = full ? NULL : malloc(sizeof(*a));
        if (a == NULL) {
            log_warn("too many handshakes in progress; connection closed");
            goto drop;
        }
        a->dd = dd;
        a->fd = fd;
        if (llmdd__spawn(dd, llmdd__handshake_main, a) == 0)
            continue;
        free(a);
    drop:
        if (!full) {
            llmdd__ctrl_hello_done(dd, fd);
            pthread_mutex_lock(&dd->lock);
            c->handshakes--;
            pthread_mutex_unlock(&dd->lock);
        }
        close(fd);
    }
}

static void *
reopen_main(void *arg)
{
    llmdd__link *link = arg;

    link->ops->reopen(link);
    pthread_mutex_lock(&link->dd->lock);
    link->reopening = false;
    pthread_mutex_unlock(&link->dd->lock);
    llmdd__link_put(link);
    return NULL;
}

int
llmdd__ctrl_rx_next(llmdd__link *link, uint16_t *type, uint8_t *buf,
                    size_t *len)
{
    llmdd__frame f;

    for (;;) {
        size_t have = link->ctrl_rx_len;
        if (have >= LLMDD_WIRE_HDR_LEN) {
            if (llmdd__wire_frame_decode(link->ctrl_rx, &f) != 0 ||
                f.len > CTRL_MSG_MAX)
                return -1;
            size_t whole = LLMDD_WIRE_HDR_LEN + f.len;
            if (have >= whole) {
                memcpy(buf, link->ctrl_rx + LLMDD_WIRE_HDR_LEN, f.len);
                memmove(link->ctrl_rx, link->ctrl_rx + whole, have - whole);
                link->ctrl_rx_len = have - whole;
                *type = f.type;
                *len = f.len;
                return 1;
            }
        }
        ssize_t n = recv(link->ctrl_fd, link->ctrl_rx + have,
                         sizeof(link->ctrl_rx) - have, MSG_DONTWAIT);
        if (n > 0) {
            link->ctrl_rx_len += (size_t)n;
            continue;
        }
        if (n < 0 && errno == EINTR)
            continue;
        if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK))
            return 0;
        return -1;
    }
}

/* ---- Cache keys over the control connection. ---- */

/* A llmdd_lookup_remote_key call waiting for its KEY_REPLY. */
struct llmdd__key_wait {
    uint64_t seq;
    bool done;
    llmdd__key_reply reply;
    struct llmdd__key_wait *next;
};

/*
 * Answers a peer's KEY_QUERY. The reply goes out without waiting: a peer
 * that asks and never reads fills its own socket and loses the link, it
 * does not hold the control thread.
 */
static bool
key_serve(llmdd *dd, llmdd__link *link, const uint8_t *buf, size_t len)
{
    llmdd__key_query q;
    llmdd__key_reply r = {.status = LLM_KV_CACHE_NOT_EXIST};
    uint8_t out[32];

    if (llmdd__wire_key_query_decode(buf, len, &q) != 0) {
        llmdd__link_drop(link, "malformed KEY_QUERY");
        return false;
    }
    r.seq = q.seq;
    if (llmdd__keys_find(dd, q.key, q.key_len, &r.cache_id, &r.batch_index))
        r.status = LLM_SUCCESS;
    size_t n = llmdd__wire_key_reply_encode(&r, out, sizeof(out));
    pthread_mutex_lock(&link->wlock);
    int rc = llmdd__send_msg(dd->stop_fd, link->ctrl_fd, WMSG_KEY_REPLY, out, n,
                             llmdd__now_ms());
    pthread_mutex_unlock(&link->wlock);
    if (rc != 0) {
        llmdd__link_drop(link, "peer does not read its KEY_REPLYs");
        return false;
    }
    return true;
}

/* Hands a KEY_REPLY to its waiter; one nobody waits for (late) is dropped. */
static bool
key_deliver(llmdd *dd, llmdd__link *link, const uint8_t *buf, size_t len)
{
    llmdd__key_reply r;

    if (llmdd__wire_key_reply_decode(buf, len, &r) != 0) {
        llmdd__link_drop(link, "malformed KEY_REPLY");
        return false;
    }
    pthread_mutex_lock(&dd->lock);
    for (struct llmdd__key_wait *w = link->key_waits; w != NULL; w = w->next) {
        if (w->seq == r.seq && !w->done) {
            w->reply = r;
            w->done = true;
            pthread_cond_broadcast(&dd->cond);
            break;
        }
    }
    pthread_mutex_unlock(&dd->lock);
    return true;
}

llmdd_status
llmdd_lookup_remote_key(llmdd *dd, uint64_t cluster_id, const void *key,
                        size_t key_len, llmdd_cache_index *index_out)
{
    struct llmdd__key_wait w = {0};
    llmdd__key_query q = {0};
    uint8_t buf[CTRL_MSG_MAX];
    llmdd_status st;

    if (dd == NULL)
        return LLM_PARAM_INVALID;
    if ((st = llmdd__ready(dd)) != LLM_SUCCESS)
        return st;
    if (key == NULL || key_len == 0 || key_len > LLMDD_KEY_MAX ||
        index_out == NULL)
        return LLM_PARAM_INVALID;
    llmdd__link *link = llmdd__link_get(dd, cluster_id);
    if (link == NULL)
        return LLM_NOT_YET_LINK;
    pthread_mutex_lock(&dd->lock);
    int64_t deadline = llmdd__now_ms() + dd->opts.wait_ms;
    w.seq = q.seq = ++link->key_seq;
    w.next = link->key_waits;
    link->key_waits = &w;
    pthread_mutex_unlock(&dd->lock);

    q.key_len = (uint32_t)key_len;
    memcpy(q.key, key, key_len);
    size_t n = llmdd__wire_key_query_encode(&q, buf, sizeof(buf));
    pthread_mutex_lock(&link->wlock);
    int rc = llmdd__send_msg(dd->stop_fd, link->ctrl_fd, WMSG_KEY_QUERY, buf, n,
                             deadline);
    pthread_mutex_unlock(&link->wlock);

    pthread_mutex_lock(&dd->lock);
    while (rc == 0 && !w.done && !link->dead && llmdd__now_ms() < deadline)
        llmdd__cond_wait_until(&dd->cond, &dd->lock, deadline);
    for (struct llmdd__key_wait **p = &link->key_waits; *p != NULL;
         p = &(*p)->next) {
        if (*p == &w) {
            *p = w.next;
            break;
        }
    }
    if (w.done)
        st = w.reply.status == LLM_SUCCESS ? LLM_SUCCESS
                                           : LLM_KV_CACHE_NOT_EXIST;
    else
        st = link->dead || rc != 0 ? LLM_NOT_YET_LINK : LLM_TIMEOUT;
    pthread_mutex_unlock(&dd->lock);
    llmdd__link_put(link);
    if (st == LLM_SUCCESS)
        *index_out = (llmdd_cache_index){.cluster_id = cluster_id,
                                         .cache_id = w.reply.cache_id,
                                         .batch_index = w.reply.batch_index};
    return st;
}

/*
 * Handles one control message of a link; false when the link was dropped
 * or paused, and no more of its messages are to be read now.
 */
static bool
ctrl_link_msg(llmdd *dd, llmdd__link *link, uint16_t type, const uint8_t *buf,
              size_t len)
{
    switch (type) {
    case WMSG_UNLINK:
        /* Never wait on the peer here: the ACK is a few bytes into an idle
         * socket, and a peer that stops reading loses only its own ACK. */
        pthread_mutex_lock(&link->wlock);
        llmdd__send_msg(dd->stop_fd, link->ctrl_fd, WMSG_UNLINK_ACK, NULL, 0,
                        llmdd__now_ms());
        pthread_mutex_unlock(&link->wlock);
        llmdd__link_drop(link, "peer unlinked");
        return false;
    case WMSG_REOPEN:
        if (link->client && link->ops->reopen != NULL) {
            /* One reopen at a time: a peer repeating REOPEN cannot make us
             * spawn threads and connections without bound. */
            pthread_mutex_lock(&dd->lock);
            bool start = !link->reopening && !link->dead;
            if (start) {
                link->reopening = true;
                link->refs++;
            }
            pthread_mutex_unlock(&dd->lock);
            if (start && llmdd__spawn(dd, reopen_main, link) != 0) {
                pthread_mutex_lock(&dd->lock);
                link->reopening = false;
                pthread_mutex_unlock(&dd->lock);
                llmdd__link_put(link);
            }
        }
        return true;
    case WMSG_UNLINK_ACK:
        pthread_mutex_lock(&dd->lock);
        link->unlink_acked = true;
        pthread_cond_broadcast(&dd->cond);
        pthread_mutex_unlock(&dd->lock);
        return true;
    case WMSG_NOTIFY:
        if (len > LLMDD_NOTIFY_MAX) {
            llmdd__link_drop(link, "oversized notification");
            return false;
        }
        if (!llmdd__notify_received(dd, link->peer.cluster_id, buf, len)) {
            log_error("cluster %llu: no memory for a notification",
                      (unsigned long long)link->peer.cluster_id);
            llmdd__link_drop(link, "notification lost: out of memory");
            return false;
        }
        atomic_fetch_add_explicit(&dd->metrics.notify_recv, 1,
                                  memory_order_relaxed);
        if (llmdd__notify_full(dd)) {
            /* Backpressure, never loss: read this link again once the
             * application drains the queue (llmdd__links_resume). */
            pthread_mutex_lock(&dd->lock);
            link->rx_paused = true;
            pthread_mutex_unlock(&dd->lock);
            return false;
        }
        return true;
    case WMSG_KEY_QUERY:
        return key_serve(dd, link, buf, len);
    case WMSG_KEY_REPLY:
        return key_deliver(dd, link, buf, len);
    default:
        llmdd__link_drop(link, "unexpected control message");
        return false;
    }
}

/* Handles every whole message that has arrived on a link's control socket. */
static void
ctrl_link_readable(llmdd *dd, llmdd__link *link)
{
    uint8_t buf[CTRL_MSG_MAX];
    uint16_t type;
    size_t len;
    int rc;

    while ((rc = llmdd__ctrl_rx_next(link, &type, buf, &len)) == 1)
        if (!ctrl_link_msg(dd, link, type, buf, len))
            return;
    if (rc < 0)
        llmdd__link_drop(link, "peer closed the control connection");
}

/*
 * A link that was paused holds frames it had read: after a wake, its
 * buffer is worked off without waiting for the socket.
 */
static bool
resumed(llmdd *dd, llmdd__link *link)
{
    pthread_mutex_lock(&dd->lock);
    bool go = !link->rx_paused && !link->dead;
    pthread_mutex_unlock(&dd->lock);
    return go && link->ctrl_rx_len > 0;
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

        pthread_mutex_lock(&dd->lock);
        if (c->stop) {
            pthread_mutex_unlock(&dd->lock);
            break;
        }
        c->seen_gen = c->gen;
        pthread_cond_broadcast(&dd->cond);
        for (llmdd__link *l = dd->links; l != NULL; l = l->next)
            nlinks++;
        if (nlinks + 2 > cap) {
            size_t ncap = nlinks + 16;
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
        int timeout = -1;
        int64_t pause = c->accept_resume - llmdd__now_ms();
        if (lfd >= 0 && pause > 0)
            timeout = (int)pause;
        pfd[n++] = (struct pollfd){.fd = c->wake_fd, .events = POLLIN};
        /* A negative fd is skipped by poll. */
        pfd[n++] =
            (struct pollfd){.fd = timeout < 0 ? lfd : -1, .events = POLLIN};
        nlinks = 0;
        for (llmdd__link *l = dd->links; l != NULL; l = l->next) {
            l->refs++;
            links[nlinks++] = l;
            pfd[n++] = (struct pollfd){.fd = l->rx_paused ? -1 : l->ctrl_fd,
                                       .events = POLLIN};
        }
        pthread_mutex_unlock(&dd->lock);

        if (poll(pfd, n, timeout) > 0) {
            if (pfd[0].revents & POLLIN) {
                uint64_t v;
                (void)!read(c->wake_fd, &v, sizeof(v));
            }
            if (lfd >= 0 && (pfd[1].revents & POLLIN))
                ctrl_accept(dd, lfd);
            for (size_t i = 0; i < nlinks; i++)
                if (pfd[2 + i].revents != 0 || resumed(dd, links[i]))
                    ctrl_link_readable(dd, links[i]);
        }
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
    dd->ctrl = c;
    if (pthread_create(&c->thread, NULL, ctrl_main, dd) != 0)
        goto err_wake;
    return LLM_SUCCESS;
err_wake:
    dd->ctrl = NULL;
    close(c->wake_fd);
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
    close(c->wake_fd);
    free(c);
}

static llmdd_status
listen_start(llmdd *dd)
{
    const llmdd__sockaddr *a = &dd->opts.listen_addr;
    char name[80];
    int fd, one = 1;

    llmdd__sockaddr_str(a, name, sizeof(name));
    fd = socket(a->addr.ss_family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC,
                0);
    if (fd < 0)
        goto err;
    setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
    llmdd__sockaddr bound = {.len = sizeof(bound.addr)};
    if (bind(fd, (const struct sockaddr *)&a->addr, a->len) != 0 ||
        listen(fd, 128) != 0 ||
        getsockname(fd, (struct sockaddr *)&bound.addr, &bound.len) != 0)
        goto err_close;
    llmdd__sockaddr_str(&bound, name, sizeof(name)); /* port 0: the real one */
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
