/*
 * `llmdd serve` and `llmdd pull` as two real processes, as a user runs them
 * in two terminals: slot, layer-range and block pulls verified against the
 * deterministic fill; verification that catches wrong data; library errors
 * reported with their status names; clean shutdown on SIGTERM and SIGINT.
 */
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "harness/cli_util.h"

#define SHAPE "--model", "tiny", "--tokens", "64", "--batch", "3"

typedef struct {
    cu_bg bg;
    char addr[32];
} server;

/* Starts `llmdd serve` on port 0 with the extra args (NULL-ended); s->addr
 * gets the address it prints, with the port the kernel chose. */
static void
serve_start(server *s, const char *cluster, const char *const *extra)
{
    const char *args[32] = {"serve",        "--listen", s->addr,
                            "--cluster-id", cluster,    SHAPE};
    size_t n = 0;
    char line[512];

    while (args[n] != NULL)
        n++;
    for (; extra != NULL && *extra != NULL && n < 30; extra++)
        args[n++] = *extra;
    args[n] = NULL;
    snprintf(s->addr, sizeof(s->addr), "127.0.0.1:0");
    cu_start(&s->bg, args);
    const char *at = NULL;
    unsigned port = 0;
    if (cu_wait_line(&s->bg, "listening on ", line, sizeof(line), 20))
        at = strstr(line, "listening on 127.0.0.1:");
    if (at == NULL || sscanf(at, "listening on 127.0.0.1:%u,", &port) != 1 ||
        port == 0 || port > 65535 ||
        !cu_wait_line(&s->bg, "serving", line, sizeof(line), 20)) {
        cu_result r = cu_stop(&s->bg, SIGKILL, 10);
        cu_dump("serve did not come up", &r);
        cu_result_free(&r);
        fail();
    }
    snprintf(s->addr, sizeof(s->addr), "127.0.0.1:%u", port);
}

/* Runs `llmdd pull` against s with the extra args; returns its result. */
static cu_result
pull(const server *s, const char *const *extra)
{
    const char *args[40] = {
        "pull", "--connect",           s->addr, "--cluster-id",
        "8",    "--remote-cluster-id", "7",     SHAPE};
    size_t n = 0;

    while (args[n] != NULL)
        n++;
    for (; extra != NULL && *extra != NULL && n < 38; extra++)
        args[n++] = *extra;
    args[n] = NULL;
    return cu_run(60, args);
}

static void
expect(const cu_result *r, int code, const char *in_out, const char *in_err)
{
    if (r->code != code || (in_out && !strstr(r->out, in_out)) ||
        (in_err && !strstr(r->err, in_err)))
        cu_dump("pull", r);
    assert_int_equal(r->code, code);
    if (in_out != NULL)
        assert_non_null(strstr(r->out, in_out));
    if (in_err != NULL)
        assert_non_null(strstr(r->err, in_err));
}

static void
test_serve_pull_verified(void **state)
{
    (void)state;
    server s;
    const char *fill[] = {"--fill", NULL};
    serve_start(&s, "7", fill);
    /* It prints its caches and the command for the second terminal. */
    assert_non_null(strstr(s.bg.seen, "cache 1: KV cache, 8 tensors of bf16 "
                                      "[3,64,2,64]"));
    assert_non_null(strstr(s.bg.seen, "cache 2: paged cache"));
    assert_non_null(strstr(s.bg.seen, "--remote-cluster-id 7"));
    assert_non_null(strstr(s.bg.seen, "--verify"));

    const char *slot[] = {"--batch-index", "2", "--verify", NULL};
    cu_result r = pull(&s, slot);
    expect(&r, 0, "verified: 128 KiB", NULL);
    assert_non_null(strstr(r.out, "slot 2, all layers"));
    cu_result_free(&r);

    const char *layers[] = {"--batch-index", "1",        "--layers",
                            "1:2",           "--verify", NULL};
    r = pull(&s, layers);
    expect(&r, 0, "verified: 64 KiB", NULL);
    cu_result_free(&r);

    const char *blocks[] = {"--blocks", "0,3,5-7", "--verify", NULL};
    r = pull(&s, blocks);
    expect(&r, 0, "verified: 160 KiB", NULL);
    assert_non_null(strstr(r.out, "cache 2, 5 blocks"));
    cu_result_free(&r);

    const char *blayers[] = {"--blocks", "11",       "--layers",
                             "3:3",      "--verify", NULL};
    r = pull(&s, blayers);
    expect(&r, 0, "verified: 8 KiB", NULL);
    cu_result_free(&r);

    /* A host name resolves: the same server as "localhost". */
    server byname = s;
    snprintf(byname.addr, sizeof(byname.addr), "localhost%s",
             strrchr(s.addr, ':'));
    const char *named[] = {"--verify", NULL};
    r = pull(&byname, named);
    expect(&r, 0, "verified: 128 KiB", NULL);
    cu_result_free(&r);

    /* The check is real: another seed's pattern does not match. */
    const char *seed[] = {"--seed", "99", "--verify", NULL};
    r = pull(&s, seed);
    expect(&r, 1, NULL, "verification FAILED");
    cu_result_free(&r);

    /* Library errors carry the status name. */
    const char *nocache[] = {"--cache-id", "5", NULL};
    r = pull(&s, nocache);
    expect(&r, 1, NULL, "LLM_KV_CACHE_NOT_EXIST");
    cu_result_free(&r);
    const char *badrange[] = {"--layers", "2:9", NULL};
    r = pull(&s, badrange);
    expect(&r, 1, NULL, "LLM_PARAM_INVALID");
    cu_result_free(&r);
    const char *badblock[] = {"--blocks", "12", NULL};
    r = pull(&s, badblock);
    expect(&r, 1, NULL, "LLM_PARAM_INVALID");
    cu_result_free(&r);

    r = cu_stop(&s.bg, SIGTERM, 20);
    if (r.code != 0)
        cu_dump("serve", &r);
    assert_int_equal(r.code, 0);
    assert_non_null(strstr(r.out, "SIGTERM: shutting down"));
    assert_non_null(strstr(r.out, "llmdd serve: stopped"));
    /* The operator saw each decoder come and go. */
    assert_non_null(strstr(r.err, "linked with cluster 8"));
    assert_non_null(strstr(r.err, "link to cluster 8 dropped"));
    cu_result_free(&r);
}

static void
test_serve_unfilled_sigint(void **state)
{
    (void)state;
    server s;
    serve_start(&s, "7", NULL);
    assert_non_null(strstr(s.bg.seen, "zeroed (not filled)"));
    /* Zeros are not the pattern: --verify must say so. */
    const char *v[] = {"--verify", NULL};
    cu_result r = pull(&s, v);
    expect(&r, 1, NULL, "was `llmdd serve` started with --fill");
    cu_result_free(&r);
    /* Without --verify the pull itself succeeds. */
    r = pull(&s, NULL);
    expect(&r, 0, "GB/s", NULL);
    cu_result_free(&r);
    r = cu_stop(&s.bg, SIGINT, 20);
    assert_int_equal(r.code, 0);
    assert_non_null(strstr(r.out, "SIGINT: shutting down"));
    cu_result_free(&r);
}

/* Ctrl-C during a long fill (4 GiB here) stops it at the next tensor:
 * serve exits cleanly long before the fill would end. */
static void
test_sigint_stops_fill(void **state)
{
    (void)state;
    char line[512];
    cu_bg bg;
    const char *args[] = {
        "serve",    "--listen", "127.0.0.1:0",  "--cluster-id",
        "7",        "--fill",   "--num-layers", "16",
        "--heads",  "8",        "--head-dim",   "128",
        "--tokens", "4096",     "--batch",      "8",
        NULL};
    cu_start(&bg, args);
    assert_true(cu_wait_line(&bg, "filling", line, sizeof(line), 60));
    assert_non_null(strstr(line, "filling 4 GiB of caches"));
    struct timespec a, b;
    clock_gettime(CLOCK_MONOTONIC, &a);
    cu_result r = cu_stop(&bg, SIGINT, 20);
    clock_gettime(CLOCK_MONOTONIC, &b);
    long long took =
        (b.tv_sec - a.tv_sec) * 1000LL + (b.tv_nsec - a.tv_nsec) / 1000000;
    if (r.code != 0 || strstr(r.out, "serving;") != NULL)
        cu_dump("serve", &r);
    assert_int_equal(r.code, 0);
    assert_non_null(strstr(r.out, "SIGINT: shutting down"));
    assert_null(strstr(r.out, "serving;")); /* it never started serving */
    print_message("serve stopped %lld ms after SIGINT, mid-fill\n", took);
    cu_result_free(&r);
}

static void
test_auth_token(void **state)
{
    (void)state;
    server s;
    const char *extra[] = {"--fill=5", "-o", "llm.AuthToken=s3cret", NULL};
    serve_start(&s, "7", extra);
    assert_non_null(strstr(s.bg.seen, "--seed 5"));
    const char *wrong[] = {"-o", "llm.AuthToken=other", NULL};
    cu_result r = pull(&s, wrong);
    expect(&r, 1, NULL, "LLM_LINK_FAILED");
    cu_result_free(&r);
    const char *right[] = {
        "-o", "llm.AuthToken=s3cret", "--seed", "5", "--verify", NULL};
    r = pull(&s, right);
    expect(&r, 0, "verified", NULL);
    cu_result_free(&r);
    r = cu_stop(&s.bg, SIGTERM, 20);
    assert_int_equal(r.code, 0);
    cu_result_free(&r);
}

static void
test_pull_nobody_listening(void **state)
{
    (void)state;
    server s;
    snprintf(s.addr, sizeof(s.addr), "127.0.0.1:%u", cu_free_port());
    cu_result r = pull(&s, NULL);
    expect(&r, 1, NULL, "LLM_LINK_FAILED");
    assert_non_null(strstr(r.err, "llmdd_link_clusters"));
    cu_result_free(&r);
}

static void
test_serve_address_in_use(void **state)
{
    (void)state;
    server s;
    serve_start(&s, "7", NULL);
    const char *args[] = {"serve",        "--listen", s.addr,
                          "--cluster-id", "9",        NULL};
    cu_result r = cu_run(30, args);
    if (r.code != 1)
        cu_dump("second serve", &r);
    assert_int_equal(r.code, 1);
    assert_non_null(strstr(r.err, "llmdd_initialize"));
    assert_non_null(strstr(r.err, "LLM_"));
    cu_result_free(&r);
    r = cu_stop(&s.bg, SIGTERM, 20);
    assert_int_equal(r.code, 0);
    cu_result_free(&r);
}

static int
teardown(void **state)
{
    (void)state;
    cu_reap_all();
    return 0;
}

int
main(int argc, char **argv)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_teardown(test_serve_pull_verified, teardown),
        cmocka_unit_test_teardown(test_serve_unfilled_sigint, teardown),
        cmocka_unit_test_teardown(test_sigint_stops_fill, teardown),
        cmocka_unit_test_teardown(test_auth_token, teardown),
        cmocka_unit_test_teardown(test_pull_nobody_listening, teardown),
        cmocka_unit_test_teardown(test_serve_address_in_use, teardown),
    };
    return cu_main("serve_pull", tests, sizeof(tests) / sizeof(tests[0]), argc,
                   argv);
}
