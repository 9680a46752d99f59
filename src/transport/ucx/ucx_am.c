/*
 * The ucx transport's active messages (docs/rdma.md): where UCX would only
 * emulate RMA, a GET or PUT is a message the serving side answers with DATA
 * or ACK; PING and PONG check an endpoint. ucx.c describes the design.
 */
#include "transport/ucx/ucx_int.h"

/* ---- Active-message transfers (docs/rdma.md). ---- */

/*
 * Where UCX would emulate RMA (no RDMA device on one side), a GET or PUT is
 * an active message to the peer's serve worker, answered by DATA or ACK on
 * the reply endpoint. UCX 1.13 aborts a process whose emulated get reply or
 * put completion meets a failed endpoint; active messages complete with an
 * error status instead. The serving side also checks every address against
 * the caches it described to this peer, which the emulation does not.
 */

/* The region of a cache described to this peer that holds [addr, addr +
 * len), or NULL. Lock held. */
static ucx_reg *
ucx_reg_holding(ucx_link *ul, uint64_t addr, uint64_t len)
{
    for (ucx_reg *r = ul->regs; r != NULL; r = r->next) {
        if (!r->sent || r->removed)
            continue; /* not yet described, or being taken back */
        for (uint32_t i = 0; i < r->nregions; i++)
            if (addr >= r->base[i] && addr - r->base[i] <= r->len[i] &&
                len <= r->len[i] - (addr - r->base[i]))
                return r;
    }
    return NULL;
}

/* A reply on its way: its header must outlive the send. */
typedef struct {
    uint8_t hdr[LLMDD_UCX_AMREP_SIZE];
    ucx_link *ul;
    ucx_reg *reg; /* DATA: read from it until the send completes */
} ucx_amrep;

static void
ucx_amrep_done(ucx_amrep *rep)
{
    if (rep->reg != NULL && --rep->reg->sending == 0)
        pthread_cond_broadcast(&rep->ul->cond);
    free(rep);
}

static void
ucx_amrep_sent(void *req, ucs_status_t status, void *user_data)
{
    (void)status; /* a dead requester: nothing to tell it */
    ucx_amrep_done(user_data);
    ucp_request_free(req);
}

/* The peer broke the protocol: drop the link (lock held, in progress). */
static void
ucx_am_broken(ucx_link *ul, const char *what)
{
    if (!ul->failed && !ul->down)
        log_error("ucx: cluster %llu sent a malformed %s",
                  (unsigned long long)ucx_cluster(ul), what);
    ul->failed = true;
    pthread_cond_broadcast(&ul->cond);
}

/* A request without our key: not from our peer (UCX authenticates no one
 * who connects to a worker). Dropped; logged once per link. Lock held. */
static void
ucx_am_stranger(ucx_link *ul, const char *what)
{
    if (!ul->stranger_seen)
        log_warn("ucx: cluster %llu: dropped a %s without the link's key",
                 (unsigned long long)ucx_cluster(ul), what);
    ul->stranger_seen = true;
}

/* Serving side: a GET or PUT from the peer. Lock held (in progress). */
static ucs_status_t
ucx_am_serve(ucx_link *ul, bool put, const void *header, size_t hlen,
             void *data, size_t len, const ucp_am_recv_param_t *prm)
{
    llmdd__ucx_amreq m;

    if (llmdd__ucx_amreq_decode(header, hlen, &m) != 0 ||
        !(prm->recv_attr & UCP_AM_RECV_ATTR_FIELD_REPLY_EP) ||
        (prm->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV) ||
        len != (put ? m.len : 0)) {
        ucx_am_broken(ul, put ? "PUT" : "GET");
        return UCS_OK;
    }
    if (m.key != ul->key) {
        ucx_am_stranger(ul, put ? "PUT" : "GET");
        return UCS_OK;
    }
    ucx_reg *r = ul->down ? NULL : ucx_reg_holding(ul, m.addr, m.len);
    ucx_amrep *rep = calloc(1, sizeof(*rep));
    if (rep == NULL)
        return UCS_OK; /* the requester times out */
    rep->ul = ul;
    if (r != NULL && put)
        memcpy((void *)(uintptr_t)m.addr, data, m.len);
    if (r != NULL && !put) {
        rep->reg = r;
        r->sending++;
    }
    llmdd_status st = r != NULL  ? LLM_SUCCESS
                      : ul->down ? LLM_NOT_YET_LINK
                                 : LLM_KV_CACHE_NOT_EXIST;
    llmdd__ucx_ack_encode(m.tag, st, rep->hdr, sizeof(rep->hdr));
    llmdd__metrics_served(ul->link->dd, ul->link->ops, put, st, m.len);
    ucp_request_param_t p = {
        .op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS | UCP_OP_ATTR_FIELD_CALLBACK |
                        UCP_OP_ATTR_FIELD_USER_DATA,
        .flags = UCP_AM_SEND_FLAG_EAGER,
        .cb.send = ucx_amrep_sent,
        .user_data = rep,
    };
    ucs_status_ptr_t sp = ucp_am_send_nbx(
        prm->reply_ep, put ? LLMDD_UCX_AM_ACK : LLMDD_UCX_AM_DATA, rep->hdr,
        sizeof(rep->hdr), rep->reg != NULL ? (void *)(uintptr_t)m.addr : NULL,
        rep->reg != NULL ? m.len : 0, &p);
    if (!UCS_PTR_IS_PTR(sp))
        ucx_amrep_done(rep);
    return UCS_OK;
}

ucs_status_t
llmdd__ucx_am_get(void *arg, const void *header, size_t hlen, void *data,
                  size_t len, const ucp_am_recv_param_t *prm)
{
    return ucx_am_serve(arg, false, header, hlen, data, len, prm);
}

/* Serving side: PING, answered on the same lane as the wireup reply, so a
 * PONG tells the requester that reply is gone (llmdd__ucx_ep_wire). */
ucs_status_t
llmdd__ucx_am_ping(void *arg, const void *header, size_t hlen, void *data,
                   size_t len, const ucp_am_recv_param_t *prm)
{
    ucp_request_param_t p = {.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS,
                             .flags = UCP_AM_SEND_FLAG_EAGER};
    ucx_link *ul = arg;
    int64_t key;

    (void)data;
    if (llmdd__wire_i64_decode(header, hlen, &key) != 0 || len != 0 ||
        !(prm->recv_attr & UCP_AM_RECV_ATTR_FIELD_REPLY_EP)) {
        ucx_am_broken(ul, "PING");
        return UCS_OK;
    }
    if ((uint64_t)key != ul->key) {
        ucx_am_stranger(ul, "PING");
        return UCS_OK;
    }
    ucs_status_ptr_t sp =
        ucp_am_send_nbx(prm->reply_ep, LLMDD_UCX_AM_PONG, NULL, 0, NULL, 0, &p);
    if (UCS_PTR_IS_PTR(sp))
        ucp_request_free(sp); /* released once sent */
    return UCS_OK;
}

ucs_status_t
llmdd__ucx_am_put(void *arg, const void *header, size_t hlen, void *data,
                  size_t len, const ucp_am_recv_param_t *prm)
{
    return ucx_am_serve(arg, true, header, hlen, data, len, prm);
}

/* Requesting side: DATA or ACK for one of slot e's operations. A tag no
 * operation holds is an aborted transfer's answer: dropped. Lock held. */
static ucs_status_t
ucx_am_answer(ucx_ep *e, bool data_msg, const void *header, size_t hlen,
              void *data, size_t len, const ucp_am_recv_param_t *prm)
{
    uint64_t tag;
    uint32_t st;

    if (llmdd__ucx_ack_decode(header, hlen, &tag, &st) != 0) {
        ucx_am_broken(e->ul, data_msg ? "DATA" : "ACK");
        return UCS_OK;
    }
    if (e->ops == NULL || tag == 0 || e->ops[tag & (UCX_WINDOW - 1)].tag != tag)
        return UCS_OK;
    ucx_amop *op = &e->ops[tag & (UCX_WINDOW - 1)];
    ucx_xstate *xs = op->xs;
    if (st == LLM_SUCCESS) {
        if (data_msg != (op->dst != NULL) ||
            (prm->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV) ||
            len != (data_msg ? op->len : 0)) {
            ucx_am_broken(e->ul, data_msg ? "DATA" : "ACK");
            st = LLM_FAILED;
        } else if (data_msg) {
            memcpy(op->dst, data, len);
        }
    } else if (st != LLM_KV_CACHE_NOT_EXIST && st != LLM_NOT_YET_LINK) {
        st = LLM_FAILED;
    }
    if (st != LLM_SUCCESS && xs->refused == LLM_SUCCESS)
        xs->refused = (llmdd_status)st;
    xs->bytes -= op->len;
    op->tag = 0;
    e->free_ops[e->nfree++] = (uint16_t)(op - e->ops);
    if (--xs->outstanding <= xs->wake_at)
        pthread_cond_broadcast(&e->ul->cond);
    return UCS_OK;
}

ucs_status_t
llmdd__ucx_am_data(void *arg, const void *header, size_t hlen, void *data,
                   size_t len, const ucp_am_recv_param_t *prm)
{
    return ucx_am_answer(arg, true, header, hlen, data, len, prm);
}

ucs_status_t
llmdd__ucx_am_ack(void *arg, const void *header, size_t hlen, void *data,
                  size_t len, const ucp_am_recv_param_t *prm)
{
    return ucx_am_answer(arg, false, header, hlen, data, len, prm);
}

ucs_status_t
llmdd__ucx_am_pong(void *arg, const void *header, size_t hlen, void *data,
                   size_t len, const ucp_am_recv_param_t *prm)
{
    ucx_ep *e = arg;

    (void)header;
    (void)data;
    (void)prm;
    if (hlen != 0 || len != 0) {
        ucx_am_broken(e->ul, "PONG");
        return UCS_OK;
    }
    e->ponged = true;
    pthread_cond_broadcast(&e->ul->cond);
    return UCS_OK;
}

/* Installs handlers on a worker: ids[i] runs cbs[i] with arg. */
ucs_status_t
llmdd__ucx_am_install(ucp_worker_h w, const unsigned *ids,
                      const ucp_am_recv_callback_t *cbs, int n, void *arg)
{
    for (int i = 0; i < n; i++) {
        ucp_am_handler_param_t hp = {
            .field_mask = UCP_AM_HANDLER_PARAM_FIELD_ID |
                          UCP_AM_HANDLER_PARAM_FIELD_FLAGS |
                          UCP_AM_HANDLER_PARAM_FIELD_CB |
                          UCP_AM_HANDLER_PARAM_FIELD_ARG,
            .id = ids[i],
            .flags = UCP_AM_FLAG_WHOLE_MSG,
            .cb = cbs[i],
            .arg = arg,
        };
        ucs_status_t st = ucp_worker_set_am_recv_handler(w, &hp);
        if (st != UCS_OK)
            return st;
    }
    return UCS_OK;
}

/* Gives back every operation of xs still waiting for an answer: whatever
 * comes for them later is dropped. Lock held. */
void
llmdd__ucx_am_forget(ucx_ep *e, ucx_xstate *xs)
{
    for (int i = 0; e->ops != NULL && i < UCX_WINDOW; i++) {
        if (e->ops[i].tag == 0 || e->ops[i].xs != xs)
            continue;
        e->ops[i].tag = 0;
        e->free_ops[e->nfree++] = (uint16_t)i;
        xs->outstanding--;
        xs->bytes -= e->ops[i].len;
    }
}
