/*
 * The ucx transport's private header: shared by its files (ucx.c, ucx_ctx.c,
 * ucx_am.c, ucx_ep.c, ucx_serve.c, ucx_xfer.c), included by nothing else.
 * ucx.c's opening comment describes the design and the locking.
 */
#ifndef LLMDD_TRANSPORT_UCX_UCX_INT_H
#define LLMDD_TRANSPORT_UCX_UCX_INT_H

#include <errno.h>
#include <poll.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include <ucp/api/ucp.h>

#include "core/internal.h"
#include "base/net.h"
#include "base/codec.h"
#include "base/wire.h"
#include "transport/serve.h"
#include "transport/ucx/ucx_wire.h"

#define UCX_EPS 4          /* request endpoints: concurrent transfers a link */
#define UCX_WINDOW 1024    /* operations in flight per transfer (2^n) */
#define UCX_WINDOW_BITS 10
#define UCX_AM_BYTES (8u << 20) /* active-message mode: bytes asked at once */
#define UCX_SERVE_MAX 4    /* connections served at once per link */
#define UCX_STALL_MS 5000  /* a serving side gives up on a peer this silent */
#define UCX_REVOKE_MS 5000 /* an owner waits this long for REVOKE_ACK */
#define UCX_CLOSE_WARN_MS 5000
#define UCX_SPIN_US 50   /* the progress thread polls this long after work */
#define UCX_SLICE_US 200 /* and holds the lock at most about this long */
#define UCX_FAIR_US 2000 /* busy this long with waiters: a real pause */
#define UCX_PAUSE_NS 100000
#define UCX_FLAG_HELLO 1u /* the first FWD connection: address exchange */
#define UCX_FLAG_REV 2u   /* the server's request connection */
#define UCX_SMALL_MSG 64
/* A pull of at least this many runs averaging under UCX_GATHER_SMALL bytes,
 * whose span per tensor is at most UCX_GATHER_DENSITY times the bytes asked
 * and at most UCX_GATHER_MAX, reads the span once (ucx_gather_span). */
#define UCX_GATHER_MIN_RUNS 64
#define UCX_GATHER_SMALL 4096
#define UCX_GATHER_DENSITY 4
#define UCX_GATHER_MAX (64ull << 20)
#define UCX_GATHER_BATCH (64ull << 20) /* bounce buffer per round */

/* What probing UCX found, once per process (llmdd__ucx_probe). */
typedef struct {
    bool ok;        /* UCX initialises */
    bool rdma;      /* it found an RDMA-capable transport */
    bool peer_mode; /* and one with peer failure handling (tcp, IB) */
    bool tcp;       /* tcp is among the transports */
    int rma_env;    /* LLMDD_UCX_RMA: 1 always RMA, 0 never, -1 auto */
    char info[1024];
} ucx_probe;

/* ---- Per-link state. ---- */

typedef struct ucx_link ucx_link;

/* One transfer's operations in flight. */
typedef struct {
    ucx_link *ul;
    size_t outstanding; /* posted, not yet completed */
    size_t wake_at;     /* signal the requester at or below this */
    size_t bytes;       /* asked for with active messages, not yet answered */
    ucs_status_t status;
    llmdd_status refused; /* what the serving side answered, if not success */
} ucx_xstate;

/*
 * An active-message GET or PUT in flight (docs/rdma.md): found again by the
 * tag in the peer's DATA or ACK, whose low UCX_WINDOW_BITS are its index.
 */
typedef struct {
    uint8_t hdr[LLMDD_UCX_AMREQ_SIZE]; /* UCX reads it until the send goes */
    uint64_t tag;                      /* 0: free */
    uint8_t *dst;                      /* GET: where the bytes go */
    size_t len;
    ucx_xstate *xs;
} ucx_amop;

typedef struct {
    ucx_link *ul;
    ucp_worker_h w; /* the slot's request worker; NULL until first used */
    int efd;        /* its event fd, -1 without wakeup */
    ucp_ep_h ep;    /* NULL: none open */
    uint32_t gen;   /* bumped whenever the slot's endpoint is closed */
    bool busy;    /* a transfer owns it */
    bool failed;  /* its error callback fired */
    bool closing; /* we are closing it: errors on it are ours */
    bool peer_mode; /* created with UCP_ERR_HANDLING_MODE_PEER */
    bool ponged;    /* the peer answered our PING on this endpoint */
    ucx_amop *ops;  /* UCX_WINDOW, with the worker */
    uint16_t *free_ops;
    int nfree;
    uint64_t tags; /* issued */
} ucx_ep;

/* Owner side: one of our caches as this link's peer sees it. */
typedef struct ucx_reg {
    int64_t id;
    uint32_t nregions;
    ucp_mem_h *memh;
    void **rkey; /* packed, from ucp_rkey_pack */
    size_t *rkey_len;
    uint64_t *base, *len;
    uint32_t *treg; /* region of each tensor */
    int busy;       /* a QUERY is answering from it */
    int sending;    /* DATA replies that read it, not yet completed */
    bool mapped, sent, removed;
    struct ucx_reg *next;
} ucx_reg;

/* Requester side: rc->priv, the peer's cache as the QUERY described it. */
typedef struct ucx_rc {
    ucx_link *ul; /* NULL once the link is finished */
    int64_t id;
    uint32_t nregions, ntensors;
    uint8_t **rkey_buf;
    uint32_t *rkey_len;
    uint64_t *taddr;
    uint32_t *treg;
    ucp_rkey_h *rkeys[UCX_EPS]; /* unpacked per endpoint slot */
    uint32_t gen[UCX_EPS];
    int inflight; /* transfers using it */
    bool revoked; /* the owner took it back: no more transfers */
    struct ucx_rc *prev, *next;
} ucx_rc;

struct ucx_link {
    llmdd__link *link;
    pthread_mutex_t lock;
    pthread_cond_t cond; /* CLOCK_MONOTONIC; any state change */
    pthread_mutex_t map_lock;
    ucp_context_h ctx;
    ucp_worker_h sw; /* the serve worker; NULL once torn down */
    int sefd;        /* its event fd */
    bool wakeup;     /* workers have event fds */
    bool rma;        /* RMA, not active messages, moves the bytes */
    uint64_t key;    /* requests to our serve worker must carry it */
    uint64_t peer_key;  /* and ours to the peer's, this */
    bool stranger_seen; /* a request without the key was logged */
    int wake_fd;
    uint8_t *peer_addr; /* the peer's serve worker; NULL before UCX_HELLO */
    size_t peer_addr_len;
    ucx_ep eps[UCX_EPS];
    int users; /* transfers: the progress thread stays while any runs */
    int waiters; /* threads in ucx_wait_until */
    bool down, failed, drop_asked;
    bool progress_started, torn_down;
    ucx_reg *regs;
    ucx_rc *rcs;
    /* The request connection: FWD on the client, REV on the server. */
    int req_fd;
    bool req_busy;
    uint64_t seq;
    llmdd__serve_set serve; /* under lock */
    bool hello_done;
};

static inline uint64_t
ucx_cluster(const ucx_link *ul)
{
    return ul->link->peer.cluster_id;
}

/* Waits on ul->cond (lock held) until woken or the deadline; counted, so
 * that a busy progress thread lets go of the lock now and then (see
 * llmdd__ucx_progress_main). */
static inline void
ucx_wait_until(ucx_link *ul, int64_t deadline)
{
    ul->waiters++;
    llmdd__cond_wait_until(&ul->cond, &ul->lock, deadline);
    ul->waiters--;
}

static inline int64_t
ucx_now_us(void)
{
    struct timespec ts;

    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000 + ts.tv_nsec / 1000;
}

static inline void
ucx_wake(ucx_link *ul)
{
    uint64_t one = 1;

    (void)!write(ul->wake_fd, &one, sizeof(one));
}

/* ucx.c */
void llmdd__ucx_rc_drop_keys(ucx_rc *p, int s);
llmdd_status llmdd__ucx_rc_keys(ucx_link *ul, ucx_rc *p, int s);
void llmdd__ucx_reg_unmap(ucx_link *ul, ucx_reg *r);
llmdd_status llmdd__ucx_reg_map(ucx_link *ul, ucx_reg *r,
                                const llmdd__cache *c);
ucx_reg *llmdd__ucx_reg_find(ucx_link *ul, int64_t id);
void llmdd__ucx_reg_unlink(ucx_link *ul, ucx_reg *r);

/* ucx_ctx.c */
ucp_context_h llmdd__ucx_ctx_get(void);
void llmdd__ucx_ctx_put(void);
const ucx_probe *llmdd__ucx_probe(void);
const char *llmdd__ucx_info(void);

/* ucx_am.c */
ucs_status_t llmdd__ucx_am_get(void *arg, const void *header, size_t hlen,
                               void *data, size_t len,
                               const ucp_am_recv_param_t *prm);
ucs_status_t llmdd__ucx_am_ping(void *arg, const void *header, size_t hlen,
                                void *data, size_t len,
                                const ucp_am_recv_param_t *prm);
ucs_status_t llmdd__ucx_am_put(void *arg, const void *header, size_t hlen,
                               void *data, size_t len,
                               const ucp_am_recv_param_t *prm);
ucs_status_t llmdd__ucx_am_data(void *arg, const void *header, size_t hlen,
                                void *data, size_t len,
                                const ucp_am_recv_param_t *prm);
ucs_status_t llmdd__ucx_am_ack(void *arg, const void *header, size_t hlen,
                               void *data, size_t len,
                               const ucp_am_recv_param_t *prm);
ucs_status_t llmdd__ucx_am_pong(void *arg, const void *header, size_t hlen,
                                void *data, size_t len,
                                const ucp_am_recv_param_t *prm);
ucs_status_t llmdd__ucx_am_install(ucp_worker_h w, const unsigned *ids,
                                   const ucp_am_recv_callback_t *cbs, int n,
                                   void *arg);
void llmdd__ucx_am_forget(ucx_ep *e, ucx_xstate *xs);

/* ucx_ep.c */
llmdd_status llmdd__ucx_ep_open(ucx_link *ul, int s);
void llmdd__ucx_op_done(void *req, ucs_status_t status, void *user_data);
void llmdd__ucx_slot_abort(ucx_link *ul, int s, ucx_xstate *xs);
llmdd_status llmdd__ucx_ep_wire(ucx_link *ul, int s, int64_t deadline);
void llmdd__ucx_teardown(ucx_link *ul, bool inline_progress);
void *llmdd__ucx_progress_main(void *arg);
int llmdd__ucx_progress_start(ucx_link *ul);

/* ucx_serve.c */

llmdd_status llmdd__ucx_call(ucx_link *ul, uint16_t type, int64_t id,
                             uint16_t rtype, uint8_t *buf, size_t cap,
                             size_t *rlen, int64_t deadline);
/* Answers the peer's requests on fd (a REV connection; ul: the ucx_link)
 * until it closes; run by llmdd__serve_spawn. */
void llmdd__ucx_serve(void *ul, int fd);
size_t llmdd__ucx_hello_make(ucx_link *ul, uint32_t status, uint8_t **out);
llmdd_status llmdd__ucx_hello_take(ucx_link *ul, const uint8_t *buf,
                                   size_t len);
void llmdd__ucx_accept_hello(ucx_link *ul, int fd);

/* ucx_xfer.c */
llmdd_status llmdd__ucx_xfer(llmdd__link *link, const llmdd__xfer *x);

#endif
