/*
 * Peers that die or stop (docs/model.md, faults): a peer killed
 * while idle, killed in the middle of a 1 GiB pull, stopped (SIGSTOP) in the
 * middle of one, and a non-force unlink of a stopped peer. Each time the
 * decoder gets an error within its wait time, changes nothing it should not,
 * and links again to a fresh peer.
 *
 * The mid-pull cases force the tcp transport: there the peer serves every
 * byte, so its death or silence is what ends the transfer. (With shm the
 * decoder copies from memory the peer has already shared, which a stopped
 * peer does not interrupt; test_stop_query_auto covers what does need the
 * peer there.)
 */
#include <pthread.h>
#include <sched.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>

#include "harness/mp.h"

#define WAIT_MS 3000
#define MARGIN_MS 2000
/* Per tensor, 2 tensors: 1 GiB; a quarter of it under sanitizers, where
 * filling and moving it costs ten times more and the pull is still far
 * longer than the moment it takes to kill or stop the peer. */
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
#define BIG_MIB 128
#else
#define BIG_MIB 512
#endif

static int
teardown(void **state)
{
    (void)state;
    mp_reap_all();
    return 0;
}

static void
test_kill_idle(void **state)
{
    static const char *const args[] = {"--role", "prompt", NULL};
    th_proc *p;
    llmdd *dd;

    (void)state;
    p = mp_peer_start(1, args);
    dd = mp_decoder(MP_SELF, NULL, 0);
    assert_int_equal(th_link(dd, 1, MP_IP, p->port, 2000), LLM_SUCCESS);
    assert_int_equal(mp_pull_check(dd, 1, p->ids.kv, 1), LLM_SUCCESS);

    mp_peer_kill(p);
    /* The control thread notices the closed connection and drops it. */
    assert_int_equal(mp_wait_pull_status(dd, 1, p->ids.kv, LLM_NOT_YET_LINK,
                                         2000),
                     LLM_NOT_YET_LINK);

    /* A fresh peer under the same cluster id. */
    p = mp_peer_start(1, args);
    assert_int_equal(th_link(dd, 1, MP_IP, p->port, 2000), LLM_SUCCESS);
    assert_int_equal(mp_pull_check(dd, 1, p->ids.kv, 1), LLM_SUCCESS);
    assert_int_equal(mp_pull_check(dd, 1, p->ids.reg, 2), LLM_SUCCESS);
    llmdd_destroy(dd);
    assert_int_equal(th_proc_stop(p), 0);
}

/* ---- A big pull on a thread. ---- */

typedef struct {
    llmdd *dd;
    llmdd_cache_index idx;
    llmdd_cache dst;
    llmdd_status st;
    int64_t t_start, t_end;
    pthread_mutex_t lock;
    bool done;
} big_pull;

static void *
big_pull_main(void *arg)
{
    big_pull *b = arg;
    uint64_t all[] = {0, 1, 2, 3};

    llmdd_status st =
        llmdd_pull_kv_blocks(b->dd, &b->idx, &b->dst, all, all, 4, NULL);
    pthread_mutex_lock(&b->lock);
    b->st = st;
    b->t_end = th_now_ms();
    b->done = true;
    pthread_mutex_unlock(&b->lock);
    return NULL;
}

static bool
big_done(big_pull *b)
{
    pthread_mutex_lock(&b->lock);
    bool d = b->done;
    pthread_mutex_unlock(&b->lock);
    return d;
}

/*
 * Starts a peer with a big cache (seed 5), links dd to it over tcp and
 * starts pulling all of it into b->dst. Returns once the first bytes have
 * landed (or the pull ended, or 5 s passed).
 */
static th_proc *
big_pull_start(big_pull *b, pthread_t *t)
{
    static const char *const args[] = {"--role", "prompt", "--transport",
                                       "tcp", NULL};
    char cmd[64], reply[64];
    /* The stopped peer is watched by the wait time here, not declared
     * dead by heartbeats (3 s at the defaults: a race with the wait). */
    llmdd_option o[] = {{"llm.SyncKvCacheWaitTime", "3000"},
                        {"llm.Transport", "tcp"},
                        {"llm.HeartbeatMisses", "10"}};
    llmdd_cache_desc d = {.num_tensors = 2,
                          .data_type = LLMDD_DT_UINT8,
                          .num_dims = 2,
                          .shape = {4, (int64_t)BIG_MIB << 18}};
    th_proc *p;

    memset(b, 0, sizeof(*b));
    pthread_mutex_init(&b->lock, NULL);
    p = mp_peer_start(1, args);
    snprintf(cmd, sizeof(cmd), "alloc-big %d 2 5", BIG_MIB);
    assert_int_equal(th_proc_cmd(p, cmd, reply, sizeof(reply)), 0);
    b->dd = mp_decoder(MP_SELF, o, 3);
    b->idx = (llmdd_cache_index){1, atoll(reply + 3), 0};
    assert_int_equal(llmdd_allocate_cache(b->dd, &d, &b->dst), LLM_SUCCESS);
    assert_int_equal(th_link(b->dd, 1, MP_IP, p->port, 2000), LLM_SUCCESS);

    volatile const uint8_t *t0 =
        (volatile const uint8_t *)(uintptr_t)b->dst.tensor_addrs[0];
    volatile const uint8_t *t1 =
        (volatile const uint8_t *)(uintptr_t)b->dst.tensor_addrs[1];
    b->t_start = th_now_ms();
    assert_int_equal(pthread_create(t, NULL, big_pull_main, b), 0);
    /* Byte 0 of either tensor is nonzero in the pattern (th_byte). */
    while (t0[0] == 0 && t1[0] == 0 && !big_done(b) &&
           th_now_ms() - b->t_start < 5000)
        sched_yield(); /* two cores are shared with the peer */
    return p;
}

static void
big_pull_end(big_pull *b, pthread_t t)
{
    int64_t end = th_now_ms() + WAIT_MS + MARGIN_MS;

    /* Bounded: a pull past its wait time plus the margin is the failure
     * this test exists to catch, and must not hang the suite. */
    while (!big_done(b) && th_now_ms() < end)
        th_sleep_ms(5);
    if (!big_done(b))
        fail_msg("the pull did not return within %d ms of its wait time",
                 MARGIN_MS);
    pthread_join(t, NULL);
}

/* The local cache must not change once the pull has returned. */
static void
assert_quiet_after_return(const llmdd_cache *c)
{
    enum { N = 8, LEN = 4096 };
    static uint8_t snap[2][N][LEN];
    const uint64_t size = (uint64_t)BIG_MIB << 20;

    for (int t = 0; t < 2; t++)
        for (int k = 0; k < N; k++)
            memcpy(snap[t][k],
                   (const uint8_t *)(uintptr_t)c->tensor_addrs[t] +
                       size / N * (uint64_t)k,
                   LEN);
    th_sleep_ms(200);
    for (int t = 0; t < 2; t++)
        for (int k = 0; k < N; k++)
            assert_memory_equal(snap[t][k],
                                (const uint8_t *)(uintptr_t)c->tensor_addrs[t] +
                                    size / N * (uint64_t)k,
                                LEN);
}

static void
relink_fresh_peer(llmdd *dd)
{
    static const char *const args[] = {"--role", "prompt", "--transport",
                                       "tcp", NULL};
    th_proc *p = mp_peer_start(1, args);

    assert_int_equal(th_link_retry(dd, 1, MP_IP, p->port, 3000), LLM_SUCCESS);
    assert_int_equal(mp_pull_check(dd, 1, p->ids.kv, 1), LLM_SUCCESS);
    assert_int_equal(mp_pull_check(dd, 1, p->ids.reg, 2), LLM_SUCCESS);
    assert_int_equal(th_proc_stop(p), 0);
}

static void
test_kill_mid_pull(void **state)
{
    /* Static: the pull thread must never outlive what it writes to, even
     * when an assertion leaves this function early. */
    static big_pull b;
    static pthread_t t;

    (void)state;
    th_proc *p = big_pull_start(&b, &t);
    if (big_done(&b))
        fail_msg("the big pull ended before the peer could be killed (%s)",
                 llmdd_status_str(b.st));
    int64_t t_kill = th_now_ms();
    mp_peer_kill(p);
    big_pull_end(&b, t);
    fprintf(stderr, "# pull ended %lld ms after the kill (%s)\n",
            (long long)(b.t_end - t_kill), llmdd_status_str(b.st));
    if (b.st != LLM_NOT_YET_LINK && b.st != LLM_TIMEOUT)
        fail_msg("pull from a killed peer: %s", llmdd_status_str(b.st));
    assert_true(b.t_end - b.t_start <= WAIT_MS + MARGIN_MS);
    assert_quiet_after_return(&b.dst);

    /* Usable: the link is gone, and a fresh peer links and serves. */
    assert_int_equal(mp_wait_pull_status(b.dd, 1, b.idx.cache_id,
                                         LLM_NOT_YET_LINK, 2000),
                     LLM_NOT_YET_LINK);
    relink_fresh_peer(b.dd);
    llmdd_destroy(b.dd);
    pthread_mutex_destroy(&b.lock);
}

static void
test_stop_mid_pull(void **state)
{
    /* Static: the pull thread must never outlive what it writes to, even
     * when an assertion leaves this function early. */
    static big_pull b;
    static pthread_t t;

    (void)state;
    th_proc *p = big_pull_start(&b, &t);
    if (big_done(&b))
        fail_msg("the big pull ended before the peer could be stopped (%s)",
                 llmdd_status_str(b.st));
    mp_peer_stop(p);
    big_pull_end(&b, t);
    fprintf(stderr, "# pull from a stopped peer ended after %lld ms (%s)\n",
            (long long)(b.t_end - b.t_start), llmdd_status_str(b.st));
    assert_int_equal(b.st, LLM_TIMEOUT);
    assert_true(b.t_end - b.t_start >= WAIT_MS - 100);
    assert_true(b.t_end - b.t_start <= WAIT_MS + MARGIN_MS);
    assert_quiet_after_return(&b.dst);

    /* The peer resumes and is killed; the decoder goes on. */
    th_proc_kill(p, SIGCONT);
    mp_peer_kill(p);
    assert_int_equal(mp_wait_pull_status(b.dd, 1, b.idx.cache_id,
                                         LLM_NOT_YET_LINK, 2000),
                     LLM_NOT_YET_LINK);
    relink_fresh_peer(b.dd);
    llmdd_destroy(b.dd);
    pthread_mutex_destroy(&b.lock);
}

static void
test_stop_query_auto(void **state)
{
    /* Any transport: a cache the decoder has not seen yet must be asked
     * for, and a stopped peer never answers. */
    static const char *const args[] = {"--role", "prompt", NULL};
    llmdd_option o = {"llm.SyncKvCacheWaitTime", "1000"};
    char reply[64];
    th_proc *p;
    llmdd *dd;

    (void)state;
    p = mp_peer_start(1, args);
    assert_int_equal(th_proc_cmd(p, "alloc 6", reply, sizeof(reply)), 0);
    int64_t fresh = atoll(reply + 3);
    dd = mp_decoder(MP_SELF, &o, 1);
    assert_int_equal(th_link(dd, 1, MP_IP, p->port, 2000), LLM_SUCCESS);
    assert_int_equal(mp_pull_check(dd, 1, p->ids.kv, 1), LLM_SUCCESS);

    mp_peer_stop(p);
    int64_t t0 = th_now_ms();
    assert_int_equal(mp_pull_status(dd, 1, fresh), LLM_TIMEOUT);
    int64_t dt = th_now_ms() - t0;
    if (dt < 900 || dt > 1000 + MARGIN_MS)
        fail_msg("a 1000 ms wait ended after %lld ms", (long long)dt);

    th_proc_kill(p, SIGCONT);
    /* Once it answers again, so does the link. */
    assert_int_equal(mp_pull_check(dd, 1, fresh, 6), LLM_SUCCESS);
    llmdd_destroy(dd);
    assert_int_equal(th_proc_stop(p), 0);
}

static void
test_unlink_stopped_peer(void **state)
{
    static const char *const args[] = {"--role", "prompt", NULL};
    th_proc *p;
    llmdd *dd;

    (void)state;
    p = mp_peer_start(1, args);
    dd = mp_decoder(MP_SELF, NULL, 0);
    assert_int_equal(th_link(dd, 1, MP_IP, p->port, 2000), LLM_SUCCESS);
    mp_peer_stop(p);

    int64_t t0 = th_now_ms();
    assert_int_equal(th_unlink(dd, 1, MP_IP, p->port, false, 500),
                     LLM_UNLINK_FAILED);
    int64_t dt = th_now_ms() - t0;
    if (dt < 450 || dt > 500 + MARGIN_MS)
        fail_msg("a 500 ms unlink took %lld ms", (long long)dt);
    /* Gone locally all the same. */
    assert_int_equal(mp_pull_status(dd, 1, p->ids.kv), LLM_NOT_YET_LINK);

    /* Resumed, the peer finds the UNLINK (or the close) and drops its
     * side, so linking again works. */
    th_proc_kill(p, SIGCONT);
    assert_int_equal(th_link_retry(dd, 1, MP_IP, p->port, 3000), LLM_SUCCESS);
    assert_int_equal(mp_pull_check(dd, 1, p->ids.kv, 1), LLM_SUCCESS);
    llmdd_destroy(dd);
    assert_int_equal(th_proc_stop(p), 0);
}

int
main(int argc, char **argv)
{
    th_test_filter(argc, argv);
#define T(f) cmocka_unit_test_teardown(f, teardown)
    const struct CMUnitTest tests[] = {
        T(test_kill_idle),        T(test_kill_mid_pull),
        T(test_stop_mid_pull),    T(test_stop_query_auto),
        T(test_unlink_stopped_peer),
    };
#undef T
    return cmocka_run_group_tests_name("multiproc.peer_fault", tests, NULL,
                                       NULL);
}
