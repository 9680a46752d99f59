/*
 * The C side of bench_overhead.py: the same async pull of 64 blocks the
 * Python side makes (llmdd_pull_kv_blocks_async + llmdd_request_wait +
 * llmdd_request_free), against the same prompt process.
 *   bench_async PORT CACHE_ID NSLOTS BLOCK TRANSPORT ITERS SRC0,SRC1,... DST0,...
 * Prints the p50 and p99 per call in microseconds.
 */
#include <llmdd/llmdd.h>
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

static size_t
parse_list(char *s, uint64_t *out, size_t cap)
{
    size_t n = 0;
    for (char *t = strtok(s, ","); t != NULL && n < cap; t = strtok(NULL, ","))
        out[n++] = strtoull(t, NULL, 10);
    return n;
}

int
main(int argc, char **argv)
{
    if (argc != 9) {
        fprintf(stderr, "usage: bench_async PORT CACHE_ID NSLOTS BLOCK TRANSPORT "
                        "ITERS SRC DST\n");
        return 2;
    }
    uint64_t sb[64], db[64];
    size_t n = parse_list(argv[7], sb, 64);
    if (parse_list(argv[8], db, 64) != n || n == 0)
        return 2;
    int iters = atoi(argv[6]);
    llmdd *dd;
    llmdd_option o = {"llm.Transport", argv[5]};
    if (llmdd_create(3, LLMDD_ROLE_DECODER, &dd) || llmdd_initialize(dd, &o, 1))
        return 1;
    llmdd_cache_desc d = {.num_tensors = 1, .data_type = LLMDD_DT_UINT8, .num_dims = 2,
                          .shape = {atoll(argv[3]), atoll(argv[4])}};
    llmdd_cache c;
    llmdd_ip_info ip = {"127.0.0.1", (uint16_t)atoi(argv[1])};
    llmdd_cluster_info ci = {.remote_cluster_id = 1, .remote_ip_infos = &ip,
                             .num_remote_ip_infos = 1};
    llmdd_status rets[1];
    if (llmdd_allocate_cache(dd, &d, &c) || llmdd_link_clusters(dd, &ci, 1, rets, 5000))
        return 1;
    llmdd_cache_index src = {1, atoll(argv[2]), 0};
    llmdd_kv_ext_param ext = {{-1, -1}, {-1, -1}, 1};
    int64_t *lat = calloc((size_t)iters, sizeof(*lat));
    for (int i = -2000; i < iters; i++) {
        int64_t t = now_ns();
        llmdd_request *r;
        if (llmdd_pull_kv_blocks_async(dd, &src, &c, sb, db, n, &ext, NULL, &r))
            return 1;
        llmdd_status st = llmdd_request_wait(r, -1);
        llmdd_request_free(r);
        if (st != LLM_SUCCESS)
            return 1;
        if (i >= 0)
            lat[i] = now_ns() - t;
    }
    qsort(lat, (size_t)iters, sizeof(*lat), cmp64);
    printf("%.1f %.1f\n", lat[iters / 2] / 1e3, lat[iters * 99 / 100] / 1e3);
    llmdd_destroy(dd);
    return 0;
}
