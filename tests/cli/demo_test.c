/*
 * `llmdd demo` with one transport (argv[1]): the README's first command
 * must move and verify every byte, with the default shape and with odd
 * shapes whose slots are not a multiple of 8 bytes. A transport that is not
 * built in must fail with a clear message instead.
 *
 *   demo_test <auto|loop|shm|tcp|ucx> [test name]
 */
#include <stdlib.h>
#include <string.h>

#include "harness/cli_util.h"

static const char *transport;

/* Lines of the table whose "verified" column says yes. */
static int
verified_rows(const char *out)
{
    return cu_count(out, " yes\n");
}

static void
expect_demo_ok(const cu_result *r)
{
    if (r->code != 0 || strstr(r->out, "OK: every transfer verified") == NULL ||
        verified_rows(r->out) != 7)
        cu_dump("demo", r);
    assert_int_equal(r->code, 0);
    assert_non_null(strstr(r->out, "OK: every transfer verified"));
    /* Five transfers (the slot pull cold and warm), the layer-wise push and
     * its notification. */
    assert_int_equal(verified_rows(r->out), 7);
    assert_non_null(strstr(r->out, ", cold (the link's first) "));
    assert_non_null(strstr(r->out, ", again (warm) "));
    /* The transport the transfers took; with auto, said to be its choice. */
    const char *t = strstr(r->out, "\ntransport: ");
    assert_non_null(t);
    if (strcmp(transport, "auto") == 0) {
        assert_non_null(strstr(t, " (what auto chose for this peer)\n"));
        /* Two processes on one host: shm when it is built in. */
        assert_true(strncmp(t, "\ntransport: shm ", 16) == 0 ||
                    strncmp(t, "\ntransport: tcp ", 16) == 0);
    } else {
        assert_true(strncmp(t + 12, transport, strlen(transport)) == 0);
        assert_true(t[12 + strlen(transport)] == '\n');
    }
}

static void
test_demo_default(void **state)
{
    (void)state;
    /* With auto, exactly the README's command: no flags at all. */
    const char *args_auto[] = {"demo", NULL};
    const char *args[] = {"demo", "--transport", transport, NULL};
    cu_result r = cu_run(60, strcmp(transport, "auto") == 0 ? args_auto : args);
    expect_demo_ok(&r);
    /* The default layout is Llama-3-8B's. */
    assert_non_null(strstr(r.out, "llama3-8b"));
    assert_non_null(strstr(r.out, "64 tensors of bf16 [4,128,8,128]"));
    assert_non_null(strstr(r.out, "pull layers 8-15"));
    assert_non_null(strstr(r.out, "push slot 3 -> 3"));
    assert_non_null(strstr(r.out, "push slot 0 -> 1 layer by layer "));
    assert_non_null(strstr(r.out, "decoder: notify_fd, get_notifies "));
    assert_non_null(strstr(r.out, "notification: \"slot 1 of cache "));
    if (strcmp(transport, "loop") == 0)
        assert_non_null(strstr(r.out, "two instances in this process"));
    else
        assert_non_null(strstr(r.out, "separate processes"));
    cu_result_free(&r);
}

static void
test_demo_odd_shape(void **state)
{
    (void)state;
    /* 3 layers, 3 heads x 25 dims: a slot is 37 * 150 bytes, a block
     * 5 * 150, neither a multiple of 8; 2 slots leave the push slot at 1. */
    const char *args[] = {
        "demo", "--transport",    transport, "--num-layers", "3",  "--heads",
        "3",    "--head-dim",     "25",      "--tokens",     "37", "--batch",
        "2",    "--block-tokens", "5",       "--seed",       "7",  NULL};
    cu_result r = cu_run(60, args);
    expect_demo_ok(&r);
    assert_non_null(strstr(r.out, "custom KV layout"));
    cu_result_free(&r);
}

static void
test_demo_model_option(void **state)
{
    (void)state;
    const char *args[] = {"demo",
                          "-t",
                          transport,
                          "--model",
                          "tiny",
                          "-o",
                          "llm.AuthToken=demo-secret",
                          NULL};
    cu_result r = cu_run(60, args);
    expect_demo_ok(&r);
    assert_non_null(strstr(r.out, "tiny KV layout, 4 layers"));
    cu_result_free(&r);
}

/* A transport this library lacks: a clear refusal, never a crash. */
static void
test_demo_not_built(void **state)
{
    (void)state;
    const char *args[] = {"demo", "--transport", transport, NULL};
    cu_result r = cu_run(30, args);
    assert_int_not_equal(r.code, 0);
    assert_int_not_equal(r.code, -1);
    assert_non_null(strstr(r.err, "not built into this library"));
    cu_result_free(&r);
}

int
main(int argc, char **argv)
{
    if (argc < 2) {
        fprintf(stderr, "usage: %s <transport> [test]\n", argv[0]);
        return 2;
    }
    transport = argv[1];
    if (strcmp(transport, "auto") != 0 && !cu_transport_built(transport)) {
        const struct CMUnitTest tests[] = {
            cmocka_unit_test(test_demo_not_built),
        };
        return cu_main(transport, tests, 1, argc - 1, argv + 1);
    }
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_demo_default),
        cmocka_unit_test(test_demo_odd_shape),
        cmocka_unit_test(test_demo_model_option),
    };
    return cu_main(transport, tests, sizeof(tests) / sizeof(tests[0]), argc - 1,
                   argv + 1);
}
