/*
 * Cache keys: names a peer can look up instead of cache ids. A key is raw
 * bytes (1..LLMDD_KEY_MAX) bound to (cache id, batch index) of a live local
 * cache. The table is a chained hash table guarded by dd->lock; entries go
 * with their cache (cache.c calls llmdd__keys_drop_cache).
 */
#include <stdlib.h>
#include <string.h>

#include "core/internal.h"

typedef struct key_entry {
    struct key_entry *next;
    int64_t cache_id;
    uint32_t batch_index;
    size_t len;
    uint8_t bytes[];
} key_entry;

struct llmdd__keys {
    key_entry **buckets;
    size_t nbuckets; /* a power of two */
    size_t count;
};

static uint64_t
key_hash(const uint8_t *p, size_t n)
{
    uint64_t h = 0xcbf29ce484222325ull; /* FNV-1a */

    for (size_t i = 0; i < n; i++)
        h = (h ^ p[i]) * 0x100000001b3ull;
    return h;
}

static bool
key_valid(const void *key, size_t len)
{
    return key != NULL && len >= 1 && len <= LLMDD_KEY_MAX;
}

/* dd->lock held. The slot that holds the key, or where it would go. */
static key_entry **
key_slot(struct llmdd__keys *t, const void *key, size_t len)
{
    key_entry **p = &t->buckets[key_hash(key, len) & (t->nbuckets - 1)];

    while (*p != NULL &&
           ((*p)->len != len || memcmp((*p)->bytes, key, len) != 0))
        p = &(*p)->next;
    return p;
}

/* dd->lock held. Doubles the table when it is full; false without memory. */
static bool
keys_grow(llmdd *dd)
{
    struct llmdd__keys *t = dd->keys;

    if (t == NULL) {
        t = calloc(1, sizeof(*t));
        if (t == NULL)
            return false;
        t->nbuckets = 64;
        t->buckets = calloc(t->nbuckets, sizeof(*t->buckets));
        if (t->buckets == NULL) {
            free(t);
            return false;
        }
        dd->keys = t;
        return true;
    }
    if (t->count < t->nbuckets)
        return true;
    size_t n = t->nbuckets * 2;
    key_entry **b = calloc(n, sizeof(*b));
    if (b == NULL)
        return t->count < 4 * t->nbuckets; /* slower, still correct */
    for (size_t i = 0; i < t->nbuckets; i++) {
        while (t->buckets[i] != NULL) {
            key_entry *e = t->buckets[i];
            t->buckets[i] = e->next;
            size_t j = key_hash(e->bytes, e->len) & (n - 1);
            e->next = b[j];
            b[j] = e;
        }
    }
    free(t->buckets);
    t->buckets = b;
    t->nbuckets = n;
    return true;
}

llmdd_status
llmdd_set_cache_key(llmdd *dd, int64_t cache_id, uint32_t batch_index,
                    const void *key, size_t key_len)
{
    llmdd_status st;

    if (dd == NULL)
        return LLM_PARAM_INVALID;
    if ((st = llmdd__ready(dd)) != LLM_SUCCESS)
        return st;
    if (!key_valid(key, key_len))
        return LLM_PARAM_INVALID;
    llmdd__cache *c = llmdd__cache_get(dd, cache_id);
    if (c == NULL)
        return LLM_KV_CACHE_NOT_EXIST;
    if (batch_index >= c->slot.slots) {
        llmdd__cache_put(dd, c);
        return LLM_PARAM_INVALID;
    }
    pthread_mutex_lock(&dd->lock);
    if (c->dead) { /* removed meanwhile: its keys are already dropped */
        st = LLM_KV_CACHE_NOT_EXIST;
    } else if (!keys_grow(dd)) {
        st = LLM_OUT_OF_MEMORY;
    } else {
        key_entry **p = key_slot(dd->keys, key, key_len);
        key_entry *e = *p == NULL ? malloc(sizeof(*e) + key_len) : NULL;
        if (*p != NULL) {
            st = LLM_CACHE_KEY_ALREADY_EXIST;
        } else if (e == NULL) {
            st = LLM_OUT_OF_MEMORY;
        } else {
            e->next = NULL;
            e->cache_id = cache_id;
            e->batch_index = batch_index;
            e->len = key_len;
            memcpy(e->bytes, key, key_len);
            *p = e;
            dd->keys->count++;
        }
    }
    pthread_mutex_unlock(&dd->lock);
    llmdd__cache_put(dd, c);
    return st;
}

llmdd_status
llmdd_remove_cache_key(llmdd *dd, const void *key, size_t key_len)
{
    llmdd_status st;

    if (dd == NULL)
        return LLM_PARAM_INVALID;
    if ((st = llmdd__ready(dd)) != LLM_SUCCESS)
        return st;
    if (!key_valid(key, key_len))
        return LLM_PARAM_INVALID;
    pthread_mutex_lock(&dd->lock);
    if (dd->keys != NULL) {
        key_entry **p = key_slot(dd->keys, key, key_len);
        key_entry *e = *p;
        if (e != NULL) {
            *p = e->next;
            dd->keys->count--;
            free(e);
        }
    }
    pthread_mutex_unlock(&dd->lock);
    return LLM_SUCCESS;
}

bool
llmdd__keys_find(llmdd *dd, const void *key, size_t key_len, int64_t *cache_id,
                 uint32_t *batch_index)
{
    bool found = false;

    if (!key_valid(key, key_len))
        return false;
    pthread_mutex_lock(&dd->lock);
    if (dd->initialized && dd->keys != NULL) {
        key_entry *e = *key_slot(dd->keys, key, key_len);
        if (e != NULL) {
            *cache_id = e->cache_id;
            *batch_index = e->batch_index;
            found = true;
        }
    }
    pthread_mutex_unlock(&dd->lock);
    return found;
}

void
llmdd__keys_drop_cache(llmdd *dd, int64_t cache_id)
{
    struct llmdd__keys *t = dd->keys;

    if (t == NULL)
        return;
    for (size_t i = 0; i < t->nbuckets; i++) {
        for (key_entry **p = &t->buckets[i]; *p != NULL;) {
            key_entry *e = *p;
            if (e->cache_id == cache_id) {
                *p = e->next;
                t->count--;
                free(e);
            } else {
                p = &e->next;
            }
        }
    }
}

void
llmdd__keys_fini(llmdd *dd)
{
    struct llmdd__keys *t = dd->keys;

    if (t == NULL)
        return;
    for (size_t i = 0; i < t->nbuckets; i++) {
        while (t->buckets[i] != NULL) {
            key_entry *e = t->buckets[i];
            t->buckets[i] = e->next;
            free(e);
        }
    }
    free(t->buckets);
    free(t);
    dd->keys = NULL;
}

/* ---- Keys over a link's control connection. ---- */

/*
 * Answers a peer's KEY_QUERY (control thread). The reply is queued, never
 * waited on: a peer that asks and never reads fills only its own link's
 * queue, and loses the link.
 */
bool
llmdd__keys_serve(llmdd__link *link, const uint8_t *buf, size_t len)
{
    llmdd__key_query q;
    llmdd__key_reply r = {.status = LLM_KV_CACHE_NOT_EXIST};
    uint8_t out[32];

    if (llmdd__wire_key_query_decode(buf, len, &q) != 0) {
        llmdd__link_breach(link, "malformed KEY_QUERY");
        return false;
    }
    r.seq = q.seq;
    if (llmdd__keys_find(link->dd, q.key, q.key_len, &r.cache_id,
                         &r.batch_index))
        r.status = LLM_SUCCESS;
    size_t n = llmdd__wire_key_reply_encode(&r, out, sizeof(out));
    return llmdd__link_send(link, WMSG_KEY_REPLY, out, n) == 0;
}

llmdd_status
llmdd_lookup_remote_key(llmdd *dd, uint64_t cluster_id, const void *key,
                        size_t key_len, llmdd_cache_index *index_out)
{
    llmdd__link_wait w = {.type = WMSG_KEY_REPLY};
    llmdd__key_query q = {0};
    llmdd__key_reply r;
    uint8_t buf[LLMDD_CTRL_MSG_MAX];
    llmdd_status st;

    if (dd == NULL)
        return LLM_PARAM_INVALID;
    if ((st = llmdd__ready(dd)) != LLM_SUCCESS)
        return st;
    if (!key_valid(key, key_len) || index_out == NULL)
        return LLM_PARAM_INVALID;
    llmdd__link *link = llmdd__link_get(dd, cluster_id);
    if (link == NULL)
        return LLM_NOT_YET_LINK;
    int64_t deadline = llmdd__now_ms() + llmdd__wait_ms(dd);
    q.seq = llmdd__link_await_begin(link, &w);
    q.key_len = (uint32_t)key_len;
    memcpy(q.key, key, key_len);
    size_t n = llmdd__wire_key_query_encode(&q, buf, sizeof(buf));
    (void)llmdd__link_send(link, WMSG_KEY_QUERY, buf, n); /* else: dead */
    st = llmdd__link_await(link, &w, deadline);
    llmdd__link_put(link);
    if (st != LLM_SUCCESS)
        return st;
    /* The control thread decoded it to find its sequence number. */
    (void)llmdd__wire_key_reply_decode(w.reply, w.len, &r);
    if (r.status != LLM_SUCCESS) {
        /* Expected while the prompt has not keyed its cache yet. */
        log_info("cluster %llu has no cache under the key looked up",
                 (unsigned long long)cluster_id);
        return LLM_KV_CACHE_NOT_EXIST;
    }
    *index_out = (llmdd_cache_index){.cluster_id = cluster_id,
                                     .cache_id = r.cache_id,
                                     .batch_index = r.batch_index};
    return LLM_SUCCESS;
}
