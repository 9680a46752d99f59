/*
 * The tool with discovery through a real etcd (tests/harness/etcd_util.c):
 * `llmdd serve --metadata` publishes, `llmdd info --metadata` lists it,
 * `llmdd pull --metadata --remote-cluster-id` finds it without --connect
 * and verifies every byte; an unknown id and a prefix of another fleet fail
 * with the library's status; a wildcard --listen is refused; after serve
 * stops, the list is empty; `llmdd bench --op discovery` runs.
 */
#include <signal.h>
#include <stdlib.h>
#include <string.h>

#include "harness/cli_util.h"
#include "harness/etcd_util.h"

#define SHAPE "--model", "tiny", "--tokens", "64", "--batch", "3"

static te_etcd etcd;

static int
teardown(void **state)
{
    (void)state;
    cu_reap_all();
    te_etcd_destroy(&etcd);
    return 0;
}

static void
test_serve_info_pull(void **state)
{
    (void)state;
    char line[512];
    cu_bg s;

    te_etcd_start(&etcd);
    const char *serve[] = {"serve", "--listen", "127.0.0.1:0", "--cluster-id",
                           "7", "--fill", "--metadata", etcd.server,
                           "--metadata-prefix", "fleet-a", SHAPE, NULL};
    cu_start(&s, serve);
    assert_true(cu_wait_line(&s, "serving", line, sizeof(line), 20));
    assert_non_null(strstr(s.seen, "llmdd pull --metadata"));

    const char *info[] = {"info", "--metadata", etcd.server,
                          "--metadata-prefix", "fleet-a", NULL};
    cu_result r = cu_run(30, info);
    if (r.code != 0 || strstr(r.out, "cluster 7 ") == NULL)
        cu_dump("info --metadata", &r);
    assert_int_equal(r.code, 0);
    assert_non_null(strstr(r.out, "cluster 7 "));
    assert_non_null(strstr(r.out, "prompt"));
    assert_non_null(strstr(r.out, "1 cluster\n"));
    cu_result_free(&r);

    const char *pull[] = {"pull", "--metadata", etcd.server,
                          "--metadata-prefix", "fleet-a", "--cluster-id", "8",
                          "--remote-cluster-id", "7", "--verify", SHAPE, NULL};
    r = cu_run(60, pull);
    if (r.code != 0)
        cu_dump("pull --metadata", &r);
    assert_int_equal(r.code, 0);
    assert_non_null(strstr(r.out, "verified"));
    cu_result_free(&r);

    /* Another id, another fleet: the library's status, exit 1. */
    const char *unknown[] = {"pull", "--metadata", etcd.server,
                             "--metadata-prefix", "fleet-a", "--cluster-id",
                             "8", "--remote-cluster-id", "9", SHAPE, NULL};
    r = cu_run(60, unknown);
    assert_int_equal(r.code, 1);
    assert_non_null(strstr(r.err, "LLM_LINK_FAILED"));
    cu_result_free(&r);
    const char *other[] = {"pull", "--metadata", etcd.server, "--cluster-id",
                           "8", "--remote-cluster-id", "7", SHAPE, NULL};
    r = cu_run(60, other);
    assert_int_equal(r.code, 1);
    assert_non_null(strstr(r.err, "LLM_LINK_FAILED"));
    cu_result_free(&r);

    /* Stopped: its entry is revoked. */
    r = cu_stop(&s, SIGTERM, 20);
    assert_int_equal(r.code, 0);
    cu_result_free(&r);
    r = cu_run(30, info);
    assert_int_equal(r.code, 0);
    assert_non_null(strstr(r.out, "0 clusters"));
    cu_result_free(&r);

    /* The bench of a burst of decoders linking by id, small. */
    const char *bench[] = {"bench", "--op", "discovery", "--metadata",
                           etcd.server, "--decoders", "16", "--rounds", "1",
                           NULL};
    r = cu_run(120, bench);
    if (r.code != 0)
        cu_dump("bench --op discovery", &r);
    assert_int_equal(r.code, 0);
    assert_non_null(strstr(r.out, "by id / by address"));
    cu_result_free(&r);

    /* A wildcard address cannot be published. */
    const char *wild[] = {"serve", "--listen", "0.0.0.0:0", "--cluster-id",
                          "7", "--metadata", etcd.server, SHAPE, NULL};
    r = cu_run(30, wild);
    assert_int_equal(r.code, 1);
    assert_non_null(strstr(r.err, "LLM_PARAM_INVALID"));
    cu_result_free(&r);
}

int
main(int argc, char **argv)
{
    te_etcd_require();
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_teardown(test_serve_info_pull, teardown),
    };
    return cu_main("metadata", tests, 1, argc, argv);
}
