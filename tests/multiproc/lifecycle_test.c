/*
 * Lifecycles that serving frameworks use (docs/model.md, "Concurrent link
 * and unlink calls"), called the way such a framework calls them:
 * - two threads link the same cluster at once, each in a retry loop on the
 *   retryable statuses (LLM_LINK_BUSY, LLM_PROCESSING_LINK, LLM_TIMEOUT):
 *   while one call runs, the other is LLM_PROCESSING_LINK at once, and so is
 *   an unlink of that cluster; the retry loop then ends with the link made
 *   (LLM_ALREADY_LINK: the other thread's call made it), and one link works;
 * - a forced unlink while posted pulls from the peer are in flight, over tcp
 *   and shm: when it returns, every one of them has ended, and not a byte
 *   lands in the destination after that.
 */
#include <pthread.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>

#include "harness/mp.h"

#define PROMPT 1

static int
teardown(void **state)
{
    (void)state;
    mp_reap_all();
    return 0;
}

static bool
retryable(llmdd_status st)
{
    return st == LLM_LINK_BUSY || st == LLM_PROCESSING_LINK ||
           st == LLM_TIMEOUT;
}

struct linker {
    llmdd *dd;
    uint16_t port;
    pthread_mutex_t *lock;
    pthread_cond_t *cond;
    pthread_barrier_t *start;
    bool first_done;
    llmdd_status first, last;
    int attempts;
};

/* A framework's link loop: retries the retryable statuses, with back-off. */
static void *
linker_main(void *arg)
{
    struct linker *l = arg;
    int64_t end = th_now_ms() + 20000;
    int pause = 5;

    pthread_barrier_wait(l->start);
    llmdd_status st = th_link(l->dd, PROMPT, MP_IP, l->port, 10000);
    pthread_mutex_lock(l->lock);
    l->first = st;
    l->first_done = true;
    pthread_cond_broadcast(l->cond);
    pthread_mutex_unlock(l->lock);
    l->attempts = 1;
    while (retryable(st) && th_now_ms() < end) {
        th_sleep_ms(pause); /* the retry loop's back-off, not a wait */
        pause = pause * 2 > 100 ? 100 : pause * 2;
        st = th_link(l->dd, PROMPT, MP_IP, l->port, 10000);
        l->attempts++;
    }
    l->last = st;
    return NULL;
}

static void
test_concurrent_link_calls(void **state)
{
    pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
    pthread_cond_t cond = PTHREAD_COND_INITIALIZER;
    pthread_barrier_t start;
    struct linker ls[2];
    pthread_t t[2];

    (void)state;
    th_proc *p = mp_peer_start(PROMPT, NULL);
    llmdd *dd = mp_decoder(MP_SELF, NULL, 0);
    /* Stopped, the peer takes the connection (its kernel does) and answers
     * nothing: the first link call stays in flight until it runs again. */
    mp_peer_stop(p);
    assert_int_equal(pthread_barrier_init(&start, NULL, 2), 0);
    for (int i = 0; i < 2; i++) {
        ls[i] = (struct linker){.dd = dd,
                                .port = p->port,
                                .lock = &lock,
                                .cond = &cond,
                                .start = &start};
        assert_int_equal(pthread_create(&t[i], NULL, linker_main, &ls[i]), 0);
    }
    /* One of the two calls returns while the other is in flight. */
    int64_t end = th_now_ms() + 5000;
    int first = -1;
    pthread_mutex_lock(&lock);
    while (first < 0 && th_now_ms() < end) {
        first = ls[0].first_done ? 0 : ls[1].first_done ? 1 : -1;
        if (first < 0) {
            struct timespec ts;
            clock_gettime(CLOCK_REALTIME, &ts);
            ts.tv_nsec += 50 * 1000000L;
            if (ts.tv_nsec >= 1000000000L) {
                ts.tv_sec++;
                ts.tv_nsec -= 1000000000L;
            }
            pthread_cond_timedwait(&cond, &lock, &ts);
        }
    }
    bool other_running = first >= 0 && !ls[1 - first].first_done;
    llmdd_status first_st = first >= 0 ? ls[first].first : LLM_FAILED;
    pthread_mutex_unlock(&lock);
    /* An unlink of the cluster meanwhile: the link call still runs. */
    llmdd_status unlinked = th_unlink(dd, PROMPT, MP_IP, p->port, false, 1000);
    th_proc_kill(p, SIGCONT);
    for (int i = 0; i < 2; i++)
        pthread_join(t[i], NULL);
    pthread_barrier_destroy(&start);
    fprintf(stderr,
            "concurrent link: first return %s (other running: %d), unlink "
            "meanwhile %s; ends %s/%s after %d/%d attempts\n",
            llmdd_status_str(first_st), other_running,
            llmdd_status_str(unlinked), llmdd_status_str(ls[0].last),
            llmdd_status_str(ls[1].last), ls[0].attempts, ls[1].attempts);

    assert_true(first >= 0);
    assert_true(other_running);
    assert_int_equal(first_st, LLM_PROCESSING_LINK);
    assert_int_equal(unlinked, LLM_PROCESSING_LINK);
    /* The call that ran made the link; the retry loop found it made. */
    assert_int_equal(ls[1 - first].first, LLM_SUCCESS);
    assert_int_equal(ls[1 - first].last, LLM_SUCCESS);
    assert_int_equal(ls[first].last, LLM_ALREADY_LINK);
    assert_int_equal(mp_pull_check(dd, PROMPT, p->ids.kv, 1), LLM_SUCCESS);
    assert_int_equal(th_unlink(dd, PROMPT, MP_IP, p->port, false, 2000),
                     LLM_SUCCESS);
    assert_int_equal(llmdd_check_link(dd, PROMPT, 1000), LLM_NOT_YET_LINK);
    llmdd_destroy(dd);
}

#define FORCE_ROUNDS 6
#define FORCE_PULLS 8
#define FORCE_MIB 8 /* per tensor, 2 tensors, 4 slots: 4 MiB a pull */

static void
force_unlink_rounds(const char *transport, int *ended_early)
{
    const char *args[] = {"--role", "prompt", "--transport", transport, NULL};
    llmdd_option o = {"llm.Transport", transport};
    llmdd_cache_desc d = {.num_tensors = 2,
                          .data_type = LLMDD_DT_UINT8,
                          .num_dims = 2,
                          .shape = {4, (int64_t)FORCE_MIB << 18}};
    llmdd_request *reqs[FORCE_PULLS];
    char cmd[64], reply[128];
    llmdd_cache kv;

    th_proc *p = mp_peer_start(PROMPT, args);
    snprintf(cmd, sizeof(cmd), "alloc-big %d 2 7", FORCE_MIB);
    assert_int_equal(th_proc_cmd(p, cmd, reply, sizeof(reply)), 0);
    int64_t src = atoll(reply + 3);
    llmdd *dd = mp_decoder(MP_SELF, &o, 1);
    assert_int_equal(llmdd_allocate_cache(dd, &d, &kv), LLM_SUCCESS);
    uint64_t size = th_tensor_size(&d);

    for (int r = 0; r < FORCE_ROUNDS; r++) {
        assert_int_equal(th_link_retry(dd, PROMPT, MP_IP, p->port, 3000),
                         LLM_SUCCESS);
        for (int i = 0; i < FORCE_PULLS; i++) {
            llmdd_cache_index from = {.cluster_id = PROMPT,
                                      .cache_id = src,
                                      .batch_index = (uint32_t)i % 4};
            assert_int_equal(llmdd_pull_kv_cache_async(dd, &from, &kv,
                                                       (uint32_t)i % 4, -1,
                                                       NULL, NULL, &reqs[i]),
                             LLM_SUCCESS);
        }
        assert_int_equal(th_unlink(dd, PROMPT, MP_IP, p->port, true, 3000),
                         LLM_SUCCESS);
        /* Ended, every one, when the unlink returned. */
        for (int i = 0; i < FORCE_PULLS; i++) {
            llmdd_status st = llmdd_request_wait(reqs[i], 0);
            if (st == LLM_WAIT_PROC_TIMEOUT)
                fail_msg("%s round %d: pull %d still in flight after the "
                         "forced unlink returned",
                         transport, r, i);
            *ended_early += st != LLM_SUCCESS;
        }
        for (uint32_t t = 0; t < 2; t++)
            memset((void *)(uintptr_t)kv.tensor_addrs[t], 0xA5, size);
        th_sleep_ms(200); /* anything late would land meanwhile */
        for (uint32_t t = 0; t < 2; t++) {
            const uint8_t *m = (const uint8_t *)(uintptr_t)kv.tensor_addrs[t];
            for (uint64_t i = 0; i < size; i++)
                if (m[i] != 0xA5)
                    fail_msg("%s round %d: byte %llu of tensor %u written "
                             "after the forced unlink",
                             transport, r, (unsigned long long)i, t);
        }
        for (int i = 0; i < FORCE_PULLS; i++)
            llmdd_request_free(reqs[i]);
    }
    /* The peer is fine and links again: the bytes of a pull are right. */
    assert_int_equal(th_link_retry(dd, PROMPT, MP_IP, p->port, 3000),
                     LLM_SUCCESS);
    assert_int_equal(mp_pull_check(dd, PROMPT, p->ids.kv, 1), LLM_SUCCESS);
    llmdd_destroy(dd);
    assert_int_equal(th_proc_stop(p), 0);
}

static void
test_force_unlink_ends_transfers(void **state)
{
    (void)state;
    int ended_early = 0;
    force_unlink_rounds("tcp", &ended_early);
    mp_reap_all();
    force_unlink_rounds("shm", &ended_early);
    fprintf(stderr, "force unlink: %d of %d pulls ended by it\n", ended_early,
            2 * FORCE_ROUNDS * FORCE_PULLS);
    /* Some pulls were in flight when unlink was called: it ended them. */
    assert_true(ended_early > 0);
}

int
main(int argc, char **argv)
{
    th_test_filter(argc, argv);
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_teardown(test_concurrent_link_calls, teardown),
        cmocka_unit_test_teardown(test_force_unlink_ends_transfers, teardown),
    };
    return cmocka_run_group_tests_name("multiproc.lifecycle", tests, NULL,
                                       NULL);
}
