/*
 * llm.AuthToken across processes (MODEL.md "Links"): equal tokens link,
 * different tokens or a token on one side only fail with LLM_LINK_FAILED,
 * and a failed attempt leaves both sides usable.
 */
#include <stdlib.h>
#include <string.h>

#include "mp.h"

static int
teardown(void **state)
{
    (void)state;
    mp_reap_all();
    return 0;
}

static llmdd *
decoder_with_token(uint64_t cluster, const char *token)
{
    llmdd_option o = {"llm.AuthToken", token};

    return mp_decoder(cluster, &o, token != NULL ? 1 : 0);
}

static void
test_same_token(void **state)
{
    static const char *const args[] = {"--role", "prompt", "--auth",
                                       "s3cret-token", NULL};
    th_proc *p;
    llmdd *dd;

    (void)state;
    p = mp_peer_start(1, args);
    dd = decoder_with_token(MP_SELF, "s3cret-token");
    assert_int_equal(th_link(dd, 1, MP_IP, p->port, 2000), LLM_SUCCESS);
    assert_int_equal(mp_pull_check(dd, 1, p->ids.kv, 1), LLM_SUCCESS);
    assert_int_equal(mp_pull_check(dd, 1, p->ids.reg, 2), LLM_SUCCESS);
    assert_int_equal(th_unlink(dd, 1, MP_IP, p->port, false, 2000),
                     LLM_SUCCESS);
    llmdd_destroy(dd);
    assert_int_equal(th_proc_stop(p), 0);
}

static void
test_token_mismatch(void **state)
{
    static const char *const args[] = {"--role", "prompt", "--auth",
                                       "s3cret-token", NULL};
    /* Near misses too: a prefix, an extension, another case. */
    static const char *const wrong[] = {"other", "s3cret-toke",
                                        "s3cret-token2", "S3CRET-TOKEN"};
    th_proc *p;
    llmdd *dd;

    (void)state;
    p = mp_peer_start(1, args);
    for (size_t i = 0; i < sizeof(wrong) / sizeof(wrong[0]); i++) {
        dd = decoder_with_token(MP_SELF + i, wrong[i]);
        if (th_link(dd, 1, MP_IP, p->port, 2000) != LLM_LINK_FAILED)
            fail_msg("token \"%s\" was not refused", wrong[i]);
        assert_int_equal(mp_pull_status(dd, 1, p->ids.kv), LLM_NOT_YET_LINK);
        llmdd_destroy(dd);
    }
    /* The peer kept no half link: the right token still links. */
    dd = decoder_with_token(MP_SELF, "s3cret-token");
    assert_int_equal(th_link(dd, 1, MP_IP, p->port, 2000), LLM_SUCCESS);
    assert_int_equal(mp_pull_check(dd, 1, p->ids.kv, 1), LLM_SUCCESS);
    llmdd_destroy(dd);
    assert_int_equal(th_proc_stop(p), 0);
}

static void
test_token_one_side(void **state)
{
    static const char *const with[] = {"--role", "prompt", "--auth", "abc",
                                       NULL};
    static const char *const without[] = {"--role", "prompt", NULL};
    th_proc *pa, *pn;
    llmdd *dd;

    (void)state;
    pa = mp_peer_start(1, with);
    pn = mp_peer_start(2, without);

    /* Only the server has a token. */
    dd = decoder_with_token(MP_SELF, NULL);
    assert_int_equal(th_link(dd, 1, MP_IP, pa->port, 2000), LLM_LINK_FAILED);
    assert_int_equal(mp_pull_status(dd, 1, pa->ids.kv), LLM_NOT_YET_LINK);
    /* The same decoder links to the server without one. */
    assert_int_equal(th_link(dd, 2, MP_IP, pn->port, 2000), LLM_SUCCESS);
    assert_int_equal(mp_pull_check(dd, 2, pn->ids.kv, 1), LLM_SUCCESS);
    llmdd_destroy(dd);

    /* Only the client has a token. */
    dd = decoder_with_token(MP_SELF, "abc");
    assert_int_equal(th_link(dd, 2, MP_IP, pn->port, 2000), LLM_LINK_FAILED);
    assert_int_equal(mp_pull_status(dd, 2, pn->ids.kv), LLM_NOT_YET_LINK);
    assert_int_equal(th_link(dd, 1, MP_IP, pa->port, 2000), LLM_SUCCESS);
    assert_int_equal(mp_pull_check(dd, 1, pa->ids.kv, 1), LLM_SUCCESS);
    llmdd_destroy(dd);

    assert_int_equal(th_proc_stop(pa), 0);
    assert_int_equal(th_proc_stop(pn), 0);
}

int
main(int argc, char **argv)
{
    th_test_filter(argc, argv);
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_teardown(test_same_token, teardown),
        cmocka_unit_test_teardown(test_token_mismatch, teardown),
        cmocka_unit_test_teardown(test_token_one_side, teardown),
    };
    return cmocka_run_group_tests_name("multiproc.auth", tests, NULL, NULL);
}
