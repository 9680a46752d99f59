/*
 * Hostile input on the listening port, while a real decoder process keeps
 * pulling and checking every byte from the same prompt process:
 *
 * - hundreds of connections, four at a time, sending random bytes, frame
 *   headers with huge lengths, truncated HELLOs, a valid HELLO then garbage,
 *   data-connection HELLOs with random tokens, bad magic and versions: the
 *   prompt stays up, each bad stream is refused promptly, and its memory,
 *   fds and threads return to where they were;
 * - slowloris: 200 connections that send nothing (more than the 128
 *   concurrent handshakes the listener serves) while a real client links
 *   and pulls; each idle one is cut by the handshake deadline;
 * - a peer with a real link that asks for bytes outside a cache, for a cache
 *   id it was never told about, or writes outside a cache: it gets an error
 *   status and not one data byte, and no byte of the cache changes;
 * - a peer that asks for 32 MiB and never reads: the prompt gives up on that
 *   connection and nobody else notices;
 * - and at the end, the real decoder saw no error and no corrupt byte.
 *
 *   hostile_test
 * LLMDD_HOSTILE_CONNS sets the number of hostile connections (default 400).
 */
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "harness/fault_util.h"

#define PEER 1
#define SELF 2
#define ATTACKERS 4
#define IDLE_CONNS 200 /* more than the listener's 128 handshake slots */
#define HANDSHAKE_MS 2000 /* ctrl/ctrl.h: each handshake's deadline */
#define STALL_MS 5000     /* the data plane's stall limit */

static th_proc prompt;
static th_child decoder;
static int margin;
static uint64_t rng0;

static int
setup(void **state)
{
    const char *args[] = {"--cluster", "1", "--role", "prompt",
                          "--transport", "tcp", NULL};
    char sport[16], scache[24], line[128];

    (void)state;
    margin = fu_margin_ms();
    rng0 = fu_seed();
    printf("hostile_test: LLMDD_FAULT_SEED=%llu\n", (unsigned long long)rng0);
    signal(SIGPIPE, SIG_IGN);
    if (th_proc_start(&prompt, NULL, args) != 0)
        return -1;
    snprintf(sport, sizeof(sport), "%u", prompt.port);
    snprintf(scache, sizeof(scache), "%lld", (long long)prompt.ids.kv);
    const char *dargs[] = {fu_decoder_path(), "--port", sport, "--cache",
                           scache, "--seed", "1", "--pulls", "0",
                           "--transport", "tcp", NULL};
    if (th_child_spawn(&decoder, dargs) != 0 ||
        th_child_readline(&decoder, line, sizeof(line), 10000 * FU_SLOW) != 0 ||
        strcmp(line, "LINKED") != 0)
        return -1;
    return 0;
}

static int
teardown(void **state)
{
    (void)state;
    th_child_reap(&decoder, 5000);
    return th_proc_stop(&prompt) == 0 ? 0 : -1;
}

/* ---- Hostile connections. ---- */

typedef struct {
    uint64_t rng;
    int count;
    int refused_late; /* the prompt kept a bad stream open too long */
    int odd_answer;   /* an answer other than the expected refusal */
    int conn_failed;
} attacker;

static size_t
ctrl_hello(uint8_t *buf, size_t cap, uint64_t cluster, const char *tp)
{
    llmdd__hello h;

    memset(&h, 0, sizeof(h));
    h.kind = CONN_CTRL;
    h.cluster_id = cluster;
    h.role = LLMDD_ROLE_DECODER;
    memset(h.boot_id, 0x42, sizeof(h.boot_id));
    snprintf(h.transport, sizeof(h.transport), "%s", tp);
    h.terms = FU_TERMS;
    return llmdd__wire_hello_encode(&h, buf, cap);
}

static void
random_bytes(uint64_t *rng, uint8_t *buf, size_t n)
{
    for (size_t i = 0; i < n; i++)
        buf[i] = (uint8_t)fu_rand(rng);
}

/* The prompt must close a bad stream well before the handshake deadline. */
static void
expect_closed(attacker *a, int fd)
{
    if (!fu_closed_within(fd, 1000 + margin))
        a->refused_late++;
}

static void
attack(attacker *a, int kind)
{
    uint8_t buf[8192], hdr[LLMDD_WIRE_HDR_LEN];
    uint16_t type;
    size_t n, len;
    uint32_t st;
    int fd = fu_connect(prompt.port);

    if (fd < 0) {
        a->conn_failed++;
        return;
    }
    a->count++;
    switch (kind) {
    case 0: /* random bytes, then we hang up */
        n = 1 + fu_rand(&a->rng) % sizeof(buf);
        random_bytes(&a->rng, buf, n);
        fu_send_all(fd, buf, n);
        break;
    case 1: /* a HELLO header claiming 4 GiB */
        llmdd__wire_frame_encode(hdr, WMSG_HELLO, UINT32_MAX);
        fu_send_all(fd, hdr, sizeof(hdr));
        expect_closed(a, fd);
        break;
    case 2: /* a HELLO at the payload cap: far beyond a handshake's */
        llmdd__wire_frame_encode(hdr, WMSG_HELLO, LLMDD_WIRE_MAX_PAYLOAD);
        fu_send_all(fd, hdr, sizeof(hdr));
        random_bytes(&a->rng, buf, 4096);
        fu_send_all(fd, buf, 4096);
        expect_closed(a, fd);
        break;
    case 3: /* a truncated HELLO, then we hang up */
        n = ctrl_hello(buf, sizeof(buf), 5000 + a->count, "tcp");
        llmdd__wire_frame_encode(hdr, WMSG_HELLO, (uint32_t)n);
        fu_send_all(fd, hdr, sizeof(hdr));
        fu_send_all(fd, buf, n / 2);
        break;
    case 4: /* a valid HELLO, then garbage instead of CONFIRM */
        n = ctrl_hello(buf, sizeof(buf), 5000 + a->count, "tcp");
        fu_send_frame(fd, WMSG_HELLO, buf, n);
        if (fu_recv_frame(fd, &type, buf, sizeof(buf), &len, 2000) != 0 ||
            type != WMSG_HELLO_REPLY)
            a->odd_answer++;
        random_bytes(&a->rng, buf, 512);
        fu_send_all(fd, buf, 512);
        expect_closed(a, fd);
        break;
    case 5: /* a data connection with a made-up link token */
        random_bytes(&a->rng, buf, 16);
        {
            llmdd__hello h = {.kind = CONN_DATA};
            memcpy(h.token, buf, 16);
            n = llmdd__wire_hello_encode(&h, buf, sizeof(buf));
        }
        fu_send_frame(fd, WMSG_HELLO, buf, n);
        if (fu_recv_frame(fd, &type, buf, sizeof(buf), &len, 2000) != 0 ||
            type != WMSG_DATA_REPLY ||
            llmdd__wire_u32_decode(buf, len, &st) != 0 || st == LLM_SUCCESS)
            a->odd_answer++;
        expect_closed(a, fd);
        break;
    case 6: /* a wrong magic, or a version from the future */
        llmdd__wire_frame_encode(hdr, WMSG_HELLO, 8);
        hdr[fu_rand(&a->rng) % 2 ? 0 : 4] ^= 0x40;
        fu_send_all(fd, hdr, sizeof(hdr));
        fu_send_all(fd, hdr, 8);
        expect_closed(a, fd);
        break;
    case 7: /* a HELLO of an unknown kind, or with a bad transport name */
        n = ctrl_hello(buf, sizeof(buf), 5000 + a->count, "t\x01p");
        if (n == 0 || fu_rand(&a->rng) % 2) {
            buf[0] = 9;
            n = 40;
        }
        fu_send_frame(fd, WMSG_HELLO, buf, n);
        expect_closed(a, fd);
        break;
    default: /* a CONFIRM for a transport nobody has: refused */
        n = ctrl_hello(buf, sizeof(buf), 5000 + a->count, "tcp");
        fu_send_frame(fd, WMSG_HELLO, buf, n);
        if (fu_recv_frame(fd, &type, buf, sizeof(buf), &len, 2000) != 0) {
            a->odd_answer++;
            break;
        }
        {
            llmdd__confirm c;
            llmdd__result r;
            memset(&c, 0, sizeof(c));
            strcpy(c.transport, "nope");
            n = llmdd__wire_confirm_encode(&c, buf, sizeof(buf));
            fu_send_frame(fd, WMSG_CONFIRM, buf, n);
            if (fu_recv_frame(fd, &type, buf, sizeof(buf), &len, 2000) != 0 ||
                type != WMSG_RESULT ||
                llmdd__wire_result_decode(buf, len, &r) != 0 ||
                r.status == LLM_SUCCESS)
                a->odd_answer++;
        }
        expect_closed(a, fd);
        break;
    }
    close(fd);
}

static int total_attacks;

static void *
attacker_main(void *arg)
{
    attacker *a = arg;

    for (int i = 0; i < total_attacks / ATTACKERS; i++)
        attack(a, (int)(fu_rand(&a->rng) % 9));
    return NULL;
}

static void
attack_round(int n, const char *what)
{
    attacker a[ATTACKERS];
    pthread_t t[ATTACKERS];
    int sum = 0, late = 0, odd = 0, failed = 0;

    total_attacks = n;
    for (int i = 0; i < ATTACKERS; i++) {
        memset(&a[i], 0, sizeof(a[i]));
        a[i].rng = rng0 + (uint64_t)i * 7919 + (uint64_t)n;
        assert_int_equal(pthread_create(&t[i], NULL, attacker_main, &a[i]),
                         0);
    }
    for (int i = 0; i < ATTACKERS; i++) {
        pthread_join(t[i], NULL);
        sum += a[i].count;
        late += a[i].refused_late;
        odd += a[i].odd_answer;
        failed += a[i].conn_failed;
    }
    printf("hostile_test: %s: %d hostile connections, %d refused late, "
           "%d odd answers, %d connects failed\n",
           what, sum, late, odd, failed);
    assert_int_equal(late, 0);
    assert_int_equal(odd, 0);
    assert_int_equal(failed, 0);
}

static void
test_hostile_connections(void **state)
{
    int n = (int)fu_env("LLMDD_HOSTILE_CONNS", 400);

    (void)state;
    int fds = fu_fd_count(prompt.pid);
    long threads = fu_proc_status(prompt.pid, "Threads");
    attack_round(n / 8, "warm-up");
    assert_true(fu_settles(prompt.pid, fds, threads, 3000 * FU_SLOW));
    long rss0 = fu_proc_status(prompt.pid, "VmRSS");
    attack_round(n, "attack");
    assert_int_equal(th_proc_cmd(&prompt, "ping", NULL, 0), 0);
    assert_true(fu_settles(prompt.pid, fds, threads, 3000 * FU_SLOW));
    long rss1 = fu_proc_status(prompt.pid, "VmRSS");
    printf("hostile_test: prompt RSS %ld kB after warm-up, %ld kB after "
           "%d more hostile connections; %d fds, %ld threads as before\n",
           rss0, rss1, n, fds, threads);
    assert_true(rss1 - rss0 < 8 * 1024);
}

/* ---- Slowloris. ---- */

static int idle[IDLE_CONNS];
static int64_t idle_at[IDLE_CONNS]; /* when its connect completed */

static int
idle_teardown(void **state)
{
    (void)state;
    for (int i = 0; i < IDLE_CONNS; i++)
        if (idle[i] >= 0)
            close(idle[i]);
    return 0;
}

static void
test_idle_connections(void **state)
{
    llmdd_cache_desc d = th_desc_kv();
    llmdd_cache local;
    llmdd_cache_index idx = {PEER, prompt.ids.kv, 2};
    llmdd *dd;

    (void)state;
    int fds = fu_fd_count(prompt.pid);
    long threads = fu_proc_status(prompt.pid, "Threads");
    for (int i = 0; i < IDLE_CONNS; i++)
        idle[i] = -1;
    /* Past the listen backlog a connect may wait for a SYN retry (1 s). */
    for (int i = 0; i < IDLE_CONNS; i++) {
        idle[i] = fu_connect(prompt.port);
        idle_at[i] = th_now_ms();
        assert_true(idle[i] >= 0);
    }
    /* A real client links and pulls although every handshake slot is busy. */
    assert_int_equal(llmdd_create(SELF, LLMDD_ROLE_DECODER, &dd), LLM_SUCCESS);
    assert_int_equal(llmdd_initialize(dd, NULL, 0), LLM_SUCCESS);
    assert_int_equal(llmdd_allocate_cache(dd, &d, &local), LLM_SUCCESS);
    int64_t t0 = th_now_ms();
    /* Within the idle ones' deadline; sanitizers need longer. */
    int timeout = FU_SLOW > 1 ? 2000 * FU_SLOW : 1500;
    llmdd_status st = th_link(dd, PEER, "127.0.0.1", prompt.port, timeout);
    printf("hostile_test: link with %d idle connections open: %s after "
           "%lld ms\n",
           IDLE_CONNS, llmdd_status_str(st), (long long)(th_now_ms() - t0));
    assert_int_equal(st, LLM_SUCCESS);
    assert_int_equal(llmdd_pull_kv_cache(dd, &idx, &local, 0, -1, NULL),
                     LLM_SUCCESS);
    uint64_t stride = th_tensor_size(&d) / 4;
    for (uint32_t t = 0; t < d.num_tensors; t++)
        for (uint64_t k = 0; k < stride; k++)
            assert_int_equal(((uint8_t *)(uintptr_t)local.tensor_addrs[t])[k],
                             th_byte(1, t, 2 * stride + k));
    llmdd_destroy(dd);

    /* Every idle connection is cut by its handshake deadline. */
    int cut = 0;
    for (int i = 0; i < IDLE_CONNS; i++) {
        /* The deadline runs from the accept, which lags under sanitizers. */
        int left = (int)(idle_at[i] + HANDSHAKE_MS * (FU_SLOW > 1 ? 2 : 1) +
                         margin - th_now_ms());
        cut += fu_closed_within(idle[i], left > 0 ? left : 0);
        close(idle[i]);
        idle[i] = -1;
    }
    printf("hostile_test: %d of %d idle connections cut within %d ms of "
           "their connect\n",
           cut, IDLE_CONNS, HANDSHAKE_MS * (FU_SLOW > 1 ? 2 : 1) + margin);
    assert_int_equal(cut, IDLE_CONNS);
    assert_true(fu_settles(prompt.pid, fds, threads, 3000 * FU_SLOW));
}

/* ---- A linked peer asking for what is not its to read. ---- */

static size_t
rw_req(uint8_t *buf, size_t cap, int64_t id, uint32_t first, uint32_t count,
       uint64_t off, uint64_t len)
{
    llmdd__rw_req r = {.cache_id = id,
                       .first = first,
                       .count = count,
                       .nruns = 1,
                       .offs = &off,
                       .lens = &len};
    return llmdd__wire_rw_encode(&r, buf, cap);
}

/* A READ that must succeed, with its bytes: nothing else was in the way. */
static void
read_good(int fd, int64_t id, uint32_t seed)
{
    uint8_t buf[4096];
    uint16_t type;
    size_t len;
    uint32_t st;
    uint64_t total;

    len = rw_req(buf, sizeof(buf), id, 0, 8, 1124, 200);
    assert_int_equal(fu_send_frame(fd, WMSG_READ, buf, len), 0);
    assert_int_equal(fu_recv_frame(fd, &type, buf, sizeof(buf), &len, 3000),
                     0);
    assert_int_equal(type, WMSG_READ_REPLY);
    assert_int_equal(llmdd__wire_read_reply_decode(buf, len, &st, &total), 0);
    assert_int_equal(st, LLM_SUCCESS);
    assert_int_equal(total, 8 * 200);
    assert_int_equal(fu_recv_all(fd, buf, 8 * 200, 3000), 0);
    for (uint32_t t = 0; t < 8; t++)
        for (uint32_t k = 0; k < 200; k++)
            assert_int_equal(buf[t * 200 + k], th_byte(seed, t, 1124 + k));
}

static void
test_out_of_bounds_requests(void **state)
{
    const uint64_t tsize = 4096; /* th_desc_kv: 4 x 16 x 32 x 2 bytes */
    const int64_t kv = prompt.ids.kv, reg = prompt.ids.reg;
    struct {
        int64_t id;
        uint32_t first, count;
        uint64_t off, len;
    } bad[] = {
        {999999, 0, 1, 0, 64},           /* never told about */
        {0, 0, 1, 0, 64},                /* ids start at 1 */
        {-1, 0, 1, 0, 64},
        {INT64_MAX, 0, 1, 0, 64},
        {kv, 0, 1, tsize, 1},            /* one past the end */
        {kv, 0, 1, tsize - 96, 97},      /* straddles the end */
        {kv, 0, 8, 0, tsize + 1},
        {kv, 0, 1, UINT64_MAX - 10, 20}, /* offset + length wraps */
        {kv, 0, 1, 0, 1ull << 62},       /* huge */
        {kv, 7, 2, 0, 64},               /* a tensor past the last */
        {kv, 8, 1, 0, 64},
        {kv, UINT32_MAX, 2, 0, 64},      /* first + count wraps */
        {reg, 0, 1, tsize - 1, 2},       /* registered memory too */
        {reg, 3, 6, 0, 8},
    };
    uint8_t token[16], buf[8192];
    char cmd[64], reply[64];
    uint16_t type;
    size_t len;
    uint32_t st;
    uint64_t total;

    (void)state;
    assert_int_equal(th_proc_cmd(&prompt, "alloc 7", reply, sizeof(reply)), 0);
    int64_t target = atoll(reply + 3);
    int ctrl = fu_raw_link(prompt.port, 4242, "tcp", token, &st);
    assert_true(ctrl >= 0);
    int fd = fu_raw_data(prompt.port, token, 0, &st);
    assert_true(fd >= 0);

    /* QUERY of a cache id never told about. */
    len = llmdd__wire_i64_encode(123456, buf, sizeof(buf));
    assert_int_equal(fu_send_frame(fd, WMSG_QUERY, buf, len), 0);
    assert_int_equal(fu_recv_frame(fd, &type, buf, sizeof(buf), &len, 3000),
                     0);
    llmdd_cache_desc d;
    uint32_t bd;
    assert_int_equal(type, WMSG_QUERY_REPLY);
    assert_int_equal(llmdd__wire_desc_decode(buf, len, &st, &d, &bd), 0);
    assert_int_equal(st, LLM_KV_CACHE_NOT_EXIST);
    read_good(fd, kv, 1);

    /* Each bad READ: an error status, zero bytes, and the stream intact. */
    for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
        len = rw_req(buf, sizeof(buf), bad[i].id, bad[i].first, bad[i].count,
                     bad[i].off, bad[i].len);
        assert_true(len > 0);
        assert_int_equal(fu_send_frame(fd, WMSG_READ, buf, len), 0);
        assert_int_equal(
            fu_recv_frame(fd, &type, buf, sizeof(buf), &len, 3000), 0);
        assert_int_equal(type, WMSG_READ_REPLY);
        assert_int_equal(llmdd__wire_read_reply_decode(buf, len, &st, &total),
                         0);
        if (st == LLM_SUCCESS || total != 0)
            fail_msg("bad read %zu answered %s with %llu bytes", i,
                     llmdd_status_str(st), (unsigned long long)total);
        read_good(fd, kv, 1);
    }

    /* A READ with one good run and one bad: refused whole. */
    uint64_t offs[2] = {0, tsize - 8}, lens[2] = {64, 9};
    llmdd__rw_req two = {.cache_id = kv, .first = 0, .count = 1,
                         .nruns = 2, .offs = offs, .lens = lens};
    len = llmdd__wire_rw_encode(&two, buf, sizeof(buf));
    assert_int_equal(fu_send_frame(fd, WMSG_READ, buf, len), 0);
    assert_int_equal(fu_recv_frame(fd, &type, buf, sizeof(buf), &len, 3000),
                     0);
    assert_int_equal(llmdd__wire_read_reply_decode(buf, len, &st, &total), 0);
    assert_true(st != LLM_SUCCESS && total == 0);
    read_good(fd, kv, 1);

    /* Strided READs whose last element ends past the tensor, or whose
     * count x stride wraps around: refused whole. */
    uint64_t soff = 0, slen = 64, scnt[2] = {2, 3},
             sstride[2] = {tsize - 63, UINT64_C(1) << 63};
    for (int k = 0; k < 2; k++) {
        llmdd__rw_req sr = {.cache_id = kv,
                            .first = 0,
                            .count = 1,
                            .nruns = 1,
                            .offs = &soff,
                            .lens = &slen,
                            .cnts = &scnt[k],
                            .strides = &sstride[k]};
        len = llmdd__wire_rw_encode(&sr, buf, sizeof(buf));
        assert_int_equal(fu_send_frame(fd, WMSG_READ, buf, len), 0);
        assert_int_equal(fu_recv_frame(fd, &type, buf, sizeof(buf), &len, 3000),
                         0);
        assert_int_equal(llmdd__wire_read_reply_decode(buf, len, &st, &total),
                         0);
        assert_true(st != LLM_SUCCESS && total == 0);
        read_good(fd, kv, 1);
    }

    /* Bad WRITEs: refused, their payload swallowed, no byte written. */
    for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
        if (bad[i].len * bad[i].count > sizeof(buf) ||
            bad[i].len > sizeof(buf) || bad[i].id == reg)
            continue;
        int64_t id = bad[i].id == kv ? target : bad[i].id;
        size_t n = (size_t)(bad[i].len * bad[i].count);
        len = rw_req(buf, sizeof(buf), id, bad[i].first, bad[i].count,
                     bad[i].off, bad[i].len);
        assert_int_equal(fu_send_frame(fd, WMSG_WRITE, buf, len), 0);
        memset(buf, 0xff, n);
        assert_int_equal(fu_send_all(fd, buf, n), 0);
        assert_int_equal(
            fu_recv_frame(fd, &type, buf, sizeof(buf), &len, 3000), 0);
        assert_int_equal(type, WMSG_WRITE_REPLY);
        assert_int_equal(llmdd__wire_u32_decode(buf, len, &st), 0);
        assert_true(st != LLM_SUCCESS);
        read_good(fd, kv, 1);
    }
    snprintf(cmd, sizeof(cmd), "check %lld 7", (long long)target);
    assert_int_equal(th_proc_cmd(&prompt, cmd, reply, sizeof(reply)), 0);

    /* A request that does not decode, and an unknown message: cut off. */
    len = rw_req(buf, sizeof(buf), kv, 0, 0, 0, 64); /* count 0 */
    assert_int_equal(fu_send_frame(fd, WMSG_READ, buf, len), 0);
    assert_true(fu_closed_within(fd, 1000 + margin));
    close(fd);
    fd = fu_raw_data(prompt.port, token, 0, &st);
    assert_true(fd >= 0);
    read_good(fd, kv, 1);
    assert_int_equal(fu_send_frame(fd, WMSG_HELLO_REPLY, buf, 8), 0);
    assert_true(fu_closed_within(fd, 1000 + margin));
    close(fd);
    close(ctrl);
}

/* ---- A peer that asks and never reads. ---- */

static void
test_stalled_reader(void **state)
{
    uint8_t token[16], buf[256];
    char reply[64];
    uint32_t st;

    (void)state;
    assert_int_equal(
        th_proc_cmd(&prompt, "alloc-big 8 4 3", reply, sizeof(reply)), 0);
    int64_t big = atoll(reply + 3);
    int fds = fu_fd_count(prompt.pid);
    int ctrl = fu_raw_link(prompt.port, 4343, "tcp", token, &st);
    assert_true(ctrl >= 0);
    int fd = fu_raw_data(prompt.port, token, 0, &st);
    assert_true(fd >= 0);
    int rcvbuf = 4096;
    setsockopt(fd, SOL_SOCKET, SO_RCVBUF, &rcvbuf, sizeof(rcvbuf));
    size_t len = rw_req(buf, sizeof(buf), big, 0, 4, 0, 8u << 20);
    assert_int_equal(fu_send_frame(fd, WMSG_READ, buf, len), 0);

    /* While that sender is stuck, a real link and the decoder go on. */
    llmdd *dd;
    llmdd_cache_desc d = th_desc_kv();
    llmdd_cache local;
    llmdd_cache_index idx = {PEER, prompt.ids.kv, 3};
    assert_int_equal(llmdd_create(SELF, LLMDD_ROLE_DECODER, &dd), LLM_SUCCESS);
    assert_int_equal(llmdd_initialize(dd, NULL, 0), LLM_SUCCESS);
    assert_int_equal(llmdd_allocate_cache(dd, &d, &local), LLM_SUCCESS);
    assert_int_equal(th_link(dd, PEER, "127.0.0.1", prompt.port, 2000),
                     LLM_SUCCESS);
    assert_int_equal(llmdd_pull_kv_cache(dd, &idx, &local, 1, -1, NULL),
                     LLM_SUCCESS);
    llmdd_destroy(dd);

    /*
     * The prompt gives up on the stuck connection by itself, keeping the
     * link: of the two fds it has for our raw link, only the control one is
     * left once the stall limit has passed.
     */
    int64_t t0 = th_now_ms();
    assert_true(fu_settles(prompt.pid, fds + 1, 1 << 20,
                           STALL_MS + 2000 + margin));
    printf("hostile_test: a reader that never reads was cut off after "
           "%lld ms\n",
           (long long)(th_now_ms() - t0));
    close(fd);
    close(ctrl);
    assert_true(fu_settles(prompt.pid, fds, 1 << 20, 2000 * FU_SLOW));
}

static void
test_real_decoder_unharmed(void **state)
{
    char line[256];

    (void)state;
    th_child_close_in(&decoder);
    assert_int_equal(th_child_readline(&decoder, line, sizeof(line), 10000), 0);
    printf("hostile_test: the real decoder, meanwhile: %s\n", line);
    assert_non_null(strstr(line, " errors=0 mismatches=0 "));
    assert_int_equal(th_child_reap(&decoder, 5000), 0);
    assert_int_equal(th_proc_cmd(&prompt, "ping", NULL, 0), 0);
}

int
main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_hostile_connections),
        cmocka_unit_test_teardown(test_idle_connections, idle_teardown),
        cmocka_unit_test(test_out_of_bounds_requests),
        cmocka_unit_test(test_stalled_reader),
        cmocka_unit_test(test_real_decoder_unharmed),
    };

    return cmocka_run_group_tests(tests, setup, teardown);
}
