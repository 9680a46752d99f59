/*
 * llmdd bench, the node side: a prompt or decoder instance that sets up
 * each row's caches and runs the timed calls the parent asks for.
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
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/utsname.h>
#include <time.h>
#include <unistd.h>

#if defined(__x86_64__)
#include <emmintrin.h>
#endif

#include "bench.h"

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
bool
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
 * Simulated compute: layer l of a pass ends at t0 + (l + 1) * ns, as a GPU
 * running the layers back to back would end it, whatever the thread that
 * marks the layers spent in between (a mark late by a few microseconds
 * does not delay the next layer's compute). A sleep, not a busy loop: on
 * a machine with few cores a spinning thread would take a core from the
 * threads moving the previous layer, which a GPU computing the next layer
 * would not.
 */
static void
bench_compute_until(int64_t t0, int64_t ns, uint32_t l)
{
    int64_t end = t0 + ns * ((int64_t)l + 1);
    struct timespec ts = {.tv_sec = end / 1000000000,
                          .tv_nsec = end % 1000000000};

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
    int64_t t0 = cli_now_ns();
    for (uint32_t l = 0; l < c->num_layers; l++) {
        if (compute_ns > 0) {
            bench_compute_until(t0, compute_ns, l);
            comp = cli_now_ns() - t0; /* where the last compute ended */
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
    /* Sleeps end within a microsecond of their time, not the default 50
     * (the simulated compute is what it says). */
    (void)prctl(PR_SET_TIMERSLACK, 1000UL, 0, 0, 0);
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
                    bench_compute_until(t, compute_ns, l);
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

int
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
