/*
 * Load: many decoder processes pull from one prompt process at once, each
 * checking every byte of every pull against the deterministic fill. Zero
 * mismatches, zero errors, every decoder exits cleanly (under ASan that
 * includes its leak check), and the prompt's fds and threads return to where
 * they were. Prints the aggregate throughput.
 *
 *   load_test
 * LLMDD_LOAD_DECODERS (default 8) and LLMDD_LOAD_PULLS (default 2000 small
 * pulls per decoder; fewer under sanitizers) scale it.
 */
#include <stdlib.h>
#include <string.h>

#include "harness/fault_util.h"

#define MAX_DECODERS 64

static th_proc prompt;

static int
setup(void **state)
{
    const char *args[] = {"--cluster", "1", "--role", "prompt",
                          "--transport", "tcp", NULL};

    (void)state;
    return th_proc_start(&prompt, NULL, args);
}

static int
teardown(void **state)
{
    (void)state;
    return th_proc_stop(&prompt) == 0 ? 0 : -1;
}

static unsigned long long
field(const char *line, const char *name)
{
    const char *p = strstr(line, name);

    return p != NULL ? strtoull(p + strlen(name), NULL, 10) : ~0ull;
}

/* Runs n decoders of `pulls` pulls each from cache id (shape desc). */
static void
load(const char *what, int64_t id, unsigned seed, const char *desc, int n,
     long pulls)
{
    char sport[16], scache[24], sseed[16], spulls[24], line[256];
    th_child d[MAX_DECODERS];
    unsigned long long total = 0, bytes = 0, slowest = 0;

    snprintf(sport, sizeof(sport), "%u", prompt.port);
    snprintf(scache, sizeof(scache), "%lld", (long long)id);
    snprintf(sseed, sizeof(sseed), "%u", seed);
    snprintf(spulls, sizeof(spulls), "%ld", pulls);
    const char *argv[] = {fu_decoder_path(), "--port", sport, "--cache",
                          scache, "--seed", sseed, "--desc", desc,
                          "--pulls", spulls, "--transport", "tcp", "--go",
                          NULL};
    int fds = fu_fd_count(prompt.pid);
    long threads = fu_proc_status(prompt.pid, "Threads");
    long rss0 = fu_proc_status(prompt.pid, "VmRSS");

    for (int i = 0; i < n; i++) {
        assert_int_equal(th_child_spawn(&d[i], argv), 0);
        assert_int_equal(
            th_child_readline(&d[i], line, sizeof(line), 20000 * FU_SLOW), 0);
        assert_string_equal(line, "LINKED");
    }
    int64_t t0 = th_now_ms();
    for (int i = 0; i < n; i++)
        assert_int_equal(th_child_write(&d[i], "go\n"), 0);
    for (int i = 0; i < n; i++) {
        assert_int_equal(th_child_readline(&d[i], line, sizeof(line), 300000),
                         0);
        if (field(line, " errors=") != 0 || field(line, " mismatches=") != 0)
            fail_msg("decoder %d: %s", i, line);
        total += field(line, " ok=");
        bytes += field(line, " bytes=");
        unsigned long long m = field(line, " maxms=");
        slowest = m > slowest ? m : slowest;
    }
    int64_t ms = th_now_ms() - t0;
    for (int i = 0; i < n; i++)
        assert_int_equal(th_child_reap(&d[i], 10000 * FU_SLOW), 0);
    assert_int_equal((long long)total, (long long)n * pulls);
    double sec = ms > 0 ? (double)ms / 1000 : 0.001;
    printf("load_test: %s: %d decoders x %ld pulls = %llu pulls of %llu "
           "bytes, 0 mismatches, 0 errors, in %.2f s: %.0f pulls/s, "
           "%.3f GB/s aggregate, slowest pull %llu ms\n",
           what, n, pulls, total, bytes / total, sec, (double)total / sec,
           (double)bytes / sec / 1e9, slowest);
    assert_true(fu_settles(prompt.pid, fds, threads, 5000 * FU_SLOW));
    long rss1 = fu_proc_status(prompt.pid, "VmRSS");
    printf("load_test: prompt RSS %ld kB before, %ld kB after; %d fds, "
           "%ld threads as before\n",
           rss0, rss1, fds, threads);
    assert_int_equal(th_proc_cmd(&prompt, "ping", NULL, 0), 0);
}

static void
test_small_pulls(void **state)
{
    int n = (int)fu_env("LLMDD_LOAD_DECODERS", 8);
    long pulls = fu_env("LLMDD_LOAD_PULLS", 2000 / FU_SLOW);

    (void)state;
    assert_true(n <= MAX_DECODERS);
    load("8 KiB pulls", prompt.ids.kv, 1, "kv", n, pulls);
}

static void
test_big_pulls(void **state)
{
    int n = (int)fu_env("LLMDD_LOAD_DECODERS", 8);
    long pulls = fu_env("LLMDD_LOAD_PULLS", 2000 / FU_SLOW) / 16;
    char reply[64];

    (void)state;
    assert_true(n <= MAX_DECODERS);
    assert_int_equal(
        th_proc_cmd(&prompt, "alloc-big 4 2 6", reply, sizeof(reply)), 0);
    load("2 MiB pulls", atoll(reply + 3), 6, "big:4:2", n, pulls);
}

int
main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_small_pulls),
        cmocka_unit_test(test_big_pulls),
    };

    return cmocka_run_group_tests(tests, setup, teardown);
}
