#include <errno.h>
#include <stdatomic.h>
#include <fcntl.h>
#include <poll.h>
#include <stdio.h>
#include <string.h>
#include <sys/random.h>
#include <stdlib.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include "core/internal.h"

int
llmdd__random(void *buf, size_t len)
{
    uint8_t *p = buf;

    while (len > 0) {
        ssize_t n = getrandom(p, len, 0);
        if (n < 0) {
            if (errno == EINTR)
                continue;
            return -1;
        }
        p += n;
        len -= (size_t)n;
    }
    return 0;
}

static uint8_t boot_id[LLMDD_BOOT_ID_LEN];
static pthread_once_t boot_once = PTHREAD_ONCE_INIT;

static int
hexval(int c)
{
    if (c >= '0' && c <= '9')
        return c - '0';
    if (c >= 'a' && c <= 'f')
        return c - 'a' + 10;
    if (c >= 'A' && c <= 'F')
        return c - 'A' + 10;
    return -1;
}

static void
boot_id_read(void)
{
    char text[64];
    size_t n = 0;
    int fd = open("/proc/sys/kernel/random/boot_id", O_RDONLY | O_CLOEXEC);

    if (fd >= 0) {
        ssize_t r = read(fd, text, sizeof(text) - 1);
        n = r > 0 ? (size_t)r : 0;
        close(fd);
    }
    text[n] = '\0';
    size_t k = 0;
    for (size_t i = 0; i + 1 < n && k < LLMDD_BOOT_ID_LEN; i++) {
        int hi = hexval(text[i]), lo = hexval(text[i + 1]);
        if (hi < 0 || lo < 0)
            continue;
        boot_id[k++] = (uint8_t)(hi << 4 | lo);
        i++;
    }
    if (k != LLMDD_BOOT_ID_LEN) {
        /* Unknown kernel: a random id, so no peer ever looks same-host. */
        log_warn("cannot read the kernel boot id; same-host transports off");
        llmdd__random(boot_id, sizeof(boot_id));
    }
}

const uint8_t *
llmdd__boot_id(void)
{
    pthread_once(&boot_once, boot_id_read);
    return boot_id;
}

bool
llmdd__peer_same_kernel(const llmdd__peer *p)
{
    return memcmp(p->boot_id, llmdd__boot_id(), LLMDD_BOOT_ID_LEN) == 0;
}

void
llmdd__cond_init(pthread_cond_t *cond)
{
    pthread_condattr_t ca;

    pthread_condattr_init(&ca);
    pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
    pthread_cond_init(cond, &ca);
    pthread_condattr_destroy(&ca);
}

void
llmdd__cond_wait_until(pthread_cond_t *cond, pthread_mutex_t *mutex,
                       int64_t deadline_ms)
{
    struct timespec ts;

    if (deadline_ms == INT64_MAX) {
        pthread_cond_wait(cond, mutex);
        return;
    }
    ts.tv_sec = (time_t)(deadline_ms / 1000);
    ts.tv_nsec = (long)(deadline_ms % 1000) * 1000000;
    pthread_cond_timedwait(cond, mutex, &ts);
}

struct spawn_arg {
    llmdd *dd;
    void *(*fn)(void *);
    void *arg;
};

static void *
spawn_main(void *p)
{
    struct spawn_arg a = *(struct spawn_arg *)p;

    free(p);
    a.fn(a.arg);
    pthread_mutex_lock(&a.dd->lock);
    a.dd->nthreads--;
    pthread_cond_broadcast(&a.dd->cond);
    pthread_mutex_unlock(&a.dd->lock);
    return NULL;
}

int
llmdd__spawn(llmdd *dd, void *(*fn)(void *), void *arg)
{
    struct spawn_arg *a = malloc(sizeof(*a));
    pthread_attr_t attr;
    pthread_t t;
    int rc;

    if (a == NULL)
        return -1;
    a->dd = dd;
    a->fn = fn;
    a->arg = arg;
    pthread_mutex_lock(&dd->lock);
    dd->nthreads++;
    pthread_mutex_unlock(&dd->lock);
    pthread_attr_init(&attr);
    pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
    pthread_attr_setstacksize(&attr, 1024 * 1024);
    rc = pthread_create(&t, &attr, spawn_main, a);
    pthread_attr_destroy(&attr);
    if (rc != 0) {
        free(a);
        pthread_mutex_lock(&dd->lock);
        dd->nthreads--;
        pthread_cond_broadcast(&dd->cond);
        pthread_mutex_unlock(&dd->lock);
        log_error("pthread_create: %s", strerror(rc));
        return -1;
    }
    return 0;
}

void
llmdd__assist_init(llmdd__assist *a)
{
    memset(a, 0, sizeof(*a));
    pthread_mutex_init(&a->lock, NULL);
    pthread_cond_init(&a->cond, NULL);
}

void
llmdd__assist_fini(llmdd__assist *a)
{
    pthread_cond_destroy(&a->cond);
    pthread_mutex_destroy(&a->lock);
}

/* a->lock held: the oldest listed work with pieces left, or NULL. */
static llmdd__share *
share_next(llmdd__assist *a)
{
    for (llmdd__share *s = a->shares; s != NULL; s = s->next)
        if (!s->empty)
            return s;
    return NULL;
}

static void *
assist_main(void *p)
{
    llmdd__assist *a = &((llmdd *)p)->assist;

    pthread_mutex_lock(&a->lock);
    for (;;) {
        llmdd__share *s = NULL;
        while (a->fn == NULL && (s = share_next(a)) == NULL &&
               !(a->stop && a->shares == NULL))
            pthread_cond_wait(&a->cond, &a->lock);
        if (a->fn != NULL) {
            void *(*fn)(void *) = a->fn;
            void *arg = a->arg;
            a->fn = NULL;
            pthread_mutex_unlock(&a->lock);
            fn(arg);
            pthread_mutex_lock(&a->lock);
            a->done = true;
            pthread_cond_broadcast(&a->cond);
            continue;
        }
        if (s == NULL) /* stopped, nothing posted or listed */
            break;
        s->moving++;
        pthread_mutex_unlock(&a->lock);
        bool more = s->piece(s);
        pthread_mutex_lock(&a->lock);
        if (!more)
            s->empty = true;
        if (--s->moving == 0)
            pthread_cond_broadcast(&a->cond);
    }
    a->running = false;
    pthread_cond_broadcast(&a->cond);
    pthread_mutex_unlock(&a->lock);
    return NULL;
}

/* a->lock held: the thread runs, started if need be; false when stopped or
 * it cannot start. */
static bool
assist_running(llmdd *dd)
{
    llmdd__assist *a = &dd->assist;

    if (a->stop)
        return false;
    if (!a->running) {
        if (llmdd__spawn(dd, assist_main, dd) != 0)
            return false;
        a->running = true;
    }
    return true;
}

bool
llmdd__share_begin(llmdd *dd, llmdd__share *s, bool (*piece)(llmdd__share *))
{
    llmdd__assist *a = &dd->assist;

    *s = (llmdd__share){.piece = piece};
    pthread_mutex_lock(&a->lock);
    bool ok = assist_running(dd);
    if (ok) {
        llmdd__share **t = &a->shares;
        while (*t != NULL)
            t = &(*t)->next;
        *t = s;
        pthread_cond_broadcast(&a->cond);
    }
    pthread_mutex_unlock(&a->lock);
    return ok;
}

void
llmdd__share_end(llmdd *dd, llmdd__share *s)
{
    llmdd__assist *a = &dd->assist;

    pthread_mutex_lock(&a->lock);
    for (llmdd__share **t = &a->shares; *t != NULL; t = &(*t)->next)
        if (*t == s) {
            *t = s->next;
            break;
        }
    while (s->moving > 0)
        pthread_cond_wait(&a->cond, &a->lock);
    if (a->shares == NULL)
        pthread_cond_broadcast(&a->cond); /* a stop may wait for this */
    pthread_mutex_unlock(&a->lock);
}

bool
llmdd__assist_post(llmdd *dd, void *(*fn)(void *), void *arg)
{
    llmdd__assist *a = &dd->assist;

    pthread_mutex_lock(&a->lock);
    if (a->busy || !assist_running(dd)) {
        pthread_mutex_unlock(&a->lock);
        return false;
    }
    a->busy = true;
    a->done = false;
    a->fn = fn;
    a->arg = arg;
    pthread_cond_broadcast(&a->cond);
    pthread_mutex_unlock(&a->lock);
    return true;
}

void
llmdd__assist_wait(llmdd *dd)
{
    llmdd__assist *a = &dd->assist;

    pthread_mutex_lock(&a->lock);
    while (!a->done)
        pthread_cond_wait(&a->cond, &a->lock);
    a->busy = false;
    pthread_mutex_unlock(&a->lock);
}

void
llmdd__assist_stop(llmdd *dd)
{
    llmdd__assist *a = &dd->assist;

    pthread_mutex_lock(&a->lock);
    a->stop = true;
    pthread_cond_broadcast(&a->cond);
    while (a->running)
        pthread_cond_wait(&a->cond, &a->lock);
    pthread_mutex_unlock(&a->lock);
}
