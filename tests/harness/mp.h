/*
 * Helpers shared by the multi-process tests: peer processes that are always
 * reaped (even when an assertion fails mid-test), pulls checked byte for
 * byte, bounded polling, and whether a listening socket (th_socket) has a
 * connection waiting. Not thread-safe except where a comment says so; tests
 * use them from the main thread.
 */
#ifndef LLMDD_TESTS_MP_H
#define LLMDD_TESTS_MP_H

#include "harness/harness.h"

#define MP_IP "127.0.0.1"
#define MP_SELF 100 /* the decoder's cluster id in these tests */

/*
 * Starts peer_helper as cluster `cluster` with extra arguments
 * (NULL-terminated, may be NULL) and fails the test if it does not come up.
 * The th_proc lives in a table here, so that mp_reap_all can still find it
 * after an assertion has left the test function.
 */
th_proc *mp_peer_start(uint64_t cluster, const char *const *extra);
/* SIGKILLs (after SIGCONT) and reaps every peer still running; empties
 * the table. Call it from each test's teardown. */
void mp_reap_all(void);
/* Kills one peer with SIGKILL and reaps it. */
void mp_peer_kill(th_proc *p);
/*
 * SIGSTOPs a peer and returns once every thread of it is stopped: kill()
 * only queues the stop, and a thread already running could still answer.
 */
void mp_peer_stop(th_proc *p);

/* A decoder (role Decoder, not listening) initialized with opts. */
llmdd *mp_decoder(uint64_t cluster, const llmdd_option *opts, size_t n);

/*
 * Pulls every slot of the peer's cache `id` (th_desc_kv, filled with seed)
 * into a fresh local cache and checks every byte; returns the first failing
 * status. A success with wrong bytes fails the test.
 */
llmdd_status mp_pull_check(llmdd *dd, uint64_t cluster, int64_t id,
                           uint32_t seed);
/* One pull of slot 0 of cache `id` into a scratch cache: just the status. */
llmdd_status mp_pull_status(llmdd *dd, uint64_t cluster, int64_t id);
/* Repeats mp_pull_status until it returns `want` or timeout_ms passes. */
llmdd_status mp_wait_pull_status(llmdd *dd, uint64_t cluster, int64_t id,
                                 llmdd_status want, int timeout_ms);

/* Whether a connection is waiting in a listening socket's backlog. */
bool mp_conn_pending(int lfd);

#endif
