/*
 * The socket data plane's private header: shared by its files (stream.c: the
 * scatter/gather helpers, the serving side, setup and teardown;
 * stream_xfer.c: the requesting side, its connection pool and striping),
 * included by nothing else. stream.c's opening comment describes the design
 * and the locking.
 */
#ifndef LLMDD_TRANSPORT_STREAM_STREAM_INT_H
#define LLMDD_TRANSPORT_STREAM_STREAM_INT_H

#include <errno.h>
#include <limits.h>
#include <poll.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <unistd.h>

#include "core/internal.h"
#include "base/net.h"
#include "base/wire.h"
#include "transport/serve.h"
#include "transport/stream/stream.h"

struct llmdd__stream {
    llmdd__link *link;
    int nfwd, nrev; /* requester connections allowed: client, server */
    int lanes;      /* connections one transfer of ours may stripe over */
    pthread_mutex_t lock;
    pthread_cond_t cond;
    int idle[LLMDD__STREAM_CONNS_MAX]; /* idle requester connections */
    int nidle;
    int nconns; /* requester connections open, idle or busy */
    int busy[LLMDD__STREAM_CONNS_MAX];
    int nbusy;
    /* Connections being served; a conn's cache_id is whose memory the
     * request in progress moves (serve_mark). */
    llmdd__serve_set serve;
    bool down;
    /*
     * Lane threads (stream_xfer.c): the lanes of a striped transfer other
     * than the caller's run on them. Started as lanes need them, up to
     * LLMDD__STREAM_CONNS_MAX, and kept while transfers come, so a striped
     * transfer (a layer of a layer-wise push) starts no thread; one idle
     * for LLMDD__STREAM_LANE_IDLE_MS ends, and whoever next takes the lock
     * to start or stop threads joins it (lane_gone). Guarded by lane_lock.
     */
    pthread_mutex_t lane_lock;
    pthread_cond_t lane_work, lane_done;
    struct llmdd__lane *lane_head, *lane_tail; /* lanes waiting for one */
    pthread_t lane_thr[LLMDD__STREAM_CONNS_MAX];
    pthread_t lane_gone[LLMDD__STREAM_CONNS_MAX]; /* ended, not joined */
    int nlane_gone;
    int nlane_thr, lane_idle;
    int lane_nqueued; /* lanes in the queue: idle threads not yet awake */
    bool lane_stop;
};

/*
 * A position in (tensor, run, element) segments, for scatter/gather I/O
 * (stream.c). Run i is cnts[i * step] elements of lens[i * step] bytes, the
 * k-th at offs[i * step] + k * strides[i * step] in each tensor.
 */
typedef struct {
    uint8_t *const *bases; /* per tensor */
    uint32_t count;
    const uint64_t *offs;
    const uint64_t *lens;
    const uint64_t *cnts; /* NULL: one element a run */
    const uint64_t *strides;
    size_t step;
    size_t nruns;
    /* position */
    uint32_t t;
    size_t r;
    uint64_t e;    /* element of run r */
    uint64_t done; /* bytes done in the current element */
} seg_iter;

/* stream.c (their comments are there) */
/* Puts a data connection in blocking mode; a requester's gets the receive
 * timeout its waits rely on (stream.c's opening comment). */
void llmdd__stream_conn_mode(int fd, bool requester);
int llmdd__stream_seg_io(llmdd *dd, int fd, seg_iter *it, bool send,
                         int64_t deadline, int stall_ms, struct iovec *pre,
                         size_t npre);
/* The serving side's read of the next request (also the fuzz target's). */
#define LLMDD__STREAM_SERVE_FIRST (LLMDD_WIRE_HDR_LEN + 256)
int llmdd__stream_serve_next(llmdd *dd, int fd, uint8_t *buf, uint16_t *type,
                             const uint8_t **body, size_t *len, size_t *extra);
int llmdd__stream_recv_reply(llmdd *dd, int fd, struct iovec *rv,
                             seg_iter *it, int64_t deadline);

/* stream_xfer.c: puts a requester connection back in the pool. */
void llmdd__stream_pool_put_idle(llmdd__stream *s, int fd);
#define LLMDD__STREAM_LANE_IDLE_MS 5000
/* stream_xfer.c: the lane threads, at the data plane's creation and end
 * (no transfer may be in progress at the end). */
void llmdd__stream_lanes_init(llmdd__stream *s);
void llmdd__stream_lanes_fini(llmdd__stream *s);

#endif /* LLMDD_TRANSPORT_STREAM_STREAM_INT_H */
