/*
 * The shm transport's data path: mapping what a QUERY_REPLY describes, and
 * the transfers (memcpy through a mapped memfd, cross-memory attach, or the
 * socket data plane).
 */
#include "transport/shm/shm_int.h"

static atomic_uint_fast64_t stat_memfd, stat_cma, stat_cma_split,
    stat_copy_split, stat_assist_claims, stat_stream, stat_refused;

void
llmdd__shm_stats_get(llmdd__shm_stats *out)
{
    out->memfd_xfers = atomic_load(&stat_memfd);
    out->cma_xfers = atomic_load(&stat_cma);
    out->cma_split = atomic_load(&stat_cma_split);
    out->copy_split = atomic_load(&stat_copy_split);
    out->assist_claims = atomic_load(&stat_assist_claims);
    out->stream_xfers = atomic_load(&stat_stream);
    out->cma_refused = atomic_load(&stat_refused);
}

/* ---- The peer's side: mapping what a QUERY_REPLY describes. ---- */

/* Maps the peer's memfd for an entry; takes ownership of fd. */
int
llmdd__shm_map(shm_link *sl, shm_entry *e, int fd, bool pooled, uint64_t fd_off,
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
/* ---- Transfers. ---- */

/*
 * Whether the owner has begun to end the link: our side is down, or the
 * owner half-closed or closed the socket. Its teardown starts with that
 * half-close, and only after it may it free memory a copy of ours targets,
 * so a copy that finds this false once it is done ran entirely on memory
 * still leased to us.
 *
 * The owner frees nothing until SHM_BYE_MS after its half-close, so a copy
 * that ended less than SHM_OPEN_MS (well under SHM_BYE_MS) after the socket
 * was last seen open also ran on leased memory: the socket is looked at
 * (a poll, which costs more than a 4 KiB copy) at most once per
 * SHM_OPEN_MS, not after every copy. The time is taken before the poll, so
 * it is never later than the moment the socket was seen open.
 */
bool
llmdd__shm_owner_left(shm_link *sl)
{
    int64_t now = llmdd__now_ms();

    pthread_mutex_lock(&sl->lock);
    bool down = sl->down;
    bool recent = now - sl->open_at < SHM_OPEN_MS;
    int fd = sl->sock;
    pthread_mutex_unlock(&sl->lock);
    if (down)
        return true;
    if (recent)
        return false;
    struct pollfd p = {.fd = fd, .events = POLLRDHUP};
    bool left = poll(&p, 1, 0) == 1 &&
                (p.revents & (POLLRDHUP | POLLHUP | POLLERR | POLLNVAL));
    if (!left) {
        pthread_mutex_lock(&sl->lock);
        if (now > sl->open_at)
            sl->open_at = now;
        pthread_mutex_unlock(&sl->lock);
    }
    return left;
}

/*
 * A copy through the mapping goes in claims of about `piece` bytes, taken
 * in order from one cursor: by the thread that runs the transfer and, from
 * SHM_SPLIT_BYTES on, by the instance's assist thread, which moves claims
 * of whichever shared copy of the instance is oldest with some left
 * (llmdd__share). A core is idle only when no copy has a claim left: with
 * fixed halves (one transfer at a time on the assist thread) the legs of a
 * 4-source slice pull of about 4 ms ended 2.6-2.8 ms apart, the one with
 * the assist thread first.
 */
typedef struct {
    uint32_t t;   /* tensor */
    size_t r;     /* run */
    uint64_t k;   /* element */
    uint64_t off; /* bytes into the element (a long one, cut) */
} copy_pos;

typedef struct {
    llmdd__share share; /* first: the assist thread's handle */
    const shm_entry *e;
    const llmdd__xfer *x;
    llmdd__cancel *cancel;
    uint64_t piece;
    bool shared; /* the assist thread may claim: take the lock */
    pthread_mutex_t lock;
    copy_pos next; /* the first byte nobody claimed */
    bool stop;     /* a cancel was seen: nothing more is claimed */
    bool failed;   /* the assist thread saw the cancel */
} copy_share;

/* One segment of the copy: elements [k, k + n) of run `run` of tensor t,
 * bytes [off, off + m) of each (m < run.len only for a cut element). */
typedef struct {
    uint32_t t;
    llmdd__run2 run;
    uint64_t k, n, off, m;
} copy_seg;

/*
 * The segment at *p, and *p moved past it; false at the end. Elements
 * longer than `cut` go in cuts of at most max bytes; shorter ones whole,
 * as many as fit in max (one at least).
 */
static bool
copy_step(const llmdd__xfer *x, copy_pos *p, uint64_t max, uint64_t cut,
          copy_seg *g)
{
    if (p->t >= x->count || llmdd__xfer_nruns(x) == 0)
        return false;
    llmdd__run2 r = llmdd__xfer_run(x, p->r);
    *g = (copy_seg){
        .t = p->t, .run = r, .k = p->k, .n = 1, .off = p->off, .m = r.len};
    if (r.len > cut) {
        g->m = r.len - p->off < max ? r.len - p->off : max;
        p->off += g->m;
        if (p->off < r.len)
            return true;
        p->off = 0;
        p->k++;
    } else {
        uint64_t n = r.len > 0 ? max / r.len : r.count;
        n = n > 0 ? n : 1;
        g->n = n < r.count - p->k ? n : r.count - p->k;
        p->k += g->n;
    }
    if (p->k >= r.count) {
        p->k = 0;
        if (++p->r == llmdd__xfer_nruns(x)) {
            p->r = 0;
            p->t++;
        }
    }
    return true;
}

static void
copy_seg_run(llmdd__copy_batch *b, const shm_entry *e, const llmdd__xfer *x,
             const copy_seg *g)
{
    uint8_t *rbase = e->base + (uint64_t)(x->remote_first + g->t) * e->pitch;
    uint8_t *src = x->write ? x->local[g->t] : rbase;
    uint8_t *dst = x->write ? rbase : x->local[g->t];
    const llmdd__run2 *r = &g->run;
    uint64_t so = r->src_off + g->k * r->src_stride + g->off;
    uint64_t dof = r->dst_off + g->k * r->dst_stride + g->off;

    if (g->n == 0 || g->m == 0)
        return;
    if (g->m < r->len)
        llmdd__copy(b, dst + dof, src + so, g->m);
    else
        llmdd__copy_2d(b, dst + dof, r->dst_stride, src + so, r->src_stride,
                       r->len, g->n);
}

/*
 * One claim from *p: segments up to s->piece bytes (a whole element past
 * it), copied into b, or with b NULL only counted off. The same walk from
 * the same position gives the same segments, so a claim is taken under the
 * lock with b NULL and copied outside it.
 */
static void
copy_claim(const copy_share *s, copy_pos *p, llmdd__copy_batch *b)
{
    copy_seg g;

    for (uint64_t got = 0;
         got < s->piece && copy_step(s->x, p, s->piece - got, s->piece, &g);
         got += g.n * g.m)
        if (b != NULL)
            copy_seg_run(b, s->e, s->x, &g);
}

/* Takes the next claim into *from: false when none is left. */
static bool
copy_take(copy_share *s, copy_pos *from)
{
    if (s->shared)
        pthread_mutex_lock(&s->lock);
    bool some =
        !s->stop && s->next.t < s->x->count && llmdd__xfer_nruns(s->x) > 0;
    *from = s->next;
    if (some)
        copy_claim(s, &s->next, NULL);
    if (s->shared)
        pthread_mutex_unlock(&s->lock);
    return some;
}

/* A cancel was seen: nothing more is claimed, by anyone. */
static void
copy_stop(copy_share *s)
{
    if (s->shared)
        pthread_mutex_lock(&s->lock);
    s->stop = true;
    if (s->shared)
        pthread_mutex_unlock(&s->lock);
}

/*
 * One claim by the assist thread, under the request's cancellation, its
 * stores fenced before it returns (the owner reports the transfer once
 * the assist thread has left it).
 */
static bool
copy_piece(llmdd__share *sh)
{
    copy_share *s = (copy_share *)sh;
    llmdd__copy_batch b;
    copy_pos from;

    if (!copy_take(s, &from))
        return false;
    atomic_fetch_add(&stat_assist_claims, 1);
    (void)llmdd__cancel_enter(s->cancel, false);
    llmdd__copy_begin(&b, llmdd__xfer_bytes(s->x), llmdd__xfer_dst_bytes(s->x));
    copy_claim(s, &from, &b);
    llmdd__copy_end(&b);
    bool cancelled = llmdd__cancelled();
    llmdd__cancel_leave();
    if (cancelled) {
        s->failed = true; /* read by the owner after llmdd__share_end */
        copy_stop(s);
        return false;
    }
    return true;
}

/*
 * The whole copy, a cancel seen between claims (false then, with part of
 * the bytes moved). Every claim has ended, its stores fenced, when this
 * returns.
 */
static bool
shm_copy(llmdd *dd, const shm_entry *e, const llmdd__xfer *x)
{
    uint64_t total = llmdd__xfer_bytes(x);
    copy_share s = {
        .e = e, .x = x, .cancel = x->cancel, .piece = SHM_COPY_PIECE};
    llmdd__copy_batch b;
    copy_pos from;
    bool ok = true;

    if (total >= SHM_SPLIT_BYTES) {
        /* Claims of 1/32 of the copy, SHM_CLAIM_MIN to SHM_COPY_PIECE. */
        s.piece = total / 32 > SHM_CLAIM_MIN ? total / 32 : SHM_CLAIM_MIN;
        s.piece = s.piece < SHM_COPY_PIECE ? s.piece : SHM_COPY_PIECE;
        pthread_mutex_init(&s.lock, NULL);
        s.shared = true; /* before the assist thread can see it */
        if (llmdd__share_begin(dd, &s.share, copy_piece)) {
            atomic_fetch_add(&stat_copy_split, 1);
        } else {
            s.shared = false;
            pthread_mutex_destroy(&s.lock);
        }
    }
    llmdd__copy_begin(&b, total, llmdd__xfer_dst_bytes(x));
    while (ok) {
        /* Alone, a claim is copied as it is walked. */
        if (!s.shared && s.next.t < x->count && llmdd__xfer_nruns(x) > 0)
            copy_claim(&s, &s.next, &b);
        else if (s.shared && copy_take(&s, &from))
            copy_claim(&s, &from, &b);
        else
            break;
        if (llmdd__cancelled()) {
            ok = false;
            copy_stop(&s);
        }
    }
    llmdd__copy_end(&b);
    if (s.shared) {
        llmdd__share_end(dd, &s.share);
        pthread_mutex_destroy(&s.lock);
    }
    return ok && !s.failed;
}

/* A position in a transfer's bytes: run r of tensor t, `done` bytes in. */
typedef struct {
    uint32_t t;
    size_t r;
    uint64_t done;
} cma_pos;

/* Moves pos forward by n bytes (n no more than what is left). */
static void
cma_advance(const llmdd__xfer *x, cma_pos *pos, uint64_t n)
{
    while (pos->t < x->count) {
        uint64_t left = x->runs[pos->r].len - pos->done;
        if (n < left) {
            pos->done += n;
            return;
        }
        n -= left;
        pos->done = 0;
        if (++pos->r == x->nruns) {
            pos->r = 0;
            pos->t++;
        }
    }
}

/*
 * Cross-memory attach of `len` bytes of the transfer from `pos`, in batches
 * of SHM_IOV_BATCH iovec pairs. 0 done; -1 with *err the errno; -2 the link
 * went down or the deadline passed; -3 the request was cancelled (seen
 * between batches).
 */
static int
shm_cma(shm_link *sl, const shm_entry *e, const llmdd__xfer *x, cma_pos pos,
        uint64_t len, int *err)
{
    struct iovec liov[SHM_IOV_BATCH], riov[SHM_IOV_BATCH];
    pid_t pid = (pid_t)sl->link->peer.pid;

    while (len > 0) {
        size_t n = 0;
        uint64_t total = 0, cap = len < SHM_CMA_BATCH_BYTES
                                      ? len
                                      : SHM_CMA_BATCH_BYTES;
        cma_pos b = pos;
        while (n < SHM_IOV_BATCH && b.t < x->count && total < cap) {
            const llmdd__run *run = &x->runs[b.r];
            uint64_t part = run->len - b.done;
            if (part > cap - total)
                part = cap - total;
            liov[n].iov_base =
                x->local[b.t] + llmdd__run_local(x, run) + b.done;
            riov[n].iov_base =
                (void *)(uintptr_t)(e->addrs[x->remote_first + b.t] +
                                    llmdd__run_remote(x, run) + b.done);
            liov[n].iov_len = riov[n].iov_len = (size_t)part;
            total += part;
            n++;
            cma_advance(x, &b, part);
        }
        ssize_t k = x->write ? process_vm_writev(pid, liov, n, riov, n, 0)
                             : process_vm_readv(pid, liov, n, riov, n, 0);
        if (k < 0 && errno == EINTR)
            continue;
        if (k <= 0) {
            *err = k < 0 ? errno : EFAULT;
            return -1;
        }
        /* Advance by what moved; a short count resumes mid-run. */
        cma_advance(x, &pos, (uint64_t)k);
        len -= (uint64_t)k;
        /* A peer that was stopped between batches must not write on into
         * memory the owner may have handed back meanwhile. */
        if (len > 0 &&
            (llmdd__shm_owner_left(sl) || llmdd__now_ms() >= x->deadline_ms))
            return -2;
        if (len > 0 && llmdd__cancelled())
            return -3;
    }
    return 0;
}

typedef struct {
    shm_link *sl;
    const shm_entry *e;
    const llmdd__xfer *x;
    cma_pos pos;
    uint64_t len;
    llmdd__cancel *cancel; /* the request's, which this thread works for */
    int rc, err;
} cma_half;

static void *
cma_half_main(void *p)
{
    cma_half *h = p;

    (void)llmdd__cancel_enter(h->cancel, false);
    h->rc = shm_cma(h->sl, h->e, h->x, h->pos, h->len, &h->err);
    llmdd__cancel_leave();
    return NULL;
}

/*
 * The whole transfer. From SHM_SPLIT_BYTES on, the assist thread (when
 * free, as for shm_copy) moves the second half: one thread's cross-memory
 * copy (page pinning plus copy in the kernel) reaches about half of
 * memcpy, two about 0.9x (BENCHMARKS.md). The first failure decides; both
 * halves have ended when this returns, so nothing moves after it.
 */
static int
shm_cma_xfer(shm_link *sl, const shm_entry *e, const llmdd__xfer *x,
             int *err)
{
    uint64_t total = llmdd__xfer_bytes(x);
    cma_pos start = {0, 0, 0};
    cma_half h = {.sl = sl, .e = e, .x = x, .pos = start, .cancel = x->cancel};

    if (total < SHM_SPLIT_BYTES)
        return shm_cma(sl, e, x, start, total, err);
    h.len = total / 2;
    cma_advance(x, &h.pos, total - h.len);
    if (!llmdd__assist_post(sl->link->dd, cma_half_main, &h))
        return shm_cma(sl, e, x, start, total, err);
    int rc = shm_cma(sl, e, x, start, total - h.len, err);
    llmdd__assist_wait(sl->link->dd);
    atomic_fetch_add(&stat_cma_split, 1);
    if (rc == 0 && h.rc != 0) {
        rc = h.rc;
        *err = h.err;
    }
    return rc;
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

llmdd_status
llmdd__shm_xfer(llmdd__link *link, const llmdd__xfer *x)
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
    if (!llmdd__xfer_fits(x, e->tensor_size))
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
        if (!shm_copy(link->dd, e, x))
            rc = -3;
        atomic_fetch_add(&stat_memfd, 1);
        /* Stalled mid-copy (SIGSTOP, a long page fault) past the owner's
         * patience: the owner dropped the link, and the pages may belong
         * to another cache by now (a pool hands them out again only once
         * this process exits, an older owner sooner). Do not call the
         * copy a success. */
        left = llmdd__shm_owner_left(sl);
    } else {
        /* Cross-memory attach takes plain runs. */
        llmdd__xfer px;
        llmdd__run *tmp;
        if (llmdd__xfer_plain(x, &px, &tmp) != 0) {
            rc = -4;
        } else {
            rc = shm_cma_xfer(sl, e, &px, &err);
            free(tmp);
        }
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
    if (rc == -3) /* cancelled: the request's own end, the link stays */
        return LLM_FAILED;
    if (rc == -4)
        return LLM_OUT_OF_MEMORY;
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
