/*
 * tcp lanes (llm.TcpLanes) against a peer process: a striped pull really
 * goes out on four data connections at once; one of them cut in the middle
 * of the transfer fails the request within its wait time, writes nothing
 * after that, and a pull after linking again is byte-exact. And a decoder
 * given local_ip_infos opens every connection from that address. And
 * llm.TcpLanes=auto gives one lane to a peer on loopback on both sides of a
 * link: the side that linked and the side that accepted (which knows the
 * peer only by its connection's address).
 *
 * The data connections are found the way the kernel sees them: the sockets
 * in /proc/self/fd connected to the peer's port; the control connection is
 * the one with SO_KEEPALIVE. TCP_INFO's bytes_acked tells which of them
 * carried a request.
 */
#include <arpa/inet.h>
#include <dirent.h>
#include <netinet/in.h>
#include <pthread.h>
#include <linux/tcp.h> /* tcp_info with bytes_acked; glibc's lacks it */
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "harness/mp.h"

#define WAIT_MS 3000
#define MARGIN_MS 2000
#define BIG_MIB 64 /* one tensor, 4 slots of 16 MiB */
#define MAX_SOCKS 64

typedef struct {
    int fd;
    bool ctrl;
    uint64_t acked;
    struct sockaddr_in local;
} sock;

/* Our TCP sockets connected to 127.0.0.1:port (and their state now). */
static int
socks_to(uint16_t port, sock *out, int max)
{
    DIR *d = opendir("/proc/self/fd");
    struct dirent *e;
    int n = 0;

    assert_non_null(d);
    while ((e = readdir(d)) != NULL && n < max) {
        int fd = atoi(e->d_name);
        struct sockaddr_in peer, local;
        socklen_t plen = sizeof(peer), llen = sizeof(local);
        struct tcp_info ti;
        socklen_t tlen = sizeof(ti);
        int ka = 0;
        socklen_t kalen = sizeof(ka);

        if (fd <= 2 || fd == dirfd(d))
            continue;
        if (getpeername(fd, (struct sockaddr *)&peer, &plen) != 0 ||
            peer.sin_family != AF_INET || ntohs(peer.sin_port) != port ||
            getsockname(fd, (struct sockaddr *)&local, &llen) != 0 ||
            getsockopt(fd, IPPROTO_TCP, TCP_INFO, &ti, &tlen) != 0 ||
            getsockopt(fd, SOL_SOCKET, SO_KEEPALIVE, &ka, &kalen) != 0)
            continue;
        out[n++] = (sock){.fd = fd,
                          .ctrl = ka != 0,
                          .acked = ti.tcpi_bytes_acked,
                          .local = local};
    }
    closedir(d);
    return n;
}

static int
teardown(void **state)
{
    (void)state;
    mp_reap_all();
    return 0;
}

static int64_t
alloc_big(th_proc *p, uint32_t seed)
{
    char cmd[64], reply[64];

    snprintf(cmd, sizeof(cmd), "alloc-big %d 1 %u", BIG_MIB, seed);
    assert_int_equal(th_proc_cmd(p, cmd, reply, sizeof(reply)), 0);
    return atoll(reply + 3);
}

static llmdd_cache_desc
big_desc(void)
{
    return (llmdd_cache_desc){.num_tensors = 1,
                              .data_type = LLMDD_DT_UINT8,
                              .num_dims = 2,
                              .shape = {4, (int64_t)BIG_MIB << 18}};
}

static llmdd_status
pull_all(llmdd *dd, int64_t rid, const llmdd_cache *c)
{
    static const uint64_t all[] = {0, 1, 2, 3};
    llmdd_cache_index idx = {1, rid, 0};

    return llmdd_pull_kv_blocks(dd, &idx, c, all, all, 4, NULL);
}

static uint64_t
hash(const uint8_t *p, uint64_t n)
{
    uint64_t h = 1469598103934665603ull;

    for (uint64_t i = 0; i < n; i += 64)
        h = (h ^ p[i]) * 1099511628211ull;
    return h;
}

typedef struct {
    llmdd *dd;
    int64_t rid;
    const llmdd_cache *c;
    llmdd_status st;
    int64_t done_ms;
} puller;

static void *
pull_main(void *arg)
{
    puller *pl = arg;

    pl->st = pull_all(pl->dd, pl->rid, pl->c);
    pl->done_ms = th_now_ms();
    return NULL;
}

static void
test_lane_cut_mid_pull(void **state)
{
    static const char *const args[] = {"--role", "prompt", "--transport",
                                       "tcp", NULL};
    llmdd_option opts[] = {{"llm.Transport", "tcp"},
                           {"llm.TcpLanes", "4"},
                           {"llm.SyncKvCacheWaitTime", "3000"}};
    const uint64_t size = (uint64_t)BIG_MIB << 20;
    sock before[MAX_SOCKS], after[MAX_SOCKS];
    llmdd_cache c;

    (void)state;
    th_proc *p = mp_peer_start(1, args);
    llmdd *dd = mp_decoder(MP_SELF, opts, 3);
    assert_int_equal(th_link(dd, 1, MP_IP, p->port, 2000), LLM_SUCCESS);
    int64_t rid = alloc_big(p, 9);
    llmdd_cache_desc d = big_desc();
    assert_int_equal(llmdd_allocate_cache(dd, &d, &c), LLM_SUCCESS);
    uint8_t *buf = (uint8_t *)(uintptr_t)c.tensor_addrs[0];
    /* Striped and byte-exact; it also fetches the cache's description, so
     * that the next pull sends its requests without waiting for a reply. */
    assert_int_equal(pull_all(dd, rid, &c), LLM_SUCCESS);
    assert_int_equal(th_check_buf(buf, size, 9, 0), -1);
    memset(buf, 0, size);

    /* The peer stopped: our requests land in its socket buffers, acked by
     * its kernel, and no reply comes. */
    int n = socks_to(p->port, before, MAX_SOCKS);
    mp_peer_stop(p);
    /* A synchronous pull: its status is the transport's own. */
    puller pl = {.dd = dd, .rid = rid, .c = &c};
    pthread_t th;
    assert_int_equal(pthread_create(&th, NULL, pull_main, &pl), 0);
    int lanes = 0, cut = -1;
    for (int64_t end = th_now_ms() + 5000; th_now_ms() < end;) {
        int m = socks_to(p->port, after, MAX_SOCKS);
        lanes = 0;
        for (int i = 0; i < m; i++) {
            for (int j = 0; j < n; j++) {
                if (after[i].fd == before[j].fd && !after[i].ctrl &&
                    after[i].acked > before[j].acked) {
                    lanes++;
                    cut = after[i].fd;
                }
            }
        }
        if (lanes >= 4)
            break;
        th_sleep_ms(1);
    }
    printf("lanes_test: the pull sent requests on %d connections\n", lanes);
    assert_int_equal(lanes, 4);

    /* One lane goes; the peer resumes. */
    int64_t t0 = th_now_ms();
    assert_int_equal(shutdown(cut, SHUT_RDWR), 0);
    th_proc_kill(p, SIGCONT);
    pthread_join(th, NULL);
    int64_t ms = pl.done_ms - t0;
    printf("lanes_test: a cut lane failed the pull in %lld ms: %s\n",
           (long long)ms, llmdd_status_str(pl.st));
    assert_int_not_equal(pl.st, LLM_SUCCESS);
    assert_true(ms < WAIT_MS + MARGIN_MS);

    /* Nothing lands after the failure, even while we link again. */
    uint64_t h = hash(buf, size);
    assert_int_equal(th_link_retry(dd, 1, MP_IP, p->port, 5000), LLM_SUCCESS);
    assert_int_equal(hash(buf, size), h);
    assert_int_equal(pull_all(dd, rid, &c), LLM_SUCCESS);
    assert_int_equal(th_check_buf(buf, size, 9, 0), -1);
    assert_int_equal(th_proc_cmd(p, "ping", NULL, 0), 0);
    assert_int_equal(llmdd_deallocate_cache(dd, c.cache_id), LLM_SUCCESS);
    llmdd_destroy(dd);
    assert_int_equal(th_proc_stop(p), 0);
}

/*
 * local_ip_infos: every connection of the link, control and data, leaves
 * from the given address (127.0.0.2 here, the peer listens on 127.0.0.1),
 * so the peer sees that source address.
 */
static void
test_local_ip(void **state)
{
    static const char *const args[] = {"--role", "prompt", "--transport",
                                       "tcp", NULL};
    llmdd_option opts[] = {{"llm.Transport", "tcp"}, {"llm.TcpLanes", "2"}};
    sock s[MAX_SOCKS];
    llmdd_ip_info local = {.ip = "127.0.0.2", .port = 0}, remote;
    llmdd_status ret;

    (void)state;
    th_proc *p = mp_peer_start(1, args);
    llmdd *dd = mp_decoder(MP_SELF, opts, 2);
    llmdd_cluster_info ci = th_cluster(1, &remote, MP_IP, p->port);
    ci.local_ip_infos = &local;
    ci.num_local_ip_infos = 1;
    assert_int_equal(llmdd_link_clusters(dd, &ci, 1, &ret, 2000), LLM_SUCCESS);
    assert_int_equal(ret, LLM_SUCCESS);
    assert_int_equal(mp_pull_check(dd, 1, p->ids.kv, 1), LLM_SUCCESS);
    int n = socks_to(p->port, s, MAX_SOCKS);
    int ctrl = 0;
    /* Control, 3 FWD and 3 REV connections. */
    assert_true(n >= 7);
    for (int i = 0; i < n; i++) {
        char ip[INET_ADDRSTRLEN];
        inet_ntop(AF_INET, &s[i].local.sin_addr, ip, sizeof(ip));
        if (strcmp(ip, "127.0.0.2") != 0)
            fail_msg("a connection to the peer left from %s", ip);
        ctrl += s[i].ctrl;
    }
    assert_int_equal(ctrl, 1);
    llmdd_destroy(dd);

    /* An address that is not ours fails the link, not some other NIC. */
    dd = mp_decoder(MP_SELF, opts, 2);
    llmdd_ip_info bad = {.ip = "192.0.2.1", .port = 0};
    ci.local_ip_infos = &bad;
    llmdd_link_clusters(dd, &ci, 1, &ret, 2000);
    assert_int_equal(ret, LLM_LINK_FAILED);
    /* One that is not an address at all is the caller's mistake. */
    llmdd_ip_info junk = {.ip = "not-an-ip", .port = 0};
    ci.local_ip_infos = &junk;
    assert_int_equal(llmdd_link_clusters(dd, &ci, 1, &ret, 2000),
                     LLM_PARAM_INVALID);
    llmdd_destroy(dd);
    assert_int_equal(th_proc_stop(p), 0);
}

/*
 * llm.TcpLanes=auto on loopback: a push that would stripe (a 16 MiB slot)
 * goes over one connection from either side. The side that accepted the
 * link once did not know its peer's address and striped over every REV
 * connection the peer had opened. The peer listens on listen_ip; we link
 * to 127.0.0.1 (a listener on :: sees us as ::ffff:127.0.0.1).
 */
static void
auto_loopback(const char *listen_ip)
{
    const char *const args[] = {"--role", "prompt",  "--transport", "tcp",
                                "--ip",   listen_ip, NULL};
    llmdd_option opts[] = {{"llm.Transport", "tcp"},
                           {"llm.TcpLanes", "auto"}};
    const uint64_t slot = (uint64_t)BIG_MIB << 18;
    sock before[MAX_SOCKS], after[MAX_SOCKS];
    char cmd[96], reply[64];
    llmdd_cache c;

    th_proc *p = mp_peer_start(1, args);
    llmdd *dd = mp_decoder(MP_SELF, opts, 2);
    assert_int_equal(th_link(dd, 1, MP_IP, p->port, 2000), LLM_SUCCESS);
    int64_t rid = alloc_big(p, 9);
    llmdd_cache_desc d = big_desc();
    assert_int_equal(llmdd_allocate_cache(dd, &d, &c), LLM_SUCCESS);
    printf("lanes_test: a peer listening on %s\n", listen_ip);

    /* The accepting side's push, counted by the peer on its sockets. */
    snprintf(cmd, sizeof(cmd), "push-lanes %d %lld %lld", MP_SELF,
             (long long)rid, (long long)c.cache_id);
    assert_int_equal(th_proc_cmd(p, cmd, reply, sizeof(reply)), 0);
    printf("lanes_test: the accepting side's push went over %s "
           "connection(s)\n", reply + 3);
    assert_int_equal(atoi(reply + 3), 1);
    const uint8_t *buf = (const uint8_t *)(uintptr_t)c.tensor_addrs[0];
    assert_int_equal(th_check_pushed(buf, slot, 9, 0), -1);

    /* Ours, counted on the connections to the peer's listener. */
    int n = socks_to(p->port, before, MAX_SOCKS);
    llmdd_cache_index dst = {1, rid, 0};
    assert_int_equal(llmdd_push_kv_cache(dd, &c, &dst, 0, -1, NULL),
                     LLM_SUCCESS);
    int m = socks_to(p->port, after, MAX_SOCKS), lanes = 0;
    for (int i = 0; i < m; i++)
        for (int j = 0; j < n; j++)
            lanes += after[i].fd == before[j].fd &&
                     after[i].acked >= before[j].acked + (1u << 20);
    printf("lanes_test: the linking side's push went over %d "
           "connection(s)\n", lanes);
    assert_int_equal(lanes, 1);

    assert_int_equal(llmdd_deallocate_cache(dd, c.cache_id), LLM_SUCCESS);
    llmdd_destroy(dd);
    assert_int_equal(th_proc_stop(p), 0);
}

/*
 * Whether a listener on :: takes IPv4 here: IPv6 sockets exist and are
 * dual-stack by default (net.ipv6.bindv6only 0), as the peer's will be.
 */
static bool
dual_stack(void)
{
    struct sockaddr_in6 a = {.sin6_family = AF_INET6, .sin6_addr = in6addr_any};
    int fd = socket(AF_INET6, SOCK_STREAM | SOCK_CLOEXEC, 0), only = 1;
    socklen_t len = sizeof(only);
    bool ok = fd >= 0 &&
              getsockopt(fd, IPPROTO_IPV6, IPV6_V6ONLY, &only, &len) == 0 &&
              only == 0 && bind(fd, (struct sockaddr *)&a, sizeof(a)) == 0;

    if (fd >= 0)
        close(fd);
    return ok;
}

static void
test_auto_loopback(void **state)
{
    (void)state;
    auto_loopback("127.0.0.1");
    if (dual_stack())
        auto_loopback("::");
    else
        printf("lanes_test: no dual-stack IPv6 here; the :: case skipped\n");
}

int
main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_teardown(test_lane_cut_mid_pull, teardown),
        cmocka_unit_test_teardown(test_local_ip, teardown),
        cmocka_unit_test_teardown(test_auto_loopback, teardown),
    };

    return cmocka_run_group_tests_name("multiproc.lanes", tests, NULL, NULL);
}
