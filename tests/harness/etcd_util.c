#include "harness/etcd_util.h"

#include <arpa/inet.h>
#include <cjson/cJSON.h>
#include <curl/curl.h>
#include <errno.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include "harness/harness.h"
#include "meta/meta.h" /* the entry encoder and base64, for the fake */

#define ETCD_BIN "etcd"
#define ETCD_READY_MS 20000

static bool
etcd_installed(void)
{
    const char *path = getenv("PATH");
    char buf[512];

    if (path == NULL)
        path = "/usr/bin:/bin";
    while (*path != '\0') {
        size_t n = strcspn(path, ":");
        snprintf(buf, sizeof(buf), "%.*s/" ETCD_BIN, (int)n, path);
        if (access(buf, X_OK) == 0)
            return true;
        path += n;
        if (*path == ':')
            path++;
    }
    return false;
}

void
te_etcd_require(void)
{
    if (!etcd_installed()) {
        fprintf(stderr, "etcd is not installed (scripts/deps.sh installs "
                        "etcd-server): skipped\n");
        exit(TH_SKIP);
    }
}

static void
etcd_spawn(te_etcd *e)
{
    char data[160], log[160], curl[64], purl[64], cluster[96];

    snprintf(data, sizeof(data), "%s/data", e->dir);
    snprintf(log, sizeof(log), "%s/etcd.log", e->dir);
    snprintf(curl, sizeof(curl), "http://127.0.0.1:%u", e->client);
    snprintf(purl, sizeof(purl), "http://127.0.0.1:%u", e->peer);
    snprintf(cluster, sizeof(cluster), "t=%s", purl);
    int fd = open(log, O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0600);
    assert_true(fd >= 0);
    const char *argv[] = {ETCD_BIN,
                          "--name", "t",
                          "--data-dir", data,
                          "--listen-client-urls", curl,
                          "--advertise-client-urls", curl,
                          "--listen-peer-urls", purl,
                          "--initial-advertise-peer-urls", purl,
                          "--initial-cluster", cluster,
                          "--log-level", "warn",
                          NULL};
    /* Not th_spawn: etcd must not outlive a test that is killed (a CTest
     * timeout), so it gets SIGKILL when this thread ends. */
    fflush(NULL);
    pid_t parent = getpid();
    e->pid = fork();
    if (e->pid == 0) {
        if (prctl(PR_SET_PDEATHSIG, SIGKILL) != 0 || getppid() != parent ||
            dup2(fd, 1) < 0 || dup2(fd, 2) < 0)
            _exit(127);
        execvp(argv[0], (char *const *)argv);
        _exit(127);
    }
    close(fd);
    assert_true(e->pid > 0);
    /* Ready when the library's own client gets an answer. */
    int64_t deadline = th_now_ms() + ETCD_READY_MS;
    char buf[16];
    size_t len;
    while (llmdd_metadata_list(e->server, "llmdd", 1000, buf, sizeof(buf),
                               &len) != LLM_SUCCESS) {
        int st;
        if (waitpid(e->pid, &st, WNOHANG) == e->pid) {
            e->pid = 0;
            fail_msg("etcd exited; see %s", log);
        }
        if (th_now_ms() > deadline)
            fail_msg("etcd did not answer within %d ms; see %s",
                     ETCD_READY_MS, log);
        th_sleep_ms(50);
    }
}

void
te_etcd_start(te_etcd *e)
{
    memset(e, 0, sizeof(*e));
    snprintf(e->dir, sizeof(e->dir), "/tmp/llmdd-etcd-XXXXXX");
    assert_non_null(mkdtemp(e->dir));
    e->client = th_free_port();
    do
        e->peer = th_free_port();
    while (e->peer == e->client);
    snprintf(e->server, sizeof(e->server), "etcd://127.0.0.1:%u", e->client);
    snprintf(e->opt, sizeof(e->opt), "llm.MetadataServer=%s", e->server);
    etcd_spawn(e);
}

void
te_etcd_stop(te_etcd *e, int sig)
{
    if (e->pid <= 0)
        return;
    kill(e->pid, sig);
    th_wait(e->pid, 10000, NULL);
    e->pid = 0;
}

static void
rm_data(te_etcd *e)
{
    char cmd[200];
    snprintf(cmd, sizeof(cmd), "rm -rf '%s/data'", e->dir);
    assert_int_equal(system(cmd), 0);
}

void
te_etcd_restart(te_etcd *e, bool wipe)
{
    te_etcd_stop(e, SIGKILL);
    if (wipe)
        rm_data(e);
    etcd_spawn(e);
}

static size_t
discard(char *p, size_t size, size_t n, void *arg)
{
    (void)p;
    (void)arg;
    return size * n;
}

int
te_etcd_delete(te_etcd *e, const char *key)
{
    char url[96], b64[256], body[320];
    CURL *h = curl_easy_init();
    long code = 0;

    if (h == NULL)
        return -1;
    llmdd__b64_encode(key, strlen(key), b64, sizeof(b64));
    snprintf(body, sizeof(body), "{\"key\":\"%s\"}", b64);
    snprintf(url, sizeof(url), "http://127.0.0.1:%u/v3/kv/deleterange",
             e->client);
    curl_easy_setopt(h, CURLOPT_URL, url);
    curl_easy_setopt(h, CURLOPT_POSTFIELDS, body);
    curl_easy_setopt(h, CURLOPT_WRITEFUNCTION, discard);
    curl_easy_setopt(h, CURLOPT_TIMEOUT_MS, 5000L);
    CURLcode cc = curl_easy_perform(h);
    curl_easy_getinfo(h, CURLINFO_RESPONSE_CODE, &code);
    curl_easy_cleanup(h);
    return cc == CURLE_OK && code == 200 ? 0 : -1;
}

/* A body of the gateway's answer. */
typedef struct {
    char buf[1 << 16];
    size_t len;
} gw_body;

static size_t
gw_write(char *p, size_t size, size_t n, void *arg)
{
    gw_body *b = arg;
    size_t len = size * n;

    if (b->len + len >= sizeof(b->buf))
        return 0;
    memcpy(b->buf + b->len, p, len);
    b->len += len;
    b->buf[b->len] = '\0';
    return len;
}

/* POSTs body to path; the answer's JSON (the caller's), or the test fails. */
static cJSON *
gw_call(te_etcd *e, const char *path, const char *body)
{
    static gw_body b;
    char url[128];
    long code = 0;
    CURL *h = curl_easy_init();

    assert_non_null(h);
    b.len = 0;
    b.buf[0] = '\0';
    snprintf(url, sizeof(url), "http://127.0.0.1:%u%s", e->client, path);
    curl_easy_setopt(h, CURLOPT_URL, url);
    curl_easy_setopt(h, CURLOPT_POSTFIELDS, body);
    curl_easy_setopt(h, CURLOPT_WRITEFUNCTION, gw_write);
    curl_easy_setopt(h, CURLOPT_WRITEDATA, &b);
    curl_easy_setopt(h, CURLOPT_TIMEOUT_MS, 5000L);
    CURLcode cc = curl_easy_perform(h);
    curl_easy_getinfo(h, CURLINFO_RESPONSE_CODE, &code);
    curl_easy_cleanup(h);
    if (cc != CURLE_OK || code != 200)
        fail_msg("etcd %s: %s, HTTP %ld: %s", path, curl_easy_strerror(cc),
                 code, b.buf);
    cJSON *j = cJSON_Parse(b.buf);
    assert_non_null(j);
    return j;
}

/* An int64 the gateway writes as a string; 0 when absent. */
static int64_t
gw_i64(const cJSON *o, const char *name)
{
    const cJSON *it = cJSON_GetObjectItemCaseSensitive(o, name);
    if (cJSON_IsNumber(it))
        return (int64_t)it->valuedouble;
    const char *s = cJSON_GetStringValue(it);
    return s != NULL ? strtoll(s, NULL, 10) : 0;
}

static char *
gw_b64(const char *s)
{
    size_t cap = (strlen(s) + 2) / 3 * 4 + 1;
    char *out = malloc(cap);
    assert_non_null(out);
    llmdd__b64_encode(s, strlen(s), out, cap);
    return out;
}

int64_t
te_etcd_grant(te_etcd *e, int ttl_s)
{
    char body[64];

    snprintf(body, sizeof(body), "{\"TTL\":\"%d\"}", ttl_s);
    cJSON *j = gw_call(e, "/v3/lease/grant", body);
    int64_t id = gw_i64(j, "ID");
    cJSON_Delete(j);
    assert_true(id != 0);
    return id;
}

void
te_etcd_revoke(te_etcd *e, int64_t lease)
{
    char body[64];

    snprintf(body, sizeof(body), "{\"ID\":\"%lld\"}", (long long)lease);
    cJSON_Delete(gw_call(e, "/v3/lease/revoke", body));
}

void
te_etcd_put(te_etcd *e, const char *key, const char *value, int64_t lease)
{
    char *k = gw_b64(key), *v = gw_b64(value);
    size_t cap = strlen(k) + strlen(v) + 96;
    char *body = malloc(cap);

    assert_non_null(body);
    snprintf(body, cap, "{\"key\":\"%s\",\"value\":\"%s\",\"lease\":\"%lld\"}",
             k, v, (long long)lease);
    cJSON_Delete(gw_call(e, "/v3/kv/put", body));
    free(body);
    free(k);
    free(v);
}

bool
te_etcd_get(te_etcd *e, const char *key, char *value, size_t cap,
            int64_t *version)
{
    char *k = gw_b64(key), body[320];

    snprintf(body, sizeof(body), "{\"key\":\"%s\"}", k);
    free(k);
    cJSON *j = gw_call(e, "/v3/kv/range", body);
    const cJSON *kv =
        cJSON_GetArrayItem(cJSON_GetObjectItemCaseSensitive(j, "kvs"), 0);
    bool found = kv != NULL;
    if (found) {
        const char *v = cJSON_GetStringValue(
            cJSON_GetObjectItemCaseSensitive(kv, "value"));
        long n = v != NULL ? llmdd__b64_decode(v, strlen(v), value, cap - 1)
                           : -1;
        assert_true(n >= 0);
        value[n] = '\0';
        if (version != NULL)
            *version = gw_i64(kv, "version");
    }
    cJSON_Delete(j);
    return found;
}

void
te_etcd_destroy(te_etcd *e)
{
    char cmd[200];

    te_etcd_stop(e, SIGKILL);
    if (e->dir[0] != '\0') {
        snprintf(cmd, sizeof(cmd), "rm -rf '%s'", e->dir);
        (void)!system(cmd);
        e->dir[0] = '\0';
    }
}

/* ---- The fake gateway. ---- */

static struct {
    int lfd;
    int stop_pipe[2];
    pthread_t thread;
    enum te_fake_mode mode;
    char entry_b64[LLMDD_META_VALUE_MAX * 4];
    atomic_int count;
} fake = {.lfd = -1};

static void
send_all(int fd, const char *p, size_t n)
{
    while (n > 0) {
        ssize_t w = send(fd, p, n, MSG_NOSIGNAL);
        if (w <= 0)
            return;
        p += w;
        n -= (size_t)w;
    }
}

static void
answer(int fd, int code, const char *body, size_t len)
{
    char hdr[160];
    int n = snprintf(hdr, sizeof(hdr),
                     "HTTP/1.1 %d X\r\nContent-Type: application/json\r\n"
                     "Content-Length: %zu\r\nConnection: close\r\n\r\n",
                     code, len);
    send_all(fd, hdr, (size_t)n);
    send_all(fd, body, len);
}

/* Reads a request (headers and a Content-Length body); its text. */
static bool
read_request(int fd, char *buf, size_t cap)
{
    size_t have = 0;
    for (;;) {
        struct pollfd p = {.fd = fd, .events = POLLIN};
        if (poll(&p, 1, 2000) <= 0)
            return false;
        ssize_t n = recv(fd, buf + have, cap - 1 - have, 0);
        if (n <= 0)
            return false;
        have += (size_t)n;
        buf[have] = '\0';
        char *end = strstr(buf, "\r\n\r\n");
        if (end == NULL)
            continue;
        const char *cl = strcasestr(buf, "Content-Length:");
        size_t want = cl != NULL ? strtoul(cl + 15, NULL, 10) : 0;
        if (have >= (size_t)(end + 4 - buf) + want || have + 1 >= cap)
            return true;
    }
}

static void
serve_one(int fd)
{
    char req[8192], body[LLMDD_META_VALUE_MAX * 5];

    if (!read_request(fd, req, sizeof(req)))
        return;
    atomic_fetch_add(&fake.count, 1);
    switch (fake.mode) {
    case TE_FAKE_MALFORMED:
        snprintf(body, sizeof(body), "{\"header\":{\"revision\":\"3\"},\"kv");
        answer(fd, 200, body, strlen(body));
        break;
    case TE_FAKE_OVERSIZED: {
        size_t n = 2u << 20;
        char *big = malloc(n);
        memset(big, ' ', n);
        memcpy(big, "{\"header\":{\"revision\":\"3\"},\"x\":\"", 33);
        big[n - 2] = '"';
        big[n - 1] = '}';
        answer(fd, 200, big, n);
        free(big);
        break;
    }
    case TE_FAKE_HTTP404:
        snprintf(body, sizeof(body),
                 "{\"error\":\"Not Found\",\"code\":5,\"message\":\"nope\"}");
        answer(fd, 404, body, strlen(body));
        break;
    case TE_FAKE_BAD_VALUE:
    case TE_FAKE_BIG_VALUE:
    case TE_FAKE_UNKNOWN: {
        bool unknown = fake.mode != TE_FAKE_BAD_VALUE;
        const char *value = unknown ? fake.entry_b64 : "bm90IGFuIGVudHJ5"; /* "not an entry" */
        if (strstr(req, "/v3/watch") != NULL) {
            /* A message over the 1 MiB limit, one that is not JSON, one
             * created message, then the stream ends. */
            static const char tail[] =
                "\nnot json\n{\"result\":{\"header\":{\"revision\":\"3\"},"
                "\"created\":true,\"zz\":[1]}}\n";
            size_t big = (3u << 19) + sizeof(tail);
            char *w = malloc(big);
            assert_non_null(w);
            memset(w, '[', 3u << 19);
            memcpy(w + (3u << 19), tail, sizeof(tail));
            answer(fd, 200, w, strlen(w));
            free(w);
            break;
        } else if (strstr(req, "count_only") != NULL) {
            snprintf(body, sizeof(body),
                     "{\"header\":{\"revision\":\"3\",\"future\":1},"
                     "\"count\":\"1\",\"more\":{\"a\":[]}}");
        } else {
            snprintf(body, sizeof(body),
                     "{\"header\":{\"revision\":\"3\"},\"kvs\":[{\"key\":"
                     "\"eA==\",\"value\":\"%s\",\"mod_revision\":\"2\","
                     "\"extra\":{\"deep\":[1,2,{\"x\":null}]}}],"
                     "\"count\":\"1\",\"unknown\":true}",
                     value);
        }
        answer(fd, 200, body, strlen(body));
        break;
    }
    }
}

static void *
fake_main(void *arg)
{
    (void)arg;
    for (;;) {
        struct pollfd p[2] = {{.fd = fake.lfd, .events = POLLIN},
                              {.fd = fake.stop_pipe[0], .events = POLLIN}};
        if (poll(p, 2, -1) < 0)
            continue;
        if (p[1].revents)
            break;
        int fd = accept4(fake.lfd, NULL, NULL, SOCK_CLOEXEC);
        if (fd < 0)
            continue;
        serve_one(fd);
        close(fd);
    }
    return NULL;
}

uint16_t
te_fake_start(enum te_fake_mode mode, uint64_t cluster, const char *ip,
              uint16_t port)
{
    uint16_t fport;
    llmdd__meta_entry e;
    char json[LLMDD_META_VALUE_MAX];

    memset(&e, 0, sizeof(e));
    e.cluster_id = cluster;
    e.role = 1;
    e.protocol = 2;
    e.pid = 1;
    e.nonce = 7;
    e.naddrs = 1;
    snprintf(e.addrs[0].ip, sizeof(e.addrs[0].ip), "%s", ip ? ip : "127.0.0.1");
    e.addrs[0].port = port ? port : 1;
    size_t n = llmdd__meta_entry_encode(&e, json, sizeof(json));
    assert_true(n > 2);
    /* Fields a later version might add: ignored. */
    char more[LLMDD_META_VALUE_MAX + 64];
    snprintf(more, sizeof(more),
             "{\"later\":{\"x\":[1,\"y\"]},\"zone\":\"a\",%s", json + 1);
    if (mode == TE_FAKE_BIG_VALUE) { /* the entry, padded past 4 KiB */
        char *big = malloc(2 * LLMDD_META_VALUE_MAX + 1);
        assert_non_null(big);
        size_t m = strlen(more);
        memcpy(big, more, m - 1);
        memset(big + m - 1, ' ', 2 * LLMDD_META_VALUE_MAX - m);
        big[2 * LLMDD_META_VALUE_MAX - 1] = '}';
        big[2 * LLMDD_META_VALUE_MAX] = '\0';
        llmdd__b64_encode(big, strlen(big), fake.entry_b64,
                          sizeof(fake.entry_b64));
        free(big);
    } else {
        llmdd__b64_encode(more, strlen(more), fake.entry_b64,
                          sizeof(fake.entry_b64));
    }
    fake.mode = mode;
    atomic_store(&fake.count, 0);
    fake.lfd = th_socket(true, &fport);
    assert_int_equal(pipe2(fake.stop_pipe, O_CLOEXEC), 0);
    assert_int_equal(pthread_create(&fake.thread, NULL, fake_main, NULL), 0);
    return fport;
}

void
te_fake_stop(void)
{
    if (fake.lfd < 0)
        return;
    (void)!write(fake.stop_pipe[1], "x", 1);
    pthread_join(fake.thread, NULL);
    close(fake.stop_pipe[0]);
    close(fake.stop_pipe[1]);
    close(fake.lfd);
    fake.lfd = -1;
}

int
te_fake_count(void)
{
    return atomic_load(&fake.count);
}

/* ---- The proxy. ---- */

#define PROXY_PAIRS 256

static struct {
    int lfd;
    int wake[2];
    uint16_t to;
    pthread_t thread;
    atomic_bool blackhole, stop;
    /* The thread's own: client side, upstream side (-1: not yet). */
    int a[PROXY_PAIRS], b[PROXY_PAIRS];
    size_t n;
} proxy = {.lfd = -1};

static int
proxy_connect(uint16_t port)
{
    struct sockaddr_in sa = {.sin_family = AF_INET,
                             .sin_port = htons(port),
                             .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);

    if (fd >= 0 && connect(fd, (struct sockaddr *)&sa, sizeof(sa)) != 0) {
        close(fd);
        fd = -1;
    }
    return fd;
}

static void
proxy_close(size_t i)
{
    close(proxy.a[i]);
    if (proxy.b[i] >= 0)
        close(proxy.b[i]);
    proxy.n--;
    proxy.a[i] = proxy.a[proxy.n];
    proxy.b[i] = proxy.b[proxy.n];
}

/* Passes what `from` has to `to`; false when either side is done. */
static bool
proxy_pass(int from, int to)
{
    char buf[65536];
    ssize_t n = recv(from, buf, sizeof(buf), MSG_DONTWAIT);

    if (n == 0 || (n < 0 && errno != EAGAIN && errno != EINTR))
        return false;
    for (ssize_t off = 0; off < n;) {
        ssize_t w = send(to, buf + off, (size_t)(n - off), MSG_NOSIGNAL);
        if (w < 0 && errno == EINTR)
            continue;
        if (w <= 0)
            return false;
        off += w;
    }
    return true;
}

static void *
proxy_main(void *arg)
{
    struct pollfd p[2 + 2 * PROXY_PAIRS];

    (void)arg;
    while (!atomic_load(&proxy.stop)) {
        bool hole = atomic_load(&proxy.blackhole);
        size_t np = 2;
        p[0] = (struct pollfd){.fd = proxy.wake[0], .events = POLLIN};
        p[1] = (struct pollfd){.fd = proxy.lfd, .events = POLLIN};
        /* A connection accepted in a blackhole reaches etcd once it
         * ends, as a SYN retransmitted after a partition would. */
        for (size_t i = proxy.n; i-- > 0 && !hole;)
            if (proxy.b[i] < 0 && (proxy.b[i] = proxy_connect(proxy.to)) < 0)
                proxy_close(i);
        for (size_t i = 0; i < proxy.n && !hole; i++) {
            p[np++] = (struct pollfd){.fd = proxy.a[i], .events = POLLIN};
            p[np++] = (struct pollfd){.fd = proxy.b[i], .events = POLLIN};
        }
        if (poll(p, np, -1) < 0)
            continue;
        if (p[0].revents) {
            char c[64];
            (void)!read(proxy.wake[0], c, sizeof(c));
            continue; /* the blackhole changed: the set is built anew */
        }
        if (p[1].revents) {
            int fd = accept4(proxy.lfd, NULL, NULL, SOCK_CLOEXEC);
            if (fd >= 0 && proxy.n < PROXY_PAIRS) {
                proxy.a[proxy.n] = fd;
                proxy.b[proxy.n++] = -1;
            } else if (fd >= 0) {
                close(fd);
            }
        }
        /* Pairs from the end: proxy_close moves the last into a hole. */
        for (size_t k = (np - 2) / 2; k-- > 0;) {
            bool ok = true;
            if (p[2 + 2 * k].revents)
                ok = proxy_pass(p[2 + 2 * k].fd, p[3 + 2 * k].fd);
            if (ok && p[3 + 2 * k].revents)
                ok = proxy_pass(p[3 + 2 * k].fd, p[2 + 2 * k].fd);
            if (!ok)
                proxy_close(k);
        }
    }
    while (proxy.n > 0)
        proxy_close(0);
    return NULL;
}

uint16_t
te_proxy_start(uint16_t to)
{
    uint16_t port;

    proxy.to = to;
    proxy.n = 0;
    atomic_store(&proxy.blackhole, false);
    atomic_store(&proxy.stop, false);
    proxy.lfd = th_socket(true, &port);
    assert_int_equal(pipe2(proxy.wake, O_CLOEXEC | O_NONBLOCK), 0);
    assert_int_equal(pthread_create(&proxy.thread, NULL, proxy_main, NULL),
                     0);
    return port;
}

void
te_proxy_blackhole(bool on)
{
    atomic_store(&proxy.blackhole, on);
    (void)!write(proxy.wake[1], "x", 1);
}

void
te_proxy_stop(void)
{
    if (proxy.lfd < 0)
        return;
    atomic_store(&proxy.stop, true);
    (void)!write(proxy.wake[1], "x", 1);
    pthread_join(proxy.thread, NULL);
    close(proxy.wake[0]);
    close(proxy.wake[1]);
    close(proxy.lfd);
    proxy.lfd = -1;
}
