/*
 * llmdd_metrics_text (llmdd.h, docs/operations.md): after N pulls of B
 * bytes between two in-process instances the counters say N and N * B, the
 * histogram counts N with cumulative, monotone buckets whose +Inf bucket is
 * the count; failures and copies land under their own labels; the gauges
 * see links and caches; the snprintf contract holds at every capacity; and
 * the text is valid exposition format: checked by our own strict line
 * parser always, and by `promtool check metrics` too where promtool exists.
 */
#include <ctype.h>
#include <poll.h>
#include <time.h>
#include <inttypes.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "harness/harness.h"

#define PROMPT 71
#define DECODER 72
#define NPULLS 5
#define PROMTOOL "/usr/bin/promtool"

typedef struct {
    llmdd *prompt, *decoder;
    llmdd_cache src, dst;
} pair;

static char *
text_of(llmdd *dd)
{
    size_t n = llmdd_metrics_text(dd, NULL, 0);
    char *t = malloc(n + 1);

    assert_non_null(t);
    assert_int_equal(llmdd_metrics_text(dd, t, n + 1), n);
    assert_int_equal(strlen(t), n);
    return t;
}

/* The value of the sample whose name and labels are exactly `series`; -1
 * when the text has no such line. */
static int64_t
value_of(const char *text, const char *series)
{
    size_t n = strlen(series);

    for (const char *p = text; p != NULL && *p != '\0';) {
        if (strncmp(p, series, n) == 0 && p[n] == ' ')
            return strtoll(p + n + 1, NULL, 10);
        p = strchr(p, '\n');
        p = p != NULL ? p + 1 : NULL;
    }
    return -1;
}

static bool
name_ok(const char *s, size_t n)
{
    if (n == 0 || !(isalpha((unsigned char)s[0]) || s[0] == '_' || s[0] == ':'))
        return false;
    for (size_t i = 1; i < n; i++)
        if (!(isalnum((unsigned char)s[i]) || s[i] == '_' || s[i] == ':'))
            return false;
    return true;
}

/* `{a="x",b="y"}`, values without escapes (ours never need one). Returns
 * the length consumed, 0 when malformed. */
static size_t
labels_len(const char *s)
{
    size_t i = 1;

    if (s[0] != '{')
        return 0;
    while (s[i] != '}') {
        size_t k = i;
        while (isalnum((unsigned char)s[i]) || s[i] == '_')
            i++;
        if (!name_ok(s + k, i - k) || s[i] != '=' || s[i + 1] != '"')
            return 0;
        i += 2;
        while (s[i] != '"' && s[i] != '\\' && s[i] != '\n' && s[i] != '\0')
            i++;
        if (s[i] != '"')
            return 0;
        i++;
        if (s[i] == ',')
            i++;
        else if (s[i] != '}')
            return 0;
    }
    return i + 1;
}

/*
 * Text format 0.0.4, strictly: every line a `# HELP name text`, a
 * `# TYPE name counter|gauge|histogram`, or `name{labels} value`, with
 * names starting llmdd_, each sample under the TYPE of its family, and the
 * text ending in a newline.
 */
static void
check_format(const char *text)
{
    char family[128] = "";
    int lines = 0;

    assert_true(strlen(text) > 0 && text[strlen(text) - 1] == '\n');
    for (const char *p = text; *p != '\0'; lines++) {
        const char *end = strchr(p, '\n');
        assert_non_null(end);
        size_t len = (size_t)(end - p);
        if (strncmp(p, "# HELP ", 7) == 0) {
            const char *n = p + 7, *sp = memchr(n, ' ', (size_t)(end - n));
            assert_non_null(sp);
            assert_true(name_ok(n, (size_t)(sp - n)));
        } else if (strncmp(p, "# TYPE ", 7) == 0) {
            const char *n = p + 7, *sp = memchr(n, ' ', (size_t)(end - n));
            assert_non_null(sp);
            assert_true(name_ok(n, (size_t)(sp - n)));
            assert_true((size_t)(sp - n) < sizeof(family));
            memcpy(family, n, (size_t)(sp - n));
            family[sp - n] = '\0';
            size_t tl = (size_t)(end - sp - 1);
            assert_true((tl == 7 && !strncmp(sp + 1, "counter", 7)) ||
                        (tl == 5 && !strncmp(sp + 1, "gauge", 5)) ||
                        (tl == 9 && !strncmp(sp + 1, "histogram", 9)));
        } else {
            size_t i = 0;
            while (i < len && p[i] != '{' && p[i] != ' ')
                i++;
            if (!name_ok(p, i) || strncmp(p, "llmdd_", 6) != 0)
                fail_msg("bad metric name in: %.*s", (int)len, p);
            size_t fl = strlen(family);
            if (fl == 0 || strncmp(p, family, fl) != 0)
                fail_msg("sample outside its family: %.*s", (int)len, p);
            if (p[i] == '{') {
                size_t l = labels_len(p + i);
                if (l == 0)
                    fail_msg("bad labels in: %.*s", (int)len, p);
                i += l;
            }
            if (p[i] != ' ')
                fail_msg("no value in: %.*s", (int)len, p);
            char *vend;
            strtod(p + i + 1, &vend);
            if (vend != end || vend == p + i + 1)
                fail_msg("bad value in: %.*s", (int)len, p);
        }
        p = end + 1;
    }
    assert_true(lines > 10);
}

/* promtool where the prometheus package is installed; its lint too. */
static void
check_promtool(const char *text)
{
    char path[] = "/tmp/llmdd-metrics-XXXXXX", cmd[256];

    if (access(PROMTOOL, X_OK) != 0) {
        print_message("promtool absent: the built-in format check only\n");
        return;
    }
    int fd = mkstemp(path);
    assert_true(fd >= 0);
    size_t n = strlen(text);
    assert_int_equal(write(fd, text, n), (ssize_t)n);
    close(fd);
    snprintf(cmd, sizeof(cmd), PROMTOOL " check metrics < %s", path);
    int rc = system(cmd);
    unlink(path);
    if (rc != 0)
        fail_msg("promtool check metrics failed on:\n%s", text);
}

static int
setup(void **state)
{
    static pair p;
    llmdd_cache_desc d = th_desc_kv();
    uint16_t port;

    memset(&p, 0, sizeof(p));
    if (llmdd_create(PROMPT, LLMDD_ROLE_PROMPT, &p.prompt) != LLM_SUCCESS ||
        th_init_listen(p.prompt, "127.0.0.1", &port, NULL, 0) != LLM_SUCCESS ||
        llmdd_create(DECODER, LLMDD_ROLE_MIX, &p.decoder) != LLM_SUCCESS ||
        llmdd_initialize(p.decoder, NULL, 0) != LLM_SUCCESS ||
        llmdd_allocate_cache(p.prompt, &d, &p.src) != LLM_SUCCESS ||
        llmdd_allocate_cache(p.decoder, &d, &p.dst) != LLM_SUCCESS ||
        th_link(p.decoder, PROMPT, "127.0.0.1", port, 5000) != LLM_SUCCESS)
        return -1;
    *state = &p;
    return 0;
}

static int
teardown(void **state)
{
    pair *p = *state;

    llmdd_destroy(p->decoder);
    llmdd_destroy(p->prompt);
    return 0;
}

static void
test_counts_match_calls(void **state)
{
    pair *p = *state;
    llmdd_cache_index idx = {
        .cluster_id = PROMPT, .cache_id = p->src.cache_id, .batch_index = 1};
    uint64_t slot = th_tensor_size(&p->dst.desc) /
                    (uint64_t)p->dst.desc.shape[0] * p->dst.desc.num_tensors;
    char s[256];

    struct timespec t0, t1;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    for (int i = 0; i < NPULLS; i++)
        assert_int_equal(
            llmdd_pull_kv_cache(p->decoder, &idx, &p->dst, 2, -1, NULL),
            LLM_SUCCESS);
    clock_gettime(CLOCK_MONOTONIC, &t1);
    double wall = (double)(t1.tv_sec - t0.tv_sec) +
                  (double)(t1.tv_nsec - t0.tv_nsec) / 1e9;
    llmdd_cache_index none = idx;
    none.cache_id = 999;
    assert_int_equal(
        llmdd_pull_kv_cache(p->decoder, &none, &p->dst, 0, -1, NULL),
        LLM_KV_CACHE_NOT_EXIST);
    assert_int_equal(
        llmdd_copy_kv_cache(p->decoder, &p->dst, &p->dst, 2, 3, 0, -1),
        LLM_SUCCESS);

    char *t = text_of(p->decoder);
    const char *pull = "{side=\"caller\",op=\"pull\",transport=\"loop\","
                       "status=\"LLM_SUCCESS\"}";
    snprintf(s, sizeof(s), "llmdd_transfers_total%s", pull);
    assert_int_equal(value_of(t, s), NPULLS);
    snprintf(s, sizeof(s), "llmdd_transfer_bytes_total%s", pull);
    assert_int_equal(value_of(t, s), NPULLS * slot);
    assert_int_equal(
        value_of(t, "llmdd_transfers_total{side=\"caller\",op=\"pull\","
                    "transport=\"loop\",status=\"LLM_KV_CACHE_NOT_EXIST\"}"),
        1);
    assert_int_equal(
        value_of(t, "llmdd_transfers_total{side=\"caller\",op=\"copy\","
                    "transport=\"local\",status=\"LLM_SUCCESS\"}"),
        1);
    assert_int_equal(
        value_of(t, "llmdd_transfer_bytes_total{side=\"caller\",op=\"copy\","
                    "transport=\"local\",status=\"LLM_SUCCESS\"}"),
        slot);

    /* The histogram: successes only; cumulative; +Inf is the count. */
    const char *h = "llmdd_transfer_duration_seconds";
    snprintf(s, sizeof(s), "%s_count{op=\"pull\",transport=\"loop\"}", h);
    assert_int_equal(value_of(t, s), NPULLS);
    int64_t prev = 0, nb = 0;
    const char *line = t;
    char want[128];
    snprintf(want, sizeof(want), "%s_bucket{op=\"pull\",transport=\"loop\",",
             h);
    while ((line = strstr(line, want)) != NULL) {
        const char *v = strchr(line, ' ');
        int64_t c = strtoll(v + 1, NULL, 10);
        assert_true(c >= prev);
        prev = c;
        nb++;
        if (strncmp(line + strlen(want), "le=\"+Inf\"", 9) == 0)
            assert_int_equal(c, NPULLS);
        line = v;
    }
    assert_int_equal(nb, 23); /* 1 us .. 10 s in 1/2.5/5 steps, and +Inf */
    snprintf(s, sizeof(s),
             "%s_bucket{op=\"pull\",transport=\"loop\","
             "le=\"+Inf\"}",
             h);
    assert_int_equal(value_of(t, s), NPULLS);
    /* The durations are the calls' own: their sum is positive and no more
     * than the time the loop of calls took (a histogram of zeros, or of
     * anything but these calls, fails here), give or take the calibration
     * of the TSC the library times with (a loaded host skews it a little
     * against CLOCK_MONOTONIC). */
    snprintf(s, sizeof(s), "%s_sum{op=\"pull\",transport=\"loop\"} ", h);
    const char *sum = strstr(t, s);
    assert_non_null(sum);
    double secs = strtod(sum + strlen(s), NULL);
    assert_true(secs > 0);
    assert_true(secs <= wall * 1.25);

    /* Gauges and link counters. */
    assert_int_equal(value_of(t, "llmdd_links{direction=\"out\"}"), 1);
    assert_int_equal(value_of(t, "llmdd_links{direction=\"in\"}"), 0);
    assert_int_equal(
        value_of(t, "llmdd_link_attempts_total{status=\"LLM_SUCCESS\"}"), 1);
    assert_int_equal(value_of(t, "llmdd_links_established_total"), 1);
    assert_int_equal(value_of(t, "llmdd_caches{kind=\"allocated\"}"), 1);
    assert_true(value_of(t, "llmdd_cache_bytes{kind=\"allocated\"}") >=
                (int64_t)th_tensor_size(&p->dst.desc) *
                    p->dst.desc.num_tensors);
    assert_int_equal(value_of(t, "llmdd_transfers_in_flight"), 0);
    assert_int_equal(value_of(t, "llmdd_notifications_sent_total"), 0);
    assert_int_equal(value_of(t, "llmdd_notifications_received_total"), 0);
    assert_int_equal(value_of(t, "llmdd_heartbeat_drops_total"), 0);
    snprintf(s, sizeof(s),
             "llmdd_instance_info{cluster_id=\"%d\",role=\"mix\","
             "version=\"%s\"}",
             DECODER, llmdd_version());
    assert_int_equal(value_of(t, s), 1);
    check_format(t);
    check_promtool(t);
    free(t);

    /* The owner sees the link from its side; the loop moves the bytes
     * without it, so it served nothing it could count. */
    t = text_of(p->prompt);
    assert_int_equal(value_of(t, "llmdd_links{direction=\"in\"}"), 1);
    assert_int_equal(value_of(t, "llmdd_transfers_in_flight"), 0);
    check_format(t);
    check_promtool(t);
    free(t);
}

static void
test_snprintf_contract(void **state)
{
    pair *p = *state;
    char *full = text_of(p->decoder);
    size_t n = strlen(full);
    char small[16];

    /* cap 0 writes nothing, not even the NUL. */
    memset(small, 'x', sizeof(small));
    assert_int_equal(llmdd_metrics_text(p->decoder, small, 0), n);
    assert_int_equal(small[0], 'x');
    /* A small cap: the text's first cap - 1 bytes and a NUL. */
    assert_int_equal(llmdd_metrics_text(p->decoder, small, sizeof(small)), n);
    assert_int_equal(strlen(small), sizeof(small) - 1);
    assert_memory_equal(small, full, sizeof(small) - 1);
    assert_int_equal(llmdd_metrics_text(p->decoder, small, 1), n);
    assert_int_equal(small[0], '\0');
    /* Exactly n + 1: all of it; n: all but the last byte. */
    char *buf = malloc(n + 1);
    assert_non_null(buf);
    memset(buf, 'x', n + 1);
    assert_int_equal(llmdd_metrics_text(p->decoder, buf, n + 1), n);
    assert_string_equal(buf, full);
    memset(buf, 'x', n + 1);
    assert_int_equal(llmdd_metrics_text(p->decoder, buf, n), n);
    assert_int_equal(strlen(buf), n - 1);
    assert_memory_equal(buf, full, n - 1);
    assert_int_equal(buf[n], 'x'); /* nothing past cap */
    free(buf);
    free(full);
    /* No instance: nothing to say. */
    assert_int_equal(llmdd_metrics_text(NULL, small, sizeof(small)), 0);
    assert_int_equal(small[0], '\0');
}

/* Notifications are counted where they are sent and where they arrive. */
static void
test_notifications_counted(void **state)
{
    pair *p = *state;
    llmdd_notify got[8];
    size_t n, total = 0;

    for (int i = 0; i < 3; i++)
        assert_int_equal(llmdd_send_notify(p->decoder, PROMPT, "n", 1),
                         LLM_SUCCESS);
    while (total < 3) {
        struct pollfd pfd = {.fd = llmdd_notify_fd(p->prompt),
                             .events = POLLIN};
        assert_int_equal(poll(&pfd, 1, 5000), 1);
        assert_int_equal(llmdd_get_notifies(p->prompt, got, 8, &n),
                         LLM_SUCCESS);
        total += n;
    }
    char *t = text_of(p->decoder);
    assert_int_equal(value_of(t, "llmdd_notifications_sent_total"), 3);
    assert_int_equal(value_of(t, "llmdd_notifications_received_total"), 0);
    free(t);
    t = text_of(p->prompt);
    assert_int_equal(value_of(t, "llmdd_notifications_received_total"), 3);
    assert_int_equal(value_of(t, "llmdd_notifications_sent_total"), 0);
    free(t);
}

int
main(int argc, char **argv)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_counts_match_calls),
        cmocka_unit_test(test_snprintf_contract),
        cmocka_unit_test(test_notifications_counted),
    };

    th_test_filter(argc, argv);
    return cmocka_run_group_tests(tests, setup, teardown);
}
