/*
 * Discovery through a metadata server (docs/model.md, "Discovery"): the
 * control plane's side of src/meta. A listening instance publishes its
 * entry once bound and removes it before it stops listening; a link call
 * for a cluster without addresses looks it up; a peer whose entry is
 * deleted or expires loses its link only when it announced no heartbeats
 * (the metadata thread's callback).
 */
#include <arpa/inet.h>
#include <inttypes.h>
#include <netinet/in.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "ctrl/ctrl.h"

/*
 * The metadata thread: cluster_id's entry was deleted or expired. That
 * stops new lookups of it; it ends no link whose peer announced
 * heartbeats, which are the authority on whether it lives (a node cut off
 * from etcd alone is still a healthy peer). A link whose peer announced
 * none has nothing else to tell, and goes with the entry.
 */
static void
disc_gone(void *arg, uint64_t cluster_id, uint64_t nonce)
{
    llmdd *dd = arg;
    llmdd__link *link = llmdd__link_get(dd, cluster_id);

    if (link == NULL)
        return;
    /* A later instance of that cluster, linked since, is not the one that
     * left. */
    if (nonce != 0 && link->peer.nonce != nonce) {
        llmdd__link_put(link);
        return;
    }
    if (link->terms.hb_ms > 0) {
        log_info("metadata: cluster %" PRIu64 "'s entry is gone (deleted or "
                 "expired): new lookups fail; its link stays while its "
                 "heartbeats pass",
                 cluster_id);
    } else {
        log_warn("metadata: cluster %" PRIu64 " left (its entry was deleted "
                 "or expired, and it announced no heartbeats): its link is "
                 "dropped",
                 cluster_id);
        llmdd__link_drop(link, "its metadata entry is gone");
    }
    llmdd__link_put(link);
}

llmdd_status
llmdd__disc_open(llmdd *dd, llmdd__ctrl *c)
{
    pthread_mutex_lock(&dd->lock);
    char *server = dd->opts.meta_server ? strdup(dd->opts.meta_server) : NULL;
    bool want = dd->opts.meta_server != NULL;
    char prefix[sizeof(dd->opts.meta_prefix)];
    memcpy(prefix, dd->opts.meta_prefix, sizeof(prefix));
    uint32_t lease = dd->opts.meta_lease_ms;
    pthread_mutex_unlock(&dd->lock);

    if (!want)
        return LLM_SUCCESS;
    if (server == NULL)
        return LLM_OUT_OF_MEMORY;
    llmdd_status st =
        llmdd__meta_open(server, prefix, lease, disc_gone, dd,
                         llmdd__now_ms() + LLMDD_META_INIT_MS, &c->meta);
    free(server);
    return st;
}

void
llmdd__disc_close(llmdd__ctrl *c)
{
    llmdd__meta_close(c->meta);
    c->meta = NULL;
}

static bool
addr_wildcard(const llmdd__sockaddr *a)
{
    if (a->addr.ss_family == AF_INET)
        return ((const struct sockaddr_in *)&a->addr)->sin_addr.s_addr ==
               htonl(INADDR_ANY);
    if (a->addr.ss_family == AF_INET6)
        return IN6_IS_ADDR_UNSPECIFIED(
            &((const struct sockaddr_in6 *)&a->addr)->sin6_addr);
    return false;
}

llmdd_status
llmdd__disc_check_listen(llmdd *dd)
{
    if (dd->ctrl->meta == NULL)
        return LLM_SUCCESS;
    pthread_mutex_lock(&dd->lock);
    bool wild = addr_wildcard(&dd->opts.listen_addr);
    pthread_mutex_unlock(&dd->lock);
    if (wild) {
        log_error("llm.ListenIpInfo: a wildcard address cannot be published "
                  "(llm.MetadataServer is set): listen on a reachable one");
        return LLM_PARAM_INVALID;
    }
    return LLM_SUCCESS;
}

/* The entry's transports: llmdd_transport_list's names. */
static void
entry_transports(llmdd__meta_entry *e)
{
    const char *p = llmdd_transport_list();

    while (*p != '\0' && e->ntransports < LLMDD_META_TRANSPORTS_MAX) {
        size_t n = strcspn(p, ",");
        if (n > 0 && n < LLMDD_META_NAME_MAX) {
            memcpy(e->transports[e->ntransports], p, n);
            e->transports[e->ntransports++][n] = '\0';
        }
        p += n;
        if (*p == ',')
            p++;
    }
}

llmdd_status
llmdd__disc_publish(llmdd *dd, const llmdd__sockaddr *bound)
{
    llmdd__meta_entry e;

    if (dd->ctrl->meta == NULL)
        return LLM_SUCCESS;
    memset(&e, 0, sizeof(e));
    pthread_mutex_lock(&dd->lock);
    e.cluster_id = dd->cluster_id;
    e.role = (uint32_t)dd->role;
    e.nonce = dd->nonce;
    pthread_mutex_unlock(&dd->lock);
    e.protocol = LLMDD_WIRE_VERSION;
    e.pid = (uint32_t)getpid();
    memcpy(e.boot_id, llmdd__boot_id(), sizeof(e.boot_id));
    if (bound->addr.ss_family == AF_INET6) {
        const struct sockaddr_in6 *v6 = (const void *)&bound->addr;
        inet_ntop(AF_INET6, &v6->sin6_addr, e.addrs[0].ip,
                  sizeof(e.addrs[0].ip));
        e.addrs[0].port = ntohs(v6->sin6_port);
    } else {
        const struct sockaddr_in *v4 = (const void *)&bound->addr;
        inet_ntop(AF_INET, &v4->sin_addr, e.addrs[0].ip,
                  sizeof(e.addrs[0].ip));
        e.addrs[0].port = ntohs(v4->sin_port);
    }
    e.naddrs = 1;
    entry_transports(&e);
    return llmdd__meta_publish(dd->ctrl->meta, &e,
                               llmdd__now_ms() + LLMDD_META_INIT_MS);
}

void
llmdd__disc_unpublish(llmdd *dd)
{
    if (dd->ctrl != NULL && dd->ctrl->meta != NULL)
        llmdd__meta_unpublish(dd->ctrl->meta,
                              llmdd__now_ms() + LLMDD_META_REVOKE_MS);
}

llmdd_status
llmdd__disc_resolve(llmdd *dd, uint64_t cluster_id, int64_t deadline,
                    llmdd_ip_info *out)
{
    llmdd__meta_entry e;
    llmdd_status st;

    /* Copies: a lookup needs no metadata thread, so a finalize that stops
     * it meanwhile cannot pull anything from under this call. */
    pthread_mutex_lock(&dd->lock);
    char *server = dd->opts.meta_server ? strdup(dd->opts.meta_server) : NULL;
    bool set = dd->opts.meta_server != NULL;
    char prefix[sizeof(dd->opts.meta_prefix)];
    memcpy(prefix, dd->opts.meta_prefix, sizeof(prefix));
    pthread_mutex_unlock(&dd->lock);
    if (!set)
        return LLM_PARAM_INVALID;
    if (server == NULL)
        return LLM_OUT_OF_MEMORY;
    st = llmdd__meta_resolve(server, prefix, cluster_id, deadline, &e);
    free(server);
    if (st != LLM_SUCCESS)
        return st;
    if (e.protocol != LLMDD_WIRE_VERSION)
        log_warn("cluster %" PRIu64 " publishes protocol version %" PRIu32
                 " (ours: %d); the handshake decides",
                 cluster_id, e.protocol, LLMDD_WIRE_VERSION);
    memset(out, 0, sizeof(*out));
    memcpy(out->ip, e.addrs[0].ip, sizeof(out->ip));
    out->port = e.addrs[0].port;
    return LLM_SUCCESS;
}

llmdd_status
llmdd_metadata_list(const char *server, const char *prefix,
                    int32_t timeout_ms, char *buf, size_t cap,
                    size_t *len_out)
{
    char *json = NULL;

    if (server == NULL || timeout_ms <= 0 || len_out == NULL ||
        (buf == NULL && cap > 0))
        return LLM_PARAM_INVALID;
    llmdd_status st = llmdd__meta_list(
        server, prefix != NULL ? prefix : "llmdd",
        llmdd__now_ms() + timeout_ms, &json);
    if (st != LLM_SUCCESS)
        return st;
    size_t len = strlen(json);
    if (cap > 0) {
        size_t n = len < cap - 1 ? len : cap - 1;
        memcpy(buf, json, n);
        buf[n] = '\0';
    }
    free(json);
    *len_out = len;
    return LLM_SUCCESS;
}
