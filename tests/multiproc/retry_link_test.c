/*
 * A decoder that starts before its prompt listens (docs/operations.md,
 * Logs): it retries llmdd_link_clusters until the prompt, started while it
 * retries, listens; then it pulls and unlinks. The run succeeds, and
 * neither process writes a line holding "error" in any case at the default
 * log level: a refused connect that a caller retries is no error, and
 * runners of the reference's examples fail a run whose output holds one.
 */
#include <fcntl.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/mman.h>
#include <unistd.h>

#include "harness/mp.h"

#define PROMPT 1

static int
teardown(void **state)
{
    (void)state;
    mp_reap_all();
    return 0;
}

struct prompt_start {
    th_proc p;
    const char *const *args;
    int rc;
};

static void *
prompt_main(void *arg)
{
    struct prompt_start *s = arg;

    s->rc = th_proc_start(&s->p, NULL, s->args);
    return NULL;
}

/* The lines of text holding "error" in any case, printed; their count. */
static int
error_lines(const char *text)
{
    int n = 0;

    for (const char *l = text; *l != '\0';) {
        const char *end = strchr(l, '\n');
        size_t len = end != NULL ? (size_t)(end - l) : strlen(l);
        for (size_t i = 0; i + 5 <= len; i++) {
            if (strncasecmp(l + i, "error", 5) == 0) {
                fprintf(stderr, "a line with \"error\": %.*s\n", (int)len, l);
                n++;
                break;
            }
        }
        l += len + (end != NULL);
    }
    return n;
}

static void
test_link_retried_until_prompt_listens(void **state)
{
    char listen[64];
    llmdd_status st;
    llmdd *dd;

    (void)state;
    uint16_t port = th_free_port();
    snprintf(listen, sizeof(listen), "llm.ListenIpInfo=%s:%u", MP_IP, port);
    const char *const args[] = {"--cluster", "1",    "--role", "prompt",
                                "--opt",     listen, NULL};

    /* Both processes write their log lines here: the prompt inherits it. */
    int out = memfd_create("retry_link_output", MFD_CLOEXEC);
    int saved = dup(STDERR_FILENO);
    assert_true(out >= 0 && saved >= 0);
    assert_int_equal(dup2(out, STDERR_FILENO), STDERR_FILENO);

    dd = mp_decoder(MP_SELF, NULL, 0);
    /* Nobody listens yet: refused. */
    st = th_link(dd, PROMPT, MP_IP, port, 1000);
    bool refused = st == LLM_LINK_FAILED;

    /* The prompt starts while the decoder retries, as the reference's
     * runner starts both sides at once. */
    struct prompt_start ps = {.args = args, .rc = -1};
    pthread_t t;
    bool started = pthread_create(&t, NULL, prompt_main, &ps) == 0;
    int64_t end = th_now_ms() + 30000;
    int pause = 10, attempts = 1;
    while (st != LLM_SUCCESS && th_now_ms() < end && started) {
        th_sleep_ms(pause); /* the retry loop's back-off, not a wait */
        pause = pause * 2 > 200 ? 200 : pause * 2;
        st = th_link(dd, PROMPT, MP_IP, port, 1000);
        attempts++;
    }
    if (started)
        pthread_join(t, NULL);
    llmdd_status pulled = LLM_FAILED, unlinked = LLM_FAILED;
    if (st == LLM_SUCCESS && ps.rc == 0) {
        pulled = mp_pull_check(dd, PROMPT, ps.p.ids.kv, 1);
        unlinked = th_unlink(dd, PROMPT, MP_IP, port, false, 2000);
    }
    llmdd_destroy(dd);
    int stopped = ps.rc == 0 ? th_proc_stop(&ps.p) : -1;

    /* Back to the test's own stderr, with what both wrote. */
    fflush(stderr);
    assert_int_equal(dup2(saved, STDERR_FILENO), STDERR_FILENO);
    close(saved);
    off_t len = lseek(out, 0, SEEK_END);
    assert_true(len >= 0);
    char *text = calloc(1, (size_t)len + 1);
    assert_non_null(text);
    assert_int_equal(pread(out, text, (size_t)len, 0), len);
    close(out);
    fprintf(stderr, "%s", text);
    fprintf(stderr, "retry_link: %d link attempts, the last %s\n", attempts,
            llmdd_status_str(st));

    assert_true(refused);
    assert_true(started);
    assert_int_equal(ps.rc, 0);
    assert_int_equal(st, LLM_SUCCESS);
    assert_int_equal(pulled, LLM_SUCCESS);
    assert_int_equal(unlinked, LLM_SUCCESS);
    assert_int_equal(stopped, 0);
    int bad = error_lines(text);
    free(text);
    assert_int_equal(bad, 0);
}

int
main(int argc, char **argv)
{
    /* The default level: what a runner of the examples sees. */
    unsetenv("LLMDD_LOG_LEVEL");
    unsetenv("LLMDD_LOG_FORMAT");
    th_test_filter(argc, argv);
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_teardown(test_link_retried_until_prompt_listens,
                                  teardown),
    };
    return cmocka_run_group_tests_name("multiproc.retry_link", tests, NULL,
                                       NULL);
}
