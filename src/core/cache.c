/*
 * The cache registry: allocate, register, look up, release.
 *
 * Allocated caches live in memfd-backed shared mappings so that a same-host
 * peer can map the very same pages; their memory (one memfd per cache, or
 * pages of the host pool, sealed against size changes, held back from the
 * pool while a stalled peer may write them) is cache_mem.c's. Allocations
 * check the memory cgroup's limits first (memlimit.c).
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
#include "core/internal.h"
#include "core/slices.h"


static void
cache_free(llmdd *dd, llmdd__cache *c)
{
    if (c->allocated)
        llmdd__mem_free(dd, c);
    llmdd__pidfds_close(c->stale_pidfds, c->nstale);
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
    llmdd__pool_destroy(dd->host_pool);
    dd->host_pool = NULL;
}

static llmdd__cache *
cache_new(const llmdd_cache_desc *desc, uint64_t tensor_size,
          const llmdd__slot_geom *slot)
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
    c->slot = *slot;
    c->stride = llmdd__slot_bytes(slot);
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

/* The desc, the batch dimension and the layout of a new cache (the layout
 * calls pass batch dimension 0). */
static llmdd_status
cache_check(const char *what, const llmdd_cache_desc *desc, uint32_t batch_dim,
            const llmdd_kv_layout *layout, uint64_t *tensor_size,
            llmdd__slot_geom *slot)
{
    uint64_t stride;

    if (llmdd__desc_check(desc, tensor_size, &stride) != LLM_SUCCESS)
        return LLM_PARAM_INVALID;
    if (llmdd__slot_geom_make(desc, batch_dim, slot) != LLM_SUCCESS) {
        log_error("%s: batch dimension %u of a %u-dimensional shape", what,
                  batch_dim, desc->num_dims);
        return LLM_PARAM_INVALID;
    }
    return layout_fits(layout, stride);
}

static llmdd_status
allocate(llmdd *dd, const llmdd_cache_desc *desc, uint32_t batch_dim,
         const llmdd_kv_layout *layout, llmdd_cache *cache_out)
{
    llmdd__slot_geom slot;
    uint64_t tensor_size;
    llmdd_status st;
    llmdd__cache *c;

    if (dd == NULL)
        return LLM_PARAM_INVALID;
    pthread_mutex_lock(&dd->lock);
    if ((st = ready(dd)) != LLM_SUCCESS)
        goto out;
    if (cache_out == NULL ||
        cache_check("allocate_cache", desc, batch_dim, layout, &tensor_size,
                    &slot) != LLM_SUCCESS) {
        st = LLM_PARAM_INVALID;
        goto out;
    }
    if (desc->placement == LLMDD_PLACEMENT_DEVICE)
        device_as_host(dd);
    c = cache_new(desc, tensor_size, &slot);
    if (c == NULL) {
        st = LLM_OUT_OF_MEMORY;
        goto out;
    }
    st = llmdd__mem_alloc(dd, tensor_size, desc->num_tensors, &c->mem);
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
register_cache(llmdd *dd, const llmdd_cache_desc *desc, uint32_t batch_dim,
               const llmdd_kv_layout *layout, const uint64_t *addrs,
               size_t num_addrs, int64_t *cache_id_out)
{
    llmdd__slot_geom slot;
    uint64_t tensor_size;
    llmdd_status st;
    llmdd__cache *c;

    if (dd == NULL)
        return LLM_PARAM_INVALID;
    pthread_mutex_lock(&dd->lock);
    if ((st = ready(dd)) != LLM_SUCCESS)
        goto out;
    st = LLM_PARAM_INVALID;
    if (cache_id_out == NULL || addrs == NULL || num_addrs == 0 ||
        cache_check("register_kv_cache", desc, batch_dim, layout, &tensor_size,
                    &slot) != LLM_SUCCESS ||
        num_addrs != desc->num_tensors)
        goto out;
    for (size_t i = 0; i < num_addrs; i++) {
        uint64_t end;
        if (addrs[i] == 0 ||
            __builtin_add_overflow(addrs[i], tensor_size, &end))
            goto out;
    }
    if (desc->placement == LLMDD_PLACEMENT_DEVICE)
        device_as_host(dd);
    c = cache_new(desc, tensor_size, &slot);
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
    return allocate(dd, desc, 0, NULL, cache_out);
}

llmdd_status
llmdd_allocate_cache_ex(llmdd *dd, const llmdd_cache_desc *desc,
                        uint32_t batch_dim, llmdd_cache *cache_out)
{
    return allocate(dd, desc, batch_dim, NULL, cache_out);
}

llmdd_status
llmdd_allocate_cache_layout(llmdd *dd, const llmdd_cache_desc *desc,
                            const llmdd_kv_layout *layout,
                            llmdd_cache *cache_out)
{
    if (layout == NULL)
        return LLM_PARAM_INVALID;
    return allocate(dd, desc, 0, layout, cache_out);
}

llmdd_status
llmdd_register_kv_cache(llmdd *dd, const llmdd_cache_desc *desc,
                        const uint64_t *addrs, size_t num_addrs,
                        int64_t *cache_id_out)
{
    return register_cache(dd, desc, 0, NULL, addrs, num_addrs, cache_id_out);
}

llmdd_status
llmdd_register_kv_cache_ex(llmdd *dd, const llmdd_cache_desc *desc,
                           uint32_t batch_dim, const uint64_t *addrs,
                           size_t num_addrs, int64_t *cache_id_out)
{
    return register_cache(dd, desc, batch_dim, NULL, addrs, num_addrs,
                          cache_id_out);
}

llmdd_status
llmdd_register_kv_cache_layout(llmdd *dd, const llmdd_cache_desc *desc,
                               const llmdd_kv_layout *layout,
                               const uint64_t *addrs, size_t num_addrs,
                               int64_t *id_out)
{
    if (layout == NULL)
        return LLM_PARAM_INVALID;
    return register_cache(dd, desc, 0, layout, addrs, num_addrs, id_out);
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
                      const uint64_t *offs, const uint64_t *lens,
                      const uint64_t *cnts, const uint64_t *strides,
                      size_t nruns, llmdd__cache **out)
{
    llmdd__cache *c = llmdd__cache_get(dd, id);

    if (c == NULL)
        return LLM_KV_CACHE_NOT_EXIST;
    if (count == 0 || first >= c->desc.num_tensors ||
        count > c->desc.num_tensors - first)
        goto err;
    for (size_t i = 0; i < nruns; i++)
        if (!llmdd__elems_fit(offs[i], lens[i], cnts != NULL ? cnts[i] : 1,
                              cnts != NULL ? strides[i] : 0, c->tensor_size))
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
    return llmdd__pool_create(&dd->opts.host_pool_config, &dd->host_pool);
}
