/*
 * The connections a link is serving: each carries the peer's requests and
 * is answered in its own counted thread. They are tracked so that the
 * link's shutdown can wake every one (shutdown(2) fails their I/O) and so
 * that a cache's removal can find those moving it. Shared by the stream
 * data plane and the ucx transport.
 *
 * The set lives inside its owner and is guarded by the owner's lock, given
 * at init: llmdd__serve_track takes it; the rest expect it held.
 */
#ifndef LLMDD_TRANSPORT_SERVE_H
#define LLMDD_TRANSPORT_SERVE_H

#include <pthread.h>
#include <stdbool.h>
#include <stdint.h>

/* A link's data connections one way (the stream data plane's 17) and one
 * replacing a failed one before its thread saw the end. */
#define LLMDD__SERVE_MAX 18

typedef struct {
    pthread_mutex_t *lock; /* the owner's */
    pthread_cond_t *cond;  /* broadcast when one ends; NULL for none */
    const bool *down;      /* the owner's flag: no new ones once set */
    int max;               /* 1..LLMDD__SERVE_MAX served at once */
    int n;
    struct {
        int fd;
        int64_t cache_id; /* the owner's mark; 0 when it sets none */
    } conn[LLMDD__SERVE_MAX];
} llmdd__serve_set;

void llmdd__serve_init(llmdd__serve_set *set, pthread_mutex_t *lock,
                       pthread_cond_t *cond, const bool *down, int max);

/*
 * Starts (add) or ends tracking fd. Starting fails when the owner is down
 * or already serves max connections: the caller closes fd and returns.
 * Takes the lock.
 */
bool llmdd__serve_track(llmdd__serve_set *set, int fd, bool add);

/*
 * Serves fd on a new counted thread, fn(owner, fd), which owns fd (closes it
 * when done); link is held meanwhile. -1, with fd closed, when no thread
 * starts (fd < 0 too, as a failed connect gives).
 */
struct llmdd__link;
int llmdd__serve_spawn(struct llmdd__link *link, void (*fn)(void *, int),
                       void *owner, int fd);

/* Shuts down every connection served, so their threads fail out of their
 * I/O and end. Lock held. */
void llmdd__serve_shutdown(llmdd__serve_set *set);

/* Waits until no connection is served, up to the deadline (a transport's
 * quiesce op); false when one still is. Takes the lock; needs a cond. */
bool llmdd__serve_wait_idle(llmdd__serve_set *set, int64_t deadline_ms);

#endif
