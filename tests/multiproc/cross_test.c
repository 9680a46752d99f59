/*
 * Two instances linking to each other at the same moment (docs/model.md,
 * crossed links): two processes, each listening, each calling
 * llmdd_link_clusters to the other as soon as a barrier lets both go (one
 * pipe both block on; the coordinator writes one byte for each). Every round
 * both calls must return LLM_SUCCESS, each side must hold exactly one link
 * (the same one: one side's "out" is the other's "in"), and both directions
 * must pull and push over it, every byte checked. Then one side unlinks by
 * cluster id (every third round both do, released by the same barrier: the
 * unlinks cross, and both must return LLM_SUCCESS) and both wait until the
 * link is gone on both sides.
 *
 *   cross_test tcp|shm [rounds]        (50 rounds by default)
 */
#include <errno.h>
#include <signal.h>
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "harness/mp.h"

#define ROUNDS_DEFAULT 50
#define LINK_TIMEOUT_MS 5000

static const char *transport;

static int64_t
now_us(void)
{
    struct timespec ts;

    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000 + ts.tv_nsec / 1000;
}
static int rounds = ROUNDS_DEFAULT;

/* ---- A participant: one child process, one instance. ---- */

typedef struct {
    int cmd, report, go; /* read, write, read */
    uint64_t id, peer;
    llmdd *dd;
    llmdd_cache src, scratch, inbox;
    uint16_t peer_port;
    int64_t peer_src, peer_inbox;
} party;

static int
read_line(int fd, char *buf, size_t cap)
{
    size_t n = 0;
    char ch;

    while (n + 1 < cap) {
        ssize_t r = read(fd, &ch, 1);
        if (r < 0 && errno == EINTR)
            continue;
        if (r != 1)
            return -1;
        if (ch == '\n')
            break;
        buf[n++] = ch;
    }
    buf[n] = '\0';
    return 0;
}

static void
say(int fd, const char *fmt, ...)
{
    char buf[256];
    va_list ap;

    va_start(ap, fmt);
    int n = vsnprintf(buf, sizeof(buf) - 1, fmt, ap);
    va_end(ap);
    buf[n++] = '\n';
    if (write(fd, buf, (size_t)n) != n)
        _exit(3);
}

/* The instance's live links by direction, from its metrics. */
static void
links_of(llmdd *dd, unsigned *out, unsigned *in)
{
    static char text[65536];
    const char *p;

    llmdd_metrics_text(dd, text, sizeof(text));
    *out = *in = 99;
    if ((p = strstr(text, "llmdd_links{direction=\"out\"} ")) != NULL)
        *out = (unsigned)strtoul(p + strlen("llmdd_links{direction=\"out\"} "),
                                 NULL, 10);
    if ((p = strstr(text, "llmdd_links{direction=\"in\"} ")) != NULL)
        *in = (unsigned)strtoul(p + strlen("llmdd_links{direction=\"in\"} "),
                                NULL, 10);
}

/* Whether every slot of c holds the pattern of `seed` (0: all zero). */
static bool
holds(const llmdd_cache *c, uint32_t seed)
{
    uint64_t size = th_tensor_size(&c->desc);

    for (uint32_t t = 0; t < c->desc.num_tensors; t++) {
        const uint8_t *p = (const uint8_t *)(uintptr_t)c->tensor_addrs[t];
        for (uint64_t i = 0; i < size; i++)
            if (p[i] != (seed == 0 ? 0 : th_byte(seed, t, i)))
                return false;
    }
    return true;
}

static void
zero(const llmdd_cache *c)
{
    for (uint32_t t = 0; t < c->desc.num_tensors; t++)
        memset((void *)(uintptr_t)c->tensor_addrs[t], 0,
               th_tensor_size(&c->desc));
}

/*
 * Checks and clears the inbox the peer pushed into. A serving thread of
 * ours wrote it for the peer's push, and the peer's call had returned before
 * the coordinator asked: an order through other processes, which
 * ThreadSanitizer cannot see (tests/fault/tsan.supp names these two).
 */
static bool
inbox_check_and_clear(const llmdd_cache *inbox, uint32_t seed)
{
    bool ok = holds(inbox, seed);

    zero(inbox);
    return ok;
}

/*
 * One round: wait at the barrier, link, then pull and push both ways. The
 * barrier releases both at once; skew_us then holds this side back a
 * little, so that the rounds sweep the interleavings of the two calls
 * (from simultaneous to one handshake apart) instead of hitting only one.
 */
static void
party_round(party *p, long skew_us)
{
    char b;
    llmdd_ip_info ipi;
    llmdd_cluster_info ci = th_cluster(p->peer, &ipi, MP_IP, p->peer_port);
    llmdd_status ret = LLM_FAILED, st, pull = LLM_FAILED, push = LLM_FAILED;

    while (read(p->go, &b, 1) != 1)
        if (errno != EINTR)
            _exit(4);
    if (skew_us > 0)
        usleep((useconds_t)skew_us);
    int64_t t0 = now_us();
    st = llmdd_link_clusters(p->dd, &ci, 1, &ret, LINK_TIMEOUT_MS);
    if (st == LLM_SUCCESS) {
        zero(&p->scratch);
        pull = LLM_SUCCESS;
        for (uint32_t s = 0; s < 4 && pull == LLM_SUCCESS; s++) {
            llmdd_cache_index idx = {p->peer, p->peer_src, s};
            pull = llmdd_pull_kv_cache(p->dd, &idx, &p->scratch, s, -1, NULL);
        }
        if (pull == LLM_SUCCESS && !holds(&p->scratch, (uint32_t)p->peer))
            pull = LLM_FAILED; /* the bytes are wrong */
        push = LLM_SUCCESS;
        for (uint32_t s = 0; s < 4 && push == LLM_SUCCESS; s++) {
            llmdd_cache_index idx = {p->peer, p->peer_inbox, s};
            push = llmdd_push_kv_cache(p->dd, &p->src, &idx, s, -1, NULL);
        }
    }
    int64_t t1 = now_us();
    unsigned out, in;
    links_of(p->dd, &out, &in);
    say(p->report, "done %u %u %u %u %u %u %lld", st, ret, pull, push, out, in,
        (long long)(t1 - t0));
}

/* Waits (bounded) until this side holds no link any more. */
static void
party_wait_unlinked(party *p)
{
    int64_t deadline = th_now_ms() + 10000;
    unsigned out = 1, in = 1;

    while (th_now_ms() < deadline) {
        links_of(p->dd, &out, &in);
        if (out == 0 && in == 0)
            break;
        th_sleep_ms(2);
    }
    llmdd_status st = mp_pull_status(p->dd, p->peer, p->peer_src);
    say(p->report, "gone %u %u %u", out, in, st);
}

static int
party_main(party *p)
{
    char line[128];
    uint16_t port;

    llmdd_option o[] = {{"llm.Transport", transport},
                        {"llm.SyncKvCacheWaitTime", "10000"}};
    llmdd_cache_desc d = th_desc_kv();
    if (llmdd_create(p->id, p->id == 1 ? LLMDD_ROLE_PROMPT : LLMDD_ROLE_DECODER,
                     &p->dd) != LLM_SUCCESS ||
        th_init_listen(p->dd, MP_IP, &port, o, 2) != LLM_SUCCESS ||
        llmdd_allocate_cache(p->dd, &d, &p->src) != LLM_SUCCESS ||
        llmdd_allocate_cache(p->dd, &d, &p->scratch) != LLM_SUCCESS ||
        llmdd_allocate_cache(p->dd, &d, &p->inbox) != LLM_SUCCESS)
        return 2;
    th_fill(&p->src, (uint32_t)p->id);
    say(p->report, "ready %u %lld %lld", port, (long long)p->src.cache_id,
        (long long)p->inbox.cache_id);
    unsigned pp;
    long long ps, pi;
    if (read_line(p->cmd, line, sizeof(line)) != 0 ||
        sscanf(line, "peer %u %lld %lld", &pp, &ps, &pi) != 3)
        return 2;
    p->peer_port = (uint16_t)pp;
    p->peer_src = ps;
    p->peer_inbox = pi;
    while (read_line(p->cmd, line, sizeof(line)) == 0) {
        long skew;
        if (sscanf(line, "round %ld", &skew) == 1) {
            party_round(p, skew);
        } else if (strcmp(line, "inbox") == 0) {
            say(p->report, "inbox %d",
                inbox_check_and_clear(&p->inbox, (uint32_t)p->peer));
        } else if (strcmp(line, "unlink") == 0 ||
                   strcmp(line, "unlink-go") == 0) {
            char b;
            while (line[6] == '-' && read(p->go, &b, 1) != 1)
                if (errno != EINTR)
                    _exit(4);
            llmdd_cluster_info ci = {.remote_cluster_id = p->peer};
            llmdd_status ret = LLM_FAILED;
            llmdd_status st = llmdd_unlink_clusters(p->dd, &ci, 1, &ret,
                                                    LINK_TIMEOUT_MS, false);
            say(p->report, "unlinked %u", st);
        } else if (strcmp(line, "wait-unlinked") == 0) {
            party_wait_unlinked(p);
        } else if (strcmp(line, "quit") == 0) {
            break;
        }
    }
    llmdd_destroy(p->dd);
    return 0;
}

/* ---- The coordinator: this process. ---- */

typedef struct {
    pid_t pid;
    int cmd, report; /* write, read */
} child;

static child kids[2];
static int go_w = -1;

static void
kids_reap(void)
{
    for (int i = 0; i < 2; i++) {
        if (kids[i].pid > 0) {
            kill(kids[i].pid, SIGKILL);
            waitpid(kids[i].pid, NULL, 0);
            kids[i].pid = 0;
        }
    }
}

static void
tell(int i, const char *cmd)
{
    say(kids[i].cmd, "%s", cmd);
}

static void
hear(int i, char *buf, size_t cap)
{
    assert_int_equal(read_line(kids[i].report, buf, cap), 0);
}

static void
kids_start(void)
{
    int go[2];

    assert_int_equal(pipe(go), 0);
    go_w = go[1];
    for (int i = 0; i < 2; i++) {
        int cmd[2], rep[2];
        assert_int_equal(pipe(cmd), 0);
        assert_int_equal(pipe(rep), 0);
        pid_t pid = fork();
        assert_true(pid >= 0);
        if (pid == 0) {
            party p = {.cmd = cmd[0],
                       .report = rep[1],
                       .go = go[0],
                       .id = (uint64_t)i + 1,
                       .peer = (uint64_t)(2 - i)};
            close(cmd[1]);
            close(rep[0]);
            close(go[1]);
            if (i == 1) {
                close(kids[0].cmd);
                close(kids[0].report);
            }
            _exit(party_main(&p));
        }
        close(cmd[0]);
        close(rep[1]);
        kids[i] = (child){.pid = pid, .cmd = cmd[1], .report = rep[0]};
    }
    close(go[0]);
}

static void
test_crossed_links(void **state)
{
    char line[128];
    unsigned port[2];
    long long src[2], inbox[2];

    (void)state;
    kids_start();
    for (int i = 0; i < 2; i++) {
        hear(i, line, sizeof(line));
        assert_int_equal(
            sscanf(line, "ready %u %lld %lld", &port[i], &src[i], &inbox[i]),
            3);
    }
    for (int i = 0; i < 2; i++) {
        char cmd[96];
        snprintf(cmd, sizeof(cmd), "peer %u %lld %lld", port[1 - i], src[1 - i],
                 inbox[1 - i]);
        tell(i, cmd);
    }
    int both_ok = 0;
    for (int r = 0; r < rounds; r++) {
        unsigned st[2], ret[2], pull[2], push[2], out[2], in[2];
        long long us[2];
        /* Rounds alternate which side lags, by 0, 200, 400 ... us: from
         * simultaneous to one side starting after the other's call (about
         * 2 ms here) has returned. */
        char cmd[32];
        long skew = (long)(r / 2) * 200;
        snprintf(cmd, sizeof(cmd), "round %ld", r % 2 == 0 ? skew : 0L);
        tell(0, cmd);
        snprintf(cmd, sizeof(cmd), "round %ld", r % 2 == 1 ? skew : 0L);
        tell(1, cmd);
        /* Both block on the barrier: one write releases both. */
        assert_int_equal(write(go_w, "gg", 2), 2);
        for (int i = 0; i < 2; i++) {
            hear(i, line, sizeof(line));
            assert_int_equal(sscanf(line, "done %u %u %u %u %u %u %lld", &st[i],
                                    &ret[i], &pull[i], &push[i], &out[i],
                                    &in[i], &us[i]),
                             7);
        }
        printf("round %d (side %d %ld us late): link %#x/%#x in %lld/%lld us, "
               "pull %#x/%#x, push %#x/%#x, links out/in %u/%u and %u/%u\n",
               r, r % 2, skew, st[0], st[1], us[0], us[1], pull[0], pull[1],
               push[0], push[1], out[0], in[0], out[1], in[1]);
        for (int i = 0; i < 2; i++) {
            assert_int_equal(st[i], LLM_SUCCESS);
            assert_int_equal(ret[i], LLM_SUCCESS);
            assert_int_equal(pull[i], LLM_SUCCESS);
            assert_int_equal(push[i], LLM_SUCCESS);
            assert_int_equal(out[i] + in[i], 1); /* exactly one link */
        }
        assert_int_equal(out[0], in[1]); /* and the same one */
        for (int i = 0; i < 2; i++) {
            tell(i, "inbox");
            hear(i, line, sizeof(line));
            assert_string_equal(line, "inbox 1");
        }
        both_ok++;
        /* One side unlinks by id, or both at once; both wait until the
         * link is gone. */
        if (r % 3 == 2) {
            tell(0, "unlink-go");
            tell(1, "unlink-go");
            assert_int_equal(write(go_w, "gg", 2), 2);
            for (int i = 0; i < 2; i++) {
                hear(i, line, sizeof(line));
                assert_string_equal(line, "unlinked 0");
            }
        } else {
            tell(r % 2, "unlink");
            hear(r % 2, line, sizeof(line));
            assert_string_equal(line, "unlinked 0");
        }
        for (int i = 0; i < 2; i++) {
            tell(i, "wait-unlinked");
            hear(i, line, sizeof(line));
            char want[32];
            snprintf(want, sizeof(want), "gone 0 0 %u", LLM_NOT_YET_LINK);
            assert_string_equal(line, want);
        }
    }
    printf("crossed links over %s: %d rounds, both calls LLM_SUCCESS in %d\n",
           transport, rounds, both_ok);
    for (int i = 0; i < 2; i++) {
        tell(i, "quit");
        int status = 0;
        waitpid(kids[i].pid, &status, 0);
        kids[i].pid = 0;
        assert_true(WIFEXITED(status) && WEXITSTATUS(status) == 0);
    }
}

static int
teardown(void **state)
{
    (void)state;
    kids_reap();
    return 0;
}

int
main(int argc, char **argv)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_teardown(test_crossed_links, teardown),
    };

    signal(SIGPIPE, SIG_IGN);
    if (argc < 2) {
        fprintf(stderr, "usage: cross_test tcp|shm [rounds]\n");
        return 2;
    }
    transport = argv[1];
    if (argc > 2)
        rounds = atoi(argv[2]);
    return cmocka_run_group_tests_name("cross", tests, NULL, NULL);
}
