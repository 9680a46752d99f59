/*
 * llmdd bench --op fleet (bench_fleet.c): the network namespaces and the
 * node processes, prompt and decoders, that the orchestrator drives.
 */
#include <cjson/cJSON.h>
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <poll.h>
#include <sched.h>
#include <signal.h>
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "bench_fleet.h"

/* llm.SyncKvCacheWaitTime of every node: -o's, else FLEET_WAIT_DEFAULT. */
int64_t
fleet_wait_ms(const bench_cfg *cfg)
{
    const char *v = FLEET_WAIT_DEFAULT;

    for (size_t i = 0; i < cfg->lo.nuser; i++)
        if (strcmp(cfg->lo.user[i].key, CLI_WAIT_KEY) == 0)
            v = cfg->lo.user[i].value;
    return strtoll(v, NULL, 10);
}

/* ---- Latencies. ---- */

typedef struct {
    int64_t *v;
    size_t n, cap;
} fleet_samples;

static void
samples_add(fleet_samples *s, int64_t ns)
{
    if (s->n == s->cap) {
        size_t cap = s->cap ? s->cap * 2 : 1024;
        int64_t *v = realloc(s->v, cap * sizeof(*v));
        if (v == NULL)
            return; /* a sample less; the run goes on */
        s->v = v;
        s->cap = cap;
    }
    s->v[s->n++] = ns;
}

/* p50, p99 and max in microseconds; zeros without samples. */
static void
samples_stats(fleet_samples *s, double *p50, double *p99, double *max)
{
    *p50 = *p99 = *max = 0;
    if (s->n == 0)
        return;
    qsort(s->v, s->n, sizeof(*s->v), bench_cmp_i64);
    *p50 = bench_pct(s->v, s->n, 0.50);
    *p99 = bench_pct(s->v, s->n, 0.99);
    *max = (double)s->v[s->n - 1] / 1e3;
}

/* ---- Namespaces. ---- */

char fleet_ns_a[32], fleet_ns_c[32], fleet_veth_c[16];
static char veth_a[16];
static bool ns_made;

int
fleet_run(const char *const *argv)
{
    pid_t pid = fork();
    int status;

    if (pid < 0)
        return -1;
    if (pid == 0) {
        int null = open("/dev/null", O_WRONLY);
        if (null >= 0) {
            dup2(null, STDOUT_FILENO);
            dup2(null, STDERR_FILENO);
        }
        execvp(argv[0], (char *const *)argv);
        _exit(127);
    }
    if (waitpid(pid, &status, 0) != pid)
        return -1;
    return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

void
fleet_ns_down(void)
{
    if (!ns_made)
        return;
    ns_made = false;
    fleet_run((const char *[]){"ip", "netns", "delete", fleet_ns_a, NULL});
    fleet_run((const char *[]){"ip", "netns", "delete", fleet_ns_c, NULL});
}

static void
fleet_on_signal(int sig)
{
    fleet_ns_down();
    signal(sig, SIG_DFL);
    raise(sig);
}

/* A and C joined by a veth pair; false (nothing left behind) without the
 * rights or the tools. */
bool
fleet_ns_up(void)
{
    int pid = (int)getpid();

    snprintf(fleet_ns_a, sizeof(fleet_ns_a), "llmddfa%d", pid);
    snprintf(fleet_ns_c, sizeof(fleet_ns_c), "llmddfc%d", pid);
    snprintf(veth_a, sizeof(veth_a), "lfa%d", pid % 1000000);
    snprintf(fleet_veth_c, sizeof(fleet_veth_c), "lfc%d", pid % 1000000);
    if (fleet_run((const char *[]){"ip", "netns", "add", fleet_ns_a, NULL}) !=
        0)
        return false;
    ns_made = true;
    atexit(fleet_ns_down);
    signal(SIGINT, fleet_on_signal);
    signal(SIGTERM, fleet_on_signal);
    const char *const cmds[][14] = {
        {"ip", "netns", "add", fleet_ns_c, NULL},
        {"ip", "link", "add", veth_a, "netns", fleet_ns_a, "type", "veth",
         "peer", "name", fleet_veth_c, "netns", fleet_ns_c, NULL},
        {"ip", "-n", fleet_ns_a, "addr", "add", FLEET_NET "1/24", "dev", veth_a,
         NULL},
        {"ip", "-n", fleet_ns_c, "addr", "add", FLEET_NET "2/24", "dev",
         fleet_veth_c, NULL},
        {"ip", "-n", fleet_ns_a, "link", "set", veth_a, "up", NULL},
        {"ip", "-n", fleet_ns_c, "link", "set", fleet_veth_c, "up", NULL},
        {"ip", "-n", fleet_ns_a, "link", "set", "lo", "up", NULL},
        {"ip", "-n", fleet_ns_c, "link", "set", "lo", "up", NULL},
    };
    for (size_t i = 0; i < sizeof(cmds) / sizeof(cmds[0]); i++) {
        if (fleet_run(cmds[i]) != 0) {
            fleet_ns_down();
            return false;
        }
    }
    return true;
}

/* Moves the calling (forked) node into network namespace `name`. */
static bool
fleet_enter(const char *name)
{
    char path[64];

    snprintf(path, sizeof(path), "/run/netns/%s", name);
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    bool ok = fd >= 0 && setns(fd, CLONE_NEWNET) == 0;
    if (fd >= 0)
        close(fd);
    return ok;
}

/* ---- The nodes. ---- */

static llmdd_status
fleet_instance(const fleet_role *r, bool listen, uint16_t *port, llmdd **dd,
               char *err, size_t cap)
{
    cli_lib_opts lo = r->cfg->lo;
    const char *ip = r->netns != NULL ? FLEET_NET "1" : "127.0.0.1";

    /* Isolation, not detection: no heartbeats; a short wait time, unless
     * -o gives one (the user's options come last). */
    lo.nuser = 0;
    lo.user[lo.nuser++] = (llmdd_option){"llm.HeartbeatInterval", "0"};
    lo.user[lo.nuser++] = (llmdd_option){CLI_WAIT_KEY, FLEET_WAIT_DEFAULT};
    for (size_t i = 0; i < r->cfg->lo.nuser && i < CLI_MAX_OPTIONS - 2; i++)
        lo.user[lo.nuser++] = r->cfg->lo.user[i];
    return cli_instance(r->index < 0 ? BENCH_PROMPT_ID
                                     : FLEET_DEC_ID + (uint64_t)r->index,
                        r->index < 0 ? LLMDD_ROLE_PROMPT : LLMDD_ROLE_DECODER,
                        &lo, listen ? ip : NULL, port, dd, err, cap);
}

static llmdd_status
fleet_cache(llmdd *dd, uint64_t size, llmdd_cache *c)
{
    llmdd_cache_desc d = {.num_tensors = 2,
                          .data_type = LLMDD_DT_UINT8,
                          .num_dims = 2,
                          .shape = {FLEET_SLOTS, (int64_t)size}};
    return llmdd_allocate_cache(dd, &d, c);
}

typedef struct {
    int64_t cache; /* its destination cache; -1: unknown */
    llmdd_request *req;
    int64_t t0, next;
    uint32_t slot;
    uint64_t ok, failed;
    llmdd_status last_fail;
    fleet_samples lat;
} fleet_target;

/* Ended pushes from the completion queue: each counted for its decoder
 * and freed. */
static void
fleet_collect(fleet_target *t, llmdd_request *const *done, size_t n)
{
    for (size_t k = 0; k < n; k++) {
        for (int i = 0; i < FLEET_N; i++) {
            if (t[i].req != done[k])
                continue;
            llmdd_status st = llmdd_request_wait(done[k], 0);
            if (st == LLM_SUCCESS) {
                t[i].ok++;
                samples_add(&t[i].lat, cli_now_ns() - t[i].t0);
            } else {
                t[i].failed++;
                t[i].last_fail = st;
            }
            llmdd_request_free(done[k]);
            t[i].req = NULL;
        }
    }
}

/*
 * The prompt's pushes for `ms`: to each decoder in `mask` one posted push
 * at a time, every FLEET_PERIOD_MS, collected on the completion queue; the
 * notifications that reach the prompt are taken as they come.
 */
static void
fleet_push_run(llmdd *dd, const llmdd_cache *src, fleet_target *t,
               uint32_t mask, int64_t ms)
{
    static llmdd_notify drained[64];
    int64_t end = cli_now_ns() + ms * 1000000, now;
    llmdd_xfer_opts o = {.flags = LLMDD_XFER_COMPLETION};
    char note[32];

    for (int i = 0; i < FLEET_N; i++) {
        t[i].next = cli_now_ns();
        t[i].lat.n = 0;
        t[i].ok = t[i].failed = 0;
    }
    while ((now = cli_now_ns()) < end) {
        int64_t wake = end;
        for (int i = 0; i < FLEET_N; i++) {
            if (!(mask & (1u << i)) || t[i].cache < 0 || t[i].req != NULL)
                continue;
            if (now < t[i].next) {
                wake = t[i].next < wake ? t[i].next : wake;
                continue;
            }
            llmdd_cache_index dst = {FLEET_DEC_ID + (uint64_t)i, t[i].cache,
                                     t[i].slot};
            o.notify = note;
            o.notify_len =
                (size_t)snprintf(note, sizeof(note), "%u", t[i].slot);
            t[i].t0 = now;
            t[i].next = now + FLEET_PERIOD_MS * 1000000ll;
            llmdd_status st = llmdd_push_kv_cache_async(
                dd, src, &dst, t[i].slot, -1, NULL, &o, &t[i].req);
            if (st != LLM_SUCCESS) {
                t[i].req = NULL;
                t[i].failed++;
                t[i].last_fail = st;
            }
            t[i].slot = (t[i].slot + 1) % FLEET_SLOTS;
        }
        struct pollfd p[2] = {{.fd = llmdd_completion_fd(dd), .events = POLLIN},
                              {.fd = llmdd_notify_fd(dd), .events = POLLIN}};
        int64_t left = (wake - cli_now_ns()) / 1000000 + 1;
        poll(p, 2, left < 0 ? 0 : (int)left);
        size_t n;
        while (llmdd_get_notifies(dd, drained, 64, &n) == LLM_SUCCESS && n > 0)
            ;
        llmdd_request *done[FLEET_N];
        if (llmdd_get_completions(dd, done, FLEET_N, &n) != LLM_SUCCESS)
            continue;
        fleet_collect(t, done, n);
    }
}

/*
 * The end of a phase: the pushes to the decoders in `settle` that are still
 * in flight finish (they were posted at most a period ago); the others'
 * (the misbehaving decoders') are counted as failed and go.
 */
static void
fleet_push_end(llmdd *dd, fleet_target *t, uint32_t settle, int64_t wait_ms)
{
    int64_t end = cli_now_ns() + wait_ms * 1000000ll;
    llmdd_request *done[FLEET_N];
    size_t n;

    for (;;) {
        bool busy = false;
        for (int i = 0; i < FLEET_N; i++)
            busy = busy || ((settle & (1u << i)) && t[i].req != NULL);
        if (!busy || cli_now_ns() >= end)
            break;
        struct pollfd p = {.fd = llmdd_completion_fd(dd), .events = POLLIN};
        poll(&p, 1, 10);
        if (llmdd_get_completions(dd, done, FLEET_N, &n) != LLM_SUCCESS)
            break;
        fleet_collect(t, done, n);
    }
    for (int i = 0; i < FLEET_N; i++) {
        if (t[i].req == NULL)
            continue;
        t[i].failed++;
        t[i].last_fail = LLM_WAIT_PROC_TIMEOUT; /* still in flight */
        llmdd_request_free(t[i].req);
        t[i].req = NULL;
    }
}

typedef struct {
    uint64_t ok, failed, mismatched, pushes_seen;
    llmdd_status last_fail;
    fleet_samples lat;
} fleet_pulls;

/* Whether slot s of every tensor of c holds the prompt's bytes. */
static bool
fleet_slot_ok(const llmdd_cache *c, uint32_t s, uint64_t size,
              uint8_t *const *want)
{
    for (uint32_t t = 0; t < 2; t++) {
        const uint8_t *got =
            (const uint8_t *)(uintptr_t)c->tensor_addrs[t] + s * size;
        if (memcmp(got, want[t] + s * size, size) != 0)
            return false;
    }
    return true;
}

/*
 * A decoder's pulls for `ms`: a slot every FLEET_PERIOD_MS, checked; and
 * for each push notification of the prompt, its slot in our cache checked.
 */
static void
fleet_pull_run(llmdd *dd, int64_t remote, const llmdd_cache *dst,
               const llmdd_cache *scratch, uint64_t size, uint8_t *const *want,
               int64_t ms, fleet_pulls *r)
{
    static llmdd_notify got[64];
    int64_t end = cli_now_ns() + ms * 1000000, next = cli_now_ns();
    uint32_t slot = 0;

    r->lat.n = 0;
    r->ok = r->failed = r->mismatched = r->pushes_seen = 0;
    for (int64_t now; (now = cli_now_ns()) < end;) {
        if (now >= next) {
            llmdd_cache_index src = {BENCH_PROMPT_ID, remote, slot};
            llmdd_status st =
                llmdd_pull_kv_cache(dd, &src, scratch, slot, -1, NULL);
            if (st == LLM_SUCCESS) {
                r->ok++;
                samples_add(&r->lat, cli_now_ns() - now);
                r->mismatched += !fleet_slot_ok(scratch, slot, size, want);
            } else {
                r->failed++;
                r->last_fail = st;
            }
            slot = (slot + 1) % FLEET_SLOTS;
            next = now + FLEET_PERIOD_MS * 1000000ll;
        }
        struct pollfd p = {.fd = llmdd_notify_fd(dd), .events = POLLIN};
        int64_t left = (next - cli_now_ns()) / 1000000;
        poll(&p, 1, left < 0 ? 0 : (int)left);
        size_t n;
        if (llmdd_get_notifies(dd, got, 64, &n) != LLM_SUCCESS)
            continue;
        for (size_t k = 0; k < n; k++) {
            unsigned s = (unsigned)strtoul((const char *)got[k].msg, NULL, 10);
            r->pushes_seen++;
            r->mismatched +=
                s >= FLEET_SLOTS || !fleet_slot_ok(dst, s, size, want);
        }
    }
}

/* The flooder: notifications to the prompt as fast as it takes them. */
static uint64_t
fleet_flood(llmdd *dd, int64_t ms)
{
    static const char msg[LLMDD_NOTIFY_MAX];
    int64_t end = cli_now_ns() + ms * 1000000;
    uint64_t sent = 0;

    while (cli_now_ns() < end)
        sent += llmdd_send_notify(dd, BENCH_PROMPT_ID, msg, sizeof(msg)) ==
                LLM_SUCCESS;
    return sent;
}

static void fleet_say(FILE *out, const char *fmt, ...)
    __attribute__((format(printf, 2, 3)));

static void
fleet_say(FILE *out, const char *fmt, ...)
{
    va_list ap;

    va_start(ap, fmt);
    vfprintf(out, fmt, ap);
    va_end(ap);
    fputc('\n', out);
    fflush(out);
}

int
fleet_node_main(void *arg, int in_fd, int out_fd)
{
    const fleet_role *r = arg;
    FILE *in = fdopen(in_fd, "r"), *out = fdopen(out_fd, "w");
    char line[FLEET_LINE], err[512];
    llmdd_cache c = {0}, scratch = {0};
    fleet_target t[FLEET_N];
    uint8_t *want[2] = {NULL, NULL};
    int64_t remote = -1;
    uint16_t port = 0;
    llmdd *dd = NULL;

    if (in == NULL || out == NULL)
        return CLI_EXIT_FAIL;
    memset(t, 0, sizeof(t));
    if (r->netns != NULL && !fleet_enter(r->netns)) {
        fleet_say(out, "ERR cannot enter network namespace %s", r->netns);
        return CLI_EXIT_FAIL;
    }
    llmdd_status st =
        fleet_instance(r, r->index < 0, &port, &dd, err, sizeof(err));
    if (st == LLM_SUCCESS)
        st = fleet_cache(dd, r->size, &c);
    if (st == LLM_SUCCESS && r->index >= 0)
        st = fleet_cache(dd, r->size, &scratch);
    for (uint32_t k = 0; k < 2 && st == LLM_SUCCESS; k++) {
        want[k] = malloc(FLEET_SLOTS * r->size);
        if (want[k] == NULL)
            st = LLM_OUT_OF_MEMORY;
        else
            cli_fill(want[k], FLEET_SLOTS * r->size, FLEET_SEED, k, 0);
    }
    if (st == LLM_SUCCESS && r->index < 0)
        for (uint32_t k = 0; k < 2; k++)
            memcpy((void *)(uintptr_t)c.tensor_addrs[k], want[k],
                   FLEET_SLOTS * r->size);
    if (st == LLM_SUCCESS && r->index >= 0)
        st = llmdd_set_cache_key(dd, c.cache_id, 0, FLEET_KEY,
                                 strlen(FLEET_KEY));
    if (st != LLM_SUCCESS) {
        fleet_say(out, "ERR %s", llmdd_status_str(st));
        goto out;
    }
    fleet_say(out, "READY %u %lld", port, (long long)c.cache_id);

    while (fgets(line, sizeof(line), in) != NULL) {
        char ip[64];
        unsigned p, mask;
        long long ms, id;
        if (sscanf(line, "link %63s %u %lld", ip, &p, &id) == 3) {
            remote = id;
            st = cli_link(dd, BENCH_PROMPT_ID, ip, (uint16_t)p,
                          CLI_LINK_TIMEOUT_MS, err, sizeof(err));
            fleet_say(out, st == LLM_SUCCESS ? "OK" : "ERR %s", err);
        } else if (strncmp(line, "targets", 7) == 0) {
            for (int i = 0; i < FLEET_N; i++) {
                llmdd_cache_index idx;
                t[i].cache = llmdd_lookup_remote_key(
                                 dd, FLEET_DEC_ID + (uint64_t)i, FLEET_KEY,
                                 strlen(FLEET_KEY), &idx) == LLM_SUCCESS
                                 ? idx.cache_id
                                 : -1;
            }
            fleet_say(out, "OK");
        } else if (sscanf(line, "push %lld %u", &ms, &mask) == 2) {
            fleet_push_run(dd, &c, t, mask, ms);
            fleet_push_end(dd, t, mask & ((1u << FLEET_HEALTHY) - 1),
                           fleet_wait_ms(r->cfg));
            char buf[FLEET_LINE];
            int n = snprintf(buf, sizeof(buf), "OK");
            for (int i = 0; i < FLEET_N && n < (int)sizeof(buf) - 96; i++) {
                double p50, p99, max;
                samples_stats(&t[i].lat, &p50, &p99, &max);
                n += snprintf(buf + n, sizeof(buf) - (size_t)n,
                              " %" PRIu64 ":%" PRIu64 ":%.0f:%.0f:%.0f:%s",
                              t[i].ok, t[i].failed, p50, p99, max,
                              llmdd_status_str(t[i].last_fail));
            }
            fleet_say(out, "%s", buf);
        } else if (sscanf(line, "pull %lld", &ms) == 1) {
            fleet_pulls pr = {0};
            double p50, p99, max;
            fleet_pull_run(dd, remote, &c, &scratch, r->size, want, ms, &pr);
            samples_stats(&pr.lat, &p50, &p99, &max);
            fleet_say(out,
                      "OK %" PRIu64 " %" PRIu64 " %" PRIu64 " %" PRIu64
                      " %.0f %.0f %.0f %s",
                      pr.ok, pr.failed, pr.mismatched, pr.pushes_seen, p50, p99,
                      max, llmdd_status_str(pr.last_fail));
            free(pr.lat.v);
        } else if (sscanf(line, "flood %lld", &ms) == 1) {
            fleet_say(out, "OK %" PRIu64, fleet_flood(dd, ms));
        } else {
            fleet_say(out, "ERR unknown command");
        }
    }
out:
    for (int i = 0; i < FLEET_N; i++)
        free(t[i].lat.v);
    free(want[0]);
    free(want[1]);
    llmdd_destroy(dd);
    fclose(in);
    fclose(out);
    return st == LLM_SUCCESS ? CLI_EXIT_OK : CLI_EXIT_FAIL;
}
