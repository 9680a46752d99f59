/*
 * The control plane: the listener, the handshake, the link table and the
 * control thread that watches every link's control socket.
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
#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <openssl/hmac.h>
#include <poll.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <time.h>
#include <sys/socket.h>
#include <unistd.h>

#include "core/internal.h"
#include "ctrl/net.h"
#include "ctrl/wire.h"

#define HANDSHAKE_MS 2000
#define HANDSHAKE_MAX 128
#define CTRL_MSG_MAX LLMDD_CTRL_MSG_MAX
#define ACCEPT_BACKOFF_MIN_MS 10
#define ACCEPT_BACKOFF_MAX_MS 1000

_Static_assert(LLMDD_CTRL_FRAME_MAX == LLMDD_WIRE_HDR_LEN + CTRL_MSG_MAX,
               "a link's control buffer holds one whole frame");

struct llmdd__ctrl {
    pthread_t thread;
    int wake_fd;
    /* Guarded by dd->lock. */
    int listen_fd;
    bool stop;
    uint64_t gen, seen_gen; /* the thread has rebuilt its poll set */
    int handshakes;
    /* Handshakes still waiting for their HELLO: fd (-1: free) and since. */
    int waiting[HANDSHAKE_MAX];
    int64_t waiting_since[HANDSHAKE_MAX];
    llmdd__sockaddr bound; /* where listen_fd listens; guarded by dd->lock */
    /* The control thread's own: while accept cannot get a descriptor the
     * listener is not polled until accept_resume (CLOCK_MONOTONIC ms). */
    int64_t accept_resume;
    int accept_backoff_ms;
};

/* ---- Authentication: HMAC-SHA256 over both nonces and both ids. ---- */

static void
auth_mac(const char *token, const char *label, const uint8_t *cnonce,
         const uint8_t *snonce, uint64_t client_id, uint64_t server_id,
         uint8_t *mac)
{
    uint8_t msg[16 + 2 * LLMDD_WIRE_NONCE_LEN + 16];
    unsigned int len = LLMDD_WIRE_MAC_LEN;
    size_t n = 0;

    memset(msg, 0, sizeof(msg));
    memcpy(msg, label, strnlen(label, 16));
    n = 16;
    memcpy(msg + n, cnonce, LLMDD_WIRE_NONCE_LEN);
    n += LLMDD_WIRE_NONCE_LEN;
    memcpy(msg + n, snonce, LLMDD_WIRE_NONCE_LEN);
    n += LLMDD_WIRE_NONCE_LEN;
    for (int i = 0; i < 8; i++) {
        msg[n + (size_t)i] = (uint8_t)(client_id >> (8 * i));
        msg[n + 8 + (size_t)i] = (uint8_t)(server_id >> (8 * i));
    }
    n += 16;
    HMAC(EVP_sha256(), token, (int)strlen(token), msg, n, mac, &len);
}

static bool
auth_ok(const char *token, const char *label, const uint8_t *cnonce,
        const uint8_t *snonce, uint64_t client_id, uint64_t server_id,
        const uint8_t *mac)
{
    uint8_t want[LLMDD_WIRE_MAC_LEN];

    auth_mac(token, label, cnonce, snonce, client_id, server_id, want);
    return CRYPTO_memcmp(want, mac, sizeof(want)) == 0;
}

/* ---- The link table. ---- */

static llmdd__link *
link_new(llmdd *dd, const llmdd__peer *peer, bool client, int ctrl_fd)
{
    llmdd__link *link = calloc(1, sizeof(*link));

    if (link == NULL)
        return NULL;
    link->dd = dd;
    link->peer = *peer;
    link->client = client;
    link->ctrl_fd = ctrl_fd;
    link->refs = 1;
    pthread_mutex_init(&link->rc_lock, NULL);
    pthread_mutex_init(&link->wlock, NULL);
    return link;
}

/* Frees a link that never became visible (or whose last ref is gone). */
static void
link_free(llmdd__link *link)
{
    if (link->tp != NULL)
        link->ops->link_fini(link);
    for (size_t i = 0; i < link->nrcs; i++) {
        if (link->ops != NULL && link->ops->remote_free != NULL)
            link->ops->remote_free(link->rcs[i]);
        free(link->rcs[i]);
    }
    free(link->rcs);
    if (link->ctrl_fd >= 0)
        close(link->ctrl_fd);
    pthread_mutex_destroy(&link->wlock);
    pthread_mutex_destroy(&link->rc_lock);
    free(link);
}

llmdd__link *
llmdd__link_get(llmdd *dd, uint64_t cluster_id)
{
    llmdd__link *link;

    pthread_mutex_lock(&dd->lock);
    for (link = dd->links; link != NULL; link = link->next)
        if (link->peer.cluster_id == cluster_id)
            break;
    if (link != NULL)
        link->refs++;
    pthread_mutex_unlock(&dd->lock);
    return link;
}

llmdd__link *
llmdd__link_find_token(llmdd *dd, const uint8_t *token)
{
    llmdd__link *link;

    pthread_mutex_lock(&dd->lock);
    for (link = dd->links; link != NULL; link = link->next)
        if (CRYPTO_memcmp(link->token, token, LLMDD_TOKEN_LEN) == 0)
            break;
    if (link != NULL)
        link->refs++;
    pthread_mutex_unlock(&dd->lock);
    return link;
}

void
llmdd__link_put(llmdd__link *link)
{
    llmdd *dd;
    bool last;

    if (link == NULL)
        return;
    dd = link->dd;
    pthread_mutex_lock(&dd->lock);
    last = --link->refs == 0;
    pthread_mutex_unlock(&dd->lock);
    if (last)
        link_free(link);
}

void
llmdd__link_drop(llmdd__link *link, const char *why)
{
    llmdd *dd = link->dd;
    bool was_live = false;

    pthread_mutex_lock(&dd->lock);
    if (!link->dead) {
        link->dead = true;
        for (llmdd__link **p = &dd->links; *p != NULL; p = &(*p)->next) {
            if (*p == link) {
                *p = link->next;
                was_live = true;
                break;
            }
        }
    }
    pthread_cond_broadcast(&dd->cond);
    pthread_mutex_unlock(&dd->lock);
    if (!was_live)
        return;
    llmdd__metrics_link_event(dd, false);
    log_info("link to cluster %llu dropped: %s",
             (unsigned long long)link->peer.cluster_id, why);
    shutdown(link->ctrl_fd, SHUT_RDWR);
    link->ops->link_shutdown(link);
    llmdd__requests_link_down(dd, link);
    llmdd__ctrl_wake(dd);
    llmdd__link_put(link); /* the table's reference */
}

/* dd->lock held. Links we serve (the peer linked to us). */
static size_t
links_served(const llmdd *dd)
{
    size_t n = 0;

    for (const llmdd__link *l = dd->links; l != NULL; l = l->next)
        n += !l->client;
    return n;
}

/* dd->lock held. Whether a link call of ours to `cluster` is in flight. */
static bool
linking_to(const llmdd *dd, uint64_t cluster)
{
    for (const llmdd__linking *l = dd->linking; l != NULL; l = l->next)
        if (l->cluster_id == cluster)
            return true;
    return false;
}

/*
 * dd->lock held. Whether the server side may take a link from `cluster`:
 * LLM_ALREADY_LINK when one exists; LLM_PROCESSING_LINK when we are linking
 * to it at the same time and our call wins (the lower cluster id's outgoing
 * link is the one both sides keep); LLM_CLUSTER_NUM_EXCEED_LIMIT when we
 * serve llm.MaxLinks links already.
 */
static llmdd_status
link_admit(const llmdd *dd, uint64_t cluster)
{
    for (const llmdd__link *l = dd->links; l != NULL; l = l->next)
        if (l->peer.cluster_id == cluster)
            return LLM_ALREADY_LINK;
    if (dd->cluster_id < cluster && linking_to(dd, cluster))
        return LLM_PROCESSING_LINK;
    if (links_served(dd) >= dd->opts.max_links)
        return LLM_CLUSTER_NUM_EXCEED_LIMIT;
    return LLM_SUCCESS;
}

/* Makes a set-up link visible; fails if the cluster is linked already. */
static llmdd_status
link_publish(llmdd *dd, llmdd__link *link)
{
    llmdd_status st = LLM_SUCCESS;

    pthread_mutex_lock(&dd->lock);
    if (!dd->initialized) {
        st = LLM_FAILED;
    } else if (!link->client) {
        st = link_admit(dd, link->peer.cluster_id);
    } else {
        for (llmdd__link *l = dd->links; l != NULL; l = l->next)
            if (l->peer.cluster_id == link->peer.cluster_id)
                st = LLM_ALREADY_LINK;
    }
    if (st == LLM_SUCCESS) {
        link->next = dd->links;
        dd->links = link;
        pthread_cond_broadcast(&dd->cond); /* a crossed link call waits */
    }
    pthread_mutex_unlock(&dd->lock);
    if (st == LLM_SUCCESS) {
        llmdd__metrics_link_event(dd, true);
        llmdd__ctrl_wake(dd);
    }
    return st;
}

void
llmdd__links_fini(llmdd *dd)
{
    for (;;) {
        pthread_mutex_lock(&dd->lock);
        llmdd__link *link = dd->links;
        if (link != NULL)
            link->refs++;
        pthread_mutex_unlock(&dd->lock);
        if (link == NULL)
            return;
        llmdd__link_drop(link, "finalize");
        llmdd__link_put(link);
    }
}

/* ---- Remote cache descriptions, cached per link. ---- */

static llmdd__remote_cache *
rc_find(llmdd__link *link, int64_t id, size_t *idx)
{
    for (size_t i = 0; i < link->nrcs; i++) {
        if (link->rcs[i]->id == id) {
            *idx = i;
            return link->rcs[i];
        }
    }
    return NULL;
}

static void
rc_unref(llmdd__link *link, llmdd__remote_cache *rc)
{
    /* rc_lock held. */
    if (--rc->refs == 0) {
        if (link->ops->remote_free != NULL)
            link->ops->remote_free(rc);
        free(rc);
    }
}

llmdd_status
llmdd__link_remote(llmdd__link *link, int64_t id, int64_t deadline_ms,
                   llmdd__remote_cache **out)
{
    llmdd__remote_cache *rc, *have;
    llmdd_status st;
    size_t idx;

    pthread_mutex_lock(&link->rc_lock);
    rc = rc_find(link, id, &idx);
    if (rc != NULL) {
        rc->refs++;
        pthread_mutex_unlock(&link->rc_lock);
        *out = rc;
        return LLM_SUCCESS;
    }
    pthread_mutex_unlock(&link->rc_lock);

    rc = calloc(1, sizeof(*rc));
    if (rc == NULL)
        return LLM_OUT_OF_MEMORY;
    st = link->ops->query(link, id, deadline_ms, rc);
    if (st != LLM_SUCCESS) {
        free(rc);
        return st;
    }
    /* The peer's desc is untrusted: it must describe a sane cache. */
    uint64_t tsize, stride;
    if (llmdd__desc_check(&rc->desc, &tsize, &stride) != LLM_SUCCESS ||
        tsize != rc->tensor_size || stride != rc->stride) {
        log_error("cluster %llu sent a bad description of cache %lld",
                  (unsigned long long)link->peer.cluster_id, (long long)id);
        if (link->ops->remote_free != NULL)
            link->ops->remote_free(rc);
        free(rc);
        return LLM_KV_CACHE_NOT_EXIST;
    }
    rc->id = id;
    rc->refs = 2; /* the table's and the caller's */
    pthread_mutex_lock(&link->rc_lock);
    have = rc_find(link, id, &idx);
    if (have != NULL) {
        /* Another thread asked too; keep the first answer. */
        have->refs++;
        rc->refs = 1;
        rc_unref(link, rc);
        rc = have;
    } else if (link->nrcs == link->rcs_cap) {
        size_t cap = link->rcs_cap ? link->rcs_cap * 2 : 8;
        llmdd__remote_cache **n = realloc(link->rcs, cap * sizeof(*n));
        if (n == NULL) {
            rc->refs = 1; /* not in the table: only the caller's */
        } else {
            link->rcs = n;
            link->rcs_cap = cap;
            link->rcs[link->nrcs++] = rc;
        }
    } else {
        link->rcs[link->nrcs++] = rc;
    }
    pthread_mutex_unlock(&link->rc_lock);
    *out = rc;
    return LLM_SUCCESS;
}

void
llmdd__link_remote_put(llmdd__link *link, llmdd__remote_cache *rc)
{
    pthread_mutex_lock(&link->rc_lock);
    rc_unref(link, rc);
    pthread_mutex_unlock(&link->rc_lock);
}

void
llmdd__link_forget(llmdd__link *link, int64_t id)
{
    llmdd__remote_cache *rc;
    size_t idx;

    pthread_mutex_lock(&link->rc_lock);
    rc = rc_find(link, id, &idx);
    if (rc != NULL) {
        link->rcs[idx] = link->rcs[--link->nrcs];
        rc->gone = true;
        rc_unref(link, rc);
    }
    pthread_mutex_unlock(&link->rc_lock);
}

/* ---- The control thread. ---- */

void
llmdd__ctrl_wake(llmdd *dd)
{
    uint64_t one = 1;

    if (dd->ctrl != NULL)
        (void)!write(dd->ctrl->wake_fd, &one, sizeof(one));
}

static void *handshake_main(void *arg);

struct handshake_arg {
    llmdd *dd;
    int fd;
};

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

/* The handshake on fd got its HELLO, or failed: it cannot be evicted now. */
static void
ctrl_hello_done(llmdd *dd, int fd)
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
        struct handshake_arg *a = full ? NULL : malloc(sizeof(*a));
        if (a == NULL) {
            log_warn("too many handshakes in progress; connection closed");
            goto drop;
        }
        a->dd = dd;
        a->fd = fd;
        if (llmdd__spawn(dd, handshake_main, a) == 0)
            continue;
        free(a);
    drop:
        if (!full) {
            ctrl_hello_done(dd, fd);
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

void
llmdd__link_ask_reopen(llmdd__link *link)
{
    pthread_mutex_lock(&link->wlock);
    llmdd__send_msg(link->dd, link->ctrl_fd, WMSG_REOPEN, NULL, 0,
                    llmdd__now_ms() + HANDSHAKE_MS);
    pthread_mutex_unlock(&link->wlock);
}

/*
 * The next whole control frame of a link, read incrementally so that a peer
 * which sends part of a frame and stops blocks nobody: 1 and the frame, 0
 * when more bytes must arrive first, -1 on EOF, error or a bad frame.
 */
static int
ctrl_rx_next(llmdd__link *link, uint16_t *type, uint8_t *buf, size_t *len)
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
    int rc = llmdd__send_msg(dd, link->ctrl_fd, WMSG_KEY_REPLY, out, n,
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
    int rc =
        llmdd__send_msg(dd, link->ctrl_fd, WMSG_KEY_QUERY, buf, n, deadline);
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
        llmdd__send_msg(dd, link->ctrl_fd, WMSG_UNLINK_ACK, NULL, 0,
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
             * application drains the queue (llmdd__ctrl_resume_links). */
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

    while ((rc = ctrl_rx_next(link, &type, buf, &len)) == 1)
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

void
llmdd__ctrl_resume_links(llmdd *dd)
{
    pthread_mutex_lock(&dd->lock);
    for (llmdd__link *l = dd->links; l != NULL; l = l->next)
        l->rx_paused = false;
    pthread_mutex_unlock(&dd->lock);
    llmdd__ctrl_wake(dd);
}

llmdd_status
llmdd__notify_send(llmdd__link *link, const void *msg, size_t len,
                   int64_t deadline_ms)
{
    pthread_mutex_lock(&link->wlock);
    int rc = llmdd__send_msg(link->dd, link->ctrl_fd, WMSG_NOTIFY, msg, len,
                             deadline_ms);
    pthread_mutex_unlock(&link->wlock);
    if (rc == 0) {
        atomic_fetch_add_explicit(&link->dd->metrics.notify_sent, 1,
                                  memory_order_relaxed);
        return LLM_SUCCESS;
    }
    /* Part of a frame may have gone out: the connection is unusable. */
    bool late = llmdd__now_ms() >= deadline_ms;
    llmdd__link_drop(link, late ? "notification not taken in time"
                                : "notification not sent");
    return late ? LLM_TIMEOUT : LLM_NOT_YET_LINK;
}

llmdd_status
llmdd_send_notify(llmdd *dd, uint64_t cluster_id, const void *msg, size_t len)
{
    llmdd_status st;

    if (dd == NULL)
        return LLM_PARAM_INVALID;
    if ((st = llmdd__ready(dd)) != LLM_SUCCESS)
        return st;
    if (len > LLMDD_NOTIFY_MAX || (msg == NULL && len > 0))
        return LLM_PARAM_INVALID;
    llmdd__link *link = llmdd__link_get(dd, cluster_id);
    if (link == NULL)
        return LLM_NOT_YET_LINK;
    st = llmdd__notify_send(link, msg, len,
                            llmdd__now_ms() + llmdd__wait_ms(dd));
    llmdd__link_put(link);
    return st;
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

llmdd_status
llmdd__ctrl_start(llmdd *dd)
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

void
llmdd__ctrl_stop(llmdd *dd)
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

llmdd_status
llmdd__listen_start(llmdd *dd)
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

void
llmdd__listen_stop(llmdd *dd)
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

/* ---- The handshake, server side. ---- */

static const llmdd_transport_ops *
transport_pick(llmdd *dd, llmdd__link *link, const char *peer_forced)
{
    const char *mine = dd->opts.transport;

    if (strcmp(mine, "auto") == 0)
        mine = peer_forced;
    link->forced = strcmp(mine, "auto") != 0;
    if (link->forced) {
        const llmdd_transport_ops *ops = llmdd__transport_find(mine);
        if (ops == NULL || !ops->reaches(link)) {
            log_error("transport %s cannot reach cluster %llu", mine,
                      (unsigned long long)link->peer.cluster_id);
            return NULL;
        }
        return ops;
    }
    for (size_t i = 0; i < llmdd__transport_count(); i++) {
        const llmdd_transport_ops *ops = llmdd__transport_at(i);
        if (ops->reaches(link))
            return ops;
    }
    return NULL;
}

static void
handshake_data(llmdd *dd, int fd, const llmdd__hello *h, int64_t deadline)
{
    llmdd__link *link = llmdd__link_find_token(dd, h->token);
    uint8_t buf[8];
    uint32_t st = LLM_SUCCESS;

    if (link == NULL || link->ops->accept_conn == NULL)
        st = LLM_LINK_FAILED;
    size_t n = llmdd__wire_u32_encode(st, buf, sizeof(buf));
    if (llmdd__send_msg(dd, fd, WMSG_DATA_REPLY, buf, n, deadline) != 0 ||
        st != LLM_SUCCESS) {
        close(fd);
        llmdd__link_put(link);
        return;
    }
    llmdd__sock_tune(fd, false);
    link->ops->accept_conn(link, fd, h->flags);
    llmdd__link_put(link);
}

static void
handshake_ctrl(llmdd *dd, int fd, const llmdd__hello *h, int64_t deadline)
{
    llmdd__hello_reply rep;
    llmdd__confirm conf;
    llmdd__result res;
    llmdd__link *link = NULL;
    uint8_t buf[CTRL_MSG_MAX];
    uint16_t type;
    size_t len;
    bool to;

    memset(&rep, 0, sizeof(rep));
    memset(&res, 0, sizeof(res));
    pthread_mutex_lock(&dd->lock);
    char *token = dd->opts.auth_token ? strdup(dd->opts.auth_token) : NULL;
    rep.cluster_id = dd->cluster_id;
    rep.role = (uint32_t)dd->role;
    strcpy(rep.transport, dd->opts.transport);
    pthread_mutex_unlock(&dd->lock);
    rep.pid = (uint32_t)getpid();
    memcpy(rep.boot_id, llmdd__boot_id(), sizeof(rep.boot_id));
    rep.nonce = dd->nonce;
    rep.auth = token != NULL;
    rep.status = LLM_SUCCESS;
    /* Our end of the connection, so a client in this process can prove it
     * is one (loop); removed when the handshake ends. */
    bool registered = llmdd__own_conn_add(fd, dd->nonce) == 0;
    pthread_mutex_lock(&dd->lock);
    bool full = links_served(dd) >= dd->opts.max_links;
    pthread_mutex_unlock(&dd->lock);
    if (llmdd__random(rep.snonce, sizeof(rep.snonce)) != 0) {
        log_error("handshake: no random bytes: %s", strerror(errno));
        rep.status = LLM_FAILED;
    } else if (h->cluster_id == dd->cluster_id) {
        log_error("handshake: peer has our own cluster id %llu",
                  (unsigned long long)h->cluster_id);
        rep.status = LLM_LINK_FAILED;
    } else if (h->auth != rep.auth) {
        log_error("handshake: cluster %llu %s an auth token and we %s",
                  (unsigned long long)h->cluster_id, h->auth ? "has" : "has no",
                  rep.auth ? "do" : "do not");
        rep.status = LLM_LINK_FAILED;
    } else if (full) {
        log_error("handshake: cluster %llu refused: %u links served "
                  "(llm.MaxLinks)",
                  (unsigned long long)h->cluster_id, dd->opts.max_links);
        rep.status = LLM_CLUSTER_NUM_EXCEED_LIMIT;
    } else if (token != NULL) {
        auth_mac(token, "llmdd-server", h->cnonce, rep.snonce, h->cluster_id,
                 dd->cluster_id, rep.mac);
    }
    len = llmdd__wire_hello_reply_encode(&rep, buf, sizeof(buf));
    if (llmdd__send_msg(dd, fd, WMSG_HELLO_REPLY, buf, len, deadline) != 0 ||
        rep.status != LLM_SUCCESS)
        goto out;

    if (llmdd__recv_msg(dd, fd, &type, buf, sizeof(buf), &len, deadline, &to) !=
            0 ||
        type != WMSG_CONFIRM ||
        llmdd__wire_confirm_decode(buf, len, &conf) != 0)
        goto out;
    /* The client checked our end before its CONFIRM; check its end. */
    bool local = llmdd__own_conn_peer(fd, h->nonce);
    if (registered)
        llmdd__own_conn_del(fd);
    registered = false;
    res.status = LLM_LINK_FAILED;
    if (token != NULL && !auth_ok(token, "llmdd-client", h->cnonce, rep.snonce,
                                  h->cluster_id, dd->cluster_id, conf.mac)) {
        log_error("handshake: cluster %llu failed authentication",
                  (unsigned long long)h->cluster_id);
        goto reply;
    }
    llmdd__peer peer = {.cluster_id = h->cluster_id,
                        .role = h->role,
                        .pid = h->pid,
                        .nonce = h->nonce,
                        .local = local};
    memcpy(peer.boot_id, h->boot_id, sizeof(peer.boot_id));
    link = link_new(dd, &peer, false, -1);
    if (link == NULL)
        goto reply;
    link->ops = llmdd__transport_find(conf.transport);
    if (link->ops == NULL || !link->ops->reaches(link) ||
        (strcmp(dd->opts.transport, "auto") != 0 &&
         strcmp(dd->opts.transport, conf.transport) != 0)) {
        log_error("handshake: cluster %llu wants transport %s; refused",
                  (unsigned long long)h->cluster_id, conf.transport);
        goto reply;
    }
    if (llmdd__random(link->token, sizeof(link->token)) != 0 ||
        link->ops->link_init(link, false) != LLM_SUCCESS)
        goto reply;
    link->ctrl_fd = fd;
    res.status = link_publish(dd, link);
    if (res.status != LLM_SUCCESS) {
        link->ctrl_fd = -1;
        link->ops->link_shutdown(link); /* its threads let go of it */
        goto reply;
    }
    memcpy(res.token, link->token, sizeof(res.token));
    len = llmdd__wire_result_encode(&res, buf, sizeof(buf));
    if (llmdd__send_msg(dd, fd, WMSG_RESULT, buf, len, deadline) != 0)
        llmdd__link_drop(link, "handshake result not delivered");
    llmdd__sock_tune(fd, true);
    log_info("linked with cluster %llu (server side, %s)",
             (unsigned long long)h->cluster_id, link->ops->name);
    free(token);
    return; /* fd now belongs to the link */
reply:
    len = llmdd__wire_result_encode(&res, buf, sizeof(buf));
    llmdd__send_msg(dd, fd, WMSG_RESULT, buf, len, deadline);
out:
    llmdd__link_put(link);
    if (registered)
        llmdd__own_conn_del(fd);
    close(fd);
    free(token);
}

static void *
handshake_main(void *arg)
{
    struct handshake_arg a = *(struct handshake_arg *)arg;
    llmdd *dd = a.dd;
    int64_t deadline = llmdd__now_ms() + HANDSHAKE_MS;
    uint8_t buf[CTRL_MSG_MAX];
    llmdd__hello h;
    uint16_t type;
    size_t len;
    bool to;

    free(arg);
    int rc =
        llmdd__recv_msg(dd, a.fd, &type, buf, sizeof(buf), &len, deadline, &to);
    ctrl_hello_done(dd, a.fd);
    if (rc != 0 || type != WMSG_HELLO ||
        llmdd__wire_hello_decode(buf, len, &h) != 0) {
        log_info("handshake rejected: %s",
                 to ? "too slow" : "malformed or truncated");
        close(a.fd);
    } else if (h.kind == CONN_DATA) {
        /* From here on this may be a long-lived serving thread. */
        pthread_mutex_lock(&dd->lock);
        dd->ctrl->handshakes--;
        pthread_cond_broadcast(&dd->cond);
        pthread_mutex_unlock(&dd->lock);
        handshake_data(dd, a.fd, &h, deadline);
        return NULL;
    } else {
        handshake_ctrl(dd, a.fd, &h, deadline);
    }
    pthread_mutex_lock(&dd->lock);
    dd->ctrl->handshakes--;
    pthread_cond_broadcast(&dd->cond);
    pthread_mutex_unlock(&dd->lock);
    return NULL;
}

/* ---- Linking and unlinking, client side. ---- */

/*
 * The peer refused our link because it links to us at the same time and its
 * call wins (link_admit): wait for its link to reach our listener.
 */
static llmdd_status
link_adopt(llmdd *dd, uint64_t cluster, int64_t deadline)
{
    bool linked = false;

    pthread_mutex_lock(&dd->lock);
    while (dd->initialized && llmdd__now_ms() < deadline) {
        for (llmdd__link *l = dd->links; l != NULL && !linked; l = l->next)
            linked = l->peer.cluster_id == cluster;
        if (linked)
            break;
        llmdd__cond_wait_until(&dd->cond, &dd->lock, deadline);
    }
    pthread_mutex_unlock(&dd->lock);
    if (linked) {
        log_info("linked with cluster %llu (its crossing link call won)",
                 (unsigned long long)cluster);
        return LLM_SUCCESS;
    }
    log_error("link to cluster %llu: its crossing link call did not arrive "
              "in time",
              (unsigned long long)cluster);
    return LLM_TIMEOUT;
}

/*
 * Where a link's connections leave from (local_ip_infos): the first entry
 * of the remote address's family, port 0, since each connection needs its
 * own port; AF_UNSPEC when there is none. LLM_PARAM_INVALID for an entry
 * that is not an address, or entries of none of the remote's family.
 */
static llmdd_status
link_local_addr(const llmdd_cluster_info *ci, const llmdd__sockaddr *remote,
                llmdd__sockaddr *out)
{
    llmdd__sockaddr found;

    memset(&found, 0, sizeof(found));
    if (ci->num_local_ip_infos > 0 && ci->local_ip_infos == NULL)
        return LLM_PARAM_INVALID;
    for (size_t i = 0; i < ci->num_local_ip_infos; i++) {
        llmdd_ip_info info = ci->local_ip_infos[i];
        llmdd__sockaddr a;
        info.port = 1; /* checked here, replaced by 0 below */
        if (llmdd__parse_ip_info(&info, &a) != LLM_SUCCESS)
            return LLM_PARAM_INVALID;
        if (a.addr.ss_family != remote->addr.ss_family ||
            found.addr.ss_family != AF_UNSPEC)
            continue;
        if (a.addr.ss_family == AF_INET)
            ((struct sockaddr_in *)&a.addr)->sin_port = 0;
        else
            ((struct sockaddr_in6 *)&a.addr)->sin6_port = 0;
        found = a;
    }
    if (ci->num_local_ip_infos > 0 && found.addr.ss_family == AF_UNSPEC)
        return LLM_PARAM_INVALID;
    *out = found;
    return LLM_SUCCESS;
}

/* The client side of the control handshake, up to a published link. */
static llmdd_status
link_handshake(llmdd *dd, const llmdd_cluster_info *ci, int64_t deadline)
{
    llmdd__hello h;
    llmdd__hello_reply rep;
    llmdd__confirm conf;
    llmdd__result res;
    llmdd__sockaddr addr;
    uint8_t buf[CTRL_MSG_MAX];
    llmdd__link *link;
    llmdd_status st;
    uint16_t type;
    size_t len;
    bool to = false; /* a failed send leaves it unset by recv_msg */
    int fd;

    llmdd__sockaddr from;
    llmdd__parse_ip_info(&ci->remote_ip_infos[0], &addr);
    link_local_addr(ci, &addr, &from); /* checked by check_clusters */
    fd = llmdd__connect_from(dd, &addr, &from, deadline, &st);
    if (fd < 0)
        return st;
    /* Our end, so a server in this process can prove we are one (loop). */
    bool registered = llmdd__own_conn_add(fd, dd->nonce) == 0;

    memset(&h, 0, sizeof(h));
    h.kind = CONN_CTRL;
    pthread_mutex_lock(&dd->lock);
    char *token = dd->opts.auth_token ? strdup(dd->opts.auth_token) : NULL;
    h.role = (uint32_t)dd->role;
    strcpy(h.transport, dd->opts.transport);
    pthread_mutex_unlock(&dd->lock);
    h.cluster_id = dd->cluster_id;
    h.pid = (uint32_t)getpid();
    memcpy(h.boot_id, llmdd__boot_id(), sizeof(h.boot_id));
    h.nonce = dd->nonce;
    h.auth = token != NULL;

    st = LLM_LINK_FAILED;
    if (llmdd__random(h.cnonce, sizeof(h.cnonce)) != 0 ||
        (len = llmdd__wire_hello_encode(&h, buf, sizeof(buf))) == 0 ||
        llmdd__send_msg(dd, fd, WMSG_HELLO, buf, len, deadline) != 0 ||
        llmdd__recv_msg(dd, fd, &type, buf, sizeof(buf), &len, deadline, &to) !=
            0 ||
        type != WMSG_HELLO_REPLY ||
        llmdd__wire_hello_reply_decode(buf, len, &rep) != 0) {
        if (to)
            st = LLM_TIMEOUT;
        log_error("link to cluster %llu: handshake %s",
                  (unsigned long long)ci->remote_cluster_id,
                  to ? "timed out" : "failed");
        goto err_fd;
    }
    if (rep.status != LLM_SUCCESS) {
        log_error("link to cluster %llu: refused by the peer (%s)",
                  (unsigned long long)ci->remote_cluster_id,
                  llmdd_status_str(rep.status));
        if (rep.status == LLM_CLUSTER_NUM_EXCEED_LIMIT)
            st = rep.status;
        goto err_fd;
    }
    if (rep.cluster_id != ci->remote_cluster_id) {
        log_error("link: the peer is cluster %llu, not %llu",
                  (unsigned long long)rep.cluster_id,
                  (unsigned long long)ci->remote_cluster_id);
        goto err_fd;
    }
    if (token != NULL && !auth_ok(token, "llmdd-server", h.cnonce, rep.snonce,
                                  dd->cluster_id, rep.cluster_id, rep.mac)) {
        log_error("link to cluster %llu: the peer failed authentication",
                  (unsigned long long)rep.cluster_id);
        goto err_fd;
    }
    llmdd__peer peer = {.cluster_id = rep.cluster_id,
                        .role = rep.role,
                        .pid = rep.pid,
                        .nonce = rep.nonce,
                        .local = llmdd__own_conn_peer(fd, rep.nonce),
                        .addr = addr};
    memcpy(peer.boot_id, rep.boot_id, sizeof(peer.boot_id));
    link = link_new(dd, &peer, true, -1);
    if (link == NULL)
        goto err_fd;
    link->bind_addr = from;
    pthread_mutex_lock(&dd->lock);
    link->ops = transport_pick(dd, link, rep.transport);
    pthread_mutex_unlock(&dd->lock);
    if (link->ops == NULL)
        goto err_link;

    memset(&conf, 0, sizeof(conf));
    strcpy(conf.transport, link->ops->name);
    if (token != NULL)
        auth_mac(token, "llmdd-client", h.cnonce, rep.snonce, dd->cluster_id,
                 rep.cluster_id, conf.mac);
    len = llmdd__wire_confirm_encode(&conf, buf, sizeof(buf));
    if (llmdd__send_msg(dd, fd, WMSG_CONFIRM, buf, len, deadline) != 0 ||
        llmdd__recv_msg(dd, fd, &type, buf, sizeof(buf), &len, deadline, &to) !=
            0 ||
        type != WMSG_RESULT || llmdd__wire_result_decode(buf, len, &res) != 0) {
        st = to ? LLM_TIMEOUT : LLM_LINK_FAILED;
        goto err_link;
    }
    if (res.status == LLM_PROCESSING_LINK) {
        /* The peer links to us at the same time and its call wins: its link
         * reaches our listener, and the caller gets that one. */
        link_free(link);
        if (registered)
            llmdd__own_conn_del(fd);
        close(fd);
        free(token);
        return link_adopt(dd, rep.cluster_id, deadline);
    }
    if (res.status != LLM_SUCCESS) {
        log_error("link to cluster %llu: refused by the peer (%s)",
                  (unsigned long long)rep.cluster_id,
                  llmdd_status_str(res.status));
        st = res.status == LLM_ALREADY_LINK ||
                     res.status == LLM_CLUSTER_NUM_EXCEED_LIMIT
                 ? res.status
                 : LLM_LINK_FAILED;
        goto err_link;
    }
    memcpy(link->token, res.token, sizeof(link->token));
    if (registered)
        llmdd__own_conn_del(fd); /* before the link may close fd */
    link->ctrl_fd = fd;
    llmdd__sock_tune(fd, true);
    /* The transport may connect its data channels with our deadline. */
    link->deadline_ms = deadline;
    st = link->ops->link_init(link, true);
    if (st == LLM_SUCCESS)
        st = link_publish(dd, link);
    if (st != LLM_SUCCESS) {
        /* Transport threads may hold references: let the last one free it.
         * Closing fd makes the peer drop its side. */
        shutdown(fd, SHUT_RDWR);
        link->ops->link_shutdown(link);
        llmdd__link_put(link);
        free(token);
        return st;
    }
    log_info("linked with cluster %llu (%s)",
             (unsigned long long)rep.cluster_id, link->ops->name);
    free(token);
    return LLM_SUCCESS;

err_link:
    link_free(link);
err_fd:
    if (registered)
        llmdd__own_conn_del(fd);
    close(fd);
    free(token);
    return st;
}

/*
 * Runs one llmdd_link_clusters job: refuses a cluster we are linked to, and
 * meanwhile records the call, so that a peer linking to us at the same time
 * finds the crossing (link_admit) and exactly one link results.
 */
static llmdd_status
link_one(llmdd *dd, const llmdd_cluster_info *ci, int64_t deadline)
{
    llmdd__linking me = {.cluster_id = ci->remote_cluster_id};
    llmdd_status st = LLM_SUCCESS;

    pthread_mutex_lock(&dd->lock);
    for (llmdd__link *l = dd->links; l != NULL; l = l->next)
        if (l->peer.cluster_id == ci->remote_cluster_id)
            st = LLM_ALREADY_LINK;
    if (st == LLM_SUCCESS) {
        me.next = dd->linking;
        dd->linking = &me;
    }
    pthread_mutex_unlock(&dd->lock);
    if (st != LLM_SUCCESS)
        return st;
    st = link_handshake(dd, ci, deadline);
    pthread_mutex_lock(&dd->lock);
    for (llmdd__linking **p = &dd->linking; *p != NULL; p = &(*p)->next) {
        if (*p == &me) {
            *p = me.next;
            break;
        }
    }
    pthread_mutex_unlock(&dd->lock);
    return st;
}

struct link_job {
    llmdd *dd;
    const llmdd_cluster_info *ci;
    int64_t deadline;
    bool force;
    bool unlink;
    llmdd_status st;
};

/*
 * The link died while we waited for UNLINK_ACK. A peer that honours our
 * UNLINK sends the ACK and then closes its data connections; a transfer of
 * ours can see that close and drop the link before the control thread has
 * read the ACK, which then sits unread in the socket. Once the control thread
 * no longer polls this link, read what is queued ourselves.
 */
static bool
unlink_ack_queued(llmdd *dd, llmdd__link *link, int64_t deadline)
{
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
    acked = link->unlink_acked;
    pthread_mutex_unlock(&dd->lock);
    /* The socket is shut down: this reads only what had arrived, after
     * what the control thread had read of a frame. */
    while (!acked) {
        rc = ctrl_rx_next(link, &type, buf, &len);
        if (rc == 1)
            acked = type == WMSG_UNLINK_ACK;
        else if (rc < 0 ||
                 llmdd__wait_fd(dd, link->ctrl_fd, POLLIN, deadline) != 1)
            break;
    }
    return acked;
}

static llmdd_status
unlink_one(llmdd *dd, const llmdd_cluster_info *ci, int64_t deadline,
           bool force)
{
    llmdd__link *link = llmdd__link_get(dd, ci->remote_cluster_id);
    llmdd_status st = LLM_SUCCESS;

    if (link == NULL)
        return LLM_SUCCESS;
    if (!force) {
        pthread_mutex_lock(&link->wlock);
        int rc =
            llmdd__send_msg(dd, link->ctrl_fd, WMSG_UNLINK, NULL, 0, deadline);
        pthread_mutex_unlock(&link->wlock);
        pthread_mutex_lock(&dd->lock);
        while (rc == 0 && !link->unlink_acked && !link->dead &&
               llmdd__now_ms() < deadline)
            llmdd__cond_wait_until(&dd->cond, &dd->lock, deadline);
        bool acked = link->unlink_acked, dead = link->dead;
        pthread_mutex_unlock(&dd->lock);
        if (!acked && dead && rc == 0)
            acked = unlink_ack_queued(dd, link, deadline);
        if (!acked) {
            log_error("unlink cluster %llu: the peer did not confirm",
                      (unsigned long long)ci->remote_cluster_id);
            st = LLM_UNLINK_FAILED;
        }
    }
    llmdd__link_drop(link, force ? "force unlink" : "unlinked");
    llmdd__link_put(link);
    return st;
}

static void *
link_job_main(void *arg)
{
    struct link_job *j = arg;

    j->st = j->unlink ? unlink_one(j->dd, j->ci, j->deadline, j->force)
                      : link_one(j->dd, j->ci, j->deadline);
    if (!j->unlink)
        llmdd__metrics_link_attempt(j->dd, j->st);
    return NULL;
}

static llmdd_status
check_clusters(const llmdd_cluster_info *clusters, size_t n, llmdd_status *rets,
               int32_t timeout_ms, bool need_addr)
{
    if (clusters == NULL || rets == NULL || n == 0 || timeout_ms <= 0)
        return LLM_PARAM_INVALID;
    if (n > LLMDD_MAX_LINK_CLUSTERS)
        return LLM_CLUSTER_NUM_EXCEED_LIMIT;
    if (!need_addr)
        return LLM_SUCCESS;
    for (size_t i = 0; i < n; i++) {
        llmdd__sockaddr a, from;
        if (clusters[i].num_remote_ip_infos != 1 ||
            clusters[i].remote_ip_infos == NULL ||
            llmdd__parse_ip_info(&clusters[i].remote_ip_infos[0], &a) !=
                LLM_SUCCESS ||
            link_local_addr(&clusters[i], &a, &from) != LLM_SUCCESS)
            return LLM_PARAM_INVALID;
    }
    return LLM_SUCCESS;
}

static llmdd_status
run_jobs(llmdd *dd, const llmdd_cluster_info *clusters, size_t n,
         llmdd_status *rets, int32_t timeout_ms, bool unlink, bool force)
{
    struct link_job jobs[LLMDD_MAX_LINK_CLUSTERS];
    pthread_t threads[LLMDD_MAX_LINK_CLUSTERS];
    bool started[LLMDD_MAX_LINK_CLUSTERS];
    int64_t deadline = llmdd__now_ms() + timeout_ms;
    llmdd_status st = LLM_SUCCESS;

    for (size_t i = 0; i < n; i++) {
        jobs[i] = (struct link_job){.dd = dd,
                                    .ci = &clusters[i],
                                    .deadline = deadline,
                                    .force = force,
                                    .unlink = unlink};
        /* One cluster needs no thread; several go in parallel. */
        started[i] = n > 1 && pthread_create(&threads[i], NULL, link_job_main,
                                             &jobs[i]) == 0;
        if (!started[i])
            link_job_main(&jobs[i]);
    }
    for (size_t i = 0; i < n; i++) {
        if (started[i])
            pthread_join(threads[i], NULL);
        rets[i] = jobs[i].st;
        if (jobs[i].st != LLM_SUCCESS)
            st = jobs[i].st;
    }
    return st;
}

llmdd_status
llmdd_link_clusters(llmdd *dd, const llmdd_cluster_info *clusters,
                    size_t num_clusters, llmdd_status *rets, int32_t timeout_ms)
{
    llmdd_status st;

    if (dd == NULL)
        return LLM_PARAM_INVALID;
    if (llmdd__ready(dd) != LLM_SUCCESS)
        return LLM_FAILED;
    st = check_clusters(clusters, num_clusters, rets, timeout_ms, true);
    if (st != LLM_SUCCESS)
        return st;
    return run_jobs(dd, clusters, num_clusters, rets, timeout_ms, false, false);
}

llmdd_status
llmdd_unlink_clusters(llmdd *dd, const llmdd_cluster_info *clusters,
                      size_t num_clusters, llmdd_status *rets,
                      int32_t timeout_ms, bool force)
{
    llmdd_status st;

    if (dd == NULL)
        return LLM_PARAM_INVALID;
    if (llmdd__ready(dd) != LLM_SUCCESS)
        return LLM_FAILED;
    st = check_clusters(clusters, num_clusters, rets, timeout_ms, !force);
    if (st != LLM_SUCCESS)
        return st;
    return run_jobs(dd, clusters, num_clusters, rets, timeout_ms, true, force);
}
