#include "ctrl/wire.h"

#include <string.h>

/* Bounded little-endian writer and reader; a short buffer sets err. */
typedef struct {
    uint8_t *p;
    size_t len, cap;
    bool err;
} wbuf;

typedef struct {
    const uint8_t *p;
    size_t len, pos;
    bool err;
} rbuf;

static void
put_bytes(wbuf *w, const void *src, size_t n)
{
    if (w->err || w->cap - w->len < n) {
        w->err = true;
        return;
    }
    memcpy(w->p + w->len, src, n);
    w->len += n;
}

static void
put_u8(wbuf *w, uint8_t v)
{
    put_bytes(w, &v, 1);
}

static void
put_u32(wbuf *w, uint32_t v)
{
    uint8_t b[4] = {(uint8_t)v, (uint8_t)(v >> 8), (uint8_t)(v >> 16),
                    (uint8_t)(v >> 24)};
    put_bytes(w, b, 4);
}

static void
put_u64(wbuf *w, uint64_t v)
{
    put_u32(w, (uint32_t)v);
    put_u32(w, (uint32_t)(v >> 32));
}

static void
put_name(wbuf *w, const char *s)
{
    size_t n = strnlen(s, LLMDD_WIRE_NAME_MAX + 1);

    if (n > LLMDD_WIRE_NAME_MAX) {
        w->err = true;
        return;
    }
    put_u8(w, (uint8_t)n);
    put_bytes(w, s, n);
}

static void
get_bytes(rbuf *r, void *dst, size_t n)
{
    if (r->err || r->len - r->pos < n) {
        r->err = true;
        memset(dst, 0, n);
        return;
    }
    memcpy(dst, r->p + r->pos, n);
    r->pos += n;
}

static uint8_t
get_u8(rbuf *r)
{
    uint8_t v;

    get_bytes(r, &v, 1);
    return v;
}

static uint32_t
get_u32(rbuf *r)
{
    uint8_t b[4];

    get_bytes(r, b, 4);
    return (uint32_t)b[0] | (uint32_t)b[1] << 8 | (uint32_t)b[2] << 16 |
           (uint32_t)b[3] << 24;
}

static uint64_t
get_u64(rbuf *r)
{
    uint64_t lo = get_u32(r);
    return lo | (uint64_t)get_u32(r) << 32;
}

/* A length-prefixed name of printable ASCII, at most the cap. */
static void
get_name(rbuf *r, char *out)
{
    uint8_t n = get_u8(r);

    if (n > LLMDD_WIRE_NAME_MAX) {
        r->err = true;
        n = 0;
    }
    get_bytes(r, out, n);
    out[r->err ? 0 : n] = '\0';
    for (uint8_t i = 0; i < n && !r->err; i++)
        if (out[i] < 0x21 || out[i] > 0x7e)
            r->err = true;
}

/* The payload must be consumed exactly: trailing bytes are an error. */
static int
rdone(const rbuf *r)
{
    return r->err || r->pos != r->len ? -1 : 0;
}

static size_t
wdone(const wbuf *w)
{
    return w->err ? 0 : w->len;
}

int
llmdd__wire_frame_decode(const uint8_t *buf, llmdd__frame *out)
{
    rbuf r = {.p = buf, .len = LLMDD_WIRE_HDR_LEN};
    uint32_t magic = get_u32(&r);
    uint32_t vt = get_u32(&r); /* version and type, 16 bits each */
    uint16_t version = (uint16_t)vt;
    uint16_t type = (uint16_t)(vt >> 16);
    uint32_t len = get_u32(&r);

    if (magic != LLMDD_WIRE_MAGIC || version != LLMDD_WIRE_VERSION ||
        type == 0 || type >= WMSG_TYPE_MAX || len > LLMDD_WIRE_MAX_PAYLOAD)
        return -1;
    out->type = type;
    out->len = len;
    return 0;
}

void
llmdd__wire_frame_encode(uint8_t *buf, uint16_t type, uint32_t len)
{
    wbuf w = {.p = buf, .cap = LLMDD_WIRE_HDR_LEN};

    put_u32(&w, LLMDD_WIRE_MAGIC);
    put_u32(&w, (uint32_t)LLMDD_WIRE_VERSION | (uint32_t)type << 16);
    put_u32(&w, len);
}

size_t
llmdd__wire_hello_encode(const llmdd__hello *m, uint8_t *buf, size_t cap)
{
    wbuf w = {.p = buf, .cap = cap};

    put_u8(&w, m->kind);
    if (m->kind == CONN_CTRL) {
        put_u64(&w, m->cluster_id);
        put_u32(&w, m->role);
        put_u32(&w, m->pid);
        put_bytes(&w, m->boot_id, sizeof(m->boot_id));
        put_u64(&w, m->nonce);
        put_u8(&w, m->auth);
        put_bytes(&w, m->cnonce, sizeof(m->cnonce));
        put_name(&w, m->transport);
    } else {
        put_bytes(&w, m->token, sizeof(m->token));
        put_u32(&w, m->flags);
    }
    return wdone(&w);
}

int
llmdd__wire_hello_decode(const uint8_t *buf, size_t len, llmdd__hello *out)
{
    rbuf r = {.p = buf, .len = len};
    llmdd__hello m;

    memset(&m, 0, sizeof(m));
    m.kind = get_u8(&r);
    if (m.kind == CONN_CTRL) {
        m.cluster_id = get_u64(&r);
        m.role = get_u32(&r);
        m.pid = get_u32(&r);
        get_bytes(&r, m.boot_id, sizeof(m.boot_id));
        m.nonce = get_u64(&r);
        m.auth = get_u8(&r);
        get_bytes(&r, m.cnonce, sizeof(m.cnonce));
        get_name(&r, m.transport);
        if (m.auth > 1)
            return -1;
    } else if (m.kind == CONN_DATA) {
        get_bytes(&r, m.token, sizeof(m.token));
        m.flags = get_u32(&r);
    } else {
        return -1;
    }
    if (rdone(&r) != 0)
        return -1;
    *out = m;
    return 0;
}

size_t
llmdd__wire_hello_reply_encode(const llmdd__hello_reply *m, uint8_t *buf,
                               size_t cap)
{
    wbuf w = {.p = buf, .cap = cap};

    put_u32(&w, m->status);
    put_u64(&w, m->cluster_id);
    put_u32(&w, m->role);
    put_u32(&w, m->pid);
    put_bytes(&w, m->boot_id, sizeof(m->boot_id));
    put_u64(&w, m->nonce);
    put_u8(&w, m->auth);
    put_bytes(&w, m->snonce, sizeof(m->snonce));
    put_bytes(&w, m->mac, sizeof(m->mac));
    put_name(&w, m->transport);
    return wdone(&w);
}

int
llmdd__wire_hello_reply_decode(const uint8_t *buf, size_t len,
                               llmdd__hello_reply *out)
{
    rbuf r = {.p = buf, .len = len};
    llmdd__hello_reply m;

    m.status = get_u32(&r);
    m.cluster_id = get_u64(&r);
    m.role = get_u32(&r);
    m.pid = get_u32(&r);
    get_bytes(&r, m.boot_id, sizeof(m.boot_id));
    m.nonce = get_u64(&r);
    m.auth = get_u8(&r);
    get_bytes(&r, m.snonce, sizeof(m.snonce));
    get_bytes(&r, m.mac, sizeof(m.mac));
    get_name(&r, m.transport);
    if (rdone(&r) != 0 || m.auth > 1)
        return -1;
    *out = m;
    return 0;
}

size_t
llmdd__wire_confirm_encode(const llmdd__confirm *m, uint8_t *buf, size_t cap)
{
    wbuf w = {.p = buf, .cap = cap};

    put_name(&w, m->transport);
    put_bytes(&w, m->mac, sizeof(m->mac));
    return wdone(&w);
}

int
llmdd__wire_confirm_decode(const uint8_t *buf, size_t len, llmdd__confirm *out)
{
    rbuf r = {.p = buf, .len = len};
    llmdd__confirm m;

    get_name(&r, m.transport);
    get_bytes(&r, m.mac, sizeof(m.mac));
    if (rdone(&r) != 0)
        return -1;
    *out = m;
    return 0;
}

size_t
llmdd__wire_result_encode(const llmdd__result *m, uint8_t *buf, size_t cap)
{
    wbuf w = {.p = buf, .cap = cap};

    put_u32(&w, m->status);
    put_bytes(&w, m->token, sizeof(m->token));
    return wdone(&w);
}

int
llmdd__wire_result_decode(const uint8_t *buf, size_t len, llmdd__result *out)
{
    rbuf r = {.p = buf, .len = len};
    llmdd__result m;

    m.status = get_u32(&r);
    get_bytes(&r, m.token, sizeof(m.token));
    if (rdone(&r) != 0)
        return -1;
    *out = m;
    return 0;
}

size_t
llmdd__wire_key_query_encode(const llmdd__key_query *m, uint8_t *buf,
                             size_t cap)
{
    wbuf w = {.p = buf, .cap = cap};

    if (m->key_len == 0 || m->key_len > LLMDD_WIRE_KEY_MAX)
        return 0;
    put_u64(&w, m->seq);
    put_u32(&w, m->key_len);
    put_bytes(&w, m->key, m->key_len);
    return wdone(&w);
}

int
llmdd__wire_key_query_decode(const uint8_t *buf, size_t len,
                             llmdd__key_query *out)
{
    rbuf r = {.p = buf, .len = len};
    llmdd__key_query m;

    memset(&m, 0, sizeof(m));
    m.seq = get_u64(&r);
    m.key_len = get_u32(&r);
    if (r.err || m.key_len == 0 || m.key_len > LLMDD_WIRE_KEY_MAX)
        return -1;
    get_bytes(&r, m.key, m.key_len);
    if (rdone(&r) != 0)
        return -1;
    *out = m;
    return 0;
}

size_t
llmdd__wire_key_reply_encode(const llmdd__key_reply *m, uint8_t *buf,
                             size_t cap)
{
    wbuf w = {.p = buf, .cap = cap};

    put_u64(&w, m->seq);
    put_u32(&w, m->status);
    put_u64(&w, (uint64_t)m->cache_id);
    put_u32(&w, m->batch_index);
    return wdone(&w);
}

int
llmdd__wire_key_reply_decode(const uint8_t *buf, size_t len,
                             llmdd__key_reply *out)
{
    rbuf r = {.p = buf, .len = len};
    llmdd__key_reply m;

    m.seq = get_u64(&r);
    m.status = get_u32(&r);
    m.cache_id = (int64_t)get_u64(&r);
    m.batch_index = get_u32(&r);
    if (rdone(&r) != 0)
        return -1;
    *out = m;
    return 0;
}

size_t
llmdd__wire_u32_encode(uint32_t v, uint8_t *buf, size_t cap)
{
    wbuf w = {.p = buf, .cap = cap};

    put_u32(&w, v);
    return wdone(&w);
}

int
llmdd__wire_u32_decode(const uint8_t *buf, size_t len, uint32_t *out)
{
    rbuf r = {.p = buf, .len = len};
    uint32_t v = get_u32(&r);

    if (rdone(&r) != 0)
        return -1;
    *out = v;
    return 0;
}

size_t
llmdd__wire_i64_encode(int64_t v, uint8_t *buf, size_t cap)
{
    wbuf w = {.p = buf, .cap = cap};

    put_u64(&w, (uint64_t)v);
    return wdone(&w);
}

int
llmdd__wire_i64_decode(const uint8_t *buf, size_t len, int64_t *out)
{
    rbuf r = {.p = buf, .len = len};
    uint64_t v = get_u64(&r);

    if (rdone(&r) != 0)
        return -1;
    *out = (int64_t)v;
    return 0;
}

size_t
llmdd__wire_desc_encode(uint32_t status, const llmdd_cache_desc *d,
                        uint8_t *buf, size_t cap)
{
    wbuf w = {.p = buf, .cap = cap};

    put_u32(&w, status);
    if (status == LLM_SUCCESS) {
        put_u32(&w, (uint32_t)d->placement);
        put_u32(&w, d->num_tensors);
        put_u32(&w, (uint32_t)d->data_type);
        put_u32(&w, d->num_dims);
        for (uint32_t i = 0; i < d->num_dims && i < LLMDD_MAX_DIMS; i++)
            put_u64(&w, (uint64_t)d->shape[i]);
    }
    return wdone(&w);
}

int
llmdd__wire_desc_decode(const uint8_t *buf, size_t len, uint32_t *status,
                        llmdd_cache_desc *out)
{
    rbuf r = {.p = buf, .len = len};
    llmdd_cache_desc d;
    uint32_t st = get_u32(&r);

    memset(&d, 0, sizeof(d));
    if (st == LLM_SUCCESS) {
        d.placement = (llmdd_placement)get_u32(&r);
        d.num_tensors = get_u32(&r);
        d.data_type = (llmdd_data_type)get_u32(&r);
        d.num_dims = get_u32(&r);
        if (d.num_dims < 1 || d.num_dims > LLMDD_MAX_DIMS)
            return -1;
        for (uint32_t i = 0; i < d.num_dims; i++)
            d.shape[i] = (int64_t)get_u64(&r);
    }
    if (rdone(&r) != 0)
        return -1;
    *status = st;
    *out = d;
    return 0;
}

size_t
llmdd__wire_read_reply_encode(uint32_t status, uint64_t total, uint8_t *buf,
                              size_t cap)
{
    wbuf w = {.p = buf, .cap = cap};

    put_u32(&w, status);
    put_u64(&w, total);
    return wdone(&w);
}

int
llmdd__wire_read_reply_decode(const uint8_t *buf, size_t len,
                              uint32_t *status, uint64_t *total)
{
    rbuf r = {.p = buf, .len = len};
    uint32_t st = get_u32(&r);
    uint64_t t = get_u64(&r);

    if (rdone(&r) != 0)
        return -1;
    *status = st;
    *total = t;
    return 0;
}

size_t
llmdd__wire_rw_encode(const llmdd__rw_req *m, uint8_t *buf, size_t cap)
{
    wbuf w = {.p = buf, .cap = cap};

    put_u64(&w, (uint64_t)m->cache_id);
    put_u32(&w, m->first);
    put_u32(&w, m->count);
    put_u32(&w, m->nruns);
    for (uint32_t i = 0; i < m->nruns; i++) {
        put_u64(&w, m->offs[i]);
        put_u64(&w, m->lens[i]);
    }
    return wdone(&w);
}

int
llmdd__wire_rw_decode(const uint8_t *buf, size_t len, llmdd__rw_req *out)
{
    rbuf r = {.p = buf, .len = len};
    uint64_t sum = 0;

    out->cache_id = (int64_t)get_u64(&r);
    out->first = get_u32(&r);
    out->count = get_u32(&r);
    out->nruns = get_u32(&r);
    if (r.err || out->count == 0 || out->nruns == 0 ||
        out->nruns > LLMDD_WIRE_MAX_RUNS ||
        r.len - r.pos != (size_t)out->nruns * 16)
        return -1;
    for (uint32_t i = 0; i < out->nruns; i++) {
        out->offs[i] = get_u64(&r);
        out->lens[i] = get_u64(&r);
        if (out->lens[i] == 0 ||
            __builtin_add_overflow(sum, out->lens[i], &sum))
            return -1;
    }
    if (rdone(&r) != 0 ||
        __builtin_mul_overflow(sum, (uint64_t)out->count, &out->total) ||
        out->total > INT64_MAX)
        return -1;
    return 0;
}
