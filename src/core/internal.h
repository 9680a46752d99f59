/*
 * Internal state of an instance, shared by the core, the control plane and
 * the transports. Locking: dd->lock guards the cache registry, the link table,
 * the thread count and the initialized flag; it is never held across I/O or
 * a memcpy of cache data. Cache and link objects are reference-counted so
 * that I/O can proceed without the lock.
 */
#ifndef LLMDD_CORE_INTERNAL_H
#define LLMDD_CORE_INTERNAL_H

#include <llmdd/llmdd.h>
#include <pthread.h>
#include <stdatomic.h>

#include "base/log.h"
#include "base/net.h"
#include "base/wire.h"
#include "core/layout.h"
#include "core/metrics.h"
#include "core/options.h"
#include "transport/transport.h"

#define LLMDD_MAX_LINK_CLUSTERS 16
#define LLMDD_BOOT_ID_LEN 16
#define LLMDD_TOKEN_LEN 16
/* The largest control message a link carries (ctrl.c). */
#define LLMDD_CTRL_MSG_MAX 1040 /* a notification and its header */
#define LLMDD_CTRL_FRAME_MAX (12 + LLMDD_CTRL_MSG_MAX)
/*
 * Frames a link's control connection may hold unsent: a full window of
 * notifications and room for the small messages beside them. A peer that
 * stops reading past it loses the link (it cannot hold the sender).
 */
#define LLMDD_CTRL_OUT_MAX (1u << 20)

/* Backing memory of an allocated cache: a range of a memfd mapping. */
typedef struct {
    int fd;          /* the memfd (the pool's when pooled) */
    uint64_t fd_off; /* where the cache starts in the memfd */
    uint64_t len;    /* bytes reserved in the memfd */
    uint64_t pitch;  /* distance between consecutive tensors */
    uint8_t *base;   /* our mapping of [fd_off, fd_off + len) */
    bool pooled;
} llmdd__mem;

typedef struct llmdd__cache {
    int64_t id;
    llmdd_cache_desc desc;
    uint64_t tensor_size;
    uint64_t stride;       /* bytes of one slot (of the batch dimension) */
    llmdd__slot_geom slot; /* where slots lie; batch_dim fixed for life */
    uint64_t *addrs; /* num_tensors entries */
    bool allocated;  /* else registered user memory */
    bool has_layout; /* made with a KV layout (fixed for its life) */
    llmdd_kv_layout layout;
    llmdd__mem mem;  /* when allocated */
    int refs;        /* transfers in progress; guarded by dd->lock */
    bool dead;       /* removed from the registry, waiting for refs == 0 */
    /* Pooled only, guarded by dd->lock: processes that may still write the
     * pages (llmdd__cache_put_stale); the pool holds them back from reuse
     * until those exit. forever: one could not be watched. */
    int *stale_pidfds;
    size_t nstale;
    bool stale_forever;
} llmdd__cache;

typedef struct llmdd__pool llmdd__pool;

/* What the handshake told us about the peer. */
typedef struct llmdd__peer {
    uint64_t cluster_id;
    uint32_t role;
    uint32_t pid;
    uint8_t boot_id[LLMDD_BOOT_ID_LEN];
    uint64_t nonce; /* the peer instance's random id, as it claims */
    /* Verified, not claimed: the other end of the control connection is
     * held by an instance of this very process (llmdd__own_conn_peer). */
    bool local;
    /* Client side: where its listener is; server side: where its control
     * connection comes from (a port no one listens on). */
    llmdd__sockaddr addr;
} llmdd__peer;

/* A reply awaited on a link's control connection (llmdd__link_await). */
typedef struct llmdd__link_wait {
    uint16_t type; /* WMSG_KEY_REPLY, WMSG_PONG */
    uint64_t seq;
    bool done;
    uint8_t reply[64]; /* the reply's payload */
    size_t len;
    struct llmdd__link_wait *next;
} llmdd__link_wait;

typedef struct llmdd__link {
    struct llmdd *dd;
    llmdd__peer peer;
    bool client;
    uint8_t token[LLMDD_TOKEN_LEN]; /* names the link in data connections */
    /* Client side: the local_ip_infos address our connections to the peer
     * leave from (port 0); family AF_UNSPEC: wherever routing says. */
    llmdd__sockaddr bind_addr;
    int ctrl_fd;
    /* What the peer announced in its handshake: its heartbeat interval,
     * its notification window, and (from a server) the data connections it
     * serves each way. */
    llmdd__link_terms terms;
    /* The instance's options a transport needs, as they were when the link
     * was made: transports read these, never dd->opts (dd->lock's). */
    struct {
        uint32_t wait_ms;
        int tcp_lanes;
        char transport[LLMDD_TRANSPORT_NAME_MAX]; /* "auto" or a name */
    } opts;
    const llmdd_transport_ops *ops;
    bool forced;         /* ops was named by one side, not picked by auto */
    void *tp;            /* transport state */
    int64_t deadline_ms; /* of the link call, for the transport's setup */
    /* The control plane's own per-link state (src/ctrl): plain memory, set
     * before the link is published and freed with it. */
    void *ctrl;
    /* The notification flow control's account (notify.c). */
    struct llmdd__notify_acct *acct;

    /* The control connection's outgoing side (llmdd__link_send): frames
     * the socket did not take yet. Guarded by out_lock; never held across
     * a blocking call. */
    pthread_mutex_t out_lock;
    uint8_t *out;
    size_t out_len, out_cap;
    int64_t last_tx_ms; /* when a frame was last queued */
    bool out_closed;    /* dropped: nothing more is queued */

    /* Guarded by dd->lock. */
    int refs;
    bool dead;
    int busy;                   /* transfers between enter and leave */
    uint32_t tx_credits;        /* notifications the peer will still take */
    llmdd__link_wait *waits;    /* replies awaited */
    uint64_t wait_seq;          /* requests asked: the last sequence number */
    uint64_t replies;           /* replies the peer sent, awaited or late */
    /* Crossed link calls (linking.c): when the link entered the table, and
     * whether a link call of ours has returned it (a client link is its own
     * call's; a server link is claimed by our first call that adopts it). */
    int64_t published_ms;
    bool claimed;
    uint64_t notified; /* the last cache_removed round that told it */
    struct llmdd__link *next;

    /* The peer's caches we have seen; guarded by rc_lock. */
    pthread_mutex_t rc_lock;
    llmdd__remote_cache **rcs;
    size_t nrcs, rcs_cap;
} llmdd__link;

typedef struct llmdd__ctrl llmdd__ctrl;

/*
 * The control plane (listener, handshakes, control thread: src/ctrl) as the
 * core sees it. The core never calls src/ctrl by name: llmdd_create, which
 * lives in src/ctrl, registers these ops with the instance, and the core
 * starts, stops and wakes the control plane only through them, as it
 * reaches a transport only through its llmdd_transport_ops. None is called
 * with dd->lock held.
 */
typedef struct llmdd__plane_ops {
    /* Starts the control thread (dd->ctrl); LLM_SUCCESS or a status. */
    llmdd_status (*start)(llmdd *dd);
    /* Stops it and waits for its handshake threads; safe when not started. */
    void (*stop)(llmdd *dd);
    /* Listens per dd->opts; stops listening; both on a started plane. */
    llmdd_status (*listen_start)(llmdd *dd);
    void (*listen_stop)(llmdd *dd);
    /* The link table changed or paused links may be read again. */
    void (*wake)(llmdd *dd);
} llmdd__plane_ops;

/*
 * Link and unlink calls in progress (ctrl), one node per cluster: a second
 * call for a cluster that has one is LLM_PROCESSING_LINK (linking.c). Nodes
 * live on the stack.
 */
typedef struct llmdd__linking {
    uint64_t cluster_id;
    bool unlink; /* an unlink call's; link_admit looks at link calls only */
    struct llmdd__linking *next;
} llmdd__linking;

/*
 * A second copying thread, kept for the instance (util.c), instead of a
 * thread started per copy (pthread_create and join cost 40 us on a 2-core
 * VM, an eighth of a 4 MiB copy): a cross-memory attach split over two
 * threads posts its second half here, one job at a time; between jobs it
 * moves pieces of the shared works (llmdd__share), the shm copies through
 * a mapping. Started on first use, stopped by finalize.
 */
typedef struct llmdd__share llmdd__share;
struct llmdd__share {
    /* Moves one piece of the work: true, or false when none is left (then
     * and from then on). Called by the assist thread, unlocked. */
    bool (*piece)(llmdd__share *s);
    llmdd__share *next;
    uint32_t moving; /* pieces the assist thread is moving now */
    bool empty;      /* piece() returned false */
};

typedef struct {
    pthread_mutex_t lock;
    pthread_cond_t cond;
    bool running; /* the thread lives */
    bool stop;
    bool busy; /* a job is taken: posted and not yet waited for */
    bool done; /* the taken job has ended */
    void *(*fn)(void *);
    void *arg;
    llmdd__share *shares; /* listed works, oldest first */
} llmdd__assist;

struct llmdd {
    uint64_t cluster_id;
    llmdd_role role;
    uint64_t nonce;

    /* The control plane (src/ctrl), registered by llmdd_create. */
    const llmdd__plane_ops *plane;

    pthread_mutex_t lock;
    pthread_cond_t cond; /* cache refs, link events, thread exits */
    bool initialized;
    llmdd__options opts;

    llmdd__cache **caches; /* sorted by id */
    size_t ncaches, caches_cap;
    int64_t next_cache_id;
    llmdd__pool *host_pool;
    struct llmdd__keys *keys; /* cache keys (keys.c); NULL until the first */
    struct llmdd__reqs *reqs; /* requests (request.c); from initialize */
    struct llmdd__notifies *notifies; /* received (notify.c); from init */
    bool device_as_host_said; /* device placement was logged (cache.c); lock */
    uint64_t notify_serial; /* cache_removed rounds told link by link */
    bool notify_busy;       /* such a round is running */

    llmdd__link *links;
    llmdd__linking *linking; /* our link and unlink calls in flight */
    llmdd__ctrl *ctrl;       /* the plane's; NULL when down; opaque here */
    int stop_fd;             /* eventfd, readable once finalize has begun */
    int nthreads;            /* helper threads alive */
    llmdd__assist assist;    /* a second copying thread (util.c) */
    llmdd__metrics *metrics; /* its own block of atomics, no lock (metrics.h) */

    struct llmdd *next_instance; /* in the process-wide list */
};

/*
 * Memory limits (memlimit.c): the process's memory cgroup, so that an
 * allocation can tell whether its pages fit before it faults them in.
 */
typedef struct {
    int version;    /* 1 or 2; 0: none found, nothing to check */
    size_t top_len; /* path[0, top_len) is the hierarchy's mount point */
    char path[4096];
} llmdd__memcg;

void llmdd__memcg_find(llmdd__memcg *cg);
/*
 * Whether len more resident bytes (plus a reserve for the rest of the
 * process) fit below the limits of cg and of every ancestor.
 */
bool llmdd__memcg_fits(const llmdd__memcg *cg, uint64_t len);

/* Misc utilities (util.c); the clock and fd waits are in base/net.h. */
int llmdd__random(void *buf, size_t len);
const uint8_t *llmdd__boot_id(void);
/* Whether the peer runs on this kernel (same boot id): the one test of
 * "same host" for shared memory and cross-memory attach. */
bool llmdd__peer_same_kernel(const llmdd__peer *p);

/* A condition variable timed against CLOCK_MONOTONIC, like every deadline. */
void llmdd__cond_init(pthread_cond_t *cond);
/*
 * Waits on cond (mutex held) until woken or deadline_ms (CLOCK_MONOTONIC;
 * INT64_MAX: no deadline). The cond must come from llmdd__cond_init.
 * Callers recheck their predicate and the deadline in a loop.
 */
void llmdd__cond_wait_until(pthread_cond_t *cond, pthread_mutex_t *mutex,
                            int64_t deadline_ms);

/* Runs fn(arg) on a detached thread counted in dd->nthreads. */
int llmdd__spawn(llmdd *dd, void *(*fn)(void *), void *arg);

/*
 * The assist thread (llmdd__assist). llmdd__assist_post: true when the
 * thread took fn(arg), and the caller must then call llmdd__assist_wait,
 * which returns once fn has returned; false when it is busy with another
 * caller's job or cannot start (the caller does the work itself).
 * llmdd__assist_stop ends the thread and refuses jobs from then on
 * (finalize; the thread counts in dd->nthreads); initialize clears `stop`.
 * init and fini pair with the instance's create and destroy.
 */
void llmdd__assist_init(llmdd__assist *a);
void llmdd__assist_fini(llmdd__assist *a);
bool llmdd__assist_post(llmdd *dd, void *(*fn)(void *), void *arg);
void llmdd__assist_wait(llmdd *dd);
/*
 * Shared work: from llmdd__share_begin (false when the thread is stopped or
 * cannot start: the caller works alone) to llmdd__share_end, the assist
 * thread, between posted jobs, moves pieces of the listed works, the
 * oldest with pieces left first, so that a core that would idle at the
 * end of one transfer moves another's (the legs of a request of several
 * sources). llmdd__share_end unlists the work and returns once the
 * thread moves no piece of it.
 */
bool llmdd__share_begin(llmdd *dd, llmdd__share *s,
                        bool (*piece)(llmdd__share *));
void llmdd__share_end(llmdd *dd, llmdd__share *s);
void llmdd__assist_stop(llmdd *dd);

/* LLM_SUCCESS when dd is initialized, else LLM_FAILED; takes dd->lock. */
llmdd_status llmdd__ready(llmdd *dd);
/*
 * The level a link call's failure with status st is logged at: info where
 * callers retry it (LLM_PROCESSING_LINK, LLM_LINK_BUSY, LLM_TIMEOUT) or it
 * is an expected answer (LLM_ALREADY_LINK), error otherwise
 * (docs/operations.md, Logs).
 */
enum llmdd__log_level llmdd__link_fail_level(llmdd_status st);
/* llm.SyncKvCacheWaitTime in ms; takes dd->lock. */
uint32_t llmdd__wait_ms(llmdd *dd);
/* TCP_USER_TIMEOUT for the instance's connections; takes dd->lock. */
uint32_t llmdd__user_timeout(llmdd *dd);

/*
 * Requests (request.c). A plan is a validated transfer with its references
 * (link, local cache, remote cache) and its arrays (x.local, x.runs, both
 * malloc'd); submitting hands all of them over, whatever the outcome.
 * req_out NULL: runs it on the calling thread and returns its status (the
 * synchronous calls); else posts it to the workers.
 */
/* One peer's part of a request: slice transfers carry several (one per
 * slice); legs of one group go to one peer and share its notification. */
typedef struct {
    llmdd__link *link;
    llmdd__remote_cache *rc;
    llmdd__xfer x; /* x.local and x.runs malloc'd; nruns 0: notify only */
    uint32_t group;
} llmdd__request_leg;
typedef struct {
    llmdd__link *link;
    llmdd__cache *lc;
    llmdd__remote_cache *rc;
    llmdd__xfer x;
    /* nlegs > 0: the legs (malloc'd, with their references and arrays)
     * instead of link, rc and x; groups numbered 0..ngroups-1. */
    llmdd__request_leg *legs;
    uint32_t nlegs, ngroups;
    uint32_t flags; /* LLMDD_XFER_* */
    uint32_t tnpl;  /* tensors a layer, for LLMDD_XFER_LAYERWISE */
    const void *notify;
    size_t notify_len;
    enum llmdd__metrics_op op; /* counted when the request is done */
    uint64_t bytes;
    uint64_t t0; /* llmdd__metrics_begin's stamp */
} llmdd__request_plan;
llmdd_status llmdd__request_submit(llmdd *dd, const llmdd__request_plan *p,
                                   llmdd_request **req_out);
/* Posted requests on a link that went down end with LLM_NOT_YET_LINK. */
void llmdd__requests_link_down(llmdd *dd, const llmdd__link *link);
/* After llmdd__requests_link_down: waits until every request with a leg on
 * the link is done (its running jobs returned), or the deadline; true when
 * they are. No lock of dd held. */
bool llmdd__requests_link_wait(llmdd *dd, const llmdd__link *link,
                               int64_t deadline_ms);
/* Posted requests on a cache being removed end with LLM_KV_CACHE_NOT_EXIST;
 * no lock of dd held. */
void llmdd__requests_cache_removed(llmdd *dd, const llmdd__cache *cache);
/* Initialize: creates the request state (its completion queue's eventfd)
 * or restarts it after a finalize. */
llmdd_status llmdd__requests_init(llmdd *dd);
/* Finalize: ends every request and stops the workers; the requests stay
 * the caller's to free. Destroy drops the instance's hold on the state,
 * which goes with the last request. */
void llmdd__requests_fini(llmdd *dd);
void llmdd__requests_free(llmdd *dd);

/*
 * Notifications (notify.c): a bounded queue per instance with flow control
 * per link (credits, docs/protocol.md). llmdd__notify_send waits for the
 * peer's credit up to deadline_ms (LLM_TIMEOUT, the link stays) and queues
 * the frame after everything this instance queued on the link before.
 * The control thread hands NOTIFY and CREDIT frames to llmdd__notify_on_msg
 * (false: the link was dropped for a violation). A link's account is made
 * with the link and let go when it goes.
 */
llmdd_status llmdd__notify_send(llmdd__link *link, const void *msg,
                                size_t len, int64_t deadline_ms);
bool llmdd__notify_on_msg(llmdd__link *link, uint16_t type, const uint8_t *buf,
                          size_t len);
int llmdd__notify_link_init(llmdd__link *link);
void llmdd__notify_link_fini(llmdd__link *link);
llmdd_status llmdd__notify_init(llmdd *dd);
void llmdd__notify_fini(llmdd *dd);

/* KV layouts (slice_xfer.c). The control thread hands a LAYOUT_QUERY
 * here; the answer is queued, never waited on. */
bool llmdd__layouts_serve(llmdd__link *link, const uint8_t *buf, size_t len);

/* Cache keys (keys.c). The control thread hands a KEY_QUERY here. */
bool llmdd__keys_serve(llmdd__link *link, const uint8_t *buf, size_t len);
/* Takes dd->lock. Whether `key` is bound, and to what. */
bool llmdd__keys_find(llmdd *dd, const void *key, size_t key_len,
                      int64_t *cache_id, uint32_t *batch_index);
void llmdd__keys_drop_cache(llmdd *dd, int64_t cache_id); /* dd->lock held */
void llmdd__keys_fini(llmdd *dd);                          /* dd->lock held */

/* Cache registry (cache.c). */
void llmdd__caches_fini(llmdd *dd); /* dd->lock held; waits for refs */
/* Looks up a live cache and takes a reference; NULL when unknown. */
llmdd__cache *llmdd__cache_get(llmdd *dd, int64_t id);
void llmdd__cache_put(llmdd *dd, llmdd__cache *c);
/* Whether the owner has removed c (deallocated or unregistered it). */
bool llmdd__cache_removed(llmdd *dd, const llmdd__cache *c);
/*
 * Drops a reference that stood for another process's access to the
 * cache's memory (a transport's lease) when that process did not confirm
 * it stopped touching it. An allocated pooled cache then keeps its pages
 * out of the pool after it is freed, until the process behind pidfd (a
 * pidfd, duplicated here; -1: unknown) has exited, or for the pool's life.
 * Other caches need nothing: a non-pooled cache's memfd pages are never
 * given to another cache, and registered memory is the user's.
 */
void llmdd__cache_put_stale(llmdd *dd, llmdd__cache *c, int pidfd);
/*
 * The serving side of a remote access: looks up cache `id`, checks that
 * tensors [first, first + count) exist and that every element of every run
 * lies inside a tensor, and takes a reference. Run i is cnts[i] elements of
 * lens[i] bytes from offs[i], strides[i] apart (cnts NULL: one each).
 */
llmdd_status llmdd__cache_get_span(llmdd *dd, int64_t id, uint32_t first,
                                   uint32_t count, const uint64_t *offs,
                                   const uint64_t *lens, const uint64_t *cnts,
                                   const uint64_t *strides, size_t nruns,
                                   llmdd__cache **out);
/* Creates dd->host_pool when configured; dd->lock held. */
llmdd_status llmdd__pool_setup(llmdd *dd);
/*
 * Creates an instance whose control plane is `plane` (llmdd_create, in
 * src/ctrl, passes its own).
 */
llmdd_status llmdd__instance_new(uint64_t cluster_id, llmdd_role role,
                                 const llmdd__plane_ops *plane, llmdd **dd_out);

/* The process-wide instance list, for in-process peers (instance.c). */
void llmdd__instances_lock(void);
void llmdd__instances_unlock(void);
llmdd *llmdd__instance_find(uint64_t nonce); /* list lock held */

/*
 * Connections whose both ends may be in this process. A handshake registers
 * its socket for its duration; the other side then learns from the kernel's
 * own addresses, not from anything the peer says, whether an instance of
 * this process holds the other end. Thread-safe.
 */
int llmdd__own_conn_add(int fd, uint64_t nonce); /* 0, or -1 */
void llmdd__own_conn_del(int fd);
/*
 * Whether the other end of connected socket fd is a registered socket of
 * this process whose instance has `nonce`.
 */
bool llmdd__own_conn_peer(int fd, uint64_t nonce);

/* Links (link.c). */
/* A new link holding one reference, not yet in the table. */
llmdd__link *llmdd__link_new(llmdd *dd, const llmdd__peer *peer, bool client,
                             int ctrl_fd);
/* Frees a link that never became visible (or whose last ref is gone). */
void llmdd__link_free(llmdd__link *link);
/*
 * Makes a set-up link visible; fails if the cluster is linked already, and
 * on the server side when the link is not admitted (crossing link calls,
 * llm.MaxLinks).
 */
llmdd_status llmdd__link_publish(llmdd *dd, llmdd__link *link);
/* dd->lock held. Links we serve (the peer linked to us). */
size_t llmdd__links_served(const llmdd *dd);
llmdd__link *llmdd__link_get(llmdd *dd, uint64_t cluster_id);
void llmdd__link_put(llmdd__link *link);
/* One more reference to a link already referenced (a thread it spawns). */
void llmdd__link_hold(llmdd__link *link);
/* Marks the link dead, removes it from the table and wakes its users. */
void llmdd__link_drop(llmdd__link *link, const char *why);
/*
 * The peer broke the protocol (a malformed or unasked frame, heartbeats or
 * notifications past their limits): logged as a warning, counted
 * (llmdd_protocol_breaches_total), and the link dropped.
 */
void llmdd__link_breach(llmdd__link *link, const char *why);
/*
 * A transport's status for a call on the link: LLM_NOT_YET_LINK means the
 * peer is lost, and the link goes with it if the transport left it up, so
 * that the status means the same for every later call and the link table.
 */
void llmdd__link_status(llmdd__link *link, llmdd_status st);
llmdd__link *llmdd__link_find_token(llmdd *dd, const uint8_t *token);
/*
 * Server side of a link: asks the client, over the control connection, to
 * open one more data connection for our requests (ops->reopen on its side).
 */
void llmdd__link_ask_reopen(llmdd__link *link);
/*
 * Finds the peer's cache `id`, asking the peer on a miss, and takes a
 * reference. LLM_KV_CACHE_NOT_EXIST when the peer has no such cache.
 */
llmdd_status llmdd__link_remote(llmdd__link *link, int64_t id,
                                int64_t deadline_ms, llmdd__remote_cache **out);
void llmdd__link_remote_put(llmdd__link *link, llmdd__remote_cache *rc);
/* Forgets a remote cache the peer no longer has. */
void llmdd__link_forget(llmdd__link *link, int64_t id);
/* Finalize: drops every link. */
void llmdd__links_fini(llmdd *dd);
/*
 * Marks the link dead and takes it out of the table, as llmdd__link_drop
 * does (nothing new starts on it; its posted requests end), but leaves its
 * transport and control connection up, so that transfers already moving
 * finish and a last message can go out (an UNLINK_ACK); llmdd__link_drop
 * shuts both down afterwards.
 */
void llmdd__link_retire(llmdd__link *link, const char *why);
/*
 * A transfer moves bytes on the link between enter and leave; enter is
 * false once the link is dead (nothing starts on it then).
 */
bool llmdd__link_enter(llmdd__link *link);
void llmdd__link_leave(llmdd__link *link);
/*
 * Waits, for a dead link, until no transfer of ours is between enter and
 * leave (none touches the peer's memory) and, with `serving`, the
 * transport serves the peer nothing any more (none touches ours for it:
 * ops->quiesce, after link_shutdown). False at the deadline.
 */
bool llmdd__link_quiesce(llmdd__link *link, bool serving,
                         int64_t deadline_ms);

/*
 * The control connection, outgoing: one frame, queued after everything
 * queued before it and sent without blocking; the control thread sends
 * the rest as the socket takes it (llmdd__link_flush). 0, or -1 when the
 * link is down or the peer stopped reading past LLMDD_CTRL_OUT_MAX (the
 * link is dropped, logged). Thread-safe; never blocks.
 */
int llmdd__link_send(llmdd__link *link, uint16_t type, const void *payload,
                     size_t len);
/* Control thread: sends what the socket takes; whether some remains. A
 * broken connection drops the link. */
bool llmdd__link_flush(llmdd__link *link);
/* Sends what is queued, waiting for the socket up to deadline_ms (not on
 * the control thread); 0 when all went. */
int llmdd__link_flush_until(llmdd__link *link, int64_t deadline_ms);
int64_t llmdd__link_last_tx(llmdd__link *link);
/*
 * A reply awaited on the control connection: llmdd__link_await_begin
 * registers w (type set by the caller) and gives it a sequence number to
 * send; llmdd__link_await waits for the control thread's
 * llmdd__link_answer: LLM_SUCCESS with w->reply, LLM_NOT_YET_LINK when the
 * link died, LLM_TIMEOUT at the deadline. Either way w is unregistered.
 */
uint64_t llmdd__link_await_begin(llmdd__link *link, llmdd__link_wait *w);
llmdd_status llmdd__link_await(llmdd__link *link, llmdd__link_wait *w,
                               int64_t deadline_ms);
/*
 * A reply arrived; one nobody waits for any more (late) is dropped. False
 * when it answers nothing this instance asked: a sequence number never
 * given, or more replies than requests. The caller then drops the link.
 */
bool llmdd__link_answer(llmdd__link *link, uint16_t type, uint64_t seq,
                        const uint8_t *buf, size_t len);
/*
 * Opens a data connection for `link` to the peer's listener (client side):
 * a HELLO of kind CONN_DATA with the link token and the transport's flags,
 * answered by DATA_REPLY. The listener hands the connection to the link's
 * transport (ops->accept_conn). Returns the fd or -1.
 */
int llmdd__data_connect(llmdd__link *link, uint32_t flags, int64_t deadline);

#endif
