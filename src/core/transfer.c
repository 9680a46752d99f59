/*
 * Transfers: pull and push, planned here and moved by the link's transport
 * (local copies are local_copy.c). Every check runs before any byte moves,
 * in the order docs/model.md gives, so the first failing check decides the
 * status, and each refusal logs its cause. An instance's role is a label:
 * any role pulls and pushes.
 */
#include <stdlib.h>
#include <string.h>

#include "core/copy.h"
#include "core/internal.h"
#include "core/slices.h"

/*
 * KIND_CACHE: a slot (pull or push _kv_cache). KIND_BLOCKS: blocks (pull or
 * push _kv_blocks). KIND_SLOT_BLOCKS: a slot of a cache without blocks into
 * blocks of a block cache (pull or push _kv_cache_to_blocks): the slot is
 * the source's, the block list the destination's.
 */
enum xfer_kind { KIND_CACHE, KIND_BLOCKS, KIND_SLOT_BLOCKS };

typedef struct {
    enum xfer_kind kind;
    bool write; /* push */
    bool post;  /* an _async call: req_out and opts apply */
    const llmdd_xfer_opts *opts;
    llmdd_request **req_out;
    const llmdd_cache_index *remote_index;
    const llmdd_cache *local_cache;
    const llmdd_kv_ext_param *ext;
    /* KIND_CACHE; a push's source slot in KIND_SLOT_BLOCKS */
    uint32_t local_batch;
    int64_t size;
    /* KIND_BLOCKS; KIND_SLOT_BLOCKS: the destination's list only */
    const uint64_t *local_blocks;
    const uint64_t *remote_blocks;
    size_t nblocks;
} xfer_args;

static llmdd_status
instance_ready(llmdd *dd)
{
    return dd == NULL ? LLM_PARAM_INVALID : llmdd__ready(dd);
}

static bool
layerwise(const xfer_args *a)
{
    return a->opts != NULL && (a->opts->flags & LLMDD_XFER_LAYERWISE) != 0;
}

static uint32_t
layer_tensors(const xfer_args *a)
{
    return a->ext != NULL ? a->ext->tensor_num_per_layer : 2;
}

/* The call's own arguments, before any cache is looked up. */
static llmdd_status
check_args(llmdd *dd, const xfer_args *a)
{
    if (a->remote_index == NULL || a->local_cache == NULL)
        return LLM_PARAM_INVALID;
    if (a->kind == KIND_CACHE) {
        if (a->size == 0 || a->size < -1)
            return LLM_PARAM_INVALID;
    } else if (a->kind == KIND_SLOT_BLOCKS) {
        /* A push names the remote block cache with batch_index 0. */
        if (a->nblocks == 0 ||
            (a->write ? a->remote_blocks : a->local_blocks) == NULL ||
            (a->write && a->remote_index->batch_index != 0))
            return LLM_PARAM_INVALID;
    } else {
        if (a->nblocks == 0 || a->local_blocks == NULL ||
            a->remote_blocks == NULL || a->remote_index->batch_index != 0)
            return LLM_PARAM_INVALID;
    }
    if (a->ext != NULL && llmdd__ext_check_shape(a->ext) != LLM_SUCCESS) {
        log_error("%s: bad layer ranges {%d,%d} -> {%d,%d} with %u tensors "
                  "per layer",
                  a->write ? "push" : "pull", a->ext->src_layer_range.first,
                  a->ext->src_layer_range.second, a->ext->dst_layer_range.first,
                  a->ext->dst_layer_range.second, a->ext->tensor_num_per_layer);
        return LLM_PARAM_INVALID;
    }
    if (a->post) {
        const llmdd_xfer_opts *o = a->opts;
        if (a->req_out == NULL)
            return LLM_PARAM_INVALID;
        if (o != NULL && ((o->flags & ~(LLMDD_XFER_LAYERWISE |
                                        LLMDD_XFER_COMPLETION)) != 0 ||
                          ((o->flags & LLMDD_XFER_LAYERWISE) && !a->write) ||
                          o->notify_len > LLMDD_NOTIFY_MAX ||
                          (o->notify == NULL && o->notify_len > 0)))
            return LLM_PARAM_INVALID;
        /* A layer-wise push counts layers: tnpl is used even with default
         * ranges. */
        if (layerwise(a) && layer_tensors(a) < 1)
            return LLM_PARAM_INVALID;
    }
    if (a->remote_index->cluster_id == dd->cluster_id)
        return LLM_PARAM_INVALID;
    return LLM_SUCCESS;
}

/* Local indices and ranges. The local side is the destination of a pull. */
static llmdd_status
check_local(const xfer_args *a, const llmdd__cache *c, llmdd__tensor_span *span)
{
    const char *what = a->write ? "push" : "pull";

    if (a->kind != KIND_CACHE && c->slot.batch_dim != 0) {
        log_error("%s: local cache %lld has batch dimension %u; blocks need "
                  "0",
                  what, (long long)c->id, c->slot.batch_dim);
        return LLM_PARAM_INVALID;
    }
    if (a->kind == KIND_CACHE || (a->kind == KIND_SLOT_BLOCKS && a->write)) {
        if (a->local_batch >= c->slot.slots) {
            log_error("%s: slot %u is past local cache %lld's %llu", what,
                      a->local_batch, (long long)c->id,
                      (unsigned long long)c->slot.slots);
            return LLM_PARAM_INVALID;
        }
        if (a->size > 0 && llmdd__slot_range_check(
                               &c->slot, 0, (uint64_t)a->size) != LLM_SUCCESS) {
            log_error("%s: size %lld does not fit local cache %lld's slot "
                      "(%llu bytes, rows of %llu)",
                      what, (long long)a->size, (long long)c->id,
                      (unsigned long long)c->stride,
                      (unsigned long long)c->slot.row);
            return LLM_PARAM_INVALID;
        }
    } else if (llmdd__blocks_check(a->local_blocks, a->nblocks,
                                   (uint64_t)c->desc.shape[0]) != LLM_SUCCESS) {
        log_error("%s: a block index is past local cache %lld's %lld blocks",
                  what, (long long)c->id, (long long)c->desc.shape[0]);
        return LLM_PARAM_INVALID;
    }
    llmdd_status st =
        llmdd__range_resolve(a->ext, a->write, c->desc.num_tensors, span);
    if (st != LLM_SUCCESS) {
        log_error("%s: the layer range does not fit local cache %lld (%u "
                  "tensors)",
                  a->write ? "push" : "pull", (long long)c->id,
                  c->desc.num_tensors);
        return st;
    }
    /* Layer-wise (a push): the layers are the source range's, whole. */
    if (layerwise(a) && span->count % layer_tensors(a) != 0) {
        log_error("push: layer-wise needs whole layers: %u tensors, %u per "
                  "layer",
                  span->count, layer_tensors(a));
        return LLM_PARAM_INVALID;
    }
    return LLM_SUCCESS;
}

static llmdd_status
check_remote(const xfer_args *a, const llmdd__cache *lc,
             const llmdd__remote_cache *rc, llmdd__tensor_span lspan,
             llmdd__tensor_span *rspan)
{
    const char *what = a->write ? "push" : "pull";
    llmdd_status st;

    if (a->kind != KIND_CACHE && rc->slot.batch_dim != 0) {
        log_error("%s: cache %lld of cluster %llu has batch dimension %u; "
                  "blocks need 0",
                  what, (long long)rc->id,
                  (unsigned long long)a->remote_index->cluster_id,
                  rc->slot.batch_dim);
        return LLM_PARAM_INVALID;
    }
    if (a->kind == KIND_CACHE) {
        if (a->remote_index->batch_index >= rc->slot.slots) {
            log_error("%s: slot %u is past cache %lld of cluster %llu (%llu "
                      "slots)",
                      what, a->remote_index->batch_index, (long long)rc->id,
                      (unsigned long long)a->remote_index->cluster_id,
                      (unsigned long long)rc->slot.slots);
            return LLM_PARAM_INVALID;
        }
        uint64_t len = a->size > 0 ? (uint64_t)a->size : lc->stride;
        if (llmdd__slot_range_check(&rc->slot, 0, len) != LLM_SUCCESS) {
            log_error("%s: %llu bytes a slot do not fit cache %lld of "
                      "cluster %llu (%llu bytes a slot, rows of %llu)",
                      what, (unsigned long long)len, (long long)rc->id,
                      (unsigned long long)a->remote_index->cluster_id,
                      (unsigned long long)rc->stride,
                      (unsigned long long)rc->slot.row);
            return LLM_PARAM_INVALID;
        }
    } else if (a->kind == KIND_SLOT_BLOCKS) {
        if (a->write
                ? llmdd__blocks_check(a->remote_blocks, a->nblocks,
                                      (uint64_t)rc->desc.shape[0]) !=
                      LLM_SUCCESS
                : (int64_t)a->remote_index->batch_index >= rc->desc.shape[0])
            return LLM_PARAM_INVALID;
        /* Every chunk of the slot lands in a block, and every block takes
         * a chunk: n = ceil(slot / block). */
        uint64_t slot = a->write ? lc->stride : rc->stride;
        uint64_t block = a->write ? rc->stride : lc->stride;
        uint64_t want = slot / block + (slot % block != 0);
        if (a->nblocks != want) {
            log_error("%s_kv_cache_to_blocks: a %llu-byte slot needs %llu "
                      "blocks of %llu bytes, %zu given",
                      a->write ? "push" : "pull", (unsigned long long)slot,
                      (unsigned long long)want, (unsigned long long)block,
                      a->nblocks);
            return LLM_PARAM_INVALID;
        }
    } else {
        if (llmdd__blocks_check(a->remote_blocks, a->nblocks,
                                (uint64_t)rc->desc.shape[0]) != LLM_SUCCESS) {
            log_error("%s: a block index is past cache %lld of cluster %llu "
                      "(%lld blocks)",
                      what, (long long)rc->id,
                      (unsigned long long)a->remote_index->cluster_id,
                      (long long)rc->desc.shape[0]);
            return LLM_PARAM_INVALID;
        }
        if (rc->stride != lc->stride) {
            log_error("%s: blocks of %llu bytes here, %llu in cache %lld of "
                      "cluster %llu: they must be equal",
                      what, (unsigned long long)lc->stride,
                      (unsigned long long)rc->stride, (long long)rc->id,
                      (unsigned long long)a->remote_index->cluster_id);
            return LLM_PARAM_INVALID;
        }
    }
    st = llmdd__range_resolve(a->ext, !a->write, rc->desc.num_tensors, rspan);
    if (st != LLM_SUCCESS) {
        log_error("%s: the layer range does not fit cache %lld of cluster "
                  "%llu (%u tensors)",
                  what, (long long)rc->id,
                  (unsigned long long)a->remote_index->cluster_id,
                  rc->desc.num_tensors);
        return st;
    }
    if (llmdd__spans_match(lspan, *rspan) != LLM_SUCCESS) {
        /* The usual cause: one range given, the other left whole. */
        log_error("%s: the layer ranges select %u tensors here and %u in "
                  "cache %lld of cluster %llu; give both ranges, of equal "
                  "width",
                  what, lspan.count, rspan->count, (long long)rc->id,
                  (unsigned long long)a->remote_index->cluster_id);
        return LLM_PARAM_INVALID;
    }
    return LLM_SUCCESS;
}

static enum llmdd__metrics_op
xfer_op(const xfer_args *a)
{
    if (a->kind == KIND_CACHE)
        return a->write ? LLMDD__OP_PUSH : LLMDD__OP_PULL;
    return a->write ? LLMDD__OP_PUSH_BLOCKS : LLMDD__OP_PULL_BLOCKS;
}

/*
 * A remote slot into local blocks: chunk k of the slot, [k*B, (k+1)*B) with
 * B the local block stride, to block dst[k]; the last chunk may be short.
 * Chunks whose blocks are consecutive are one run (the slot side always
 * is). Indices are checked, so no offset overflows. runs holds n entries.
 */
static size_t
slot_block_runs(uint64_t slot_off, uint64_t slot_len, const uint64_t *dst,
                size_t n, uint64_t block, llmdd__run *runs)
{
    size_t nruns = 0;

    for (size_t k = 0; k < n; k++) {
        uint64_t off = k * block;
        uint64_t len = slot_len - off < block ? slot_len - off : block;
        llmdd__run *prev = nruns > 0 ? &runs[nruns - 1] : NULL;
        if (prev != NULL && prev->len % block == 0 &&
            prev->dst_off + prev->len == dst[k] * block) {
            prev->len += len;
            continue;
        }
        runs[nruns++] = (llmdd__run){
            .src_off = slot_off + off, .dst_off = dst[k] * block, .len = len};
    }
    return nruns;
}

/*
 * A slot of a cache with a batch dimension other than 0 on either side:
 * its rows as 2-D runs (core/slices.h), as they are for a transport that
 * moves them (strided), else one run a row.
 */
static llmdd_status
plan_slot(const xfer_args *a, const llmdd__cache *lc,
          const llmdd__remote_cache *rc, bool strided, llmdd__run **runs_out,
          size_t *nruns_out, llmdd__run2 **runs2_out, size_t *nruns2_out)
{
    const llmdd__slot_geom *sg = a->write ? &lc->slot : &rc->slot;
    const llmdd__slot_geom *dg = a->write ? &rc->slot : &lc->slot;
    uint64_t ss = a->write ? a->local_batch : a->remote_index->batch_index;
    uint64_t ds = a->write ? a->remote_index->batch_index : a->local_batch;
    uint64_t len = a->size > 0 ? (uint64_t)a->size : lc->stride;
    llmdd__plan2 p = {0};

    if (llmdd__plan_slot(&p, sg, ss, dg, ds, 0, len) != 0) {
        llmdd__plan2_free(&p);
        return LLM_OUT_OF_MEMORY;
    }
    if (strided) {
        *runs2_out = p.runs;
        *nruns2_out = p.n;
        return LLM_SUCCESS;
    }
    int rc2 = llmdd__plan2_flatten(&p, runs_out, nruns_out);
    llmdd__plan2_free(&p);
    return rc2 == 0 ? LLM_SUCCESS : LLM_OUT_OF_MEMORY;
}

/* Builds the run list; *runs_out (or *runs2_out) is malloc'd. */
static llmdd_status
plan_runs(const xfer_args *a, const llmdd__cache *lc,
          const llmdd__remote_cache *rc, bool strided, llmdd__run **runs_out,
          size_t *nruns_out, llmdd__run2 **runs2_out, size_t *nruns2_out)
{
    if (a->kind == KIND_CACHE &&
        (lc->slot.batch_dim != 0 || rc->slot.batch_dim != 0))
        return plan_slot(a, lc, rc, strided, runs_out, nruns_out, runs2_out,
                         nruns2_out);
    if (a->kind == KIND_CACHE) {
        llmdd__run *r = malloc(sizeof(*r));
        if (r == NULL)
            return LLM_OUT_OF_MEMORY;
        uint64_t roff = a->remote_index->batch_index * rc->stride;
        uint64_t loff = a->local_batch * lc->stride;
        r->src_off = a->write ? loff : roff;
        r->dst_off = a->write ? roff : loff;
        r->len = a->size > 0 ? (uint64_t)a->size : lc->stride;
        *runs_out = r;
        *nruns_out = 1;
        return LLM_SUCCESS;
    }

    llmdd__run *r = malloc(a->nblocks * sizeof(*r));
    if (r == NULL)
        return LLM_OUT_OF_MEMORY;
    if (a->kind == KIND_SLOT_BLOCKS && a->write) {
        *runs_out = r;
        *nruns_out =
            slot_block_runs(a->local_batch * lc->stride, lc->stride,
                            a->remote_blocks, a->nblocks, rc->stride, r);
        return LLM_SUCCESS;
    }
    if (a->kind == KIND_SLOT_BLOCKS) {
        *runs_out = r;
        *nruns_out = slot_block_runs(a->remote_index->batch_index * rc->stride,
                                     rc->stride, a->local_blocks, a->nblocks,
                                     lc->stride, r);
        return LLM_SUCCESS;
    }
    const uint64_t *src = a->write ? a->local_blocks : a->remote_blocks;
    const uint64_t *dst = a->write ? a->remote_blocks : a->local_blocks;
    size_t n = llmdd__block_runs(src, dst, a->nblocks, lc->stride, r);
    *runs_out = r;
    *nruns_out = n;
    return LLM_SUCCESS;
}

/*
 * Every pull and push, synchronous or posted: the checks of docs/model.md
 * in their order, then a plan that request.c runs now or posts. Once the plan
 * is submitted (*submitted), the request counts its metrics when done.
 */
static llmdd_status
remote_xfer_run(llmdd *dd, const xfer_args *a,
                const llmdd_transport_ops **ops_out, uint64_t *bytes_out,
                uint64_t t0, bool *submitted)
{
    llmdd__tensor_span lspan, rspan;
    llmdd__remote_cache *rc;
    llmdd__run *runs = NULL;
    llmdd__run2 *runs2 = NULL;
    size_t nruns2 = 0;
    uint8_t **local = NULL;
    llmdd__cache *lc;
    llmdd__link *link;
    llmdd_status st;
    size_t nruns;

    if ((st = instance_ready(dd)) != LLM_SUCCESS)
        return st;
    if ((st = check_args(dd, a)) != LLM_SUCCESS)
        return st;
    int64_t deadline = llmdd__now_ms() + llmdd__wait_ms(dd);

    lc = llmdd__cache_get(dd, a->local_cache->cache_id);
    if (lc == NULL)
        return LLM_KV_CACHE_NOT_EXIST;
    if ((st = check_local(a, lc, &lspan)) != LLM_SUCCESS)
        goto out_cache;

    link = llmdd__link_get(dd, a->remote_index->cluster_id);
    if (link == NULL) {
        st = LLM_NOT_YET_LINK;
        goto out_cache;
    }
    *ops_out = link->ops;
    st = llmdd__link_remote(link, a->remote_index->cache_id, deadline, &rc);
    if (st != LLM_SUCCESS) {
        llmdd__link_status(link, st);
        goto out_link;
    }
    if ((st = check_remote(a, lc, rc, lspan, &rspan)) != LLM_SUCCESS)
        goto out_remote;
    nruns = 0;
    if ((st = plan_runs(a, lc, rc, link->ops->strided, &runs, &nruns, &runs2,
                        &nruns2)) != LLM_SUCCESS)
        goto out_remote;
    for (size_t i = 0; i < nruns; i++)
        *bytes_out += runs[i].len * rspan.count;
    for (size_t i = 0; i < nruns2; i++)
        *bytes_out += runs2[i].len * runs2[i].count * rspan.count;
    local = malloc(lspan.count * sizeof(*local));
    if (local == NULL) {
        free(runs);
        free(runs2);
        st = LLM_OUT_OF_MEMORY;
        goto out_remote;
    }
    for (uint32_t i = 0; i < lspan.count; i++)
        local[i] = (uint8_t *)(uintptr_t)lc->addrs[lspan.first + i];

    llmdd__request_plan p = {
        .link = link,
        .lc = lc,
        .rc = rc,
        .x = {.write = a->write,
              .remote = rc,
              .remote_first = rspan.first,
              .count = rspan.count,
              .local = local,
              .runs = runs,
              .nruns = nruns,
              .runs2 = runs2,
              .nruns2 = nruns2,
              .deadline_ms = deadline,
              .local_bytes = lc->tensor_size * lc->desc.num_tensors},
        .flags = a->opts != NULL ? a->opts->flags : 0,
        .tnpl = layer_tensors(a),
        .notify = a->opts != NULL ? a->opts->notify : NULL,
        .notify_len = a->opts != NULL ? a->opts->notify_len : 0,
        .op = xfer_op(a),
        .bytes = *bytes_out,
        .t0 = t0,
    };
    /* The plan's references and arrays are the request's now. */
    *submitted = true;
    return llmdd__request_submit(dd, &p, a->post ? a->req_out : NULL);

out_remote:
    llmdd__link_remote_put(link, rc);
out_link:
    llmdd__link_put(link);
out_cache:
    llmdd__cache_put(dd, lc);
    return st;
}

/* Every remote transfer, timed and counted once, whatever its outcome. */
static llmdd_status
remote_xfer(llmdd *dd, const xfer_args *a)
{
    const llmdd_transport_ops *ops = NULL;
    uint64_t bytes = 0;
    llmdd_status st;

    if (dd == NULL)
        return LLM_PARAM_INVALID;
    uint64_t t0 = llmdd__metrics_begin(dd);
    bool submitted = false;
    st = remote_xfer_run(dd, a, &ops, &bytes, t0, &submitted);
    if (!submitted) /* refused before it became a request */
        llmdd__metrics_xfer(dd, xfer_op(a), ops, st, bytes, t0);
    return st;
}

/* A slot transfer (pull or push _kv_cache), posted when req_out matters. */
static llmdd_status
xfer_cache(llmdd *dd, bool write, const llmdd_cache_index *remote,
           const llmdd_cache *local, uint32_t local_batch, int64_t size,
           const llmdd_kv_ext_param *ext, bool post,
           const llmdd_xfer_opts *opts, llmdd_request **req_out)
{
    xfer_args a = {.kind = KIND_CACHE,
                   .write = write,
                   .post = post,
                   .opts = opts,
                   .req_out = req_out,
                   .remote_index = remote,
                   .local_cache = local,
                   .ext = ext,
                   .local_batch = local_batch,
                   .size = size};
    return remote_xfer(dd, &a);
}

/* A block transfer (pull or push _kv_blocks). */
static llmdd_status
xfer_blocks(llmdd *dd, bool write, const llmdd_cache_index *remote,
            const llmdd_cache *local, const uint64_t *remote_blocks,
            const uint64_t *local_blocks, size_t n,
            const llmdd_kv_ext_param *ext, bool post,
            const llmdd_xfer_opts *opts, llmdd_request **req_out)
{
    xfer_args a = {.kind = KIND_BLOCKS,
                   .write = write,
                   .post = post,
                   .opts = opts,
                   .req_out = req_out,
                   .remote_index = remote,
                   .local_cache = local,
                   .ext = ext,
                   .local_blocks = local_blocks,
                   .remote_blocks = remote_blocks,
                   .nblocks = n};
    return remote_xfer(dd, &a);
}

llmdd_status
llmdd_pull_kv_cache(llmdd *dd, const llmdd_cache_index *src_cache_index,
                    const llmdd_cache *dst_cache, uint32_t batch_index,
                    int64_t size, const llmdd_kv_ext_param *ext)
{
    return xfer_cache(dd, false, src_cache_index, dst_cache, batch_index, size,
                      ext, false, NULL, NULL);
}

llmdd_status
llmdd_pull_kv_blocks(llmdd *dd, const llmdd_cache_index *src_cache_index,
                     const llmdd_cache *dst_cache, const uint64_t *src_blocks,
                     const uint64_t *dst_blocks, size_t num_blocks,
                     const llmdd_kv_ext_param *ext)
{
    return xfer_blocks(dd, false, src_cache_index, dst_cache, src_blocks,
                       dst_blocks, num_blocks, ext, false, NULL, NULL);
}

llmdd_status
llmdd_push_kv_cache(llmdd *dd, const llmdd_cache *src_cache,
                    const llmdd_cache_index *dst_cache_index,
                    uint32_t src_batch_index, int64_t size,
                    const llmdd_kv_ext_param *ext)
{
    return xfer_cache(dd, true, dst_cache_index, src_cache, src_batch_index,
                      size, ext, false, NULL, NULL);
}

llmdd_status
llmdd_push_kv_blocks(llmdd *dd, const llmdd_cache *src_cache,
                     const llmdd_cache_index *dst_cache_index,
                     const uint64_t *src_blocks, const uint64_t *dst_blocks,
                     size_t num_blocks, const llmdd_kv_ext_param *ext)
{
    return xfer_blocks(dd, true, dst_cache_index, src_cache, dst_blocks,
                       src_blocks, num_blocks, ext, false, NULL, NULL);
}

llmdd_status
llmdd_pull_kv_cache_async(llmdd *dd, const llmdd_cache_index *src_cache_index,
                          const llmdd_cache *dst_cache, uint32_t batch_index,
                          int64_t size, const llmdd_kv_ext_param *ext,
                          const llmdd_xfer_opts *opts, llmdd_request **req_out)
{
    return xfer_cache(dd, false, src_cache_index, dst_cache, batch_index, size,
                      ext, true, opts, req_out);
}

llmdd_status
llmdd_pull_kv_blocks_async(llmdd *dd, const llmdd_cache_index *src_cache_index,
                           const llmdd_cache *dst_cache,
                           const uint64_t *src_blocks,
                           const uint64_t *dst_blocks, size_t num_blocks,
                           const llmdd_kv_ext_param *ext,
                           const llmdd_xfer_opts *opts, llmdd_request **req_out)
{
    return xfer_blocks(dd, false, src_cache_index, dst_cache, src_blocks,
                       dst_blocks, num_blocks, ext, true, opts, req_out);
}

llmdd_status
llmdd_push_kv_cache_async(llmdd *dd, const llmdd_cache *src_cache,
                          const llmdd_cache_index *dst_cache_index,
                          uint32_t src_batch_index, int64_t size,
                          const llmdd_kv_ext_param *ext,
                          const llmdd_xfer_opts *opts, llmdd_request **req_out)
{
    return xfer_cache(dd, true, dst_cache_index, src_cache, src_batch_index,
                      size, ext, true, opts, req_out);
}

llmdd_status
llmdd_push_kv_blocks_async(llmdd *dd, const llmdd_cache *src_cache,
                           const llmdd_cache_index *dst_cache_index,
                           const uint64_t *src_blocks,
                           const uint64_t *dst_blocks, size_t num_blocks,
                           const llmdd_kv_ext_param *ext,
                           const llmdd_xfer_opts *opts, llmdd_request **req_out)
{
    return xfer_blocks(dd, true, dst_cache_index, src_cache, dst_blocks,
                       src_blocks, num_blocks, ext, true, opts, req_out);
}

/*
 * A slot into blocks: a remote slot into local blocks (a pull), or local
 * slot local_batch into remote blocks (a push); blocks are the
 * destination's. Posted when post.
 */
static llmdd_status
xfer_slot_blocks(llmdd *dd, bool write, const llmdd_cache_index *remote,
                 const llmdd_cache *local, uint32_t local_batch,
                 const uint64_t *blocks, size_t n,
                 const llmdd_kv_ext_param *ext, bool post,
                 const llmdd_xfer_opts *opts, llmdd_request **req_out)
{
    xfer_args a = {.kind = KIND_SLOT_BLOCKS,
                   .write = write,
                   .post = post,
                   .opts = opts,
                   .req_out = req_out,
                   .remote_index = remote,
                   .local_cache = local,
                   .ext = ext,
                   .local_batch = local_batch,
                   .local_blocks = write ? NULL : blocks,
                   .remote_blocks = write ? blocks : NULL,
                   .nblocks = n};
    return remote_xfer(dd, &a);
}

llmdd_status
llmdd_pull_kv_cache_to_blocks(llmdd *dd,
                              const llmdd_cache_index *src_cache_index,
                              const llmdd_cache *dst_cache,
                              const uint64_t *dst_blocks, size_t num_blocks,
                              const llmdd_kv_ext_param *ext)
{
    return xfer_slot_blocks(dd, false, src_cache_index, dst_cache, 0,
                            dst_blocks, num_blocks, ext, false, NULL, NULL);
}

llmdd_status
llmdd_pull_kv_cache_to_blocks_async(
    llmdd *dd, const llmdd_cache_index *src_cache_index,
    const llmdd_cache *dst_cache, const uint64_t *dst_blocks, size_t num_blocks,
    const llmdd_kv_ext_param *ext, const llmdd_xfer_opts *opts,
    llmdd_request **req_out)
{
    return xfer_slot_blocks(dd, false, src_cache_index, dst_cache, 0,
                            dst_blocks, num_blocks, ext, true, opts, req_out);
}

llmdd_status
llmdd_push_kv_cache_to_blocks(llmdd *dd, const llmdd_cache *src_cache,
                              const llmdd_cache_index *dst_cache_index,
                              uint32_t src_batch_index,
                              const uint64_t *dst_blocks, size_t num_blocks,
                              const llmdd_kv_ext_param *ext)
{
    return xfer_slot_blocks(dd, true, dst_cache_index, src_cache,
                            src_batch_index, dst_blocks, num_blocks, ext, false,
                            NULL, NULL);
}

llmdd_status
llmdd_push_kv_cache_to_blocks_async(llmdd *dd, const llmdd_cache *src_cache,
                                    const llmdd_cache_index *dst_cache_index,
                                    uint32_t src_batch_index,
                                    const uint64_t *dst_blocks,
                                    size_t num_blocks,
                                    const llmdd_kv_ext_param *ext,
                                    const llmdd_xfer_opts *opts,
                                    llmdd_request **req_out)
{
    return xfer_slot_blocks(dd, true, dst_cache_index, src_cache,
                            src_batch_index, dst_blocks, num_blocks, ext, true,
                            opts, req_out);
}
