/*
 * KV layouts and slice planning: layout rules, table checks, the 2-D run
 * planner and llmdd_tp_plan. Pure; see core/slices.h.
 */
#include <stdlib.h>
#include <string.h>

#include "core/slices.h"

static uint64_t
dim_extent(const llmdd_kv_layout *l, llmdd_kv_dim d)
{
    switch (d) {
    case LLMDD_KV_DIM_PART:
        return l->num_parts;
    case LLMDD_KV_DIM_HEAD:
        return l->num_heads;
    case LLMDD_KV_DIM_TOKEN:
        return l->block_size;
    case LLMDD_KV_DIM_BYTES:
        return l->head_bytes;
    default:
        return 0;
    }
}

llmdd_status
llmdd__layout_check(const llmdd_kv_layout *l, uint64_t block_bytes,
                    llmdd__layout_geom *g)
{
    bool seen[LLMDD_KV_MAX_DIMS + 1] = {false};
    llmdd__layout_geom geo;

    if (l == NULL || (l->num_dims != 4 && l->num_dims != 5))
        return LLM_PARAM_INVALID;
    for (uint32_t i = 0; i < l->num_dims; i++) {
        int d = (int)l->order[i];
        if (d < LLMDD_KV_DIM_BLOCK || d > LLMDD_KV_DIM_BYTES || seen[d])
            return LLM_PARAM_INVALID;
        seen[d] = true;
    }
    if (l->order[0] != LLMDD_KV_DIM_BLOCK ||
        l->order[l->num_dims - 1] != LLMDD_KV_DIM_BYTES ||
        seen[LLMDD_KV_DIM_PART] != (l->num_dims == 5))
        return LLM_PARAM_INVALID;
    if (l->block_size == 0 || l->num_heads == 0 || l->total_heads == 0 ||
        l->head_bytes == 0 || l->num_parts == 0 ||
        (l->num_dims == 4 && l->num_parts != 1) ||
        (uint64_t)l->head_first + l->num_heads > l->total_heads)
        return LLM_PARAM_INVALID;
    memset(&geo, 0, sizeof(geo));
    uint64_t s = 1;
    for (uint32_t i = l->num_dims; i-- > 1;) {
        llmdd_kv_dim d = l->order[i];
        geo.stride[d] = s;
        if (__builtin_mul_overflow(s, dim_extent(l, d), &s))
            return LLM_PARAM_INVALID;
    }
    geo.block = s;
    if (s != block_bytes)
        return LLM_PARAM_INVALID;
    geo.stride[LLMDD_KV_DIM_BLOCK] = s;
    if (g != NULL)
        *g = geo;
    return LLM_SUCCESS;
}

bool
llmdd__layout_compatible(const llmdd_kv_layout *a, const llmdd_kv_layout *b)
{
    if (a->total_heads != b->total_heads || a->head_bytes != b->head_bytes ||
        a->num_parts != b->num_parts)
        return false;
    return a->compat_tag == 0 || b->compat_tag == 0 ||
           a->compat_tag == b->compat_tag;
}

void
llmdd__slice_heads(const llmdd_kv_slice *s, const llmdd_kv_layout *src,
                   const llmdd_kv_layout *dst, uint32_t *begin, uint32_t *end)
{
    if (s->head_begin != 0 || s->head_end != 0) {
        *begin = s->head_begin;
        *end = s->head_end;
        return;
    }
    uint32_t b = src->head_first > dst->head_first ? src->head_first
                                                   : dst->head_first;
    uint64_t se = (uint64_t)src->head_first + src->num_heads;
    uint64_t de = (uint64_t)dst->head_first + dst->num_heads;
    uint64_t e = se < de ? se : de;
    *begin = b;
    *end = e > b ? (uint32_t)e : b;
}

llmdd_status
llmdd__table_check(const llmdd_block_table *t, const llmdd_kv_layout *l,
                   uint64_t num_blocks, uint64_t tb, uint64_t te)
{
    uint64_t B = l->block_size;

    if (t->first_token % B != 0 || tb < t->first_token || t->blocks == NULL)
        return LLM_PARAM_INVALID;
    uint64_t first = (tb - t->first_token) / B;
    uint64_t last = (te - 1 - t->first_token) / B;
    if (last >= t->num_blocks)
        return LLM_PARAM_INVALID;
    for (uint64_t k = first; k <= last; k++)
        if (t->blocks[k] >= num_blocks)
            return LLM_PARAM_INVALID;
    return LLM_SUCCESS;
}

static int
u64_cmp(const void *a, const void *b)
{
    uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
    return x < y ? -1 : x > y;
}

int
llmdd__table_repeats(const llmdd_block_table *t, uint32_t block_size,
                     uint64_t tb, uint64_t te)
{
    uint64_t first = (tb - t->first_token) / block_size;
    uint64_t last = (te - 1 - t->first_token) / block_size;
    size_t n = (size_t)(last - first + 1);
    const uint64_t *b = t->blocks + first;
    if (n < 2)
        return 0;
    /* An increasing table (a fresh allocation's, or the bench's) repeats
     * nothing; say so in one pass. */
    uint64_t max = b[0];
    bool rising = true;
    for (size_t i = 1; i < n; i++) {
        rising = rising && b[i] > b[i - 1];
        max = b[i] > max ? b[i] : max;
    }
    if (rising)
        return 0;
    /* Block ids within 64 per entry: one bit each, no more memory than the
     * sorted copy would take. A pool-wide permutation is that. */
    if (max / 64 < n) {
        uint64_t *bits = calloc((size_t)(max / 64 + 1), sizeof(*bits));
        if (bits == NULL)
            return -1;
        int rep = 0;
        for (size_t i = 0; i < n && !rep; i++) {
            uint64_t w = b[i] / 64, m = 1ull << (b[i] % 64);
            rep = (bits[w] & m) != 0;
            bits[w] |= m;
        }
        free(bits);
        return rep;
    }
    uint64_t *c = malloc(n * sizeof(*c));
    if (c == NULL)
        return -1;
    memcpy(c, b, n * sizeof(*c));
    qsort(c, n, sizeof(*c), u64_cmp);
    int rep = 0;
    for (size_t i = 1; i < n && !rep; i++)
        rep = c[i] == c[i - 1];
    free(c);
    return rep;
}

void
llmdd__plan2_free(llmdd__plan2 *p)
{
    free(p->runs);
    p->runs = NULL;
    p->n = p->cap = 0;
}

/*
 * Merges the run (so, dof, len, count, sst, dst) into the last one when it
 * continues it; else appends. Scalars, not a run by value: a struct built
 * on the stack and read back in 16-byte loads stalls on store forwarding,
 * which was half of the planner's time.
 */
static int
plan_push(llmdd__plan2 *p, uint64_t so, uint64_t dof, uint64_t len,
          uint64_t count, uint64_t sst, uint64_t dst)
{
    if (p->n > 0) {
        llmdd__run2 *l = &p->runs[p->n - 1];
        if (l->count == 1 && count == 1 && so == l->src_off + l->len &&
            dof == l->dst_off + l->len) {
            l->len += len; /* contiguous on both sides */
            return 0;
        }
        if (l->len == len) {
            if (l->count == 1 && so >= l->src_off &&
                dof >= l->dst_off + l->len &&
                (count == 1 ||
                 (so - l->src_off == sst && dof - l->dst_off == dst))) {
                l->src_stride = so - l->src_off;
                l->dst_stride = dof - l->dst_off;
                l->count += count;
                return 0;
            }
            if (l->count > 1 &&
                (count == 1 ||
                 (sst == l->src_stride && dst == l->dst_stride)) &&
                so == l->src_off + l->count * l->src_stride &&
                dof == l->dst_off + l->count * l->dst_stride) {
                l->count += count;
                return 0;
            }
        }
    }
    if (p->n == p->cap) {
        size_t cap = p->cap ? p->cap * 2 : 16;
        llmdd__run2 *n = realloc(p->runs, cap * sizeof(*n));
        if (n == NULL)
            return -1;
        p->runs = n;
        p->cap = cap;
    }
    llmdd__run2 *r = &p->runs[p->n++];
    r->src_off = so;
    r->dst_off = dof;
    r->len = len;
    r->count = count;
    r->src_stride = count == 1 ? 0 : sst;
    r->dst_stride = count == 1 ? 0 : dst;
    return 0;
}

/*
 * The dims of a box: count, source and destination stride each, as three
 * arrays rather than an array of structs, so that moving a dim is three
 * 8-byte copies of values just stored as such (a struct copy's 16-byte
 * loads stall on them). All four are set, parts, heads, tokens and blocks,
 * and emit_box keeps the count of those in use itself: a count stored
 * beside them is one the compiler cannot bound, and gcc 12 then warns at
 * -O2 and above that the dims past it may be read uninitialized.
 */
typedef struct {
    uint64_t n[4], ss[4], ds[4];
} box_dims;

/* Dim i takes dim j's place. */
static void
box_move(box_dims *b, int i, int j)
{
    b->n[i] = b->n[j];
    b->ss[i] = b->ss[j];
    b->ds[i] = b->ds[j];
}

/*
 * A box of elements: base offsets, 4 dims (those of count 1 are left out
 * first), elements of len bytes. Dims whose strides equal the element length
 * on both sides fold into it, and a dim that steps by a whole inner dim on
 * both sides joins it (whole blocks in a row after their tokens); the
 * widest remaining dim becomes the count of 2-D runs, the others are
 * walked, outer (larger source stride) first.
 */
static int
emit_box(llmdd__plan2 *p, uint64_t sbase, uint64_t dbase, uint64_t len,
         box_dims *d)
{
    int nd = 0;
    for (int i = 0; i < 4; i++)
        if (d->n[i] > 1)
            box_move(d, nd++, i);
    for (bool folded = true; folded;) {
        folded = false;
        for (int i = 0; i < nd && !folded; i++) {
            if (d->ss[i] == len && d->ds[i] == len) {
                len *= d->n[i];
                box_move(d, i, --nd);
                folded = true;
                break;
            }
            for (int j = 0; j < nd; j++) {
                if (j != i && d->ss[i] == d->n[j] * d->ss[j] &&
                    d->ds[i] == d->n[j] * d->ds[j]) {
                    d->n[j] *= d->n[i];
                    box_move(d, i, --nd);
                    folded = true;
                    break;
                }
            }
        }
    }
    if (nd == 0)
        return plan_push(p, sbase, dbase, len, 1, 0, 0);
    int c = 0;
    for (int i = 1; i < nd; i++)
        if (d->n[i] > d->n[c])
            c = i;
    uint64_t cn = d->n[c], css = d->ss[c], cds = d->ds[c];
    box_move(d, c, --nd);
    /* The walked dims, outer first; absent ones walk once. */
    for (int i = 1; i < nd; i++)
        for (int j = i; j > 0 && d->ss[j] > d->ss[j - 1]; j--) {
            uint64_t n = d->n[j], ss = d->ss[j], ds = d->ds[j];
            box_move(d, j, j - 1);
            d->n[j - 1] = n;
            d->ss[j - 1] = ss;
            d->ds[j - 1] = ds;
        }
    for (int i = nd; i < 3; i++) {
        d->n[i] = 1;
        d->ss[i] = d->ds[i] = 0;
    }
    for (uint64_t a = 0; a < d->n[0]; a++)
        for (uint64_t b = 0; b < d->n[1]; b++)
            for (uint64_t e = 0; e < d->n[2]; e++) {
                uint64_t so =
                    sbase + a * d->ss[0] + b * d->ss[1] + e * d->ss[2];
                uint64_t dof =
                    dbase + a * d->ds[0] + b * d->ds[1] + e * d->ds[2];
                if (plan_push(p, so, dof, len, cn, css, cds) != 0)
                    return -1;
            }
    return 0;
}

int
llmdd__plan_slice(llmdd__plan2 *p, const llmdd_kv_layout *sl,
                  const llmdd_block_table *st, const llmdd_kv_layout *dl,
                  const llmdd_block_table *dt, uint64_t tb, uint64_t te,
                  uint32_t h0, uint32_t h1)
{
    llmdd__layout_geom sg, dg;

    /* Checked layouts: the geometry is their own product. */
    (void)llmdd__layout_check(sl, (uint64_t)sl->block_size * sl->num_heads *
                                      sl->head_bytes * sl->num_parts,
                              &sg);
    (void)llmdd__layout_check(dl, (uint64_t)dl->block_size * dl->num_heads *
                                      dl->head_bytes * dl->num_parts,
                              &dg);
    uint64_t sB = sl->block_size, dB = dl->block_size;
    for (uint64_t t = tb; t < te;) {
        uint64_t sr = t - st->first_token, dr = t - dt->first_token;
        uint64_t ss = sr % sB, ds = dr % dB;
        uint64_t L = te - t;
        if (sB - ss < L)
            L = sB - ss;
        if (dB - ds < L)
            L = dB - ds;
        const uint64_t *sb = st->blocks + sr / sB, *db = dt->blocks + dr / dB;
        /* Whole blocks of one size, numbered in a row on both sides, make
         * one box (the tables were checked up to te's block). Measured from
         * t, which may sit near the top of the range: no sum can wrap. */
        uint64_t nb = 1;
        if (ss == 0 && ds == 0 && L == sB && sB == dB)
            while ((te - t) / sB > nb && sb[nb] == sb[0] + nb &&
                   db[nb] == db[0] + nb)
                nb++;
        uint64_t sbase =
            sb[0] * sg.block + ss * sg.stride[LLMDD_KV_DIM_TOKEN] +
            (uint64_t)(h0 - sl->head_first) * sg.stride[LLMDD_KV_DIM_HEAD];
        uint64_t dbase =
            db[0] * dg.block + ds * dg.stride[LLMDD_KV_DIM_TOKEN] +
            (uint64_t)(h0 - dl->head_first) * dg.stride[LLMDD_KV_DIM_HEAD];
        /* Every field set by value: a zero initializer costs a `rep stos`
         * here. */
        box_dims d = {
            .n = {sl->num_parts, h1 - h0, L, nb},
            .ss = {sg.stride[LLMDD_KV_DIM_PART], sg.stride[LLMDD_KV_DIM_HEAD],
                   sg.stride[LLMDD_KV_DIM_TOKEN], sg.block},
            .ds = {dg.stride[LLMDD_KV_DIM_PART], dg.stride[LLMDD_KV_DIM_HEAD],
                   dg.stride[LLMDD_KV_DIM_TOKEN], dg.block},
        };
        if (emit_box(p, sbase, dbase, sl->head_bytes, &d) != 0)
            return -1;
        t += L * nb;
    }
    return 0;
}

/* Where byte x of slot b lies in its tensor (core/layout.h). */
static uint64_t
slot_pos(const llmdd__slot_geom *g, uint64_t b, uint64_t x)
{
    return b * g->row + (x / g->row) * g->pitch + x % g->row;
}

static uint64_t
gcd64(uint64_t a, uint64_t b)
{
    while (b != 0) {
        uint64_t t = a % b;
        a = b;
        b = t;
    }
    return a;
}

int
llmdd__plan_slot(llmdd__plan2 *p, const llmdd__slot_geom *sg, uint64_t ss,
                 const llmdd__slot_geom *dg, uint64_t ds, uint64_t off,
                 uint64_t len)
{
    /* A side of one row is contiguous: it cuts nothing (0). */
    uint64_t sr = sg->rows > 1 ? sg->row : 0;
    uint64_t dr = dg->rows > 1 ? dg->row : 0;
    uint64_t period;

    if (sr == 0 && dr == 0)
        period = len;
    else if (sr == 0 || dr == 0)
        period = sr == 0 ? dr : sr;
    else if (__builtin_mul_overflow(sr / gcd64(sr, dr), dr, &period))
        period = len + 1; /* cannot be: len is whole rows of both */
    /* The checked range is whole rows of every side that has several, so
     * it is whole periods; anything else is the caller's error. */
    if (period == 0 || len % period != 0)
        return -1;
    uint64_t count = len / period;
    uint64_t sst = sr != 0 ? period / sr * sg->pitch : period;
    uint64_t dst = dr != 0 ? period / dr * dg->pitch : period;
    /* The pieces of the first period, each repeated once a period. */
    for (uint64_t y = 0; y < period;) {
        uint64_t x = off + y, e = period;
        if (sr != 0 && (x / sr + 1) * sr - off < e)
            e = (x / sr + 1) * sr - off;
        if (dr != 0 && (x / dr + 1) * dr - off < e)
            e = (x / dr + 1) * dr - off;
        if (plan_push(p, slot_pos(sg, ss, x), slot_pos(dg, ds, x), e - y, count,
                      sst, dst) != 0)
            return -1;
        y = e;
    }
    return 0;
}

uint64_t
llmdd__plan2_elems(const llmdd__plan2 *p)
{
    uint64_t n = 0;
    for (size_t i = 0; i < p->n; i++)
        n += p->runs[i].count;
    return n;
}

uint64_t
llmdd__plan2_bytes(const llmdd__plan2 *p)
{
    uint64_t n = 0;
    for (size_t i = 0; i < p->n; i++)
        n += p->runs[i].count * p->runs[i].len;
    return n;
}

int
llmdd__plan2_flatten(const llmdd__plan2 *p, llmdd__run **out, size_t *n_out)
{
    uint64_t total = llmdd__plan2_elems(p);
    size_t n = 0;

    *out = NULL;
    *n_out = 0;
    if (total == 0)
        return 0;
    if (total > SIZE_MAX / sizeof(llmdd__run))
        return -1;
    llmdd__run *r = malloc((size_t)total * sizeof(*r));
    if (r == NULL)
        return -1;
    for (size_t i = 0; i < p->n; i++) {
        const llmdd__run2 *q = &p->runs[i];
        for (uint64_t k = 0; k < q->count; k++) {
            uint64_t so = q->src_off + k * q->src_stride;
            uint64_t dof = q->dst_off + k * q->dst_stride;
            if (n > 0 && r[n - 1].src_off + r[n - 1].len == so &&
                r[n - 1].dst_off + r[n - 1].len == dof) {
                r[n - 1].len += q->len;
                continue;
            }
            r[n++] = (llmdd__run){so, dof, q->len};
        }
    }
    *out = r;
    *n_out = n;
    return 0;
}

static uint64_t
product(const llmdd_kv_layout *l)
{
    uint64_t b = l->block_size;
    if (__builtin_mul_overflow(b, (uint64_t)l->num_heads, &b) ||
        __builtin_mul_overflow(b, (uint64_t)l->head_bytes, &b) ||
        __builtin_mul_overflow(b, (uint64_t)l->num_parts, &b))
        return 0;
    return b;
}

llmdd_status
llmdd_kv_slice_plan_size(const llmdd_kv_layout *src,
                         const llmdd_kv_layout *dst,
                         const llmdd_kv_slice *slice, uint64_t *runs_out,
                         uint64_t *bytes_out)
{
    uint32_t h0, h1;

    if (src == NULL || dst == NULL || slice == NULL || runs_out == NULL ||
        bytes_out == NULL ||
        llmdd__layout_check(src, product(src), NULL) != LLM_SUCCESS ||
        llmdd__layout_check(dst, product(dst), NULL) != LLM_SUCCESS ||
        !llmdd__layout_compatible(src, dst) ||
        slice->token_begin > slice->token_end)
        return LLM_PARAM_INVALID;
    if (slice->token_begin == slice->token_end) {
        *runs_out = *bytes_out = 0;
        return LLM_SUCCESS;
    }
    uint64_t tb = slice->token_begin, te = slice->token_end;
    if (llmdd__table_check(&slice->src, src, UINT64_MAX, tb, te) !=
            LLM_SUCCESS ||
        llmdd__table_check(&slice->dst, dst, UINT64_MAX, tb, te) !=
            LLM_SUCCESS)
        return LLM_PARAM_INVALID;
    if ((slice->head_begin != 0 || slice->head_end != 0) &&
        slice->head_begin >= slice->head_end)
        return LLM_PARAM_INVALID;
    llmdd__slice_heads(slice, src, dst, &h0, &h1);
    if (h0 >= h1 || h0 < src->head_first || h0 < dst->head_first ||
        (uint64_t)h1 > (uint64_t)src->head_first + src->num_heads ||
        (uint64_t)h1 > (uint64_t)dst->head_first + dst->num_heads)
        return LLM_PARAM_INVALID;
    llmdd__plan2 p = {0};
    if (llmdd__plan_slice(&p, src, &slice->src, dst, &slice->dst, tb, te, h0,
                          h1) != 0) {
        llmdd__plan2_free(&p);
        return LLM_OUT_OF_MEMORY;
    }
    *runs_out = p.n;
    *bytes_out = llmdd__plan2_bytes(&p);
    llmdd__plan2_free(&p);
    return LLM_SUCCESS;
}

/* ---- llmdd_tp_plan ---- */

/* Whether tp ranks can share H heads (docs/model.md's ownership rule). */
static bool
tp_valid(uint32_t H, uint32_t tp)
{
    return tp > 0 && (tp <= H ? H % tp == 0 : tp % H == 0);
}

/* The heads rank r of tp holds: [*b, *e). */
static void
tp_heads(uint32_t H, uint32_t tp, uint32_t r, uint32_t *b, uint32_t *e)
{
    if (tp <= H) {
        *b = r * (H / tp);
        *e = *b + H / tp;
    } else {
        *b = r / (tp / H);
        *e = *b + 1;
    }
}

llmdd_status
llmdd_tp_plan(uint32_t total_heads, uint32_t src_tp, uint32_t dst_tp,
              uint32_t dst_rank, llmdd_tp_piece *out, size_t cap,
              size_t *count_out)
{
    uint32_t H = total_heads, db, de;

    if (H == 0 || !tp_valid(H, src_tp) || !tp_valid(H, dst_tp) ||
        dst_rank >= dst_tp || out == NULL || count_out == NULL ||
        cap < src_tp)
        return LLM_PARAM_INVALID;
    tp_heads(H, dst_tp, dst_rank, &db, &de);
    for (uint32_t s = 0; s < src_tp; s++)
        out[s] = (llmdd_tp_piece){s, 0, 0};
    if (src_tp <= H) {
        /* One holder per head: the ranks whose ranges meet ours. */
        uint32_t per = H / src_tp;
        for (uint32_t s = db / per; s * per < de; s++) {
            uint32_t b = s * per > db ? s * per : db;
            uint32_t e = (s + 1) * per < de ? (s + 1) * per : de;
            out[s].head_begin = b;
            out[s].head_end = e;
        }
    } else {
        /* k replicas per head: the j-th destination rank holding head h
         * reads replica j mod k; a head with one reader takes replica
         * h mod k, so neighbouring heads come from different ranks. */
        uint32_t k = src_tp / H;
        for (uint32_t h = db; h < de; h++) {
            uint32_t j = dst_tp > H ? dst_rank - h * (dst_tp / H) : h;
            uint32_t s = h * k + j % k;
            out[s].head_begin = h;
            out[s].head_end = h + 1;
        }
    }
    *count_out = src_tp;
    return LLM_SUCCESS;
}
