/*
 * llmdd bench --op discovery: N decoders of this process (default 256)
 * link to one prompt at once, all released together, and the time from the
 * first link call to the last success is measured two ways in each round:
 *   address: every decoder names the prompt by its address (the baseline,
 *            no metadata server involved);
 *   by id:   every decoder names it by cluster id alone, looked up in etcd
 *            (--metadata, a running etcd; the run uses a prefix of its own).
 * Between the two every link is undone. --rounds R repeats both (default
 * 3); the result is each round's times, their median and spread, and the
 * ratio of the medians. Without --metadata only the first: a link storm.
 * Each round also reads the kernel's TcpExt ListenOverflows and ListenDrops
 * (/proc/net/netstat, this network namespace's) before and after: a SYN the
 * listen queue dropped costs its client a second. Exit 1 when any link
 * fails.
 */
#include <errno.h>
#include <inttypes.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <unistd.h>

#include "bench.h"

#define DISC_PROMPT 1
#define DISC_DEC_ID 1000 /* decoder i is cluster DISC_DEC_ID + i */
#define DISC_MAX_ROUNDS 100

typedef struct disc_run disc_run;
typedef struct {
    disc_run *run;
    llmdd *dd;
    llmdd_status st;
    int64_t done_ns;
} disc_dec;

struct disc_run {
    pthread_mutex_t lock;
    pthread_cond_t cond;
    bool go;        /* the gate: every thread starts its call once it opens */
    const char *ip; /* NULL: by cluster id */
    uint16_t port;
    int timeout_ms;
    int64_t start_ns;
    disc_dec *decs;
};

static void *
disc_link_main(void *arg)
{
    disc_dec *d = arg;
    disc_run *r = d->run;
    char err[512];

    pthread_mutex_lock(&r->lock);
    while (!r->go)
        pthread_cond_wait(&r->cond, &r->lock);
    pthread_mutex_unlock(&r->lock);
    d->st = cli_link(d->dd, DISC_PROMPT, r->ip, r->port, r->timeout_ms, err,
                     sizeof(err));
    d->done_ns = cli_now_ns();
    if (d->st != LLM_SUCCESS)
        cli_err("%s", err);
    return NULL;
}

/*
 * TcpExt ListenOverflows and ListenDrops from /proc/net/netstat, whose
 * TcpExt lines are a header of names and a line of values; false when the
 * file cannot be read.
 */
static bool
disc_listen_drops(uint64_t *overflows, uint64_t *drops)
{
    FILE *f = fopen("/proc/net/netstat", "r");
    char names[4096], values[4096];
    bool found = false;

    if (f == NULL)
        return false;
    while (!found && fgets(names, sizeof(names), f) != NULL &&
           fgets(values, sizeof(values), f) != NULL) {
        if (strncmp(names, "TcpExt:", 7) != 0)
            continue;
        char *ns, *vs;
        char *n = strtok_r(names, " \n", &ns),
             *v = strtok_r(values, " \n", &vs);
        for (; n != NULL && v != NULL;
             n = strtok_r(NULL, " \n", &ns), v = strtok_r(NULL, " \n", &vs)) {
            if (strcmp(n, "ListenOverflows") == 0)
                *overflows = strtoull(v, NULL, 10);
            else if (strcmp(n, "ListenDrops") == 0)
                *drops = strtoull(v, NULL, 10);
        }
        found = true;
    }
    fclose(f);
    return found;
}

/* One round of n links at once: first call to last success, or -1. */
static int64_t
disc_round(disc_dec *decs, uint32_t n, const char *ip, uint16_t port,
           int timeout_ms)
{
    disc_run r = {.lock = PTHREAD_MUTEX_INITIALIZER,
                  .cond = PTHREAD_COND_INITIALIZER,
                  .ip = ip,
                  .port = port,
                  .timeout_ms = timeout_ms,
                  .decs = decs};
    pthread_t *th = calloc(n, sizeof(*th));
    int64_t last = 0;
    bool ok = th != NULL;
    uint32_t started = 0;

    for (; ok && started < n; started++) {
        decs[started].run = &r;
        decs[started].st = LLM_FAILED;
        if (pthread_create(&th[started], NULL, disc_link_main,
                           &decs[started]) != 0)
            break;
    }
    if (started < n) {
        cli_err("bench: could not start %u threads", n);
        ok = false;
    }
    /* Every thread waits at the gate: open it. */
    pthread_mutex_lock(&r.lock);
    r.start_ns = cli_now_ns();
    r.go = true;
    pthread_cond_broadcast(&r.cond);
    pthread_mutex_unlock(&r.lock);
    for (uint32_t i = 0; i < started; i++) {
        pthread_join(th[i], NULL);
        if (decs[i].st != LLM_SUCCESS)
            ok = false;
        else if (decs[i].done_ns - r.start_ns > last)
            last = decs[i].done_ns - r.start_ns;
    }
    free(th);
    /* Undo every link for the next round. */
    for (uint32_t i = 0; i < started; i++) {
        char err[512];
        if (decs[i].st == LLM_SUCCESS &&
            cli_unlink(decs[i].dd, DISC_PROMPT, "127.0.0.1", port, timeout_ms,
                       err, sizeof(err)) != LLM_SUCCESS) {
            cli_err("%s", err);
            ok = false;
        }
    }
    return ok ? last : -1;
}

static int
cmp_i64(const void *a, const void *b)
{
    int64_t x = *(const int64_t *)a, y = *(const int64_t *)b;
    return x < y ? -1 : x > y;
}

static void
disc_summary(const char *what, int64_t *v, uint32_t n, int64_t *median)
{
    char a[32], b[32], c[32];

    qsort(v, n, sizeof(*v), cmp_i64);
    *median = v[n / 2];
    printf("  %-8s median %s, min %s, max %s over %u rounds\n", what,
           cli_fmt_ns(a, sizeof(a), *median), cli_fmt_ns(b, sizeof(b), v[0]),
           cli_fmt_ns(c, sizeof(c), v[n - 1]), n);
}

int
bench_discovery(const bench_cfg *cfg)
{
    uint32_t n = cfg->decoders_set ? cfg->decoders : 256;
    uint32_t rounds = cfg->rounds > 1 ? cfg->rounds : 3;
    char prefix[64], maxlinks[16], err[1024];
    int64_t by_addr[DISC_MAX_ROUNDS], by_id[DISC_MAX_ROUNDS];
    disc_dec *decs = calloc(n, sizeof(*decs));
    llmdd *prompt = NULL;
    uint16_t port = 0;
    uint32_t made = 0;
    int rc = CLI_EXIT_FAIL;
    struct rlimit rl;

    if (decs == NULL)
        return CLI_EXIT_FAIL;
    /* Each link holds a few descriptors on each side, and each decoder
     * instance its own: as many as the hard limit allows. */
    if (getrlimit(RLIMIT_NOFILE, &rl) == 0 && rl.rlim_cur < rl.rlim_max) {
        rl.rlim_cur = rl.rlim_max;
        (void)setrlimit(RLIMIT_NOFILE, &rl);
    }
    /* A prefix of this run's own: nothing else is published there. */
    snprintf(prefix, sizeof(prefix), "llmdd-bench-%d", (int)getpid());
    snprintf(maxlinks, sizeof(maxlinks), "%u", n + 16);
    /* The decoders take the user's options and the run's prefix; the
     * prompt also serves them all (MaxLinks). The copies share cfg's
     * strings and own's. */
    cli_lib_opts dlo = cfg->lo, plo;
    char kv1[96], kv2[48];
    cli_lib_opts own;
    cli_lib_opts_init(&own);
    snprintf(kv1, sizeof(kv1), "llm.MetadataPrefix=%s", prefix);
    snprintf(kv2, sizeof(kv2), "llm.MaxLinks=%s", maxlinks);
    if (!cli_add_option(&own, kv1) || !cli_add_option(&own, kv2))
        goto out;
    dlo.nuser = 0;
    for (size_t i = 0; i < cfg->lo.nuser && dlo.nuser < CLI_MAX_OPTIONS - 2;
         i++)
        if (strcmp(cfg->lo.user[i].key, "llm.MetadataPrefix") != 0)
            dlo.user[dlo.nuser++] = cfg->lo.user[i];
    dlo.user[dlo.nuser++] = own.user[0];
    plo = dlo;
    plo.user[plo.nuser++] = own.user[1];
    llmdd_status st =
        cli_instance(DISC_PROMPT, LLMDD_ROLE_PROMPT, &plo, "127.0.0.1", &port,
                     &prompt, err, sizeof(err));
    if (st != LLM_SUCCESS) {
        cli_err("%s", err);
        goto out;
    }
    for (; made < n; made++) {
        decs[made].dd = NULL;
        st = cli_instance(DISC_DEC_ID + made, LLMDD_ROLE_DECODER, &dlo, NULL,
                          NULL, &decs[made].dd, err, sizeof(err));
        if (st != LLM_SUCCESS) {
            cli_err("decoder %u of %u: %s (raise the fd limit: ulimit -n)",
                    made, n, err);
            goto out;
        }
    }
    printf("llmdd bench --op discovery: %u decoders of this process link "
           "at once to one prompt (127.0.0.1:%u, transport %s), by address",
           n, port, dlo.transport);
    if (cfg->lo.metadata[0] != '\0')
        printf(" and by cluster id through %s (prefix %s)", cfg->lo.metadata,
               prefix);
    printf("; first call to last success:\n");
    bool by_id_too = cfg->lo.metadata[0] != '\0';
    for (uint32_t r = 0; r < rounds; r++) {
        char a[32], b[32];
        uint64_t o0 = 0, d0 = 0, o1 = 0, d1 = 0;
        bool kernel = disc_listen_drops(&o0, &d0);
        by_addr[r] = disc_round(decs, n, "127.0.0.1", port, cfg->timeout_ms);
        by_id[r] =
            by_id_too ? disc_round(decs, n, NULL, port, cfg->timeout_ms) : 0;
        kernel = kernel && disc_listen_drops(&o1, &d1);
        if (by_addr[r] < 0 || by_id[r] < 0) {
            cli_err("round %u: a link failed", r + 1);
            goto out;
        }
        printf("  round %u: by address %s", r + 1,
               cli_fmt_ns(a, sizeof(a), by_addr[r]));
        if (by_id_too)
            printf(", by id %s", cli_fmt_ns(b, sizeof(b), by_id[r]));
        if (kernel)
            printf("; listen overflows %" PRIu64 ", drops %" PRIu64, o1 - o0,
                   d1 - d0);
        printf("\n");
    }
    int64_t ma, mi;
    disc_summary("address", by_addr, rounds, &ma);
    if (!by_id_too) {
        rc = CLI_EXIT_OK;
        goto out;
    }
    disc_summary("by id", by_id, rounds, &mi);
    printf("  by id / by address (medians): %.2f; goal: by id <= 2 s: %s\n",
           ma > 0 ? (double)mi / (double)ma : 0.0,
           mi <= 2000000000ll ? "met" : "NOT met");
    rc = CLI_EXIT_OK;
out:
    for (uint32_t i = 0; i < made; i++)
        llmdd_destroy(decs[i].dd);
    llmdd_destroy(prompt);
    cli_lib_opts_fini(&own);
    free(decs);
    return rc;
}
