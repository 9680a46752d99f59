/*
 * etcd's v3 JSON gateway, one request at a time on the calling thread
 * (etcd.c), for agent.c. Keys and values are bytes (base64 on the wire);
 * revisions and lease ids are int64 (strings on the wire).
 */
#ifndef LLMDD_META_ETCD_H
#define LLMDD_META_ETCD_H

#include <cjson/cJSON.h>
#include <stdatomic.h>

#include "meta/meta.h"

/* The server's endpoints; cur is the last one that answered. */
typedef struct {
    char urls[LLMDD_META_ENDPOINTS_MAX][300];
    size_t n;
    atomic_size_t cur;
} llmdd__etcd;

/* What a call came to. */
enum {
    ETCD_OK = 0,
    ETCD_UNREACHABLE = -1, /* no endpoint answered by the deadline */
    ETCD_BAD = -2,         /* an answer that is not what etcd says (logged) */
};

/* libcurl's global setup, once per process. */
void llmdd__etcd_global_init(void);
/*
 * POSTs body to path ("/v3/kv/range") on the endpoints, from the last good
 * one on, until one answers with HTTP 200 and a JSON object (*out, the
 * caller's to delete) or the deadline passes. An endpoint that refuses,
 * times out or answers 5xx is skipped; once all were tried, the round
 * repeats after a pause (waking early when stop_fd, if >= 0, is readable).
 */
int llmdd__etcd_call(llmdd__etcd *c, const char *path, const char *body,
                     int stop_fd, int64_t deadline_ms, cJSON **out);

/* An int64 field that the gateway writes as a string (or a number);
 * absent: def. false when present and malformed. */
bool llmdd__etcd_i64(const cJSON *o, const char *name, int64_t def,
                     int64_t *out);

int llmdd__etcd_grant(llmdd__etcd *c, int64_t ttl_s, int64_t deadline_ms,
                      int64_t *id, int64_t *ttl_out);
/* *ttl_out 0: the lease is gone. */
int llmdd__etcd_keepalive(llmdd__etcd *c, int64_t id, int64_t deadline_ms,
                          int64_t *ttl_out);
int llmdd__etcd_revoke(llmdd__etcd *c, int64_t id, int64_t deadline_ms);

/*
 * Puts key = value under lease if the key does not exist (create_revision
 * 0), or, with mod_rev > 0, if its mod_revision is still mod_rev: one
 * transaction. *done tells which; when not done, the key's value as it is
 * (up to cap bytes, *vlen) and its mod_revision (0: it is gone).
 */
int llmdd__etcd_put_if(llmdd__etcd *c, const char *key, const char *value,
                       int64_t lease, int64_t mod_rev, int64_t deadline_ms,
                       bool *done, char *cur, size_t cap, size_t *vlen,
                       int64_t *cur_rev);
/*
 * The value of key (up to cap - 1 bytes, NUL-terminated; *vlen -1 when it
 * is not base64 or does not fit), its mod_revision and its lease (0: none;
 * either pointer may be NULL); *found false when it has none.
 */
int llmdd__etcd_get(llmdd__etcd *c, const char *key, int stop_fd,
                    int64_t deadline_ms, bool *found, char *value, size_t cap,
                    long *vlen, int64_t *mod_rev, int64_t *lease);
/* Every key under prefix: the answer's "kvs" array stays in *out (the
 * caller's); *rev: the store's revision. count_only: no kvs. */
int llmdd__etcd_range_prefix(llmdd__etcd *c, const char *prefix,
                             bool count_only, int stop_fd,
                             int64_t deadline_ms, cJSON **out, int64_t *rev);
/* Decodes a kv's base64 field into buf (NUL-terminated); its length or
 * -1. */
long llmdd__etcd_kv_bytes(const cJSON *kv, const char *name, char *buf,
                          size_t cap);
/* {"create_request": ...} for a watch of prefix from revision rev. */
char *llmdd__etcd_watch_body(const char *prefix, int64_t rev);

#endif
