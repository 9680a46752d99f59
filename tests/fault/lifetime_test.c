/*
 * Requests outlive their instance, and hold nothing but memory. In one
 * process (the loop transport), so that ASan and TSan see every thread:
 *
 * - one thread waits on a request that never ends by itself (a layer-wise
 *   push with no layer marked) while another destroys the instance: the
 *   wait returns LLM_FAILED, every round, and wait, cancel and layer_ready
 *   after destroy answer from the request alone;
 * - free races a wait in progress on another thread: the wait returns
 *   LLM_FAILED and the memory goes when it leaves;
 * - a request holds no descriptor: with the fd limit 64 above what is open,
 *   2000 posted pulls held at once all post and finish, and the process
 *   holds no more descriptors after them than a bounded set of workers;
 * - the completion queue: each request posted with LLMDD_XFER_COMPLETION
 *   is collected exactly once, by one of two threads collecting at once;
 *   the fd is readable exactly while some wait; one freed before it was
 *   collected leaves the queue; requests without the flag never appear.
 *
 *   lifetime_test
 */
#include <dirent.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <unistd.h>
#include <poll.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>

#include "harness/fault_util.h"

#define PEER 1
#define SELF 2

static llmdd_cache_desc
desc(uint32_t batch)
{
    llmdd_cache_desc d = {.num_tensors = 4,
                          .data_type = LLMDD_DT_UINT8,
                          .num_dims = 2,
                          .shape = {batch, 4096}};
    return d;
}

/* A prompt listening on loopback and a decoder linked to it, in-process. */
typedef struct {
    llmdd *prompt, *dec;
    llmdd_cache pkv, dkv;
} pair;

static void
pair_up(pair *p, uint32_t batch)
{
    llmdd_option o = {"llm.Transport", "loop"};
    llmdd_cache_desc d = desc(batch);
    uint16_t port;

    assert_int_equal(llmdd_create(PEER, LLMDD_ROLE_PROMPT, &p->prompt),
                     LLM_SUCCESS);
    assert_int_equal(th_init_listen(p->prompt, "127.0.0.1", &port, &o, 1),
                     LLM_SUCCESS);
    assert_int_equal(llmdd_create(SELF, LLMDD_ROLE_MIX, &p->dec),
                     LLM_SUCCESS);
    assert_int_equal(llmdd_initialize(p->dec, &o, 1), LLM_SUCCESS);
    assert_int_equal(llmdd_allocate_cache(p->prompt, &d, &p->pkv),
                     LLM_SUCCESS);
    assert_int_equal(llmdd_allocate_cache(p->dec, &d, &p->dkv), LLM_SUCCESS);
    th_fill(&p->pkv, 3);
    assert_int_equal(th_link(p->dec, PEER, "127.0.0.1", port, 2000),
                     LLM_SUCCESS);
}

static void
pair_down(pair *p)
{
    llmdd_destroy(p->dec);
    llmdd_destroy(p->prompt);
    p->dec = p->prompt = NULL;
}

/* A request that ends only by cancel, free or finalize. */
static llmdd_request *
post_endless(pair *p)
{
    llmdd_cache_index dst = {PEER, p->pkv.cache_id, 0};
    llmdd_xfer_opts lw = {.flags = LLMDD_XFER_LAYERWISE};
    llmdd_request *req = NULL;

    assert_int_equal(llmdd_push_kv_cache_async(p->dec, &p->dkv, &dst, 0, -1,
                                               NULL, &lw, &req),
                     LLM_SUCCESS);
    return req;
}

typedef struct {
    llmdd_request *req;
    llmdd_status st;
    atomic_int tid; /* set just before the wait */
    int spin;       /* yields before it: spreads the waits over a destroy */
} waiter;

static void *
waiter_main(void *arg)
{
    waiter *w = arg;

    for (int i = 0; i < w->spin; i++)
        sched_yield();
    atomic_store(&w->tid, (int)gettid());
    w->st = llmdd_request_wait(w->req, -1);
    return NULL;
}

/*
 * Until the waiter sleeps: the one place it can is inside the wait (the
 * kernel's view of the thread, /proc/self/task/TID/stat, not a guess).
 */
static void
until_inside(waiter *w)
{
    char path[64], buf[256];

    while (atomic_load(&w->tid) == 0)
        sched_yield();
    snprintf(path, sizeof(path), "/proc/self/task/%d/stat",
             atomic_load(&w->tid));
    for (;;) {
        FILE *f = fopen(path, "r");
        assert_non_null(f);
        size_t n = fread(buf, 1, sizeof(buf) - 1, f);
        fclose(f);
        buf[n] = '\0';
        const char *st = strrchr(buf, ')');
        if (st != NULL && st[1] == ' ' && st[2] == 'S')
            return;
        sched_yield();
    }
}

#define WAITERS 4

static void
test_wait_races_destroy(void **state)
{
    int rounds = (int)fu_env("LLMDD_FAULT_ITERS", FU_SLOW > 1 ? 60 : 200);

    (void)state;
    for (int i = 0; i < rounds; i++) {
        pair p;
        pair_up(&p, 2);
        llmdd_request *req = post_endless(&p);
        waiter w[WAITERS];
        pthread_t t[WAITERS];
        for (int k = 0; k < WAITERS; k++) {
            w[k] = (waiter){.req = req,
                            .st = LLM_SUCCESS,
                            .spin = k == 0 ? 0 : rand() % (200 << k)};
            assert_int_equal(pthread_create(&t[k], NULL, waiter_main, &w[k]),
                             0);
        }
        /* Either order: the destroy may come before, while or after each
         * waiter enters its wait; in even rounds one is surely inside. */
        if (i % 2 == 0)
            until_inside(&w[0]);
        pair_down(&p);
        for (int k = 0; k < WAITERS; k++) {
            assert_int_equal(pthread_join(t[k], NULL), 0);
            assert_int_equal(w[k].st, LLM_FAILED);
        }
        /* The request answers alone once its instance is gone. */
        assert_int_equal(llmdd_request_wait(req, 0), LLM_FAILED);
        assert_int_equal(llmdd_request_cancel(req), LLM_SUCCESS);
        assert_int_equal(llmdd_request_layer_ready(req, 0), LLM_SUCCESS);
        assert_int_equal(llmdd_request_wait(req, -1), LLM_FAILED);
        llmdd_request_free(req);
    }
}

static void
test_free_races_wait(void **state)
{
    pair p;

    (void)state;
    pair_up(&p, 2);
    for (int i = 0; i < 100; i++) {
        waiter w = {.req = post_endless(&p), .st = LLM_SUCCESS};
        pthread_t t;
        assert_int_equal(pthread_create(&t, NULL, waiter_main, &w), 0);
        until_inside(&w); /* a wait that starts after free is an error */
        llmdd_request_free(w.req);
        assert_int_equal(pthread_join(t, NULL), 0);
        assert_int_equal(w.st, LLM_FAILED);
    }
    pair_down(&p);
}

static int
open_fds(void)
{
    DIR *d = opendir("/proc/self/fd");
    int n = 0;

    assert_non_null(d);
    while (readdir(d) != NULL)
        n++;
    closedir(d);
    return n - 3; /* ".", ".." and the DIR's own */
}

#define HELD 2000

static void
test_no_fd_per_request(void **state)
{
    static llmdd_request *reqs[HELD];
    struct rlimit old, low;
    pair p;

    (void)state;
    pair_up(&p, HELD);
    /* Room for the workers' eventfds (one each) and nothing else. */
    int before = open_fds();
    assert_int_equal(getrlimit(RLIMIT_NOFILE, &old), 0);
    low = old;
    low.rlim_cur = (rlim_t)before + 80;
    assert_int_equal(setrlimit(RLIMIT_NOFILE, &low), 0);
    for (int i = 0; i < HELD; i++) {
        llmdd_cache_index src = {PEER, p.pkv.cache_id, (uint32_t)i};
        assert_int_equal(llmdd_pull_kv_cache_async(p.dec, &src, &p.dkv,
                                                   (uint32_t)i, -1, NULL,
                                                   NULL, &reqs[i]),
                         LLM_SUCCESS);
    }
    for (int i = 0; i < HELD; i++)
        assert_int_equal(llmdd_request_wait(reqs[i], -1), LLM_SUCCESS);
    int during = open_fds();
    for (int i = 0; i < HELD; i++)
        llmdd_request_free(reqs[i]);
    assert_int_equal(setrlimit(RLIMIT_NOFILE, &old), 0);
    /* Only the workers' eventfds (at most 64), never one per request. */
    assert_in_range(during - before, 0, 64);
    assert_int_equal(th_check_buf((const uint8_t *)(uintptr_t)
                                      p.dkv.tensor_addrs[1],
                                  4096 * HELD, 3, 1),
                     -1);
    pair_down(&p);
}

#define NCOMP 600

typedef struct {
    llmdd *dd;
    int fd;
    atomic_int *left;
    llmdd_request *got[NCOMP]; /* what this collector took, in order */
    int ngot;
} collector;

/* Collects until every request was taken by one of the collectors. */
static void *
collector_main(void *arg)
{
    collector *c = arg;
    size_t n;

    while (atomic_load(c->left) > 0) {
        struct pollfd pfd = {.fd = c->fd, .events = POLLIN};
        if (poll(&pfd, 1, 50) <= 0)
            continue;
        assert_int_equal(llmdd_get_completions(c->dd, c->got + c->ngot,
                                               NCOMP - (size_t)c->ngot, &n),
                         LLM_SUCCESS);
        c->ngot += (int)n;
        atomic_fetch_sub(c->left, (int)n);
    }
    return NULL;
}

static bool
readable(int fd)
{
    struct pollfd pfd = {.fd = fd, .events = POLLIN};

    return poll(&pfd, 1, 0) == 1;
}

static void
test_completions(void **state)
{
    static llmdd_request *reqs[NCOMP];
    atomic_int left = NCOMP;
    llmdd_xfer_opts done = {.flags = LLMDD_XFER_COMPLETION};
    llmdd_request *out[4], *plain, *freed;
    size_t n;
    pair p;

    (void)state;
    pair_up(&p, NCOMP); /* a slot each: the pulls run at once */
    int fd = llmdd_completion_fd(p.dec);
    assert_true(fd >= 0);
    assert_false(readable(fd));
    assert_int_equal(llmdd_get_completions(p.dec, out, 4, &n), LLM_SUCCESS);
    assert_int_equal(n, 0);
    assert_int_equal(llmdd_get_completions(p.dec, NULL, 4, &n),
                     LLM_PARAM_INVALID);
    assert_int_equal(llmdd_get_completions(p.dec, out, 4, NULL),
                     LLM_PARAM_INVALID);

    /* Without the flag: never queued. With it, but freed first: gone. */
    llmdd_cache_index src = {PEER, p.pkv.cache_id, 0};
    assert_int_equal(llmdd_pull_kv_cache_async(p.dec, &src, &p.dkv, 0, -1,
                                               NULL, NULL, &plain),
                     LLM_SUCCESS);
    assert_int_equal(llmdd_pull_kv_cache_async(p.dec, &src, &p.dkv, 1, -1,
                                               NULL, &done, &freed),
                     LLM_SUCCESS);
    assert_int_equal(llmdd_request_wait(plain, -1), LLM_SUCCESS);
    assert_int_equal(llmdd_request_wait(freed, -1), LLM_SUCCESS);
    assert_true(readable(fd));
    llmdd_request_free(freed);
    assert_false(readable(fd));
    assert_int_equal(llmdd_get_completions(p.dec, out, 4, &n), LLM_SUCCESS);
    assert_int_equal(n, 0);
    llmdd_request_free(plain);

    /* Two collectors at once: every request exactly once. */
    static collector c[2];
    pthread_t t[2];
    int posted = 0;
    for (int k = 0; k < 2; k++)
        c[k] = (collector){.dd = p.dec, .fd = fd, .left = &left};
    for (int i = 0; i < NCOMP; i++) {
        src.batch_index = (uint32_t)i;
        /* Every fifth one is refused at post: nothing to collect. */
        if (i % 5 == 4)
            src.cache_id = 999;
        assert_int_equal(llmdd_pull_kv_cache_async(p.dec, &src, &p.dkv,
                                                   (uint32_t)i, -1, NULL,
                                                   &done, &reqs[posted]),
                         i % 5 == 4 ? LLM_KV_CACHE_NOT_EXIST : LLM_SUCCESS);
        src.cache_id = p.pkv.cache_id;
        if (i % 5 == 4)
            atomic_fetch_sub(&left, 1);
        else
            posted++;
        if (i == 0)
            for (int k = 0; k < 2; k++)
                assert_int_equal(
                    pthread_create(&t[k], NULL, collector_main, &c[k]), 0);
    }
    for (int k = 0; k < 2; k++)
        assert_int_equal(pthread_join(t[k], NULL), 0);
    assert_int_equal(c[0].ngot + c[1].ngot, posted);
    for (int i = 0; i < posted; i++) {
        int times = 0;
        for (int k = 0; k < 2; k++)
            for (int g = 0; g < c[k].ngot; g++)
                times += c[k].got[g] == reqs[i];
        assert_int_equal(times, 1);
        assert_int_equal(llmdd_request_wait(reqs[i], 0), LLM_SUCCESS);
        llmdd_request_free(reqs[i]);
    }
    assert_false(readable(fd));

    /* A cancelled request ends too, and is queued once. */
    llmdd_cache_index dst = {PEER, p.pkv.cache_id, 0};
    llmdd_xfer_opts lwdone = {.flags = LLMDD_XFER_LAYERWISE |
                                       LLMDD_XFER_COMPLETION};
    llmdd_request *lw;
    assert_int_equal(llmdd_push_kv_cache_async(p.dec, &p.dkv, &dst, 0, -1,
                                               NULL, &lwdone, &lw),
                     LLM_SUCCESS);
    assert_false(readable(fd));
    assert_int_equal(llmdd_request_cancel(lw), LLM_SUCCESS);
    assert_true(readable(fd));
    assert_int_equal(llmdd_get_completions(p.dec, out, 4, &n), LLM_SUCCESS);
    assert_int_equal(n, 1);
    assert_ptr_equal(out[0], lw);
    assert_int_equal(llmdd_request_wait(lw, 0), LLM_FAILED);
    assert_false(readable(fd));
    llmdd_request_free(lw);
    pair_down(&p);
}

int
main(int argc, char **argv)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_wait_races_destroy),
        cmocka_unit_test(test_free_races_wait),
        cmocka_unit_test(test_no_fd_per_request),
        cmocka_unit_test(test_completions),
    };

    th_test_filter(argc, argv);
    return cmocka_run_group_tests(tests, NULL, NULL);
}
