/*
 * Requests' internal state, shared by request.c (a request's life) and
 * request_queue.c (workers, queues, completions). Nothing else includes it.
 */
#ifndef LLMDD_CORE_REQUEST_INT_H
#define LLMDD_CORE_REQUEST_INT_H

#include "core/internal.h"

#define WORKERS_MIN 4     /* started with the first posted request */
#define WORKERS_MAX 64    /* more when links stall: LINK_SHARE each */
#define LINK_SHARE 4      /* jobs of one link running at once */
#define WORKER_IDLE_MS 10000 /* a worker above WORKERS_MIN ends when idle */

typedef struct job {
    llmdd_request *req;
    uint32_t leg;
    int32_t layer; /* -1: the whole transfer */
    int64_t deadline;
    struct job *next;
} job;

/* One link's posted jobs. Lives while a request of the link does. */
typedef struct lq {
    const llmdd__link *link; /* the key; the requests hold the link */
    job *head, *tail;
    int running;
    int refs;   /* requests of this link, not yet freed */
    bool ready; /* on the ring */
    struct lq *next_ready;
    struct lq *next; /* reqs->lqs */
} lq;

struct llmdd__reqs {
    pthread_mutex_t lock;
    pthread_cond_t work; /* a job can start, or stop: wakes one worker */
    pthread_cond_t cond; /* a request is done, a worker ended */
    lq *lqs;
    lq *ring_head, *ring_tail; /* queues with a job that may start now */
    llmdd_request *all;        /* not yet freed */
    llmdd_request *cq_head, *cq_tail; /* done, not yet collected */
    int cq_fd;                 /* readable while cq_head != NULL */
    int nthreads, idle;
    bool stop;
    int refs; /* the instance's, and one per request not yet freed */
};

enum req_state { RQ_ACTIVE, RQ_ENDING, RQ_FINISHING, RQ_DONE };

struct llmdd_request {
    struct llmdd__reqs *r;
    llmdd *dd;      /* until done */
    bool posted;
    llmdd__cache *lc;
    /* The peers' parts (one for every call but slice transfers): each
     * leg's whole transfer, x.local and x.runs ours; its link's queue
     * (posted only); jobs of each notification group not yet done. */
    llmdd__request_leg *legs;
    lq **lqs;
    uint32_t nlegs, ngroups;
    uint32_t *group_left;
    uint32_t flags;
    uint32_t tnpl, nlayers;
    uint8_t *marked; /* per layer, layer-wise only */
    uint32_t wait_ms;
    uint8_t *notify;
    size_t notify_len;
    enum llmdd__metrics_op op;
    uint64_t bytes, t0;
    llmdd__cancel cancel;

    /* Guarded by r->lock. */
    enum req_state state;
    llmdd_status status;
    int queued, running;
    uint32_t layers_left;
    int refs;    /* the caller's until free, and one per thread waiting */
    bool in_cq;
    llmdd_request *cq_prev, *cq_next;
    llmdd_request *prev, *next; /* r->all */
};

void llmdd__rq_reqs_unref(struct llmdd__reqs *r);
void llmdd__rq_finish(llmdd_request *q, int64_t deadline);
void llmdd__rq_job_run(struct llmdd__reqs *r, job *j);
void llmdd__rq_request_destroy(llmdd_request *q);
bool llmdd__rq_request_unref(llmdd_request *q);
void llmdd__rq_cancel_locked(struct llmdd__reqs *r, llmdd_request *q);
void llmdd__rq_worker_add(struct llmdd__reqs *r, llmdd *dd);
void llmdd__rq_list_add(llmdd_request **head, llmdd_request *q);
void llmdd__rq_list_remove(llmdd_request **head, llmdd_request *q);
lq *llmdd__rq_lq_get(struct llmdd__reqs *r, const llmdd__link *link);
void llmdd__rq_lq_put(struct llmdd__reqs *r, lq *l);
void llmdd__rq_enqueue(struct llmdd__reqs *r, job *j);
void llmdd__rq_dequeue_all(llmdd_request *q);
bool llmdd__rq_finish_claim(llmdd_request *q);
void llmdd__rq_end_locked(llmdd_request *q, llmdd_status why);
void llmdd__rq_cq_remove(struct llmdd__reqs *r, llmdd_request *q);
void llmdd__rq_cq_add(struct llmdd__reqs *r, llmdd_request *q);

#endif
