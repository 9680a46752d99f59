/*
 * The logger's line formats (base/log.h): ISO-8601 UTC timestamps with
 * milliseconds and pid/tid in text lines; with LLMDD_LOG_FORMAT=json one
 * object a line whose message is escaped so any collector parses it.
 */
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "base/log.h"
#include "harness/harness.h"

/* Runs one log call with stderr sent to a file; returns what it wrote. */
static char *
capture(const char *msg)
{
    char path[] = "/tmp/llmdd-log-XXXXXX";
    int fd = mkstemp(path), saved = dup(STDERR_FILENO);
    static char buf[8192];

    assert_true(fd >= 0 && saved >= 0);
    dup2(fd, STDERR_FILENO);
    log_error("%s", msg);
    dup2(saved, STDERR_FILENO);
    close(saved);
    ssize_t n = pread(fd, buf, sizeof(buf) - 1, 0);
    assert_true(n > 0);
    buf[n] = '\0';
    close(fd);
    unlink(path);
    return buf;
}

static void
test_json_escapes(void **state)
{
    (void)state;
    char *line = capture("say \"hi\" \\ to\nthe\tpeer \x01 now");
    char want[128];

    /* {"ts":"YYYY-MM-DDTHH:MM:SS.mmmZ","level":"error","pid":P,"tid":T,... */
    assert_int_equal(strncmp(line, "{\"ts\":\"", 7), 0);
    assert_int_equal(line[7 + 10], 'T');
    assert_int_equal(line[7 + 19], '.');
    assert_int_equal(line[7 + 23], 'Z');
    snprintf(want, sizeof(want),
             "\",\"level\":\"error\",\"pid\":%d,\"tid\":", (int)getpid());
    if (strncmp(line + 7 + 24, want, strlen(want)) != 0)
        fail_msg("%s", line);
    const char *msg = strstr(line, ",\"msg\":\"");
    assert_non_null(msg);
    assert_string_equal(msg, ",\"msg\":\"say \\\"hi\\\" \\\\ to\\nthe\\tpeer "
                             "\\u0001 now\"}\n");
    /* A message longer than the line still ends as a whole object. */
    char *big = malloc(3000);
    assert_non_null(big);
    memset(big, '"', 2999);
    big[2999] = '\0';
    line = capture(big);
    free(big);
    size_t n = strlen(line);
    assert_true(n > 100);
    assert_string_equal(line + n - 3, "\"}\n");
    assert_true(line[n - 4] == '"' && line[n - 5] == '\\');
}

int
main(int argc, char **argv)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_json_escapes),
    };

    setenv("LLMDD_LOG_FORMAT", "json", 1); /* read once, at the first line */
    th_test_filter(argc, argv);
    return cmocka_run_group_tests(tests, NULL, NULL);
}
