/*
 * `llmdd bench`: short sweeps whose JSON and CSV output is parsed and
 * checked (rows, sizes, counts, percentiles, baselines and ratios), every
 * --op, several decoders, registered memory, repeated rounds and the
 * gnuplot picture.
 */
#include <cjson/cJSON.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "harness/cli_util.h"

/* Runs bench with args (NULL-ended) plus --json FILE; returns the JSON. */
static cJSON *
bench_json(const char *const *args, cu_result *res)
{
    const char *argv[48];
    char path[64];
    size_t n = 0;

    cu_tmpname(path, sizeof(path), ".json");
    argv[n++] = "bench";
    for (; *args != NULL && n < 44; args++)
        argv[n++] = *args;
    argv[n++] = "--json";
    argv[n++] = path;
    argv[n++] = "--no-progress";
    argv[n] = NULL;
    *res = cu_run(90, argv);
    if (res->code != 0)
        cu_dump("bench", res);
    assert_int_equal(res->code, 0);
    char *text = cu_read_file(path, NULL);
    assert_non_null(text);
    unlink(path);
    cJSON *root = cJSON_Parse(text);
    free(text);
    assert_non_null(root);
    return root;
}

static double
num(const cJSON *o, const char *key)
{
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(o, key);
    if (!cJSON_IsNumber(v))
        fail_msg("JSON: no number \"%s\"", key);
    return v->valuedouble;
}

static const char *
str(const cJSON *o, const char *key)
{
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(o, key);
    if (!cJSON_IsString(v))
        fail_msg("JSON: no string \"%s\"", key);
    return v->valuestring;
}

static const cJSON *
obj(const cJSON *o, const char *key)
{
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(o, key);
    if (v == NULL)
        fail_msg("JSON: no \"%s\"", key);
    return v;
}

/* The checks every sweep row must pass. */
static void
check_row(const cJSON *row, double block, double blocks, double calls,
          const char *base)
{
    assert_true(num(row, "block_size") == block);
    assert_true(num(row, "blocks") == blocks);
    assert_true(num(row, "bytes_per_call") == block * blocks);
    assert_true(num(row, "calls") == calls);
    double gbps = num(row, "gbps"), p50 = num(row, "p50_us");
    assert_true(gbps > 0);
    assert_true(p50 > 0);
    assert_true(num(row, "p99_us") >= p50);
    assert_true(num(row, "blocks_per_s") > 0);
    const cJSON *b = obj(row, "baseline");
    assert_string_equal(str(b, "kind"), base);
    assert_true(num(b, "gbps") > 0);
    assert_true(num(b, "p50_us") > 0);
    double ratio = num(row, "ratio");
    assert_true(fabs(ratio - gbps / num(b, "gbps")) <= 1e-6 * ratio + 1e-9);
    /* Next to memcpy, the best copy: the faster of it and a streamed copy. */
    const cJSON *best = cJSON_GetObjectItemCaseSensitive(row, "best_copy");
    if (strcmp(base, "memcpy") != 0) {
        assert_null(best);
        return;
    }
    assert_non_null(best);
    const char *kind = str(best, "kind");
    assert_true(strcmp(kind, "memcpy") == 0 || strcmp(kind, "streamed") == 0);
    double bg = num(best, "gbps");
    assert_true(strcmp(kind, "memcpy") == 0 ? bg == num(b, "gbps")
                                            : bg > num(b, "gbps"));
    double rb = num(row, "ratio_best");
    assert_true(fabs(rb - gbps / bg) <= 1e-6 * rb + 1e-9);
}

static void
test_bench_tcp_sweep_json_csv(void **state)
{
    (void)state;
    char csv[64];
    cu_tmpname(csv, sizeof(csv), ".csv");
    const char *args[] = {
        "--transport", "tcp", "--block-size", "4K:16K", "--iters", "20",
        "--warmup",    "2",   "--total-size", "1M",     "--csv",   csv,
        NULL};
    cu_result r;
    cJSON *root = bench_json(args, &r);

    assert_string_equal(str(root, "tool"), "llmdd bench");
    assert_non_null(strstr(str(root, "command"), "--block-size 4K:16K"));
    assert_true(num(obj(root, "host"), "cores") >= 1);
    const cJSON *cfg = obj(root, "config");
    assert_string_equal(str(cfg, "op"), "pull");
    assert_string_equal(str(cfg, "transport"), "tcp");
    assert_string_equal(str(cfg, "baseline"), "tcp");
    const cJSON *rows = obj(root, "rows");
    assert_int_equal(cJSON_GetArraySize(rows), 3);
    for (int i = 0; i < 3; i++) {
        const cJSON *row = cJSON_GetArrayItem(rows, i);
        check_row(row, 4096 << i, 1, 20, "tcp");
        assert_true(num(row, "iters") == 20);
        assert_true(num(row, "warmup") == 2);
    }
    cJSON_Delete(root);
    /* The table went to stdout, one line per row. */
    assert_non_null(strstr(r.out, "    4 KiB"));
    assert_non_null(strstr(r.out, "   16 KiB"));
    cu_result_free(&r);

    char *text = cu_read_file(csv, NULL);
    assert_non_null(text);
    unlink(csv);
    assert_int_equal(cu_count(text, "\n"), 4);
    assert_true(strncmp(text, "op,transport,decoders,block_size", 32) == 0);
    assert_non_null(strstr(text, "\npull,tcp,1,8192,1,8192,20,"));
    free(text);
}

static void
test_bench_push_two_decoders_loop(void **state)
{
    (void)state;
    const char *args[] = {"-t",           "loop", "--op",     "push",
                          "--decoders",   "2",    "--blocks", "2",
                          "--block-size", "64K",  "--iters",  "10",
                          "--total-size", "1M",   NULL};
    cu_result r;
    cJSON *root = bench_json(args, &r);
    assert_non_null(strstr(r.out, "threads: loop needs one process"));
    const cJSON *rows = obj(root, "rows");
    assert_int_equal(cJSON_GetArraySize(rows), 1);
    /* Two decoders, ten timed pushes each. */
    check_row(cJSON_GetArrayItem(rows, 0), 65536, 2, 20, "memcpy");
    assert_string_equal(str(obj(root, "config"), "op"), "push");
    cJSON_Delete(root);
    cu_result_free(&r);
}

static void
test_bench_pull_blocks(void **state)
{
    (void)state;
    const char *args[] = {
        "-t",           "tcp",      "--op", "pull-blocks", "--block-size",
        "16K",          "--blocks", "64",   "--iters",     "5",
        "--total-size", "2M",       NULL};
    cu_result r;
    cJSON *root = bench_json(args, &r);
    const cJSON *rows = obj(root, "rows");
    assert_int_equal(cJSON_GetArraySize(rows), 1);
    check_row(cJSON_GetArrayItem(rows, 0), 16384, 64, 5, "tcp");
    cJSON_Delete(root);
    cu_result_free(&r);
}

/* --inflight: posted requests, their ratio and post cost lines. */
static void
test_bench_pull_blocks_inflight(void **state)
{
    (void)state;
    const char *args[] = {
        "-t",      "tcp",      "--op",     "pull-blocks", "--block-size",
        "16K",     "--blocks", "8",        "--inflight",  "4",
        "--iters", "12",       "--warmup", "4",           "--total-size",
        "1M",      NULL};
    cu_result r;
    cJSON *root = bench_json(args, &r);
    const cJSON *rows = obj(root, "rows");
    assert_int_equal(cJSON_GetArraySize(rows), 1);
    const cJSON *row = cJSON_GetArrayItem(rows, 0);
    check_row(row, 16384, 8, 12, "tcp");
    assert_true(num(row, "inflight") == 4);
    assert_true(num(row, "post_ns_per_block") > 0);
    assert_non_null(strstr(r.out, "4 in flight: "));
    assert_non_null(strstr(r.out, " x raw TCP GB/s; post cost: "));
    assert_non_null(strstr(r.out, " ns/block (8 blocks, p50 "));
    cJSON_Delete(root);
    cu_result_free(&r);
}

/* --op layerwise: both times, the ratios, where the time went. */
static void
test_bench_layerwise(void **state)
{
    (void)state;
    const char *args[] = {"--op",
                          "layerwise",
                          "--num-layers",
                          "4",
                          "--block-size",
                          "64K",
                          "--compute-us",
                          "300",
                          "--iters",
                          "3",
                          "--warmup",
                          "1",
                          NULL};
    cu_result r;
    cJSON *root = bench_json(args, &r);
    assert_string_equal(str(obj(root, "config"), "transport"), "tcp");
    const cJSON *rows = obj(root, "rows");
    assert_int_equal(cJSON_GetArraySize(rows), 1);
    const cJSON *row = cJSON_GetArrayItem(rows, 0);
    assert_true(num(row, "layers") == 4);
    assert_true(num(row, "rounds") == 3);
    assert_true(num(row, "layer_bytes") == 2 * 65536);
    assert_true(num(row, "push_ms") > 0);
    /* (a) sleeps 4 x 300 us before it pushes. */
    assert_true(num(row, "compute_then_push_ms") >= 1.2);
    assert_true(num(row, "layerwise_ms") >= 1.2);
    assert_true(num(row, "ratio_layerwise_to_sequential") > 0);
    assert_true(num(row, "ratio_layerwise_to_ideal") > 0);
    /* A layer's share of the slot against that layer alone: positive, and
     * far from the 4x an inverted ratio would give. */
    assert_true(num(row, "layer_efficiency") > 0.05);
    assert_true(num(row, "layer_efficiency") < 20);
    assert_non_null(strstr(r.out, "  layerwise: (b)/(a) = "));
    assert_non_null(strstr(r.out, "; (b)/ideal = "));
    assert_non_null(strstr(r.out, "; per-layer efficiency "));
    assert_non_null(strstr(r.out, "where (b) goes: compute "));
    cJSON_Delete(root);
    cu_result_free(&r);
}

/* --op slices --row: that row alone, over loop (small: 1 MiB a tensor). */
static void
test_bench_slices_row(void **state)
{
    (void)state;
    cu_result r =
        cu_run(120, (const char *[]){"bench", "--op", "slices", "-t", "loop",
                                     "--row", "heads-nhd", "--rounds", "2",
                                     "--block-size", "1M", NULL});
    if (r.code != 0)
        cu_dump("bench --op slices --row heads-nhd", &r);
    assert_int_equal(r.code, 0);
    assert_non_null(strstr(r.out, "\nheads-nhd "));
    assert_null(strstr(r.out, "\nheads-hnd "));
    assert_null(strstr(r.out, "copy floor"));
    assert_null(strstr(r.out, "planner:"));
    cu_result_free(&r);
}

/* The 4-source row pulls its 1-source reference in the same rounds and
 * prints the two against each other. */
static void
test_bench_slices_sources(void **state)
{
    (void)state;
    cu_result r =
        cu_run(120, (const char *[]){"bench", "--op", "slices", "-t", "loop",
                                     "--row", "4-sources", "--rounds", "2",
                                     "--block-size", "1M", NULL});
    if (r.code != 0)
        cu_dump("bench --op slices --row 4-sources", &r);
    assert_int_equal(r.code, 0);
    assert_non_null(strstr(r.out, "\n4-sources "));
    assert_non_null(strstr(r.out, "\n1-source "));
    assert_non_null(strstr(r.out, "\n4-sources vs 1-source (same bytes, same "
                                  "layouts, in the same rounds): "));
    assert_null(strstr(r.out, "\nheads-hnd "));
    cu_result_free(&r);
}

static void
test_bench_link(void **state)
{
    (void)state;
    const char *args[] = {"--op", "link",       "--iters", "5", "--warmup",
                          "1",    "--decoders", "2",       NULL};
    cu_result r;
    cJSON *root = bench_json(args, &r);
    const cJSON *rows = obj(root, "rows");
    assert_int_equal(cJSON_GetArraySize(rows), 1);
    const cJSON *row = cJSON_GetArrayItem(rows, 0);
    assert_true(num(row, "iters") == 5);
    assert_true(num(row, "link_p50_us") > 0);
    assert_true(num(row, "link_p99_us") >= num(row, "link_p50_us"));
    assert_true(num(row, "unlink_p50_us") > 0);
    cJSON_Delete(root);
    cu_result_free(&r);
}

static void
test_bench_register_auto(void **state)
{
    (void)state;
    const char *args[] = {"--register", "--decoders",   "2",    "--block-size",
                          "8K:16K",     "--iters",      "5",    "--warmup",
                          "0",          "--total-size", "256K", NULL};
    cu_result r;
    cJSON *root = bench_json(args, &r);
    assert_non_null(strstr(r.out, "prompt memory registered"));
    assert_true(cJSON_IsTrue(obj(obj(root, "config"), "register")));
    const char *base = str(obj(root, "config"), "baseline");
    const cJSON *rows = obj(root, "rows");
    assert_int_equal(cJSON_GetArraySize(rows), 2);
    for (int i = 0; i < 2; i++)
        check_row(cJSON_GetArrayItem(rows, i), 8192 << i, 1, 10, base);
    cJSON_Delete(root);
    cu_result_free(&r);
}

static bool
have_gnuplot(void)
{
    return access("/usr/bin/gnuplot", X_OK) == 0 ||
           access("/usr/local/bin/gnuplot", X_OK) == 0;
}

/* --rounds 3: every row is the median of three, with its spread. */
static void
test_bench_rounds(void **state)
{
    (void)state;
    char csv[64];
    cu_tmpname(csv, sizeof(csv), ".csv");
    const char *args[] = {"-t",           "loop",   "--block-size", "4K:8K",
                          "--iters",      "7",      "--total-size", "1M",
                          "--rounds",     "3",      "--csv",        csv,
                          NULL};
    cu_result r;
    cJSON *root = bench_json(args, &r);
    assert_non_null(strstr(r.out, "round 3 of 3 done"));
    assert_non_null(strstr(r.out, "range"));
    const cJSON *rows = obj(root, "rows");
    assert_int_equal(cJSON_GetArraySize(rows), 2);
    for (int i = 0; i < 2; i++) {
        const cJSON *row = cJSON_GetArrayItem(rows, i);
        /* Seven timed calls a round, three rounds. */
        assert_true(num(row, "rounds") == 3);
        assert_true(num(row, "calls") == 21);
        assert_true(num(row, "iters") == 21);
        const cJSON *sp = obj(row, "spread");
        double g = num(row, "gbps"), q = num(row, "ratio");
        assert_true(num(sp, "gbps_min") <= g && g <= num(sp, "gbps_max"));
        assert_true(num(sp, "ratio_min") <= q && q <= num(sp, "ratio_max"));
        double b = num(obj(row, "baseline"), "gbps");
        assert_true(num(sp, "baseline_gbps_min") <= b &&
                    b <= num(sp, "baseline_gbps_max"));
        /* The rounds themselves: the extremes are two of them. */
        const cJSON *pr = obj(row, "per_round");
        assert_int_equal(cJSON_GetArraySize(pr), 3);
        bool lo = false, hi = false;
        for (int k = 0; k < 3; k++) {
            double rk = num(cJSON_GetArrayItem(pr, k), "ratio");
            lo = lo || rk == num(sp, "ratio_min");
            hi = hi || rk == num(sp, "ratio_max");
        }
        assert_true(lo && hi);
    }
    char *text = cu_read_file(csv, NULL);
    assert_non_null(text);
    unlink(csv);
    assert_non_null(strstr(text, ",rounds,gbps_min,gbps_max,"));
    assert_non_null(strstr(strchr(text, '\n'), ",3,"));
    free(text);
    cJSON_Delete(root);
    cu_result_free(&r);
}

static void
test_bench_plot(void **state)
{
    (void)state;
    if (!have_gnuplot())
        skip();
    char png[64];
    cu_tmpname(png, sizeof(png), ".png");
    const char *args[] = {"bench",  "-t",      "loop", "--block-size",
                          "4K:64K", "--iters", "5",    "--total-size",
                          "1M",     "--plot",  png,    "--no-progress",
                          NULL};
    cu_result r = cu_run(90, args);
    if (r.code != 0)
        cu_dump("bench --plot", &r);
    assert_int_equal(r.code, 0);
    size_t len = 0;
    char *data = cu_read_file(png, &len);
    assert_non_null(data);
    unlink(png);
    assert_true(len > 1000);
    assert_memory_equal(data, "\x89PNG\r\n\x1a\n", 8);
    free(data);
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
        cmocka_unit_test_teardown(test_bench_tcp_sweep_json_csv, teardown),
        cmocka_unit_test_teardown(test_bench_push_two_decoders_loop, teardown),
        cmocka_unit_test_teardown(test_bench_pull_blocks, teardown),
        cmocka_unit_test_teardown(test_bench_pull_blocks_inflight, teardown),
        cmocka_unit_test_teardown(test_bench_layerwise, teardown),
        cmocka_unit_test_teardown(test_bench_slices_row, teardown),
        cmocka_unit_test_teardown(test_bench_slices_sources, teardown),
        cmocka_unit_test_teardown(test_bench_link, teardown),
        cmocka_unit_test_teardown(test_bench_register_auto, teardown),
        cmocka_unit_test_teardown(test_bench_rounds, teardown),
        cmocka_unit_test_teardown(test_bench_plot, teardown),
    };
    return cu_main("bench", tests, sizeof(tests) / sizeof(tests[0]), argc,
                   argv);
}
