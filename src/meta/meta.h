/*
 * Discovery through a metadata server (docs/model.md, "Discovery"): etcd's
 * v3 API through its JSON gateway, over HTTP with libcurl, JSON with cJSON.
 * No instance here: the control plane (src/ctrl) hands this module what it
 * publishes and a callback for departures; the core only validates the
 * option's text (llmdd__meta_server_parse).
 *
 *  - entry.c: the published entry <prefix>/clusters/<cluster id> (encode,
 *    and the bounded decoder of what another host wrote there: fuzzed,
 *    tests/fuzz/fuzz_meta.c), base64, the server option's syntax.
 *  - etcd.c: one HTTP request to the gateway on the calling thread, with
 *    fail-over over the endpoints, bounded by a deadline; the etcd calls.
 *  - agent.c: one metadata thread per instance: keeps the lease alive,
 *    confirms that our key still holds our entry and takes it back when it
 *    does not, and watches the prefix (curl multi: the watch stream and
 *    the thread's wake eventfd in one wait).
 */
#ifndef LLMDD_META_META_H
#define LLMDD_META_META_H

#include <llmdd/llmdd.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#define LLMDD_META_SERVER_MAX 1024 /* the option's text */
#define LLMDD_META_ENDPOINTS_MAX 8
#define LLMDD_META_PREFIX_MAX 64
#define LLMDD_META_LEASE_MIN_MS 1000u
#define LLMDD_META_LEASE_MAX_MS 3600000u
#define LLMDD_META_ADDRS_MAX 8
#define LLMDD_META_TRANSPORTS_MAX 8
#define LLMDD_META_NAME_MAX 16
/* The largest entry value accepted from the server (bytes of JSON). */
#define LLMDD_META_VALUE_MAX 4096
/* The largest answer body or watch message accepted from the gateway. */
#define LLMDD_META_BODY_MAX (1u << 20)
/* Initialize waits at most this long for the server (LLM_TIMEOUT). */
#define LLMDD_META_INIT_MS 5000
/* Finalize and set_role wait at most this long to revoke the lease. */
#define LLMDD_META_REVOKE_MS 1000
/* An endpoint that does not accept the connection within this is skipped. */
#define LLMDD_META_CONNECT_MS 1000

typedef struct {
    char ip[LLMDD_IP_LEN];
    uint16_t port;
} llmdd__meta_addr;

/* What an instance publishes about itself (a peer's entry: its claims). */
typedef struct {
    uint64_t cluster_id;
    uint32_t role;
    uint32_t protocol; /* the wire protocol version */
    uint32_t pid;
    uint8_t boot_id[16];
    uint64_t nonce; /* the instance's random id */
    size_t naddrs;
    llmdd__meta_addr addrs[LLMDD_META_ADDRS_MAX];
    size_t ntransports;
    char transports[LLMDD_META_TRANSPORTS_MAX][LLMDD_META_NAME_MAX];
} llmdd__meta_entry;

/* ---- entry.c: pure functions (thread-safe). ---- */

/*
 * "etcd://host:port[,host:port...]": 1..LLMDD_META_ENDPOINTS_MAX
 * endpoints, host a name of [A-Za-z0-9.-], an IPv4 address or [IPv6],
 * port 1..65535. urls (may be NULL) gets "http://host:port" for each.
 */
llmdd_status llmdd__meta_server_parse(const char *s, char (*urls)[300],
                                      size_t *n_out);
/* 1..64 of [A-Za-z0-9._/-]. */
bool llmdd__meta_prefix_valid(const char *s);
/* The entry as JSON, NUL-terminated; the length, or 0 when it does not fit. */
size_t llmdd__meta_entry_encode(const llmdd__meta_entry *e, char *buf,
                                size_t cap);
/*
 * Parses an entry's JSON (len bytes, not NUL-terminated). Every field is
 * checked against its limits; unknown fields are ignored. LLM_SUCCESS, or
 * LLM_FAILED for anything malformed or out of bounds (*out unchanged).
 */
llmdd_status llmdd__meta_entry_decode(const char *json, size_t len,
                                      llmdd__meta_entry *out);
/* Standard base64 with padding; the output length, or 0 when it does not
 * fit (encode NUL-terminates). decode: -1 on a malformed input. */
size_t llmdd__b64_encode(const void *in, size_t len, char *out, size_t cap);
long llmdd__b64_decode(const char *in, size_t len, void *out, size_t cap);

/* ---- The metadata service of one instance. ---- */

typedef struct llmdd__meta llmdd__meta;

/*
 * An entry under the prefix was deleted or its lease expired: cluster_id's
 * entry is gone (the instance may still live: heartbeats tell). nonce: the
 * departed instance's, from the entry's last value (0: unknown, the server
 * did not say). Not called for a deleted value that was no entry of that
 * cluster, nor for our own entry. Called on the metadata thread, with no
 * lock of this module held.
 */
typedef void (*llmdd__meta_gone_fn)(void *arg, uint64_t cluster_id,
                                    uint64_t nonce);

/*
 * Connects to the server (server as llmdd__meta_server_parse takes it) and
 * starts the metadata thread, which watches <prefix>/clusters/. gone may be
 * NULL. LLM_TIMEOUT when no endpoint answers by deadline_ms, LLM_FAILED for
 * a malformed answer or no resources.
 */
llmdd_status llmdd__meta_open(const char *server, const char *prefix,
                              uint32_t lease_ms, llmdd__meta_gone_fn gone,
                              void *arg, int64_t deadline_ms,
                              llmdd__meta **out);
/* Stops the thread (revoking the lease, as unpublish) and frees; NULL ok. */
void llmdd__meta_close(llmdd__meta *m);

/*
 * Publishes e under a new lease that the metadata thread keeps alive:
 * LLM_SUCCESS; LLM_PARAM_INVALID when a live instance holds the cluster
 * id (an entry of a dead process of this host with this boot id is taken
 * over); LLM_TIMEOUT when the server cannot be reached by deadline_ms;
 * LLM_FAILED for a malformed answer.
 */
llmdd_status llmdd__meta_publish(llmdd__meta *m, const llmdd__meta_entry *e,
                                 int64_t deadline_ms);
/* Revokes the lease (the entry goes with it); bounded by deadline_ms. */
void llmdd__meta_unpublish(llmdd__meta *m, int64_t deadline_ms);

/*
 * Looks cluster_id up under prefix on server (as llmdd__meta_open takes
 * them; no instance or thread needed, so a lookup never depends on the
 * metadata thread's life): LLM_SUCCESS and *out; LLM_LINK_FAILED when it
 * has no entry or its entry is malformed; LLM_TIMEOUT when the server
 * cannot be reached by deadline_ms.
 */
llmdd_status llmdd__meta_resolve(const char *server, const char *prefix,
                                 uint64_t cluster_id, int64_t deadline_ms,
                                 llmdd__meta_entry *out);

/*
 * Every entry under <prefix>/clusters/ as one JSON array of the entries'
 * values (malformed entries skipped), malloc'd, in *json_out. No instance
 * needed (llmdd_metadata_list).
 */
llmdd_status llmdd__meta_list(const char *server, const char *prefix,
                              int64_t deadline_ms, char **json_out);

#endif
