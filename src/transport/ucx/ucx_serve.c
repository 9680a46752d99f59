/*
 * The ucx transport's exchange connections: the HELLO that swaps serve-worker
 * addresses, the requests (QUERY, REVOKE) a side sends on its request
 * connection, and the serving of the peer's requests.
 */
#include "transport/ucx/ucx_int.h"

/* ---- The exchange connections. ---- */

/*
 * Sends a QUERY or REVOKE on the request connection and receives its reply
 * into buf (cap bytes). A deadline that passes before any byte of the reply
 * arrived leaves the connection usable: a late reply is skipped by its seq,
 * whatever its type and size. Any other failure leaves the stream position
 * unknown and drops the link.
 */
llmdd_status
llmdd__ucx_call(ucx_link *ul, uint16_t type, int64_t id, uint16_t rtype,
                uint8_t *buf, size_t cap, size_t *rlen, int64_t deadline)
{
    llmdd__link *link = ul->link;
    llmdd *dd = link->dd;
    uint8_t req[UCX_SMALL_MSG];
    llmdd_status st = LLM_SUCCESS;
    bool broken = false;
    uint8_t *in = buf;
    uint64_t seq;
    int fd;

    /* Stale replies may be larger than this call's. */
    if (cap < LLMDD_WIRE_MAX_PAYLOAD &&
        (in = malloc(LLMDD_WIRE_MAX_PAYLOAD)) == NULL)
        return LLM_OUT_OF_MEMORY;
    pthread_mutex_lock(&ul->lock);
    while (!ul->down && (ul->req_busy || ul->req_fd < 0)) {
        if (llmdd__now_ms() >= deadline) {
            st = LLM_TIMEOUT;
            break;
        }
        ucx_wait_until(ul, deadline);
    }
    if (st == LLM_SUCCESS && ul->down)
        st = LLM_NOT_YET_LINK;
    if (st != LLM_SUCCESS) {
        pthread_mutex_unlock(&ul->lock);
        goto out_free;
    }
    ul->req_busy = true;
    fd = ul->req_fd;
    seq = ++ul->seq;
    pthread_mutex_unlock(&ul->lock);

    size_t n = llmdd__ucx_req_encode(seq, id, req, sizeof(req));
    if (llmdd__send_msg(dd->stop_fd, fd, type, req, n, deadline) != 0) {
        broken = true;
        goto out;
    }
    for (;;) {
        uint64_t rseq;
        uint16_t t;
        bool to;
        int w = llmdd__wait_fd(dd->stop_fd, fd, POLLIN, deadline);
        if (w == 0) {
            st = LLM_TIMEOUT;
            break;
        }
        if (w < 0 ||
            llmdd__recv_msg(dd->stop_fd, fd, &t, in, LLMDD_WIRE_MAX_PAYLOAD, rlen,
                            deadline, &to) != 0 ||
            (t != WMSG_UCX_QUERY_REPLY && t != WMSG_UCX_REVOKE_ACK) ||
            llmdd__ucx_seq_peek(in, *rlen, &rseq) != 0 || rseq > seq) {
            broken = true;
            break;
        }
        if (rseq < seq)
            continue; /* the late reply to a request that timed out */
        if (t != rtype || *rlen > cap)
            broken = true;
        else if (in != buf)
            memcpy(buf, in, *rlen);
        break;
    }
out:
    pthread_mutex_lock(&ul->lock);
    ul->req_busy = false;
    pthread_cond_broadcast(&ul->cond);
    pthread_mutex_unlock(&ul->lock);
    if (broken) {
        st = llmdd__now_ms() >= deadline ? LLM_TIMEOUT : LLM_NOT_YET_LINK;
        llmdd__link_drop(link, "ucx exchange connection lost");
    }
out_free:
    if (in != buf)
        free(in);
    return st;
}

static int
ucx_send_status(llmdd *dd, int fd, uint16_t type, uint64_t seq, uint32_t st)
{
    uint8_t out[UCX_SMALL_MSG];
    size_t n = type == WMSG_UCX_REVOKE_ACK
                   ? llmdd__ucx_ack_encode(seq, st, out, sizeof(out))
                   : llmdd__ucx_reply_encode(
                         &(llmdd__ucx_reply){.seq = seq, .status = st}, out,
                         sizeof(out));

    return llmdd__send_msg(dd->stop_fd, fd, type, out, n,
                           llmdd__now_ms() + UCX_STALL_MS);
}

/* Builds and sends a successful QUERY_REPLY from a mapped entry. */
static int
ucx_send_reply(llmdd *dd, int fd, uint64_t seq, const llmdd__cache *c,
               const ucx_reg *r)
{
    llmdd__ucx_region *g = calloc(r->nregions, sizeof(*g));
    llmdd__ucx_reply m = {.seq = seq,
                          .status = LLM_SUCCESS,
                          .desc = c->desc,
                          .batch_dim = c->slot.batch_dim,
                          .nregions = r->nregions,
                          .regions = g,
                          .taddr = c->addrs,
                          .treg = r->treg};
    uint8_t *buf = NULL;
    int rc;

    if (g == NULL)
        return ucx_send_status(dd, fd, WMSG_UCX_QUERY_REPLY, seq,
                               LLM_OUT_OF_MEMORY);
    for (uint32_t i = 0; i < r->nregions; i++)
        g[i] = (llmdd__ucx_region){.base = r->base[i],
                                   .len = r->len[i],
                                   .rkey = r->rkey[i],
                                   .rkey_len = (uint32_t)r->rkey_len[i]};
    size_t need = llmdd__ucx_reply_size(&m);
    if (need == 0 || need > LLMDD_WIRE_MAX_PAYLOAD ||
        (buf = malloc(need)) == NULL) {
        if (need > LLMDD_WIRE_MAX_PAYLOAD || need == 0)
            log_error("ucx: cache %lld: %u tensors do not fit one reply",
                      (long long)c->id, c->desc.num_tensors);
        free(g);
        return ucx_send_status(dd, fd, WMSG_UCX_QUERY_REPLY, seq, LLM_FAILED);
    }
    size_t n = llmdd__ucx_reply_encode(&m, buf, need);
    rc = n == 0 ? ucx_send_status(dd, fd, WMSG_UCX_QUERY_REPLY, seq, LLM_FAILED)
                : llmdd__send_msg(dd->stop_fd, fd, WMSG_UCX_QUERY_REPLY, buf, n,
                                  llmdd__now_ms() + UCX_STALL_MS);
    free(buf);
    free(g);
    return rc;
}

static int
ucx_serve_query(ucx_link *ul, int fd, const uint8_t *buf, size_t len)
{
    llmdd *dd = ul->link->dd;
    llmdd_status st = LLM_KV_CACHE_NOT_EXIST;
    llmdd__cache *c;
    ucx_reg *r = NULL;
    bool dead = false;
    uint64_t seq;
    int64_t id;
    int rc;

    if (llmdd__ucx_req_decode(buf, len, &seq, &id) != 0)
        return -1;
    c = llmdd__cache_get(dd, id);
    if (c == NULL)
        return ucx_send_status(dd, fd, WMSG_UCX_QUERY_REPLY, seq, st);

    pthread_mutex_lock(&ul->lock);
    if (!ul->down) {
        r = llmdd__ucx_reg_find(ul, id);
        if (r == NULL && (r = calloc(1, sizeof(*r))) != NULL) {
            r->id = id;
            r->next = ul->regs;
            ul->regs = r;
        }
        if (r != NULL)
            r->busy++;
    }
    pthread_mutex_unlock(&ul->lock);
    if (r == NULL) {
        st = LLM_NOT_YET_LINK;
        goto reply;
    }
    pthread_mutex_lock(&ul->map_lock);
    st = r->mapped ? LLM_SUCCESS : llmdd__ucx_reg_map(ul, r, c);
    pthread_mutex_unlock(&ul->map_lock);

    /* The owner may have removed it meanwhile: then cache_removed either
     * waits for us (the entry is busy) or has passed and never saw it. */
    dead = llmdd__cache_removed(dd, c);
    if (dead)
        st = LLM_KV_CACHE_NOT_EXIST;
    if (st == LLM_SUCCESS) {
        pthread_mutex_lock(&ul->lock);
        r->sent = true; /* before sending: cache_removed must revoke */
        pthread_mutex_unlock(&ul->lock);
    }
reply:
    if (st == LLM_SUCCESS) {
        rc = ucx_send_reply(dd, fd, seq, c, r);
    } else {
        rc = ucx_send_status(dd, fd, WMSG_UCX_QUERY_REPLY, seq, st);
    }
    ucx_reg *orphan = NULL;
    if (r != NULL) {
        pthread_mutex_lock(&ul->lock);
        if (--r->busy == 0 && dead && !r->removed) {
            llmdd__ucx_reg_unlink(ul, r);
            orphan = r;
        }
        pthread_cond_broadcast(&ul->cond);
        pthread_mutex_unlock(&ul->lock);
    }
    if (orphan != NULL) {
        llmdd__ucx_reg_unmap(ul, orphan);
        free(orphan);
    }
    llmdd__cache_put(dd, c);
    return rc;
}

/* The owner takes cache `id` back: abort transfers on it, drop its keys. */
static int
ucx_serve_revoke(ucx_link *ul, int fd, const uint8_t *buf, size_t len)
{
    llmdd__link *link = ul->link;
    int64_t deadline = llmdd__now_ms() + UCX_REVOKE_MS - 1000;
    uint32_t st = LLM_SUCCESS;
    uint64_t seq;
    int64_t id;

    if (llmdd__ucx_req_decode(buf, len, &seq, &id) != 0)
        return -1;
    pthread_mutex_lock(&ul->lock);
    for (ucx_rc *p = ul->rcs; p != NULL; p = p->next)
        if (p->id == id)
            p->revoked = true;
    pthread_cond_broadcast(&ul->cond);
    for (;;) {
        bool busy = false;
        for (ucx_rc *p = ul->rcs; p != NULL; p = p->next)
            busy = busy || (p->id == id && p->inflight > 0);
        if (!busy)
            break;
        if (llmdd__now_ms() >= deadline) {
            st = LLM_TIMEOUT;
            break;
        }
        ucx_wait_until(ul, deadline);
    }
    if (st == LLM_SUCCESS)
        for (ucx_rc *p = ul->rcs; p != NULL; p = p->next)
            if (p->id == id)
                for (int s = 0; s < UCX_EPS; s++)
                    llmdd__ucx_rc_drop_keys(p, s);
    pthread_mutex_unlock(&ul->lock);
    llmdd__link_forget(link, id);
    return ucx_send_status(link->dd, fd, WMSG_UCX_REVOKE_ACK, seq, st);
}

/* Answers the peer's requests on fd until it closes or the link goes down. */
static void
ucx_serve(ucx_link *ul, int fd)
{
    llmdd__link *link = ul->link;
    llmdd *dd = link->dd;
    uint8_t buf[UCX_SMALL_MSG];

    if (!llmdd__serve_track(&ul->serve, fd, true)) {
        close(fd);
        return;
    }
    for (;;) {
        uint16_t type;
        size_t len;
        bool to;
        int rc = -1;

        /* Idle connections wait for as long as the link lives. */
        if (llmdd__wait_fd(dd->stop_fd, fd, POLLIN, INT64_MAX) != 1 ||
            llmdd__recv_msg(dd->stop_fd, fd, &type, buf, sizeof(buf), &len,
                            llmdd__now_ms() + UCX_STALL_MS, &to) != 0)
            break;
        if (type == WMSG_UCX_QUERY)
            rc = ucx_serve_query(ul, fd, buf, len);
        else if (type == WMSG_UCX_REVOKE)
            rc = ucx_serve_revoke(ul, fd, buf, len);
        if (rc != 0)
            break;
    }
    llmdd__serve_track(&ul->serve, fd, false);
    close(fd);
    pthread_mutex_lock(&ul->lock);
    bool down = ul->down;
    pthread_mutex_unlock(&ul->lock);
    if (!down)
        llmdd__link_drop(link, "ucx exchange connection closed");
}

void
llmdd__ucx_serve(void *ul, int fd)
{
    ucx_serve(ul, fd);
}

/* Our serve worker's address as a HELLO payload; *out is malloc'd. */
size_t
llmdd__ucx_hello_make(ucx_link *ul, uint32_t status, uint8_t **out)
{
    unsigned maj, min, rel;
    ucp_address_t *addr = NULL;
    size_t alen = 0, n = 0;
    uint8_t *buf = NULL;

    *out = NULL;
    ucp_get_version(&maj, &min, &rel);
    if (status == LLM_SUCCESS) {
        pthread_mutex_lock(&ul->lock);
        ucs_status_t st = ucp_worker_get_address(ul->sw, &addr, &alen);
        pthread_mutex_unlock(&ul->lock);
        if (st != UCS_OK || alen == 0 || alen > LLMDD_UCX_ADDR_MAX) {
            log_error("ucx: worker address: %s", ucs_status_string(st));
            if (st == UCS_OK)
                ucp_worker_release_address(ul->sw, addr);
            return 0;
        }
    }
    bool rdma = llmdd__ucx_probe()->rdma;
    llmdd__ucx_hello h = {.version = LLMDD_UCX_WIRE_VERSION,
                          .ucp_version = maj << 16 | min << 8 | rel,
                          .flags = rdma ? LLMDD_UCX_HELLO_RDMA : 0,
                          .key = ul->key,
                          .addr = (const uint8_t *)addr,
                          .addr_len = (uint32_t)alen};
    size_t cap = 32 + alen;
    if ((buf = malloc(cap)) != NULL)
        n = llmdd__ucx_hello_encode(status, &h, buf, cap);
    if (addr != NULL) {
        pthread_mutex_lock(&ul->lock);
        ucp_worker_release_address(ul->sw, addr);
        pthread_mutex_unlock(&ul->lock);
    }
    if (n == 0)
        free(buf);
    else
        *out = buf;
    return n;
}

/* Takes the peer's HELLO: stores its address, opens the first endpoint. */
llmdd_status
llmdd__ucx_hello_take(ucx_link *ul, const uint8_t *buf, size_t len)
{
    llmdd__ucx_hello h;
    uint32_t status;
    unsigned maj, min, rel;

    if (llmdd__ucx_hello_decode(buf, len, &status, &h) != 0) {
        log_error("ucx: cluster %llu sent a malformed hello",
                  (unsigned long long)ucx_cluster(ul));
        return LLM_LINK_FAILED;
    }
    if (status != LLM_SUCCESS)
        return LLM_LINK_FAILED;
    if (h.version != LLMDD_UCX_WIRE_VERSION) {
        log_error("ucx: cluster %llu speaks exchange version %u, not %u",
                  (unsigned long long)ucx_cluster(ul), h.version,
                  LLMDD_UCX_WIRE_VERSION);
        return LLM_LINK_FAILED;
    }
    ucp_get_version(&maj, &min, &rel);
    if (h.ucp_version >> 8 != (maj << 8 | min))
        log_warn("ucx: cluster %llu runs UCX %u.%u, we run %u.%u",
                 (unsigned long long)ucx_cluster(ul), h.ucp_version >> 16,
                 (h.ucp_version >> 8) & 0xff, maj, min);
    uint8_t *addr = malloc(h.addr_len);
    if (addr == NULL)
        return LLM_OUT_OF_MEMORY;
    memcpy(addr, h.addr, h.addr_len);
    pthread_mutex_lock(&ul->lock);
    llmdd_status st = LLM_LINK_FAILED;
    if (!ul->down && ul->peer_addr == NULL) {
        ul->peer_addr = addr;
        ul->peer_addr_len = h.addr_len;
        ul->peer_key = h.key;
        addr = NULL;
        /* RMA only where both sides have RDMA: elsewhere UCX 1.13 would
         * emulate it, and aborts on a peer that dies (see above). */
        const ucx_probe *probed = llmdd__ucx_probe();
        ul->rma = probed->rma_env >= 0
                      ? probed->rma_env == 1
                      : probed->rdma && (h.flags & LLMDD_UCX_HELLO_RDMA);
        log_info("ucx: cluster %llu: transfers use %s",
                 (unsigned long long)ucx_cluster(ul),
                 ul->rma ? "RMA" : "active messages");
        /* The client's endpoints open now (an unreachable peer, with no
         * common transport, fails the link); the server's when it first
         * transfers. */
        st = ul->link->client ? llmdd__ucx_ep_open(ul, 0) : LLM_SUCCESS;
        pthread_cond_broadcast(&ul->cond);
    }
    pthread_mutex_unlock(&ul->lock);
    free(addr);
    return st;
}

/* Server side of UCX_HELLO, then serves the connection. */
void
llmdd__ucx_accept_hello(ucx_link *ul, int fd)
{
    llmdd *dd = ul->link->dd;
    int64_t deadline = llmdd__now_ms() + UCX_STALL_MS;
    size_t cap = 32 + LLMDD_UCX_ADDR_MAX;
    uint8_t *buf = malloc(cap), *out = NULL;
    llmdd_status st = LLM_LINK_FAILED;
    uint16_t type;
    size_t len, n;
    bool to;

    pthread_mutex_lock(&ul->lock);
    bool first = !ul->hello_done && !ul->down;
    ul->hello_done = true;
    pthread_mutex_unlock(&ul->lock);
    if (buf == NULL || !first ||
        llmdd__recv_msg(dd->stop_fd, fd, &type, buf, cap, &len, deadline, &to) != 0 ||
        type != WMSG_UCX_HELLO)
        goto err;
    st = llmdd__ucx_hello_take(ul, buf, len);
    if (st == LLM_SUCCESS && llmdd__ucx_progress_start(ul) != 0)
        st = LLM_FAILED;
    n = llmdd__ucx_hello_make(ul, st, &out);
    if (n == 0 ||
        llmdd__send_msg(dd->stop_fd, fd, WMSG_UCX_HELLO_REPLY, out, n, deadline) != 0 ||
        st != LLM_SUCCESS)
        goto err;
    free(out);
    free(buf);
    ucx_serve(ul, fd);
    return;
err:
    free(out);
    free(buf);
    close(fd);
    /* The client fails its link call; our half must not linger. */
    llmdd__link_drop(ul->link, "ucx hello failed");
}
