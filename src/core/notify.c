/*
 * Received notifications: a bounded FIFO per instance and the eventfd that
 * is readable while it is not empty (llmdd_notify_fd, level-triggered: the
 * fd holds a count of 1 exactly while entries wait).
 *
 * At the bound (NOTIFY_QUEUE_MAX) nothing is dropped: the control thread
 * stops reading the link that filled it, so the sender's control
 * connection backs up and its llmdd_send_notify, or the finish of a request
 * carrying a notification, fails with LLM_TIMEOUT after its wait time. Once
 * llmdd_get_notifies makes room, reading resumes.
 *
 * Locking: n->lock guards the queue and the eventfd's count; dd->lock is
 * taken after it only to resume paused links.
 */
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include "core/internal.h"

#define NOTIFY_QUEUE_MAX 4096

typedef struct entry {
    struct entry *next;
    uint64_t cluster_id;
    size_t len;
    unsigned char msg[];
} entry;

struct llmdd__notifies {
    pthread_mutex_t lock;
    int efd;
    entry *head, *tail;
    size_t count;
    bool paused; /* a link stopped reading because the queue was full */
};

llmdd_status
llmdd__notify_init(llmdd *dd)
{
    struct llmdd__notifies *n = calloc(1, sizeof(*n));

    if (n == NULL)
        return LLM_OUT_OF_MEMORY;
    n->efd = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
    if (n->efd < 0) {
        free(n);
        return LLM_FAILED;
    }
    pthread_mutex_init(&n->lock, NULL);
    dd->notifies = n;
    return LLM_SUCCESS;
}

void
llmdd__notify_fini(llmdd *dd)
{
    struct llmdd__notifies *n = dd->notifies;

    if (n == NULL)
        return;
    while (n->head != NULL) {
        entry *e = n->head;
        n->head = e->next;
        free(e);
    }
    close(n->efd);
    pthread_mutex_destroy(&n->lock);
    free(n);
    dd->notifies = NULL;
}

bool
llmdd__notify_received(llmdd *dd, uint64_t cluster_id, const void *msg,
                       size_t len)
{
    struct llmdd__notifies *n = dd->notifies;
    entry *e = malloc(sizeof(*e) + len);

    if (e == NULL)
        return false;
    e->next = NULL;
    e->cluster_id = cluster_id;
    e->len = len;
    if (len > 0)
        memcpy(e->msg, msg, len);
    pthread_mutex_lock(&n->lock);
    if (n->tail != NULL)
        n->tail->next = e;
    else
        n->head = e;
    n->tail = e;
    if (n->count++ == 0) {
        uint64_t one = 1;
        (void)!write(n->efd, &one, sizeof(one));
    }
    bool full = n->count >= NOTIFY_QUEUE_MAX;
    if (full)
        n->paused = true;
    pthread_mutex_unlock(&n->lock);
    return true;
}

bool
llmdd__notify_full(llmdd *dd)
{
    struct llmdd__notifies *n = dd->notifies;

    pthread_mutex_lock(&n->lock);
    bool full = n->count >= NOTIFY_QUEUE_MAX;
    pthread_mutex_unlock(&n->lock);
    return full;
}

llmdd_status
llmdd_get_notifies(llmdd *dd, llmdd_notify *out, size_t cap, size_t *count_out)
{
    llmdd_status st;

    if (dd == NULL)
        return LLM_PARAM_INVALID;
    if ((st = llmdd__ready(dd)) != LLM_SUCCESS)
        return st;
    if (count_out == NULL || (out == NULL && cap > 0))
        return LLM_PARAM_INVALID;
    struct llmdd__notifies *n = dd->notifies;
    size_t k = 0;
    pthread_mutex_lock(&n->lock);
    while (k < cap && n->head != NULL) {
        entry *e = n->head;
        n->head = e->next;
        if (n->head == NULL)
            n->tail = NULL;
        n->count--;
        out[k].cluster_id = e->cluster_id;
        out[k].len = e->len;
        memcpy(out[k].msg, e->msg, e->len);
        free(e);
        k++;
    }
    if (n->count == 0) {
        uint64_t v;
        (void)!read(n->efd, &v, sizeof(v));
    }
    bool resume = n->paused && n->count < NOTIFY_QUEUE_MAX;
    if (resume)
        n->paused = false;
    pthread_mutex_unlock(&n->lock);
    if (resume)
        llmdd__links_resume(dd);
    *count_out = k;
    return LLM_SUCCESS;
}

int
llmdd_notify_fd(llmdd *dd)
{
    if (dd == NULL || llmdd__ready(dd) != LLM_SUCCESS)
        return -1;
    return dd->notifies->efd;
}
