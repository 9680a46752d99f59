/*
 * llmdd demo: a prompt and a decoder instance, each in its own process (or
 * both in this one for the loop transport), with caches shaped like a real
 * model. The decoder links, pulls a batch slot, a layer range and a set of
 * paged blocks; the prompt pushes a slot back over the same link, then
 * streams another layer by layer as it "computes" it, with a notification
 * the decoder waits for. Every transferred byte is checked against the
 * deterministic fill.
 */
#include <inttypes.h>
#include <poll.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "demo.h"

static const char demo_usage[] =
    "Usage: llmdd demo [options]\n"
    "\n"
    "Starts a prompt and a decoder process on loopback with KV caches shaped\n"
    "like a real model (default: Llama-3-8B, 32 layers x K,V, bf16, 8 KV\n"
    "heads x 128 dims, 4 slots x 128 tokens = 64 MiB per cache), fills the\n"
    "prompt's caches with a deterministic pattern, then: the decoder links,\n"
    "pulls a whole batch slot, a layer range and a set of paged blocks; the\n"
    "prompt pushes one slot into the decoder over that link, then streams\n"
    "another layer by layer (LLMDD_XFER_LAYERWISE: each layer moves once\n"
    "the prompt has written it) with a notification the decoder waits for\n"
    "(llmdd_notify_fd, llmdd_get_notifies). Every byte is verified with a\n"
    "checksum. Exits 0 only if everything verified.\n"
    "\n"
    "Options:\n"
    "  -t, --transport NAME  auto (default), loop, shm, tcp, ucx. auto picks\n"
    "                        the fastest transport that reaches the peer.\n"
    "                        loop only reaches an instance in the same\n"
    "                        process, so with loop both instances run in\n"
    "                        this one process (two threads)\n"
    CLI_SHAPE_HELP
    "      --seed N          pattern seed (default 1)\n"
    "      --timeout MS      link timeout (default 5000)\n"
    "  -o, --option K=V      extra llmdd option for both instances\n"
    "                        (e.g. -o llm.AuthToken=secret); see `llmdd info`\n"
    "  -h, --help            this text\n";

/* ---- The orchestrating parent. ---- */

/*
 * Sends a command (none: just the READY message) and waits for the answer,
 * at most timeout_ms: every library call in a node is bounded by the link
 * timeout or llm.SyncKvCacheWaitTime, so a node silent for longer is stuck.
 */
static bool
demo_call(cli_node *node, const demo_cmd *c, demo_reply *r, int timeout_ms)
{
    uint32_t type;
    void *p = NULL;
    size_t len;

    if (c != NULL &&
        cli_msg_send(node->cmd_fd, c->op, c, sizeof(*c), NULL, 0) != 0) {
        cli_err("the %s node stopped answering", node->name);
        return false;
    }
    if (cli_node_wait(node, timeout_ms) == 0) {
        cli_err("the %s node did not answer within %d s: a library call "
                "is stuck; giving up",
                node->name, timeout_ms / 1000);
        cli_node_kill(node);
        return false;
    }
    if (cli_msg_recv(node->rep_fd, &type, &p, &len) != 0 || len != sizeof(*r)) {
        free(p);
        cli_err("the %s node stopped answering", node->name);
        return false;
    }
    memcpy(r, p, sizeof(*r));
    free(p);
    return true;
}

typedef struct {
    char name[64];
    demo_reply r;
    bool moved;     /* a transfer (counts toward "all verified") */
    const char *by; /* the node that ran it */
} demo_row;

#define DEMO_MAX_ROWS 10 /* the steps add 8 */

static void
demo_print(const demo_row *rows, size_t n)
{
    char b[32], t[32], g[32];

    printf("\n%-40s %10s %10s %8s  %s\n", "operation", "bytes", "time", "GB/s",
           "verified");
    for (size_t i = 0; i < n; i++) {
        const demo_reply *r = &rows[i].r;
        if (rows[i].moved)
            snprintf(g, sizeof(g), "%.2f", cli_gbps(r->bytes, r->ns));
        else
            snprintf(g, sizeof(g), "-");
        printf("%-40s %10s %10s %8s  %s\n", rows[i].name,
               rows[i].moved ? cli_fmt_bytes(b, sizeof(b), r->bytes) : "-",
               cli_fmt_ns(t, sizeof(t), r->ns), g,
               r->status != LLM_SUCCESS ? llmdd_status_str(r->status)
               : r->verified == 1       ? "yes"
               : r->verified == 0       ? "NO"
                                        : "-");
    }
}

/* ---- The steps. ---- */

/* What the steps share: the nodes, their caches and the rows so far. */
typedef struct {
    const demo_cfg *cfg;
    cli_node *prompt, *decoder;
    demo_reply pr, dr; /* the nodes' setup: port, cache ids */
    uint32_t kv_seed, paged_seed;
    int op_ms;
    demo_row rows[DEMO_MAX_ROWS];
    size_t nrows;
} demo_run;

static demo_row *demo_row_add(demo_run *d, const cli_node *by, bool moved,
                              const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));

static demo_row *
demo_row_add(demo_run *d, const cli_node *by, bool moved, const char *fmt, ...)
{
    demo_row *row = &d->rows[d->nrows++];
    va_list ap;

    va_start(ap, fmt);
    vsnprintf(row->name, sizeof(row->name), fmt, ap);
    va_end(ap);
    row->moved = moved;
    row->by = by->name;
    return row;
}

static bool
demo_link(demo_run *d)
{
    demo_cmd c = {.op = DM_LINK, .port = d->pr.port};
    demo_row *row =
        demo_row_add(d, d->decoder, false, "link decoder -> prompt");

    return demo_call(d->decoder, &c, &row->r, d->op_ms);
}

/*
 * A whole batch slot, twice: the link's first transfer pays what a fresh
 * link pays once (connections, the remote cache's description, first
 * touches), so the demo labels it cold and shows the same pull warm.
 */
static bool
demo_pull_slot_at(demo_run *d, bool warm)
{
    const cli_shape *s = &d->cfg->shape;
    demo_cmd c = {.op = DM_PULL_SLOT,
                  .remote_cache = d->pr.kv_id,
                  .remote_seed = d->kv_seed,
                  .src_slot = 1 % s->batch,
                  .dst_slot = 0};
    demo_row *row = demo_row_add(
        d, d->decoder, true, "pull slot %" PRIu32 " -> %" PRIu32 ", %s",
        c.src_slot, c.dst_slot,
        warm ? "again (warm)" : "cold (the link's first)");

    return demo_call(d->decoder, &c, &row->r, d->op_ms);
}

static bool
demo_pull_slot(demo_run *d)
{
    return demo_pull_slot_at(d, false);
}

static bool
demo_pull_slot_warm(demo_run *d)
{
    return demo_pull_slot_at(d, true);
}

/* The second quarter of the layers. */
static bool
demo_pull_layers(demo_run *d)
{
    const cli_shape *s = &d->cfg->shape;
    uint32_t L = s->layers;
    int32_t first = (int32_t)(L / 4);
    int32_t last = (int32_t)(L / 2 > 0 ? L / 2 - 1 : 0);

    if (last < first)
        last = first;
    demo_cmd c = {.op = DM_PULL_LAYERS,
                  .remote_cache = d->pr.kv_id,
                  .remote_seed = d->kv_seed,
                  .src_slot = 2 % s->batch,
                  .dst_slot = 2 % s->batch,
                  .first_layer = first,
                  .last_layer = last};
    demo_row *row =
        demo_row_add(d, d->decoder, true,
                     "pull layers %" PRId32 "-%" PRId32 " of slot %" PRIu32,
                     first, last, c.src_slot);

    return demo_call(d->decoder, &c, &row->r, d->op_ms);
}

/* Paged blocks, scattered on the prompt, into a fresh block table. */
static bool
demo_pull_blocks(demo_run *d)
{
    llmdd_cache_desc paged = cli_shape_paged(&d->cfg->shape);
    uint64_t nb = (uint64_t)paged.shape[0];
    demo_cmd c = {.op = DM_PULL_BLOCKS,
                  .remote_cache = d->pr.paged_id,
                  .remote_seed = d->paged_seed};

    c.nblocks = (uint32_t)(nb / 2 > DEMO_MAX_BLOCKS ? DEMO_MAX_BLOCKS
                           : nb / 2 > 0             ? nb / 2
                                                    : 1);
    cli_pick_blocks(nb, c.nblocks, c.src_blocks, c.dst_blocks);
    demo_row *row =
        demo_row_add(d, d->decoder, true,
                     "pull %" PRIu32 " paged blocks (scattered)", c.nblocks);
    return demo_call(d->decoder, &c, &row->r, d->op_ms);
}

/* The prompt pushes a slot into the decoder over the same link; the
 * decoder checks it. */
static bool
demo_push(demo_run *d)
{
    const cli_shape *s = &d->cfg->shape;
    demo_cmd c = {.op = DM_PUSH,
                  .remote_cache = d->dr.kv_id,
                  .src_slot = 3 % s->batch,
                  .dst_slot = 3 % s->batch};
    demo_row *row =
        demo_row_add(d, d->prompt, true,
                     "push slot %" PRIu32 " -> %" PRIu32 " (prompt -> decoder)",
                     c.src_slot, c.dst_slot);
    demo_reply *push = &row->r, vr;

    if (!demo_call(d->prompt, &c, push, d->op_ms))
        return false;
    if (push->status != LLM_SUCCESS)
        return true;
    c.op = DM_VERIFY_SLOT;
    c.remote_seed = d->kv_seed;
    if (!demo_call(d->decoder, &c, &vr, d->op_ms))
        return false;
    push->verified = vr.verified;
    push->sum = vr.sum;
    memcpy(push->err, vr.err, sizeof(vr.err));
    if (vr.status != LLM_SUCCESS)
        push->status = vr.status;
    return true;
}

/*
 * A layer-streamed push with a notification: the decoder waits for it (as
 * it would in its event loop) while the prompt computes and marks each
 * layer.
 */
static bool
demo_push_layerwise(demo_run *d)
{
    const cli_shape *s = &d->cfg->shape;
    demo_cmd c = {.op = DM_WAIT_NOTIFY,
                  .remote_cache = d->dr.kv_id,
                  .remote_seed = d->kv_seed,
                  .src_slot = 0,
                  .dst_slot = 1 % s->batch};

    snprintf(c.note, sizeof(c.note),
             "slot %" PRIu32 " of cache %" PRId64 ": %" PRIu32 " layers",
             c.dst_slot, d->dr.kv_id, s->layers);
    if (cli_msg_send(d->decoder->cmd_fd, c.op, &c, sizeof(c), NULL, 0) != 0) {
        cli_err("the decoder node stopped answering");
        return false;
    }
    c.op = DM_PUSH_LAYERWISE;
    demo_reply *lw =
        &demo_row_add(d, d->prompt, true,
                      "push slot %" PRIu32 " -> %" PRIu32 " layer by layer",
                      c.src_slot, c.dst_slot)
             ->r;
    if (!demo_call(d->prompt, &c, lw, d->op_ms))
        return false;
    demo_reply *nr =
        &demo_row_add(d, d->decoder, false, "decoder: notify_fd, get_notifies")
             ->r;
    if (!demo_call(d->decoder, NULL, nr, d->op_ms))
        return false;
    if (lw->status == LLM_SUCCESS) {
        lw->verified = nr->verified;
        lw->sum = nr->sum;
        if (nr->status != LLM_SUCCESS || nr->verified != 1)
            memcpy(lw->err, nr->err, sizeof(nr->err));
    }
    printf("  notification: \"%s\"\n", c.note);
    return true;
}

static bool
demo_unlink(demo_run *d)
{
    demo_cmd c = {.op = DM_UNLINK, .port = d->pr.port};
    demo_row *row = demo_row_add(d, d->decoder, false, "unlink");

    return demo_call(d->decoder, &c, &row->r, d->op_ms);
}

/*
 * The demo, in order. A step adds its rows to the table; it returns false
 * only when a node stopped answering. A required step that failed ends the
 * demo: nothing after it can work.
 */
static const struct {
    const char *name;
    bool (*fn)(demo_run *d);
    bool required;
} demo_steps[] = {
    {"link", demo_link, true},
    {"pull a batch slot", demo_pull_slot, false},
    {"pull it again", demo_pull_slot_warm, false},
    {"pull a layer range", demo_pull_layers, false},
    {"pull paged blocks", demo_pull_blocks, false},
    {"push a slot", demo_push, false},
    {"push layer by layer", demo_push_layerwise, false},
    {"unlink", demo_unlink, false},
};

static int
demo_parse(demo_cfg *cfg, int argc, char **argv)
{
    static const struct option longopts[] = {
        {"layers", required_argument, NULL, CLI_OPT_LAYERS},
        {NULL, 0, NULL, 0},
    };
    const cli_args a = {.usage = demo_usage,
                        .lo = &cfg->lo,
                        .shape = &cfg->shape,
                        .seed = &cfg->seed,
                        .timeout_ms = &cfg->timeout_ms};
    int rc = cli_args_parse(&a, longopts, NULL, NULL, NULL, argc, argv);

    if (rc != 0)
        return rc;
    if (!cli_shape_check(&cfg->shape))
        return CLI_EXIT_USAGE;
    return 0;
}

int
cli_demo(int argc, char **argv)
{
    demo_cfg cfg;
    cli_node prompt = {.cmd_fd = -1, .rep_fd = -1};
    cli_node decoder = {.cmd_fd = -1, .rep_fd = -1};
    demo_run d = {.cfg = &cfg, .prompt = &prompt, .decoder = &decoder};
    demo_reply *pr = &d.pr, *dr = &d.dr;
    char b1[32], b2[32], b3[32], desc[96];
    int rc = CLI_EXIT_FAIL;

    cli_lib_opts_init(&cfg.lo);
    cli_shape_default(&cfg.shape);
    cfg.seed = CLI_DEFAULT_SEED;
    cfg.timeout_ms = CLI_LINK_TIMEOUT_MS;
    int prc = demo_parse(&cfg, argc, argv);
    if (prc != 0) {
        cli_lib_opts_fini(&cfg.lo);
        return prc < 0 ? CLI_EXIT_OK : prc;
    }

    const cli_shape *s = &cfg.shape;
    llmdd_cache_desc kv = cli_shape_kv(s), paged = cli_shape_paged(s);
    uint64_t stride = cli_desc_stride(&kv);
    uint64_t nb = (uint64_t)paged.shape[0];
    bool threaded = strcmp(cfg.lo.transport, "loop") == 0;
    uint64_t cache_bytes =
        (cli_desc_tensor_size(&kv) + cli_desc_tensor_size(&paged)) *
        kv.num_tensors;
    /* Both processes hold a KV and a paged cache. */
    if (!cli_memory_fits(2 * cache_bytes,
                         "lower --tokens or --batch, or pick a smaller "
                         "--model")) {
        rc = CLI_EXIT_USAGE;
        goto out;
    }
    printf("llmdd demo: %s KV layout, %" PRIu32 " layers x (K,V) = %" PRIu32
           " tensors of %s\n",
           s->model, s->layers, kv.num_tensors,
           cli_fmt_desc(desc, sizeof(desc), &kv));
    printf("  KV cache %s (%s per batch slot); paged cache %" PRIu64
           " blocks of %" PRIu32 " tokens (%s per block)\n",
           cli_fmt_bytes(b1, sizeof(b1),
                         cli_desc_tensor_size(&kv) * kv.num_tensors),
           cli_fmt_bytes(b2, sizeof(b2), stride * kv.num_tensors), nb,
           s->block_tokens,
           cli_fmt_bytes(b3, sizeof(b3),
                         cli_desc_stride(&paged) * paged.num_tensors));
    printf("  transport %s (%s%s); %s\n", cfg.lo.transport,
           strcmp(cfg.lo.transport, "auto") == 0
               ? "the first of these that reaches the peer: "
               : "built in: ",
           llmdd_transport_list(),
           threaded ? "prompt and decoder are two instances in this process"
                    : "prompt and decoder are separate processes");

    /* Setting up fills the caches (about 1 GB/s at worst); an operation
     * is one library call bounded by the link or the transfer timeout. */
    int setup_ms = 60000 + (int)(cache_bytes >> 20) * 4;
    d.op_ms = cfg.timeout_ms + atoi(CLI_WAIT_MS) + 30000;
    demo_role prole = {.cfg = &cfg, .prompt = true};
    demo_role drole = {.cfg = &cfg, .prompt = false};
    if (cli_node_start(&prompt, "prompt", threaded, demo_node_main, &prole) !=
            0 ||
        !demo_call(&prompt, NULL, pr, setup_ms))
        goto out;
    if (pr->status != LLM_SUCCESS) {
        cli_err("prompt: %s", pr->err);
        goto out;
    }
    printf("  prompt: cluster %d, listening on 127.0.0.1:%u, KV cache %" PRId64
           ", paged cache %" PRId64 ", filled %s in %s\n",
           DEMO_PROMPT_ID, pr->port, pr->kv_id, pr->paged_id,
           cli_fmt_bytes(b1, sizeof(b1), pr->bytes),
           cli_fmt_ns(b2, sizeof(b2), pr->ns));
    if (cli_node_start(&decoder, "decoder", threaded, demo_node_main, &drole) !=
            0 ||
        !demo_call(&decoder, NULL, dr, setup_ms))
        goto out;
    if (dr->status != LLM_SUCCESS) {
        cli_err("decoder: %s", dr->err);
        goto out;
    }
    printf("  decoder: cluster %d, KV cache %" PRId64 ", paged cache %" PRId64
           ", first-touched %s in %s\n",
           DEMO_DECODER_ID, dr->kv_id, dr->paged_id,
           cli_fmt_bytes(b1, sizeof(b1), dr->bytes),
           cli_fmt_ns(b2, sizeof(b2), dr->ns));
    fflush(stdout);

    d.kv_seed = cli_cache_seed(cfg.seed, pr->kv_id);
    d.paged_seed = cli_cache_seed(cfg.seed, pr->paged_id);
    for (size_t i = 0; i < sizeof(demo_steps) / sizeof(demo_steps[0]); i++) {
        if (!demo_steps[i].fn(&d)) {
            cli_err("stopped at step %zu, %s", i + 1, demo_steps[i].name);
            goto out;
        }
        const demo_row *last = &d.rows[d.nrows - 1];
        if (demo_steps[i].required && last->r.status != LLM_SUCCESS) {
            demo_print(d.rows, d.nrows);
            cli_err("%s: %s", last->by, last->r.err);
            goto out;
        }
    }

    demo_print(d.rows, d.nrows);
    if (d.nrows > 1 && d.rows[1].r.transport[0] != '\0')
        printf("\ntransport: %s%s\n", d.rows[1].r.transport,
               strcmp(cfg.lo.transport, "auto") == 0
                   ? " (what auto chose for this peer)"
                   : "");
    bool ok = true;
    uint64_t moved = 0;
    for (size_t i = 0; i < d.nrows; i++) {
        const demo_row *row = &d.rows[i];
        const demo_reply *r = &row->r;
        if (r->status != LLM_SUCCESS || (row->moved && r->verified != 1)) {
            ok = false;
            cli_err("%s: %s", row->name, r->err);
        }
        if (row->moved)
            moved += r->bytes;
    }
    if (ok) {
        printf("\nOK: every transfer verified (%s moved; checksums match "
               "the deterministic fill).\n",
               cli_fmt_bytes(b1, sizeof(b1), moved));
        rc = CLI_EXIT_OK;
    } else {
        printf("\nFAILED: see the errors above.\n");
    }
out:
    fflush(stdout);
    if (cli_node_stop(&decoder) != 0 && rc == CLI_EXIT_OK)
        rc = CLI_EXIT_FAIL;
    if (cli_node_stop(&prompt) != 0 && rc == CLI_EXIT_OK)
        rc = CLI_EXIT_FAIL;
    cli_lib_opts_fini(&cfg.lo);
    return rc;
}
