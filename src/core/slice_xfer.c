/*
 * Slice transfers (docs/model.md, "KV layouts"): every check in the
 * documented order before anything is posted, the layouts of the peers'
 * caches (asked over the control connection once per remote cache), a
 * plan per slice (core/slices.h) applied to every tensor pair of it, and
 * one request whose legs are the slices: each peer is notified after its
 * own bytes landed.
 */
#include <stdlib.h>
#include <string.h>

#include "core/internal.h"
#include "core/slices.h"

typedef struct {
    bool write; /* push: local -> remotes */
    bool post;
    const llmdd_cache_index *remotes; /* srcs of a pull, dsts of a push */
    const llmdd_kv_slice *slices;
    size_t n;
    const llmdd_cache *local;
    const llmdd_xfer_opts *opts;
    llmdd_request **req_out;
} sargs;

/* One slice's state between the checks and the plan. */
typedef struct {
    llmdd__link *link;
    llmdd__remote_cache *rc;
    llmdd__tensor_span lspan, rspan;
    uint32_t h0, h1;
    bool moves;
    uint32_t group;
} sstate;

/* ---- Layouts over the control connection ---- */

bool
llmdd__layouts_serve(llmdd__link *link, const uint8_t *buf, size_t len)
{
    llmdd__layout_query q;
    llmdd__layout_reply r;
    uint8_t out[64];

    if (llmdd__wire_layout_query_decode(buf, len, &q) != 0) {
        llmdd__link_breach(link, "malformed LAYOUT_QUERY");
        return false;
    }
    memset(&r, 0, sizeof(r));
    r.seq = q.seq;
    r.status = LLM_KV_CACHE_NOT_EXIST;
    llmdd__cache *c = llmdd__cache_get(link->dd, q.cache_id);
    if (c != NULL) {
        r.status = c->has_layout ? LLM_SUCCESS : LLM_CACHE_INCOMPATIBLE;
        if (c->has_layout)
            r.layout = c->layout;
        llmdd__cache_put(link->dd, c);
    }
    size_t n = llmdd__wire_layout_reply_encode(&r, out, sizeof(out));
    return llmdd__link_send(link, WMSG_LAYOUT_REPLY, out, n) == 0;
}

/* Asks the peer; LLM_SUCCESS, LLM_KV_CACHE_NOT_EXIST,
 * LLM_CACHE_INCOMPATIBLE (no layout), LLM_NOT_YET_LINK or LLM_TIMEOUT. */
static llmdd_status
layout_ask(llmdd__link *link, int64_t cache_id, int64_t deadline,
           llmdd_kv_layout *out)
{
    llmdd__link_wait w = {.type = WMSG_LAYOUT_REPLY};
    llmdd__layout_query q = {.cache_id = cache_id};
    llmdd__layout_reply r;
    uint8_t buf[32];

    q.seq = llmdd__link_await_begin(link, &w);
    size_t n = llmdd__wire_layout_query_encode(&q, buf, sizeof(buf));
    (void)llmdd__link_send(link, WMSG_LAYOUT_QUERY, buf, n); /* else dead */
    llmdd_status st = llmdd__link_await(link, &w, deadline);
    if (st != LLM_SUCCESS)
        return st;
    if (llmdd__wire_layout_reply_decode(w.reply, w.len, &r) != 0)
        return LLM_FAILED; /* the control thread decoded it already */
    if (r.status == LLM_SUCCESS) {
        *out = r.layout;
        return LLM_SUCCESS;
    }
    return r.status == LLM_KV_CACHE_NOT_EXIST ? LLM_KV_CACHE_NOT_EXIST
                                              : LLM_CACHE_INCOMPATIBLE;
}

llmdd_status
llmdd_query_remote_layout(llmdd *dd, uint64_t cluster_id, int64_t cache_id,
                          llmdd_kv_layout *layout_out)
{
    llmdd_status st;

    if (dd == NULL)
        return LLM_PARAM_INVALID;
    if ((st = llmdd__ready(dd)) != LLM_SUCCESS)
        return st;
    if (layout_out == NULL)
        return LLM_PARAM_INVALID;
    llmdd__link *link = llmdd__link_get(dd, cluster_id);
    if (link == NULL)
        return LLM_NOT_YET_LINK;
    llmdd_kv_layout l;
    st = layout_ask(link, cache_id, llmdd__now_ms() + llmdd__wait_ms(dd), &l);
    llmdd__link_put(link);
    if (st == LLM_SUCCESS)
        *layout_out = l;
    return st;
}

/* The remote cache's layout, asked once and kept with its description. */
static llmdd_status
remote_layout(llmdd__link *link, llmdd__remote_cache *rc, int64_t deadline,
              llmdd_kv_layout *out)
{
    pthread_mutex_lock(&link->rc_lock);
    int state = rc->layout_state;
    if (state == 1)
        *out = rc->layout;
    pthread_mutex_unlock(&link->rc_lock);
    if (state == 1)
        return LLM_SUCCESS;
    if (state == 2) {
        log_error("slices: cache %lld of cluster %llu has no KV layout",
                  (long long)rc->id,
                  (unsigned long long)link->peer.cluster_id);
        return LLM_CACHE_INCOMPATIBLE;
    }
    llmdd_kv_layout l;
    llmdd_status st = layout_ask(link, rc->id, deadline, &l);
    /* A peer's layout is a claim: it must fit the cache it described. */
    if (st == LLM_SUCCESS &&
        (rc->slot.batch_dim != 0 ||
         llmdd__layout_check(&l, rc->stride, NULL) != LLM_SUCCESS)) {
        log_error("slices: cluster %llu describes cache %lld with a layout "
                  "that does not fit it",
                  (unsigned long long)link->peer.cluster_id,
                  (long long)rc->id);
        st = LLM_CACHE_INCOMPATIBLE;
    }
    if (st == LLM_CACHE_INCOMPATIBLE)
        log_error("slices: cache %lld of cluster %llu has no KV layout",
                  (long long)rc->id,
                  (unsigned long long)link->peer.cluster_id);
    if (st == LLM_SUCCESS || st == LLM_CACHE_INCOMPATIBLE) {
        pthread_mutex_lock(&link->rc_lock);
        rc->layout_state = st == LLM_SUCCESS ? 1 : 2;
        if (st == LLM_SUCCESS)
            rc->layout = l;
        pthread_mutex_unlock(&link->rc_lock);
        if (st == LLM_SUCCESS)
            *out = l;
    }
    return st;
}

/* ---- Checks ---- */

static bool
layerwise(const sargs *a)
{
    return a->opts != NULL && (a->opts->flags & LLMDD_XFER_LAYERWISE) != 0;
}

static int64_t
range_width(const llmdd_layer_range *r)
{
    return r->first < 0 ? -1 : (int64_t)r->second - r->first + 1;
}

/* Whether a table names one block twice (all its entries): 0 or 1, -1
 * without memory for the sorted copy. */
static int
table_repeats(const llmdd_block_table *t)
{
    llmdd_block_table all = {t->blocks, t->num_blocks, 0};
    return t->num_blocks > 1 ? llmdd__table_repeats(&all, 1, 0, t->num_blocks)
                             : 0;
}

/* A refusal, logged with its cause (the status is the caller's). */
#define REFUSE(st, ...)                                                        \
    do {                                                                       \
        log_error(__VA_ARGS__);                                                \
        return (st);                                                           \
    } while (0)

static const char *
what(const sargs *a)
{
    return a->write ? "push_kv_slices" : "pull_kv_slices";
}

static llmdd_status
check_args(llmdd *dd, const sargs *a)
{
    if (a->n == 0)
        REFUSE(LLM_PARAM_INVALID, "%s: no slices", what(a));
    if (a->n > LLMDD_SLICES_MAX)
        REFUSE(LLM_CLUSTER_NUM_EXCEED_LIMIT, "%s: %zu slices, at most %d",
               what(a), a->n, LLMDD_SLICES_MAX);
    if (a->remotes == NULL || a->slices == NULL || a->local == NULL ||
        (a->post && a->req_out == NULL))
        REFUSE(LLM_PARAM_INVALID, "%s: a NULL argument", what(a));
    const llmdd_xfer_opts *o = a->opts;
    if (o != NULL &&
        ((o->flags & ~(LLMDD_XFER_LAYERWISE | LLMDD_XFER_COMPLETION)) != 0 ||
         o->notify_len > LLMDD_NOTIFY_MAX ||
         (o->notify == NULL && o->notify_len > 0) || !a->post))
        REFUSE(LLM_PARAM_INVALID, "%s: bad opts (flags 0x%x, notify %zu bytes)",
               what(a), o->flags, o->notify_len);
    for (size_t i = 0; i < a->n; i++) {
        const llmdd_kv_slice *s = &a->slices[i];
        bool moves = s->token_begin < s->token_end;
        if ((s->src.blocks == NULL && s->src.num_blocks > 0) ||
            (s->dst.blocks == NULL && s->dst.num_blocks > 0))
            REFUSE(LLM_PARAM_INVALID, "%s: slice %zu: a NULL block table",
                   what(a), i);
        if (a->remotes[i].cluster_id == dd->cluster_id ||
            a->remotes[i].batch_index != 0)
            REFUSE(LLM_PARAM_INVALID,
                   "%s: slice %zu: cluster %llu batch %u (not our own cluster, "
                   "batch_index 0)",
                   what(a), i, (unsigned long long)a->remotes[i].cluster_id,
                   a->remotes[i].batch_index);
        if ((s->head_begin != 0 || s->head_end != 0) &&
            s->head_begin >= s->head_end)
            REFUSE(LLM_PARAM_INVALID, "%s: slice %zu: empty head range [%u, %u)",
                   what(a), i, s->head_begin, s->head_end);
        if (s->token_begin > s->token_end)
            REFUSE(LLM_PARAM_INVALID,
                   "%s: slice %zu: reversed token range [%llu, %llu)", what(a),
                   i, (unsigned long long)s->token_begin,
                   (unsigned long long)s->token_end);
        if (moves && (s->src.num_blocks == 0 || s->dst.num_blocks == 0))
            REFUSE(LLM_PARAM_INVALID,
                   "%s: slice %zu moves tokens with an empty table", what(a), i);
        int rep = table_repeats(&s->dst);
        if (rep < 0)
            REFUSE(LLM_OUT_OF_MEMORY,
                   "%s: slice %zu: no memory to check the destination table",
                   what(a), i);
        if (rep > 0)
            REFUSE(LLM_PARAM_INVALID,
                   "%s: slice %zu: the destination table names a block twice",
                   what(a), i);
        if (llmdd__ext_check_shape(&s->ext) != LLM_SUCCESS)
            REFUSE(LLM_PARAM_INVALID,
                   "%s: slice %zu: bad layer ranges {%d,%d} -> {%d,%d}",
                   what(a), i, s->ext.src_layer_range.first,
                   s->ext.src_layer_range.second, s->ext.dst_layer_range.first,
                   s->ext.dst_layer_range.second);
    }
    if (layerwise(a)) {
        if (!a->write)
            REFUSE(LLM_PARAM_INVALID, "%s: layer-wise is for pushes", what(a));
        const llmdd_kv_ext_param *e0 = &a->slices[0].ext;
        if (e0->tensor_num_per_layer < 1)
            REFUSE(LLM_PARAM_INVALID, "%s: layer-wise with 0 tensors a layer",
                   what(a));
        for (size_t i = 1; i < a->n; i++) {
            const llmdd_kv_ext_param *e = &a->slices[i].ext;
            if (range_width(&e->src_layer_range) !=
                    range_width(&e0->src_layer_range) ||
                e->tensor_num_per_layer != e0->tensor_num_per_layer)
                REFUSE(LLM_PARAM_INVALID,
                       "%s: layer-wise slices 0 and %zu differ in source "
                       "layers or tensors a layer",
                       what(a), i);
        }
    }
    return LLM_SUCCESS;
}

/* One side's table for a moving slice: the source's on a push when local
 * is the source. */
static const llmdd_block_table *
table_of(const llmdd_kv_slice *s, bool source)
{
    return source ? &s->src : &s->dst;
}

static llmdd_status
check_local(const sargs *a, const llmdd__cache *lc, sstate *ss)
{
    if (!lc->has_layout)
        REFUSE(LLM_CACHE_INCOMPATIBLE, "%s: local cache %lld has no KV layout",
               what(a), (long long)lc->id);
    for (size_t i = 0; i < a->n; i++) {
        const llmdd_kv_slice *s = &a->slices[i];
        ss[i].moves = s->token_begin < s->token_end;
        if (ss[i].moves &&
            llmdd__table_check(table_of(s, a->write), &lc->layout,
                               (uint64_t)lc->desc.shape[0], s->token_begin,
                               s->token_end) != LLM_SUCCESS)
            REFUSE(LLM_PARAM_INVALID,
                   "%s: slice %zu: the local table (first token %llu, %zu "
                   "blocks of %u) is misaligned, does not cover [%llu, %llu) "
                   "or names a block past local cache %lld's %lld",
                   what(a), i,
                   (unsigned long long)table_of(s, a->write)->first_token,
                   table_of(s, a->write)->num_blocks, lc->layout.block_size,
                   (unsigned long long)s->token_begin,
                   (unsigned long long)s->token_end, (long long)lc->id,
                   (long long)lc->desc.shape[0]);
        /* The local side is the source of a push, the destination of a
         * pull; resolve with is_src accordingly. */
        if (llmdd__range_resolve(&s->ext, a->write, lc->desc.num_tensors,
                                 &ss[i].lspan) != LLM_SUCCESS)
            REFUSE(LLM_PARAM_INVALID,
                   "%s: slice %zu: the layer range does not fit local cache "
                   "%lld (%u tensors)",
                   what(a), i, (long long)lc->id, lc->desc.num_tensors);
        if (layerwise(a) &&
            ss[i].lspan.count % s->ext.tensor_num_per_layer != 0)
            REFUSE(LLM_PARAM_INVALID,
                   "%s: slice %zu: layer-wise needs whole layers", what(a), i);
    }
    return LLM_SUCCESS;
}

static bool
holds(const llmdd_kv_layout *l, uint32_t h0, uint32_t h1)
{
    return h0 >= l->head_first &&
           (uint64_t)h1 <= (uint64_t)l->head_first + l->num_heads;
}

/* Destination coordinates one slice writes, for the overlap check. */
typedef struct {
    uint64_t dest; /* which destination cache: the slice's remote, or 0 */
    uint64_t block, lo, hi; /* slots [lo, hi) of a block */
    uint32_t slice;
} dst_seg;

static int
seg_cmp(const void *x, const void *y)
{
    const dst_seg *a = x, *b = y;
    if (a->dest != b->dest)
        return a->dest < b->dest ? -1 : 1;
    if (a->block != b->block)
        return a->block < b->block ? -1 : 1;
    return a->slice < b->slice ? -1 : a->slice > b->slice;
}

/* Two slices writing one destination (tensor, token slot, head):
 * LLM_PARAM_INVALID. The destination of a push is each slice's remote
 * cache (slices to one cache compete). */
static llmdd_status
check_overlap(const sargs *a, const llmdd_kv_layout *dl_local,
              const llmdd_kv_layout *const *dls, const sstate *ss)
{
    size_t nseg = 0, cap = 0, moving = 0;
    dst_seg *segs = NULL;
    llmdd_status st = LLM_SUCCESS;

    /* Only two slices can compete (one slice's table names no block
     * twice: check_args). */
    for (size_t i = 0; i < a->n; i++)
        moving += ss[i].moves;
    if (moving < 2)
        return LLM_SUCCESS;
    for (size_t i = 0; i < a->n; i++) {
        if (!ss[i].moves)
            continue;
        const llmdd_kv_slice *s = &a->slices[i];
        const llmdd_kv_layout *dl = a->write ? dls[i] : dl_local;
        uint64_t B = dl->block_size;
        for (uint64_t t = s->token_begin; t < s->token_end;) {
            uint64_t r = t - s->dst.first_token, slot = r % B;
            uint64_t L = B - slot < s->token_end - t ? B - slot
                                                     : s->token_end - t;
            if (nseg == cap) {
                cap = cap ? cap * 2 : 64;
                dst_seg *n = realloc(segs, cap * sizeof(*n));
                if (n == NULL) {
                    free(segs);
                    return LLM_OUT_OF_MEMORY;
                }
                segs = n;
            }
            uint64_t dest = a->write ? (a->remotes[i].cluster_id * 1000003u) ^
                                           (uint64_t)a->remotes[i].cache_id
                                     : 0;
            segs[nseg++] = (dst_seg){dest, s->dst.blocks[r / B], slot,
                                     slot + L, (uint32_t)i};
            t += L;
        }
    }
    qsort(segs, nseg, sizeof(*segs), seg_cmp);
    for (size_t i = 0; i < nseg && st == LLM_SUCCESS; i++) {
        for (size_t j = i + 1; j < nseg && segs[j].dest == segs[i].dest &&
                               segs[j].block == segs[i].block;
             j++) {
            const dst_seg *x = &segs[i], *y = &segs[j];
            const sstate *p = &ss[x->slice], *q = &ss[y->slice];
            const llmdd__tensor_span *ps = a->write ? &p->rspan : &p->lspan;
            const llmdd__tensor_span *qs = a->write ? &q->rspan : &q->lspan;
            if (x->slice != y->slice && x->lo < y->hi && y->lo < x->hi &&
                p->h0 < q->h1 && q->h0 < p->h1 &&
                ps->first < qs->first + qs->count &&
                qs->first < ps->first + ps->count &&
                (!a->write ||
                 (a->remotes[x->slice].cluster_id ==
                      a->remotes[y->slice].cluster_id &&
                  a->remotes[x->slice].cache_id ==
                      a->remotes[y->slice].cache_id))) {
                log_error("slices: slices %u and %u write the same "
                          "destination block %llu",
                          x->slice, y->slice, (unsigned long long)x->block);
                st = LLM_PARAM_INVALID;
                break;
            }
        }
    }
    free(segs);
    return st;
}

/* Slice i's remote cache against ours, as soon as its layout is known (so
 * that every kind of incompatibility of a slice comes before anything of a
 * later slice's remote cache). */
static llmdd_status
check_compatible(const sargs *a, const llmdd__cache *lc, const sstate *ss,
                 const llmdd_kv_layout *rl, size_t i)
{
    if (!llmdd__layout_compatible(&lc->layout, rl) ||
        lc->desc.data_type != ss[i].rc->desc.data_type)
        REFUSE(LLM_CACHE_INCOMPATIBLE,
               "%s: slice %zu: cache %lld of cluster %llu is not compatible "
               "(total heads %u/%u, head bytes %u/%u, parts %u/%u, data "
               "type %d/%d, or both tags set and different)",
               what(a), i, (long long)ss[i].rc->id,
               (unsigned long long)a->remotes[i].cluster_id,
               lc->layout.total_heads, rl->total_heads, lc->layout.head_bytes,
               rl->head_bytes, lc->layout.num_parts, rl->num_parts,
               (int)lc->desc.data_type, (int)ss[i].rc->desc.data_type);
    return LLM_SUCCESS;
}

/* The remote side of every slice, once every link, remote cache and layout
 * is known and compatible: tables, heads, ranges, then overlaps. */
static llmdd_status
check_remote(const sargs *a, const llmdd__cache *lc, sstate *ss,
             const llmdd_kv_layout *rls)
{
    const llmdd_kv_layout **dls = calloc(a->n, sizeof(*dls));
    if (dls == NULL)
        return LLM_OUT_OF_MEMORY;
    llmdd_status st = LLM_SUCCESS;
    size_t bad = 0;
    for (size_t i = 0; i < a->n && st == LLM_SUCCESS; i++) {
        const llmdd_kv_slice *s = &a->slices[i];
        const llmdd_kv_layout *rl = &rls[i];
        bad = i;
        const llmdd_kv_layout *sl = a->write ? &lc->layout : rl;
        const llmdd_kv_layout *dl = a->write ? rl : &lc->layout;
        dls[i] = rl;
        st = LLM_PARAM_INVALID;
        if (ss[i].moves &&
            llmdd__table_check(table_of(s, !a->write), rl,
                               (uint64_t)ss[i].rc->desc.shape[0],
                               s->token_begin, s->token_end) != LLM_SUCCESS)
            break;
        llmdd__slice_heads(s, sl, dl, &ss[i].h0, &ss[i].h1);
        if (ss[i].moves && (ss[i].h0 >= ss[i].h1 ||
                            !holds(sl, ss[i].h0, ss[i].h1) ||
                            !holds(dl, ss[i].h0, ss[i].h1)))
            break;
        if (llmdd__range_resolve(&s->ext, !a->write,
                                 ss[i].rc->desc.num_tensors,
                                 &ss[i].rspan) != LLM_SUCCESS ||
            llmdd__spans_match(ss[i].lspan, ss[i].rspan) != LLM_SUCCESS)
            break;
        st = LLM_SUCCESS;
    }
    if (st != LLM_SUCCESS)
        log_error("%s: slice %zu: the remote table, the heads [%u, %u) (held "
                  "by both sides?) or the layer ranges do not fit cache %lld "
                  "of cluster %llu",
                  what(a), bad, ss[bad].h0, ss[bad].h1,
                  (long long)ss[bad].rc->id,
                  (unsigned long long)a->remotes[bad].cluster_id);
    if (st == LLM_SUCCESS)
        st = check_overlap(a, &lc->layout, dls, ss);
    free(dls);
    return st;
}

/* ---- The request ---- */

static void
release(llmdd *dd, llmdd__cache *lc, sstate *ss, size_t n)
{
    for (size_t i = 0; i < n; i++) {
        if (ss[i].rc != NULL)
            llmdd__link_remote_put(ss[i].link, ss[i].rc);
        if (ss[i].link != NULL)
            llmdd__link_put(ss[i].link);
    }
    if (lc != NULL)
        llmdd__cache_put(dd, lc);
}

/* Plans every slice into the legs; on failure frees what it made. */
static llmdd_status
plan_legs(const sargs *a, const llmdd__cache *lc, const sstate *ss,
          const llmdd_kv_layout *rls, int64_t deadline,
          llmdd__request_leg *legs, uint64_t *bytes)
{
    for (size_t i = 0; i < a->n; i++) {
        const llmdd_kv_slice *s = &a->slices[i];
        llmdd__run *runs = NULL;
        llmdd__plan2 p = {0};
        uint8_t **local = NULL;
        size_t nruns = 0;
        if (ss[i].moves) {
            const llmdd_kv_layout *sl = a->write ? &lc->layout : &rls[i];
            const llmdd_kv_layout *dl = a->write ? &rls[i] : &lc->layout;
            int rc =
                llmdd__plan_slice(&p, sl, &s->src, dl, &s->dst, s->token_begin,
                                  s->token_end, ss[i].h0, ss[i].h1);
            *bytes += llmdd__plan2_bytes(&p) * ss[i].rspan.count;
            /* A transport that moves 2-D runs gets the plan as it is. */
            if (rc == 0 && !ss[i].link->ops->strided) {
                rc = llmdd__plan2_flatten(&p, &runs, &nruns);
                llmdd__plan2_free(&p);
            }
            local = malloc(ss[i].lspan.count * sizeof(*local));
            if (rc != 0 || local == NULL) {
                free(runs);
                free(local);
                llmdd__plan2_free(&p);
                for (size_t k = 0; k < i; k++) {
                    free((void *)legs[k].x.runs);
                    free((void *)legs[k].x.runs2);
                    free((void *)legs[k].x.local);
                }
                return LLM_OUT_OF_MEMORY;
            }
            for (uint32_t t = 0; t < ss[i].lspan.count; t++)
                local[t] = (uint8_t *)(uintptr_t)lc->addrs[ss[i].lspan.first + t];
        }
        legs[i] = (llmdd__request_leg){
            .link = ss[i].link,
            .rc = ss[i].rc,
            .x = {.write = a->write,
                  .remote = ss[i].rc,
                  .remote_first = ss[i].rspan.first,
                  .count = ss[i].rspan.count,
                  .local = local,
                  .runs = runs,
                  .nruns = nruns,
                  .runs2 = p.runs,
                  .nruns2 = p.n,
                  .deadline_ms = deadline,
                  .local_bytes = lc->tensor_size * lc->desc.num_tensors},
            .group = ss[i].group,
        };
    }
    return LLM_SUCCESS;
}

static llmdd_status
slices_run(llmdd *dd, const sargs *a, uint64_t t0, bool *submitted,
           uint64_t *bytes)
{
    llmdd_status st;

    if ((st = llmdd__ready(dd)) != LLM_SUCCESS)
        return st;
    if ((st = check_args(dd, a)) != LLM_SUCCESS)
        return st;
    int64_t deadline = llmdd__now_ms() + llmdd__wait_ms(dd);
    sstate *ss = calloc(a->n, sizeof(*ss));
    llmdd_kv_layout *rls = calloc(a->n, sizeof(*rls));
    if (ss == NULL || rls == NULL) {
        free(ss);
        free(rls);
        return LLM_OUT_OF_MEMORY;
    }
    llmdd__cache *lc = llmdd__cache_get(dd, a->local->cache_id);
    if (lc == NULL) {
        st = LLM_KV_CACHE_NOT_EXIST;
        goto out;
    }
    if ((st = check_local(a, lc, ss)) != LLM_SUCCESS)
        goto out;
    /* Every link, then every remote cache and its layout. */
    uint32_t ngroups = 0;
    for (size_t i = 0; i < a->n; i++) {
        ss[i].link = llmdd__link_get(dd, a->remotes[i].cluster_id);
        if (ss[i].link == NULL) {
            st = LLM_NOT_YET_LINK;
            goto out;
        }
        size_t k = 0;
        while (k < i && ss[k].link != ss[i].link)
            k++;
        ss[i].group = k < i ? ss[k].group : ngroups++;
    }
    for (size_t i = 0; i < a->n; i++) {
        st = llmdd__link_remote(ss[i].link, a->remotes[i].cache_id, deadline,
                                &ss[i].rc);
        if (st == LLM_SUCCESS)
            st = remote_layout(ss[i].link, ss[i].rc, deadline, &rls[i]);
        if (st == LLM_SUCCESS &&
            (st = check_compatible(a, lc, ss, &rls[i], i)) != LLM_SUCCESS)
            goto out;
        if (st != LLM_SUCCESS) {
            if (st == LLM_KV_CACHE_NOT_EXIST && ss[i].rc != NULL)
                llmdd__link_forget(ss[i].link, a->remotes[i].cache_id);
            llmdd__link_status(ss[i].link, st);
            goto out;
        }
    }
    if ((st = check_remote(a, lc, ss, rls)) != LLM_SUCCESS)
        goto out;

    llmdd__request_leg *legs = calloc(a->n, sizeof(*legs));
    if (legs == NULL) {
        st = LLM_OUT_OF_MEMORY;
        goto out;
    }
    if ((st = plan_legs(a, lc, ss, rls, deadline, legs, bytes)) !=
        LLM_SUCCESS) {
        free(legs);
        goto out;
    }
    llmdd__request_plan p = {
        .lc = lc,
        .legs = legs,
        .nlegs = (uint32_t)a->n,
        .ngroups = ngroups,
        .flags = a->opts != NULL ? a->opts->flags : 0,
        .tnpl = a->slices[0].ext.tensor_num_per_layer,
        .notify = a->opts != NULL ? a->opts->notify : NULL,
        .notify_len = a->opts != NULL ? a->opts->notify_len : 0,
        .op = a->write ? LLMDD__OP_PUSH_BLOCKS : LLMDD__OP_PULL_BLOCKS,
        .bytes = *bytes,
        .t0 = t0,
    };
    free(ss);
    free(rls);
    *submitted = true;
    return llmdd__request_submit(dd, &p, a->post ? a->req_out : NULL);
out:
    release(dd, lc, ss, a->n);
    free(ss);
    free(rls);
    return st;
}

static llmdd_status
slices(llmdd *dd, const sargs *a)
{
    uint64_t bytes = 0;

    if (dd == NULL)
        return LLM_PARAM_INVALID;
    uint64_t t0 = llmdd__metrics_begin(dd);
    bool submitted = false;
    llmdd_status st = slices_run(dd, a, t0, &submitted, &bytes);
    if (!submitted)
        llmdd__metrics_xfer(dd,
                            a->write ? LLMDD__OP_PUSH_BLOCKS
                                     : LLMDD__OP_PULL_BLOCKS,
                            NULL, st, bytes, t0);
    return st;
}

llmdd_status
llmdd_pull_kv_slices_async(llmdd *dd, const llmdd_cache_index *srcs,
                           const llmdd_kv_slice *sl, size_t n,
                           const llmdd_cache *dst_cache,
                           const llmdd_xfer_opts *opts,
                           llmdd_request **req_out)
{
    sargs a = {.write = false, .post = true, .remotes = srcs, .slices = sl,
               .n = n, .local = dst_cache, .opts = opts, .req_out = req_out};
    return slices(dd, &a);
}

llmdd_status
llmdd_push_kv_slices_async(llmdd *dd, const llmdd_cache *src_cache,
                           const llmdd_cache_index *dsts,
                           const llmdd_kv_slice *sl, size_t n,
                           const llmdd_xfer_opts *opts,
                           llmdd_request **req_out)
{
    sargs a = {.write = true, .post = true, .remotes = dsts, .slices = sl,
               .n = n, .local = src_cache, .opts = opts, .req_out = req_out};
    return slices(dd, &a);
}

llmdd_status
llmdd_pull_kv_slices(llmdd *dd, const llmdd_cache_index *srcs,
                     const llmdd_kv_slice *sl, size_t n,
                     const llmdd_cache *dst_cache)
{
    sargs a = {.write = false, .remotes = srcs, .slices = sl, .n = n,
               .local = dst_cache};
    return slices(dd, &a);
}

llmdd_status
llmdd_push_kv_slices(llmdd *dd, const llmdd_cache *src_cache,
                     const llmdd_cache_index *dsts, const llmdd_kv_slice *sl,
                     size_t n)
{
    sargs a = {.write = true, .remotes = dsts, .slices = sl, .n = n,
               .local = src_cache};
    return slices(dd, &a);
}
