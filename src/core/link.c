/*
 * The link table and, per link, the registry of the peer's caches: core
 * state that the control plane (src/ctrl) fills and the transfer path reads.
 * Links and remote caches are reference-counted; the table is guarded by
 * dd->lock, a link's remote caches by its rc_lock. Also what the core and
 * the transports send to the peer outside a transfer: a data connection's
 * HELLO, a notification and REOPEN on the control connection (whose writes
 * the link's wlock serializes; only the control thread reads it).
 */
#include <openssl/crypto.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "core/internal.h"
#include "base/wire.h"

/* How long asking the client to reopen may wait for its socket. */
#define REOPEN_ASK_MS 2000

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
    pthread_mutex_init(&link->rc_lock, NULL);
    pthread_mutex_init(&link->wlock, NULL);
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
        llmdd__link_free(link);
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
    dd->plane->wake(dd);
    llmdd__link_put(link); /* the table's reference */
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

void
llmdd__links_resume(llmdd *dd)
{
    pthread_mutex_lock(&dd->lock);
    for (llmdd__link *l = dd->links; l != NULL; l = l->next)
        l->rx_paused = false;
    pthread_mutex_unlock(&dd->lock);
    dd->plane->wake(dd);
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
    st = link->ops->query(link, id, deadline_ms, &rc->desc, &rc->priv);
    if (st != LLM_SUCCESS) {
        free(rc);
        return st;
    }
    /* The peer's desc is untrusted: it must describe a sane cache. This is
     * the one check of it, for every transport. */
    if (llmdd__desc_check(&rc->desc, &rc->tensor_size, &rc->stride) !=
        LLM_SUCCESS) {
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

    fd = llmdd__connect(dd->stop_fd, &link->peer.addr, &link->bind_addr,
                       deadline, &st);
    if (fd < 0)
        return -1;
    llmdd__sock_tune(fd);
    memcpy(h.token, link->token, sizeof(h.token));
    len = llmdd__wire_hello_encode(&h, buf, sizeof(buf));
    if (llmdd__send_msg(dd->stop_fd, fd, WMSG_HELLO, buf, len, deadline) != 0 ||
        llmdd__recv_msg(dd->stop_fd, fd, &type, buf, sizeof(buf), &len,
                        deadline, &to) != 0 ||
        type != WMSG_DATA_REPLY ||
        llmdd__wire_u32_decode(buf, len, &status) != 0 ||
        status != LLM_SUCCESS) {
        log_error("data connection to cluster %llu refused",
                  (unsigned long long)link->peer.cluster_id);
        close(fd);
        return -1;
    }
    return fd;
}

/* ---- Messages of the core on a link's control connection. ---- */

void
llmdd__link_ask_reopen(llmdd__link *link)
{
    pthread_mutex_lock(&link->wlock);
    llmdd__send_msg(link->dd->stop_fd, link->ctrl_fd, WMSG_REOPEN, NULL, 0,
                    llmdd__now_ms() + REOPEN_ASK_MS);
    pthread_mutex_unlock(&link->wlock);
}

llmdd_status
llmdd__notify_send(llmdd__link *link, const void *msg, size_t len,
                   int64_t deadline_ms)
{
    pthread_mutex_lock(&link->wlock);
    int rc = llmdd__send_msg(link->dd->stop_fd, link->ctrl_fd, WMSG_NOTIFY, msg,
                             len, deadline_ms);
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
