#include "transport/serve.h"

#include <stdlib.h>
#include <sys/socket.h>
#include <unistd.h>

#include "core/internal.h"

void
llmdd__serve_init(llmdd__serve_set *set, pthread_mutex_t *lock,
                  pthread_cond_t *cond, const bool *down, int max)
{
    set->lock = lock;
    set->cond = cond;
    set->down = down;
    set->max = max < LLMDD__SERVE_MAX ? max : LLMDD__SERVE_MAX;
    set->n = 0;
}

bool
llmdd__serve_track(llmdd__serve_set *set, int fd, bool add)
{
    bool ok = true;

    pthread_mutex_lock(set->lock);
    if (add) {
        ok = !*set->down && set->n < set->max;
        if (ok) {
            set->conn[set->n].fd = fd;
            set->conn[set->n].cache_id = 0;
            set->n++;
        }
    } else {
        for (int i = 0; i < set->n; i++) {
            if (set->conn[i].fd == fd) {
                set->conn[i] = set->conn[--set->n];
                break;
            }
        }
        if (set->cond != NULL)
            pthread_cond_broadcast(set->cond);
    }
    pthread_mutex_unlock(set->lock);
    return ok;
}

void
llmdd__serve_shutdown(llmdd__serve_set *set)
{
    for (int i = 0; i < set->n; i++)
        shutdown(set->conn[i].fd, SHUT_RDWR);
}

bool
llmdd__serve_wait_idle(llmdd__serve_set *set, int64_t deadline_ms)
{
    pthread_mutex_lock(set->lock);
    while (set->n > 0 && llmdd__now_ms() < deadline_ms)
        llmdd__cond_wait_until(set->cond, set->lock, deadline_ms);
    bool idle = set->n == 0;
    pthread_mutex_unlock(set->lock);
    return idle;
}

struct serve_job {
    llmdd__link *link;
    void (*fn)(void *, int);
    void *owner;
    int fd;
};

static void *
serve_job_main(void *p)
{
    struct serve_job j = *(struct serve_job *)p;

    free(p);
    j.fn(j.owner, j.fd);
    llmdd__link_put(j.link);
    return NULL;
}

int
llmdd__serve_spawn(llmdd__link *link, void (*fn)(void *, int), void *owner,
                   int fd)
{
    struct serve_job *j = fd < 0 ? NULL : malloc(sizeof(*j));

    if (j == NULL) {
        if (fd >= 0)
            close(fd);
        return -1;
    }
    *j = (struct serve_job){.link = link, .fn = fn, .owner = owner, .fd = fd};
    llmdd__link_hold(link);
    if (llmdd__spawn(link->dd, serve_job_main, j) != 0) {
        close(fd);
        free(j);
        llmdd__link_put(link);
        return -1;
    }
    return 0;
}
