/*
 * Flags: --help on every subcommand, a usage message and exit code 2 for
 * every bad flag (never a crash), and `llmdd info`.
 */
#include <stdlib.h>
#include <string.h>

#include "harness/cli_util.h"

static void
test_help_everywhere(void **state)
{
    (void)state;
    static const char *const cmds[] = {"demo", "serve", "pull", "bench",
                                       "info"};
    for (size_t i = 0; i < sizeof(cmds) / sizeof(cmds[0]); i++) {
        char want[64];
        const char *args[] = {cmds[i], "--help", NULL};
        cu_result r = cu_run(30, args);
        snprintf(want, sizeof(want), "Usage: llmdd %s", cmds[i]);
        if (r.code != 0 || strstr(r.out, want) == NULL)
            cu_dump(cmds[i], &r);
        assert_int_equal(r.code, 0);
        assert_non_null(strstr(r.out, want));
        assert_string_equal(r.err, "");
        cu_result_free(&r);
    }
    const char *top[] = {"--help", NULL};
    cu_result r = cu_run(30, top);
    assert_int_equal(r.code, 0);
    assert_non_null(strstr(r.out, "Commands:"));
    cu_result_free(&r);
}

typedef struct {
    const char *args[12];
    const char *in_err; /* expected in stderr */
} bad_case;

static const bad_case bad[] = {
    {{NULL}, "Usage: llmdd <command>"},
    {{"frobnicate", NULL}, "unknown command"},
    {{"demo", "--bogus", NULL}, "Try 'llmdd demo --help'"},
    {{"demo", "--transport", "carrier-pigeon", NULL}, "unknown transport"},
    {{"demo", "--tokens", "0", NULL}, "--tokens"},
    {{"demo", "--tokens", "12x", NULL}, "--tokens"},
    {{"demo", "--model", "gpt-5", NULL}, "unknown model"},
    {{"demo", "--layers", NULL}, "requires an argument"},
    {{"demo", "--layers", "8", NULL}, "the number of layers is --num-layers"},
    {{"serve", "--listen", "127.0.0.1:0", "--cluster-id", "1", "--layers", "8",
      NULL},
     "the number of layers is --num-layers"},
    {{"demo", "--heads", "1024", "--head-dim", "16384", "--tokens", "16777216",
      NULL},
     "too large"},
    {{"demo", "extra", NULL}, "unexpected argument"},
    {{"demo", "-o", "novalue", NULL}, "KEY=VALUE"},
    {{"serve", "--cluster-id", "1", NULL}, "--listen IP:PORT and"},
    {{"serve", "--listen", "127.0.0.1:70000", "--cluster-id", "1", NULL},
     "port in 0..65535"},
    {{"serve", "--listen", "no-such-host.invalid:26000", "--cluster-id", "1",
      NULL},
     "is not IP:PORT"},
    {{"serve", "--listen", "127.0.0.1:26000", "--cluster-id", "-3", NULL},
     "--cluster-id"},
    {{"serve", "--listen", "127.0.0.1:26000", "--cluster-id", "1", "--fill=x",
      NULL},
     "--fill"},
    {{"serve", "--listen", "127.0.0.1:26000", "--cluster-id", "1", "-t", "loop",
      NULL},
     "same process"},
    {{"pull", "--connect", "127.0.0.1:26000", NULL}, "are required"},
    {{"pull", "--connect", "127.0.0.1:26000", "--cluster-id", "2",
      "--remote-cluster-id", "2", NULL},
     "must differ"},
    {{"pull", "--connect", "127.0.0.1:26000", "--cluster-id", "2",
      "--remote-cluster-id", "1", "--layers", "5:2", NULL},
     "--layers"},
    {{"pull", "--connect", "127.0.0.1:26000", "--cluster-id", "2",
      "--remote-cluster-id", "1", "--blocks", "3-1", NULL},
     "--blocks"},
    {{"pull", "--connect", "127.0.0.1:26000", "--cluster-id", "2",
      "--remote-cluster-id", "1", "--blocks", "0-99999999", NULL},
     "--blocks"},
    {{"pull", "--connect", "[::1:26000", "--cluster-id", "2",
      "--remote-cluster-id", "1", NULL},
     "--connect"},
    {{"bench", "--op", "teleport", NULL}, "--op"},
    {{"bench", "--block-size", "3K:9K", NULL}, "powers of two"},
    {{"bench", "--block-size", "16K:4K", NULL}, "--block-size"},
    {{"bench", "--block-size", "0", NULL}, "--block-size"},
    {{"bench", "--blocks", "0", NULL}, "--blocks"},
    {{"bench", "--decoders", "1000", NULL}, "--decoders"},
    {{"bench", "--iters", "-1", NULL}, "--iters"},
    {{"bench", "--total-size", "lots", NULL}, "--total-size"},
    {{"bench", "--baseline", "vibes", NULL}, "--baseline"},
    {{"bench", "--rounds", "0", NULL}, "--rounds"},
    {{"bench", "--rounds", "101", NULL}, "--rounds"},
    {{"bench", "--op", "link", "--rounds", "2", NULL}, "--rounds"},
    {{"bench", "--op", "link", "--plot", "x.png", NULL}, "--plot"},
    {{"bench", "--block-size", "64G", "--blocks", "64", NULL}, "64G"},
    {{"bench", "--op", "slices", "--row", "heads", NULL}, "--row"},
    {{"bench", "--row", "heads-hnd", NULL}, "--row: only with --op slices"},
    {{"info", "--verbose", NULL}, "Try 'llmdd info --help'"},
};

static void
test_bad_flags(void **state)
{
    (void)state;
    for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
        cu_result r = cu_run(30, bad[i].args);
        if (r.code != 2 || strstr(r.err, bad[i].in_err) == NULL) {
            fprintf(stderr, "case %zu (%s %s):\n", i,
                    bad[i].args[0] ? bad[i].args[0] : "",
                    bad[i].args[0] && bad[i].args[1] ? bad[i].args[1] : "");
            cu_dump("bad flag", &r);
        }
        assert_int_equal(r.code, 2);
        assert_non_null(strstr(r.err, bad[i].in_err));
        assert_string_equal(r.out, "");
        cu_result_free(&r);
    }
}

/* A transport missing from this build is refused with a reason. */
static void
test_transport_not_built(void **state)
{
    (void)state;
    static const char *const names[] = {"shm", "ucx"};
    int checked = 0;
    for (size_t i = 0; i < 2; i++) {
        if (cu_transport_built(names[i]))
            continue;
        const char *args[] = {"bench", "--transport", names[i], NULL};
        cu_result r = cu_run(30, args);
        assert_int_equal(r.code, 2);
        assert_non_null(strstr(r.err, "is not built into this library"));
        cu_result_free(&r);
        checked++;
    }
    if (checked == 0)
        skip();
}

static void
test_info(void **state)
{
    (void)state;
    const char *args[] = {"info", NULL};
    cu_result r = cu_run(60, args);
    if (r.code != 0)
        cu_dump("info", &r);
    assert_int_equal(r.code, 0);
    assert_non_null(strstr(r.out, llmdd_version()));
    assert_non_null(strstr(r.out, llmdd_transport_list()));
    /* loop and tcp always work here; each was really tried. */
    assert_non_null(strstr(r.out, "loop  usable here"));
    assert_non_null(strstr(r.out, "tcp   usable here"));
    /* The probes' own warnings are not the user's (UCX's over tcp was). */
    if (strstr(r.err, " warn: ") != NULL)
        fail_msg("llmdd info printed a warning of its probes:\n%s", r.err);
    static const char *const keys[] = {
        "llm.ListenIpInfo",      "llm.DeviceId",      "llm.SyncKvCacheWaitTime",
        "llm.HostMemPoolConfig", "llm.MemPoolConfig", "llm.Transport",
        "llm.AuthToken",         "LLMDD_LOG_LEVEL"};
    for (size_t i = 0; i < sizeof(keys) / sizeof(keys[0]); i++)
        assert_non_null(strstr(r.out, keys[i]));
    /* Every key the library documents, with its default. */
    const llmdd_option_doc *d;
    for (size_t i = 0; (d = llmdd_option_info(i)) != NULL; i++) {
        char want[256];
        snprintf(want, sizeof(want), "  %-24s default: %s\n", d->key,
                 d->default_text);
        if (strstr(r.out, want) == NULL)
            fail_msg("llmdd info does not list \"%s\"", want);
    }
    cu_result_free(&r);

    const char *noprobe[] = {"info", "--no-probe", NULL};
    r = cu_run(30, noprobe);
    assert_int_equal(r.code, 0);
    assert_null(strstr(r.out, "usable here"));
    cu_result_free(&r);
}

int
main(int argc, char **argv)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_help_everywhere),
        cmocka_unit_test(test_bad_flags),
        cmocka_unit_test(test_transport_not_built),
        cmocka_unit_test(test_info),
    };
    return cu_main("usage", tests, sizeof(tests) / sizeof(tests[0]), argc,
                   argv);
}
