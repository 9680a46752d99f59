/*
 * The socket data plane: one-sided reads and writes of registered caches,
 * served over dedicated data connections of a link. It is not a transport
 * (nothing registers it); transports build on it: tcp is this and nothing
 * else, shm uses it for queries it cannot answer itself and as the fallback
 * when memory cannot be shared.
 *
 * A data plane belongs to one link and is created by the transport's
 * link_init. Data connections are opened by the client (the side that
 * linked): FWD connections carry the client's requests, REV connections the
 * server's. Flag bits 0..7 of a data connection are the data plane's; a
 * transport that has data connections of its own uses higher bits and hands
 * every other connection to llmdd__stream_accept.
 *
 * Thread-safe: every function may be called from several threads at once,
 * except llmdd__stream_free.
 */
#ifndef LLMDD_TRANSPORT_STREAM_STREAM_H
#define LLMDD_TRANSPORT_STREAM_STREAM_H

#include "core/internal.h"

#define LLMDD__STREAM_FLAG_REV 1u
#define LLMDD__STREAM_FLAG_MASK 0xffu
/* Requester connections a side may hold: llm.TcpLanes' 16 lanes plus one
 * for a small request beside a striped one. */
#define LLMDD__STREAM_CONNS_MAX 17

typedef struct llmdd__stream llmdd__stream;

/*
 * A data plane for `link` with at most nfwd requester connections on the
 * client and nrev on the server (each 1..LLMDD__STREAM_CONNS_MAX), serving
 * at most serve_max of the peer's at once (1..LLMDD__SERVE_MAX; more are
 * closed). Opens nothing. NULL when out of memory.
 */
llmdd__stream *llmdd__stream_new(llmdd__link *link, int nfwd, int nrev,
                                 int serve_max);

/*
 * Lets one large transfer of ours stripe over up to `lanes` requester
 * connections at once (1..LLMDD__STREAM_CONNS_MAX; 1, the default, never
 * stripes). Call before the data plane is used.
 */
void llmdd__stream_set_lanes(llmdd__stream *s, int lanes);

/*
 * Client side: opens the FWD and REV connections by link->deadline_ms and
 * starts serving the REV ones (the serving threads hold link references).
 * When one cannot be opened: LLM_TIMEOUT if the deadline passed meanwhile,
 * else LLM_LINK_FAILED; the data plane must then still be shut down and
 * freed.
 */
llmdd_status llmdd__stream_connect(llmdd__stream *s);

/*
 * Client side (ops->reopen): the peer lost a REV connection and asked for
 * another; opens and serves it.
 */
void llmdd__stream_reopen(llmdd__stream *s);

/*
 * A data connection reached our listener (ops->accept_conn). Takes
 * ownership of fd; serves it in the calling thread when it is a FWD
 * connection of the peer.
 */
void llmdd__stream_accept(llmdd__stream *s, int fd, uint32_t flags);

/* Wakes every thread blocked on the data plane. NULL is ignored. */
void llmdd__stream_shutdown(llmdd__stream *s);
/* After shutdown: until no serving thread moves our memory for the peer
 * (the transports' quiesce op); NULL s is quiet. */
bool llmdd__stream_quiesce(llmdd__stream *s, int64_t deadline_ms);

/*
 * The owner removed `cache` (ops->cache_removed). A request our serving
 * threads are answering from it gets llm.SyncKvCacheWaitTime to finish;
 * then its connection is shut down, so that the thread lets go of the cache
 * and the owner's deallocate does not wait on the peer. Returns by then.
 */
void llmdd__stream_cache_removed(llmdd__stream *s, const llmdd__cache *cache);

/* Frees it once no thread uses it (the link's last reference is gone). */
void llmdd__stream_free(llmdd__stream *s);

/* ops->query and ops->xfer over the data connections. */
llmdd_status llmdd__stream_query(llmdd__stream *s, int64_t id,
                                 int64_t deadline_ms, llmdd_cache_desc *desc,
                                 uint32_t *batch_dim);
llmdd_status llmdd__stream_xfer(llmdd__stream *s, const llmdd__xfer *x);

#endif
