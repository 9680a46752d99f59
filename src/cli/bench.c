/*
 * llmdd bench: a sweep in the style of nixlbench and tebench. One prompt
 * node and N decoder nodes (processes; threads for the loop transport) move
 * blocks of each size in turn; every row reports GB/s, p50/p99 latency per
 * call and the ratio to a baseline measured in the same run: a single
 * thread's memcpy for same-host transports, one raw TCP loopback connection
 * between two processes for tcp.
 */
#include <cjson/cJSON.h>
#include <errno.h>
#include <inttypes.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/utsname.h>
#include <time.h>
#include <unistd.h>

#if defined(__x86_64__)
#include <emmintrin.h>
#endif

#include "common.h"

#include "bench.h"

const char *const bench_ops[BOP_N] = {"pull",      "push",  "pull-blocks",
                                      "link",      "layerwise", "fleet",
                                      "discovery", "slices"};
const char *const bench_bases[BASE_N] = {"auto", "memcpy", "tcp", "none"};

/* ---- The sweep. ---- */

/* Builds one row's command for block size `block`. */
static void
bench_row_cmd(const bench_cfg *cfg, uint64_t block, bench_cmd *c)
{
    memset(c, 0, sizeof(*c));
    c->op = (uint32_t)cfg->op;
    c->block = block;
    if (cfg->op == BOP_LAYERWISE) {
        c->tensors = 2 * cfg->num_layers;
        c->per_call = 1;
        c->num_layers = cfg->num_layers;
        c->compute_ns = cfg->compute_ns;
        uint64_t fit = cfg->total / (block * c->tensors);
        c->nslots = fit > 1 ? fit : 1;
    } else if (cfg->op == BOP_PULL_BLOCKS) {
        c->tensors = 1;
        c->per_call = cfg->blocks;
        c->inflight = cfg->inflight;
        uint64_t fit = cfg->total / block;
        c->nslots = fit > cfg->blocks ? fit : cfg->blocks;
    } else {
        c->tensors = cfg->blocks;
        c->per_call = cfg->blocks;
        uint64_t fit = cfg->total / (block * cfg->blocks);
        c->nslots = fit > 1 ? fit : 1;
    }
    if (c->nslots > BENCH_MAX_SLOTS)
        c->nslots = BENCH_MAX_SLOTS;
    uint64_t per_call = block * cfg->blocks;
    c->iters = cfg->iters != 0 ? cfg->iters : BENCH_AUTO_CALLS;
    c->min_ns = cfg->iters != 0 ? 0 : (int64_t)cfg->min_time_ms * 1000000;
    /*
     * Auto warm-up: one pass over every slot (a transport may map or
     * register the peer's memory page by page on first use) and at least
     * 16 MiB, within 1..BENCH_WARMUP_MAX calls.
     */
    uint64_t cover = cfg->op == BOP_PULL_BLOCKS
                         ? (c->nslots + c->per_call - 1) / c->per_call
                         : c->nslots;
    uint64_t w = (16ull << 20) / per_call;
    if (w < cover)
        w = cover;
    if (w < c->inflight) /* a full pipeline before the clock starts */
        w = c->inflight;
    c->warmup = cfg->warmup_set        ? cfg->warmup
                : w < 1                ? 1
                : w > BENCH_WARMUP_MAX ? BENCH_WARMUP_MAX
                                       : (uint32_t)w;
    /* Layer-wise: a warm-up round is a push each way, whole slots. */
    if (cfg->op == BOP_LAYERWISE && !cfg->warmup_set)
        c->warmup = c->nslots < 2    ? 2
                    : c->nslots > 20 ? 20
                                     : (uint32_t)c->nslots;
}

/* Checks the sweep fits in memory; sizes the host pool (pool_bytes). */
static bool
bench_memory_ok(bench_cfg *cfg)
{
    bench_cmd c;
    double worst = 0;

    if (cfg->op == BOP_LINK)
        return true;
    for (uint64_t b = cfg->bmin; b <= cfg->bmax && b != 0; b *= 2) {
        bench_row_cmd(cfg, b, &c);
        double side = (double)c.nslots * (double)c.block * c.tensors;
        /* The pool holds whole pages of every tensor. */
        uint64_t page = 1ull << BENCH_POOL_SHIFT;
        uint64_t pitch = (c.nslots * c.block + page - 1) & ~(page - 1);
        if (!cfg->no_pool && pitch * c.tensors > cfg->pool_bytes)
            cfg->pool_bytes = pitch * c.tensors;
        /* The prompt's and every decoder's cache, and the baseline's
         * two buffers (kept across rows). */
        double need = side * (1 + cfg->decoders) + 2 * side;
        if (need > worst)
            worst = need;
        if (cfg->bmin == cfg->bmax)
            break;
    }
    return cli_memory_fits((uint64_t)worst,
                           "lower --block-size, --blocks, --total-size or "
                           "--decoders");
}

/* Runs one row on the nodes; fills *res. */
static bool
bench_row(const bench_cfg *cfg, cli_node *prompt, cli_node *decs,
          uint64_t block, bench_bufs *bufs, bench_progress *prog,
          bench_result *res)
{
    bench_cmd c;
    bench_reply r;
    int64_t *all = NULL, *s = NULL;
    size_t nall = 0;
    int64_t t0 = 0, t1 = 0;
    uint64_t bytes = 0, calls = 0;
    bool ok = false;

    bench_row_cmd(cfg, block, &c);
    memset(res, 0, sizeof(*res));
    res->block = block;
    res->per_call = cfg->blocks;
    res->bytes_per_call = block * cfg->blocks;
    res->warmup = c.warmup;
    res->inflight = cfg->inflight;
    res->base = bench_base_kind(cfg);

    /* The baseline first, while no cache of this row holds memory. */
    if (res->base != BASE_NONE) {
        bench_base_result b = {0, 0, 0};
        snprintf(prog->label, sizeof(prog->label), "%s baseline",
                 bench_base_label(res->base));
        bench_progress_draw(prog);
        if (!(res->base == BASE_TCP
                  ? bench_base_tcp(&c, res->bytes_per_call, &b)
                  : bench_base_memcpy(&c, bufs, false, &b)))
            return false;
        res->base_gbps = b.gbps;
        res->base_p50 = b.p50;
        res->base_p99 = b.p99;
        res->best_gbps = b.gbps;
        /* The best copy: the faster of memcpy and the streamed copy, timed
         * in the same run on the same buffers. */
        if (res->base == BASE_MEMCPY) {
            bench_base_result nb = {0, 0, 0};
            if (!bench_base_memcpy(&c, bufs, true, &nb))
                return false;
            if (nb.gbps > b.gbps) {
                res->best_gbps = nb.gbps;
                res->best_nt = true;
            }
        }
    }
    char bs[32];
    snprintf(prog->label, sizeof(prog->label), "block %s",
             cli_fmt_bytes(bs, sizeof(bs), block));
    bench_progress_draw(prog);

    if (!bench_call(prompt, BC_SETUP, &c, NULL, &r, NULL))
        return false;
    if (r.status != LLM_SUCCESS) {
        cli_err("prompt: %s", r.err);
        return false;
    }
    c.remote_cache = r.cache_id;
    c.ndec = cfg->decoders;
    for (uint32_t i = 0; i < cfg->decoders; i++) {
        if (!bench_call(&decs[i], BC_SETUP, &c, NULL, &r, NULL))
            return false;
        if (r.status != LLM_SUCCESS) {
            cli_err("decoder %" PRIu32 ": %s", i + 1, r.err);
            return false;
        }
        c.dec_cache[i] = r.cache_id;
    }

    /* The decoders start together; the aggregate spans first to last. */
    uint32_t nrep = cfg->op == BOP_PUSH ? 1 : cfg->decoders;
    cli_node *who = cfg->op == BOP_PUSH ? prompt : decs;
    for (uint32_t i = 0; i < nrep; i++) {
        if (cli_msg_send(who[i].cmd_fd,
                         cfg->op == BOP_PUSH ? BC_PUSH_RUN : BC_RUN, &c,
                         sizeof(c), NULL, 0) != 0) {
            cli_err("the %s node stopped answering", who[i].name);
            goto out;
        }
    }
    bool failed = false;
    for (uint32_t i = 0; i < nrep; i++) {
        if (!bench_recv(&who[i], prog, &r, &s))
            goto out;
        if (r.status != LLM_SUCCESS) {
            cli_err("%s: %s", who[i].name, r.err);
            failed = true;
            free(s);
            continue;
        }
        int64_t *na = realloc(all, (nall + r.nsamples + 1) * sizeof(*all));
        if (na == NULL) {
            free(s);
            cli_err("out of memory");
            goto out;
        }
        all = na;
        memcpy(all + nall, s, r.nsamples * sizeof(*all));
        nall += r.nsamples;
        free(s);
        if (i == 0 || r.t0 < t0)
            t0 = r.t0;
        if (i == 0 || r.t1 > t1)
            t1 = r.t1;
        bytes += r.bytes;
        calls += r.calls;
        /* The slowest decoder's post cost. */
        if ((double)r.post_ns > res->post_ns)
            res->post_ns = (double)r.post_ns;
    }
    if (failed)
        goto out;

    /* Free this row's caches before the next row's baseline. */
    c.nslots = 0;
    if (!bench_call(prompt, BC_SETUP, &c, NULL, &r, NULL))
        goto out;
    for (uint32_t i = 0; i < cfg->decoders; i++)
        if (!bench_call(&decs[i], BC_SETUP, &c, NULL, &r, NULL))
            goto out;

    qsort(all, nall, sizeof(*all), bench_cmp_i64);
    res->calls = calls;
    res->iters = (uint32_t)(calls / cfg->decoders);
    res->gbps = cli_gbps(bytes, t1 - t0);
    res->p50 = bench_pct(all, nall, 0.50);
    res->p99 = bench_pct(all, nall, 0.99);
    res->blocks_per_s =
        t1 > t0 ? (double)calls * cfg->blocks / ((double)(t1 - t0) / 1e9) : 0;
    res->ratio = res->base_gbps > 0 ? res->gbps / res->base_gbps : 0;
    res->ratio_best = res->best_gbps > 0 ? res->gbps / res->best_gbps : 0;
    ok = true;
out:
    free(all);
    return ok;
}

static bool
bench_link_row(const bench_cfg *cfg, cli_node *decs, uint16_t port,
               bench_progress *prog, bench_result *res)
{
    bench_cmd c;
    bench_reply r;
    int64_t *links = NULL, *unlinks = NULL, *s;
    size_t n = 0;
    bool ok = false;

    memset(&c, 0, sizeof(c));
    memset(res, 0, sizeof(*res));
    c.op = BOP_LINK;
    c.port = port;
    c.iters = cfg->iters != 0 ? cfg->iters : 100;
    c.warmup = cfg->warmup_set    ? cfg->warmup
               : c.iters / 10 > 0 ? c.iters / 10
                                  : 1;
    res->iters = c.iters;
    res->warmup = c.warmup;
    res->base = BASE_NONE;
    snprintf(prog->label, sizeof(prog->label), "link + unlink");
    links = calloc((size_t)c.iters * cfg->decoders, sizeof(int64_t));
    unlinks = calloc((size_t)c.iters * cfg->decoders, sizeof(int64_t));
    if (links == NULL || unlinks == NULL) {
        cli_err("out of memory");
        goto out;
    }
    for (uint32_t i = 0; i < cfg->decoders; i++) {
        if (cli_msg_send(decs[i].cmd_fd, BC_LINKBENCH, &c, sizeof(c), NULL,
                         0) != 0) {
            cli_err("the %s node stopped answering", decs[i].name);
            goto out;
        }
    }
    bool failed = false;
    for (uint32_t i = 0; i < cfg->decoders; i++) {
        if (!bench_recv(&decs[i], prog, &r, &s))
            goto out;
        if (r.status != LLM_SUCCESS || r.nsamples != 2ull * c.iters) {
            cli_err("%s: %s", decs[i].name, r.err);
            failed = true;
            free(s);
            continue;
        }
        memcpy(links + n, s, c.iters * sizeof(int64_t));
        memcpy(unlinks + n, s + c.iters, c.iters * sizeof(int64_t));
        n += c.iters;
        free(s);
    }
    if (failed)
        goto out;
    qsort(links, n, sizeof(int64_t), bench_cmp_i64);
    qsort(unlinks, n, sizeof(int64_t), bench_cmp_i64);
    res->calls = n;
    res->p50 = bench_pct(links, n, 0.50);
    res->p99 = bench_pct(links, n, 0.99);
    res->unlink_p50 = bench_pct(unlinks, n, 0.50);
    res->unlink_p99 = bench_pct(unlinks, n, 0.99);
    ok = true;
out:
    free(links);
    free(unlinks);
    return ok;
}

static double
bench_median(double *v, size_t n)
{
    /* Insertion sort: a few dozen rounds. */
    for (size_t i = 1; i < n; i++)
        for (size_t k = i; k > 0 && v[k - 1] > v[k]; k--) {
            double t = v[k];
            v[k] = v[k - 1];
            v[k - 1] = t;
        }
    return n == 0 ? 0 : n % 2 ? v[n / 2] : (v[n / 2 - 1] + v[n / 2]) / 2;
}

/* The median, lowest and highest of one double field (its offset in
 * bench_result) over n rounds of one row. */
static double
bench_spread(const bench_result *runs, size_t n, size_t stride, size_t field,
             double *lo, double *hi)
{
    double v[100];

    for (size_t i = 0; i < n; i++)
        memcpy(&v[i], (const char *)&runs[i * stride] + field, sizeof(v[i]));
    double m = bench_median(v, n); /* sorts v */
    if (lo != NULL)
        *lo = v[0];
    if (hi != NULL)
        *hi = v[n - 1];
    return m;
}

/*
 * One row from its n rounds (runs[0], runs[stride], ...): the median of
 * each measure, the ratios the medians of each round's own ratio (a round's
 * row and baseline ran minutes apart from the next round's).
 */
#define F(field) offsetof(bench_result, field)

static void
bench_aggregate(const bench_result *runs, size_t n, size_t stride,
                bench_result *out)
{
    *out = runs[0];
    out->rounds = (uint32_t)n;
    out->calls = 0;
    out->iters = 0;
    for (size_t i = 0; i < n; i++) {
        out->calls += runs[i * stride].calls;
        out->iters += runs[i * stride].iters; /* over all rounds */
    }
    out->gbps =
        bench_spread(runs, n, stride, F(gbps), &out->gbps_lo, &out->gbps_hi);
    out->p50 = bench_spread(runs, n, stride, F(p50), NULL, NULL);
    out->p99 = bench_spread(runs, n, stride, F(p99), NULL, NULL);
    out->blocks_per_s =
        bench_spread(runs, n, stride, F(blocks_per_s), NULL, NULL);
    out->base_gbps = bench_spread(runs, n, stride, F(base_gbps), &out->base_lo,
                                  &out->base_hi);
    out->base_p50 = bench_spread(runs, n, stride, F(base_p50), NULL, NULL);
    out->base_p99 = bench_spread(runs, n, stride, F(base_p99), NULL, NULL);
    out->best_gbps = bench_spread(runs, n, stride, F(best_gbps), NULL, NULL);
    out->ratio =
        bench_spread(runs, n, stride, F(ratio), &out->ratio_lo, &out->ratio_hi);
    out->ratio_best = bench_spread(runs, n, stride, F(ratio_best), NULL, NULL);
    out->post_ns = bench_spread(runs, n, stride, F(post_ns), NULL, NULL);
}
#undef F

/*
 * One row of --op layerwise. The ideal of a round is max(its compute, its
 * transfer) + one layer's transfer: the last layer can only move after its
 * compute. Ratios are taken within each round, then their median.
 */
static bool
bench_layerwise_row(const bench_cfg *cfg, cli_node *prompt, cli_node *dec,
                    uint64_t block, bench_progress *prog, bench_result *res)
{
    bench_cmd c;
    bench_reply r, lw;
    int64_t *s = NULL;
    double *v = NULL;
    bool ok = false;

    bench_row_cmd(cfg, block, &c);
    memset(res, 0, sizeof(*res));
    res->block = block;
    res->per_call = 1;
    res->bytes_per_call = block * c.tensors;
    res->warmup = c.warmup;
    res->base = BASE_NONE;
    res->layers = c.num_layers;
    char bs[32];
    snprintf(prog->label, sizeof(prog->label), "layers of %s",
             cli_fmt_bytes(bs, sizeof(bs), 2 * block));
    if (!bench_call(prompt, BC_SETUP, &c, NULL, &r, NULL))
        return false;
    if (r.status != LLM_SUCCESS) {
        cli_err("prompt: %s", r.err);
        return false;
    }
    if (!bench_call(dec, BC_SETUP, &c, NULL, &r, NULL))
        return false;
    if (r.status != LLM_SUCCESS) {
        cli_err("decoder 1: %s", r.err);
        return false;
    }
    c.dec_cache[0] = r.cache_id;
    c.ndec = 1;
    if (!bench_call(prompt, BC_LAYERWISE, &c, prog, &lw, &s))
        return false;
    if (lw.status != LLM_SUCCESS || lw.calls == 0 ||
        lw.nsamples != lw.calls * LW_N) {
        cli_err("prompt: %s", lw.err);
        goto out;
    }
    c.nslots = 0; /* free this row's caches */
    if (!bench_call(prompt, BC_SETUP, &c, NULL, &r, NULL) ||
        !bench_call(dec, BC_SETUP, &c, NULL, &r, NULL))
        goto out;

    size_t n = lw.calls, L = c.num_layers;
    v = calloc(n + 1, sizeof(*v));
    if (v == NULL) {
        cli_err("out of memory");
        goto out;
    }
    res->calls = n;
    res->iters = (uint32_t)n;
    res->compute_ms = (double)lw.compute_ns / 1e6;
    double *dst[LW_N] = {
        [LW_PUSH] = &res->push_ms,    [LW_SEQ] = &res->seq_ms,
        [LW_LAYERED] = &res->lw_ms,   [LW_COMPUTE] = &res->comp_ms,
        [LW_TAIL] = &res->tail_ms,    [LW_MARKS] = &res->marks_ms,
        [LW_PREEMPT] = &res->preempt, [LW_LAYER] = &res->layer_ms};
    for (int k = 0; k < LW_N; k++) {
        for (size_t i = 0; i < n; i++)
            v[i] = (double)s[i * LW_N + k] / (k == LW_PREEMPT ? 1 : 1e6);
        *dst[k] = bench_median(v, n);
    }
    for (size_t i = 0; i < n; i++) {
        const int64_t *x = s + i * LW_N;
        double t = (double)x[LW_PUSH];
        v[i] = ((x[LW_COMPUTE] > x[LW_PUSH] ? (double)x[LW_COMPUTE] : t) +
                t / (double)L) /
               1e6;
    }
    res->ideal_ms = bench_median(v, n);
    for (size_t i = 0; i < n; i++)
        v[i] = (double)s[i * LW_N + LW_LAYERED] / (double)s[i * LW_N + LW_SEQ];
    res->ratio_seq = bench_median(v, n);
    for (size_t i = 0; i < n; i++) {
        const int64_t *x = s + i * LW_N;
        double t = (double)x[LW_PUSH];
        double ideal =
            (x[LW_COMPUTE] > x[LW_PUSH] ? (double)x[LW_COMPUTE] : t) +
            t / (double)L;
        v[i] = (double)x[LW_LAYERED] / ideal;
    }
    res->ratio_ideal = bench_median(v, n);
    /* Per-layer efficiency: a layer's share of the whole slot's push
     * against that layer pushed alone, both in this round. */
    for (size_t i = 0; i < n; i++)
        v[i] = (double)s[i * LW_N + LW_PUSH] / (double)L /
               (double)s[i * LW_N + LW_LAYER];
    res->layer_eff = bench_median(v, n);
    res->gbps = cli_gbps(res->bytes_per_call, (int64_t)(res->push_ms * 1e6));
    ok = true;
out:
    free(v);
    free(s);
    return ok;
}

int
cli_bench(int argc, char **argv)
{
    bench_cfg cfg;
    cli_node prompt = {.cmd_fd = -1, .rep_fd = -1};
    cli_node decs[BENCH_MAX_DECODERS];
    bench_role prole, droles[BENCH_MAX_DECODERS];
    bench_result *rows = NULL, *runs = NULL;
    size_t nrows = 0, maxrows = 0;
    bench_progress prog;
    bench_bufs bufs = {NULL, NULL, 0};
    bench_reply r;
    char b1[32], b2[32];
    int rc = CLI_EXIT_FAIL;
    uint32_t started = 0;

    memset(&cfg, 0, sizeof(cfg));
    memset(&prog, 0, sizeof(prog));
    cli_lib_opts_init(&cfg.lo);
    cfg.op = BOP_PULL;
    cfg.bmin = 4096;
    cfg.bmax = 16u << 20;
    cfg.decoders = 1;
    cfg.total = 64u << 20;
    cfg.baseline = BASE_AUTO;
    cfg.progress = isatty(STDERR_FILENO);
    cfg.timeout_ms = CLI_LINK_TIMEOUT_MS;
    cfg.min_time_ms = BENCH_MIN_TIME_MS;
    cfg.num_layers = 32;
    cfg.compute_ns = -1;
    cfg.row = -1;
    for (int i = 0, n = 0; i < argc && n < (int)sizeof(cfg.command) - 1; i++) {
        int k = snprintf(cfg.command + n, sizeof(cfg.command) - (size_t)n,
                         "%s%s", i > 0 ? " " : "", argv[i]);
        if (k < 0)
            break;
        n += k;
    }
    for (uint32_t i = 0; i < BENCH_MAX_DECODERS; i++)
        decs[i] = (cli_node){.cmd_fd = -1, .rep_fd = -1};

    int prc = bench_parse(&cfg, argc, argv);
    if (prc != 0) {
        rc = prc < 0 ? CLI_EXIT_OK : prc;
        goto out;
    }
    if (cfg.op == BOP_FLEET) {
        rc = bench_fleet(&cfg);
        goto out;
    }
    if (cfg.op == BOP_DISCOVERY) {
        rc = bench_discovery(&cfg);
        goto out;
    }
    if (cfg.op == BOP_SLICES) {
        rc = bench_slices(&cfg);
        goto out;
    }
    if (!bench_memory_ok(&cfg))
        goto out;
    bool threaded = strcmp(cfg.lo.transport, "loop") == 0;
    for (uint64_t b = cfg.bmin; b <= cfg.bmax && b != 0; b *= 2) {
        maxrows++;
        if (cfg.bmin == cfg.bmax)
            break;
    }
    if (cfg.op == BOP_LINK)
        maxrows = 1;
    rows = calloc(maxrows, sizeof(*rows));
    runs = calloc(maxrows * cfg.rounds, sizeof(*runs));
    if (rows == NULL || runs == NULL) {
        cli_err("out of memory");
        goto out;
    }
    prog.on = cfg.progress;
    prog.total = maxrows * cfg.rounds;
    prog.t0 = cli_now_ns();

    int base = bench_base_kind(&cfg);
    printf("llmdd bench: op %s, transport %s (built in: %s), %" PRIu32
           " decoder%s%s, %s\n",
           bench_ops[cfg.op], cfg.lo.transport, llmdd_transport_list(),
           cfg.decoders, cfg.decoders > 1 ? "s" : "",
           threaded ? " (threads: loop needs one process)" : " (processes)",
           cfg.reg ? "prompt memory registered (malloc)"
                   : "prompt memory from llmdd_allocate_cache");
    if (cfg.op == BOP_LAYERWISE)
        printf("  %" PRIu32 " layers (K, V tensors each); one slot per push; "
               "compute per layer: %s, simulated by sleeping (a busy loop "
               "would take a core from the transfer threads); (a) compute "
               "all layers, then llmdd_push_kv_cache; (b) "
               "llmdd_push_kv_cache_async with LLMDD_XFER_LAYERWISE posted "
               "first, llmdd_request_layer_ready after each layer's compute, "
               "then llmdd_request_wait\n",
               cfg.num_layers,
               cfg.compute_ns < 0 ? "one layer's push (measured per row)"
                                  : cli_fmt_ns(b1, sizeof(b1), cfg.compute_ns));
    else if (cfg.op != BOP_LINK)
        printf("  %" PRIu32 " %s per call; each cache up to %s per row; "
               "baseline: %s%s\n",
               cfg.blocks,
               cfg.op != BOP_PULL_BLOCKS ? "tensor(s), one batch slot of each,"
               : cfg.inflight > 0 ? "scattered block(s) of one tensor, posted "
                                    "(llmdd_pull_kv_blocks_async),"
                                  : "scattered block(s) of one tensor",
               cli_fmt_bytes(b1, sizeof(b1), cfg.total), bench_base_label(base),
               base == BASE_TCP ? " (one loopback connection, two processes)"
               : base == BASE_MEMCPY ? " (one thread, same bytes) and the best "
                                       "copy (the faster of memcpy and "
                                       "non-temporal stores)"
                                     : "");
    if (cfg.inflight > 0)
        printf("  %" PRIu32 " request(s) in flight per decoder: each "
               "completion (llmdd_request_wait on the oldest) posts the "
               "next\n",
               cfg.inflight);
    fflush(stdout);

    prole = (bench_role){.cfg = &cfg, .prompt = true};
    if (cli_node_start(&prompt, "prompt", threaded, bench_node_main, &prole) !=
            0 ||
        !bench_recv(&prompt, NULL, &r, NULL))
        goto out;
    if (r.status != LLM_SUCCESS) {
        cli_err("prompt: %s", r.err);
        goto out;
    }
    uint16_t port = r.port;
    for (; started < cfg.decoders; started++) {
        char name[32];
        snprintf(name, sizeof(name), "decoder %" PRIu32, started + 1);
        droles[started] =
            (bench_role){.cfg = &cfg, .prompt = false, .index = started};
        if (cli_node_start(&decs[started], name, threaded, bench_node_main,
                           &droles[started]) != 0) {
            goto out;
        }
        if (!bench_recv(&decs[started], NULL, &r, NULL)) {
            started++;
            goto out;
        }
        if (r.status != LLM_SUCCESS) {
            cli_err("%s: %s", name, r.err);
            started++;
            goto out;
        }
    }
    if (cfg.rounds == 1)
        bench_print_header(&cfg);
    if (cfg.op == BOP_LINK) {
        if (!bench_link_row(&cfg, decs, port, &prog, &rows[0]))
            goto out;
        nrows = 1;
        bench_progress_clear(&prog);
        bench_print_row(&cfg, &rows[0]);
    } else {
        bench_cmd c;
        memset(&c, 0, sizeof(c));
        c.port = port;
        for (uint32_t i = 0; i < cfg.decoders; i++) {
            if (!bench_call(&decs[i], BC_LINK, &c, NULL, &r, NULL))
                goto out;
            if (r.status != LLM_SUCCESS) {
                cli_err("%s: %s", decs[i].name, r.err);
                goto out;
            }
        }
        /* Round after round over the whole sweep, so that each row's
         * rounds are spread over the run's time, not taken back to back. */
        for (uint32_t k = 0; k < cfg.rounds; k++) {
            uint64_t b = cfg.bmin;
            for (size_t i = 0; i < maxrows; i++, b *= 2) {
                bench_result *res = &runs[k * maxrows + i];
                prog.done = k * maxrows + i;
                if (!(cfg.op == BOP_LAYERWISE
                          ? bench_layerwise_row(&cfg, &prompt, &decs[0], b,
                                                &prog, res)
                          : bench_row(&cfg, &prompt, decs, b, &bufs, &prog,
                                      res))) {
                    bench_progress_clear(&prog);
                    goto out;
                }
                bench_progress_clear(&prog);
                if (cfg.rounds == 1)
                    bench_print_row(&cfg, res);
            }
            if (cfg.rounds > 1) {
                printf("  round %" PRIu32 " of %" PRIu32 " done, %s\n", k + 1,
                       cfg.rounds,
                       cli_fmt_ns(b2, sizeof(b2), cli_now_ns() - prog.t0));
                fflush(stdout);
            }
        }
        if (cfg.rounds > 1)
            bench_print_header(&cfg);
        for (nrows = 0; nrows < maxrows; nrows++) {
            bench_aggregate(runs + nrows, cfg.rounds, maxrows, &rows[nrows]);
            if (cfg.rounds > 1)
                bench_print_row(&cfg, &rows[nrows]);
        }
    }
    if (cfg.op == BOP_LINK)
        printf("\nlink: llmdd_link_clusters, unlink: llmdd_unlink_clusters "
               "(not forced), per call, all decoders; %s total.\n",
               cli_fmt_ns(b2, sizeof(b2), cli_now_ns() - prog.t0));
    else if (cfg.op == BOP_LAYERWISE)
        printf("\nMedians over rounds: compute = all layers' sleeps as "
               "measured; push = the synchronous push alone (the "
               "transfer); ideal = max(compute, push) + push / layers; "
               "layer eff = (push / layers) / one layer pushed alone; "
               "ratios are per round, then their median; %s total.\n",
               cli_fmt_ns(b2, sizeof(b2), cli_now_ns() - prog.t0));
    else
        printf("\nGB/s = 10^9 bytes/s, aggregate over decoders; p50/p99 per "
               "call; ratio = GB/s / baseline GB/s%s%s; %s total.\n",
               base == BASE_MEMCPY ? "; vs best = GB/s / best copy GB/s" : "",
               cfg.rounds > 1 ? "; every column the median of the rounds, "
                                "the ratios each round's own, range = the "
                                "lowest and highest round's ratio"
                              : "",
               cli_fmt_ns(b2, sizeof(b2), cli_now_ns() - prog.t0));
    rc = CLI_EXIT_OK;
    if (cfg.json != NULL && !bench_write_json(&cfg, rows, nrows, runs))
        rc = CLI_EXIT_FAIL;
    if (cfg.csv != NULL && !bench_write_csv(&cfg, rows, nrows))
        rc = CLI_EXIT_FAIL;
    if (cfg.plot != NULL) {
        if (bench_plot(&cfg, rows, nrows))
            printf("plot: %s\n", cfg.plot);
        else
            rc = CLI_EXIT_FAIL;
    }
out:
    fflush(stdout);
    if (!bench_base_tcp_stop())
        rc = CLI_EXIT_FAIL;
    for (uint32_t i = 0; i < started; i++)
        if (cli_node_stop(&decs[i]) != 0)
            rc = CLI_EXIT_FAIL;
    if (cli_node_stop(&prompt) != 0)
        rc = CLI_EXIT_FAIL;
    bench_bufs_free(&bufs);
    free(runs);
    free(rows);
    cli_lib_opts_fini(&cfg.lo);
    return rc;
}
