/*
 * The /metrics endpoint as an operator scrapes it: `llmdd serve --metrics`
 * and `llmdd pull` as two real processes over tcp; the serving side's
 * "served" counters and bytes match what the puller moved; the endpoint
 * speaks HTTP with the exposition content type, answers 404 elsewhere, and
 * `llmdd stats` reads it. Clients that trickle header bytes neither lock
 * other clients out nor hold their connections past the request cap.
 */
#include <arpa/inet.h>
#include <netinet/in.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "harness/cli_util.h"

#define SHAPE "--model", "tiny", "--tokens", "64", "--batch", "3"
#define REPLY_MAX (1u << 20)

/* A connection to 127.0.0.1:port from the loopback address `from`. */
static int
http_connect(uint16_t port, const char *from)
{
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons(port)};
    struct sockaddr_in me = {.sin_family = AF_INET};
    int fd = socket(AF_INET, SOCK_STREAM, 0);

    assert_true(fd >= 0);
    assert_int_equal(inet_pton(AF_INET, from, &me.sin_addr), 1);
    assert_int_equal(bind(fd, (struct sockaddr *)&me, sizeof(me)), 0);
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    assert_int_equal(connect(fd, (struct sockaddr *)&a, sizeof(a)), 0);
    return fd;
}

/* GET path from 127.0.0.1:port with HTTP/1.0; the whole reply, malloc'd. */
static char *
http_get_from(uint16_t port, const char *path, const char *from)
{
    char req[256], *buf = malloc(REPLY_MAX + 1);
    size_t len = 0;
    ssize_t n;

    assert_non_null(buf);
    int fd = http_connect(port, from);
    int rl = snprintf(req, sizeof(req), "GET %s HTTP/1.0\r\n\r\n", path);
    assert_int_equal(write(fd, req, (size_t)rl), rl);
    while (len < REPLY_MAX && (n = read(fd, buf + len, REPLY_MAX - len)) > 0)
        len += (size_t)n;
    close(fd);
    buf[len] = '\0';
    return buf;
}

static char *
http_get(uint16_t port, const char *path)
{
    return http_get_from(port, path, "127.0.0.1");
}

/* The value of the sample `series` (name and labels, exactly); -1 if none. */
static long long
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

static cu_result
pull(const char *addr, const char *const *extra)
{
    const char *args[40] = {"pull", "--connect",
                            addr,   "--cluster-id",
                            "8",    "--remote-cluster-id",
                            "7",    "--transport",
                            "tcp",  "--verify",
                            SHAPE};
    size_t n = 0;

    while (args[n] != NULL)
        n++;
    for (; extra != NULL && *extra != NULL && n < 38; extra++)
        args[n++] = *extra;
    args[n] = NULL;
    return cu_run(60, args);
}

static void
test_served_counters_match_pulls(void **state)
{
    (void)state;
    char addr[32], url[64], line[512];
    unsigned port = 0, mport = 0;
    cu_bg bg;

    /* Both on port 0: serve prints the ports the kernel chose. */
    const char *args[] = {"serve",     "--listen",    "127.0.0.1:0",
                          "--cluster-id", "7",        "--transport",
                          "tcp",       "--fill",      "--metrics",
                          "127.0.0.1:0", SHAPE,       NULL};
    cu_start(&bg, args);
    const char *at = NULL, *mat = NULL;
    if (cu_wait_line(&bg, "listening on ", line, sizeof(line), 20))
        at = strstr(line, "listening on 127.0.0.1:");
    if (at == NULL || sscanf(at, "listening on 127.0.0.1:%u,", &port) != 1 ||
        !cu_wait_line(&bg, "metrics: ", line, sizeof(line), 20) ||
        (mat = strstr(line, "metrics: http://127.0.0.1:")) == NULL ||
        sscanf(mat, "metrics: http://127.0.0.1:%u/metrics", &mport) != 1 ||
        port == 0 || port > 65535 || mport == 0 || mport > 65535 ||
        !cu_wait_line(&bg, "serving", line, sizeof(line), 20)) {
        cu_result r = cu_stop(&bg, SIGKILL, 10);
        cu_dump("serve did not come up", &r);
        fail();
    }
    snprintf(addr, sizeof(addr), "127.0.0.1:%u", port);
    snprintf(url, sizeof(url), "http://127.0.0.1:%u/metrics", mport);

    /* Nothing served yet, and the reply is an exposition. */
    char *reply = http_get((uint16_t)mport, "/metrics");
    assert_true(strncmp(reply, "HTTP/1.1 200", 12) == 0 ||
                strncmp(reply, "HTTP/1.0 200", 12) == 0);
    assert_non_null(strstr(reply, "Content-Type: text/plain; version=0.0.4"));
    assert_non_null(strstr(reply, "# TYPE llmdd_transfers_total counter"));
    assert_null(strstr(reply, "side=\"served\""));
    free(reply);

    /* One slot (8 tensors of 16 KiB) and five blocks (8 tensors of 4 KiB
     * each): one request each on the data plane. */
    cu_result r = pull(addr, (const char *[]){"--batch-index", "2", NULL});
    if (r.code != 0)
        cu_dump("pull", &r);
    assert_int_equal(r.code, 0);
    assert_non_null(strstr(r.out, "verified: 128 KiB"));
    cu_result_free(&r);
    r = pull(addr, (const char *[]){"--blocks", "0,3,5-7", NULL});
    if (r.code != 0)
        cu_dump("pull", &r);
    assert_int_equal(r.code, 0);
    assert_non_null(strstr(r.out, "verified: 160 KiB"));
    cu_result_free(&r);

    reply = http_get((uint16_t)mport, "/metrics");
    const char *body = strstr(reply, "\r\n\r\n");
    assert_non_null(body);
    const char *served = "{side=\"served\",op=\"pull\",transport=\"tcp\","
                         "status=\"LLM_SUCCESS\"}";
    char s[256];
    snprintf(s, sizeof(s), "llmdd_transfers_total%s", served);
    assert_int_equal(value_of(body + 4, s), 2);
    snprintf(s, sizeof(s), "llmdd_transfer_bytes_total%s", served);
    assert_int_equal(value_of(body + 4, s), (128 + 160) * 1024);
    /* The owner called nothing itself; both links came and went. */
    assert_null(strstr(body, "side=\"caller\""));
    assert_int_equal(value_of(body + 4, "llmdd_links_established_total"), 2);
    assert_int_equal(value_of(body + 4, "llmdd_links_dropped_total"), 2);
    assert_int_equal(value_of(body + 4, "llmdd_links{direction=\"in\"}"), 0);
    assert_int_equal(value_of(body + 4, "llmdd_caches{kind=\"allocated\"}"), 2);
    free(reply);

    /* Only /metrics. */
    reply = http_get((uint16_t)mport, "/other");
    assert_true(strncmp(reply + 9, "404", 3) == 0);
    free(reply);

    /* stats reads the same endpoint. */
    r = cu_run(30, (const char *[]){"stats", "--metrics-url", url, "--interval",
                                    "0.1", "--count", "1", NULL});
    if (r.code != 0)
        cu_dump("stats", &r);
    assert_int_equal(r.code, 0);
    assert_non_null(strstr(r.out, "transfers/s"));
    assert_non_null(strstr(r.out, "served"));
    cu_result_free(&r);

    r = cu_stop(&bg, SIGTERM, 20);
    assert_int_equal(r.code, 0);
    cu_result_free(&r);
}

static void
test_bad_metrics_args(void **state)
{
    (void)state;
    cu_result r = cu_run(10, (const char *[]){"serve", "--listen",
                                              "127.0.0.1:1", "--cluster-id",
                                              "7", "--metrics", "nope", NULL});
    assert_int_equal(r.code, 2);
    assert_non_null(strstr(r.err, "--metrics"));
    cu_result_free(&r);
    r = cu_run(10, (const char *[]){"stats", "--metrics-url",
                                    "ftp://127.0.0.1:1/metrics", NULL});
    assert_int_equal(r.code, 2);
    cu_result_free(&r);
    /* Nobody there: a failure, not a hang. */
    char url[64];
    snprintf(url, sizeof(url), "http://127.0.0.1:%u/metrics", cu_free_port());
    r = cu_run(20, (const char *[]){"stats", "--metrics-url", url, "--count",
                                    "1", NULL});
    assert_int_equal(r.code, 1);
    assert_non_null(strstr(r.err, "cannot connect"));
    cu_result_free(&r);
}

#define TRICKLERS 16

static bool
http_ok(const char *reply)
{
    return strncmp(reply, "HTTP/1.1 200", 12) == 0 ||
           strncmp(reply, "HTTP/1.0 200", 12) == 0;
}

static void
test_tricklers_do_not_lock_out_scrapes(void **state)
{
    char line[512];
    unsigned mport = 0;
    int fds[TRICKLERS];
    cu_bg bg;

    (void)state;
    const char *args[] = {"serve",     "--listen", "127.0.0.1:0",
                          "--cluster-id", "7",     "--metrics",
                          "127.0.0.1:0", SHAPE,    NULL};
    cu_start(&bg, args);
    const char *mat = NULL;
    if (!cu_wait_line(&bg, "metrics: ", line, sizeof(line), 20) ||
        (mat = strstr(line, "metrics: http://127.0.0.1:")) == NULL ||
        sscanf(mat, "metrics: http://127.0.0.1:%u/metrics", &mport) != 1 ||
        !cu_wait_line(&bg, "serving", line, sizeof(line), 20)) {
        cu_result r = cu_stop(&bg, SIGKILL, 10);
        cu_dump("serve did not come up", &r);
        fail();
    }
    /* Sixteen clients send the start of a request, then a header byte now
     * and then, never the end (each byte resets an idle timeout). */
    int64_t t0 = th_now_ms();
    for (int i = 0; i < TRICKLERS; i++) {
        fds[i] = http_connect((uint16_t)mport, "127.0.0.1");
        assert_int_equal(write(fds[i], "GET /metrics HTTP/1.1\r\nX-A: ", 29),
                         29);
    }
    /* Another client is served at once. */
    char *reply = http_get_from((uint16_t)mport, "/metrics", "127.0.0.2");
    assert_true(http_ok(reply));
    free(reply);
    /* The tricklers are cut within the request cap (2 s), trickle as they
     * may: every one sees its connection end. */
    int open = TRICKLERS;
    while (open > 0) {
        for (int i = 0; i < TRICKLERS; i++) {
            if (fds[i] < 0)
                continue;
            char c;
            if (write(fds[i], "a", 1) != 1 ||
                recv(fds[i], &c, 1, MSG_DONTWAIT) == 0) {
                close(fds[i]);
                fds[i] = -1;
                open--;
            }
        }
        if (th_now_ms() - t0 > 2000 + 3000)
            fail_msg("%d trickling connections still open after %lld ms",
                     open, (long long)(th_now_ms() - t0));
        usleep(100000); /* the trickle's pace */
    }
    fprintf(stderr, "# %d tricklers cut after %lld ms\n", TRICKLERS,
            (long long)(th_now_ms() - t0));
    reply = http_get((uint16_t)mport, "/metrics");
    assert_true(http_ok(reply));
    free(reply);
    cu_result r = cu_stop(&bg, SIGTERM, 20);
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
        cmocka_unit_test_teardown(test_served_counters_match_pulls, teardown),
        cmocka_unit_test_teardown(test_bad_metrics_args, teardown),
        cmocka_unit_test_teardown(test_tricklers_do_not_lock_out_scrapes,
                                  teardown),
    };
    return cu_main("serve_metrics", tests, sizeof(tests) / sizeof(tests[0]),
                   argc, argv);
}
