/*
 * etcd's v3 API through its JSON gateway (POST /v3/..., JSON in and out,
 * keys and values in base64), over HTTP with libcurl's easy interface: one
 * request on the calling thread, bounded by its deadline, tried on each
 * endpoint in turn (fail-over). Answers are untrusted: the body is capped
 * (LLMDD_META_BODY_MAX) and every field read is checked.
 */
#include <curl/curl.h>
#include <inttypes.h>
#include <poll.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "base/log.h"
#include "base/net.h"
#include "meta/etcd.h"

#define RETRY_PAUSE_MS 100

static pthread_once_t curl_once = PTHREAD_ONCE_INIT;

static void
curl_init_once(void)
{
    if (curl_global_init(CURL_GLOBAL_DEFAULT) != CURLE_OK)
        log_error("metadata: libcurl could not start");
}

void
llmdd__etcd_global_init(void)
{
    pthread_once(&curl_once, curl_init_once);
}

typedef struct {
    char *buf;
    size_t len, cap;
    bool over;
} body_buf;

static size_t
body_write(char *p, size_t size, size_t n, void *arg)
{
    body_buf *b = arg;
    size_t len = size * n;

    if (b->len + len > LLMDD_META_BODY_MAX) {
        b->over = true;
        return 0; /* ends the transfer */
    }
    if (b->len + len + 1 > b->cap) {
        size_t ncap = b->cap ? b->cap : 1024;
        while (ncap < b->len + len + 1)
            ncap *= 2;
        char *nb = realloc(b->buf, ncap);
        if (nb == NULL)
            return 0;
        b->buf = nb;
        b->cap = ncap;
    }
    memcpy(b->buf + b->len, p, len);
    b->len += len;
    b->buf[b->len] = '\0';
    return len;
}

/* One request to one endpoint: ETCD_OK (*out), ETCD_UNREACHABLE, ETCD_BAD. */
static int
call_one(const char *url, const char *path, const char *body,
         int64_t left_ms, cJSON **out)
{
    char full[400];
    body_buf b = {0};
    long code = 0;
    int rc = ETCD_UNREACHABLE;
    CURL *h = curl_easy_init();

    if (h == NULL)
        return ETCD_UNREACHABLE;
    snprintf(full, sizeof(full), "%s%s", url, path);
    struct curl_slist *hdr =
        curl_slist_append(NULL, "Content-Type: application/json");
    curl_easy_setopt(h, CURLOPT_URL, full);
    curl_easy_setopt(h, CURLOPT_NOSIGNAL, 1L);
    curl_easy_setopt(h, CURLOPT_POSTFIELDS, body);
    curl_easy_setopt(h, CURLOPT_HTTPHEADER, hdr);
    curl_easy_setopt(h, CURLOPT_WRITEFUNCTION, body_write);
    curl_easy_setopt(h, CURLOPT_WRITEDATA, &b);
    curl_easy_setopt(h, CURLOPT_TIMEOUT_MS, (long)(left_ms > 0 ? left_ms : 1));
    curl_easy_setopt(h, CURLOPT_CONNECTTIMEOUT_MS,
                     (long)(left_ms < LLMDD_META_CONNECT_MS
                                ? (left_ms > 0 ? left_ms : 1)
                                : LLMDD_META_CONNECT_MS));
    curl_easy_setopt(h, CURLOPT_PROTOCOLS_STR, "http");
    CURLcode cc = curl_easy_perform(h);
    curl_easy_getinfo(h, CURLINFO_RESPONSE_CODE, &code);
    if (b.over) {
        log_error("metadata server %s: an answer over %u bytes", url,
                  LLMDD_META_BODY_MAX);
        rc = ETCD_BAD;
    } else if (cc != CURLE_OK) {
        log_debug("metadata server %s: %s", url, curl_easy_strerror(cc));
    } else if (code >= 500 || code == 0) {
        /* Retried, on the next endpoint or after a pause. */
        log_debug("metadata server %s%s: HTTP %ld", url, path, code);
    } else {
        cJSON *j = cJSON_ParseWithLength(b.buf ? b.buf : "", b.len);
        if (code != 200 || !cJSON_IsObject(j)) {
            const char *msg = cJSON_GetStringValue(
                cJSON_GetObjectItemCaseSensitive(j, "message"));
            log_error("metadata server %s%s: HTTP %ld, %s%s", url, path, code,
                      cJSON_IsObject(j) ? "" : "not a JSON object",
                      msg != NULL ? msg : "");
            cJSON_Delete(j);
            rc = ETCD_BAD;
        } else {
            *out = j;
            rc = ETCD_OK;
        }
    }
    free(b.buf);
    curl_slist_free_all(hdr);
    curl_easy_cleanup(h);
    return rc;
}

int
llmdd__etcd_call(llmdd__etcd *c, const char *path, const char *body,
                 int stop_fd, int64_t deadline_ms, cJSON **out)
{
    llmdd__etcd_global_init();
    for (;;) {
        size_t first = atomic_load(&c->cur) % c->n;
        for (size_t k = 0; k < c->n; k++) {
            size_t i = (first + k) % c->n;
            int64_t left = deadline_ms - llmdd__now_ms();
            if (left <= 0)
                return ETCD_UNREACHABLE;
            int rc = call_one(c->urls[i], path, body, left, out);
            if (rc != ETCD_UNREACHABLE) {
                atomic_store(&c->cur, i);
                return rc;
            }
        }
        int64_t left = deadline_ms - llmdd__now_ms();
        if (left <= 0)
            return ETCD_UNREACHABLE;
        struct pollfd p = {.fd = stop_fd, .events = POLLIN};
        if (poll(&p, 1, (int)(left < RETRY_PAUSE_MS ? left : RETRY_PAUSE_MS)) >
            0)
            return ETCD_UNREACHABLE;
    }
}

bool
llmdd__etcd_i64(const cJSON *o, const char *name, int64_t def, int64_t *out)
{
    const cJSON *it = cJSON_GetObjectItemCaseSensitive(o, name);
    int64_t v = 0;
    bool neg = false;

    if (it == NULL) {
        *out = def;
        return true;
    }
    if (cJSON_IsNumber(it)) {
        double d = it->valuedouble;
        if (!(d >= -9e15 && d <= 9e15) || (double)(int64_t)d != d)
            return false;
        *out = (int64_t)d;
        return true;
    }
    const char *s = cJSON_GetStringValue(it);
    if (s == NULL || s[0] == '\0' || strlen(s) > 20)
        return false;
    if (*s == '-') {
        neg = true;
        s++;
    }
    if (*s == '\0')
        return false;
    for (; *s != '\0'; s++) {
        if (*s < '0' || *s > '9' || v > (INT64_MAX - (*s - '0')) / 10)
            return false;
        v = v * 10 + (*s - '0');
    }
    *out = neg ? -v : v;
    return true;
}

/* Base64 of a string; NULL without memory. */
static char *
b64_str(const char *s)
{
    size_t len = strlen(s), cap = (len + 2) / 3 * 4 + 1;
    char *out = malloc(cap);

    if (out != NULL)
        llmdd__b64_encode(s, len, out, cap);
    return out;
}

long
llmdd__etcd_kv_bytes(const cJSON *kv, const char *name, char *buf, size_t cap)
{
    const char *s =
        cJSON_GetStringValue(cJSON_GetObjectItemCaseSensitive(kv, name));
    if (s == NULL || cap == 0)
        return -1;
    long n = llmdd__b64_decode(s, strlen(s), buf, cap - 1);
    if (n >= 0)
        buf[n] = '\0';
    return n;
}

int
llmdd__etcd_grant(llmdd__etcd *c, int64_t ttl_s, int64_t deadline_ms,
                  int64_t *id, int64_t *ttl_out)
{
    char body[64];
    cJSON *j = NULL;

    snprintf(body, sizeof(body), "{\"TTL\":\"%" PRId64 "\"}", ttl_s);
    int rc = llmdd__etcd_call(c, "/v3/lease/grant", body, -1, deadline_ms, &j);
    if (rc != ETCD_OK)
        return rc;
    if (!llmdd__etcd_i64(j, "ID", 0, id) || *id == 0 ||
        !llmdd__etcd_i64(j, "TTL", 0, ttl_out) || *ttl_out <= 0 ||
        *ttl_out > (int64_t)(LLMDD_META_LEASE_MAX_MS / 1000)) {
        /* A TTL past the longest we ask for is a server's claim we do not
         * take: ttl * 1000 and its thirds must stay in range. */
        log_error("metadata server: a lease grant without ID or a TTL in "
                  "1..%u s",
                  LLMDD_META_LEASE_MAX_MS / 1000);
        rc = ETCD_BAD;
    }
    cJSON_Delete(j);
    return rc;
}

int
llmdd__etcd_keepalive(llmdd__etcd *c, int64_t id, int64_t deadline_ms,
                      int64_t *ttl_out)
{
    char body[64];
    cJSON *j = NULL;

    snprintf(body, sizeof(body), "{\"ID\":\"%" PRId64 "\"}", id);
    int rc =
        llmdd__etcd_call(c, "/v3/lease/keepalive", body, -1, deadline_ms, &j);
    if (rc != ETCD_OK)
        return rc;
    /* One message of the stream: {"result": {"ID", "TTL"}}; no TTL: gone. */
    const cJSON *r = cJSON_GetObjectItemCaseSensitive(j, "result");
    if (!cJSON_IsObject(r) || !llmdd__etcd_i64(r, "TTL", 0, ttl_out)) {
        log_error("metadata server: a malformed keepalive answer");
        rc = ETCD_BAD;
    }
    cJSON_Delete(j);
    return rc;
}

int
llmdd__etcd_revoke(llmdd__etcd *c, int64_t id, int64_t deadline_ms)
{
    char body[64];
    cJSON *j = NULL;

    snprintf(body, sizeof(body), "{\"ID\":\"%" PRId64 "\"}", id);
    int rc = llmdd__etcd_call(c, "/v3/lease/revoke", body, -1, deadline_ms, &j);
    cJSON_Delete(j);
    return rc;
}

int
llmdd__etcd_put_if(llmdd__etcd *c, const char *key, const char *value,
                   int64_t lease, int64_t mod_rev, int64_t deadline_ms,
                   bool *done, char *cur, size_t cap, size_t *vlen,
                   int64_t *cur_rev)
{
    char *k = b64_str(key), *v = b64_str(value), *body = NULL;
    cJSON *j = NULL;
    int rc = ETCD_BAD;

    if (k == NULL || v == NULL)
        goto out;
    size_t blen = strlen(k) + strlen(v) + 512;
    body = malloc(blen);
    if (body == NULL)
        goto out;
    snprintf(body, blen,
             "{\"compare\":[{\"target\":\"%s\",\"key\":\"%s\","
             "\"result\":\"EQUAL\",\"%s\":\"%" PRId64 "\"}],"
             "\"success\":[{\"request_put\":{\"key\":\"%s\",\"value\":\"%s\","
             "\"lease\":\"%" PRId64 "\"}}],"
             "\"failure\":[{\"request_range\":{\"key\":\"%s\"}}]}",
             mod_rev > 0 ? "MOD" : "CREATE", k,
             mod_rev > 0 ? "mod_revision" : "create_revision", mod_rev, k, v,
             lease, k);
    rc = llmdd__etcd_call(c, "/v3/kv/txn", body, -1, deadline_ms, &j);
    if (rc != ETCD_OK)
        goto out;
    const cJSON *ok = cJSON_GetObjectItemCaseSensitive(j, "succeeded");
    *done = cJSON_IsTrue(ok);
    *cur_rev = 0;
    *vlen = 0;
    if (*done)
        goto out;
    /* responses[0].response_range.kvs[0] */
    const cJSON *resp = cJSON_GetArrayItem(
        cJSON_GetObjectItemCaseSensitive(j, "responses"), 0);
    const cJSON *kvs = cJSON_GetObjectItemCaseSensitive(
        cJSON_GetObjectItemCaseSensitive(resp, "response_range"), "kvs");
    const cJSON *kv = cJSON_GetArrayItem(kvs, 0);
    if (kv == NULL)
        goto out; /* gone meanwhile */
    long n = llmdd__etcd_kv_bytes(kv, "value", cur, cap);
    if (n < 0 || !llmdd__etcd_i64(kv, "mod_revision", 0, cur_rev)) {
        log_error("metadata server: a malformed value of %s", key);
        rc = ETCD_BAD;
        goto out;
    }
    *vlen = (size_t)n;
out:
    cJSON_Delete(j);
    free(body);
    free(k);
    free(v);
    return rc;
}

int
llmdd__etcd_get(llmdd__etcd *c, const char *key, int stop_fd,
                int64_t deadline_ms, bool *found, char *value, size_t cap,
                long *vlen, int64_t *mod_rev, int64_t *lease)
{
    char *k = b64_str(key), *body = NULL;
    cJSON *j = NULL;
    int rc = ETCD_BAD;

    if (k == NULL || (body = malloc(strlen(k) + 32)) == NULL)
        goto out;
    sprintf(body, "{\"key\":\"%s\"}", k);
    rc = llmdd__etcd_call(c, "/v3/kv/range", body, stop_fd, deadline_ms, &j);
    if (rc != ETCD_OK)
        goto out;
    const cJSON *kvs = cJSON_GetObjectItemCaseSensitive(j, "kvs");
    const cJSON *kv = cJSON_GetArrayItem(kvs, 0);
    int64_t rev = 0, ls = 0;
    *found = kv != NULL;
    if (kv == NULL)
        goto out;
    if (!llmdd__etcd_i64(kv, "mod_revision", 0, &rev) ||
        !llmdd__etcd_i64(kv, "lease", 0, &ls)) {
        log_error("metadata server: a malformed revision or lease of %s",
                  key);
        rc = ETCD_BAD;
        goto out;
    }
    if (mod_rev != NULL)
        *mod_rev = rev;
    if (lease != NULL)
        *lease = ls;
    /* A value that is not base64 or over cap is what the key holds all
     * the same: the caller decides what that means. */
    *vlen = llmdd__etcd_kv_bytes(kv, "value", value, cap);
out:
    cJSON_Delete(j);
    free(body);
    free(k);
    return rc;
}

/* The range end of a prefix: the prefix with its last byte plus one. */
static char *
prefix_end_b64(const char *prefix)
{
    char end[LLMDD_META_PREFIX_MAX + 32];
    size_t len = strlen(prefix);

    if (len == 0 || len >= sizeof(end))
        return NULL;
    memcpy(end, prefix, len + 1);
    end[len - 1]++;
    return b64_str(end);
}

int
llmdd__etcd_range_prefix(llmdd__etcd *c, const char *prefix, bool count_only,
                         int stop_fd, int64_t deadline_ms, cJSON **out,
                         int64_t *rev)
{
    char *k = b64_str(prefix), *e = prefix_end_b64(prefix), *body = NULL;
    cJSON *j = NULL;
    int rc = ETCD_BAD;

    if (k == NULL || e == NULL ||
        (body = malloc(strlen(k) + strlen(e) + 64)) == NULL)
        goto out;
    sprintf(body, "{\"key\":\"%s\",\"range_end\":\"%s\"%s}", k, e,
            count_only ? ",\"count_only\":true" : "");
    rc = llmdd__etcd_call(c, "/v3/kv/range", body, stop_fd, deadline_ms, &j);
    if (rc != ETCD_OK)
        goto out;
    const cJSON *hdr = cJSON_GetObjectItemCaseSensitive(j, "header");
    if (!cJSON_IsObject(hdr) || !llmdd__etcd_i64(hdr, "revision", 0, rev) ||
        *rev < 0) {
        log_error("metadata server: an answer without its revision");
        rc = ETCD_BAD;
        goto out;
    }
    if (out != NULL) {
        *out = j;
        j = NULL;
    }
out:
    cJSON_Delete(j);
    free(body);
    free(k);
    free(e);
    return rc;
}

char *
llmdd__etcd_watch_body(const char *prefix, int64_t rev)
{
    char *k = b64_str(prefix), *e = prefix_end_b64(prefix), *body = NULL;

    if (k != NULL && e != NULL &&
        (body = malloc(strlen(k) + strlen(e) + 160)) != NULL)
        sprintf(body,
                "{\"create_request\":{\"key\":\"%s\",\"range_end\":\"%s\","
                "\"start_revision\":\"%" PRId64 "\",\"prev_kv\":true}}",
                k, e, rev);
    free(k);
    free(e);
    return body;
}
