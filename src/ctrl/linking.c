/*
 * Linking and unlinking, the client side of llmdd_link_clusters and
 * llmdd_unlink_clusters: one job per cluster, several in parallel, each
 * bounded by the call's deadline.
 */
#include <poll.h>
#include <stdlib.h>
#include <string.h>

#include "ctrl/ctrl.h"

/*
 * Runs one llmdd_link_clusters job: refuses a cluster we are linked to, and
 * meanwhile records the call, so that a peer linking to us at the same time
 * finds the crossing (core/link.c, link_admit) and exactly one link results.
 */
static llmdd_status
link_one(llmdd *dd, const llmdd_cluster_info *ci, int64_t deadline)
{
    llmdd__linking me = {.cluster_id = ci->remote_cluster_id};
    llmdd_status st = LLM_SUCCESS;

    pthread_mutex_lock(&dd->lock);
    for (llmdd__link *l = dd->links; l != NULL; l = l->next)
        if (l->peer.cluster_id == ci->remote_cluster_id)
            st = LLM_ALREADY_LINK;
    if (st == LLM_SUCCESS) {
        me.next = dd->linking;
        dd->linking = &me;
    }
    pthread_mutex_unlock(&dd->lock);
    if (st != LLM_SUCCESS)
        return st;
    st = llmdd__link_handshake(dd, ci, deadline);
    pthread_mutex_lock(&dd->lock);
    for (llmdd__linking **p = &dd->linking; *p != NULL; p = &(*p)->next) {
        if (*p == &me) {
            *p = me.next;
            break;
        }
    }
    pthread_mutex_unlock(&dd->lock);
    return st;
}

struct link_job {
    llmdd *dd;
    const llmdd_cluster_info *ci;
    int64_t deadline;
    bool force;
    bool unlink;
    llmdd_status st;
};

/*
 * The link died while we waited for UNLINK_ACK. A peer that honours our
 * UNLINK sends the ACK and then closes its data connections; a transfer of
 * ours can see that close and drop the link before the control thread has
 * read the ACK, which then sits unread in the socket. Once the control thread
 * no longer polls this link, read what is queued ourselves.
 */
static bool
unlink_ack_queued(llmdd *dd, llmdd__link *link, int64_t deadline)
{
    llmdd__ctrl *c = dd->ctrl;
    uint8_t buf[CTRL_MSG_MAX];
    uint16_t type;
    size_t len;
    bool acked;
    int rc;

    pthread_mutex_lock(&dd->lock);
    uint64_t want = ++c->gen;
    pthread_mutex_unlock(&dd->lock);
    llmdd__ctrl_wake(dd);
    pthread_mutex_lock(&dd->lock);
    while (c->seen_gen < want && !c->stop)
        pthread_cond_wait(&dd->cond, &dd->lock);
    acked = ctrl_of(link)->unlink_acked;
    pthread_mutex_unlock(&dd->lock);
    /* The socket is shut down: this reads only what had arrived, after
     * what the control thread had read of a frame. */
    while (!acked) {
        rc = llmdd__ctrl_rx_next(link, &type, buf, &len);
        if (rc == 1)
            acked = type == WMSG_UNLINK_ACK;
        else if (rc < 0 || llmdd__wait_fd(dd->stop_fd, link->ctrl_fd, POLLIN,
                                          deadline) != 1)
            break;
    }
    return acked;
}

static llmdd_status
unlink_one(llmdd *dd, const llmdd_cluster_info *ci, int64_t deadline,
           bool force)
{
    llmdd__link *link = llmdd__link_get(dd, ci->remote_cluster_id);
    llmdd_status st = LLM_SUCCESS;

    if (link == NULL)
        return LLM_SUCCESS;
    if (!force) {
        int rc = llmdd__link_send(link, WMSG_UNLINK, NULL, 0);
        pthread_mutex_lock(&dd->lock);
        while (rc == 0 && !ctrl_of(link)->unlink_acked && !link->dead &&
               llmdd__now_ms() < deadline)
            llmdd__cond_wait_until(&dd->cond, &dd->lock, deadline);
        bool acked = ctrl_of(link)->unlink_acked, dead = link->dead;
        pthread_mutex_unlock(&dd->lock);
        if (!acked && dead && rc == 0)
            acked = unlink_ack_queued(dd, link, deadline);
        if (!acked) {
            log_error("unlink cluster %llu: the peer did not confirm",
                      (unsigned long long)ci->remote_cluster_id);
            st = LLM_UNLINK_FAILED;
        }
    }
    llmdd__link_drop(link, force ? "force unlink" : "unlinked");
    /* The peer stopped touching our memory (its ACK); our side stops too:
     * nothing of ours serves it or moves bytes for the link any more. */
    if (st == LLM_SUCCESS && !force &&
        !llmdd__link_quiesce(link, true, deadline)) {
        log_error("unlink cluster %llu: our transfers on the link did not "
                  "end in time",
                  (unsigned long long)ci->remote_cluster_id);
        st = LLM_UNLINK_FAILED;
    }
    llmdd__link_put(link);
    return st;
}

static void *
link_job_main(void *arg)
{
    struct link_job *j = arg;

    j->st = j->unlink ? unlink_one(j->dd, j->ci, j->deadline, j->force)
                      : link_one(j->dd, j->ci, j->deadline);
    if (!j->unlink)
        llmdd__metrics_link_attempt(j->dd, j->st);
    return NULL;
}

static llmdd_status
check_clusters(const llmdd_cluster_info *clusters, size_t n, llmdd_status *rets,
               int32_t timeout_ms, bool need_addr)
{
    if (clusters == NULL || rets == NULL || n == 0 || timeout_ms <= 0)
        return LLM_PARAM_INVALID;
    if (n > LLMDD_MAX_LINK_CLUSTERS)
        return LLM_CLUSTER_NUM_EXCEED_LIMIT;
    if (!need_addr)
        return LLM_SUCCESS;
    for (size_t i = 0; i < n; i++) {
        llmdd__sockaddr a, from;
        if (clusters[i].num_remote_ip_infos != 1 ||
            clusters[i].remote_ip_infos == NULL ||
            llmdd__parse_ip_info(&clusters[i].remote_ip_infos[0], &a) !=
                LLM_SUCCESS ||
            llmdd__link_local_addr(&clusters[i], &a, &from) != LLM_SUCCESS)
            return LLM_PARAM_INVALID;
    }
    return LLM_SUCCESS;
}

static llmdd_status
run_jobs(llmdd *dd, const llmdd_cluster_info *clusters, size_t n,
         llmdd_status *rets, int32_t timeout_ms, bool unlink, bool force)
{
    struct link_job jobs[LLMDD_MAX_LINK_CLUSTERS];
    pthread_t threads[LLMDD_MAX_LINK_CLUSTERS];
    bool started[LLMDD_MAX_LINK_CLUSTERS];
    int64_t deadline = llmdd__now_ms() + timeout_ms;
    llmdd_status st = LLM_SUCCESS;

    for (size_t i = 0; i < n; i++) {
        jobs[i] = (struct link_job){.dd = dd,
                                    .ci = &clusters[i],
                                    .deadline = deadline,
                                    .force = force,
                                    .unlink = unlink};
        /* One cluster needs no thread; several go in parallel. */
        started[i] = n > 1 && pthread_create(&threads[i], NULL, link_job_main,
                                             &jobs[i]) == 0;
        if (!started[i])
            link_job_main(&jobs[i]);
    }
    for (size_t i = 0; i < n; i++) {
        if (started[i])
            pthread_join(threads[i], NULL);
        rets[i] = jobs[i].st;
        if (jobs[i].st != LLM_SUCCESS)
            st = jobs[i].st;
    }
    return st;
}

llmdd_status
llmdd_link_clusters(llmdd *dd, const llmdd_cluster_info *clusters,
                    size_t num_clusters, llmdd_status *rets, int32_t timeout_ms)
{
    llmdd_status st;

    if (dd == NULL)
        return LLM_PARAM_INVALID;
    if (llmdd__ready(dd) != LLM_SUCCESS)
        return LLM_FAILED;
    st = check_clusters(clusters, num_clusters, rets, timeout_ms, true);
    if (st != LLM_SUCCESS)
        return st;
    return run_jobs(dd, clusters, num_clusters, rets, timeout_ms, false, false);
}

llmdd_status
llmdd_unlink_clusters(llmdd *dd, const llmdd_cluster_info *clusters,
                      size_t num_clusters, llmdd_status *rets,
                      int32_t timeout_ms, bool force)
{
    llmdd_status st;

    if (dd == NULL)
        return LLM_PARAM_INVALID;
    if (llmdd__ready(dd) != LLM_SUCCESS)
        return LLM_FAILED;
    /* A link is known by its cluster id: addresses, when given, are not
     * used, so they are not checked either. */
    st = check_clusters(clusters, num_clusters, rets, timeout_ms, false);
    if (st != LLM_SUCCESS)
        return st;
    return run_jobs(dd, clusters, num_clusters, rets, timeout_ms, true, force);
}

llmdd_status
llmdd_check_link(llmdd *dd, uint64_t cluster_id, int32_t timeout_ms)
{
    llmdd__link_wait w = {.type = WMSG_PONG};
    uint8_t buf[16];

    if (dd == NULL || timeout_ms <= 0)
        return LLM_PARAM_INVALID;
    if (llmdd__ready(dd) != LLM_SUCCESS)
        return LLM_FAILED;
    llmdd__link *link = llmdd__link_get(dd, cluster_id);
    if (link == NULL)
        return LLM_NOT_YET_LINK;
    int64_t deadline = llmdd__now_ms() + timeout_ms;
    uint64_t seq = llmdd__link_await_begin(link, &w);
    size_t n = llmdd__wire_i64_encode((int64_t)seq, buf, sizeof(buf));
    (void)llmdd__link_send(link, WMSG_PING, buf, n); /* else: dead */
    llmdd_status st = llmdd__link_await(link, &w, deadline);
    llmdd__link_put(link);
    return st;
}
