/*
 * The metadata service of one instance: publishing under a lease, lookups,
 * and one metadata thread that keeps the lease alive, confirms that our key
 * still carries our entry (taking it back when it was deleted or
 * overwritten, or publishing again when the server lost the lease), and
 * watches <prefix>/clusters/ for departures and for writes to our key.
 *
 * The thread waits in curl_multi_wait on the watch stream and its wake
 * eventfd; keepalives are short requests of their own (llmdd__etcd_call).
 * Publishing, unpublishing and lookups run on the caller's thread. op_lock
 * orders the publishing steps (the caller's and the thread's); lock guards
 * the fields marked so and is never held across a request.
 */
#include <curl/curl.h>
#include <errno.h>
#include <inttypes.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include "base/log.h"
#include "base/net.h"
#include "meta/etcd.h"

#define WATCH_RETRY_MS 500
#define KEEPALIVE_RETRY_MS 1000

struct llmdd__meta {
    llmdd__etcd etcd;
    char prefix[LLMDD_META_PREFIX_MAX + 16]; /* "<prefix>/clusters/" */
    uint32_t lease_ms;
    llmdd__meta_gone_fn gone;
    void *gone_arg;
    pthread_t thread;
    int wake_fd;

    pthread_mutex_t op_lock; /* publish, unpublish, republish */
    pthread_mutex_t lock;
    /* Guarded by lock. */
    bool stop;
    bool published;
    int64_t lease_id;
    int64_t ttl_ms;  /* the server's TTL for the lease */
    char key[LLMDD_META_PREFIX_MAX + 48];
    llmdd__meta_entry entry;
    int64_t ka_due;   /* next keepalive */
    int64_t take_due; /* no take of our key before: one a lease period */

    /* Guarded by op_lock. */
    int64_t claim_due; /* the next "two instances claim" line */

    /* The thread's own. */
    int64_t watch_rev;  /* the next revision to watch from */
    bool watch_restart; /* the server cancelled the watch: start it anew */
    char *line;        /* a watch message being received */
    size_t line_len, line_cap; /* grows up to LLMDD_META_BODY_MAX */
    bool line_over;
};

static void
meta_wake(llmdd__meta *m)
{
    uint64_t one = 1;
    (void)!write(m->wake_fd, &one, sizeof(one));
}

static bool
pid_alive(uint32_t pid)
{
    return kill((pid_t)pid, 0) == 0 || errno == EPERM;
}

/* ---- Publishing (op_lock held). ---- */

/*
 * Grants a lease and puts the entry under it: created, or taken over from
 * our own earlier value (same nonce) or from a dead process of this host.
 */
static llmdd_status
do_publish(llmdd__meta *m, const char *key, const llmdd__meta_entry *e,
           int64_t deadline)
{
    char value[LLMDD_META_VALUE_MAX], cur[LLMDD_META_VALUE_MAX + 1];
    int64_t id, ttl, rev = 0;
    size_t vlen;
    bool done = false;
    int rc;

    if (llmdd__meta_entry_encode(e, value, sizeof(value)) == 0)
        return LLM_PARAM_INVALID;
    rc = llmdd__etcd_grant(&m->etcd, (m->lease_ms + 999) / 1000, deadline,
                           &id, &ttl);
    if (rc != ETCD_OK)
        goto err;
    for (int round = 0; round < 4 && !done; round++) {
        rc = llmdd__etcd_put_if(&m->etcd, key, value, id, rev, deadline,
                                &done, cur, sizeof(cur), &vlen, &rev);
        if (rc != ETCD_OK)
            goto err_lease;
        if (done || rev == 0)
            continue; /* gone meanwhile: create it */
        llmdd__meta_entry old;
        if (llmdd__meta_entry_decode(cur, vlen, &old) != LLM_SUCCESS) {
            log_error("metadata: %s holds a value that is no entry; "
                      "refused (it goes when its lease ends)",
                      key);
            goto err_dup;
        }
        if (old.nonce == e->nonce)
            continue; /* ours, from before a lost answer */
        if (memcmp(old.boot_id, e->boot_id, sizeof(e->boot_id)) == 0 &&
            old.pid != e->pid && !pid_alive(old.pid)) {
            log_warn("metadata: %s was published by pid %" PRIu32
                     " of this host, which is gone: taken over",
                     key, old.pid);
            continue;
        }
        log_error("metadata: cluster %" PRIu64 " is published by a live "
                  "instance (pid %" PRIu32 "%s); refused",
                  e->cluster_id, old.pid,
                  memcmp(old.boot_id, e->boot_id, sizeof(e->boot_id)) == 0
                      ? " of this host"
                      : " of another host");
        goto err_dup;
    }
    if (!done)
        goto err_dup;
    pthread_mutex_lock(&m->lock);
    m->published = true;
    m->lease_id = id;
    m->ttl_ms = ttl * 1000;
    m->entry = *e;
    snprintf(m->key, sizeof(m->key), "%s", key);
    m->ka_due = llmdd__now_ms() + m->ttl_ms / 3;
    m->take_due = 0;
    pthread_mutex_unlock(&m->lock);
    m->claim_due = 0;
    meta_wake(m);
    log_info("metadata: published %s (lease TTL %" PRId64 " s)", key, ttl);
    return LLM_SUCCESS;

err_dup:
    (void)llmdd__etcd_revoke(&m->etcd, id, deadline);
    return LLM_PARAM_INVALID;
err_lease:
    (void)llmdd__etcd_revoke(&m->etcd, id, deadline);
err:
    if (rc == ETCD_UNREACHABLE) {
        log_error("metadata: no endpoint of the server answered in time");
        return LLM_TIMEOUT;
    }
    return LLM_FAILED;
}

llmdd_status
llmdd__meta_publish(llmdd__meta *m, const llmdd__meta_entry *e,
                    int64_t deadline_ms)
{
    char key[sizeof(m->key)];

    snprintf(key, sizeof(key), "%s%" PRIu64, m->prefix, e->cluster_id);
    pthread_mutex_lock(&m->op_lock);
    llmdd_status st = do_publish(m, key, e, deadline_ms);
    pthread_mutex_unlock(&m->op_lock);
    return st;
}

void
llmdd__meta_unpublish(llmdd__meta *m, int64_t deadline_ms)
{
    pthread_mutex_lock(&m->op_lock);
    pthread_mutex_lock(&m->lock);
    bool was = m->published;
    int64_t id = m->lease_id;
    m->published = false;
    pthread_mutex_unlock(&m->lock);
    if (was && llmdd__etcd_revoke(&m->etcd, id, deadline_ms) != ETCD_OK)
        log_warn("metadata: could not revoke the lease of %s; the entry "
                 "goes when it expires",
                 m->key);
    else if (was)
        log_info("metadata: %s removed", m->key);
    pthread_mutex_unlock(&m->op_lock);
}

/*
 * The thread (op_lock held): whether our key still carries our entry under
 * our lease `id`, read back with a range on the key. When it does not (an
 * operator's delete or stray put, a hostile writer, our lease lost), it is
 * taken back with a transaction that succeeds only while the key is as it
 * was read (its mod_revision, or absent), at most once per lease period,
 * so that a writer who keeps writing is never fought more often than that.
 * An entry of another live instance of our cluster id is not taken: two
 * instances claim one id, which only the operator can settle; it is logged
 * at error once per lease period while it lasts, and our key is taken back
 * when that entry goes. Returns when to look again.
 */
static int64_t
confirm_key(llmdd__meta *m, int64_t id, int64_t ttl_ms, int64_t retry)
{
    char key[sizeof(m->key)], cur[LLMDD_META_VALUE_MAX + 1];
    char value[LLMDD_META_VALUE_MAX];
    llmdd__meta_entry e, old;
    int64_t rev = 0, lease = 0, now = llmdd__now_ms(), step = ttl_ms / 3;
    long vlen = -1;
    size_t clen;
    bool found = false, done = false;

    pthread_mutex_lock(&m->lock);
    e = m->entry;
    memcpy(key, m->key, sizeof(key));
    int64_t take_due = m->take_due;
    pthread_mutex_unlock(&m->lock);
    int rc = llmdd__etcd_get(&m->etcd, key, -1, now + retry, &found,
                             cur, sizeof(cur), &vlen, &rev, &lease);
    if (rc != ETCD_OK)
        return llmdd__now_ms() + retry;
    bool entry = found && vlen > 0 &&
                 llmdd__meta_entry_decode(cur, (size_t)vlen, &old) ==
                     LLM_SUCCESS &&
                 old.cluster_id == e.cluster_id;
    if (entry && old.nonce == e.nonce && lease == id)
        return now + step; /* ours */
    /* Another instance's entry under a lease is live while etcd keeps it
     * (a key goes with its lease), unless a dead process of this host
     * wrote it (as do_publish judges it). */
    bool same_host = entry && memcmp(old.boot_id, e.boot_id,
                                     sizeof(e.boot_id)) == 0;
    if (entry && old.nonce != e.nonce && lease != 0 &&
        !(same_host && old.pid != e.pid && !pid_alive(old.pid))) {
        if (now >= m->claim_due) {
            log_error("metadata: two instances claim cluster %" PRIu64
                      ": %s holds the entry of another live instance (pid "
                      "%" PRIu32 " of %s host); ours is published again "
                      "only when it goes",
                      e.cluster_id, key, old.pid,
                      same_host ? "this" : "another");
            m->claim_due = now + ttl_ms;
        }
        /* Nothing to take: writes seen meanwhile wait for the next look. */
        pthread_mutex_lock(&m->lock);
        m->take_due = now + step;
        pthread_mutex_unlock(&m->lock);
        return now + step;
    }
    if (now < take_due)
        return take_due < now + step ? take_due : now + step;
    if (llmdd__meta_entry_encode(&e, value, sizeof(value)) == 0)
        return now + step; /* published once, so it fits */
    rc = llmdd__etcd_put_if(&m->etcd, key, value, id, found ? rev : 0,
                            llmdd__now_ms() + retry, &done, cur, sizeof(cur),
                            &clen, &rev);
    if (rc == ETCD_UNREACHABLE)
        return llmdd__now_ms() + retry;
    /* An answered try counts, taken or not (the key changed again since
     * it was read): the next waits for the period to end. */
    pthread_mutex_lock(&m->lock);
    m->take_due = now + ttl_ms;
    pthread_mutex_unlock(&m->lock);
    if (done)
        log_warn("metadata: %s was %s; taken back", key,
                 !found  ? "deleted"
                 : entry ? (old.nonce == e.nonce
                                ? "ours under another lease"
                                : "overwritten by another entry")
                         : "overwritten by a value that is no entry");
    else
        log_warn("metadata: %s changed again while it was taken back; "
                 "trying again within a lease period",
                 key);
    return llmdd__now_ms() + step;
}

/* The thread: a keepalive is due. Returns when the next one is. */
static int64_t
keepalive(llmdd__meta *m)
{
    int64_t now = llmdd__now_ms(), ttl = 0, next;

    pthread_mutex_lock(&m->op_lock);
    pthread_mutex_lock(&m->lock);
    bool pub = m->published;
    int64_t id = m->lease_id, ttl_ms = m->ttl_ms;
    pthread_mutex_unlock(&m->lock);
    if (!pub) {
        pthread_mutex_unlock(&m->op_lock);
        return INT64_MAX;
    }
    /* Every request is bounded by the retry step, not the TTL: op_lock is
     * held, and unpublish (set_role, finalize) waits for it. A failure
     * tries again at the next step. */
    int64_t step = ttl_ms / 3, retry = step < KEEPALIVE_RETRY_MS
                                           ? step
                                           : KEEPALIVE_RETRY_MS;
    int rc = llmdd__etcd_keepalive(&m->etcd, id, now + retry, &ttl);
    if (rc != ETCD_OK) {
        /* Links keep working while the server is away. */
        log_debug("metadata: keepalive failed; retrying");
        next = llmdd__now_ms() + retry;
        goto out;
    }
    if (ttl <= 0) {
        /* Our key went with the lease: a new lease, and the key is taken
         * back under it. */
        int64_t nid, nttl;
        rc = llmdd__etcd_grant(&m->etcd, (m->lease_ms + 999) / 1000,
                               llmdd__now_ms() + retry, &nid, &nttl);
        if (rc != ETCD_OK) {
            next = llmdd__now_ms() + retry;
            goto out;
        }
        log_warn("metadata: the server lost the lease of %s (restarted "
                 "without its data, or it did not hear from us within the "
                 "TTL); publishing again",
                 m->key);
        pthread_mutex_lock(&m->lock);
        m->lease_id = id = nid;
        m->ttl_ms = ttl_ms = nttl * 1000;
        m->take_due = 0;
        pthread_mutex_unlock(&m->lock);
        step = ttl_ms / 3;
        retry = step < KEEPALIVE_RETRY_MS ? step : KEEPALIVE_RETRY_MS;
    }
    next = confirm_key(m, id, ttl_ms, retry);
out:
    pthread_mutex_unlock(&m->op_lock);
    return next;
}

/* ---- The watch. ---- */

static void
watch_event(llmdd__meta *m, const cJSON *ev)
{
    char key[256], val[LLMDD_META_VALUE_MAX + 1];
    const cJSON *kv = cJSON_GetObjectItemCaseSensitive(ev, "kv");
    const char *type =
        cJSON_GetStringValue(cJSON_GetObjectItemCaseSensitive(ev, "type"));
    int64_t rev;
    uint64_t id = 0;
    size_t plen = strlen(m->prefix);

    if (!cJSON_IsObject(kv) ||
        !llmdd__etcd_i64(kv, "mod_revision", 0, &rev))
        return;
    if (rev >= m->watch_rev)
        m->watch_rev = rev + 1;
    long klen = llmdd__etcd_kv_bytes(kv, "key", key, sizeof(key));
    if (klen <= (long)plen || memcmp(key, m->prefix, plen) != 0 ||
        klen - (long)plen > 20)
        return;
    for (const char *p = key + plen; *p != '\0'; p++) {
        if (*p < '0' || *p > '9' || id > (UINT64_MAX - 9) / 10)
            return;
        id = id * 10 + (uint64_t)(*p - '0');
    }
    /* The value written (a PUT), or the one deleted (prev_kv: the departed
     * instance's entry), and its lease. */
    bool del = type != NULL && strcmp(type, "DELETE") == 0;
    const cJSON *src =
        del ? cJSON_GetObjectItemCaseSensitive(ev, "prev_kv") : kv;
    llmdd__meta_entry e;
    int64_t lease = 0;
    long vlen = src != NULL
                    ? llmdd__etcd_kv_bytes(src, "value", val, sizeof(val))
                    : -1;
    bool entry = vlen > 0 &&
                 llmdd__meta_entry_decode(val, (size_t)vlen, &e) ==
                     LLM_SUCCESS &&
                 e.cluster_id == id;
    if (src != NULL && !llmdd__etcd_i64(src, "lease", 0, &lease))
        lease = 0;
    /* Our key: a write that is not our own put (our nonce under the lease
     * we hold now), or a delete, has the thread confirm the key as soon as
     * it may take it back (confirm_key decides what to take): a writer who
     * keeps writing costs no more requests than that. A delete of our
     * entry under an older lease (a lost lease) is looked at as well, and
     * finds the key ours or takes it. */
    pthread_mutex_lock(&m->lock);
    bool mine = m->published && m->entry.cluster_id == id;
    bool own = mine && entry && e.nonce == m->entry.nonce;
    bool ours = own && lease == m->lease_id;
    if (mine && (del || !ours) && m->take_due < m->ka_due)
        m->ka_due = m->take_due;
    pthread_mutex_unlock(&m->lock);
    if (!del) {
        /* What is done about it is logged by confirm_key, at most once a
         * lease period: a writer who keeps writing floods no log. */
        if (mine && !ours)
            log_debug("metadata: our entry %s%" PRIu64 " was overwritten; "
                      "looking at it",
                      m->prefix, id);
        return; /* an arrival or an update: no link depends on it */
    }
    if (ours)
        log_warn("metadata: our entry %s%" PRIu64 " was deleted; publishing "
                 "it again",
                 m->prefix, id);
    if (own)
        return; /* ours, or ours under a lease we no longer hold */
    /* A deleted value that is no entry of this cluster (a stray put) says
     * nothing about the instance linked under that id. */
    if (src != NULL && !entry) {
        log_info("metadata: a value under %s%" PRIu64 " that is no entry "
                 "was deleted; nothing is dropped for it",
                 m->prefix, id);
        return;
    }
    log_info("metadata: cluster %" PRIu64 " left (its entry was deleted or "
             "expired)",
             id);
    if (m->gone != NULL)
        m->gone(m->gone_arg, id, entry ? e.nonce : 0);
}

/* One whole message of the watch stream. */
static void
watch_message(llmdd__meta *m, const char *s, size_t len)
{
    cJSON *j = cJSON_ParseWithLength(s, len);
    const cJSON *r = cJSON_GetObjectItemCaseSensitive(j, "result");
    const cJSON *ev;
    int64_t crev = 0;

    if (!cJSON_IsObject(r)) {
        log_warn("metadata: a malformed watch message ignored");
        goto out;
    }
    if (cJSON_IsTrue(cJSON_GetObjectItemCaseSensitive(r, "canceled"))) {
        if (llmdd__etcd_i64(r, "compact_revision", 0, &crev) && crev > 0) {
            log_warn("metadata: watch compacted at revision %" PRId64
                     "; departures before it are not seen",
                     crev);
            m->watch_rev = crev;
        }
        /* The stream stays open with no watch on it: start another. */
        m->watch_restart = true;
        goto out;
    }
    cJSON_ArrayForEach(ev, cJSON_GetObjectItemCaseSensitive(r, "events"))
        watch_event(m, ev);
out:
    cJSON_Delete(j);
}

static size_t
watch_write(char *p, size_t size, size_t n, void *arg)
{
    llmdd__meta *m = arg;
    size_t len = size * n;

    for (size_t i = 0; i < len; i++) {
        if (p[i] == '\n') {
            if (!m->line_over && m->line_len > 0)
                watch_message(m, m->line, m->line_len);
            else if (m->line_over)
                log_warn("metadata: a watch message over %u bytes ignored",
                         LLMDD_META_BODY_MAX);
            m->line_len = 0;
            m->line_over = false;
        } else if (m->line_over) {
            continue;
        } else if (m->line_len < m->line_cap) {
            m->line[m->line_len++] = p[i];
        } else if (m->line_cap < LLMDD_META_BODY_MAX) {
            /* Most messages are small: the buffer grows as one needs. */
            size_t ncap = m->line_cap * 2;
            char *nl = realloc(m->line, ncap);
            if (nl == NULL) {
                m->line_over = true;
                continue;
            }
            m->line = nl;
            m->line_cap = ncap;
            m->line[m->line_len++] = p[i];
        } else {
            m->line_over = true;
        }
    }
    return len;
}

/* Starts the watch on the current endpoint from m->watch_rev. */
static CURL *
watch_start(llmdd__meta *m, CURLM *multi, char **body_out)
{
    int64_t rev;
    char url[400];

    /* The server's revision: behind ours means it lost its data, and
     * its history is new: watch from its present (absence drops
     * nothing). */
    int rc = llmdd__etcd_range_prefix(&m->etcd, m->prefix, true, m->wake_fd,
                                      llmdd__now_ms() + 1000, NULL, &rev);
    if (rc != ETCD_OK)
        return NULL;
    if (rev + 1 < m->watch_rev) {
        log_warn("metadata: the server's revision %" PRId64 " is behind "
                 "ours (%" PRId64 "): it lost its data; watching anew",
                 rev, m->watch_rev - 1);
        m->watch_rev = rev + 1;
    }
    if (m->watch_rev == 0)
        m->watch_rev = rev + 1;
    char *body = llmdd__etcd_watch_body(m->prefix, m->watch_rev);
    CURL *h = body != NULL ? curl_easy_init() : NULL;
    if (h == NULL) {
        free(body);
        return NULL;
    }
    snprintf(url, sizeof(url), "%s/v3/watch",
             m->etcd.urls[atomic_load(&m->etcd.cur) % m->etcd.n]);
    curl_easy_setopt(h, CURLOPT_URL, url);
    curl_easy_setopt(h, CURLOPT_NOSIGNAL, 1L);
    curl_easy_setopt(h, CURLOPT_POSTFIELDS, body);
    curl_easy_setopt(h, CURLOPT_WRITEFUNCTION, watch_write);
    curl_easy_setopt(h, CURLOPT_WRITEDATA, m);
    curl_easy_setopt(h, CURLOPT_CONNECTTIMEOUT_MS,
                     (long)LLMDD_META_CONNECT_MS);
    curl_easy_setopt(h, CURLOPT_PROTOCOLS_STR, "http");
    /* A server that vanishes without a close is noticed. */
    curl_easy_setopt(h, CURLOPT_TCP_KEEPALIVE, 1L);
    curl_easy_setopt(h, CURLOPT_TCP_KEEPIDLE, 2L);
    curl_easy_setopt(h, CURLOPT_TCP_KEEPINTVL, 1L);
    m->line_len = 0;
    m->line_over = false;
    curl_multi_add_handle(multi, h);
    *body_out = body;
    return h;
}

static void *
meta_main(void *arg)
{
    llmdd__meta *m = arg;
    CURLM *multi = curl_multi_init();
    CURL *watch = NULL;
    char *watch_body = NULL;
    int64_t watch_retry = 0;

    if (multi == NULL) {
        log_error("metadata: no curl multi handle; departures are not seen");
        return NULL;
    }
    for (;;) {
        pthread_mutex_lock(&m->lock);
        bool stop = m->stop;
        int64_t ka_due = m->published ? m->ka_due : INT64_MAX;
        pthread_mutex_unlock(&m->lock);
        if (stop)
            break;
        int64_t now = llmdd__now_ms();
        if (watch == NULL && now >= watch_retry) {
            watch = watch_start(m, multi, &watch_body);
            if (watch == NULL)
                watch_retry = llmdd__now_ms() + WATCH_RETRY_MS;
        }
        if (now >= ka_due) {
            int64_t next = keepalive(m);
            pthread_mutex_lock(&m->lock);
            if (m->published)
                m->ka_due = next;
            ka_due = m->published ? m->ka_due : INT64_MAX;
            pthread_mutex_unlock(&m->lock);
        }
        now = llmdd__now_ms();
        int64_t wait = ka_due - now;
        if (watch == NULL && watch_retry - now < wait)
            wait = watch_retry - now;
        if (wait > 1000)
            wait = 1000;
        if (wait < 0)
            wait = 0;
        struct curl_waitfd wfd = {.fd = m->wake_fd, .events = CURL_WAIT_POLLIN};
        int nfds = 0;
        curl_multi_wait(multi, &wfd, 1, (int)wait, &nfds);
        if (wfd.revents & CURL_WAIT_POLLIN) {
            uint64_t v;
            (void)!read(m->wake_fd, &v, sizeof(v));
        }
        int running = 0;
        curl_multi_perform(multi, &running);
        CURLMsg *msg;
        int left;
        bool ended = m->watch_restart;
        m->watch_restart = false;
        while ((msg = curl_multi_info_read(multi, &left)) != NULL) {
            if (msg->msg != CURLMSG_DONE || msg->easy_handle != watch)
                continue;
            log_info("metadata: the watch ended (%s); watching again",
                     curl_easy_strerror(msg->data.result));
            ended = true;
        }
        if (ended && watch != NULL) {
            curl_multi_remove_handle(multi, watch);
            curl_easy_cleanup(watch);
            free(watch_body);
            watch = NULL;
            watch_body = NULL;
            /* Another endpoint next time. */
            atomic_fetch_add(&m->etcd.cur, 1);
            watch_retry = llmdd__now_ms() + WATCH_RETRY_MS;
        }
    }
    if (watch != NULL) {
        curl_multi_remove_handle(multi, watch);
        curl_easy_cleanup(watch);
    }
    free(watch_body);
    curl_multi_cleanup(multi);
    return NULL;
}

/* ---- Open, close, lookups. ---- */

static llmdd_status
etcd_status(int rc)
{
    return rc == ETCD_UNREACHABLE ? LLM_TIMEOUT : LLM_FAILED;
}

static int
etcd_setup(llmdd__etcd *e, const char *server)
{
    memset(e, 0, sizeof(*e));
    if (llmdd__meta_server_parse(server, e->urls, &e->n) != LLM_SUCCESS)
        return -1;
    atomic_init(&e->cur, 0);
    return 0;
}

llmdd_status
llmdd__meta_open(const char *server, const char *prefix, uint32_t lease_ms,
                 llmdd__meta_gone_fn gone, void *arg, int64_t deadline_ms,
                 llmdd__meta **out)
{
    llmdd__meta *m;
    int64_t rev;
    llmdd_status st = LLM_FAILED;

    if (!llmdd__meta_prefix_valid(prefix))
        return LLM_PARAM_INVALID;
    llmdd__etcd_global_init();
    m = calloc(1, sizeof(*m));
    if (m == NULL)
        return LLM_OUT_OF_MEMORY;
    if (etcd_setup(&m->etcd, server) != 0) {
        st = LLM_PARAM_INVALID;
        goto err_free;
    }
    snprintf(m->prefix, sizeof(m->prefix), "%s/clusters/", prefix);
    m->lease_ms = lease_ms;
    m->gone = gone;
    m->gone_arg = arg;
    m->line_cap = 4096;
    m->line = malloc(m->line_cap);
    m->wake_fd = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
    if (m->line == NULL || m->wake_fd < 0)
        goto err_fd;
    int rc = llmdd__etcd_range_prefix(&m->etcd, m->prefix, true, -1,
                                      deadline_ms, NULL, &rev);
    if (rc != ETCD_OK) {
        log_error("metadata server %s: %s", server,
                  rc == ETCD_UNREACHABLE ? "no endpoint answered in time"
                                         : "a malformed answer");
        st = etcd_status(rc);
        goto err_fd;
    }
    m->watch_rev = rev + 1;
    pthread_mutex_init(&m->op_lock, NULL);
    pthread_mutex_init(&m->lock, NULL);
    if (pthread_create(&m->thread, NULL, meta_main, m) != 0) {
        pthread_mutex_destroy(&m->lock);
        pthread_mutex_destroy(&m->op_lock);
        goto err_fd;
    }
    *out = m;
    return LLM_SUCCESS;
err_fd:
    if (m->wake_fd >= 0)
        close(m->wake_fd);
    free(m->line);
err_free:
    free(m);
    return st;
}

void
llmdd__meta_close(llmdd__meta *m)
{
    if (m == NULL)
        return;
    llmdd__meta_unpublish(m, llmdd__now_ms() + LLMDD_META_REVOKE_MS);
    pthread_mutex_lock(&m->lock);
    m->stop = true;
    pthread_mutex_unlock(&m->lock);
    meta_wake(m);
    pthread_join(m->thread, NULL);
    pthread_mutex_destroy(&m->lock);
    pthread_mutex_destroy(&m->op_lock);
    close(m->wake_fd);
    free(m->line);
    free(m);
}

llmdd_status
llmdd__meta_resolve(const char *server, const char *prefix,
                    uint64_t cluster_id, int64_t deadline_ms,
                    llmdd__meta_entry *out)
{
    char key[LLMDD_META_PREFIX_MAX + 48], val[LLMDD_META_VALUE_MAX + 1];
    llmdd__meta_entry e;
    llmdd__etcd etcd;
    bool found = false;
    long vlen = -1;

    if (!llmdd__meta_prefix_valid(prefix) || etcd_setup(&etcd, server) != 0)
        return LLM_PARAM_INVALID;
    snprintf(key, sizeof(key), "%s/clusters/%" PRIu64, prefix, cluster_id);
    int rc = llmdd__etcd_get(&etcd, key, -1, deadline_ms, &found, val,
                             sizeof(val), &vlen, NULL, NULL);
    /* A link call's LLM_TIMEOUT and a lookup that found nothing: callers
     * retry both (a peer not published yet), so info. */
    if (rc == ETCD_UNREACHABLE) {
        log_info("link to cluster %" PRIu64 ": the metadata server did not "
                 "answer in time",
                 cluster_id);
        return LLM_TIMEOUT;
    }
    if (rc != ETCD_OK)
        return LLM_LINK_FAILED;
    if (!found) {
        log_info("link to cluster %" PRIu64 ": not published (%s)", cluster_id,
                 key);
        return LLM_LINK_FAILED;
    }
    if (vlen < 0 ||
        llmdd__meta_entry_decode(val, (size_t)vlen, &e) != LLM_SUCCESS ||
        e.cluster_id != cluster_id) {
        log_error("link to cluster %" PRIu64 ": its entry %s is malformed "
                  "or over %u bytes",
                  cluster_id, key, LLMDD_META_VALUE_MAX);
        return LLM_LINK_FAILED;
    }
    *out = e;
    return LLM_SUCCESS;
}

llmdd_status
llmdd__meta_list(const char *server, const char *prefix, int64_t deadline_ms,
                 char **json_out)
{
    char pfx[LLMDD_META_PREFIX_MAX + 16], val[LLMDD_META_VALUE_MAX + 1];
    llmdd__etcd e;
    cJSON *j = NULL;
    int64_t rev;

    if (!llmdd__meta_prefix_valid(prefix) || etcd_setup(&e, server) != 0)
        return LLM_PARAM_INVALID;
    snprintf(pfx, sizeof(pfx), "%s/clusters/", prefix);
    int rc = llmdd__etcd_range_prefix(&e, pfx, false, -1, deadline_ms, &j, &rev);
    if (rc != ETCD_OK)
        return etcd_status(rc);
    cJSON *arr = cJSON_CreateArray();
    const cJSON *kv;
    if (arr == NULL) {
        cJSON_Delete(j);
        return LLM_OUT_OF_MEMORY;
    }
    cJSON_ArrayForEach(kv, cJSON_GetObjectItemCaseSensitive(j, "kvs"))
    {
        llmdd__meta_entry ent;
        long n = llmdd__etcd_kv_bytes(kv, "value", val, sizeof(val));
        if (n <= 0 ||
            llmdd__meta_entry_decode(val, (size_t)n, &ent) != LLM_SUCCESS)
            continue;
        cJSON *item = cJSON_Parse(val);
        if (item != NULL)
            cJSON_AddItemToArray(arr, item);
    }
    cJSON_Delete(j);
    char *s = arr != NULL ? cJSON_PrintUnformatted(arr) : NULL;
    cJSON_Delete(arr);
    if (s == NULL)
        return LLM_OUT_OF_MEMORY;
    *json_out = s;
    return LLM_SUCCESS;
}
