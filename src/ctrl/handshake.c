/*
 * The handshake, both sides (docs/protocol.md): HELLO, HELLO_REPLY, CONFIRM
 * and RESULT on a new connection, with mutual authentication by HMAC-SHA256
 * when llm.AuthToken is set. The server side runs on a short-lived thread
 * per accepted connection (ctrl.c); a data connection's HELLO hands it to
 * the link's transport instead. The client side runs in llmdd_link_clusters
 * (linking.c).
 */
#include <errno.h>
#include <netinet/in.h>
#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <openssl/hmac.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "base/codec.h"
#include "ctrl/ctrl.h"

/* ---- Authentication: HMAC-SHA256 over both nonces and both ids. ---- */

static void
auth_mac(const char *token, const char *label, const uint8_t *cnonce,
         const uint8_t *snonce, uint64_t client_id, uint64_t server_id,
         uint8_t *mac)
{
    uint8_t msg[16 + 2 * LLMDD_WIRE_NONCE_LEN + 16], name[16];
    llmdd__wbuf w = LLMDD__WBUF(msg, sizeof(msg));
    unsigned int len = LLMDD_WIRE_MAC_LEN;
    size_t n;

    memset(name, 0, sizeof(name));
    memcpy(name, label, strnlen(label, sizeof(name)));
    llmdd__put_bytes(&w, name, sizeof(name));
    llmdd__put_bytes(&w, cnonce, LLMDD_WIRE_NONCE_LEN);
    llmdd__put_bytes(&w, snonce, LLMDD_WIRE_NONCE_LEN);
    llmdd__put_u64(&w, client_id);
    llmdd__put_u64(&w, server_id);
    n = llmdd__wdone(&w); /* sizeof(msg): it fits by construction */
    HMAC(EVP_sha256(), token, (int)strlen(token), msg, n, mac, &len);
}

static bool
auth_ok(const char *token, const char *label, const uint8_t *cnonce,
        const uint8_t *snonce, uint64_t client_id, uint64_t server_id,
        const uint8_t *mac)
{
    uint8_t want[LLMDD_WIRE_MAC_LEN];

    auth_mac(token, label, cnonce, snonce, client_id, server_id, want);
    return CRYPTO_memcmp(want, mac, sizeof(want)) == 0;
}

/* ---- Terms of a link: heartbeats, notification window, connections. ---- */

/*
 * What this side announces (docs/protocol.md). A server also says how many
 * data connections each way it serves a link: its own llm.TcpLanes plus
 * one (the budget llm.MaxLinks=auto counts), whatever the client wants.
 */
static llmdd__link_terms
our_terms(const llmdd__options *o, bool server)
{
    llmdd__link_terms t = {.hb_ms = o->hb_ms,
                           .notify_window = LLMDD_NOTIFY_WINDOW};

    if (server) {
        int lanes = o->tcp_lanes > 0 ? o->tcp_lanes : LLMDD__TCP_LANES_AUTO;
        t.conns_max = (uint32_t)(lanes + 1);
    }
    return t;
}

/* Records the peer's terms and makes the control plane's part of the link. */
static int
link_terms(llmdd__link *link, const llmdd__link_terms *peer,
           const llmdd__link_terms *ours)
{
    link->terms = *peer;
    if (!link->client) /* the server's bound, on both sides */
        link->terms.conns_max = ours->conns_max;
    link->tx_credits = peer->notify_window;
    link->ctrl = llmdd__ctrl_link_new();
    return link->ctrl == NULL ? -1 : 0;
}

/* ---- The handshake, server side. ---- */

static const llmdd_transport_ops *
transport_pick(const char *mine, llmdd__link *link, const char *peer_forced)
{
    if (strcmp(mine, "auto") == 0)
        mine = peer_forced;
    link->forced = strcmp(mine, "auto") != 0;
    if (link->forced) {
        const llmdd_transport_ops *ops = llmdd__transport_find(mine);
        if (ops == NULL || !ops->reaches(link)) {
            log_error("transport %s cannot reach cluster %llu", mine,
                      (unsigned long long)link->peer.cluster_id);
            return NULL;
        }
        return ops;
    }
    for (size_t i = 0; i < llmdd__transport_count(); i++) {
        const llmdd_transport_ops *ops = llmdd__transport_at(i);
        if (ops->reaches(link))
            return ops;
    }
    return NULL;
}

static void
handshake_data(llmdd *dd, int fd, const llmdd__hello *h, int64_t deadline)
{
    llmdd__link *link = llmdd__link_find_token(dd, h->token);
    uint8_t buf[8];
    uint32_t st = LLM_SUCCESS;

    if (link == NULL || link->ops->accept_conn == NULL) {
        log_info("data connection refused: %s",
                 link == NULL ? "no link has its token" : "not taken");
        st = LLM_LINK_FAILED;
    }
    size_t n = llmdd__wire_u32_encode(st, buf, sizeof(buf));
    if (llmdd__send_msg(dd->stop_fd, fd, WMSG_DATA_REPLY, buf, n, deadline) !=
            0 ||
        st != LLM_SUCCESS) {
        close(fd);
        llmdd__link_put(link);
        return;
    }
    link->ops->accept_conn(link, fd, h->flags);
    llmdd__link_put(link);
}

static void
handshake_ctrl(llmdd *dd, int fd, const llmdd__hello *h, int64_t deadline)
{
    llmdd__hello_reply rep;
    llmdd__confirm conf;
    llmdd__result res;
    llmdd__link *link = NULL;
    uint8_t buf[CTRL_MSG_MAX];
    uint16_t type;
    size_t len;
    bool to;

    memset(&rep, 0, sizeof(rep));
    memset(&res, 0, sizeof(res));
    pthread_mutex_lock(&dd->lock);
    char *token = dd->opts.auth_token ? strdup(dd->opts.auth_token) : NULL;
    rep.cluster_id = dd->cluster_id;
    rep.role = (uint32_t)dd->role;
    strcpy(rep.transport, dd->opts.transport);
    rep.terms = our_terms(&dd->opts, true);
    pthread_mutex_unlock(&dd->lock);
    rep.pid = (uint32_t)getpid();
    memcpy(rep.boot_id, llmdd__boot_id(), sizeof(rep.boot_id));
    rep.nonce = dd->nonce;
    rep.auth = token != NULL;
    rep.status = LLM_SUCCESS;
    /* Our end of the connection, so a client in this process can prove it
     * is one (loop); removed when the handshake ends. */
    bool registered = llmdd__own_conn_add(fd, dd->nonce) == 0;
    pthread_mutex_lock(&dd->lock);
    bool full = llmdd__links_served(dd) >= dd->opts.max_links;
    pthread_mutex_unlock(&dd->lock);
    if (llmdd__random(rep.snonce, sizeof(rep.snonce)) != 0) {
        log_error("handshake: no random bytes: %s", strerror(errno));
        rep.status = LLM_FAILED;
    } else if (h->cluster_id == dd->cluster_id) {
        log_warn("handshake: peer has our own cluster id %llu",
                 (unsigned long long)h->cluster_id);
        rep.status = LLM_LINK_FAILED;
    } else if (h->auth != rep.auth) {
        log_warn("handshake: cluster %llu %s an auth token and we %s",
                 (unsigned long long)h->cluster_id,
                 h->auth ? "has" : "does not have", rep.auth ? "do" : "do not");
        rep.status = LLM_LINK_FAILED;
    } else if (full) {
        log_warn("handshake: cluster %llu refused: %u links served "
                 "(llm.MaxLinks)",
                 (unsigned long long)h->cluster_id, dd->opts.max_links);
        rep.status = LLM_CLUSTER_NUM_EXCEED_LIMIT;
    } else if (token != NULL) {
        auth_mac(token, "llmdd-server", h->cnonce, rep.snonce, h->cluster_id,
                 dd->cluster_id, rep.mac);
    }
    len = llmdd__wire_hello_reply_encode(&rep, buf, sizeof(buf));
    if (llmdd__send_msg(dd->stop_fd, fd, WMSG_HELLO_REPLY, buf, len,
                        deadline) != 0 ||
        rep.status != LLM_SUCCESS)
        goto out;

    if (llmdd__recv_msg(dd->stop_fd, fd, &type, buf, sizeof(buf), &len,
                        deadline, &to) != 0 ||
        type != WMSG_CONFIRM ||
        llmdd__wire_confirm_decode(buf, len, &conf) != 0)
        goto out;
    /* The client checked our end before its CONFIRM; check its end. */
    bool local = llmdd__own_conn_peer(fd, h->nonce);
    if (registered)
        llmdd__own_conn_del(fd);
    registered = false;
    res.status = LLM_LINK_FAILED;
    if (token != NULL && !auth_ok(token, "llmdd-client", h->cnonce, rep.snonce,
                                  h->cluster_id, dd->cluster_id, conf.mac)) {
        log_warn("handshake: cluster %llu failed authentication",
                 (unsigned long long)h->cluster_id);
        goto reply;
    }
    llmdd__peer peer = {.cluster_id = h->cluster_id,
                        .role = h->role,
                        .pid = h->pid,
                        .nonce = h->nonce,
                        .local = local};
    memcpy(peer.boot_id, h->boot_id, sizeof(peer.boot_id));
    /* Where the peer's connection comes from: it tells llm.TcpLanes=auto a
     * peer on loopback (tcp.c) on this side too. Unknown: not loopback. */
    peer.addr.len = sizeof(peer.addr.addr);
    if (getpeername(fd, (struct sockaddr *)&peer.addr.addr,
                    &peer.addr.len) != 0)
        memset(&peer.addr, 0, sizeof(peer.addr));
    link = llmdd__link_new(dd, &peer, false, -1);
    if (link == NULL || link_terms(link, &h->terms, &rep.terms) != 0)
        goto reply;
    link->ops = llmdd__transport_find(conf.transport);
    if (link->ops == NULL || !link->ops->reaches(link) ||
        (strcmp(dd->opts.transport, "auto") != 0 &&
         strcmp(dd->opts.transport, conf.transport) != 0)) {
        log_warn("handshake: cluster %llu wants transport %s; refused",
                 (unsigned long long)h->cluster_id, conf.transport);
        goto reply;
    }
    if (llmdd__random(link->token, sizeof(link->token)) != 0 ||
        link->ops->link_init(link, false) != LLM_SUCCESS)
        goto reply;
    link->ctrl_fd = fd;
    res.status = llmdd__link_publish(dd, link);
    if (res.status != LLM_SUCCESS) {
        link->ctrl_fd = -1;
        link->ops->link_shutdown(link); /* its threads let go of it */
        goto reply;
    }
    memcpy(res.token, link->token, sizeof(res.token));
    len = llmdd__wire_result_encode(&res, buf, sizeof(buf));
    if (llmdd__send_msg(dd->stop_fd, fd, WMSG_RESULT, buf, len, deadline) != 0)
        llmdd__link_drop(link, "handshake result not delivered");
    llmdd__sock_keepalive(fd); /* tuned when accepted */
    log_info("linked with cluster %llu (server side, %s)",
             (unsigned long long)h->cluster_id, link->ops->name);
    free(token);
    return; /* fd now belongs to the link */
reply:
    len = llmdd__wire_result_encode(&res, buf, sizeof(buf));
    llmdd__send_msg(dd->stop_fd, fd, WMSG_RESULT, buf, len, deadline);
out:
    llmdd__link_put(link);
    if (registered)
        llmdd__own_conn_del(fd);
    close(fd);
    free(token);
}

/*
 * A handshake thread's slot is free: the control thread may start one for a
 * connection that waits (starved). Woken under dd->lock, so that llmdd__ctrl
 * stays until the wake is written (ctrl_stop waits for handshakes under it).
 */
static void
handshake_done(llmdd *dd)
{
    pthread_mutex_lock(&dd->lock);
    dd->ctrl->handshakes--;
    if (dd->ctrl->starved)
        llmdd__ctrl_wake(dd);
    pthread_cond_broadcast(&dd->cond);
    pthread_mutex_unlock(&dd->lock);
}

void *
llmdd__handshake_main(void *arg)
{
    struct llmdd__handshake_arg a = *(struct llmdd__handshake_arg *)arg;
    llmdd *dd = a.dd;
    int64_t deadline = llmdd__now_ms() + HANDSHAKE_MS;
    uint8_t buf[CTRL_MSG_MAX];
    llmdd__hello h;
    uint16_t type;
    size_t len;
    bool to;

    free(arg);
    /* Before any reply: once it has one, the peer may use the connection. */
    llmdd__sock_tune(a.fd, llmdd__user_timeout(dd));
    int rc = llmdd__recv_msg(dd->stop_fd, a.fd, &type, buf, sizeof(buf), &len,
                             deadline, &to);
    llmdd__ctrl_hello_done(dd, a.fd);
    if (rc != 0 || type != WMSG_HELLO ||
        llmdd__wire_hello_decode(buf, len, &h) != 0) {
        log_info("handshake rejected: %s",
                 to ? "too slow" : "malformed or truncated");
        close(a.fd);
    } else if (h.kind == CONN_DATA) {
        /* From here on this may be a long-lived serving thread. */
        handshake_done(dd);
        handshake_data(dd, a.fd, &h, deadline);
        return NULL;
    } else {
        handshake_ctrl(dd, a.fd, &h, deadline);
    }
    handshake_done(dd);
    return NULL;
}

/* ---- The handshake, client side. ---- */

/*
 * The peer refused our link because it links to us at the same time and its
 * call wins (link_admit in core/link.c): wait for its link to reach our
 * listener.
 */
static llmdd_status
link_adopt(llmdd *dd, uint64_t cluster, int64_t deadline)
{
    bool linked = false;

    pthread_mutex_lock(&dd->lock);
    while (dd->initialized && llmdd__now_ms() < deadline) {
        for (llmdd__link *l = dd->links; l != NULL && !linked; l = l->next) {
            linked = l->peer.cluster_id == cluster;
            if (linked)
                l->claimed = true; /* this call returns it */
        }
        if (linked)
            break;
        llmdd__cond_wait_until(&dd->cond, &dd->lock, deadline);
    }
    pthread_mutex_unlock(&dd->lock);
    if (linked) {
        log_info("linked with cluster %llu (its crossing link call won)",
                 (unsigned long long)cluster);
        return LLM_SUCCESS;
    }
    log_info("link to cluster %llu: its crossing link call did not arrive "
             "in time",
             (unsigned long long)cluster);
    return LLM_TIMEOUT;
}

/*
 * Where a link's connections leave from (local_ip_infos): the first entry
 * of the remote address's family, port 0, since each connection needs its
 * own port; AF_UNSPEC when there is none. LLM_PARAM_INVALID for an entry
 * that is not an address, or entries of none of the remote's family.
 */
llmdd_status
llmdd__link_local_addr(const llmdd_cluster_info *ci,
                       const llmdd__sockaddr *remote, llmdd__sockaddr *out)
{
    llmdd__sockaddr found;

    memset(&found, 0, sizeof(found));
    if (ci->num_local_ip_infos > 0 && ci->local_ip_infos == NULL)
        return LLM_PARAM_INVALID;
    for (size_t i = 0; i < ci->num_local_ip_infos; i++) {
        llmdd_ip_info info = ci->local_ip_infos[i];
        llmdd__sockaddr a;
        info.port = 1; /* checked here, replaced by 0 below */
        if (llmdd__parse_ip_info(&info, &a) != LLM_SUCCESS)
            return LLM_PARAM_INVALID;
        if (a.addr.ss_family != remote->addr.ss_family ||
            found.addr.ss_family != AF_UNSPEC)
            continue;
        if (a.addr.ss_family == AF_INET)
            ((struct sockaddr_in *)&a.addr)->sin_port = 0;
        else
            ((struct sockaddr_in6 *)&a.addr)->sin6_port = 0;
        found = a;
    }
    if (ci->num_local_ip_infos > 0 && found.addr.ss_family == AF_UNSPEC)
        return LLM_PARAM_INVALID;
    *out = found;
    return LLM_SUCCESS;
}

/* The client side of the control handshake, up to a published link. */
llmdd_status
llmdd__link_handshake(llmdd *dd, const llmdd_cluster_info *ci, int64_t deadline)
{
    llmdd__hello h;
    llmdd__hello_reply rep;
    llmdd__confirm conf;
    llmdd__result res;
    llmdd__sockaddr addr;
    uint8_t buf[CTRL_MSG_MAX];
    llmdd__link *link;
    llmdd_status st;
    uint16_t type;
    size_t len;
    bool to = false; /* a failed send leaves it unset by recv_msg */
    int fd;

    llmdd__sockaddr from;
    llmdd__parse_ip_info(&ci->remote_ip_infos[0], &addr);
    llmdd__link_local_addr(ci, &addr, &from); /* checked by check_clusters */
    fd = llmdd__connect(dd->stop_fd, &addr, &from, deadline, LLMDD_LOG_INFO,
                        &st);
    if (fd < 0)
        return st;
    /* Our end, so a server in this process can prove we are one (loop). */
    bool registered = llmdd__own_conn_add(fd, dd->nonce) == 0;

    memset(&h, 0, sizeof(h));
    h.kind = CONN_CTRL;
    pthread_mutex_lock(&dd->lock);
    char *token = dd->opts.auth_token ? strdup(dd->opts.auth_token) : NULL;
    h.role = (uint32_t)dd->role;
    strcpy(h.transport, dd->opts.transport);
    h.terms = our_terms(&dd->opts, false);
    pthread_mutex_unlock(&dd->lock);
    h.cluster_id = dd->cluster_id;
    h.pid = (uint32_t)getpid();
    memcpy(h.boot_id, llmdd__boot_id(), sizeof(h.boot_id));
    h.nonce = dd->nonce;
    h.auth = token != NULL;

    st = LLM_LINK_FAILED;
    if (llmdd__random(h.cnonce, sizeof(h.cnonce)) != 0 ||
        (len = llmdd__wire_hello_encode(&h, buf, sizeof(buf))) == 0 ||
        llmdd__send_msg(dd->stop_fd, fd, WMSG_HELLO, buf, len, deadline) != 0 ||
        llmdd__recv_msg(dd->stop_fd, fd, &type, buf, sizeof(buf), &len,
                        deadline, &to) != 0 ||
        type != WMSG_HELLO_REPLY ||
        llmdd__wire_hello_reply_decode(buf, len, &rep) != 0) {
        if (to)
            st = LLM_TIMEOUT;
        /* A peer of another protocol version (llmdd 0.3 speaks 2) closes
         * at our HELLO without a word: say so, since nothing else will. */
        LLMDD_LOG(to ? LLMDD_LOG_INFO : LLMDD_LOG_ERROR,
                  "link to cluster %llu: handshake %s",
                  (unsigned long long)ci->remote_cluster_id,
                  to ? "timed out"
                     : "failed (the peer closed the connection; a peer of "
                       "another llmdd protocol version does that: this "
                       "side speaks " LLMDD__STR(LLMDD_WIRE_VERSION) ")");
        goto err_fd;
    }
    if (rep.status == LLM_LINK_BUSY) {
        /* Its handshake stage is full: the caller retries. */
        log_info("link to cluster %llu: the peer is busy with other "
                 "handshakes (LLM_LINK_BUSY)",
                 (unsigned long long)ci->remote_cluster_id);
        st = rep.status;
        goto err_fd;
    }
    if (rep.status != LLM_SUCCESS) {
        LLMDD_LOG(llmdd__link_fail_level(rep.status),
                  "link to cluster %llu: refused by the peer (%s)",
                  (unsigned long long)ci->remote_cluster_id,
                  llmdd_status_str(rep.status));
        if (rep.status == LLM_CLUSTER_NUM_EXCEED_LIMIT)
            st = rep.status;
        goto err_fd;
    }
    if (rep.cluster_id != ci->remote_cluster_id) {
        log_error("link: the peer is cluster %llu, not %llu",
                  (unsigned long long)rep.cluster_id,
                  (unsigned long long)ci->remote_cluster_id);
        goto err_fd;
    }
    if (token != NULL && !auth_ok(token, "llmdd-server", h.cnonce, rep.snonce,
                                  dd->cluster_id, rep.cluster_id, rep.mac)) {
        log_error("link to cluster %llu: the peer failed authentication",
                  (unsigned long long)rep.cluster_id);
        goto err_fd;
    }
    llmdd__peer peer = {.cluster_id = rep.cluster_id,
                        .role = rep.role,
                        .pid = rep.pid,
                        .nonce = rep.nonce,
                        .local = llmdd__own_conn_peer(fd, rep.nonce),
                        .addr = addr};
    memcpy(peer.boot_id, rep.boot_id, sizeof(peer.boot_id));
    link = llmdd__link_new(dd, &peer, true, -1);
    if (link == NULL)
        goto err_fd;
    if (link_terms(link, &rep.terms, &h.terms) != 0)
        goto err_link;
    link->bind_addr = from;
    /* Not under dd->lock: the loop transport's reaches() takes the
     * process-wide instance lock, which a loop pin holds while it takes a
     * peer instance's lock (the other order). */
    char mine[LLMDD_TRANSPORT_NAME_MAX];
    pthread_mutex_lock(&dd->lock);
    strcpy(mine, dd->opts.transport);
    pthread_mutex_unlock(&dd->lock);
    link->ops = transport_pick(mine, link, rep.transport);
    if (link->ops == NULL)
        goto err_link;

    memset(&conf, 0, sizeof(conf));
    strcpy(conf.transport, link->ops->name);
    if (token != NULL)
        auth_mac(token, "llmdd-client", h.cnonce, rep.snonce, dd->cluster_id,
                 rep.cluster_id, conf.mac);
    len = llmdd__wire_confirm_encode(&conf, buf, sizeof(buf));
    if (llmdd__send_msg(dd->stop_fd, fd, WMSG_CONFIRM, buf, len, deadline) !=
            0 ||
        llmdd__recv_msg(dd->stop_fd, fd, &type, buf, sizeof(buf), &len,
                        deadline, &to) != 0 ||
        type != WMSG_RESULT || llmdd__wire_result_decode(buf, len, &res) != 0) {
        st = to ? LLM_TIMEOUT : LLM_LINK_FAILED;
        goto err_link;
    }
    if (res.status == LLM_PROCESSING_LINK) {
        /* The peer links to us at the same time and its call wins: its link
         * reaches our listener, and the caller gets that one. */
        llmdd__link_free(link);
        if (registered)
            llmdd__own_conn_del(fd);
        close(fd);
        free(token);
        return link_adopt(dd, rep.cluster_id, deadline);
    }
    if (res.status == LLM_ALREADY_LINK) {
        /* Said by link_one, which may find the peer's crossing link. */
        log_info("link to cluster %llu: the peer has a link with us",
                 (unsigned long long)rep.cluster_id);
    } else if (res.status != LLM_SUCCESS) {
        LLMDD_LOG(llmdd__link_fail_level(res.status),
                  "link to cluster %llu: refused by the peer (%s)",
                  (unsigned long long)rep.cluster_id,
                  llmdd_status_str(res.status));
    }
    if (res.status != LLM_SUCCESS) {
        st = res.status == LLM_ALREADY_LINK ||
                     res.status == LLM_CLUSTER_NUM_EXCEED_LIMIT
                 ? res.status
                 : LLM_LINK_FAILED;
        goto err_link;
    }
    memcpy(link->token, res.token, sizeof(link->token));
    if (registered)
        llmdd__own_conn_del(fd); /* before the link may close fd */
    link->ctrl_fd = fd;
    llmdd__sock_tune(fd, llmdd__user_timeout(dd));
    llmdd__sock_keepalive(fd);
    /* The transport may connect its data channels with our deadline. */
    link->deadline_ms = deadline;
    st = link->ops->link_init(link, true);
    if (st == LLM_SUCCESS)
        st = llmdd__link_publish(dd, link);
    if (st != LLM_SUCCESS) {
        /* Transport threads may hold references: let the last one free it.
         * Closing fd makes the peer drop its side. */
        shutdown(fd, SHUT_RDWR);
        link->ops->link_shutdown(link);
        llmdd__link_put(link);
        free(token);
        return st;
    }
    /* Set up: the server judges our silence from our first byte on. */
    if (h.terms.hb_ms > 0)
        (void)llmdd__link_send(link, WMSG_HEARTBEAT, NULL, 0);
    log_info("linked with cluster %llu (%s)",
             (unsigned long long)rep.cluster_id, link->ops->name);
    free(token);
    return LLM_SUCCESS;

err_link:
    llmdd__link_free(link);
err_fd:
    if (registered)
        llmdd__own_conn_del(fd);
    close(fd);
    free(token);
    return st;
}
