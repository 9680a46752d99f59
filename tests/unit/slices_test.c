/*
 * KV layouts and slice planning (src/core/slices.c), pure: the layout
 * rules, a property test of the planner against a per-byte reference
 * (10,000 random cases over NHD, HND and PART orders, block sizes 1..64 per
 * side, TP pairs including TP > heads and MLA, permuted tables with offset
 * first tokens), llmdd_tp_plan exhaustively for heads and TP sizes up to 64,
 * and the named regressions.
 */
#include <stdlib.h>
#include <string.h>

#include "core/slices.h"
#include "harness/harness.h"
#include "harness/slice_cases.h"

#define SENT 0xa5

static llmdd_kv_layout
nhd(uint32_t B, uint32_t heads, uint32_t first, uint32_t total, uint32_t hb)
{
    return (llmdd_kv_layout){
        .num_dims = 4,
        .order = {LLMDD_KV_DIM_BLOCK, LLMDD_KV_DIM_TOKEN, LLMDD_KV_DIM_HEAD,
                  LLMDD_KV_DIM_BYTES},
        .block_size = B,
        .num_heads = heads,
        .head_first = first,
        .total_heads = total,
        .head_bytes = hb,
        .num_parts = 1};
}

static llmdd_kv_layout
hnd(uint32_t B, uint32_t heads, uint32_t first, uint32_t total, uint32_t hb)
{
    llmdd_kv_layout l = nhd(B, heads, first, total, hb);
    l.order[1] = LLMDD_KV_DIM_HEAD;
    l.order[2] = LLMDD_KV_DIM_TOKEN;
    return l;
}

static void
test_layout_rules(void **state)
{
    (void)state;
    llmdd_kv_layout l = nhd(16, 2, 0, 4, 8), b;
    uint64_t blk = 16 * 2 * 8;
    assert_int_equal(llmdd__layout_check(&l, blk, NULL), LLM_SUCCESS);
    assert_int_equal(llmdd__layout_check(&l, blk + 1, NULL), LLM_PARAM_INVALID);
    assert_int_equal(llmdd__layout_check(NULL, blk, NULL), LLM_PARAM_INVALID);
    b = l, b.num_dims = 3;
    assert_int_equal(llmdd__layout_check(&b, blk, NULL), LLM_PARAM_INVALID);
    b = l, b.order[1] = LLMDD_KV_DIM_HEAD; /* HEAD twice, TOKEN missing */
    assert_int_equal(llmdd__layout_check(&b, blk, NULL), LLM_PARAM_INVALID);
    b = l, b.order[0] = LLMDD_KV_DIM_TOKEN, b.order[1] = LLMDD_KV_DIM_BLOCK;
    assert_int_equal(llmdd__layout_check(&b, blk, NULL), LLM_PARAM_INVALID);
    b = l, b.order[3] = LLMDD_KV_DIM_HEAD, b.order[2] = LLMDD_KV_DIM_BYTES;
    assert_int_equal(llmdd__layout_check(&b, blk, NULL), LLM_PARAM_INVALID);
    b = l, b.order[2] = (llmdd_kv_dim)9;
    assert_int_equal(llmdd__layout_check(&b, blk, NULL), LLM_PARAM_INVALID);
    b = l, b.order[2] = LLMDD_KV_DIM_PART; /* PART with num_dims 4 */
    assert_int_equal(llmdd__layout_check(&b, blk, NULL), LLM_PARAM_INVALID);
    b = l, b.num_dims = 5; /* 5 dims without PART */
    b.order[4] = LLMDD_KV_DIM_BYTES, b.order[3] = LLMDD_KV_DIM_HEAD;
    assert_int_equal(llmdd__layout_check(&b, blk, NULL), LLM_PARAM_INVALID);
    b = l, b.num_parts = 2; /* parts without a PART dim */
    assert_int_equal(llmdd__layout_check(&b, blk * 2, NULL), LLM_PARAM_INVALID);
    b = l, b.head_first = 3; /* 3 + 2 > 4 */
    assert_int_equal(llmdd__layout_check(&b, blk, NULL), LLM_PARAM_INVALID);
    b = l, b.block_size = 0;
    assert_int_equal(llmdd__layout_check(&b, 0, NULL), LLM_PARAM_INVALID);
    b = l, b.head_bytes = 0;
    assert_int_equal(llmdd__layout_check(&b, 0, NULL), LLM_PARAM_INVALID);
    b = l, b.total_heads = 0, b.head_first = 0;
    assert_int_equal(llmdd__layout_check(&b, blk, NULL), LLM_PARAM_INVALID);
    /* The product overflows: refused, not wrapped. */
    b = l, b.block_size = 1u << 31, b.head_bytes = 1u << 31;
    b.num_heads = 1u << 31, b.total_heads = 1u << 31;
    assert_int_equal(llmdd__layout_check(&b, 0, NULL), LLM_PARAM_INVALID);
    /* PART: 5 dims, any middle order. */
    llmdd_kv_layout p = {.num_dims = 5,
                         .order = {LLMDD_KV_DIM_BLOCK, LLMDD_KV_DIM_PART,
                                   LLMDD_KV_DIM_TOKEN, LLMDD_KV_DIM_HEAD,
                                   LLMDD_KV_DIM_BYTES},
                         .block_size = 4, .num_heads = 1, .total_heads = 1,
                         .head_bytes = 8, .num_parts = 2};
    llmdd__layout_geom g;
    assert_int_equal(llmdd__layout_check(&p, 64, &g), LLM_SUCCESS);
    assert_int_equal(g.stride[LLMDD_KV_DIM_PART], 32);
    assert_int_equal(g.stride[LLMDD_KV_DIM_TOKEN], 8);
    /* Compatibility: heads, bytes, parts and non-zero tags. */
    llmdd_kv_layout x = nhd(32, 1, 1, 4, 8);
    assert_true(llmdd__layout_compatible(&l, &x));
    x.head_bytes = 4;
    assert_false(llmdd__layout_compatible(&l, &x));
    x = nhd(32, 1, 1, 4, 8), x.compat_tag = 7;
    assert_true(llmdd__layout_compatible(&l, &x)); /* one tag is 0 */
    b = l, b.compat_tag = 8;
    assert_false(llmdd__layout_compatible(&b, &x));
    x.total_heads = 8;
    assert_false(llmdd__layout_compatible(&l, &x));
}

/* Applies 2-D runs and their 1-D form; both must equal the reference. */
static void
check_case(const sc_case *c, uint64_t *runs_total)
{
    llmdd__layout_geom sg, dg;
    assert_int_equal(llmdd__layout_check(&c->sl, sc_block_bytes(&c->sl), &sg),
                     LLM_SUCCESS);
    assert_int_equal(llmdd__layout_check(&c->dl, sc_block_bytes(&c->dl), &dg),
                     LLM_SUCCESS);
    assert_true(llmdd__layout_compatible(&c->sl, &c->dl));
    uint64_t tb = c->slice.token_begin, te = c->slice.token_end;
    assert_int_equal(llmdd__table_check(&c->slice.src, &c->sl, c->s_blocks,
                                        tb, te),
                     LLM_SUCCESS);
    assert_int_equal(llmdd__table_check(&c->slice.dst, &c->dl, c->d_blocks,
                                        tb, te),
                     LLM_SUCCESS);
    assert_int_equal(llmdd__table_repeats(&c->slice.dst, c->dl.block_size,
                                          tb, te),
                     0);
    uint32_t h0, h1;
    llmdd__slice_heads(&c->slice, &c->sl, &c->dl, &h0, &h1);
    assert_int_equal(h0, c->h0);
    assert_int_equal(h1, c->h1);

    uint64_t ssize = c->s_blocks * sg.block, dsize = c->d_blocks * dg.block;
    uint8_t *src = malloc(ssize), *ref = malloc(dsize), *got = malloc(dsize);
    sc_fill_src(c, 3, src);
    memset(ref, SENT, dsize);
    memset(got, SENT, dsize);
    uint64_t moved = sc_reference(c, src, ref);

    llmdd__plan2 p = {0};
    assert_int_equal(llmdd__plan_slice(&p, &c->sl, &c->slice.src, &c->dl,
                                       &c->slice.dst, tb, te, h0, h1),
                     0);
    assert_true(llmdd__plan2_bytes(&p) == moved);
    for (size_t i = 0; i < p.n; i++) {
        const llmdd__run2 *r = &p.runs[i];
        assert_true(r->count >= 1 && r->len >= 1);
        for (uint64_t k = 0; k < r->count; k++) {
            uint64_t so = r->src_off + k * r->src_stride;
            uint64_t dof = r->dst_off + k * r->dst_stride;
            assert_true(so + r->len <= ssize && dof + r->len <= dsize);
            memcpy(got + dof, src + so, r->len);
        }
    }
    assert_memory_equal(got, ref, dsize);

    llmdd__run *flat;
    size_t nflat;
    assert_int_equal(llmdd__plan2_flatten(&p, &flat, &nflat), 0);
    memset(got, SENT, dsize);
    uint64_t fb = 0;
    for (size_t i = 0; i < nflat; i++) {
        memcpy(got + flat[i].dst_off, src + flat[i].src_off, flat[i].len);
        fb += flat[i].len;
    }
    assert_true(fb == moved);
    assert_memory_equal(got, ref, dsize);
    *runs_total += p.n;
    free(flat);
    llmdd__plan2_free(&p);
    free(src);
    free(ref);
    free(got);
}

static void
test_property(void **state)
{
    (void)state;
    sc_rng r = {0x2545f4914f6cdd1dull};
    uint64_t runs = 0;
    for (int i = 0; i < 10000; i++) {
        sc_case c;
        sc_case_make(&r, &c, 64);
        check_case(&c, &runs);
        sc_case_free(&c);
    }
    assert_true(runs > 0);
}

/* Whether a destination table names a block twice, against a pairwise
 * reference: increasing tables, ids small enough for the bitmap, and ids
 * that need the sorted copy, with and without one repeat. */
static void
test_table_repeats(void **state)
{
    (void)state;
    sc_rng r = {0x9e3779b97f4a7c15ull};
    static uint64_t tab[300];
    for (int i = 0; i < 3000; i++) {
        uint32_t n = 1 + sc_below(&r, 300), kind = sc_below(&r, 3);
        for (uint32_t k = 0; k < n; k++)
            tab[k] = kind == 0   ? 5 + 3ull * k
                     : kind == 1 ? sc_below(&r, 64 * n)
                                 : sc_next(&r) >> sc_below(&r, 8);
        if (sc_below(&r, 2) == 0 && n > 1)
            tab[sc_below(&r, n)] = tab[sc_below(&r, n)];
        int want = 0;
        for (uint32_t a = 0; a < n && !want; a++)
            for (uint32_t b = a + 1; b < n && !want; b++)
                want = tab[a] == tab[b];
        uint32_t B = 1 + sc_below(&r, 4);
        llmdd_block_table t = {tab, n, 0};
        assert_int_equal(llmdd__table_repeats(&t, B, 0, (uint64_t)n * B), want);
    }
}

/* Token positions at the top of the 64-bit range (a table's first token
 * may be any multiple of its block size): whole blocks in a row join
 * without the position wrapping, and the plan covers exactly the tokens. */
static void
test_tokens_at_the_top(void **state)
{
    (void)state;
    const uint64_t first = UINT64_MAX - 31;   /* a multiple of 16 */
    uint64_t *tab = malloc(2 * sizeof(*tab)); /* on the heap: ASan sees past */
    assert_non_null(tab);
    tab[0] = 0;
    tab[1] = 1;
    llmdd_kv_layout l = hnd(16, 1, 0, 1, 8);
    llmdd_block_table t = {tab, 2, first};
    for (uint64_t te = first + 16; te <= UINT64_MAX && te > first; te += 15) {
        assert_int_equal(llmdd__table_check(&t, &l, 2, first, te), LLM_SUCCESS);
        llmdd__plan2 p = {0};
        assert_int_equal(llmdd__plan_slice(&p, &l, &t, &l, &t, first, te, 0, 1),
                         0);
        assert_true(llmdd__plan2_bytes(&p) == (te - first) * 8);
        llmdd__plan2_free(&p);
    }
    free(tab);
}

/* One order on both sides: the run count follows the blocks, not heads or
 * tokens. HND, 4 of 8 heads from a rank holding 1, contiguous tables. */
static void
test_runs_follow_blocks(void **state)
{
    (void)state;
    for (int order = 0; order < 2; order++) {
        llmdd_kv_layout s = order ? hnd(16, 1, 2, 8, 256) : nhd(16, 1, 2, 8, 256);
        llmdd_kv_layout d = order ? hnd(16, 4, 0, 8, 256) : nhd(16, 4, 0, 8, 256);
        uint64_t tab[512];
        for (int i = 0; i < 512; i++)
            tab[i] = (uint64_t)i;
        llmdd_block_table t = {tab, 512, 0};
        llmdd__plan2 p = {0};
        assert_int_equal(llmdd__plan_slice(&p, &s, &t, &d, &t, 0, 8192, 2, 3),
                         0);
        assert_int_equal(p.n, 1);
        assert_true(llmdd__plan2_bytes(&p) == 8192ull * 256);
        llmdd__plan2_free(&p);
    }
}

/* Llama-3-70B: 8 KV heads, 8,192 tokens, block 16, prefill TP 8 -> decode
 * TP 2, contiguous tables, HND both sides: a decode rank's plan, summed
 * over its sources, has under 1,000 2-D runs. */
static void
test_llama70b_plan(void **state)
{
    (void)state;
    static uint64_t tab[512];
    for (int i = 0; i < 512; i++)
        tab[i] = (uint64_t)i;
    llmdd_block_table t = {tab, 512, 0};
    for (uint32_t dr = 0; dr < 2; dr++) {
        llmdd_tp_piece pc[8];
        size_t np;
        assert_int_equal(llmdd_tp_plan(8, 8, 2, dr, pc, 8, &np), LLM_SUCCESS);
        llmdd_kv_layout d = hnd(16, 4, dr * 4, 8, 256);
        size_t total = 0;
        for (size_t i = 0; i < np; i++) {
            if (pc[i].head_end == pc[i].head_begin)
                continue;
            llmdd_kv_layout s = hnd(16, 1, pc[i].rank, 8, 256);
            llmdd__plan2 p = {0};
            assert_int_equal(llmdd__plan_slice(&p, &s, &t, &d, &t, 0, 8192,
                                               pc[i].head_begin,
                                               pc[i].head_end),
                             0);
            total += p.n;
            llmdd__plan2_free(&p);
        }
        assert_true(total > 0 && total < 1000);
    }
}

/* Block-size remap 32 -> 16 (and back), HND and NHD: every byte right. */
static void
test_blocks_32_to_16(void **state)
{
    (void)state;
    for (int k = 0; k < 4; k++) {
        sc_case c;
        memset(&c, 0, sizeof(c));
        c.sl = (k & 1) ? hnd(32, 2, 0, 2, 8) : nhd(32, 2, 0, 2, 8);
        c.dl = (k & 1) ? nhd(16, 2, 0, 2, 8) : hnd(16, 2, 0, 2, 8);
        if (k & 2) {
            llmdd_kv_layout t = c.sl;
            c.sl = c.dl;
            c.dl = t;
        }
        c.s_blocks = c.d_blocks = 8;
        uint64_t st[8] = {3, 1, 2, 0, 4, 5, 6, 7}, dt[8] = {7, 6, 5, 4, 3, 2, 1, 0};
        c.stab = st, c.dtab = dt;
        c.slice.src = (llmdd_block_table){st, 8, 0};
        c.slice.dst = (llmdd_block_table){dt, 8, 0};
        c.slice.token_begin = 5;
        c.slice.token_end = 100;
        c.h0 = 0, c.h1 = 2;
        uint64_t runs = 0;
        check_case(&c, &runs);
    }
}

/* The heads rank r of tp holds, as docs/model.md states them. */
static void
holds(uint32_t H, uint32_t tp, uint32_t r, uint32_t *b, uint32_t *e)
{
    if (tp <= H) {
        *b = r * H / tp;
        *e = (r + 1) * H / tp;
    } else {
        *b = r * H / tp;
        *e = *b + 1;
    }
}

static bool
valid_tp(uint32_t H, uint32_t tp)
{
    return tp <= H ? H % tp == 0 : tp % H == 0;
}

/*
 * llmdd__plan_slot against a per-byte reference: caches [rows, slots, row]
 * (batch dim 1) or [slots, S] (batch dim 0) of one slot size S on each
 * side, every range of whole rows of both, applied to buffers and compared
 * byte for byte (untouched bytes included); rows of equal length make one
 * run.
 */
static void
slot_case(uint64_t srows, uint64_t drows, uint64_t S, uint64_t sslots,
          uint64_t dslots)
{
    llmdd_cache_desc sd = {.num_tensors = 1, .data_type = LLMDD_DT_UINT8};
    llmdd_cache_desc dd = sd;
    llmdd__slot_geom sg, dg;
    uint32_t sbd = srows > 1, dbd = drows > 1;
    int64_t s3[3] = {(int64_t)srows, (int64_t)sslots, (int64_t)(S / srows)};
    int64_t d3[3] = {(int64_t)drows, (int64_t)dslots, (int64_t)(S / drows)};
    sd.num_dims = sbd ? 3 : 2;
    dd.num_dims = dbd ? 3 : 2;
    for (int i = 0; i < 3; i++) {
        sd.shape[i] = sbd ? s3[i] : (i == 0 ? (int64_t)sslots : (int64_t)S);
        dd.shape[i] = dbd ? d3[i] : (i == 0 ? (int64_t)dslots : (int64_t)S);
    }
    uint64_t ts, st;
    assert_int_equal(llmdd__desc_check(&sd, &ts, &st), LLM_SUCCESS);
    assert_int_equal(llmdd__slot_geom_make(&sd, sbd, &sg), LLM_SUCCESS);
    assert_int_equal(llmdd__desc_check(&dd, &ts, &st), LLM_SUCCESS);
    assert_int_equal(llmdd__slot_geom_make(&dd, dbd, &dg), LLM_SUCCESS);
    assert_int_equal(llmdd__slot_bytes(&sg), S);
    assert_int_equal(llmdd__slot_bytes(&dg), S);
    uint64_t ssize = S * sslots, dsize = S * dslots;
    uint8_t *src = malloc(ssize), *got = malloc(dsize), *ref = malloc(dsize);
    for (uint64_t i = 0; i < ssize; i++)
        src[i] = (uint8_t)(i * 7 + 3);
    for (uint64_t sb = 0; sb < sslots; sb++) {
        uint64_t db = (sb * 3 + 1) % dslots;
        for (uint64_t off = 0; off < S; off++) {
            for (uint64_t len = 1; off + len <= S; len++) {
                bool ok =
                    llmdd__slot_range_check(&sg, off, len) == LLM_SUCCESS &&
                    llmdd__slot_range_check(&dg, off, len) == LLM_SUCCESS;
                bool whole =
                    (!sbd || (off % sg.row == 0 && len % sg.row == 0)) &&
                    (!dbd || (off % dg.row == 0 && len % dg.row == 0));
                assert_int_equal(ok, whole);
                if (!ok)
                    continue;
                memset(got, 0xee, dsize);
                memset(ref, 0xee, dsize);
                for (uint64_t x = off; x < off + len; x++) {
                    /* [rows, slots, row]: byte x of slot b by coordinates */
                    uint64_t sp = sbd ? (x / sg.row) * sslots * sg.row +
                                            sb * sg.row + x % sg.row
                                      : sb * S + x;
                    uint64_t dp = dbd ? (x / dg.row) * dslots * dg.row +
                                            db * dg.row + x % dg.row
                                      : db * S + x;
                    ref[dp] = src[sp];
                }
                llmdd__plan2 p = {0};
                assert_int_equal(
                    llmdd__plan_slot(&p, &sg, sb, &dg, db, off, len), 0);
                for (size_t r = 0; r < p.n; r++) {
                    const llmdd__run2 *q = &p.runs[r];
                    assert_true(llmdd__elems_fit(q->src_off, q->len, q->count,
                                                 q->src_stride, ssize));
                    assert_true(llmdd__elems_fit(q->dst_off, q->len, q->count,
                                                 q->dst_stride, dsize));
                    for (uint64_t k = 0; k < q->count; k++)
                        memcpy(got + q->dst_off + k * q->dst_stride,
                               src + q->src_off + k * q->src_stride, q->len);
                }
                if (sg.row == dg.row || !sbd || !dbd)
                    assert_int_equal(p.n, 1);
                assert_int_equal(llmdd__plan2_bytes(&p), len);
                llmdd__plan2_free(&p);
                assert_memory_equal(got, ref, dsize);
            }
        }
    }
    free(src);
    free(got);
    free(ref);
}

static void
test_plan_slot(void **state)
{
    (void)state;
    /* S = 24: rows of 6 against 4 (a period of 12), 24 against 8, equal
     * rows, and batch dim 0 against each. */
    slot_case(4, 6, 24, 3, 5);
    slot_case(1, 3, 24, 2, 3);
    slot_case(3, 3, 24, 3, 2);
    slot_case(4, 1, 24, 4, 2);
    slot_case(1, 1, 24, 3, 3);
    slot_case(2, 3, 12, 5, 4);
}

static void
test_tp_plan_exhaustive(void **state)
{
    (void)state;
    static llmdd_tp_piece out[64];
    static uint32_t reads[64][64]; /* [head][src rank] */
    for (uint32_t H = 1; H <= 64; H++) {
        for (uint32_t S = 1; S <= 64; S++) {
            for (uint32_t D = 1; D <= 64; D++) {
                size_t n = 99;
                bool ok = valid_tp(H, S) && valid_tp(H, D);
                llmdd_status st = llmdd_tp_plan(H, S, D, 0, out, 64, &n);
                if (!ok) {
                    assert_int_equal(st, LLM_PARAM_INVALID);
                    assert_int_equal(n, 99);
                    continue;
                }
                assert_int_equal(st, LLM_SUCCESS);
                memset(reads, 0, sizeof(reads));
                for (uint32_t d = 0; d < D; d++) {
                    assert_int_equal(llmdd_tp_plan(H, S, D, d, out, 64, &n),
                                     LLM_SUCCESS);
                    assert_int_equal(n, S); /* every source rank named */
                    uint32_t db, de, cnt[64] = {0};
                    holds(H, D, d, &db, &de);
                    for (uint32_t i = 0; i < S; i++) {
                        assert_int_equal(out[i].rank, i);
                        if (out[i].head_begin == out[i].head_end)
                            continue;
                        uint32_t sb, se;
                        holds(H, S, i, &sb, &se);
                        assert_true(out[i].head_begin < out[i].head_end);
                        assert_true(out[i].head_begin >= sb &&
                                    out[i].head_end <= se);
                        for (uint32_t h = out[i].head_begin;
                             h < out[i].head_end; h++) {
                            cnt[h]++;
                            reads[h][i]++;
                        }
                    }
                    for (uint32_t h = 0; h < H; h++) /* each read once */
                        assert_int_equal(cnt[h], h >= db && h < de ? 1 : 0);
                }
                /* Replicas spread: a head's replicas are read evenly. */
                for (uint32_t h = 0; h < H; h++) {
                    uint32_t lo = UINT32_MAX, hi = 0;
                    for (uint32_t s = 0; s < S; s++) {
                        uint32_t sb, se;
                        holds(H, S, s, &sb, &se);
                        if (h < sb || h >= se)
                            continue;
                        lo = reads[h][s] < lo ? reads[h][s] : lo;
                        hi = reads[h][s] > hi ? reads[h][s] : hi;
                    }
                    assert_true(hi - lo <= 1);
                }
            }
        }
    }
    /* Bad arguments. */
    size_t n;
    assert_int_equal(llmdd_tp_plan(0, 1, 1, 0, out, 64, &n), LLM_PARAM_INVALID);
    assert_int_equal(llmdd_tp_plan(8, 0, 1, 0, out, 64, &n), LLM_PARAM_INVALID);
    assert_int_equal(llmdd_tp_plan(8, 2, 2, 2, out, 64, &n), LLM_PARAM_INVALID);
    assert_int_equal(llmdd_tp_plan(8, 4, 2, 0, out, 3, &n), LLM_PARAM_INVALID);
    assert_int_equal(llmdd_tp_plan(8, 4, 2, 0, NULL, 4, &n), LLM_PARAM_INVALID);
    assert_int_equal(llmdd_tp_plan(8, 4, 2, 0, out, 4, NULL), LLM_PARAM_INVALID);
    assert_int_equal(llmdd_tp_plan(6, 4, 2, 0, out, 4, &n), LLM_PARAM_INVALID);
}

/* The one non-empty piece of dst_rank's plan. */
static llmdd_tp_piece
only_piece(uint32_t H, uint32_t S, uint32_t D, uint32_t r)
{
    llmdd_tp_piece out[64], got = {UINT32_MAX, 0, 0};
    size_t n, full = 0;
    assert_int_equal(llmdd_tp_plan(H, S, D, r, out, 64, &n), LLM_SUCCESS);
    assert_int_equal(n, S);
    for (size_t i = 0; i < n; i++)
        if (out[i].head_end > out[i].head_begin) {
            got = out[i];
            full++;
        }
    assert_int_equal(full, 1);
    return got;
}

static void
test_tp_regressions(void **state)
{
    (void)state;
    /* TP 1 -> 4 with 2 heads: decode ranks 2 and 3 read head 1, not 0. */
    for (uint32_t r = 0; r < 4; r++) {
        llmdd_tp_piece p = only_piece(2, 1, 4, r);
        assert_int_equal(p.rank, 0);
        assert_int_equal(p.head_begin, r / 2);
        assert_int_equal(p.head_end, r / 2 + 1);
    }
    /* TP 8 -> 16 with 8 heads: rank r reads head r/2 from its holder. */
    for (uint32_t r = 0; r < 16; r++) {
        llmdd_tp_piece p = only_piece(8, 8, 16, r);
        assert_int_equal(p.rank, r / 2);
        assert_int_equal(p.head_begin, r / 2);
    }
    /* MLA 8 -> 2: the two decode ranks read different replicas. */
    llmdd_tp_piece a = only_piece(1, 8, 2, 0), b = only_piece(1, 8, 2, 1);
    assert_int_not_equal(a.rank, b.rank);
    assert_int_equal(a.head_begin, 0);
    assert_int_equal(b.head_end, 1);
    /* MLA 2 -> 8: decode rank r reads replica r mod 2. */
    for (uint32_t r = 0; r < 8; r++)
        assert_int_equal(only_piece(1, 2, 8, r).rank, r % 2);
}

int
main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_layout_rules),
        cmocka_unit_test(test_property),
        cmocka_unit_test(test_table_repeats),
        cmocka_unit_test(test_tokens_at_the_top),
        cmocka_unit_test(test_runs_follow_blocks),
        cmocka_unit_test(test_llama70b_plan),
        cmocka_unit_test(test_blocks_32_to_16),
        cmocka_unit_test(test_plan_slot),
        cmocka_unit_test(test_tp_plan_exhaustive),
        cmocka_unit_test(test_tp_regressions),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
