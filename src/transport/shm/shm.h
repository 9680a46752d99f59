/*
 * What the shm transport shows of itself besides its ops table: counters of
 * the paths its transfers took, process-wide, so that tests and tools can
 * tell a shared-memory copy from a cross-memory attach or a fallback to the
 * socket data plane. Thread-safe.
 */
#ifndef LLMDD_TRANSPORT_SHM_SHM_H
#define LLMDD_TRANSPORT_SHM_SHM_H

#include <stdint.h>

typedef struct {
    uint64_t memfd_xfers;  /* a memcpy through a mapping of the peer's memfd */
    uint64_t cma_xfers;    /* process_vm_readv / process_vm_writev */
    uint64_t cma_split;    /* of those, moved by two threads (large ones) */
    uint64_t copy_split;   /* memfd copies shared with the instance's
                              assist thread */
    uint64_t assist_claims; /* claims of those the assist thread moved */
    uint64_t stream_xfers; /* over the socket data plane */
    uint64_t cma_refused;  /* caches whose cross-memory attach was refused */
} llmdd__shm_stats;

void llmdd__shm_stats_get(llmdd__shm_stats *out);

#endif
