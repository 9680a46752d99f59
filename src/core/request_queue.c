/*
 * Requests, the shared part (split from request.c): the workers and their
 * per-link queues (fairness: round robin over links, LINK_SHARE jobs of a
 * link at once), the request lists, the completion queue, and ending the
 * requests of a link or cache that went and of a finalizing instance.
 * Locking as request.c says: r->lock guards all of it.
 */
#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include "core/request_int.h"

static void *worker_main(void *arg);

void
llmdd__rq_reqs_unref(struct llmdd__reqs *r)
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

/*
 * r->lock held. One more worker, when a queue has a job it may start, all
 * workers are busy and the cap allows. A job of a link at its share waits
 * for that link's own workers: a layer marked while the request's earlier
 * layers move starts no thread (the marking thread is the prefill's).
 */
void
llmdd__rq_worker_add(struct llmdd__reqs *r, llmdd *dd)
{
    pthread_attr_t attr;
    pthread_t t;

    if (r->stop || r->idle > 0 || r->nthreads >= WORKERS_MAX ||
        (r->ring_head == NULL && r->nthreads > 0))
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
void
llmdd__rq_list_add(llmdd_request **head, llmdd_request *q)
{
    q->prev = NULL;
    q->next = *head;
    if (*head != NULL)
        (*head)->prev = q;
    *head = q;
}

void
llmdd__rq_list_remove(llmdd_request **head, llmdd_request *q)
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
lq *
llmdd__rq_lq_get(struct llmdd__reqs *r, const llmdd__link *link)
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

void
llmdd__rq_lq_put(struct llmdd__reqs *r, lq *l)
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
void
llmdd__rq_enqueue(struct llmdd__reqs *r, job *j)
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
    llmdd__rq_worker_add(r, q->dd);
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

void
llmdd__rq_dequeue_all(llmdd_request *q)
{
    if (q->lqs == NULL)
        return;
    for (uint32_t i = 0; i < q->nlegs; i++)
        dequeue_lq(q, q->lqs[i]);
}

/* r->lock held. Whether the request can finish now; claims it if so. */
bool
llmdd__rq_finish_claim(llmdd_request *q)
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
void
llmdd__rq_end_locked(llmdd_request *q, llmdd_status why)
{
    if (q->state != RQ_ACTIVE)
        return;
    q->state = RQ_ENDING;
    q->status = why;
    llmdd__rq_dequeue_all(q);
    llmdd__cancel_fire(&q->cancel);
}

/* r->lock held. */
void
llmdd__rq_cq_remove(struct llmdd__reqs *r, llmdd_request *q)
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
void
llmdd__rq_cq_add(struct llmdd__reqs *r, llmdd_request *q)
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
            llmdd__rq_worker_add(r, dd);
        pthread_mutex_unlock(&r->lock);
        llmdd__rq_job_run(r, j);
        free(j);
        pthread_mutex_lock(&r->lock);
        r->idle++;
        l->running--;
        ring_offer(r, l);
        llmdd__rq_lq_put(r, l);
    }
    r->idle--;
    r->nthreads--;
    pthread_cond_broadcast(&r->cond);
    pthread_mutex_unlock(&r->lock);
    return NULL;
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
        llmdd__rq_cq_remove(r, q);
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
        llmdd__rq_end_locked(q, link != NULL ? LLM_NOT_YET_LINK : LLM_KV_CACHE_NOT_EXIST);
        if (llmdd__rq_finish_claim(q)) {
            /* Nothing of it runs: finish it here, with the lock dropped
             * (it is no longer ACTIVE: the search moves on). */
            pthread_mutex_unlock(&r->lock);
            llmdd__rq_finish(q, 0);
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

bool
llmdd__requests_link_wait(llmdd *dd, const llmdd__link *link,
                          int64_t deadline_ms)
{
    pthread_mutex_lock(&dd->lock);
    struct llmdd__reqs *r = dd->reqs;
    pthread_mutex_unlock(&dd->lock);
    if (r == NULL)
        return true;
    pthread_mutex_lock(&r->lock);
    for (;;) {
        const llmdd_request *q = r->all;
        while (q != NULL && (q->state == RQ_DONE || !has_link(q, link)))
            q = q->next;
        if (q == NULL || llmdd__now_ms() >= deadline_ms) {
            pthread_mutex_unlock(&r->lock);
            return q == NULL;
        }
        /* r->cond: a request is done. */
        llmdd__cond_wait_until(&r->cond, &r->lock, deadline_ms);
    }
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
        llmdd__rq_cancel_locked(r, q);
        if (llmdd__rq_request_unref(q)) {
            pthread_mutex_unlock(&r->lock);
            llmdd__rq_request_destroy(q);
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
    llmdd__rq_reqs_unref(r);
}

