/*
 * The loop transport: both instances live in this process, so a transfer is
 * a memcpy between their registered memory. The handshake proves that the
 * peer is in this process (llmdd__own_conn_peer); it is then found by its
 * random instance nonce in the process-wide instance list, and its cache is
 * pinned by a reference for the copy, exactly as a remote server would pin
 * it.
 */
#include <string.h>
#include <unistd.h>

#include "core/copy.h"
#include "core/internal.h"

/*
 * Only a peer proven to be in this process: what it says about its pid and
 * instance is a claim any client can copy from our own HELLO_REPLY, and a
 * link that believed it would turn our pushes into writes to ourselves.
 */
static bool
loop_reaches(const llmdd__link *link)
{
    bool found;

    if (!link->peer.local)
        return false;
    llmdd__instances_lock();
    llmdd *peer = llmdd__instance_find(link->peer.nonce);
    found = peer != NULL && peer != link->dd;
    llmdd__instances_unlock();
    return found;
}

static llmdd_status
loop_link_init(llmdd__link *link, bool client)
{
    (void)client;
    link->tp = link; /* no state; non-NULL marks it set up */
    return LLM_SUCCESS;
}

static void
loop_link_shutdown(llmdd__link *link)
{
    (void)link;
}

static void
loop_link_fini(llmdd__link *link)
{
    link->tp = NULL;
}

/* Pins the peer's cache span; the peer cannot finish finalize meanwhile. */
static llmdd_status
loop_pin(const llmdd__link *link, int64_t id, uint32_t first, uint32_t count,
         const uint64_t *offs, const uint64_t *lens, size_t nruns,
         llmdd **peer_out, llmdd__cache **out)
{
    llmdd_status st = LLM_NOT_YET_LINK;

    llmdd__instances_lock();
    llmdd *peer = llmdd__instance_find(link->peer.nonce);
    if (peer != NULL)
        st = llmdd__cache_get_span(peer, id, first, count, offs, lens, NULL,
                                   NULL, nruns, out);
    llmdd__instances_unlock();
    *peer_out = peer;
    return st;
}

static llmdd_status
loop_query(llmdd__link *link, int64_t id, int64_t deadline_ms,
           llmdd_cache_desc *desc, uint32_t *batch_dim, void **priv)
{
    llmdd__cache *c;
    llmdd *peer;
    uint64_t zero = 0;
    llmdd_status st;

    (void)deadline_ms;
    st = loop_pin(link, id, 0, 1, &zero, &zero, 0, &peer, &c);
    if (st != LLM_SUCCESS)
        return st;
    *desc = c->desc;
    *batch_dim = c->slot.batch_dim;
    *priv = NULL;
    llmdd__cache_put(peer, c);
    return LLM_SUCCESS;
}

static llmdd_status
loop_xfer(llmdd__link *link, const llmdd__xfer *x)
{
    llmdd__cache *c;
    llmdd *peer;
    llmdd_status st;
    uint64_t zero = 0;

    /* The core checked every run against the peer's desc; the pin checks
     * the tensors again and that the cache still exists. */
    st = loop_pin(link, x->remote->id, x->remote_first, x->count, &zero, &zero,
                  0, &peer, &c);
    if (st == LLM_PARAM_INVALID)
        st = LLM_KV_CACHE_NOT_EXIST;
    if (st != LLM_SUCCESS)
        return st;
    if (!llmdd__xfer_fits(x, c->tensor_size)) {
        llmdd__cache_put(peer, c);
        return LLM_PARAM_INVALID;
    }
    /* One batch; the engine keeps memmove for runs that overlap (both
     * instances may map the same memory). */
    llmdd__copy_batch b;
    llmdd__copy_begin(&b, llmdd__xfer_bytes(x), llmdd__xfer_dst_bytes(x));
    for (uint32_t t = 0; t < x->count; t++) {
        uint8_t *rbase = (uint8_t *)(uintptr_t)c->addrs[x->remote_first + t];
        uint8_t *src = x->write ? x->local[t] : rbase;
        uint8_t *dst = x->write ? rbase : x->local[t];
        for (size_t i = 0; i < llmdd__xfer_nruns(x); i++) {
            llmdd__run2 r = llmdd__xfer_run(x, i);
            llmdd__copy_2d(&b, dst + r.dst_off, r.dst_stride, src + r.src_off,
                           r.src_stride, r.len, r.count);
        }
    }
    llmdd__copy_end(&b);
    llmdd__cache_put(peer, c);
    return LLM_SUCCESS;
}

const llmdd_transport_ops llmdd__loop_ops = {
    .name = "loop",
    .strided = true,
    .reaches = loop_reaches,
    .link_init = loop_link_init,
    .link_shutdown = loop_link_shutdown,
    .link_fini = loop_link_fini,
    .accept_conn = NULL,
    .query = loop_query,
    .remote_free = NULL,
    .xfer = loop_xfer,
};
