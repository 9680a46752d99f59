/*
 * Option values: parsers for every key llmdd.h documents, and one table of the keys
 * (options.c) that applies them, sets their defaults and documents them
 * (llmdd_option_info). Pure functions over their arguments (thread-safe);
 * each parser writes its output only on success.
 * They read untrusted text and are fuzzed (tests/fuzz/fuzz_options.c).
 */
#ifndef LLMDD_CORE_OPTIONS_H
#define LLMDD_CORE_OPTIONS_H

#include <llmdd/llmdd.h>
#include <sys/socket.h>

#include "base/net.h" /* llmdd__sockaddr */
#include "meta/meta.h"   /* the metadata options' limits */

#define LLMDD_OPT_LISTEN "llm.ListenIpInfo"
#define LLMDD_OPT_DEVICE_ID "llm.DeviceId"
#define LLMDD_OPT_WAIT_TIME "llm.SyncKvCacheWaitTime"
#define LLMDD_OPT_HOST_POOL "llm.HostMemPoolConfig"
#define LLMDD_OPT_DEVICE_POOL "llm.MemPoolConfig"
#define LLMDD_OPT_TRANSPORT "llm.Transport"
#define LLMDD_OPT_AUTH_TOKEN "llm.AuthToken"
#define LLMDD_OPT_MAX_LINKS "llm.MaxLinks"
#define LLMDD_OPT_TCP_LANES "llm.TcpLanes"
#define LLMDD_OPT_HB_INTERVAL "llm.HeartbeatInterval"
#define LLMDD_OPT_HB_MISSES "llm.HeartbeatMisses"
#define LLMDD_OPT_META_SERVER "llm.MetadataServer"
#define LLMDD_OPT_META_PREFIX "llm.MetadataPrefix"
#define LLMDD_OPT_META_LEASE "llm.MetadataLeaseMs"

/* Defaults are in options.c's table of keys (llmdd_option_info). */
#define LLMDD_MAX_WAIT_MS 86400000u /* one day */
#define LLMDD_AUTH_TOKEN_MAX 1024
#define LLMDD_TRANSPORT_NAME_MAX 16
#define LLMDD_MAX_LINKS_MAX 65535u
#define LLMDD_TCP_LANES_MAX 16
#define LLMDD_HB_MISSES_MAX 100
/* llm.TcpLanes=auto to a peer that is not on loopback (tcp.c) */
#define LLMDD__TCP_LANES_AUTO 4

typedef struct {
    uint64_t memory_size; /* bytes, a multiple of the page */
    uint32_t page_shift;
} llmdd__pool_config;

typedef struct {
    bool listen;
    llmdd__sockaddr listen_addr;
    uint32_t device_id;
    uint32_t wait_ms;
    bool host_pool;
    llmdd__pool_config host_pool_config;
    bool device_pool;
    llmdd__pool_config device_pool_config;
    char transport[LLMDD_TRANSPORT_NAME_MAX]; /* "auto" or a transport name */
    char *auth_token;                         /* NULL: none; owned */
    uint32_t max_links; /* links a server accepts; see llmdd__max_links_auto */
    int tcp_lanes;      /* llm.TcpLanes: 1..LLMDD_TCP_LANES_MAX; 0: auto */
    bool max_links_auto; /* llm.MaxLinks=auto: max_links follows tcp_lanes */
    uint32_t hb_ms;      /* llm.HeartbeatInterval; 0: this side sends none */
    uint32_t hb_misses;  /* llm.HeartbeatMisses */
    char *meta_server;   /* llm.MetadataServer; NULL: none; owned */
    char meta_prefix[LLMDD_META_PREFIX_MAX + 1]; /* llm.MetadataPrefix */
    uint32_t meta_lease_ms;                      /* llm.MetadataLeaseMs */
} llmdd__options;

/*
 * TCP_USER_TIMEOUT for every connection of an instance with these options:
 * interval x (misses + 1), or the wait time when heartbeats are off.
 */
uint32_t llmdd__user_timeout_ms(const llmdd__options *o);

/*
 * llm.MaxLinks=auto: what the fd limit allows, keeping 64 for the
 * application and counting what a link holds with tcp_lanes (0: auto, as
 * to a remote peer): the control connection, N + 1 data connections each
 * way, shm's socket; at least 8. 16..1024.
 */
uint32_t llmdd__max_links_auto(int tcp_lanes);

/* Every key at its documented default. */
void llmdd__options_init(llmdd__options *o);
void llmdd__options_fini(llmdd__options *o);

/*
 * Applies options on top of *o. All values are checked first; on any bad
 * value *o is left unchanged and LLM_PARAM_INVALID is returned. Unknown keys
 * are logged and ignored. A NULL key or value is LLM_PARAM_INVALID.
 */
llmdd_status llmdd__options_apply(llmdd__options *o,
                                  const llmdd_option *options, size_t n);

/* "a.b.c.d:port" or "[v6]:port", port 0..65535 (0: the kernel picks). */
llmdd_status llmdd__parse_listen(const char *s, llmdd__sockaddr *out);
/* A textual IPv4 or IPv6 address (no brackets) and a port 1..65535. */
llmdd_status llmdd__parse_ip_info(const llmdd_ip_info *info,
                                  llmdd__sockaddr *out);
/* All digits, > 0, <= LLMDD_MAX_WAIT_MS. */
llmdd_status llmdd__parse_wait_time(const char *s, uint32_t *ms_out);
/* All digits, fits in uint32. */
llmdd_status llmdd__parse_u32(const char *s, uint32_t *out);
/* {"memory_size": N, "page_shift": S}; S in 12..30 (default 16). */
llmdd_status llmdd__parse_pool(const char *s, llmdd__pool_config *out);

#endif
