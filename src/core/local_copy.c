/*
 * Local copies (llmdd_copy_kv_cache, llmdd_copy_kv_blocks): both caches
 * belong to this instance; no link, no transport. Each run of each tensor is
 * one batch of the copy engine (copy.h).
 */
#include <stdlib.h>

#include "core/copy.h"
#include "core/internal.h"
#include "core/slices.h"

static llmdd_status
instance_ready(llmdd *dd)
{
    return dd == NULL ? LLM_PARAM_INVALID : llmdd__ready(dd);
}

/* Local copies: both caches looked up, referenced for the copy. */
static llmdd_status
copy_get(llmdd *dd, const llmdd_cache *src, const llmdd_cache *dst,
         llmdd__cache **s, llmdd__cache **d)
{
    *s = llmdd__cache_get(dd, src->cache_id);
    *d = llmdd__cache_get(dd, dst->cache_id);
    if (*s == NULL || *d == NULL) {
        llmdd__cache_put(dd, *s);
        llmdd__cache_put(dd, *d);
        return LLM_KV_CACHE_NOT_EXIST;
    }
    if ((*s)->desc.num_tensors != (*d)->desc.num_tensors) {
        llmdd__cache_put(dd, *s);
        llmdd__cache_put(dd, *d);
        return LLM_PARAM_INVALID;
    }
    return LLM_SUCCESS;
}

/* Every run of every tensor is one batch of the copy engine (copy.h). */
static void
copy_runs(const llmdd__cache *s, const llmdd__cache *d, const llmdd__run *runs,
          size_t nruns)
{
    llmdd__copy_batch b;
    uint64_t total = 0;

    for (size_t i = 0; i < nruns; i++)
        total += runs[i].len;
    llmdd__copy_begin(&b, total * s->desc.num_tensors,
                      d->tensor_size * d->desc.num_tensors);
    for (uint32_t t = 0; t < s->desc.num_tensors; t++) {
        uint8_t *sb = (uint8_t *)(uintptr_t)s->addrs[t];
        uint8_t *db = (uint8_t *)(uintptr_t)d->addrs[t];
        for (size_t i = 0; i < nruns; i++)
            llmdd__copy(&b, db + runs[i].dst_off, sb + runs[i].src_off,
                        runs[i].len);
    }
    llmdd__copy_end(&b);
}

/* The 2-D runs of a slot copy (a batch dimension other than 0): one batch
 * of the copy engine, as copy_runs. */
static void
copy_runs2(const llmdd__cache *s, const llmdd__cache *d, const llmdd__plan2 *p)
{
    llmdd__copy_batch b;

    llmdd__copy_begin(&b, llmdd__plan2_bytes(p) * s->desc.num_tensors,
                      d->tensor_size * d->desc.num_tensors);
    for (uint32_t t = 0; t < s->desc.num_tensors; t++) {
        uint8_t *sb = (uint8_t *)(uintptr_t)s->addrs[t];
        uint8_t *db = (uint8_t *)(uintptr_t)d->addrs[t];
        for (size_t i = 0; i < p->n; i++) {
            const llmdd__run2 *r = &p->runs[i];
            llmdd__copy_2d(&b, db + r->dst_off, r->dst_stride, sb + r->src_off,
                           r->src_stride, r->len, r->count);
        }
    }
    llmdd__copy_end(&b);
}

/*
 * A slot copy where either cache has a batch dimension other than 0:
 * offset and len count bytes of the slot and are whole rows of such a
 * side (docs/model.md, "The batch dimension").
 */
static llmdd_status
copy_slot(const llmdd__cache *s, const llmdd__cache *d, uint32_t sb,
          uint32_t db, uint64_t offset, int64_t size, uint64_t *bytes_out)
{
    if (sb >= s->slot.slots || db >= d->slot.slots || offset >= s->stride)
        return LLM_PARAM_INVALID;
    uint64_t len = size > 0 ? (uint64_t)size : s->stride - offset;
    if (llmdd__slot_range_check(&s->slot, offset, len) != LLM_SUCCESS ||
        llmdd__slot_range_check(&d->slot, offset, len) != LLM_SUCCESS) {
        log_error(
            "copy_kv_cache: %llu bytes at %llu do not fit the slots "
            "(%llu bytes in rows of %llu, %llu bytes in rows of %llu)",
            (unsigned long long)len, (unsigned long long)offset,
            (unsigned long long)s->stride, (unsigned long long)s->slot.row,
            (unsigned long long)d->stride, (unsigned long long)d->slot.row);
        return LLM_PARAM_INVALID;
    }
    llmdd__plan2 p = {0};
    if (llmdd__plan_slot(&p, &s->slot, sb, &d->slot, db, offset, len) != 0) {
        llmdd__plan2_free(&p);
        return LLM_OUT_OF_MEMORY;
    }
    copy_runs2(s, d, &p);
    llmdd__plan2_free(&p);
    *bytes_out = len * s->desc.num_tensors;
    return LLM_SUCCESS;
}

static llmdd_status
copy_cache_run(llmdd *dd, const llmdd_cache *src, const llmdd_cache *dst,
               uint32_t src_batch_index, uint32_t dst_batch_index,
               uint64_t offset, int64_t size, uint64_t *bytes_out)
{
    llmdd__cache *s, *d;
    llmdd_status st;

    if ((st = instance_ready(dd)) != LLM_SUCCESS)
        return st;
    if (src == NULL || dst == NULL || size == 0 || size < -1)
        return LLM_PARAM_INVALID;
    if ((st = copy_get(dd, src, dst, &s, &d)) != LLM_SUCCESS)
        return st;
    if (s->slot.batch_dim != 0 || d->slot.batch_dim != 0) {
        st = copy_slot(s, d, src_batch_index, dst_batch_index, offset, size,
                       bytes_out);
        goto out;
    }
    st = LLM_PARAM_INVALID;
    if ((int64_t)src_batch_index >= s->desc.shape[0] ||
        (int64_t)dst_batch_index >= d->desc.shape[0] || offset >= s->stride ||
        offset >= d->stride)
        goto out;
    uint64_t len = size > 0 ? (uint64_t)size : s->stride - offset;
    if (len > s->stride - offset || len > d->stride - offset)
        goto out;
    llmdd__run run = {.src_off = src_batch_index * s->stride + offset,
                      .dst_off = dst_batch_index * d->stride + offset,
                      .len = len};
    copy_runs(s, d, &run, 1);
    *bytes_out = len * s->desc.num_tensors;
    st = LLM_SUCCESS;
out:
    llmdd__cache_put(dd, s);
    llmdd__cache_put(dd, d);
    return st;
}

static llmdd_status
copy_blocks_run(llmdd *dd, const llmdd_cache *src, const llmdd_cache *dst,
                const uint64_t *src_blocks, const uint64_t *dst_blocks,
                size_t num_blocks, uint64_t *bytes_out)
{
    llmdd__cache *s, *d;
    llmdd__run *runs;
    llmdd_status st;

    if ((st = instance_ready(dd)) != LLM_SUCCESS)
        return st;
    if (src == NULL || dst == NULL || src_blocks == NULL ||
        dst_blocks == NULL || num_blocks == 0)
        return LLM_PARAM_INVALID;
    if ((st = copy_get(dd, src, dst, &s, &d)) != LLM_SUCCESS)
        return st;
    st = LLM_PARAM_INVALID;
    if (s->slot.batch_dim != 0 || d->slot.batch_dim != 0 ||
        s->stride != d->stride ||
        llmdd__blocks_check(src_blocks, num_blocks,
                            (uint64_t)s->desc.shape[0]) != LLM_SUCCESS ||
        llmdd__blocks_check(dst_blocks, num_blocks,
                            (uint64_t)d->desc.shape[0]) != LLM_SUCCESS)
        goto out;
    runs = malloc(num_blocks * sizeof(*runs));
    if (runs == NULL) {
        st = LLM_OUT_OF_MEMORY;
        goto out;
    }
    size_t n;
    if (s == d) {
        /* Within one cache a merged run could overlap its own destination
         * differently from block-by-block order: keep pairs separate. */
        for (n = 0; n < num_blocks; n++)
            runs[n] = (llmdd__run){.src_off = src_blocks[n] * s->stride,
                                   .dst_off = dst_blocks[n] * s->stride,
                                   .len = s->stride};
    } else {
        n = llmdd__block_runs(src_blocks, dst_blocks, num_blocks, s->stride,
                              runs);
    }
    copy_runs(s, d, runs, n);
    free(runs);
    *bytes_out = num_blocks * s->stride * s->desc.num_tensors;
    st = LLM_SUCCESS;
out:
    llmdd__cache_put(dd, s);
    llmdd__cache_put(dd, d);
    return st;
}

/* The two copies, timed and counted once, like remote transfers. */
llmdd_status
llmdd_copy_kv_cache(llmdd *dd, const llmdd_cache *src, const llmdd_cache *dst,
                    uint32_t src_batch_index, uint32_t dst_batch_index,
                    uint64_t offset, int64_t size)
{
    uint64_t bytes = 0;
    llmdd_status st;

    if (dd == NULL)
        return LLM_PARAM_INVALID;
    uint64_t t0 = llmdd__metrics_begin(dd);
    st = copy_cache_run(dd, src, dst, src_batch_index, dst_batch_index, offset,
                        size, &bytes);
    llmdd__metrics_xfer(dd, LLMDD__OP_COPY, NULL, st, bytes, t0);
    return st;
}

llmdd_status
llmdd_copy_kv_blocks(llmdd *dd, const llmdd_cache *src, const llmdd_cache *dst,
                     const uint64_t *src_blocks, const uint64_t *dst_blocks,
                     size_t num_blocks)
{
    uint64_t bytes = 0;
    llmdd_status st;

    if (dd == NULL)
        return LLM_PARAM_INVALID;
    uint64_t t0 = llmdd__metrics_begin(dd);
    st = copy_blocks_run(dd, src, dst, src_blocks, dst_blocks, num_blocks,
                         &bytes);
    llmdd__metrics_xfer(dd, LLMDD__OP_COPY, NULL, st, bytes, t0);
    return st;
}
