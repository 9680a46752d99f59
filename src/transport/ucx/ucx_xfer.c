/*
 * The ucx transport's transfers: a planned llmdd__xfer becomes gets and puts
 * (RMA) or GET and PUT active messages on one endpoint slot, within a window
 * of operations in flight.
 */
#include "transport/ucx/ucx_int.h"

/* ---- Transfers. ---- */

/*
 * Waits (lock held) until at most `max` operations and `max_bytes` bytes
 * asked with active messages are in flight. Fails on the deadline, a down
 * link, a failed endpoint or operation, a refusal, or a revoke.
 */
static llmdd_status
ucx_xwait(ucx_link *ul, ucx_rc *p, int s, ucx_xstate *xs, size_t max,
          size_t max_bytes, int64_t deadline)
{
    for (;;) {
        if (ul->down)
            return LLM_NOT_YET_LINK;
        if (xs->status != UCS_OK || ul->eps[s].failed)
            return LLM_NOT_YET_LINK;
        if (xs->refused != LLM_SUCCESS)
            return xs->refused;
        if (p->revoked)
            return LLM_KV_CACHE_NOT_EXIST;
        if (xs->outstanding <= max && xs->bytes <= max_bytes)
            return LLM_SUCCESS;
        if (llmdd__now_ms() >= deadline)
            return LLM_TIMEOUT;
        xs->wake_at = max;
        /* Make the progress thread look: posting may leave work queued. */
        ucp_worker_signal(ul->eps[s].w);
        ucx_wait_until(ul, deadline);
    }
}

/* Claims an endpoint slot for one transfer (lock held). */
static llmdd_status
ucx_xbegin(ucx_link *ul, ucx_rc *p, int64_t deadline, int *slot)
{
    for (;;) {
        if (ul->down || ul->sw == NULL)
            return LLM_NOT_YET_LINK;
        if (p->revoked)
            return LLM_KV_CACHE_NOT_EXIST;
        int s = -1;
        if (ul->peer_addr != NULL) {
            /* An open idle endpoint first, then an empty slot. */
            for (int i = 0; i < UCX_EPS && s < 0; i++)
                if (!ul->eps[i].busy && ul->eps[i].ep != NULL &&
                    !ul->eps[i].failed)
                    s = i;
            for (int i = 0; i < UCX_EPS && s < 0; i++)
                if (!ul->eps[i].busy && ul->eps[i].ep == NULL)
                    s = i;
        }
        if (s >= 0) {
            llmdd_status st = LLM_SUCCESS;
            ul->eps[s].busy = true;
            if (ul->eps[s].ep == NULL &&
                (st = llmdd__ucx_ep_open(ul, s)) == LLM_SUCCESS)
                st = llmdd__ucx_ep_wire(ul, s, deadline);
            if (st == LLM_SUCCESS)
                st = llmdd__ucx_rc_keys(ul, p, s);
            if (st != LLM_SUCCESS) {
                ul->eps[s].busy = false;
                pthread_cond_broadcast(&ul->cond);
                return st == LLM_LINK_FAILED ? LLM_NOT_YET_LINK : st;
            }
            *slot = s;
            return LLM_SUCCESS;
        }
        if (llmdd__now_ms() >= deadline)
            return LLM_TIMEOUT;
        ucx_wait_until(ul, deadline);
    }
}

/* One transfer's claim on an endpoint and its operations in flight. */
typedef struct {
    ucx_link *ul;
    ucx_rc *p;
    int s;
    ucp_ep_h ep;
    int64_t deadline;
    ucx_xstate xs;
    ucp_request_param_t prm;
    bool am; /* active messages, not RMA */
} ucx_xctx;

/* Posts one GET or PUT active message per chunk of the range, each once
 * the window has room (lock held). */
static llmdd_status
ucx_am_post(ucx_xctx *c, bool write, uint8_t *local, uint64_t raddr, size_t len)
{
    ucx_ep *e = &c->ul->eps[c->s];
    ucp_request_param_t prm = c->prm;

    prm.op_attr_mask |= UCP_OP_ATTR_FIELD_FLAGS;
    prm.flags = UCP_AM_SEND_FLAG_REPLY | UCP_AM_SEND_FLAG_EAGER;
    while (len > 0) {
        size_t n = len < LLMDD_UCX_AM_CHUNK ? len : LLMDD_UCX_AM_CHUNK;
        /* Room for the operation and its send request. */
        llmdd_status st = ucx_xwait(c->ul, c->p, c->s, &c->xs, UCX_WINDOW - 2,
                                    UCX_AM_BYTES - n, c->deadline);
        if (st != LLM_SUCCESS)
            return st;
        uint16_t i = e->free_ops[--e->nfree];
        ucx_amop *op = &e->ops[i];
        op->tag = ++e->tags << UCX_WINDOW_BITS | i;
        op->dst = write ? NULL : local;
        op->len = n;
        op->xs = &c->xs;
        llmdd__ucx_amreq m = {
            .key = c->ul->peer_key, .tag = op->tag, .addr = raddr, .len = n};
        llmdd__ucx_amreq_encode(&m, op->hdr, sizeof(op->hdr));
        c->xs.outstanding++;
        c->xs.bytes += n;
        ucs_status_ptr_t sp = ucp_am_send_nbx(
            c->ep, write ? LLMDD_UCX_AM_PUT : LLMDD_UCX_AM_GET, op->hdr,
            sizeof(op->hdr), write ? local : NULL, write ? n : 0, &prm);
        if (UCS_PTR_IS_ERR(sp))
            c->xs.status = UCS_PTR_STATUS(sp);
        else if (sp != NULL)
            c->xs.outstanding++; /* llmdd__ucx_op_done frees it */
        local += n;
        raddr += n;
        len -= n;
    }
    return LLM_SUCCESS;
}

/* Posts one get or put once the window has room (lock held). */
static llmdd_status
ucx_post(ucx_xctx *c, bool write, void *local, uint64_t raddr,
         ucp_rkey_h key, size_t len)
{
    if (c->am)
        return ucx_am_post(c, write, local, raddr, len);
    llmdd_status st = ucx_xwait(c->ul, c->p, c->s, &c->xs, UCX_WINDOW - 1,
                                SIZE_MAX, c->deadline);

    if (st != LLM_SUCCESS)
        return st;
    ucs_status_ptr_t sp = write
                              ? ucp_put_nbx(c->ep, local, len, raddr, key,
                                            &c->prm)
                              : ucp_get_nbx(c->ep, local, len, raddr, key,
                                            &c->prm);
    if (UCS_PTR_IS_ERR(sp))
        c->xs.status = UCS_PTR_STATUS(sp);
    else if (sp != NULL)
        c->xs.outstanding++; /* llmdd__ucx_op_done frees it */
    return LLM_SUCCESS;
}

/* Every run of every tensor as its own operation. */
static llmdd_status
ucx_xfer_runs(ucx_xctx *c, const llmdd__xfer *x)
{
    ucp_rkey_h *keys = c->p->rkeys[c->s];
    llmdd_status st = LLM_SUCCESS;

    for (uint32_t t = 0; t < x->count && st == LLM_SUCCESS; t++) {
        uint32_t rt = x->remote_first + t;
        ucp_rkey_h key = keys[c->p->treg[rt]];
        for (size_t r = 0; r < x->nruns && st == LLM_SUCCESS; r++) {
            const llmdd__run *run = &x->runs[r];
            st = ucx_post(c, x->write, x->local[t] + llmdd__run_local(x, run),
                          c->p->taddr[rt] + llmdd__run_remote(x, run), key,
                          (size_t)run->len);
        }
    }
    /* An RMA put is complete at the peer only once the endpoint is
     * flushed; an active-message PUT once it is acknowledged. */
    if (st == LLM_SUCCESS && x->write && !c->am && c->xs.status == UCS_OK) {
        ucs_status_ptr_t sp = ucp_ep_flush_nbx(c->ep, &c->prm);
        if (UCS_PTR_IS_ERR(sp))
            c->xs.status = UCS_PTR_STATUS(sp);
        else if (sp != NULL)
            c->xs.outstanding++;
    }
    if (st == LLM_SUCCESS)
        st = ucx_xwait(c->ul, c->p, c->s, &c->xs, 0, 0, c->deadline);
    return st;
}

/*
 * Whether a pull is many small runs close together (paged blocks): then one
 * read of their span per tensor and local copies beat an operation per run,
 * above all where UCX emulates RMA with a message per operation.
 */
static bool
ucx_gather_span(const llmdd__xfer *x, uint64_t *lo_out, uint64_t *span_out)
{
    uint64_t lo = UINT64_MAX, hi = 0, bytes = 0;

    if (x->write || x->nruns < UCX_GATHER_MIN_RUNS)
        return false;
    for (size_t r = 0; r < x->nruns; r++) {
        /* A pull: the remote side is the source. */
        const llmdd__run *run = &x->runs[r];
        lo = run->src_off < lo ? run->src_off : lo;
        hi = run->src_off + run->len > hi ? run->src_off + run->len : hi;
        if (__builtin_add_overflow(bytes, run->len, &bytes))
            bytes = UINT64_MAX;
    }
    if (bytes / x->nruns >= UCX_GATHER_SMALL || hi - lo > UCX_GATHER_MAX ||
        (hi - lo) / UCX_GATHER_DENSITY > bytes)
        return false;
    *lo_out = lo;
    *span_out = hi - lo;
    return true;
}

/*
 * The gathered pull: spans of a batch of tensors land in a bounce buffer,
 * then the runs are copied out in order, so a later run wins as it would
 * run by run. Lock held; dropped for the copies.
 */
static llmdd_status
ucx_xfer_gather(ucx_xctx *c, const llmdd__xfer *x, uint64_t lo,
                uint64_t span, uint8_t **bounce_out)
{
    ucp_rkey_h *keys = c->p->rkeys[c->s];
    uint32_t batch = span >= UCX_GATHER_BATCH
                         ? 1
                         : (uint32_t)(UCX_GATHER_BATCH / span);
    llmdd_status st = LLM_SUCCESS;

    if (batch > x->count)
        batch = x->count;
    uint8_t *bounce = malloc((size_t)batch * span);
    if (bounce == NULL)
        return LLM_OUT_OF_MEMORY;
    *bounce_out = bounce; /* freed by the caller, after any close */
    for (uint32_t t0 = 0; t0 < x->count && st == LLM_SUCCESS; t0 += batch) {
        uint32_t n = x->count - t0 < batch ? x->count - t0 : batch;
        for (uint32_t i = 0; i < n && st == LLM_SUCCESS; i++) {
            uint32_t rt = x->remote_first + t0 + i;
            st = ucx_post(c, false, bounce + (size_t)i * span,
                          c->p->taddr[rt] + lo, keys[c->p->treg[rt]],
                          (size_t)span);
        }
        if (st == LLM_SUCCESS)
            st = ucx_xwait(c->ul, c->p, c->s, &c->xs, 0, 0, c->deadline);
        if (st != LLM_SUCCESS)
            break;
        pthread_mutex_unlock(&c->ul->lock);
        for (uint32_t i = 0; i < n; i++) {
            const uint8_t *src = bounce + (size_t)i * span - lo;
            uint8_t *dst = x->local[t0 + i];
            for (size_t r = 0; r < x->nruns; r++)
                memcpy(dst + x->runs[r].dst_off, src + x->runs[r].src_off,
                       (size_t)x->runs[r].len);
        }
        pthread_mutex_lock(&c->ul->lock);
    }
    return st;
}

/*
 * Ends a transfer that failed with operations possibly in flight, so that
 * none writes into the caller's buffers after we return. Lock held.
 */
static void
ucx_xabort(ucx_xctx *c)
{
    ucx_link *ul = c->ul;
    ucx_ep *e = &ul->eps[c->s];

    llmdd__ucx_am_forget(e, &c->xs);
    if (c->xs.outstanding == 0 && !e->failed && c->xs.status == UCS_OK)
        return; /* nothing in flight: the endpoint stays usable */
    llmdd__ucx_slot_abort(ul, c->s, &c->xs);
    c->xs.outstanding = 0;
}

llmdd_status
llmdd__ucx_xfer(llmdd__link *link, const llmdd__xfer *x)
{
    ucx_link *ul = link->tp;
    ucx_xctx c = {.ul = ul, .p = x->remote->priv, .deadline = x->deadline_ms};
    uint8_t *bounce = NULL;
    uint64_t lo, span;
    llmdd_status st;

    if (c.p == NULL)
        return LLM_KV_CACHE_NOT_EXIST;
    c.xs.ul = ul;
    c.prm = (ucp_request_param_t){
        .op_attr_mask =
            UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA,
        .cb.send = llmdd__ucx_op_done,
        .user_data = &c.xs,
    };
    pthread_mutex_lock(&ul->lock);
    if ((st = ucx_xbegin(ul, c.p, x->deadline_ms, &c.s)) != LLM_SUCCESS) {
        pthread_mutex_unlock(&ul->lock);
        return st;
    }
    ul->users++;
    c.p->inflight++;
    c.ep = ul->eps[c.s].ep;
    c.am = !ul->rma;
    if (ucx_gather_span(x, &lo, &span))
        st = ucx_xfer_gather(&c, x, lo, span, &bounce);
    else
        st = ucx_xfer_runs(&c, x);
    if (st != LLM_SUCCESS && c.xs.status != UCS_OK && !ul->down)
        log_error("ucx: cluster %llu: %s failed: %s",
                  (unsigned long long)link->peer.cluster_id,
                  x->write ? "put" : "get", ucs_status_string(c.xs.status));
    if (st != LLM_SUCCESS)
        ucx_xabort(&c);
    bool peer_failed = st == LLM_NOT_YET_LINK && !ul->down;
    ul->eps[c.s].busy = false;
    c.p->inflight--;
    /* The progress thread leaves a down link once no transfer needs it. */
    bool wake = --ul->users == 0 && ul->down;
    pthread_cond_broadcast(&ul->cond);
    pthread_mutex_unlock(&ul->lock);
    free(bounce);
    if (peer_failed)
        llmdd__link_drop(link, "UCX operation failed");
    if (wake)
        ucx_wake(ul);
    return st;
}
