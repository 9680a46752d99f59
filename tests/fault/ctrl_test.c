/*
 * The control plane against peers that lie, stall or crowd it:
 *
 * - a TCP client that copies the server's pid, boot id and instance nonce
 *   from its HELLO_REPLY and asks for transport loop is refused (it would
 *   make the server's pushes write into its own caches), and so is a server
 *   that answers a client with the client's own identity;
 * - one byte of a frame on a linked control connection does not block the
 *   control thread: another client links meanwhile, and a frame that
 *   arrives a byte at a time is still understood;
 * - out of file descriptors, the control thread does not spin on the
 *   readable listener, and accepts the queued connection once fds free;
 * - llm.MaxLinks bounds the links a server takes;
 * - the handshake stage: 1024 clients linking at once (eight times the
 *   handshake threads; 256 under sanitizers) all link; past the connections
 *   the stage holds, a link call gets LLM_LINK_BUSY (retryable), and links
 *   once they are gone;
 * - two instances linking to each other at the same moment end with one
 *   link that both can use, and both calls report it truthfully;
 * - a peer of another protocol version (llmdd 0.3 speaks 2) is refused at
 *   its HELLO, with a log line naming both versions, and nothing else is
 *   harmed.
 *
 *   ctrl_test [case]
 */
#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include "ctrl/ctrl.h"
#include "harness/fault_util.h"

#define SERVER 1
#define CLIENT 2
#define RAW 9

static llmdd *
instance(uint64_t id, llmdd_role role, uint16_t *port, const char *transport,
         const llmdd_option *extra, size_t nextra)
{
    llmdd_option opts[8] = {{"llm.Transport", transport}};
    llmdd *dd;

    assert_true(nextra < 7);
    if (nextra > 0)
        memcpy(opts + 1, extra, nextra * sizeof(*extra));
    assert_int_equal(llmdd_create(id, role, &dd), LLM_SUCCESS);
    if (port != NULL)
        assert_int_equal(
            th_init_listen(dd, "127.0.0.1", port, opts, nextra + 1),
            LLM_SUCCESS);
    else
        assert_int_equal(llmdd_initialize(dd, opts, nextra + 1), LLM_SUCCESS);
    return dd;
}

static int
hello_raw(int fd, const llmdd__hello *h, llmdd__hello_reply *rep)
{
    uint8_t buf[512];
    uint16_t type;
    size_t len = llmdd__wire_hello_encode(h, buf, sizeof(buf));

    if (fu_send_frame(fd, WMSG_HELLO, buf, len) != 0 ||
        fu_recv_frame(fd, &type, buf, sizeof(buf), &len, 5000) != 0 ||
        type != WMSG_HELLO_REPLY ||
        llmdd__wire_hello_reply_decode(buf, len, rep) != 0)
        return -1;
    return 0;
}

/* A client that claims to be the server's own process asks for loop. */
static void
test_loop_spoof_by_client(void **state)
{
    uint16_t port;
    llmdd *srv = instance(SERVER, LLMDD_ROLE_MIX, &port, "auto", NULL, 0);
    llmdd__hello h = {.kind = CONN_CTRL,
                      .cluster_id = RAW,
                      .role = LLMDD_ROLE_MIX,
                      .terms = FU_TERMS};
    llmdd__hello_reply rep;
    llmdd__confirm conf;
    llmdd__result res;
    uint8_t buf[512];
    uint16_t type;
    size_t len;

    (void)state;
    /* Learn the server's identity from one handshake... */
    int fd = fu_connect(port);
    assert_true(fd >= 0);
    strcpy(h.transport, "auto");
    assert_int_equal(hello_raw(fd, &h, &rep), 0);
    close(fd);
    /* ...and present it as our own in the next. */
    h.pid = rep.pid;
    memcpy(h.boot_id, rep.boot_id, sizeof(h.boot_id));
    h.nonce = rep.nonce;
    strcpy(h.transport, "loop");
    fd = fu_connect(port);
    assert_true(fd >= 0);
    assert_int_equal(hello_raw(fd, &h, &rep), 0);
    assert_int_equal(rep.status, LLM_SUCCESS);
    memset(&conf, 0, sizeof(conf));
    strcpy(conf.transport, "loop");
    len = llmdd__wire_confirm_encode(&conf, buf, sizeof(buf));
    assert_int_equal(fu_send_frame(fd, WMSG_CONFIRM, buf, len), 0);
    assert_int_equal(fu_recv_frame(fd, &type, buf, sizeof(buf), &len, 5000), 0);
    assert_int_equal(type, WMSG_RESULT);
    assert_int_equal(llmdd__wire_result_decode(buf, len, &res), 0);
    assert_int_not_equal(res.status, LLM_SUCCESS);
    close(fd);

    /* Nothing was linked: a push to the spoofer has no link. */
    llmdd_cache_desc d = th_desc_kv();
    llmdd_cache c;
    assert_int_equal(llmdd_allocate_cache(srv, &d, &c), LLM_SUCCESS);
    th_fill(&c, 5);
    llmdd_cache_index dst = {.cluster_id = RAW, .cache_id = c.cache_id};
    assert_int_equal(llmdd_push_kv_cache(srv, &c, &dst, 0, -1, NULL),
                     LLM_NOT_YET_LINK);
    llmdd_destroy(srv);
}

struct fake_server {
    int lfd;
    uint16_t port;
    uint32_t result; /* what the client's CONFIRM got */
    char asked[16];  /* the transport it confirmed */
};

/* Answers one client with the client's own pid, boot id and nonce. */
static void *
fake_server_main(void *arg)
{
    struct fake_server *fs = arg;
    llmdd__hello h;
    llmdd__hello_reply rep;
    llmdd__confirm conf;
    llmdd__result res = {.status = LLM_SUCCESS};
    uint8_t buf[512];
    uint16_t type;
    size_t len;

    int fd = accept(fs->lfd, NULL, NULL);
    if (fd < 0)
        return NULL;
    if (fu_recv_frame(fd, &type, buf, sizeof(buf), &len, 5000) != 0 ||
        llmdd__wire_hello_decode(buf, len, &h) != 0)
        goto out;
    memset(&rep, 0, sizeof(rep));
    rep.status = LLM_SUCCESS;
    rep.cluster_id = SERVER;
    rep.role = LLMDD_ROLE_MIX;
    rep.pid = h.pid;
    memcpy(rep.boot_id, h.boot_id, sizeof(rep.boot_id));
    rep.nonce = h.nonce;
    strcpy(rep.transport, "loop");
    rep.terms = FU_SERVER_TERMS;
    len = llmdd__wire_hello_reply_encode(&rep, buf, sizeof(buf));
    if (fu_send_frame(fd, WMSG_HELLO_REPLY, buf, len) != 0)
        goto out;
    /* A client that refuses closes here; one that believes us confirms. */
    if (fu_recv_frame(fd, &type, buf, sizeof(buf), &len, 5000) != 0 ||
        type != WMSG_CONFIRM || llmdd__wire_confirm_decode(buf, len, &conf))
        goto out;
    snprintf(fs->asked, sizeof(fs->asked), "%s", conf.transport);
    len = llmdd__wire_result_encode(&res, buf, sizeof(buf));
    fu_send_frame(fd, WMSG_RESULT, buf, len);
    fu_closed_within(fd, 2000);
out:
    close(fd);
    return NULL;
}

/* A server that claims to be the client's own process offers loop. */
static void
test_loop_spoof_by_server(void **state)
{
    struct fake_server fs = {.lfd = -1};
    uint16_t port;
    pthread_t t;

    (void)state;
    fs.lfd = th_socket(true, &port);
    assert_int_equal(pthread_create(&t, NULL, fake_server_main, &fs), 0);

    llmdd *cli = instance(CLIENT, LLMDD_ROLE_MIX, NULL, "auto", NULL, 0);
    assert_int_not_equal(th_link(cli, SERVER, "127.0.0.1", port, 2000),
                         LLM_SUCCESS);
    pthread_join(t, NULL);
    assert_string_not_equal(fs.asked, "loop");
    llmdd_cache_desc d = th_desc_kv();
    llmdd_cache c;
    assert_int_equal(llmdd_allocate_cache(cli, &d, &c), LLM_SUCCESS);
    llmdd_cache_index dst = {.cluster_id = SERVER, .cache_id = c.cache_id};
    assert_int_equal(llmdd_push_kv_cache(cli, &c, &dst, 0, -1, NULL),
                     LLM_NOT_YET_LINK);
    llmdd_destroy(cli);
    close(fs.lfd);
}

/* One byte of a frame on a linked control socket, then nothing. */
static void
test_partial_frame_blocks_nobody(void **state)
{
    uint16_t port;
    llmdd *srv = instance(SERVER, LLMDD_ROLE_MIX, &port, "tcp", NULL, 0);
    uint8_t token[16], frame[LLMDD_WIRE_HDR_LEN];
    uint32_t st;

    (void)state;
    int ctl = fu_raw_link(port, RAW, "tcp", token, &st);
    assert_true(ctl >= 0);
    llmdd__wire_frame_encode(frame, WMSG_UNLINK, 0);
    assert_int_equal(fu_send_all(ctl, frame, 1), 0);

    /* The control thread accepts new links meanwhile; on the old code it
     * sat in a 2 s read of that one frame and this link timed out. */
    llmdd *cli = instance(CLIENT, LLMDD_ROLE_MIX, NULL, "tcp", NULL, 0);
    int64_t t0 = th_now_ms();
    assert_int_equal(th_link(cli, SERVER, "127.0.0.1", port, 1000),
                     LLM_SUCCESS);
    printf("link beside a stalled frame: %lld ms\n",
           (long long)(th_now_ms() - t0));

    /* The rest of the frame, a byte at a time: an UNLINK the server
     * understands, answers and acts on. */
    for (size_t i = 1; i < sizeof(frame); i++)
        assert_int_equal(fu_send_all(ctl, frame + i, 1), 0);
    uint8_t buf[64];
    uint16_t type;
    size_t len;
    assert_int_equal(fu_recv_frame(ctl, &type, buf, sizeof(buf), &len, 5000),
                     0);
    assert_int_equal(type, WMSG_UNLINK_ACK);
    assert_true(fu_closed_within(ctl, 5000));
    close(ctl);

    llmdd_destroy(cli);
    llmdd_destroy(srv);
}

static int64_t
cpu_ms(void)
{
    struct timespec ts;

    clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
    return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

/* The listener stays readable while accept has no fd to give. */
static void
test_out_of_fds_no_spin(void **state)
{
    uint16_t port;
    llmdd *srv = instance(SERVER, LLMDD_ROLE_MIX, &port, "tcp", NULL, 0);
    struct rlimit old, low;
    int fds[256], n = 0;

    (void)state;
    int s = socket(AF_INET, SOCK_STREAM, 0);
    assert_true(s >= 0);
    /* Leave no descriptor free: a low limit, then fill it. */
    assert_int_equal(getrlimit(RLIMIT_NOFILE, &old), 0);
    low = old;
    low.rlim_cur = (rlim_t)s + 64;
    assert_int_equal(setrlimit(RLIMIT_NOFILE, &low), 0);
    for (int fd; n < 256 && (fd = dup(0)) >= 0;)
        fds[n++] = fd;
    assert_int_equal(errno, EMFILE);

    struct sockaddr_in a = {.sin_family = AF_INET,
                            .sin_port = htons(port),
                            .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    assert_int_equal(connect(s, (struct sockaddr *)&a, sizeof(a)), 0);
    int64_t c0 = cpu_ms(), t0 = th_now_ms();
    th_sleep_ms(500); /* the window measured, not a synchronization */
    int64_t cpu = cpu_ms() - c0, wall = th_now_ms() - t0;
    printf("out of fds: %lld ms of CPU in %lld ms\n", (long long)cpu,
           (long long)wall);

    while (n > 0)
        close(fds[--n]);
    assert_int_equal(setrlimit(RLIMIT_NOFILE, &old), 0);
    /* A spinning control thread burns one core: about wall ms. */
    assert_true(cpu < wall / 4);

    /* Once fds are free the queued connection is taken: garbage on it is
     * refused and closed. */
    assert_int_equal(fu_send_all(s, "garbage!garbage!", 16), 0);
    assert_true(fu_closed_within(s, 5000));
    close(s);
    llmdd *cli = instance(CLIENT, LLMDD_ROLE_MIX, NULL, "tcp", NULL, 0);
    assert_int_equal(th_link(cli, SERVER, "127.0.0.1", port, 2000),
                     LLM_SUCCESS);
    llmdd_destroy(cli);
    llmdd_destroy(srv);
}

static void
test_max_links(void **state)
{
    llmdd_option o = {"llm.MaxLinks", "2"};
    uint16_t port;
    llmdd *srv = instance(SERVER, LLMDD_ROLE_MIX, &port, "tcp", &o, 1);
    uint8_t token[16];
    uint32_t st;

    (void)state;
    int a = fu_raw_link(port, RAW, "tcp", token, &st);
    int b = fu_raw_link(port, RAW + 1, "tcp", token, &st);
    assert_true(a >= 0 && b >= 0);
    assert_int_equal(fu_raw_link(port, RAW + 2, "tcp", token, &st), -1);
    assert_int_equal(st, LLM_CLUSTER_NUM_EXCEED_LIMIT);
    llmdd *cli = instance(CLIENT, LLMDD_ROLE_MIX, NULL, "tcp", NULL, 0);
    assert_int_equal(th_link(cli, SERVER, "127.0.0.1", port, 2000),
                     LLM_CLUSTER_NUM_EXCEED_LIMIT);

    /* A link that goes frees its place. */
    close(a);
    int64_t deadline = th_now_ms() + 5000;
    llmdd_status ls;
    while ((ls = th_link(cli, SERVER, "127.0.0.1", port, 2000)) ==
               LLM_CLUSTER_NUM_EXCEED_LIMIT &&
           th_now_ms() < deadline)
        ; /* the server drops the closed link when its thread sees EOF */
    assert_int_equal(ls, LLM_SUCCESS);
    close(b);
    llmdd_destroy(cli);
    llmdd_destroy(srv);
}

/* Eight times the handshake threads; under sanitizers twice. */
#define STORM (FU_SLOW == 1 ? 1024 : 256)

typedef struct {
    llmdd *dd;
    uint16_t port;
    pthread_barrier_t *go;
    llmdd_status st;
} stormer;

static void *
stormer_main(void *arg)
{
    stormer *s = arg;

    pthread_barrier_wait(s->go);
    s->st = th_link(s->dd, SERVER, "127.0.0.1", s->port, 30000 * FU_SLOW);
    return NULL;
}

/* More clients than handshake threads link at once: every one links. */
static void
test_link_storm(void **state)
{
    char max[16];
    snprintf(max, sizeof(max), "%d", STORM + 16);
    llmdd_option o = {"llm.MaxLinks", max};
    uint16_t port;
    struct rlimit was, rl;
    assert_int_equal(getrlimit(RLIMIT_NOFILE, &was), 0);
    rl = was;
    if (rl.rlim_max < 16 * STORM)
        rl.rlim_max = 16 * STORM; /* root may */
    rl.rlim_cur = rl.rlim_max;
    assert_int_equal(setrlimit(RLIMIT_NOFILE, &rl), 0);
    llmdd *srv = instance(SERVER, LLMDD_ROLE_MIX, &port, "tcp", &o, 1);
    static stormer s[1024];
    static pthread_t th[1024];
    pthread_barrier_t go;

    (void)state;
    pthread_barrier_init(&go, NULL, STORM);
    for (int i = 0; i < STORM; i++) {
        s[i] = (stormer){.port = port, .go = &go, .st = LLM_FAILED};
        s[i].dd = instance(100 + i, LLMDD_ROLE_DECODER, NULL, "tcp", NULL, 0);
    }
    int64_t t0 = th_now_ms();
    for (int i = 0; i < STORM; i++)
        assert_int_equal(pthread_create(&th[i], NULL, stormer_main, &s[i]), 0);
    int ok = 0;
    for (int i = 0; i < STORM; i++) {
        assert_int_equal(pthread_join(th[i], NULL), 0);
        ok += s[i].st == LLM_SUCCESS;
    }
    fprintf(stderr, "# %d of %d clients linked at once in %lld ms\n", ok, STORM,
            (long long)(th_now_ms() - t0));
    assert_int_equal(ok, STORM);
    /* Heartbeats that queued up during a slow setup are no flood, and a
     * link whose client is still setting up is not silent. */
    assert_int_equal(th_metric(srv, "llmdd_protocol_breaches_total"), 0);
    assert_int_equal(th_metric(srv, "llmdd_heartbeat_drops_total"), 0);
    for (int i = 0; i < STORM; i++) {
        assert_int_equal(llmdd_check_link(s[i].dd, SERVER, 5000 * FU_SLOW),
                         LLM_SUCCESS);
        assert_int_equal(th_metric(s[i].dd, "llmdd_protocol_breaches_total"),
                         0);
    }
    for (int i = 0; i < STORM; i++)
        llmdd_destroy(s[i].dd);
    pthread_barrier_destroy(&go);
    llmdd_destroy(srv);
    assert_int_equal(setrlimit(RLIMIT_NOFILE, &was), 0);
}

/*
 * HANDSHAKE_PENDING connections that send nothing fill the stage; a link
 * call then gets LLM_LINK_BUSY, and links once the idle ones are cut.
 */
static void
test_link_busy(void **state)
{
    uint16_t port;
    llmdd *srv = instance(SERVER, LLMDD_ROLE_MIX, &port, "tcp", NULL, 0);
    llmdd *cli = instance(CLIENT, LLMDD_ROLE_MIX, NULL, "tcp", NULL, 0);
    struct rlimit rl = {.rlim_cur = 3 * HANDSHAKE_PENDING,
                        .rlim_max = 3 * HANDSHAKE_PENDING};
    static int idle[HANDSHAKE_PENDING];

    (void)state;
    /* Both ends of each in this process: raise the limit (root may). */
    struct rlimit was;
    assert_int_equal(getrlimit(RLIMIT_NOFILE, &was), 0);
    if (was.rlim_max > rl.rlim_max)
        rl.rlim_max = was.rlim_max;
    assert_int_equal(setrlimit(RLIMIT_NOFILE, &rl), 0);
    for (int i = 0; i < HANDSHAKE_PENDING; i++) {
        idle[i] = fu_connect(port);
        assert_true(idle[i] >= 0);
    }
    /* The idle ones are accepted first: the link call's is one too many. */
    int64_t t0 = th_now_ms();
    llmdd_status st = th_link(cli, SERVER, "127.0.0.1", port, 2000 * FU_SLOW);
    fprintf(stderr, "# link past %d idle connections: %s in %lld ms\n",
            HANDSHAKE_PENDING, llmdd_status_str(st),
            (long long)(th_now_ms() - t0));
    assert_int_equal(st, LLM_LINK_BUSY);
    for (int i = 0; i < HANDSHAKE_PENDING; i++)
        close(idle[i]);
    /* Retried, as a caller does: the closed ones leave the stage. */
    int64_t deadline = th_now_ms() + (HANDSHAKE_MS + 2000) * FU_SLOW;
    while (((st = th_link(cli, SERVER, "127.0.0.1", port, 2000 * FU_SLOW)) ==
                LLM_LINK_BUSY ||
            st == LLM_TIMEOUT) &&
           th_now_ms() < deadline)
        ;
    assert_int_equal(st, LLM_SUCCESS);
    llmdd_destroy(cli);
    llmdd_destroy(srv);
    assert_int_equal(setrlimit(RLIMIT_NOFILE, &was), 0);
}

struct crosser {
    llmdd *dd;
    uint64_t peer;
    uint16_t port;
    pthread_barrier_t *go;
    llmdd_status st;
};

static void *
crosser_main(void *arg)
{
    struct crosser *x = arg;

    pthread_barrier_wait(x->go);
    x->st = th_link(x->dd, x->peer, "127.0.0.1", x->port, 3000);
    return NULL;
}

/* Pulls one slot of the peer's cache `id`: the link works this way. */
static llmdd_status
pull_one(llmdd *dd, uint64_t peer, const llmdd_cache *dst, int64_t id)
{
    llmdd_cache_index src = {.cluster_id = peer, .cache_id = id};

    return llmdd_pull_kv_cache(dd, &src, dst, 0, -1, NULL);
}

static void
test_crossed_links(void **state)
{
    uint16_t pa, pb;
    llmdd *a = instance(SERVER, LLMDD_ROLE_MIX, &pa, "tcp", NULL, 0);
    llmdd *b = instance(CLIENT, LLMDD_ROLE_MIX, &pb, "tcp", NULL, 0);
    llmdd_cache_desc d = th_desc_kv();
    llmdd_cache ca, cb, sa, sb;
    pthread_barrier_t go;
    int rounds = (int)fu_env("LLMDD_CROSS_ROUNDS", 40), both_ok = 0;

    (void)state;
    /* Sources (ca, cb) are filled once and never written again; each side
     * pulls into its own scratch cache (sa, sb). */
    assert_int_equal(llmdd_allocate_cache(a, &d, &ca), LLM_SUCCESS);
    assert_int_equal(llmdd_allocate_cache(b, &d, &cb), LLM_SUCCESS);
    assert_int_equal(llmdd_allocate_cache(a, &d, &sa), LLM_SUCCESS);
    assert_int_equal(llmdd_allocate_cache(b, &d, &sb), LLM_SUCCESS);
    th_fill(&ca, 1);
    th_fill(&cb, 2);
    pthread_barrier_init(&go, NULL, 2);
    for (int r = 0; r < rounds; r++) {
        struct crosser xa = {a, CLIENT, pb, &go, 0},
                       xb = {b, SERVER, pa, &go, 0};
        pthread_t ta, tb;
        assert_int_equal(pthread_create(&ta, NULL, crosser_main, &xa), 0);
        assert_int_equal(pthread_create(&tb, NULL, crosser_main, &xb), 0);
        pthread_join(ta, NULL);
        pthread_join(tb, NULL);
        /* Both calls succeed (docs/model.md, crossed links). */
        assert_int_equal(xa.st, LLM_SUCCESS);
        assert_int_equal(xb.st, LLM_SUCCESS);
        both_ok++;
        /* One link, usable from both sides. */
        assert_int_equal(pull_one(a, CLIENT, &sa, cb.cache_id), LLM_SUCCESS);
        assert_int_equal(pull_one(b, SERVER, &sb, ca.cache_id), LLM_SUCCESS);
        /* Unlink and wait until the other side has let go too. */
        assert_int_equal(th_unlink(a, CLIENT, "127.0.0.1", pb, false, 2000),
                         LLM_SUCCESS);
        int64_t deadline = th_now_ms() + 5000;
        while (pull_one(b, SERVER, &sb, ca.cache_id) != LLM_NOT_YET_LINK)
            assert_true(th_now_ms() < deadline);
    }
    printf("crossed links: %d rounds, %d with both calls LLM_SUCCESS\n", rounds,
           both_ok);
    pthread_barrier_destroy(&go);
    llmdd_destroy(a);
    llmdd_destroy(b);
}

/* Log lines of this process, captured: fd 2 goes to a pipe meanwhile. */
static int saved_stderr = -1, capture_rd = -1;

static void
capture_start(void)
{
    int fds[2];

    assert_int_equal(pipe(fds), 0);
    saved_stderr = dup(2);
    assert_true(saved_stderr >= 0);
    assert_int_equal(dup2(fds[1], 2), 2);
    close(fds[1]);
    capture_rd = fds[0];
}

/* Restores fd 2 and returns what was written there (static). */
static const char *
capture_stop(void)
{
    static char text[16384];
    size_t n = 0;

    dup2(saved_stderr, 2);
    close(saved_stderr);
    for (;;) {
        struct pollfd p = {.fd = capture_rd, .events = POLLIN};
        if (poll(&p, 1, 0) != 1 || n + 1 >= sizeof(text))
            break;
        ssize_t k = read(capture_rd, text + n, sizeof(text) - 1 - n);
        if (k <= 0)
            break;
        n += (size_t)k;
    }
    text[n] = '\0';
    close(capture_rd);
    fputs(text, stderr);
    return text;
}

static void
test_old_protocol_refused(void **state)
{
    uint16_t port;
    llmdd *srv = instance(SERVER, LLMDD_ROLE_MIX, &port, "auto", NULL, 0);
    llmdd__hello h = {.kind = CONN_CTRL,
                      .cluster_id = RAW,
                      .role = LLMDD_ROLE_MIX,
                      .terms = FU_TERMS};
    uint8_t buf[512], frame[LLMDD_WIRE_HDR_LEN];

    (void)state;
    strcpy(h.transport, "tcp");
    size_t len = llmdd__wire_hello_encode(&h, buf, sizeof(buf));
    /* A 0.2 peer's frame: the same header, version 1. */
    llmdd__wire_frame_encode(frame, WMSG_HELLO, (uint32_t)len);
    frame[4] = 1;
    frame[5] = 0;
    capture_start();
    int fd = fu_connect(port);
    assert_true(fd >= 0);
    assert_int_equal(fu_send_all(fd, frame, sizeof(frame)), 0);
    assert_int_equal(fu_send_all(fd, buf, len), 0);
    bool closed = fu_closed_within(fd, 3000);
    close(fd);
    /* The log line is written before the close. */
    const char *log = capture_stop();
    assert_true(closed);
    assert_non_null(strstr(log, "peer speaks llmdd protocol version 1; this "
                                "side speaks 3"));
    /* The server is unharmed: a real client links. */
    llmdd *cli = instance(CLIENT, LLMDD_ROLE_MIX, NULL, "auto", NULL, 0);
    assert_int_equal(th_link(cli, SERVER, "127.0.0.1", port, 2000),
                     LLM_SUCCESS);
    llmdd_destroy(cli);
    llmdd_destroy(srv);
}

int
main(int argc, char **argv)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_loop_spoof_by_client),
        cmocka_unit_test(test_loop_spoof_by_server),
        cmocka_unit_test(test_partial_frame_blocks_nobody),
        cmocka_unit_test(test_out_of_fds_no_spin),
        cmocka_unit_test(test_max_links),
        cmocka_unit_test(test_link_storm),
        cmocka_unit_test(test_link_busy),
        cmocka_unit_test(test_crossed_links),
        cmocka_unit_test(test_old_protocol_refused),
    };

    signal(SIGPIPE, SIG_IGN);
    th_test_filter(argc, argv);
    return cmocka_run_group_tests(tests, NULL, NULL);
}
