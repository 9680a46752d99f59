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
 *    met memory that was no longer leased. Registered (CMA) memory cannot
 *    be held back; the peer checks the socket between CMA batches.
 *  - Seals. Memfds are sealed against size changes before they are passed
 *    (core/cache.c): a peer that shrank one would make the owner die of
 *    SIGBUS. The peer maps only memfds sealed against shrinking.
 *
 * Thread-safety: shm_link.lock guards the entry table, entry users and dead
 * flags, the waiters and the state flags; expose_lock guards the leases and
 * orders QUERY replies before INVALs. Neither is held across a memcpy or a
 * cross-memory attach.
 */
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/uio.h>
#include <sys/un.h>
#include <time.h>
#include <unistd.h>

#include "core/copy.h"
#include "core/internal.h"
#include "base/net.h"
#include "ctrl/wire.h"
#include "transport/shm/shm.h"
#include "transport/stream/stream.h"

#define SHM_MAGIC 0x4d48534cu /* "LSHM" little-endian */
#define SHM_VERSION 1
#define SHM_HDR_LEN 16
#define SHM_MSG_MAX 65536
/* A registered cache whose addresses fit in one reply uses CMA. */
#define SHM_CMA_TENSORS_MAX ((SHM_MSG_MAX - SHM_HDR_LEN - 512) / 8)
#define SHM_FLAG_SOCK 0x100u   /* data connection: accept my socket */
#define SHM_FLAG_NOSOCK 0x200u /* data connection: I cannot use it */
#define SHM_ACCEPT_MS 2000
#define SHM_BYE_MS 2000
#define SHM_STALL_MS 5000
#define SHM_IOV_BATCH 1024              /* iovec pairs per CMA call */
#define SHM_CMA_BATCH_BYTES (1ull << 30) /* under the kernel's MAX_RW_COUNT */
#define SHM_FWD_CONNS 1                 /* the data plane is a fallback */
#define SHM_DIR "/tmp"    /* shared by every namespace that shares /tmp */
#define SHM_STALE_S 60    /* a socket file this old has lost its link */
#define SHM_REV_CONNS 1

enum {
    SMSG_READY = 1,
    SMSG_QUERY = 2,
    SMSG_QUERY_REPLY = 3,
    SMSG_INVAL = 4,
    SMSG_INVAL_ACK = 5,
};

enum { SHM_KIND_MEMFD = 1, SHM_KIND_CMA = 2, SHM_KIND_STREAM = 3 };

/* One of the peer's caches as this side reaches it. */
typedef struct shm_entry {
    int64_t id;
    atomic_int refs; /* the table's, each remote cache's, a waiter's */
    int kind;        /* changes from CMA to STREAM once; under lock */
    int users;       /* copies in flight; under lock */
    bool dead;       /* under lock */
    bool warned;
    uint8_t *map; /* our own mapping, unmapped when dead; NULL in the pool */
    size_t map_len;
    uint8_t *base; /* tensor 0, memfd kind */
    uint64_t pitch;
    uint32_t ntensors;
    uint64_t tensor_size;
    uint64_t *addrs; /* the owner's tensor addresses, CMA kind */
    struct shm_entry *next;
} shm_entry;

/* A request of ours waiting for its reply. */
typedef struct shm_wait {
    uint64_t seq;
    bool done;
    uint32_t status;
    llmdd_cache_desc desc;
    shm_entry *e; /* a reference, for a successful QUERY */
    struct shm_wait *next;
} shm_wait;

/* One of our caches the peer may reach: a reference keeps it alive. */
typedef struct {
    int64_t id;
    llmdd__cache *c;
} shm_lease;

typedef struct {
    llmdd__link *link;
    llmdd__stream *stream;
    char path[64];
    int listen_fd; /* server side, until the client connected */
    int sock;      /* -1 until connected; closed at link_fini */
    int wake_fd;   /* eventfd, readable once the link is down */
    int peer_pidfd;       /* the peer process, from the socket's SO_PEERCRED */
    uint8_t *rbuf, *obuf; /* the reader's, SHM_MSG_MAX each */

    pthread_mutex_t lock;
    pthread_cond_t cond; /* CLOCK_MONOTONIC */
    bool ready;          /* the socket carries requests */
    bool nosock;         /* everything goes over the data plane */
    bool accepted;       /* server: the socket was set up (once) */
    bool down;
    uint64_t seq;
    shm_wait *waits;
    shm_entry *entries;
    uint8_t *pool; /* the peer's pool memfd, mapped once */
    size_t pool_len;
    dev_t pool_dev;
    ino_t pool_ino;

    pthread_mutex_t expose_lock;
    shm_lease *leases;
    size_t nleases, leases_cap;
} shm_link;

static atomic_uint_fast64_t stat_memfd, stat_cma, stat_stream, stat_refused;

void
llmdd__shm_stats_get(llmdd__shm_stats *out)
{
    out->memfd_xfers = atomic_load(&stat_memfd);
    out->cma_xfers = atomic_load(&stat_cma);
    out->stream_xfers = atomic_load(&stat_stream);
    out->cma_refused = atomic_load(&stat_refused);
}

/* ---- Explicit little-endian encoding. ---- */

typedef struct {
    uint8_t *p;
    size_t cap, len;
    bool bad;
} shm_wbuf;

typedef struct {
    const uint8_t *p;
    size_t len, off;
    bool bad;
} shm_rbuf;

static void
w_bytes(shm_wbuf *w, const void *src, size_t n)
{
    if (w->bad || n > w->cap - w->len) {
        w->bad = true;
        return;
    }
    memcpy(w->p + w->len, src, n);
    w->len += n;
}

static void
w_u64(shm_wbuf *w, uint64_t v, size_t n)
{
    uint8_t b[8];

    for (size_t i = 0; i < n; i++)
        b[i] = (uint8_t)(v >> (8 * i));
    w_bytes(w, b, n);
}

static const uint8_t *
r_bytes(shm_rbuf *r, size_t n)
{
    if (r->bad || n > r->len - r->off) {
        r->bad = true;
        return NULL;
    }
    r->off += n;
    return r->p + r->off - n;
}

static uint64_t
r_u64(shm_rbuf *r, size_t n)
{
    const uint8_t *b = r_bytes(r, n);
    uint64_t v = 0;

    for (size_t i = 0; b != NULL && i < n; i++)
        v |= (uint64_t)b[i] << (8 * i);
    return v;
}

/* ---- Small helpers. ---- */

static bool
shm_forced(llmdd *dd)
{
    pthread_mutex_lock(&dd->lock);
    bool forced = strcmp(dd->opts.transport, "shm") == 0;
    pthread_mutex_unlock(&dd->lock);
    return forced;
}

static int64_t
shm_wait_ms(llmdd *dd)
{
    pthread_mutex_lock(&dd->lock);
    int64_t ms = dd->opts.wait_ms;
    pthread_mutex_unlock(&dd->lock);
    return ms;
}

/* Waits on sl->cond until deadline (CLOCK_MONOTONIC ms); lock held. */
static void
shm_cond_wait(shm_link *sl, int64_t deadline)
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
static int
shm_poll(shm_link *sl, int fd, short events, int64_t deadline, bool wake)
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

static void
entry_put(shm_entry *e)
{
    if (e == NULL || atomic_fetch_sub(&e->refs, 1) != 1)
        return;
    if (e->map != NULL)
        munmap(e->map, e->map_len);
    free(e->addrs);
    free(e);
}

/* lock held. */
static shm_entry *
entry_find(shm_link *sl, int64_t id)
{
    for (shm_entry *e = sl->entries; e != NULL; e = e->next)
        if (e->id == id)
            return e;
    return NULL;
}

/* ---- Messages on the socket. ---- */

static int
shm_send(shm_link *sl, uint16_t type, uint64_t seq, const uint8_t *payload,
         size_t len, int pass_fd, int64_t deadline)
{
    uint8_t hdr[SHM_HDR_LEN];
    shm_wbuf w = {.p = hdr, .cap = sizeof(hdr)};
    union {
        char buf[CMSG_SPACE(sizeof(int))];
        struct cmsghdr align;
    } cm;
    struct iovec iov[2] = {{hdr, sizeof(hdr)}, {(void *)payload, len}};
    struct msghdr mh = {.msg_iov = iov, .msg_iovlen = len > 0 ? 2 : 1};

    w_u64(&w, SHM_MAGIC, 4);
    w_u64(&w, SHM_VERSION, 2);
    w_u64(&w, type, 2);
    w_u64(&w, seq, 8);
    if (pass_fd >= 0) {
        memset(&cm, 0, sizeof(cm));
        mh.msg_control = cm.buf;
        mh.msg_controllen = sizeof(cm.buf);
        struct cmsghdr *c = CMSG_FIRSTHDR(&mh);
        c->cmsg_level = SOL_SOCKET;
        c->cmsg_type = SCM_RIGHTS;
        c->cmsg_len = CMSG_LEN(sizeof(int));
        memcpy(CMSG_DATA(c), &pass_fd, sizeof(int));
    }
    for (;;) {
        /* A SEQPACKET message goes whole or not at all. */
        if (sendmsg(sl->sock, &mh, MSG_DONTWAIT | MSG_NOSIGNAL) >= 0)
            return 0;
        if (errno == EINTR)
            continue;
        if (errno != EAGAIN && errno != EWOULDBLOCK)
            return -1;
        if (shm_poll(sl, sl->sock, POLLOUT, deadline, true) != 1)
            return -1;
    }
}

typedef struct {
    uint16_t type;
    uint64_t seq;
    shm_rbuf body;
    int fd; /* a passed descriptor, or -1 */
} shm_msg;

/*
 * Receives one message without blocking. 1: a message (its fd, if any, is
 * the caller's); 0: EOF; -1: nothing yet; -2: error or malformed. Passed
 * descriptors beyond the first are closed.
 */
static int
shm_recv(shm_link *sl, shm_msg *m)
{
    uint8_t *buf = sl->rbuf;
    union {
        char buf[CMSG_SPACE(4 * sizeof(int))];
        struct cmsghdr align;
    } cm;
    struct iovec iov = {buf, SHM_MSG_MAX};
    struct msghdr mh = {.msg_iov = &iov,
                        .msg_iovlen = 1,
                        .msg_control = cm.buf,
                        .msg_controllen = sizeof(cm.buf)};
    ssize_t k = recvmsg(sl->sock, &mh, MSG_DONTWAIT | MSG_CMSG_CLOEXEC);

    m->fd = -1;
    if (k < 0)
        return errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR ? -1
                                                                         : -2;
    for (struct cmsghdr *c = CMSG_FIRSTHDR(&mh); c != NULL;
         c = CMSG_NXTHDR(&mh, c)) {
        if (c->cmsg_level != SOL_SOCKET || c->cmsg_type != SCM_RIGHTS)
            continue;
        size_t n = (c->cmsg_len - CMSG_LEN(0)) / sizeof(int);
        for (size_t i = 0; i < n; i++) {
            int fd;
            memcpy(&fd, CMSG_DATA(c) + i * sizeof(int), sizeof(int));
            if (m->fd < 0)
                m->fd = fd;
            else
                close(fd);
        }
    }
    if (k == 0 && m->fd < 0)
        return 0;
    shm_rbuf h = {.p = buf, .len = (size_t)k};
    uint32_t magic = (uint32_t)r_u64(&h, 4);
    uint16_t version = (uint16_t)r_u64(&h, 2);
    m->type = (uint16_t)r_u64(&h, 2);
    m->seq = r_u64(&h, 8);
    if (h.bad || (mh.msg_flags & (MSG_TRUNC | MSG_CTRUNC)) ||
        magic != SHM_MAGIC || version != SHM_VERSION) {
        if (m->fd >= 0)
            close(m->fd);
        m->fd = -1;
        errno = EBADMSG;
        return -2;
    }
    m->body = (shm_rbuf){.p = buf + SHM_HDR_LEN,
                         .len = (size_t)k - SHM_HDR_LEN};
    return 1;
}

/* Hands a reply to the request waiting for it; lock held. */
static void
shm_deliver(shm_link *sl, uint64_t seq, uint32_t status,
            const llmdd_cache_desc *desc, shm_entry *e)
{
    for (shm_wait *w = sl->waits; w != NULL; w = w->next) {
        if (w->seq != seq || w->done)
            continue;
        w->done = true;
        w->status = status;
        if (desc != NULL)
            w->desc = *desc;
        if (e != NULL) {
            atomic_fetch_add(&e->refs, 1);
            w->e = e;
        }
        pthread_cond_broadcast(&sl->cond);
        return;
    }
}

/*
 * Sends a request and waits for its reply (delivered by the reader into w).
 * 0: replied; 1: the link has no socket (use the data plane); -1: down,
 * unsent or no reply by the deadline.
 */
static int
shm_call(shm_link *sl, uint16_t type, int64_t id, int64_t deadline,
         shm_wait *w)
{
    uint8_t payload[8];
    shm_wbuf pw = {.p = payload, .cap = sizeof(payload)};
    int rc = -1;

    memset(w, 0, sizeof(*w));
    w_u64(&pw, (uint64_t)id, 8);
    pthread_mutex_lock(&sl->lock);
    while (!sl->ready && !sl->nosock && !sl->down &&
           llmdd__now_ms() < deadline)
        shm_cond_wait(sl, deadline);
    if (sl->nosock && !sl->ready) {
        pthread_mutex_unlock(&sl->lock);
        return 1;
    }
    if (!sl->ready || sl->down) {
        pthread_mutex_unlock(&sl->lock);
        return -1;
    }
    w->seq = ++sl->seq;
    w->next = sl->waits;
    sl->waits = w;
    pthread_mutex_unlock(&sl->lock);

    bool sent = shm_send(sl, type, w->seq, payload, pw.len, -1, deadline) == 0;
    pthread_mutex_lock(&sl->lock);
    while (sent && !w->done && !sl->down && llmdd__now_ms() < deadline)
        shm_cond_wait(sl, deadline);
    for (shm_wait **p = &sl->waits; *p != NULL; p = &(*p)->next) {
        if (*p == w) {
            *p = w->next;
            break;
        }
    }
    if (w->done)
        rc = 0;
    pthread_mutex_unlock(&sl->lock);
    return rc;
}

/* ---- The owner's side: answering QUERY, sending INVAL. ---- */

/*
 * expose_lock held. Keeps c's reference as the lease: 1. The cache has one
 * already: 0 (the caller drops its reference). Out of memory: -1.
 */
static int
lease_add(shm_link *sl, llmdd__cache *c)
{
    for (size_t i = 0; i < sl->nleases; i++)
        if (sl->leases[i].id == c->id)
            return 0;
    if (sl->nleases == sl->leases_cap) {
        size_t cap = sl->leases_cap ? sl->leases_cap * 2 : 16;
        shm_lease *n = realloc(sl->leases, cap * sizeof(*n));
        if (n == NULL)
            return -1;
        sl->leases = n;
        sl->leases_cap = cap;
    }
    sl->leases[sl->nleases++] = (shm_lease){.id = c->id, .c = c};
    return 1;
}

/* expose_lock held. Removes the lease of `id`; its cache, or NULL. */
static llmdd__cache *
lease_take(shm_link *sl, int64_t id)
{
    for (size_t i = 0; i < sl->nleases; i++) {
        if (sl->leases[i].id == id) {
            llmdd__cache *c = sl->leases[i].c;
            sl->leases[i] = sl->leases[--sl->nleases];
            return c;
        }
    }
    return NULL;
}

/*
 * Ends every lease. Unconfirmed: the peer never said it stopped touching
 * our memory (it may be stalled mid-copy), so its pooled caches' pages
 * must not go to another cache while its process lives.
 */
static void
leases_release(shm_link *sl, bool confirmed)
{
    pthread_mutex_lock(&sl->expose_lock);
    shm_lease *l = sl->leases;
    size_t n = sl->nleases;
    sl->leases = NULL;
    sl->nleases = sl->leases_cap = 0;
    pthread_mutex_unlock(&sl->expose_lock);
    if (!confirmed && n > 0)
        log_warn("shm: cluster %llu (pid %u) did not confirm it let go of "
                 "%zu caches; their pool pages wait for its exit",
                 (unsigned long long)sl->link->peer.cluster_id,
                 sl->link->peer.pid, n);
    for (size_t i = 0; i < n; i++) {
        if (confirmed)
            llmdd__cache_put(sl->link->dd, l[i].c);
        else
            llmdd__cache_put_stale(sl->link->dd, l[i].c, sl->peer_pidfd);
    }
    free(l);
}

static int
shm_serve_query(shm_link *sl, const shm_msg *m, uint8_t *out)
{
    llmdd *dd = sl->link->dd;
    shm_rbuf r = m->body;
    shm_wbuf w = {.p = out, .cap = SHM_MSG_MAX};
    int64_t id = (int64_t)r_u64(&r, 8);
    int pass_fd = -1;

    if (r.bad || r.off != r.len)
        return -1;
    /* Held from the lookup to the send: an INVAL for this cache cannot
     * overtake the reply. */
    pthread_mutex_lock(&sl->expose_lock);
    llmdd__cache *c = llmdd__cache_get(dd, id);
    /* The peer may reach a cache only while we hold a lease on it. */
    int leased = c != NULL ? lease_add(sl, c) : -1;
    w_u64(&w, (uint64_t)id, 8);
    if (leased < 0) {
        w_u64(&w, LLM_KV_CACHE_NOT_EXIST, 4);
    } else {
        uint8_t d[16 + 8 * LLMDD_MAX_DIMS + 16];
        size_t dn = llmdd__wire_desc_encode(LLM_SUCCESS, &c->desc, d,
                                            sizeof(d));
        w_u64(&w, LLM_SUCCESS, 4);
        w_u64(&w, dn, 4);
        w_bytes(&w, d, dn);
        if (c->allocated) {
            w_u64(&w, SHM_KIND_MEMFD, 4);
            w_u64(&w, c->mem.pooled, 1);
            w_u64(&w, c->mem.fd_off, 8);
            w_u64(&w, c->mem.len, 8);
            w_u64(&w, c->mem.pitch, 8);
            pass_fd = c->mem.fd;
        } else if (c->desc.num_tensors <= SHM_CMA_TENSORS_MAX) {
            w_u64(&w, SHM_KIND_CMA, 4);
            w_u64(&w, c->desc.num_tensors, 4);
            for (uint32_t t = 0; t < c->desc.num_tensors; t++)
                w_u64(&w, c->addrs[t], 8);
        } else {
            w_u64(&w, SHM_KIND_STREAM, 4);
        }
    }
    int rc = w.bad ? -1
                   : shm_send(sl, SMSG_QUERY_REPLY, m->seq, out, w.len,
                              pass_fd, llmdd__now_ms() + SHM_STALL_MS);
    pthread_mutex_unlock(&sl->expose_lock);
    if (leased != 1) /* else our reference is the lease now */
        llmdd__cache_put(dd, c);
    return rc;
}

static void
shm_cache_removed(llmdd__link *link, const llmdd__cache *cache)
{
    shm_link *sl = link->tp;
    uint8_t payload[8];
    shm_wbuf pw = {.p = payload, .cap = sizeof(payload)};
    shm_wait w;
    bool leased = false;

    if (sl == NULL)
        return;
    /* Requests on the fallback data plane hold the cache too. */
    llmdd__stream_cache_removed(sl->stream, cache);
    memset(&w, 0, sizeof(w));
    w_u64(&pw, (uint64_t)cache->id, 8);
    int64_t deadline = llmdd__now_ms() + shm_wait_ms(link->dd);
    pthread_mutex_lock(&sl->expose_lock);
    for (size_t i = 0; i < sl->nleases && !leased; i++)
        leased = sl->leases[i].id == cache->id;
    pthread_mutex_lock(&sl->lock);
    bool live = leased && sl->ready && !sl->down;
    if (live) {
        w.seq = ++sl->seq;
        w.next = sl->waits;
        sl->waits = &w;
    }
    pthread_mutex_unlock(&sl->lock);
    /* Not live: the teardown releases the lease once the peer let go. */
    bool sent = live && shm_send(sl, SMSG_INVAL, w.seq, payload, pw.len, -1,
                                 deadline) == 0;
    pthread_mutex_unlock(&sl->expose_lock);
    if (!live)
        return;

    pthread_mutex_lock(&sl->lock);
    while (sent && !w.done && !sl->down && llmdd__now_ms() < deadline)
        shm_cond_wait(sl, deadline);
    for (shm_wait **p = &sl->waits; *p != NULL; p = &(*p)->next) {
        if (*p == &w) {
            *p = w.next;
            break;
        }
    }
    bool acked = w.done, down = sl->down;
    pthread_mutex_unlock(&sl->lock);
    if (acked) {
        pthread_mutex_lock(&sl->expose_lock);
        llmdd__cache *c = lease_take(sl, cache->id);
        pthread_mutex_unlock(&sl->expose_lock);
        llmdd__cache_put(link->dd, c);
    } else if (!down) {
        log_error("shm: cluster %llu did not release cache %lld in time; "
                  "dropping the link",
                  (unsigned long long)link->peer.cluster_id,
                  (long long)cache->id);
        llmdd__link_drop(link, "shm: cache release not acknowledged");
    }
}

/* ---- The peer's side: mapping what a QUERY_REPLY describes. ---- */

/* Maps the peer's memfd for an entry; takes ownership of fd. */
static int
shm_map(shm_link *sl, shm_entry *e, int fd, bool pooled, uint64_t fd_off,
        uint64_t len)
{
    unsigned long long cid =
        (unsigned long long)sl->link->peer.cluster_id;
    struct stat st;
    uint64_t end, tensors;

    if (fd < 0 || fstat(fd, &st) != 0 || !S_ISREG(st.st_mode) ||
        st.st_size <= 0)
        goto err_bad;
    /* A file the owner could still shrink would make our copies fault
     * (SIGBUS) on the pages it cut: map only memfds sealed against it. */
    int seals = fcntl(fd, F_GET_SEALS);
    if (seals < 0 || !(seals & F_SEAL_SHRINK)) {
        log_error("shm: cluster %llu passed cache %lld in a file not sealed "
                  "against shrinking; not mapping it",
                  cid, (long long)e->id);
        close(fd);
        return -1;
    }
    if (__builtin_add_overflow(fd_off, len, &end) ||
        end > (uint64_t)st.st_size ||
        __builtin_mul_overflow(e->pitch, (uint64_t)e->ntensors, &tensors) ||
        tensors > len || e->tensor_size > e->pitch)
        goto err_bad;
    if (!pooled) {
        e->map_len = (size_t)st.st_size;
        e->map = mmap(NULL, e->map_len, PROT_READ | PROT_WRITE,
                      MAP_SHARED | MAP_POPULATE, fd, 0);
        if (e->map == MAP_FAILED) {
            e->map = NULL;
            log_error("shm: mapping cache %lld of cluster %llu: %s",
                      (long long)e->id, cid, strerror(errno));
            close(fd);
            return -1;
        }
        e->base = e->map + fd_off;
        close(fd);
        return 0;
    }
    /* Only the reader maps, so the pool needs no lock to be set once. */
    if (sl->pool == NULL) {
        uint8_t *p = mmap(NULL, (size_t)st.st_size, PROT_READ | PROT_WRITE,
                          MAP_SHARED, fd, 0);
        if (p == MAP_FAILED) {
            log_error("shm: mapping the pool of cluster %llu: %s", cid,
                      strerror(errno));
            close(fd);
            return -1;
        }
        pthread_mutex_lock(&sl->lock);
        sl->pool = p;
        sl->pool_len = (size_t)st.st_size;
        sl->pool_dev = st.st_dev;
        sl->pool_ino = st.st_ino;
        pthread_mutex_unlock(&sl->lock);
    } else if (st.st_dev != sl->pool_dev || st.st_ino != sl->pool_ino ||
               end > sl->pool_len) {
        goto err_bad;
    }
    close(fd);
    e->base = sl->pool + fd_off;
    /* Prefault just this cache's pages; the pool may be mostly unused. */
    long page = sysconf(_SC_PAGESIZE);
    uint64_t from = fd_off & ~((uint64_t)page - 1);
    (void)madvise(sl->pool + from, (size_t)(end - from), MADV_POPULATE_WRITE);
    return 0;
err_bad:
    log_error("shm: cluster %llu described cache %lld inconsistently",
              cid, (long long)e->id);
    if (fd >= 0)
        close(fd);
    return -1;
}

/* Builds the entry a QUERY_REPLY describes and hands it to its waiter. */
static int
shm_on_query_reply(shm_link *sl, shm_msg *m)
{
    shm_rbuf r = m->body;
    int64_t id = (int64_t)r_u64(&r, 8);
    uint32_t status = (uint32_t)r_u64(&r, 4), dstatus;
    llmdd_cache_desc desc;
    uint64_t tsize, stride;
    shm_entry *e = NULL, *have;
    int fd = m->fd;

    m->fd = -1;
    if (r.bad)
        goto err_proto;
    if (status != LLM_SUCCESS) {
        if (r.off != r.len)
            goto err_proto;
        goto not_exist;
    }
    size_t dn = (size_t)r_u64(&r, 4);
    const uint8_t *d = r_bytes(&r, dn);
    if (d == NULL || llmdd__wire_desc_decode(d, dn, &dstatus, &desc) != 0 ||
        dstatus != LLM_SUCCESS ||
        llmdd__desc_check(&desc, &tsize, &stride) != LLM_SUCCESS)
        goto err_proto;
    uint32_t kind = (uint32_t)r_u64(&r, 4);

    pthread_mutex_lock(&sl->lock);
    have = entry_find(sl, id);
    if (have != NULL && !have->dead) {
        /* Asked twice (two threads, or after a timeout): one mapping. */
        shm_deliver(sl, m->seq, LLM_SUCCESS, &desc, have);
        pthread_mutex_unlock(&sl->lock);
        if (fd >= 0)
            close(fd);
        return 0;
    }
    pthread_mutex_unlock(&sl->lock);
    if (have != NULL)
        goto not_exist;
    e = calloc(1, sizeof(*e));
    if (e == NULL)
        goto not_exist;
    atomic_init(&e->refs, 1);
    e->id = id;
    e->kind = (int)kind;
    e->ntensors = desc.num_tensors;
    e->tensor_size = tsize;
    if (kind == SHM_KIND_MEMFD) {
        bool pooled = r_u64(&r, 1) != 0;
        uint64_t fd_off = r_u64(&r, 8), len = r_u64(&r, 8);
        e->pitch = r_u64(&r, 8);
        if (r.bad || r.off != r.len)
            goto err_proto;
        int mrc = shm_map(sl, e, fd, pooled, fd_off, len);
        fd = -1; /* shm_map owns it */
        if (mrc != 0)
            goto not_exist;
    } else if (kind == SHM_KIND_CMA) {
        uint32_t n = (uint32_t)r_u64(&r, 4);
        if (r.bad || n != desc.num_tensors || n > SHM_CMA_TENSORS_MAX)
            goto err_proto;
        e->addrs = malloc(n * sizeof(*e->addrs));
        if (e->addrs == NULL)
            goto not_exist;
        for (uint32_t t = 0; t < n; t++)
            e->addrs[t] = r_u64(&r, 8);
        if (r.bad || r.off != r.len)
            goto err_proto;
    } else if (kind != SHM_KIND_STREAM || r.off != r.len) {
        goto err_proto;
    }
    if (fd >= 0)
        close(fd);
    pthread_mutex_lock(&sl->lock);
    e->next = sl->entries;
    sl->entries = e;
    shm_deliver(sl, m->seq, LLM_SUCCESS, &desc, e);
    pthread_mutex_unlock(&sl->lock);
    return 0;
not_exist:
    if (fd >= 0)
        close(fd);
    entry_put(e);
    pthread_mutex_lock(&sl->lock);
    shm_deliver(sl, m->seq, LLM_KV_CACHE_NOT_EXIST, NULL, NULL);
    pthread_mutex_unlock(&sl->lock);
    return 0;
err_proto:
    if (fd >= 0)
        close(fd);
    entry_put(e);
    return -1;
}

/* The peer's cache is gone: stop using it, then acknowledge. */
static int
shm_on_inval(shm_link *sl, const shm_msg *m)
{
    shm_rbuf r = m->body;
    int64_t id = (int64_t)r_u64(&r, 8);

    if (r.bad || r.off != r.len)
        return -1;
    pthread_mutex_lock(&sl->lock);
    shm_entry *e = entry_find(sl, id);
    if (e != NULL) {
        e->dead = true;
        while (e->users > 0)
            pthread_cond_wait(&sl->cond, &sl->lock);
        for (shm_entry **p = &sl->entries; *p != NULL; p = &(*p)->next) {
            if (*p == e) {
                *p = e->next;
                break;
            }
        }
    }
    pthread_mutex_unlock(&sl->lock);
    if (e != NULL) {
        /* Nobody copies through it any more; a pooled entry has no
         * mapping of its own and is now simply unreachable. */
        if (e->map != NULL)
            munmap(e->map, e->map_len);
        e->map = NULL;
        entry_put(e);
    }
    return shm_send(sl, SMSG_INVAL_ACK, m->seq, NULL, 0, -1,
                    llmdd__now_ms() + SHM_STALL_MS);
}

static int
shm_dispatch(shm_link *sl, shm_msg *m, uint8_t *out)
{
    switch (m->type) {
    case SMSG_QUERY:
        return shm_serve_query(sl, m, out);
    case SMSG_QUERY_REPLY:
        return shm_on_query_reply(sl, m);
    case SMSG_INVAL:
        return shm_on_inval(sl, m);
    case SMSG_INVAL_ACK:
        if (m->body.len != 0)
            return -1;
        pthread_mutex_lock(&sl->lock);
        shm_deliver(sl, m->seq, LLM_SUCCESS, NULL, NULL);
        pthread_mutex_unlock(&sl->lock);
        return 0;
    default:
        return -1;
    }
}

/*
 * The end of a link's socket: stop touching the peer's memory, say so with
 * a half-close, wait for the peer to say the same, release our leases.
 */
static void
shm_teardown(shm_link *sl, bool peer_closed)
{
    shm_entry *list;

    pthread_mutex_lock(&sl->lock);
    sl->down = true;
    pthread_cond_broadcast(&sl->cond);
    for (shm_entry *e = sl->entries; e != NULL; e = e->next)
        e->dead = true;
    for (;;) {
        bool busy = false;
        for (shm_entry *e = sl->entries; e != NULL && !busy; e = e->next)
            busy = e->users > 0;
        if (!busy)
            break;
        pthread_cond_wait(&sl->cond, &sl->lock);
    }
    list = sl->entries;
    sl->entries = NULL;
    uint8_t *pool = sl->pool;
    size_t pool_len = sl->pool_len;
    sl->pool = NULL;
    pthread_mutex_unlock(&sl->lock);
    while (list != NULL) {
        shm_entry *e = list;
        list = e->next;
        if (e->map != NULL)
            munmap(e->map, e->map_len);
        e->map = NULL;
        entry_put(e);
    }
    if (pool != NULL)
        munmap(pool, pool_len);

    shutdown(sl->sock, SHUT_WR);
    /* The peer's EOF (its own half-close, or its exit) is its word that it
     * no longer touches our memory; a reset is a close too. */
    bool confirmed = peer_closed;
    int64_t deadline = llmdd__now_ms() + SHM_BYE_MS;
    while (!peer_closed) {
        shm_msg m;
        int k = shm_recv(sl, &m);
        if (k == 1 && m.fd >= 0)
            close(m.fd);
        if (k == 0 || k == -2) {
            confirmed = k == 0 || errno == ECONNRESET;
            break;
        }
        if (k == -1 && shm_poll(sl, sl->sock, POLLIN, deadline, false) != 1) {
            log_warn("shm: cluster %llu did not close its socket in time",
                     (unsigned long long)sl->link->peer.cluster_id);
            break;
        }
    }
    leases_release(sl, confirmed);
}

/* Serves the socket until the link goes down; runs in a counted thread. */
static void
shm_reader(shm_link *sl)
{
    llmdd__link *link = sl->link;
    const char *why;
    bool peer_closed = false;

    for (;;) {
        shm_msg m;
        int k = shm_recv(sl, &m);
        if (k == -1) {
            if (shm_poll(sl, sl->sock, POLLIN, INT64_MAX, true) == 1)
                continue;
            why = "shm: socket error";
            break;
        }
        if (k == 0) {
            why = "shm: peer closed its socket";
            peer_closed = true;
            break;
        }
        int rc = k == 1 ? shm_dispatch(sl, &m, sl->obuf) : -1;
        if (k == 1 && m.fd >= 0)
            close(m.fd); /* a descriptor where none belongs */
        if (rc != 0) {
            why = "shm: socket error or bad message";
            pthread_mutex_lock(&sl->lock);
            bool down = sl->down; /* a reply that could not go out */
            pthread_mutex_unlock(&sl->lock);
            if (down)
                break;
            if (k == 1)
                log_error("shm: cluster %llu: bad message (type %u)",
                          (unsigned long long)link->peer.cluster_id, m.type);
            else
                log_error("shm: cluster %llu: socket: %s",
                          (unsigned long long)link->peer.cluster_id,
                          strerror(errno));
            break;
        }
    }
    /* A no-op when the link is already down (the usual way out). */
    llmdd__link_drop(link, why);
    shm_teardown(sl, peer_closed);
}

static void *
shm_reader_main(void *arg)
{
    shm_link *sl = arg;
    llmdd__link *link = sl->link;

    shm_reader(sl);
    llmdd__link_put(link);
    return NULL;
}

/* ---- Transfers. ---- */

/*
 * Whether the owner has begun to end the link: our side is down, or the
 * owner half-closed or closed the socket. Its teardown starts with that
 * half-close, and only after it may it free memory a copy of ours targets,
 * so a copy that finds this false once it is done ran entirely on memory
 * still leased to us.
 */
static bool
shm_owner_left(shm_link *sl)
{
    pthread_mutex_lock(&sl->lock);
    bool down = sl->down;
    int fd = sl->sock;
    pthread_mutex_unlock(&sl->lock);
    if (down)
        return true;
    struct pollfd p = {.fd = fd, .events = POLLRDHUP};
    return poll(&p, 1, 0) == 1 &&
           (p.revents & (POLLRDHUP | POLLHUP | POLLERR | POLLNVAL));
}

/* One batch of the copy engine; it has fenced its stores once this returns,
 * before the transfer is reported or a notification follows. */
static void
shm_copy(const shm_entry *e, const llmdd__xfer *x)
{
    llmdd__copy_batch b;

    llmdd__copy_begin(&b, llmdd__xfer_bytes(x));
    for (uint32_t t = 0; t < x->count; t++) {
        uint8_t *rbase = e->base + (uint64_t)(x->remote_first + t) * e->pitch;
        uint8_t *lbase = x->local[t];
        for (size_t i = 0; i < x->nruns; i++) {
            const llmdd__xrun *r = &x->runs[i];
            if (x->write)
                llmdd__copy(&b, rbase + r->remote_off, lbase + r->local_off,
                            r->len);
            else
                llmdd__copy(&b, lbase + r->local_off, rbase + r->remote_off,
                            r->len);
        }
    }
    llmdd__copy_end(&b);
}

/*
 * Cross-memory attach in batches of SHM_IOV_BATCH iovec pairs. 0 done; -1
 * with *err the errno; -2 the link went down or the deadline passed.
 */
static int
shm_cma(shm_link *sl, const shm_entry *e, const llmdd__xfer *x, int *err)
{
    struct iovec liov[SHM_IOV_BATCH], riov[SHM_IOV_BATCH];
    pid_t pid = (pid_t)sl->link->peer.pid;
    uint32_t t = 0;
    size_t r = 0;
    uint64_t done = 0; /* bytes of run r of tensor t already moved */

    while (t < x->count) {
        size_t n = 0;
        uint64_t total = 0;
        uint32_t bt = t;
        size_t br = r;
        uint64_t bdone = done;
        while (n < SHM_IOV_BATCH && bt < x->count &&
               total < SHM_CMA_BATCH_BYTES) {
            const llmdd__xrun *run = &x->runs[br];
            uint64_t len = run->len - bdone;
            if (len > SHM_CMA_BATCH_BYTES - total)
                len = SHM_CMA_BATCH_BYTES - total;
            liov[n].iov_base = x->local[bt] + run->local_off + bdone;
            riov[n].iov_base = (void *)(uintptr_t)(
                e->addrs[x->remote_first + bt] + run->remote_off + bdone);
            liov[n].iov_len = riov[n].iov_len = (size_t)len;
            total += len;
            n++;
            bdone += len;
            if (bdone == run->len) {
                bdone = 0;
                if (++br == x->nruns) {
                    br = 0;
                    bt++;
                }
            }
        }
        ssize_t k = 0;
        if (total > 0)
            k = x->write ? process_vm_writev(pid, liov, n, riov, n, 0)
                         : process_vm_readv(pid, liov, n, riov, n, 0);
        if (k < 0 && errno == EINTR)
            continue;
        if (k < 0 || (k == 0 && total > 0)) {
            *err = k < 0 ? errno : EFAULT;
            return -1;
        }
        /* Advance by what moved; a short count resumes mid-run. */
        uint64_t moved = (uint64_t)k;
        while (t < x->count) {
            uint64_t left = x->runs[r].len - done;
            if (moved < left) {
                done += moved;
                break;
            }
            moved -= left;
            done = 0;
            if (++r == x->nruns) {
                r = 0;
                t++;
            }
        }
        /* A peer that was stopped between batches must not write on into
         * memory the owner may have handed back meanwhile. */
        if (t < x->count &&
            (shm_owner_left(sl) || llmdd__now_ms() >= x->deadline_ms))
            return -2;
    }
    return 0;
}

static llmdd_status
shm_stream_xfer(shm_link *sl, const llmdd__xfer *x)
{
    atomic_fetch_add(&stat_stream, 1);
    return llmdd__stream_xfer(sl->stream, x);
}

/* The owner refused CMA: log once, use the data plane for this cache. */
static void
shm_cma_refused(shm_link *sl, shm_entry *e, int err)
{
    pthread_mutex_lock(&sl->lock);
    e->kind = SHM_KIND_STREAM;
    bool first = !e->warned;
    e->warned = true;
    pthread_mutex_unlock(&sl->lock);
    if (!first)
        return;
    atomic_fetch_add(&stat_refused, 1);
    log_warn("shm: cross-memory attach to pid %u of cluster %llu refused "
             "(%s); cache %lld uses tcp",
             sl->link->peer.pid, (unsigned long long)sl->link->peer.cluster_id,
             strerror(err), (long long)e->id);
}

static llmdd_status
shm_xfer(llmdd__link *link, const llmdd__xfer *x)
{
    shm_link *sl = link->tp;
    shm_entry *e = x->remote->priv;
    llmdd_status st = LLM_SUCCESS;
    int kind = 0;

    if (e == NULL) /* a link without the socket */
        return shm_stream_xfer(sl, x);
    /* The core checked every run; recheck what indexes our mapping. */
    if (x->remote_first > e->ntensors || x->count > e->ntensors ||
        x->remote_first + x->count > e->ntensors)
        return LLM_PARAM_INVALID;
    for (size_t i = 0; i < x->nruns; i++)
        if (x->runs[i].len > e->tensor_size ||
            x->runs[i].remote_off > e->tensor_size - x->runs[i].len)
            return LLM_PARAM_INVALID;
    pthread_mutex_lock(&sl->lock);
    if (sl->down)
        st = LLM_NOT_YET_LINK;
    else if (e->dead)
        st = LLM_KV_CACHE_NOT_EXIST;
    else if ((kind = e->kind) != SHM_KIND_STREAM)
        e->users++;
    pthread_mutex_unlock(&sl->lock);
    if (st != LLM_SUCCESS)
        return st;
    if (kind == SHM_KIND_STREAM)
        return shm_stream_xfer(sl, x);

    int err = 0, rc = 0;
    bool left = false;
    if (kind == SHM_KIND_MEMFD) {
        shm_copy(e, x);
        atomic_fetch_add(&stat_memfd, 1);
        /* Stalled mid-copy (SIGSTOP, a long page fault) past the owner's
         * patience: the owner dropped the link, and the pages may belong
         * to another cache by now (a pool hands them out again only once
         * this process exits, an older owner sooner). Do not call the
         * copy a success. */
        left = shm_owner_left(sl);
    } else {
        rc = shm_cma(sl, e, x, &err);
        if (rc == 0)
            atomic_fetch_add(&stat_cma, 1);
    }
    pthread_mutex_lock(&sl->lock);
    if (--e->users == 0)
        pthread_cond_broadcast(&sl->cond);
    pthread_mutex_unlock(&sl->lock);
    if (left)
        return LLM_NOT_YET_LINK;
    if (rc == 0)
        return LLM_SUCCESS;
    if (rc == -2)
        return llmdd__now_ms() >= x->deadline_ms ? LLM_TIMEOUT
                                                 : LLM_NOT_YET_LINK;
    if (err == EPERM || err == EACCES || err == ENOSYS) {
        /* Refused before a byte moved: the data plane redoes it all. */
        shm_cma_refused(sl, e, err);
        return shm_stream_xfer(sl, x);
    }
    if (err == ESRCH) {
        llmdd__link_drop(link, "shm: peer process gone");
        return LLM_NOT_YET_LINK;
    }
    log_error("shm: cross-memory attach to cluster %llu cache %lld: %s",
              (unsigned long long)link->peer.cluster_id, (long long)e->id,
              strerror(err));
    return LLM_FAILED;
}

static llmdd_status
shm_query(llmdd__link *link, int64_t id, int64_t deadline_ms,
          llmdd__remote_cache *out)
{
    shm_link *sl = link->tp;
    shm_wait w;
    int rc = shm_call(sl, SMSG_QUERY, id, deadline_ms, &w);

    if (rc == 1)
        return llmdd__stream_query(sl->stream, id, deadline_ms, out);
    if (rc != 0)
        return llmdd__now_ms() >= deadline_ms ? LLM_TIMEOUT : LLM_NOT_YET_LINK;
    if (w.status != LLM_SUCCESS || w.e == NULL) {
        entry_put(w.e);
        return LLM_KV_CACHE_NOT_EXIST;
    }
    out->desc = w.desc;
    if (llmdd__desc_check(&out->desc, &out->tensor_size, &out->stride) !=
        LLM_SUCCESS) {
        entry_put(w.e);
        return LLM_KV_CACHE_NOT_EXIST;
    }
    out->priv = w.e;
    return LLM_SUCCESS;
}

static void
shm_remote_free(llmdd__remote_cache *rc)
{
    entry_put(rc->priv);
    rc->priv = NULL;
}

/* ---- Link setup and teardown. ---- */

static bool
shm_reaches(const llmdd__link *link)
{
    pid_t pid = (pid_t)link->peer.pid;

    if (memcmp(link->peer.boot_id, llmdd__boot_id(), LLMDD_BOOT_ID_LEN) !=
        0) {
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
    sl->wake_fd = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
    sl->stream = llmdd__stream_new(link, SHM_FWD_CONNS, SHM_REV_CONNS);
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
        if (shm_forced(link->dd)) {
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
            shm_poll(sl, sl->listen_fd, POLLIN, deadline, true) != 1)
            break;
    }
    shm_unlisten(sl);
    if (fd < 0) {
        log_error("shm: cluster %llu never connected its socket", cid);
        llmdd__link_drop(link, "shm: socket not connected");
        return;
    }
    pthread_mutex_lock(&sl->lock);
    sl->sock = fd;
    sl->peer_pidfd = shm_pidfd((pid_t)link->peer.pid);
    pthread_mutex_unlock(&sl->lock);
    if (shm_send(sl, SMSG_READY, 0, NULL, 0, -1, deadline) != 0) {
        llmdd__link_drop(link, "shm: socket setup failed");
        return;
    }
    pthread_mutex_lock(&sl->lock);
    sl->ready = true;
    pthread_cond_broadcast(&sl->cond);
    pthread_mutex_unlock(&sl->lock);
    shm_reader(sl);
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
        if (shm_forced(link->dd)) {
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
        int k = shm_recv(sl, &m);
        if (k == 1 && m.fd >= 0)
            close(m.fd);
        if (k == 1 && m.type == SMSG_READY && m.body.len == 0)
            break;
        if (k == -1 && shm_poll(sl, sl->sock, POLLIN, link->deadline_ms,
                                true) == 1)
            continue;
        log_error("shm: cluster %llu: no READY on %s", cid, sl->path);
        return llmdd__now_ms() >= link->deadline_ms ? LLM_TIMEOUT
                                                    : LLM_LINK_FAILED;
    }
    llmdd_status st = llmdd__stream_connect(sl->stream);
    if (st != LLM_SUCCESS)
        return st;
    pthread_mutex_lock(&sl->lock);
    sl->ready = true;
    pthread_mutex_unlock(&sl->lock);
    pthread_mutex_lock(&link->dd->lock);
    link->refs++;
    pthread_mutex_unlock(&link->dd->lock);
    if (llmdd__spawn(link->dd, shm_reader_main, sl) != 0) {
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
        entry_put(e);
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
    .reaches = shm_reaches,
    .link_init = shm_link_init,
    .link_shutdown = shm_link_shutdown,
    .link_fini = shm_link_fini,
    .accept_conn = shm_accept_conn,
    .query = shm_query,
    .remote_free = shm_remote_free,
    .xfer = shm_xfer,
    .cache_removed = shm_cache_removed,
    .reopen = shm_reopen,
};
