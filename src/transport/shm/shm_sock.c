/*
 * The shm transport's socket protocol: messages on the Unix-domain socket
 * (QUERY and its reply with a memfd or addresses, INVAL and its ack), the
 * owner's answers and leases, and the reader thread that dispatches them.
 * shm.c describes the design.
 */
#include "transport/shm/shm_int.h"

/* ---- Messages on the socket. ---- */

int
llmdd__shm_send(shm_link *sl, uint16_t type, uint64_t seq,
                const uint8_t *payload, size_t len, int pass_fd,
                int64_t deadline)
{
    uint8_t hdr[SHM_HDR_LEN];
    llmdd__wbuf w = LLMDD__WBUF(hdr, sizeof(hdr));
    union {
        char buf[CMSG_SPACE(sizeof(int))];
        struct cmsghdr align;
    } cm;
    struct iovec iov[2] = {{hdr, sizeof(hdr)}, {(void *)payload, len}};
    struct msghdr mh = {.msg_iov = iov, .msg_iovlen = len > 0 ? 2 : 1};

    llmdd__put_u32(&w, SHM_MAGIC);
    llmdd__put_u16(&w, SHM_VERSION);
    llmdd__put_u16(&w, type);
    llmdd__put_u64(&w, seq);
    if (pass_fd >= 0) {
        memset(&cm, 0, sizeof(cm));
        mh.msg_control = cm.buf;
        mh.msg_controllen = sizeof(cm.buf);
        struct cmsghdr *c = CMSG_FIRSTHDR(&mh);
        c->cmsg_level = SOL_SOCKET;
        c->cmsg_type = SCM_RIGHTS;
        c->cmsg_len = CMSG_LEN(sizeof(int));
        memcpy(CMSG_DATA(c), &pass_fd, sizeof(int));
    }
    for (;;) {
        /* A SEQPACKET message goes whole or not at all. */
        if (sendmsg(sl->sock, &mh, MSG_DONTWAIT | MSG_NOSIGNAL) >= 0)
            return 0;
        if (errno == EINTR)
            continue;
        if (errno != EAGAIN && errno != EWOULDBLOCK)
            return -1;
        if (llmdd__shm_poll(sl, sl->sock, POLLOUT, deadline, true) != 1)
            return -1;
    }
}

/*
 * Receives one message without blocking. 1: a message (its fd, if any, is
 * the caller's); 0: EOF; -1: nothing yet; -2: error or malformed. Passed
 * descriptors beyond the first are closed.
 */
int
llmdd__shm_recv(shm_link *sl, shm_msg *m)
{
    uint8_t *buf = sl->rbuf;
    union {
        char buf[CMSG_SPACE(4 * sizeof(int))];
        struct cmsghdr align;
    } cm;
    struct iovec iov = {buf, SHM_MSG_MAX};
    struct msghdr mh = {.msg_iov = &iov,
                        .msg_iovlen = 1,
                        .msg_control = cm.buf,
                        .msg_controllen = sizeof(cm.buf)};
    ssize_t k = recvmsg(sl->sock, &mh, MSG_DONTWAIT | MSG_CMSG_CLOEXEC);

    m->fd = -1;
    if (k < 0)
        return errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR ? -1
                                                                         : -2;
    for (struct cmsghdr *c = CMSG_FIRSTHDR(&mh); c != NULL;
         c = CMSG_NXTHDR(&mh, c)) {
        if (c->cmsg_level != SOL_SOCKET || c->cmsg_type != SCM_RIGHTS)
            continue;
        size_t n = (c->cmsg_len - CMSG_LEN(0)) / sizeof(int);
        for (size_t i = 0; i < n; i++) {
            int fd;
            memcpy(&fd, CMSG_DATA(c) + i * sizeof(int), sizeof(int));
            if (m->fd < 0)
                m->fd = fd;
            else
                close(fd);
        }
    }
    if (k == 0 && m->fd < 0)
        return 0;
    llmdd__rbuf h = LLMDD__RBUF(buf, (size_t)k);
    uint32_t magic = llmdd__get_u32(&h);
    uint16_t version = llmdd__get_u16(&h);
    m->type = llmdd__get_u16(&h);
    m->seq = llmdd__get_u64(&h);
    if (h.err || (mh.msg_flags & (MSG_TRUNC | MSG_CTRUNC)) ||
        magic != SHM_MAGIC || version != SHM_VERSION) {
        if (m->fd >= 0)
            close(m->fd);
        m->fd = -1;
        errno = EBADMSG;
        return -2;
    }
    m->body = LLMDD__RBUF(buf + SHM_HDR_LEN, (size_t)k - SHM_HDR_LEN);
    return 1;
}

/* Hands a reply to the request waiting for it; lock held. */
static void
shm_deliver(shm_link *sl, uint64_t seq, uint32_t status,
            const llmdd_cache_desc *desc, uint32_t batch_dim, shm_entry *e)
{
    for (shm_wait *w = sl->waits; w != NULL; w = w->next) {
        if (w->seq != seq || w->done)
            continue;
        w->done = true;
        w->status = status;
        if (desc != NULL)
            w->desc = *desc;
        w->batch_dim = batch_dim;
        if (e != NULL) {
            atomic_fetch_add(&e->refs, 1);
            w->e = e;
        }
        pthread_cond_broadcast(&sl->cond);
        return;
    }
}

/*
 * Sends a request and waits for its reply (delivered by the reader into w).
 * 0: replied; 1: the link has no socket (use the data plane); -1: down,
 * unsent or no reply by the deadline.
 */
int
llmdd__shm_call(shm_link *sl, uint16_t type, int64_t id, int64_t deadline,
                shm_wait *w)
{
    uint8_t payload[8];
    llmdd__wbuf pw = LLMDD__WBUF(payload, sizeof(payload));
    int rc = -1;

    memset(w, 0, sizeof(*w));
    llmdd__put_i64(&pw, id);
    pthread_mutex_lock(&sl->lock);
    while (!sl->ready && !sl->nosock && !sl->down &&
           llmdd__now_ms() < deadline)
        llmdd__shm_cond_wait(sl, deadline);
    if (sl->nosock && !sl->ready) {
        pthread_mutex_unlock(&sl->lock);
        return 1;
    }
    if (!sl->ready || sl->down) {
        pthread_mutex_unlock(&sl->lock);
        return -1;
    }
    w->seq = ++sl->seq;
    w->next = sl->waits;
    sl->waits = w;
    pthread_mutex_unlock(&sl->lock);

    bool sent =
        llmdd__shm_send(sl, type, w->seq, payload, pw.len, -1, deadline) == 0;
    pthread_mutex_lock(&sl->lock);
    while (sent && !w->done && !sl->down && llmdd__now_ms() < deadline)
        llmdd__shm_cond_wait(sl, deadline);
    for (shm_wait **p = &sl->waits; *p != NULL; p = &(*p)->next) {
        if (*p == w) {
            *p = w->next;
            break;
        }
    }
    if (w->done)
        rc = 0;
    pthread_mutex_unlock(&sl->lock);
    return rc;
}

/* ---- The owner's side: answering QUERY, sending INVAL. ---- */

/*
 * expose_lock held. Keeps c's reference as the lease: 1. The cache has one
 * already: 0 (the caller drops its reference). Out of memory: -1.
 */
static int
lease_add(shm_link *sl, llmdd__cache *c)
{
    for (size_t i = 0; i < sl->nleases; i++)
        if (sl->leases[i].id == c->id)
            return 0;
    if (sl->nleases == sl->leases_cap) {
        size_t cap = sl->leases_cap ? sl->leases_cap * 2 : 16;
        shm_lease *n = realloc(sl->leases, cap * sizeof(*n));
        if (n == NULL)
            return -1;
        sl->leases = n;
        sl->leases_cap = cap;
    }
    sl->leases[sl->nleases++] = (shm_lease){.id = c->id, .c = c};
    return 1;
}

/* expose_lock held. Removes the lease of `id`; its cache, or NULL. */
static llmdd__cache *
lease_take(shm_link *sl, int64_t id)
{
    for (size_t i = 0; i < sl->nleases; i++) {
        if (sl->leases[i].id == id) {
            llmdd__cache *c = sl->leases[i].c;
            sl->leases[i] = sl->leases[--sl->nleases];
            return c;
        }
    }
    return NULL;
}

/*
 * Ends every lease. Unconfirmed: the peer never said it stopped touching
 * our memory (it may be stalled mid-copy), so its pooled caches' pages
 * must not go to another cache while its process lives.
 */
static void
leases_release(shm_link *sl, bool confirmed)
{
    pthread_mutex_lock(&sl->expose_lock);
    shm_lease *l = sl->leases;
    size_t n = sl->nleases;
    sl->leases = NULL;
    sl->nleases = sl->leases_cap = 0;
    pthread_mutex_unlock(&sl->expose_lock);
    if (!confirmed && n > 0)
        log_warn("shm: cluster %llu (pid %u) did not confirm it let go of "
                 "%zu caches; their pool pages wait for its exit",
                 (unsigned long long)sl->link->peer.cluster_id,
                 sl->link->peer.pid, n);
    for (size_t i = 0; i < n; i++) {
        if (confirmed)
            llmdd__cache_put(sl->link->dd, l[i].c);
        else
            llmdd__cache_put_stale(sl->link->dd, l[i].c, sl->peer_pidfd);
    }
    free(l);
}

static int
shm_serve_query(shm_link *sl, const shm_msg *m, uint8_t *out)
{
    llmdd *dd = sl->link->dd;
    llmdd__rbuf r = m->body;
    llmdd__wbuf w = LLMDD__WBUF(out, SHM_MSG_MAX);
    int64_t id = llmdd__get_i64(&r);
    int pass_fd = -1;

    if (r.err || r.pos != r.len)
        return -1;
    /* Held from the lookup to the send: an INVAL for this cache cannot
     * overtake the reply. */
    pthread_mutex_lock(&sl->expose_lock);
    llmdd__cache *c = llmdd__cache_get(dd, id);
    /* The peer may reach a cache only while we hold a lease on it. */
    int leased = c != NULL ? lease_add(sl, c) : -1;
    llmdd__put_i64(&w, id);
    if (leased < 0) {
        llmdd__put_u32(&w, LLM_KV_CACHE_NOT_EXIST);
    } else {
        llmdd__put_u32(&w, LLM_SUCCESS);
        llmdd__put_desc(&w, &c->desc, c->slot.batch_dim);
        if (c->allocated) {
            llmdd__put_u32(&w, SHM_KIND_MEMFD);
            llmdd__put_u8(&w, c->mem.pooled);
            llmdd__put_u64(&w, c->mem.fd_off);
            llmdd__put_u64(&w, c->mem.len);
            llmdd__put_u64(&w, c->mem.pitch);
            pass_fd = c->mem.fd;
        } else if (c->desc.num_tensors <= SHM_CMA_TENSORS_MAX) {
            llmdd__put_u32(&w, SHM_KIND_CMA);
            llmdd__put_u32(&w, c->desc.num_tensors);
            for (uint32_t t = 0; t < c->desc.num_tensors; t++)
                llmdd__put_u64(&w, c->addrs[t]);
        } else {
            llmdd__put_u32(&w, SHM_KIND_STREAM);
        }
    }
    int rc = w.err ? -1
                   : llmdd__shm_send(sl, SMSG_QUERY_REPLY, m->seq, out, w.len,
                                     pass_fd, llmdd__now_ms() + SHM_STALL_MS);
    pthread_mutex_unlock(&sl->expose_lock);
    if (leased != 1) /* else our reference is the lease now */
        llmdd__cache_put(dd, c);
    return rc;
}

void
llmdd__shm_cache_removed(llmdd__link *link, const llmdd__cache *cache)
{
    shm_link *sl = link->tp;
    uint8_t payload[8];
    llmdd__wbuf pw = LLMDD__WBUF(payload, sizeof(payload));
    shm_wait w;
    bool leased = false;

    if (sl == NULL)
        return;
    /* Requests on the fallback data plane hold the cache too. */
    llmdd__stream_cache_removed(sl->stream, cache);
    memset(&w, 0, sizeof(w));
    llmdd__put_i64(&pw, cache->id);
    int64_t deadline = llmdd__now_ms() + link->opts.wait_ms;
    pthread_mutex_lock(&sl->expose_lock);
    for (size_t i = 0; i < sl->nleases && !leased; i++)
        leased = sl->leases[i].id == cache->id;
    pthread_mutex_lock(&sl->lock);
    bool live = leased && sl->ready && !sl->down;
    if (live) {
        w.seq = ++sl->seq;
        w.next = sl->waits;
        sl->waits = &w;
    }
    pthread_mutex_unlock(&sl->lock);
    /* Not live: the teardown releases the lease once the peer let go. */
    bool sent = live && llmdd__shm_send(sl, SMSG_INVAL, w.seq, payload, pw.len,
                                        -1, deadline) == 0;
    pthread_mutex_unlock(&sl->expose_lock);
    if (!live)
        return;

    pthread_mutex_lock(&sl->lock);
    while (sent && !w.done && !sl->down && llmdd__now_ms() < deadline)
        llmdd__shm_cond_wait(sl, deadline);
    for (shm_wait **p = &sl->waits; *p != NULL; p = &(*p)->next) {
        if (*p == &w) {
            *p = w.next;
            break;
        }
    }
    bool acked = w.done, down = sl->down;
    pthread_mutex_unlock(&sl->lock);
    if (acked) {
        pthread_mutex_lock(&sl->expose_lock);
        llmdd__cache *c = lease_take(sl, cache->id);
        pthread_mutex_unlock(&sl->expose_lock);
        llmdd__cache_put(link->dd, c);
    } else if (!down) {
        log_error("shm: cluster %llu did not release cache %lld in time; "
                  "dropping the link",
                  (unsigned long long)link->peer.cluster_id,
                  (long long)cache->id);
        llmdd__link_drop(link, "shm: cache release not acknowledged");
    }
}

/* Builds the entry a QUERY_REPLY describes and hands it to its waiter. */
static int
shm_on_query_reply(shm_link *sl, shm_msg *m)
{
    llmdd__rbuf r = m->body;
    int64_t id = llmdd__get_i64(&r);
    uint32_t status = llmdd__get_u32(&r);
    llmdd_cache_desc desc;
    uint64_t tsize, stride;
    uint32_t bd;
    shm_entry *e = NULL, *have;
    int fd = m->fd;

    m->fd = -1;
    if (r.err)
        goto err_proto;
    if (status != LLM_SUCCESS) {
        if (r.pos != r.len)
            goto err_proto;
        goto not_exist;
    }
    llmdd__get_desc(&r, &desc, &bd);
    if (r.err || llmdd__desc_check(&desc, &tsize, &stride) != LLM_SUCCESS)
        goto err_proto;
    uint32_t kind = llmdd__get_u32(&r);

    pthread_mutex_lock(&sl->lock);
    have = llmdd__shm_entry_find(sl, id);
    if (have != NULL && !have->dead) {
        /* Asked twice (two threads, or after a timeout): one mapping. */
        shm_deliver(sl, m->seq, LLM_SUCCESS, &desc, bd, have);
        pthread_mutex_unlock(&sl->lock);
        if (fd >= 0)
            close(fd);
        return 0;
    }
    pthread_mutex_unlock(&sl->lock);
    if (have != NULL)
        goto not_exist;
    e = calloc(1, sizeof(*e));
    if (e == NULL)
        goto not_exist;
    atomic_init(&e->refs, 1);
    e->id = id;
    e->kind = (int)kind;
    e->ntensors = desc.num_tensors;
    e->tensor_size = tsize;
    if (kind == SHM_KIND_MEMFD) {
        bool pooled = llmdd__get_u8(&r) != 0;
        uint64_t fd_off = llmdd__get_u64(&r), len = llmdd__get_u64(&r);
        e->pitch = llmdd__get_u64(&r);
        if (r.err || r.pos != r.len)
            goto err_proto;
        int mrc = llmdd__shm_map(sl, e, fd, pooled, fd_off, len);
        fd = -1; /* llmdd__shm_map owns it */
        if (mrc != 0)
            goto not_exist;
    } else if (kind == SHM_KIND_CMA) {
        uint32_t n = llmdd__get_u32(&r);
        if (r.err || n != desc.num_tensors || n > SHM_CMA_TENSORS_MAX)
            goto err_proto;
        e->addrs = malloc(n * sizeof(*e->addrs));
        if (e->addrs == NULL)
            goto not_exist;
        for (uint32_t t = 0; t < n; t++)
            e->addrs[t] = llmdd__get_u64(&r);
        if (r.err || r.pos != r.len)
            goto err_proto;
    } else if (kind != SHM_KIND_STREAM || r.pos != r.len) {
        goto err_proto;
    }
    if (fd >= 0)
        close(fd);
    pthread_mutex_lock(&sl->lock);
    e->next = sl->entries;
    sl->entries = e;
    shm_deliver(sl, m->seq, LLM_SUCCESS, &desc, bd, e);
    pthread_mutex_unlock(&sl->lock);
    return 0;
not_exist:
    if (fd >= 0)
        close(fd);
    llmdd__shm_entry_put(e);
    pthread_mutex_lock(&sl->lock);
    shm_deliver(sl, m->seq, LLM_KV_CACHE_NOT_EXIST, NULL, 0, NULL);
    pthread_mutex_unlock(&sl->lock);
    return 0;
err_proto:
    if (fd >= 0)
        close(fd);
    llmdd__shm_entry_put(e);
    return -1;
}

/* The peer's cache is gone: stop using it, then acknowledge. */
static int
shm_on_inval(shm_link *sl, const shm_msg *m)
{
    llmdd__rbuf r = m->body;
    int64_t id = llmdd__get_i64(&r);

    if (r.err || r.pos != r.len)
        return -1;
    pthread_mutex_lock(&sl->lock);
    shm_entry *e = llmdd__shm_entry_find(sl, id);
    if (e != NULL) {
        e->dead = true;
        while (e->users > 0)
            pthread_cond_wait(&sl->cond, &sl->lock);
        for (shm_entry **p = &sl->entries; *p != NULL; p = &(*p)->next) {
            if (*p == e) {
                *p = e->next;
                break;
            }
        }
    }
    pthread_mutex_unlock(&sl->lock);
    if (e != NULL) {
        /* Nobody copies through it any more; a pooled entry has no
         * mapping of its own and is now simply unreachable. */
        if (e->map != NULL)
            munmap(e->map, e->map_len);
        e->map = NULL;
        llmdd__shm_entry_put(e);
    }
    return llmdd__shm_send(sl, SMSG_INVAL_ACK, m->seq, NULL, 0, -1,
                           llmdd__now_ms() + SHM_STALL_MS);
}

static int
shm_dispatch(shm_link *sl, shm_msg *m, uint8_t *out)
{
    switch (m->type) {
    case SMSG_QUERY:
        return shm_serve_query(sl, m, out);
    case SMSG_QUERY_REPLY:
        return shm_on_query_reply(sl, m);
    case SMSG_INVAL:
        return shm_on_inval(sl, m);
    case SMSG_INVAL_ACK:
        if (m->body.len != 0)
            return -1;
        pthread_mutex_lock(&sl->lock);
        shm_deliver(sl, m->seq, LLM_SUCCESS, NULL, 0, NULL);
        pthread_mutex_unlock(&sl->lock);
        return 0;
    default:
        return -1;
    }
}

/*
 * The end of a link's socket: stop touching the peer's memory, say so with
 * a half-close, wait for the peer to say the same, release our leases.
 */
static void
shm_teardown(shm_link *sl, bool peer_closed)
{
    shm_entry *list;

    pthread_mutex_lock(&sl->lock);
    sl->down = true;
    pthread_cond_broadcast(&sl->cond);
    for (shm_entry *e = sl->entries; e != NULL; e = e->next)
        e->dead = true;
    for (;;) {
        bool busy = false;
        for (shm_entry *e = sl->entries; e != NULL && !busy; e = e->next)
            busy = e->users > 0;
        if (!busy)
            break;
        pthread_cond_wait(&sl->cond, &sl->lock);
    }
    list = sl->entries;
    sl->entries = NULL;
    uint8_t *pool = sl->pool;
    size_t pool_len = sl->pool_len;
    sl->pool = NULL;
    pthread_mutex_unlock(&sl->lock);
    while (list != NULL) {
        shm_entry *e = list;
        list = e->next;
        if (e->map != NULL)
            munmap(e->map, e->map_len);
        e->map = NULL;
        llmdd__shm_entry_put(e);
    }
    if (pool != NULL)
        munmap(pool, pool_len);

    shutdown(sl->sock, SHUT_WR);
    /* The peer's EOF (its own half-close, or its exit) is its word that it
     * no longer touches our memory; a reset is a close too. */
    bool confirmed = peer_closed;
    int64_t deadline = llmdd__now_ms() + SHM_BYE_MS;
    while (!peer_closed) {
        shm_msg m;
        int k = llmdd__shm_recv(sl, &m);
        if (k == 1 && m.fd >= 0)
            close(m.fd);
        if (k == 0 || k == -2) {
            confirmed = k == 0 || errno == ECONNRESET;
            break;
        }
        if (k == -1 &&
            llmdd__shm_poll(sl, sl->sock, POLLIN, deadline, false) != 1) {
            log_warn("shm: cluster %llu did not close its socket in time",
                     (unsigned long long)sl->link->peer.cluster_id);
            break;
        }
    }
    leases_release(sl, confirmed);
}

/* Serves the socket until the link goes down; runs in a counted thread. */
void
llmdd__shm_reader(shm_link *sl)
{
    llmdd__link *link = sl->link;
    const char *why;
    bool peer_closed = false;

    for (;;) {
        shm_msg m;
        int k = llmdd__shm_recv(sl, &m);
        if (k == -1) {
            if (llmdd__shm_poll(sl, sl->sock, POLLIN, INT64_MAX, true) == 1)
                continue;
            why = "shm: the socket failed";
            break;
        }
        if (k == 0) {
            why = "shm: peer closed its socket";
            peer_closed = true;
            break;
        }
        int rc = k == 1 ? shm_dispatch(sl, &m, sl->obuf) : -1;
        if (k == 1 && m.fd >= 0)
            close(m.fd); /* a descriptor where none belongs */
        if (rc != 0) {
            why = "shm: the socket failed, or a bad message";
            pthread_mutex_lock(&sl->lock);
            bool down = sl->down; /* a reply that could not go out */
            pthread_mutex_unlock(&sl->lock);
            if (down)
                break;
            if (k == 1)
                log_error("shm: cluster %llu: bad message (type %u)",
                          (unsigned long long)link->peer.cluster_id, m.type);
            else
                log_error("shm: cluster %llu: socket: %s",
                          (unsigned long long)link->peer.cluster_id,
                          strerror(errno));
            break;
        }
    }
    /* A no-op when the link is already down (the usual way out). */
    llmdd__link_drop(link, why);
    shm_teardown(sl, peer_closed);
}

void *
llmdd__shm_reader_main(void *arg)
{
    shm_link *sl = arg;
    llmdd__link *link = sl->link;

    llmdd__shm_reader(sl);
    llmdd__link_put(link);
    return NULL;
}
