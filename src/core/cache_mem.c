/*
 * Backing memory of allocated caches (split from cache.c): memfd-backed
 * shared mappings, one per cache or carved page by page out of the host
 * pool (llm.HostMemPoolConfig), prefaulted within the memory cgroup's limit
 * (memlimit.c); pool pages a stalled peer may still write are held back
 * until its process exits (pool_hold).
 */
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <unistd.h>

#include "core/cache_mem.h"

#define TENSOR_ALIGN 4096u

/*
 * Pages of a freed pooled cache that a peer process may still write: a
 * peer whose link ended without its word that it stopped (a stalled
 * process, see transport/shm) still has the whole pool mapped and may be
 * in the middle of a copy. The pages stay marked used until every such
 * process has exited (its pidfd reads ready), then are zeroed and freed;
 * `forever` ones only go with the pool.
 */
typedef struct pool_hold {
    size_t first, pages;
    int *pidfds;
    size_t npidfds;
    bool forever;
    struct pool_hold *next;
} pool_hold;

struct llmdd__pool {
    int fd;
    uint8_t *base;
    uint64_t size;
    uint32_t shift;
    size_t npages;
    uint8_t *used; /* one byte a page: simple, and pools are few pages */
    pool_hold *holds;
};

#define PREFAULT_CHUNK (64ull << 20)

/*
 * Caches are allocated once and then written at full speed: map their pages
 * writable now (MAP_POPULATE maps a shared mapping's pages read-only, so
 * every first write would still fault). Kernels before 5.14 lack
 * MADV_POPULATE_WRITE (EINVAL) and fault the pages in on first use.
 *
 * Under a memory cgroup limit a page that cannot be charged gets the
 * process OOM-killed inside this call, so the pages go in by chunks and
 * the limit is checked before each (memlimit.c): whatever else the process
 * allocated meanwhile counts. Returns 0, or -1 when the rest does not fit
 * or the kernel could not populate (the caller frees and reports
 * LLM_OUT_OF_MEMORY).
 */
static int
prefault(const llmdd__memcg *cg, uint8_t *base, uint64_t len, const char *what)
{
    for (uint64_t off = 0; off < len; off += PREFAULT_CHUNK) {
        uint64_t n = len - off < PREFAULT_CHUNK ? len - off : PREFAULT_CHUNK;
        if (!llmdd__memcg_fits(cg, len - off)) {
            log_error("%s of %llu bytes: the memory cgroup's limit leaves "
                      "no room for %llu more",
                      what, (unsigned long long)len,
                      (unsigned long long)(len - off));
            return -1;
        }
        if (madvise(base + off, n, MADV_POPULATE_WRITE) == 0)
            continue;
        if (errno == EINVAL)
            return 0;
        log_error("%s of %llu bytes: populating: %s", what,
                  (unsigned long long)len, strerror(errno));
        return -1;
    }
    return 0;
}

/* Refuses, before any memfd exists, a size that cannot be held. */
static bool
mem_fits(const llmdd__memcg *cg, uint64_t len, const char *what)
{
    struct rlimit rl;

    /* Growing a file past RLIMIT_FSIZE raises SIGXFSZ, fatal by default. */
    if (getrlimit(RLIMIT_FSIZE, &rl) == 0 && rl.rlim_cur != RLIM_INFINITY &&
        len > rl.rlim_cur) {
        log_error("%s of %llu bytes: over RLIMIT_FSIZE", what,
                  (unsigned long long)len);
        return false;
    }
    if (!llmdd__memcg_fits(cg, len)) {
        log_error("%s of %llu bytes: over what the memory cgroup's limit "
                  "leaves free",
                  what, (unsigned long long)len);
        return false;
    }
    return true;
}

/*
 * A memfd of `len` bytes, sealed against any change of size. Its pages are
 * handed to peers (transport/shm passes the descriptor), and a peer that
 * could shrink the file would make our next touch of the cut pages raise
 * SIGBUS; F_SEAL_SEAL keeps a peer from lifting the seals. The peer checks
 * F_SEAL_SHRINK before it maps, for its own sake. -1 on failure, logged.
 */
static int
memfd_new(const char *name, uint64_t len)
{
    int fd = memfd_create(name, MFD_CLOEXEC | MFD_ALLOW_SEALING);

    if (fd < 0) {
        log_error("memfd_create: %s", strerror(errno));
        return -1;
    }
    if (ftruncate(fd, (off_t)len) != 0) {
        log_error("%s of %llu bytes: ftruncate: %s", name,
                  (unsigned long long)len, strerror(errno));
        goto err_fd;
    }
    if (fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL) !=
        0) {
        log_error("%s: sealing: %s", name, strerror(errno));
        goto err_fd;
    }
    return fd;
err_fd:
    close(fd);
    return -1;
}

llmdd_status
llmdd__pool_create(const llmdd__pool_config *cfg, llmdd__pool **out)
{
    llmdd__pool *p = calloc(1, sizeof(*p));
    llmdd__memcg cg;

    if (p == NULL)
        return LLM_OUT_OF_MEMORY;
    p->size = cfg->memory_size;
    p->shift = cfg->page_shift;
    p->npages = (size_t)(p->size >> p->shift);
    p->used = calloc(p->npages, 1);
    if (p->used == NULL)
        goto err_free;
    llmdd__memcg_find(&cg);
    if (!mem_fits(&cg, p->size, "pool"))
        goto err_used;
    p->fd = memfd_new("llmdd-pool", p->size);
    if (p->fd < 0)
        goto err_used;
    p->base = mmap(NULL, p->size, PROT_READ | PROT_WRITE, MAP_SHARED, p->fd, 0);
    if (p->base == MAP_FAILED) {
        log_error("pool of %llu bytes: mmap: %s", (unsigned long long)p->size,
                  strerror(errno));
        goto err_fd;
    }
    if (prefault(&cg, p->base, p->size, "pool") != 0)
        goto err_map;
    *out = p;
    return LLM_SUCCESS;

err_map:
    munmap(p->base, p->size);
err_fd:
    close(p->fd);
err_used:
    free(p->used);
err_free:
    free(p);
    return LLM_OUT_OF_MEMORY;
}

void
llmdd__pidfds_close(int *fds, size_t n)
{
    for (size_t i = 0; i < n; i++)
        if (fds[i] >= 0)
            close(fds[i]);
    free(fds);
}

void
llmdd__pool_destroy(llmdd__pool *p)
{
    if (p == NULL)
        return;
    /* A stalled peer keeps its own mapping: what it writes lands in pages
     * that belong to no cache any more. */
    while (p->holds != NULL) {
        pool_hold *h = p->holds;
        p->holds = h->next;
        llmdd__pidfds_close(h->pidfds, h->npidfds);
        free(h);
    }
    munmap(p->base, p->size);
    close(p->fd);
    free(p->used);
    free(p);
}

/* First fit over the page map. Returns the first page or SIZE_MAX. */
static size_t
pool_take(llmdd__pool *p, size_t pages)
{
    size_t run = 0;

    for (size_t i = 0; i < p->npages; i++) {
        run = p->used[i] ? 0 : run + 1;
        if (run == pages) {
            size_t first = i + 1 - pages;
            memset(p->used + first, 1, pages);
            return first;
        }
    }
    return SIZE_MAX;
}

static void
pool_give(llmdd__pool *p, size_t first, size_t pages)
{
    /* Freed pages must read as zero for the next cache. */
    memset(p->base + ((uint64_t)first << p->shift), 0,
           (uint64_t)pages << p->shift);
    memset(p->used + first, 0, pages);
}

static bool
pidfd_exited(int fd)
{
    struct pollfd pfd = {.fd = fd, .events = POLLIN};

    return poll(&pfd, 1, 0) == 1 && (pfd.revents & (POLLIN | POLLHUP));
}

/* dd->lock held. Frees the held pages whose processes have all exited. */
static void
pool_reap(llmdd__pool *p)
{
    for (pool_hold **hp = &p->holds; *hp != NULL;) {
        pool_hold *h = *hp;
        bool gone = !h->forever;
        for (size_t i = 0; gone && i < h->npidfds; i++)
            gone = pidfd_exited(h->pidfds[i]);
        if (!gone) {
            hp = &h->next;
            continue;
        }
        *hp = h->next;
        log_info("pool: %zu pages a stalled peer could write are free again",
                 h->pages);
        pool_give(p, h->first, h->pages);
        llmdd__pidfds_close(h->pidfds, h->npidfds);
        free(h);
    }
}

/*
 * dd->lock held. Holds back [first, first + pages) for the processes behind
 * pidfds (taken over); on allocation failure the pages are simply never
 * freed, which is safe.
 */
static void
pool_hold_back(llmdd__pool *p, size_t first, size_t pages, int *pidfds,
               size_t n, bool forever)
{
    pool_hold *h = malloc(sizeof(*h));

    log_warn("pool: %zu pages stay out of use until the peer that may still "
             "write them has exited%s",
             pages,
             forever ? " (it cannot be watched: until the pool goes)" : "");
    if (h == NULL) {
        llmdd__pidfds_close(pidfds, n);
        return;
    }
    *h = (pool_hold){.first = first,
                     .pages = pages,
                     .pidfds = pidfds,
                     .npidfds = n,
                     .forever = forever,
                     .next = p->holds};
    p->holds = h;
}

static uint64_t
round_up(uint64_t v, uint64_t align)
{
    return (v + align - 1) & ~(align - 1);
}

llmdd_status
llmdd__mem_alloc(llmdd *dd, uint64_t tensor_size, uint32_t num_tensors,
          llmdd__mem *m)
{
    llmdd__pool *p = dd->host_pool;
    uint64_t align = p != NULL ? 1ull << p->shift : TENSOR_ALIGN;
    uint64_t pitch = round_up(tensor_size, align);
    uint64_t len;

    if (pitch < tensor_size ||
        __builtin_mul_overflow(pitch, (uint64_t)num_tensors, &len))
        return LLM_OUT_OF_MEMORY;
    memset(m, 0, sizeof(*m));
    m->pitch = pitch;
    m->len = len;
    if (p != NULL) {
        /* Called with dd->lock held: the page map is guarded by it. */
        if (len > p->size)
            return LLM_OUT_OF_MEMORY;
        pool_reap(p);
        size_t first = pool_take(p, (size_t)(len >> p->shift));
        if (first == SIZE_MAX) {
            if (p->holds != NULL)
                log_warn("pool: no room; some pages are held back from a "
                         "stalled peer");
            return LLM_OUT_OF_MEMORY;
        }
        m->pooled = true;
        m->fd = p->fd;
        m->fd_off = (uint64_t)first << p->shift;
        m->base = p->base + m->fd_off;
        return LLM_SUCCESS;
    }
    llmdd__memcg cg;
    llmdd__memcg_find(&cg);
    if (!mem_fits(&cg, len, "cache"))
        return LLM_OUT_OF_MEMORY;
    m->fd = memfd_new("llmdd-cache", len);
    if (m->fd < 0)
        return LLM_OUT_OF_MEMORY;
    m->base = mmap(NULL, len, PROT_READ | PROT_WRITE, MAP_SHARED, m->fd, 0);
    if (m->base == MAP_FAILED) {
        log_error("cache of %llu bytes: mmap: %s", (unsigned long long)len,
                  strerror(errno));
        close(m->fd);
        return LLM_OUT_OF_MEMORY;
    }
    if (prefault(&cg, m->base, len, "cache") != 0) {
        munmap(m->base, len);
        close(m->fd);
        return LLM_OUT_OF_MEMORY;
    }
    return LLM_SUCCESS;
}

/* dd->lock held. */
void
llmdd__mem_free(llmdd *dd, llmdd__cache *c)
{
    llmdd__mem *m = &c->mem;

    if (m->pooled) {
        llmdd__pool *p = dd->host_pool;
        size_t first = (size_t)(m->fd_off >> p->shift);
        size_t pages = (size_t)(m->len >> p->shift);
        if (c->nstale == 0 && !c->stale_forever) {
            pool_give(p, first, pages);
            return;
        }
        pool_hold_back(p, first, pages, c->stale_pidfds, c->nstale,
                       c->stale_forever);
        c->stale_pidfds = NULL;
        c->nstale = 0;
        return;
    }
    /* A peer's mapping keeps these pages alive apart from any new memfd. */
    munmap(m->base, m->len);
    close(m->fd);
}
