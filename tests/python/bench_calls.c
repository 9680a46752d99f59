/*
 * The C side of bench_overhead.py: the calls the Python side makes, made
 * from C against the same prompt process, into memory registered the way
 * the Python side registers its numpy arrays (malloc'd, faulted in).
 *
 *   bench_calls PORT TRANSPORT SMALL_ID SMALL_SLOTS SMALL_BLOCK ITERS
 *               LARGE_ID LARGE_BYTES LARGE_ITERS
 *
 * Prints one line per measurement: "<name> <p50 us> <p99 us>" for the
 * 4 KiB pulls (sync: llmdd_pull_kv_cache; posted: _async + request_wait +
 * free; posted_fd: _async with LLMDD_XFER_COMPLETION, poll() on
 * llmdd_completion_fd, llmdd_get_completions, wait(0), free) and
 * "large <GB/s median> <GB/s best>" for the synchronous large pull.
 */
#include <llmdd/llmdd.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

static int64_t
now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

static int
cmp64(const void *a, const void *b)
{
    int64_t x = *(const int64_t *)a, y = *(const int64_t *)b;
    return (x > y) - (x < y);
}

static void
report(const char *name, int64_t *lat, int n)
{
    qsort(lat, (size_t)n, sizeof(*lat), cmp64);
    printf("%s %.2f %.2f\n", name, lat[n / 2] / 1e3, lat[n * 99 / 100] / 1e3);
}

/* One tensor of slots x block bytes; *a holds its address. */
static int
reg(llmdd *dd, uint64_t slots, uint64_t block, uint64_t *a, llmdd_cache *c)
{
    size_t bytes = slots * block;
    uint8_t *m = aligned_alloc(4096, bytes);
    if (m == NULL)
        return -1;
    memset(m, 1, bytes);
    *a = (uint64_t)(uintptr_t)m;
    c->desc = (llmdd_cache_desc){.num_tensors = 1,
                                 .data_type = LLMDD_DT_UINT8,
                                 .num_dims = 2,
                                 .shape = {(int64_t)slots, (int64_t)block}};
    c->tensor_addrs = a;
    return llmdd_register_kv_cache(dd, &c->desc, a, 1, &c->cache_id) ? -1 : 0;
}

/* One posted pull, waited for: by llmdd_request_wait, or on the fd. */
static int
posted(llmdd *dd, const llmdd_cache_index *src, const llmdd_cache *c,
       bool fd_wait)
{
    llmdd_xfer_opts o = {.flags = LLMDD_XFER_COMPLETION};
    llmdd_request *r, *got;
    size_t n = 0;

    if (llmdd_pull_kv_cache_async(dd, src, c, src->batch_index, -1, NULL,
                                  fd_wait ? &o : NULL, &r))
        return -1;
    if (fd_wait) {
        struct pollfd p = {.fd = llmdd_completion_fd(dd), .events = POLLIN};
        while (n == 0) {
            if (poll(&p, 1, -1) < 0 ||
                llmdd_get_completions(dd, &got, 1, &n) != LLM_SUCCESS)
                return -1;
        }
        if (got != r)
            return -1;
    }
    llmdd_status st = llmdd_request_wait(r, fd_wait ? 0 : -1);
    llmdd_request_free(r);
    return st == LLM_SUCCESS ? 0 : -1;
}

int
main(int argc, char **argv)
{
    if (argc != 10) {
        fprintf(stderr, "usage: bench_calls PORT TRANSPORT SMALL_ID "
                        "SMALL_SLOTS SMALL_BLOCK ITERS LARGE_ID LARGE_BYTES "
                        "LARGE_ITERS\n");
        return 2;
    }
    uint64_t slots = strtoull(argv[4], NULL, 10);
    uint64_t block = strtoull(argv[5], NULL, 10);
    int iters = atoi(argv[6]);
    uint64_t large = strtoull(argv[8], NULL, 10);
    int liters = atoi(argv[9]);
    llmdd *dd;
    llmdd_option o[] = {{"llm.Transport", argv[2]},
                        {"llm.SyncKvCacheWaitTime", "30000"}};
    if (llmdd_create(3, LLMDD_ROLE_DECODER, &dd) || llmdd_initialize(dd, o, 2))
        return 1;
    llmdd_cache sc, lc;
    uint64_t addrs[2];
    if (reg(dd, slots, block, &addrs[0], &sc) ||
        reg(dd, 1, large, &addrs[1], &lc))
        return 1;
    llmdd_ip_info ip = {"127.0.0.1", (uint16_t)atoi(argv[1])};
    llmdd_cluster_info ci = {.remote_cluster_id = 1,
                             .remote_ip_infos = &ip,
                             .num_remote_ip_infos = 1};
    llmdd_status rets[1];
    if (llmdd_link_clusters(dd, &ci, 1, rets, 5000)) {
        fprintf(stderr, "bench_calls: link failed\n");
        return 1;
    }
    llmdd_cache_index src = {1, atoll(argv[3]), 0};
    llmdd_cache_index lsrc = {1, atoll(argv[7]), 0};
    int64_t *lat = calloc((size_t)iters, sizeof(*lat));
    const char *names[] = {"sync", "posted", "posted_fd"};
    for (int mode = 0; mode < 3; mode++) {
        for (int i = -iters / 10; i < iters; i++) {
            src.batch_index = (uint32_t)((unsigned)(i + iters) % slots);
            int64_t t = now_ns();
            int rc = mode == 0 ? (llmdd_pull_kv_cache(dd, &src, &sc,
                                                      src.batch_index, -1,
                                                      NULL) != LLM_SUCCESS
                                      ? -1
                                      : 0)
                               : posted(dd, &src, &sc, mode == 2);
            if (rc != 0) {
                fprintf(stderr, "bench_calls: %s pull %d failed\n", names[mode], i);
                return 1;
            }
            if (i >= 0)
                lat[i] = now_ns() - t;
        }
        report(names[mode], lat, iters);
    }
    int64_t *gb = calloc((size_t)liters + 1, sizeof(*gb));
    for (int i = -1; i < liters; i++) {
        int64_t t = now_ns();
        llmdd_status st = llmdd_pull_kv_cache(dd, &lsrc, &lc, 0, -1, NULL);
        if (st != LLM_SUCCESS) {
            fprintf(stderr, "bench_calls: large pull: %s\n", llmdd_status_str(st));
            return 1;
        }
        if (i >= 0)
            gb[i] = now_ns() - t;
    }
    qsort(gb, (size_t)liters, sizeof(*gb), cmp64);
    printf("large %.3f %.3f\n", (double)large / (double)gb[liters / 2],
           (double)large / (double)gb[0]);
    llmdd_destroy(dd);
    return 0;
}
