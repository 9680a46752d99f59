/*
 * Argument parsing of the llmdd tool and the library options every
 * node-running subcommand shares; see common.h.
 */
#include "common.h"

#include <arpa/inet.h>
#include <errno.h>
#include <inttypes.h>
#include <netdb.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

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

/*
 * A host name ("localhost", "prefill-0") in place of an address: its first
 * address, IPv4 before IPv6, written back as numbers (the library takes
 * numeric addresses only).
 */
static bool
resolve_name(char *name, size_t cap)
{
    struct addrinfo hints = {.ai_socktype = SOCK_STREAM}, *ai, *pick = NULL;

    if (getaddrinfo(name, NULL, &hints, &ai) != 0)
        return false;
    for (struct addrinfo *a = ai; a != NULL; a = a->ai_next)
        if (pick == NULL ||
            (a->ai_family == AF_INET && pick->ai_family != AF_INET))
            pick = a;
    bool ok = pick != NULL &&
              getnameinfo(pick->ai_addr, pick->ai_addrlen, name, (socklen_t)cap,
                          NULL, 0, NI_NUMERICHOST) == 0;
    freeaddrinfo(ai);
    return ok;
}

bool
cli_parse_hostport(const char *s, uint32_t min_port, char *ip, size_t cap,
                   uint16_t *port)
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
        if (inet_pton(AF_INET, addr, tmp) != 1 &&
            !resolve_name(addr, sizeof(addr)))
            return false;
        n = strlen(addr);
        p = colon + 1;
    }
    if (!cli_parse_u32(p, min_port, 65535, &v) || n >= cap)
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

/* "a, b or c" (last " or ") or "a, b, c" (last ", "). */
static const char *
ca_join(char *buf, size_t cap, const char *const *names, size_t n,
        const char *last)
{
    size_t len = 0;

    buf[0] = '\0';
    for (size_t i = 0; i < n && len < cap; i++)
        len += (size_t)snprintf(buf + len, cap - len, "%s%s",
                                i == 0       ? ""
                                : i + 1 == n ? last
                                             : ", ",
                                names[i]);
    return buf;
}

int
cli_parse_choice(const char *flag, const char *s, const char *const *names,
                 size_t n, int *out)
{
    char list[256];

    for (size_t i = 0; i < n; i++) {
        if (strcmp(s, names[i]) == 0) {
            *out = (int)i;
            return 0;
        }
    }
    return cli_usage_err("%s: \"%s\" is not %s", flag, s,
                         ca_join(list, sizeof(list), names, n, " or "));
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

const cli_transport cli_transports[] = {
    {"loop", "both instances in one process: a bounds-checked memcpy"},
    {"shm", "processes on one host: shared memory"},
    {"ucx", "UCX (RDMA, shared memory, TCP, as UCX finds them)"},
    {"tcp", "processes or hosts: one-sided reads and writes over TCP"},
};
const size_t cli_ntransports =
    sizeof(cli_transports) / sizeof(cli_transports[0]);

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

int
cli_peer_args_check(const cli_lib_opts *lo, const cli_shape *shape)
{
    if (strcmp(lo->transport, "loop") == 0)
        return cli_usage_err("--transport loop only reaches an instance in "
                             "the same process; `llmdd demo --transport "
                             "loop` shows it");
    return cli_shape_check(shape) ? 0 : CLI_EXIT_USAGE;
}

bool
cli_set_transport(cli_lib_opts *lo, const char *name)
{
    char list[64] = "auto";
    size_t len = strlen(list);
    bool ok = strcmp(name, "auto") == 0;

    for (size_t i = 0; i < cli_ntransports; i++) {
        ok = ok || strcmp(name, cli_transports[i].name) == 0;
        if (len < sizeof(list))
            len += (size_t)snprintf(list + len, sizeof(list) - len, ", %s",
                                    cli_transports[i].name);
    }
    if (!ok) {
        cli_err("unknown transport \"%s\" (%s)", name, list);
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
    opts[n++] = (llmdd_option){CLI_WAIT_KEY, CLI_WAIT_MS};
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
    llmdd_cluster_info ci = cm_cluster(cluster_id, &ipi, ip ? ip : "", port);
    llmdd_status rets[1] = {LLM_FAILED};

    if (ip == NULL) { /* by cluster id: looked up (llm.MetadataServer) */
        ci.remote_ip_infos = NULL;
        ci.num_remote_ip_infos = 0;
    }
    llmdd_status st = llmdd_link_clusters(dd, &ci, 1, rets, timeout_ms);

    char a[LLMDD_IP_LEN + 16];

    if (st != LLM_SUCCESS)
        cli_fmt_st(err, cap, rets[0] != LLM_SUCCESS ? rets[0] : st,
                   "llmdd_link_clusters(cluster %" PRIu64 " at %s)", cluster_id,
                   ip ? cli_fmt_addr(a, sizeof(a), ip, port)
                      : "the address the metadata server has");
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

/* ---- The command line. ---- */

#define CA_MAX_LONGOPTS 64

static const struct option ca_lib_longopts[] = {
    {"transport", required_argument, NULL, 't'},
    {"option", required_argument, NULL, 'o'},
    {"metadata", required_argument, NULL, CLI_OPT_METADATA},
    {"metadata-prefix", required_argument, NULL, CLI_OPT_METADATA_PREFIX},
};
static const struct option ca_shape_longopts[] = {CLI_SHAPE_LONGOPTS};
static const struct option ca_seed_longopt = {"seed", required_argument, NULL,
                                              CLI_OPT_SEED};
static const struct option ca_timeout_longopt = {"timeout", required_argument,
                                                 NULL, CLI_OPT_TIMEOUT};
static const struct option ca_help_longopt = {"help", no_argument, NULL, 'h'};

/* Whether opt is a shared option `a` takes; if so *rc is 0 once applied,
 * else an exit code after a message. */
static bool
ca_shared(const cli_args *a, int opt, const char *arg, int *rc)
{
    uint32_t v;
    int k;

    *rc = 0;
    switch (opt) {
    case 't':
        if (a->lo == NULL)
            return false;
        if (!cli_set_transport(a->lo, arg))
            *rc = CLI_EXIT_USAGE;
        else if (a->transport_set != NULL)
            *a->transport_set = true;
        return true;
    case 'o':
        if (a->lo == NULL)
            return false;
        if (!cli_add_option(a->lo, arg))
            *rc = cli_usage_err("-o wants KEY=VALUE, got \"%s\"", arg);
        return true;
    case CLI_OPT_METADATA:
    case CLI_OPT_METADATA_PREFIX: {
        char kv[1200];
        bool server = opt == CLI_OPT_METADATA;
        if (a->lo == NULL)
            return false;
        if (strlen(arg) >= sizeof(a->lo->metadata)) {
            *rc = cli_usage_err("--metadata: too long");
            return true;
        }
        snprintf(kv, sizeof(kv), "%s=%s",
                 server ? "llm.MetadataServer" : "llm.MetadataPrefix", arg);
        if (server)
            snprintf(a->lo->metadata, sizeof(a->lo->metadata), "%s", arg);
        if (!cli_add_option(a->lo, kv))
            *rc = cli_usage_err("too many options");
        return true;
    }
    case CLI_OPT_SEED:
        if (a->seed == NULL)
            return false;
        if (!cli_parse_u32(arg, 0, UINT32_MAX, a->seed))
            *rc = cli_usage_err("--seed: bad number \"%s\"", arg);
        return true;
    case CLI_OPT_TIMEOUT:
        if (a->timeout_ms == NULL)
            return false;
        if (!cli_parse_u32(arg, 1, 3600000, &v))
            *rc = cli_usage_err("--timeout: bad milliseconds \"%s\"", arg);
        else
            *a->timeout_ms = (int)v;
        return true;
    default:
        if (a->shape == NULL)
            return false;
        k = cli_shape_opt(a->shape, opt == 'm' ? CLI_OPT_MODEL : opt, arg);
        if (k < 0)
            *rc = CLI_EXIT_USAGE;
        return k != 0;
    }
}

int
cli_args_parse(const cli_args *a, const struct option *own, const char *shorts,
               cli_own_fn own_fn, void *ctx, int argc, char **argv)
{
    struct option longopts[CA_MAX_LONGOPTS];
    char shortopts[64] = "h";
    size_t n = 0;
    int opt, rc;

    /* The subcommand's own options come first: pull's --layers is a
     * range, not the shape's count that demo and serve take. */
    for (; own != NULL && own[n].name != NULL; n++) {
        if (n + 16 > CA_MAX_LONGOPTS) {
            cli_err("internal error: too many options");
            return CLI_EXIT_FAIL;
        }
        longopts[n] = own[n];
    }
    longopts[n++] = ca_help_longopt;
    if (a->lo != NULL) {
        memcpy(longopts + n, ca_lib_longopts, sizeof(ca_lib_longopts));
        n += sizeof(ca_lib_longopts) / sizeof(ca_lib_longopts[0]);
        strcat(shortopts, "t:o:");
    }
    if (a->shape != NULL) {
        memcpy(longopts + n, ca_shape_longopts, sizeof(ca_shape_longopts));
        n += sizeof(ca_shape_longopts) / sizeof(ca_shape_longopts[0]);
        strcat(shortopts, "m:");
    }
    if (a->seed != NULL)
        longopts[n++] = ca_seed_longopt;
    if (a->timeout_ms != NULL)
        longopts[n++] = ca_timeout_longopt;
    longopts[n] = (struct option){NULL, 0, NULL, 0};
    if (shorts != NULL)
        strncat(shortopts, shorts, sizeof(shortopts) - strlen(shortopts) - 1);

    while ((opt = getopt_long(argc, argv, shortopts, longopts, NULL)) != -1) {
        if (opt == 'h') {
            fputs(a->usage, stdout);
            return -1;
        }
        if (ca_shared(a, opt, optarg, &rc)) {
            if (rc != 0)
                return rc;
            continue;
        }
        /* '?': getopt_long has said what is wrong. */
        if (opt == '?' || opt == ':' || own_fn == NULL)
            return cli_usage_err("bad option");
        if ((rc = own_fn(ctx, opt, optarg)) != 0)
            return rc;
    }
    if (optind < argc)
        return cli_usage_err("unexpected argument \"%s\"", argv[optind]);
    return 0;
}
