/*
 * Discovery through a real etcd (docs/model.md, "Discovery"): each case
 * starts its own etcd on loopback (etcd_util.c), prompts are peer_helper
 * processes or instances of this process, the decoders are instances of
 * this process. Cases: link and pull by cluster id only, prefixes kept
 * apart, explicit addresses skipping the server, publishing that follows
 * set_role (and comes back when an operator deletes the entry); a duplicate cluster id, a wildcard listen address and an
 * unreachable server refused at initialize, fail-over to a second endpoint;
 * a stopped prompt's expired entry dropping the decoder's link, a killed
 * prompt's entry gone within lease + 1 s and a restart on this host
 * taking its entry over (cuts_peers); etcd restarted without its data
 * (everyone back within a lease, links kept, a new decoder links, a
 * departure in its new history seen) and
 * stopped (links keep pulling, lookups LLM_TIMEOUT, finalize bounded); a
 * hostile fake gateway. An instance's own key overwritten (taken back, at
 * most once a lease period, never from another live instance, which is
 * logged), a deleted value that is no entry dropping nothing, and a node
 * cut off from etcd alone past its lease keeping its links (heartbeats are
 * the authority on liveness).
 */
#include <fcntl.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "harness/etcd_util.h"
#include "harness/mp.h"
#include "meta/meta.h" /* entries written as another instance would */

#define LEASE_MS 2000
#define LEASE_OPT "llm.MetadataLeaseMs=2000"

static te_etcd etcd;

/* This process's stderr, sent to a file while a case reads its log. */
static int saved_stderr = -1;
static char errlog[64];

static void
capture_stderr(void)
{
    snprintf(errlog, sizeof(errlog), "/tmp/llmdd-disc-XXXXXX");
    int fd = mkstemp(errlog);
    assert_true(fd >= 0);
    fflush(stderr);
    saved_stderr = dup(2);
    assert_true(saved_stderr >= 0 && dup2(fd, 2) == 2);
    close(fd);
}

static void
restore_stderr(void)
{
    if (saved_stderr < 0)
        return;
    fflush(stderr);
    dup2(saved_stderr, 2);
    close(saved_stderr);
    saved_stderr = -1;
    unlink(errlog);
}

/* Lines of the captured log that contain needle. */
static int
log_count(const char *needle)
{
    static char buf[1 << 20];
    int fd = open(errlog, O_RDONLY | O_CLOEXEC), n = 0;
    assert_true(fd >= 0);
    ssize_t len = read(fd, buf, sizeof(buf) - 1);
    close(fd);
    buf[len > 0 ? len : 0] = '\0';
    for (const char *p = buf; (p = strstr(p, needle)) != NULL; p++)
        n++;
    return n;
}

static int
teardown(void **state)
{
    (void)state;
    restore_stderr();
    mp_reap_all();
    te_fake_stop();
    te_proxy_stop();
    te_etcd_destroy(&etcd);
    return 0;
}

/* A decoder of this process using the server under prefix (NULL: default). */
static llmdd *
decoder(uint64_t id, const char *server, const char *prefix)
{
    llmdd_option o[3] = {{"llm.MetadataServer", server},
                         {"llm.MetadataPrefix", prefix ? prefix : "llmdd"},
                         {"llm.MetadataLeaseMs", "2000"}};
    return mp_decoder(id, o, 3);
}

static llmdd_status
link_id(llmdd *dd, uint64_t cluster, int timeout_ms)
{
    llmdd_cluster_info ci = {.remote_cluster_id = cluster};
    llmdd_status ret = LLM_FAILED;
    llmdd_status st = llmdd_link_clusters(dd, &ci, 1, &ret, timeout_ms);
    return st == LLM_SUCCESS ? ret : st;
}

/* Whether cluster id is published under prefix. */
static bool
listed(const char *prefix, uint64_t id)
{
    char buf[8192], want[48];
    size_t len;

    assert_int_equal(llmdd_metadata_list(etcd.server, prefix, 2000, buf,
                                         sizeof(buf), &len),
                     LLM_SUCCESS);
    snprintf(want, sizeof(want), "\"cluster_id\":\"%llu\"",
             (unsigned long long)id);
    return strstr(buf, want) != NULL;
}

/* Waits until id is (or is not) listed; the ms it took, or -1. */
static int64_t
wait_listed(const char *prefix, uint64_t id, bool want, int timeout_ms)
{
    int64_t t0 = th_now_ms();
    while (listed(prefix, id) != want) {
        if (th_now_ms() - t0 > timeout_ms)
            return -1;
        th_sleep_ms(20);
    }
    return th_now_ms() - t0;
}

static th_proc *
prompt(uint64_t id, const char *prefix_opt, const char *extra)
{
    const char *args[] = {"--role", "prompt", "--opt",     etcd.opt,
                          "--opt",  LEASE_OPT, "--opt",    prefix_opt,
                          extra ? "--opt" : NULL, extra,   NULL};
    return mp_peer_start(id, args);
}

/* The key of cluster id under the default prefix. */
static const char *
key_of(uint64_t id)
{
    static char k[64];
    snprintf(k, sizeof(k), "llmdd/clusters/%llu", (unsigned long long)id);
    return k;
}

/* Waits until key holds want; the ms it took, or -1. */
static int64_t
wait_value(uint64_t id, const char *want, int timeout_ms)
{
    char cur[LLMDD_META_VALUE_MAX + 1];
    int64_t t0 = th_now_ms();
    while (!te_etcd_get(&etcd, key_of(id), cur, sizeof(cur), NULL) ||
           strcmp(cur, want) != 0) {
        if (th_now_ms() - t0 > timeout_ms)
            return -1;
        th_sleep_ms(20);
    }
    return th_now_ms() - t0;
}

/* The entry `mine` as another instance would write it: another nonce and
 * pid, another host. */
static void
other_entry(const char *mine, char *out, size_t cap)
{
    llmdd__meta_entry e;
    assert_int_equal(llmdd__meta_entry_decode(mine, strlen(mine), &e),
                     LLM_SUCCESS);
    e.nonce ^= 0x5a5a5a5a5a5a5a5aull;
    e.pid = 1;
    memset(e.boot_id, 0xab, sizeof(e.boot_id));
    assert_true(llmdd__meta_entry_encode(&e, out, cap) > 0);
}

/*
 * Whether every event of the decoder's watch up to now was handled: the
 * entry of sentinel, a prompt that announced no heartbeats, is deleted,
 * and the decoder drops its link once the watch delivers that delete (in
 * revision order, after every earlier event).
 */
static void
watch_caught_up(llmdd *d, uint64_t sentinel)
{
    assert_int_equal(llmdd_check_link(d, sentinel, 1000), LLM_SUCCESS);
    assert_int_equal(te_etcd_delete(&etcd, key_of(sentinel)), 0);
    int64_t t0 = th_now_ms();
    while (llmdd_check_link(d, sentinel, 100) != LLM_NOT_YET_LINK)
        assert_true(th_now_ms() - t0 <= 5000);
}

static void
test_link_by_id(void **state)
{
    (void)state;
    te_etcd_start(&etcd);
    th_proc *p = prompt(11, "llm.MetadataPrefix=fleetA", NULL);
    llmdd *a = decoder(100, etcd.server, "fleetA");
    llmdd *b = decoder(101, etcd.server, "fleetB");

    assert_true(listed("fleetA", 11));
    assert_false(listed("fleetB", 11));
    assert_false(listed(NULL, 11));
    /* By id alone, then every byte of a pull. */
    assert_int_equal(link_id(a, 11, 3000), LLM_SUCCESS);
    assert_int_equal(mp_pull_check(a, 11, p->ids.kv, 1), LLM_SUCCESS);
    /* Another fleet's prefix does not see it; unknown ids are refused. */
    assert_int_equal(link_id(b, 11, 3000), LLM_LINK_FAILED);
    assert_int_equal(link_id(a, 99, 3000), LLM_LINK_FAILED);
    /* Explicit addresses skip the server. */
    assert_int_equal(th_link(b, 11, MP_IP, p->port, 3000), LLM_SUCCESS);
    assert_int_equal(mp_pull_check(b, 11, p->ids.kv, 1), LLM_SUCCESS);
    llmdd_destroy(a);
    llmdd_destroy(b);

    /* Without a server, a cluster without addresses is a bad argument. */
    llmdd *c = mp_decoder(102, NULL, 0);
    assert_int_equal(link_id(c, 11, 1000), LLM_PARAM_INVALID);
    llmdd_destroy(c);
}

static void
test_refused_at_initialize(void **state)
{
    (void)state;
    te_etcd_start(&etcd);
    th_proc *p = prompt(12, "llm.MetadataPrefix=llmdd", NULL);
    (void)p;
    llmdd_option o[2] = {{"llm.MetadataServer", etcd.server},
                         {"llm.ListenIpInfo", "127.0.0.1:0"}};
    llmdd *dd;

    /* A live instance holds 12 (another process of this host). */
    assert_int_equal(llmdd_create(12, LLMDD_ROLE_PROMPT, &dd), LLM_SUCCESS);
    assert_int_equal(llmdd_initialize(dd, o, 2), LLM_PARAM_INVALID);
    /* ... and one of this very process holds 13. */
    llmdd *first;
    assert_int_equal(llmdd_create(13, LLMDD_ROLE_PROMPT, &first), LLM_SUCCESS);
    assert_int_equal(llmdd_initialize(first, o, 2), LLM_SUCCESS);
    llmdd_destroy(dd);
    assert_int_equal(llmdd_create(13, LLMDD_ROLE_PROMPT, &dd), LLM_SUCCESS);
    assert_int_equal(llmdd_initialize(dd, o, 2), LLM_PARAM_INVALID);
    llmdd_destroy(first);
    assert_false(listed(NULL, 13)); /* finalize revoked it */
    /* The id is free again. */
    assert_int_equal(llmdd_initialize(dd, o, 2), LLM_SUCCESS);
    assert_true(listed(NULL, 13));
    llmdd_destroy(dd);

    /* A wildcard address cannot be published. */
    o[1].value = "0.0.0.0:0";
    assert_int_equal(llmdd_create(14, LLMDD_ROLE_PROMPT, &dd), LLM_SUCCESS);
    assert_int_equal(llmdd_initialize(dd, o, 2), LLM_PARAM_INVALID);

    /* Nobody at the address: LLM_TIMEOUT, within the documented 5 s. */
    int lfd;
    uint16_t dead;
    lfd = th_socket(false, &dead); /* held: nobody else takes the port */
    char srv[160];
    snprintf(srv, sizeof(srv), "etcd://127.0.0.1:%u", dead);
    o[0].value = srv;
    o[1].value = "127.0.0.1:0";
    int64_t t0 = th_now_ms();
    assert_int_equal(llmdd_initialize(dd, o, 2), LLM_TIMEOUT);
    assert_true(th_now_ms() - t0 <= 5000 + 1000);
    llmdd_destroy(dd);

    /* Fail-over: the first endpoint refuses, the second answers. */
    snprintf(srv, sizeof(srv), "etcd://127.0.0.1:%u,127.0.0.1:%u", dead,
             etcd.client);
    llmdd *d = decoder(100, srv, NULL);
    assert_int_equal(link_id(d, 12, 3000), LLM_SUCCESS);
    llmdd_destroy(d);
    close(lfd);
}

static void
test_set_role_publishes(void **state)
{
    (void)state;
    te_etcd_start(&etcd);
    llmdd_option o[1] = {{"llm.MetadataServer", etcd.server}};
    llmdd_option listen[1] = {{"llm.ListenIpInfo", "127.0.0.1:0"}};
    llmdd *dd;

    assert_int_equal(llmdd_create(15, LLMDD_ROLE_DECODER, &dd), LLM_SUCCESS);
    assert_int_equal(llmdd_initialize(dd, o, 1), LLM_SUCCESS);
    assert_false(listed(NULL, 15)); /* not listening: not published */
    assert_int_equal(llmdd_set_role(dd, LLMDD_ROLE_PROMPT, listen, 1),
                     LLM_SUCCESS);
    assert_true(listed(NULL, 15));
    /* Deleted by an operator under its live lease: published again. */
    assert_int_equal(te_etcd_delete(&etcd, "llmdd/clusters/15"), 0);
    int64_t back = wait_listed(NULL, 15, true, 2000);
    print_message("deleted entry published again after %lld ms\n",
                  (long long)back);
    assert_true(back >= 0);
    llmdd *d = decoder(100, etcd.server, NULL);
    assert_int_equal(link_id(d, 15, 3000), LLM_SUCCESS);
    llmdd_cluster_info ci = {.remote_cluster_id = 15};
    llmdd_status ret;
    assert_int_equal(llmdd_unlink_clusters(d, &ci, 1, &ret, 3000, false),
                     LLM_SUCCESS);
    assert_int_equal(llmdd_set_role(dd, LLMDD_ROLE_DECODER, NULL, 0),
                     LLM_SUCCESS);
    assert_false(listed(NULL, 15));
    assert_int_equal(link_id(d, 15, 3000), LLM_LINK_FAILED);
    llmdd_destroy(d);
    llmdd_destroy(dd);
}

static void
test_departures(void **state)
{
    (void)state;
    te_etcd_start(&etcd);
    /* No heartbeats from this prompt: only its lease can tell. */
    th_proc *p = prompt(21, "llm.MetadataPrefix=llmdd",
                        "llm.HeartbeatInterval=0");
    llmdd *d = decoder(100, etcd.server, NULL);
    assert_int_equal(link_id(d, 21, 3000), LLM_SUCCESS);
    assert_int_equal(mp_pull_check(d, 21, p->ids.kv, 1), LLM_SUCCESS);
    mp_peer_stop(p);
    int64_t t0 = th_now_ms();
    while (llmdd_check_link(d, 21, 100) != LLM_NOT_YET_LINK)
        assert_true(th_now_ms() - t0 <= LEASE_MS + 1000);
    print_message("stopped prompt: link dropped after %lld ms\n",
                  (long long)(th_now_ms() - t0));
    assert_false(listed(NULL, 21));
    assert_int_equal(mp_pull_status(d, 21, p->ids.kv), LLM_NOT_YET_LINK);
    mp_peer_kill(p);

    /* Killed: its entry is gone within lease + 1 s. */
    p = prompt(22, "llm.MetadataPrefix=llmdd", NULL);
    assert_int_equal(link_id(d, 22, 3000), LLM_SUCCESS);
    mp_peer_kill(p);
    int64_t ms = wait_listed(NULL, 22, false, LEASE_MS + 1000);
    print_message("killed prompt: entry gone after %lld ms\n", (long long)ms);
    assert_true(ms >= 0);

    /* Killed and restarted on this host at once: it takes its entry over
     * (its predecessor's lease still runs), and links by id work. */
    p = prompt(23, "llm.MetadataPrefix=llmdd", "llm.MetadataLeaseMs=30000");
    mp_peer_kill(p);
    p = prompt(23, "llm.MetadataPrefix=llmdd", "llm.MetadataLeaseMs=30000");
    assert_int_equal(link_id(d, 23, 3000), LLM_SUCCESS);
    assert_int_equal(mp_pull_check(d, 23, p->ids.kv, 1), LLM_SUCCESS);
    llmdd_destroy(d);
}

static void
test_server_restart(void **state)
{
    (void)state;
    te_etcd_start(&etcd);
    th_proc *p = prompt(31, "llm.MetadataPrefix=llmdd", NULL);
    llmdd *d = decoder(100, etcd.server, NULL);
    assert_int_equal(link_id(d, 31, 3000), LLM_SUCCESS);

    /* Down: links keep pulling, lookups time out within their timeout. */
    te_etcd_stop(&etcd, SIGKILL);
    assert_int_equal(mp_pull_check(d, 31, p->ids.kv, 1), LLM_SUCCESS);
    int64_t t0 = th_now_ms();
    assert_int_equal(link_id(d, 32, 1500), LLM_TIMEOUT);
    assert_true(th_now_ms() - t0 <= 1500 + 500);

    /* Back without its data: everyone publishes again within a lease;
     * the absence dropped no link. */
    te_etcd_restart(&etcd, true);
    int64_t ms = wait_listed(NULL, 31, true, LEASE_MS);
    print_message("server back without its data: entry back after %lld ms\n",
                  (long long)ms);
    assert_true(ms >= 0);
    assert_int_equal(mp_pull_check(d, 31, p->ids.kv, 1), LLM_SUCCESS);
    llmdd *d2 = decoder(101, etcd.server, NULL);
    assert_int_equal(link_id(d2, 31, 3000), LLM_SUCCESS);
    assert_int_equal(mp_pull_check(d2, 31, p->ids.kv, 1), LLM_SUCCESS);

    /* Down again: a published instance finalizes in bounded time. */
    llmdd *q;
    llmdd_option o[2] = {{"llm.MetadataServer", etcd.server},
                         {"llm.ListenIpInfo", "127.0.0.1:0"}};
    assert_int_equal(llmdd_create(33, LLMDD_ROLE_PROMPT, &q), LLM_SUCCESS);
    assert_int_equal(llmdd_initialize(q, o, 2), LLM_SUCCESS);
    te_etcd_stop(&etcd, SIGKILL);
    t0 = th_now_ms();
    llmdd_destroy(q);
    llmdd_destroy(d2);
    llmdd_destroy(d);
    assert_true(th_now_ms() - t0 <= 3000);
}

/*
 * After the server lost its data, its revisions start again below the ones
 * a decoder saw: the decoder must watch the new history from its present,
 * or it would miss departures until the new history caught up.
 */
static void
test_departure_after_data_loss(void **state)
{
    (void)state;
    te_etcd_start(&etcd);
    llmdd_option o[2] = {{"llm.MetadataServer", etcd.server},
                         {"llm.ListenIpInfo", "127.0.0.1:0"}};
    llmdd *x;
    /* History: 40 publishes and removals. */
    assert_int_equal(llmdd_create(50, LLMDD_ROLE_PROMPT, &x), LLM_SUCCESS);
    assert_int_equal(llmdd_initialize(x, o, 2), LLM_SUCCESS);
    for (int i = 0; i < 20; i++) {
        assert_int_equal(llmdd_set_role(x, LLMDD_ROLE_DECODER, NULL, 0),
                         LLM_SUCCESS);
        assert_int_equal(llmdd_set_role(x, LLMDD_ROLE_PROMPT, &o[1], 1),
                         LLM_SUCCESS);
    }
    llmdd_destroy(x);
    llmdd *d = decoder(100, etcd.server, NULL); /* watches from there */
    te_etcd_restart(&etcd, true);
    th_proc *p = prompt(51, "llm.MetadataPrefix=llmdd",
                        "llm.HeartbeatInterval=0");
    assert_int_equal(link_id(d, 51, 3000), LLM_SUCCESS);
    mp_peer_stop(p);
    int64_t t0 = th_now_ms();
    while (llmdd_check_link(d, 51, 100) != LLM_NOT_YET_LINK)
        assert_true(th_now_ms() - t0 <= LEASE_MS + 1000);
    print_message("departure after data loss seen after %lld ms\n",
                  (long long)(th_now_ms() - t0));
    llmdd_destroy(d);
}

static void
test_hostile_gateway(void **state)
{
    (void)state;
    llmdd *pr;
    uint16_t port;
    char srv[64];

    assert_int_equal(llmdd_create(41, LLMDD_ROLE_PROMPT, &pr), LLM_SUCCESS);
    assert_int_equal(th_init_listen(pr, MP_IP, &port, NULL, 0), LLM_SUCCESS);
    static const struct {
        enum te_fake_mode mode;
        llmdd_status init, link;
    } cases[] = {
        {TE_FAKE_MALFORMED, LLM_FAILED, 0},
        {TE_FAKE_OVERSIZED, LLM_FAILED, 0},
        {TE_FAKE_HTTP404, LLM_FAILED, 0},
        {TE_FAKE_BAD_VALUE, LLM_SUCCESS, LLM_LINK_FAILED},
        {TE_FAKE_BIG_VALUE, LLM_SUCCESS, LLM_LINK_FAILED},
        {TE_FAKE_UNKNOWN, LLM_SUCCESS, LLM_SUCCESS},
    };
    for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
        uint16_t f = te_fake_start(cases[i].mode, 41, MP_IP, port);
        snprintf(srv, sizeof(srv), "etcd://127.0.0.1:%u", f);
        llmdd_option o[1] = {{"llm.MetadataServer", srv}};
        llmdd *d;
        assert_int_equal(llmdd_create(100, LLMDD_ROLE_DECODER, &d),
                         LLM_SUCCESS);
        assert_int_equal(llmdd_initialize(d, o, 1), cases[i].init);
        if (cases[i].init == LLM_SUCCESS)
            assert_int_equal(link_id(d, 41, 3000), cases[i].link);
        /* The metadata thread read a whole hostile watch stream (over
         * 1 MiB, not JSON) once it asks for another. */
        int64_t t0 = th_now_ms();
        while (cases[i].init == LLM_SUCCESS && te_fake_count() < 6 &&
               th_now_ms() - t0 < 10000)
            th_sleep_ms(10);
        assert_true(cases[i].init != LLM_SUCCESS || te_fake_count() >= 6);
        llmdd_destroy(d);
        assert_true(te_fake_count() > 0);
        te_fake_stop();
    }
    llmdd_destroy(pr);
}

/*
 * Our key overwritten by a value that is no entry, or by another entry
 * without a lease (an operator's stray put): taken back within a lease
 * period, so that new peers link and the list shows it; a writer who
 * keeps writing gets at most one take a lease period; overwritten and
 * then deleted, it comes back and no link is dropped.
 */
static void
test_overwrite_taken_back(void **state)
{
    (void)state;
    char mine[LLMDD_META_VALUE_MAX + 1], other[LLMDD_META_VALUE_MAX];
    int64_t v0, v1;

    te_etcd_start(&etcd);
    th_proc *p = prompt(61, "llm.MetadataPrefix=llmdd", NULL);
    th_proc *s = prompt(62, "llm.MetadataPrefix=llmdd",
                        "llm.HeartbeatInterval=0");
    llmdd *d = decoder(100, etcd.server, NULL);
    assert_true(te_etcd_get(&etcd, key_of(61), mine, sizeof(mine), NULL));
    assert_int_equal(link_id(d, 61, 3000), LLM_SUCCESS);
    assert_int_equal(link_id(d, 62, 3000), LLM_SUCCESS);

    te_etcd_put(&etcd, key_of(61), "not an entry", 0);
    int64_t ms = wait_value(61, mine, LEASE_MS + 1000);
    print_message("overwritten by a non-entry: taken back after %lld ms\n",
                  (long long)ms);
    assert_true(ms >= 0);
    assert_true(listed(NULL, 61));
    llmdd *d2 = decoder(101, etcd.server, NULL);
    assert_int_equal(link_id(d2, 61, 3000), LLM_SUCCESS);
    assert_int_equal(mp_pull_check(d2, 61, p->ids.kv, 1), LLM_SUCCESS);
    llmdd_destroy(d2);

    /* Another instance's entry with no lease is nobody's live entry. */
    other_entry(mine, other, sizeof(other));
    te_etcd_put(&etcd, key_of(61), other, 0);
    ms = wait_value(61, mine, LEASE_MS + 1000);
    print_message("overwritten by another entry: taken back after %lld ms\n",
                  (long long)ms);
    assert_true(ms >= 0);

    /* A writer that puts every 250 ms for four lease periods: the puts
     * beyond the writer's own are our takes, one a lease period at most
     * (a take can lose to a put that came between its read and its
     * transaction; not all of them do). */
    assert_true(te_etcd_get(&etcd, key_of(61), mine, sizeof(mine), &v0));
    int puts = 0;
    int64_t t0 = th_now_ms();
    while (th_now_ms() - t0 < 4 * LEASE_MS) {
        te_etcd_put(&etcd, key_of(61), "not an entry", 0);
        puts++;
        th_sleep_ms(250);
    }
    int64_t window = th_now_ms() - t0;
    char cur[LLMDD_META_VALUE_MAX + 1];
    assert_true(te_etcd_get(&etcd, key_of(61), cur, sizeof(cur), &v1));
    int takes = (int)(v1 - v0) - puts;
    print_message("%d puts over %lld ms: %d takes\n", puts,
                  (long long)window, takes);
    assert_true(takes >= 1 && takes <= window / LEASE_MS + 1);
    assert_true(wait_value(61, mine, LEASE_MS + 1000) >= 0);

    /* Overwritten and deleted at once: back, and the link stays. */
    te_etcd_put(&etcd, key_of(61), "not an entry", 0);
    assert_int_equal(te_etcd_delete(&etcd, key_of(61)), 0);
    assert_true(wait_value(61, mine, LEASE_MS + 1000) >= 0);
    watch_caught_up(d, 62);
    assert_int_equal(llmdd_check_link(d, 61, 1000), LLM_SUCCESS);
    assert_int_equal(mp_pull_check(d, 61, p->ids.kv, 1), LLM_SUCCESS);
    (void)s;
    llmdd_destroy(d);
}

/*
 * A value that is no entry, put under the id of a peer linked by address
 * that announced no heartbeats, then deleted: the delete says nothing
 * about that peer, and its link stays.
 */
static void
test_undecodable_delete(void **state)
{
    (void)state;
    te_etcd_start(&etcd);
    const char *args[] = {"--role", "prompt", "--opt",
                          "llm.HeartbeatInterval=0", NULL};
    th_proc *q = mp_peer_start(63, args);
    th_proc *s = prompt(64, "llm.MetadataPrefix=llmdd",
                        "llm.HeartbeatInterval=0");
    llmdd *d = decoder(100, etcd.server, NULL);
    assert_int_equal(th_link(d, 63, MP_IP, q->port, 3000), LLM_SUCCESS);
    assert_int_equal(link_id(d, 64, 3000), LLM_SUCCESS);
    te_etcd_put(&etcd, key_of(63), "not an entry", 0);
    assert_int_equal(te_etcd_delete(&etcd, key_of(63)), 0);
    watch_caught_up(d, 64);
    assert_int_equal(llmdd_check_link(d, 63, 1000), LLM_SUCCESS);
    assert_int_equal(mp_pull_check(d, 63, q->ids.kv, 1), LLM_SUCCESS);
    (void)s;
    llmdd_destroy(d);
}

/*
 * Another live instance's entry (under a lease of its own) on our key:
 * two instances claim one id. Logged at error once a lease period, never
 * taken; once its lease ends, our key is taken back.
 */
static void
test_two_instances_claim(void **state)
{
    (void)state;
    char mine[LLMDD_META_VALUE_MAX + 1], other[LLMDD_META_VALUE_MAX];
    char cur[LLMDD_META_VALUE_MAX + 1];
    int64_t v0, v1;
    llmdd_option o[3] = {{"llm.MetadataServer", NULL},
                         {"llm.ListenIpInfo", "127.0.0.1:0"},
                         {"llm.MetadataLeaseMs", "2000"}};
    llmdd *a;

    te_etcd_start(&etcd);
    o[0].value = etcd.server;
    capture_stderr();
    assert_int_equal(llmdd_create(65, LLMDD_ROLE_PROMPT, &a), LLM_SUCCESS);
    assert_int_equal(llmdd_initialize(a, o, 3), LLM_SUCCESS);
    assert_true(te_etcd_get(&etcd, key_of(65), mine, sizeof(mine), NULL));
    other_entry(mine, other, sizeof(other));
    int64_t lease = te_etcd_grant(&etcd, 60);
    te_etcd_put(&etcd, key_of(65), other, lease);
    assert_true(te_etcd_get(&etcd, key_of(65), cur, sizeof(cur), &v0));

    /* Two lines take a lease period between them. */
    int64_t t0 = th_now_ms();
    while (log_count("two instances claim cluster 65") < 2)
        assert_true(th_now_ms() - t0 <= 2 * LEASE_MS + 2000);
    print_message("second claim logged after %lld ms\n",
                  (long long)(th_now_ms() - t0));
    assert_true(te_etcd_get(&etcd, key_of(65), cur, sizeof(cur), &v1));
    assert_string_equal(cur, other);
    assert_int_equal(v1, v0); /* not fought */

    te_etcd_revoke(&etcd, lease);
    int64_t ms = wait_value(65, mine, LEASE_MS + 1000);
    print_message("the other gone: taken back after %lld ms\n",
                  (long long)ms);
    assert_true(ms >= 0);
    llmdd_destroy(a);
    restore_stderr();
}

/*
 * One prompt cut off from etcd alone (a blackhole between them) past its
 * lease, while a decoder keeps pulling from it: its entry expires, new
 * lookups fail, and the link stays, since its heartbeats pass; every pull
 * succeeds; a new entry for 66 (a replacement's, say) drops nothing
 * either. Back in touch, it takes its key back and new peers link, with
 * the old link as it was.
 */
static void
test_cut_from_etcd(void **state)
{
    (void)state;
    char srv[96];

    te_etcd_start(&etcd);
    uint16_t px = te_proxy_start(etcd.client);
    snprintf(srv, sizeof(srv), "llm.MetadataServer=etcd://127.0.0.1:%u", px);
    const char *args[] = {"--role", "prompt", "--opt", srv,
                          "--opt",  LEASE_OPT, NULL};
    th_proc *p = mp_peer_start(66, args);
    th_proc *s = prompt(67, "llm.MetadataPrefix=llmdd",
                        "llm.HeartbeatInterval=0");
    llmdd *d = decoder(100, etcd.server, NULL);
    char mine[LLMDD_META_VALUE_MAX + 1], other[LLMDD_META_VALUE_MAX];
    assert_true(te_etcd_get(&etcd, key_of(66), mine, sizeof(mine), NULL));
    assert_int_equal(link_id(d, 66, 3000), LLM_SUCCESS);
    assert_int_equal(link_id(d, 67, 3000), LLM_SUCCESS);

    te_proxy_blackhole(true);
    int pulls = 0;
    int64_t t0 = th_now_ms();
    while (listed(NULL, 66)) {
        assert_int_equal(mp_pull_check(d, 66, p->ids.kv, 1), LLM_SUCCESS);
        pulls++;
        assert_true(th_now_ms() - t0 <= LEASE_MS + 3000);
    }
    print_message("cut off: entry gone after %lld ms\n",
                  (long long)(th_now_ms() - t0));
    /* The decoder has seen the expiry. */
    watch_caught_up(d, 67);
    for (int i = 0; i < 10; i++, pulls++)
        assert_int_equal(mp_pull_check(d, 66, p->ids.kv, 1), LLM_SUCCESS);
    assert_int_equal(llmdd_check_link(d, 66, 1000), LLM_SUCCESS);
    print_message("%d pulls while cut off, all good\n", pulls);
    llmdd *d2 = decoder(101, etcd.server, NULL);
    assert_int_equal(link_id(d2, 66, 3000), LLM_LINK_FAILED);

    /* A new entry for 66 meanwhile (as a replacement would publish, with
     * another nonce; without a lease, so that 66 takes its key back
     * later): the live link is not dropped for it either. */
    other_entry(mine, other, sizeof(other));
    te_etcd_put(&etcd, key_of(66), other, 0);
    assert_int_equal(link_id(d, 67, 3000), LLM_SUCCESS);
    watch_caught_up(d, 67);
    assert_int_equal(llmdd_check_link(d, 66, 1000), LLM_SUCCESS);
    assert_int_equal(mp_pull_check(d, 66, p->ids.kv, 1), LLM_SUCCESS);

    te_proxy_blackhole(false);
    int64_t ms = wait_value(66, mine, LEASE_MS + 2000);
    print_message("back in touch: published again after %lld ms\n",
                  (long long)ms);
    assert_true(ms >= 0);
    assert_int_equal(link_id(d2, 66, 3000), LLM_SUCCESS);
    assert_int_equal(mp_pull_check(d2, 66, p->ids.kv, 1), LLM_SUCCESS);
    assert_int_equal(mp_pull_check(d, 66, p->ids.kv, 1), LLM_SUCCESS);
    (void)s;
    llmdd_destroy(d2);
    llmdd_destroy(d);
}

int
main(int argc, char **argv)
{
    te_etcd_require();
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_teardown(test_link_by_id, teardown),
        cmocka_unit_test_teardown(test_refused_at_initialize, teardown),
        cmocka_unit_test_teardown(test_set_role_publishes, teardown),
        cmocka_unit_test_teardown(test_departures, teardown),
        cmocka_unit_test_teardown(test_server_restart, teardown),
        cmocka_unit_test_teardown(test_departure_after_data_loss, teardown),
        cmocka_unit_test_teardown(test_hostile_gateway, teardown),
        cmocka_unit_test_teardown(test_overwrite_taken_back, teardown),
        cmocka_unit_test_teardown(test_undecodable_delete, teardown),
        cmocka_unit_test_teardown(test_two_instances_claim, teardown),
        cmocka_unit_test_teardown(test_cut_from_etcd, teardown),
    };
    th_test_filter(argc, argv);
    return cmocka_run_group_tests(tests, NULL, NULL);
}
