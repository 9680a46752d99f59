/*
 * One linked peer's flood never takes another peer's link down
 * (docs/model.md, "Isolation"). This process holds the victim (a prompt),
 * a healthy decoder linked to it, a new decoder that links mid-flood, and a
 * raw wire peer that floods the victim's control thread for 8 s:
 *
 * - with empty HEARTBEATs, far more than the two per interval it announced:
 *   it breaks the protocol and loses its link;
 * - with PINGs and key lookups whose replies it reads (what the protocol
 *   allows): it keeps its link, and is served within its share of each of
 *   the control thread's rounds, which counts frames and bytes.
 *
 * Meanwhile the healthy decoder checks its link every 250 ms: every check
 * succeeds, none takes 500 ms or more, and no link of the victim's or the
 * decoder's is dropped for silence; the new decoder links in under 200 ms.
 * Under ThreadSanitizer only the successes and the absence of drops are
 * asserted: its slowdown is not the library's.
 */
#include <errno.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "harness/fault_util.h"

#define FLOOD_MS 8000
#define CHECK_EVERY_MS 250
#define HB_MS "200" /* heartbeats every 200 ms, 3 misses: 600 ms to a drop */

#define WINDOW 4096 /* requests the allowed flooder has unanswered, at most */

typedef struct {
    int fd;
    bool allowed; /* PINGs and key lookups, not heartbeats */
    atomic_bool stop;
    atomic_llong sent, replies;
    /* The allowed flooder reads its replies: it sends no more than WINDOW
     * ahead of them, so the victim never holds a backlog of replies for it
     * (it drops a peer that leaves 1 MiB of them unread). */
    pthread_mutex_t lock;
    pthread_cond_t read;
} flooder;

static void
window_wait(flooder *f)
{
    pthread_mutex_lock(&f->lock);
    while (!atomic_load(&f->stop) &&
           atomic_load(&f->sent) - atomic_load(&f->replies) >= WINDOW)
        pthread_cond_wait(&f->read, &f->lock);
    pthread_mutex_unlock(&f->lock);
}

static void *
flood_send(void *arg)
{
    flooder *f = arg;
    llmdd__key_query q = {.key_len = 1};
    uint8_t buf[256];

    q.key[0] = 'k';
    for (int64_t seq = 1; !atomic_load(&f->stop); seq++) {
        int rc;
        if (!f->allowed) {
            rc = fu_send_frame(f->fd, WMSG_HEARTBEAT, NULL, 0);
        } else if ((window_wait(f), atomic_load(&f->stop))) {
            break;
        } else if (seq % 2 == 0) {
            size_t n = llmdd__wire_i64_encode(seq, buf, sizeof(buf));
            rc = fu_send_frame(f->fd, WMSG_PING, buf, n);
        } else {
            q.seq = (uint64_t)seq;
            size_t n = llmdd__wire_key_query_encode(&q, buf, sizeof(buf));
            rc = fu_send_frame(f->fd, WMSG_KEY_QUERY, buf, n);
        }
        if (rc != 0)
            break; /* dropped */
        atomic_fetch_add(&f->sent, 1);
    }
    return NULL;
}

/* Reads the victim's replies as fast as they come, frame by frame. */
static void *
flood_read(void *arg)
{
    flooder *f = arg;
    uint8_t buf[2048];
    uint16_t type;
    size_t len;

    while (!atomic_load(&f->stop)) {
        int rc = fu_recv_frame(f->fd, &type, buf, sizeof(buf), &len, 100);
        if (rc == 0 && (type == WMSG_PONG || type == WMSG_KEY_REPLY)) {
            pthread_mutex_lock(&f->lock);
            atomic_fetch_add(&f->replies, 1);
            pthread_cond_signal(&f->read);
            pthread_mutex_unlock(&f->lock);
        } else if (rc != 0 && errno != ETIMEDOUT) {
            break;
        }
    }
    pthread_mutex_lock(&f->lock);
    atomic_store(&f->stop, true); /* the sender must not wait for it */
    pthread_cond_signal(&f->read);
    pthread_mutex_unlock(&f->lock);
    return NULL;
}

static void
flood(bool allowed)
{
    llmdd_option o[] = {{"llm.Transport", "tcp"},
                        {"llm.HeartbeatInterval", HB_MS},
                        {"llm.HeartbeatMisses", "3"}};
    llmdd *victim, *healthy, *late;
    uint8_t token[16];
    uint32_t st;
    uint16_t port;

    assert_int_equal(llmdd_create(1, LLMDD_ROLE_PROMPT, &victim), LLM_SUCCESS);
    assert_int_equal(th_init_listen(victim, "127.0.0.1", &port, o, 3),
                     LLM_SUCCESS);
    llmdd_cache_desc d = th_desc_kv();
    llmdd_cache kv;
    assert_int_equal(llmdd_allocate_cache(victim, &d, &kv), LLM_SUCCESS);
    assert_int_equal(llmdd_set_cache_key(victim, kv.cache_id, 0, "k", 1),
                     LLM_SUCCESS);
    assert_int_equal(llmdd_create(2, LLMDD_ROLE_DECODER, &healthy),
                     LLM_SUCCESS);
    assert_int_equal(llmdd_initialize(healthy, o, 3), LLM_SUCCESS);
    assert_int_equal(th_link(healthy, 1, "127.0.0.1", port, 2000 * FU_SLOW),
                     LLM_SUCCESS);
    assert_int_equal(llmdd_create(3, LLMDD_ROLE_DECODER, &late), LLM_SUCCESS);
    assert_int_equal(llmdd_initialize(late, o, 3), LLM_SUCCESS);

    /* The flooder announces heartbeats every second: two a second are
     * allowed, thousands are not. */
    llmdd__link_terms terms = FU_TERMS;
    terms.hb_ms = allowed ? 0 : 1000;
    flooder f = {.allowed = allowed};
    f.fd = fu_raw_link_terms(port, 77, "tcp", terms, token, &st);
    assert_true(f.fd >= 0);
    atomic_init(&f.stop, false);
    atomic_init(&f.sent, 0);
    atomic_init(&f.replies, 0);
    pthread_mutex_init(&f.lock, NULL);
    pthread_cond_init(&f.read, NULL);
    pthread_t ts, tr;
    assert_int_equal(pthread_create(&ts, NULL, flood_send, &f), 0);
    assert_int_equal(pthread_create(&tr, NULL, flood_read, &f), 0);

    int64_t start = th_now_ms(), worst = 0, link_ms = -1;
    int checks = 0;
    while (th_now_ms() - start < FLOOD_MS) {
        int64_t t0 = th_now_ms();
        assert_int_equal(llmdd_check_link(healthy, 1, 2000 * FU_SLOW),
                         LLM_SUCCESS);
        int64_t took = th_now_ms() - t0;
        worst = took > worst ? took : worst;
        checks++;
        if (link_ms < 0 && t0 - start >= FLOOD_MS / 2) {
            assert_int_equal(
                th_link(late, 1, "127.0.0.1", port, 2000 * FU_SLOW),
                LLM_SUCCESS);
            link_ms = th_now_ms() - t0 - took;
        }
        int64_t next = t0 + CHECK_EVERY_MS - th_now_ms();
        if (next > 0)
            th_sleep_ms((int)next);
    }
    /* An allowed flooder still has its link: its next PING is answered. */
    bool kept = false;
    if (allowed) {
        pthread_mutex_lock(&f.lock);
        atomic_store(&f.stop, true);
        pthread_cond_signal(&f.read);
        pthread_mutex_unlock(&f.lock);
        assert_int_equal(pthread_join(ts, NULL), 0);
        assert_int_equal(pthread_join(tr, NULL), 0);
        uint8_t buf[2048];
        size_t n = llmdd__wire_i64_encode(-1, buf, sizeof(buf));
        uint16_t type = 0;
        int64_t seq = 0;
        kept = fu_send_frame(f.fd, WMSG_PING, buf, n) == 0;
        while (kept) { /* replies to the flood may come first */
            kept = fu_recv_frame(f.fd, &type, buf, sizeof(buf), &n,
                                 2000 * FU_SLOW) == 0;
            if (kept && type == WMSG_PONG &&
                llmdd__wire_i64_decode(buf, n, &seq) == 0 && seq == -1)
                break;
        }
    } else {
        kept = !fu_closed_within(f.fd, 2000 * FU_SLOW);
        atomic_store(&f.stop, true);
        shutdown(f.fd, SHUT_RDWR);
        assert_int_equal(pthread_join(ts, NULL), 0);
        assert_int_equal(pthread_join(tr, NULL), 0);
    }
    int64_t breaches = th_metric(victim, "llmdd_protocol_breaches_total");
    fprintf(stderr,
            "# %s flood: %lld frames sent, %lld replies read; %d checks, "
            "worst %lld ms; a new link took %lld ms; flooder %s, breaches "
            "%lld\n",
            allowed ? "allowed" : "heartbeat", (long long)atomic_load(&f.sent),
            (long long)atomic_load(&f.replies), checks, (long long)worst,
            (long long)link_ms, kept ? "kept" : "dropped", (long long)breaches);
    assert_true(kept == allowed);
    assert_int_equal(breaches, allowed ? 0 : 1);
    /* No link of the healthy peers was dropped for silence. */
    assert_int_equal(th_metric(victim, "llmdd_heartbeat_drops_total"), 0);
    assert_int_equal(th_metric(healthy, "llmdd_heartbeat_drops_total"), 0);
    assert_int_equal(th_metric(late, "llmdd_heartbeat_drops_total"), 0);
    assert_int_equal(th_metric(healthy, "llmdd_links_dropped_total"), 0);
    assert_int_equal(llmdd_check_link(late, 1, 2000 * FU_SLOW), LLM_SUCCESS);
    if (allowed)
        assert_true(atomic_load(&f.replies) > 1000);
    if (FU_SLOW < 8) { /* not under ThreadSanitizer */
        assert_true(worst < 500);
        assert_true(link_ms < 200);
    }
    close(f.fd);
    pthread_cond_destroy(&f.read);
    pthread_mutex_destroy(&f.lock);
    llmdd_destroy(late);
    llmdd_destroy(healthy);
    llmdd_destroy(victim);
}

static void
test_heartbeat_flood_drops_the_flooder(void **state)
{
    (void)state;
    flood(false);
}

static void
test_allowed_flood_is_served_in_its_share(void **state)
{
    (void)state;
    flood(true);
}

/* A peer that announced no heartbeats may send none. */
static void
test_heartbeat_unannounced_breaks_the_protocol(void **state)
{
    llmdd_option o[] = {{"llm.Transport", "tcp"}};
    uint8_t token[16];
    uint32_t st;
    uint16_t port;
    llmdd *victim;

    (void)state;
    assert_int_equal(llmdd_create(1, LLMDD_ROLE_PROMPT, &victim), LLM_SUCCESS);
    assert_int_equal(th_init_listen(victim, "127.0.0.1", &port, o, 1),
                     LLM_SUCCESS);
    int fd = fu_raw_link(port, 77, "tcp", token, &st);
    assert_true(fd >= 0);
    assert_int_equal(fu_send_frame(fd, WMSG_HEARTBEAT, NULL, 0), 0);
    assert_true(fu_closed_within(fd, 2000 * FU_SLOW));
    assert_int_equal(th_metric(victim, "llmdd_protocol_breaches_total"), 1);
    close(fd);
    llmdd_destroy(victim);
}

/* Replies answer requests: a PONG nobody asked for breaks the protocol. */
static void
test_unasked_reply_breaks_the_protocol(void **state)
{
    llmdd_option o[] = {{"llm.Transport", "tcp"}};
    uint8_t token[16], buf[16];
    uint32_t st;
    uint16_t port;
    llmdd *victim;

    (void)state;
    assert_int_equal(llmdd_create(1, LLMDD_ROLE_PROMPT, &victim), LLM_SUCCESS);
    assert_int_equal(th_init_listen(victim, "127.0.0.1", &port, o, 1),
                     LLM_SUCCESS);
    int fd = fu_raw_link(port, 77, "tcp", token, &st);
    assert_true(fd >= 0);
    /* The victim asks once; the raw peer answers that, then once more. */
    size_t n = llmdd__wire_i64_encode(1, buf, sizeof(buf));
    assert_int_equal(llmdd_check_link(victim, 77, 200), LLM_TIMEOUT);
    assert_int_equal(fu_send_frame(fd, WMSG_PONG, buf, n), 0);
    assert_false(fu_closed_within(fd, 300));
    assert_int_equal(fu_send_frame(fd, WMSG_PONG, buf, n), 0);
    assert_true(fu_closed_within(fd, 2000 * FU_SLOW));
    assert_int_equal(th_metric(victim, "llmdd_protocol_breaches_total"), 1);
    close(fd);
    llmdd_destroy(victim);
}

int
main(int argc, char **argv)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_heartbeat_unannounced_breaks_the_protocol),
        cmocka_unit_test(test_unasked_reply_breaks_the_protocol),
        cmocka_unit_test(test_heartbeat_flood_drops_the_flooder),
        cmocka_unit_test(test_allowed_flood_is_served_in_its_share),
    };

    th_test_filter(argc, argv);
    return cmocka_run_group_tests(tests, NULL, NULL);
}
