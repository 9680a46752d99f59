/*
 * The cache registry: allocate, register, look up, release.
 *
 * Allocated caches live in memfd-backed shared mappings so that a same-host
 * peer can map the very same pages. Without a pool each cache has its own
 * memfd; with llm.HostMemPoolConfig all caches are carved, page by page, out
 * of one memfd that is mapped once. Every memfd is sealed against size
 * changes before a peer can see it (memfd_new). Pool pages a stalled peer
 * may still write are held back until its process exits (pool_hold).
 * Allocations check the memory cgroup's limits first (memlimit.c).
 */
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <unistd.h>

#include "core/internal.h"
#include "core/slices.h"

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

static llmdd_status
pool_create(const llmdd__pool_config *cfg, llmdd__pool **out)
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

static void
pidfds_close(int *fds, size_t n)
{
    for (size_t i = 0; i < n; i++)
        if (fds[i] >= 0)
            close(fds[i]);
    free(fds);
}

static void
pool_destroy(llmdd__pool *p)
{
    if (p == NULL)
        return;
    /* A stalled peer keeps its own mapping: what it writes lands in pages
     * that belong to no cache any more. */
    while (p->holds != NULL) {
        pool_hold *h = p->holds;
        p->holds = h->next;
        pidfds_close(h->pidfds, h->npidfds);
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
        pidfds_close(h->pidfds, h->npidfds);
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
        pidfds_close(pidfds, n);
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

static llmdd_status
mem_alloc(llmdd *dd, uint64_t tensor_size, uint32_t num_tensors,
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
static void
mem_free(llmdd *dd, llmdd__cache *c)
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

static void
cache_free(llmdd *dd, llmdd__cache *c)
{
    if (c->allocated)
        mem_free(dd, c);
    pidfds_close(c->stale_pidfds, c->nstale);
    free(c->addrs);
    free(c);
}

static size_t
cache_index(const llmdd *dd, int64_t id, bool *found)
{
    size_t lo = 0, hi = dd->ncaches;

    while (lo < hi) {
        size_t mid = lo + (hi - lo) / 2;
        if (dd->caches[mid]->id < id)
            lo = mid + 1;
        else
            hi = mid;
    }
    *found = lo < dd->ncaches && dd->caches[lo]->id == id;
    return lo;
}

/* dd->lock held. Ids only grow, so appending keeps the array sorted. */
static llmdd_status
cache_insert(llmdd *dd, llmdd__cache *c)
{
    if (dd->ncaches == dd->caches_cap) {
        size_t cap = dd->caches_cap ? dd->caches_cap * 2 : 16;
        llmdd__cache **n = realloc(dd->caches, cap * sizeof(*n));
        if (n == NULL)
            return LLM_OUT_OF_MEMORY;
        dd->caches = n;
        dd->caches_cap = cap;
    }
    c->id = dd->next_cache_id++;
    dd->caches[dd->ncaches++] = c;
    return LLM_SUCCESS;
}

/*
 * dd->lock held; drops it meanwhile. The fallback of notify_links when it
 * cannot allocate its list: tells one link at a time, marks each link told
 * with this round's serial, and rescans the table after every call, since
 * the table may change while the lock is dropped. Such rounds take turns so
 * that one round's marks are not overwritten by another's.
 */
static void
notify_links_slowly(llmdd *dd, llmdd__cache *c)
{
    while (dd->notify_busy)
        pthread_cond_wait(&dd->cond, &dd->lock);
    dd->notify_busy = true;
    uint64_t serial = ++dd->notify_serial;
    for (;;) {
        llmdd__link *l = dd->links;
        while (l != NULL &&
               (l->ops->cache_removed == NULL || l->notified == serial))
            l = l->next;
        if (l == NULL)
            break;
        l->notified = serial;
        l->refs++;
        pthread_mutex_unlock(&dd->lock);
        l->ops->cache_removed(l, c);
        llmdd__link_put(l);
        pthread_mutex_lock(&dd->lock);
    }
    dd->notify_busy = false;
    pthread_cond_broadcast(&dd->cond);
}

/*
 * dd->lock held; drops it meanwhile. Tells every link's transport that the
 * cache is gone, so that a peer which mapped its memory stops using it
 * before the memory is released or reused. Every link is told, however
 * many: one left out would keep its lease (the caller would wait until that
 * link ends) or keep reaching pages a new cache gets. A link made after the
 * cache left the registry cannot reach it and needs no word.
 */
static void
notify_links(llmdd *dd, llmdd__cache *c)
{
    size_t n = 0;

    for (llmdd__link *l = dd->links; l != NULL; l = l->next)
        n += l->ops->cache_removed != NULL;
    if (n == 0)
        return;
    llmdd__link **links = malloc(n * sizeof(*links));
    if (links == NULL) {
        notify_links_slowly(dd, c);
        return;
    }
    n = 0;
    for (llmdd__link *l = dd->links; l != NULL; l = l->next) {
        if (l->ops->cache_removed != NULL) {
            l->refs++;
            links[n++] = l;
        }
    }
    pthread_mutex_unlock(&dd->lock);
    for (size_t i = 0; i < n; i++) {
        links[i]->ops->cache_removed(links[i], c);
        llmdd__link_put(links[i]);
    }
    free(links);
    pthread_mutex_lock(&dd->lock);
}

/* dd->lock held. Unlinks cache `id`, waits for its users, frees it. */
static bool
cache_remove(llmdd *dd, int64_t id, bool want_allocated)
{
    bool found;
    size_t i = cache_index(dd, id, &found);

    if (!found || dd->caches[i]->allocated != want_allocated)
        return false;
    llmdd__cache *c = dd->caches[i];
    memmove(dd->caches + i, dd->caches + i + 1,
            (dd->ncaches - i - 1) * sizeof(*dd->caches));
    dd->ncaches--;
    c->dead = true;
    llmdd__keys_drop_cache(dd, id);
    /* Posted requests on it end now (a layer-wise one may wait forever for
     * its marks); the references they hold are waited out below. */
    pthread_mutex_unlock(&dd->lock);
    llmdd__requests_cache_removed(dd, c);
    pthread_mutex_lock(&dd->lock);
    notify_links(dd, c);
    /* Transfers hold references only for bounded I/O; wait them out so the
     * memory is never touched after we return. */
    while (c->refs > 0)
        pthread_cond_wait(&dd->cond, &dd->lock);
    cache_free(dd, c);
    return true;
}

void
llmdd__caches_fini(llmdd *dd)
{
    while (dd->ncaches > 0)
        cache_remove(dd, dd->caches[dd->ncaches - 1]->id,
                     dd->caches[dd->ncaches - 1]->allocated);
    llmdd__keys_fini(dd);
    free(dd->caches);
    dd->caches = NULL;
    dd->caches_cap = 0;
    pool_destroy(dd->host_pool);
    dd->host_pool = NULL;
}

static llmdd__cache *
cache_new(const llmdd_cache_desc *desc, uint64_t tensor_size, uint64_t stride)
{
    llmdd__cache *c = calloc(1, sizeof(*c));

    if (c == NULL)
        return NULL;
    c->addrs = calloc(desc->num_tensors, sizeof(*c->addrs));
    if (c->addrs == NULL) {
        free(c);
        return NULL;
    }
    c->desc = *desc;
    c->tensor_size = tensor_size;
    c->stride = stride;
    return c;
}

/*
 * Code written for LLM-DataDist asks for device placement everywhere. This
 * build has no device memory: such a cache is host memory, said once per
 * instance (its first device cache), not on every call. dd->lock held.
 */
static void
device_as_host(llmdd *dd)
{
    if (dd->device_as_host_said)
        return;
    dd->device_as_host_said = true;
    log_warn("cluster %llu: device placement: this build has no device "
             "support; device caches are host memory",
             (unsigned long long)dd->cluster_id);
}

static llmdd_status
ready(llmdd *dd)
{
    if (dd == NULL)
        return LLM_PARAM_INVALID;
    return dd->initialized ? LLM_SUCCESS : LLM_FAILED;
}

/* A layout, when given, must fit the desc (core/slices.h); no layout:
 * LLM_SUCCESS. */
static llmdd_status
layout_fits(const llmdd_kv_layout *layout, uint64_t stride)
{
    if (layout == NULL)
        return LLM_SUCCESS;
    return llmdd__layout_check(layout, stride, NULL);
}

static void
layout_set(llmdd__cache *c, const llmdd_kv_layout *layout)
{
    if (layout != NULL) {
        c->has_layout = true;
        c->layout = *layout;
    }
}

static llmdd_status
allocate(llmdd *dd, const llmdd_cache_desc *desc,
         const llmdd_kv_layout *layout, llmdd_cache *cache_out)
{
    uint64_t tensor_size, stride;
    llmdd_status st;
    llmdd__cache *c;

    if (dd == NULL)
        return LLM_PARAM_INVALID;
    pthread_mutex_lock(&dd->lock);
    if ((st = ready(dd)) != LLM_SUCCESS)
        goto out;
    if (cache_out == NULL ||
        (st = llmdd__desc_check(desc, &tensor_size, &stride)) != LLM_SUCCESS ||
        layout_fits(layout, stride) != LLM_SUCCESS) {
        st = LLM_PARAM_INVALID;
        goto out;
    }
    if (desc->placement == LLMDD_PLACEMENT_DEVICE)
        device_as_host(dd);
    c = cache_new(desc, tensor_size, stride);
    if (c == NULL) {
        st = LLM_OUT_OF_MEMORY;
        goto out;
    }
    st = mem_alloc(dd, tensor_size, desc->num_tensors, &c->mem);
    if (st != LLM_SUCCESS) {
        log_error("allocate_cache: %u tensors of %llu bytes: out of memory",
                  desc->num_tensors, (unsigned long long)tensor_size);
        free(c->addrs);
        free(c);
        goto out;
    }
    c->allocated = true;
    layout_set(c, layout);
    for (uint32_t i = 0; i < desc->num_tensors; i++)
        c->addrs[i] = (uint64_t)(uintptr_t)(c->mem.base + i * c->mem.pitch);
    if ((st = cache_insert(dd, c)) != LLM_SUCCESS) {
        cache_free(dd, c);
        goto out;
    }
    cache_out->cache_id = c->id;
    cache_out->desc = *desc;
    cache_out->tensor_addrs = c->addrs;
out:
    pthread_mutex_unlock(&dd->lock);
    return st;
}

llmdd_status
llmdd_deallocate_cache(llmdd *dd, int64_t cache_id)
{
    llmdd_status st;

    if (dd == NULL)
        return LLM_PARAM_INVALID;
    pthread_mutex_lock(&dd->lock);
    if ((st = ready(dd)) == LLM_SUCCESS && !cache_remove(dd, cache_id, true))
        st = LLM_KV_CACHE_NOT_EXIST;
    pthread_mutex_unlock(&dd->lock);
    return st;
}

static llmdd_status
register_cache(llmdd *dd, const llmdd_cache_desc *desc,
               const llmdd_kv_layout *layout, const uint64_t *addrs,
               size_t num_addrs, int64_t *cache_id_out)
{
    uint64_t tensor_size, stride;
    llmdd_status st;
    llmdd__cache *c;

    if (dd == NULL)
        return LLM_PARAM_INVALID;
    pthread_mutex_lock(&dd->lock);
    if ((st = ready(dd)) != LLM_SUCCESS)
        goto out;
    st = LLM_PARAM_INVALID;
    if (cache_id_out == NULL || addrs == NULL || num_addrs == 0 ||
        llmdd__desc_check(desc, &tensor_size, &stride) != LLM_SUCCESS ||
        num_addrs != desc->num_tensors ||
        layout_fits(layout, stride) != LLM_SUCCESS)
        goto out;
    for (size_t i = 0; i < num_addrs; i++) {
        uint64_t end;
        if (addrs[i] == 0 ||
            __builtin_add_overflow(addrs[i], tensor_size, &end))
            goto out;
    }
    if (desc->placement == LLMDD_PLACEMENT_DEVICE)
        device_as_host(dd);
    c = cache_new(desc, tensor_size, stride);
    if (c == NULL) {
        st = LLM_OUT_OF_MEMORY;
        goto out;
    }
    memcpy(c->addrs, addrs, num_addrs * sizeof(*addrs));
    layout_set(c, layout);
    if ((st = cache_insert(dd, c)) != LLM_SUCCESS) {
        cache_free(dd, c);
        goto out;
    }
    *cache_id_out = c->id;
out:
    pthread_mutex_unlock(&dd->lock);
    return st;
}

llmdd_status
llmdd_allocate_cache(llmdd *dd, const llmdd_cache_desc *desc,
                     llmdd_cache *cache_out)
{
    return allocate(dd, desc, NULL, cache_out);
}

llmdd_status
llmdd_allocate_cache_layout(llmdd *dd, const llmdd_cache_desc *desc,
                            const llmdd_kv_layout *layout,
                            llmdd_cache *cache_out)
{
    if (layout == NULL)
        return LLM_PARAM_INVALID;
    return allocate(dd, desc, layout, cache_out);
}

llmdd_status
llmdd_register_kv_cache(llmdd *dd, const llmdd_cache_desc *desc,
                        const uint64_t *addrs, size_t num_addrs,
                        int64_t *cache_id_out)
{
    return register_cache(dd, desc, NULL, addrs, num_addrs, cache_id_out);
}

llmdd_status
llmdd_register_kv_cache_layout(llmdd *dd, const llmdd_cache_desc *desc,
                               const llmdd_kv_layout *layout,
                               const uint64_t *addrs, size_t num_addrs,
                               int64_t *id_out)
{
    if (layout == NULL)
        return LLM_PARAM_INVALID;
    return register_cache(dd, desc, layout, addrs, num_addrs, id_out);
}

llmdd_status
llmdd_unregister_kv_cache(llmdd *dd, int64_t cache_id)
{
    llmdd_status st;

    if (dd == NULL)
        return LLM_PARAM_INVALID;
    pthread_mutex_lock(&dd->lock);
    if ((st = ready(dd)) == LLM_SUCCESS)
        cache_remove(dd, cache_id, false);
    pthread_mutex_unlock(&dd->lock);
    return st;
}

llmdd__cache *
llmdd__cache_get(llmdd *dd, int64_t id)
{
    llmdd__cache *c = NULL;
    bool found;

    pthread_mutex_lock(&dd->lock);
    if (dd->initialized) {
        size_t i = cache_index(dd, id, &found);
        if (found) {
            c = dd->caches[i];
            c->refs++;
        }
    }
    pthread_mutex_unlock(&dd->lock);
    return c;
}

bool
llmdd__cache_removed(llmdd *dd, const llmdd__cache *c)
{
    pthread_mutex_lock(&dd->lock);
    bool dead = c->dead;
    pthread_mutex_unlock(&dd->lock);
    return dead;
}

void
llmdd__cache_put(llmdd *dd, llmdd__cache *c)
{
    if (c == NULL)
        return;
    pthread_mutex_lock(&dd->lock);
    if (--c->refs == 0 && c->dead)
        pthread_cond_broadcast(&dd->cond);
    pthread_mutex_unlock(&dd->lock);
}

void
llmdd__cache_put_stale(llmdd *dd, llmdd__cache *c, int pidfd)
{
    if (c == NULL)
        return;
    pthread_mutex_lock(&dd->lock);
    if (c->allocated && c->mem.pooled && !c->stale_forever) {
        int fd = pidfd >= 0 ? fcntl(pidfd, F_DUPFD_CLOEXEC, 0) : -1;
        int *n = fd >= 0
                     ? realloc(c->stale_pidfds, (c->nstale + 1) * sizeof(*n))
                     : NULL;
        if (n != NULL) {
            n[c->nstale++] = fd;
            c->stale_pidfds = n;
        } else {
            if (fd >= 0)
                close(fd);
            c->stale_forever = true;
        }
    }
    if (--c->refs == 0 && c->dead)
        pthread_cond_broadcast(&dd->cond);
    pthread_mutex_unlock(&dd->lock);
}

llmdd_status
llmdd__cache_get_span(llmdd *dd, int64_t id, uint32_t first, uint32_t count,
                      const uint64_t *offs, const uint64_t *lens, size_t nruns,
                      llmdd__cache **out)
{
    llmdd__cache *c = llmdd__cache_get(dd, id);
    uint64_t end;

    if (c == NULL)
        return LLM_KV_CACHE_NOT_EXIST;
    if (count == 0 || first >= c->desc.num_tensors ||
        count > c->desc.num_tensors - first)
        goto err;
    for (size_t i = 0; i < nruns; i++)
        if (__builtin_add_overflow(offs[i], lens[i], &end) ||
            end > c->tensor_size)
            goto err;
    *out = c;
    return LLM_SUCCESS;
err:
    llmdd__cache_put(dd, c);
    return LLM_PARAM_INVALID;
}

llmdd_status
llmdd__pool_setup(llmdd *dd)
{
    if (!dd->opts.host_pool)
        return LLM_SUCCESS;
    return pool_create(&dd->opts.host_pool_config, &dd->host_pool);
}
