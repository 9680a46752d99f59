/*
 * An llmdd tcp pull against a raw TCP round trip of the same bytes, call
 * by call, in one pair of processes and over the same memory: the prompt's
 * cache is what both senders send from, the decoder's cache what both
 * receive into. `llmdd bench` times a row and its baseline one after the
 * other, so a change of load between the two moves their ratio; here the
 * two alternate (which one goes first alternates too), so load and memory
 * are shared alike (BENCHMARKS.md, "The 256 KiB dip").
 *
 *   cc -O2 -Iinclude -o build/tcp_ab scripts/tcp_ab.c -Lbuild -lllmdd \
 *       -lpthread -Wl,-rpath,$PWD/build
 *   ./build/tcp_ab SIZE ITERS [MODE [PLACE]]
 *
 * MODE 0: both (the default), 1: llmdd only, 2: raw only. PLACE same: both
 * processes on CPU 0; split: this one on CPU 0, the child on CPU 1; by
 * default where the scheduler puts them.
 *
 * The child process is the prompt (llm.Transport=tcp) plus a raw sender
 * thread; the parent is the decoder and the raw receiver. Prints, for each
 * of the two, the p25/p50/p75 and mean of a call's time, the calls over
 * 1 ms, and the p50 CPU time of a call on each side: the receiver's (this
 * thread's) and the sender's (the child process's, every thread).
 */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <llmdd/llmdd.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <pthread.h>
#include <sched.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#define TOTAL (64u << 20) /* each side's memory, cycled through */
#define WARMUP 200

typedef struct {
    int64_t *wall, *rx, *tx;
    int n;
} samples;

static size_t size, slots;
static uint8_t *src;
static int lfd;

static int64_t
clk_ns(clockid_t c)
{
    struct timespec t;

    clock_gettime(c, &t);
    return t.tv_sec * 1000000000LL + t.tv_nsec;
}

/* As the library sets up a connection within one host, and the bench. */
static void
tune(int fd)
{
    int one = 1;

    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
    setsockopt(fd, IPPROTO_TCP, TCP_CONGESTION, "cubic", 5);
}

static int
io_full(int fd, void *p, size_t n, bool wr)
{
    for (size_t got = 0; got < n;) {
        ssize_t k = wr ? write(fd, (uint8_t *)p + got, n - got)
                       : read(fd, (uint8_t *)p + got, n - got);
        if (k <= 0)
            return -1;
        got += (size_t)k;
    }
    return 0;
}

/* The raw sender: {offset, length} in, those bytes of src out. */
static void *
raw_sender(void *arg)
{
    int fd = accept(lfd, NULL, NULL);
    uint64_t req[2];

    (void)arg;
    if (fd < 0)
        return NULL;
    tune(fd);
    while (io_full(fd, req, sizeof(req), false) == 0)
        if (req[0] + req[1] > slots * size ||
            io_full(fd, src + req[0], req[1], true) != 0)
            break;
    close(fd);
    return NULL;
}

/* Keeps this process (every thread it starts from now on) on one CPU. */
static void
pin(int cpu)
{
    cpu_set_t m;

    CPU_ZERO(&m);
    CPU_SET(cpu, &m);
    if (sched_setaffinity(0, sizeof(m), &m) != 0)
        perror("sched_setaffinity");
}

static int
cmp(const void *a, const void *b)
{
    int64_t x = *(const int64_t *)a, y = *(const int64_t *)b;
    return x < y ? -1 : x > y;
}

static double
p(int64_t *v, int n, int q)
{
    return v[(size_t)n * (size_t)q / 4] / 1e3;
}

static void
report(const char *name, samples *s)
{
    int64_t sum = 0;
    int over = 0;

    if (s->n == 0)
        return;
    for (int i = 0; i < s->n; i++) {
        sum += s->wall[i];
        over += s->wall[i] > 1000000;
    }
    qsort(s->wall, s->n, sizeof(int64_t), cmp);
    qsort(s->rx, s->n, sizeof(int64_t), cmp);
    qsort(s->tx, s->n, sizeof(int64_t), cmp);
    printf("%-5s %8zu B: p25 %7.1f p50 %7.1f p75 %7.1f mean %7.1f us, "
           "%d over 1 ms; cpu p50 receiver %6.1f sender %6.1f us\n",
           name, size, p(s->wall, s->n, 1), p(s->wall, s->n, 2),
           p(s->wall, s->n, 3), sum / 1e3 / s->n, over, p(s->rx, s->n, 2),
           p(s->tx, s->n, 2));
}

/* The child: the prompt and the raw sender, until the parent closes q. */
static int
prompt_main(const llmdd_cache_desc *d, int out, int q)
{
    llmdd_option o[2] = {{"llm.ListenIpInfo", "127.0.0.1:0"},
                         {"llm.Transport", "tcp"}};
    struct sockaddr_in sa = {.sin_family = AF_INET,
                             .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    socklen_t sl = sizeof(sa);
    llmdd_ip_info ip;
    llmdd_cache c;
    pthread_t th;
    llmdd *dd;
    char x;

    if (llmdd_create(1, LLMDD_ROLE_PROMPT, &dd) != LLM_SUCCESS ||
        llmdd_initialize(dd, o, 2) != LLM_SUCCESS ||
        llmdd_listen_address(dd, &ip) != LLM_SUCCESS ||
        llmdd_allocate_cache(dd, d, &c) != LLM_SUCCESS)
        return 2;
    src = (uint8_t *)(uintptr_t)c.tensor_addrs[0];
    memset(src, 0x5a, slots * size);
    lfd = socket(AF_INET, SOCK_STREAM, 0);
    if (lfd < 0 || bind(lfd, (struct sockaddr *)&sa, sizeof(sa)) != 0 ||
        listen(lfd, 1) != 0 ||
        getsockname(lfd, (struct sockaddr *)&sa, &sl) != 0 ||
        pthread_create(&th, NULL, raw_sender, NULL) != 0)
        return 2;
    int64_t msg[3] = {ip.port, ntohs(sa.sin_port), c.cache_id};
    if (io_full(out, msg, sizeof(msg), true) != 0)
        return 2;
    while (read(q, &x, 1) > 0)
        ;
    return 0;
}

int
main(int argc, char **argv)
{
    int iters = argc > 2 ? atoi(argv[2]) : 0;
    int mode = argc > 3 ? atoi(argv[3]) : 0;
    const char *place = argc > 4 ? argv[4] : "";
    int pfd[2], qfd[2];

    size = argc > 2 ? strtoul(argv[1], NULL, 0) : 0;
    if (size == 0 || size > TOTAL || iters <= 0) {
        fprintf(stderr, "usage: tcp_ab SIZE ITERS [MODE]\n");
        return 2;
    }
    slots = TOTAL / size;
    llmdd_cache_desc d = {.num_tensors = 1,
                          .data_type = LLMDD_DT_UINT8,
                          .num_dims = 2,
                          .shape = {(int64_t)slots, (int64_t)size}};
    if (pipe(pfd) != 0 || pipe(qfd) != 0)
        return 2;
    pid_t pid = fork();
    if (pid == 0) {
        if (strcmp(place, "same") == 0 || strcmp(place, "split") == 0)
            pin(strcmp(place, "same") == 0 ? 0 : 1);
        close(qfd[1]);
        _exit(prompt_main(&d, pfd[1], qfd[0]));
    }
    close(qfd[0]);
    if (strcmp(place, "same") == 0 || strcmp(place, "split") == 0)
        pin(0);

    int64_t msg[3];
    llmdd_option topt = {"llm.Transport", "tcp"};
    llmdd_ip_info ri = {.ip = "127.0.0.1"};
    llmdd_status ret = LLM_FAILED;
    llmdd_cache c;
    llmdd *dd;
    if (io_full(pfd[0], msg, sizeof(msg), false) != 0 ||
        llmdd_create(2, LLMDD_ROLE_DECODER, &dd) != LLM_SUCCESS ||
        llmdd_initialize(dd, &topt, 1) != LLM_SUCCESS ||
        llmdd_allocate_cache(dd, &d, &c) != LLM_SUCCESS)
        return 2;
    ri.port = (uint16_t)msg[0];
    llmdd_cluster_info ci = {.remote_cluster_id = 1,
                             .remote_ip_infos = &ri,
                             .num_remote_ip_infos = 1};
    if (llmdd_link_clusters(dd, &ci, 1, &ret, 5000) != LLM_SUCCESS ||
        ret != LLM_SUCCESS)
        return 3;
    struct sockaddr_in sa = {.sin_family = AF_INET,
                             .sin_port = htons((uint16_t)msg[1]),
                             .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    if (fd < 0 || connect(fd, (struct sockaddr *)&sa, sizeof(sa)) != 0)
        return 3;
    tune(fd);
    uint8_t *dst = (uint8_t *)(uintptr_t)c.tensor_addrs[0];
    memset(dst, 0xa5, slots * size);

    clockid_t child;
    samples s[2];
    if (clock_getcpuclockid(pid, &child) != 0)
        return 3;
    for (int k = 0; k < 2; k++) {
        s[k].wall = calloc(iters, sizeof(int64_t));
        s[k].rx = calloc(iters, sizeof(int64_t));
        s[k].tx = calloc(iters, sizeof(int64_t));
        s[k].n = 0;
        if (s[k].wall == NULL || s[k].rx == NULL || s[k].tx == NULL)
            return 2;
    }
    for (int i = 0; i < iters + WARMUP; i++) {
        for (int k = 0; k < 2; k++) {
            int raw = k == i % 2; /* which goes first alternates */
            if ((mode == 1 && raw) || (mode == 2 && !raw))
                continue;
            /* Different slots, so that neither finds the other's bytes
             * in a CPU cache. */
            uint64_t slot = ((uint64_t)i + (raw ? slots / 2 : 0)) % slots;
            int64_t c0 = clk_ns(CLOCK_THREAD_CPUTIME_ID), p0 = clk_ns(child);
            int64_t t0 = clk_ns(CLOCK_MONOTONIC);
            if (raw) {
                uint64_t req[2] = {slot * size, size};
                if (io_full(fd, req, sizeof(req), true) != 0 ||
                    io_full(fd, dst + slot * size, size, false) != 0)
                    return 4;
            } else {
                llmdd_cache_index idx = {1, msg[2], (uint32_t)slot};
                if (llmdd_pull_kv_cache(dd, &idx, &c, (uint32_t)slot, -1,
                                        NULL) != LLM_SUCCESS)
                    return 4;
            }
            int64_t t1 = clk_ns(CLOCK_MONOTONIC);
            samples *x = &s[raw];
            if (i >= WARMUP) {
                x->wall[x->n] = t1 - t0;
                x->rx[x->n] = clk_ns(CLOCK_THREAD_CPUTIME_ID) - c0;
                x->tx[x->n] = clk_ns(child) - p0;
                x->n++;
            }
        }
    }
    report("llmdd", &s[0]);
    report("raw", &s[1]);
    if (s[0].n > 0 && s[1].n > 0)
        printf("p50 ratio (raw / llmdd, as bench's ratio): %.2f\n",
               (double)s[1].wall[s[1].n / 2] / (double)s[0].wall[s[0].n / 2]);
    fflush(stdout);
    close(fd);
    close(qfd[1]);
    llmdd_destroy(dd);
    waitpid(pid, NULL, 0);
    return 0;
}
