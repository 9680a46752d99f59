/*
 * Messages and formatting of the llmdd tool; see common.h. Errors go to
 * stderr one line at a time, prefixed with the subcommand.
 */
#include "common.h"

#include <inttypes.h>
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

const char *cli_prog = "llmdd";

/* ---- Messages. ---- */

static const char *
cm_hint(llmdd_status st)
{
    switch (st) {
    case LLM_LINK_FAILED:
        return "the library's error line above says which: nothing listens "
               "there (connection refused: is `llmdd serve` running?), the "
               "peer is another cluster id than --remote-cluster-id, or the "
               "two sides' llm.AuthToken differ (-o llm.AuthToken=...)";
    case LLM_TIMEOUT:
        return "the peer did not answer in time; raise --timeout or "
               "-o llm.SyncKvCacheWaitTime=MS";
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
