/*
 * Linking across processes (docs/model.md): this process is the decoder,
 * peer_helper processes are prompt instances listening on 127.0.0.1. Link,
 * pull, unlink and relink; the argument checks that come before any
 * connection; refused, silent, duplicate and mistaken links; several
 * clusters in one call.
 */
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "harness/mp.h"

static const char *const prompt_args[] = {"--role", "prompt", NULL};

static int
teardown(void **state)
{
    (void)state;
    mp_reap_all();
    return 0;
}

static void
test_link_pull_unlink_relink(void **state)
{
    th_proc *p;
    llmdd *dd;

    (void)state;
    p = mp_peer_start(1, prompt_args);
    dd = mp_decoder(MP_SELF, NULL, 0);
    assert_int_equal(mp_pull_status(dd, 1, p->ids.kv), LLM_NOT_YET_LINK);

    assert_int_equal(th_link(dd, 1, MP_IP, p->port, 2000), LLM_SUCCESS);
    assert_int_equal(mp_pull_check(dd, 1, p->ids.kv, 1), LLM_SUCCESS);
    assert_int_equal(mp_pull_check(dd, 1, p->ids.reg, 2), LLM_SUCCESS);

    /* Non-force unlink removes both sides: relinking at once works. */
    assert_int_equal(th_unlink(dd, 1, MP_IP, p->port, false, 2000),
                     LLM_SUCCESS);
    assert_int_equal(mp_pull_status(dd, 1, p->ids.kv), LLM_NOT_YET_LINK);
    assert_int_equal(th_link(dd, 1, MP_IP, p->port, 2000), LLM_SUCCESS);
    assert_int_equal(mp_pull_check(dd, 1, p->ids.kv, 1), LLM_SUCCESS);

    /* Force unlink removes our side at once. The peer learns of it only
     * when it sees the connection close, so relinking may race with that. */
    assert_int_equal(th_unlink(dd, 1, MP_IP, p->port, true, 2000),
                     LLM_SUCCESS);
    assert_int_equal(mp_pull_status(dd, 1, p->ids.kv), LLM_NOT_YET_LINK);
    assert_int_equal(th_link_retry(dd, 1, MP_IP, p->port, 2000), LLM_SUCCESS);
    assert_int_equal(mp_pull_check(dd, 1, p->ids.reg, 2), LLM_SUCCESS);

    /* The peer is still fine and answers its pipe. */
    assert_int_equal(th_proc_cmd(p, "ping", NULL, 0), 0);
    llmdd_destroy(dd);
    assert_int_equal(th_proc_stop(p), 0);
}

static void
test_unlink_args(void **state)
{
    llmdd_ip_info ipi[17], none;
    llmdd_cluster_info ci[17];
    llmdd_status rets[17];
    th_proc *p;
    llmdd *dd;

    (void)state;
    p = mp_peer_start(1, prompt_args);
    dd = mp_decoder(MP_SELF, NULL, 0);
    for (int i = 0; i < 17; i++)
        ci[i] = th_cluster(50 + (uint64_t)i, &ipi[i], MP_IP, p->port);

    /* Not linked: success, per cluster too. */
    rets[0] = LLM_FAILED;
    assert_int_equal(llmdd_unlink_clusters(dd, ci, 1, rets, 1000, false),
                     LLM_SUCCESS);
    assert_int_equal(rets[0], LLM_SUCCESS);
    assert_int_equal(llmdd_unlink_clusters(dd, ci, 16, rets, 1000, true),
                     LLM_SUCCESS);
    assert_int_equal(llmdd_unlink_clusters(dd, ci, 16, rets, 1000, false),
                     LLM_SUCCESS);
    for (int i = 0; i < 16; i++)
        assert_int_equal(rets[i], LLM_SUCCESS);

    assert_int_equal(th_link(dd, 1, MP_IP, p->port, 2000), LLM_SUCCESS);
    llmdd_cluster_info one = th_cluster(1, &ipi[0], MP_IP, p->port);
    assert_int_equal(llmdd_unlink_clusters(dd, &one, 1, rets, 0, false),
                     LLM_PARAM_INVALID);
    assert_int_equal(llmdd_unlink_clusters(dd, &one, 1, rets, -1, true),
                     LLM_PARAM_INVALID);
    assert_int_equal(llmdd_unlink_clusters(dd, &one, 0, rets, 1000, false),
                     LLM_PARAM_INVALID);
    assert_int_equal(llmdd_unlink_clusters(dd, NULL, 1, rets, 1000, true),
                     LLM_PARAM_INVALID);
    assert_int_equal(llmdd_unlink_clusters(dd, ci, 17, rets, 1000, false),
                     LLM_CLUSTER_NUM_EXCEED_LIMIT);
    assert_int_equal(llmdd_unlink_clusters(dd, ci, 17, rets, 1000, true),
                     LLM_CLUSTER_NUM_EXCEED_LIMIT);

    /* None of that touched the link. */
    assert_int_equal(mp_pull_check(dd, 1, p->ids.kv, 1), LLM_SUCCESS);

    /* A link is known by its cluster id: addresses are not used, so two, a
     * bad one or none all end it (non-force: the peer is told). */
    llmdd_cluster_info noaddr = {.remote_cluster_id = 1};
    llmdd_ip_info two[2];
    llmdd_cluster_info twoaddr = th_cluster(1, &two[0], MP_IP, p->port);
    two[1] = two[0];
    twoaddr.num_remote_ip_infos = 2;
    llmdd_cluster_info badip = th_cluster(1, &none, "300.0.0.1", p->port);
    const llmdd_cluster_info *ends[] = {&twoaddr, &badip, &noaddr};
    for (size_t i = 0; i < 3; i++) {
        rets[0] = LLM_FAILED;
        assert_int_equal(
            llmdd_unlink_clusters(dd, ends[i], 1, rets, 1000, false),
            LLM_SUCCESS);
        assert_int_equal(rets[0], LLM_SUCCESS);
        assert_int_equal(mp_pull_status(dd, 1, p->ids.kv), LLM_NOT_YET_LINK);
        assert_int_equal(th_link_retry(dd, 1, MP_IP, p->port, 2000),
                         LLM_SUCCESS);
        assert_int_equal(mp_pull_check(dd, 1, p->ids.kv, 1), LLM_SUCCESS);
    }

    /* A force unlink, the same. */
    rets[0] = LLM_FAILED;
    assert_int_equal(llmdd_unlink_clusters(dd, &noaddr, 1, rets, 1000, true),
                     LLM_SUCCESS);
    assert_int_equal(rets[0], LLM_SUCCESS);
    assert_int_equal(mp_pull_status(dd, 1, p->ids.kv), LLM_NOT_YET_LINK);
    llmdd_destroy(dd);
    assert_int_equal(th_proc_stop(p), 0);
}

static void
test_link_args(void **state)
{
    llmdd_ip_info ipi[17], two[2];
    llmdd_cluster_info ci[17];
    llmdd_status rets[17];
    uint16_t port;
    int lfd = th_socket(true, &port);
    llmdd *dd;

    (void)state;
    dd = mp_decoder(MP_SELF, NULL, 0);
    for (int i = 0; i < 17; i++)
        ci[i] = th_cluster(1 + (uint64_t)i, &ipi[i], MP_IP, port);

    assert_int_equal(llmdd_link_clusters(dd, ci, 1, rets, 0),
                     LLM_PARAM_INVALID);
    assert_int_equal(llmdd_link_clusters(dd, ci, 1, rets, -1000),
                     LLM_PARAM_INVALID);
    assert_int_equal(llmdd_link_clusters(dd, ci, 0, rets, 1000),
                     LLM_PARAM_INVALID);
    assert_int_equal(llmdd_link_clusters(dd, NULL, 1, rets, 1000),
                     LLM_PARAM_INVALID);
    assert_int_equal(llmdd_link_clusters(dd, ci, 1, NULL, 1000),
                     LLM_PARAM_INVALID);
    assert_int_equal(llmdd_link_clusters(dd, ci, 17, rets, 1000),
                     LLM_CLUSTER_NUM_EXCEED_LIMIT);

    /* Other than exactly one remote address. */
    llmdd_cluster_info c = ci[0];
    c.num_remote_ip_infos = 0;
    assert_int_equal(llmdd_link_clusters(dd, &c, 1, rets, 1000),
                     LLM_PARAM_INVALID);
    c.remote_ip_infos = NULL;
    assert_int_equal(llmdd_link_clusters(dd, &c, 1, rets, 1000),
                     LLM_PARAM_INVALID);
    c = th_cluster(1, &two[0], MP_IP, port);
    two[1] = two[0];
    c.num_remote_ip_infos = 2;
    assert_int_equal(llmdd_link_clusters(dd, &c, 1, rets, 1000),
                     LLM_PARAM_INVALID);

    /* Addresses that are not addresses. */
    static const char *const bad_ips[] = {
        "300.1.1.1", "localhost", "", "127.0.0.1:80", "[::1]", "1.2.3",
        " 127.0.0.1",
    };
    for (size_t i = 0; i < sizeof(bad_ips) / sizeof(bad_ips[0]); i++) {
        llmdd_ip_info b;
        c = th_cluster(1, &b, bad_ips[i], port);
        if (llmdd_link_clusters(dd, &c, 1, rets, 1000) != LLM_PARAM_INVALID)
            fail_msg("ip \"%s\" accepted", bad_ips[i]);
    }
    /* One bad cluster rejects the whole call, before any connection. */
    llmdd_ip_info b;
    llmdd_cluster_info mixed[3] = {ci[0], ci[1],
                                   th_cluster(9, &b, "1.2.3.999", port)};
    assert_int_equal(llmdd_link_clusters(dd, mixed, 3, rets, 1000),
                     LLM_PARAM_INVALID);

    assert_false(mp_conn_pending(lfd));
    assert_int_equal(mp_pull_status(dd, 1, 1), LLM_NOT_YET_LINK);
    llmdd_destroy(dd);
    close(lfd);
}

static void
test_link_refused_and_silent(void **state)
{
    uint16_t closed_port, silent_port;
    int cfd = th_socket(false, &closed_port); /* bound, not listening */
    int sfd = th_socket(true, &silent_port);  /* listening, never answers */
    llmdd *dd;
    int64_t t0, dt;

    (void)state;
    dd = mp_decoder(MP_SELF, NULL, 0);
    t0 = th_now_ms();
    assert_int_equal(th_link(dd, 1, MP_IP, closed_port, 5000),
                     LLM_LINK_FAILED);
    dt = th_now_ms() - t0;
    if (dt > 1000)
        fail_msg("a refused link took %lld ms", (long long)dt);

    t0 = th_now_ms();
    assert_int_equal(th_link(dd, 1, MP_IP, silent_port, 500), LLM_TIMEOUT);
    dt = th_now_ms() - t0;
    if (dt < 450 || dt > 1500)
        fail_msg("a 500 ms link timed out after %lld ms", (long long)dt);
    assert_true(mp_conn_pending(sfd)); /* it did get that far */

    /* Neither left anything behind. */
    assert_int_equal(mp_pull_status(dd, 1, 1), LLM_NOT_YET_LINK);
    llmdd_destroy(dd);
    close(cfd);
    close(sfd);
}

static void
test_link_duplicate(void **state)
{
    llmdd_ip_info ipi[2];
    llmdd_cluster_info ci[2];
    llmdd_status rets[2];
    th_proc *p;
    llmdd *dd;

    (void)state;
    p = mp_peer_start(1, prompt_args);
    dd = mp_decoder(MP_SELF, NULL, 0);
    assert_int_equal(th_link(dd, 1, MP_IP, p->port, 2000), LLM_SUCCESS);
    ci[0] = th_cluster(1, &ipi[0], MP_IP, p->port);
    rets[0] = LLM_FAILED;
    assert_int_equal(llmdd_link_clusters(dd, ci, 1, rets, 2000),
                     LLM_ALREADY_LINK);
    assert_int_equal(rets[0], LLM_ALREADY_LINK);
    assert_int_equal(mp_pull_check(dd, 1, p->ids.kv, 1), LLM_SUCCESS);

    /* The same cluster twice in one call: one link, one refusal, which is
     * LLM_PROCESSING_LINK while the other job runs and LLM_ALREADY_LINK
     * once it made the link (docs/model.md). */
    assert_int_equal(th_unlink(dd, 1, MP_IP, p->port, false, 2000),
                     LLM_SUCCESS);
    ci[1] = th_cluster(1, &ipi[1], MP_IP, p->port);
    llmdd_status st = llmdd_link_clusters(dd, ci, 2, rets, 2000);
    assert_true(st == LLM_ALREADY_LINK || st == LLM_PROCESSING_LINK);
    assert_true((rets[0] == LLM_SUCCESS && rets[1] == st) ||
                (rets[0] == st && rets[1] == LLM_SUCCESS));
    assert_int_equal(mp_pull_check(dd, 1, p->ids.kv, 1), LLM_SUCCESS);
    llmdd_destroy(dd);
    assert_int_equal(th_proc_stop(p), 0);
}

static void
test_link_wrong_cluster_id(void **state)
{
    th_proc *p;
    llmdd *dd;

    (void)state;
    p = mp_peer_start(1, prompt_args);
    dd = mp_decoder(MP_SELF, NULL, 0);
    /* The peer reports cluster 1; we asked for 7. */
    assert_int_equal(th_link(dd, 7, MP_IP, p->port, 2000), LLM_LINK_FAILED);
    assert_int_equal(mp_pull_status(dd, 7, p->ids.kv), LLM_NOT_YET_LINK);
    assert_int_equal(mp_pull_status(dd, 1, p->ids.kv), LLM_NOT_YET_LINK);
    /* The peer kept nothing of it. */
    assert_int_equal(th_link(dd, 1, MP_IP, p->port, 2000), LLM_SUCCESS);
    assert_int_equal(mp_pull_check(dd, 1, p->ids.kv, 1), LLM_SUCCESS);
    llmdd_destroy(dd);
    assert_int_equal(th_proc_stop(p), 0);
}

static void
test_link_own_cluster_id(void **state)
{
    static const char *const args[] = {"--role", "prompt", NULL};
    th_proc *p;
    llmdd *dd;

    (void)state;
    p = mp_peer_start(MP_SELF, args); /* a peer with our cluster id */
    dd = mp_decoder(MP_SELF, NULL, 0);
    assert_int_equal(th_link(dd, MP_SELF, MP_IP, p->port, 2000),
                     LLM_LINK_FAILED);
    assert_int_equal(th_link(dd, 5, MP_IP, p->port, 2000), LLM_LINK_FAILED);
    /* A decoder with another id links to it. */
    llmdd *other = mp_decoder(MP_SELF + 1, NULL, 0);
    assert_int_equal(th_link(other, MP_SELF, MP_IP, p->port, 2000),
                     LLM_SUCCESS);
    assert_int_equal(mp_pull_check(other, MP_SELF, p->ids.kv, 1), LLM_SUCCESS);
    llmdd_destroy(other);
    llmdd_destroy(dd);
    assert_int_equal(th_proc_stop(p), 0);
}

static void
test_link_several_clusters(void **state)
{
    th_proc *p[3];
    llmdd_ip_info ipi[5];
    llmdd_cluster_info ci[5];
    llmdd_status rets[5];
    uint16_t closed;
    int cfd = th_socket(false, &closed);
    llmdd *dd;

    (void)state;
    for (int i = 0; i < 3; i++)
        p[i] = mp_peer_start(11 + (uint64_t)i, prompt_args);
    dd = mp_decoder(MP_SELF, NULL, 0);
    ci[0] = th_cluster(11, &ipi[0], MP_IP, p[0]->port);
    ci[1] = th_cluster(14, &ipi[1], MP_IP, closed); /* refused */
    ci[2] = th_cluster(12, &ipi[2], MP_IP, p[1]->port);
    ci[3] = th_cluster(13, &ipi[3], MP_IP, p[2]->port);
    for (int i = 0; i < 4; i++)
        rets[i] = LLM_FAILED;
    assert_int_equal(llmdd_link_clusters(dd, ci, 4, rets, 3000),
                     LLM_LINK_FAILED);
    assert_int_equal(rets[0], LLM_SUCCESS);
    assert_int_equal(rets[1], LLM_LINK_FAILED);
    assert_int_equal(rets[2], LLM_SUCCESS);
    assert_int_equal(rets[3], LLM_SUCCESS);
    for (int i = 0; i < 3; i++)
        assert_int_equal(mp_pull_check(dd, 11 + (uint64_t)i, p[i]->ids.kv, 1),
                         LLM_SUCCESS);

    /* The call returns the status of the last failing cluster. */
    llmdd_cluster_info order[2] = {ci[1], ci[0]};
    assert_int_equal(llmdd_link_clusters(dd, order, 2, rets, 3000),
                     LLM_ALREADY_LINK);
    assert_int_equal(rets[0], LLM_LINK_FAILED);
    assert_int_equal(rets[1], LLM_ALREADY_LINK);
    order[0] = ci[0];
    order[1] = ci[1];
    assert_int_equal(llmdd_link_clusters(dd, order, 2, rets, 3000),
                     LLM_LINK_FAILED);
    assert_int_equal(rets[0], LLM_ALREADY_LINK);
    assert_int_equal(rets[1], LLM_LINK_FAILED);

    /* Unlink all of them in one call, including the one never linked. */
    assert_int_equal(llmdd_unlink_clusters(dd, ci, 4, rets, 3000, false),
                     LLM_SUCCESS);
    for (int i = 0; i < 4; i++)
        assert_int_equal(rets[i], LLM_SUCCESS);
    for (int i = 0; i < 3; i++)
        assert_int_equal(mp_pull_status(dd, 11 + (uint64_t)i, p[i]->ids.kv),
                         LLM_NOT_YET_LINK);
    llmdd_destroy(dd);
    for (int i = 0; i < 3; i++)
        assert_int_equal(th_proc_stop(p[i]), 0);
    close(cfd);
}

int
main(int argc, char **argv)
{
    th_test_filter(argc, argv);
#define T(f) cmocka_unit_test_teardown(f, teardown)
    const struct CMUnitTest tests[] = {
        T(test_link_pull_unlink_relink),
        T(test_unlink_args),
        T(test_link_args),
        T(test_link_refused_and_silent),
        T(test_link_duplicate),
        T(test_link_wrong_cluster_id),
        T(test_link_own_cluster_id),
        T(test_link_several_clusters),
    };
#undef T
    return cmocka_run_group_tests_name("multiproc.link", tests, NULL, NULL);
}
