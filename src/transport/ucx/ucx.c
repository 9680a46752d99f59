/*
 * The ucx transport: one-sided reads and writes through UCX (ucp_get_nbx,
 * ucp_put_nbx), so that on an RDMA fabric a pull costs the serving side
 * nothing. docs/rdma.md covers setup, the exchange and the limits.
 *
 * Per link, UCP workers on one process-wide context: a serve worker that
 * only answers the peer (UCX 1.13 emulates RMA over tcp and shared memory
 * with active messages, which need progress on the serving side), and up to
 * UCX_EPS request slots, each a worker with one endpoint to the peer's serve
 * worker, owned by one transfer at a time. Keeping them apart means that
 * ending one of our endpoints (a timed-out transfer) never fails an endpoint
 * the peer or another transfer relies on: a forced close where UCX has peer
 * error handling, destroying the slot's worker where it has not (shared
 * memory). One progress thread per link drives every worker and sleeps on
 * their event fds; requesters post their operations and wait on a condition
 * variable that completions signal.
 *
 * The exchange runs over the link's data connections, opened by the client:
 * the first FWD connection starts with UCX_HELLO (serve-worker addresses) and
 * then carries the client's requests; the REV connection carries the
 * server's. A QUERY maps the cache with ucp_mem_map (lazily, per link and
 * cache) and answers with its packed remote keys. Before a cache's memory
 * goes away its owner sends REVOKE; the peer aborts transfers on that cache,
 * destroys its keys and acknowledges, or the owner drops the link.
 *
 * Locking: ucx_link.lock guards the link state and every call into its
 * workers (UCS_THREAD_MODE_SERIALIZED); UCX callbacks run with it held.
 * ucx_link.map_lock serializes memory mapping, which may be slow. Neither is
 * held across socket I/O.
 */
#include "transport/ucx/ucx_int.h"

/* ---- Remote keys, requester side. ---- */

/*
 * A packed key as UCX 1.13 lays it out: a 64-bit MD map, a memory type, then
 * one length-prefixed key per MD bit. ucp_ep_rkey_unpack trusts those
 * lengths, so they must stay inside the bytes the peer sent.
 */
static bool
ucx_rkey_sane(const uint8_t *k, uint32_t len)
{
    llmdd__rbuf r = LLMDD__RBUF(k, len);
    uint64_t map = llmdd__get_u64(&r);

    (void)llmdd__get_u8(&r); /* the memory type */
    for (; map != 0 && !r.err; map &= map - 1)
        (void)llmdd__get_span(&r, llmdd__get_u8(&r));
    return !r.err;
}

/* Destroys the keys of slot s (lock held; no operation uses them). */
void
llmdd__ucx_rc_drop_keys(ucx_rc *p, int s)
{
    if (p->rkeys[s] == NULL)
        return;
    for (uint32_t i = 0; i < p->nregions; i++)
        if (p->rkeys[s][i] != NULL)
            ucp_rkey_destroy(p->rkeys[s][i]);
    free(p->rkeys[s]);
    p->rkeys[s] = NULL;
}

static void
ucx_rc_free(ucx_rc *p)
{
    for (uint32_t i = 0; p->rkey_buf != NULL && i < p->nregions; i++)
        free(p->rkey_buf[i]);
    free(p->rkey_buf);
    free(p->rkey_len);
    free(p->taddr);
    free(p->treg);
    free(p);
}

/* Unpacks p's keys on slot s's endpoint (lock held). */
llmdd_status
llmdd__ucx_rc_keys(ucx_link *ul, ucx_rc *p, int s)
{
    ucp_rkey_h *keys;

    if (p->rkeys[s] != NULL && p->gen[s] == ul->eps[s].gen)
        return LLM_SUCCESS;
    llmdd__ucx_rc_drop_keys(p, s);
    keys = calloc(p->nregions, sizeof(*keys));
    if (keys == NULL)
        return LLM_OUT_OF_MEMORY;
    for (uint32_t i = 0; i < p->nregions; i++) {
        ucs_status_t st =
            ucp_ep_rkey_unpack(ul->eps[s].ep, p->rkey_buf[i], &keys[i]);
        if (st != UCS_OK) {
            log_error("ucx: cluster %llu: remote key of cache %lld: %s",
                      (unsigned long long)ucx_cluster(ul), (long long)p->id,
                      ucs_status_string(st));
            for (uint32_t j = 0; j < i; j++)
                ucp_rkey_destroy(keys[j]);
            free(keys);
            return LLM_FAILED;
        }
    }
    p->rkeys[s] = keys;
    p->gen[s] = ul->eps[s].gen;
    return LLM_SUCCESS;
}

/* ---- Memory mapping, owner side. ---- */

void
llmdd__ucx_reg_unmap(ucx_link *ul, ucx_reg *r)
{
    for (uint32_t i = 0; i < r->nregions; i++) {
        if (r->rkey != NULL && r->rkey[i] != NULL)
            ucp_rkey_buffer_release(r->rkey[i]);
        if (r->memh != NULL && r->memh[i] != NULL)
            ucp_mem_unmap(ul->ctx, r->memh[i]);
    }
    free(r->memh);
    free(r->rkey);
    free(r->rkey_len);
    free(r->base);
    free(r->len);
    free(r->treg);
    r->memh = NULL;
    r->rkey = NULL;
    r->rkey_len = NULL;
    r->base = r->len = NULL;
    r->treg = NULL;
    r->nregions = 0;
    r->mapped = false;
}

static int
ucx_addr_cmp(const void *a, const void *b, void *arg)
{
    const uint64_t *addrs = arg;
    uint64_t x = addrs[*(const uint32_t *)a], y = addrs[*(const uint32_t *)b];

    return x < y ? -1 : x > y;
}

/*
 * The regions to map: the whole allocation of an allocated cache; for
 * registered memory, the tensors merged where they touch or overlap, so a
 * cache carved out of one buffer needs one key.
 */
static int
ucx_reg_regions(ucx_reg *r, const llmdd__cache *c)
{
    uint32_t n = c->desc.num_tensors;

    r->treg = calloc(n, sizeof(*r->treg));
    r->base = calloc(n, sizeof(*r->base));
    r->len = calloc(n, sizeof(*r->len));
    if (r->treg == NULL || r->base == NULL || r->len == NULL)
        return -1;
    if (c->allocated) {
        r->base[0] = (uint64_t)(uintptr_t)c->mem.base;
        r->len[0] = c->mem.len;
        r->nregions = 1;
        return 0;
    }
    uint32_t *order = malloc(n * sizeof(*order));
    if (order == NULL)
        return -1;
    for (uint32_t i = 0; i < n; i++)
        order[i] = i;
    qsort_r(order, n, sizeof(*order), ucx_addr_cmp, c->addrs);
    uint32_t k = 0;
    for (uint32_t i = 0; i < n; i++) {
        uint64_t a = c->addrs[order[i]], end = a + c->tensor_size;
        if (k > 0 && a <= r->base[k - 1] + r->len[k - 1]) {
            uint64_t cur = r->base[k - 1] + r->len[k - 1];
            if (end > cur)
                r->len[k - 1] = end - r->base[k - 1];
        } else {
            r->base[k] = a;
            r->len[k] = c->tensor_size;
            k++;
        }
        r->treg[order[i]] = k - 1;
    }
    free(order);
    r->nregions = k;
    return 0;
}

/* Maps cache c for this link and packs its keys. map_lock held. */
llmdd_status
llmdd__ucx_reg_map(ucx_link *ul, ucx_reg *r, const llmdd__cache *c)
{
    if (ucx_reg_regions(r, c) != 0)
        goto err_nomem;
    r->memh = calloc(r->nregions, sizeof(*r->memh));
    r->rkey = calloc(r->nregions, sizeof(*r->rkey));
    r->rkey_len = calloc(r->nregions, sizeof(*r->rkey_len));
    if (r->memh == NULL || r->rkey == NULL || r->rkey_len == NULL)
        goto err_nomem;
    for (uint32_t i = 0; i < r->nregions; i++) {
        ucp_mem_map_params_t mp = {
            .field_mask = UCP_MEM_MAP_PARAM_FIELD_ADDRESS |
                          UCP_MEM_MAP_PARAM_FIELD_LENGTH,
            .address = (void *)(uintptr_t)r->base[i],
            .length = r->len[i],
        };
        ucs_status_t st = ucp_mem_map(ul->ctx, &mp, &r->memh[i]);
        if (st == UCS_OK)
            st = ucp_rkey_pack(ul->ctx, r->memh[i], &r->rkey[i],
                               &r->rkey_len[i]);
        if (st == UCS_OK &&
            (r->rkey_len[i] == 0 || r->rkey_len[i] > LLMDD_UCX_RKEY_MAX))
            st = UCS_ERR_EXCEEDS_LIMIT;
        if (st != UCS_OK) {
            log_error("ucx: cache %lld: mapping %llu bytes: %s",
                      (long long)c->id, (unsigned long long)r->len[i],
                      ucs_status_string(st));
            llmdd__ucx_reg_unmap(ul, r);
            return LLM_FAILED;
        }
    }
    r->mapped = true;
    return LLM_SUCCESS;
err_nomem:
    llmdd__ucx_reg_unmap(ul, r);
    return LLM_OUT_OF_MEMORY;
}

ucx_reg *
llmdd__ucx_reg_find(ucx_link *ul, int64_t id)
{
    for (ucx_reg *r = ul->regs; r != NULL; r = r->next)
        if (r->id == id)
            return r;
    return NULL;
}

void
llmdd__ucx_reg_unlink(ucx_link *ul, ucx_reg *r)
{
    for (ucx_reg **pp = &ul->regs; *pp != NULL; pp = &(*pp)->next) {
        if (*pp == r) {
            *pp = r->next;
            return;
        }
    }
}

/* ---- Ops. ---- */

static bool
ucx_reaches(const llmdd__link *link)
{
    const ucx_probe *probed = llmdd__ucx_probe();

    if (!probed->ok)
        return false;
    /* The server only checks that it can serve what the client chose. */
    if (!link->client)
        return true;
    /* Client side: named by either side, ucx reaches any peer; under auto
     * it is for other hosts with RDMA. */
    if (link->forced)
        return true;
    return probed->rdma && !llmdd__peer_same_kernel(&link->peer);
}

/* Once per process: what a forced ucx over UCX 1.13's tcp still risks. */
static pthread_once_t ucx_warn_once = PTHREAD_ONCE_INIT;

static void
ucx_warn_tcp(void)
{
    const ucx_probe *probed = llmdd__ucx_probe();
    unsigned maj, min, rel;

    ucp_get_version(&maj, &min, &rel);
    if (probed->tcp && !probed->rdma &&
        (maj << 8 | min) <= (1u << 8 | 13))
        log_warn("ucx: UCX %u.%u over tcp aborts a process whose peer dies "
                 "while their link is being made (docs/rdma.md); prefer "
                 "llm.Transport=auto or tcp here",
                 maj, min);
}

static ucx_link *
ucx_link_new(llmdd__link *link)
{
    ucx_link *ul = calloc(1, sizeof(*ul));

    if (ul == NULL)
        return NULL;
    ul->link = link;
    ul->req_fd = -1;
    ul->wake_fd = -1;
    ul->sefd = -1;
    for (int s = 0; s < UCX_EPS; s++) {
        ul->eps[s].ul = ul;
        ul->eps[s].efd = -1;
    }
    pthread_mutex_init(&ul->lock, NULL);
    pthread_mutex_init(&ul->map_lock, NULL);
    llmdd__cond_init(&ul->cond);
    llmdd__serve_init(&ul->serve, &ul->lock, &ul->cond, &ul->down,
                      UCX_SERVE_MAX);
    return ul;
}

static llmdd_status
ucx_workers_init(ucx_link *ul)
{
    ucp_worker_params_t wp = {.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE,
                              .thread_mode = UCS_THREAD_MODE_SERIALIZED};
    ucs_status_t st;

    ul->wake_fd = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
    if (ul->wake_fd < 0 || llmdd__random(&ul->key, sizeof(ul->key)) != 0)
        return LLM_FAILED;
    llmdd__ucx_probe();
    pthread_once(&ucx_warn_once, ucx_warn_tcp);
    if ((ul->ctx = llmdd__ucx_ctx_get()) == NULL)
        return LLM_LINK_FAILED;
    if ((st = ucp_worker_create(ul->ctx, &wp, &ul->sw)) != UCS_OK) {
        log_error("ucx: ucp_worker_create: %s", ucs_status_string(st));
        return LLM_LINK_FAILED;
    }
    static const unsigned ids[] = {LLMDD_UCX_AM_GET, LLMDD_UCX_AM_PUT,
                                   LLMDD_UCX_AM_PING};
    static const ucp_am_recv_callback_t cbs[] = {
        llmdd__ucx_am_get, llmdd__ucx_am_put, llmdd__ucx_am_ping};
    if ((st = llmdd__ucx_am_install(ul->sw, ids, cbs, 3, ul)) != UCS_OK) {
        log_error("ucx: active message handlers: %s", ucs_status_string(st));
        return LLM_LINK_FAILED;
    }
    ul->wakeup = ucp_worker_get_efd(ul->sw, &ul->sefd) == UCS_OK;
    if (!ul->wakeup) {
        log_warn("ucx: no wakeup support; progress polls every millisecond");
        ul->sefd = -1;
    }
    return LLM_SUCCESS;
}

static llmdd_status
ucx_link_init(llmdd__link *link, bool client)
{
    ucx_link *ul = ucx_link_new(link);
    llmdd *dd = link->dd;
    int64_t deadline = link->deadline_ms;
    uint8_t *out = NULL, *buf = NULL;
    llmdd_status st;
    uint16_t type;
    size_t n, len;
    bool to = false; /* a failed send leaves it unset */

    if (ul == NULL)
        return LLM_OUT_OF_MEMORY;
    link->tp = ul;
    if ((st = ucx_workers_init(ul)) != LLM_SUCCESS || !client)
        return st;

    /* FWD: the address exchange, then our requests. */
    int fd = llmdd__data_connect(link, UCX_FLAG_HELLO, deadline);
    if (fd < 0)
        return llmdd__now_ms() >= deadline ? LLM_TIMEOUT : LLM_LINK_FAILED;
    pthread_mutex_lock(&ul->lock);
    ul->req_fd = fd;
    pthread_mutex_unlock(&ul->lock);
    st = LLM_LINK_FAILED;
    size_t cap = 32 + LLMDD_UCX_ADDR_MAX;
    if ((n = llmdd__ucx_hello_make(ul, LLM_SUCCESS, &out)) == 0 ||
        (buf = malloc(cap)) == NULL)
        goto out;
    if (llmdd__send_msg(dd->stop_fd, fd, WMSG_UCX_HELLO, out, n, deadline) != 0 ||
        llmdd__recv_msg(dd->stop_fd, fd, &type, buf, cap, &len, deadline, &to) != 0 ||
        type != WMSG_UCX_HELLO_REPLY) {
        st = to ? LLM_TIMEOUT : LLM_LINK_FAILED;
        log_error("ucx: hello with cluster %llu %s",
                  (unsigned long long)link->peer.cluster_id,
                  to ? "timed out" : "failed");
        goto out;
    }
    if ((st = llmdd__ucx_hello_take(ul, buf, len)) != LLM_SUCCESS)
        goto out;
    if (llmdd__ucx_progress_start(ul) != 0) {
        st = LLM_FAILED;
        goto out;
    }

    /* REV: the server's requests, which we serve. */
    int rev = llmdd__data_connect(link, UCX_FLAG_REV, deadline);
    if (llmdd__serve_spawn(link, llmdd__ucx_serve, ul, rev) != 0) {
        st = LLM_LINK_FAILED;
        goto out;
    }

    /* Every endpoint wired before the link is up: see llmdd__ucx_ep_wire. */
    pthread_mutex_lock(&ul->lock);
    for (int s = 0; s < UCX_EPS && st == LLM_SUCCESS; s++)
        if (ul->eps[s].ep == NULL)
            st = llmdd__ucx_ep_open(ul, s); /* their wireups run at once */
    for (int s = 0; s < UCX_EPS && st == LLM_SUCCESS; s++)
        st = llmdd__ucx_ep_wire(ul, s, deadline);
    pthread_mutex_unlock(&ul->lock);
    if (st == LLM_NOT_YET_LINK)
        st = LLM_LINK_FAILED;
out:
    free(buf);
    free(out);
    return st;
}

static void
ucx_accept_conn(llmdd__link *link, int fd, uint32_t flags)
{
    ucx_link *ul = link->tp;

    if (flags == UCX_FLAG_REV) {
        pthread_mutex_lock(&ul->lock);
        bool take = !ul->down && ul->req_fd < 0 && !link->client;
        if (take) {
            ul->req_fd = fd;
            pthread_cond_broadcast(&ul->cond);
        }
        pthread_mutex_unlock(&ul->lock);
        if (!take)
            close(fd);
        return;
    }
    if (flags == UCX_FLAG_HELLO && !link->client) {
        llmdd__ucx_accept_hello(ul, fd); /* serves in this counted thread */
        return;
    }
    close(fd);
}

static void
ucx_link_shutdown(llmdd__link *link)
{
    ucx_link *ul = link->tp;

    if (ul == NULL)
        return;
    pthread_mutex_lock(&ul->lock);
    ul->down = true;
    if (ul->req_fd >= 0)
        shutdown(ul->req_fd, SHUT_RDWR);
    llmdd__serve_shutdown(&ul->serve);
    pthread_cond_broadcast(&ul->cond);
    pthread_mutex_unlock(&ul->lock);
    if (ul->wake_fd >= 0)
        ucx_wake(ul);
}

/* Our serving threads answer the peer's active messages from our memory;
 * its RMA reaches registered memory itself (its transfers end before it
 * confirms an unlink). */
static bool
ucx_quiesce(llmdd__link *link, int64_t deadline_ms)
{
    ucx_link *ul = link->tp;

    return ul == NULL || llmdd__serve_wait_idle(&ul->serve, deadline_ms);
}

static void
ucx_link_fini(llmdd__link *link)
{
    ucx_link *ul = link->tp;

    /* Every thread that used the link is gone. */
    pthread_mutex_lock(&ul->lock);
    ul->down = true;
    llmdd__ucx_teardown(ul, true);
    for (ucx_rc *p = ul->rcs; p != NULL; p = p->next)
        p->ul = NULL; /* remote_free runs after us */
    ul->rcs = NULL;
    pthread_mutex_unlock(&ul->lock);
    if (ul->ctx != NULL)
        llmdd__ucx_ctx_put();
    if (ul->req_fd >= 0)
        close(ul->req_fd);
    if (ul->wake_fd >= 0)
        close(ul->wake_fd);
    free(ul->peer_addr);
    for (int s = 0; s < UCX_EPS; s++) {
        free(ul->eps[s].ops);
        free(ul->eps[s].free_ops);
    }
    pthread_cond_destroy(&ul->cond);
    pthread_mutex_destroy(&ul->map_lock);
    pthread_mutex_destroy(&ul->lock);
    free(ul);
    link->tp = NULL;
}

static void
ucx_rc_unlist(ucx_link *ul, ucx_rc *p)
{
    if (p->prev != NULL)
        p->prev->next = p->next;
    else if (ul->rcs == p)
        ul->rcs = p->next;
    if (p->next != NULL)
        p->next->prev = p->prev;
    p->prev = p->next = NULL;
}

/* Copies a decoded reply into p; every key is checked first. */
static llmdd_status
ucx_rc_fill(ucx_rc *p, const llmdd__ucx_reply *m)
{
    p->nregions = m->nregions;
    p->ntensors = m->desc.num_tensors;
    p->rkey_buf = calloc(m->nregions, sizeof(*p->rkey_buf));
    p->rkey_len = calloc(m->nregions, sizeof(*p->rkey_len));
    p->taddr = malloc(p->ntensors * sizeof(*p->taddr));
    p->treg = malloc(p->ntensors * sizeof(*p->treg));
    if (p->rkey_buf == NULL || p->rkey_len == NULL || p->taddr == NULL ||
        p->treg == NULL)
        return LLM_OUT_OF_MEMORY;
    for (uint32_t i = 0; i < m->nregions; i++) {
        const llmdd__ucx_region *g = &m->regions[i];
        if (!ucx_rkey_sane(g->rkey, g->rkey_len))
            return LLM_FAILED;
        if ((p->rkey_buf[i] = malloc(g->rkey_len)) == NULL)
            return LLM_OUT_OF_MEMORY;
        memcpy(p->rkey_buf[i], g->rkey, g->rkey_len);
        p->rkey_len[i] = g->rkey_len;
    }
    memcpy(p->taddr, m->taddr, p->ntensors * sizeof(*p->taddr));
    memcpy(p->treg, m->treg, p->ntensors * sizeof(*p->treg));
    return LLM_SUCCESS;
}

static llmdd_status
ucx_query(llmdd__link *link, int64_t id, int64_t deadline,
          llmdd_cache_desc *desc, uint32_t *batch_dim, void **priv)
{
    ucx_link *ul = link->tp;
    llmdd__ucx_reply m;
    llmdd_status st;
    uint8_t *buf;
    size_t len;
    ucx_rc *p = calloc(1, sizeof(*p));

    if (p == NULL)
        return LLM_OUT_OF_MEMORY;
    p->id = id;
    /* Listed from the start, so that a REVOKE racing the reply marks it. */
    pthread_mutex_lock(&ul->lock);
    p->ul = ul;
    p->next = ul->rcs;
    if (ul->rcs != NULL)
        ul->rcs->prev = p;
    ul->rcs = p;
    pthread_mutex_unlock(&ul->lock);

    buf = malloc(LLMDD_WIRE_MAX_PAYLOAD);
    st = buf == NULL
             ? LLM_OUT_OF_MEMORY
             : llmdd__ucx_call(ul, WMSG_UCX_QUERY, id, WMSG_UCX_QUERY_REPLY,
                               buf, LLMDD_WIRE_MAX_PAYLOAD, &len, deadline);
    if (st == LLM_SUCCESS) {
        if (llmdd__ucx_reply_decode(buf, len, &m) != 0) {
            log_error("ucx: cluster %llu sent a malformed reply for cache "
                      "%lld",
                      (unsigned long long)link->peer.cluster_id, (long long)id);
            st = LLM_FAILED;
        } else {
            if (m.status == LLM_SUCCESS)
                st = ucx_rc_fill(p, &m);
            else
                st = m.status == LLM_KV_CACHE_NOT_EXIST ||
                             m.status == LLM_NOT_YET_LINK
                         ? (llmdd_status)m.status
                         : LLM_FAILED;
            if (st == LLM_FAILED && m.status == LLM_SUCCESS)
                log_error("ucx: cluster %llu sent a bad key for cache %lld",
                          (unsigned long long)link->peer.cluster_id,
                          (long long)id);
            if (st == LLM_SUCCESS) {
                *desc = m.desc;
                *batch_dim = m.batch_dim;
            }
            llmdd__ucx_reply_free(&m);
        }
    }
    free(buf);
    pthread_mutex_lock(&ul->lock);
    if (st == LLM_SUCCESS && p->revoked)
        st = LLM_KV_CACHE_NOT_EXIST;
    if (st != LLM_SUCCESS)
        ucx_rc_unlist(ul, p);
    else
        *priv = p;
    pthread_mutex_unlock(&ul->lock);
    if (st != LLM_SUCCESS)
        ucx_rc_free(p);
    return st;
}

static void
ucx_remote_free(llmdd__remote_cache *rc)
{
    ucx_rc *p = rc->priv;

    if (p == NULL)
        return;
    rc->priv = NULL;
    ucx_link *ul = p->ul;
    if (ul != NULL) {
        pthread_mutex_lock(&ul->lock);
        for (int s = 0; s < UCX_EPS; s++)
            llmdd__ucx_rc_drop_keys(p, s);
        ucx_rc_unlist(ul, p);
        pthread_mutex_unlock(&ul->lock);
    }
    ucx_rc_free(p);
}

/* ---- Cache removal, owner side. ---- */

static void
ucx_cache_removed(llmdd__link *link, const llmdd__cache *cache)
{
    ucx_link *ul = link->tp;
    uint8_t buf[UCX_SMALL_MSG];
    size_t len;

    if (ul == NULL)
        return;
    pthread_mutex_lock(&ul->lock);
    ucx_reg *r = llmdd__ucx_reg_find(ul, cache->id);
    if (r == NULL) {
        pthread_mutex_unlock(&ul->lock);
        return;
    }
    r->removed = true;
    while (r->busy > 0)
        ucx_wait_until(ul, INT64_MAX); /* a reply in flight, bounded */
    llmdd__ucx_reg_unlink(ul, r);
    bool sent = r->sent;
    /* DATA replies still reading it (active messages) end first. */
    int64_t until = llmdd__now_ms() + UCX_STALL_MS;
    while (r->sending > 0 && llmdd__now_ms() < until)
        ucx_wait_until(ul, until);
    bool released = r->sending == 0;
    pthread_mutex_unlock(&ul->lock);

    if (sent && released) {
        uint64_t seq;
        uint32_t ack = LLM_FAILED;
        llmdd_status st = llmdd__ucx_call(
            ul, WMSG_UCX_REVOKE, cache->id, WMSG_UCX_REVOKE_ACK, buf,
            sizeof(buf), &len, llmdd__now_ms() + UCX_REVOKE_MS);
        if (st == LLM_SUCCESS &&
            llmdd__ucx_ack_decode(buf, len, &seq, &ack) != 0)
            ack = LLM_FAILED;
        released = st == LLM_SUCCESS && ack == LLM_SUCCESS;
    }
    if (!released) {
        llmdd__link_drop(link, "peer did not release a removed cache");
        /* Nothing may reach the memory once we return: wait until the
         * workers are gone (transfers abort once the link is down). */
        until = llmdd__now_ms() + UCX_STALL_MS;
        pthread_mutex_lock(&ul->lock);
        while (ul->progress_started && !ul->torn_down &&
               llmdd__now_ms() < until)
            ucx_wait_until(ul, until);
        if (!ul->torn_down && ul->progress_started)
            log_error("ucx: cluster %llu: workers still up after a "
                      "failed revoke",
                      (unsigned long long)link->peer.cluster_id);
        pthread_mutex_unlock(&ul->lock);
    }
    llmdd__ucx_reg_unmap(ul, r);
    free(r);
}

const llmdd_transport_ops llmdd__ucx_ops = {
    .name = "ucx",
    .reaches = ucx_reaches,
    .link_init = ucx_link_init,
    .link_shutdown = ucx_link_shutdown,
    .quiesce = ucx_quiesce,
    .link_fini = ucx_link_fini,
    .accept_conn = ucx_accept_conn,
    .query = ucx_query,
    .remote_free = ucx_remote_free,
    .xfer = llmdd__ucx_xfer,
    .cache_removed = ucx_cache_removed,
    .info = llmdd__ucx_info,
};
