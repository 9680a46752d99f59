/*
 * A real etcd for the discovery tests (Debian's etcd-server): started on
 * loopback with free ports and a temporary data directory, stopped and
 * restarted (with its data or wiped), always reaped and removed; keys and
 * leases written as an operator would. A proxy that can cut one node off
 * from it. And a fake gateway, a hostile peer that answers every request
 * with what the test chose. Not thread-safe; tests use them from the main thread.
 */
#ifndef LLMDD_TESTS_ETCD_UTIL_H
#define LLMDD_TESTS_ETCD_UTIL_H

#include <stdbool.h>
#include <stdint.h>
#include <sys/types.h>

typedef struct {
    pid_t pid;
    uint16_t client, peer;
    char dir[128];    /* holds data/ and etcd.log */
    char server[64];  /* "etcd://127.0.0.1:PORT", llm.MetadataServer */
    char opt[96];     /* "llm.MetadataServer=etcd://...", for peer_helper */
} te_etcd;

/* Exits the test program with 77 (skipped) when etcd is not installed. */
void te_etcd_require(void);
/* Starts etcd and waits until it answers; fails the test otherwise. */
void te_etcd_start(te_etcd *e);
/* Stops it with sig (SIGKILL, SIGTERM) and reaps it. */
void te_etcd_stop(te_etcd *e, int sig);
/* Starts it again on the same ports, with its data or with none. */
void te_etcd_restart(te_etcd *e, bool wipe);
/* Deletes key as an operator would (the gateway's deleterange); 0 when
 * etcd answered. */
int te_etcd_delete(te_etcd *e, const char *key);
/* Stops it and removes its directory; safe to call twice. */
void te_etcd_destroy(te_etcd *e);

/* What an operator or another writer does with etcdctl, through the
 * gateway; each fails the test when etcd does not answer. */
/* A lease of ttl_s seconds; its id. */
int64_t te_etcd_grant(te_etcd *e, int ttl_s);
void te_etcd_revoke(te_etcd *e, int64_t lease);
/* Puts key = value, under lease (0: none). */
void te_etcd_put(te_etcd *e, const char *key, const char *value,
                 int64_t lease);
/* key's value (NUL-terminated, up to cap - 1 bytes) and its version (puts
 * since it was created); false when the key does not exist. */
bool te_etcd_get(te_etcd *e, const char *key, char *value, size_t cap,
                 int64_t *version);

/*
 * A TCP proxy on a free loopback port to 127.0.0.1:to (one node's way to
 * etcd), served by a thread until te_proxy_stop (safe to call twice). A
 * blackhole passes nothing either way and answers nothing, with every
 * connection held open (as a partition does: no reset, no close); once it
 * ends, what waited is passed on.
 */
uint16_t te_proxy_start(uint16_t to);
void te_proxy_blackhole(bool on);
void te_proxy_stop(void);

/* The fake gateway: what it answers. */
enum te_fake_mode {
    TE_FAKE_MALFORMED, /* a body cut in the middle of the JSON */
    TE_FAKE_OVERSIZED, /* 2 MiB of JSON */
    TE_FAKE_BAD_VALUE, /* a range whose value is not an entry */
    TE_FAKE_UNKNOWN,   /* valid answers full of fields etcd never sends */
    TE_FAKE_HTTP404,   /* an error answer */
    TE_FAKE_BIG_VALUE, /* a range whose value is 8 KiB (entries: 4 KiB) */
};
/*
 * Serves on a free loopback port until te_fake_stop. With TE_FAKE_UNKNOWN,
 * lookups of any key answer an entry of cluster `cluster` at ip:port.
 */
uint16_t te_fake_start(enum te_fake_mode mode, uint64_t cluster,
                       const char *ip, uint16_t port);
void te_fake_stop(void);
/* Requests it answered. */
int te_fake_count(void);

#endif
