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
 * A request has legs (one for every call but slice transfers, one per slice
 * there), each a link, a remote cache and a planned transfer; legs to one
 * peer form a group, told with the request's notification once all its
 * jobs landed. A request holds references on its links, its local cache and
 * the remote caches from post until done, so nothing it touches is freed under it. Its
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

#include "core/request_int.h"

/*
 * Called without locks by whoever claimed the finish: the metrics, the
 * references, then done. Notifications went when each group's bytes landed
 * (llmdd__rq_job_run).
 */
void
llmdd__rq_finish(llmdd_request *q, int64_t deadline)
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
        llmdd__rq_cq_add(r, q);
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
void
llmdd__rq_job_run(struct llmdd__reqs *r, job *j)
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

    if (go && llmdd__xfer_nruns(&g->x) > 0) {
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
            llmdd__rq_end_locked(q, st);
    }
    bool fin = llmdd__rq_finish_claim(q);
    pthread_mutex_unlock(&r->lock);
    if (fin)
        llmdd__rq_finish(q, j->deadline);
}

/* The request's own memory; its reference on r goes last. */
void
llmdd__rq_request_destroy(llmdd_request *q)
{
    struct llmdd__reqs *r = q->r;

    llmdd__cancel_fini(&q->cancel);
    for (uint32_t i = 0; i < q->nlegs; i++) {
        free((void *)q->legs[i].x.runs);
        free((void *)q->legs[i].x.runs2);
        free((void *)q->legs[i].x.local);
    }
    free(q->legs);
    free(q->lqs);
    free(q->group_left);
    free(q->marked);
    free(q->notify);
    free(q);
    llmdd__rq_reqs_unref(r);
}

/* Releases what a plan holds: its references and its arrays. */
static void
plan_release(llmdd *dd, const llmdd__request_plan *p)
{
    if (p->nlegs == 0) {
        llmdd__link_remote_put(p->link, p->rc);
        llmdd__link_put(p->link);
        free((void *)p->x.runs);
        free((void *)p->x.runs2);
        free((void *)p->x.local);
    }
    for (uint32_t i = 0; i < p->nlegs; i++) {
        llmdd__link_remote_put(p->legs[i].link, p->legs[i].rc);
        llmdd__link_put(p->legs[i].link);
        free((void *)p->legs[i].x.runs);
        free((void *)p->legs[i].x.runs2);
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
    llmdd__cancel_init(&q->cancel); /* err_req finishes it */
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
        if ((q->lqs[i] = llmdd__rq_lq_get(r, legs[i].link)) == NULL) {
            while (i-- > 0)
                llmdd__rq_lq_put(r, q->lqs[i]);
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
    llmdd__rq_list_add(&r->all, q);
    /* Before any worker can end it: a completion may be collected on
     * another thread before this call returns, and the caller's handle
     * must be there by then. */
    if (posted)
        *req_out = q;
    for (uint32_t i = 0; j != NULL && i < nlegs; i++) {
        job *ji = posted ? malloc(sizeof(*ji)) : &j[i];
        if (ji == NULL) { /* posted: the jobs so far run, the rest fail */
            llmdd__rq_end_locked(q, LLM_OUT_OF_MEMORY);
            break;
        }
        *ji = (job){.req = q, .leg = i, .layer = -1,
                    .deadline = legs[i].x.deadline_ms};
        if (posted)
            llmdd__rq_enqueue(r, ji);
        else
            q->queued++;
    }
    if (posted && j != NULL && llmdd__rq_finish_claim(q)) {
        pthread_mutex_unlock(&r->lock);
        free(j);
        llmdd__rq_finish(q, 0);
        return LLM_SUCCESS;
    }
    pthread_mutex_unlock(&r->lock);

    if (posted) {
        free(j);
        return LLM_SUCCESS;
    }
    /* The synchronous call: this thread moves the bytes, leg by leg. */
    for (uint32_t i = 0; j != NULL && i < nlegs; i++)
        llmdd__rq_job_run(r, &j[i]);
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
bool
llmdd__rq_request_unref(llmdd_request *q)
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
    bool last = llmdd__rq_request_unref(q);
    pthread_mutex_unlock(&r->lock);
    if (last) /* freed meanwhile by another thread */
        llmdd__rq_request_destroy(q);
    return st;
}

/* r->lock held. Ends q and waits until it is done. */
void
llmdd__rq_cancel_locked(struct llmdd__reqs *r, llmdd_request *q)
{
    llmdd__rq_end_locked(q, LLM_FAILED);
    if (llmdd__rq_finish_claim(q)) {
        pthread_mutex_unlock(&r->lock);
        llmdd__rq_finish(q, 0);
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
    llmdd__rq_cancel_locked(r, q);
    bool last = llmdd__rq_request_unref(q);
    pthread_mutex_unlock(&r->lock);
    if (last)
        llmdd__rq_request_destroy(q);
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
            llmdd__rq_end_locked(q, LLM_OUT_OF_MEMORY);
            break;
        }
        *ji = (job){.req = q, .leg = i, .layer = (int32_t)layer,
                    .deadline = deadline};
        llmdd__rq_enqueue(r, ji);
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
    llmdd__rq_cancel_locked(r, q);
    llmdd__rq_list_remove(&r->all, q);
    llmdd__rq_cq_remove(r, q);
    for (uint32_t i = 0; q->lqs != NULL && i < q->nlegs; i++) {
        llmdd__rq_lq_put(r, q->lqs[i]);
        q->lqs[i] = NULL;
    }
    bool last = llmdd__rq_request_unref(q);
    pthread_mutex_unlock(&r->lock);
    if (last)
        llmdd__rq_request_destroy(q);
}
