/*
 * The transport contract. A transport moves bytes between a local process's
 * memory and a peer's registered caches, for one link. The core plans every
 * transfer (validation, layer mapping, block runs) and hands the transport a
 * finished llmdd__xfer; the transport never validates user arguments, but it
 * never touches remote memory outside the cache the peer names, and the
 * serving side bounds-checks every request against its own registry.
 *
 * A transport is a static const ops table registered in transport.c; the
 * core never names one. Every op may be called from several threads at once
 * for the same link unless its comment says otherwise.
 */
#ifndef LLMDD_TRANSPORT_TRANSPORT_H
#define LLMDD_TRANSPORT_TRANSPORT_H

#include <llmdd/llmdd.h>

#include "base/net.h"
#include "core/layout.h"

struct llmdd__link;
struct llmdd__peer;
struct llmdd__cache;

/*
 * What a link knows of one of the peer's caches. ops->query gives desc and
 * priv; the core (llmdd__link_remote) checks desc and derives the sizes.
 */
typedef struct llmdd__remote_cache {
    int64_t id;
    llmdd_cache_desc desc; /* checked with llmdd__desc_check */
    uint64_t tensor_size;
    uint64_t stride;       /* bytes of one slot */
    llmdd__slot_geom slot; /* with the batch dimension the peer sent */
    void *priv; /* the transport's, released by ops->remote_free */
    int refs;   /* the link's bookkeeping; guarded by the link */
    bool gone;
    /* Its KV layout, asked once (slice transfers): 0 not yet, 1 known,
     * 2 it has none. Guarded by the link's rc_lock. */
    int layout_state;
    llmdd_kv_layout layout;
} llmdd__remote_cache;

/*
 * One planned transfer: `count` tensor pairs (remote tensor remote_first + i
 * with local tensor base local[i]) times `nruns` runs, or, for a transport
 * that says `strided`, possibly `nruns2` 2-D runs instead (a slice's plan;
 * runs is then NULL). Runs apply in order, tensor by tensor. A run
 * (core/layout.h, the same as a local copy's) goes from src_off in the side the
 * bytes leave, the remote tensor on a pull and the local one on a push, to
 * dst_off in the other: llmdd__run_remote and llmdd__run_local name them by
 * side. Every offset and length is already checked against both caches.
 */
typedef struct {
    bool write; /* push: local -> remote; pull otherwise */
    const llmdd__remote_cache *remote;
    uint32_t remote_first;
    uint32_t count;
    uint8_t *const *local;
    const llmdd__run *runs;
    size_t nruns;
    const llmdd__run2 *runs2;
    size_t nruns2;
    int64_t deadline_ms; /* CLOCK_MONOTONIC, see llmdd__now_ms() */
    uint64_t local_bytes; /* the local cache's size, all its tensors */
    /* The request's cancellation (NULL: none). The calling thread already
     * works under it; a thread a transport starts for this transfer enters
     * it (llmdd__cancel_enter) so that a cancel reaches that thread too. */
    llmdd__cancel *cancel;
} llmdd__xfer;

/* How many runs x has, of either kind. */
static inline size_t
llmdd__xfer_nruns(const llmdd__xfer *x)
{
    return x->runs2 != NULL ? x->nruns2 : x->nruns;
}

/* Run i of x as a 2-D run (a plain run is one element). */
static inline llmdd__run2
llmdd__xfer_run(const llmdd__xfer *x, size_t i)
{
    if (x->runs2 != NULL)
        return x->runs2[i];
    return (llmdd__run2){
        x->runs[i].src_off, x->runs[i].dst_off, x->runs[i].len, 1, 0, 0};
}

/* A run's offset in the remote tensor. */
static inline uint64_t
llmdd__run_remote(const llmdd__xfer *x, const llmdd__run *r)
{
    return x->write ? r->dst_off : r->src_off;
}

/* A run's offset in the local tensor. */
static inline uint64_t
llmdd__run_local(const llmdd__xfer *x, const llmdd__run *r)
{
    return x->write ? r->src_off : r->dst_off;
}

/* Whether every element of every run lies inside a remote tensor of
 * tensor_size bytes (a transport's recheck of what indexes its mapping). */
bool llmdd__xfer_fits(const llmdd__xfer *x, uint64_t tensor_size);

/*
 * x with plain runs: x itself, or with runs2 expanded into *tmp (malloc'd;
 * free it after; NULL when nothing was made). -1 when out of memory.
 */
int llmdd__xfer_plain(const llmdd__xfer *x, llmdd__xfer *out, llmdd__run **tmp);

/* The bytes a planned transfer moves: count times the sum of its runs. */
uint64_t llmdd__xfer_bytes(const llmdd__xfer *x);

/* The size of the cache a transfer writes into: the remote one on a push,
 * the local one on a pull (the copy engine's dst_span, core/copy.h). */
uint64_t llmdd__xfer_dst_bytes(const llmdd__xfer *x);

/*
 * Mandatory ops: name, reaches, link_init, link_shutdown, link_fini, query
 * and xfer; the core calls them without checking. The rest may be NULL.
 * Registration (transport.c) leaves out, with an error, a table that lacks
 * one (llmdd__transport_valid).
 */
typedef struct llmdd_transport_ops {
    const char *name;
    /* Whether xfer takes 2-D runs (llmdd__xfer's runs2); the core expands
     * a slice's plan into plain runs for the others. */
    bool strided;

    /*
     * Whether the transport can carry this link. Called in the handshake,
     * before link_init, with link->peer (cluster id, pid, boot id, `local`)
     * and link->client set; it must not block for long.
     *
     * Client side (ctrl/handshake.c, transport_pick), which chooses. Under "auto" on
     * both sides (link->forced false) every registered transport is asked
     * in preference order and the first that says yes is used, so the
     * answer is "this is the right transport for this peer", not only "it
     * could work": ucx says no to a peer on the same kernel or without an
     * RDMA device here, leaving it to shm or tcp. When either side named a
     * transport (link->forced: ours, or else the server's from its
     * HELLO_REPLY) only that one is asked and a no fails the link, so the
     * answer is "it can work at all" (ucx: UCX initialises; shm: the same
     * kernel and the peer's pid visible here).
     *
     * Server side (link->client false, link->forced false), which serves
     * what the client chose in its CONFIRM: a no refuses the link. The
     * answer is whether this side can serve it; it must not second-guess
     * the client's preference (ucx says yes whenever UCX initialises, shm
     * whenever the kernel is the same, even where another pid namespace
     * hides the client's pid from us). The server also refuses when its own
     * llm.Transport names another transport.
     */
    bool (*reaches)(const struct llmdd__link *link);

    /*
     * Sets up the transport's side of a new link (link->tp). `client` is
     * true on the side that called llmdd_link_clusters. Called once, after
     * the handshake agreed on this transport, before the link is visible.
     */
    llmdd_status (*link_init)(struct llmdd__link *link, bool client);

    /*
     * Wakes every thread blocked on this link so it fails promptly. The link
     * may still be in use; nothing is freed. Idempotent.
     */
    void (*link_shutdown)(struct llmdd__link *link);

    /*
     * Optional. After link_shutdown: waits until no thread of the transport
     * serves the peer any more (reads or writes our memory for it), up to
     * the deadline; false when one still does. Unlink returns only after
     * it, so the peer can no longer reach our memory.
     */
    bool (*quiesce)(struct llmdd__link *link, int64_t deadline_ms);

    /* Frees link->tp. Called once, when nothing uses the link any more. */
    void (*link_fini)(struct llmdd__link *link);

    /*
     * A data connection for this link reached our listener. Takes ownership
     * of fd. May run long (it may serve the connection) in the calling,
     * counted thread. NULL when the transport has no data connections.
     */
    void (*accept_conn)(struct llmdd__link *link, int fd, uint32_t flags);

    /*
     * Asks the peer to describe its cache `id`: its desc and batch
     * dimension as the peer sent them (untrusted; the core validates them
     * once, with llmdd__desc_check and llmdd__slot_geom_make, and computes
     * the sizes) and the transport's own state for it in *priv
     * (NULL when it keeps none). LLM_KV_CACHE_NOT_EXIST when the peer has no
     * such cache. On failure nothing is left for remote_free.
     */
    llmdd_status (*query)(struct llmdd__link *link, int64_t id,
                          int64_t deadline_ms, llmdd_cache_desc *desc,
                          uint32_t *batch_dim, void **priv);
    /* Releases rc->priv. Optional where query never sets it. */
    void (*remote_free)(llmdd__remote_cache *rc);

    /*
     * Moves the bytes. Returns only when no byte of the transfer will be
     * written any more, into local or remote memory, even on LLM_TIMEOUT.
     * LLM_KV_CACHE_NOT_EXIST when the peer no longer has the cache.
     */
    llmdd_status (*xfer)(struct llmdd__link *link, const llmdd__xfer *x);

    /*
     * Optional. Called on the owner's side, without library locks, for
     * every live link, after `cache` left the registry and before its memory
     * is released or reused. Returns once the peer can no longer touch that
     * memory through this link (dropping the link is an acceptable way).
     */
    void (*cache_removed)(struct llmdd__link *link,
                          const struct llmdd__cache *cache);

    /*
     * Optional, client side. The peer asked (llmdd__link_ask_reopen) for
     * one more data connection it can send requests on, because one of its
     * own failed. Runs on a counted helper thread; may block until done.
     */
    void (*reopen)(struct llmdd__link *link);

    /*
     * Optional. One line about what the transport found on this machine
     * (library version, devices), for llmdd_transport_info. The string is
     * static; thread-safe.
     */
    const char *(*info)(void);
} llmdd_transport_ops;

/* The registry: transports in "auto" preference order, each table checked
 * once at first use. Thread-safe. */
const llmdd_transport_ops *llmdd__transport_find(const char *name);
bool llmdd__transport_known(const char *name);
size_t llmdd__transport_count(void);
/* NULL past the end. */
const llmdd_transport_ops *llmdd__transport_at(size_t i);
/* Whether a table has every mandatory op (see llmdd_transport_ops). */
bool llmdd__transport_valid(const llmdd_transport_ops *ops);

#endif
