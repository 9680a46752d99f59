/*
 * llmdd bench --op slices: slice transfers (KV layouts) against a
 * contiguous pull of the same bytes measured in the same run. A decoder
 * instance and four source instances live in this process and talk over
 * the chosen transport (tcp unless -t; shm, ucx). Each row alternates the
 * baseline and the slice pull --rounds times (default 5) and reports the
 * median GB/s of each, the median ratio and the spread of the per-round
 * ratios, and (best) the best round's test GB/s over the best round's
 * baseline. Rows:
 *   heads-hnd   half the heads of an HND cache, 4 KiB elements
 *   heads-nhd   half the heads of an NHD cache, 256-byte elements
 *   remap16-64  all heads, HND block 16 -> HND block 64
 *   4-sources   8 heads from 4 sources (2 each); each round also pulls
 *               its reference, 1-source (the same 8 heads from one
 *               source), and the row's ratio to it is taken per round
 *   heads-perm  heads-hnd into a permuted decoder table
 * then the planner alone: ns per 2-D run (llmdd_kv_slice_plan_size), and
 * Llama-3-70B's plan (80 layers, 8 KV heads, 8,192 tokens, block 16,
 * prefill TP 8 -> decode TP 2, contiguous tables): 2-D runs of one decode
 * rank, summed over its sources, before they apply to the 160 tensors.
 * Uses only the public API.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "bench.h"

#define SB_SRCS 4
#define SB_DEC 100

const char *const bench_slice_rows[SROW_N] = {[SROW_HND] = "heads-hnd",
                                              [SROW_NHD] = "heads-nhd",
                                              [SROW_REMAP] = "remap16-64",
                                              [SROW_4SRC] = "4-sources",
                                              [SROW_PERM] = "heads-perm"};

typedef struct {
    llmdd *dec, *src[SB_SRCS];
    uint64_t bytes; /* per tensor and pull */
    uint32_t rounds;
} sb_ctx;

static double
sb_now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static llmdd_kv_layout
sb_layout(bool hnd, uint32_t B, uint32_t heads, uint32_t first,
          uint32_t total, uint32_t hb)
{
    llmdd_kv_layout l = {.num_dims = 4,
                         .order = {LLMDD_KV_DIM_BLOCK, LLMDD_KV_DIM_TOKEN,
                                   LLMDD_KV_DIM_HEAD, LLMDD_KV_DIM_BYTES},
                         .block_size = B, .num_heads = heads,
                         .head_first = first, .total_heads = total,
                         .head_bytes = hb, .num_parts = 1};
    if (hnd) {
        l.order[1] = LLMDD_KV_DIM_HEAD;
        l.order[2] = LLMDD_KV_DIM_TOKEN;
    }
    return l;
}

static llmdd_cache_desc
sb_desc(uint64_t blocks, uint64_t block_bytes)
{
    llmdd_cache_desc d;
    memset(&d, 0, sizeof(d));
    d.placement = LLMDD_PLACEMENT_HOST;
    d.num_tensors = 2;
    d.data_type = LLMDD_DT_UINT8;
    d.num_dims = 2;
    d.shape[0] = (int64_t)blocks;
    d.shape[1] = (int64_t)block_bytes;
    return d;
}

static int
sb_cmp(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

/* The median of v[0..n); sorts v in place. */
static double
sb_median(double *v, uint32_t n)
{
    qsort(v, n, sizeof(*v), sb_cmp);
    return n % 2 ? v[n / 2] : (v[n / 2 - 1] + v[n / 2]) / 2;
}

/* One row: src layouts (nsrc of them, pieces of heads), the decoder's,
 * and the baseline's one-source contiguous pull of the same bytes. */
typedef struct {
    const char *name;
    uint32_t nsrc;
    llmdd_kv_layout sl[SB_SRCS], dl;
    uint32_t h0[SB_SRCS], h1[SB_SRCS];
    bool shuffled; /* the decoder's table permuted, as a serving engine's */
} sb_row;

/* A posted request's end: its status, the request freed. */
static llmdd_status
sb_wait(llmdd_status st, llmdd_request **req)
{
    if (st == LLM_SUCCESS) {
        st = llmdd_request_wait(*req, -1);
        llmdd_request_free(*req);
    }
    if (st != LLM_SUCCESS)
        fprintf(stderr, "bench slices: %s\n", llmdd_status_str(st));
    return st;
}

/* A row's caches, tables and slices, allocated for `tokens` tokens. */
typedef struct {
    llmdd_cache dc, sc[SB_SRCS];
    bool have_dc, have_sc[SB_SRCS];
    uint64_t *dtab, *stab[SB_SRCS];
    llmdd_kv_slice sl[SB_SRCS];
    llmdd_cache_index si[SB_SRCS];
    uint64_t runs, moved; /* 2-D runs and bytes per tensor, all sources */
} sb_set;

static void
sb_set_free(const sb_ctx *c, const sb_row *row, sb_set *x)
{
    for (uint32_t i = 0; i < row->nsrc; i++) {
        if (x->have_sc[i])
            llmdd_deallocate_cache(c->src[i], x->sc[i].cache_id);
        free(x->stab[i]);
    }
    if (x->have_dc)
        llmdd_deallocate_cache(c->dec, x->dc.cache_id);
    free(x->dtab);
}

static bool
sb_set_new(const sb_ctx *c, const sb_row *row, uint64_t tokens, sb_set *x)
{
    memset(x, 0, sizeof(*x));
    uint64_t dbb =
        (uint64_t)row->dl.block_size * row->dl.num_heads * row->dl.head_bytes;
    uint64_t dblocks = tokens / row->dl.block_size;
    llmdd_cache_desc dd = sb_desc(dblocks, dbb);
    x->dtab = malloc(dblocks * sizeof(*x->dtab));
    if (x->dtab == NULL || llmdd_allocate_cache_layout(c->dec, &dd, &row->dl,
                                                       &x->dc) != LLM_SUCCESS) {
        fprintf(stderr, "bench slices: cannot allocate the decoder cache\n");
        sb_set_free(c, row, x);
        return false;
    }
    x->have_dc = true;
    for (uint64_t b = 0; b < dblocks; b++)
        x->dtab[b] = b;
    for (uint64_t b = dblocks; row->shuffled && b > 1; b--) {
        uint64_t j = ((b * 2654435761u) >> 11) % b, t = x->dtab[b - 1];
        x->dtab[b - 1] = x->dtab[j];
        x->dtab[j] = t;
    }
    for (uint32_t i = 0; i < row->nsrc; i++) {
        const llmdd_kv_layout *l = &row->sl[i];
        uint64_t nb = tokens / l->block_size;
        llmdd_cache_desc d =
            sb_desc(nb, (uint64_t)l->block_size * l->num_heads * l->head_bytes);
        x->stab[i] = malloc(nb * sizeof(**x->stab));
        if (x->stab[i] == NULL ||
            llmdd_allocate_cache_layout(c->src[i], &d, l, &x->sc[i]) !=
                LLM_SUCCESS) {
            fprintf(stderr, "bench slices: cannot allocate a source cache\n");
            sb_set_free(c, row, x);
            return false;
        }
        x->have_sc[i] = true;
        for (uint64_t b = 0; b < nb; b++)
            x->stab[i][b] = b;
        for (uint32_t t = 0; t < 2; t++)
            memset((void *)(uintptr_t)x->sc[i].tensor_addrs[t],
                   0x11 * (int)(i + 1), (size_t)(nb * d.shape[1]));
        x->sl[i] = (llmdd_kv_slice){.src = {x->stab[i], nb, 0},
                                    .dst = {x->dtab, dblocks, 0},
                                    .token_begin = 0,
                                    .token_end = tokens,
                                    .head_begin = row->h0[i],
                                    .head_end = row->h1[i],
                                    .ext = LLMDD_KV_EXT_PARAM_DEFAULT};
        x->si[i] = (llmdd_cache_index){(uint64_t)i + 1, x->sc[i].cache_id, 0};
        uint64_t r = 0, by = 0;
        (void)llmdd_kv_slice_plan_size(l, &row->dl, &x->sl[i], &r, &by);
        x->runs += r;
        x->moved += by;
    }
    return true;
}

/* One slice pull of x, timed: GB/s of 2 tensors of `moved` bytes, or a
 * negative value when it failed. */
static double
sb_pull(const sb_ctx *c, const sb_row *row, sb_set *x, uint64_t moved)
{
    llmdd_request *req = NULL;
    double t0 = sb_now();
    llmdd_status st = llmdd_pull_kv_slices_async(c->dec, x->si, x->sl,
                                                 row->nsrc, &x->dc, NULL, &req);
    if (sb_wait(st, &req) != LLM_SUCCESS)
        return -1;
    return 2.0 * (double)moved / (sb_now() - t0) / 1e9;
}

static void
sb_print(const char *name, uint64_t moved, uint64_t runs, double *base,
         double *test, double *ratio, uint32_t n)
{
    double bb = 0, tb = 0;
    for (uint32_t i = 0; i < n; i++) {
        bb = base[i] > bb ? base[i] : bb;
        tb = test[i] > tb ? test[i] : tb;
    }
    double bm = sb_median(base, n), tm = sb_median(test, n);
    double rm = sb_median(ratio, n); /* sorted now: the range is its ends */
    printf("%-11s %9.1f MiB %7llu %9.2f %9.2f %6.2f  [%.2f .. %.2f] %6.2f\n",
           name, 2.0 * (double)moved / (1 << 20), (unsigned long long)runs, bm,
           tm, rm, ratio[0], ratio[n - 1], tb / bb);
}

/*
 * One row: each round pulls the baseline (one contiguous slot of the same
 * bytes from source 1), then the row's slices, then, with ref, the
 * reference row's slices (the same bytes); prints the row against the
 * baseline and, with ref, the reference against it and the row against
 * the reference, each ratio taken per round.
 */
static bool
sb_run_row(const sb_ctx *c, const sb_row *row, const sb_row *ref)
{
    /* Tokens so that the slices move c->bytes per tensor. */
    uint64_t per_tok = 0;
    for (uint32_t i = 0; i < row->nsrc; i++)
        per_tok += (uint64_t)(row->h1[i] - row->h0[i]) * row->dl.head_bytes;
    uint64_t lcm = row->dl.block_size;
    for (uint32_t i = 0; i < row->nsrc; i++)
        while (lcm % row->sl[i].block_size != 0)
            lcm += row->dl.block_size;
    uint64_t tokens = c->bytes / per_tok / lcm * lcm;
    if (tokens == 0)
        tokens = lcm;
    sb_set ts, rs;
    if (!sb_set_new(c, row, tokens, &ts))
        return false;
    if (ref != NULL && !sb_set_new(c, ref, tokens, &rs)) {
        sb_set_free(c, row, &ts);
        return false;
    }
    uint64_t moved = ts.moved;
    llmdd_cache bdc, bsc;
    llmdd_cache_desc bd = sb_desc(1, moved);
    bool have_bsc = llmdd_allocate_cache(c->src[0], &bd, &bsc) == LLM_SUCCESS;
    bool have_bdc =
        have_bsc && llmdd_allocate_cache(c->dec, &bd, &bdc) == LLM_SUCCESS;
    bool ok = have_bdc;
    if (!ok)
        fprintf(stderr, "bench slices: cannot allocate the baseline caches\n");
    llmdd_cache_index bi = {1, have_bsc ? bsc.cache_id : 0, 0};
    uint32_t n = c->rounds;
    double *v = calloc(6 * (size_t)n, sizeof(double));
    double *base = v, *test = v + n, *ratio = v + 2 * n, *rtest = v + 3 * n,
           *rratio = v + 4 * n, *vs = v + 5 * n;
    ok = ok && v != NULL;
    /* One warm-up of each, then alternate. */
    for (int32_t r = -1; ok && r < (int32_t)n; r++) {
        llmdd_request *req = NULL;
        double t0 = sb_now();
        llmdd_status st = llmdd_pull_kv_cache_async(c->dec, &bi, &bdc, 0, -1,
                                                    NULL, NULL, &req);
        ok = sb_wait(st, &req) == LLM_SUCCESS;
        double b = 2.0 * (double)moved / (sb_now() - t0) / 1e9;
        double t = ok ? sb_pull(c, row, &ts, moved) : -1;
        double q = ok && ref != NULL ? sb_pull(c, ref, &rs, moved) : 1;
        ok = ok && t > 0 && q > 0;
        if (ok && r >= 0) {
            base[r] = b;
            test[r] = t;
            ratio[r] = t / b;
            rtest[r] = q;
            rratio[r] = q / b;
            vs[r] = t / q;
        }
    }
    if (ok) {
        sb_print(row->name, moved, ts.runs, base, test, ratio, n);
        if (ref != NULL) {
            sb_print(ref->name, moved, rs.runs, base, rtest, rratio, n);
            double vm = sb_median(vs, n); /* sorts vs */
            printf("%s vs %s (same bytes, same layouts, in the same rounds): "
                   "%.2f  [%.2f .. %.2f]\n",
                   row->name, ref->name, vm, vs[0], vs[n - 1]);
        }
    } else {
        fprintf(stderr, "bench slices: %s: a pull failed\n", row->name);
    }
    free(v);
    if (have_bsc)
        llmdd_deallocate_cache(c->src[0], bsc.cache_id);
    if (have_bdc)
        llmdd_deallocate_cache(c->dec, bdc.cache_id);
    if (ref != NULL)
        sb_set_free(c, ref, &rs);
    sb_set_free(c, row, &ts);
    return ok;
}

/*
 * The floor a same-host slice meets on this machine: one thread copying the
 * head rows' elements (every other element of el bytes, as half the heads
 * of the rows' caches are) with memcpy, between two of the library's own
 * caches, and one memcpy of the same bytes; best of 5 each, in GB/s, to
 * read beside the rows' (whose baseline streams its stores).
 */
static void
sb_floor(const sb_ctx *c)
{
    llmdd_cache_desc sd = sb_desc(1, 2 * c->bytes), dd = sb_desc(1, c->bytes);
    llmdd_cache sc, dc;
    if (llmdd_allocate_cache(c->dec, &sd, &sc) != LLM_SUCCESS)
        return;
    if (llmdd_allocate_cache(c->dec, &dd, &dc) != LLM_SUCCESS) {
        llmdd_deallocate_cache(c->dec, sc.cache_id);
        return;
    }
    uint8_t *s = (uint8_t *)(uintptr_t)sc.tensor_addrs[0];
    uint8_t *d = (uint8_t *)(uintptr_t)dc.tensor_addrs[0];
    memset(s, 1, 2 * c->bytes);
    memset(d, 0, c->bytes);
    static const size_t el[2] = {4096, 256};
    double best[3] = {1e9, 1e9, 1e9};
    for (int r = 0; r < 5; r++) {
        double t0 = sb_now();
        memcpy(d, s, c->bytes);
        double t = sb_now() - t0;
        best[0] = t < best[0] ? t : best[0];
        for (int k = 0; k < 2; k++) {
            t0 = sb_now();
            for (size_t i = 0; i < c->bytes / el[k]; i++)
                memcpy(d + i * el[k], s + 2 * i * el[k], el[k]);
            t = sb_now() - t0;
            best[k + 1] = t < best[k + 1] ? t : best[k + 1];
        }
    }
    double gb = (double)c->bytes / 1e9;
    printf("copy floor (one thread, memcpy, this host): contiguous %.2f GB/s, "
           "every other 4 KiB element %.2f GB/s, every other 256-byte "
           "element %.2f GB/s\n",
           gb / best[0], gb / best[1], gb / best[2]);
    llmdd_deallocate_cache(c->dec, dc.cache_id);
    llmdd_deallocate_cache(c->dec, sc.cache_id);
}

/* The planner alone, and the Llama-3-70B plan size. */
static void
sb_planner(void)
{
    static uint64_t tab[512];
    for (int i = 0; i < 512; i++)
        tab[i] = (uint64_t)i;
    /* ns per run: an NHD -> HND remap with a permuted table, many runs. */
    static uint64_t ptab[512];
    for (int i = 0; i < 512; i++)
        ptab[i] = (uint64_t)((i * 37) % 512);
    llmdd_kv_layout s = sb_layout(false, 16, 2, 0, 8, 256);
    llmdd_kv_layout d = sb_layout(true, 32, 4, 0, 8, 256);
    llmdd_kv_slice sl = {.src = {ptab, 512, 0}, .dst = {tab, 256, 0},
                         .token_begin = 0, .token_end = 8192,
                         .head_begin = 0, .head_end = 2,
                         .ext = LLMDD_KV_EXT_PARAM_DEFAULT};
    uint64_t runs = 0, bytes = 0, total = 0;
    double t0 = sb_now();
    int iters = 0;
    while (sb_now() - t0 < 0.5) {
        (void)llmdd_kv_slice_plan_size(&s, &d, &sl, &runs, &bytes);
        total += runs;
        iters++;
    }
    double ns = (sb_now() - t0) * 1e9 / (double)(total ? total : 1);
    printf("planner: %llu 2-D runs a plan (NHD block 16 -> HND block 32, "
           "permuted table), %.1f ns per run over %d plans\n",
           (unsigned long long)runs, ns, iters);
    /* Llama-3-70B, decode rank 0 of TP 2 from prefill TP 8, HND both. */
    llmdd_tp_piece pc[8];
    size_t np = 0;
    uint64_t sum = 0;
    (void)llmdd_tp_plan(8, 8, 2, 0, pc, 8, &np);
    llmdd_kv_layout dl = sb_layout(true, 16, 4, 0, 8, 256);
    for (size_t i = 0; i < np; i++) {
        if (pc[i].head_begin == pc[i].head_end)
            continue;
        llmdd_kv_layout sl8 = sb_layout(true, 16, 1, pc[i].rank, 8, 256);
        llmdd_kv_slice x = {.src = {tab, 512, 0}, .dst = {tab, 512, 0},
                            .token_begin = 0, .token_end = 8192,
                            .head_begin = pc[i].head_begin,
                            .head_end = pc[i].head_end,
                            .ext = LLMDD_KV_EXT_PARAM_DEFAULT};
        if (llmdd_kv_slice_plan_size(&sl8, &dl, &x, &runs, &bytes) ==
            LLM_SUCCESS)
            sum += runs;
    }
    printf("llama-3-70b (80 layers, 8 KV heads, 8192 tokens, block 16, TP 8 "
           "-> 2, HND): %llu 2-D runs for decode rank 0 over %zu sources, "
           "applied to 160 tensors\n",
           (unsigned long long)sum, np);
}

int
bench_slices(const bench_cfg *cfg)
{
    sb_ctx c = {.bytes = 32u << 20, .rounds = cfg->rounds > 1 ? cfg->rounds
                                                              : 5};
    char err[256];
    uint16_t port[SB_SRCS];
    int rc = CLI_EXIT_FAIL;

    if (cfg->block_set)
        c.bytes = cfg->bmax;
    if (cli_instance(SB_DEC, LLMDD_ROLE_DECODER, &cfg->lo, NULL, NULL, &c.dec,
                     err, sizeof(err)) != LLM_SUCCESS) {
        fprintf(stderr, "bench slices: %s\n", err);
        return rc;
    }
    for (int i = 0; i < SB_SRCS; i++) {
        port[i] = 0;
        if (cli_instance((uint64_t)i + 1, LLMDD_ROLE_PROMPT, &cfg->lo,
                         "127.0.0.1", &port[i], &c.src[i], err,
                         sizeof(err)) != LLM_SUCCESS ||
            cli_link(c.dec, (uint64_t)i + 1, "127.0.0.1", port[i],
                     cfg->timeout_ms, err, sizeof(err)) != LLM_SUCCESS) {
            fprintf(stderr, "bench slices: %s\n", err);
            goto out;
        }
    }
    printf("llmdd bench --op slices, transport %s, %u rounds, %.0f MiB a "
           "tensor (2 tensors), baseline: a contiguous pull of the same "
           "bytes in the same run\n",
           cfg->lo.transport, c.rounds, (double)c.bytes / (1 << 20));
    printf("%-11s %13s %7s %9s %9s %6s  %s %6s\n", "row", "bytes", "runs",
           "base GB/s", "test GB/s", "ratio", "[min .. max ratio]", "best");
    sb_row rows[SROW_N];
    memset(rows, 0, sizeof(rows));
    rows[SROW_HND] = (sb_row){.name = bench_slice_rows[SROW_HND],
                              .nsrc = 1,
                              .sl = {sb_layout(true, 16, 2, 0, 2, 256)},
                              .dl = sb_layout(true, 16, 1, 0, 2, 256),
                              .h0 = {0},
                              .h1 = {1}};
    rows[SROW_NHD] = (sb_row){.name = bench_slice_rows[SROW_NHD],
                              .nsrc = 1,
                              .sl = {sb_layout(false, 16, 2, 0, 2, 256)},
                              .dl = sb_layout(false, 16, 1, 0, 2, 256),
                              .h0 = {0},
                              .h1 = {1}};
    rows[SROW_REMAP] = (sb_row){.name = bench_slice_rows[SROW_REMAP],
                                .nsrc = 1,
                                .sl = {sb_layout(true, 16, 8, 0, 8, 128)},
                                .dl = sb_layout(true, 64, 8, 0, 8, 128),
                                .h0 = {0},
                                .h1 = {8}};
    rows[SROW_PERM] = rows[SROW_HND];
    rows[SROW_PERM].name = bench_slice_rows[SROW_PERM];
    rows[SROW_PERM].shuffled = true;
    rows[SROW_4SRC] = (sb_row){.name = bench_slice_rows[SROW_4SRC],
                               .nsrc = SB_SRCS,
                               .dl = sb_layout(true, 16, 8, 0, 8, 128)};
    for (uint32_t i = 0; i < SB_SRCS; i++) {
        rows[SROW_4SRC].sl[i] = sb_layout(true, 16, 2, 2 * i, 8, 128);
        rows[SROW_4SRC].h0[i] = 2 * i;
        rows[SROW_4SRC].h1[i] = 2 * i + 2;
    }
    /* The 4-source row's reference: one source moving the same bytes with
     * the same layouts, heads 0..8 from source 1. */
    sb_row one = {.name = "1-source", .nsrc = 1,
                  .sl = {sb_layout(true, 16, 8, 0, 8, 128)},
                  .dl = sb_layout(true, 16, 8, 0, 8, 128),
                  .h0 = {0}, .h1 = {8}};
    bool ok = true;
    for (int i = 0; i < SROW_N; i++)
        if (cfg->row < 0 || cfg->row == i)
            ok = sb_run_row(&c, &rows[i], i == SROW_4SRC ? &one : NULL) && ok;
    if (cfg->row < 0) {
        sb_floor(&c);
        sb_planner();
    }
    rc = ok ? CLI_EXIT_OK : CLI_EXIT_FAIL;
out:
    llmdd_destroy(c.dec);
    for (int i = 0; i < SB_SRCS; i++)
        llmdd_destroy(c.src[i]);
    return rc;
}
