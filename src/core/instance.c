/*
 * Instance lifecycle: create (llmdd__instance_new; llmdd_create in src/ctrl
 * adds the control plane), initialize, set_role, finalize, destroy.
 */
#include <netinet/in.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <unistd.h>

#include "core/internal.h"

/* Every initialized instance of the process, for in-process peers. */
static pthread_mutex_t instances_lock = PTHREAD_MUTEX_INITIALIZER;
static llmdd *instances;

void
llmdd__instances_lock(void)
{
    pthread_mutex_lock(&instances_lock);
}

void
llmdd__instances_unlock(void)
{
    pthread_mutex_unlock(&instances_lock);
}

llmdd *
llmdd__instance_find(uint64_t nonce)
{
    for (llmdd *dd = instances; dd != NULL; dd = dd->next_instance)
        if (dd->nonce == nonce)
            return dd;
    return NULL;
}

/*
 * The registry of handshake sockets. An entry is a connected socket's two
 * addresses: TCP allows one connection per address pair on a host, so an
 * entry whose addresses mirror a socket's is the other end of that very
 * connection, and the process that registered it holds that end.
 */
typedef struct own_conn {
    int fd;
    uint64_t nonce;
    struct sockaddr_storage local, peer;
    struct own_conn *next;
} own_conn;

static pthread_mutex_t own_lock = PTHREAD_MUTEX_INITIALIZER;
static own_conn *own_conns;

static int
sock_addrs(int fd, struct sockaddr_storage *local,
           struct sockaddr_storage *peer)
{
    socklen_t ll = sizeof(*local), pl = sizeof(*peer);

    memset(local, 0, sizeof(*local));
    memset(peer, 0, sizeof(*peer));
    if (getsockname(fd, (struct sockaddr *)local, &ll) != 0 ||
        getpeername(fd, (struct sockaddr *)peer, &pl) != 0)
        return -1;
    return 0;
}

static bool
addr_eq(const struct sockaddr_storage *a, const struct sockaddr_storage *b)
{
    if (a->ss_family != b->ss_family)
        return false;
    if (a->ss_family == AF_INET) {
        const struct sockaddr_in *x = (const void *)a, *y = (const void *)b;
        return x->sin_port == y->sin_port &&
               x->sin_addr.s_addr == y->sin_addr.s_addr;
    }
    if (a->ss_family == AF_INET6) {
        const struct sockaddr_in6 *x = (const void *)a, *y = (const void *)b;
        return x->sin6_port == y->sin6_port &&
               memcmp(&x->sin6_addr, &y->sin6_addr, sizeof(x->sin6_addr)) ==
                   0 &&
               x->sin6_scope_id == y->sin6_scope_id;
    }
    return false;
}

int
llmdd__own_conn_add(int fd, uint64_t nonce)
{
    own_conn *e = calloc(1, sizeof(*e));

    if (e == NULL)
        return -1;
    if (sock_addrs(fd, &e->local, &e->peer) != 0) {
        free(e);
        return -1;
    }
    e->fd = fd;
    e->nonce = nonce;
    pthread_mutex_lock(&own_lock);
    e->next = own_conns;
    own_conns = e;
    pthread_mutex_unlock(&own_lock);
    return 0;
}

void
llmdd__own_conn_del(int fd)
{
    own_conn *gone = NULL;

    pthread_mutex_lock(&own_lock);
    for (own_conn **p = &own_conns; *p != NULL; p = &(*p)->next) {
        if ((*p)->fd == fd) {
            gone = *p;
            *p = gone->next;
            break;
        }
    }
    pthread_mutex_unlock(&own_lock);
    free(gone);
}

bool
llmdd__own_conn_peer(int fd, uint64_t nonce)
{
    struct sockaddr_storage local, peer;
    bool found = false;

    if (sock_addrs(fd, &local, &peer) != 0)
        return false;
    pthread_mutex_lock(&own_lock);
    for (own_conn *e = own_conns; e != NULL && !found; e = e->next)
        found = e->fd != fd && e->nonce == nonce && addr_eq(&e->local, &peer) &&
                addr_eq(&e->peer, &local);
    pthread_mutex_unlock(&own_lock);
    return found;
}

static void
instances_remove(llmdd *dd)
{
    pthread_mutex_lock(&instances_lock);
    for (llmdd **p = &instances; *p != NULL; p = &(*p)->next_instance) {
        if (*p == dd) {
            *p = dd->next_instance;
            break;
        }
    }
    dd->next_instance = NULL;
    pthread_mutex_unlock(&instances_lock);
}

llmdd_status
llmdd__ready(llmdd *dd)
{
    pthread_mutex_lock(&dd->lock);
    bool ok = dd->initialized;
    pthread_mutex_unlock(&dd->lock);
    return ok ? LLM_SUCCESS : LLM_FAILED;
}

uint32_t
llmdd__wait_ms(llmdd *dd)
{
    pthread_mutex_lock(&dd->lock);
    uint32_t ms = dd->opts.wait_ms;
    pthread_mutex_unlock(&dd->lock);
    return ms;
}

uint32_t
llmdd__user_timeout(llmdd *dd)
{
    pthread_mutex_lock(&dd->lock);
    uint32_t ms = llmdd__user_timeout_ms(&dd->opts);
    pthread_mutex_unlock(&dd->lock);
    return ms;
}

static bool
role_valid(llmdd_role role)
{
    return role == LLMDD_ROLE_PROMPT || role == LLMDD_ROLE_DECODER ||
           role == LLMDD_ROLE_MIX;
}

llmdd_status
llmdd__instance_new(uint64_t cluster_id, llmdd_role role,
                    const llmdd__plane_ops *plane, llmdd **dd_out)
{
    llmdd *dd;

    if (dd_out == NULL || !role_valid(role))
        return LLM_PARAM_INVALID;
    dd = calloc(1, sizeof(*dd));
    if (dd == NULL)
        return LLM_OUT_OF_MEMORY;
    dd->metrics = calloc(1, sizeof(*dd->metrics));
    if (dd->metrics == NULL) {
        free(dd);
        return LLM_OUT_OF_MEMORY;
    }
    dd->cluster_id = cluster_id;
    dd->role = role;
    dd->plane = plane;
    dd->next_cache_id = 1;
    dd->stop_fd = -1;
    if (llmdd__random(&dd->nonce, sizeof(dd->nonce)) != 0) {
        free(dd->metrics);
        free(dd);
        return LLM_FAILED;
    }
    llmdd__options_init(&dd->opts);
    pthread_mutex_init(&dd->lock, NULL);
    llmdd__cond_init(&dd->cond);
    llmdd__assist_init(&dd->assist);
    *dd_out = dd;
    return LLM_SUCCESS;
}

void
llmdd_destroy(llmdd *dd)
{
    if (dd == NULL)
        return;
    llmdd_finalize(dd);
    llmdd__requests_free(dd);
    llmdd__options_fini(&dd->opts);
    llmdd__assist_fini(&dd->assist);
    pthread_cond_destroy(&dd->cond);
    pthread_mutex_destroy(&dd->lock);
    free(dd->metrics);
    free(dd);
}

/* A forced transport that is a valid name but not built in. */
static llmdd_status
transport_available(const llmdd__options *o)
{
    if (strcmp(o->transport, "auto") == 0 ||
        llmdd__transport_find(o->transport) != NULL)
        return LLM_SUCCESS;
    log_error("llm.Transport=%s: not built into this library", o->transport);
    return LLM_FEATURE_NOT_ENABLED;
}

llmdd_status
llmdd_initialize(llmdd *dd, const llmdd_option *options, size_t num_options)
{
    llmdd__options opts;
    llmdd_status st;

    if (dd == NULL)
        return LLM_PARAM_INVALID;
    pthread_mutex_lock(&dd->lock);
    if (dd->initialized) {
        pthread_mutex_unlock(&dd->lock);
        return LLM_SUCCESS;
    }
    llmdd__options_init(&opts);
    if ((st = llmdd__options_apply(&opts, options, num_options)) !=
            LLM_SUCCESS ||
        (st = transport_available(&opts)) != LLM_SUCCESS) {
        llmdd__options_fini(&opts);
        pthread_mutex_unlock(&dd->lock);
        return st;
    }
    llmdd__options_fini(&dd->opts);
    dd->opts = opts;
    st = llmdd__pool_setup(dd);
    pthread_mutex_unlock(&dd->lock);
    if (st != LLM_SUCCESS)
        goto err_opts;

    dd->stop_fd = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
    if (dd->stop_fd < 0) {
        st = LLM_FAILED;
        goto err_pool;
    }
    if ((st = llmdd__notify_init(dd)) != LLM_SUCCESS)
        goto err_stop_fd;
    if ((st = llmdd__requests_init(dd)) != LLM_SUCCESS)
        goto err_notify;
    if ((st = dd->plane->start(dd)) != LLM_SUCCESS)
        goto err_requests;
    if (dd->opts.listen && (st = dd->plane->listen_start(dd)) != LLM_SUCCESS)
        goto err_ctrl;

    pthread_mutex_lock(&instances_lock);
    dd->next_instance = instances;
    instances = dd;
    pthread_mutex_unlock(&instances_lock);
    pthread_mutex_lock(&dd->assist.lock); /* after a finalize */
    dd->assist.stop = false;
    pthread_mutex_unlock(&dd->assist.lock);
    pthread_mutex_lock(&dd->lock);
    dd->initialized = true;
    pthread_mutex_unlock(&dd->lock);
    return LLM_SUCCESS;

err_ctrl:
    dd->plane->stop(dd);
err_requests:
    llmdd__requests_fini(dd);
err_notify:
    llmdd__notify_fini(dd);
err_stop_fd:
    close(dd->stop_fd);
    dd->stop_fd = -1;
err_pool:
    pthread_mutex_lock(&dd->lock);
    llmdd__caches_fini(dd);
    pthread_mutex_unlock(&dd->lock);
err_opts:
    llmdd__options_fini(&dd->opts);
    llmdd__options_init(&dd->opts);
    return st;
}

void
llmdd_finalize(llmdd *dd)
{
    if (dd == NULL)
        return;
    pthread_mutex_lock(&dd->lock);
    if (!dd->initialized) {
        pthread_mutex_unlock(&dd->lock);
        return;
    }
    dd->initialized = false;
    pthread_mutex_unlock(&dd->lock);

    /* No new in-process peer finds us; then everyone blocked wakes up. */
    instances_remove(dd);
    uint64_t one = 1;
    (void)!write(dd->stop_fd, &one, sizeof(one));
    llmdd__requests_fini(dd);
    dd->plane->listen_stop(dd);
    llmdd__links_fini(dd);
    dd->plane->stop(dd);
    llmdd__assist_stop(dd);

    pthread_mutex_lock(&dd->lock);
    while (dd->nthreads > 0)
        pthread_cond_wait(&dd->cond, &dd->lock);
    llmdd__caches_fini(dd);
    pthread_mutex_unlock(&dd->lock);
    llmdd__notify_fini(dd);
    close(dd->stop_fd);
    dd->stop_fd = -1;
}

llmdd_status
llmdd_set_role(llmdd *dd, llmdd_role role, const llmdd_option *options,
               size_t num_options)
{
    llmdd__options opts;
    llmdd_status st;

    if (dd == NULL)
        return LLM_PARAM_INVALID;
    pthread_mutex_lock(&dd->lock);
    if (!dd->initialized) {
        st = LLM_FAILED;
        goto out;
    }
    if (!role_valid(role)) {
        st = LLM_PARAM_INVALID;
        goto out;
    }
    if (dd->links != NULL) {
        log_error("set_role: links are alive; unlink them first");
        st = LLM_EXIST_LINK;
        goto out;
    }
    /* Listening follows this call's options alone. */
    opts = dd->opts;
    opts.listen = false;
    opts.auth_token = NULL;
    opts.meta_server = NULL;
    st = llmdd__options_apply(&opts, options, num_options);
    if (st == LLM_SUCCESS)
        st = transport_available(&opts);
    if (st != LLM_SUCCESS) {
        free(opts.auth_token);
        free(opts.meta_server);
        goto out;
    }
    /* The metadata server is the one initialize connected to. */
    if (opts.meta_server != NULL ||
        strcmp(opts.meta_prefix, dd->opts.meta_prefix) != 0 ||
        opts.meta_lease_ms != dd->opts.meta_lease_ms)
        log_warn("set_role: the llm.Metadata* options are initialize's; "
                 "these are ignored");
    free(opts.meta_server);
    opts.meta_server = dd->opts.meta_server;
    memcpy(opts.meta_prefix, dd->opts.meta_prefix, sizeof(opts.meta_prefix));
    opts.meta_lease_ms = dd->opts.meta_lease_ms;
    if (opts.auth_token == NULL && dd->opts.auth_token != NULL)
        opts.auth_token = strdup(dd->opts.auth_token);
    pthread_mutex_unlock(&dd->lock);

    dd->plane->listen_stop(dd);
    pthread_mutex_lock(&dd->lock);
    free(dd->opts.auth_token);
    /* A pool keeps its first configuration: caches live in it. */
    opts.host_pool = dd->opts.host_pool;
    opts.host_pool_config = dd->opts.host_pool_config;
    dd->opts = opts;
    dd->role = role;
    pthread_mutex_unlock(&dd->lock);
    if (opts.listen)
        return dd->plane->listen_start(dd);
    return LLM_SUCCESS;
out:
    pthread_mutex_unlock(&dd->lock);
    return st;
}
