/*
 * The link table and, per link, the registry of the peer's caches: core
 * state that the control plane (src/ctrl) fills and the transfer path reads.
 * Links and remote caches are reference-counted; the table is guarded by
 * dd->lock, a link's remote caches by its rc_lock.
 *
 * Also the one way anything sends on a link's control connection
 * (llmdd__link_send): frames are queued in order and written without
 * blocking, the control thread writes the rest as the socket takes it, so
 * no caller and never the control thread waits on one peer's socket; and
 * the replies awaited on it (key lookups, pings). Notifications, keys and
 * heartbeats own their messages; only the control thread reads the socket.
 */
#include <errno.h>
#include <openssl/crypto.h>
#include <poll.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "core/internal.h"
#include "base/wire.h"

/* ---- The link table. ---- */

llmdd__link *
llmdd__link_new(llmdd *dd, const llmdd__peer *peer, bool client, int ctrl_fd)
{
    llmdd__link *link = calloc(1, sizeof(*link));

    if (link == NULL)
        return NULL;
    link->dd = dd;
    link->peer = *peer;
    link->client = client;
    link->ctrl_fd = ctrl_fd;
    link->refs = 1;
    link->last_tx_ms = llmdd__now_ms();
    pthread_mutex_lock(&dd->lock);
    link->opts.wait_ms = dd->opts.wait_ms;
    link->opts.tcp_lanes = dd->opts.tcp_lanes;
    memcpy(link->opts.transport, dd->opts.transport,
           sizeof(link->opts.transport));
    pthread_mutex_unlock(&dd->lock);
    pthread_mutex_init(&link->rc_lock, NULL);
    pthread_mutex_init(&link->out_lock, NULL);
    if (llmdd__notify_link_init(link) != 0) {
        llmdd__link_free(link);
        return NULL;
    }
    return link;
}

void
llmdd__link_free(llmdd__link *link)
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
    llmdd__notify_link_fini(link);
    free(link->ctrl);
    free(link->out);
    pthread_mutex_destroy(&link->out_lock);
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
llmdd__link_hold(llmdd__link *link)
{
    pthread_mutex_lock(&link->dd->lock);
    link->refs++;
    pthread_mutex_unlock(&link->dd->lock);
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
        llmdd__link_free(link);
}

/*
 * Marks the link dead and takes it out of the table, ends the requests on
 * it, and with `cut` shuts its transport down (what runs fails fast);
 * whether it was in the table.
 */
static bool
link_unpublish(llmdd__link *link, const char *why, bool cut)
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
        return false;
    llmdd__metrics_link_event(dd, false);
    log_info("link to cluster %llu dropped: %s",
             (unsigned long long)link->peer.cluster_id, why);
    if (cut)
        link->ops->link_shutdown(link);
    llmdd__requests_link_down(dd, link);
    dd->plane->wake(dd);
    return true;
}

void
llmdd__link_retire(llmdd__link *link, const char *why)
{
    if (link_unpublish(link, why, false))
        llmdd__link_put(link); /* the table's reference */
}

void
llmdd__link_drop(llmdd__link *link, const char *why)
{
    bool was_live = link_unpublish(link, why, true);

    /* Also after a retire: the last message has gone, or never will. */
    pthread_mutex_lock(&link->out_lock);
    link->out_closed = true;
    pthread_mutex_unlock(&link->out_lock);
    shutdown(link->ctrl_fd, SHUT_RDWR);
    link->ops->link_shutdown(link); /* idempotent */
    if (was_live)
        llmdd__link_put(link); /* the table's reference */
}

void
llmdd__link_breach(llmdd__link *link, const char *why)
{
    pthread_mutex_lock(&link->dd->lock);
    bool live = !link->dead;
    pthread_mutex_unlock(&link->dd->lock);
    if (live) {
        log_warn("cluster %llu broke the protocol: %s; its link is dropped",
                 (unsigned long long)link->peer.cluster_id, why);
        llmdd__metrics_breach(link->dd);
    }
    llmdd__link_drop(link, why);
}

void
llmdd__link_status(llmdd__link *link, llmdd_status st)
{
    if (st == LLM_NOT_YET_LINK)
        llmdd__link_drop(link, "the transport lost the peer");
}

bool
llmdd__link_enter(llmdd__link *link)
{
    llmdd *dd = link->dd;

    pthread_mutex_lock(&dd->lock);
    bool live = !link->dead;
    if (live)
        link->busy++;
    pthread_mutex_unlock(&dd->lock);
    return live;
}

void
llmdd__link_leave(llmdd__link *link)
{
    llmdd *dd = link->dd;

    pthread_mutex_lock(&dd->lock);
    if (--link->busy == 0 && link->dead)
        pthread_cond_broadcast(&dd->cond); /* llmdd__link_quiesce */
    pthread_mutex_unlock(&dd->lock);
}

bool
llmdd__link_quiesce(llmdd__link *link, bool serving, int64_t deadline_ms)
{
    llmdd *dd = link->dd;

    pthread_mutex_lock(&dd->lock);
    while (link->busy > 0 && llmdd__now_ms() < deadline_ms)
        llmdd__cond_wait_until(&dd->cond, &dd->lock, deadline_ms);
    bool quiet = link->busy == 0;
    pthread_mutex_unlock(&dd->lock);
    if (quiet && serving && link->ops->quiesce != NULL)
        quiet = link->ops->quiesce(link, deadline_ms);
    return quiet;
}

size_t
llmdd__links_served(const llmdd *dd)
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
        if (l->cluster_id == cluster && !l->unlink)
            return true;
    return false;
}

/*
 * dd->lock held. Whether the server side may take a link from `cluster`:
 * LLM_ALREADY_LINK when one exists; LLM_PROCESSING_LINK when we are linking
 * to it at the same time and our call wins (the lower cluster id's outgoing
 * link is the one both sides keep: the peer's call then adopts it, see
 * linking.c); LLM_CLUSTER_NUM_EXCEED_LIMIT when we serve llm.MaxLinks links
 * already.
 */
static llmdd_status
link_admit(const llmdd *dd, uint64_t cluster)
{
    for (const llmdd__link *l = dd->links; l != NULL; l = l->next)
        if (l->peer.cluster_id == cluster)
            return LLM_ALREADY_LINK;
    if (dd->cluster_id < cluster && linking_to(dd, cluster))
        return LLM_PROCESSING_LINK;
    if (llmdd__links_served(dd) >= dd->opts.max_links)
        return LLM_CLUSTER_NUM_EXCEED_LIMIT;
    return LLM_SUCCESS;
}

llmdd_status
llmdd__link_publish(llmdd *dd, llmdd__link *link)
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
        link->published_ms = llmdd__now_ms();
        link->claimed = link->client;
        link->next = dd->links;
        dd->links = link;
        pthread_cond_broadcast(&dd->cond); /* a crossed link call waits */
    }
    pthread_mutex_unlock(&dd->lock);
    if (st == LLM_SUCCESS) {
        llmdd__metrics_link_event(dd, true);
        dd->plane->wake(dd);
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
    uint32_t batch_dim = 0;
    st = link->ops->query(link, id, deadline_ms, &rc->desc, &batch_dim,
                          &rc->priv);
    if (st != LLM_SUCCESS) {
        free(rc);
        return st;
    }
    /* The peer's desc is untrusted: it must describe a sane cache. This is
     * the one check of it, for every transport. */
    if (llmdd__desc_check(&rc->desc, &rc->tensor_size, &rc->stride) !=
            LLM_SUCCESS ||
        llmdd__slot_geom_make(&rc->desc, batch_dim, &rc->slot) != LLM_SUCCESS) {
        log_error("cluster %llu sent a bad description of cache %lld",
                  (unsigned long long)link->peer.cluster_id, (long long)id);
        if (link->ops->remote_free != NULL)
            link->ops->remote_free(rc);
        free(rc);
        return LLM_KV_CACHE_NOT_EXIST;
    }
    rc->stride = llmdd__slot_bytes(&rc->slot);
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

/* ---- Data connections to the peer's listener. ---- */

int
llmdd__data_connect(llmdd__link *link, uint32_t flags, int64_t deadline)
{
    llmdd *dd = link->dd;
    llmdd__hello h = {.kind = CONN_DATA, .flags = flags};
    uint8_t buf[64];
    llmdd_status st;
    uint16_t type;
    uint32_t status;
    size_t len;
    bool to;
    int fd;

    /* The peer's listener answered the link's control connection: its
     * refusing this one now is final. */
    fd = llmdd__connect(dd->stop_fd, &link->peer.addr, &link->bind_addr,
                        deadline, LLMDD_LOG_ERROR, &st);
    if (fd < 0)
        return -1;
    llmdd__sock_tune(fd, llmdd__user_timeout(dd));
    memcpy(h.token, link->token, sizeof(h.token));
    len = llmdd__wire_hello_encode(&h, buf, sizeof(buf));
    to = false;
    if (llmdd__send_msg(dd->stop_fd, fd, WMSG_HELLO, buf, len, deadline) != 0 ||
        llmdd__recv_msg(dd->stop_fd, fd, &type, buf, sizeof(buf), &len,
                        deadline, &to) != 0 ||
        type != WMSG_DATA_REPLY ||
        llmdd__wire_u32_decode(buf, len, &status) != 0 ||
        status != LLM_SUCCESS) {
        /* Not answered by the link call's deadline: that call's
         * LLM_TIMEOUT, which callers retry. */
        if (!llmdd__cancelled())
            LLMDD_LOG(to && deadline == link->deadline_ms ? LLMDD_LOG_INFO
                                                          : LLMDD_LOG_ERROR,
                      "data connection to cluster %llu %s",
                      (unsigned long long)link->peer.cluster_id,
                      to ? "not answered in time" : "refused");
        close(fd);
        return -1;
    }
    return fd;
}

/* ---- The control connection, outgoing. ---- */

/* out_lock held. Sends queued bytes without blocking: 0, or -1 broken. */
static int
out_push(llmdd__link *link)
{
    while (link->out_len > 0) {
        ssize_t n = send(link->ctrl_fd, link->out, link->out_len,
                         MSG_DONTWAIT | MSG_NOSIGNAL);
        if (n > 0) {
            memmove(link->out, link->out + n, link->out_len - (size_t)n);
            link->out_len -= (size_t)n;
            continue;
        }
        if (n < 0 && errno == EINTR)
            continue;
        if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK))
            return 0;
        return -1;
    }
    return 0;
}

int
llmdd__link_send(llmdd__link *link, uint16_t type, const void *payload,
                 size_t len)
{
    uint8_t hdr[LLMDD_WIRE_HDR_LEN];
    size_t frame = sizeof(hdr) + len;
    const char *why = NULL;
    bool was_empty;

    llmdd__wire_frame_encode(hdr, type, (uint32_t)len);
    pthread_mutex_lock(&link->out_lock);
    if (link->out_closed) {
        pthread_mutex_unlock(&link->out_lock);
        return -1;
    }
    was_empty = link->out_len == 0;
    if (link->out_len + frame > LLMDD_CTRL_OUT_MAX) {
        why = "peer does not read its control connection";
    } else if (link->out_len + frame > link->out_cap) {
        size_t cap = link->out_cap ? link->out_cap : 4096;
        while (cap < link->out_len + frame)
            cap *= 2;
        uint8_t *n = realloc(link->out, cap);
        if (n == NULL) {
            why = "out of memory for a control message";
        } else {
            link->out = n;
            link->out_cap = cap;
        }
    }
    if (why == NULL) {
        memcpy(link->out + link->out_len, hdr, sizeof(hdr));
        if (len > 0)
            memcpy(link->out + link->out_len + sizeof(hdr), payload, len);
        link->out_len += frame;
        link->last_tx_ms = llmdd__now_ms();
        if (was_empty && out_push(link) != 0)
            why = "control connection broken";
    }
    bool pending = link->out_len > 0;
    pthread_mutex_unlock(&link->out_lock);
    if (why != NULL) {
        llmdd__link_drop(link, why);
        return -1;
    }
    /* Queued: it goes out unless the link dies, which may happen at any
     * moment now (the peer may even have read it and closed). */
    if (was_empty && pending) /* the control thread watches for room */
        link->dd->plane->wake(link->dd);
    return 0;
}

bool
llmdd__link_flush(llmdd__link *link)
{
    pthread_mutex_lock(&link->out_lock);
    int rc = out_push(link);
    bool pending = link->out_len > 0;
    pthread_mutex_unlock(&link->out_lock);
    if (rc != 0)
        llmdd__link_drop(link, "control connection broken");
    return rc == 0 && pending;
}

int
llmdd__link_flush_until(llmdd__link *link, int64_t deadline_ms)
{
    for (;;) {
        pthread_mutex_lock(&link->out_lock);
        int rc = out_push(link);
        bool pending = link->out_len > 0;
        pthread_mutex_unlock(&link->out_lock);
        if (rc != 0)
            return -1;
        if (!pending)
            return 0;
        if (llmdd__wait_fd(link->dd->stop_fd, link->ctrl_fd, POLLOUT,
                           deadline_ms) != 1)
            return -1;
    }
}

int64_t
llmdd__link_last_tx(llmdd__link *link)
{
    pthread_mutex_lock(&link->out_lock);
    int64_t t = link->last_tx_ms;
    pthread_mutex_unlock(&link->out_lock);
    return t;
}

/* ---- Replies awaited on the control connection. ---- */

uint64_t
llmdd__link_await_begin(llmdd__link *link, llmdd__link_wait *w)
{
    llmdd *dd = link->dd;

    w->done = false;
    pthread_mutex_lock(&dd->lock);
    w->seq = ++link->wait_seq;
    w->next = link->waits;
    link->waits = w;
    pthread_mutex_unlock(&dd->lock);
    return w->seq;
}

llmdd_status
llmdd__link_await(llmdd__link *link, llmdd__link_wait *w, int64_t deadline_ms)
{
    llmdd *dd = link->dd;
    llmdd_status st;

    pthread_mutex_lock(&dd->lock);
    while (!w->done && !link->dead && llmdd__now_ms() < deadline_ms)
        llmdd__cond_wait_until(&dd->cond, &dd->lock, deadline_ms);
    for (llmdd__link_wait **p = &link->waits; *p != NULL; p = &(*p)->next) {
        if (*p == w) {
            *p = w->next;
            break;
        }
    }
    st = w->done ? LLM_SUCCESS : link->dead ? LLM_NOT_YET_LINK : LLM_TIMEOUT;
    pthread_mutex_unlock(&dd->lock);
    return st;
}

bool
llmdd__link_answer(llmdd__link *link, uint16_t type, uint64_t seq,
                   const uint8_t *buf, size_t len)
{
    llmdd *dd = link->dd;

    pthread_mutex_lock(&dd->lock);
    /* Every request takes one sequence number, and gets at most one
     * reply: more replies than requests, or one to a number never given,
     * answer nothing. */
    bool asked =
        seq >= 1 && seq <= link->wait_seq && ++link->replies <= link->wait_seq;
    for (llmdd__link_wait *w = link->waits; w != NULL; w = w->next) {
        if (w->type == type && w->seq == seq && !w->done) {
            w->len = len < sizeof(w->reply) ? len : sizeof(w->reply);
            memcpy(w->reply, buf, w->len);
            w->done = true;
            pthread_cond_broadcast(&dd->cond);
            break;
        }
    }
    pthread_mutex_unlock(&dd->lock);
    return asked;
}

/* ---- Messages of the core on a link's control connection. ---- */

void
llmdd__link_ask_reopen(llmdd__link *link)
{
    (void)llmdd__link_send(link, WMSG_REOPEN, NULL, 0);
}
