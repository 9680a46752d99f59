#include "transport/ucx/ucx_wire.h"

#include <stdlib.h>
#include <string.h>

#include "base/codec.h"
#include "core/layout.h"

size_t
llmdd__ucx_hello_encode(uint32_t status, const llmdd__ucx_hello *h,
                        uint8_t *buf, size_t cap)
{
    llmdd__wbuf w = LLMDD__WBUF(buf, cap);

    llmdd__put_u32(&w, status);
    if (status == LLM_SUCCESS) {
        if (h->addr_len == 0 || h->addr_len > LLMDD_UCX_ADDR_MAX)
            return 0;
        llmdd__put_u32(&w, h->version);
        llmdd__put_u32(&w, h->ucp_version);
        llmdd__put_u32(&w, h->flags);
        llmdd__put_u64(&w, h->key);
        llmdd__put_u32(&w, h->addr_len);
        llmdd__put_bytes(&w, h->addr, h->addr_len);
    }
    return llmdd__wdone(&w);
}

int
llmdd__ucx_hello_decode(const uint8_t *buf, size_t len, uint32_t *status,
                        llmdd__ucx_hello *out)
{
    llmdd__rbuf r = LLMDD__RBUF(buf, len);
    llmdd__ucx_hello h;
    uint32_t st = llmdd__get_u32(&r);

    memset(&h, 0, sizeof(h));
    if (st == LLM_SUCCESS) {
        h.version = llmdd__get_u32(&r);
        h.ucp_version = llmdd__get_u32(&r);
        h.flags = llmdd__get_u32(&r);
        h.key = llmdd__get_u64(&r);
        h.addr_len = llmdd__get_u32(&r);
        if (h.addr_len == 0 || h.addr_len > LLMDD_UCX_ADDR_MAX)
            return -1;
        h.addr = llmdd__get_span(&r, h.addr_len);
    }
    if (llmdd__rdone(&r) != 0)
        return -1;
    *status = st;
    *out = h;
    return 0;
}

size_t
llmdd__ucx_amreq_encode(const llmdd__ucx_amreq *m, uint8_t *buf, size_t cap)
{
    llmdd__wbuf w = LLMDD__WBUF(buf, cap);

    llmdd__put_u64(&w, m->key);
    llmdd__put_u64(&w, m->tag);
    llmdd__put_u64(&w, m->addr);
    llmdd__put_u64(&w, m->len);
    return llmdd__wdone(&w);
}

int
llmdd__ucx_amreq_decode(const uint8_t *buf, size_t len, llmdd__ucx_amreq *out)
{
    llmdd__rbuf r = LLMDD__RBUF(buf, len);
    llmdd__ucx_amreq m;

    m.key = llmdd__get_u64(&r);
    m.tag = llmdd__get_u64(&r);
    m.addr = llmdd__get_u64(&r);
    m.len = llmdd__get_u64(&r);
    if (llmdd__rdone(&r) != 0 || m.len == 0 || m.len > LLMDD_UCX_AM_CHUNK ||
        m.addr + m.len < m.addr)
        return -1;
    *out = m;
    return 0;
}

size_t
llmdd__ucx_req_encode(uint64_t seq, int64_t id, uint8_t *buf, size_t cap)
{
    llmdd__wbuf w = LLMDD__WBUF(buf, cap);

    llmdd__put_u64(&w, seq);
    llmdd__put_u64(&w, (uint64_t)id);
    return llmdd__wdone(&w);
}

int
llmdd__ucx_req_decode(const uint8_t *buf, size_t len, uint64_t *seq,
                      int64_t *id)
{
    llmdd__rbuf r = LLMDD__RBUF(buf, len);
    uint64_t s = llmdd__get_u64(&r);
    int64_t i = (int64_t)llmdd__get_u64(&r);

    if (llmdd__rdone(&r) != 0)
        return -1;
    *seq = s;
    *id = i;
    return 0;
}

size_t
llmdd__ucx_ack_encode(uint64_t seq, uint32_t status, uint8_t *buf, size_t cap)
{
    llmdd__wbuf w = LLMDD__WBUF(buf, cap);

    llmdd__put_u64(&w, seq);
    llmdd__put_u32(&w, status);
    return llmdd__wdone(&w);
}

int
llmdd__ucx_ack_decode(const uint8_t *buf, size_t len, uint64_t *seq,
                      uint32_t *status)
{
    llmdd__rbuf r = LLMDD__RBUF(buf, len);
    uint64_t s = llmdd__get_u64(&r);
    uint32_t st = llmdd__get_u32(&r);

    if (llmdd__rdone(&r) != 0)
        return -1;
    *seq = s;
    *status = st;
    return 0;
}

int
llmdd__ucx_seq_peek(const uint8_t *buf, size_t len, uint64_t *seq)
{
    llmdd__rbuf r = LLMDD__RBUF(buf, len);
    uint64_t s = llmdd__get_u64(&r);

    if (r.err)
        return -1;
    *seq = s;
    return 0;
}

/* Fixed part of a successful reply: seq, status, desc header and batch
 * dimension, nregions. */
#define UW_REPLY_FIXED (8 + 4 + 16 + 4 + 4)
#define UW_REGION_FIXED (8 + 8 + 4)
#define UW_TENSOR_LEN (8 + 4)

size_t
llmdd__ucx_reply_size(const llmdd__ucx_reply *m)
{
    size_t n = UW_REPLY_FIXED;

    if (m->status != LLM_SUCCESS)
        return 8 + 4;
    if (m->desc.num_dims > LLMDD_MAX_DIMS)
        return 0;
    n += 8 * (size_t)m->desc.num_dims;
    for (uint32_t i = 0; i < m->nregions; i++)
        if (__builtin_add_overflow(n, UW_REGION_FIXED + m->regions[i].rkey_len,
                                   &n))
            return 0;
    size_t t;
    if (__builtin_mul_overflow((size_t)m->desc.num_tensors,
                               (size_t)UW_TENSOR_LEN, &t) ||
        __builtin_add_overflow(n, t, &n))
        return 0;
    return n;
}

size_t
llmdd__ucx_reply_encode(const llmdd__ucx_reply *m, uint8_t *buf, size_t cap)
{
    llmdd__wbuf w = LLMDD__WBUF(buf, cap);
    const llmdd_cache_desc *d = &m->desc;

    llmdd__put_u64(&w, m->seq);
    llmdd__put_u32(&w, m->status);
    if (m->status != LLM_SUCCESS)
        return llmdd__wdone(&w);
    if (d->num_dims > LLMDD_MAX_DIMS)
        return 0;
    llmdd__put_desc(&w, d, m->batch_dim);
    llmdd__put_u32(&w, m->nregions);
    for (uint32_t i = 0; i < m->nregions; i++) {
        const llmdd__ucx_region *g = &m->regions[i];
        if (g->rkey_len == 0 || g->rkey_len > LLMDD_UCX_RKEY_MAX)
            return 0;
        llmdd__put_u64(&w, g->base);
        llmdd__put_u64(&w, g->len);
        llmdd__put_u32(&w, g->rkey_len);
        llmdd__put_bytes(&w, g->rkey, g->rkey_len);
    }
    for (uint32_t t = 0; t < d->num_tensors; t++) {
        llmdd__put_u64(&w, m->taddr[t]);
        llmdd__put_u32(&w, m->treg[t]);
    }
    return llmdd__wdone(&w);
}

void
llmdd__ucx_reply_free(llmdd__ucx_reply *m)
{
    if (m == NULL)
        return;
    free(m->regions);
    free(m->taddr);
    free(m->treg);
    m->regions = NULL;
    m->taddr = NULL;
    m->treg = NULL;
}

static int
uw_decode_desc(llmdd__rbuf *r, llmdd_cache_desc *d, uint32_t *batch_dim,
               uint64_t *tsize)
{
    uint64_t stride;

    llmdd__get_desc(r, d, batch_dim);
    if (r->err || llmdd__desc_check(d, tsize, &stride) != LLM_SUCCESS)
        return -1;
    return 0;
}

int
llmdd__ucx_reply_decode(const uint8_t *buf, size_t len, llmdd__ucx_reply *out)
{
    llmdd__rbuf r = LLMDD__RBUF(buf, len);
    llmdd__ucx_reply m;
    uint64_t tsize;

    memset(&m, 0, sizeof(m));
    m.seq = llmdd__get_u64(&r);
    m.status = llmdd__get_u32(&r);
    if (m.status != LLM_SUCCESS)
        goto done;
    if (uw_decode_desc(&r, &m.desc, &m.batch_dim, &tsize) != 0)
        return -1;
    m.nregions = llmdd__get_u32(&r);
    /* Counts are checked against the bytes present before any allocation. */
    if (r.err || m.nregions == 0 || m.nregions > m.desc.num_tensors ||
        m.nregions > llmdd__get_left(&r) / UW_REGION_FIXED ||
        m.desc.num_tensors > llmdd__get_left(&r) / UW_TENSOR_LEN)
        return -1;
    m.regions = calloc(m.nregions, sizeof(*m.regions));
    m.taddr = calloc(m.desc.num_tensors, sizeof(*m.taddr));
    m.treg = calloc(m.desc.num_tensors, sizeof(*m.treg));
    if (m.regions == NULL || m.taddr == NULL || m.treg == NULL)
        goto err;
    for (uint32_t i = 0; i < m.nregions; i++) {
        llmdd__ucx_region *g = &m.regions[i];
        uint64_t end;
        g->base = llmdd__get_u64(&r);
        g->len = llmdd__get_u64(&r);
        g->rkey_len = llmdd__get_u32(&r);
        if (r.err || g->len == 0 ||
            __builtin_add_overflow(g->base, g->len, &end) ||
            g->rkey_len == 0 || g->rkey_len > LLMDD_UCX_RKEY_MAX)
            goto err;
        g->rkey = llmdd__get_span(&r, g->rkey_len);
    }
    for (uint32_t t = 0; t < m.desc.num_tensors; t++) {
        uint64_t end;
        m.taddr[t] = llmdd__get_u64(&r);
        m.treg[t] = llmdd__get_u32(&r);
        if (r.err || m.treg[t] >= m.nregions)
            goto err;
        const llmdd__ucx_region *g = &m.regions[m.treg[t]];
        /* The region does not wrap (checked above), so base + len is safe. */
        if (m.taddr[t] < g->base ||
            __builtin_add_overflow(m.taddr[t], tsize, &end) ||
            end > g->base + g->len)
            goto err;
    }
done:
    if (llmdd__rdone(&r) != 0)
        goto err;
    *out = m;
    return 0;
err:
    llmdd__ucx_reply_free(&m);
    return -1;
}
