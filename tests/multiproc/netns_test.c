/*
 * Two "hosts": network namespaces A and B joined by a veth pair, with
 * addresses in a private /24 that exists only inside them. A peer_helper
 * listens in A; this binary re-executes itself in B (hidden argument
 * --pull-check) to link, pull and verify over the veth.
 *
 * Needs the rights to create namespaces (root or CAP_NET_ADMIN, as in CI);
 * without them it says why and exits 77 (skipped). The namespaces are named
 * after our pid and removed on every exit path, including SIGINT/SIGTERM;
 * leftovers of a killed run (whose pid is gone) are removed at start.
 */
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "mp.h"

#define NS_PREFIX "llmddt"
#define NET "10.231.7."
#define IP_A NET "1"
#define IP_B NET "2"

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

static th_proc peer_a; /* static, so teardown can reap it after a failure */

static int
teardown(void **state)
{
    (void)state;
    if (peer_a.pid > 0)
        mp_peer_kill(&peer_a);
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

int
main(int argc, char **argv)
{
    if (argc == 7 && strcmp(argv[1], "--pull-check") == 0)
        return pull_check_main(argv);

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
    };
    rc = cmocka_run_group_tests_name("multiproc.netns", tests, NULL, NULL);
    cleanup();
    return rc;
}
