#include "base/wire.h"

#include <string.h>

#include "base/codec.h"

int
llmdd__wire_frame_decode(const uint8_t *buf, llmdd__frame *out)
{
    llmdd__rbuf r = LLMDD__RBUF(buf, LLMDD_WIRE_HDR_LEN);
    uint32_t magic = llmdd__get_u32(&r);
    uint16_t version = llmdd__get_u16(&r);
    uint16_t type = llmdd__get_u16(&r);
    uint32_t len = llmdd__get_u32(&r);

    if (magic != LLMDD_WIRE_MAGIC || version != LLMDD_WIRE_VERSION ||
        type == 0 || type >= WMSG_TYPE_MAX || len > LLMDD_WIRE_MAX_PAYLOAD)
        return -1;
    out->type = type;
    out->len = len;
    return 0;
}

bool
llmdd__wire_frame_foreign(const uint8_t *buf, uint16_t *version)
{
    llmdd__rbuf r = LLMDD__RBUF(buf, LLMDD_WIRE_HDR_LEN);
    uint32_t magic = llmdd__get_u32(&r);
    uint16_t v = llmdd__get_u16(&r);

    if (magic != LLMDD_WIRE_MAGIC || v == LLMDD_WIRE_VERSION)
        return false;
    *version = v;
    return true;
}

void
llmdd__wire_frame_encode(uint8_t *buf, uint16_t type, uint32_t len)
{
    llmdd__wbuf w = LLMDD__WBUF(buf, LLMDD_WIRE_HDR_LEN);

    llmdd__put_u32(&w, LLMDD_WIRE_MAGIC);
    llmdd__put_u16(&w, LLMDD_WIRE_VERSION);
    llmdd__put_u16(&w, type);
    llmdd__put_u32(&w, len);
}

static void
terms_put(llmdd__wbuf *w, const llmdd__link_terms *t)
{
    llmdd__put_u32(w, t->hb_ms);
    llmdd__put_u32(w, t->notify_window);
    llmdd__put_u32(w, t->conns_max);
}

/* A peer's terms are claims: each must lie in its documented range. */
static int
terms_get(llmdd__rbuf *r, llmdd__link_terms *t, bool server)
{
    t->hb_ms = llmdd__get_u32(r);
    t->notify_window = llmdd__get_u32(r);
    t->conns_max = llmdd__get_u32(r);
    if (t->hb_ms != 0 &&
        (t->hb_ms < LLMDD_WIRE_HB_MIN_MS || t->hb_ms > LLMDD_WIRE_HB_MAX_MS))
        return -1;
    if (t->notify_window < 1 || t->notify_window > LLMDD_WIRE_WINDOW_MAX)
        return -1;
    if (server ? t->conns_max < 2 || t->conns_max > LLMDD_WIRE_CONNS_MAX
               : t->conns_max != 0)
        return -1;
    return 0;
}

size_t
llmdd__wire_hello_encode(const llmdd__hello *m, uint8_t *buf, size_t cap)
{
    llmdd__wbuf w = LLMDD__WBUF(buf, cap);

    llmdd__put_u8(&w, m->kind);
    if (m->kind == CONN_CTRL) {
        llmdd__put_u64(&w, m->cluster_id);
        llmdd__put_u32(&w, m->role);
        llmdd__put_u32(&w, m->pid);
        llmdd__put_bytes(&w, m->boot_id, sizeof(m->boot_id));
        llmdd__put_u64(&w, m->nonce);
        llmdd__put_u8(&w, m->auth);
        llmdd__put_bytes(&w, m->cnonce, sizeof(m->cnonce));
        llmdd__put_name(&w, m->transport, LLMDD_WIRE_NAME_MAX);
        terms_put(&w, &m->terms);
    } else {
        llmdd__put_bytes(&w, m->token, sizeof(m->token));
        llmdd__put_u32(&w, m->flags);
    }
    return llmdd__wdone(&w);
}

int
llmdd__wire_hello_decode(const uint8_t *buf, size_t len, llmdd__hello *out)
{
    llmdd__rbuf r = LLMDD__RBUF(buf, len);
    llmdd__hello m;

    memset(&m, 0, sizeof(m));
    m.kind = llmdd__get_u8(&r);
    if (m.kind == CONN_CTRL) {
        m.cluster_id = llmdd__get_u64(&r);
        m.role = llmdd__get_u32(&r);
        m.pid = llmdd__get_u32(&r);
        llmdd__get_bytes(&r, m.boot_id, sizeof(m.boot_id));
        m.nonce = llmdd__get_u64(&r);
        m.auth = llmdd__get_u8(&r);
        llmdd__get_bytes(&r, m.cnonce, sizeof(m.cnonce));
        llmdd__get_name(&r, m.transport, LLMDD_WIRE_NAME_MAX);
        if (m.auth > 1 || terms_get(&r, &m.terms, false) != 0)
            return -1;
    } else if (m.kind == CONN_DATA) {
        llmdd__get_bytes(&r, m.token, sizeof(m.token));
        m.flags = llmdd__get_u32(&r);
    } else {
        return -1;
    }
    if (llmdd__rdone(&r) != 0)
        return -1;
    *out = m;
    return 0;
}

size_t
llmdd__wire_hello_reply_encode(const llmdd__hello_reply *m, uint8_t *buf,
                               size_t cap)
{
    llmdd__wbuf w = LLMDD__WBUF(buf, cap);

    llmdd__put_u32(&w, m->status);
    llmdd__put_u64(&w, m->cluster_id);
    llmdd__put_u32(&w, m->role);
    llmdd__put_u32(&w, m->pid);
    llmdd__put_bytes(&w, m->boot_id, sizeof(m->boot_id));
    llmdd__put_u64(&w, m->nonce);
    llmdd__put_u8(&w, m->auth);
    llmdd__put_bytes(&w, m->snonce, sizeof(m->snonce));
    llmdd__put_bytes(&w, m->mac, sizeof(m->mac));
    llmdd__put_name(&w, m->transport, LLMDD_WIRE_NAME_MAX);
    terms_put(&w, &m->terms);
    return llmdd__wdone(&w);
}

int
llmdd__wire_hello_reply_decode(const uint8_t *buf, size_t len,
                               llmdd__hello_reply *out)
{
    llmdd__rbuf r = LLMDD__RBUF(buf, len);
    llmdd__hello_reply m;

    m.status = llmdd__get_u32(&r);
    m.cluster_id = llmdd__get_u64(&r);
    m.role = llmdd__get_u32(&r);
    m.pid = llmdd__get_u32(&r);
    llmdd__get_bytes(&r, m.boot_id, sizeof(m.boot_id));
    m.nonce = llmdd__get_u64(&r);
    m.auth = llmdd__get_u8(&r);
    llmdd__get_bytes(&r, m.snonce, sizeof(m.snonce));
    llmdd__get_bytes(&r, m.mac, sizeof(m.mac));
    llmdd__get_name(&r, m.transport, LLMDD_WIRE_NAME_MAX);
    /* A refusal carries no terms worth checking; an answer must. */
    if (terms_get(&r, &m.terms, true) != 0 && m.status == LLM_SUCCESS)
        return -1;
    if (llmdd__rdone(&r) != 0 || m.auth > 1)
        return -1;
    *out = m;
    return 0;
}

size_t
llmdd__wire_confirm_encode(const llmdd__confirm *m, uint8_t *buf, size_t cap)
{
    llmdd__wbuf w = LLMDD__WBUF(buf, cap);

    llmdd__put_name(&w, m->transport, LLMDD_WIRE_NAME_MAX);
    llmdd__put_bytes(&w, m->mac, sizeof(m->mac));
    return llmdd__wdone(&w);
}

int
llmdd__wire_confirm_decode(const uint8_t *buf, size_t len, llmdd__confirm *out)
{
    llmdd__rbuf r = LLMDD__RBUF(buf, len);
    llmdd__confirm m;

    llmdd__get_name(&r, m.transport, LLMDD_WIRE_NAME_MAX);
    llmdd__get_bytes(&r, m.mac, sizeof(m.mac));
    if (llmdd__rdone(&r) != 0)
        return -1;
    *out = m;
    return 0;
}

size_t
llmdd__wire_result_encode(const llmdd__result *m, uint8_t *buf, size_t cap)
{
    llmdd__wbuf w = LLMDD__WBUF(buf, cap);

    llmdd__put_u32(&w, m->status);
    llmdd__put_bytes(&w, m->token, sizeof(m->token));
    return llmdd__wdone(&w);
}

int
llmdd__wire_result_decode(const uint8_t *buf, size_t len, llmdd__result *out)
{
    llmdd__rbuf r = LLMDD__RBUF(buf, len);
    llmdd__result m;

    m.status = llmdd__get_u32(&r);
    llmdd__get_bytes(&r, m.token, sizeof(m.token));
    if (llmdd__rdone(&r) != 0)
        return -1;
    *out = m;
    return 0;
}

size_t
llmdd__wire_key_query_encode(const llmdd__key_query *m, uint8_t *buf,
                             size_t cap)
{
    llmdd__wbuf w = LLMDD__WBUF(buf, cap);

    if (m->key_len == 0 || m->key_len > LLMDD_WIRE_KEY_MAX)
        return 0;
    llmdd__put_u64(&w, m->seq);
    llmdd__put_u32(&w, m->key_len);
    llmdd__put_bytes(&w, m->key, m->key_len);
    return llmdd__wdone(&w);
}

int
llmdd__wire_key_query_decode(const uint8_t *buf, size_t len,
                             llmdd__key_query *out)
{
    llmdd__rbuf r = LLMDD__RBUF(buf, len);
    llmdd__key_query m;

    memset(&m, 0, sizeof(m));
    m.seq = llmdd__get_u64(&r);
    m.key_len = llmdd__get_u32(&r);
    if (r.err || m.key_len == 0 || m.key_len > LLMDD_WIRE_KEY_MAX)
        return -1;
    llmdd__get_bytes(&r, m.key, m.key_len);
    if (llmdd__rdone(&r) != 0)
        return -1;
    *out = m;
    return 0;
}

size_t
llmdd__wire_key_reply_encode(const llmdd__key_reply *m, uint8_t *buf,
                             size_t cap)
{
    llmdd__wbuf w = LLMDD__WBUF(buf, cap);

    llmdd__put_u64(&w, m->seq);
    llmdd__put_u32(&w, m->status);
    llmdd__put_u64(&w, (uint64_t)m->cache_id);
    llmdd__put_u32(&w, m->batch_index);
    return llmdd__wdone(&w);
}

int
llmdd__wire_key_reply_decode(const uint8_t *buf, size_t len,
                             llmdd__key_reply *out)
{
    llmdd__rbuf r = LLMDD__RBUF(buf, len);
    llmdd__key_reply m;

    m.seq = llmdd__get_u64(&r);
    m.status = llmdd__get_u32(&r);
    m.cache_id = (int64_t)llmdd__get_u64(&r);
    m.batch_index = llmdd__get_u32(&r);
    if (llmdd__rdone(&r) != 0)
        return -1;
    *out = m;
    return 0;
}

size_t
llmdd__wire_u32_encode(uint32_t v, uint8_t *buf, size_t cap)
{
    llmdd__wbuf w = LLMDD__WBUF(buf, cap);

    llmdd__put_u32(&w, v);
    return llmdd__wdone(&w);
}

int
llmdd__wire_u32_decode(const uint8_t *buf, size_t len, uint32_t *out)
{
    llmdd__rbuf r = LLMDD__RBUF(buf, len);
    uint32_t v = llmdd__get_u32(&r);

    if (llmdd__rdone(&r) != 0)
        return -1;
    *out = v;
    return 0;
}

size_t
llmdd__wire_i64_encode(int64_t v, uint8_t *buf, size_t cap)
{
    llmdd__wbuf w = LLMDD__WBUF(buf, cap);

    llmdd__put_u64(&w, (uint64_t)v);
    return llmdd__wdone(&w);
}

int
llmdd__wire_i64_decode(const uint8_t *buf, size_t len, int64_t *out)
{
    llmdd__rbuf r = LLMDD__RBUF(buf, len);
    uint64_t v = llmdd__get_u64(&r);

    if (llmdd__rdone(&r) != 0)
        return -1;
    *out = (int64_t)v;
    return 0;
}

size_t
llmdd__wire_desc_encode(uint32_t status, const llmdd_cache_desc *d,
                        uint32_t batch_dim, uint8_t *buf, size_t cap)
{
    llmdd__wbuf w = LLMDD__WBUF(buf, cap);

    llmdd__put_u32(&w, status);
    if (status == LLM_SUCCESS)
        llmdd__put_desc(&w, d, batch_dim);
    return llmdd__wdone(&w);
}

int
llmdd__wire_desc_decode(const uint8_t *buf, size_t len, uint32_t *status,
                        llmdd_cache_desc *out, uint32_t *batch_dim)
{
    llmdd__rbuf r = LLMDD__RBUF(buf, len);
    llmdd_cache_desc d;
    uint32_t st = llmdd__get_u32(&r), bd = 0;

    memset(&d, 0, sizeof(d));
    if (st == LLM_SUCCESS)
        llmdd__get_desc(&r, &d, &bd);
    if (llmdd__rdone(&r) != 0)
        return -1;
    *status = st;
    *out = d;
    *batch_dim = bd;
    return 0;
}

size_t
llmdd__wire_read_reply_encode(uint32_t status, uint64_t total, uint8_t *buf,
                              size_t cap)
{
    llmdd__wbuf w = LLMDD__WBUF(buf, cap);

    llmdd__put_u32(&w, status);
    llmdd__put_u64(&w, total);
    return llmdd__wdone(&w);
}

int
llmdd__wire_read_reply_decode(const uint8_t *buf, size_t len,
                              uint32_t *status, uint64_t *total)
{
    llmdd__rbuf r = LLMDD__RBUF(buf, len);
    uint32_t st = llmdd__get_u32(&r);
    uint64_t t = llmdd__get_u64(&r);

    if (llmdd__rdone(&r) != 0)
        return -1;
    *status = st;
    *total = t;
    return 0;
}

size_t
llmdd__wire_rw_encode(const llmdd__rw_req *m, uint8_t *buf, size_t cap)
{
    llmdd__wbuf w = LLMDD__WBUF(buf, cap);

    llmdd__put_u64(&w, (uint64_t)m->cache_id);
    llmdd__put_u32(&w, m->first);
    llmdd__put_u32(&w, m->count);
    llmdd__put_u32(&w, m->nruns);
    for (uint32_t i = 0; i < m->nruns; i++) {
        bool strided = m->cnts != NULL && m->cnts[i] > 1;
        llmdd__put_u64(&w, m->offs[i]);
        llmdd__put_u64(&w, m->lens[i] | (strided ? LLMDD_WIRE_RUN_STRIDED : 0));
        if (strided) {
            llmdd__put_u64(&w, m->cnts[i]);
            llmdd__put_u64(&w, m->strides[i]);
        }
    }
    return llmdd__wdone(&w);
}

int
llmdd__wire_rw_decode(const uint8_t *buf, size_t len, llmdd__rw_req *out)
{
    llmdd__rbuf r = LLMDD__RBUF(buf, len);
    uint64_t sum = 0, bytes;

    out->cache_id = (int64_t)llmdd__get_u64(&r);
    out->first = llmdd__get_u32(&r);
    out->count = llmdd__get_u32(&r);
    out->nruns = llmdd__get_u32(&r);
    if (r.err || out->count == 0 || out->nruns == 0 ||
        out->nruns > LLMDD_WIRE_MAX_RUNS ||
        r.len - r.pos < (size_t)out->nruns * 16)
        return -1;
    for (uint32_t i = 0; i < out->nruns; i++) {
        out->offs[i] = llmdd__get_u64(&r);
        uint64_t l = llmdd__get_u64(&r);
        out->lens[i] = l & ~LLMDD_WIRE_RUN_STRIDED;
        out->cnts[i] = 1;
        out->strides[i] = 0;
        if (l & LLMDD_WIRE_RUN_STRIDED) {
            out->cnts[i] = llmdd__get_u64(&r);
            out->strides[i] = llmdd__get_u64(&r);
            if (out->cnts[i] < 2)
                return -1;
        }
        if (r.err || out->lens[i] == 0 ||
            __builtin_mul_overflow(out->lens[i], out->cnts[i], &bytes) ||
            __builtin_add_overflow(sum, bytes, &sum))
            return -1;
    }
    if (llmdd__rdone(&r) != 0 ||
        __builtin_mul_overflow(sum, (uint64_t)out->count, &out->total) ||
        out->total > INT64_MAX)
        return -1;
    return 0;
}

size_t
llmdd__wire_layout_query_encode(const llmdd__layout_query *m, uint8_t *buf,
                                size_t cap)
{
    llmdd__wbuf w = LLMDD__WBUF(buf, cap);

    llmdd__put_u64(&w, m->seq);
    llmdd__put_u64(&w, (uint64_t)m->cache_id);
    return llmdd__wdone(&w);
}

int
llmdd__wire_layout_query_decode(const uint8_t *buf, size_t len,
                                llmdd__layout_query *out)
{
    llmdd__rbuf r = LLMDD__RBUF(buf, len);
    llmdd__layout_query m;

    m.seq = llmdd__get_u64(&r);
    m.cache_id = (int64_t)llmdd__get_u64(&r);
    if (llmdd__rdone(&r) != 0)
        return -1;
    *out = m;
    return 0;
}

size_t
llmdd__wire_layout_reply_encode(const llmdd__layout_reply *m, uint8_t *buf,
                                size_t cap)
{
    llmdd__wbuf w = LLMDD__WBUF(buf, cap);
    const llmdd_kv_layout *l = &m->layout;

    if (l->num_dims > LLMDD_KV_MAX_DIMS)
        return 0;
    llmdd__put_u64(&w, m->seq);
    llmdd__put_u32(&w, m->status);
    llmdd__put_u8(&w, (uint8_t)l->num_dims);
    for (int i = 0; i < LLMDD_KV_MAX_DIMS; i++)
        llmdd__put_u8(&w, i < (int)l->num_dims ? (uint8_t)l->order[i] : 0);
    llmdd__put_u32(&w, l->block_size);
    llmdd__put_u32(&w, l->num_heads);
    llmdd__put_u32(&w, l->head_first);
    llmdd__put_u32(&w, l->total_heads);
    llmdd__put_u32(&w, l->head_bytes);
    llmdd__put_u32(&w, l->num_parts);
    llmdd__put_u64(&w, l->compat_tag);
    return llmdd__wdone(&w);
}

int
llmdd__wire_layout_reply_decode(const uint8_t *buf, size_t len,
                                llmdd__layout_reply *out)
{
    llmdd__rbuf r = LLMDD__RBUF(buf, len);
    llmdd__layout_reply m;
    llmdd_kv_layout *l = &m.layout;

    memset(&m, 0, sizeof(m));
    m.seq = llmdd__get_u64(&r);
    m.status = llmdd__get_u32(&r);
    l->num_dims = llmdd__get_u8(&r);
    uint8_t dims[LLMDD_KV_MAX_DIMS];
    for (int i = 0; i < LLMDD_KV_MAX_DIMS; i++)
        dims[i] = llmdd__get_u8(&r);
    l->block_size = llmdd__get_u32(&r);
    l->num_heads = llmdd__get_u32(&r);
    l->head_first = llmdd__get_u32(&r);
    l->total_heads = llmdd__get_u32(&r);
    l->head_bytes = llmdd__get_u32(&r);
    l->num_parts = llmdd__get_u32(&r);
    l->compat_tag = llmdd__get_u64(&r);
    if (llmdd__rdone(&r) != 0)
        return -1;
    if (m.status == LLM_SUCCESS) {
        if (l->num_dims != 4 && l->num_dims != 5)
            return -1;
        for (int i = 0; i < LLMDD_KV_MAX_DIMS; i++) {
            bool used = i < (int)l->num_dims;
            if (used ? dims[i] < LLMDD_KV_DIM_BLOCK ||
                           dims[i] > LLMDD_KV_DIM_BYTES
                     : dims[i] != 0)
                return -1;
            l->order[i] = used ? (llmdd_kv_dim)dims[i] : (llmdd_kv_dim)0;
        }
    } else if (l->num_dims != 0) {
        return -1;
    } else {
        for (int i = 0; i < LLMDD_KV_MAX_DIMS; i++)
            if (dims[i] != 0)
                return -1;
    }
    *out = m;
    return 0;
}
