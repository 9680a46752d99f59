/*
 * Helpers for the fault, hostile-input, load and auth tests: /proc readings
 * of a process, a raw wire client (frames, the control handshake, data
 * connections), a recording TCP relay, and the time bounds that every call
 * is checked against. Child processes with a line protocol and deadlines
 * are harness/proc.h's th_child. Not thread-safe unless a function says so.
 */
#ifndef LLMDD_TESTS_FAULT_UTIL_H
#define LLMDD_TESTS_FAULT_UTIL_H

#include <pthread.h>
#include <stdbool.h>

#include "base/wire.h"
#include "harness/harness.h"

#if defined(__SANITIZE_THREAD__)
#define FU_SLOW 8 /* TSan */
#elif defined(__SANITIZE_ADDRESS__)
#define FU_SLOW 3
#else
#define FU_SLOW 1
#endif

/* An integer from the environment, or def when unset or invalid. */
long fu_env(const char *name, long def);

/*
 * What a fake peer announces in its handshake: no heartbeats (it sends
 * none, so the instance must never declare it dead for silence), a window
 * of 128 notifications, and as a server 5 data connections each way.
 */
#define FU_TERMS ((llmdd__link_terms){.hb_ms = 0, .notify_window = 128})
#define FU_SERVER_TERMS                                                        \
    ((llmdd__link_terms){.hb_ms = 0, .notify_window = 128, .conns_max = 5})
/*
 * The slack a call may take past its wait time: scheduling on a loaded
 * 2-core machine, more under sanitizers. LLMDD_FAULT_MARGIN_MS overrides.
 */
int fu_margin_ms(void);
/* A small PRNG (xorshift), seeded from LLMDD_FAULT_SEED or the clock. */
uint64_t fu_seed(void);
uint32_t fu_rand(uint64_t *state);

/* Where the fault_decoder helper is: LLMDD_FAULT_DECODER. */
const char *fu_decoder_path(void);

/* /proc/<pid>/status field in kB or count (VmRSS, Threads); -1 if absent. */
long fu_proc_status(pid_t pid, const char *field);
int fu_fd_count(pid_t pid);
/*
 * Waits until the process has at most max_fds fds and max_threads threads,
 * or timeout_ms passes; returns true when it got there.
 */
bool fu_settles(pid_t pid, int max_fds, long max_threads, int timeout_ms);

/* ---- The raw wire client. ---- */

/* A blocking TCP connection to 127.0.0.1:port, or -1. */
int fu_connect(uint16_t port);
int fu_send_all(int fd, const void *buf, size_t len);
int fu_send_frame(int fd, uint16_t type, const void *payload, size_t len);
/* 0, or -1 on EOF, error or timeout (errno ETIMEDOUT for the latter). */
int fu_recv_all(int fd, void *buf, size_t len, int timeout_ms);
int fu_recv_frame(int fd, uint16_t *type, uint8_t *buf, size_t cap,
                  size_t *len, int timeout_ms);
/* Whether the peer closed fd (EOF or reset) within timeout_ms. */
bool fu_closed_within(int fd, int timeout_ms);

/*
 * The control handshake of a peer that has no auth token, as cluster
 * `cluster` with the given transport. Returns the control fd and the link
 * token, or -1 with *status the peer's refusal (LLM_FAILED: no answer).
 */
int fu_raw_link(uint16_t port, uint64_t cluster, const char *transport,
                uint8_t token[16], uint32_t *status);
/* The same, announcing `terms` (fu_raw_link announces FU_TERMS). */
int fu_raw_link_terms(uint16_t port, uint64_t cluster, const char *transport,
                      llmdd__link_terms terms, uint8_t token[16],
                      uint32_t *status);
/* A data connection for a link token; returns the fd, or -1 and *status. */
int fu_raw_data(uint16_t port, const uint8_t token[16], uint32_t flags,
                uint32_t *status);

/* ---- A recording relay: 127.0.0.1:port -> 127.0.0.1:target. ---- */

typedef struct fu_relay fu_relay;

fu_relay *fu_relay_start(uint16_t target, uint16_t *port);
/* Stops it, closes every connection, and returns what passed both ways. */
uint8_t *fu_relay_stop(fu_relay *r, size_t *len, int *conns);

#endif
