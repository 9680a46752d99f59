/* Shared pieces of the llmdd tool; see common.h. */
#include "common.h"

#include <arpa/inet.h>
#include <endian.h>
#include <errno.h>
#include <inttypes.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

const char *cli_prog = "llmdd";

/* ---- Messages. ---- */

static const char *
cm_hint(llmdd_status st)
{
    switch (st) {
    case LLM_LINK_FAILED:
        return "nothing accepted the link there: is `llmdd serve` running at "
               "that address, with a different cluster id and the same "
               "llm.AuthToken?";
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

/* ---- Parsing. ---- */

bool
cli_parse_u64(const char *s, uint64_t min, uint64_t max, uint64_t *out)
{
    uint64_t v = 0;

    if (s == NULL || *s == '\0')
        return false;
    for (; *s != '\0'; s++) {
        if (*s < '0' || *s > '9')
            return false;
        unsigned d = (unsigned)(*s - '0');
        if (v > (UINT64_MAX - d) / 10)
            return false;
        v = v * 10 + d;
    }
    if (v < min || v > max)
        return false;
    *out = v;
    return true;
}

bool
cli_parse_u32(const char *s, uint32_t min, uint32_t max, uint32_t *out)
{
    uint64_t v;

    if (!cli_parse_u64(s, min, max, &v))
        return false;
    *out = (uint32_t)v;
    return true;
}

bool
cli_parse_size(const char *s, uint64_t *out)
{
    char digits[32];
    size_t nd = 0;
    unsigned shift = 0;
    uint64_t v;

    if (s == NULL)
        return false;
    while (s[nd] >= '0' && s[nd] <= '9' && nd < sizeof(digits) - 1) {
        digits[nd] = s[nd];
        nd++;
    }
    digits[nd] = '\0';
    if (nd == 0 || !cli_parse_u64(digits, 0, UINT64_MAX, &v))
        return false;
    const char *suf = s + nd;
    switch (*suf) {
    case '\0':
        break;
    case 'k':
    case 'K':
        shift = 10;
        break;
    case 'm':
    case 'M':
        shift = 20;
        break;
    case 'g':
    case 'G':
        shift = 30;
        break;
    case 't':
    case 'T':
        shift = 40;
        break;
    case 'b':
    case 'B':
        if (suf[1] != '\0')
            return false;
        break;
    default:
        return false;
    }
    if (shift > 0) {
        suf++;
        if (strcmp(suf, "") != 0 && strcmp(suf, "B") != 0 &&
            strcmp(suf, "iB") != 0 && strcmp(suf, "i") != 0)
            return false;
        if (v > (UINT64_MAX >> shift))
            return false;
        v <<= shift;
    }
    *out = v;
    return true;
}

bool
cli_parse_range(const char *s, bool sizes, uint64_t *a, uint64_t *b)
{
    char left[64];
    const char *colon;
    uint64_t x, y;

    if (s == NULL)
        return false;
    colon = strchr(s, ':');
    if (colon == NULL) {
        if (!(sizes ? cli_parse_size(s, &x)
                    : cli_parse_u64(s, 0, UINT64_MAX, &x)))
            return false;
        *a = *b = x;
        return true;
    }
    size_t n = (size_t)(colon - s);
    if (n == 0 || n >= sizeof(left))
        return false;
    memcpy(left, s, n);
    left[n] = '\0';
    if (sizes) {
        if (!cli_parse_size(left, &x) || !cli_parse_size(colon + 1, &y))
            return false;
    } else if (!cli_parse_u64(left, 0, UINT64_MAX, &x) ||
               !cli_parse_u64(colon + 1, 0, UINT64_MAX, &y)) {
        return false;
    }
    if (x > y)
        return false;
    *a = x;
    *b = y;
    return true;
}

bool
cli_parse_hostport(const char *s, char *ip, size_t cap, uint16_t *port)
{
    char addr[LLMDD_IP_LEN];
    const char *p;
    size_t n;
    uint32_t v;
    unsigned char tmp[16];

    if (s == NULL)
        return false;
    if (s[0] == '[') {
        const char *close = strchr(s, ']');
        if (close == NULL || close[1] != ':')
            return false;
        n = (size_t)(close - s - 1);
        if (n == 0 || n >= sizeof(addr))
            return false;
        memcpy(addr, s + 1, n);
        addr[n] = '\0';
        if (inet_pton(AF_INET6, addr, tmp) != 1)
            return false;
        p = close + 2;
    } else {
        const char *colon = strrchr(s, ':');
        if (colon == NULL)
            return false;
        n = (size_t)(colon - s);
        if (n == 0 || n >= sizeof(addr))
            return false;
        memcpy(addr, s, n);
        addr[n] = '\0';
        if (inet_pton(AF_INET, addr, tmp) != 1)
            return false;
        p = colon + 1;
    }
    if (!cli_parse_u32(p, 1, 65535, &v) || n >= cap)
        return false;
    memcpy(ip, addr, n + 1);
    *port = (uint16_t)v;
    return true;
}

bool
cli_parse_list(const char *s, size_t max, uint64_t **out, size_t *count)
{
    uint64_t *v = NULL;
    size_t n = 0, cap = 0;
    char *copy, *save = NULL;

    if (s == NULL || *s == '\0' || (copy = strdup(s)) == NULL)
        return false;
    for (char *tok = strtok_r(copy, ",", &save); tok != NULL;
         tok = strtok_r(NULL, ",", &save)) {
        uint64_t a, b;
        char *dash = strchr(tok, '-');
        if (dash != NULL) {
            *dash = '\0';
            if (!cli_parse_u64(tok, 0, UINT32_MAX, &a) ||
                !cli_parse_u64(dash + 1, 0, UINT32_MAX, &b) || a > b)
                goto err;
        } else if (!cli_parse_u64(tok, 0, UINT32_MAX, &a)) {
            goto err;
        } else {
            b = a;
        }
        if (b - a + 1 > max - n)
            goto err;
        if (n + (b - a + 1) > cap) {
            size_t ncap = (n + (size_t)(b - a + 1)) * 2;
            uint64_t *nv = realloc(v, ncap * sizeof(*v));
            if (nv == NULL)
                goto err;
            v = nv;
            cap = ncap;
        }
        for (uint64_t x = a; x <= b; x++)
            v[n++] = x;
    }
    free(copy);
    if (n == 0) {
        free(v);
        return false;
    }
    *out = v;
    *count = n;
    return true;
err:
    free(copy);
    free(v);
    return false;
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

/* ---- Library options. ---- */

void
cli_lib_opts_init(cli_lib_opts *lo)
{
    memset(lo, 0, sizeof(*lo));
    strcpy(lo->transport, "auto");
}

void
cli_lib_opts_fini(cli_lib_opts *lo)
{
    for (size_t i = 0; i < lo->nuser; i++)
        free((char *)lo->user[i].key); /* value shares the allocation */
    lo->nuser = 0;
}

bool
cli_transport_built(const char *name)
{
    const char *list = llmdd_transport_list();
    size_t len = strlen(name);

    for (const char *p = list; *p != '\0';) {
        const char *end = strchr(p, ',');
        size_t n = end != NULL ? (size_t)(end - p) : strlen(p);
        if (n == len && strncmp(p, name, n) == 0)
            return true;
        p += n;
        if (*p == ',')
            p++;
    }
    return false;
}

bool
cli_set_transport(cli_lib_opts *lo, const char *name)
{
    static const char *const known[] = {"auto", "loop", "shm", "tcp", "ucx"};
    bool ok = false;

    for (size_t i = 0; i < sizeof(known) / sizeof(known[0]); i++)
        if (strcmp(name, known[i]) == 0)
            ok = true;
    if (!ok) {
        cli_err("unknown transport \"%s\" (auto, loop, shm, tcp, ucx)", name);
        return false;
    }
    if (strcmp(name, "auto") != 0 && !cli_transport_built(name)) {
        cli_err("transport %s is not built into this library (built in: "
                "%s); see `llmdd info`",
                name, llmdd_transport_list());
        return false;
    }
    snprintf(lo->transport, sizeof(lo->transport), "%s", name);
    return true;
}

bool
cli_add_option(cli_lib_opts *lo, const char *kv)
{
    const char *eq = strchr(kv, '=');
    char *copy;

    if (eq == NULL || eq == kv || lo->nuser == CLI_MAX_OPTIONS)
        return false;
    if ((copy = strdup(kv)) == NULL)
        return false;
    copy[eq - kv] = '\0';
    lo->user[lo->nuser].key = copy;
    lo->user[lo->nuser].value = copy + (eq - kv) + 1;
    lo->nuser++;
    return true;
}

llmdd_status
cli_instance(uint64_t cluster_id, llmdd_role role, const cli_lib_opts *lo,
             const char *listen_ip, uint16_t *port, llmdd **out, char *err,
             size_t cap)
{
    llmdd_option opts[CLI_MAX_OPTIONS + 4];
    char addr[LLMDD_IP_LEN + 16] = "";
    size_t n = 0;
    llmdd *dd = NULL;
    llmdd_status st;

    st = llmdd_create(cluster_id, role, &dd);
    if (st != LLM_SUCCESS) {
        cli_fmt_st(err, cap, st, "llmdd_create(cluster %" PRIu64 ")",
                   cluster_id);
        return st;
    }
    opts[n++] = (llmdd_option){"llm.SyncKvCacheWaitTime", CLI_WAIT_MS};
    if (lo->host_pool[0] != '\0')
        opts[n++] = (llmdd_option){"llm.HostMemPoolConfig", lo->host_pool};
    if (strcmp(lo->transport, "auto") != 0)
        opts[n++] = (llmdd_option){"llm.Transport", lo->transport};
    size_t listen_at = n;
    if (listen_ip != NULL)
        n++;
    memcpy(opts + n, lo->user, lo->nuser * sizeof(lo->user[0]));
    n += lo->nuser;

    /* Port 0: the kernel picks a free port; the instance says which. */
    if (listen_ip != NULL) {
        cli_fmt_addr(addr, sizeof(addr), listen_ip, port != NULL ? *port : 0);
        opts[listen_at] = (llmdd_option){"llm.ListenIpInfo", addr};
    }
    st = llmdd_initialize(dd, opts, n);
    if (st == LLM_SUCCESS) {
        llmdd_ip_info bound;
        if (listen_ip != NULL && port != NULL &&
            llmdd_listen_address(dd, &bound) == LLM_SUCCESS)
            *port = bound.port;
        *out = dd;
        return LLM_SUCCESS;
    }
    if (listen_ip != NULL && st == LLM_FAILED)
        cli_fmt_st(err, cap, st,
                   "llmdd_initialize(cluster %" PRIu64 ", listen %s) (is the "
                   "address in use or not on this host?)",
                   cluster_id, addr);
    else
        cli_fmt_st(err, cap, st, "llmdd_initialize(cluster %" PRIu64 ")",
                   cluster_id);
    llmdd_destroy(dd);
    return st;
}

static llmdd_cluster_info
cm_cluster(uint64_t id, llmdd_ip_info *ipi, const char *ip, uint16_t port)
{
    memset(ipi, 0, sizeof(*ipi));
    snprintf(ipi->ip, sizeof(ipi->ip), "%s", ip);
    ipi->port = port;
    return (llmdd_cluster_info){.remote_cluster_id = id,
                                .remote_role_type = LLMDD_ROLE_PROMPT,
                                .remote_ip_infos = ipi,
                                .num_remote_ip_infos = 1};
}

llmdd_status
cli_link(llmdd *dd, uint64_t cluster_id, const char *ip, uint16_t port,
         int timeout_ms, char *err, size_t cap)
{
    llmdd_ip_info ipi;
    llmdd_cluster_info ci = cm_cluster(cluster_id, &ipi, ip, port);
    llmdd_status rets[1] = {LLM_FAILED};
    llmdd_status st = llmdd_link_clusters(dd, &ci, 1, rets, timeout_ms);

    char a[LLMDD_IP_LEN + 16];

    if (st != LLM_SUCCESS)
        cli_fmt_st(err, cap, rets[0] != LLM_SUCCESS ? rets[0] : st,
                   "llmdd_link_clusters(cluster %" PRIu64 " at %s)", cluster_id,
                   cli_fmt_addr(a, sizeof(a), ip, port));
    return st;
}

llmdd_status
cli_unlink(llmdd *dd, uint64_t cluster_id, const char *ip, uint16_t port,
           int timeout_ms, char *err, size_t cap)
{
    llmdd_ip_info ipi;
    llmdd_cluster_info ci = cm_cluster(cluster_id, &ipi, ip, port);
    llmdd_status rets[1] = {LLM_FAILED};
    llmdd_status st =
        llmdd_unlink_clusters(dd, &ci, 1, rets, timeout_ms, false);

    if (st != LLM_SUCCESS)
        cli_fmt_st(err, cap, rets[0] != LLM_SUCCESS ? rets[0] : st,
                   "llmdd_unlink_clusters(cluster %" PRIu64 ")", cluster_id);
    return st;
}

bool
cli_memory_fits(uint64_t bytes, const char *hint)
{
    double phys = (double)sysconf(_SC_PHYS_PAGES) * sysconf(_SC_PAGESIZE);
    char need[32], have[32];

    if (phys <= 0 || (double)bytes <= 0.8 * phys)
        return true;
    cli_err("this needs %s of memory at once; this machine has %s: %s",
            cli_fmt_bytes(need, sizeof(need), bytes),
            cli_fmt_bytes(have, sizeof(have), (uint64_t)phys), hint);
    return false;
}

/* ---- Model shapes. ---- */

typedef struct {
    const char *name;
    uint32_t layers, heads, head_dim;
} cm_model;

/* KV layouts of public models (grouped-query attention where they use it). */
static const cm_model cm_models[] = {
    {"llama3-8b", 32, 8, 128},  {"llama3-70b", 80, 8, 128},
    {"llama2-7b", 32, 32, 128}, {"qwen2-7b", 28, 4, 128},
    {"mistral-7b", 32, 8, 128}, {"tiny", 4, 2, 64},
};

void
cli_shape_default(cli_shape *s)
{
    memset(s, 0, sizeof(*s));
    snprintf(s->model, sizeof(s->model), "%s", cm_models[0].name);
    s->layers = cm_models[0].layers;
    s->heads = cm_models[0].heads;
    s->head_dim = cm_models[0].head_dim;
    s->tokens = 128;
    s->batch = 4;
    s->block_tokens = 16;
}

static bool
cm_shape_num(const char *what, const char *arg, uint32_t max, uint32_t *out)
{
    if (cli_parse_u32(arg, 1, max, out))
        return true;
    cli_usage_err("%s: \"%s\" is not a whole number in 1..%" PRIu32, what, arg,
                  max);
    return false;
}

int
cli_shape_opt(cli_shape *s, int opt, const char *arg)
{
    uint32_t *field = NULL, max = 0;
    const char *what = NULL;

    switch (opt) {
    case CLI_OPT_MODEL:
        for (size_t i = 0; i < sizeof(cm_models) / sizeof(cm_models[0]); i++) {
            if (strcmp(arg, cm_models[i].name) == 0) {
                snprintf(s->model, sizeof(s->model), "%s", arg);
                s->layers = cm_models[i].layers;
                s->heads = cm_models[i].heads;
                s->head_dim = cm_models[i].head_dim;
                return 1;
            }
        }
        cli_usage_err("unknown model \"%s\" (llama3-8b, llama3-70b, "
                      "llama2-7b, qwen2-7b, mistral-7b, tiny)",
                      arg);
        return -1;
    case CLI_OPT_LAYERS:
    case CLI_OPT_NUM_LAYERS:
        field = &s->layers, max = 1024, what = "--layers";
        break;
    case CLI_OPT_HEADS:
        field = &s->heads, max = 1024, what = "--heads";
        break;
    case CLI_OPT_HEAD_DIM:
        field = &s->head_dim, max = 16384, what = "--head-dim";
        break;
    case CLI_OPT_TOKENS:
        field = &s->tokens, max = 1u << 24, what = "--tokens";
        break;
    case CLI_OPT_BATCH:
        field = &s->batch, max = 65536, what = "--batch";
        break;
    case CLI_OPT_BLOCK_TOKENS:
        field = &s->block_tokens, max = 1u << 20, what = "--block-tokens";
        break;
    default:
        return 0;
    }
    if (!cm_shape_num(what, arg, max, field))
        return -1;
    if (opt != CLI_OPT_BATCH && opt != CLI_OPT_TOKENS &&
        opt != CLI_OPT_BLOCK_TOKENS)
        snprintf(s->model, sizeof(s->model), "custom");
    return 1;
}

/* Bytes one token takes in one tensor. */
static uint64_t
cm_token_bytes(const cli_shape *s)
{
    return (uint64_t)s->heads * s->head_dim * 2;
}

static uint64_t
cm_paged_blocks(const cli_shape *s)
{
    uint64_t toks = (uint64_t)s->batch * s->tokens;
    return (toks + s->block_tokens - 1) / s->block_tokens;
}

bool
cli_shape_check(const cli_shape *s)
{
    /* A tensor stays below 64 GiB and a cache below 1 TiB, so the sizes
     * the tool prints and allocates never overflow. */
    uint64_t kv = (uint64_t)s->batch * s->tokens * cm_token_bytes(s);
    uint64_t paged = cm_paged_blocks(s) * s->block_tokens * cm_token_bytes(s);
    uint64_t tensors = 2ull * s->layers;

    if (kv > (64ull << 30) || paged > (64ull << 30) ||
        kv * tensors > (1ull << 40) || paged * tensors > (1ull << 40)) {
        cli_usage_err("the cache shape is too large (a tensor may hold at "
                      "most 64 GiB, a cache 1 TiB)");
        return false;
    }
    return true;
}

llmdd_cache_desc
cli_shape_kv(const cli_shape *s)
{
    llmdd_cache_desc d = {
        .placement = LLMDD_PLACEMENT_HOST,
        .num_tensors = 2 * s->layers,
        .data_type = LLMDD_DT_BF16,
        .num_dims = 4,
        .shape = {s->batch, s->tokens, s->heads, s->head_dim}};
    return d;
}

llmdd_cache_desc
cli_shape_paged(const cli_shape *s)
{
    llmdd_cache_desc d = {.placement = LLMDD_PLACEMENT_HOST,
                          .num_tensors = 2 * s->layers,
                          .data_type = LLMDD_DT_BF16,
                          .num_dims = 4,
                          .shape = {(int64_t)cm_paged_blocks(s),
                                    s->block_tokens, s->heads, s->head_dim}};
    return d;
}

void
cli_shape_flags(const cli_shape *s, char *buf, size_t cap)
{
    cli_shape def;
    size_t n = 0;

    cli_shape_default(&def);
    buf[0] = '\0';
#define CM_ADD(...)                                                            \
    do {                                                                       \
        int k = snprintf(buf + n, cap - n, __VA_ARGS__);                       \
        if (k > 0 && (size_t)k < cap - n)                                      \
            n += (size_t)k;                                                    \
    } while (0)
    if (strcmp(s->model, "custom") == 0)
        CM_ADD(" --num-layers %" PRIu32 " --heads %" PRIu32
               " --head-dim %" PRIu32,
               s->layers, s->heads, s->head_dim);
    else if (strcmp(s->model, def.model) != 0)
        CM_ADD(" --model %s", s->model);
    if (s->tokens != def.tokens)
        CM_ADD(" --tokens %" PRIu32, s->tokens);
    if (s->batch != def.batch)
        CM_ADD(" --batch %" PRIu32, s->batch);
    if (s->block_tokens != def.block_tokens)
        CM_ADD(" --block-tokens %" PRIu32, s->block_tokens);
#undef CM_ADD
}

uint64_t
cli_desc_tensor_size(const llmdd_cache_desc *d)
{
    uint64_t n = llmdd_data_type_size(d->data_type);

    for (uint32_t i = 0; i < d->num_dims; i++)
        n *= (uint64_t)d->shape[i];
    return n;
}

uint64_t
cli_desc_stride(const llmdd_cache_desc *d)
{
    return cli_desc_tensor_size(d) / (uint64_t)d->shape[0];
}

const char *
cli_fmt_desc(char *buf, size_t cap, const llmdd_cache_desc *d)
{
    size_t n = 0;
    int k;

    k = snprintf(buf, cap, "%s [",
                 d->data_type == LLMDD_DT_BF16      ? "bf16"
                 : d->data_type == LLMDD_DT_FLOAT16 ? "fp16"
                                                    : "u8");
    if (k < 0 || (size_t)k >= cap)
        return buf;
    n = (size_t)k;
    for (uint32_t i = 0; i < d->num_dims && n < cap; i++) {
        k = snprintf(buf + n, cap - n, "%s%" PRId64, i > 0 ? "," : "",
                     d->shape[i]);
        if (k < 0)
            break;
        n += (size_t)k;
    }
    if (n < cap)
        snprintf(buf + n, cap - n, "]");
    return buf;
}

/* ---- The deterministic fill and its checksum. ---- */

static inline uint64_t
cm_mix(uint64_t x)
{
    /* The splitmix64 finalizer: every input bit moves every output bit. */
    x ^= x >> 30;
    x *= 0xbf58476d1ce4e5b9ull;
    x ^= x >> 27;
    x *= 0x94d049bb133111ebull;
    x ^= x >> 31;
    return x;
}

static inline uint64_t
cm_tensor_key(uint32_t seed, uint32_t t)
{
    return cm_mix(((uint64_t)seed << 32 | t) ^ 0x6c6c6d6464ull);
}

uint64_t
cli_fill_word(uint32_t seed, uint32_t t, uint64_t w)
{
    return cm_mix(cm_tensor_key(seed, t) + w * 0x9e3779b97f4a7c15ull);
}

uint32_t
cli_cache_seed(uint32_t seed, int64_t cache_id)
{
    return seed + (uint32_t)cache_id * 0x9e3779b9u;
}

void
cli_fill(void *dst, uint64_t len, uint32_t seed, uint32_t t, uint64_t off)
{
    uint8_t *p = dst;
    uint64_t key = cm_tensor_key(seed, t);

    /* Unaligned head and tail go byte by byte; the middle a word a step. */
    while (len > 0 && (off & 7) != 0) {
        uint64_t w = cm_mix(key + (off >> 3) * 0x9e3779b97f4a7c15ull);
        *p++ = (uint8_t)(w >> (8 * (off & 7)));
        off++;
        len--;
    }
    uint64_t w = off >> 3;
    for (; len >= 8; len -= 8, p += 8, w++) {
        uint64_t v = htole64(cm_mix(key + w * 0x9e3779b97f4a7c15ull));
        memcpy(p, &v, 8);
    }
    if (len > 0) {
        uint64_t v = cm_mix(key + w * 0x9e3779b97f4a7c15ull);
        for (uint64_t i = 0; i < len; i++)
            p[i] = (uint8_t)(v >> (8 * i));
    }
}

void
cli_fill_cache(const llmdd_cache *c, uint32_t seed)
{
    uint64_t size = cli_desc_tensor_size(&c->desc);

    for (uint32_t t = 0; t < c->desc.num_tensors; t++)
        cli_fill((void *)(uintptr_t)c->tensor_addrs[t], size, seed, t, 0);
}

#define CM_P1 0x9e3779b185ebca87ull
#define CM_P2 0xc2b2ae3d27d4eb4full
#define CM_P3 0x165667b19e3779f9ull

static inline uint64_t
cm_rotl(uint64_t x, int r)
{
    return (x << r) | (x >> (64 - r));
}

static inline uint64_t
cm_step(uint64_t h, uint64_t v)
{
    return cm_rotl(h ^ (v * CM_P2), 31) * CM_P1 + CM_P3;
}

void
cli_hash_init(cli_hash *x)
{
    memset(x, 0, sizeof(*x));
    x->h = CM_P3;
}

void
cli_hash_update(cli_hash *x, const void *p, size_t len)
{
    const uint8_t *b = p;
    uint64_t v;

    x->n += len;
    if (x->ntail > 0) {
        while (len > 0 && x->ntail < 8) {
            x->tail[x->ntail++] = *b++;
            len--;
        }
        if (x->ntail < 8)
            return;
        memcpy(&v, x->tail, 8);
        x->h = cm_step(x->h, le64toh(v));
        x->ntail = 0;
    }
    uint64_t h = x->h;
    for (; len >= 8; len -= 8, b += 8) {
        memcpy(&v, b, 8);
        h = cm_step(h, le64toh(v));
    }
    x->h = h;
    memcpy(x->tail, b, len);
    x->ntail = (unsigned)len;
}

uint64_t
cli_hash_final(const cli_hash *x)
{
    uint64_t h = x->h;

    for (unsigned i = 0; i < x->ntail; i++)
        h = cm_rotl(h ^ (x->tail[i] * CM_P3), 11) * CM_P1;
    return cm_mix(h ^ x->n);
}

#define CM_CHUNK (64u << 10)

/* Finds the first byte of a segment that differs from its pattern. */
static bool
cm_find_bad(const cli_seg *s, uint32_t seed, uint8_t *scratch,
            uint64_t *off_out)
{
    for (uint64_t o = 0; o < s->len; o += CM_CHUNK) {
        uint64_t n = s->len - o < CM_CHUNK ? s->len - o : CM_CHUNK;
        cli_fill(scratch, n, seed, s->src_tensor, s->src_off + o);
        if (memcmp(scratch, s->local + o, n) != 0) {
            for (uint64_t i = 0; i < n; i++) {
                if (scratch[i] != s->local[o + i]) {
                    *off_out = o + i;
                    return true;
                }
            }
        }
    }
    return false;
}

void
cli_verify(const cli_seg *segs, size_t n, uint32_t src_seed, cli_verdict *v)
{
    uint8_t *scratch = malloc(CM_CHUNK);
    cli_hash got, want;

    memset(v, 0, sizeof(*v));
    if (scratch == NULL)
        return;
    cli_hash_init(&got);
    cli_hash_init(&want);
    for (size_t i = 0; i < n; i++) {
        const cli_seg *s = &segs[i];
        cli_hash_update(&got, s->local, s->len);
        for (uint64_t o = 0; o < s->len; o += CM_CHUNK) {
            uint64_t k = s->len - o < CM_CHUNK ? s->len - o : CM_CHUNK;
            cli_fill(scratch, k, src_seed, s->src_tensor, s->src_off + o);
            cli_hash_update(&want, scratch, k);
        }
        v->bytes += s->len;
    }
    v->got = cli_hash_final(&got);
    v->want = cli_hash_final(&want);
    v->ok = v->got == v->want;
    if (!v->ok) {
        /* Only a failure pays for locating the damage. */
        for (size_t i = 0; i < n; i++) {
            if (cm_find_bad(&segs[i], src_seed, scratch, &v->bad_off)) {
                v->bad_seg = i;
                break;
            }
        }
    }
    free(scratch);
}

bool
cli_segs_slot(const llmdd_cache *local, uint32_t lfirst, uint32_t sfirst,
              uint32_t count, uint64_t loff, uint64_t soff, uint64_t len,
              cli_seg **out, size_t *n)
{
    cli_seg *s = calloc(count > 0 ? count : 1, sizeof(*s));

    if (s == NULL)
        return false;
    for (uint32_t i = 0; i < count; i++) {
        s[i].local =
            (const uint8_t *)(uintptr_t)local->tensor_addrs[lfirst + i] + loff;
        s[i].src_tensor = sfirst + i;
        s[i].src_off = soff;
        s[i].len = len;
    }
    *out = s;
    *n = count;
    return true;
}

bool
cli_segs_blocks(const llmdd_cache *local, const uint64_t *src,
                const uint64_t *dst, size_t nblocks, cli_seg **out, size_t *n)
{
    uint64_t stride = cli_desc_stride(&local->desc);
    size_t total = (size_t)local->desc.num_tensors * nblocks;
    cli_seg *s = calloc(total > 0 ? total : 1, sizeof(*s));

    if (s == NULL)
        return false;
    for (uint32_t t = 0; t < local->desc.num_tensors; t++) {
        for (size_t k = 0; k < nblocks; k++) {
            cli_seg *g = &s[(size_t)t * nblocks + k];
            g->local = (const uint8_t *)(uintptr_t)local->tensor_addrs[t] +
                       dst[k] * stride;
            g->src_tensor = t;
            g->src_off = src[k] * stride;
            g->len = stride;
        }
    }
    *out = s;
    *n = total;
    return true;
}

static uint64_t
cm_gcd(uint64_t a, uint64_t b)
{
    while (b != 0) {
        uint64_t t = a % b;
        a = b;
        b = t;
    }
    return a;
}

void
cli_pick_blocks(uint64_t nb, size_t n, uint64_t *src, uint64_t *dst)
{
    uint64_t step = nb * 5 / 8 + 1;

    /* A step coprime with nb visits every block once. */
    while (cm_gcd(step, nb) != 1 || (nb > 2 && step % nb == 1))
        step++;
    for (size_t k = 0; k < n; k++) {
        src[k] = (3 + (uint64_t)k * step) % nb;
        dst[k] = k;
    }
}

/* ---- Nodes. ---- */

struct cli_node_thread {
    pthread_t tid;
    cli_node_fn fn;
    void *arg;
    int in_fd, out_fd;
    int rc;
};

/* Parent-side pipe ends of every node, which each later child closes. */
#define CM_NODES_MAX 256
static int cm_parent_fds[2 * CM_NODES_MAX];
static size_t cm_nparent_fds;

static void
cm_forget_fd(int fd)
{
    for (size_t i = 0; i < cm_nparent_fds; i++) {
        if (cm_parent_fds[i] == fd) {
            cm_parent_fds[i] = cm_parent_fds[--cm_nparent_fds];
            return;
        }
    }
}

static void *
cm_node_thread(void *p)
{
    struct cli_node_thread *t = p;

    t->rc = t->fn(t->arg, t->in_fd, t->out_fd);
    close(t->in_fd);
    close(t->out_fd);
    return NULL;
}

int
cli_node_start(cli_node *n, const char *name, bool threaded, cli_node_fn fn,
               void *arg)
{
    int cmd[2], rep[2];

    memset(n, 0, sizeof(*n));
    n->cmd_fd = n->rep_fd = -1;
    snprintf(n->name, sizeof(n->name), "%s", name);
    if (cm_nparent_fds + 2 > sizeof(cm_parent_fds) / sizeof(int)) {
        cli_err("too many nodes");
        return -1;
    }
    if (pipe(cmd) != 0)
        goto err;
    if (pipe(rep) != 0) {
        close(cmd[0]);
        close(cmd[1]);
        goto err;
    }
    if (threaded) {
        n->thr = calloc(1, sizeof(*n->thr));
        if (n->thr == NULL)
            goto err_pipes;
        n->thr->fn = fn;
        n->thr->arg = arg;
        n->thr->in_fd = cmd[0];
        n->thr->out_fd = rep[1];
        if (pthread_create(&n->thr->tid, NULL, cm_node_thread, n->thr) != 0) {
            free(n->thr);
            n->thr = NULL;
            goto err_pipes;
        }
        n->threaded = true;
    } else {
        fflush(NULL); /* the child must not write our buffered output */
        n->pid = fork();
        if (n->pid < 0)
            goto err_pipes;
        if (n->pid == 0) {
            for (size_t i = 0; i < cm_nparent_fds; i++)
                close(cm_parent_fds[i]);
            close(cmd[1]);
            close(rep[0]);
            int rc = fn(arg, cmd[0], rep[1]);
            close(cmd[0]);
            close(rep[1]);
            fflush(NULL);
            exit(rc);
        }
        close(cmd[0]);
        close(rep[1]);
    }
    n->cmd_fd = cmd[1];
    n->rep_fd = rep[0];
    cm_parent_fds[cm_nparent_fds++] = n->cmd_fd;
    cm_parent_fds[cm_nparent_fds++] = n->rep_fd;
    return 0;
err_pipes:
    close(cmd[0]);
    close(cmd[1]);
    close(rep[0]);
    close(rep[1]);
err:
    cli_err("cannot start the %s node: %s", name, strerror(errno));
    return -1;
}

int
cli_node_wait(cli_node *n, int timeout_ms)
{
    struct pollfd pfd = {.fd = n->rep_fd, .events = POLLIN};
    int64_t deadline = cli_now_ns() + (int64_t)timeout_ms * 1000000;

    for (;;) {
        int left = -1;
        if (timeout_ms >= 0) {
            int64_t ns = deadline - cli_now_ns();
            if (ns <= 0)
                return 0;
            left = (int)((ns + 999999) / 1000000);
        }
        int k = poll(&pfd, 1, left);
        if (k > 0)
            return 1;
        if (k < 0 && errno != EINTR)
            return 1; /* the read that follows reports the error */
    }
}

void
cli_node_kill(cli_node *n)
{
    if (n->threaded) {
        n->abandoned = true;
        return;
    }
    if (n->pid > 0) {
        kill(n->pid, SIGKILL);
        while (waitpid(n->pid, NULL, 0) < 0 && errno == EINTR)
            ;
        n->pid = 0;
    }
}

int
cli_node_stop(cli_node *n)
{
    int rc = 0;

    if (n->cmd_fd < 0 && n->rep_fd < 0)
        return 0;
    if (n->abandoned) {
        /* Its thread may still use the pipes: leave them to exit(). */
        n->cmd_fd = n->rep_fd = -1;
        return -1;
    }
    if (n->cmd_fd >= 0) {
        cm_forget_fd(n->cmd_fd);
        close(n->cmd_fd);
        n->cmd_fd = -1;
    }
    if (n->threaded) {
        pthread_join(n->thr->tid, NULL);
        rc = n->thr->rc;
        free(n->thr);
        n->thr = NULL;
    } else if (n->pid == 0) {
        rc = -1; /* killed by cli_node_kill */
    } else {
        int status;
        while (waitpid(n->pid, &status, 0) < 0 && errno == EINTR)
            ;
        if (WIFEXITED(status)) {
            rc = WEXITSTATUS(status);
        } else {
            cli_err("the %s process died of signal %d (%s)", n->name,
                    WTERMSIG(status), strsignal(WTERMSIG(status)));
            rc = -1;
        }
        n->pid = 0;
    }
    if (n->rep_fd >= 0) {
        cm_forget_fd(n->rep_fd);
        close(n->rep_fd);
        n->rep_fd = -1;
    }
    return rc;
}

static int
cm_write_full(int fd, const void *p, size_t len)
{
    const uint8_t *b = p;

    while (len > 0) {
        ssize_t k = write(fd, b, len);
        if (k < 0 && errno == EINTR)
            continue;
        if (k <= 0)
            return -1;
        b += k;
        len -= (size_t)k;
    }
    return 0;
}

static int
cm_read_full(int fd, void *p, size_t len)
{
    uint8_t *b = p;

    while (len > 0) {
        ssize_t k = read(fd, b, len);
        if (k < 0 && errno == EINTR)
            continue;
        if (k <= 0)
            return -1;
        b += k;
        len -= (size_t)k;
    }
    return 0;
}

int
cli_msg_send(int fd, uint32_t type, const void *a, size_t alen, const void *b,
             size_t blen)
{
    cli_msg_hdr h = {.type = type, .len = alen + blen};

    if (h.len > CLI_MSG_MAX)
        return -1;
    if (cm_write_full(fd, &h, sizeof(h)) != 0 ||
        (alen > 0 && cm_write_full(fd, a, alen) != 0) ||
        (blen > 0 && cm_write_full(fd, b, blen) != 0))
        return -1;
    return 0;
}

int
cli_msg_recv(int fd, uint32_t *type, void **payload, size_t *len)
{
    cli_msg_hdr h;
    void *p = NULL;

    if (cm_read_full(fd, &h, sizeof(h)) != 0 || h.len > CLI_MSG_MAX)
        return -1;
    if (h.len > 0) {
        p = malloc(h.len);
        if (p == NULL || cm_read_full(fd, p, h.len) != 0) {
            free(p);
            return -1;
        }
    }
    *type = h.type;
    *payload = p;
    *len = h.len;
    return 0;
}
