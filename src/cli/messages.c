/*
 * Messages and formatting of the llmdd tool; see common.h. Errors go to
 * stderr one line at a time, prefixed with the subcommand.
 */
#include "common.h"

#include <inttypes.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

const char *cli_prog = "llmdd";

/* ---- Messages. ---- */

static const char *
cm_hint(llmdd_status st)
{
    switch (st) {
    case LLM_LINK_FAILED:
        return "the library's log says which (a refused connect is an "
               "info line: LLMDD_LOG_LEVEL=info shows it): nothing listens "
               "there (connection refused: is `llmdd serve` running?), the "
               "peer is another cluster id than --remote-cluster-id, the "
               "two sides' llm.AuthToken differ (-o llm.AuthToken=...), or, "
               "with --metadata, the cluster is not published there (see "
               "`llmdd info --metadata ...`)";
    case LLM_TIMEOUT:
        return "the peer (or, with --metadata, etcd) did not answer in "
               "time; raise --timeout or -o llm.SyncKvCacheWaitTime=MS";
    case LLM_NOT_YET_LINK:
        return "no live link to that cluster (it was never made, or the "
               "peer went away)";
    case LLM_KV_CACHE_NOT_EXIST:
        return "no such cache: check --cache-id against the ids `llmdd "
               "serve` printed";
    case LLM_PARAM_INVALID:
        return "the library refused the arguments: do the shapes match the "
               "server's (--model, --tokens, --batch, ...) and are the "
               "indices in range?";
    case LLM_FEATURE_NOT_ENABLED:
        return "not built into this library; see `llmdd info`";
    case LLM_OUT_OF_MEMORY:
        return "not enough memory for these caches; try a smaller --tokens "
               "or --batch";
    case LLM_ALREADY_LINK:
        return "already linked to that cluster id";
    default:
        return NULL;
    }
}

void
cli_fmt_st(char *buf, size_t cap, llmdd_status st, const char *fmt, ...)
{
    va_list ap;
    int n;

    va_start(ap, fmt);
    n = vsnprintf(buf, cap, fmt, ap);
    va_end(ap);
    if (n < 0 || (size_t)n >= cap)
        return;
    const char *hint = cm_hint(st);
    snprintf(buf + n, cap - (size_t)n, " failed: %s (0x%08" PRIX32 ")%s%s",
             llmdd_status_str(st), st, hint != NULL ? "\n  hint: " : "",
             hint != NULL ? hint : "");
}

void
cli_err(const char *fmt, ...)
{
    char line[1024];
    va_list ap;

    va_start(ap, fmt);
    vsnprintf(line, sizeof(line), fmt, ap);
    va_end(ap);
    fflush(stdout);
    fprintf(stderr, "%s: %s\n", cli_prog, line);
}

void
cli_err_st(llmdd_status st, const char *fmt, ...)
{
    char what[512], line[1024];
    va_list ap;

    va_start(ap, fmt);
    vsnprintf(what, sizeof(what), fmt, ap);
    va_end(ap);
    cli_fmt_st(line, sizeof(line), st, "%s", what);
    cli_err("%s", line);
}

int
cli_usage_err(const char *fmt, ...)
{
    char line[512];
    va_list ap;

    va_start(ap, fmt);
    vsnprintf(line, sizeof(line), fmt, ap);
    va_end(ap);
    fflush(stdout);
    fprintf(stderr, "%s: %s\nTry '%s --help'.\n", cli_prog, line, cli_prog);
    return CLI_EXIT_USAGE;
}

/* ---- Formatting. ---- */

const char *
cli_fmt_bytes(char *buf, size_t cap, uint64_t n)
{
    static const char *const units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
    unsigned u = 0;
    double v = (double)n;

    while (v >= 1024 && u < 4) {
        v /= 1024;
        u++;
    }
    if (u == 0)
        snprintf(buf, cap, "%" PRIu64 " B", n);
    else if (v == (double)(uint64_t)v)
        snprintf(buf, cap, "%.0f %s", v, units[u]);
    else
        snprintf(buf, cap, "%.1f %s", v, units[u]);
    return buf;
}

const char *
cli_fmt_addr(char *buf, size_t cap, const char *ip, uint16_t port)
{
    snprintf(buf, cap, strchr(ip, ':') != NULL ? "[%s]:%u" : "%s:%u", ip, port);
    return buf;
}

const char *
cli_fmt_ns(char *buf, size_t cap, int64_t ns)
{
    if (ns < 10000)
        snprintf(buf, cap, "%.2f us", (double)ns / 1e3);
    else if (ns < 1000000)
        snprintf(buf, cap, "%.0f us", (double)ns / 1e3);
    else if (ns < 1000000000)
        snprintf(buf, cap, "%.2f ms", (double)ns / 1e6);
    else
        snprintf(buf, cap, "%.2f s", (double)ns / 1e9);
    return buf;
}

int64_t
cli_now_ns(void)
{
    struct timespec ts;

    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

double
cli_gbps(uint64_t bytes, int64_t ns)
{
    return ns > 0 ? (double)bytes / (double)ns : 0.0;
}

/* ---- Progress of long work, on a terminal. ---- */

struct cli_progress {
    pthread_t thread;
    pthread_mutex_t lock;
    pthread_cond_t cond;
    const char *what;
    uint64_t total, done; /* done stays 0 when unknown (one blocking call) */
    int64_t t0;
    bool stop;
};

static void *
cp_main(void *arg)
{
    cli_progress *p = arg;
    char b1[32], b2[32];

    pthread_mutex_lock(&p->lock);
    while (!p->stop) {
        struct timespec ts;
        clock_gettime(CLOCK_MONOTONIC, &ts);
        ts.tv_nsec += 500000000;
        ts.tv_sec += ts.tv_nsec / 1000000000;
        ts.tv_nsec %= 1000000000;
        pthread_cond_timedwait(&p->cond, &p->lock, &ts);
        if (p->stop)
            break;
        cli_fmt_bytes(b1, sizeof(b1), p->total);
        cli_fmt_ns(b2, sizeof(b2), cli_now_ns() - p->t0);
        if (p->done > 0)
            fprintf(stderr, "\r%s %s: %3.0f%%, %s ", p->what, b1,
                    100.0 * (double)p->done / (double)p->total, b2);
        else
            fprintf(stderr, "\r%s %s: %s ", p->what, b1, b2);
    }
    pthread_mutex_unlock(&p->lock);
    return NULL;
}

cli_progress *
cli_progress_start(const char *what, uint64_t total)
{
    cli_progress *p;

    if (total < CLI_PROGRESS_MIN || !isatty(STDERR_FILENO) ||
        (p = calloc(1, sizeof(*p))) == NULL)
        return NULL;
    *p = (cli_progress){.what = what, .total = total, .t0 = cli_now_ns()};
    pthread_mutex_init(&p->lock, NULL);
    pthread_condattr_t ca;
    pthread_condattr_init(&ca);
    pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
    pthread_cond_init(&p->cond, &ca);
    pthread_condattr_destroy(&ca);
    if (pthread_create(&p->thread, NULL, cp_main, p) != 0) {
        pthread_cond_destroy(&p->cond);
        pthread_mutex_destroy(&p->lock);
        free(p);
        return NULL;
    }
    return p;
}

void
cli_progress_set(cli_progress *p, uint64_t done)
{
    if (p == NULL)
        return;
    pthread_mutex_lock(&p->lock);
    p->done = done;
    pthread_mutex_unlock(&p->lock);
}

void
cli_progress_end(cli_progress *p)
{
    if (p == NULL)
        return;
    pthread_mutex_lock(&p->lock);
    p->stop = true;
    pthread_cond_signal(&p->cond);
    pthread_mutex_unlock(&p->lock);
    pthread_join(p->thread, NULL);
    fprintf(stderr, "\r\033[K"); /* the line is cleared for what follows */
    pthread_cond_destroy(&p->cond);
    pthread_mutex_destroy(&p->lock);
    free(p);
}
