/*
 * Liveness between real processes (docs/model.md, "Liveness"): this
 * process is the decoder, a peer_helper the prompt.
 *
 * - A peer stopped with SIGSTOP (its kernel still answers TCP, so only the
 *   heartbeats can tell) is declared dead within interval x misses + one
 *   interval (4 s at the defaults): a pull then returns LLM_NOT_YET_LINK,
 *   at once and from then on, the link table agrees (llmdd_check_link),
 *   the drop is counted, and pulls posted meanwhile all end with a
 *   non-success status within their wait time. Once resumed, the peer can
 *   be linked again and pulls verify.
 * - llmdd_check_link: LLM_SUCCESS on a live link, LLM_NOT_YET_LINK
 *   without one, LLM_TIMEOUT while the peer is stopped (shorter than the
 *   heartbeats need to declare it dead), LLM_PARAM_INVALID for no time.
 * - A peer that announced no heartbeats (llm.HeartbeatInterval=0) is
 *   never declared dead for silence: stopped longer than the detection
 *   time, its link survives, on both sides.
 *
 * The partition case (no RST, no FIN) is netns_test's test_partition.
 */
#include <signal.h>
#include <stdlib.h>
#include <string.h>

#include "harness/mp.h"

#if defined(__SANITIZE_THREAD__)
#define SLOW 4
#elif defined(__SANITIZE_ADDRESS__)
#define SLOW 2
#else
#define SLOW 1
#endif

#define MARGIN_MS (1000 * SLOW)
#define DETECT_MS (1000 * 3 + 1000) /* interval x misses + one interval */

static int
teardown(void **state)
{
    (void)state;
    mp_reap_all();
    return 0;
}

/* Over tcp: the peer serves every byte, so its stop holds the transfers
 * (over shm a puller copies shared memory by itself). */
static llmdd *
decoder(void)
{
    llmdd_option o[] = {{"llm.SyncKvCacheWaitTime", "1000"},
                        {"llm.Transport", "tcp"}};

    return mp_decoder(MP_SELF, o, 2);
}

/* The value of a metric line "name value" in the instance's text. */
static long long
metric(llmdd *dd, const char *name)
{
    static char text[1 << 16];
    size_t n = strlen(name);

    llmdd_metrics_text(dd, text, sizeof(text));
    for (const char *p = text; (p = strstr(p, name)) != NULL; p += n)
        if ((p == text || p[-1] == '\n') && p[n] == ' ')
            return atoll(p + n + 1);
    return -1;
}

static void
test_stopped_peer_is_dropped(void **state)
{
    static const char *const args[] = {"--role", "prompt", "--transport",
                                       "tcp", NULL};
    llmdd_request *reqs[8];
    llmdd_cache scratch;
    llmdd_cache_desc d = th_desc_kv();

    (void)state;
    th_proc *p = mp_peer_start(1, args);
    llmdd *dd = decoder();
    assert_int_equal(llmdd_allocate_cache(dd, &d, &scratch), LLM_SUCCESS);
    assert_int_equal(th_link(dd, 1, MP_IP, p->port, 2000), LLM_SUCCESS);
    assert_int_equal(mp_pull_check(dd, 1, p->ids.kv, 1), LLM_SUCCESS);
    assert_int_equal(metric(dd, "llmdd_heartbeat_drops_total"), 0);

    mp_peer_stop(p);
    int64_t t0 = th_now_ms();
    /* Posted while the peer is stopped: each ends within its wait time. */
    llmdd_cache_index src = {1, p->ids.kv, 0};
    for (int i = 0; i < 8; i++)
        assert_int_equal(llmdd_pull_kv_cache_async(dd, &src, &scratch,
                                                   (uint32_t)(i % 4), -1,
                                                   NULL, NULL, &reqs[i]),
                         LLM_SUCCESS);
    for (int i = 0; i < 8; i++) {
        llmdd_status st = llmdd_request_wait(reqs[i], -1);
        assert_true(st == LLM_TIMEOUT || st == LLM_NOT_YET_LINK);
        llmdd_request_free(reqs[i]);
    }
    assert_true(th_now_ms() - t0 <= 1000 + MARGIN_MS);

    /* The link goes within the detection time, and stays gone. */
    llmdd_status st;
    while ((st = mp_pull_status(dd, 1, p->ids.kv)) != LLM_NOT_YET_LINK) {
        assert_int_equal(st, LLM_TIMEOUT);
        if (th_now_ms() - t0 > DETECT_MS + MARGIN_MS)
            fail_msg("a stopped peer still linked after %lld ms",
                     (long long)(th_now_ms() - t0));
    }
    int64_t found = th_now_ms() - t0;
    fprintf(stderr, "# stopped peer declared dead after %lld ms\n",
            (long long)found);
    assert_true(found >= 1000 * 3 - 100); /* not before the misses */
    int64_t t1 = th_now_ms();
    assert_int_equal(mp_pull_status(dd, 1, p->ids.kv), LLM_NOT_YET_LINK);
    assert_int_equal(llmdd_check_link(dd, 1, 1000), LLM_NOT_YET_LINK);
    assert_true(th_now_ms() - t1 < 100 * SLOW); /* at once */
    assert_int_equal(metric(dd, "llmdd_heartbeat_drops_total"), 1);

    th_proc_kill(p, SIGCONT);
    assert_int_equal(th_link_retry(dd, 1, MP_IP, p->port, 3000), LLM_SUCCESS);
    assert_int_equal(mp_pull_check(dd, 1, p->ids.kv, 1), LLM_SUCCESS);
    llmdd_destroy(dd);
    assert_int_equal(th_proc_stop(p), 0);
}

static void
test_check_link(void **state)
{
    static const char *const args[] = {"--role", "prompt", NULL};

    (void)state;
    th_proc *p = mp_peer_start(1, args);
    llmdd *dd = decoder();
    assert_int_equal(llmdd_check_link(dd, 1, 1000), LLM_NOT_YET_LINK);
    assert_int_equal(th_link(dd, 1, MP_IP, p->port, 2000), LLM_SUCCESS);
    assert_int_equal(llmdd_check_link(dd, 1, 1000), LLM_SUCCESS);
    assert_int_equal(llmdd_check_link(dd, 1, 0), LLM_PARAM_INVALID);
    assert_int_equal(llmdd_check_link(dd, 2, 1000), LLM_NOT_YET_LINK);
    assert_int_equal(llmdd_check_link(NULL, 1, 1000), LLM_PARAM_INVALID);
    /* Many at once from this side: each gets its own answer. */
    for (int i = 0; i < 200; i++)
        assert_int_equal(llmdd_check_link(dd, 1, 1000), LLM_SUCCESS);

    mp_peer_stop(p);
    int64_t t0 = th_now_ms();
    assert_int_equal(llmdd_check_link(dd, 1, 300), LLM_TIMEOUT);
    int64_t dt = th_now_ms() - t0;
    assert_true(dt >= 290 && dt <= 300 + MARGIN_MS);
    th_proc_kill(p, SIGCONT);
    assert_int_equal(llmdd_check_link(dd, 1, 1000), LLM_SUCCESS);

    /* The peer asks too (its check-link command). */
    char reply[64];
    assert_int_equal(th_proc_cmd(p, "check-link 100 1000", reply,
                                 sizeof(reply)),
                     0);
    llmdd_destroy(dd);
    assert_int_equal(th_proc_stop(p), 0);
}

static void
test_heartbeats_off_is_never_dead(void **state)
{
    static const char *const args[] = {"--role", "prompt", "--opt",
                                       "llm.HeartbeatInterval=0", NULL};
    char reply[64];

    (void)state;
    th_proc *p = mp_peer_start(1, args);
    llmdd *dd = decoder();
    assert_int_equal(th_link(dd, 1, MP_IP, p->port, 2000), LLM_SUCCESS);
    mp_peer_stop(p);
    th_sleep_ms(DETECT_MS + 500); /* longer than heartbeats would allow */
    th_proc_kill(p, SIGCONT);
    assert_int_equal(mp_pull_check(dd, 1, p->ids.kv, 1), LLM_SUCCESS);
    assert_int_equal(metric(dd, "llmdd_heartbeat_drops_total"), 0);
    /* Its side kept the link too, though it saw nothing of ours while it
     * was stopped: what waited in its socket is read before any verdict. */
    assert_int_equal(th_proc_cmd(p, "check-link 100 1000", reply,
                                 sizeof(reply)),
                     0);
    llmdd_destroy(dd);
    assert_int_equal(th_proc_stop(p), 0);
}

int
main(int argc, char **argv)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_teardown(test_stopped_peer_is_dropped, teardown),
        cmocka_unit_test_teardown(test_check_link, teardown),
        cmocka_unit_test_teardown(test_heartbeats_off_is_never_dead,
                                  teardown),
    };

    th_test_filter(argc, argv);
    return cmocka_run_group_tests_name("multiproc.liveness", tests, NULL,
                                       NULL);
}
