/*
 * The published entry, base64 and the server option: pure functions. The
 * entry decoder reads what any host with access to the server wrote, so
 * every field is bounded and checked (fuzzed: tests/fuzz/fuzz_meta.c).
 */
#include <arpa/inet.h>
#include <cjson/cJSON.h>
#include <inttypes.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "meta/meta.h"

/* ---- The server option and the prefix. ---- */

static bool
host_char(char c)
{
    return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') ||
           (c >= '0' && c <= '9') || c == '.' || c == '-';
}

/* One "host:port" of len bytes; url gets "http://host:port". */
static bool
endpoint_parse(const char *s, size_t len, char *url, size_t cap)
{
    char host[256];
    size_t hlen;
    const char *port;

    if (len == 0 || len >= 300)
        return false;
    if (s[0] == '[') {
        const char *close = memchr(s, ']', len);
        if (close == NULL || (size_t)(close - s) + 1 >= len ||
            close[1] != ':')
            return false;
        hlen = (size_t)(close - s - 1);
        if (hlen == 0 || hlen >= LLMDD_IP_LEN)
            return false;
        memcpy(host, s + 1, hlen);
        host[hlen] = '\0';
        struct in6_addr a6;
        if (inet_pton(AF_INET6, host, &a6) != 1)
            return false;
        port = close + 2;
    } else {
        const char *colon = memchr(s, ':', len);
        if (colon == NULL)
            return false;
        hlen = (size_t)(colon - s);
        if (hlen == 0 || hlen >= sizeof(host))
            return false;
        for (size_t i = 0; i < hlen; i++)
            if (!host_char(s[i]))
                return false;
        memcpy(host, s, hlen);
        host[hlen] = '\0';
        port = colon + 1;
    }
    size_t plen = len - (size_t)(port - s);
    unsigned long p = 0;
    if (plen == 0 || plen > 5)
        return false;
    for (size_t i = 0; i < plen; i++) {
        if (port[i] < '0' || port[i] > '9')
            return false;
        p = p * 10 + (unsigned long)(port[i] - '0');
    }
    if (p == 0 || p > 65535)
        return false;
    if (url != NULL)
        snprintf(url, cap, "http://%.*s", (int)len, s);
    return true;
}

llmdd_status
llmdd__meta_server_parse(const char *s, char (*urls)[300], size_t *n_out)
{
    static const char scheme[] = "etcd://";
    size_t n = 0;

    if (s == NULL || strlen(s) > LLMDD_META_SERVER_MAX ||
        strncmp(s, scheme, sizeof(scheme) - 1) != 0)
        return LLM_PARAM_INVALID;
    const char *p = s + sizeof(scheme) - 1;
    for (;;) {
        const char *comma = strchr(p, ',');
        size_t len = comma != NULL ? (size_t)(comma - p) : strlen(p);
        if (n == LLMDD_META_ENDPOINTS_MAX ||
            !endpoint_parse(p, len, urls != NULL ? urls[n] : NULL, 300))
            return LLM_PARAM_INVALID;
        n++;
        if (comma == NULL)
            break;
        p = comma + 1;
    }
    if (n_out != NULL)
        *n_out = n;
    return LLM_SUCCESS;
}

bool
llmdd__meta_prefix_valid(const char *s)
{
    size_t n = 0;

    if (s == NULL)
        return false;
    for (; s[n] != '\0'; n++) {
        char c = s[n];
        if (n >= LLMDD_META_PREFIX_MAX ||
            !((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') ||
              (c >= '0' && c <= '9') || c == '.' || c == '_' || c == '/' ||
              c == '-'))
            return false;
    }
    return n > 0;
}

/* ---- base64 ---- */

static const char b64[] =
    "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";

size_t
llmdd__b64_encode(const void *in, size_t len, char *out, size_t cap)
{
    const uint8_t *p = in;
    size_t need = (len + 2) / 3 * 4, o = 0;

    if (need + 1 > cap)
        return 0;
    for (size_t i = 0; i < len; i += 3) {
        uint32_t v = (uint32_t)p[i] << 16;
        if (i + 1 < len)
            v |= (uint32_t)p[i + 1] << 8;
        if (i + 2 < len)
            v |= p[i + 2];
        out[o++] = b64[(v >> 18) & 63];
        out[o++] = b64[(v >> 12) & 63];
        out[o++] = i + 1 < len ? b64[(v >> 6) & 63] : '=';
        out[o++] = i + 2 < len ? b64[v & 63] : '=';
    }
    out[o] = '\0';
    return o;
}

static int
b64_val(char c)
{
    if (c >= 'A' && c <= 'Z')
        return c - 'A';
    if (c >= 'a' && c <= 'z')
        return c - 'a' + 26;
    if (c >= '0' && c <= '9')
        return c - '0' + 52;
    if (c == '+')
        return 62;
    if (c == '/')
        return 63;
    return -1;
}

long
llmdd__b64_decode(const char *in, size_t len, void *out, size_t cap)
{
    uint8_t *o = out;
    size_t n = 0;

    if (len % 4 != 0)
        return -1;
    for (size_t i = 0; i < len; i += 4) {
        int v[4];
        int pad = 0;
        for (int k = 0; k < 4; k++) {
            if (in[i + k] == '=' && i + 4 == len && k >= 2) {
                v[k] = 0;
                pad++;
            } else if (pad > 0 || (v[k] = b64_val(in[i + k])) < 0) {
                return -1;
            }
        }
        uint32_t w = (uint32_t)v[0] << 18 | (uint32_t)v[1] << 12 |
                     (uint32_t)v[2] << 6 | (uint32_t)v[3];
        size_t take = 3 - (size_t)pad;
        if (n + take > cap)
            return -1;
        o[n++] = (uint8_t)(w >> 16);
        if (take > 1)
            o[n++] = (uint8_t)(w >> 8);
        if (take > 2)
            o[n++] = (uint8_t)w;
    }
    return (long)n;
}

/* ---- The entry. ---- */

static void
hex(const uint8_t *p, size_t n, char *out)
{
    for (size_t i = 0; i < n; i++)
        sprintf(out + 2 * i, "%02x", p[i]);
}

static bool
unhex(const char *s, uint8_t *out, size_t n)
{
    if (strlen(s) != 2 * n)
        return false;
    for (size_t i = 0; i < n; i++) {
        unsigned v = 0;
        for (int k = 0; k < 2; k++) {
            char c = s[2 * i + (size_t)k];
            v <<= 4;
            if (c >= '0' && c <= '9')
                v |= (unsigned)(c - '0');
            else if (c >= 'a' && c <= 'f')
                v |= (unsigned)(c - 'a' + 10);
            else
                return false;
        }
        out[i] = (uint8_t)v;
    }
    return true;
}

size_t
llmdd__meta_entry_encode(const llmdd__meta_entry *e, char *buf, size_t cap)
{
    char boot[33], nonce[17];
    uint8_t nb[8];
    int n;

    hex(e->boot_id, sizeof(e->boot_id), boot);
    for (int i = 0; i < 8; i++)
        nb[i] = (uint8_t)(e->nonce >> (56 - 8 * i));
    hex(nb, sizeof(nb), nonce);
    n = snprintf(buf, cap,
                 "{\"cluster_id\":\"%" PRIu64 "\",\"role\":%" PRIu32
                 ",\"protocol\":%" PRIu32 ",\"pid\":%" PRIu32
                 ",\"boot_id\":\"%s\",\"nonce\":\"%s\",\"addrs\":[",
                 e->cluster_id, e->role, e->protocol, e->pid, boot, nonce);
    for (size_t i = 0; i < e->naddrs && n >= 0 && (size_t)n < cap; i++)
        n += snprintf(buf + n, cap - (size_t)n,
                      "%s{\"ip\":\"%s\",\"port\":%u}", i ? "," : "",
                      e->addrs[i].ip, e->addrs[i].port);
    if (n >= 0 && (size_t)n < cap)
        n += snprintf(buf + n, cap - (size_t)n, "],\"transports\":[");
    for (size_t i = 0; i < e->ntransports && n >= 0 && (size_t)n < cap; i++)
        n += snprintf(buf + n, cap - (size_t)n, "%s\"%s\"", i ? "," : "",
                      e->transports[i]);
    if (n >= 0 && (size_t)n < cap)
        n += snprintf(buf + n, cap - (size_t)n, "]}");
    if (n < 0 || (size_t)n >= cap)
        return 0;
    return (size_t)n;
}

/* A JSON number that is an integer in [min, max]. */
static bool
get_uint(const cJSON *o, const char *name, double min, double max,
         uint32_t *out)
{
    const cJSON *it = cJSON_GetObjectItemCaseSensitive(o, name);
    if (!cJSON_IsNumber(it))
        return false;
    double v = it->valuedouble;
    if (!(v >= min && v <= max) || floor(v) != v)
        return false;
    *out = (uint32_t)v;
    return true;
}

/* A decimal uint64 in a string (JSON numbers lose precision past 2^53). */
static bool
get_u64_str(const cJSON *o, const char *name, uint64_t *out)
{
    const cJSON *it = cJSON_GetObjectItemCaseSensitive(o, name);
    const char *s = cJSON_GetStringValue(it);
    uint64_t v = 0;

    if (s == NULL || s[0] == '\0' || strlen(s) > 20)
        return false;
    for (; *s != '\0'; s++) {
        if (*s < '0' || *s > '9')
            return false;
        uint64_t d = (uint64_t)(*s - '0');
        if (v > (UINT64_MAX - d) / 10)
            return false;
        v = v * 10 + d;
    }
    *out = v;
    return true;
}

static bool
name_valid(const char *s, size_t max)
{
    size_t n = 0;

    for (; s[n] != '\0'; n++)
        if (n + 1 >= max || !host_char(s[n]))
            return false;
    return n > 0;
}

llmdd_status
llmdd__meta_entry_decode(const char *json, size_t len, llmdd__meta_entry *out)
{
    llmdd__meta_entry e;
    llmdd_status st = LLM_FAILED;
    cJSON *root;

    if (json == NULL || len == 0 || len > LLMDD_META_VALUE_MAX)
        return LLM_FAILED;
    root = cJSON_ParseWithLength(json, len);
    if (!cJSON_IsObject(root))
        goto out;
    memset(&e, 0, sizeof(e));
    const char *boot = cJSON_GetStringValue(
        cJSON_GetObjectItemCaseSensitive(root, "boot_id"));
    const char *nonce = cJSON_GetStringValue(
        cJSON_GetObjectItemCaseSensitive(root, "nonce"));
    uint8_t nb[8];
    if (!get_u64_str(root, "cluster_id", &e.cluster_id) ||
        !get_uint(root, "role", 1, 3, &e.role) ||
        !get_uint(root, "protocol", 1, 65535, &e.protocol) ||
        !get_uint(root, "pid", 1, 4194304, &e.pid) || boot == NULL ||
        !unhex(boot, e.boot_id, sizeof(e.boot_id)) || nonce == NULL ||
        !unhex(nonce, nb, sizeof(nb)))
        goto out;
    for (int i = 0; i < 8; i++)
        e.nonce = e.nonce << 8 | nb[i];

    const cJSON *addrs = cJSON_GetObjectItemCaseSensitive(root, "addrs");
    const cJSON *a;
    if (!cJSON_IsArray(addrs))
        goto out;
    cJSON_ArrayForEach(a, addrs)
    {
        const char *ip =
            cJSON_GetStringValue(cJSON_GetObjectItemCaseSensitive(a, "ip"));
        uint32_t port;
        uint8_t bin[16];
        if (e.naddrs == LLMDD_META_ADDRS_MAX || ip == NULL ||
            strlen(ip) >= LLMDD_IP_LEN ||
            (inet_pton(AF_INET, ip, bin) != 1 &&
             inet_pton(AF_INET6, ip, bin) != 1) ||
            !get_uint(a, "port", 1, 65535, &port))
            goto out;
        strcpy(e.addrs[e.naddrs].ip, ip);
        e.addrs[e.naddrs].port = (uint16_t)port;
        e.naddrs++;
    }
    if (e.naddrs == 0)
        goto out;

    /* Optional: transports are informative (the handshake picks). */
    const cJSON *tps = cJSON_GetObjectItemCaseSensitive(root, "transports");
    if (tps != NULL) {
        if (!cJSON_IsArray(tps))
            goto out;
        cJSON_ArrayForEach(a, tps)
        {
            const char *t = cJSON_GetStringValue(a);
            if (e.ntransports == LLMDD_META_TRANSPORTS_MAX || t == NULL ||
                !name_valid(t, LLMDD_META_NAME_MAX))
                goto out;
            strcpy(e.transports[e.ntransports++], t);
        }
    }
    *out = e;
    st = LLM_SUCCESS;
out:
    cJSON_Delete(root);
    return st;
}
