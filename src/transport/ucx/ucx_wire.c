#include "transport/ucx/ucx_wire.h"

#include <stdlib.h>
#include <string.h>

#include "core/layout.h"

/* Bounded little-endian writer and reader; a short buffer sets err. */
typedef struct {
    uint8_t *p;
    size_t len, cap;
    bool err;
} uw_wbuf;

typedef struct {
    const uint8_t *p;
    size_t len, pos;
    bool err;
} uw_rbuf;

static void
uw_put_bytes(uw_wbuf *w, const void *src, size_t n)
{
    if (w->err || w->cap - w->len < n) {
        w->err = true;
        return;
    }
    if (n > 0)
        memcpy(w->p + w->len, src, n);
    w->len += n;
}

static void
uw_put_u32(uw_wbuf *w, uint32_t v)
{
    uint8_t b[4] = {(uint8_t)v, (uint8_t)(v >> 8), (uint8_t)(v >> 16),
                    (uint8_t)(v >> 24)};
    uw_put_bytes(w, b, 4);
}

static void
uw_put_u64(uw_wbuf *w, uint64_t v)
{
    uw_put_u32(w, (uint32_t)v);
    uw_put_u32(w, (uint32_t)(v >> 32));
}

static size_t
uw_wdone(const uw_wbuf *w)
{
    return w->err ? 0 : w->len;
}

/* Returns a pointer to the next n bytes, or NULL (and err) when short. */
static const uint8_t *
uw_get_span(uw_rbuf *r, size_t n)
{
    if (r->err || r->len - r->pos < n) {
        r->err = true;
        return NULL;
    }
    const uint8_t *p = r->p + r->pos;
    r->pos += n;
    return p;
}

static uint32_t
uw_get_u32(uw_rbuf *r)
{
    const uint8_t *b = uw_get_span(r, 4);

    if (b == NULL)
        return 0;
    return (uint32_t)b[0] | (uint32_t)b[1] << 8 | (uint32_t)b[2] << 16 |
           (uint32_t)b[3] << 24;
}

static uint64_t
uw_get_u64(uw_rbuf *r)
{
    uint64_t lo = uw_get_u32(r);
    return lo | (uint64_t)uw_get_u32(r) << 32;
}

static size_t
uw_left(const uw_rbuf *r)
{
    return r->err ? 0 : r->len - r->pos;
}

/* The payload must be consumed exactly: trailing bytes are an error. */
static int
uw_rdone(const uw_rbuf *r)
{
    return r->err || r->pos != r->len ? -1 : 0;
}

size_t
llmdd__ucx_hello_encode(uint32_t status, const llmdd__ucx_hello *h,
                        uint8_t *buf, size_t cap)
{
    uw_wbuf w = {.p = buf, .cap = cap};

    uw_put_u32(&w, status);
    if (status == LLM_SUCCESS) {
        if (h->addr_len == 0 || h->addr_len > LLMDD_UCX_ADDR_MAX)
            return 0;
        uw_put_u32(&w, h->version);
        uw_put_u32(&w, h->ucp_version);
        uw_put_u32(&w, h->flags);
        uw_put_u64(&w, h->key);
        uw_put_u32(&w, h->addr_len);
        uw_put_bytes(&w, h->addr, h->addr_len);
    }
    return uw_wdone(&w);
}

int
llmdd__ucx_hello_decode(const uint8_t *buf, size_t len, uint32_t *status,
                        llmdd__ucx_hello *out)
{
    uw_rbuf r = {.p = buf, .len = len};
    llmdd__ucx_hello h;
    uint32_t st = uw_get_u32(&r);

    memset(&h, 0, sizeof(h));
    if (st == LLM_SUCCESS) {
        h.version = uw_get_u32(&r);
        h.ucp_version = uw_get_u32(&r);
        h.flags = uw_get_u32(&r);
        h.key = uw_get_u64(&r);
        h.addr_len = uw_get_u32(&r);
        if (h.addr_len == 0 || h.addr_len > LLMDD_UCX_ADDR_MAX)
            return -1;
        h.addr = uw_get_span(&r, h.addr_len);
    }
    if (uw_rdone(&r) != 0)
        return -1;
    *status = st;
    *out = h;
    return 0;
}

size_t
llmdd__ucx_amreq_encode(const llmdd__ucx_amreq *m, uint8_t *buf, size_t cap)
{
    uw_wbuf w = {.p = buf, .cap = cap};

    uw_put_u64(&w, m->key);
    uw_put_u64(&w, m->tag);
    uw_put_u64(&w, m->addr);
    uw_put_u64(&w, m->len);
    return uw_wdone(&w);
}

int
llmdd__ucx_amreq_decode(const uint8_t *buf, size_t len, llmdd__ucx_amreq *out)
{
    uw_rbuf r = {.p = buf, .len = len};
    llmdd__ucx_amreq m;

    m.key = uw_get_u64(&r);
    m.tag = uw_get_u64(&r);
    m.addr = uw_get_u64(&r);
    m.len = uw_get_u64(&r);
    if (uw_rdone(&r) != 0 || m.len == 0 || m.len > LLMDD_UCX_AM_CHUNK ||
        m.addr + m.len < m.addr)
        return -1;
    *out = m;
    return 0;
}

size_t
llmdd__ucx_ping_encode(uint64_t key, uint8_t *buf, size_t cap)
{
    uw_wbuf w = {.p = buf, .cap = cap};

    uw_put_u64(&w, key);
    return uw_wdone(&w);
}

int
llmdd__ucx_ping_decode(const uint8_t *buf, size_t len, uint64_t *key)
{
    uw_rbuf r = {.p = buf, .len = len};
    uint64_t k = uw_get_u64(&r);

    if (uw_rdone(&r) != 0)
        return -1;
    *key = k;
    return 0;
}

size_t
llmdd__ucx_req_encode(uint64_t seq, int64_t id, uint8_t *buf, size_t cap)
{
    uw_wbuf w = {.p = buf, .cap = cap};

    uw_put_u64(&w, seq);
    uw_put_u64(&w, (uint64_t)id);
    return uw_wdone(&w);
}

int
llmdd__ucx_req_decode(const uint8_t *buf, size_t len, uint64_t *seq,
                      int64_t *id)
{
    uw_rbuf r = {.p = buf, .len = len};
    uint64_t s = uw_get_u64(&r);
    int64_t i = (int64_t)uw_get_u64(&r);

    if (uw_rdone(&r) != 0)
        return -1;
    *seq = s;
    *id = i;
    return 0;
}

size_t
llmdd__ucx_ack_encode(uint64_t seq, uint32_t status, uint8_t *buf, size_t cap)
{
    uw_wbuf w = {.p = buf, .cap = cap};

    uw_put_u64(&w, seq);
    uw_put_u32(&w, status);
    return uw_wdone(&w);
}

int
llmdd__ucx_ack_decode(const uint8_t *buf, size_t len, uint64_t *seq,
                      uint32_t *status)
{
    uw_rbuf r = {.p = buf, .len = len};
    uint64_t s = uw_get_u64(&r);
    uint32_t st = uw_get_u32(&r);

    if (uw_rdone(&r) != 0)
        return -1;
    *seq = s;
    *status = st;
    return 0;
}

/* Fixed part of a successful reply: seq, status, desc header, nregions. */
#define UW_REPLY_FIXED (8 + 4 + 16 + 4)
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
    uw_wbuf w = {.p = buf, .cap = cap};
    const llmdd_cache_desc *d = &m->desc;

    uw_put_u64(&w, m->seq);
    uw_put_u32(&w, m->status);
    if (m->status != LLM_SUCCESS)
        return uw_wdone(&w);
    if (d->num_dims > LLMDD_MAX_DIMS)
        return 0;
    uw_put_u32(&w, (uint32_t)d->placement);
    uw_put_u32(&w, d->num_tensors);
    uw_put_u32(&w, (uint32_t)d->data_type);
    uw_put_u32(&w, d->num_dims);
    for (uint32_t i = 0; i < d->num_dims; i++)
        uw_put_u64(&w, (uint64_t)d->shape[i]);
    uw_put_u32(&w, m->nregions);
    for (uint32_t i = 0; i < m->nregions; i++) {
        const llmdd__ucx_region *g = &m->regions[i];
        if (g->rkey_len == 0 || g->rkey_len > LLMDD_UCX_RKEY_MAX)
            return 0;
        uw_put_u64(&w, g->base);
        uw_put_u64(&w, g->len);
        uw_put_u32(&w, g->rkey_len);
        uw_put_bytes(&w, g->rkey, g->rkey_len);
    }
    for (uint32_t t = 0; t < d->num_tensors; t++) {
        uw_put_u64(&w, m->taddr[t]);
        uw_put_u32(&w, m->treg[t]);
    }
    return uw_wdone(&w);
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
uw_decode_desc(uw_rbuf *r, llmdd_cache_desc *d, uint64_t *tsize)
{
    uint64_t stride;

    memset(d, 0, sizeof(*d));
    d->placement = (llmdd_placement)uw_get_u32(r);
    d->num_tensors = uw_get_u32(r);
    d->data_type = (llmdd_data_type)uw_get_u32(r);
    d->num_dims = uw_get_u32(r);
    if (r->err || d->num_dims < 1 || d->num_dims > LLMDD_MAX_DIMS)
        return -1;
    for (uint32_t i = 0; i < d->num_dims; i++)
        d->shape[i] = (int64_t)uw_get_u64(r);
    if (r->err || llmdd__desc_check(d, tsize, &stride) != LLM_SUCCESS)
        return -1;
    return 0;
}

int
llmdd__ucx_reply_decode(const uint8_t *buf, size_t len, llmdd__ucx_reply *out)
{
    uw_rbuf r = {.p = buf, .len = len};
    llmdd__ucx_reply m;
    uint64_t tsize;

    memset(&m, 0, sizeof(m));
    m.seq = uw_get_u64(&r);
    m.status = uw_get_u32(&r);
    if (m.status != LLM_SUCCESS)
        goto done;
    if (uw_decode_desc(&r, &m.desc, &tsize) != 0)
        return -1;
    m.nregions = uw_get_u32(&r);
    /* Counts are checked against the bytes present before any allocation. */
    if (r.err || m.nregions == 0 || m.nregions > m.desc.num_tensors ||
        m.nregions > uw_left(&r) / UW_REGION_FIXED ||
        m.desc.num_tensors > uw_left(&r) / UW_TENSOR_LEN)
        return -1;
    m.regions = calloc(m.nregions, sizeof(*m.regions));
    m.taddr = calloc(m.desc.num_tensors, sizeof(*m.taddr));
    m.treg = calloc(m.desc.num_tensors, sizeof(*m.treg));
    if (m.regions == NULL || m.taddr == NULL || m.treg == NULL)
        goto err;
    for (uint32_t i = 0; i < m.nregions; i++) {
        llmdd__ucx_region *g = &m.regions[i];
        uint64_t end;
        g->base = uw_get_u64(&r);
        g->len = uw_get_u64(&r);
        g->rkey_len = uw_get_u32(&r);
        if (r.err || g->len == 0 ||
            __builtin_add_overflow(g->base, g->len, &end) ||
            g->rkey_len == 0 || g->rkey_len > LLMDD_UCX_RKEY_MAX)
            goto err;
        g->rkey = uw_get_span(&r, g->rkey_len);
    }
    for (uint32_t t = 0; t < m.desc.num_tensors; t++) {
        uint64_t end;
        m.taddr[t] = uw_get_u64(&r);
        m.treg[t] = uw_get_u32(&r);
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
    if (uw_rdone(&r) != 0)
        goto err;
    *out = m;
    return 0;
err:
    llmdd__ucx_reply_free(&m);
    return -1;
}
