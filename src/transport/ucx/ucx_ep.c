/*
 * The ucx transport's endpoints (one per request slot, to the peer's serve
 * worker) and the link's progress thread, which drives every worker.
 */
#include "transport/ucx/ucx_int.h"

/* ---- Endpoints. ---- */

static void
ucx_ep_error(void *arg, ucp_ep_h ep, ucs_status_t status)
{
    ucx_link *ul = arg;

    /* Runs inside worker progress, lock held: record, let others act. */
    for (int s = 0; s < UCX_EPS; s++) {
        if (ul->eps[s].ep != ep)
            continue;
        if (ul->eps[s].closing)
            return;
        ul->eps[s].failed = true;
    }
    if (!ul->failed && !ul->down)
        log_warn("ucx: cluster %llu: endpoint failed: %s",
                 (unsigned long long)ucx_cluster(ul),
                 ucs_status_string(status));
    ul->failed = true;
    pthread_cond_broadcast(&ul->cond);
}

/*
 * Opens slot s's endpoint to the peer's serve worker (lock held). Peer
 * failure handling when UCX has a transport for it; UCX 1.13's shared
 * memory transports have none, and then a dead peer shows through the
 * control connection instead.
 */
llmdd_status
llmdd__ucx_ep_open(ucx_link *ul, int s)
{
    ucx_ep *e = &ul->eps[s];
    ucs_status_t st;

    if (e->w == NULL) {
        ucp_worker_params_t wp = {
            .field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE,
            .thread_mode = UCS_THREAD_MODE_SERIALIZED};
        if ((st = ucp_worker_create(ul->ctx, &wp, &e->w)) != UCS_OK) {
            log_error("ucx: ucp_worker_create: %s", ucs_status_string(st));
            e->w = NULL;
            return LLM_FAILED;
        }
        e->efd = -1;
        static const unsigned ids[] = {LLMDD_UCX_AM_DATA, LLMDD_UCX_AM_ACK,
                                       LLMDD_UCX_AM_PONG};
        static const ucp_am_recv_callback_t cbs[] = {
            llmdd__ucx_am_data, llmdd__ucx_am_ack, llmdd__ucx_am_pong};
        if (e->ops == NULL) {
            e->ops = calloc(UCX_WINDOW, sizeof(*e->ops));
            e->free_ops = calloc(UCX_WINDOW, sizeof(*e->free_ops));
            for (int i = 0; e->free_ops != NULL && i < UCX_WINDOW; i++)
                e->free_ops[i] = (uint16_t)(UCX_WINDOW - 1 - i);
            e->nfree = UCX_WINDOW;
        }
        if (e->ops == NULL || e->free_ops == NULL ||
            (ul->wakeup && ucp_worker_get_efd(e->w, &e->efd) != UCS_OK) ||
            llmdd__ucx_am_install(e->w, ids, cbs, 3, e) != UCS_OK) {
            log_error("ucx: cannot set up a request worker");
            ucp_worker_destroy(e->w);
            e->w = NULL;
            return LLM_FAILED;
        }
        ucx_wake(ul); /* the progress thread polls one more fd */
    }
    ucp_ep_params_t ep = {
        .field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS |
                      UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE |
                      UCP_EP_PARAM_FIELD_ERR_HANDLER,
        .address = (const ucp_address_t *)ul->peer_addr,
        .err_mode = llmdd__ucx_probe()->peer_mode ? UCP_ERR_HANDLING_MODE_PEER
                                                  : UCP_ERR_HANDLING_MODE_NONE,
        .err_handler = {.cb = ucx_ep_error, .arg = ul},
    };
    st = ucp_ep_create(e->w, &ep, &e->ep);
    if (st == UCS_ERR_UNREACHABLE &&
        ep.err_mode == UCP_ERR_HANDLING_MODE_PEER) {
        log_info("ucx: cluster %llu: no transport with peer failure "
                 "handling; relying on the control connection",
                 (unsigned long long)ucx_cluster(ul));
        ep.err_mode = UCP_ERR_HANDLING_MODE_NONE;
        st = ucp_ep_create(e->w, &ep, &e->ep);
    }
    ul->eps[s].peer_mode = ep.err_mode == UCP_ERR_HANDLING_MODE_PEER;
    if (st != UCS_OK) {
        log_error("ucx: cannot reach cluster %llu: %s",
                  (unsigned long long)ucx_cluster(ul), ucs_status_string(st));
        ul->eps[s].ep = NULL;
        return LLM_LINK_FAILED;
    }
    ul->eps[s].failed = false;
    ul->eps[s].ponged = false;
    return LLM_SUCCESS;
}

/*
 * Completion of a transfer's operation (and of a close): lock held. The
 * request is freed here, not when posted: ucp_request_free on a pending
 * request would also cancel this callback.
 */
void
llmdd__ucx_op_done(void *req, ucs_status_t status, void *user_data)
{
    ucx_xstate *xs = user_data;

    if (status != UCS_OK && xs->status == UCS_OK)
        xs->status = status;
    if (--xs->outstanding <= xs->wake_at)
        pthread_cond_broadcast(&xs->ul->cond);
    ucp_request_free(req);
}

/*
 * Closes slot s's endpoint (created in peer mode) with FORCE, which
 * completes every operation still on it with UCS_ERR_CANCELED, and destroys
 * the keys unpacked on it. Lock held. With `inline_progress` the caller
 * progresses the worker itself (no progress thread); otherwise the progress
 * thread does, while we wait.
 */
static void
ucx_ep_close(ucx_link *ul, int s, ucx_xstate *xs, bool inline_progress)
{
    ucx_xstate none = {.ul = ul};
    ucx_xstate cl = {.ul = ul, .outstanding = 1};
    ucp_request_param_t p = {
        .op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS | UCP_OP_ATTR_FIELD_CALLBACK |
                        UCP_OP_ATTR_FIELD_USER_DATA,
        .flags = UCP_EP_CLOSE_FLAG_FORCE,
        .cb.send = llmdd__ucx_op_done,
        .user_data = &cl,
    };
    int64_t warn = llmdd__now_ms() + UCX_CLOSE_WARN_MS;

    if (ul->eps[s].ep == NULL)
        return;
    if (xs == NULL)
        xs = &none;
    xs->wake_at = 0;
    ul->eps[s].closing = true;
    ucs_status_ptr_t req = ucp_ep_close_nbx(ul->eps[s].ep, &p);
    if (!UCS_PTR_IS_PTR(req))
        cl.outstanding = 0;
    while (cl.outstanding > 0 || xs->outstanding > 0) {
        if (inline_progress) {
            ucp_worker_progress(ul->eps[s].w);
            continue;
        }
        ucp_worker_signal(ul->eps[s].w);
        ucx_wait_until(ul, llmdd__now_ms() + 100);
        if (llmdd__now_ms() > warn) {
            log_warn("ucx: cluster %llu: endpoint close is slow",
                     (unsigned long long)ucx_cluster(ul));
            warn = INT64_MAX;
        }
    }
    for (ucx_rc *p2 = ul->rcs; p2 != NULL; p2 = p2->next)
        llmdd__ucx_rc_drop_keys(p2, s);
    ul->eps[s].ep = NULL;
    ul->eps[s].failed = false;
    ul->eps[s].closing = false;
    ul->eps[s].gen++;
}

/*
 * Destroys slot s's worker with whatever is still on it. The way out for
 * endpoints without peer error handling (UCX 1.13 shared memory), which
 * cannot be closed with FORCE and whose operations may wait on a peer that
 * is slow or gone: once the worker is gone, nothing of it writes into our
 * memory. Only the slot's owner (or teardown) calls it. Lock held.
 */
static void
ucx_slot_purge(ucx_link *ul, int s)
{
    ucx_ep *e = &ul->eps[s];

    for (ucx_rc *p = ul->rcs; p != NULL; p = p->next)
        llmdd__ucx_rc_drop_keys(p, s);
    if (e->w == NULL)
        return;
    ucp_worker_destroy(e->w); /* and its endpoint */
    e->w = NULL;
    e->efd = -1;
    e->ep = NULL;
    e->failed = false;
    e->closing = false;
    e->gen++;
    ucx_wake(ul);
}

/*
 * Ends whatever slot s's owner left in flight (xs), so that nothing of it
 * touches our memory afterwards: a forced close where the endpoint has peer
 * error handling, else the slot's worker goes. Lock held.
 */
void
llmdd__ucx_slot_abort(ucx_link *ul, int s, ucx_xstate *xs)
{
    if (ul->eps[s].peer_mode)
        ucx_ep_close(ul, s, xs, false);
    else
        ucx_slot_purge(ul, s);
}

/*
 * Waits until the peer has answered a PING on slot s's new endpoint. UCX
 * 1.13 aborts a process that purges a wireup reply still queued for a
 * peer that died (ucp_request.c "got REP message"). The PONG comes behind
 * the peer's reply on the same lane, so once it is here the peer owes this
 * endpoint nothing and may die safely. The slot is the caller's (busy, or
 * the link not yet up). Lock held; the progress thread progresses.
 */
llmdd_status
llmdd__ucx_ep_wire(ucx_link *ul, int s, int64_t deadline)
{
    ucx_ep *e = &ul->eps[s];
    ucx_xstate xs = {.ul = ul};
    ucp_request_param_t p = {
        .op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS | UCP_OP_ATTR_FIELD_CALLBACK |
                        UCP_OP_ATTR_FIELD_USER_DATA,
        .flags = UCP_AM_SEND_FLAG_REPLY | UCP_AM_SEND_FLAG_EAGER,
        .cb.send = llmdd__ucx_op_done,
        .user_data = &xs,
    };
    uint8_t hdr[LLMDD_UCX_PING_SIZE]; /* the send ends before we return */

    llmdd__wire_i64_encode((int64_t)ul->peer_key, hdr, sizeof(hdr));
    ucs_status_ptr_t sp = ucp_am_send_nbx(e->ep, LLMDD_UCX_AM_PING, hdr,
                                          sizeof(hdr), NULL, 0, &p);

    if (UCS_PTR_IS_ERR(sp))
        return LLM_NOT_YET_LINK;
    xs.outstanding = sp != NULL;
    while ((xs.outstanding > 0 || !e->ponged) && !ul->down && !e->failed &&
           xs.status == UCS_OK && llmdd__now_ms() < deadline) {
        ucp_worker_signal(e->w);
        ucx_wait_until(ul, deadline);
    }
    if (xs.outstanding == 0 && e->ponged)
        return LLM_SUCCESS;
    bool late = !ul->down && !e->failed && xs.status == UCS_OK;
    llmdd__ucx_slot_abort(ul, s, &xs); /* completes or drops the PING */
    return late ? LLM_TIMEOUT : LLM_NOT_YET_LINK;
}

/*
 * Once the link is down and no transfer runs: closes every endpoint, frees
 * every key and destroys every worker, so UCX touches none of our memory
 * for this link any more; then unmaps what the peer could reach. Lock held.
 */
void
llmdd__ucx_teardown(ucx_link *ul, bool inline_progress)
{
    if (ul->torn_down)
        return;
    for (ucx_rc *p = ul->rcs; p != NULL; p = p->next)
        for (int s = 0; s < UCX_EPS; s++)
            llmdd__ucx_rc_drop_keys(p, s);
    /* Nothing is in flight. Without peer error handling a forced close is
     * undefined on the remote side and a flush may wait on a dead peer:
     * those endpoints go with their worker. */
    for (int s = 0; s < UCX_EPS; s++) {
        if (ul->eps[s].ep != NULL && ul->eps[s].peer_mode)
            ucx_ep_close(ul, s, NULL, inline_progress);
        ucx_slot_purge(ul, s);
    }
    /* A QUERY still answering holds its entry: let it finish first. */
    for (;;) {
        bool busy = false;
        for (ucx_reg *r = ul->regs; r != NULL; r = r->next)
            busy = busy || r->busy > 0;
        if (!busy)
            break;
        ucx_wait_until(ul, llmdd__now_ms() + 100);
    }
    if (ul->sw != NULL)
        ucp_worker_destroy(ul->sw);
    ul->sw = NULL;
    ul->sefd = -1;
    while (ul->regs != NULL) {
        ucx_reg *r = ul->regs;
        ul->regs = r->next;
        llmdd__ucx_reg_unmap(ul, r);
        free(r);
    }
    ul->torn_down = true;
    pthread_cond_broadcast(&ul->cond);
}

/* ---- The progress thread. ---- */

void *
llmdd__ucx_progress_main(void *arg)
{
    ucx_link *ul = arg;
    llmdd__link *link = ul->link;

    int64_t last_work = 0, busy_since = INT64_MAX;

    pthread_mutex_lock(&ul->lock);
    for (;;) {
        /* A slice at a time: the lock is the requesters' way in. */
        int64_t t0 = ucx_now_us();
        unsigned k, n = 0;
        do {
            k = ucp_worker_progress(ul->sw);
            for (int s = 0; s < UCX_EPS; s++)
                if (ul->eps[s].w != NULL)
                    k += ucp_worker_progress(ul->eps[s].w);
            n += k;
        } while (k > 0 && ucx_now_us() - t0 < UCX_SLICE_US);
        if (ul->failed && !ul->drop_asked) {
            /* link_drop calls link_shutdown, which takes the lock. */
            ul->drop_asked = true;
            pthread_mutex_unlock(&ul->lock);
            llmdd__link_drop(link, "UCX endpoint failed");
            pthread_mutex_lock(&ul->lock);
            continue;
        }
        if (ul->down && ul->users == 0)
            break;
        /* While data flows, keep polling a little (UCX_SPIN_US) rather than
         * pay a wakeup per fragment; when it stops, sleep on the fds. The
         * lock is let go each round so requesters can post. */
        int64_t t = ucx_now_us();
        if (n > 0)
            last_work = t;
        if (k > 0 || t - last_work < UCX_SPIN_US) {
            /* A mutex is not fair: a yield alone can starve a requester
             * whose wait ended (woken, or at its deadline) for as long as
             * data streams in. With someone waiting, pause now and then. */
            if (busy_since == INT64_MAX)
                busy_since = t;
            bool pause = ul->waiters > 0 && t - busy_since >= UCX_FAIR_US;
            pthread_mutex_unlock(&ul->lock);
            if (pause) {
                struct timespec ts = {0, UCX_PAUSE_NS};
                nanosleep(&ts, NULL);
                busy_since = ucx_now_us();
            } else {
                sched_yield();
            }
            pthread_mutex_lock(&ul->lock);
            continue;
        }
        busy_since = INT64_MAX;
        int timeout = -1, busy = 0;
        struct pollfd pfd[2 + UCX_EPS];
        nfds_t npfd = 0;
        pfd[npfd++] = (struct pollfd){.fd = ul->wake_fd, .events = POLLIN};
        if (!ul->wakeup) {
            timeout = 1; /* no wakeup support: poll gently */
        } else {
            busy = ucp_worker_arm(ul->sw) == UCS_ERR_BUSY;
            pfd[npfd++] = (struct pollfd){.fd = ul->sefd, .events = POLLIN};
            for (int s = 0; s < UCX_EPS && !busy; s++) {
                if (ul->eps[s].w == NULL)
                    continue;
                busy = ucp_worker_arm(ul->eps[s].w) == UCS_ERR_BUSY;
                pfd[npfd++] =
                    (struct pollfd){.fd = ul->eps[s].efd, .events = POLLIN};
            }
        }
        if (busy && n > 0)
            continue;
        if (busy)
            timeout = 1; /* events UCX will not progress yet: no spin */
        pthread_mutex_unlock(&ul->lock);
        if (poll(pfd, npfd, timeout) > 0 && (pfd[0].revents & POLLIN)) {
            uint64_t v;
            (void)!read(ul->wake_fd, &v, sizeof(v));
        }
        pthread_mutex_lock(&ul->lock);
    }
    llmdd__ucx_teardown(ul, true);
    pthread_mutex_unlock(&ul->lock);
    llmdd__link_put(link);
    return NULL;
}

/* Starts the progress thread (once); it holds a link reference. */
int
llmdd__ucx_progress_start(ucx_link *ul)
{
    llmdd__link *link = ul->link;

    llmdd__link_hold(link);
    pthread_mutex_lock(&ul->lock);
    ul->progress_started = true;
    pthread_mutex_unlock(&ul->lock);
    if (llmdd__spawn(link->dd, llmdd__ucx_progress_main, ul) != 0) {
        pthread_mutex_lock(&ul->lock);
        ul->progress_started = false;
        pthread_mutex_unlock(&ul->lock);
        llmdd__link_put(link);
        return -1;
    }
    return 0;
}
