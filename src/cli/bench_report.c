/* llmdd bench: the results as a table, JSON, CSV and a gnuplot chart. */
#include <cjson/cJSON.h>
#include <errno.h>
#include <getopt.h>
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

#include "bench.h"

/* ---- Output: table, JSON, CSV, plot. ---- */

int
bench_base_kind(const bench_cfg *cfg)
{
    if (cfg->baseline != BASE_AUTO)
        return cfg->baseline;
    const char *t = cfg->lo.transport;
    if (strcmp(t, "tcp") == 0)
        return BASE_TCP;
    if (strcmp(t, "auto") == 0 && !cli_transport_built("shm") &&
        !cli_transport_built("ucx"))
        return BASE_TCP; /* auto ends up on tcp between processes */
    return BASE_MEMCPY;
}

const char *
bench_base_label(int kind)
{
    return kind == BASE_TCP      ? "raw TCP"
           : kind == BASE_MEMCPY ? "memcpy"
                                 : "none";
}

void
bench_print_header(const bench_cfg *cfg)
{
    if (cfg->op == BOP_LAYERWISE) {
        printf("\n%9s %6s %6s %10s %10s %10s %10s %10s %8s %9s %9s\n",
               "layer", "layers", "rounds", "compute ms", "push ms", "(a) ms",
               "(b) ms", "ideal ms", "(b)/(a)", "(b)/ideal", "layer eff");
        return;
    }
    if (cfg->op == BOP_LINK) {
        printf("\n%8s %10s %12s %12s %12s %12s\n", "decoders", "iters",
               "link p50", "link p99", "unlink p50", "unlink p99");
        return;
    }
    printf("\n%9s %7s %6s %9s %10s %10s %11s | %9s %10s %7s", "block", "blocks",
           "iters", "GB/s", "p50 us", "p99 us", "blocks/s", "base GB/s",
           "base p50", "ratio");
    if (cfg->rounds > 1 && bench_base_kind(cfg) != BASE_NONE)
        printf(" %11s", "range");
    if (bench_base_kind(cfg) == BASE_MEMCPY)
        printf(" | %9s %7s", "best GB/s", "vs best");
    printf("\n");
}

void
bench_print_row(const bench_cfg *cfg, const bench_result *r)
{
    char b[32], t1[32], t2[32], t3[32], t4[32];

    if (cfg->op == BOP_LAYERWISE) {
        printf("%9s %6" PRIu32 " %6" PRIu32
               " %10.2f %10.2f %10.2f %10.2f %10.2f %8.2f %9.2f %9.2f\n",
               cli_fmt_bytes(b, sizeof(b), 2 * r->block), r->layers, r->iters,
               r->comp_ms, r->push_ms, r->seq_ms, r->lw_ms, r->ideal_ms,
               r->ratio_seq, r->ratio_ideal, r->layer_eff);
        printf("  layerwise: (b)/(a) = %.2f (target <= 0.6: %s); "
               "(b)/ideal = %.2f (target <= 1.1: %s); per-layer efficiency "
               "%.2f (target >= 0.8: %s); compute %.0f us/layer"
               "%s; push %.3f GB/s\n",
               r->ratio_seq, r->ratio_seq <= 0.6 ? "met" : "MISSED",
               r->ratio_ideal, r->ratio_ideal <= 1.1 ? "met" : "MISSED",
               r->layer_eff, r->layer_eff >= 0.8 ? "met" : "MISSED",
               r->compute_ms * 1e3,
               cfg->compute_ns < 0 ? " (auto: one layer's push)" : "", r->gbps);
        printf("  where (b) goes: compute %.2f ms, inside "
               "llmdd_request_layer_ready %.2f ms (%.0f involuntary context "
               "switches), last mark to done %.2f ms; one layer alone %.2f "
               "ms, push/layers %.2f ms\n",
               r->comp_ms, r->marks_ms, r->preempt, r->tail_ms, r->layer_ms,
               r->push_ms / r->layers);
        fflush(stdout);
        return;
    }
    if (cfg->op == BOP_LINK) {
        printf("%8" PRIu32 " %10" PRIu32 " %12s %12s %12s %12s\n",
               cfg->decoders, r->iters,
               cli_fmt_ns(t1, sizeof(t1), (int64_t)(r->p50 * 1e3)),
               cli_fmt_ns(t2, sizeof(t2), (int64_t)(r->p99 * 1e3)),
               cli_fmt_ns(t3, sizeof(t3), (int64_t)(r->unlink_p50 * 1e3)),
               cli_fmt_ns(t4, sizeof(t4), (int64_t)(r->unlink_p99 * 1e3)));
        return;
    }
    if (r->base == BASE_NONE)
        printf("%9s %7" PRIu32 " %6" PRIu32 " %9.3f %10.1f %10.1f %11.0f | "
               "%9s %10s %7s\n",
               cli_fmt_bytes(b, sizeof(b), r->block), r->per_call, r->iters,
               r->gbps, r->p50, r->p99, r->blocks_per_s, "-", "-", "-");
    else
        printf("%9s %7" PRIu32 " %6" PRIu32 " %9.3f %10.1f %10.1f %11.0f | "
               "%9.3f %10.1f %7.2f",
               cli_fmt_bytes(b, sizeof(b), r->block), r->per_call, r->iters,
               r->gbps, r->p50, r->p99, r->blocks_per_s, r->base_gbps,
               r->base_p50, r->ratio);
    if (r->rounds > 1 && r->base != BASE_NONE)
        printf(" %5.2f-%-5.2f", r->ratio_lo, r->ratio_hi);
    if (r->base == BASE_MEMCPY)
        printf(" | %9.3f %7.2f  (%s)\n", r->best_gbps, r->ratio_best,
               r->best_nt ? "streamed" : "memcpy");
    else if (r->base != BASE_NONE)
        printf("\n");
    if (r->inflight > 0) {
        char rat[64] = "";
        if (r->base != BASE_NONE)
            snprintf(rat, sizeof(rat), "%.2f x %s GB/s; ", r->ratio,
                     bench_base_label(r->base));
        printf("  %" PRIu32 " in flight: %spost cost: %.0f ns/block "
               "(%" PRIu32 " blocks, p50 %s per post)\n",
               r->inflight, rat, r->post_ns / r->per_call, r->per_call,
               cli_fmt_ns(t1, sizeof(t1), (int64_t)r->post_ns));
    }
    fflush(stdout);
}

static void
bench_iso_date(char *buf, size_t cap)
{
    time_t now = time(NULL);
    struct tm tm;

    gmtime_r(&now, &tm);
    strftime(buf, cap, "%Y-%m-%dT%H:%M:%SZ", &tm);
}

bool
bench_write_json(const bench_cfg *cfg, const bench_result *rows, size_t n,
                 const bench_result *runs)
{
    cJSON *root = cJSON_CreateObject(), *c, *h, *arr;
    struct utsname u;
    char date[32];
    bool ok = false;

    if (root == NULL)
        goto out;
    bench_iso_date(date, sizeof(date));
    cJSON_AddStringToObject(root, "tool", "llmdd bench");
    cJSON_AddStringToObject(root, "version", llmdd_version());
    cJSON_AddStringToObject(root, "date", date);
    cJSON_AddStringToObject(root, "command", cfg->command);
    h = cJSON_AddObjectToObject(root, "host");
    if (h != NULL) {
        cJSON_AddNumberToObject(h, "cores",
                                (double)sysconf(_SC_NPROCESSORS_ONLN));
        cJSON_AddNumberToObject(h, "memory_bytes",
                                (double)sysconf(_SC_PHYS_PAGES) *
                                    (double)sysconf(_SC_PAGESIZE));
        if (uname(&u) == 0) {
            cJSON_AddStringToObject(h, "sysname", u.sysname);
            cJSON_AddStringToObject(h, "release", u.release);
            cJSON_AddStringToObject(h, "machine", u.machine);
        }
    }
    c = cJSON_AddObjectToObject(root, "config");
    if (c != NULL) {
        cJSON_AddStringToObject(c, "op", bench_ops[cfg->op]);
        cJSON_AddStringToObject(c, "transport", cfg->lo.transport);
        cJSON_AddStringToObject(c, "transports_built", llmdd_transport_list());
        cJSON_AddNumberToObject(c, "decoders", cfg->decoders);
        cJSON_AddNumberToObject(c, "blocks", cfg->blocks);
        cJSON_AddNumberToObject(c, "total_size", (double)cfg->total);
        cJSON_AddBoolToObject(c, "register", cfg->reg);
        cJSON_AddStringToObject(c, "baseline",
                                bench_bases[bench_base_kind(cfg)]);
    }
    arr = cJSON_AddArrayToObject(root, "rows");
    for (size_t i = 0; arr != NULL && i < n; i++) {
        const bench_result *r = &rows[i];
        cJSON *o = cJSON_CreateObject();
        if (o == NULL)
            goto out;
        cJSON_AddItemToArray(arr, o);
        cJSON_AddStringToObject(o, "op", bench_ops[cfg->op]);
        cJSON_AddNumberToObject(o, "iters", r->iters);
        cJSON_AddNumberToObject(o, "warmup", r->warmup);
        if (cfg->op == BOP_LINK) {
            cJSON_AddNumberToObject(o, "decoders", cfg->decoders);
            cJSON_AddNumberToObject(o, "link_p50_us", r->p50);
            cJSON_AddNumberToObject(o, "link_p99_us", r->p99);
            cJSON_AddNumberToObject(o, "unlink_p50_us", r->unlink_p50);
            cJSON_AddNumberToObject(o, "unlink_p99_us", r->unlink_p99);
            continue;
        }
        if (cfg->op == BOP_LAYERWISE) {
            cJSON_AddNumberToObject(o, "layer_bytes", 2.0 * (double)r->block);
            cJSON_AddNumberToObject(o, "layers", r->layers);
            cJSON_AddNumberToObject(o, "rounds", r->iters);
            cJSON_AddNumberToObject(o, "compute_per_layer_ms", r->compute_ms);
            cJSON_AddNumberToObject(o, "compute_ms", r->comp_ms);
            cJSON_AddNumberToObject(o, "push_ms", r->push_ms);
            cJSON_AddNumberToObject(o, "compute_then_push_ms", r->seq_ms);
            cJSON_AddNumberToObject(o, "layerwise_ms", r->lw_ms);
            cJSON_AddNumberToObject(o, "ideal_ms", r->ideal_ms);
            cJSON_AddNumberToObject(o, "layer_ready_ms", r->marks_ms);
            cJSON_AddNumberToObject(o, "layer_ready_preemptions", r->preempt);
            cJSON_AddNumberToObject(o, "last_mark_to_done_ms", r->tail_ms);
            cJSON_AddNumberToObject(o, "one_layer_ms", r->layer_ms);
            cJSON_AddNumberToObject(o, "ratio_layerwise_to_sequential",
                                    r->ratio_seq);
            cJSON_AddNumberToObject(o, "ratio_layerwise_to_ideal",
                                    r->ratio_ideal);
            cJSON_AddNumberToObject(o, "layer_efficiency", r->layer_eff);
            continue;
        }
        cJSON_AddNumberToObject(o, "block_size", (double)r->block);
        cJSON_AddNumberToObject(o, "rounds", r->rounds);
        if (r->rounds > 1) {
            cJSON *sp = cJSON_AddObjectToObject(o, "spread");
            if (sp != NULL) {
                cJSON_AddNumberToObject(sp, "gbps_min", r->gbps_lo);
                cJSON_AddNumberToObject(sp, "gbps_max", r->gbps_hi);
                cJSON_AddNumberToObject(sp, "baseline_gbps_min", r->base_lo);
                cJSON_AddNumberToObject(sp, "baseline_gbps_max", r->base_hi);
                cJSON_AddNumberToObject(sp, "ratio_min", r->ratio_lo);
                cJSON_AddNumberToObject(sp, "ratio_max", r->ratio_hi);
            }
            /* Each round as measured, in the order they ran. */
            cJSON *pr = cJSON_AddArrayToObject(o, "per_round");
            for (uint32_t k = 0; pr != NULL && k < r->rounds; k++) {
                const bench_result *q = &runs[(size_t)k * n + i];
                cJSON *e = cJSON_CreateObject();
                if (e == NULL)
                    goto out;
                cJSON_AddItemToArray(pr, e);
                cJSON_AddNumberToObject(e, "gbps", q->gbps);
                cJSON_AddNumberToObject(e, "p50_us", q->p50);
                cJSON_AddNumberToObject(e, "baseline_gbps", q->base_gbps);
                cJSON_AddNumberToObject(e, "baseline_p50_us", q->base_p50);
                cJSON_AddNumberToObject(e, "ratio", q->ratio);
            }
        }
        cJSON_AddNumberToObject(o, "blocks", r->per_call);
        cJSON_AddNumberToObject(o, "bytes_per_call", (double)r->bytes_per_call);
        cJSON_AddNumberToObject(o, "calls", (double)r->calls);
        cJSON_AddNumberToObject(o, "gbps", r->gbps);
        cJSON_AddNumberToObject(o, "p50_us", r->p50);
        cJSON_AddNumberToObject(o, "p99_us", r->p99);
        cJSON_AddNumberToObject(o, "blocks_per_s", r->blocks_per_s);
        if (r->inflight > 0) {
            cJSON_AddNumberToObject(o, "inflight", r->inflight);
            cJSON_AddNumberToObject(o, "post_ns", r->post_ns);
            cJSON_AddNumberToObject(o, "post_ns_per_block",
                                    r->post_ns / r->per_call);
        }
        if (r->base != BASE_NONE) {
            cJSON *b = cJSON_AddObjectToObject(o, "baseline");
            if (b != NULL) {
                cJSON_AddStringToObject(b, "kind", bench_bases[r->base]);
                cJSON_AddNumberToObject(b, "gbps", r->base_gbps);
                cJSON_AddNumberToObject(b, "p50_us", r->base_p50);
                cJSON_AddNumberToObject(b, "p99_us", r->base_p99);
            }
            cJSON_AddNumberToObject(o, "ratio", r->ratio);
            if (r->base == BASE_MEMCPY) {
                cJSON *bc = cJSON_AddObjectToObject(o, "best_copy");
                if (bc != NULL) {
                    cJSON_AddStringToObject(bc, "kind",
                                            r->best_nt ? "streamed" : "memcpy");
                    cJSON_AddNumberToObject(bc, "gbps", r->best_gbps);
                }
                cJSON_AddNumberToObject(o, "ratio_best", r->ratio_best);
            }
        }
    }
    char *text = cJSON_Print(root);
    if (text == NULL)
        goto out;
    FILE *f = fopen(cfg->json, "w");
    if (f != NULL) {
        ok = fputs(text, f) >= 0 && fputc('\n', f) != EOF;
        ok = fclose(f) == 0 && ok;
    }
    free(text);
out:
    cJSON_Delete(root);
    if (!ok)
        cli_err("cannot write %s: %s", cfg->json, strerror(errno));
    return ok;
}

bool
bench_write_csv(const bench_cfg *cfg, const bench_result *rows, size_t n)
{
    FILE *f = fopen(cfg->csv, "w");
    bool ok;

    if (f == NULL) {
        cli_err("cannot write %s: %s", cfg->csv, strerror(errno));
        return false;
    }
    if (cfg->op == BOP_LINK) {
        fprintf(f, "op,decoders,iters,link_p50_us,link_p99_us,unlink_p50_us,"
                   "unlink_p99_us\n");
        for (size_t i = 0; i < n; i++)
            fprintf(f, "link,%" PRIu32 ",%" PRIu32 ",%.3f,%.3f,%.3f,%.3f\n",
                    cfg->decoders, rows[i].iters, rows[i].p50, rows[i].p99,
                    rows[i].unlink_p50, rows[i].unlink_p99);
    } else {
        fprintf(f, "op,transport,decoders,block_size,blocks,bytes_per_call,"
                   "iters,gbps,p50_us,p99_us,blocks_per_s,baseline,"
                   "baseline_gbps,baseline_p50_us,ratio,best_copy_gbps,"
                   "ratio_best,rounds,gbps_min,gbps_max,baseline_gbps_min,"
                   "baseline_gbps_max,ratio_min,ratio_max\n");
        for (size_t i = 0; i < n; i++) {
            const bench_result *r = &rows[i];
            fprintf(
                f,
                "%s,%s,%" PRIu32 ",%" PRIu64 ",%" PRIu32 ",%" PRIu64 ",%" PRIu32
                ",%.4f,%.3f,%.3f,%.1f,%s,%.4f,%.3f,%.4f,%.4f,%.4f,%" PRIu32
                ",%.4f,%.4f,%.4f,%.4f,%.4f,%.4f\n",
                bench_ops[cfg->op], cfg->lo.transport, cfg->decoders, r->block,
                r->per_call, r->bytes_per_call, r->iters, r->gbps, r->p50,
                r->p99, r->blocks_per_s, bench_bases[r->base], r->base_gbps,
                r->base_p50, r->ratio, r->best_gbps, r->ratio_best, r->rounds,
                r->gbps_lo, r->gbps_hi, r->base_lo, r->base_hi, r->ratio_lo,
                r->ratio_hi);
        }
    }
    ok = !ferror(f);
    ok = fclose(f) == 0 && ok;
    if (!ok)
        cli_err("cannot write %s: %s", cfg->csv, strerror(errno));
    return ok;
}

static bool
bench_have_gnuplot(void)
{
    const char *path = getenv("PATH");
    char dir[4096];

    if (path == NULL)
        path = "/usr/bin:/bin";
    while (*path != '\0') {
        const char *end = strchr(path, ':');
        size_t n = end != NULL ? (size_t)(end - path) : strlen(path);
        if (n > 0 && n < sizeof(dir) - 16) {
            memcpy(dir, path, n);
            strcpy(dir + n, "/gnuplot");
            if (access(dir, X_OK) == 0)
                return true;
        }
        path += n;
        if (*path == ':')
            path++;
    }
    return false;
}

/* A gnuplot single-quoted string: a quote is written twice. */
static void
bench_gp_str(FILE *f, const char *s)
{
    fputc('\'', f);
    for (; *s != '\0'; s++) {
        if (*s == '\'')
            fputc('\'', f);
        fputc(*s, f);
    }
    fputc('\'', f);
}

bool
bench_plot(const bench_cfg *cfg, const bench_result *rows, size_t n)
{
    char title[256], date[32];
    FILE *gp;

    if (!bench_have_gnuplot()) {
        cli_err("--plot: gnuplot is not installed (`sh scripts/deps.sh` "
                "installs gnuplot-nox); the tables above are complete");
        return false;
    }
    fflush(NULL);
    gp = popen("gnuplot", "w");
    if (gp == NULL) {
        cli_err("--plot: cannot run gnuplot: %s", strerror(errno));
        return false;
    }
    bench_iso_date(date, sizeof(date));
    date[10] = '\0';
    int base = n > 0 ? rows[0].base : BASE_NONE;
    snprintf(title, sizeof(title),
             "llmdd bench --op %s, transport %s, %" PRIu32
             " block(s)/call, %" PRIu32 " decoder(s), %ld cores, %s",
             bench_ops[cfg->op], cfg->lo.transport,
             n > 0 ? rows[0].per_call : 0, cfg->decoders,
             sysconf(_SC_NPROCESSORS_ONLN), date);
    fputs("if (strstrt(GPVAL_TERMINALS, 'pngcairo') > 0) {\n"
          "  set terminal pngcairo size 960,600 font 'Sans,10'\n"
          "} else {\n"
          "  set terminal png size 960,600\n"
          "}\n",
          gp);
    fputs("set output ", gp);
    bench_gp_str(gp, cfg->plot);
    fputs("\nset title ", gp);
    bench_gp_str(gp, title);
    if (cfg->rounds > 1) /* a second line: "\n" only works in "" */
        fprintf(gp,
                ".\"\\nmedians of %" PRIu32 " rounds; bars: lowest to highest "
                "round\"",
                cfg->rounds);
    /* Tick labels from the rows themselves: 4K, 64K, 1M, ... */
    fputs("\nset xtics (", gp);
    size_t every = n > 12 ? 2 : 1;
    for (size_t i = 0; i < n; i += every) {
        uint64_t b = rows[i].block;
        const char *u = "";
        while (b >= 1024 && b % 1024 == 0 && *u != 'G') {
            b /= 1024;
            u = *u == '\0' ? "K" : *u == 'K' ? "M" : "G";
        }
        fprintf(gp, "%s'%" PRIu64 "%s' %" PRIu64, i > 0 ? ", " : "", b, u,
                rows[i].block);
    }
    fputs(")\nset logscale x 2\n"
          "set xlabel 'block size (bytes)'\n"
          "set ylabel 'throughput, GB/s (10^9 bytes/s)'\n"
          "set y2label 'p50 latency per call (us)'\n"
          "set logscale y2 10\n"
          "set format y2 '10^{%T}'\n"
          "set ytics nomirror\n"
          "set y2tics\n"
          "set yrange [0:*]\n"
          "set grid xtics ytics\n"
          "set key below horizontal\n"
          "$data << EOD\n",
          gp);
    /* Columns: block, GB/s, its low and high, baseline GB/s, its low and
     * high, p50 (one round's low and high are its own value). */
    bool bars = cfg->rounds > 1;
    for (size_t i = 0; i < n; i++) {
        const bench_result *r = &rows[i];
        fprintf(gp, "%" PRIu64 " %.6f %.6f %.6f %.6f %.6f %.6f %.3f\n",
                r->block, r->gbps, r->gbps_lo, r->gbps_hi, r->base_gbps,
                r->base_lo, r->base_hi, r->p50);
    }
    const char *style = bars ? "yerrorlines" : "linespoints";
    fprintf(gp,
            "EOD\nplot $data using 1:2%s with %s lw 2 pt 7 "
            "title 'llmdd %s (%s), GB/s'",
            bars ? ":3:4" : "", style, bench_ops[cfg->op], cfg->lo.transport);
    if (base != BASE_NONE)
        fprintf(gp,
                ", $data using 1:5%s with %s lw 2 pt 5 dt 2 "
                "title '%s baseline, GB/s'",
                bars ? ":6:7" : "", style, bench_base_label(base));
    fputs(", $data using 1:8 axes x1y2 with linespoints lw 1.5 pt 1 dt 3 "
          "title 'llmdd p50 latency per call (right axis)'\n",
          gp);
    int st = pclose(gp);
    if (st != 0) {
        cli_err("--plot: gnuplot failed (status %d)", st);
        return false;
    }
    return true;
}
