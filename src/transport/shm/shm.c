/*
 * The shm transport: peers on the same kernel move bytes with one memcpy.
 *
 * Allocated caches live in memfds (core/cache.c). The owner hands a cache's
 * memfd to the peer over a Unix-domain SOCK_SEQPACKET socket (SCM_RIGHTS);
 * the peer maps it once, read-write and prefaulted, and then pulls and
 * pushes with memcpy: no work at all on the owner. A pool memfd is mapped
 * once per link and a pooled cache is an (offset, length) entry in it.
 * Registered caches are user memory that cannot be shared that way: the
 * peer reads and writes them with process_vm_readv/writev (CMA), and when
 * the kernel refuses that (ptrace rules) it falls back, for that cache, to
 * the socket data plane (transport/stream), which also carries everything
 * on a link whose peer cannot use the socket at all.
 *
 * The socket: the server side creates /tmp/llmdd-<its pid>-<link
 * token>.sock (mode 0600) in link_init; the client connects to it, checks
 * that the process behind it has the peer's pid (SO_PEERCRED), and asks the
 * server, over a data connection flagged SHM_FLAG_SOCK, to accept it; the
 * server checks the client's pid too, unlinks the file and says READY.
 * Filesystem sockets work across network namespaces; a file left by a
 * killed server is removed later by another (shm_sweep). Each side then
 * runs one reader thread on the socket. Messages are requests and replies
 * matched by a sequence number: QUERY (describe a cache, with its memfd or
 * addresses) and INVAL (a cache of the sender's is gone). On a link whose
 * peer cannot use the socket (another mount namespace: ENOENT; another pid
 * namespace: SO_PEERCRED differs), "auto" runs on the data plane alone and
 * a forced shm fails to link.
 *
 * Memory safety rests on two rules:
 *  - Leases. Answering a QUERY, the owner takes a reference on the cache and
 *    keeps it (the lease) until the peer has acknowledged an INVAL for it or
 *    the link's teardown has finished. core/cache.c frees a removed cache
 *    only once its references are gone, so its memory is never released or
 *    reused while the peer may still touch it. cache_removed sends the INVAL;
 *    the peer marks its entry dead, waits for the copies in flight on it,
 *    unmaps it and acknowledges. A QUERY reply and a later INVAL for the same
 *    cache travel in order on the one socket, under expose_lock.
 *  - Teardown. When a link goes down each reader first stops using the
 *    peer's memory (marks every entry dead, waits for copies in flight,
 *    unmaps), then half-closes the socket: an EOF means "I no longer touch
 *    your memory". A reader releases its leases only after the peer's EOF
 *    (or SHM_BYE_MS), so an unlink or finalize never frees memory that the
 *    peer is still writing.
 *  - Stalled peers. A peer stopped mid-copy (SIGSTOP, swapped out) neither
 *    acknowledges an INVAL nor sends its EOF; the owner drops the link and,
 *    after SHM_BYE_MS, ends the leases anyway so that deallocation returns.
 *    The peer still has the memory mapped, so such leases end "stale"
 *    (llmdd__cache_put_stale, with a pidfd of the peer taken when the
 *    socket was set up): a pooled cache's pages then stay out of the pool
 *    until the peer process has exited (core/cache.c), while a non-pooled
 *    cache's memfd pages are never given to another cache anyway. The peer,
 *    for its part, reports a memfd copy as failed (LLM_NOT_YET_LINK) when
 *    by its end the owner had half-closed the socket: the copy may have
 *    met memory that was no longer leased. (It looks at the socket at most
 *    every SHM_BYE_MS / 4: a copy that ended sooner after the socket was
 *    seen open ran on leased memory all the same.) Registered (CMA) memory
 *    cannot be held back; the peer checks the socket between CMA batches.
 *  - Seals. Memfds are sealed against size changes before they are passed
 *    (core/cache.c): a peer that shrank one would make the owner die of
 *    SIGBUS. The peer maps only memfds sealed against shrinking.
 *
 * Thread-safety: shm_link.lock guards the entry table, entry users and dead
 * flags, the waiters and the state flags; expose_lock guards the leases and
 * orders QUERY replies before INVALs. Neither is held across a memcpy or a
 * cross-memory attach.
 */
#include "transport/shm/shm_int.h"

/* ---- Small helpers. ---- */

/* This side named shm (llm.Transport=shm): no fallback to tcp. */
static bool
shm_forced(const llmdd__link *link)
{
    return strcmp(link->opts.transport, "shm") == 0;
}

/* Waits on sl->cond until deadline (CLOCK_MONOTONIC ms); lock held. */
void
llmdd__shm_cond_wait(shm_link *sl, int64_t deadline)
{
    int64_t now = llmdd__now_ms();

    if (deadline - now > 1000)
        deadline = now + 1000; /* callers loop */
    llmdd__cond_wait_until(&sl->cond, &sl->lock, deadline);
}

/*
 * Waits until fd is ready for `events` or the deadline passes; with `wake`,
 * also until the link goes down. 1 ready, 0 timeout, -1 down or error.
 */
int
llmdd__shm_poll(shm_link *sl, int fd, short events, int64_t deadline, bool wake)
{
    for (;;) {
        struct pollfd p[2] = {{.fd = fd, .events = events},
                              {.fd = sl->wake_fd, .events = POLLIN}};
        int64_t left = deadline - llmdd__now_ms();
        if (left <= 0)
            return 0;
        int k = poll(p, wake ? 2 : 1, left > 1000 ? 1000 : (int)left);
        if (k < 0 && errno != EINTR)
            return -1;
        if (k <= 0)
            continue;
        if (wake && p[1].revents != 0)
            return -1;
        if (p[0].revents & (events | POLLHUP | POLLERR))
            return 1;
        if (p[0].revents & POLLNVAL)
            return -1;
    }
}

void
llmdd__shm_entry_put(shm_entry *e)
{
    if (e == NULL || atomic_fetch_sub(&e->refs, 1) != 1)
        return;
    if (e->map != NULL)
        munmap(e->map, e->map_len);
    free(e->addrs);
    free(e);
}

/* lock held. */
shm_entry *
llmdd__shm_entry_find(shm_link *sl, int64_t id)
{
    for (shm_entry *e = sl->entries; e != NULL; e = e->next)
        if (e->id == id)
            return e;
    return NULL;
}

static llmdd_status
shm_query(llmdd__link *link, int64_t id, int64_t deadline_ms,
          llmdd_cache_desc *desc, uint32_t *batch_dim, void **priv)
{
    shm_link *sl = link->tp;
    shm_wait w;
    int rc = llmdd__shm_call(sl, SMSG_QUERY, id, deadline_ms, &w);

    *priv = NULL;
    if (rc == 1)
        return llmdd__stream_query(sl->stream, id, deadline_ms, desc,
                                   batch_dim);
    if (rc != 0)
        return llmdd__now_ms() >= deadline_ms ? LLM_TIMEOUT : LLM_NOT_YET_LINK;
    if (w.status != LLM_SUCCESS || w.e == NULL) {
        llmdd__shm_entry_put(w.e);
        return LLM_KV_CACHE_NOT_EXIST;
    }
    *desc = w.desc;
    *batch_dim = w.batch_dim;
    *priv = w.e;
    return LLM_SUCCESS;
}

static void
shm_remote_free(llmdd__remote_cache *rc)
{
    llmdd__shm_entry_put(rc->priv);
    rc->priv = NULL;
}

/* ---- Link setup and teardown. ---- */

static bool
shm_reaches(const llmdd__link *link)
{
    pid_t pid = (pid_t)link->peer.pid;

    if (!llmdd__peer_same_kernel(&link->peer)) {
        log_info("shm: cluster %llu runs on another kernel",
                 (unsigned long long)link->peer.cluster_id);
        return false;
    }
    /* The server serves what the client chose: the client may see our pid
     * where we cannot see its own (another pid namespace), and the link
     * then runs on the data plane alone (shm_accept_sock). */
    if (!link->client)
        return true;
    if (pid <= 0 || (kill(pid, 0) != 0 && errno != EPERM)) {
        log_info("shm: pid %u of cluster %llu is not visible here",
                 link->peer.pid, (unsigned long long)link->peer.cluster_id);
        return false;
    }
    return true;
}

/*
 * A pidfd of the peer process, taken once the socket showed that pid: it
 * tells, without a race against pid reuse, when the process has exited
 * (core/cache.c holds pool pages back until then). -1 when the kernel
 * has no pidfds (before 5.3); such pages then wait for the pool's end.
 */
static int
shm_pidfd(pid_t pid)
{
#ifdef SYS_pidfd_open
    int fd = (int)syscall(SYS_pidfd_open, pid, 0);
    if (fd >= 0) {
        (void)fcntl(fd, F_SETFD, FD_CLOEXEC);
        return fd;
    }
    log_info("shm: pidfd_open(%d): %s", (int)pid, strerror(errno));
#else
    (void)pid;
#endif
    return -1;
}

static int
shm_peer_pid(int fd)
{
    struct ucred cred;
    socklen_t len = sizeof(cred);

    if (getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &cred, &len) != 0)
        return -1;
    return cred.pid;
}

static void
shm_addr(const shm_link *sl, struct sockaddr_un *a)
{
    memset(a, 0, sizeof(*a));
    a->sun_family = AF_UNIX;
    memcpy(a->sun_path, sl->path, strlen(sl->path) + 1);
}

static shm_link *
shm_new(llmdd__link *link)
{
    shm_link *sl = calloc(1, sizeof(*sl));

    if (sl == NULL)
        return NULL;
    sl->link = link;
    sl->listen_fd = sl->sock = sl->peer_pidfd = -1;
    sl->open_at = INT64_MIN / 2; /* never */
    sl->wake_fd = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
    sl->stream = llmdd__stream_new(link, SHM_FWD_CONNS, SHM_REV_CONNS,
                                   SHM_FWD_CONNS + SHM_REV_CONNS + 1);
    sl->rbuf = malloc(SHM_MSG_MAX);
    sl->obuf = malloc(SHM_MSG_MAX);
    if (sl->wake_fd < 0 || sl->stream == NULL || sl->rbuf == NULL ||
        sl->obuf == NULL) {
        if (sl->wake_fd >= 0)
            close(sl->wake_fd);
        llmdd__stream_free(sl->stream);
        free(sl->obuf);
        free(sl->rbuf);
        free(sl);
        return NULL;
    }
    pthread_mutex_init(&sl->lock, NULL);
    pthread_mutex_init(&sl->expose_lock, NULL);
    llmdd__cond_init(&sl->cond);
    /* Named after the server's pid too, so stale files can be told. */
    unsigned pid = link->client ? link->peer.pid : (unsigned)getpid();
    int n = snprintf(sl->path, sizeof(sl->path), SHM_DIR "/llmdd-%u-", pid);
    for (int i = 0; i < LLMDD_TOKEN_LEN; i++)
        n += snprintf(sl->path + n, sizeof(sl->path) - (size_t)n, "%02x",
                      link->token[i]);
    snprintf(sl->path + n, sizeof(sl->path) - (size_t)n, ".sock");
    return sl;
}

/*
 * A server killed between creating its socket and the client's connect
 * leaves the file behind. Once per process, remove such files: their
 * server's pid is gone and they are older than any link setup.
 */
static void
shm_sweep(void)
{
    DIR *d = opendir(SHM_DIR);
    struct dirent *de;
    time_t now = time(NULL);

    if (d == NULL)
        return;
    while ((de = readdir(d)) != NULL) {
        char path[sizeof(SHM_DIR) + 256], hex[33], tail[8];
        unsigned pid;
        struct stat st;
        if (sscanf(de->d_name, "llmdd-%u-%32[0-9a-f]%7s", &pid, hex, tail) !=
                3 ||
            strlen(hex) != 2 * LLMDD_TOKEN_LEN || strcmp(tail, ".sock") != 0)
            continue;
        snprintf(path, sizeof(path), SHM_DIR "/%s", de->d_name);
        if (pid == 0 || pid > INT32_MAX || kill((pid_t)pid, 0) == 0 ||
            errno != ESRCH || lstat(path, &st) != 0 || !S_ISSOCK(st.st_mode) ||
            now - st.st_mtime < SHM_STALE_S)
            continue;
        if (unlink(path) == 0)
            log_info("shm: removed %s, left by a process that is gone", path);
    }
    closedir(d);
}

static pthread_once_t sweep_once = PTHREAD_ONCE_INIT;

/* Server side: the socket the client will connect to. */
static llmdd_status
shm_listen(shm_link *sl)
{
    struct sockaddr_un a;
    int fd;

    pthread_once(&sweep_once, shm_sweep);
    fd = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    if (fd < 0)
        goto err;
    shm_addr(sl, &a);
    if (bind(fd, (struct sockaddr *)&a, sizeof(a)) != 0)
        goto err_close;
    /* Only our user may connect; SO_PEERCRED then checks the very pid. */
    if (chmod(sl->path, 0600) != 0 || listen(fd, 4) != 0)
        goto err_unlink;
    sl->listen_fd = fd;
    return LLM_SUCCESS;
err_unlink:
    unlink(sl->path);
err_close:
    close(fd);
err:
    log_error("shm: socket %s: %s", sl->path, strerror(errno));
    sl->path[0] = '\0';
    return LLM_LINK_FAILED;
}

static void
shm_unlisten(shm_link *sl)
{
    if (sl->listen_fd >= 0)
        close(sl->listen_fd);
    sl->listen_fd = -1;
    if (sl->path[0] != '\0')
        unlink(sl->path);
    sl->path[0] = '\0';
}

/*
 * Server side, in the thread of the client's SHM_FLAG_SOCK data
 * connection: accepts the client's socket, says READY and serves it until
 * the link ends.
 */
static void
shm_accept_sock(shm_link *sl, bool want)
{
    llmdd__link *link = sl->link;
    unsigned long long cid = (unsigned long long)link->peer.cluster_id;
    int64_t deadline = llmdd__now_ms() + SHM_ACCEPT_MS;
    int fd = -1;

    pthread_mutex_lock(&sl->lock);
    bool once = !sl->accepted && !sl->down && sl->listen_fd >= 0;
    sl->accepted = true;
    pthread_mutex_unlock(&sl->lock);
    if (!once)
        return;
    if (!want) {
        shm_unlisten(sl);
        pthread_mutex_lock(&sl->lock);
        sl->nosock = true;
        pthread_cond_broadcast(&sl->cond);
        pthread_mutex_unlock(&sl->lock);
        if (shm_forced(link)) {
            log_error("shm: cluster %llu cannot use our socket and "
                      "llm.Transport=shm; dropping the link",
                      cid);
            llmdd__link_drop(link, "shm: peer cannot use the socket");
        } else {
            log_info("shm: cluster %llu cannot use our socket; using tcp",
                     cid);
        }
        return;
    }
    while (fd < 0) {
        fd = accept4(sl->listen_fd, NULL, NULL, SOCK_NONBLOCK | SOCK_CLOEXEC);
        if (fd >= 0 && shm_peer_pid(fd) != (int)link->peer.pid) {
            log_warn("shm: a process other than cluster %llu's pid %u "
                     "connected to %s; refused",
                     cid, link->peer.pid, sl->path);
            close(fd);
            fd = -1;
            continue;
        }
        if (fd < 0 && errno != EAGAIN && errno != EWOULDBLOCK &&
            errno != EINTR)
            break;
        if (fd < 0 &&
            llmdd__shm_poll(sl, sl->listen_fd, POLLIN, deadline, true) != 1)
            break;
    }
    shm_unlisten(sl);
    if (fd < 0) {
        /* The peer's link call failed or gave up, and says why. */
        log_info("shm: cluster %llu never connected its socket", cid);
        llmdd__link_drop(link, "shm: socket not connected");
        return;
    }
    pthread_mutex_lock(&sl->lock);
    sl->sock = fd;
    sl->peer_pidfd = shm_pidfd((pid_t)link->peer.pid);
    pthread_mutex_unlock(&sl->lock);
    if (llmdd__shm_send(sl, SMSG_READY, 0, NULL, 0, -1, deadline) != 0) {
        llmdd__link_drop(link, "shm: socket setup failed");
        return;
    }
    pthread_mutex_lock(&sl->lock);
    sl->ready = true;
    pthread_cond_broadcast(&sl->cond);
    pthread_mutex_unlock(&sl->lock);
    llmdd__shm_reader(sl);
}

/* Client side: the socket, or a reason why not. */
static const char *
shm_connect_sock(shm_link *sl, int *err)
{
    llmdd__link *link = sl->link;
    struct sockaddr_un a;
    int fd = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);

    *err = 0;
    if (fd < 0) {
        *err = errno;
        return "socket";
    }
    shm_addr(sl, &a);
    if (connect(fd, (struct sockaddr *)&a, sizeof(a)) != 0) {
        *err = errno;
        close(fd);
        return "connect";
    }
    if (shm_peer_pid(fd) != (int)link->peer.pid) {
        close(fd);
        return "the socket's process is not the peer's pid (another pid "
               "namespace?)";
    }
    sl->sock = fd;
    sl->peer_pidfd = shm_pidfd((pid_t)link->peer.pid);
    return NULL;
}

static llmdd_status
shm_client_init(shm_link *sl)
{
    llmdd__link *link = sl->link;
    unsigned long long cid = (unsigned long long)link->peer.cluster_id;
    int err;
    const char *why = shm_connect_sock(sl, &err);

    if (why != NULL) {
        if (shm_forced(link)) {
            log_error("shm: cluster %llu: %s %s%s%s; llm.Transport=shm needs "
                      "it",
                      cid, why, sl->path, err ? ": " : "",
                      err ? strerror(err) : "");
            return LLM_LINK_FAILED;
        }
        log_info("shm: cluster %llu: %s %s%s%s; using tcp", cid, why,
                 sl->path, err ? ": " : "", err ? strerror(err) : "");
        int dfd = llmdd__data_connect(link, SHM_FLAG_NOSOCK,
                                      link->deadline_ms);
        if (dfd < 0)
            return LLM_LINK_FAILED;
        close(dfd);
        pthread_mutex_lock(&sl->lock);
        sl->nosock = true;
        pthread_mutex_unlock(&sl->lock);
        return llmdd__stream_connect(sl->stream);
    }
    int dfd = llmdd__data_connect(link, SHM_FLAG_SOCK, link->deadline_ms);
    if (dfd < 0)
        return LLM_LINK_FAILED;
    close(dfd);
    for (;;) {
        shm_msg m;
        int k = llmdd__shm_recv(sl, &m);
        if (k == 1 && m.fd >= 0)
            close(m.fd);
        if (k == 1 && m.type == SMSG_READY && m.body.len == 0)
            break;
        if (k == -1 &&
            llmdd__shm_poll(sl, sl->sock, POLLIN, link->deadline_ms, true) == 1)
            continue;
        bool late = llmdd__now_ms() >= link->deadline_ms;
        LLMDD_LOG(late ? LLMDD_LOG_INFO : LLMDD_LOG_ERROR,
                  "shm: cluster %llu: no READY on %s", cid, sl->path);
        return late ? LLM_TIMEOUT : LLM_LINK_FAILED;
    }
    llmdd_status st = llmdd__stream_connect(sl->stream);
    if (st != LLM_SUCCESS)
        return st;
    pthread_mutex_lock(&sl->lock);
    sl->ready = true;
    pthread_mutex_unlock(&sl->lock);
    llmdd__link_hold(link);
    if (llmdd__spawn(link->dd, llmdd__shm_reader_main, sl) != 0) {
        llmdd__link_put(link);
        return LLM_LINK_FAILED;
    }
    return LLM_SUCCESS;
}

static llmdd_status
shm_link_init(llmdd__link *link, bool client)
{
    shm_link *sl = shm_new(link);

    if (sl == NULL)
        return LLM_OUT_OF_MEMORY;
    link->tp = sl;
    return client ? shm_client_init(sl) : shm_listen(sl);
}

static void
shm_accept_conn(llmdd__link *link, int fd, uint32_t flags)
{
    shm_link *sl = link->tp;

    if (flags & (SHM_FLAG_SOCK | SHM_FLAG_NOSOCK)) {
        close(fd);
        if (!link->client)
            shm_accept_sock(sl, (flags & SHM_FLAG_SOCK) != 0);
        return;
    }
    llmdd__stream_accept(sl->stream, fd, flags & LLMDD__STREAM_FLAG_MASK);
}

static void
shm_reopen(llmdd__link *link)
{
    shm_link *sl = link->tp;

    llmdd__stream_reopen(sl->stream);
}

static void
shm_link_shutdown(llmdd__link *link)
{
    shm_link *sl = link->tp;
    uint64_t one = 1;

    if (sl == NULL)
        return;
    pthread_mutex_lock(&sl->lock);
    sl->down = true;
    pthread_cond_broadcast(&sl->cond);
    pthread_mutex_unlock(&sl->lock);
    (void)!write(sl->wake_fd, &one, sizeof(one));
    llmdd__stream_shutdown(sl->stream);
}

/* The peer reaches our memfds and CMA memory itself (its transfers end
 * before it confirms an unlink); we serve it only on the fallback plane. */
static bool
shm_quiesce(llmdd__link *link, int64_t deadline_ms)
{
    shm_link *sl = link->tp;

    return sl == NULL || llmdd__stream_quiesce(sl->stream, deadline_ms);
}

static void
shm_link_fini(llmdd__link *link)
{
    shm_link *sl = link->tp;

    /* The reader, which tears down mappings and leases, has finished; what
     * is left belongs to a link whose socket never came up. */
    llmdd__stream_free(sl->stream);
    shm_unlisten(sl);
    if (sl->sock >= 0)
        close(sl->sock);
    close(sl->wake_fd);
    if (sl->peer_pidfd >= 0)
        close(sl->peer_pidfd);
    while (sl->entries != NULL) {
        shm_entry *e = sl->entries;
        sl->entries = e->next;
        if (e->map != NULL)
            munmap(e->map, e->map_len);
        e->map = NULL;
        llmdd__shm_entry_put(e);
    }
    if (sl->pool != NULL)
        munmap(sl->pool, sl->pool_len);
    for (size_t i = 0; i < sl->nleases; i++)
        llmdd__cache_put(link->dd, sl->leases[i].c);
    free(sl->leases);
    free(sl->obuf);
    free(sl->rbuf);
    pthread_cond_destroy(&sl->cond);
    pthread_mutex_destroy(&sl->expose_lock);
    pthread_mutex_destroy(&sl->lock);
    free(sl);
    link->tp = NULL;
}

const llmdd_transport_ops llmdd__shm_ops = {
    .name = "shm",
    .strided = true,
    .reaches = shm_reaches,
    .link_init = shm_link_init,
    .link_shutdown = shm_link_shutdown,
    .quiesce = shm_quiesce,
    .link_fini = shm_link_fini,
    .accept_conn = shm_accept_conn,
    .query = shm_query,
    .remote_free = shm_remote_free,
    .xfer = llmdd__shm_xfer,
    .cache_removed = llmdd__shm_cache_removed,
    .reopen = shm_reopen,
};
