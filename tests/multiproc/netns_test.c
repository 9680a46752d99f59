/*
 * Two "hosts": network namespaces A and B joined by a veth pair, with
 * addresses in a private /24 that exists only inside them. A peer_helper
 * listens in A; this binary re-executes itself in B (hidden argument
 * --pull-check) to link, pull and verify over the veth.
 *
 * test_per_flow_cap limits the veth the way clouds limit a flow: each TCP
 * connection gets its own htb class of FLOW_MBIT, picked by a u32 hash on
 * the port of B's end (B's ephemeral ports are narrowed to 64 so that the
 * hash gives each connection a class of its own). A pull striped over 4
 * lanes must then beat one lane by far (llm.TcpLanes).
 *
 * test_same_host_cc: a connection that stays on its host gets the cubic
 * congestion control (base/net.h), one to another host keeps the system's.
 *
 * test_auto_lanes: llm.TcpLanes=auto stripes a large push over four lanes
 * to a peer on another host from both sides of the link, the one that
 * accepted it too (lanes_test: one lane on loopback).
 *
 * test_partition: one end of the veth set down, a silent partition; both
 * sides' heartbeats notice it (so the test has the label cuts_peers).
 *
 * Needs the rights to create namespaces (root or CAP_NET_ADMIN, as in CI);
 * without them it says why and exits 77 (skipped). The namespaces are named
 * after our pid and removed on every exit path, including SIGINT/SIGTERM;
 * leftovers of a killed run (whose pid is gone) are removed at start.
 */
#include <arpa/inet.h>
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <sys/wait.h>
#include <unistd.h>

#include "harness/mp.h"

#define NS_PREFIX "llmddt"
#define NET "10.231.7."
#define IP_A NET "1"
#define IP_B NET "2"

/* The per-flow cap: B's ephemeral ports, one htb class each. */
#define FLOW_MBIT 200
#define PORT_LO 40000 /* a multiple of 64: port & 63 is the class */
#define PORTS 64
#define CAP_MIB 32 /* pulled per round: 1.3 s at one capped flow */
#define CAP_ROUNDS 3
#define CAP_MIN_RATIO 2.5 /* 4 lanes against 1; ideally 4 */

#if defined(__SANITIZE_THREAD__)
#define FU_SLOW_NS 4
#elif defined(__SANITIZE_ADDRESS__)
#define FU_SLOW_NS 2
#else
#define FU_SLOW_NS 1
#endif

static char ns_a[32], ns_b[32], veth_a[16], veth_b[16];
static char self_exe[4096];
static volatile sig_atomic_t ns_made;

/* Runs argv (no shell); returns its exit status, or -1. quiet: no output. */
static int
run(const char *const *argv, bool quiet)
{
    int null = quiet ? open("/dev/null", O_WRONLY | O_CLOEXEC) : -1;
    pid_t pid = th_spawn(argv, (const int[3]){-1, null, null});
    int status;

    if (null >= 0)
        close(null);
    if (pid < 0 || th_wait(pid, -1, &status) != 0)
        return -1;
    return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

static void
ns_delete(const char *name)
{
    const char *argv[] = {"ip", "netns", "delete", name, NULL};
    run(argv, true);
}

static void
cleanup(void)
{
    if (!ns_made)
        return;
    ns_made = 0;
    /* Deleting a namespace destroys its end of the veth, and so the pair. */
    ns_delete(ns_a);
    ns_delete(ns_b);
}

static void
on_signal(int sig)
{
    cleanup();
    signal(sig, SIG_DFL);
    raise(sig);
}

/* Namespaces of earlier runs that were killed before they could clean. */
static void
remove_stale(void)
{
    DIR *d = opendir("/run/netns");
    struct dirent *e;

    if (d == NULL)
        return;
    while ((e = readdir(d)) != NULL) {
        long pid;
        char side;
        if (sscanf(e->d_name, NS_PREFIX "%c%ld", &side, &pid) != 2 ||
            (side != 'a' && side != 'b'))
            continue;
        if (kill((pid_t)pid, 0) != 0 && errno == ESRCH)
            ns_delete(e->d_name);
    }
    closedir(d);
}

/* Sets up A and B; returns 0, or 77 with the reason printed. */
static int
ns_setup(void)
{
    int pid = (int)getpid();

    snprintf(ns_a, sizeof(ns_a), NS_PREFIX "a%d", pid);
    snprintf(ns_b, sizeof(ns_b), NS_PREFIX "b%d", pid);
    snprintf(veth_a, sizeof(veth_a), "lva%d", pid % 1000000);
    snprintf(veth_b, sizeof(veth_b), "lvb%d", pid % 1000000);

    const char *add_a[] = {"ip", "netns", "add", ns_a, NULL};
    const char *add_b[] = {"ip", "netns", "add", ns_b, NULL};
    int rc = run(add_a, true);
    if (rc != 0) {
        fprintf(stderr,
                "netns_test: skipped: cannot create a network namespace "
                "(`ip netns add` %s; needs root or CAP_SYS_ADMIN and "
                "CAP_NET_ADMIN)\n",
                rc == 127 ? "not found" : "failed");
        return TH_SKIP;
    }
    ns_made = 1;
    atexit(cleanup);
    if (run(add_b, false) != 0) {
        fprintf(stderr, "netns_test: skipped: second namespace failed\n");
        return TH_SKIP;
    }
    const char *veth[] = {"ip", "link", "add", veth_a, "netns", ns_a,
                          "type", "veth", "peer", "name", veth_b,
                          "netns", ns_b, NULL};
    if (run(veth, false) != 0) {
        fprintf(stderr, "netns_test: skipped: cannot create a veth pair\n");
        return TH_SKIP;
    }
    const char *cmds[][10] = {
        {"ip", "-n", ns_a, "addr", "add", IP_A "/24", "dev", veth_a, NULL},
        {"ip", "-n", ns_b, "addr", "add", IP_B "/24", "dev", veth_b, NULL},
        {"ip", "-n", ns_a, "link", "set", veth_a, "up", NULL},
        {"ip", "-n", ns_b, "link", "set", veth_b, "up", NULL},
        {"ip", "-n", ns_a, "link", "set", "lo", "up", NULL},
        {"ip", "-n", ns_b, "link", "set", "lo", "up", NULL},
    };
    for (size_t i = 0; i < sizeof(cmds) / sizeof(cmds[0]); i++) {
        if (run(cmds[i], false) != 0) {
            fprintf(stderr, "netns_test: skipped: `ip %s %s %s` failed\n",
                    cmds[i][1], cmds[i][2], cmds[i][3]);
            return TH_SKIP;
        }
    }
    /* `ip netns exec` also needs to remount /sys; some sandboxes allow
     * creating namespaces but not that. */
    const char *probe[] = {"ip", "netns", "exec", ns_b, "true", NULL};
    if (run(probe, false) != 0) {
        fprintf(stderr, "netns_test: skipped: `ip netns exec` failed\n");
        return TH_SKIP;
    }
    return 0;
}

/*
 * The decoder side, run inside namespace B:
 *   --pull-check IP PORT KV REG TRANSPORT
 * Links to cluster 1 there, pulls both caches, verifies, unlinks.
 */
static int
pull_check_main(char **argv)
{
    llmdd_option o = {"llm.Transport", argv[6]};
    uint16_t port = (uint16_t)atoi(argv[3]);
    int64_t kv = atoll(argv[4]), reg = atoll(argv[5]);
    llmdd_status st;
    llmdd *dd;

    if (llmdd_create(MP_SELF, LLMDD_ROLE_DECODER, &dd) != LLM_SUCCESS ||
        llmdd_initialize(dd, &o, 1) != LLM_SUCCESS)
        return 1;
    if ((st = th_link(dd, 1, argv[2], port, 5000)) != LLM_SUCCESS) {
        fprintf(stderr, "pull-check: link to %s:%u: %s\n", argv[2], port,
                llmdd_status_str(st));
        return 1;
    }
    /* mp_pull_check asserts with cmocka, which needs a running test:
     * check by hand here. */
    llmdd_cache_desc d = th_desc_kv();
    llmdd_cache c;
    int64_t ids[2] = {kv, reg};
    for (int k = 0; k < 2; k++) {
        if (llmdd_allocate_cache(dd, &d, &c) != LLM_SUCCESS)
            return 1;
        for (uint32_t b = 0; b < 4; b++) {
            llmdd_cache_index idx = {1, ids[k], b};
            st = llmdd_pull_kv_cache(dd, &idx, &c, b, -1, NULL);
            if (st != LLM_SUCCESS) {
                fprintf(stderr, "pull-check: pull: %s\n",
                        llmdd_status_str(st));
                return 1;
            }
        }
        for (uint32_t t = 0; t < d.num_tensors; t++) {
            if (th_check_buf((uint8_t *)(uintptr_t)c.tensor_addrs[t], 4096,
                             (uint32_t)k + 1, t) >= 0) {
                fprintf(stderr, "pull-check: cache %lld tensor %u differs\n",
                        (long long)ids[k], t);
                return 1;
            }
        }
        llmdd_deallocate_cache(dd, c.cache_id);
    }
    st = th_unlink(dd, 1, argv[2], port, false, 2000);
    llmdd_destroy(dd);
    if (st != LLM_SUCCESS) {
        fprintf(stderr, "pull-check: unlink: %s\n", llmdd_status_str(st));
        return 1;
    }
    return 0;
}

/*
 * Egress of `dev` in `ns`: one htb class of FLOW_MBIT for each value of the
 * low 6 bits of the TCP port at byte `at` of the IP header's successor (20:
 * source port, 22: destination port; there are no IP options), chosen by a
 * u32 hash table of 64 buckets. Returns tc's exit status.
 */
static int
shape(const char *ns, const char *dev, bool src_port)
{
    char path[] = "/tmp/llmdd_tcXXXXXX";
    int fd = mkstemp(path);
    FILE *f = fd < 0 ? NULL : fdopen(fd, "w");

    if (f == NULL)
        return -1;
    fprintf(f, "qdisc add dev %s root handle 1: htb default 1\n", dev);
    fprintf(f, "class add dev %s parent 1: classid 1:1 htb rate 10gbit "
               "quantum 60000\n",
            dev);
    fprintf(f, "filter add dev %s parent 1: prio 1 handle 2: protocol ip "
               "u32 divisor %d\n", dev, PORTS);
    fprintf(f, "filter add dev %s parent 1: prio 1 protocol ip u32 ht 800:: "
               "match ip protocol 6 0xff hashkey mask %s at 20 link 2:\n",
            dev, src_port ? "0x003f0000" : "0x0000003f");
    for (int i = 0; i < PORTS; i++) {
        fprintf(f, "class add dev %s parent 1: classid 1:%x htb rate %dmbit "
                   "quantum 60000\n", dev, 0x100 + i, FLOW_MBIT);
        fprintf(f, "filter add dev %s parent 1: prio 1 protocol ip u32 "
                   "ht 2:%x: match u32 0 0 flowid 1:%x\n", dev, i, 0x100 + i);
    }
    fclose(f);
    const char *argv[] = {"tc", "-n", ns, "-batch", path, NULL};
    int rc = run(argv, false);
    unlink(path);
    return rc;
}

/*
 * The decoder side of the per-flow cap, run inside namespace B:
 *   --lanes-check IP PORT ID
 * Pulls the peer's cache ID (one uint8 tensor of 4 slots, CAP_MIB MiB in
 * all, filled with seed 11) with llm.TcpLanes 1, 4 and auto, checks the
 * bytes, prints the median rate of CAP_ROUNDS pulls of each, and fails
 * unless 4 lanes and auto reach CAP_MIN_RATIO times one lane.
 */
static double
lanes_rate(const char *ip, uint16_t port, int64_t id, const char *lanes)
{
    llmdd_option o[] = {{"llm.Transport", "tcp"},
                        {"llm.TcpLanes", lanes},
                        {"llm.SyncKvCacheWaitTime", "30000"}};
    llmdd_cache_desc d = {.num_tensors = 1,
                          .data_type = LLMDD_DT_UINT8,
                          .num_dims = 2,
                          .shape = {4, (int64_t)CAP_MIB << 18}};
    const uint64_t all[] = {0, 1, 2, 3};
    llmdd_cache_index idx = {1, id, 0};
    double mbs[CAP_ROUNDS];
    llmdd_cache c;
    llmdd *dd;

    if (llmdd_create(MP_SELF, LLMDD_ROLE_DECODER, &dd) != LLM_SUCCESS ||
        llmdd_initialize(dd, o, 3) != LLM_SUCCESS ||
        th_link(dd, 1, ip, port, 5000) != LLM_SUCCESS ||
        llmdd_allocate_cache(dd, &d, &c) != LLM_SUCCESS)
        return -1;
    /* The first pull also checks the bytes and fetches the description. */
    if (llmdd_pull_kv_blocks(dd, &idx, &c, all, all, 4, NULL) != LLM_SUCCESS ||
        th_check_buf((const uint8_t *)(uintptr_t)c.tensor_addrs[0],
                     (uint64_t)CAP_MIB << 20, 11, 0) >= 0)
        return -1;
    for (int r = 0; r < CAP_ROUNDS; r++) {
        int64_t t0 = th_now_ms();
        if (llmdd_pull_kv_blocks(dd, &idx, &c, all, all, 4, NULL) !=
            LLM_SUCCESS)
            return -1;
        int64_t ms = th_now_ms() - t0;
        mbs[r] = (double)CAP_MIB * 1048576.0 / 1e6 / ((ms > 0 ? ms : 1) / 1e3);
    }
    llmdd_destroy(dd);
    /* The median of three. */
    double a = mbs[0], b = mbs[1], m = mbs[2];
    double med = a > b ? (b > m ? b : (a > m ? m : a))
                       : (a > m ? a : (b > m ? m : b));
    printf("netns_test: %s lane(s) at a %d Mbit/s per-flow cap: %.1f MB/s "
           "(%.1f %.1f %.1f)\n", lanes, FLOW_MBIT, med, mbs[0], mbs[1],
           mbs[2]);
    return med;
}

static int
lanes_check_main(char **argv)
{
    uint16_t port = (uint16_t)atoi(argv[3]);
    int64_t id = atoll(argv[4]);
    double one = lanes_rate(argv[2], port, id, "1");
    double four = lanes_rate(argv[2], port, id, "4");
    double autom = lanes_rate(argv[2], port, id, "auto");

    if (one <= 0 || four <= 0 || autom <= 0) {
        fprintf(stderr, "lanes-check: a pull failed\n");
        return 1;
    }
    printf("netns_test: 4 lanes / 1 lane = %.2f, auto / 1 lane = %.2f "
           "(at least %.1f wanted)\n", four / one, autom / one,
           CAP_MIN_RATIO);
    return four >= CAP_MIN_RATIO * one && autom >= CAP_MIN_RATIO * one ? 0 : 1;
}

/*
 * Whether every TCP socket of this process whose peer is at ip uses the
 * congestion control want, and there is at least one. Prints what differs.
 */
static bool
cc_all(const char *ip, const char *want)
{
    DIR *d = opendir("/proc/self/fd");
    struct dirent *e;
    int seen = 0, other = 0;

    if (d == NULL)
        return false;
    while ((e = readdir(d)) != NULL) {
        int fd = atoi(e->d_name);
        struct sockaddr_in peer;
        socklen_t plen = sizeof(peer);
        char cc[32] = "", pip[INET_ADDRSTRLEN];
        socklen_t cclen = sizeof(cc) - 1;

        if (e->d_name[0] == '.' || fd == dirfd(d) ||
            getpeername(fd, (struct sockaddr *)&peer, &plen) != 0 ||
            peer.sin_family != AF_INET ||
            getsockopt(fd, IPPROTO_TCP, TCP_CONGESTION, cc, &cclen) != 0 ||
            inet_ntop(AF_INET, &peer.sin_addr, pip, sizeof(pip)) == NULL ||
            strcmp(pip, ip) != 0)
            continue;
        seen++;
        if (strcmp(cc, want) != 0) {
            fprintf(stderr, "cc-check: fd %d to %s:%u: %s, not %s\n", fd,
                    pip, ntohs(peer.sin_port), cc, want);
            other++;
        }
    }
    closedir(d);
    if (seen == 0)
        fprintf(stderr, "cc-check: no TCP connection to %s\n", ip);
    return seen > 0 && other == 0;
}

/* Links dd to cluster id listening at ip:0 in this process, over tcp. */
static llmdd *
cc_link_local(llmdd *dd, uint64_t id, const char *ip)
{
    llmdd_option o = {"llm.Transport", "tcp"};
    uint16_t port;
    llmdd *p;

    if (llmdd_create(id, LLMDD_ROLE_PROMPT, &p) != LLM_SUCCESS)
        return NULL;
    if (th_init_listen(p, ip, &port, &o, 1) != LLM_SUCCESS ||
        th_link(dd, id, ip, port, 5000) != LLM_SUCCESS) {
        llmdd_destroy(p);
        return NULL;
    }
    return p;
}

/*
 * Run inside namespace B: --cc-check IP PORT. Makes reno B's default (the
 * sysctl is the namespace's own), links over tcp to the peer at IP:PORT (on
 * A), to a cluster of this process at 127.0.0.1 and to one at B's own
 * address; only the two that stay on B's host must have moved to cubic.
 */
static int
cc_check_main(char **argv)
{
    llmdd_option o = {"llm.Transport", "tcp"};
    int fd = open("/proc/sys/net/ipv4/tcp_congestion_control", O_WRONLY);
    llmdd *dd, *lo = NULL, *own = NULL;
    int rc = 1;

    if (fd < 0 || write(fd, "reno", 4) != 4) {
        fprintf(stderr, "cc-check: cannot make reno the default\n");
        return 1;
    }
    close(fd);
    if (llmdd_create(MP_SELF, LLMDD_ROLE_DECODER, &dd) != LLM_SUCCESS ||
        llmdd_initialize(dd, &o, 1) != LLM_SUCCESS)
        return 1;
    if (th_link(dd, 1, argv[2], (uint16_t)atoi(argv[3]), 5000) ==
            LLM_SUCCESS &&
        (lo = cc_link_local(dd, 2, "127.0.0.1")) != NULL &&
        (own = cc_link_local(dd, 3, IP_B)) != NULL &&
        cc_all(argv[2], "reno") && cc_all("127.0.0.1", "cubic") &&
        cc_all(IP_B, "cubic"))
        rc = 0;
    llmdd_destroy(dd);
    if (lo != NULL)
        llmdd_destroy(lo);
    if (own != NULL)
        llmdd_destroy(own);
    return rc;
}

/* Runs --pull-check inside namespace B; returns its exit status. */
static int
pull_from_b(const th_proc *p, const char *ip, const char *transport)
{
    char port[8], kv[24], reg[24];

    snprintf(port, sizeof(port), "%u", p->port);
    snprintf(kv, sizeof(kv), "%lld", (long long)p->ids.kv);
    snprintf(reg, sizeof(reg), "%lld", (long long)p->ids.reg);
    const char *argv[] = {"ip",     "netns", "exec",    ns_b, self_exe,
                          "--pull-check", ip, port, kv,      reg,
                          transport,      NULL};
    return run(argv, false);
}

/* Static, so teardown can reap them after a failure. */
static th_proc peer_a, peer_b;

static int
teardown(void **state)
{
    (void)state;
    if (peer_a.pid > 0)
        mp_peer_kill(&peer_a);
    if (peer_b.pid > 0)
        mp_peer_kill(&peer_b);
    return 0;
}

static void
test_two_hosts(void **state)
{
    const char *wrapper[] = {"ip", "netns", "exec", ns_a, NULL};
    const char *args[] = {"--cluster", "1",     "--role", "prompt",
                          "--ip",      IP_A,    NULL};
    th_proc *p = &peer_a;

    (void)state;
    if (th_proc_start(p, wrapper, args) != 0)
        fail_msg("peer_helper did not start in %s", ns_a);
    assert_int_equal(pull_from_b(p, IP_A, "auto"), 0);
    assert_int_equal(pull_from_b(p, IP_A, "tcp"), 0);
    /* Both decoders unlinked; the peer is still well. */
    assert_int_equal(th_proc_cmd(p, "ping", NULL, 0), 0);
    assert_int_equal(th_proc_stop(p), 0);
}

/* "ip -n NS link set DEV up|down": one end of the veth, a cable pulled. */
static void
link_set(const char *ns, const char *dev, const char *state)
{
    const char *argv[] = {"ip", "-n", ns, "link", "set", dev, state, NULL};
    assert_int_equal(run(argv, false), 0);
}

/* A peer's command that fails with a status: that status's name. */
static const char *
cmd_status(th_proc *p, const char *cmd, char *reply, size_t cap)
{
    if (th_proc_cmd(p, cmd, reply, cap) == 0)
        return "LLM_SUCCESS";
    return strncmp(reply, "ERR ", 4) == 0 ? reply + 4 : reply;
}

/*
 * A silent partition: no RST, no FIN, one end of the veth set down. Both
 * sides' transfers return LLM_NOT_YET_LINK within interval x misses + one
 * interval (4 s at the defaults), pulls posted meanwhile end within their
 * wait time with a non-success status and land nothing afterwards, and
 * once the cable is back the two link again and transfers verify.
 */
static void
test_partition(void **state)
{
    const char *wrap_a[] = {"ip", "netns", "exec", ns_a, NULL};
    const char *wrap_b[] = {"ip", "netns", "exec", ns_b, NULL};
    const char *args_a[] = {"--cluster", "1", "--ip", IP_A, "--transport",
                            "tcp", NULL};
    const char *args_b[] = {"--cluster", "2", "--ip", IP_B, "--transport",
                            "tcp", NULL};
    char cmd[128], reply[512];
    int64_t seen_a = -1, seen_b = -1;

    (void)state;
    if (th_proc_start(&peer_a, wrap_a, args_a) != 0 ||
        th_proc_start(&peer_b, wrap_b, args_b) != 0)
        fail_msg("peer_helper did not start in the namespaces");
    snprintf(cmd, sizeof(cmd), "link 1 %s %u", IP_A, peer_a.port);
    assert_int_equal(th_proc_cmd(&peer_b, cmd, reply, sizeof(reply)), 0);
    char pull[64], push[64];
    snprintf(pull, sizeof(pull), "pull 1 %lld", (long long)peer_a.ids.kv);
    snprintf(push, sizeof(push), "push 2 %lld", (long long)peer_b.ids.kv);
    assert_string_equal(cmd_status(&peer_b, pull, reply, sizeof(reply)),
                        "LLM_SUCCESS");
    assert_string_equal(cmd_status(&peer_a, push, reply, sizeof(reply)),
                        "LLM_SUCCESS");

    link_set(ns_a, veth_a, "down");
    int64_t t0 = th_now_ms();
    /* In flight during the partition: each ends within its wait time. */
    snprintf(cmd, sizeof(cmd), "post-pulls 1 %lld 8",
             (long long)peer_a.ids.kv);
    assert_int_equal(th_proc_cmd(&peer_b, cmd, reply, sizeof(reply)), 0);
    long long ended = atoll(reply + 3);
    assert_null(strstr(reply, "LLM_SUCCESS"));
    assert_true(ended <= 1000 + 1000 * FU_SLOW_NS);
    /* Then each side's next transfer, until it says the link is gone. */
    while (seen_a < 0 || seen_b < 0) {
        if (seen_b < 0 &&
            strcmp(cmd_status(&peer_b, pull, reply, sizeof(reply)),
                   "LLM_NOT_YET_LINK") == 0)
            seen_b = th_now_ms() - t0;
        if (seen_a < 0 &&
            strcmp(cmd_status(&peer_a, push, reply, sizeof(reply)),
                   "LLM_NOT_YET_LINK") == 0)
            seen_a = th_now_ms() - t0;
        if (th_now_ms() - t0 > 10000)
            fail_msg("still linked 10 s into the partition (A %lld, B %lld)",
                     (long long)seen_a, (long long)seen_b);
    }
    fprintf(stderr, "# partition noticed after %lld ms (A), %lld ms (B)\n",
            (long long)seen_a, (long long)seen_b);
    /* Each check takes up to a wait time (1 s) after the drop. */
    assert_true(seen_a <= 4000 + 1000 + 1000 * FU_SLOW_NS);
    assert_true(seen_b <= 4000 + 1000 + 1000 * FU_SLOW_NS);
    snprintf(cmd, sizeof(cmd), "check-link 1 500");
    assert_string_equal(cmd_status(&peer_b, cmd, reply, sizeof(reply)),
                        "LLM_NOT_YET_LINK");

    link_set(ns_a, veth_a, "up");
    snprintf(cmd, sizeof(cmd), "link 1 %s %u", IP_A, peer_a.port);
    int64_t t1 = th_now_ms();
    while (th_proc_cmd(&peer_b, cmd, reply, sizeof(reply)) != 0)
        if (th_now_ms() - t1 > 5000)
            fail_msg("no link 5 s after the partition healed: %s", reply);
    snprintf(cmd, sizeof(cmd), "pull 1 %lld 1", (long long)peer_a.ids.kv);
    assert_string_equal(cmd_status(&peer_b, cmd, reply, sizeof(reply)),
                        "LLM_SUCCESS"); /* every byte checked */
    assert_string_equal(cmd_status(&peer_a, push, reply, sizeof(reply)),
                        "LLM_SUCCESS");
    assert_int_equal(th_proc_stop(&peer_a), 0);
    assert_int_equal(th_proc_stop(&peer_b), 0);
}

/*
 * A 16 MiB push each way between two peers with llm.TcpLanes=auto, each
 * counting the connections that carried it: four lanes from the side that
 * linked (B) and from the side that accepted (A), whose only knowledge of
 * B's address is its connection's.
 */
static void
test_auto_lanes(void **state)
{
    const char *wrap_a[] = {"ip", "netns", "exec", ns_a, NULL};
    const char *wrap_b[] = {"ip", "netns", "exec", ns_b, NULL};
    const char *args_a[] = {"--cluster", "1", "--ip", IP_A, "--transport",
                            "tcp", NULL};
    const char *args_b[] = {"--cluster", "2", "--ip", IP_B, "--transport",
                            "tcp", NULL};
    char cmd[96], reply[64];

    (void)state;
    if (th_proc_start(&peer_a, wrap_a, args_a) != 0 ||
        th_proc_start(&peer_b, wrap_b, args_b) != 0)
        fail_msg("peer_helper did not start in the namespaces");
    snprintf(cmd, sizeof(cmd), "link 1 %s %u", IP_A, peer_a.port);
    assert_int_equal(th_proc_cmd(&peer_b, cmd, reply, sizeof(reply)), 0);
    assert_int_equal(th_proc_cmd(&peer_a, "alloc-big 64 1 9", reply,
                                 sizeof(reply)), 0);
    long long id_a = atoll(reply + 3);
    assert_int_equal(th_proc_cmd(&peer_b, "alloc-big 64 1 7", reply,
                                 sizeof(reply)), 0);
    long long id_b = atoll(reply + 3);

    snprintf(cmd, sizeof(cmd), "push-lanes 2 %lld %lld", id_a, id_b);
    assert_int_equal(th_proc_cmd(&peer_a, cmd, reply, sizeof(reply)), 0);
    fprintf(stderr, "# the accepting side's push: %s lanes\n", reply + 3);
    assert_int_equal(atoi(reply + 3), 4);
    snprintf(cmd, sizeof(cmd), "push-lanes 1 %lld %lld", id_b, id_a);
    assert_int_equal(th_proc_cmd(&peer_b, cmd, reply, sizeof(reply)), 0);
    fprintf(stderr, "# the linking side's push: %s lanes\n", reply + 3);
    assert_int_equal(atoi(reply + 3), 4);
    assert_int_equal(th_proc_stop(&peer_a), 0);
    assert_int_equal(th_proc_stop(&peer_b), 0);
}

static void
test_per_flow_cap(void **state)
{
    const char *wrapper[] = {"ip", "netns", "exec", ns_a, NULL};
    const char *args[] = {"--cluster", "1",     "--role", "prompt",
                          "--ip",      IP_A,    "--transport", "tcp", NULL};
    char range[64], cmd[64], reply[64], port[8], id[24];
    th_proc *p = &peer_a;

    (void)state;
    snprintf(range, sizeof(range), "net.ipv4.ip_local_port_range=%d %d",
             PORT_LO, PORT_LO + PORTS - 1);
    const char *sysctl[] = {"ip", "netns", "exec", ns_b, "sysctl", "-qw",
                            range, NULL};
    assert_int_equal(run(sysctl, false), 0);
    /* Pulls flow A -> B: A's egress by destination port; pushes and B's
     * acknowledgements: B's egress by source port. */
    assert_int_equal(shape(ns_a, veth_a, false), 0);
    assert_int_equal(shape(ns_b, veth_b, true), 0);
    if (th_proc_start(p, wrapper, args) != 0)
        fail_msg("peer_helper did not start in %s", ns_a);
    snprintf(cmd, sizeof(cmd), "alloc-big %d 1 11", CAP_MIB);
    assert_int_equal(th_proc_cmd(p, cmd, reply, sizeof(reply)), 0);
    snprintf(port, sizeof(port), "%u", p->port);
    snprintf(id, sizeof(id), "%lld", atoll(reply + 3));
    const char *check[] = {"ip",   "netns", "exec", ns_b, self_exe,
                           "--lanes-check", IP_A, port, id, NULL};
    assert_int_equal(run(check, false), 0);
    assert_int_equal(th_proc_cmd(p, "ping", NULL, 0), 0);
    assert_int_equal(th_proc_stop(p), 0);
}

static void
test_same_host_cc(void **state)
{
    const char *wrapper[] = {"ip", "netns", "exec", ns_a, NULL};
    const char *args[] = {"--cluster", "1",     "--role", "prompt",
                          "--ip",      IP_A,    "--transport", "tcp", NULL};
    th_proc *p = &peer_a;
    char port[8];

    (void)state;
    if (th_proc_start(p, wrapper, args) != 0)
        fail_msg("peer_helper did not start in %s", ns_a);
    snprintf(port, sizeof(port), "%u", p->port);
    const char *check[] = {"ip",   "netns", "exec", ns_b, self_exe,
                           "--cc-check", IP_A, port, NULL};
    assert_int_equal(run(check, false), 0);
    assert_int_equal(th_proc_stop(p), 0);
}

int
main(int argc, char **argv)
{
    if (argc == 7 && strcmp(argv[1], "--pull-check") == 0)
        return pull_check_main(argv);
    if (argc == 5 && strcmp(argv[1], "--lanes-check") == 0)
        return lanes_check_main(argv);
    if (argc == 4 && strcmp(argv[1], "--cc-check") == 0)
        return cc_check_main(argv);

    ssize_t n = readlink("/proc/self/exe", self_exe, sizeof(self_exe) - 1);
    if (n <= 0) {
        fprintf(stderr, "netns_test: skipped: cannot find my own binary\n");
        return TH_SKIP;
    }
    self_exe[n] = '\0';
    signal(SIGINT, on_signal);
    signal(SIGTERM, on_signal);
    signal(SIGHUP, on_signal);
    remove_stale();
    int rc = ns_setup();
    if (rc != 0) {
        cleanup();
        return rc;
    }
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_teardown(test_two_hosts, teardown),
        cmocka_unit_test_teardown(test_auto_lanes, teardown),
        cmocka_unit_test_teardown(test_partition, teardown),
        cmocka_unit_test_teardown(test_per_flow_cap, teardown),
        cmocka_unit_test_teardown(test_same_host_cc, teardown),
    };
    rc = cmocka_run_group_tests_name("multiproc.netns", tests, NULL, NULL);
    cleanup();
    return rc;
}
