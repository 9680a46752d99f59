/*
 * The shared test harness: deterministic cache contents, the standard cache
 * layouts, listening on a free port, linking, and peer processes
 * (peer_helper) driven over a pipe. The process and time helpers beneath
 * them, which every test directory uses, are in proc.h. Not thread-safe;
 * tests use it from their main thread.
 */
#ifndef LLMDD_TESTS_HARNESS_H
#define LLMDD_TESTS_HARNESS_H

#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <sys/types.h>

#include <cmocka.h>
#include <llmdd/llmdd.h>

#include "harness/proc.h"

#define TH_SKIP 77 /* exit code CTest reports as skipped */

/* `./test NAME` runs only the cases matching NAME (cmocka's glob filter). */
static inline void
th_test_filter(int argc, char **argv)
{
    if (argc > 1)
        cmocka_set_test_filter(argv[1]);
}

/* The byte at `off` of tensor `t` of a cache filled with `seed`. */
static inline uint8_t
th_byte(uint32_t seed, uint32_t t, uint64_t off)
{
    return (uint8_t)(seed * 97u + t * 13u + (uint32_t)off * 7u +
                     (uint32_t)(off >> 9));
}

uint64_t th_tensor_size(const llmdd_cache_desc *d);
void th_fill_buf(uint8_t *buf, uint64_t len, uint32_t seed, uint32_t t);
void th_fill(const llmdd_cache *c, uint32_t seed);
/* Index of the first byte that differs from the pattern, or -1. */
int64_t th_check_buf(const uint8_t *buf, uint64_t len, uint32_t seed,
                     uint32_t t);
/*
 * th_check_buf out of ThreadSanitizer's sight, for bytes a peer process
 * pushed: a serving thread of this process wrote them, and what orders the
 * check after them runs through the other process, which TSan cannot see.
 * The serving thread lets go of the cache just after its reply, so the
 * check can come first; TSan then reports every byte, and its handling of
 * millions of racy addresses ran for minutes (CI's TSan stage timed out).
 */
int64_t th_check_pushed(const uint8_t *buf, uint64_t len, uint32_t seed,
                        uint32_t t);

/* Standard layouts: 8 tensors (4 layers of K and V) each. */
llmdd_cache_desc th_desc_kv(void);     /* fp16 [4,16,32]: stride 1024 */
llmdd_cache_desc th_desc_blocks(void); /* bf16 [64,128]: stride 256 */
llmdd_cache_desc th_desc_small(void);  /* fp16 [4,8,32]: stride 512 */

/* The standard caches of a peer, filled with seeds 1..4. */
typedef struct {
    int64_t kv, reg, blocks, small;
    uint8_t *reg_mem; /* the registered cache's memory */
} th_peer_caches;

int th_peer_setup(llmdd *dd, th_peer_caches *pc);
void th_peer_teardown(llmdd *dd, th_peer_caches *pc);

/*
 * Initializes dd listening on ip at a port the kernel picks (port 0), with
 * the extra options. Returns the initialize status; *port_out on success.
 */
llmdd_status th_init_listen(llmdd *dd, const char *ip, uint16_t *port_out,
                            const llmdd_option *extra, size_t nextra);

/*
 * The value of an instance's metric whose name and labels are exactly
 * `series` (llmdd_metrics_text); -1 when it has no such line.
 */
int64_t th_metric(llmdd *dd, const char *series);

/* One address of a prompt cluster `id`; ipi is where the address lives. */
llmdd_cluster_info th_cluster(uint64_t id, llmdd_ip_info *ipi, const char *ip,
                              uint16_t port);
llmdd_status th_link(llmdd *dd, uint64_t cluster, const char *ip,
                     uint16_t port, int timeout_ms);
/*
 * th_link, again while it says LLM_ALREADY_LINK (a link just lost is still
 * being dropped) until timeout_ms passes; each try may take timeout_ms.
 */
llmdd_status th_link_retry(llmdd *dd, uint64_t cluster, const char *ip,
                           uint16_t port, int timeout_ms);
llmdd_status th_unlink(llmdd *dd, uint64_t cluster, const char *ip,
                       uint16_t port, bool force, int timeout_ms);

/* A peer_helper process. */
typedef struct {
    pid_t pid;
    FILE *in;  /* its stdin */
    FILE *out; /* its stdout */
    uint16_t port;
    th_peer_caches ids;
} th_proc;

/*
 * Starts peer_helper with the given arguments (NULL-terminated, may be NULL),
 * optionally prefixed by a wrapper command (e.g. "ip netns exec ns"), and
 * waits for its READY line. Returns 0 on success.
 */
int th_proc_start(th_proc *p, const char *const *wrapper,
                  const char *const *args);
/* Sends one command line; reads one reply line into reply. 0 when "OK". */
int th_proc_cmd(th_proc *p, const char *cmd, char *reply, size_t cap);
/* The two halves of th_proc_cmd, to do something while it works. */
int th_proc_send(th_proc *p, const char *cmd);
int th_proc_reply(th_proc *p, char *reply, size_t cap);
void th_proc_kill(th_proc *p, int sig);
/* Closes its stdin and reaps it; returns its exit status or -1. */
int th_proc_stop(th_proc *p);

#endif
