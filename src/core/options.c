#include "core/options.h"

#include <arpa/inet.h>
#include <cjson/cJSON.h>
#include <math.h>
#include <stdatomic.h>
#include <netinet/in.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>

#include "base/log.h"
#include "base/wire.h"
#include "transport/transport.h"

#define POOL_SHIFT_MIN 12
#define POOL_SHIFT_MAX 30
#define POOL_SHIFT_DEFAULT 16
#define POOL_SIZE_MAX (1ull << 46)

uint32_t
llmdd__max_links_auto(int tcp_lanes)
{
    struct rlimit rl;
    uint64_t n = 1024;
    /* N lanes: the control connection, N + 1 data connections each way,
     * shm's socket; at least the 8 of the default two each way. */
    uint64_t lanes =
        tcp_lanes > 0 ? (uint64_t)tcp_lanes : LLMDD__TCP_LANES_AUTO;
    uint64_t per = 2 * lanes + 4 > 8 ? 2 * lanes + 4 : 8;

    if (getrlimit(RLIMIT_NOFILE, &rl) == 0 && rl.rlim_cur != RLIM_INFINITY)
        n = rl.rlim_cur > 64 ? (rl.rlim_cur - 64) / per : 0;
    return n < 16 ? 16 : n > 1024 ? 1024 : (uint32_t)n;
}

/* 0 stands for auto until the lanes are known (options_resolve). */
static llmdd_status
parse_max_links(const char *s, uint32_t *out)
{
    uint32_t v;

    if (s != NULL && strcmp(s, "auto") == 0) {
        *out = 0;
        return LLM_SUCCESS;
    }
    if (llmdd__parse_u32(s, &v) != LLM_SUCCESS || v == 0 ||
        v > LLMDD_MAX_LINKS_MAX)
        return LLM_PARAM_INVALID;
    *out = v;
    return LLM_SUCCESS;
}

void
llmdd__options_fini(llmdd__options *o)
{
    free(o->auth_token);
    o->auth_token = NULL;
    free(o->meta_server);
    o->meta_server = NULL;
}

static bool
all_digits(const char *s, size_t max_len)
{
    size_t n = 0;

    if (*s == '\0')
        return false;
    for (; *s != '\0'; s++, n++)
        if (*s < '0' || *s > '9' || n >= max_len)
            return false;
    return true;
}

/* A listening port 0..65535; 0 (written "0") lets the kernel pick one. */
static llmdd_status
parse_port(const char *s, uint16_t *out)
{
    if (!all_digits(s, 5))
        return LLM_PARAM_INVALID;
    unsigned long v = strtoul(s, NULL, 10);
    if (v > 65535 || (v == 0 && strcmp(s, "0") != 0))
        return LLM_PARAM_INVALID;
    *out = (uint16_t)v;
    return LLM_SUCCESS;
}

static llmdd_status
make_addr(const char *ip, uint16_t port, llmdd__sockaddr *out)
{
    llmdd__sockaddr a;

    memset(&a, 0, sizeof(a));
    struct sockaddr_in *v4 = (struct sockaddr_in *)&a.addr;
    struct sockaddr_in6 *v6 = (struct sockaddr_in6 *)&a.addr;
    if (inet_pton(AF_INET, ip, &v4->sin_addr) == 1) {
        v4->sin_family = AF_INET;
        v4->sin_port = htons(port);
        a.len = sizeof(*v4);
    } else if (inet_pton(AF_INET6, ip, &v6->sin6_addr) == 1) {
        v6->sin6_family = AF_INET6;
        v6->sin6_port = htons(port);
        a.len = sizeof(*v6);
    } else {
        return LLM_PARAM_INVALID;
    }
    *out = a;
    return LLM_SUCCESS;
}

llmdd_status
llmdd__parse_listen(const char *s, llmdd__sockaddr *out)
{
    char ip[LLMDD_IP_LEN];
    const char *port;
    size_t iplen;
    uint16_t p;

    if (s == NULL)
        return LLM_PARAM_INVALID;
    if (s[0] == '[') {
        const char *close = strchr(s, ']');
        if (close == NULL || close[1] != ':')
            return LLM_PARAM_INVALID;
        iplen = (size_t)(close - s - 1);
        if (iplen == 0 || iplen >= sizeof(ip))
            return LLM_PARAM_INVALID;
        memcpy(ip, s + 1, iplen);
        ip[iplen] = '\0';
        port = close + 2;
        struct in6_addr tmp;
        if (inet_pton(AF_INET6, ip, &tmp) != 1)
            return LLM_PARAM_INVALID;
    } else {
        const char *colon = strrchr(s, ':');
        if (colon == NULL || memchr(s, ':', (size_t)(colon - s)) != NULL)
            return LLM_PARAM_INVALID;
        iplen = (size_t)(colon - s);
        if (iplen == 0 || iplen >= sizeof(ip))
            return LLM_PARAM_INVALID;
        memcpy(ip, s, iplen);
        ip[iplen] = '\0';
        port = colon + 1;
        struct in_addr tmp;
        if (inet_pton(AF_INET, ip, &tmp) != 1)
            return LLM_PARAM_INVALID;
    }
    if (parse_port(port, &p) != LLM_SUCCESS)
        return LLM_PARAM_INVALID;
    return make_addr(ip, p, out);
}

llmdd_status
llmdd__parse_ip_info(const llmdd_ip_info *info, llmdd__sockaddr *out)
{
    if (info == NULL || info->port == 0 ||
        memchr(info->ip, '\0', sizeof(info->ip)) == NULL)
        return LLM_PARAM_INVALID;
    return make_addr(info->ip, info->port, out);
}

llmdd_status
llmdd__parse_u32(const char *s, uint32_t *out)
{
    if (s == NULL || !all_digits(s, 10))
        return LLM_PARAM_INVALID;
    unsigned long long v = strtoull(s, NULL, 10);
    if (v > UINT32_MAX)
        return LLM_PARAM_INVALID;
    *out = (uint32_t)v;
    return LLM_SUCCESS;
}

llmdd_status
llmdd__parse_wait_time(const char *s, uint32_t *ms_out)
{
    uint32_t v;

    if (llmdd__parse_u32(s, &v) != LLM_SUCCESS || v == 0 ||
        v > LLMDD_MAX_WAIT_MS)
        return LLM_PARAM_INVALID;
    *ms_out = v;
    return LLM_SUCCESS;
}

/* A JSON number that is a non-negative integer no larger than max. */
static bool
json_uint(const cJSON *item, double max, uint64_t *out)
{
    if (!cJSON_IsNumber(item))
        return false;
    double v = item->valuedouble;
    if (!(v >= 0 && v <= max) || floor(v) != v)
        return false;
    *out = (uint64_t)v;
    return true;
}

llmdd_status
llmdd__parse_pool(const char *s, llmdd__pool_config *out)
{
    llmdd_status st = LLM_PARAM_INVALID;
    uint64_t size, shift = POOL_SHIFT_DEFAULT;
    cJSON *root;

    if (s == NULL)
        return LLM_PARAM_INVALID;
    root = cJSON_Parse(s);
    if (!cJSON_IsObject(root))
        goto out;
    const cJSON *jsize = cJSON_GetObjectItemCaseSensitive(root, "memory_size");
    const cJSON *jshift = cJSON_GetObjectItemCaseSensitive(root, "page_shift");
    if (!json_uint(jsize, (double)POOL_SIZE_MAX, &size) || size == 0)
        goto out;
    if (jshift != NULL && !json_uint(jshift, POOL_SHIFT_MAX, &shift))
        goto out;
    if (shift < POOL_SHIFT_MIN)
        goto out;
    /* The pool is whole pages: round the size up to one. */
    uint64_t page = 1ull << shift;
    out->memory_size = (size + page - 1) & ~(page - 1);
    out->page_shift = (uint32_t)shift;
    st = LLM_SUCCESS;
out:
    cJSON_Delete(root);
    return st;
}

static llmdd_status
parse_transport(const char *s, char *out)
{
    if (s == NULL || strlen(s) >= LLMDD_TRANSPORT_NAME_MAX)
        return LLM_PARAM_INVALID;
    if (strcmp(s, "auto") != 0 && !llmdd__transport_known(s))
        return LLM_PARAM_INVALID;
    strcpy(out, s);
    return LLM_SUCCESS;
}

/* ---- The table of keys. ---- */

/* The options being applied: a copy, so that a bad value changes nothing. */
typedef struct {
    llmdd__options o;
    const char *token; /* llm.AuthToken, copied once every value is good */
    const char *meta_server; /* llm.MetadataServer, likewise */
} opt_apply;

static llmdd_status
opt_listen(opt_apply *a, const char *v)
{
    a->o.listen = true;
    return llmdd__parse_listen(v, &a->o.listen_addr);
}

static llmdd_status
opt_device_id(opt_apply *a, const char *v)
{
    uint32_t id;

    if (llmdd__parse_u32(v, &id) != LLM_SUCCESS || id > INT32_MAX)
        return LLM_PARAM_INVALID;
    a->o.device_id = id;
    return LLM_SUCCESS;
}

static llmdd_status
opt_wait_time(opt_apply *a, const char *v)
{
    return llmdd__parse_wait_time(v, &a->o.wait_ms);
}

static llmdd_status
opt_host_pool(opt_apply *a, const char *v)
{
    a->o.host_pool = true;
    return llmdd__parse_pool(v, &a->o.host_pool_config);
}

static llmdd_status
opt_device_pool(opt_apply *a, const char *v)
{
    a->o.device_pool = true;
    return llmdd__parse_pool(v, &a->o.device_pool_config);
}

static llmdd_status
opt_transport(opt_apply *a, const char *v)
{
    return parse_transport(v, a->o.transport);
}

static llmdd_status
opt_auth_token(opt_apply *a, const char *v)
{
    size_t len = strlen(v);

    if (len == 0 || len > LLMDD_AUTH_TOKEN_MAX)
        return LLM_PARAM_INVALID;
    a->token = v;
    return LLM_SUCCESS;
}

static llmdd_status
opt_max_links(opt_apply *a, const char *v)
{
    a->o.max_links_auto = strcmp(v, "auto") == 0;
    return parse_max_links(v, &a->o.max_links);
}

static llmdd_status
opt_tcp_lanes(opt_apply *a, const char *v)
{
    uint32_t n;

    if (strcmp(v, "auto") == 0) {
        a->o.tcp_lanes = 0;
        return LLM_SUCCESS;
    }
    if (llmdd__parse_u32(v, &n) != LLM_SUCCESS || n == 0 ||
        n > LLMDD_TCP_LANES_MAX)
        return LLM_PARAM_INVALID;
    a->o.tcp_lanes = (int)n;
    return LLM_SUCCESS;
}

static llmdd_status
opt_hb_interval(opt_apply *a, const char *v)
{
    uint32_t ms;

    if (llmdd__parse_u32(v, &ms) != LLM_SUCCESS ||
        (ms != 0 && (ms < LLMDD_WIRE_HB_MIN_MS || ms > LLMDD_WIRE_HB_MAX_MS)))
        return LLM_PARAM_INVALID;
    a->o.hb_ms = ms;
    return LLM_SUCCESS;
}

static llmdd_status
opt_hb_misses(opt_apply *a, const char *v)
{
    uint32_t n;

    if (llmdd__parse_u32(v, &n) != LLM_SUCCESS || n < 1 ||
        n > LLMDD_HB_MISSES_MAX)
        return LLM_PARAM_INVALID;
    a->o.hb_misses = n;
    return LLM_SUCCESS;
}

static llmdd_status
opt_meta_server(opt_apply *a, const char *v)
{
    if (llmdd__meta_server_parse(v, NULL, NULL) != LLM_SUCCESS)
        return LLM_PARAM_INVALID;
    a->meta_server = v;
    return LLM_SUCCESS;
}

static llmdd_status
opt_meta_prefix(opt_apply *a, const char *v)
{
    if (!llmdd__meta_prefix_valid(v))
        return LLM_PARAM_INVALID;
    strcpy(a->o.meta_prefix, v);
    return LLM_SUCCESS;
}

static llmdd_status
opt_meta_lease(opt_apply *a, const char *v)
{
    uint32_t ms;

    if (llmdd__parse_u32(v, &ms) != LLM_SUCCESS ||
        ms < LLMDD_META_LEASE_MIN_MS || ms > LLMDD_META_LEASE_MAX_MS)
        return LLM_PARAM_INVALID;
    a->o.meta_lease_ms = ms;
    return LLM_SUCCESS;
}

uint32_t
llmdd__user_timeout_ms(const llmdd__options *o)
{
    return o->hb_ms > 0 ? o->hb_ms * (o->hb_misses + 1) : o->wait_ms;
}

#define OPT_ASCEND                                                             \
    "LLM-DataDist's Ascend option, accepted without effect here: "

/*
 * Every key llmdd_initialize knows: what it takes, its default (a value its
 * parser takes, which llmdd__options_init applies, or NULL for unset) and
 * what it does. A NULL parser is a reference key that means nothing here:
 * accepted, logged once per process. `llmdd info` prints this table.
 */
static const struct {
    llmdd_option_doc doc;
    llmdd_status (*parse)(opt_apply *a, const char *v);
} opt_table[] = {
    {{LLMDD_OPT_LISTEN, "IP:PORT or [IPv6]:PORT; port 0 lets the kernel pick",
      NULL, "not listening", "listen there for links (the prompt side)"},
     opt_listen},
    /* The reference's V0-era spelling (its LLMConfig still produces it);
     * whichever of the two comes last wins. */
    {{"llm.listenIpInfo", "same as " LLMDD_OPT_LISTEN, NULL, "not listening",
      "the reference's older spelling of " LLMDD_OPT_LISTEN},
     opt_listen},
    {{LLMDD_OPT_DEVICE_ID, "integer 0..2147483647", "0", "0",
      "device for caches with device placement"},
     opt_device_id},
    {{LLMDD_OPT_WAIT_TIME, "milliseconds 1..86400000", "1000", "1000",
      "every transfer returns within it (LLM_TIMEOUT past it)"},
     opt_wait_time},
    {{LLMDD_OPT_HOST_POOL, "{\"memory_size\": N, \"page_shift\": S}", NULL,
      "no pool",
      "llmdd_allocate_cache takes host memory from one pool of N bytes in "
      "pages of 2^S (S 12..30, default 16)"},
     opt_host_pool},
    {{LLMDD_OPT_DEVICE_POOL, "same as " LLMDD_OPT_HOST_POOL, NULL, "no pool",
      "the same for device memory"},
     opt_device_pool},
    {{LLMDD_OPT_TRANSPORT, "auto, or a name llmdd_transport_list() lists",
      "auto", "auto",
      "auto takes the first built-in transport (in llmdd_transport_list()'s "
      "order) that reaches the peer; a named one must reach it or the link "
      "fails"},
     opt_transport},
    {{LLMDD_OPT_AUTH_TOKEN, "a secret, 1..1024 bytes", NULL, "none",
      "peers with a different token cannot link (HMAC challenge; the token "
      "never crosses the wire)"},
     opt_auth_token},
    {{LLMDD_OPT_MAX_LINKS, "auto or 1..65535", "auto", "auto",
      "links a listening instance serves at once; more are refused with "
      "LLM_CLUSTER_NUM_EXCEED_LIMIT (auto: (fd limit - 64) / the fds a "
      "link holds with llm.TcpLanes = N, 2N + 4 and at least 8, N = 4 for "
      "auto; 16..1024)"},
     opt_max_links},
    {{LLMDD_OPT_TCP_LANES, "auto or 1..16", "auto", "auto",
      "TCP connections each tcp link stripes its transfers over (auto: the "
      "transport picks)"},
     opt_tcp_lanes},
    {{LLMDD_OPT_HB_INTERVAL, "milliseconds 100..60000, or 0", "1000", "1000",
      "the control thread sends a heartbeat when it sent nothing for this "
      "long (0: none; announced to each peer when linking)"},
     opt_hb_interval},
    {{LLMDD_OPT_HB_MISSES, "1..100", "3", "3",
      "a peer silent for its announced interval times this is dead: its "
      "link is dropped"},
     opt_hb_misses},
    {{LLMDD_OPT_META_SERVER, "etcd://HOST:PORT[,HOST:PORT...] (up to 8)", NULL,
      "none",
      "discovery through etcd's v3 JSON gateway: a listening instance "
      "publishes itself under the prefix with a lease it keeps alive, a "
      "cluster given without addresses is looked up there, and a peer whose "
      "entry is deleted or expires loses its link"},
     opt_meta_server},
    {{LLMDD_OPT_META_PREFIX, "1..64 of [A-Za-z0-9._/-]", "llmdd", "llmdd",
      "the key prefix: entries are PREFIX/clusters/CLUSTER_ID"},
     opt_meta_prefix},
    {{LLMDD_OPT_META_LEASE, "milliseconds 1000..3600000", "10000", "10000",
      "the entry's lease, rounded up to whole seconds (the server's TTL is "
      "logged); a dead instance's entry goes after it"},
     opt_meta_lease},
    {{"llm.BufPoolCfg", "any", NULL, "-",
      OPT_ASCEND "the transfer buffer pool is Ascend's"},
     NULL},
    {{"llm.EnableSwitchRole", "any", NULL, "-",
      OPT_ASCEND "set_role is always allowed"},
     NULL},
    {{"llm.LocalCommRes", "any", NULL, "-",
      OPT_ASCEND "there is no HCCL communication resource"},
     NULL},
    {{"llm.TransferBackend", "any", NULL, "-",
      OPT_ASCEND "llm.Transport picks the transport"},
     NULL},
    {{"llm.deployResPath", "any", NULL, "-",
      OPT_ASCEND "there is no deployment resource file"},
     NULL},
    {{"llm.ClusterInfo", "any", NULL, "-",
      OPT_ASCEND "the offline cluster description; links are made by "
                 "llmdd_link_clusters"},
     NULL},
    {{"llm.OutputMaxSize", "any", NULL, "-",
      OPT_ASCEND "there is no model output"},
     NULL},
    {{"llm.LinkTotalTime", "any", NULL, "-",
      OPT_ASCEND "llmdd_link_clusters' timeout_ms bounds a link"},
     NULL},
    {{"llm.LinkRetryCount", "any", NULL, "-",
      OPT_ASCEND "a link is tried once; callers retry a retryable status"},
     NULL},
    {{"llm.RdmaTrafficClass", "any", NULL, "-",
      OPT_ASCEND "there is no RoCE traffic class"},
     NULL},
    {{"llm.RdmaServiceLevel", "any", NULL, "-",
      OPT_ASCEND "there is no RoCE service level"},
     NULL},
    {{"llm.GlobalResourceConfig", "any", NULL, "-",
      OPT_ASCEND "there are no HCCL global resources"},
     NULL},
};

#define OPT_N (sizeof(opt_table) / sizeof(opt_table[0]))

const llmdd_option_doc *
llmdd_option_info(size_t index)
{
    return index < OPT_N ? &opt_table[index].doc : NULL;
}

/* What depends on several keys, once all are applied. */
static void
options_resolve(opt_apply *a)
{
    if (a->o.max_links_auto)
        a->o.max_links = llmdd__max_links_auto(a->o.tcp_lanes);
}

void
llmdd__options_init(llmdd__options *o)
{
    opt_apply a;

    memset(&a, 0, sizeof(a));
    /* The table's defaults parse (tests/unit/options_test.c checks it). */
    for (size_t i = 0; i < OPT_N; i++)
        if (opt_table[i].parse != NULL &&
            opt_table[i].doc.default_value != NULL)
            (void)opt_table[i].parse(&a, opt_table[i].doc.default_value);
    options_resolve(&a);
    *o = a.o;
}

llmdd_status
llmdd__options_apply(llmdd__options *o, const llmdd_option *options, size_t n)
{
    static atomic_bool logged[OPT_N];
    opt_apply a = {.o = *o, .token = NULL, .meta_server = NULL};
    llmdd_status st;

    if (n > 0 && options == NULL)
        return LLM_PARAM_INVALID;
    for (size_t i = 0; i < n; i++) {
        const char *k = options[i].key, *v = options[i].value;
        size_t r = 0;

        if (k == NULL || v == NULL) {
            log_error("option %zu has a NULL key or value", i);
            return LLM_PARAM_INVALID;
        }
        while (r < OPT_N && strcmp(k, opt_table[r].doc.key) != 0)
            r++;
        if (r == OPT_N) {
            log_warn("unknown option \"%s\" ignored", k);
        } else if (opt_table[r].parse == NULL) {
            if (!atomic_exchange(&logged[r], true))
                log_info("option %s: %s", k, opt_table[r].doc.meaning);
        } else if ((st = opt_table[r].parse(&a, v)) != LLM_SUCCESS) {
            /* Never log the token itself. */
            log_error("option %s: invalid value \"%s\"", k,
                      strcmp(k, LLMDD_OPT_AUTH_TOKEN) == 0 ? "..." : v);
            return st;
        }
    }
    options_resolve(&a);
    char *server = a.meta_server != NULL ? strdup(a.meta_server) : NULL;
    char *token = a.token != NULL ? strdup(a.token) : NULL;
    if ((a.meta_server != NULL && server == NULL) ||
        (a.token != NULL && token == NULL)) {
        free(server);
        free(token);
        return LLM_OUT_OF_MEMORY;
    }
    if (server != NULL) {
        free(o->meta_server);
        a.o.meta_server = server;
    }
    if (token != NULL) {
        free(o->auth_token);
        a.o.auth_token = token;
    }
    *o = a.o;
    return LLM_SUCCESS;
}
