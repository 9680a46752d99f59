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

#include "core/log.h"
#include "transport/transport.h"

#define POOL_SHIFT_MIN 12
#define POOL_SHIFT_MAX 30
#define POOL_SHIFT_DEFAULT 16
#define POOL_SIZE_MAX (1ull << 46)

void
llmdd__options_init(llmdd__options *o)
{
    memset(o, 0, sizeof(*o));
    o->wait_ms = LLMDD_DEFAULT_WAIT_MS;
    strcpy(o->transport, "auto");
    o->max_links = llmdd__max_links_auto();
}

uint32_t
llmdd__max_links_auto(void)
{
    struct rlimit rl;
    uint64_t n = 1024;

    if (getrlimit(RLIMIT_NOFILE, &rl) == 0 && rl.rlim_cur != RLIM_INFINITY)
        n = rl.rlim_cur > 64 ? (rl.rlim_cur - 64) / 8 : 0;
    return n < 16 ? 16 : n > 1024 ? 1024 : (uint32_t)n;
}

static llmdd_status
parse_max_links(const char *s, uint32_t *out)
{
    uint32_t v;

    if (s != NULL && strcmp(s, "auto") == 0) {
        *out = llmdd__max_links_auto();
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

/* A reference key that means nothing here: logs why, once per process. */
static bool
ignored_key(const char *k)
{
#define IGNORED(key, why) {key, why},
    static const struct {
        const char *key, *why;
    } keys[] = {LLMDD_OPT_IGNORED_MAP(IGNORED)};
#undef IGNORED
    static atomic_bool logged[sizeof(keys) / sizeof(keys[0])];

    for (size_t i = 0; i < sizeof(keys) / sizeof(keys[0]); i++) {
        if (strcmp(k, keys[i].key) == 0) {
            if (!atomic_exchange(&logged[i], true))
                log_info("option %s accepted without effect: %s", k,
                         keys[i].why);
            return true;
        }
    }
    return false;
}

llmdd_status
llmdd__options_apply(llmdd__options *o, const llmdd_option *options, size_t n)
{
    llmdd__options t = *o;
    const char *token = NULL;
    bool set_token = false;

    if (n > 0 && options == NULL)
        return LLM_PARAM_INVALID;
    for (size_t i = 0; i < n; i++) {
        const char *k = options[i].key, *v = options[i].value;
        llmdd_status st = LLM_SUCCESS;

        if (k == NULL || v == NULL) {
            log_error("option %zu has a NULL key or value", i);
            return LLM_PARAM_INVALID;
        }
        if (strcmp(k, LLMDD_OPT_LISTEN) == 0) {
            st = llmdd__parse_listen(v, &t.listen_addr);
            t.listen = true;
        } else if (strcmp(k, LLMDD_OPT_DEVICE_ID) == 0) {
            st = llmdd__parse_u32(v, &t.device_id);
            if (st == LLM_SUCCESS && t.device_id > INT32_MAX)
                st = LLM_PARAM_INVALID;
        } else if (strcmp(k, LLMDD_OPT_WAIT_TIME) == 0) {
            st = llmdd__parse_wait_time(v, &t.wait_ms);
        } else if (strcmp(k, LLMDD_OPT_HOST_POOL) == 0) {
            st = llmdd__parse_pool(v, &t.host_pool_config);
            t.host_pool = true;
        } else if (strcmp(k, LLMDD_OPT_DEVICE_POOL) == 0) {
            st = llmdd__parse_pool(v, &t.device_pool_config);
            t.device_pool = true;
        } else if (strcmp(k, LLMDD_OPT_TRANSPORT) == 0) {
            st = parse_transport(v, t.transport);
        } else if (strcmp(k, LLMDD_OPT_MAX_LINKS) == 0) {
            st = parse_max_links(v, &t.max_links);
        } else if (strcmp(k, LLMDD_OPT_TCP_LANES) == 0) {
            uint32_t lanes = 0;
            if (strcmp(v, "auto") != 0 &&
                (llmdd__parse_u32(v, &lanes) != LLM_SUCCESS || lanes == 0 ||
                 lanes > LLMDD_TCP_LANES_MAX))
                st = LLM_PARAM_INVALID;
            t.tcp_lanes = (int)lanes;
        } else if (strcmp(k, LLMDD_OPT_AUTH_TOKEN) == 0) {
            size_t len = strlen(v);
            if (len == 0 || len > LLMDD_AUTH_TOKEN_MAX)
                st = LLM_PARAM_INVALID;
            token = v;
            set_token = true;
        } else if (!ignored_key(k)) {
            log_warn("unknown option \"%s\" ignored", k);
        }
        if (st != LLM_SUCCESS) {
            /* Never log the token itself. */
            log_error("option %s: invalid value \"%s\"", k,
                      strcmp(k, LLMDD_OPT_AUTH_TOKEN) == 0 ? "..." : v);
            return st;
        }
    }
    if (set_token) {
        char *copy = strdup(token);
        if (copy == NULL)
            return LLM_OUT_OF_MEMORY;
        free(o->auth_token);
        t.auth_token = copy;
    }
    *o = t;
    return LLM_SUCCESS;
}

void
llmdd__sockaddr_str(const llmdd__sockaddr *a, char *buf, size_t len)
{
    char ip[INET6_ADDRSTRLEN] = "?";

    if (a->addr.ss_family == AF_INET) {
        const struct sockaddr_in *v4 = (const struct sockaddr_in *)&a->addr;
        inet_ntop(AF_INET, &v4->sin_addr, ip, sizeof(ip));
        snprintf(buf, len, "%s:%u", ip, ntohs(v4->sin_port));
    } else if (a->addr.ss_family == AF_INET6) {
        const struct sockaddr_in6 *v6 = (const struct sockaddr_in6 *)&a->addr;
        inet_ntop(AF_INET6, &v6->sin6_addr, ip, sizeof(ip));
        snprintf(buf, len, "[%s]:%u", ip, ntohs(v6->sin6_port));
    } else {
        snprintf(buf, len, "?");
    }
}
