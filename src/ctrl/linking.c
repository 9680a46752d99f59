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
 * dd->lock held. The link to `cluster`, if any; *crossing tells whether it
 * is one the peer's link call made (we are its server) that no call of ours
 * has returned yet and that entered the table less than window_ms ago: the
 * peer's half of two calls that crossed, which our call adopts.
 */
static llmdd__link *
link_find(llmdd *dd, uint64_t cluster, int64_t window_ms, bool *crossing)
{
    for (llmdd__link *l = dd->links; l != NULL; l = l->next) {
        if (l->peer.cluster_id != cluster)
            continue;
        *crossing = !l->client && !l->claimed &&
                    llmdd__now_ms() - l->published_ms <= window_ms;
        return l;
    }
    *crossing = false;
    return NULL;
}

/*
 * dd->lock held. Records a link or unlink call for me->cluster_id, or
 * returns false when another call of ours for that cluster is in flight:
 * one call at a time per cluster, the others LLM_PROCESSING_LINK, which a
 * caller retries (docs/model.md, concurrent calls).
 */
static bool
call_begin(llmdd *dd, llmdd__linking *me)
{
    for (const llmdd__linking *l = dd->linking; l != NULL; l = l->next)
        if (l->cluster_id == me->cluster_id)
            return false;
    me->next = dd->linking;
    dd->linking = me;
    return true;
}

/* dd->lock held. */
static void
call_end(llmdd *dd, llmdd__linking *me)
{
    for (llmdd__linking **p = &dd->linking; *p != NULL; p = &(*p)->next) {
        if (*p == me) {
            *p = me->next;
            break;
        }
    }
}

static void
log_processing(const char *what, uint64_t cluster)
{
    log_info("%s cluster %llu: another call of this instance for it is "
             "running (LLM_PROCESSING_LINK)",
             what, (unsigned long long)cluster);
}

/*
 * Runs one llmdd_link_clusters job. Two instances may link to each other at
 * the same moment; both calls then return LLM_SUCCESS and keep one link
 * (docs/model.md, crossed links):
 *  - The server side of the lower cluster id refuses the higher id's
 *    handshake with LLM_PROCESSING_LINK while its own call is in flight
 *    (core/link.c, link_admit); the higher id's call then waits for the
 *    lower id's link to reach its listener and adopts it (link_adopt).
 *  - A call that finds, at its start or when the peer answers
 *    LLM_ALREADY_LINK, a link the peer's call made to us within the call's
 *    timeout and that no call of ours has returned yet, adopts that link:
 *    the peer's call was faster, and both asked for the same link.
 *  - Any other link to that cluster makes the call LLM_ALREADY_LINK.
 * The call is recorded in dd->linking while it runs, for link_admit; a
 * link or unlink call of ours for the cluster already there makes it
 * LLM_PROCESSING_LINK.
 */
static llmdd_status
link_one(llmdd *dd, const llmdd_cluster_info *ci, int64_t deadline,
         int32_t timeout_ms)
{
    llmdd__linking me = {.cluster_id = ci->remote_cluster_id};
    uint64_t cluster = ci->remote_cluster_id;
    llmdd_status st = LLM_SUCCESS;
    bool crossing;

    pthread_mutex_lock(&dd->lock);
    llmdd__link *l = NULL;
    crossing = false;
    /* Checked first: a call of ours in flight may be adopting the link
     * found, or ending it. */
    if (!call_begin(dd, &me))
        st = LLM_PROCESSING_LINK;
    else if ((l = link_find(dd, cluster, timeout_ms, &crossing)) != NULL) {
        call_end(dd, &me);
        if (crossing)
            l->claimed = true;
        else
            st = LLM_ALREADY_LINK;
    }
    pthread_mutex_unlock(&dd->lock);
    if (st == LLM_PROCESSING_LINK)
        log_processing("link to", cluster);
    if (crossing) {
        log_info("linked with cluster %llu (its crossing link call was "
                 "faster)",
                 (unsigned long long)cluster);
        return LLM_SUCCESS;
    }
    if (st != LLM_SUCCESS)
        return st;
    /* Named by its cluster id alone: its address is looked up. */
    llmdd_ip_info found;
    llmdd_cluster_info named;
    if (ci->num_remote_ip_infos == 0) {
        st = llmdd__disc_resolve(dd, cluster, deadline, &found);
        named = *ci;
        named.remote_ip_infos = &found;
        named.num_remote_ip_infos = 1;
        ci = &named;
        llmdd__sockaddr a, from;
        if (st == LLM_SUCCESS &&
            (llmdd__parse_ip_info(&found, &a) != LLM_SUCCESS ||
             llmdd__link_local_addr(ci, &a, &from) != LLM_SUCCESS)) {
            log_error("link to cluster %llu: its published address %s is "
                      "of no use with these local_ip_infos",
                      (unsigned long long)cluster, found.ip);
            st = LLM_PARAM_INVALID;
        }
    }
    if (st == LLM_SUCCESS)
        st = llmdd__link_handshake(dd, ci, deadline);
    pthread_mutex_lock(&dd->lock);
    call_end(dd, &me);
    /* The peer had a link with us: the one its crossing call made while
     * ours ran, or an older one (then the answer stands). */
    if (st == LLM_ALREADY_LINK) {
        l = link_find(dd, cluster, timeout_ms, &crossing);
        if (crossing) {
            l->claimed = true;
            st = LLM_SUCCESS;
        }
    }
    pthread_mutex_unlock(&dd->lock);
    if (crossing)
        log_info("linked with cluster %llu (its crossing link call "
                 "arrived first)",
                 (unsigned long long)cluster);
    else if (st == LLM_ALREADY_LINK)
        log_info("link to cluster %llu: already linked",
                  (unsigned long long)cluster);
    return st;
}

struct link_job {
    llmdd *dd;
    const llmdd_cluster_info *ci;
    int64_t deadline;
    int32_t timeout_ms;
    bool force;
    bool unlink;
    llmdd_status st;
};

static llmdd_status
unlink_link(llmdd *dd, const llmdd_cluster_info *ci, int64_t deadline,
            bool force)
{
    llmdd__link *link = llmdd__link_get(dd, ci->remote_cluster_id);
    llmdd_status st = LLM_SUCCESS;

    if (link == NULL)
        return LLM_SUCCESS;
    if (!force) {
        /* Unlinks that cross: the peer's UNLINK, served here, reads our
         * ACK (ctrl.c, unlink_serve_main); decided before ours was sent,
         * it ended the link as a peer's unlink does, with nothing left
         * for us to confirm. */
        llmdd__ctrl_link *cl = ctrl_of(link);
        pthread_mutex_lock(&dd->lock);
        bool decided = cl->peer_unlink >= PEER_UNLINK_DECIDED;
        cl->unlinking = true;
        pthread_mutex_unlock(&dd->lock);
        if (decided) {
            llmdd__link_put(link);
            return LLM_SUCCESS;
        }
        int rc = llmdd__link_send(link, WMSG_UNLINK, NULL, 0);
        pthread_mutex_lock(&dd->lock);
        /* The peer's unlink marks the link dead at once: wait for its
         * serving to end too. */
        while (rc == 0 && !cl->unlink_acked &&
               (!link->dead || (cl->peer_unlink != PEER_UNLINK_NONE &&
                                cl->peer_unlink != PEER_UNLINK_DONE)) &&
               llmdd__now_ms() < deadline)
            llmdd__cond_wait_until(&dd->cond, &dd->lock, deadline);
        bool acked = cl->unlink_acked, dead = link->dead;
        bool ours = cl->peer_unlink == PEER_UNLINK_NONE;
        pthread_mutex_unlock(&dd->lock);
        if (!acked && dead && rc == 0 && ours)
            acked = llmdd__ctrl_read_ack(link, deadline);
        if (!acked) {
            log_error("unlink cluster %llu: the peer did not confirm",
                      (unsigned long long)ci->remote_cluster_id);
            st = LLM_UNLINK_FAILED;
        }
    }
    llmdd__link_drop(link, force ? "force unlink" : "unlinked");
    /* The peer stopped touching our memory (its ACK; forced, it is cut
     * off); our side stops too, forced or not: nothing of ours serves it
     * or moves bytes for the link any more. */
    if (st == LLM_SUCCESS && !llmdd__link_quiesce(link, true, deadline)) {
        log_error("unlink cluster %llu: our transfers on the link did not "
                  "end in time",
                  (unsigned long long)ci->remote_cluster_id);
        st = LLM_UNLINK_FAILED;
    }
    /* And the requests on it are done (link_drop ended them; a job that
     * left the link finishes its request just after): a wait returns their
     * status at once. Not a failure of the unlink when a request's leg on
     * another link (a slice request's) is still running at the deadline. */
    if (st == LLM_SUCCESS)
        (void)llmdd__requests_link_wait(dd, link, deadline);
    llmdd__link_put(link);
    return st;
}

/*
 * Runs one llmdd_unlink_clusters job, recorded in dd->linking while it
 * runs: a second call for the cluster, link or unlink, is then
 * LLM_PROCESSING_LINK, as this one is while a link call for it runs.
 */
static llmdd_status
unlink_one(llmdd *dd, const llmdd_cluster_info *ci, int64_t deadline,
           bool force)
{
    llmdd__linking me = {.cluster_id = ci->remote_cluster_id, .unlink = true};

    pthread_mutex_lock(&dd->lock);
    bool mine = call_begin(dd, &me);
    pthread_mutex_unlock(&dd->lock);
    if (!mine) {
        log_processing("unlink", ci->remote_cluster_id);
        return LLM_PROCESSING_LINK;
    }
    llmdd_status st = unlink_link(dd, ci, deadline, force);
    pthread_mutex_lock(&dd->lock);
    call_end(dd, &me);
    pthread_mutex_unlock(&dd->lock);
    return st;
}

static void *
link_job_main(void *arg)
{
    struct link_job *j = arg;

    j->st = j->unlink ? unlink_one(j->dd, j->ci, j->deadline, j->force)
                      : link_one(j->dd, j->ci, j->deadline, j->timeout_ms);
    if (!j->unlink)
        llmdd__metrics_link_attempt(j->dd, j->st);
    return NULL;
}

static llmdd_status
check_clusters(llmdd *dd, const llmdd_cluster_info *clusters, size_t n,
               llmdd_status *rets, int32_t timeout_ms, bool need_addr)
{
    if (clusters == NULL || rets == NULL || n == 0 || timeout_ms <= 0)
        return LLM_PARAM_INVALID;
    if (n > LLMDD_MAX_LINK_CLUSTERS)
        return LLM_CLUSTER_NUM_EXCEED_LIMIT;
    if (!need_addr)
        return LLM_SUCCESS;
    pthread_mutex_lock(&dd->lock);
    bool lookup = dd->opts.meta_server != NULL;
    pthread_mutex_unlock(&dd->lock);
    for (size_t i = 0; i < n; i++) {
        llmdd__sockaddr a, from;
        /* No address: looked up, with a metadata server (then the local
         * address is checked against the address found). */
        if (clusters[i].num_remote_ip_infos == 0 && lookup)
            continue;
        if (clusters[i].num_remote_ip_infos == 0)
            log_error("link to cluster %llu: no address, and no "
                      "llm.MetadataServer to look it up",
                      (unsigned long long)clusters[i].remote_cluster_id);
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
                                    .timeout_ms = timeout_ms,
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
    st = check_clusters(dd, clusters, num_clusters, rets, timeout_ms, true);
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
    st = check_clusters(dd, clusters, num_clusters, rets, timeout_ms, false);
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
