/*
 * Per-instance metrics (docs/operations.md lists every one). Counters are
 * relaxed atomics in fixed arrays indexed by (side, operation, transport
 * slot, status), so the transfer path takes no lock and allocates nothing;
 * gauges that the registries already know (links, caches) are counted when
 * the text is rendered instead of being kept twice.
 *
 * Thread-safe: every hook may be called from any thread at any time while
 * the instance exists; llmdd_metrics_text reads a consistent-enough view
 * (each counter is exact, counters are not read at one instant).
 */
#ifndef LLMDD_CORE_METRICS_H
#define LLMDD_CORE_METRICS_H

#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>

#include <llmdd/llmdd.h>

struct llmdd_transport_ops;

/* The operations, in label order: one list for the enum and the names. */
#define LLMDD__METRICS_OPS(XX)                                                 \
    XX(PULL, "pull")                                                           \
    XX(PUSH, "push")                                                           \
    XX(PULL_BLOCKS, "pull_blocks")                                             \
    XX(PUSH_BLOCKS, "push_blocks")                                             \
    XX(COPY, "copy")

enum llmdd__metrics_op {
#define LLMDD__OP_ENUM(id, name) LLMDD__OP_##id,
    LLMDD__METRICS_OPS(LLMDD__OP_ENUM)
#undef LLMDD__OP_ENUM
        LLMDD__OP_COUNT
};

/*
 * Latency buckets: upper bound in nanoseconds and its `le` label. 1 us to
 * 10 s in 1 / 2.5 / 5 steps, so a 4 KiB shm pull (microseconds) and a
 * multi-GiB tcp push (seconds) both land in buckets that tell them apart.
 */
#define LLMDD__METRICS_BUCKETS(XX)                                             \
    XX(1000ull, "1e-06")                                                       \
    XX(2500ull, "2.5e-06")                                                     \
    XX(5000ull, "5e-06")                                                       \
    XX(10000ull, "1e-05")                                                      \
    XX(25000ull, "2.5e-05")                                                    \
    XX(50000ull, "5e-05")                                                      \
    XX(100000ull, "0.0001")                                                    \
    XX(250000ull, "0.00025")                                                   \
    XX(500000ull, "0.0005")                                                    \
    XX(1000000ull, "0.001")                                                    \
    XX(2500000ull, "0.0025")                                                   \
    XX(5000000ull, "0.005")                                                    \
    XX(10000000ull, "0.01")                                                    \
    XX(25000000ull, "0.025")                                                   \
    XX(50000000ull, "0.05")                                                    \
    XX(100000000ull, "0.1")                                                    \
    XX(250000000ull, "0.25")                                                   \
    XX(500000000ull, "0.5")                                                    \
    XX(1000000000ull, "1")                                                     \
    XX(2500000000ull, "2.5")                                                   \
    XX(5000000000ull, "5")                                                     \
    XX(10000000000ull, "10")

#define LLMDD__METRICS_COUNT1(...) +1
/* Finite buckets, plus one slot for +Inf. */
#define LLMDD__METRICS_NBUCKETS                                                \
    (0 LLMDD__METRICS_BUCKETS(LLMDD__METRICS_COUNT1) + 1)
/* Every LLM_* status, plus one slot for a value outside the list. */
#define LLMDD__METRICS_NSTATUS (0 LLMDD_STATUS_MAP(LLMDD__METRICS_COUNT1) + 1)
/*
 * Transport slots: the registry's transports by their index, then "local"
 * (a copy, no transport) and "none" (a transfer that ended before a link
 * and its transport were found).
 */
#define LLMDD__METRICS_NTP 8
#define LLMDD__METRICS_TP_LOCAL (LLMDD__METRICS_NTP - 2)
#define LLMDD__METRICS_TP_NONE (LLMDD__METRICS_NTP - 1)

/* side 0: transfers this instance called; 1: requests it served to peers. */
#define LLMDD__METRICS_NSIDE 2

typedef _Atomic uint64_t llmdd__counter;

typedef struct llmdd__metrics {
    /* Side 0 counts successes in hist only: one atomic less per call. */
    llmdd__counter xfers[LLMDD__METRICS_NSIDE][LLMDD__OP_COUNT]
                        [LLMDD__METRICS_NTP][LLMDD__METRICS_NSTATUS];
    llmdd__counter bytes[LLMDD__METRICS_NSIDE][LLMDD__OP_COUNT]
                        [LLMDD__METRICS_NTP][LLMDD__METRICS_NSTATUS];
    /* Successful calls only; bucket counts are per bucket, not cumulative. */
    llmdd__counter hist[LLMDD__OP_COUNT][LLMDD__METRICS_NTP]
                       [LLMDD__METRICS_NBUCKETS];
    llmdd__counter hist_ns[LLMDD__OP_COUNT][LLMDD__METRICS_NTP];
    llmdd__counter begun; /* calls begun; in flight: begun - ended */
    llmdd__counter link_attempts[LLMDD__METRICS_NSTATUS];
    llmdd__counter links_up, links_down;
    llmdd__counter notify_sent, notify_recv;
    llmdd__counter heartbeat_drops; /* links dropped for silence */
    llmdd__counter breaches;        /* links dropped: the peer broke the protocol */
} llmdd__metrics;

/*
 * A transfer call begins: counts it in flight and returns its start stamp
 * (opaque), which the matching llmdd__metrics_xfer takes.
 */
uint64_t llmdd__metrics_begin(llmdd *dd);
/*
 * The call that began at stamp t0 ended with `st`. ops: the link's transport,
 * NULL when none was reached (ignored for a copy). bytes: what the call
 * covers, whether or not it all moved.
 */
void llmdd__metrics_xfer(llmdd *dd, enum llmdd__metrics_op op,
                         const struct llmdd_transport_ops *ops, llmdd_status st,
                         uint64_t bytes, uint64_t t0_ns);
/* Serving side: one request of a peer (a read: its pull) was answered. */
void llmdd__metrics_served(llmdd *dd, const struct llmdd_transport_ops *ops,
                           bool write, llmdd_status st, uint64_t bytes);
/* One llmdd_link_clusters attempt of ours ended with st. */
void llmdd__metrics_link_attempt(llmdd *dd, llmdd_status st);
/* A link became visible (up) or left the link table. */
void llmdd__metrics_link_event(llmdd *dd, bool up);
/* A link dropped because its peer's heartbeats stopped. */
void llmdd__metrics_heartbeat_drop(llmdd *dd);
/* A link dropped because its peer broke the protocol (llmdd__link_breach). */
void llmdd__metrics_breach(llmdd *dd);
/* A notification was sent (sent) or received. */
void llmdd__metrics_notify(llmdd *dd, bool sent);

#endif
