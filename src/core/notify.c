/*
 * Notifications: a FIFO per instance, the eventfd that is readable while it
 * is not empty (llmdd_notify_fd, level-triggered: the fd holds a count of 1
 * exactly while entries wait), and flow control per link.
 *
 * Flow control is by credit (docs/protocol.md). Each side announces in its
 * handshake the notifications it takes from the peer before it returns
 * credit (LLMDD_NOTIFY_WINDOW); a sender spends one credit per NOTIFY and
 * waits, up to the call's deadline, while it has none. The receiver counts
 * a link's notifications still in its queue (the link's account) and, as
 * the application takes them, returns credit with a CREDIT frame. So
 * LLM_SUCCESS from a send means the frame is queued on a connection whose
 * peer has room for it: it is delivered unless the link dies. A receiver
 * that does not drain makes only that peer's sends wait and then fail with
 * LLM_TIMEOUT; the control connection is always read, so the link's other
 * messages (replies, heartbeats, a hang-up) still arrive, and other peers
 * are not paused. A peer that sends past its credit breaks the protocol and
 * loses the link.
 *
 * An account outlives its link while its notifications wait in the queue
 * (its link is NULL then: no credit to return).
 *
 * Locking: n->lock guards the queue, the accounts and the eventfd's count;
 * dd->lock (credits to spend, link references) may be taken under it, never
 * the other way round.
 */
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include "core/internal.h"

struct llmdd__notify_acct {
    int refs;           /* the link's, and one per queued entry */
    llmdd__link *link;  /* NULL once the link let go */
    uint32_t queued;    /* its entries in the queue */
    uint32_t owed;      /* taken by the application, not yet returned */
};

typedef struct entry {
    struct entry *next;
    struct llmdd__notify_acct *acct;
    uint64_t cluster_id;
    size_t len;
    unsigned char msg[];
} entry;

struct llmdd__notifies {
    pthread_mutex_t lock;
    int efd;
    entry *head, *tail;
    size_t count;
};

/* n->lock held. */
static void
acct_unref(struct llmdd__notify_acct *a)
{
    if (--a->refs == 0)
        free(a);
}

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
        acct_unref(e->acct);
        free(e);
    }
    close(n->efd);
    pthread_mutex_destroy(&n->lock);
    free(n);
    dd->notifies = NULL;
}

int
llmdd__notify_link_init(llmdd__link *link)
{
    struct llmdd__notify_acct *a = calloc(1, sizeof(*a));

    if (a == NULL)
        return -1;
    a->refs = 1;
    a->link = link;
    link->acct = a;
    return 0;
}

void
llmdd__notify_link_fini(llmdd__link *link)
{
    struct llmdd__notify_acct *a = link->acct;
    struct llmdd__notifies *n = link->dd->notifies;

    if (a == NULL)
        return;
    link->acct = NULL;
    /* A link made by a handshake that finalize overtook may outlive the
     * queue; then nothing else refers to the account. */
    if (n == NULL) {
        free(a);
        return;
    }
    pthread_mutex_lock(&n->lock);
    a->link = NULL;
    acct_unref(a);
    pthread_mutex_unlock(&n->lock);
}

/* A NOTIFY from the link's peer, on the control thread. */
static bool
notify_received(llmdd__link *link, const uint8_t *msg, size_t len)
{
    llmdd *dd = link->dd;
    struct llmdd__notifies *n = dd->notifies;
    entry *e = malloc(sizeof(*e) + len);

    if (e == NULL) {
        log_error("cluster %llu: no memory for a notification",
                  (unsigned long long)link->peer.cluster_id);
        llmdd__link_drop(link, "notification lost: out of memory");
        return false;
    }
    e->next = NULL;
    e->cluster_id = link->peer.cluster_id;
    e->len = len;
    if (len > 0)
        memcpy(e->msg, msg, len);
    pthread_mutex_lock(&n->lock);
    struct llmdd__notify_acct *a = link->acct;
    if (a->queued >= LLMDD_NOTIFY_WINDOW) {
        pthread_mutex_unlock(&n->lock);
        free(e);
        llmdd__link_breach(link, "notifications past its credit");
        return false;
    }
    a->queued++;
    a->refs++;
    e->acct = a;
    /* Counted before it can be taken: whoever took it sees the count. */
    llmdd__metrics_notify(dd, false);
    if (n->tail != NULL)
        n->tail->next = e;
    else
        n->head = e;
    n->tail = e;
    if (n->count++ == 0) {
        uint64_t one = 1;
        (void)!write(n->efd, &one, sizeof(one));
    }
    pthread_mutex_unlock(&n->lock);
    return true;
}

/* A CREDIT from the link's peer: it took `n` more of ours. */
static bool
credit_received(llmdd__link *link, const uint8_t *buf, size_t len)
{
    llmdd *dd = link->dd;
    uint32_t k;

    if (llmdd__wire_u32_decode(buf, len, &k) != 0 || k == 0) {
        llmdd__link_breach(link, "malformed CREDIT");
        return false;
    }
    pthread_mutex_lock(&dd->lock);
    bool bad = (uint64_t)link->tx_credits + k > link->terms.notify_window;
    if (!bad) {
        link->tx_credits += k;
        pthread_cond_broadcast(&dd->cond);
    }
    pthread_mutex_unlock(&dd->lock);
    if (bad) {
        llmdd__link_breach(link, "more credit returned than it had");
        return false;
    }
    return true;
}

bool
llmdd__notify_on_msg(llmdd__link *link, uint16_t type, const uint8_t *buf,
                     size_t len)
{
    if (type == WMSG_CREDIT)
        return credit_received(link, buf, len);
    if (len > LLMDD_NOTIFY_MAX) {
        llmdd__link_breach(link, "oversized notification");
        return false;
    }
    return notify_received(link, buf, len);
}

llmdd_status
llmdd__notify_send(llmdd__link *link, const void *msg, size_t len,
                   int64_t deadline_ms)
{
    llmdd *dd = link->dd;

    pthread_mutex_lock(&dd->lock);
    while (link->tx_credits == 0 && !link->dead &&
           llmdd__now_ms() < deadline_ms)
        llmdd__cond_wait_until(&dd->cond, &dd->lock, deadline_ms);
    bool dead = link->dead, have = link->tx_credits > 0;
    if (!dead && have)
        link->tx_credits--;
    pthread_mutex_unlock(&dd->lock);
    if (dead)
        return LLM_NOT_YET_LINK;
    if (!have) {
        log_warn("cluster %llu takes no notifications: its queue has held "
                 "%u of ours past the wait time",
                 (unsigned long long)link->peer.cluster_id,
                 link->terms.notify_window);
        return LLM_TIMEOUT;
    }
    if (llmdd__link_send(link, WMSG_NOTIFY, msg, len) != 0)
        return LLM_NOT_YET_LINK;
    llmdd__metrics_notify(dd, true);
    return LLM_SUCCESS;
}

llmdd_status
llmdd_send_notify(llmdd *dd, uint64_t cluster_id, const void *msg, size_t len)
{
    llmdd_status st;

    if (dd == NULL)
        return LLM_PARAM_INVALID;
    if ((st = llmdd__ready(dd)) != LLM_SUCCESS)
        return st;
    if (len > LLMDD_NOTIFY_MAX || (msg == NULL && len > 0))
        return LLM_PARAM_INVALID;
    llmdd__link *link = llmdd__link_get(dd, cluster_id);
    if (link == NULL)
        return LLM_NOT_YET_LINK;
    st = llmdd__notify_send(link, msg, len,
                            llmdd__now_ms() + llmdd__wait_ms(dd));
    llmdd__link_put(link);
    return st;
}

/* Credit to return: a link and how much. */
typedef struct {
    llmdd__link *link;
    uint32_t n;
} credit;

/*
 * n->lock held. The application took e: its account owes the peer one
 * credit more, returned once a quarter window is owed or the peer has
 * nothing left in our queue. Adds to `out` (a referenced link) when due.
 */
static void
credit_due(entry *e, credit *out, size_t *nout)
{
    struct llmdd__notify_acct *a = e->acct;

    a->queued--;
    a->owed++;
    if (a->link != NULL &&
        (a->owed >= LLMDD_NOTIFY_WINDOW / 4 || a->queued == 0)) {
        out[*nout].link = a->link;
        out[*nout].n = a->owed;
        (*nout)++;
        a->owed = 0;
    }
}

llmdd_status
llmdd_get_notifies(llmdd *dd, llmdd_notify *out, size_t cap, size_t *count_out)
{
    llmdd_status st;
    credit due[16];
    size_t ndue;

    if (dd == NULL)
        return LLM_PARAM_INVALID;
    if ((st = llmdd__ready(dd)) != LLM_SUCCESS)
        return st;
    if (count_out == NULL || (out == NULL && cap > 0))
        return LLM_PARAM_INVALID;
    struct llmdd__notifies *n = dd->notifies;
    size_t k = 0;
    do {
        /* In rounds of at most 16 credits to send, sent unlocked. */
        ndue = 0;
        pthread_mutex_lock(&n->lock);
        while (k < cap && n->head != NULL && ndue < 16) {
            entry *e = n->head;
            n->head = e->next;
            if (n->head == NULL)
                n->tail = NULL;
            n->count--;
            out[k].cluster_id = e->cluster_id;
            out[k].len = e->len;
            memcpy(out[k].msg, e->msg, e->len);
            credit_due(e, due, &ndue);
            acct_unref(e->acct);
            free(e);
            k++;
        }
        if (n->count == 0) {
            uint64_t v;
            (void)!read(n->efd, &v, sizeof(v));
        }
        /* A link named by an account is allocated (it lets go of the
         * account under n->lock before it is freed), but its last
         * reference may be gone already: then no credit is owed to it. */
        pthread_mutex_lock(&dd->lock);
        for (size_t i = 0; i < ndue; i++) {
            if (due[i].link->refs > 0)
                due[i].link->refs++;
            else
                due[i].link = NULL;
        }
        pthread_mutex_unlock(&dd->lock);
        pthread_mutex_unlock(&n->lock);
        for (size_t i = 0; i < ndue; i++) {
            if (due[i].link == NULL)
                continue;
            uint8_t buf[8];
            size_t len = llmdd__wire_u32_encode(due[i].n, buf, sizeof(buf));
            (void)llmdd__link_send(due[i].link, WMSG_CREDIT, buf, len);
            llmdd__link_put(due[i].link);
        }
    } while (ndue == 16);
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
