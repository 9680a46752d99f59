/*
 * llmdd bench: a sweep in the style of nixlbench and tebench. One prompt
 * node and N decoder nodes (processes; threads for the loop transport) move
 * blocks of each size in turn; every row reports GB/s, p50/p99 latency per
 * call and the ratio to a baseline measured in the same run: a single
 * thread's memcpy for same-host transports, one raw TCP loopback connection
 * between two processes for tcp.
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

#include "common.h"

#define BENCH_MAX_DECODERS 64
#define BENCH_MAX_ITERS 100000u
#define BENCH_MAX_BLOCKS (1u << 20)
#define BENCH_MAX_SLOTS (1u << 20)
#define BENCH_PROMPT_ID 1
#define BENCH_AUTO_CALLS 100000u /* at most, per decoder and row */
#define BENCH_AUTO_MIN_CALLS 5
#define BENCH_MIN_TIME_MS 200
#define BENCH_WARMUP_MAX 20000u
#define BENCH_POOL_SHIFT 16
#define BENCH_MAX_INFLIGHT 1024

enum { BOP_PULL, BOP_PUSH, BOP_PULL_BLOCKS, BOP_LINK, BOP_LAYERWISE, BOP_N };
static const char *const bench_ops[] = {"pull", "push", "pull-blocks", "link",
                                        "layerwise"};

enum { BASE_AUTO, BASE_MEMCPY, BASE_TCP, BASE_NONE };
static const char *const bench_bases[] = {"auto", "memcpy", "tcp", "none"};

typedef struct {
    int op;
    cli_lib_opts lo;
    uint64_t bmin, bmax;
    uint32_t blocks;
    uint32_t inflight; /* pull-blocks: posted requests; 0: synchronous */
    uint32_t num_layers;
    int64_t compute_ns; /* layerwise: per layer; -1: one layer's push */
    bool block_set, transport_set, num_layers_set;
    uint32_t decoders;
    uint32_t iters, warmup; /* iters 0: auto, by time */
    bool warmup_set;
    uint32_t min_time_ms;
    bool no_pool;
    uint64_t pool_bytes; /* per node: the largest row's cache */
    uint64_t total;
    bool reg;
    int baseline;
    const char *json, *csv, *plot;
    bool progress;
    int timeout_ms;
    char command[1024];
} bench_cfg;

enum {
    BC_LINK = 1,
    BC_SETUP,
    BC_RUN,
    BC_PUSH_RUN,
    BC_LINKBENCH,
    BC_LAYERWISE,
    BC_REPLY
};

/* --op layerwise: the samples of one round, in this order. */
enum {
    LW_PUSH,    /* the push alone */
    LW_SEQ,     /* (a) */
    LW_LAYERED, /* (b) */
    LW_COMPUTE, /* (b): the sleeps, as they took */
    LW_TAIL,    /* (b): from the last mark to the end of the wait */
    LW_MARKS,   /* (b): inside llmdd_request_layer_ready, all layers */
    LW_PREEMPT, /* (b): involuntary context switches in those calls */
    LW_LAYER,   /* one layer pushed alone */
    LW_N
};

/* One row's layout: `tensors` tensors of u8 [nslots, block]. */
typedef struct {
    uint32_t op;
    uint32_t tensors;
    uint64_t block;
    uint64_t nslots;        /* slots, or blocks for pull-blocks; 0: free only */
    uint32_t per_call;      /* pull-blocks: blocks per call */
    uint32_t inflight;      /* pull-blocks: posted requests kept in flight */
    uint32_t num_layers;    /* layerwise: 2 tensors (K, V) each */
    int64_t compute_ns;     /* layerwise: per layer; < 0: one layer's push */
    uint32_t iters, warmup; /* iters: at most, with min_ns */
    int64_t min_ns;         /* > 0: stop once this long and 5 calls done */
    uint16_t port;
    uint32_t ndec;
    int64_t remote_cache;                  /* pull: the prompt's cache */
    int64_t dec_cache[BENCH_MAX_DECODERS]; /* push: each decoder's cache */
} bench_cmd;

typedef struct {
    uint32_t status;
    int64_t cache_id;
    uint16_t port;
    int64_t t0, t1; /* the timed calls, CLOCK_MONOTONIC */
    uint64_t bytes;
    uint64_t calls;
    int64_t post_ns;    /* --inflight: p50 of the post calls alone */
    int64_t compute_ns; /* layerwise: the compute per layer it simulated */
    uint64_t nsamples;  /* int64 nanoseconds follow */
    char err[768];
} bench_reply;

typedef struct {
    const bench_cfg *cfg;
    bool prompt;
    uint32_t index;
} bench_role;

typedef struct {
    const bench_cfg *cfg;
    bool prompt;
    uint64_t cluster;
    llmdd *dd;
    llmdd_cache cache;
    bool have_cache;
    uint64_t *reg_addrs; /* --register: our buffers */
} bench_node;

static const char bench_usage[] =
    "Usage: llmdd bench [options]\n"
    "\n"
    "A sweep over block sizes (powers of two): one prompt and N decoder\n"
    "processes (threads for --transport loop) move blocks of each size.\n"
    "Each row: block size, blocks per call, GB/s (decimal, aggregate over\n"
    "decoders), p50/p99 latency per call, blocks/s, and the ratio to a\n"
    "baseline measured in the same run: one thread's memcpy of the same\n"
    "bytes (loop, shm, ucx), or one raw TCP loopback connection between two\n"
    "processes moving the same bytes per request into a preallocated buffer\n"
    "(tcp; auto when shm and ucx are not built in). Next to memcpy, the\n"
    "best copy: the faster of memcpy and a copy with non-temporal stores\n"
    "of the same bytes, and the ratio to it (vs best).\n"
    "\n"
    "Options:\n"
    "      --op OP             pull (default): llmdd_pull_kv_cache of one\n"
    "                          batch slot of --blocks tensors;\n"
    "                          push: llmdd_push_kv_cache, the same from the\n"
    "                          prompt; pull-blocks: llmdd_pull_kv_blocks of\n"
    "                          --blocks scattered blocks of one tensor;\n"
    "                          link: link + unlink setup times;\n"
    "                          layerwise: compute-then-push against a\n"
    "                          layer-wise push (see below)\n"
    "  -t, --transport NAME    auto (default), loop, shm, tcp, ucx\n"
    "      --block-size MIN:MAX  block sizes, powers of two, e.g. 4K:16M or\n"
    "                          one size (default 4K:16M)\n"
    "      --blocks N          blocks per call (default 1; 64 for\n"
    "                          pull-blocks)\n"
    "      --inflight N        pull-blocks: keep N requests posted with\n"
    "                          llmdd_pull_kv_blocks_async in flight per\n"
    "                          decoder (1..1024); each row also prints the\n"
    "                          post call's own cost per block\n"
    "      --decoders N        concurrent decoder processes (default 1);\n"
    "                          push runs one prompt thread per decoder\n"
    "      --iters N           timed calls per decoder and row (default:\n"
    "                          as many as fit in --min-time, at least 5;\n"
    "                          100 for link)\n"
    "      --min-time MS       without --iters, time each row (and its\n"
    "                          baseline) for at least this long (default\n"
    "                          200)\n"
    "      --warmup N          untimed calls first (default: one pass over\n"
    "                          the cache and at least 16 MiB, 1..20000\n"
    "                          calls; iters/10 for link)\n"
    "      --total-size SIZE   memory of each cache per row (default 64M);\n"
    "                          calls cycle through the slots that fit, and a\n"
    "                          cache holds at least one call's worth\n"
    "      --register          the prompt registers malloc'd memory\n"
    "                          (llmdd_register_kv_cache) instead of\n"
    "                          llmdd_allocate_cache\n"
    "      --no-pool           allocate each row's caches on their own;\n"
    "                          by default they come from a host pool\n"
    "                          (llm.HostMemPoolConfig) sized for the largest\n"
    "                          row, so rows reuse memory already faulted in\n"
    "      --baseline KIND     auto (default), memcpy, tcp, none\n"
    "      --json FILE         write the results as JSON\n"
    "      --csv FILE          write the results as CSV\n"
    "      --plot FILE.png     draw GB/s and latency over block size with\n"
    "                          gnuplot (`sh scripts/deps.sh` installs it)\n"
    "      --no-progress       no progress bar (it shows only on a TTY)\n"
    "      --timeout MS        link timeout (default 5000)\n"
    "      --lanes N           tcp: llm.TcpLanes, auto or 1..16 data\n"
    "                          connections a transfer of 4 MiB or more is\n"
    "                          striped over (-o llm.TcpLanes=N)\n"
    "  -o, --option K=V        extra llmdd option for every instance\n"
    "  -h, --help              this text\n"
    "\n"
    "--op layerwise (tcp unless -t; one decoder; one row per block size,\n"
    "default 1M, a layer being the K and V tensors of one slot): each round\n"
    "times the prompt's llmdd_push_kv_cache of a slot alone, (a) every\n"
    "layer's compute and then that push, and (b) a push posted with\n"
    "LLMDD_XFER_LAYERWISE before the compute, each layer marked with\n"
    "llmdd_request_layer_ready after its compute, then waited for. Prints\n"
    "the medians, (b)/(a) and (b) / (max(compute, push) + push/layers).\n"
    "      --num-layers N      layers (default 32)\n"
    "      --compute-us N      compute per layer, simulated by sleeping\n"
    "                          (default: one layer's push, measured)\n"
    "      --iters N           rounds (default: as many as fit in\n"
    "                          --min-time, at least 5)\n"
    "\n"
    "Examples:\n"
    "  llmdd bench --transport tcp --block-size 4K:64M --plot bench.png\n"
    "  llmdd bench --op pull --block-size 1G --blocks 1 --transport tcp\n"
    "  llmdd bench --op pull-blocks --block-size 16K --blocks 4096\n"
    "  llmdd bench --op pull-blocks -t tcp --block-size 64K --inflight 64\n"
    "  llmdd bench --op link --iters 200\n"
    "  llmdd bench --op layerwise --num-layers 32 --iters 10\n";

/* ---- Node side. ---- */

static void bench_fail(bench_reply *r, llmdd_status st, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

static void
bench_fail(bench_reply *r, llmdd_status st, const char *fmt, ...)
{
    char what[256];
    va_list ap;

    va_start(ap, fmt);
    vsnprintf(what, sizeof(what), fmt, ap);
    va_end(ap);
    r->status = st;
    cli_fmt_st(r->err, sizeof(r->err), st, "%s", what);
}

static void
bench_free_cache(bench_node *n)
{
    if (!n->have_cache)
        return;
    if (n->reg_addrs != NULL) {
        llmdd_unregister_kv_cache(n->dd, n->cache.cache_id);
        for (uint32_t t = 0; t < n->cache.desc.num_tensors; t++)
            free((void *)(uintptr_t)n->reg_addrs[t]);
        free(n->reg_addrs);
        n->reg_addrs = NULL;
    } else {
        llmdd_deallocate_cache(n->dd, n->cache.cache_id);
    }
    n->have_cache = false;
}

static void
bench_setup(bench_node *n, const bench_cmd *c, bench_reply *r)
{
    llmdd_cache_desc d = {.num_tensors = c->tensors,
                          .data_type = LLMDD_DT_UINT8,
                          .num_dims = 2,
                          .shape = {(int64_t)c->nslots, (int64_t)c->block}};
    uint64_t size = c->nslots * c->block;
    llmdd_status st;

    bench_free_cache(n);
    if (c->nslots == 0)
        return;
    if (n->prompt && n->cfg->reg) {
        n->reg_addrs = calloc(c->tensors, sizeof(*n->reg_addrs));
        if (n->reg_addrs == NULL) {
            bench_fail(r, LLM_OUT_OF_MEMORY, "calloc");
            return;
        }
        for (uint32_t t = 0; t < c->tensors; t++) {
            void *p = NULL;
            if (posix_memalign(&p, 4096, size) != 0) {
                bench_fail(r, LLM_OUT_OF_MEMORY, "posix_memalign(%" PRIu64 ")",
                           size);
                goto err_reg;
            }
            n->reg_addrs[t] = (uint64_t)(uintptr_t)p;
        }
        int64_t id;
        st = llmdd_register_kv_cache(n->dd, &d, n->reg_addrs, c->tensors, &id);
        if (st != LLM_SUCCESS) {
            bench_fail(r, st, "llmdd_register_kv_cache");
            goto err_reg;
        }
        n->cache.cache_id = id;
        n->cache.desc = d;
        n->cache.tensor_addrs = n->reg_addrs;
    } else {
        st = llmdd_allocate_cache(n->dd, &d, &n->cache);
        if (st != LLM_SUCCESS) {
            bench_fail(r, st,
                       "llmdd_allocate_cache(%" PRIu32 " x %" PRIu64 " bytes)",
                       c->tensors, size);
            return;
        }
    }
    n->have_cache = true;
    /* Fault every page in now, not during the timed calls. */
    for (uint32_t t = 0; t < c->tensors; t++)
        memset((void *)(uintptr_t)n->cache.tensor_addrs[t],
               n->prompt ? 0x5a : 0, size);
    r->cache_id = n->cache.cache_id;
    return;
err_reg:
    for (uint32_t t = 0; t < c->tensors; t++)
        free((void *)(uintptr_t)n->reg_addrs[t]);
    free(n->reg_addrs);
    n->reg_addrs = NULL;
}

/*
 * Whether a timed loop is done after `timed` calls that began at t0: a fixed
 * --iters count, or (auto) at least min_ns and BENCH_AUTO_MIN_CALLS calls,
 * so a row is not decided by one scheduler hiccup on a busy machine.
 */
static bool
bench_done(const bench_cmd *c, uint64_t timed, int64_t t0)
{
    if (timed >= c->iters)
        return true;
    return c->min_ns > 0 && timed >= BENCH_AUTO_MIN_CALLS &&
           cli_now_ns() - t0 >= c->min_ns;
}

/* One decoder's (or one push thread's) timed loop. */
typedef struct {
    llmdd *dd;
    const bench_cmd *c;
    const llmdd_cache *local;
    uint64_t peer;
    int64_t remote;
    const uint64_t *src, *dst;
    int64_t *samples;
    bench_reply r;
} bench_job;

static int bench_cmp_i64(const void *a, const void *b);

/*
 * --inflight: c->inflight posted pulls at once; the oldest is waited for and
 * replaced as soon as it completes. The timed window runs from the
 * completion of the last warm-up request to the last completion; a sample is
 * one request, from its post to the return of its wait. Requests in flight
 * write disjoint blocks while the cache has room for them all.
 */
static void
bench_job_posted(bench_job *j)
{
    const bench_cmd *c = j->c;
    uint32_t n = c->inflight;
    llmdd_request **ring = calloc(n, sizeof(*ring));
    int64_t *posted_at = calloc(n, sizeof(int64_t));
    uint64_t *dst = calloc((size_t)n * c->per_call, sizeof(*dst));
    int64_t *post = calloc((size_t)c->iters + 1, sizeof(int64_t));
    llmdd_cache_index idx = {j->peer, j->remote, 0};
    uint64_t posted = 0, done = 0, timed = 0, nposts = 0;
    bool stop = false;
    llmdd_status st;

    if (ring == NULL || posted_at == NULL || dst == NULL || post == NULL) {
        bench_fail(&j->r, LLM_OUT_OF_MEMORY, "calloc");
        goto out;
    }
    for (size_t k = 0; k < (size_t)n * c->per_call; k++)
        dst[k] = k % c->nslots;
    j->r.t0 = cli_now_ns();
    for (;;) {
        while (!stop && posted - done < n) {
            if (posted >= c->warmup && posted - c->warmup >= c->iters) {
                stop = true;
                break;
            }
            uint32_t r = (uint32_t)(posted % n);
            int64_t t = cli_now_ns();
            st = llmdd_pull_kv_blocks_async(j->dd, &idx, j->local, j->src,
                                            dst + (size_t)r * c->per_call,
                                            c->per_call, NULL, NULL, &ring[r]);
            int64_t t1 = cli_now_ns();
            if (st != LLM_SUCCESS) {
                ring[r] = NULL;
                bench_fail(&j->r, st,
                           "llmdd_pull_kv_blocks_async (request %" PRIu64
                           ", cluster %" PRIu64 ")",
                           posted + 1, j->peer);
                goto out;
            }
            posted_at[r] = t;
            if (posted >= c->warmup)
                post[nposts++] = t1 - t;
            posted++;
        }
        if (done == posted)
            break;
        uint32_t r = (uint32_t)(done % n);
        st = llmdd_request_wait(ring[r], -1);
        int64_t now = cli_now_ns();
        llmdd_request_free(ring[r]);
        ring[r] = NULL;
        if (st != LLM_SUCCESS) {
            bench_fail(&j->r, st,
                       "llmdd_request_wait (request %" PRIu64
                       ", cluster %" PRIu64 ")",
                       done + 1, j->peer);
            goto out;
        }
        if (done >= c->warmup)
            j->samples[timed++] = now - posted_at[r];
        done++;
        if (done == c->warmup)
            j->r.t0 = now;
        if (timed > 0 && bench_done(c, timed, j->r.t0))
            stop = true;
    }
    j->r.t1 = cli_now_ns();
    j->r.calls = timed;
    j->r.bytes = c->block * c->per_call * c->tensors * timed;
    j->r.nsamples = timed;
    qsort(post, nposts, sizeof(*post), bench_cmp_i64);
    j->r.post_ns = nposts > 0 ? post[(nposts - 1) / 2] : 0;
out:
    for (uint32_t i = 0; ring != NULL && i < n; i++)
        llmdd_request_free(ring[i]); /* after a failure: cancels */
    free(ring);
    free(posted_at);
    free(dst);
    free(post);
}

static void *
bench_job_run(void *p)
{
    bench_job *j = p;
    const bench_cmd *c = j->c;
    uint64_t timed = 0;
    uint64_t per_call = c->op == BOP_PULL_BLOCKS
                            ? c->block * c->per_call * c->tensors
                            : c->block * c->tensors;

    if (c->op == BOP_PULL_BLOCKS && c->inflight > 0) {
        bench_job_posted(j);
        return NULL;
    }
    for (uint64_t i = 0;; i++) {
        if (i >= c->warmup && bench_done(c, i - c->warmup, j->r.t0))
            break;
        uint32_t slot = (uint32_t)(i % c->nslots);
        llmdd_cache_index idx = {j->peer, j->remote, slot};
        llmdd_status st;
        int64_t t = cli_now_ns();

        if (c->op == BOP_PULL) {
            st = llmdd_pull_kv_cache(j->dd, &idx, j->local, slot, -1, NULL);
        } else if (c->op == BOP_PUSH) {
            st = llmdd_push_kv_cache(j->dd, j->local, &idx, slot, -1, NULL);
        } else {
            idx.batch_index = 0;
            st = llmdd_pull_kv_blocks(j->dd, &idx, j->local, j->src, j->dst,
                                      c->per_call, NULL);
        }
        int64_t now = cli_now_ns();
        if (st != LLM_SUCCESS) {
            bench_fail(&j->r, st, "%s (call %" PRIu64 ", cluster %" PRIu64 ")",
                       c->op == BOP_PULL   ? "llmdd_pull_kv_cache"
                       : c->op == BOP_PUSH ? "llmdd_push_kv_cache"
                                           : "llmdd_pull_kv_blocks",
                       i + 1, j->peer);
            return NULL;
        }
        if (i == c->warmup)
            j->r.t0 = t;
        if (i >= c->warmup)
            j->samples[timed++] = now - t;
    }
    j->r.t1 = cli_now_ns();
    j->r.calls = timed;
    j->r.bytes = per_call * timed;
    j->r.nsamples = timed;
    return NULL;
}

static void
bench_reply_send(int fd, bench_reply *r, const int64_t *samples)
{
    if (r->status != LLM_SUCCESS)
        r->nsamples = 0;
    cli_msg_send(fd, BC_REPLY, r, sizeof(*r), samples,
                 r->nsamples * sizeof(int64_t));
}

static void
bench_run(bench_node *n, const bench_cmd *c, int out_fd)
{
    bench_reply r;
    uint32_t njobs = c->op == BOP_PUSH ? c->ndec : 1;
    bench_job *jobs = calloc(njobs, sizeof(*jobs));
    pthread_t *tids = calloc(njobs, sizeof(*tids));
    int64_t *samples = calloc((size_t)njobs * c->iters + 1, sizeof(int64_t));
    uint64_t *src = NULL, *dst = NULL;

    memset(&r, 0, sizeof(r));
    if (jobs == NULL || tids == NULL || samples == NULL) {
        bench_fail(&r, LLM_OUT_OF_MEMORY, "calloc");
        goto out;
    }
    if (!n->have_cache) {
        bench_fail(&r, LLM_KV_CACHE_NOT_EXIST, "run before setup");
        goto out;
    }
    if (c->op == BOP_PULL_BLOCKS) {
        src = calloc(c->per_call, sizeof(*src));
        dst = calloc(c->per_call, sizeof(*dst));
        if (src == NULL || dst == NULL) {
            bench_fail(&r, LLM_OUT_OF_MEMORY, "calloc");
            goto out;
        }
        cli_pick_blocks(c->nslots, c->per_call, src, dst);
    }
    for (uint32_t i = 0; i < njobs; i++) {
        jobs[i] = (bench_job){
            .dd = n->dd,
            .c = c,
            .local = &n->cache,
            .peer = c->op == BOP_PUSH ? 2 + i : BENCH_PROMPT_ID,
            .remote = c->op == BOP_PUSH ? c->dec_cache[i] : c->remote_cache,
            .src = src,
            .dst = dst,
            .samples = samples + (size_t)i * c->iters};
    }
    /* Threads only when several pushes run at once. */
    uint32_t started = 0;
    if (njobs == 1) {
        bench_job_run(&jobs[0]);
    } else {
        for (; started < njobs; started++)
            if (pthread_create(&tids[started], NULL, bench_job_run,
                               &jobs[started]) != 0)
                break;
        for (uint32_t i = 0; i < started; i++)
            pthread_join(tids[i], NULL);
        if (started < njobs) {
            bench_fail(&r, LLM_FAILED, "pthread_create");
            goto out;
        }
    }
    uint64_t nsamples = 0;
    for (uint32_t i = 0; i < njobs; i++) {
        const bench_reply *jr = &jobs[i].r;
        if (jr->status != LLM_SUCCESS) {
            r = *jr;
            goto out;
        }
        /* Each job wrote its own region; close the gaps. */
        memmove(samples + nsamples, jobs[i].samples,
                jr->nsamples * sizeof(int64_t));
        nsamples += jr->nsamples;
        if (i == 0 || jr->t0 < r.t0)
            r.t0 = jr->t0;
        if (i == 0 || jr->t1 > r.t1)
            r.t1 = jr->t1;
        r.bytes += jr->bytes;
        r.calls += jr->calls;
        if (jr->post_ns > r.post_ns)
            r.post_ns = jr->post_ns;
    }
    r.nsamples = nsamples;
out:
    bench_reply_send(out_fd, &r, samples);
    free(src);
    free(dst);
    free(samples);
    free(tids);
    free(jobs);
}

static void
bench_linkbench(bench_node *n, const bench_cmd *c, int out_fd)
{
    bench_reply r;
    uint64_t total = (uint64_t)c->warmup + c->iters;
    int64_t *samples = calloc(2 * (size_t)c->iters + 1, sizeof(int64_t));

    memset(&r, 0, sizeof(r));
    if (samples == NULL) {
        bench_fail(&r, LLM_OUT_OF_MEMORY, "calloc");
        goto out;
    }
    for (uint64_t i = 0; i < total; i++) {
        int64_t t = cli_now_ns();
        if (cli_link(n->dd, BENCH_PROMPT_ID, "127.0.0.1", c->port,
                     n->cfg->timeout_ms, r.err, sizeof(r.err)) != LLM_SUCCESS) {
            r.status = LLM_LINK_FAILED;
            goto out;
        }
        int64_t t1 = cli_now_ns();
        if (cli_unlink(n->dd, BENCH_PROMPT_ID, "127.0.0.1", c->port,
                       n->cfg->timeout_ms, r.err,
                       sizeof(r.err)) != LLM_SUCCESS) {
            r.status = LLM_UNLINK_FAILED;
            goto out;
        }
        int64_t t2 = cli_now_ns();
        if (i == c->warmup)
            r.t0 = t;
        if (i >= c->warmup) {
            samples[i - c->warmup] = t1 - t;
            samples[c->iters + i - c->warmup] = t2 - t1;
        }
    }
    r.t1 = cli_now_ns();
    r.calls = c->iters;
    r.nsamples = 2 * (uint64_t)c->iters;
out:
    bench_reply_send(out_fd, &r, samples);
    free(samples);
}

/*
 * One layer's simulated compute. A sleep, not a busy loop: on a machine with
 * few cores a spinning thread would take a core from the threads moving the
 * previous layer, which a GPU computing the next layer would not.
 */
static void
bench_compute(int64_t ns)
{
    struct timespec ts;

    clock_gettime(CLOCK_MONOTONIC, &ts);
    ts.tv_sec += ns / 1000000000;
    ts.tv_nsec += ns % 1000000000;
    if (ts.tv_nsec >= 1000000000) {
        ts.tv_sec++;
        ts.tv_nsec -= 1000000000;
    }
    while (clock_nanosleep(CLOCK_MONOTONIC, TIMER_ABSTIME, &ts, NULL) == EINTR)
        ;
}

/*
 * A layer-wise push of one slot: posted first, each layer marked ready after
 * its compute (compute_ns; 0: at once), then waited for. out[LW_COMPUTE ..
 * LW_PREEMPT] get where the time went.
 */
static llmdd_status
bench_push_layered(bench_node *n, const bench_cmd *c,
                   const llmdd_cache_index *idx, int64_t compute_ns,
                   int64_t *out)
{
    llmdd_xfer_opts o = {.flags = LLMDD_XFER_LAYERWISE};
    llmdd_request *req;
    int64_t comp = 0, marks = 0;
    struct rusage ru0, ru1;
    long preempt = 0;
    llmdd_status st;

    st = llmdd_push_kv_cache_async(n->dd, &n->cache, idx, idx->batch_index, -1,
                                   NULL, &o, &req);
    if (st != LLM_SUCCESS)
        return st;
    for (uint32_t l = 0; l < c->num_layers; l++) {
        if (compute_ns > 0) {
            int64_t t = cli_now_ns();
            bench_compute(compute_ns);
            comp += cli_now_ns() - t;
        }
        getrusage(RUSAGE_THREAD, &ru0);
        int64_t t = cli_now_ns();
        st = llmdd_request_layer_ready(req, l);
        marks += cli_now_ns() - t;
        getrusage(RUSAGE_THREAD, &ru1);
        preempt += ru1.ru_nivcsw - ru0.ru_nivcsw;
        if (st != LLM_SUCCESS) {
            llmdd_request_free(req);
            return st;
        }
    }
    int64_t t = cli_now_ns();
    st = llmdd_request_wait(req, -1);
    out[LW_TAIL] = cli_now_ns() - t;
    llmdd_request_free(req);
    out[LW_COMPUTE] = comp;
    out[LW_MARKS] = marks;
    out[LW_PREEMPT] = preempt;
    return st;
}

/*
 * --op layerwise, on the prompt. A round measures, on one slot: the push
 * alone (the transfer), (a) every layer's compute and then one synchronous
 * push, and (b) the layer-wise push; (a) and (b) swap places every round so
 * neither always runs second.
 */
static void
bench_layerwise(bench_node *n, const bench_cmd *c, int out_fd)
{
    bench_reply r;
    int64_t *s = calloc((size_t)c->iters * LW_N + 1, sizeof(int64_t));
    int64_t *cal = calloc(BENCH_AUTO_MIN_CALLS, sizeof(int64_t));
    int64_t scratch[LW_N];
    llmdd_status st = LLM_SUCCESS;
    const char *what = "llmdd_push_kv_cache";
    uint64_t round = 0;

    memset(&r, 0, sizeof(r));
    if (s == NULL || cal == NULL) {
        bench_fail(&r, LLM_OUT_OF_MEMORY, "calloc");
        goto out;
    }
    if (!n->have_cache) {
        bench_fail(&r, LLM_KV_CACHE_NOT_EXIST, "run before setup");
        goto out;
    }
    llmdd_cache_index idx = {2, c->dec_cache[0], 0};
    /* Warm-up: both paths, so the workers and their connections exist. */
    for (uint32_t i = 0; i < c->warmup; i++) {
        idx.batch_index = (uint32_t)(i % c->nslots);
        st = llmdd_push_kv_cache(n->dd, &n->cache, &idx, idx.batch_index, -1,
                                 NULL);
        if (st == LLM_SUCCESS) {
            what = "layer-wise push";
            st = bench_push_layered(n, c, &idx, 0, scratch);
        }
        if (st != LLM_SUCCESS)
            goto fail;
        what = "llmdd_push_kv_cache";
    }
    int64_t compute_ns = c->compute_ns;
    if (compute_ns < 0) { /* about one layer's transfer time */
        for (uint32_t i = 0; i < BENCH_AUTO_MIN_CALLS; i++) {
            int64_t t = cli_now_ns();
            st = llmdd_push_kv_cache(n->dd, &n->cache, &idx, idx.batch_index,
                                     -1, NULL);
            if (st != LLM_SUCCESS)
                goto fail;
            cal[i] = cli_now_ns() - t;
        }
        qsort(cal, BENCH_AUTO_MIN_CALLS, sizeof(*cal), bench_cmp_i64);
        compute_ns = cal[BENCH_AUTO_MIN_CALLS / 2] / c->num_layers;
    }
    r.compute_ns = compute_ns;
    r.t0 = cli_now_ns();
    for (;; round++) {
        if (bench_done(c, round, r.t0))
            break;
        int64_t *row = s + round * LW_N;
        idx.batch_index = (uint32_t)(round % c->nslots);
        int64_t t = cli_now_ns();
        what = "llmdd_push_kv_cache";
        st = llmdd_push_kv_cache(n->dd, &n->cache, &idx, idx.batch_index, -1,
                                 NULL);
        row[LW_PUSH] = cli_now_ns() - t;
        for (int k = 0; k < 2 && st == LLM_SUCCESS; k++) {
            t = cli_now_ns();
            if ((k == 0) == (round % 2 == 0)) {
                for (uint32_t l = 0; l < c->num_layers; l++)
                    bench_compute(compute_ns);
                what = "llmdd_push_kv_cache after compute";
                st = llmdd_push_kv_cache(n->dd, &n->cache, &idx,
                                         idx.batch_index, -1, NULL);
                row[LW_SEQ] = cli_now_ns() - t;
            } else {
                what = "layer-wise push";
                st = bench_push_layered(n, c, &idx, compute_ns, row);
                row[LW_LAYERED] = cli_now_ns() - t;
            }
        }
        /* One layer alone, as a whole request: what a layer costs when
         * nothing else moves. */
        llmdd_kv_ext_param one = {{0, 0}, {0, 0}, 2};
        if (st == LLM_SUCCESS) {
            what = "llmdd_push_kv_cache of layer 0";
            t = cli_now_ns();
            st = llmdd_push_kv_cache(n->dd, &n->cache, &idx, idx.batch_index,
                                     -1, &one);
            row[LW_LAYER] = cli_now_ns() - t;
        }
        if (st != LLM_SUCCESS)
            goto fail;
    }
    r.t1 = cli_now_ns();
    r.calls = round;
    r.nsamples = round * LW_N;
    goto out;
fail:
    bench_fail(&r, st, "%s (round %" PRIu64 ")", what, round + 1);
out:
    bench_reply_send(out_fd, &r, s);
    free(cal);
    free(s);
}

static int
bench_node_main(void *arg, int in_fd, int out_fd)
{
    const bench_role *role = arg;
    bench_node n = {.cfg = role->cfg,
                    .prompt = role->prompt,
                    .cluster = role->prompt ? BENCH_PROMPT_ID
                                            : 2 + (uint64_t)role->index};
    bench_reply r;
    uint16_t port = 0;
    cli_lib_opts lo = n.cfg->lo; /* shares the user's strings: no fini */

    /*
     * Caches come from a host pool sized for the largest row: rows then
     * reuse memory whose pages are already faulted in, instead of paying
     * the first write's faults again for every block size.
     */
    if (n.cfg->pool_bytes > 0 && !(n.prompt && n.cfg->reg))
        snprintf(lo.host_pool, sizeof(lo.host_pool),
                 "{\"memory_size\": %" PRIu64 ", \"page_shift\": %d}",
                 n.cfg->pool_bytes, BENCH_POOL_SHIFT);
    memset(&r, 0, sizeof(r));
    r.status = cli_instance(
        n.cluster, n.prompt ? LLMDD_ROLE_PROMPT : LLMDD_ROLE_DECODER, &lo,
        n.prompt ? "127.0.0.1" : NULL, &port, &n.dd, r.err, sizeof(r.err));
    r.port = port;
    if (cli_msg_send(out_fd, BC_REPLY, &r, sizeof(r), NULL, 0) != 0 ||
        r.status != LLM_SUCCESS)
        return CLI_EXIT_FAIL;
    for (;;) {
        uint32_t type;
        void *p;
        size_t len;

        if (cli_msg_recv(in_fd, &type, &p, &len) != 0)
            break;
        const bench_cmd *c = p;
        memset(&r, 0, sizeof(r));
        if (len != sizeof(bench_cmd)) {
            bench_fail(&r, LLM_PARAM_INVALID, "malformed command");
            bench_reply_send(out_fd, &r, NULL);
        } else if (type == BC_LINK) {
            r.status = cli_link(n.dd, BENCH_PROMPT_ID, "127.0.0.1", c->port,
                                n.cfg->timeout_ms, r.err, sizeof(r.err));
            bench_reply_send(out_fd, &r, NULL);
        } else if (type == BC_SETUP) {
            bench_setup(&n, c, &r);
            bench_reply_send(out_fd, &r, NULL);
        } else if (type == BC_RUN || type == BC_PUSH_RUN) {
            bench_run(&n, c, out_fd);
        } else if (type == BC_LINKBENCH) {
            bench_linkbench(&n, c, out_fd);
        } else if (type == BC_LAYERWISE) {
            bench_layerwise(&n, c, out_fd);
        } else {
            bench_fail(&r, LLM_PARAM_INVALID, "unknown command");
            bench_reply_send(out_fd, &r, NULL);
        }
        free(p);
    }
    bench_free_cache(&n);
    llmdd_destroy(n.dd);
    return CLI_EXIT_OK;
}

/* ---- Parent side: progress, statistics, baselines. ---- */

typedef struct {
    bool on;
    size_t done, total;
    int64_t t0;
    char label[64];
} bench_progress;

static void
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

static void
bench_progress_clear(const bench_progress *p)
{
    if (p->on) {
        fputs("\r\033[K", stderr);
        fflush(stderr);
    }
}

/* Receives a node's reply, redrawing the progress bar while it runs. */
static bool
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

static bool
bench_call(cli_node *node, uint32_t type, const bench_cmd *c,
           const bench_progress *prog, bench_reply *r, int64_t **samples)
{
    if (cli_msg_send(node->cmd_fd, type, c, sizeof(*c), NULL, 0) != 0) {
        cli_err("the %s node stopped answering", node->name);
        return false;
    }
    return bench_recv(node, prog, r, samples);
}

static int
bench_cmp_i64(const void *a, const void *b)
{
    int64_t x = *(const int64_t *)a, y = *(const int64_t *)b;
    return (x > y) - (x < y);
}

/* Nearest-rank percentile of sorted samples, in microseconds. */
static double
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

typedef struct {
    uint64_t block;
    uint32_t per_call;
    uint64_t bytes_per_call;
    uint32_t iters, warmup;
    uint64_t calls;
    double gbps, p50, p99, blocks_per_s;
    int base;
    double base_gbps, base_p50, base_p99;
    double ratio;
    /* memcpy baseline: the faster of memcpy and a streamed copy. */
    bool best_nt;
    double best_gbps, ratio_best;
    double unlink_p50, unlink_p99; /* op link */
    uint32_t inflight;             /* pull-blocks --inflight */
    double post_ns;                /* its post cost, per call (p50) */
    /* op layerwise: medians over rounds, in ms, and per-round ratios. */
    uint32_t layers;
    double compute_ms, push_ms, seq_ms, lw_ms, comp_ms, tail_ms, marks_ms;
    double preempt, layer_ms, ideal_ms;
    double ratio_seq, ratio_ideal;
} bench_result;

typedef struct {
    double gbps, p50, p99;
} bench_base_result;

/* The memcpy baseline's buffers, kept across rows: faulting fresh pages in
 * for every row would cost more than the copies. */
typedef struct {
    uint8_t *src, *dst;
    size_t cap;
} bench_bufs;

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

static void
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

/*
 * The memcpy baseline: the same bytes, in the same pattern, one thread,
 * with memcpy or (nt) the streamed copy, fenced once per call.
 */
static bool
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
    int64_t el = cli_now_ns() - t0;
    uint64_t per_call = c->op == BOP_PULL_BLOCKS ? c->block * c->per_call
                                                 : c->block * c->tensors;
    qsort(samples, timed, sizeof(int64_t), bench_cmp_i64);
    out->gbps = cli_gbps(per_call * timed, el);
    out->p50 = bench_pct(samples, timed, 0.50);
    out->p99 = bench_pct(samples, timed, 0.99);
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
    uint64_t bytes;
} bench_tcp_arg;

static void
bench_nodelay(int fd)
{
    int one = 1;
    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
}

/* The raw-TCP sender: answers each one-byte request with `bytes` bytes. */
static int
bench_tcp_sender(void *arg, int in_fd, int out_fd)
{
    const bench_tcp_arg *a = arg;
    struct sockaddr_in sa = {.sin_family = AF_INET,
                             .sin_port = htons(a->port),
                             .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    uint8_t *buf = malloc(a->bytes);
    int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    int rc = CLI_EXIT_FAIL;
    char req;

    (void)in_fd;
    (void)out_fd;
    if (buf == NULL || fd < 0 ||
        connect(fd, (struct sockaddr *)&sa, sizeof(sa)) != 0)
        goto out;
    memset(buf, 0x5a, a->bytes);
    bench_nodelay(fd);
    for (;;) {
        ssize_t k = recv(fd, &req, 1, 0);
        if (k < 0 && errno == EINTR)
            continue;
        if (k <= 0)
            break;
        for (uint64_t off = 0; off < a->bytes;) {
            ssize_t s = send(fd, buf + off, a->bytes - off, MSG_NOSIGNAL);
            if (s < 0 && errno == EINTR)
                continue;
            if (s <= 0)
                goto out;
            off += (uint64_t)s;
        }
    }
    rc = CLI_EXIT_OK;
out:
    if (fd >= 0)
        close(fd);
    free(buf);
    return rc;
}

/*
 * The raw-TCP baseline: per call, this process asks for the bytes of one
 * call with one byte and receives them into a preallocated buffer from a
 * sender process over one loopback connection.
 */
static bool
bench_base_tcp(const bench_cmd *c, uint64_t per_call, bench_base_result *out)
{
    struct sockaddr_in sa = {.sin_family = AF_INET,
                             .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    socklen_t slen = sizeof(sa);
    bench_tcp_arg arg = {.bytes = per_call};
    cli_node sender = {.cmd_fd = -1, .rep_fd = -1};
    int64_t *samples = calloc(c->iters, sizeof(int64_t));
    uint8_t *buf = malloc(per_call);
    int lfd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0), fd = -1;
    uint64_t timed = 0;
    int64_t t0 = 0;
    bool ok = false;

    if (samples == NULL || buf == NULL || lfd < 0 ||
        bind(lfd, (struct sockaddr *)&sa, sizeof(sa)) != 0 ||
        listen(lfd, 1) != 0 ||
        getsockname(lfd, (struct sockaddr *)&sa, &slen) != 0) {
        cli_err("raw TCP baseline: %s", strerror(errno));
        goto out;
    }
    memset(buf, 0xa5, per_call); /* non-zero: see bench_bufs_get */
    arg.port = ntohs(sa.sin_port);
    if (cli_node_start(&sender, "raw TCP sender", false, bench_tcp_sender,
                       &arg) != 0)
        goto out;
    struct pollfd pfd = {.fd = lfd, .events = POLLIN};
    if (poll(&pfd, 1, 10000) != 1 ||
        (fd = accept4(lfd, NULL, NULL, SOCK_CLOEXEC)) < 0) {
        cli_err("raw TCP baseline: the sender did not connect");
        goto out;
    }
    bench_nodelay(fd);
    for (uint64_t i = 0;; i++) {
        if (i >= c->warmup && bench_done(c, i - c->warmup, t0))
            break;
        int64_t t = cli_now_ns();
        char req = 'r';
        if (send(fd, &req, 1, MSG_NOSIGNAL) != 1)
            goto io_err;
        for (uint64_t off = 0; off < per_call;) {
            ssize_t k = recv(fd, buf + off, per_call - off, 0);
            if (k < 0 && errno == EINTR)
                continue;
            if (k <= 0)
                goto io_err;
            off += (uint64_t)k;
        }
        int64_t now = cli_now_ns();
        if (i == c->warmup)
            t0 = t;
        if (i >= c->warmup)
            samples[timed++] = now - t;
    }
    int64_t el = cli_now_ns() - t0;
    qsort(samples, timed, sizeof(int64_t), bench_cmp_i64);
    out->gbps = cli_gbps(per_call * timed, el);
    out->p50 = bench_pct(samples, timed, 0.50);
    out->p99 = bench_pct(samples, timed, 0.99);
    ok = true;
    goto out;
io_err:
    cli_err("raw TCP baseline: the connection failed: %s", strerror(errno));
out:
    if (fd >= 0)
        close(fd); /* the sender sees end of file and exits */
    if (lfd >= 0)
        close(lfd);
    if (cli_node_stop(&sender) != 0)
        ok = false;
    free(buf);
    free(samples);
    return ok;
}

/* ---- Output: table, JSON, CSV, plot. ---- */

static int
bench_base_kind(const bench_cfg *cfg)
{
    if (cfg->baseline != BASE_AUTO)
        return cfg->baseline;
    const char *t = cfg->lo.transport;
    if (strcmp(t, "tcp") == 0)
        return BASE_TCP;
    if (strcmp(t, "auto") == 0 && !cli_transport_built("shm") &&
        !cli_transport_built("ucx"))
        return BASE_TCP; /* auto ends up on tcp between processes */
    return BASE_MEMCPY;
}

static const char *
bench_base_label(int kind)
{
    return kind == BASE_TCP      ? "raw TCP"
           : kind == BASE_MEMCPY ? "memcpy"
                                 : "none";
}

static void
bench_print_header(const bench_cfg *cfg)
{
    if (cfg->op == BOP_LAYERWISE) {
        printf("\n%9s %6s %6s %10s %10s %10s %10s %10s %8s %9s\n", "layer",
               "layers", "rounds", "compute ms", "push ms", "(a) ms", "(b) ms",
               "ideal ms", "(b)/(a)", "(b)/ideal");
        return;
    }
    if (cfg->op == BOP_LINK) {
        printf("\n%8s %10s %12s %12s %12s %12s\n", "decoders", "iters",
               "link p50", "link p99", "unlink p50", "unlink p99");
        return;
    }
    printf("\n%9s %7s %6s %9s %10s %10s %11s | %9s %10s %7s", "block", "blocks",
           "iters", "GB/s", "p50 us", "p99 us", "blocks/s", "base GB/s",
           "base p50", "ratio");
    if (bench_base_kind(cfg) == BASE_MEMCPY)
        printf(" | %9s %7s", "best GB/s", "vs best");
    printf("\n");
}

static void
bench_print_row(const bench_cfg *cfg, const bench_result *r)
{
    char b[32], t1[32], t2[32], t3[32], t4[32];

    if (cfg->op == BOP_LAYERWISE) {
        printf("%9s %6" PRIu32 " %6" PRIu32
               " %10.2f %10.2f %10.2f %10.2f %10.2f %8.2f %9.2f\n",
               cli_fmt_bytes(b, sizeof(b), 2 * r->block), r->layers, r->iters,
               r->comp_ms, r->push_ms, r->seq_ms, r->lw_ms, r->ideal_ms,
               r->ratio_seq, r->ratio_ideal);
        printf("  layerwise: (b)/(a) = %.2f (target <= 0.6: %s); "
               "(b)/ideal = %.2f (target <= 1.1: %s); compute %.0f us/layer"
               "%s; push %.3f GB/s\n",
               r->ratio_seq, r->ratio_seq <= 0.6 ? "met" : "MISSED",
               r->ratio_ideal, r->ratio_ideal <= 1.1 ? "met" : "MISSED",
               r->compute_ms * 1e3,
               cfg->compute_ns < 0 ? " (auto: one layer's push)" : "", r->gbps);
        printf("  where (b) goes: compute %.2f ms, inside "
               "llmdd_request_layer_ready %.2f ms (%.0f involuntary context "
               "switches), last mark to done %.2f ms; one layer alone %.2f "
               "ms, push/layers %.2f ms\n",
               r->comp_ms, r->marks_ms, r->preempt, r->tail_ms, r->layer_ms,
               r->push_ms / r->layers);
        fflush(stdout);
        return;
    }
    if (cfg->op == BOP_LINK) {
        printf("%8" PRIu32 " %10" PRIu32 " %12s %12s %12s %12s\n",
               cfg->decoders, r->iters,
               cli_fmt_ns(t1, sizeof(t1), (int64_t)(r->p50 * 1e3)),
               cli_fmt_ns(t2, sizeof(t2), (int64_t)(r->p99 * 1e3)),
               cli_fmt_ns(t3, sizeof(t3), (int64_t)(r->unlink_p50 * 1e3)),
               cli_fmt_ns(t4, sizeof(t4), (int64_t)(r->unlink_p99 * 1e3)));
        return;
    }
    if (r->base == BASE_NONE)
        printf("%9s %7" PRIu32 " %6" PRIu32 " %9.3f %10.1f %10.1f %11.0f | "
               "%9s %10s %7s\n",
               cli_fmt_bytes(b, sizeof(b), r->block), r->per_call, r->iters,
               r->gbps, r->p50, r->p99, r->blocks_per_s, "-", "-", "-");
    else
        printf("%9s %7" PRIu32 " %6" PRIu32 " %9.3f %10.1f %10.1f %11.0f | "
               "%9.3f %10.1f %7.2f",
               cli_fmt_bytes(b, sizeof(b), r->block), r->per_call, r->iters,
               r->gbps, r->p50, r->p99, r->blocks_per_s, r->base_gbps,
               r->base_p50, r->ratio);
    if (r->base == BASE_MEMCPY)
        printf(" | %9.3f %7.2f  (%s)\n", r->best_gbps, r->ratio_best,
               r->best_nt ? "streamed" : "memcpy");
    else if (r->base != BASE_NONE)
        printf("\n");
    if (r->inflight > 0) {
        char rat[64] = "";
        if (r->base != BASE_NONE)
            snprintf(rat, sizeof(rat), "%.2f x %s GB/s; ", r->ratio,
                     bench_base_label(r->base));
        printf("  %" PRIu32 " in flight: %spost cost: %.0f ns/block "
               "(%" PRIu32 " blocks, p50 %s per post)\n",
               r->inflight, rat, r->post_ns / r->per_call, r->per_call,
               cli_fmt_ns(t1, sizeof(t1), (int64_t)r->post_ns));
    }
    fflush(stdout);
}

static void
bench_iso_date(char *buf, size_t cap)
{
    time_t now = time(NULL);
    struct tm tm;

    gmtime_r(&now, &tm);
    strftime(buf, cap, "%Y-%m-%dT%H:%M:%SZ", &tm);
}

static bool
bench_write_json(const bench_cfg *cfg, const bench_result *rows, size_t n)
{
    cJSON *root = cJSON_CreateObject(), *c, *h, *arr;
    struct utsname u;
    char date[32];
    bool ok = false;

    if (root == NULL)
        goto out;
    bench_iso_date(date, sizeof(date));
    cJSON_AddStringToObject(root, "tool", "llmdd bench");
    cJSON_AddStringToObject(root, "version", llmdd_version());
    cJSON_AddStringToObject(root, "date", date);
    cJSON_AddStringToObject(root, "command", cfg->command);
    h = cJSON_AddObjectToObject(root, "host");
    if (h != NULL) {
        cJSON_AddNumberToObject(h, "cores",
                                (double)sysconf(_SC_NPROCESSORS_ONLN));
        cJSON_AddNumberToObject(h, "memory_bytes",
                                (double)sysconf(_SC_PHYS_PAGES) *
                                    (double)sysconf(_SC_PAGESIZE));
        if (uname(&u) == 0) {
            cJSON_AddStringToObject(h, "sysname", u.sysname);
            cJSON_AddStringToObject(h, "release", u.release);
            cJSON_AddStringToObject(h, "machine", u.machine);
        }
    }
    c = cJSON_AddObjectToObject(root, "config");
    if (c != NULL) {
        cJSON_AddStringToObject(c, "op", bench_ops[cfg->op]);
        cJSON_AddStringToObject(c, "transport", cfg->lo.transport);
        cJSON_AddStringToObject(c, "transports_built", llmdd_transport_list());
        cJSON_AddNumberToObject(c, "decoders", cfg->decoders);
        cJSON_AddNumberToObject(c, "blocks", cfg->blocks);
        cJSON_AddNumberToObject(c, "total_size", (double)cfg->total);
        cJSON_AddBoolToObject(c, "register", cfg->reg);
        cJSON_AddStringToObject(c, "baseline",
                                bench_bases[bench_base_kind(cfg)]);
    }
    arr = cJSON_AddArrayToObject(root, "rows");
    for (size_t i = 0; arr != NULL && i < n; i++) {
        const bench_result *r = &rows[i];
        cJSON *o = cJSON_CreateObject();
        if (o == NULL)
            goto out;
        cJSON_AddItemToArray(arr, o);
        cJSON_AddStringToObject(o, "op", bench_ops[cfg->op]);
        cJSON_AddNumberToObject(o, "iters", r->iters);
        cJSON_AddNumberToObject(o, "warmup", r->warmup);
        if (cfg->op == BOP_LINK) {
            cJSON_AddNumberToObject(o, "decoders", cfg->decoders);
            cJSON_AddNumberToObject(o, "link_p50_us", r->p50);
            cJSON_AddNumberToObject(o, "link_p99_us", r->p99);
            cJSON_AddNumberToObject(o, "unlink_p50_us", r->unlink_p50);
            cJSON_AddNumberToObject(o, "unlink_p99_us", r->unlink_p99);
            continue;
        }
        if (cfg->op == BOP_LAYERWISE) {
            cJSON_AddNumberToObject(o, "layer_bytes", 2.0 * (double)r->block);
            cJSON_AddNumberToObject(o, "layers", r->layers);
            cJSON_AddNumberToObject(o, "rounds", r->iters);
            cJSON_AddNumberToObject(o, "compute_per_layer_ms", r->compute_ms);
            cJSON_AddNumberToObject(o, "compute_ms", r->comp_ms);
            cJSON_AddNumberToObject(o, "push_ms", r->push_ms);
            cJSON_AddNumberToObject(o, "compute_then_push_ms", r->seq_ms);
            cJSON_AddNumberToObject(o, "layerwise_ms", r->lw_ms);
            cJSON_AddNumberToObject(o, "ideal_ms", r->ideal_ms);
            cJSON_AddNumberToObject(o, "layer_ready_ms", r->marks_ms);
            cJSON_AddNumberToObject(o, "layer_ready_preemptions", r->preempt);
            cJSON_AddNumberToObject(o, "last_mark_to_done_ms", r->tail_ms);
            cJSON_AddNumberToObject(o, "one_layer_ms", r->layer_ms);
            cJSON_AddNumberToObject(o, "ratio_layerwise_to_sequential",
                                    r->ratio_seq);
            cJSON_AddNumberToObject(o, "ratio_layerwise_to_ideal",
                                    r->ratio_ideal);
            continue;
        }
        cJSON_AddNumberToObject(o, "block_size", (double)r->block);
        cJSON_AddNumberToObject(o, "blocks", r->per_call);
        cJSON_AddNumberToObject(o, "bytes_per_call", (double)r->bytes_per_call);
        cJSON_AddNumberToObject(o, "calls", (double)r->calls);
        cJSON_AddNumberToObject(o, "gbps", r->gbps);
        cJSON_AddNumberToObject(o, "p50_us", r->p50);
        cJSON_AddNumberToObject(o, "p99_us", r->p99);
        cJSON_AddNumberToObject(o, "blocks_per_s", r->blocks_per_s);
        if (r->inflight > 0) {
            cJSON_AddNumberToObject(o, "inflight", r->inflight);
            cJSON_AddNumberToObject(o, "post_ns", r->post_ns);
            cJSON_AddNumberToObject(o, "post_ns_per_block",
                                    r->post_ns / r->per_call);
        }
        if (r->base != BASE_NONE) {
            cJSON *b = cJSON_AddObjectToObject(o, "baseline");
            if (b != NULL) {
                cJSON_AddStringToObject(b, "kind", bench_bases[r->base]);
                cJSON_AddNumberToObject(b, "gbps", r->base_gbps);
                cJSON_AddNumberToObject(b, "p50_us", r->base_p50);
                cJSON_AddNumberToObject(b, "p99_us", r->base_p99);
            }
            cJSON_AddNumberToObject(o, "ratio", r->ratio);
            if (r->base == BASE_MEMCPY) {
                cJSON *bc = cJSON_AddObjectToObject(o, "best_copy");
                if (bc != NULL) {
                    cJSON_AddStringToObject(bc, "kind",
                                            r->best_nt ? "streamed" : "memcpy");
                    cJSON_AddNumberToObject(bc, "gbps", r->best_gbps);
                }
                cJSON_AddNumberToObject(o, "ratio_best", r->ratio_best);
            }
        }
    }
    char *text = cJSON_Print(root);
    if (text == NULL)
        goto out;
    FILE *f = fopen(cfg->json, "w");
    if (f != NULL) {
        ok = fputs(text, f) >= 0 && fputc('\n', f) != EOF;
        ok = fclose(f) == 0 && ok;
    }
    free(text);
out:
    cJSON_Delete(root);
    if (!ok)
        cli_err("cannot write %s: %s", cfg->json, strerror(errno));
    return ok;
}

static bool
bench_write_csv(const bench_cfg *cfg, const bench_result *rows, size_t n)
{
    FILE *f = fopen(cfg->csv, "w");
    bool ok;

    if (f == NULL) {
        cli_err("cannot write %s: %s", cfg->csv, strerror(errno));
        return false;
    }
    if (cfg->op == BOP_LINK) {
        fprintf(f, "op,decoders,iters,link_p50_us,link_p99_us,unlink_p50_us,"
                   "unlink_p99_us\n");
        for (size_t i = 0; i < n; i++)
            fprintf(f, "link,%" PRIu32 ",%" PRIu32 ",%.3f,%.3f,%.3f,%.3f\n",
                    cfg->decoders, rows[i].iters, rows[i].p50, rows[i].p99,
                    rows[i].unlink_p50, rows[i].unlink_p99);
    } else {
        fprintf(f, "op,transport,decoders,block_size,blocks,bytes_per_call,"
                   "iters,gbps,p50_us,p99_us,blocks_per_s,baseline,"
                   "baseline_gbps,baseline_p50_us,ratio,best_copy_gbps,"
                   "ratio_best\n");
        for (size_t i = 0; i < n; i++) {
            const bench_result *r = &rows[i];
            fprintf(
                f,
                "%s,%s,%" PRIu32 ",%" PRIu64 ",%" PRIu32 ",%" PRIu64 ",%" PRIu32
                ",%.4f,%.3f,%.3f,%.1f,%s,%.4f,%.3f,%.4f,%.4f,%.4f\n",
                bench_ops[cfg->op], cfg->lo.transport, cfg->decoders, r->block,
                r->per_call, r->bytes_per_call, r->iters, r->gbps, r->p50,
                r->p99, r->blocks_per_s, bench_bases[r->base], r->base_gbps,
                r->base_p50, r->ratio, r->best_gbps, r->ratio_best);
        }
    }
    ok = !ferror(f);
    ok = fclose(f) == 0 && ok;
    if (!ok)
        cli_err("cannot write %s: %s", cfg->csv, strerror(errno));
    return ok;
}

static bool
bench_have_gnuplot(void)
{
    const char *path = getenv("PATH");
    char dir[4096];

    if (path == NULL)
        path = "/usr/bin:/bin";
    while (*path != '\0') {
        const char *end = strchr(path, ':');
        size_t n = end != NULL ? (size_t)(end - path) : strlen(path);
        if (n > 0 && n < sizeof(dir) - 16) {
            memcpy(dir, path, n);
            strcpy(dir + n, "/gnuplot");
            if (access(dir, X_OK) == 0)
                return true;
        }
        path += n;
        if (*path == ':')
            path++;
    }
    return false;
}

/* A gnuplot single-quoted string: a quote is written twice. */
static void
bench_gp_str(FILE *f, const char *s)
{
    fputc('\'', f);
    for (; *s != '\0'; s++) {
        if (*s == '\'')
            fputc('\'', f);
        fputc(*s, f);
    }
    fputc('\'', f);
}

static bool
bench_plot(const bench_cfg *cfg, const bench_result *rows, size_t n)
{
    char title[256], date[32];
    FILE *gp;

    if (!bench_have_gnuplot()) {
        cli_err("--plot: gnuplot is not installed (`sh scripts/deps.sh` "
                "installs gnuplot-nox); the tables above are complete");
        return false;
    }
    fflush(NULL);
    gp = popen("gnuplot", "w");
    if (gp == NULL) {
        cli_err("--plot: cannot run gnuplot: %s", strerror(errno));
        return false;
    }
    bench_iso_date(date, sizeof(date));
    date[10] = '\0';
    int base = n > 0 ? rows[0].base : BASE_NONE;
    snprintf(title, sizeof(title),
             "llmdd bench --op %s, transport %s, %" PRIu32
             " block(s)/call, %" PRIu32 " decoder(s), %ld cores, %s",
             bench_ops[cfg->op], cfg->lo.transport,
             n > 0 ? rows[0].per_call : 0, cfg->decoders,
             sysconf(_SC_NPROCESSORS_ONLN), date);
    fputs("if (strstrt(GPVAL_TERMINALS, 'pngcairo') > 0) {\n"
          "  set terminal pngcairo size 960,600 font 'Sans,10'\n"
          "} else {\n"
          "  set terminal png size 960,600\n"
          "}\n",
          gp);
    fputs("set output ", gp);
    bench_gp_str(gp, cfg->plot);
    fputs("\nset title ", gp);
    bench_gp_str(gp, title);
    /* Tick labels from the rows themselves: 4K, 64K, 1M, ... */
    fputs("\nset xtics (", gp);
    size_t every = n > 12 ? 2 : 1;
    for (size_t i = 0; i < n; i += every) {
        uint64_t b = rows[i].block;
        const char *u = "";
        while (b >= 1024 && b % 1024 == 0 && *u != 'G') {
            b /= 1024;
            u = *u == '\0' ? "K" : *u == 'K' ? "M" : "G";
        }
        fprintf(gp, "%s'%" PRIu64 "%s' %" PRIu64, i > 0 ? ", " : "", b, u,
                rows[i].block);
    }
    fputs(")\nset logscale x 2\n"
          "set xlabel 'block size (bytes)'\n"
          "set ylabel 'throughput, GB/s (10^9 bytes/s)'\n"
          "set y2label 'p50 latency per call (us)'\n"
          "set logscale y2 10\n"
          "set format y2 '10^{%T}'\n"
          "set ytics nomirror\n"
          "set y2tics\n"
          "set yrange [0:*]\n"
          "set grid xtics ytics\n"
          "set key below horizontal\n"
          "$data << EOD\n",
          gp);
    for (size_t i = 0; i < n; i++)
        fprintf(gp, "%" PRIu64 " %.6f %.6f %.3f %.3f\n", rows[i].block,
                rows[i].gbps, rows[i].base_gbps, rows[i].p50, rows[i].base_p50);
    fprintf(gp,
            "EOD\nplot $data using 1:2 with linespoints lw 2 pt 7 "
            "title 'llmdd %s (%s), GB/s'",
            bench_ops[cfg->op], cfg->lo.transport);
    if (base != BASE_NONE)
        fprintf(gp,
                ", $data using 1:3 with linespoints lw 2 pt 5 dt 2 "
                "title '%s baseline, GB/s'",
                bench_base_label(base));
    fputs(", $data using 1:4 axes x1y2 with linespoints lw 1.5 pt 1 dt 3 "
          "title 'llmdd p50 latency per call (right axis)'\n",
          gp);
    int st = pclose(gp);
    if (st != 0) {
        cli_err("--plot: gnuplot failed (status %d)", st);
        return false;
    }
    return true;
}

/* ---- The sweep. ---- */

/* Builds one row's command for block size `block`. */
static void
bench_row_cmd(const bench_cfg *cfg, uint64_t block, bench_cmd *c)
{
    memset(c, 0, sizeof(*c));
    c->op = (uint32_t)cfg->op;
    c->block = block;
    if (cfg->op == BOP_LAYERWISE) {
        c->tensors = 2 * cfg->num_layers;
        c->per_call = 1;
        c->num_layers = cfg->num_layers;
        c->compute_ns = cfg->compute_ns;
        uint64_t fit = cfg->total / (block * c->tensors);
        c->nslots = fit > 1 ? fit : 1;
    } else if (cfg->op == BOP_PULL_BLOCKS) {
        c->tensors = 1;
        c->per_call = cfg->blocks;
        c->inflight = cfg->inflight;
        uint64_t fit = cfg->total / block;
        c->nslots = fit > cfg->blocks ? fit : cfg->blocks;
    } else {
        c->tensors = cfg->blocks;
        c->per_call = cfg->blocks;
        uint64_t fit = cfg->total / (block * cfg->blocks);
        c->nslots = fit > 1 ? fit : 1;
    }
    if (c->nslots > BENCH_MAX_SLOTS)
        c->nslots = BENCH_MAX_SLOTS;
    uint64_t per_call = block * cfg->blocks;
    c->iters = cfg->iters != 0 ? cfg->iters : BENCH_AUTO_CALLS;
    c->min_ns = cfg->iters != 0 ? 0 : (int64_t)cfg->min_time_ms * 1000000;
    /*
     * Auto warm-up: one pass over every slot (a transport may map or
     * register the peer's memory page by page on first use) and at least
     * 16 MiB, within 1..BENCH_WARMUP_MAX calls.
     */
    uint64_t cover = cfg->op == BOP_PULL_BLOCKS
                         ? (c->nslots + c->per_call - 1) / c->per_call
                         : c->nslots;
    uint64_t w = (16ull << 20) / per_call;
    if (w < cover)
        w = cover;
    if (w < c->inflight) /* a full pipeline before the clock starts */
        w = c->inflight;
    c->warmup = cfg->warmup_set        ? cfg->warmup
                : w < 1                ? 1
                : w > BENCH_WARMUP_MAX ? BENCH_WARMUP_MAX
                                       : (uint32_t)w;
    /* Layer-wise: a warm-up round is a push each way, whole slots. */
    if (cfg->op == BOP_LAYERWISE && !cfg->warmup_set)
        c->warmup = c->nslots < 2    ? 2
                    : c->nslots > 20 ? 20
                                     : (uint32_t)c->nslots;
}

/* Checks the sweep fits in memory; sizes the host pool (pool_bytes). */
static bool
bench_memory_ok(bench_cfg *cfg)
{
    bench_cmd c;
    double worst = 0;

    if (cfg->op == BOP_LINK)
        return true;
    for (uint64_t b = cfg->bmin; b <= cfg->bmax && b != 0; b *= 2) {
        bench_row_cmd(cfg, b, &c);
        double side = (double)c.nslots * (double)c.block * c.tensors;
        /* The pool holds whole pages of every tensor. */
        uint64_t page = 1ull << BENCH_POOL_SHIFT;
        uint64_t pitch = (c.nslots * c.block + page - 1) & ~(page - 1);
        if (!cfg->no_pool && pitch * c.tensors > cfg->pool_bytes)
            cfg->pool_bytes = pitch * c.tensors;
        /* The prompt's and every decoder's cache, and the baseline's
         * two buffers (kept across rows). */
        double need = side * (1 + cfg->decoders) + 2 * side;
        if (need > worst)
            worst = need;
        if (cfg->bmin == cfg->bmax)
            break;
    }
    return cli_memory_fits((uint64_t)worst,
                           "lower --block-size, --blocks, --total-size or "
                           "--decoders");
}

static int
bench_parse(bench_cfg *cfg, int argc, char **argv)
{
    enum {
        OPT_OP = CLI_OPT_FIRST_FREE,
        OPT_BLOCK_SIZE,
        OPT_BLOCKS,
        OPT_DECODERS,
        OPT_ITERS,
        OPT_WARMUP,
        OPT_TOTAL,
        OPT_REGISTER,
        OPT_BASELINE,
        OPT_JSON,
        OPT_CSV,
        OPT_PLOT,
        OPT_NO_PROGRESS,
        OPT_MIN_TIME,
        OPT_NO_POOL,
        OPT_INFLIGHT,
        OPT_NUM_LAYERS,
        OPT_COMPUTE_US,
        OPT_LANES,
    };
    static const struct option longopts[] = {
        {"op", required_argument, NULL, OPT_OP},
        {"transport", required_argument, NULL, 't'},
        {"block-size", required_argument, NULL, OPT_BLOCK_SIZE},
        {"blocks", required_argument, NULL, OPT_BLOCKS},
        {"decoders", required_argument, NULL, OPT_DECODERS},
        {"iters", required_argument, NULL, OPT_ITERS},
        {"warmup", required_argument, NULL, OPT_WARMUP},
        {"total-size", required_argument, NULL, OPT_TOTAL},
        {"register", no_argument, NULL, OPT_REGISTER},
        {"baseline", required_argument, NULL, OPT_BASELINE},
        {"json", required_argument, NULL, OPT_JSON},
        {"csv", required_argument, NULL, OPT_CSV},
        {"plot", required_argument, NULL, OPT_PLOT},
        {"no-progress", no_argument, NULL, OPT_NO_PROGRESS},
        {"min-time", required_argument, NULL, OPT_MIN_TIME},
        {"no-pool", no_argument, NULL, OPT_NO_POOL},
        {"inflight", required_argument, NULL, OPT_INFLIGHT},
        {"num-layers", required_argument, NULL, OPT_NUM_LAYERS},
        {"compute-us", required_argument, NULL, OPT_COMPUTE_US},
        {"lanes", required_argument, NULL, OPT_LANES},
        {"timeout", required_argument, NULL, CLI_OPT_TIMEOUT},
        {"option", required_argument, NULL, 'o'},
        {"help", no_argument, NULL, 'h'},
        {NULL, 0, NULL, 0},
    };
    uint32_t v;
    int opt;
    bool found;

    while ((opt = getopt_long(argc, argv, "t:o:h", longopts, NULL)) != -1) {
        switch (opt) {
        case 'h':
            fputs(bench_usage, stdout);
            return -1;
        case OPT_OP:
            found = false;
            for (int i = 0; i < BOP_N; i++)
                if (strcmp(optarg, bench_ops[i]) == 0)
                    cfg->op = i, found = true;
            if (!found)
                return cli_usage_err("--op: \"%s\" is not pull, push, "
                                     "pull-blocks, link or layerwise",
                                     optarg);
            break;
        case 't':
            if (!cli_set_transport(&cfg->lo, optarg))
                return CLI_EXIT_USAGE;
            cfg->transport_set = true;
            break;
        case OPT_BLOCK_SIZE:
            cfg->block_set = true;
            if (!cli_parse_range(optarg, true, &cfg->bmin, &cfg->bmax) ||
                cfg->bmin == 0 || cfg->bmax > (64ull << 30))
                return cli_usage_err("--block-size: \"%s\" is not MIN:MAX "
                                     "with 1 <= MIN <= MAX <= 64G",
                                     optarg);
            if (cfg->bmin != cfg->bmax && ((cfg->bmin & (cfg->bmin - 1)) != 0 ||
                                           (cfg->bmax & (cfg->bmax - 1)) != 0))
                return cli_usage_err("--block-size: a sweep's MIN and MAX "
                                     "must be powers of two");
            break;
        case OPT_BLOCKS:
            if (!cli_parse_u32(optarg, 1, BENCH_MAX_BLOCKS, &cfg->blocks))
                return cli_usage_err("--blocks: want 1..%u, got \"%s\"",
                                     BENCH_MAX_BLOCKS, optarg);
            break;
        case OPT_DECODERS:
            if (!cli_parse_u32(optarg, 1, BENCH_MAX_DECODERS, &cfg->decoders))
                return cli_usage_err("--decoders: want 1..%d, got \"%s\"",
                                     BENCH_MAX_DECODERS, optarg);
            break;
        case OPT_ITERS:
            if (!cli_parse_u32(optarg, 1, BENCH_MAX_ITERS, &cfg->iters))
                return cli_usage_err("--iters: want 1..%u, got \"%s\"",
                                     BENCH_MAX_ITERS, optarg);
            break;
        case OPT_WARMUP:
            if (!cli_parse_u32(optarg, 0, BENCH_MAX_ITERS, &cfg->warmup))
                return cli_usage_err("--warmup: want 0..%u, got \"%s\"",
                                     BENCH_MAX_ITERS, optarg);
            cfg->warmup_set = true;
            break;
        case OPT_TOTAL:
            if (!cli_parse_size(optarg, &cfg->total) || cfg->total == 0)
                return cli_usage_err("--total-size: bad size \"%s\"", optarg);
            break;
        case OPT_REGISTER:
            cfg->reg = true;
            break;
        case OPT_BASELINE:
            found = false;
            for (int i = 0; i < 4; i++)
                if (strcmp(optarg, bench_bases[i]) == 0)
                    cfg->baseline = i, found = true;
            if (!found)
                return cli_usage_err("--baseline: \"%s\" is not auto, "
                                     "memcpy, tcp or none",
                                     optarg);
            break;
        case OPT_JSON:
            cfg->json = optarg;
            break;
        case OPT_CSV:
            cfg->csv = optarg;
            break;
        case OPT_PLOT:
            cfg->plot = optarg;
            break;
        case OPT_NO_PROGRESS:
            cfg->progress = false;
            break;
        case OPT_NO_POOL:
            cfg->no_pool = true;
            break;
        case OPT_NUM_LAYERS:
            if (!cli_parse_u32(optarg, 1, 1024, &cfg->num_layers))
                return cli_usage_err("--num-layers: want 1..1024, got \"%s\"",
                                     optarg);
            cfg->num_layers_set = true;
            break;
        case OPT_COMPUTE_US:
            if (!cli_parse_u32(optarg, 0, 10000000, &v))
                return cli_usage_err("--compute-us: want 0..10000000, got "
                                     "\"%s\"",
                                     optarg);
            cfg->compute_ns = (int64_t)v * 1000;
            break;
        case OPT_INFLIGHT:
            if (!cli_parse_u32(optarg, 1, BENCH_MAX_INFLIGHT, &cfg->inflight))
                return cli_usage_err("--inflight: want 1..%u, got \"%s\"",
                                     BENCH_MAX_INFLIGHT, optarg);
            break;
        case OPT_MIN_TIME:
            if (!cli_parse_u32(optarg, 1, 3600000, &cfg->min_time_ms))
                return cli_usage_err("--min-time: bad milliseconds \"%s\"",
                                     optarg);
            break;
        case CLI_OPT_TIMEOUT:
            if (!cli_parse_u32(optarg, 1, 3600000, &v))
                return cli_usage_err("--timeout: bad milliseconds \"%s\"",
                                     optarg);
            cfg->timeout_ms = (int)v;
            break;
        case OPT_LANES: {
            char kv[64];
            snprintf(kv, sizeof(kv), "llm.TcpLanes=%s", optarg);
            if (!cli_add_option(&cfg->lo, kv))
                return cli_usage_err("--lanes: too many options");
            break;
        }
        case 'o':
            if (!cli_add_option(&cfg->lo, optarg))
                return cli_usage_err("-o wants KEY=VALUE, got \"%s\"", optarg);
            break;
        default:
            return cli_usage_err("bad option");
        }
    }
    if (optind < argc)
        return cli_usage_err("unexpected argument \"%s\"", argv[optind]);
    if (cfg->blocks == 0)
        cfg->blocks = cfg->op == BOP_PULL_BLOCKS ? 64 : 1;
    if (cfg->inflight > 0 && cfg->op != BOP_PULL_BLOCKS)
        return cli_usage_err("--inflight: only with --op pull-blocks");
    if (cfg->op == BOP_LAYERWISE) {
        if (cfg->decoders > 1 || cfg->blocks > 1 || cfg->csv != NULL ||
            cfg->plot != NULL || cfg->baseline != BASE_AUTO)
            return cli_usage_err("--op layerwise: one decoder, one block "
                                 "per tensor, no --csv, --plot or "
                                 "--baseline (its baseline is (a))");
        /* A layer of 2 MiB: long enough to time, short enough to run
         * several rounds a second. */
        if (!cfg->block_set)
            cfg->bmin = cfg->bmax = 1u << 20;
        if (!cfg->transport_set && !cli_set_transport(&cfg->lo, "tcp"))
            return CLI_EXIT_USAGE;
        cfg->baseline = BASE_NONE;
    } else if (cfg->num_layers_set || cfg->compute_ns >= 0) {
        return cli_usage_err("--num-layers and --compute-us: only with "
                             "--op layerwise");
    }
    if (cfg->op == BOP_LINK && cfg->plot != NULL)
        return cli_usage_err("--plot draws a block-size sweep; --op link "
                             "has none");
    if (cfg->bmax * cfg->blocks / cfg->blocks != cfg->bmax ||
        cfg->bmax * cfg->blocks > (64ull << 30))
        return cli_usage_err("--block-size x --blocks must stay within 64G "
                             "per call");
    return 0;
}

/* Runs one row on the nodes; fills *res. */
static bool
bench_row(const bench_cfg *cfg, cli_node *prompt, cli_node *decs,
          uint64_t block, bench_bufs *bufs, bench_progress *prog,
          bench_result *res)
{
    bench_cmd c;
    bench_reply r;
    int64_t *all = NULL, *s = NULL;
    size_t nall = 0;
    int64_t t0 = 0, t1 = 0;
    uint64_t bytes = 0, calls = 0;
    bool ok = false;

    bench_row_cmd(cfg, block, &c);
    memset(res, 0, sizeof(*res));
    res->block = block;
    res->per_call = cfg->blocks;
    res->bytes_per_call = block * cfg->blocks;
    res->warmup = c.warmup;
    res->inflight = cfg->inflight;
    res->base = bench_base_kind(cfg);

    /* The baseline first, while no cache of this row holds memory. */
    if (res->base != BASE_NONE) {
        bench_base_result b = {0, 0, 0};
        snprintf(prog->label, sizeof(prog->label), "%s baseline",
                 bench_base_label(res->base));
        bench_progress_draw(prog);
        if (!(res->base == BASE_TCP
                  ? bench_base_tcp(&c, res->bytes_per_call, &b)
                  : bench_base_memcpy(&c, bufs, false, &b)))
            return false;
        res->base_gbps = b.gbps;
        res->base_p50 = b.p50;
        res->base_p99 = b.p99;
        res->best_gbps = b.gbps;
        /* The best copy: the faster of memcpy and the streamed copy, timed
         * in the same run on the same buffers. */
        if (res->base == BASE_MEMCPY) {
            bench_base_result nb = {0, 0, 0};
            if (!bench_base_memcpy(&c, bufs, true, &nb))
                return false;
            if (nb.gbps > b.gbps) {
                res->best_gbps = nb.gbps;
                res->best_nt = true;
            }
        }
    }
    char bs[32];
    snprintf(prog->label, sizeof(prog->label), "block %s",
             cli_fmt_bytes(bs, sizeof(bs), block));
    bench_progress_draw(prog);

    if (!bench_call(prompt, BC_SETUP, &c, NULL, &r, NULL))
        return false;
    if (r.status != LLM_SUCCESS) {
        cli_err("prompt: %s", r.err);
        return false;
    }
    c.remote_cache = r.cache_id;
    c.ndec = cfg->decoders;
    for (uint32_t i = 0; i < cfg->decoders; i++) {
        if (!bench_call(&decs[i], BC_SETUP, &c, NULL, &r, NULL))
            return false;
        if (r.status != LLM_SUCCESS) {
            cli_err("decoder %" PRIu32 ": %s", i + 1, r.err);
            return false;
        }
        c.dec_cache[i] = r.cache_id;
    }

    /* The decoders start together; the aggregate spans first to last. */
    uint32_t nrep = cfg->op == BOP_PUSH ? 1 : cfg->decoders;
    cli_node *who = cfg->op == BOP_PUSH ? prompt : decs;
    for (uint32_t i = 0; i < nrep; i++) {
        if (cli_msg_send(who[i].cmd_fd,
                         cfg->op == BOP_PUSH ? BC_PUSH_RUN : BC_RUN, &c,
                         sizeof(c), NULL, 0) != 0) {
            cli_err("the %s node stopped answering", who[i].name);
            goto out;
        }
    }
    bool failed = false;
    for (uint32_t i = 0; i < nrep; i++) {
        if (!bench_recv(&who[i], prog, &r, &s))
            goto out;
        if (r.status != LLM_SUCCESS) {
            cli_err("%s: %s", who[i].name, r.err);
            failed = true;
            free(s);
            continue;
        }
        int64_t *na = realloc(all, (nall + r.nsamples + 1) * sizeof(*all));
        if (na == NULL) {
            free(s);
            cli_err("out of memory");
            goto out;
        }
        all = na;
        memcpy(all + nall, s, r.nsamples * sizeof(*all));
        nall += r.nsamples;
        free(s);
        if (i == 0 || r.t0 < t0)
            t0 = r.t0;
        if (i == 0 || r.t1 > t1)
            t1 = r.t1;
        bytes += r.bytes;
        calls += r.calls;
        /* The slowest decoder's post cost. */
        if ((double)r.post_ns > res->post_ns)
            res->post_ns = (double)r.post_ns;
    }
    if (failed)
        goto out;

    /* Free this row's caches before the next row's baseline. */
    c.nslots = 0;
    if (!bench_call(prompt, BC_SETUP, &c, NULL, &r, NULL))
        goto out;
    for (uint32_t i = 0; i < cfg->decoders; i++)
        if (!bench_call(&decs[i], BC_SETUP, &c, NULL, &r, NULL))
            goto out;

    qsort(all, nall, sizeof(*all), bench_cmp_i64);
    res->calls = calls;
    res->iters = (uint32_t)(calls / cfg->decoders);
    res->gbps = cli_gbps(bytes, t1 - t0);
    res->p50 = bench_pct(all, nall, 0.50);
    res->p99 = bench_pct(all, nall, 0.99);
    res->blocks_per_s =
        t1 > t0 ? (double)calls * cfg->blocks / ((double)(t1 - t0) / 1e9) : 0;
    res->ratio = res->base_gbps > 0 ? res->gbps / res->base_gbps : 0;
    res->ratio_best = res->best_gbps > 0 ? res->gbps / res->best_gbps : 0;
    ok = true;
out:
    free(all);
    return ok;
}

static bool
bench_link_row(const bench_cfg *cfg, cli_node *decs, uint16_t port,
               bench_progress *prog, bench_result *res)
{
    bench_cmd c;
    bench_reply r;
    int64_t *links = NULL, *unlinks = NULL, *s;
    size_t n = 0;
    bool ok = false;

    memset(&c, 0, sizeof(c));
    memset(res, 0, sizeof(*res));
    c.op = BOP_LINK;
    c.port = port;
    c.iters = cfg->iters != 0 ? cfg->iters : 100;
    c.warmup = cfg->warmup_set    ? cfg->warmup
               : c.iters / 10 > 0 ? c.iters / 10
                                  : 1;
    res->iters = c.iters;
    res->warmup = c.warmup;
    res->base = BASE_NONE;
    snprintf(prog->label, sizeof(prog->label), "link + unlink");
    links = calloc((size_t)c.iters * cfg->decoders, sizeof(int64_t));
    unlinks = calloc((size_t)c.iters * cfg->decoders, sizeof(int64_t));
    if (links == NULL || unlinks == NULL) {
        cli_err("out of memory");
        goto out;
    }
    for (uint32_t i = 0; i < cfg->decoders; i++) {
        if (cli_msg_send(decs[i].cmd_fd, BC_LINKBENCH, &c, sizeof(c), NULL,
                         0) != 0) {
            cli_err("the %s node stopped answering", decs[i].name);
            goto out;
        }
    }
    bool failed = false;
    for (uint32_t i = 0; i < cfg->decoders; i++) {
        if (!bench_recv(&decs[i], prog, &r, &s))
            goto out;
        if (r.status != LLM_SUCCESS || r.nsamples != 2ull * c.iters) {
            cli_err("%s: %s", decs[i].name, r.err);
            failed = true;
            free(s);
            continue;
        }
        memcpy(links + n, s, c.iters * sizeof(int64_t));
        memcpy(unlinks + n, s + c.iters, c.iters * sizeof(int64_t));
        n += c.iters;
        free(s);
    }
    if (failed)
        goto out;
    qsort(links, n, sizeof(int64_t), bench_cmp_i64);
    qsort(unlinks, n, sizeof(int64_t), bench_cmp_i64);
    res->calls = n;
    res->p50 = bench_pct(links, n, 0.50);
    res->p99 = bench_pct(links, n, 0.99);
    res->unlink_p50 = bench_pct(unlinks, n, 0.50);
    res->unlink_p99 = bench_pct(unlinks, n, 0.99);
    ok = true;
out:
    free(links);
    free(unlinks);
    return ok;
}

static double
bench_median(double *v, size_t n)
{
    /* Insertion sort: a few dozen rounds. */
    for (size_t i = 1; i < n; i++)
        for (size_t k = i; k > 0 && v[k - 1] > v[k]; k--) {
            double t = v[k];
            v[k] = v[k - 1];
            v[k - 1] = t;
        }
    return n == 0 ? 0 : n % 2 ? v[n / 2] : (v[n / 2 - 1] + v[n / 2]) / 2;
}

/*
 * One row of --op layerwise. The ideal of a round is max(its compute, its
 * transfer) + one layer's transfer: the last layer can only move after its
 * compute. Ratios are taken within each round, then their median.
 */
static bool
bench_layerwise_row(const bench_cfg *cfg, cli_node *prompt, cli_node *dec,
                    uint64_t block, bench_progress *prog, bench_result *res)
{
    bench_cmd c;
    bench_reply r, lw;
    int64_t *s = NULL;
    double *v = NULL;
    bool ok = false;

    bench_row_cmd(cfg, block, &c);
    memset(res, 0, sizeof(*res));
    res->block = block;
    res->per_call = 1;
    res->bytes_per_call = block * c.tensors;
    res->warmup = c.warmup;
    res->base = BASE_NONE;
    res->layers = c.num_layers;
    char bs[32];
    snprintf(prog->label, sizeof(prog->label), "layers of %s",
             cli_fmt_bytes(bs, sizeof(bs), 2 * block));
    if (!bench_call(prompt, BC_SETUP, &c, NULL, &r, NULL))
        return false;
    if (r.status != LLM_SUCCESS) {
        cli_err("prompt: %s", r.err);
        return false;
    }
    if (!bench_call(dec, BC_SETUP, &c, NULL, &r, NULL))
        return false;
    if (r.status != LLM_SUCCESS) {
        cli_err("decoder 1: %s", r.err);
        return false;
    }
    c.dec_cache[0] = r.cache_id;
    c.ndec = 1;
    if (!bench_call(prompt, BC_LAYERWISE, &c, prog, &lw, &s))
        return false;
    if (lw.status != LLM_SUCCESS || lw.calls == 0 ||
        lw.nsamples != lw.calls * LW_N) {
        cli_err("prompt: %s", lw.err);
        goto out;
    }
    c.nslots = 0; /* free this row's caches */
    if (!bench_call(prompt, BC_SETUP, &c, NULL, &r, NULL) ||
        !bench_call(dec, BC_SETUP, &c, NULL, &r, NULL))
        goto out;

    size_t n = lw.calls, L = c.num_layers;
    v = calloc(n + 1, sizeof(*v));
    if (v == NULL) {
        cli_err("out of memory");
        goto out;
    }
    res->calls = n;
    res->iters = (uint32_t)n;
    res->compute_ms = (double)lw.compute_ns / 1e6;
    double *dst[LW_N] = {
        [LW_PUSH] = &res->push_ms,    [LW_SEQ] = &res->seq_ms,
        [LW_LAYERED] = &res->lw_ms,   [LW_COMPUTE] = &res->comp_ms,
        [LW_TAIL] = &res->tail_ms,    [LW_MARKS] = &res->marks_ms,
        [LW_PREEMPT] = &res->preempt, [LW_LAYER] = &res->layer_ms};
    for (int k = 0; k < LW_N; k++) {
        for (size_t i = 0; i < n; i++)
            v[i] = (double)s[i * LW_N + k] / (k == LW_PREEMPT ? 1 : 1e6);
        *dst[k] = bench_median(v, n);
    }
    for (size_t i = 0; i < n; i++) {
        const int64_t *x = s + i * LW_N;
        double t = (double)x[LW_PUSH];
        v[i] = ((x[LW_COMPUTE] > x[LW_PUSH] ? (double)x[LW_COMPUTE] : t) +
                t / (double)L) /
               1e6;
    }
    res->ideal_ms = bench_median(v, n);
    for (size_t i = 0; i < n; i++)
        v[i] = (double)s[i * LW_N + LW_LAYERED] / (double)s[i * LW_N + LW_SEQ];
    res->ratio_seq = bench_median(v, n);
    for (size_t i = 0; i < n; i++) {
        const int64_t *x = s + i * LW_N;
        double t = (double)x[LW_PUSH];
        double ideal =
            (x[LW_COMPUTE] > x[LW_PUSH] ? (double)x[LW_COMPUTE] : t) +
            t / (double)L;
        v[i] = (double)x[LW_LAYERED] / ideal;
    }
    res->ratio_ideal = bench_median(v, n);
    res->gbps = cli_gbps(res->bytes_per_call, (int64_t)(res->push_ms * 1e6));
    ok = true;
out:
    free(v);
    free(s);
    return ok;
}

int
cli_bench(int argc, char **argv)
{
    bench_cfg cfg;
    cli_node prompt = {.cmd_fd = -1, .rep_fd = -1};
    cli_node decs[BENCH_MAX_DECODERS];
    bench_role prole, droles[BENCH_MAX_DECODERS];
    bench_result *rows = NULL;
    size_t nrows = 0, maxrows = 0;
    bench_progress prog;
    bench_bufs bufs = {NULL, NULL, 0};
    bench_reply r;
    char b1[32], b2[32];
    int rc = CLI_EXIT_FAIL;
    uint32_t started = 0;

    memset(&cfg, 0, sizeof(cfg));
    memset(&prog, 0, sizeof(prog));
    cli_lib_opts_init(&cfg.lo);
    cfg.op = BOP_PULL;
    cfg.bmin = 4096;
    cfg.bmax = 16u << 20;
    cfg.decoders = 1;
    cfg.total = 64u << 20;
    cfg.baseline = BASE_AUTO;
    cfg.progress = isatty(STDERR_FILENO);
    cfg.timeout_ms = CLI_LINK_TIMEOUT_MS;
    cfg.min_time_ms = BENCH_MIN_TIME_MS;
    cfg.num_layers = 32;
    cfg.compute_ns = -1;
    for (int i = 0, n = 0; i < argc && n < (int)sizeof(cfg.command) - 1; i++) {
        int k = snprintf(cfg.command + n, sizeof(cfg.command) - (size_t)n,
                         "%s%s", i > 0 ? " " : "", argv[i]);
        if (k < 0)
            break;
        n += k;
    }
    for (uint32_t i = 0; i < BENCH_MAX_DECODERS; i++)
        decs[i] = (cli_node){.cmd_fd = -1, .rep_fd = -1};

    int prc = bench_parse(&cfg, argc, argv);
    if (prc != 0) {
        rc = prc < 0 ? CLI_EXIT_OK : prc;
        goto out;
    }
    if (!bench_memory_ok(&cfg))
        goto out;
    bool threaded = strcmp(cfg.lo.transport, "loop") == 0;
    for (uint64_t b = cfg.bmin; b <= cfg.bmax && b != 0; b *= 2) {
        maxrows++;
        if (cfg.bmin == cfg.bmax)
            break;
    }
    if (cfg.op == BOP_LINK)
        maxrows = 1;
    rows = calloc(maxrows, sizeof(*rows));
    if (rows == NULL) {
        cli_err("out of memory");
        goto out;
    }
    prog.on = cfg.progress;
    prog.total = maxrows;
    prog.t0 = cli_now_ns();

    int base = bench_base_kind(&cfg);
    printf("llmdd bench: op %s, transport %s (built in: %s), %" PRIu32
           " decoder%s%s, %s\n",
           bench_ops[cfg.op], cfg.lo.transport, llmdd_transport_list(),
           cfg.decoders, cfg.decoders > 1 ? "s" : "",
           threaded ? " (threads: loop needs one process)" : " (processes)",
           cfg.reg ? "prompt memory registered (malloc)"
                   : "prompt memory from llmdd_allocate_cache");
    if (cfg.op == BOP_LAYERWISE)
        printf("  %" PRIu32 " layers (K, V tensors each); one slot per push; "
               "compute per layer: %s, simulated by sleeping (a busy loop "
               "would take a core from the transfer threads); (a) compute "
               "all layers, then llmdd_push_kv_cache; (b) "
               "llmdd_push_kv_cache_async with LLMDD_XFER_LAYERWISE posted "
               "first, llmdd_request_layer_ready after each layer's compute, "
               "then llmdd_request_wait\n",
               cfg.num_layers,
               cfg.compute_ns < 0 ? "one layer's push (measured per row)"
                                  : cli_fmt_ns(b1, sizeof(b1), cfg.compute_ns));
    else if (cfg.op != BOP_LINK)
        printf("  %" PRIu32 " %s per call; each cache up to %s per row; "
               "baseline: %s%s\n",
               cfg.blocks,
               cfg.op != BOP_PULL_BLOCKS ? "tensor(s), one batch slot of each,"
               : cfg.inflight > 0 ? "scattered block(s) of one tensor, posted "
                                    "(llmdd_pull_kv_blocks_async),"
                                  : "scattered block(s) of one tensor",
               cli_fmt_bytes(b1, sizeof(b1), cfg.total), bench_base_label(base),
               base == BASE_TCP ? " (one loopback connection, two processes)"
               : base == BASE_MEMCPY ? " (one thread, same bytes) and the best "
                                       "copy (the faster of memcpy and "
                                       "non-temporal stores)"
                                     : "");
    if (cfg.inflight > 0)
        printf("  %" PRIu32 " request(s) in flight per decoder: each "
               "completion (llmdd_request_wait on the oldest) posts the "
               "next\n",
               cfg.inflight);
    fflush(stdout);

    prole = (bench_role){.cfg = &cfg, .prompt = true};
    if (cli_node_start(&prompt, "prompt", threaded, bench_node_main, &prole) !=
            0 ||
        !bench_recv(&prompt, NULL, &r, NULL))
        goto out;
    if (r.status != LLM_SUCCESS) {
        cli_err("prompt: %s", r.err);
        goto out;
    }
    uint16_t port = r.port;
    for (; started < cfg.decoders; started++) {
        char name[32];
        snprintf(name, sizeof(name), "decoder %" PRIu32, started + 1);
        droles[started] =
            (bench_role){.cfg = &cfg, .prompt = false, .index = started};
        if (cli_node_start(&decs[started], name, threaded, bench_node_main,
                           &droles[started]) != 0) {
            goto out;
        }
        if (!bench_recv(&decs[started], NULL, &r, NULL)) {
            started++;
            goto out;
        }
        if (r.status != LLM_SUCCESS) {
            cli_err("%s: %s", name, r.err);
            started++;
            goto out;
        }
    }
    bench_print_header(&cfg);
    if (cfg.op == BOP_LINK) {
        if (!bench_link_row(&cfg, decs, port, &prog, &rows[0]))
            goto out;
        nrows = 1;
        bench_progress_clear(&prog);
        bench_print_row(&cfg, &rows[0]);
    } else {
        bench_cmd c;
        memset(&c, 0, sizeof(c));
        c.port = port;
        for (uint32_t i = 0; i < cfg.decoders; i++) {
            if (!bench_call(&decs[i], BC_LINK, &c, NULL, &r, NULL))
                goto out;
            if (r.status != LLM_SUCCESS) {
                cli_err("%s: %s", decs[i].name, r.err);
                goto out;
            }
        }
        for (uint64_t b = cfg.bmin; nrows < maxrows; b *= 2) {
            prog.done = nrows;
            if (!(cfg.op == BOP_LAYERWISE
                      ? bench_layerwise_row(&cfg, &prompt, &decs[0], b, &prog,
                                            &rows[nrows])
                      : bench_row(&cfg, &prompt, decs, b, &bufs, &prog,
                                  &rows[nrows]))) {
                bench_progress_clear(&prog);
                goto out;
            }
            bench_progress_clear(&prog);
            bench_print_row(&cfg, &rows[nrows]);
            nrows++;
        }
    }
    if (cfg.op == BOP_LINK)
        printf("\nlink: llmdd_link_clusters, unlink: llmdd_unlink_clusters "
               "(not forced), per call, all decoders; %s total.\n",
               cli_fmt_ns(b2, sizeof(b2), cli_now_ns() - prog.t0));
    else if (cfg.op == BOP_LAYERWISE)
        printf("\nMedians over rounds: compute = all layers' sleeps as "
               "measured; push = the synchronous push alone (the "
               "transfer); ideal = max(compute, push) + push / layers; "
               "ratios are per round, then their median; %s total.\n",
               cli_fmt_ns(b2, sizeof(b2), cli_now_ns() - prog.t0));
    else
        printf("\nGB/s = 10^9 bytes/s, aggregate over decoders; p50/p99 per "
               "call; ratio = GB/s / baseline GB/s%s; %s total.\n",
               base == BASE_MEMCPY ? "; vs best = GB/s / best copy GB/s" : "",
               cli_fmt_ns(b2, sizeof(b2), cli_now_ns() - prog.t0));
    rc = CLI_EXIT_OK;
    if (cfg.json != NULL && !bench_write_json(&cfg, rows, nrows))
        rc = CLI_EXIT_FAIL;
    if (cfg.csv != NULL && !bench_write_csv(&cfg, rows, nrows))
        rc = CLI_EXIT_FAIL;
    if (cfg.plot != NULL) {
        if (bench_plot(&cfg, rows, nrows))
            printf("plot: %s\n", cfg.plot);
        else
            rc = CLI_EXIT_FAIL;
    }
out:
    fflush(stdout);
    for (uint32_t i = 0; i < started; i++)
        if (cli_node_stop(&decs[i]) != 0)
            rc = CLI_EXIT_FAIL;
    if (cli_node_stop(&prompt) != 0)
        rc = CLI_EXIT_FAIL;
    bench_bufs_free(&bufs);
    free(rows);
    cli_lib_opts_fini(&cfg.lo);
    return rc;
}
