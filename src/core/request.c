/*
 * Requests: a planned transfer (transfer.c) and its life until done.
 *
 * The synchronous calls and the posted ones share this path: transfer.c
 * validates and plans, then either runs the request's one job on the
 * calling thread (synchronous) or queues it for the instance's workers
 * (posted). A layer-wise push queues one job per marked layer. Workers
 * sleep on a condition variable when there is nothing to run and in the
 * transport's socket waits while a job runs; none spins.
 *
 * A request holds references on its link, its local cache and the remote
 * cache from post until done, so nothing it touches is freed under it.
 * It is done once no job of it is queued or running and either every byte
 * moved, a job failed, or it was cancelled. Then, on success, its
 * notification goes to the peer (after the bytes landed: the transport has
 * returned), the references go, and waiters wake.
 *
 * Cancel removes queued jobs and wakes running ones: their transport waits
 * poll the request's cancel eventfd (llmdd__tls_cancel) or block on a
 * socket they armed, which cancel shuts down, so a socket transfer gives up
 * its connection at once; a memcpy finishes first. Cancel
 * returns when the request is done, so nothing writes into the caller's
 * memory afterwards.
 *
 * Locking: reqs->lock guards the job queue, the list of requests and every
 * request's state; it is never held across I/O, a copy or another lock
 * but a cancellation's own (net.h), which is taken last.
 * Workers sleep on `work` (signalled once a job), waiters on `cond`.
 */
#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "core/internal.h"

#define WORKERS 4

typedef struct job {
    llmdd_request *req;
    int32_t layer; /* -1: the whole transfer */
    int64_t deadline;
    struct job *next;
} job;

struct llmdd__reqs {
    pthread_mutex_t lock;
    pthread_cond_t work; /* a job was queued, or stop: wakes one worker */
    pthread_cond_t cond; /* a request is done: wakes its waiters */
    job *head, *tail;
    llmdd_request *all; /* not yet freed: finalize detaches them */
    pthread_t threads[WORKERS];
    int nthreads;
    bool stop;
};

struct llmdd_request {
    llmdd *dd;
    struct llmdd__reqs *owner; /* NULL once detached (finalize) */
    llmdd__link *link;
    llmdd__cache *lc;
    llmdd__remote_cache *rc;
    llmdd__xfer x; /* the whole transfer; x.local and x.runs are ours */
    uint32_t tnpl, nlayers;
    uint8_t *marked; /* per layer, layer-wise only */
    uint32_t layers_left;
    uint8_t *notify;
    size_t notify_len;
    enum llmdd__metrics_op op;
    uint64_t bytes, t0;
    llmdd__cancel cancel; /* fd -1 for synchronous calls */

    /* Guarded by owner->lock. */
    int queued, running;
    bool failed, cancelled, finishing, done;
    llmdd_status status;
    llmdd_request *prev, *next; /* owner->all */
};

static void *worker_main(void *arg);

/* Creates dd->reqs on first use; starts the workers when `workers`. */
static llmdd_status
reqs_get(llmdd *dd, bool workers, struct llmdd__reqs **out)
{
    struct llmdd__reqs *r;
    llmdd_status st = LLM_SUCCESS;

    pthread_mutex_lock(&dd->lock);
    if ((r = dd->reqs) == NULL) {
        r = calloc(1, sizeof(*r));
        if (r == NULL) {
            pthread_mutex_unlock(&dd->lock);
            return LLM_OUT_OF_MEMORY;
        }
        pthread_mutex_init(&r->lock, NULL);
        pthread_cond_init(&r->work, NULL);
        llmdd__cond_init(&r->cond);
        dd->reqs = r;
    }
    pthread_mutex_unlock(&dd->lock);
    if (!workers)
        goto out;
    pthread_mutex_lock(&r->lock);
    while (!r->stop && r->nthreads < WORKERS) {
        if (pthread_create(&r->threads[r->nthreads], NULL, worker_main, dd) !=
            0) {
            if (r->nthreads == 0) {
                log_error("requests: cannot start a worker thread");
                st = LLM_FAILED;
            }
            break;
        }
        r->nthreads++;
    }
    if (r->stop)
        st = LLM_FAILED;
    pthread_mutex_unlock(&r->lock);
out:
    *out = r;
    return st;
}

/* owner->lock held. */
static void
list_add(struct llmdd__reqs *r, llmdd_request *q)
{
    q->prev = NULL;
    q->next = r->all;
    if (r->all != NULL)
        r->all->prev = q;
    r->all = q;
}

static void
list_remove(struct llmdd__reqs *r, llmdd_request *q)
{
    if (q->prev != NULL)
        q->prev->next = q->next;
    else if (r->all == q)
        r->all = q->next;
    if (q->next != NULL)
        q->next->prev = q->prev;
    q->prev = q->next = NULL;
}

/* owner->lock held. */
static void
enqueue(struct llmdd__reqs *r, job *j)
{
    j->next = NULL;
    if (r->tail != NULL)
        r->tail->next = j;
    else
        r->head = j;
    r->tail = j;
    j->req->queued++;
    pthread_cond_signal(&r->work); /* one job, one worker */
}

/* owner->lock held. Drops the request's queued jobs. */
static void
dequeue_all(struct llmdd__reqs *r, llmdd_request *q)
{
    job **p = &r->head;

    r->tail = NULL;
    while (*p != NULL) {
        job *j = *p;
        if (j->req == q) {
            *p = j->next;
            q->queued--;
            free(j);
        } else {
            r->tail = j;
            p = &j->next;
        }
    }
}

/* owner->lock held. Whether the request can finish now; claims it if so. */
static bool
finish_claim(llmdd_request *q)
{
    if (q->done || q->finishing || q->queued > 0 || q->running > 0)
        return false;
    if (!q->failed && !q->cancelled && q->layers_left > 0)
        return false;
    q->finishing = true;
    if (q->cancelled && !q->failed)
        q->status = LLM_FAILED;
    else if (!q->failed)
        q->status = LLM_SUCCESS;
    return true;
}

/*
 * Called without locks by whoever claimed the finish: the notification of a
 * successful transfer, then the references, then done.
 */
static void
finish(llmdd_request *q)
{
    struct llmdd__reqs *r = q->owner;

    if (q->status == LLM_SUCCESS && q->notify_len > 0) {
        int64_t deadline = llmdd__now_ms() + llmdd__wait_ms(q->dd);
        llmdd_status st =
            llmdd__notify_send(q->link, q->notify, q->notify_len, deadline);
        if (st != LLM_SUCCESS)
            q->status = st;
    }
    llmdd__metrics_xfer(q->dd, q->op, q->link->ops, q->status, q->bytes, q->t0);
    llmdd__link_remote_put(q->link, q->rc);
    llmdd__link_put(q->link);
    llmdd__cache_put(q->dd, q->lc);
    pthread_mutex_lock(&r->lock);
    /* Others read these under the lock (end_matching). */
    q->rc = NULL;
    q->link = NULL;
    q->lc = NULL;
    q->done = true;
    pthread_cond_broadcast(&r->cond);
    pthread_mutex_unlock(&r->lock);
}

/* The tensors of one source layer, as a sub-transfer of x. */
static llmdd__xfer
layer_xfer(const llmdd_request *q, uint32_t layer)
{
    llmdd__xfer x = q->x;

    x.remote_first = q->x.remote_first + layer * q->tnpl;
    x.local = q->x.local + layer * q->tnpl;
    x.count = q->tnpl;
    return x;
}

/* Runs one job on the calling thread and finishes the request if due. */
static void
job_run(struct llmdd__reqs *r, job *j)
{
    llmdd_request *q = j->req;
    llmdd_status st;

    pthread_mutex_lock(&r->lock);
    q->queued--;
    bool skip = q->failed || q->cancelled;
    if (!skip)
        q->running++;
    pthread_mutex_unlock(&r->lock);

    if (!skip) {
        llmdd__xfer x = j->layer < 0 ? q->x : layer_xfer(q, (uint32_t)j->layer);
        x.deadline_ms = j->deadline;
        if (llmdd__now_ms() >= x.deadline_ms) {
            st = LLM_TIMEOUT;
        } else {
            llmdd__tls_cancel = q->cancel.fd >= 0 ? &q->cancel : NULL;
            st = q->link->ops->xfer(q->link, &x);
            llmdd__tls_cancel = NULL;
        }
        if (st == LLM_KV_CACHE_NOT_EXIST)
            llmdd__link_forget(q->link, q->rc->id);
        pthread_mutex_lock(&r->lock);
        q->running--;
        if (st == LLM_SUCCESS) {
            q->layers_left--;
        } else if (!q->failed) {
            q->failed = true;
            q->status = q->cancelled ? LLM_FAILED : st;
        }
    } else {
        pthread_mutex_lock(&r->lock);
    }
    bool fin = finish_claim(q);
    pthread_mutex_unlock(&r->lock);
    if (fin)
        finish(q);
}

static void *
worker_main(void *arg)
{
    llmdd *dd = arg;
    struct llmdd__reqs *r = dd->reqs;

    pthread_mutex_lock(&r->lock);
    for (;;) {
        while (r->head == NULL && !r->stop)
            pthread_cond_wait(&r->work, &r->lock);
        if (r->head == NULL)
            break;
        job *j = r->head;
        r->head = j->next;
        if (r->head == NULL)
            r->tail = NULL;
        pthread_mutex_unlock(&r->lock);
        job_run(r, j);
        free(j);
        pthread_mutex_lock(&r->lock);
    }
    pthread_mutex_unlock(&r->lock);
    return NULL;
}

static void
request_destroy(llmdd_request *q)
{
    if (q->cancel.fd >= 0)
        llmdd__cancel_fini(&q->cancel);
    free((void *)q->x.runs);
    free((void *)q->x.local);
    free(q->marked);
    free(q->notify);
    free(q);
}

/* Releases what a plan holds: its references and its arrays. */
static void
plan_release(llmdd *dd, const llmdd__request_plan *p)
{
    llmdd__link_remote_put(p->link, p->rc);
    llmdd__link_put(p->link);
    llmdd__cache_put(dd, p->lc);
    free((void *)p->x.runs);
    free((void *)p->x.local);
}

llmdd_status
llmdd__request_submit(llmdd *dd, const llmdd__request_plan *p,
                      llmdd_request **req_out)
{
    bool async = req_out != NULL;
    bool layerwise = async && (p->flags & LLMDD_XFER_LAYERWISE) != 0;
    struct llmdd__reqs *r;
    llmdd_request *q = NULL;
    job *j = NULL;
    llmdd_status st;

    if ((st = reqs_get(dd, async, &r)) != LLM_SUCCESS)
        goto err_plan;
    st = LLM_OUT_OF_MEMORY;
    q = calloc(1, sizeof(*q));
    if (q == NULL)
        goto err_plan;
    q->dd = dd;
    q->owner = r;
    q->cancel.fd = -1;
    q->layers_left = 1;
    if (layerwise) {
        q->tnpl = p->tnpl;
        q->nlayers = p->x.count / p->tnpl;
        q->layers_left = q->nlayers;
        q->marked = calloc(q->nlayers, 1);
        if (q->marked == NULL)
            goto err_plan;
    }
    if (p->notify_len > 0) {
        q->notify = malloc(p->notify_len);
        if (q->notify == NULL)
            goto err_plan;
        memcpy(q->notify, p->notify, p->notify_len);
        q->notify_len = p->notify_len;
    }
    if (async) {
        if (llmdd__cancel_init(&q->cancel) != 0)
            goto err_plan;
    }
    if (!layerwise && (j = malloc(sizeof(*j))) == NULL)
        goto err_plan;

    pthread_mutex_lock(&r->lock);
    if (r->stop) { /* finalize has begun */
        pthread_mutex_unlock(&r->lock);
        st = LLM_FAILED;
        goto err_plan;
    }
    /* The request owns the plan and its references from here on. */
    q->x = p->x;
    q->op = p->op;
    q->bytes = p->bytes;
    q->t0 = p->t0;
    q->link = p->link;
    q->lc = p->lc;
    q->rc = p->rc;
    list_add(r, q);
    if (j != NULL) {
        *j = (job){.req = q, .layer = -1, .deadline = p->x.deadline_ms};
        if (async)
            enqueue(r, j);
        else
            q->queued++;
    }
    pthread_mutex_unlock(&r->lock);

    if (async) {
        *req_out = q;
        return LLM_SUCCESS;
    }
    job_run(r, j); /* the synchronous call: this thread moves the bytes */
    free(j);
    st = q->status;
    llmdd_request_free(q);
    return st;

err_plan:
    free(j);
    if (q != NULL)
        request_destroy(q);
    llmdd__metrics_xfer(dd, p->op, p->link->ops, st, p->bytes, p->t0);
    plan_release(dd, p);
    return st;
}

llmdd_status
llmdd_request_wait(llmdd_request *q, int32_t timeout_ms)
{
    if (q == NULL || timeout_ms < -1)
        return LLM_PARAM_INVALID;
    struct llmdd__reqs *r = q->owner;
    if (r == NULL) /* detached by finalize: done */
        return q->status;
    int64_t deadline =
        timeout_ms < 0 ? INT64_MAX : llmdd__now_ms() + timeout_ms;
    pthread_mutex_lock(&r->lock);
    while (!q->done && timeout_ms != 0 && llmdd__now_ms() < deadline)
        llmdd__cond_wait_until(&r->cond, &r->lock, deadline);
    llmdd_status st = q->done ? q->status : LLM_WAIT_PROC_TIMEOUT;
    pthread_mutex_unlock(&r->lock);
    return st;
}

/*
 * owner->lock held; drops it meanwhile. Ends q: no new job of it runs, and
 * running ones are woken. Does not wait for them: it may run on a thread
 * that is itself running a job of q (a transport dropping the link).
 */
static void
end_locked(struct llmdd__reqs *r, llmdd_request *q, llmdd_status why)
{
    if (q->done || q->finishing || q->cancelled)
        return; /* a finishing request has its status already */
    q->cancelled = true;
    if (why != LLM_FAILED && !q->failed) {
        q->failed = true;
        q->status = why;
    }
    dequeue_all(r, q);
    if (q->cancel.fd >= 0)
        llmdd__cancel_fire(&q->cancel);
    else
        atomic_store(&q->cancel.flag, true);
    if (finish_claim(q)) {
        pthread_mutex_unlock(&r->lock);
        finish(q);
        pthread_mutex_lock(&r->lock);
    }
}

/* owner->lock held. Ends q and waits until it is done. */
static void
cancel_locked(struct llmdd__reqs *r, llmdd_request *q, llmdd_status why)
{
    end_locked(r, q, why);
    while (!q->done)
        pthread_cond_wait(&r->cond, &r->lock);
}

llmdd_status
llmdd_request_cancel(llmdd_request *q)
{
    if (q == NULL)
        return LLM_PARAM_INVALID;
    struct llmdd__reqs *r = q->owner;
    if (r == NULL)
        return LLM_SUCCESS;
    pthread_mutex_lock(&r->lock);
    cancel_locked(r, q, LLM_FAILED);
    pthread_mutex_unlock(&r->lock);
    return LLM_SUCCESS;
}

llmdd_status
llmdd_request_layer_ready(llmdd_request *q, uint32_t layer)
{
    if (q == NULL || q->marked == NULL || layer >= q->nlayers)
        return LLM_PARAM_INVALID;
    struct llmdd__reqs *r = q->owner;
    if (r == NULL)
        return LLM_SUCCESS; /* ended by finalize; its wait says how */
    job *j = malloc(sizeof(*j));
    if (j == NULL)
        return LLM_OUT_OF_MEMORY;
    /* Each layer's wait time counts from its mark. */
    int64_t deadline = llmdd__now_ms() + llmdd__wait_ms(q->dd);
    pthread_mutex_lock(&r->lock);
    if (q->marked[layer] || q->done || q->finishing || q->cancelled ||
        q->failed) {
        pthread_mutex_unlock(&r->lock);
        free(j);
        return LLM_SUCCESS; /* a second mark, or an ended request */
    }
    q->marked[layer] = 1;
    *j = (job){.req = q, .layer = (int32_t)layer, .deadline = deadline};
    enqueue(r, j);
    pthread_mutex_unlock(&r->lock);
    return LLM_SUCCESS;
}

void
llmdd_request_free(llmdd_request *q)
{
    if (q == NULL)
        return;
    struct llmdd__reqs *r = q->owner;
    if (r != NULL) {
        pthread_mutex_lock(&r->lock);
        cancel_locked(r, q, LLM_FAILED);
        list_remove(r, q);
        pthread_mutex_unlock(&r->lock);
    }
    request_destroy(q);
}

/*
 * Ends the requests that hold `link` (it went down) or `cache` (it is being
 * removed) with LLM_NOT_YET_LINK or LLM_KV_CACHE_NOT_EXIST, without waiting
 * for their running jobs (cache removal waits for the cache's references,
 * which the requests keep until done). No lock of dd may be held.
 */
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
        /* Synchronous calls end by themselves within their wait time, with
         * their transport's own status, as before requests existed. */
        while (q != NULL &&
               (q->done || q->finishing || q->cancelled || q->cancel.fd < 0 ||
                (link != NULL && q->link != link) ||
                (cache != NULL && q->lc != cache)))
            q = q->next;
        if (q == NULL)
            break;
        end_locked(r, q,
                   link != NULL ? LLM_NOT_YET_LINK : LLM_KV_CACHE_NOT_EXIST);
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

/*
 * The request state itself stays until llmdd_destroy: threads of the
 * instance that finalize has not stopped yet (a transport's serving thread
 * dropping a link) may still look at it.
 */
void
llmdd__requests_fini(llmdd *dd)
{
    struct llmdd__reqs *r = dd->reqs;

    if (r == NULL)
        return;
    pthread_mutex_lock(&r->lock);
    r->stop = true;
    pthread_cond_broadcast(&r->work);
    for (llmdd_request *q = r->all; q != NULL; q = q->next)
        cancel_locked(r, q, LLM_FAILED);
    /* The requests stay the caller's to free; they no longer need us. */
    while (r->all != NULL) {
        llmdd_request *q = r->all;
        list_remove(r, q);
        q->owner = NULL;
    }
    int n = r->nthreads;
    pthread_mutex_unlock(&r->lock);
    for (int i = 0; i < n; i++)
        pthread_join(r->threads[i], NULL);
    pthread_mutex_lock(&r->lock);
    r->nthreads = 0;
    pthread_mutex_unlock(&r->lock);
}

void
llmdd__requests_restart(llmdd *dd)
{
    struct llmdd__reqs *r = dd->reqs;

    if (r == NULL)
        return;
    pthread_mutex_lock(&r->lock);
    r->stop = false;
    pthread_mutex_unlock(&r->lock);
}

void
llmdd__requests_free(llmdd *dd)
{
    struct llmdd__reqs *r = dd->reqs;

    if (r == NULL)
        return;
    dd->reqs = NULL;
    pthread_mutex_destroy(&r->lock);
    pthread_cond_destroy(&r->work);
    pthread_cond_destroy(&r->cond);
    free(r);
}
