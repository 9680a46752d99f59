#include "base/codec.h"

void
llmdd__put_name(llmdd__wbuf *w, const char *s, size_t max)
{
    size_t n = strnlen(s, max + 1);

    if (n > max || n > UINT8_MAX) {
        w->err = true;
        return;
    }
    llmdd__put_u8(w, (uint8_t)n);
    llmdd__put_bytes(w, s, n);
}

void
llmdd__get_name(llmdd__rbuf *r, char *out, size_t max)
{
    size_t n = llmdd__get_u8(r);

    if (n > max) {
        r->err = true;
        n = 0;
    }
    llmdd__get_bytes(r, out, n);
    out[r->err ? 0 : n] = '\0';
    for (size_t i = 0; i < n && !r->err; i++)
        if (out[i] < 0x21 || out[i] > 0x7e)
            r->err = true;
}

void
llmdd__put_desc(llmdd__wbuf *w, const llmdd_cache_desc *d, uint32_t batch_dim)
{
    if (d->num_dims > LLMDD_MAX_DIMS || batch_dim >= d->num_dims) {
        w->err = true;
        return;
    }
    llmdd__put_u32(w, (uint32_t)d->placement);
    llmdd__put_u32(w, d->num_tensors);
    llmdd__put_u32(w, (uint32_t)d->data_type);
    llmdd__put_u32(w, d->num_dims);
    for (uint32_t i = 0; i < d->num_dims; i++)
        llmdd__put_i64(w, d->shape[i]);
    llmdd__put_u32(w, batch_dim);
}

void
llmdd__get_desc(llmdd__rbuf *r, llmdd_cache_desc *out, uint32_t *batch_dim)
{
    memset(out, 0, sizeof(*out));
    *batch_dim = 0;
    out->placement = (llmdd_placement)llmdd__get_u32(r);
    out->num_tensors = llmdd__get_u32(r);
    out->data_type = (llmdd_data_type)llmdd__get_u32(r);
    out->num_dims = llmdd__get_u32(r);
    if (r->err || out->num_dims < 1 || out->num_dims > LLMDD_MAX_DIMS) {
        r->err = true;
        out->num_dims = 0;
        return;
    }
    for (uint32_t i = 0; i < out->num_dims; i++)
        out->shape[i] = llmdd__get_i64(r);
    uint32_t bd = llmdd__get_u32(r);
    if (!r->err && bd >= out->num_dims)
        r->err = true;
    if (!r->err)
        *batch_dim = bd;
}
