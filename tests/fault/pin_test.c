/*
 * A linked peer that tries to keep one of the owner's caches pinned, so that
 * llmdd_deallocate_cache on the owner cannot return:
 *
 * - an amplified READ: one request of about 1 MiB naming the whole 64 MiB
 *   tensor 65,532 times (4 TiB) is refused with an error status and not one
 *   data byte, and a deallocate right after it returns promptly; a WRITE of
 *   that shape is cut off; runs that only just fit one tensor still work;
 * - a trickling reader: it asks for a whole 64 MiB tensor and reads a little
 *   every 125 ms, always well inside the stall limit; a deallocate of that
 *   cache cuts the connection once the owner's llm.SyncKvCacheWaitTime has
 *   passed and returns;
 * - the same reader without a deallocate: the owner gives up on it once the
 *   reply has run past the time its size allows at the data plane's floor
 *   rate (1 MiB/s after the stall limit), before the reply is done.
 *
 * Each case gets its own prompt process, so a case that fails (the old
 * behaviour: the deallocate blocks) does not leave the next one a stuck peer.
 *
 *   pin_test
 */
#include <errno.h>
#include <poll.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "harness/fault_util.h"

#define WAIT_MS 1000         /* the prompt's llm.SyncKvCacheWaitTime */
#define STALL_MS 5000        /* the data plane's stall limit */
#define FLOOR_BPS (1u << 20) /* the data plane's floor rate */
#define TRICKLE_BYTES (48 << 10)
#define TRICKLE_MS 125 /* 384 KiB/s: under the floor, never a stall */

static th_proc prompt;
static int margin;

static int
setup(void **state)
{
    const char *args[] = {"--cluster", "1",           "--role",
                          "prompt",    "--transport", "tcp",
                          "--wait",    "1000",        NULL};

    (void)state;
    margin = fu_margin_ms();
    signal(SIGPIPE, SIG_IGN);
    return th_proc_start(&prompt, NULL, args);
}

static int
teardown(void **state)
{
    (void)state;
    return th_proc_stop(&prompt) == 0 ? 0 : -1;
}

/*
 * Sends one command to the prompt and waits at most timeout_ms for its
 * answer. Returns the ms it took, or -1 when no answer came in time.
 */
static int
timed_cmd(const char *cmd, char *reply, size_t cap, int timeout_ms)
{
    struct pollfd p = {.fd = fileno(prompt.out), .events = POLLIN};
    int64_t t0 = th_now_ms();

    if (fprintf(prompt.in, "%s\n", cmd) < 0 || fflush(prompt.in) != 0)
        return -1;
    /* One reply line per command: stdio holds nothing unread here. */
    if (poll(&p, 1, timeout_ms) != 1 ||
        fgets(reply, (int)cap, prompt.out) == NULL)
        return -1;
    reply[strcspn(reply, "\n")] = '\0';
    return (int)(th_now_ms() - t0);
}

static int64_t
alloc_big(unsigned mib, unsigned seed)
{
    char cmd[64], reply[64];

    snprintf(cmd, sizeof(cmd), "alloc-big %u 1 %u", mib, seed);
    assert_int_equal(th_proc_cmd(&prompt, cmd, reply, sizeof(reply)), 0);
    return atoll(reply + 3);
}

/* Deallocates id; asserts it answered OK within bound_ms. */
static void
dealloc_within(int64_t id, int bound_ms)
{
    char cmd[64], reply[64];

    snprintf(cmd, sizeof(cmd), "dealloc %lld", (long long)id);
    int ms = timed_cmd(cmd, reply, sizeof(reply), bound_ms);
    printf("pin_test: deallocate took %d ms (bound %d ms)\n", ms, bound_ms);
    if (ms < 0)
        fail_msg("deallocate did not return within %d ms", bound_ms);
    assert_int_equal(strncmp(reply, "OK", 2), 0);
}

/* A data connection of a fresh raw link; *ctrl gets the control fd. */
static int
raw_conn(uint64_t cluster, int *ctrl)
{
    uint8_t token[16];
    uint32_t st;

    *ctrl = fu_raw_link(prompt.port, cluster, "tcp", token, &st);
    assert_true(*ctrl >= 0);
    int fd = fu_raw_data(prompt.port, token, 0, &st);
    assert_true(fd >= 0);
    return fd;
}

/* Sends a READ or WRITE of one tensor with the given runs. */
static void
send_rw(int fd, uint16_t type, int64_t id, uint32_t count, uint64_t *offs,
        uint64_t *lens, uint32_t nruns)
{
    llmdd__rw_req r = {.cache_id = id,
                       .first = 0,
                       .count = count,
                       .nruns = nruns,
                       .offs = offs,
                       .lens = lens};
    size_t cap = 64 + (size_t)nruns * 16;
    uint8_t *buf = malloc(cap);

    assert_non_null(buf);
    size_t len = llmdd__wire_rw_encode(&r, buf, cap);
    assert_true(len > 0);
    assert_int_equal(fu_send_frame(fd, type, buf, len), 0);
    free(buf);
}

/* The READ_REPLY header: its status and byte count. */
static void
read_reply(int fd, uint32_t *st, uint64_t *total)
{
    uint8_t buf[64];
    uint16_t type;
    size_t len;

    assert_int_equal(
        fu_recv_frame(fd, &type, buf, sizeof(buf), &len, 3000 + margin), 0);
    assert_int_equal(type, WMSG_READ_REPLY);
    assert_int_equal(llmdd__wire_read_reply_decode(buf, len, st, total), 0);
}

/* ---- The amplified request. ---- */

static void
test_amplified_read(void **state)
{
    const uint64_t tsize = 64ull << 20;
    const uint32_t nruns = LLMDD_WIRE_MAX_RUNS;
    uint64_t *offs = calloc(nruns, sizeof(*offs));
    uint64_t *lens = malloc(nruns * sizeof(*lens));
    uint32_t st;
    uint64_t total;
    int ctrl;

    (void)state;
    assert_non_null(offs);
    assert_non_null(lens);
    for (uint32_t i = 0; i < nruns; i++)
        lens[i] = tsize;
    int64_t big = alloc_big(64, 5);
    int fd = raw_conn(4545, &ctrl);
    send_rw(fd, WMSG_READ, big, 1, offs, lens, nruns);
    read_reply(fd, &st, &total);
    printf("pin_test: a READ of %u x 64 MiB answered %s with %llu bytes\n",
           nruns, llmdd_status_str(st), (unsigned long long)total);
    /* Whatever the answer, a deallocate meanwhile must not wait on us. */
    dealloc_within(big, WAIT_MS + 2 * margin);
    assert_int_equal(st, LLM_PARAM_INVALID);
    assert_int_equal(total, 0);

    /* The stream is intact: two runs that together are just one tensor. */
    const uint64_t ts = 4096; /* th_desc_kv */
    uint64_t o2[2] = {ts / 2, 0}, l2[2] = {ts / 2, ts / 2};
    send_rw(fd, WMSG_READ, prompt.ids.kv, 8, o2, l2, 2);
    read_reply(fd, &st, &total);
    assert_int_equal(st, LLM_SUCCESS);
    assert_int_equal(total, 8 * ts);
    uint8_t *got = malloc(8 * ts);
    assert_non_null(got);
    assert_int_equal(fu_recv_all(fd, got, 8 * ts, 3000 + margin), 0);
    for (uint32_t t = 0; t < 8; t++)
        for (uint64_t k = 0; k < ts; k++)
            assert_int_equal(got[t * ts + k], th_byte(1, t, (k + ts / 2) % ts));
    free(got);

    /* One byte more than a tensor, overlapping: refused, nothing sent. */
    l2[1] = ts / 2 + 1;
    send_rw(fd, WMSG_READ, prompt.ids.kv, 8, o2, l2, 2);
    read_reply(fd, &st, &total);
    assert_int_equal(st, LLM_PARAM_INVALID);
    assert_int_equal(total, 0);

    /* A WRITE that claims 4 TiB of payload: cut off, no draining it. */
    int64_t target = alloc_big(64, 6);
    send_rw(fd, WMSG_WRITE, target, 1, offs, lens, nruns);
    assert_true(fu_closed_within(fd, 1000 + margin));
    close(fd);
    close(ctrl);
    dealloc_within(target, WAIT_MS + 2 * margin);
    free(lens);
    free(offs);
}

/* ---- The trickling reader. ---- */

typedef struct {
    int fd;
    uint64_t want; /* bytes the reply has */
    uint64_t got;  /* bytes read */
    /*
     * With cut_fds >= 0: the prompt closed its end once it has no more fds
     * than that. Its kernel still sends what it had buffered, so our end
     * sees EOF only after that, far later.
     */
    int cut_fds;
    bool cut;
    int64_t cut_at; /* th_now_ms() then */
    int64_t until;  /* gives up then */
} trickle;

/* Reads a little every TRICKLE_MS until cut, done, closed or t->until. */
static void
trickle_run(trickle *t)
{
    static uint8_t buf[TRICKLE_BYTES];

    while (t->got < t->want && th_now_ms() < t->until) {
        th_sleep_ms(TRICKLE_MS); /* the pace, not a wait for an event */
        if (t->cut_fds >= 0 && fu_fd_count(prompt.pid) <= t->cut_fds) {
            t->cut = true;
            t->cut_at = th_now_ms();
            return;
        }
        ssize_t k = recv(t->fd, buf, sizeof(buf), MSG_DONTWAIT);
        if (k > 0)
            t->got += (uint64_t)k;
        else if (k == 0 || (errno != EAGAIN && errno != EINTR))
            return;
    }
}

static void *
trickle_main(void *arg)
{
    trickle_run(arg);
    return NULL;
}

/* A READ of the whole tensor of cache id, on a socket with a small buffer. */
static int
trickle_start(int64_t id, uint64_t size, int *ctrl)
{
    uint64_t off = 0, len = size;
    uint32_t st;
    uint64_t total;
    int fd = raw_conn(4646, ctrl);
    int rcvbuf = 64 << 10;

    setsockopt(fd, SOL_SOCKET, SO_RCVBUF, &rcvbuf, sizeof(rcvbuf));
    send_rw(fd, WMSG_READ, id, 1, &off, &len, 1);
    /* The answer came: the serving thread is in the reply now. */
    read_reply(fd, &st, &total);
    assert_int_equal(st, LLM_SUCCESS);
    assert_int_equal(total, size);
    return fd;
}

static void
test_trickler_vs_deallocate(void **state)
{
    const uint64_t size = 64ull << 20;
    pthread_t th;
    int ctrl;

    (void)state;
    int64_t big = alloc_big(64, 7);
    trickle t = {.want = size, .cut_fds = -1};
    t.fd = trickle_start(big, size, &ctrl);
    t.until = th_now_ms() + 60000;
    assert_int_equal(pthread_create(&th, NULL, trickle_main, &t), 0);

    /* The owner waits WAIT_MS for the reply, then cuts it. */
    int64_t t0 = th_now_ms();
    char cmd[64], reply[64];
    snprintf(cmd, sizeof(cmd), "dealloc %lld", (long long)big);
    int ms = timed_cmd(cmd, reply, sizeof(reply), WAIT_MS + 2000 + margin);
    /* Closing our end also frees a prompt that would wait for us forever. */
    shutdown(t.fd, SHUT_RDWR);
    pthread_join(th, NULL);
    printf("pin_test: deallocate under a trickling reader took %d ms; the "
           "reader got %llu of %llu bytes in %lld ms\n",
           ms, (unsigned long long)t.got, (unsigned long long)size,
           (long long)(th_now_ms() - t0));
    if (ms < 0)
        fail_msg("deallocate did not return within %d ms",
                 WAIT_MS + 2000 + margin);
    assert_int_equal(strncmp(reply, "OK", 2), 0);
    assert_true(ms >= WAIT_MS - 100); /* it gave the reply its time */
    assert_true(t.got < size);
    close(t.fd);
    close(ctrl);
}

static void
test_trickler_cut(void **state)
{
    const uint64_t size = 16ull << 20;
    /* The reply's allowance: the stall limit plus its size at the floor. */
    const int64_t allowed = STALL_MS + (int64_t)(size * 1000 / FLOOR_BPS);
    int ctrl;

    (void)state;
    int64_t id = alloc_big(16, 8);
    trickle t = {.want = size, .cut_fds = fu_fd_count(prompt.pid)};
    int64_t t0 = th_now_ms();
    t.fd = trickle_start(id, size, &ctrl);
    /* Two fds for our link; the data connection's is the one to go. */
    t.cut_fds += 1;
    t.until = t0 + allowed + 3000 + 2 * margin;
    trickle_run(&t);
    printf("pin_test: a reader at %d KiB/s got %llu of %llu bytes, %s after "
           "%lld ms (allowed %lld ms)\n",
           TRICKLE_BYTES / 1024 * 1000 / TRICKLE_MS, (unsigned long long)t.got,
           (unsigned long long)size, t.cut ? "cut" : "not cut",
           (long long)((t.cut ? t.cut_at : th_now_ms()) - t0),
           (long long)allowed);
    assert_true(t.cut);
    assert_true(t.got < size);
    close(t.fd);
    close(ctrl);
}

int
main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_setup_teardown(test_amplified_read, setup, teardown),
        cmocka_unit_test_setup_teardown(test_trickler_vs_deallocate, setup,
                                        teardown),
        cmocka_unit_test_setup_teardown(test_trickler_cut, setup, teardown),
    };

    return cmocka_run_group_tests(tests, NULL, NULL);
}
