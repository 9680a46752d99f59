/*
 * llmdd bench --op fleet: one prompt and eight decoders, and what three
 * misbehaving decoders do to the other five.
 *
 * Every decoder links to the prompt over tcp. The five healthy ones pull a
 * slot from the prompt every FLEET_PERIOD_MS, each checked byte for byte,
 * while the prompt pushes a slot to each decoder every FLEET_PERIOD_MS as a
 * posted request carrying a notification, which the decoder answers by
 * checking the slot's bytes. Two phases of the same length:
 *   alone: the three others are linked and idle;
 *   with:  decoder 5 is stopped (SIGSTOP), decoder 6 floods the prompt with
 *          notifications and never takes the prompt's, and decoder 7, in a
 *          network namespace of its own, is cut off (its veth set down: no
 *          RST, no FIN); the prompt keeps pushing to all eight.
 * Heartbeats are off (llm.HeartbeatInterval=0 everywhere), so that what is
 * measured is isolation, not how fast the three are declared dead. The
 * result is the healthy decoders' p99 latency of pulls and of pushes in each
 * phase, their ratio, and every error or mismatch a healthy decoder saw.
 *
 * The prompt and decoders 0-6 run in network namespace A, decoder 7 in C,
 * joined by a veth pair with addresses only inside them; without the
 * rights to make namespaces (root or CAP_NET_ADMIN) the run says so and
 * leaves the partition out.
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

/* ---- The orchestrator. ---- */

typedef struct {
    cli_node node;
    FILE *out; /* its replies, read by line (a dup of node.rep_fd) */
    fleet_role role;
    bool up;
} fleet_node;

static bool
fleet_send(fleet_node *n, const char *cmd)
{
    if (dprintf(n->node.cmd_fd, "%s\n", cmd) < 0) {
        cli_err("fleet: %s: cannot send \"%s\"", n->node.name, cmd);
        return false;
    }
    return true;
}

/* One reply line; true when it says OK (or READY). */
static bool
fleet_reply(fleet_node *n, char *reply, size_t cap)
{
    if (fgets(reply, (int)cap, n->out) == NULL) {
        cli_err("fleet: %s stopped answering", n->node.name);
        return false;
    }
    reply[strcspn(reply, "\n")] = '\0';
    if (strncmp(reply, "OK", 2) != 0 && strncmp(reply, "READY", 5) != 0) {
        cli_err("fleet: %s: %s", n->node.name, reply);
        return false;
    }
    return true;
}

static bool
fleet_cmd(fleet_node *n, const char *cmd, char *reply, size_t cap)
{
    return fleet_send(n, cmd) && fleet_reply(n, reply, cap);
}

/* Starts a node; its READY line (port, cache id) goes to reply. */
static bool
fleet_start(fleet_node *n, const char *name, const fleet_role *role,
            char *reply, size_t cap)
{
    n->role = *role;
    if (cli_node_start(&n->node, name, false, fleet_node_main, &n->role) != 0)
        return false;
    n->up = true;
    int fd = dup(n->node.rep_fd);
    n->out = fd < 0 ? NULL : fdopen(fd, "r");
    if (n->out == NULL) {
        if (fd >= 0)
            close(fd);
        return false;
    }
    return fleet_reply(n, reply, cap);
}

static void
fleet_stop(fleet_node *n)
{
    if (!n->up)
        return;
    kill(n->node.pid, SIGCONT); /* a stopped node must see its end */
    cli_node_stop(&n->node);
    if (n->out != NULL)
        fclose(n->out);
    n->up = false;
}

/* One phase's results for the five healthy decoders. */
typedef struct {
    double pull_p50, pull_p99, pull_max, push_p50, push_p99, push_max;
    uint64_t pulls, pushes, errors, mismatches, flooded;
    uint64_t push_fail[FLEET_N]; /* the prompt's failed pushes, by decoder */
} fleet_phase;

static int
fleet_cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;

    return (x > y) - (x < y);
}

/* The median over the healthy decoders of their p99 (each one's own). */
static double
fleet_median(double *v)
{
    qsort(v, FLEET_HEALTHY, sizeof(*v), fleet_cmp_double);
    return v[FLEET_HEALTHY / 2];
}

/* The prompt's per-decoder push results, "ok:failed:p50:p99:max:last". */
static bool
fleet_pushes(fleet_phase *ph, const char *reply, double *push99)
{
    const char *p = reply + 2;

    for (int i = 0; i < FLEET_N; i++) {
        unsigned long long ok, failed;
        double p50, p99, max;
        char last[48];
        int used = 0;
        if (sscanf(p, " %llu:%llu:%lf:%lf:%lf:%47s%n", &ok, &failed, &p50,
                   &p99, &max, last, &used) != 6 ||
            used == 0)
            return false;
        p += used;
        ph->push_fail[i] = failed;
        if (i >= FLEET_HEALTHY)
            continue;
        if (failed > 0)
            cli_err("fleet: %llu pushes to decoder %d failed (last: %s)",
                    failed, i, last);
        ph->pushes += ok;
        ph->errors += failed;
        push99[i] = p99;
        ph->push_p50 += p50 / FLEET_HEALTHY;
        ph->push_max = max > ph->push_max ? max : ph->push_max;
    }
    return true;
}

/*
 * One phase: the prompt pushes to the decoders in `mask`, the healthy ones
 * pull, and with `bad` the flooder floods.
 */
static bool
fleet_phase_run(fleet_node *prompt, fleet_node *decs, unsigned mask, bool bad,
                int64_t ms, fleet_phase *ph)
{
    char cmd[64], reply[FLEET_LINE];
    double pull99[FLEET_HEALTHY], push99[FLEET_HEALTHY];

    memset(ph, 0, sizeof(*ph));
    snprintf(cmd, sizeof(cmd), "push %lld %u", (long long)ms, mask);
    if (!fleet_send(prompt, cmd))
        return false;
    snprintf(cmd, sizeof(cmd), "pull %lld", (long long)ms);
    for (int i = 0; i < FLEET_HEALTHY; i++)
        if (!fleet_send(&decs[i], cmd))
            return false;
    snprintf(cmd, sizeof(cmd), "flood %lld", (long long)ms);
    if (bad && !fleet_send(&decs[FLEET_FLOOD], cmd))
        return false;
    for (int i = 0; i < FLEET_HEALTHY; i++) {
        unsigned long long ok, failed, mism, seen;
        double p50, p99, max;
        char last[48];
        if (!fleet_reply(&decs[i], reply, sizeof(reply)) ||
            sscanf(reply, "OK %llu %llu %llu %llu %lf %lf %lf %47s", &ok,
                   &failed, &mism, &seen, &p50, &p99, &max, last) != 8)
            return false;
        if (failed > 0 || mism > 0)
            cli_err("fleet: decoder %d: %llu pulls failed (last: %s), %llu "
                    "slots wrong",
                    i, failed, last, mism);
        ph->pulls += ok;
        ph->errors += failed;
        ph->mismatches += mism;
        pull99[i] = p99;
        ph->pull_p50 += p50 / FLEET_HEALTHY;
        ph->pull_max = max > ph->pull_max ? max : ph->pull_max;
    }
    if (bad) {
        if (!fleet_reply(&decs[FLEET_FLOOD], reply, sizeof(reply)))
            return false;
        ph->flooded = strtoull(reply + 3, NULL, 10);
    }
    if (!fleet_reply(prompt, reply, sizeof(reply)) ||
        !fleet_pushes(ph, reply, push99)) {
        cli_err("fleet: the prompt's results: %s", reply);
        return false;
    }
    ph->pull_p99 = fleet_median(pull99);
    ph->push_p99 = fleet_median(push99);
    return true;
}

static void
fleet_json(const char *path, uint64_t size, int64_t ms, int64_t wait_ms,
           bool cut, const fleet_phase *ph, bool ok)
{
    static const char *const names[2] = {"alone", "with_three_bad"};
    cJSON *root = cJSON_CreateObject();

    cJSON_AddStringToObject(root, "op", "fleet");
    cJSON_AddNumberToObject(root, "slot_bytes", (double)size);
    cJSON_AddNumberToObject(root, "phase_ms", (double)ms);
    cJSON_AddNumberToObject(root, "wait_ms", (double)wait_ms);
    cJSON_AddBoolToObject(root, "partition", cut);
    cJSON_AddBoolToObject(root, "healthy_ok", ok);
    for (int k = 0; k < 2; k++) {
        cJSON *o = cJSON_AddObjectToObject(root, names[k]);
        cJSON_AddNumberToObject(o, "pull_p50_us", ph[k].pull_p50);
        cJSON_AddNumberToObject(o, "pull_p99_us", ph[k].pull_p99);
        cJSON_AddNumberToObject(o, "pull_max_us", ph[k].pull_max);
        cJSON_AddNumberToObject(o, "push_p50_us", ph[k].push_p50);
        cJSON_AddNumberToObject(o, "push_p99_us", ph[k].push_p99);
        cJSON_AddNumberToObject(o, "push_max_us", ph[k].push_max);
        cJSON_AddNumberToObject(o, "pulls", (double)ph[k].pulls);
        cJSON_AddNumberToObject(o, "pushes", (double)ph[k].pushes);
        cJSON_AddNumberToObject(o, "errors", (double)ph[k].errors);
        cJSON_AddNumberToObject(o, "mismatches", (double)ph[k].mismatches);
        cJSON_AddNumberToObject(o, "notifications_flooded",
                                (double)ph[k].flooded);
        cJSON *f = cJSON_AddArrayToObject(o, "push_failures_by_decoder");
        for (int i = 0; i < FLEET_N; i++)
            cJSON_AddItemToArray(f,
                                 cJSON_CreateNumber((double)ph[k].push_fail[i]));
    }
    cJSON_AddNumberToObject(root, "pull_p99_ratio",
                            ph[1].pull_p99 / ph[0].pull_p99);
    cJSON_AddNumberToObject(root, "push_p99_ratio",
                            ph[1].push_p99 / ph[0].push_p99);
    char *text = cJSON_Print(root);
    FILE *f = fopen(path, "w");
    if (text == NULL || f == NULL || fputs(text, f) < 0)
        cli_err("--json: cannot write %s", path);
    if (f != NULL)
        fclose(f);
    free(text);
    cJSON_Delete(root);
}

static void
fleet_print(const char *label, const fleet_phase *ph)
{
    printf("%-28s %9.0f %9.0f %9.0f %9.0f %9.0f %9.0f %7" PRIu64 " %7" PRIu64
           "\n",
           label, ph->pull_p50, ph->pull_p99, ph->pull_max, ph->push_p50,
           ph->push_p99, ph->push_max, ph->errors, ph->mismatches);
}

int
bench_fleet(const bench_cfg *cfg)
{
    fleet_node prompt = {0}, decs[FLEET_N];
    fleet_phase ph[2], warm;
    char cmd[160], reply[FLEET_LINE], name[32];
    uint64_t size = cfg->bmin;
    int64_t ms = cfg->min_time_ms > BENCH_MIN_TIME_MS ? cfg->min_time_ms : 3000;
    int64_t wait_ms = fleet_wait_ms(cfg);
    unsigned port;
    long long src;
    bool ok = false;

    memset(decs, 0, sizeof(decs));
    bool cut = fleet_ns_up();
    printf("llmdd bench: op fleet, transport %s, 1 prompt and %d decoders "
           "(processes); a %s slot (2 tensors) pulled and pushed every %d ms "
           "per healthy decoder, %lld ms a phase, wait time %d ms, "
           "heartbeats off\n",
           cfg->lo.transport, FLEET_N, cli_fmt_bytes(name, sizeof(name), size),
           FLEET_PERIOD_MS, (long long)ms, (int)wait_ms);
    if (!cut)
        printf("  (no network namespaces: root or CAP_NET_ADMIN is needed; "
               "decoder %d is not cut off)\n",
               FLEET_CUT);
    fleet_role role = {.cfg = cfg,
                       .index = -1,
                       .netns = cut ? fleet_ns_a : NULL,
                       .size = size};
    if (!fleet_start(&prompt, "prompt", &role, reply, sizeof(reply)) ||
        sscanf(reply, "READY %u %lld", &port, &src) != 2)
        goto out;
    const char *ip = cut ? FLEET_NET "1" : "127.0.0.1";
    for (int i = 0; i < FLEET_N; i++) {
        role.index = i;
        role.netns = !cut ? NULL : i == FLEET_CUT ? fleet_ns_c : fleet_ns_a;
        snprintf(name, sizeof(name), "decoder %d", i);
        snprintf(cmd, sizeof(cmd), "link %s %u %lld", ip, port, src);
        if (!fleet_start(&decs[i], name, &role, reply, sizeof(reply)) ||
            !fleet_cmd(&decs[i], cmd, reply, sizeof(reply)))
            goto out;
    }
    /* The warm-up pushes to all eight: a post asks the peer to describe a
     * cache it has not seen yet, and waits for the answer (a stopped peer
     * would hold the prompt's loop for the wait time). */
    if (!fleet_cmd(&prompt, "targets", reply, sizeof(reply)) ||
        !fleet_phase_run(&prompt, decs, 0xffu, false, 500, &warm) ||
        !fleet_phase_run(&prompt, decs, (1u << FLEET_HEALTHY) - 1, false, ms,
                         &ph[0]))
        goto out;
    kill(decs[FLEET_STOPPED].node.pid, SIGSTOP);
    if (cut)
        fleet_run((const char *[]){"ip", "-n", fleet_ns_c, "link", "set",
                                   fleet_veth_c, "down", NULL});
    if (!fleet_phase_run(&prompt, decs, 0xffu, true, ms, &ph[1]))
        goto out;

    double wait_us = (double)wait_ms * 1e3;
    ok = true;
    for (int k = 0; k < 2; k++)
        ok = ok && ph[k].errors == 0 && ph[k].mismatches == 0 &&
             ph[k].pull_max < wait_us && ph[k].push_max < wait_us;
    printf("\nhealthy decoders (0-%d), us  pull p50  pull p99  pull max  "
           "push p50  push p99  push max  errors  wrong\n",
           FLEET_HEALTHY - 1);
    fleet_print("alone", &ph[0]);
    fleet_print("beside the three (5-7)", &ph[1]);
    printf("p99 with the three / alone: pulls %.2fx, pushes %.2fx "
           "(p99: the median over the five decoders of each one's p99)\n",
           ph[1].pull_p99 / ph[0].pull_p99, ph[1].push_p99 / ph[0].push_p99);
    printf("the three: the prompt's pushes failed or were still in flight at "
           "the end (LLM_WAIT_PROC_TIMEOUT): %" PRIu64 " (stopped), %" PRIu64
           " (flooding, %" PRIu64 " notifications sent), %" PRIu64 " (%s)\n",
           ph[1].push_fail[FLEET_STOPPED], ph[1].push_fail[FLEET_FLOOD],
           ph[1].flooded, ph[1].push_fail[FLEET_CUT],
           cut ? "cut off" : "not cut off here");
    printf("%s\n", ok ? "healthy decoders: no error, no wrong byte, every "
                        "request within the wait time"
                      : "FAILED: a healthy decoder saw an error, a wrong "
                        "byte or a request past the wait time");
    if (cfg->json != NULL)
        fleet_json(cfg->json, size, ms, wait_ms, cut, ph, ok);
out:
    for (int i = 0; i < FLEET_N; i++)
        fleet_stop(&decs[i]);
    fleet_stop(&prompt);
    fleet_ns_down();
    return ok ? CLI_EXIT_OK : CLI_EXIT_FAIL;
}
