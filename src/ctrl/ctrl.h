/*
 * Private to the control plane (src/ctrl), never included outside it: the
 * control thread's state and what the plane's files share. ctrl.c runs the
 * control thread and the listener and reads every link's control messages;
 * handshake.c runs both sides of the handshake and its authentication;
 * linking.c runs the link and unlink calls. The struct llmdd__ctrl fields
 * marked so are guarded by dd->lock; the functions are thread-safe.
 */
#ifndef LLMDD_CTRL_CTRL_H
#define LLMDD_CTRL_CTRL_H

#include "base/net.h"
#include "core/internal.h"
#include "base/wire.h"
#include "meta/meta.h"

/*
 * The handshake stage. An accepted connection waits, without a thread, for
 * its first bytes (at most HANDSHAKE_MS from its accept) and for a handshake
 * thread; at most HANDSHAKE_MAX threads run, each bounded by HANDSHAKE_MS
 * from its start. Past HANDSHAKE_PENDING waiting connections a new one waits
 * for its HELLO only to be answered LLM_LINK_BUSY; past HANDSHAKE_REFUSING
 * more it is closed at once.
 */
#define HANDSHAKE_MS 2000
#define HANDSHAKE_MAX 128
#define HANDSHAKE_PENDING 4096
#define HANDSHAKE_REFUSING 256
#define CTRL_MSG_MAX LLMDD_CTRL_MSG_MAX

/* An accepted connection that waits for its first bytes or a thread. */
typedef struct {
    int fd;
    int64_t since; /* accepted, CLOCK_MONOTONIC ms */
    bool ready;    /* bytes arrived: it waits for a thread only */
    bool busy;     /* past HANDSHAKE_PENDING: to be answered LLM_LINK_BUSY */
} llmdd__ctrl_pending;

struct llmdd__ctrl {
    pthread_t thread;
    int wake_fd;
    /* Guarded by dd->lock. */
    int listen_fd;
    bool stop;
    uint64_t gen, seen_gen; /* the thread has rebuilt its poll set */
    int handshakes;
    bool starved; /* connections wait for a handshake thread */
    /* Handshake threads still reading their HELLO: fd (-1: free) and
     * since. */
    int waiting[HANDSHAKE_MAX];
    int64_t waiting_since[HANDSHAKE_MAX];
    llmdd__sockaddr bound; /* where listen_fd listens; guarded by dd->lock */
    /* The control thread's own: while accept cannot get a descriptor the
     * listener is not polled until accept_resume (CLOCK_MONOTONIC ms). */
    int64_t accept_resume;
    int accept_backoff_ms;
    llmdd__ctrl_pending *pending; /* up to HANDSHAKE_PENDING of them */
    size_t npending, pending_cap;
    /* Discovery (discovery.c): set from start to stop when
     * llm.MetadataServer is; its own thread and locks. */
    llmdd__meta *meta;
};

/*
 * The control plane's part of a link (link->ctrl), made by the handshake
 * before the link is published. rx and last_rx_ms are the control
 * thread's (or, once that no longer polls the link, unlink's); the flags
 * are guarded by dd->lock.
 */
typedef struct {
    uint8_t rx[LLMDD_CTRL_FRAME_MAX]; /* a frame read so far */
    size_t rx_len;
    int64_t last_rx_ms; /* when the peer's bytes last arrived */
    bool heard;         /* any byte since the handshake */
    /* The control thread's share accounting (ctrl.c): frames were left
     * unread when the round's share ran out; when the socket was last read
     * empty; and the peer's heartbeat allowance in ms (a heartbeat costs
     * half its announced interval), topped up by the clock at hb_at. */
    bool more, hb_started;
    int64_t drained_ms, hb_at_ms, hb_credit_ms;
    bool unlink_acked;
    bool unlinking; /* our llmdd_unlink_clusters ends this link */
    /* The peer's UNLINK (ctrl.c, unlink_serve): SERVING from its arrival;
     * DECIDED once whether our unlink crossed it was read; DONE when that
     * unlink's ACK, if any, was read. */
    enum {
        PEER_UNLINK_NONE,
        PEER_UNLINK_SERVING,
        PEER_UNLINK_DECIDED,
        PEER_UNLINK_DONE
    } peer_unlink;
    bool reopening; /* a reopen job runs: the peer cannot spawn more */
} llmdd__ctrl_link;

/* The part of a link made by a handshake; NULL without memory. */
llmdd__ctrl_link *llmdd__ctrl_link_new(void);
static inline llmdd__ctrl_link *
ctrl_of(const llmdd__link *link)
{
    return (llmdd__ctrl_link *)link->ctrl;
}

/* Wakes the control thread: its poll set or the link table changed. */
void llmdd__ctrl_wake(llmdd *dd);
/*
 * The next whole control frame of a link, read incrementally so that a peer
 * which sends part of a frame and stops blocks nobody: 1 and the frame, 0
 * when more bytes must arrive first, -1 on EOF, error or a bad frame.
 */
int llmdd__ctrl_rx_next(llmdd__link *link, uint16_t *type, uint8_t *buf,
                        size_t *len);
/* The peer's UNLINK_ACK, read by an unlink itself until deadline. */
bool llmdd__ctrl_read_ack(llmdd__link *link, int64_t deadline);
/* The handshake on fd got its HELLO, or failed: it cannot be evicted now. */
void llmdd__ctrl_hello_done(llmdd *dd, int fd);

/* A connection the listener accepted, for its handshake thread. */
struct llmdd__handshake_arg {
    llmdd *dd;
    int fd;
};
/* Runs the server side of a handshake; arg is malloc'd and freed here. */
void *llmdd__handshake_main(void *arg);
/*
 * Where a link's connections leave from: the cluster's first
 * local_ip_infos entry of the remote address's family, port 0 (AF_UNSPEC
 * without entries); LLM_PARAM_INVALID for entries of no use.
 */
llmdd_status llmdd__link_local_addr(const llmdd_cluster_info *ci,
                                    const llmdd__sockaddr *remote,
                                    llmdd__sockaddr *out);
/*
 * The client side of the control handshake, up to a published link (or
 * the peer's own link, when its crossing link call wins).
 */
llmdd_status llmdd__link_handshake(llmdd *dd, const llmdd_cluster_info *ci,
                                   int64_t deadline);

/*
 * Discovery (discovery.c), with llm.MetadataServer set: the metadata
 * service starts with the plane (LLM_TIMEOUT when the server does not
 * answer within LLMDD_META_INIT_MS) and stops with it; a listener is
 * published once bound (LLM_PARAM_INVALID for a wildcard address or a
 * cluster id a live instance holds) and removed before it closes; a
 * cluster without addresses is looked up (LLM_LINK_FAILED, LLM_TIMEOUT).
 * Without the option they do nothing (resolve: LLM_PARAM_INVALID).
 */
llmdd_status llmdd__disc_open(llmdd *dd, llmdd__ctrl *c);
void llmdd__disc_close(llmdd__ctrl *c);
llmdd_status llmdd__disc_check_listen(llmdd *dd);
llmdd_status llmdd__disc_publish(llmdd *dd, const llmdd__sockaddr *bound);
void llmdd__disc_unpublish(llmdd *dd);
llmdd_status llmdd__disc_resolve(llmdd *dd, uint64_t cluster_id,
                                 int64_t deadline, llmdd_ip_info *out);

#endif
