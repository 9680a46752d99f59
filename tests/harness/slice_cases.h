/*
 * Random slice cases for the KV layout tests (tests/unit/slices_test.c and
 * the conformance tests over every transport): two layouts (NHD, HND or
 * with a PART dim, block sizes 1..64, 1..16 heads with TP pairs including
 * TP > heads and MLA, head bytes 1..64), permuted, rotated or nearly
 * in-order block tables with offset
 * first tokens, a token range and a head range, and a per-byte reference
 * computed without the library's planner.
 */
#ifndef LLMDD_TESTS_SLICE_CASES_H
#define LLMDD_TESTS_SLICE_CASES_H

#include <llmdd/llmdd.h>
#include <stdlib.h>
#include <string.h>

typedef struct {
    uint64_t s;
} sc_rng;

static inline uint64_t
sc_next(sc_rng *r)
{
    uint64_t x = r->s;
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    return r->s = x;
}

static inline uint32_t
sc_below(sc_rng *r, uint32_t n)
{
    return n == 0 ? 0 : (uint32_t)(sc_next(r) % n);
}

/* The source byte at (layer, part, token, head, byte). */
static inline uint8_t
sc_hash(uint32_t layer, uint32_t part, uint64_t token, uint32_t head,
        uint32_t byte)
{
    uint64_t h = 0x9e3779b97f4a7c15ull ^ layer;
    h = (h ^ part) * 0xff51afd7ed558ccdull;
    h = (h ^ token) * 0xc4ceb9fe1a85ec53ull;
    h = (h ^ head) * 0xff51afd7ed558ccdull;
    h = (h ^ byte) * 0xc4ceb9fe1a85ec53ull;
    return (uint8_t)(h >> 56);
}

typedef struct {
    llmdd_kv_layout sl, dl;
    uint32_t src_tp, dst_tp, src_rank, dst_rank;
    uint64_t s_blocks, d_blocks; /* blocks of each cache (shape[0]) */
    uint64_t *stab, *dtab;       /* the tables */
    llmdd_kv_slice slice;
    uint32_t h0, h1; /* the heads moved */
} sc_case;

/* Strides of a layout computed the plain way: index by llmdd_kv_dim. */
static inline void
sc_strides(const llmdd_kv_layout *l, uint64_t st[6], uint64_t *block)
{
    uint64_t s = 1;
    memset(st, 0, 6 * sizeof(uint64_t));
    for (int i = (int)l->num_dims - 1; i >= 1; i--) {
        st[l->order[i]] = s;
        switch (l->order[i]) {
        case LLMDD_KV_DIM_BYTES: s *= l->head_bytes; break;
        case LLMDD_KV_DIM_HEAD: s *= l->num_heads; break;
        case LLMDD_KV_DIM_TOKEN: s *= l->block_size; break;
        case LLMDD_KV_DIM_PART: s *= l->num_parts; break;
        default: break;
        }
    }
    *block = s;
}

/* The offset in a tensor of (part, token, head, byte) through a table. */
static inline uint64_t
sc_offset(const llmdd_kv_layout *l, const llmdd_block_table *t, uint32_t part,
          uint64_t token, uint32_t head, uint32_t byte)
{
    uint64_t st[6], blk;
    sc_strides(l, st, &blk);
    uint64_t r = token - t->first_token;
    return t->blocks[r / l->block_size] * blk +
           (r % l->block_size) * st[LLMDD_KV_DIM_TOKEN] +
           (uint64_t)(head - l->head_first) * st[LLMDD_KV_DIM_HEAD] +
           (uint64_t)part * st[LLMDD_KV_DIM_PART] + byte;
}

static inline uint64_t
sc_block_bytes(const llmdd_kv_layout *l)
{
    return (uint64_t)l->block_size * l->num_heads * l->head_bytes *
           l->num_parts;
}

static inline void
sc_tp_heads(uint32_t H, uint32_t tp, uint32_t r, uint32_t *b, uint32_t *n)
{
    if (tp <= H) {
        *b = r * (H / tp);
        *n = H / tp;
    } else {
        *b = r / (tp / H);
        *n = 1;
    }
}

/* A TP size valid for H heads: a divisor of H, or a multiple up to 4H. */
static inline uint32_t
sc_tp(sc_rng *r, uint32_t H)
{
    uint32_t c[64], n = 0;
    for (uint32_t t = 1; t <= H; t++)
        if (H % t == 0)
            c[n++] = t;
    for (uint32_t m = 2; m <= 4 && n < 64; m++)
        c[n++] = H * m;
    return c[sc_below(r, n)];
}

static inline void
sc_order(sc_rng *r, llmdd_kv_layout *l, bool part)
{
    llmdd_kv_dim mid[3] = {LLMDD_KV_DIM_HEAD, LLMDD_KV_DIM_TOKEN,
                           LLMDD_KV_DIM_PART};
    uint32_t nm = part ? 3 : 2;
    for (uint32_t i = nm - 1; i > 0; i--) {
        uint32_t j = sc_below(r, i + 1);
        llmdd_kv_dim t = mid[i];
        mid[i] = mid[j];
        mid[j] = t;
    }
    l->num_dims = nm + 2;
    l->order[0] = LLMDD_KV_DIM_BLOCK;
    for (uint32_t i = 0; i < nm; i++)
        l->order[1 + i] = mid[i];
    l->order[nm + 1] = LLMDD_KV_DIM_BYTES;
}

/* A table for tokens up to `end` with distinct blocks (repeats allowed
 * when `repeat`): covers [first, end), a few extra entries. */
static inline uint64_t *
sc_table(sc_rng *r, uint64_t first, uint64_t end, uint32_t B, bool repeat,
         size_t *n_out, uint64_t *cache_blocks)
{
    size_t n = (size_t)((end - first + B - 1) / B) + sc_below(r, 3);
    if (n == 0)
        n = 1;
    uint64_t nb = n + sc_below(r, 4);
    uint64_t *perm = malloc(nb * sizeof(*perm));
    /* Shuffled, rotated (blocks in a row, as a fresh allocation numbers
     * them: the planner joins whole blocks) or in a row but for a few
     * swaps. */
    uint32_t kind = sc_below(r, 3);
    uint64_t rot = sc_below(r, (uint32_t)nb);
    for (uint64_t i = 0; i < nb; i++)
        perm[i] = kind == 0 ? i : (i + rot) % nb;
    for (uint64_t i = nb - 1; kind == 0 && i > 0; i--) {
        uint64_t j = sc_next(r) % (i + 1), t = perm[i];
        perm[i] = perm[j];
        perm[j] = t;
    }
    for (uint32_t k = kind == 2 ? 1 + sc_below(r, 3) : 0; k > 0; k--) {
        uint64_t i = sc_below(r, (uint32_t)nb), j = sc_below(r, (uint32_t)nb);
        uint64_t t = perm[i];
        perm[i] = perm[j];
        perm[j] = t;
    }
    if (repeat && n > 1 && sc_below(r, 4) == 0)
        perm[sc_below(r, (uint32_t)n)] = perm[sc_below(r, (uint32_t)n)];
    *n_out = n;
    *cache_blocks = nb;
    return perm;
}

/*
 * A random case; max_tokens bounds the token range (the conformance tests
 * use fewer). Free with sc_case_free.
 */
static inline void
sc_case_make(sc_rng *r, sc_case *c, uint32_t max_tokens)
{
    memset(c, 0, sizeof(*c));
    uint32_t H = sc_below(r, 8) == 0 ? 1 : 1 + sc_below(r, 16); /* MLA: 1 */
    c->src_tp = sc_tp(r, H);
    c->dst_tp = sc_tp(r, H);
    c->dst_rank = sc_below(r, c->dst_tp);
    llmdd_tp_piece pieces[256];
    size_t np = 0;
    (void)llmdd_tp_plan(H, c->src_tp, c->dst_tp, c->dst_rank, pieces, 256,
                        &np);
    uint32_t pick = 0;
    for (uint32_t tries = 0; tries < 64; tries++) {
        pick = sc_below(r, (uint32_t)np);
        if (pieces[pick].head_end > pieces[pick].head_begin)
            break;
    }
    while (pieces[pick].head_end == pieces[pick].head_begin)
        pick = (pick + 1) % (uint32_t)np;
    c->src_rank = pieces[pick].rank;
    bool part = sc_below(r, 3) == 0;
    uint32_t parts = part ? 1 + sc_below(r, 3) : 1;
    llmdd_kv_layout *ls[2] = {&c->sl, &c->dl};
    uint32_t tps[2] = {c->src_tp, c->dst_tp};
    uint32_t ranks[2] = {c->src_rank, c->dst_rank};
    uint32_t hb = 1 + sc_below(r, 64);
    for (int i = 0; i < 2; i++) {
        sc_order(r, ls[i], part);
        /* One block size on both sides a third of the time. */
        ls[i]->block_size = i == 1 && sc_below(r, 3) == 0 ? ls[0]->block_size
                                                          : 1 + sc_below(r, 64);
        ls[i]->total_heads = H;
        sc_tp_heads(H, tps[i], ranks[i], &ls[i]->head_first,
                    &ls[i]->num_heads);
        ls[i]->head_bytes = hb;
        ls[i]->num_parts = parts;
    }
    /* Heads: a sub-range of the piece, or {0,0} (all both hold). */
    uint32_t pb = pieces[pick].head_begin, pe = pieces[pick].head_end;
    if (sc_below(r, 4) == 0) {
        c->slice.head_begin = c->slice.head_end = 0;
        uint32_t b = c->sl.head_first > c->dl.head_first ? c->sl.head_first
                                                         : c->dl.head_first;
        uint32_t se = c->sl.head_first + c->sl.num_heads;
        uint32_t de = c->dl.head_first + c->dl.num_heads;
        c->h0 = b;
        c->h1 = se < de ? se : de;
    } else {
        c->h0 = pb + sc_below(r, pe - pb);
        c->h1 = c->h0 + 1 + sc_below(r, pe - c->h0);
        c->slice.head_begin = c->h0;
        c->slice.head_end = c->h1;
    }
    uint64_t sf = (uint64_t)sc_below(r, 4) * c->sl.block_size;
    uint64_t df = (uint64_t)sc_below(r, 4) * c->dl.block_size;
    uint64_t lo = sf > df ? sf : df;
    uint64_t tb = lo + sc_below(r, 40);
    uint64_t te = tb + 1 + sc_below(r, max_tokens);
    size_t sn, dn;
    c->stab = sc_table(r, sf, te, c->sl.block_size, true, &sn, &c->s_blocks);
    c->dtab = sc_table(r, df, te, c->dl.block_size, false, &dn, &c->d_blocks);
    c->slice.src = (llmdd_block_table){c->stab, sn, sf};
    c->slice.dst = (llmdd_block_table){c->dtab, dn, df};
    c->slice.token_begin = tb;
    c->slice.token_end = te;
    c->slice.ext = (llmdd_kv_ext_param)LLMDD_KV_EXT_PARAM_DEFAULT;
}

static inline void
sc_case_free(sc_case *c)
{
    free(c->stab);
    free(c->dtab);
}

/* Fills a source tensor: every byte a table entry reaches is the hash of
 * its coordinates (later tokens win on a repeated block), the rest noise. */
static inline void
sc_fill_src(const sc_case *c, uint32_t layer, uint8_t *t)
{
    uint64_t size = c->s_blocks * sc_block_bytes(&c->sl);
    for (uint64_t i = 0; i < size; i++)
        t[i] = (uint8_t)(i * 131 + 7 + layer);
    const llmdd_block_table *tab = &c->slice.src;
    uint64_t end = tab->first_token + tab->num_blocks * c->sl.block_size;
    for (uint64_t tok = tab->first_token; tok < end; tok++)
        for (uint32_t p = 0; p < c->sl.num_parts; p++)
            for (uint32_t h = c->sl.head_first;
                 h < c->sl.head_first + c->sl.num_heads; h++)
                for (uint32_t b = 0; b < c->sl.head_bytes; b++)
                    t[sc_offset(&c->sl, tab, p, tok, h, b)] =
                        sc_hash(layer, p, tok, h, b);
}

/* The reference: what the destination must hold after the slice, per byte,
 * from the source tensor as filled; returns the bytes moved. */
static inline uint64_t
sc_reference(const sc_case *c, const uint8_t *src, uint8_t *dst)
{
    uint64_t moved = 0;
    for (uint64_t tok = c->slice.token_begin; tok < c->slice.token_end; tok++)
        for (uint32_t p = 0; p < c->sl.num_parts; p++)
            for (uint32_t h = c->h0; h < c->h1; h++)
                for (uint32_t b = 0; b < c->sl.head_bytes; b++) {
                    dst[sc_offset(&c->dl, &c->slice.dst, p, tok, h, b)] =
                        src[sc_offset(&c->sl, &c->slice.src, p, tok, h, b)];
                    moved++;
                }
    return moved;
}

#endif
