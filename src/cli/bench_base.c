/*
 * llmdd bench, the parent side: the progress bar, replies and statistics,
 * and the baselines every row is compared with (one thread's memcpy, one
 * raw TCP loopback connection).
 */
#include <cjson/cJSON.h>
#include <errno.h>
#include <getopt.h>
#include <inttypes.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/utsname.h>
#include <time.h>
#include <unistd.h>

#if defined(__x86_64__)
#include <emmintrin.h>
#endif

#include "bench.h"

/* ---- Parent side: progress, statistics, baselines. ---- */

void
bench_progress_draw(const bench_progress *p)
{
    enum { W = 30 };
    char bar[W + 1];
    size_t fill = p->total > 0 ? p->done * W / p->total : 0;

    if (!p->on)
        return;
    for (size_t i = 0; i < W; i++)
        bar[i] = i < fill ? '#' : '.';
    bar[W] = '\0';
    fprintf(stderr, "\r\033[K[%s] %zu/%zu %s  %.1f s", bar, p->done, p->total,
            p->label, (double)(cli_now_ns() - p->t0) / 1e9);
    fflush(stderr);
}

void
bench_progress_clear(const bench_progress *p)
{
    if (p->on) {
        fputs("\r\033[K", stderr);
        fflush(stderr);
    }
}

/* Receives a node's reply, redrawing the progress bar while it runs. */
bool
bench_recv(cli_node *node, const bench_progress *prog, bench_reply *r,
           int64_t **samples)
{
    uint32_t type;
    void *p = NULL;
    size_t len;

    if (prog != NULL && prog->on) {
        struct pollfd pfd = {.fd = node->rep_fd, .events = POLLIN};
        while (poll(&pfd, 1, 200) == 0)
            bench_progress_draw(prog);
    }
    if (cli_msg_recv(node->rep_fd, &type, &p, &len) != 0 || len < sizeof(*r)) {
        free(p);
        cli_err("the %s node stopped answering", node->name);
        return false;
    }
    memcpy(r, p, sizeof(*r));
    if (r->nsamples != (len - sizeof(*r)) / sizeof(int64_t))
        r->nsamples = 0;
    if (samples != NULL) {
        *samples = NULL;
        if (r->nsamples > 0) {
            *samples = malloc(r->nsamples * sizeof(int64_t));
            if (*samples == NULL) {
                free(p);
                cli_err("out of memory");
                return false;
            }
            memcpy(*samples, (uint8_t *)p + sizeof(*r),
                   r->nsamples * sizeof(int64_t));
        }
    }
    free(p);
    return true;
}

bool
bench_call(cli_node *node, uint32_t type, const bench_cmd *c,
           const bench_progress *prog, bench_reply *r, int64_t **samples)
{
    if (cli_msg_send(node->cmd_fd, type, c, sizeof(*c), NULL, 0) != 0) {
        cli_err("the %s node stopped answering", node->name);
        return false;
    }
    return bench_recv(node, prog, r, samples);
}

int
bench_cmp_i64(const void *a, const void *b)
{
    int64_t x = *(const int64_t *)a, y = *(const int64_t *)b;
    return (x > y) - (x < y);
}

/* Nearest-rank percentile of sorted samples, in microseconds. */
double
bench_pct(const int64_t *s, size_t n, double q)
{
    if (n == 0)
        return 0;
    size_t k = (size_t)(q * (double)n + 0.999999);
    if (k < 1)
        k = 1;
    if (k > n)
        k = n;
    return (double)s[k - 1] / 1e3;
}

static bool
bench_bufs_get(bench_bufs *b, size_t len)
{
    if (len <= b->cap)
        return true;
    free(b->src);
    free(b->dst);
    b->src = malloc(len);
    b->dst = malloc(len);
    if (b->src == NULL || b->dst == NULL) {
        free(b->src);
        free(b->dst);
        memset(b, 0, sizeof(*b));
        return false;
    }
    /* Non-zero: the compiler turns malloc + memset(0) into calloc, which
     * leaves the pages unfaulted. */
    memset(b->src, 0x5a, len);
    memset(b->dst, 0xa5, len);
    b->cap = len;
    return true;
}

void
bench_bufs_free(bench_bufs *b)
{
    free(b->src);
    free(b->dst);
    memset(b, 0, sizeof(*b));
}

/*
 * The streamed copy of the best-copy baseline: non-temporal stores, which
 * skip reading every destination line first. The tool uses only the public
 * API, so this is its own, independent of the library's copy engine: SSE2
 * (every x86-64 has it), 64-byte lines with an aligned destination, the
 * unaligned head and tail by memcpy. Elsewhere plain memcpy.
 */
static void
bench_nt_copy(uint8_t *d, const uint8_t *s, size_t n)
{
#if defined(__x86_64__)
    size_t head = (64 - ((uintptr_t)d & 63)) & 63;
    if (n < 64 + head) {
        memcpy(d, s, n);
        return;
    }
    memcpy(d, s, head);
    d += head;
    s += head;
    n -= head;
    for (; n >= 64; n -= 64, d += 64, s += 64) {
        __m128i a = _mm_loadu_si128((const __m128i *)s);
        __m128i b = _mm_loadu_si128((const __m128i *)(s + 16));
        __m128i e = _mm_loadu_si128((const __m128i *)(s + 32));
        __m128i f = _mm_loadu_si128((const __m128i *)(s + 48));
        _mm_stream_si128((__m128i *)d, a);
        _mm_stream_si128((__m128i *)(d + 16), b);
        _mm_stream_si128((__m128i *)(d + 32), e);
        _mm_stream_si128((__m128i *)(d + 48), f);
    }
#endif
    memcpy(d, s, n);
}

static void
bench_fence(void)
{
#if defined(__x86_64__)
    _mm_sfence(); /* a transfer's bytes are visible when it returns */
#endif
}

/* A baseline's result from its timed calls' samples (sorted here). */
static void
bench_base_stats(int64_t *samples, uint64_t timed, uint64_t per_call,
                 int64_t elapsed_ns, bench_base_result *out)
{
    qsort(samples, timed, sizeof(int64_t), bench_cmp_i64);
    out->gbps = cli_gbps(per_call * timed, elapsed_ns);
    out->p50 = bench_pct(samples, timed, 0.50);
    out->p99 = bench_pct(samples, timed, 0.99);
}

/*
 * The memcpy baseline: the same bytes, in the same pattern, one thread,
 * with memcpy or (nt) the streamed copy, fenced once per call.
 */
bool
bench_base_memcpy(const bench_cmd *c, bench_bufs *bufs, bool nt,
                  bench_base_result *out)
{
    uint64_t tsize = c->nslots * c->block;
    uint64_t *sb = NULL, *db = NULL;
    int64_t *samples = calloc(c->iters, sizeof(int64_t));
    uint64_t timed = 0;
    int64_t t0 = 0;
    bool ok = false;

    if (samples == NULL || !bench_bufs_get(bufs, (size_t)(tsize * c->tensors)))
        goto out;
    uint8_t *src = bufs->src, *dst = bufs->dst;
    if (c->op == BOP_PULL_BLOCKS) {
        sb = calloc(c->per_call, sizeof(*sb));
        db = calloc(c->per_call, sizeof(*db));
        if (sb == NULL || db == NULL)
            goto out;
        cli_pick_blocks(c->nslots, c->per_call, sb, db);
    }
    for (uint64_t i = 0;; i++) {
        if (i >= c->warmup && bench_done(c, i - c->warmup, t0))
            break;
        uint64_t slot = i % c->nslots;
        int64_t t = cli_now_ns();
        if (c->op == BOP_PULL_BLOCKS) {
            for (uint32_t k = 0; k < c->per_call; k++) {
                uint8_t *d = dst + db[k] * c->block;
                const uint8_t *s = src + sb[k] * c->block;
                if (nt)
                    bench_nt_copy(d, s, c->block);
                else
                    memcpy(d, s, c->block);
            }
        } else {
            for (uint32_t k = 0; k < c->tensors; k++) {
                uint8_t *d = dst + k * tsize + slot * c->block;
                const uint8_t *s = src + k * tsize + slot * c->block;
                if (nt)
                    bench_nt_copy(d, s, c->block);
                else
                    memcpy(d, s, c->block);
            }
        }
        if (nt)
            bench_fence();
        /* The copies are the measurement: keep the compiler from
         * dropping stores that nothing reads. */
        __asm__ volatile("" : : "r"(dst) : "memory");
        int64_t now = cli_now_ns();
        if (i == c->warmup)
            t0 = t;
        if (i >= c->warmup)
            samples[timed++] = now - t;
    }
    uint64_t per_call = c->op == BOP_PULL_BLOCKS ? c->block * c->per_call
                                                 : c->block * c->tensors;
    bench_base_stats(samples, timed, per_call, cli_now_ns() - t0, out);
    ok = true;
out:
    if (!ok)
        cli_err("memcpy baseline: out of memory");
    free(samples);
    free(sb);
    free(db);
    return ok;
}

typedef struct {
    uint16_t port;
} bench_tcp_arg;

/*
 * Each end of the raw connection is set up as the library sets up a data
 * connection within one host (llmdd__sock_tune): TCP_NODELAY and the cubic
 * congestion control, so the ratio measures llmdd, not the system's choice
 * between a pacing and a non-pacing one.
 */
static void
bench_sock_setup(int fd)
{
    static const char cc[] = "cubic";
    int one = 1;

    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
    (void)setsockopt(fd, IPPROTO_TCP, TCP_CONGESTION, cc, sizeof(cc) - 1);
}

/*
 * The raw-TCP sender. Each request is two u64 (host order, one host):
 * {off, len} asks for len bytes of its buffer from off; {size, 0} makes the
 * buffer size bytes of filler, answered with one byte.
 */
static int
bench_tcp_sender(void *arg, int in_fd, int out_fd)
{
    const bench_tcp_arg *a = arg;
    struct sockaddr_in sa = {.sin_family = AF_INET,
                             .sin_port = htons(a->port),
                             .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    uint8_t *buf = NULL;
    uint64_t size = 0, req[2];
    int rc = CLI_EXIT_FAIL;

    (void)in_fd;
    (void)out_fd;
    if (fd < 0 || connect(fd, (struct sockaddr *)&sa, sizeof(sa)) != 0)
        goto out;
    bench_sock_setup(fd);
    while (cli_read_full(fd, req, sizeof(req)) == 0) {
        if (req[1] == 0) {
            uint8_t *nb = realloc(buf, req[0] > 0 ? req[0] : 1);
            if (nb == NULL)
                goto out;
            buf = nb;
            size = req[0];
            memset(buf, 0x5a, size);
            uint8_t ack = 1;
            if (cli_write_full(fd, &ack, 1) != 0)
                goto out;
        } else if (req[0] > size || req[1] > size - req[0] ||
                   cli_write_full(fd, buf + req[0], req[1]) != 0) {
            goto out;
        }
    }
    rc = CLI_EXIT_OK; /* end of file: the bench is done */
out:
    if (fd >= 0)
        close(fd);
    free(buf);
    return rc;
}

/*
 * The one raw TCP connection of a run, like llmdd's link: it lives from the
 * first tcp baseline to the end of the run, so it carries the same TCP
 * state from row to row (congestion control, pacing, buffers) as the
 * link's data connections do. A connection opened afresh for every row
 * would start each one in slow start, where BBR does not pace yet
 * (BENCHMARKS.md).
 */
static struct {
    cli_node sender;
    int fd;
    bool up;
} bench_tcp;

static bool
bench_tcp_connect(void)
{
    struct sockaddr_in sa = {.sin_family = AF_INET,
                             .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    socklen_t slen = sizeof(sa);
    static bench_tcp_arg arg;
    int lfd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);

    bench_tcp.fd = -1;
    bench_tcp.sender = (cli_node){.cmd_fd = -1, .rep_fd = -1};
    if (lfd < 0 || bind(lfd, (struct sockaddr *)&sa, sizeof(sa)) != 0 ||
        listen(lfd, 1) != 0 ||
        getsockname(lfd, (struct sockaddr *)&sa, &slen) != 0) {
        cli_err("raw TCP baseline: %s", strerror(errno));
        goto out;
    }
    arg.port = ntohs(sa.sin_port);
    if (cli_node_start(&bench_tcp.sender, "raw TCP sender", false,
                       bench_tcp_sender, &arg) != 0)
        goto out;
    bench_tcp.up = true;
    struct pollfd pfd = {.fd = lfd, .events = POLLIN};
    if (poll(&pfd, 1, 10000) != 1 ||
        (bench_tcp.fd = accept4(lfd, NULL, NULL, SOCK_CLOEXEC)) < 0) {
        cli_err("raw TCP baseline: the sender did not connect");
        goto out;
    }
    bench_sock_setup(bench_tcp.fd);
out:
    if (lfd >= 0)
        close(lfd);
    return bench_tcp.fd >= 0;
}

bool
bench_base_tcp_stop(void)
{
    bool ok = true;

    if (!bench_tcp.up)
        return true;
    if (bench_tcp.fd >= 0)
        close(bench_tcp.fd); /* the sender sees end of file and exits */
    if (cli_node_stop(&bench_tcp.sender) != 0)
        ok = false;
    bench_tcp.up = false;
    return ok;
}

/*
 * The raw-TCP baseline: per call, this process asks the sender process for
 * the bytes of one call and receives them into a preallocated buffer, over
 * the run's one loopback connection. Both sides cycle through as much
 * memory as the row's caches hold, a call's worth at a time, as the row's
 * calls cycle through slots: a baseline kept in one cache-hot buffer would
 * be measuring the CPU cache, not TCP.
 */
bool
bench_base_tcp(const bench_cmd *c, uint64_t per_call, bench_base_result *out)
{
    uint64_t n = c->nslots * c->block * c->tensors / per_call;
    uint64_t slots = n > 0 ? n : 1;
    int64_t *samples = calloc(c->iters, sizeof(int64_t));
    uint8_t *buf = malloc(per_call * slots);
    uint64_t timed = 0, req[2] = {per_call * slots, 0};
    int64_t t0 = 0;
    uint8_t ack;
    bool ok = false;

    if (samples == NULL || buf == NULL) {
        cli_err("raw TCP baseline: out of memory");
        goto out;
    }
    if (!bench_tcp.up && !bench_tcp_connect())
        goto out;
    memset(buf, 0xa5, per_call * slots); /* non-zero: see bench_bufs_get */
    if (cli_write_full(bench_tcp.fd, req, sizeof(req)) != 0 ||
        cli_read_full(bench_tcp.fd, &ack, 1) != 0)
        goto io_err;
    for (uint64_t i = 0;; i++) {
        if (i >= c->warmup && bench_done(c, i - c->warmup, t0))
            break;
        uint64_t off = i % slots * per_call;
        int64_t t = cli_now_ns();
        req[0] = off;
        req[1] = per_call;
        if (cli_write_full(bench_tcp.fd, req, sizeof(req)) != 0 ||
            cli_read_full(bench_tcp.fd, buf + off, per_call) != 0)
            goto io_err;
        int64_t now = cli_now_ns();
        if (i == c->warmup)
            t0 = t;
        if (i >= c->warmup)
            samples[timed++] = now - t;
    }
    bench_base_stats(samples, timed, per_call, cli_now_ns() - t0, out);
    ok = true;
    goto out;
io_err:
    cli_err("raw TCP baseline: the connection failed: %s", strerror(errno));
    bench_base_tcp_stop();
out:
    free(buf);
    free(samples);
    return ok;
}
