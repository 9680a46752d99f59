/*
 * Requests: a planned transfer (transfer.c) and its life until done.
 *
 * The synchronous calls and the posted ones share this path: transfer.c
 * validates and plans, then either runs the request's one job on the
 * calling thread (synchronous) or queues it for the instance's workers
 * (posted). A layer-wise push queues one job per marked layer.
 *
 * Fairness. Posted jobs wait in one queue per link, and workers take them
 * round robin over the links that have jobs, at most LINK_SHARE of one link
 * at once; when every worker is busy and a link below its share has a job,
 * another worker starts (up to WORKERS_MAX; extra workers end after
 * WORKER_IDLE_MS without work). So a link whose peer stalls holds at most
 * LINK_SHARE workers until its jobs' deadlines, and every other link keeps
 * being served. Workers sleep on a condition variable when there is nothing
 * to run and in the transport's socket waits while a job runs; none spins.
 *
 * A request holds references on its link, its local cache and the remote
 * cache from post until done, so nothing it touches is freed under it. Its
 * life is one state: ACTIVE (jobs queued, running or awaiting layer marks),
 * ENDING (cancelled or failed: no job starts, running ones are woken),
 * FINISHING (the status is decided; the notification of a successful
 * transfer goes to the peer after the bytes landed, the references go) and
 * DONE. A request with LLMDD_XFER_COMPLETION then joins the instance's
 * completion queue, whose eventfd is readable while it is not empty.
 *
 * Cancel ends the request and wakes its running jobs: a worker running a
 * posted job is inside the request's cancellation (base/net.h) with its own
 * eventfd, so its socket waits give up at once; a memcpy finishes first.
 * Cancel returns when the request is done, so nothing writes into the
 * caller's memory afterwards. A request holds no descriptor.
 *
 * Lifetimes. The request state (struct llmdd__reqs) is reference-counted:
 * the instance holds one reference until destroy and every request one until
 * it is freed, so waits and cancels from any thread stay safe before, during
 * and after finalize and destroy. Finalize ends every request (LLM_FAILED)
 * and stops the workers; the requests stay the caller's to free. A request
 * itself is counted too: the caller's reference goes at free, and a thread
 * inside a wait holds one, so free may race waits already in progress (they
 * return, LLM_FAILED when free cancelled the request).
 *
 * Locking: reqs->lock guards the queues, the lists and every request's
 * state; it is never held across I/O, a copy or another lock but a
 * cancellation's own (net.h), which is taken last. Workers sleep on `work`,
 * waiters on `cond`.
 */
#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <unistd.h>

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

static void *worker_main(void *arg);

static void
reqs_unref(struct llmdd__reqs *r)
{
    pthread_mutex_lock(&r->lock);
    bool last = --r->refs == 0;
    pthread_mutex_unlock(&r->lock);
    if (!last)
        return;
    close(r->cq_fd);
    pthread_mutex_destroy(&r->lock);
    pthread_cond_destroy(&r->work);
    pthread_cond_destroy(&r->cond);
    free(r);
}

llmdd_status
llmdd__requests_init(llmdd *dd)
{
    struct llmdd__reqs *r = dd->reqs;

    if (r != NULL) { /* initialized again after a finalize */
        pthread_mutex_lock(&r->lock);
        r->stop = false;
        pthread_mutex_unlock(&r->lock);
        return LLM_SUCCESS;
    }
    r = calloc(1, sizeof(*r));
    if (r == NULL)
        return LLM_OUT_OF_MEMORY;
    r->cq_fd = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
    if (r->cq_fd < 0) {
        log_error("requests: no eventfd for the completion queue: %s",
                  strerror(errno));
        free(r);
        return LLM_FAILED;
    }
    pthread_mutex_init(&r->lock, NULL);
    pthread_cond_init(&r->work, NULL);
    llmdd__cond_init(&r->cond);
    r->refs = 1;
    pthread_mutex_lock(&dd->lock);
    dd->reqs = r;
    pthread_mutex_unlock(&dd->lock);
    return LLM_SUCCESS;
}

/* r->lock held. One more worker, when all are busy and the cap allows. */
static void
worker_add(struct llmdd__reqs *r, llmdd *dd)
{
    pthread_attr_t attr;
    pthread_t t;

    if (r->stop || r->idle > 0 || r->nthreads >= WORKERS_MAX)
        return;
    pthread_attr_init(&attr);
    pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
    int rc = pthread_create(&t, &attr, worker_main, dd);
    pthread_attr_destroy(&attr);
    if (rc != 0) {
        /* The jobs wait for the workers there are. */
        if (r->nthreads == 0)
            log_error("requests: cannot start a worker thread: %s",
                      strerror(rc));
        return;
    }
    r->nthreads++;
    r->idle++; /* until it takes its first job */
}

/* r->lock held. */
static void
list_add(llmdd_request **head, llmdd_request *q)
{
    q->prev = NULL;
    q->next = *head;
    if (*head != NULL)
        (*head)->prev = q;
    *head = q;
}

static void
list_remove(llmdd_request **head, llmdd_request *q)
{
    if (q->prev != NULL)
        q->prev->next = q->next;
    else if (*head == q)
        *head = q->next;
    if (q->next != NULL)
        q->next->prev = q->prev;
    q->prev = q->next = NULL;
}

/* r->lock held. Puts a queue with a job it may start on the ring. */
static void
ring_offer(struct llmdd__reqs *r, lq *l)
{
    if (l->ready || l->head == NULL || l->running >= LINK_SHARE)
        return;
    l->ready = true;
    l->next_ready = NULL;
    if (r->ring_tail != NULL)
        r->ring_tail->next_ready = l;
    else
        r->ring_head = l;
    r->ring_tail = l;
    pthread_cond_signal(&r->work);
}

/* r->lock held. The link's queue, made on first use. */
static lq *
lq_get(struct llmdd__reqs *r, const llmdd__link *link)
{
    lq *l;

    for (l = r->lqs; l != NULL; l = l->next)
        if (l->link == link)
            break;
    if (l == NULL) {
        l = calloc(1, sizeof(*l));
        if (l == NULL)
            return NULL;
        l->link = link;
        l->next = r->lqs;
        r->lqs = l;
    }
    l->refs++;
    return l;
}

static void
lq_put(struct llmdd__reqs *r, lq *l)
{
    if (l == NULL || --l->refs > 0)
        return;
    if (l->ready) { /* on the ring with its jobs dequeued */
        lq *prev = NULL;
        for (lq *x = r->ring_head; x != l; prev = x, x = x->next_ready)
            ;
        if (prev != NULL)
            prev->next_ready = l->next_ready;
        else
            r->ring_head = l->next_ready;
        if (r->ring_tail == l)
            r->ring_tail = prev;
    }
    for (lq **p = &r->lqs; *p != NULL; p = &(*p)->next) {
        if (*p == l) {
            *p = l->next;
            break;
        }
    }
    free(l); /* no job left: its requests are freed */
}

/* r->lock held. */
static void
enqueue(struct llmdd__reqs *r, job *j)
{
    llmdd_request *q = j->req;
    lq *l = q->lqs[j->leg];

    j->next = NULL;
    if (l->tail != NULL)
        l->tail->next = j;
    else
        l->head = j;
    l->tail = j;
    q->queued++;
    ring_offer(r, l);
    worker_add(r, q->dd);
}

/* r->lock held. Drops the request's queued jobs. */
static void
dequeue_lq(llmdd_request *q, lq *l)
{
    if (l == NULL)
        return;
    job **p = &l->head;
    l->tail = NULL;
    while (*p != NULL) {
        job *j = *p;
        if (j->req == q) {
            *p = j->next;
            q->queued--;
            free(j);
        } else {
            l->tail = j;
            p = &j->next;
        }
    }
}

static void
dequeue_all(llmdd_request *q)
{
    if (q->lqs == NULL)
        return;
    for (uint32_t i = 0; i < q->nlegs; i++)
        dequeue_lq(q, q->lqs[i]);
}

/* r->lock held. Whether the request can finish now; claims it if so. */
static bool
finish_claim(llmdd_request *q)
{
    if (q->queued > 0 || q->running > 0)
        return false;
    if (q->state == RQ_ACTIVE && q->layers_left == 0) {
        q->status = LLM_SUCCESS;
    } else if (q->state != RQ_ENDING) {
        return false;
    }
    q->state = RQ_FINISHING;
    return true;
}

/* r->lock held. A request ends: fails with `why` unless it ended already. */
static void
end_locked(llmdd_request *q, llmdd_status why)
{
    if (q->state != RQ_ACTIVE)
        return;
    q->state = RQ_ENDING;
    q->status = why;
    dequeue_all(q);
    llmdd__cancel_fire(&q->cancel);
}

/* r->lock held. */
static void
cq_remove(struct llmdd__reqs *r, llmdd_request *q)
{
    if (!q->in_cq)
        return;
    if (q->cq_prev != NULL)
        q->cq_prev->cq_next = q->cq_next;
    else
        r->cq_head = q->cq_next;
    if (q->cq_next != NULL)
        q->cq_next->cq_prev = q->cq_prev;
    else
        r->cq_tail = q->cq_prev;
    q->in_cq = false;
    if (r->cq_head == NULL) {
        uint64_t v;
        (void)!read(r->cq_fd, &v, sizeof(v));
    }
}

/* r->lock held. */
static void
cq_add(struct llmdd__reqs *r, llmdd_request *q)
{
    q->cq_next = NULL;
    q->cq_prev = r->cq_tail;
    if (r->cq_tail != NULL)
        r->cq_tail->cq_next = q;
    else
        r->cq_head = q;
    r->cq_tail = q;
    q->in_cq = true;
    if (q->cq_prev == NULL) {
        uint64_t one = 1;
        (void)!write(r->cq_fd, &one, sizeof(one));
    }
}

/*
 * Called without locks by whoever claimed the finish: the notification of a
 * successful transfer (bounded by the request's own deadline), then the
 * references, then done.
 */
static void
finish(llmdd_request *q, int64_t deadline)
{
    struct llmdd__reqs *r = q->r;

    (void)deadline; /* each group was notified when its bytes landed */
    llmdd__metrics_xfer(q->dd, q->op, q->legs[0].link->ops, q->status,
                        q->bytes, q->t0);
    for (uint32_t i = 0; i < q->nlegs; i++) {
        llmdd__link_remote_put(q->legs[i].link, q->legs[i].rc);
        llmdd__link_put(q->legs[i].link);
    }
    llmdd__cache_put(q->dd, q->lc);
    pthread_mutex_lock(&r->lock);
    /* Others read these under the lock (end_matching). */
    for (uint32_t i = 0; i < q->nlegs; i++) {
        q->legs[i].rc = NULL;
        q->legs[i].link = NULL;
    }
    q->lc = NULL;
    q->state = RQ_DONE;
    if ((q->flags & LLMDD_XFER_COMPLETION) && q->refs > 0)
        cq_add(r, q);
    pthread_cond_broadcast(&r->cond);
    pthread_mutex_unlock(&r->lock);
}

/* The tensors of one source layer, as a sub-transfer of x. */
static llmdd__xfer
layer_xfer(const llmdd_request *q, const llmdd__request_leg *g, uint32_t layer)
{
    llmdd__xfer x = g->x;

    x.remote_first = g->x.remote_first + layer * q->tnpl;
    x.local = g->x.local + layer * q->tnpl;
    x.count = q->tnpl;
    return x;
}

/*
 * Runs one job on the calling thread (a worker, or the caller of a
 * synchronous call), and finishes the request if this was its last.
 */
static void
job_run(struct llmdd__reqs *r, job *j)
{
    llmdd_request *q = j->req;
    llmdd__request_leg *g = &q->legs[j->leg];
    llmdd_status st = LLM_SUCCESS;

    pthread_mutex_lock(&r->lock);
    q->queued--;
    bool go = q->state == RQ_ACTIVE;
    if (go)
        q->running++;
    pthread_mutex_unlock(&r->lock);

    if (go && g->x.nruns > 0) {
        llmdd__xfer x =
            j->layer < 0 ? g->x : layer_xfer(q, g, (uint32_t)j->layer);
        x.deadline_ms = j->deadline;
        x.cancel = &q->cancel;
        if (llmdd__now_ms() >= x.deadline_ms) {
            st = LLM_TIMEOUT;
        } else if (!llmdd__link_enter(g->link)) {
            st = LLM_NOT_YET_LINK;
        } else {
            if (llmdd__cancel_enter(&q->cancel, q->posted) != 0) {
                st = LLM_OUT_OF_MEMORY; /* no eventfd (logged): EMFILE */
            } else {
                st = g->link->ops->xfer(g->link, &x);
                llmdd__cancel_leave();
            }
            llmdd__link_leave(g->link);
            llmdd__link_status(g->link, st);
        }
        if (st == LLM_KV_CACHE_NOT_EXIST)
            llmdd__link_forget(g->link, g->rc->id);
    }
    if (go && st == LLM_SUCCESS) {
        /* The group's last job: its peer's bytes landed, it is told now
         * (each peer of a slice request after its own bytes). */
        pthread_mutex_lock(&r->lock);
        bool tell = --q->group_left[g->group] == 0 && q->notify_len > 0 &&
                    q->state == RQ_ACTIVE;
        pthread_mutex_unlock(&r->lock);
        if (tell)
            st = llmdd__notify_send(g->link, q->notify, q->notify_len,
                                    j->deadline);
    }
    pthread_mutex_lock(&r->lock);
    if (go) {
        q->running--;
        if (st == LLM_SUCCESS)
            q->layers_left--;
        else
            end_locked(q, st);
    }
    bool fin = finish_claim(q);
    pthread_mutex_unlock(&r->lock);
    if (fin)
        finish(q, j->deadline);
}

static void *
worker_main(void *arg)
{
    llmdd *dd = arg;
    struct llmdd__reqs *r = dd->reqs;

    pthread_mutex_lock(&r->lock);
    for (;;) {
        bool timed_out = false;
        while (r->ring_head == NULL && !r->stop && !timed_out) {
            if (r->nthreads > WORKERS_MIN) {
                int64_t until = llmdd__now_ms() + WORKER_IDLE_MS;
                llmdd__cond_wait_until(&r->work, &r->lock, until);
                timed_out = llmdd__now_ms() >= until;
            } else {
                pthread_cond_wait(&r->work, &r->lock);
            }
        }
        if (r->ring_head == NULL)
            break; /* stopping, or an extra worker without work */
        lq *l = r->ring_head;
        r->ring_head = l->next_ready;
        if (r->ring_head == NULL)
            r->ring_tail = NULL;
        l->ready = false;
        job *j = l->head;
        if (j == NULL)
            continue; /* its jobs were dequeued (cancel) meanwhile */
        l->head = j->next;
        if (l->head == NULL)
            l->tail = NULL;
        l->running++;
        l->refs++; /* the request may be freed once the job finished it */
        r->idle--;
        ring_offer(r, l); /* its next job, behind the other links */
        if (r->ring_head != NULL)
            worker_add(r, dd);
        pthread_mutex_unlock(&r->lock);
        job_run(r, j);
        free(j);
        pthread_mutex_lock(&r->lock);
        r->idle++;
        l->running--;
        ring_offer(r, l);
        lq_put(r, l);
    }
    r->idle--;
    r->nthreads--;
    pthread_cond_broadcast(&r->cond);
    pthread_mutex_unlock(&r->lock);
    return NULL;
}

/* The request's own memory; its reference on r goes last. */
static void
request_destroy(llmdd_request *q)
{
    struct llmdd__reqs *r = q->r;

    llmdd__cancel_fini(&q->cancel);
    for (uint32_t i = 0; i < q->nlegs; i++) {
        free((void *)q->legs[i].x.runs);
        free((void *)q->legs[i].x.local);
    }
    free(q->legs);
    free(q->lqs);
    free(q->group_left);
    free(q->marked);
    free(q->notify);
    free(q);
    reqs_unref(r);
}

/* Releases what a plan holds: its references and its arrays. */
static void
plan_release(llmdd *dd, const llmdd__request_plan *p)
{
    if (p->nlegs == 0) {
        llmdd__link_remote_put(p->link, p->rc);
        llmdd__link_put(p->link);
        free((void *)p->x.runs);
        free((void *)p->x.local);
    }
    for (uint32_t i = 0; i < p->nlegs; i++) {
        llmdd__link_remote_put(p->legs[i].link, p->legs[i].rc);
        llmdd__link_put(p->legs[i].link);
        free((void *)p->legs[i].x.runs);
        free((void *)p->legs[i].x.local);
    }
    free(p->legs);
    llmdd__cache_put(dd, p->lc);
}

/* The plan's legs as the request keeps them: a copy of the array, or one
 * leg made of the single link, rc and x. The plan's array goes. */
static llmdd__request_leg *
plan_legs(const llmdd__request_plan *p, uint32_t *n, uint32_t *ngroups)
{
    llmdd__request_leg *legs;

    if (p->nlegs > 0) {
        *n = p->nlegs;
        *ngroups = p->ngroups;
        return p->legs;
    }
    legs = malloc(sizeof(*legs));
    if (legs != NULL)
        *legs = (llmdd__request_leg){
            .link = p->link, .rc = p->rc, .x = p->x, .group = 0};
    *n = 1;
    *ngroups = 1;
    return legs;
}

llmdd_status
llmdd__request_submit(llmdd *dd, const llmdd__request_plan *p,
                      llmdd_request **req_out)
{
    bool posted = req_out != NULL;
    bool layerwise = posted && (p->flags & LLMDD_XFER_LAYERWISE) != 0;
    struct llmdd__reqs *r = dd->reqs;
    llmdd__link *link0 = p->nlegs > 0 ? p->legs[0].link : p->link;
    llmdd_request *q = NULL;
    job *j = NULL;
    llmdd_status st = LLM_OUT_OF_MEMORY;
    uint32_t nlegs = 0, ngroups = 0;
    llmdd__request_leg *legs = NULL;

    q = calloc(1, sizeof(*q));
    if (q == NULL)
        goto err_plan;
    legs = plan_legs(p, &nlegs, &ngroups);
    q->group_left = calloc(ngroups, sizeof(*q->group_left));
    q->lqs = calloc(nlegs, sizeof(*q->lqs));
    if (legs == NULL || q->group_left == NULL || q->lqs == NULL)
        goto err_req;
    q->r = r;
    q->dd = dd;
    q->posted = posted;
    q->flags = posted ? p->flags : 0;
    q->wait_ms = llmdd__wait_ms(dd);
    q->layers_left = nlegs;
    q->refs = 1;
    llmdd__cancel_init(&q->cancel);
    if (layerwise) {
        q->tnpl = p->tnpl;
        q->nlayers = legs[0].x.count / p->tnpl;
        q->layers_left = q->nlayers * nlegs;
        q->marked = calloc(q->nlayers, 1);
        if (q->marked == NULL)
            goto err_req;
    }
    for (uint32_t i = 0; i < nlegs; i++)
        q->group_left[legs[i].group] += layerwise ? q->nlayers : 1;
    if (p->notify_len > 0) {
        q->notify = malloc(p->notify_len);
        if (q->notify == NULL)
            goto err_req;
        memcpy(q->notify, p->notify, p->notify_len);
        q->notify_len = p->notify_len;
    }
    if (!layerwise && (j = calloc(nlegs, sizeof(*j))) == NULL)
        goto err_req;

    pthread_mutex_lock(&r->lock);
    if (r->stop) { /* finalize has begun */
        pthread_mutex_unlock(&r->lock);
        st = LLM_FAILED;
        goto err_req;
    }
    for (uint32_t i = 0; posted && i < nlegs; i++) {
        if ((q->lqs[i] = lq_get(r, legs[i].link)) == NULL) {
            while (i-- > 0)
                lq_put(r, q->lqs[i]);
            pthread_mutex_unlock(&r->lock);
            goto err_req;
        }
    }
    r->refs++;
    /* The request owns the plan and its references from here on. */
    q->legs = legs;
    q->nlegs = nlegs;
    q->ngroups = ngroups;
    q->op = p->op;
    q->bytes = p->bytes;
    q->t0 = p->t0;
    q->lc = p->lc;
    list_add(&r->all, q);
    /* Before any worker can end it: a completion may be collected on
     * another thread before this call returns, and the caller's handle
     * must be there by then. */
    if (posted)
        *req_out = q;
    for (uint32_t i = 0; j != NULL && i < nlegs; i++) {
        job *ji = posted ? malloc(sizeof(*ji)) : &j[i];
        if (ji == NULL) { /* posted: the jobs so far run, the rest fail */
            end_locked(q, LLM_OUT_OF_MEMORY);
            break;
        }
        *ji = (job){.req = q, .leg = i, .layer = -1,
                    .deadline = legs[i].x.deadline_ms};
        if (posted)
            enqueue(r, ji);
        else
            q->queued++;
    }
    if (posted && j != NULL && finish_claim(q)) {
        pthread_mutex_unlock(&r->lock);
        free(j);
        finish(q, 0);
        return LLM_SUCCESS;
    }
    pthread_mutex_unlock(&r->lock);

    if (posted) {
        free(j);
        return LLM_SUCCESS;
    }
    /* The synchronous call: this thread moves the bytes, leg by leg. */
    for (uint32_t i = 0; j != NULL && i < nlegs; i++)
        job_run(r, &j[i]);
    free(j);
    st = q->status;
    llmdd_request_free(q);
    return st;

err_req:
    llmdd__cancel_fini(&q->cancel);
    free(q->marked);
    free(q->notify);
    free(q->group_left);
    free(q->lqs);
    if (p->nlegs == 0)
        free(legs);
    free(q);
    q = NULL;
err_plan:
    if (st == LLM_OUT_OF_MEMORY)
        log_error("requests: out of memory for a %s request",
                  posted ? "posted" : "synchronous");
    free(j);
    llmdd__metrics_xfer(dd, p->op, link0->ops, st, p->bytes, p->t0);
    plan_release(dd, p);
    return st;
}

/* r->lock held. A thread leaves a request it held; the last frees it. */
static bool
request_unref(llmdd_request *q)
{
    return --q->refs == 0;
}

llmdd_status
llmdd_request_wait(llmdd_request *q, int32_t timeout_ms)
{
    if (q == NULL || timeout_ms < -1)
        return LLM_PARAM_INVALID;
    struct llmdd__reqs *r = q->r;
    int64_t deadline =
        timeout_ms < 0 ? INT64_MAX : llmdd__now_ms() + timeout_ms;
    pthread_mutex_lock(&r->lock);
    q->refs++;
    while (q->state != RQ_DONE && timeout_ms != 0 &&
           llmdd__now_ms() < deadline)
        llmdd__cond_wait_until(&r->cond, &r->lock, deadline);
    llmdd_status st = q->state == RQ_DONE ? q->status : LLM_WAIT_PROC_TIMEOUT;
    bool last = request_unref(q);
    pthread_mutex_unlock(&r->lock);
    if (last) /* freed meanwhile by another thread */
        request_destroy(q);
    return st;
}

/* r->lock held. Ends q and waits until it is done. */
static void
cancel_locked(struct llmdd__reqs *r, llmdd_request *q)
{
    end_locked(q, LLM_FAILED);
    if (finish_claim(q)) {
        pthread_mutex_unlock(&r->lock);
        finish(q, 0);
        pthread_mutex_lock(&r->lock);
    }
    while (q->state != RQ_DONE)
        pthread_cond_wait(&r->cond, &r->lock);
}

llmdd_status
llmdd_request_cancel(llmdd_request *q)
{
    if (q == NULL)
        return LLM_PARAM_INVALID;
    struct llmdd__reqs *r = q->r;
    pthread_mutex_lock(&r->lock);
    q->refs++;
    cancel_locked(r, q);
    bool last = request_unref(q);
    pthread_mutex_unlock(&r->lock);
    if (last)
        request_destroy(q);
    return LLM_SUCCESS;
}

llmdd_status
llmdd_request_layer_ready(llmdd_request *q, uint32_t layer)
{
    if (q == NULL || q->marked == NULL || layer >= q->nlayers)
        return LLM_PARAM_INVALID;
    struct llmdd__reqs *r = q->r;
    job *j = malloc(sizeof(*j));
    if (j == NULL) {
        log_error("requests: out of memory for a layer mark");
        return LLM_OUT_OF_MEMORY;
    }
    /* Each layer's wait time counts from its mark. */
    int64_t deadline = llmdd__now_ms() + q->wait_ms;
    pthread_mutex_lock(&r->lock);
    if (q->marked[layer] || q->state != RQ_ACTIVE) {
        pthread_mutex_unlock(&r->lock);
        free(j);
        return LLM_SUCCESS; /* a second mark, or an ended request */
    }
    q->marked[layer] = 1;
    /* One job per leg, each its own allocation (a job is freed by the
     * worker that ran it). */
    for (uint32_t i = 0; i < q->nlegs; i++) {
        job *ji = i == 0 ? &j[0] : malloc(sizeof(*ji));
        if (ji == NULL) {
            end_locked(q, LLM_OUT_OF_MEMORY);
            break;
        }
        *ji = (job){.req = q, .leg = i, .layer = (int32_t)layer,
                    .deadline = deadline};
        enqueue(r, ji);
    }
    pthread_mutex_unlock(&r->lock);
    return LLM_SUCCESS;
}

void
llmdd_request_free(llmdd_request *q)
{
    if (q == NULL)
        return;
    struct llmdd__reqs *r = q->r;
    pthread_mutex_lock(&r->lock);
    cancel_locked(r, q);
    list_remove(&r->all, q);
    cq_remove(r, q);
    for (uint32_t i = 0; q->lqs != NULL && i < q->nlegs; i++) {
        lq_put(r, q->lqs[i]);
        q->lqs[i] = NULL;
    }
    bool last = request_unref(q);
    pthread_mutex_unlock(&r->lock);
    if (last)
        request_destroy(q);
}

int
llmdd_completion_fd(llmdd *dd)
{
    if (dd == NULL || llmdd__ready(dd) != LLM_SUCCESS)
        return -1;
    return dd->reqs->cq_fd;
}

llmdd_status
llmdd_get_completions(llmdd *dd, llmdd_request **out, size_t cap,
                      size_t *count_out)
{
    llmdd_status st;

    if (dd == NULL)
        return LLM_PARAM_INVALID;
    if ((st = llmdd__ready(dd)) != LLM_SUCCESS)
        return st;
    if (count_out == NULL || (out == NULL && cap > 0))
        return LLM_PARAM_INVALID;
    struct llmdd__reqs *r = dd->reqs;
    size_t k = 0;
    pthread_mutex_lock(&r->lock);
    while (k < cap && r->cq_head != NULL) {
        llmdd_request *q = r->cq_head;
        cq_remove(r, q);
        out[k++] = q;
    }
    pthread_mutex_unlock(&r->lock);
    *count_out = k;
    return LLM_SUCCESS;
}

/*
 * Ends the posted requests that hold `link` (it went down) or `cache` (it
 * is being removed) with LLM_NOT_YET_LINK or LLM_KV_CACHE_NOT_EXIST,
 * without waiting for their running jobs (cache removal waits for the
 * cache's references, which the requests keep until done). Synchronous
 * calls end by themselves within their wait time, with their transport's
 * own status. No lock of dd may be held.
 */
static bool
has_link(const llmdd_request *q, const llmdd__link *link)
{
    for (uint32_t i = 0; i < q->nlegs; i++)
        if (q->legs[i].link == link)
            return true;
    return false;
}

static void
end_matching(llmdd *dd, const llmdd__link *link, const llmdd__cache *cache)
{
    pthread_mutex_lock(&dd->lock);
    struct llmdd__reqs *r = dd->reqs;
    pthread_mutex_unlock(&dd->lock);
    if (r == NULL)
        return;
    pthread_mutex_lock(&r->lock);
    for (;;) {
        llmdd_request *q = r->all;
        while (q != NULL &&
               (!q->posted || q->state != RQ_ACTIVE ||
                (link != NULL && !has_link(q, link)) ||
                (cache != NULL && q->lc != cache)))
            q = q->next;
        if (q == NULL)
            break;
        end_locked(q, link != NULL ? LLM_NOT_YET_LINK : LLM_KV_CACHE_NOT_EXIST);
        if (finish_claim(q)) {
            /* Nothing of it runs: finish it here, with the lock dropped
             * (it is no longer ACTIVE: the search moves on). */
            pthread_mutex_unlock(&r->lock);
            finish(q, 0);
            pthread_mutex_lock(&r->lock);
        }
    }
    pthread_mutex_unlock(&r->lock);
}

void
llmdd__requests_link_down(llmdd *dd, const llmdd__link *link)
{
    end_matching(dd, link, NULL);
}

void
llmdd__requests_cache_removed(llmdd *dd, const llmdd__cache *cache)
{
    end_matching(dd, NULL, cache);
}

void
llmdd__requests_fini(llmdd *dd)
{
    struct llmdd__reqs *r = dd->reqs;

    if (r == NULL)
        return;
    pthread_mutex_lock(&r->lock);
    r->stop = true;
    pthread_cond_broadcast(&r->work);
    for (;;) {
        llmdd_request *q = r->all;
        while (q != NULL && q->state == RQ_DONE)
            q = q->next;
        if (q == NULL)
            break;
        q->refs++; /* the caller may free it while we wait */
        cancel_locked(r, q);
        if (request_unref(q)) {
            pthread_mutex_unlock(&r->lock);
            request_destroy(q);
            pthread_mutex_lock(&r->lock);
        }
    }
    while (r->nthreads > 0)
        pthread_cond_wait(&r->cond, &r->lock);
    pthread_mutex_unlock(&r->lock);
}

void
llmdd__requests_free(llmdd *dd)
{
    struct llmdd__reqs *r = dd->reqs;

    if (r == NULL)
        return;
    dd->reqs = NULL;
    reqs_unref(r);
}
