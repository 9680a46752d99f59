/*
 * llmdd demo (demo.c): a node, the prompt or the decoder, doing what the
 * parent asks and checking every byte it receives.
 */
#include <inttypes.h>
#include <poll.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "demo.h"

/* ---- The nodes. ---- */

static void
demo_fail(demo_reply *r, llmdd_status st, const char *what)
{
    r->status = st;
    cli_fmt_st(r->err, sizeof(r->err), st, "%s", what);
}

static void
demo_check(demo_reply *r, const cli_seg *segs, size_t n, uint32_t seed)
{
    cli_verdict v;

    cli_verify(segs, n, seed, &v);
    r->sum = v.got;
    r->verified = v.ok ? 1 : 0;
    if (!v.ok)
        snprintf(r->err, sizeof(r->err),
                 "checksum 0x%016" PRIx64 " of what arrived != 0x%016" PRIx64
                 " of what was sent; first wrong byte: source tensor %" PRIu32
                 " offset %" PRIu64,
                 v.got, v.want, segs[v.bad_seg].src_tensor,
                 segs[v.bad_seg].src_off + v.bad_off);
}

static void
demo_setup(demo_node *n, demo_reply *r)
{
    const demo_cfg *cfg = n->cfg;
    llmdd_cache_desc kv = cli_shape_kv(&cfg->shape);
    llmdd_cache_desc paged = cli_shape_paged(&cfg->shape);
    llmdd_status st;
    uint16_t port = 0;

    st = cli_instance(n->prompt ? DEMO_PROMPT_ID : DEMO_DECODER_ID,
                      n->prompt ? LLMDD_ROLE_PROMPT : LLMDD_ROLE_DECODER,
                      &cfg->lo, n->prompt ? "127.0.0.1" : NULL, &port, &n->dd,
                      r->err, sizeof(r->err));
    if (st != LLM_SUCCESS) {
        r->status = st;
        return;
    }
    if ((st = llmdd_allocate_cache(n->dd, &kv, &n->kv)) != LLM_SUCCESS) {
        demo_fail(r, st, "llmdd_allocate_cache(KV cache)");
        return;
    }
    n->have_kv = true;
    if ((st = llmdd_allocate_cache(n->dd, &paged, &n->paged)) != LLM_SUCCESS) {
        demo_fail(r, st, "llmdd_allocate_cache(paged cache)");
        return;
    }
    n->have_paged = true;
    if (n->prompt) {
        int64_t t0 = cli_now_ns();
        cli_fill_cache(&n->kv, cli_cache_seed(cfg->seed, n->kv.cache_id));
        cli_fill_cache(&n->paged, cli_cache_seed(cfg->seed, n->paged.cache_id));
        r->ns = cli_now_ns() - t0;
        r->bytes = cli_desc_tensor_size(&kv) * kv.num_tensors +
                   cli_desc_tensor_size(&paged) * paged.num_tensors;
    } else {
        /* A serving decoder allocates its caches once and reuses them, so
         * the first write's page faults are not part of a transfer. */
        int64_t t0 = cli_now_ns();
        for (uint32_t t = 0; t < kv.num_tensors; t++) {
            memset((void *)(uintptr_t)n->kv.tensor_addrs[t], 0,
                   cli_desc_tensor_size(&kv));
            memset((void *)(uintptr_t)n->paged.tensor_addrs[t], 0,
                   cli_desc_tensor_size(&paged));
        }
        r->ns = cli_now_ns() - t0;
        r->bytes = cli_desc_tensor_size(&kv) * kv.num_tensors +
                   cli_desc_tensor_size(&paged) * paged.num_tensors;
    }
    r->port = port;
    r->kv_id = n->kv.cache_id;
    r->paged_id = n->paged.cache_id;
}

static void
demo_do(demo_node *n, const demo_cmd *c, demo_reply *r)
{
    const demo_cfg *cfg = n->cfg;
    uint64_t stride = cli_desc_stride(&n->kv.desc);
    uint32_t nt = n->kv.desc.num_tensors;
    llmdd_cache_index idx = {.cluster_id =
                                 n->prompt ? DEMO_DECODER_ID : DEMO_PROMPT_ID,
                             .cache_id = c->remote_cache,
                             .batch_index = c->src_slot};
    cli_seg *segs = NULL;
    size_t nsegs = 0;
    llmdd_status st = LLM_SUCCESS;
    char what[128];
    int64_t t0 = cli_now_ns();

    r->verified = -1;
    switch (c->op) {
    case DM_LINK:
        st = cli_link(n->dd, DEMO_PROMPT_ID, "127.0.0.1", c->port,
                      cfg->timeout_ms, r->err, sizeof(r->err));
        r->ns = cli_now_ns() - t0;
        r->status = st;
        return;
    case DM_UNLINK:
        st = cli_unlink(n->dd, DEMO_PROMPT_ID, "127.0.0.1", c->port,
                        cfg->timeout_ms, r->err, sizeof(r->err));
        r->ns = cli_now_ns() - t0;
        r->status = st;
        return;
    case DM_PULL_SLOT:
        st = llmdd_pull_kv_cache(n->dd, &idx, &n->kv, c->dst_slot, -1, NULL);
        r->ns = cli_now_ns() - t0;
        cli_transport_used(n->dd, r->transport, sizeof(r->transport));
        snprintf(what, sizeof(what),
                 "llmdd_pull_kv_cache(slot %" PRIu32 " -> %" PRIu32 ")",
                 c->src_slot, c->dst_slot);
        r->bytes = stride * nt;
        if (st == LLM_SUCCESS &&
            !cli_segs_slot(&n->kv, 0, 0, nt, c->dst_slot * stride,
                           c->src_slot * stride, stride, &segs, &nsegs))
            st = LLM_OUT_OF_MEMORY;
        break;
    case DM_PULL_LAYERS: {
        llmdd_kv_ext_param ext = {{c->first_layer, c->last_layer},
                                  {c->first_layer, c->last_layer},
                                  2};
        uint32_t first = 2 * (uint32_t)c->first_layer;
        uint32_t count = 2 * (uint32_t)(c->last_layer - c->first_layer + 1);
        st = llmdd_pull_kv_cache(n->dd, &idx, &n->kv, c->dst_slot, -1, &ext);
        r->ns = cli_now_ns() - t0;
        snprintf(what, sizeof(what),
                 "llmdd_pull_kv_cache(layers %" PRId32 "-%" PRId32 ")",
                 c->first_layer, c->last_layer);
        r->bytes = stride * count;
        if (st == LLM_SUCCESS &&
            !cli_segs_slot(&n->kv, first, first, count, c->dst_slot * stride,
                           c->src_slot * stride, stride, &segs, &nsegs))
            st = LLM_OUT_OF_MEMORY;
        break;
    }
    case DM_PULL_BLOCKS:
        idx.batch_index = 0;
        st = llmdd_pull_kv_blocks(n->dd, &idx, &n->paged, c->src_blocks,
                                  c->dst_blocks, c->nblocks, NULL);
        r->ns = cli_now_ns() - t0;
        snprintf(what, sizeof(what), "llmdd_pull_kv_blocks(%" PRIu32 " blocks)",
                 c->nblocks);
        r->bytes = cli_desc_stride(&n->paged.desc) * c->nblocks * nt;
        if (st == LLM_SUCCESS &&
            !cli_segs_blocks(&n->paged, c->src_blocks, c->dst_blocks,
                             c->nblocks, &segs, &nsegs))
            st = LLM_OUT_OF_MEMORY;
        break;
    case DM_PUSH: {
        llmdd_cache_index dst = {.cluster_id = DEMO_DECODER_ID,
                                 .cache_id = c->remote_cache,
                                 .batch_index = c->dst_slot};
        st = llmdd_push_kv_cache(n->dd, &n->kv, &dst, c->src_slot, -1, NULL);
        r->ns = cli_now_ns() - t0;
        r->bytes = stride * nt;
        if (st != LLM_SUCCESS)
            demo_fail(r, st, "llmdd_push_kv_cache");
        return;
    }
    case DM_PUSH_LAYERWISE: {
        /* The slot is "computed" layer by layer: it starts zeroed and each
         * layer gets its bytes just before it is marked, so a layer that
         * moved early would arrive as zeros. */
        llmdd_cache_index dst = {.cluster_id = DEMO_DECODER_ID,
                                 .cache_id = c->remote_cache,
                                 .batch_index = c->dst_slot};
        llmdd_xfer_opts o = {.flags = LLMDD_XFER_LAYERWISE,
                             .notify = c->note,
                             .notify_len = strlen(c->note)};
        uint32_t seed = cli_cache_seed(cfg->seed, n->kv.cache_id);
        uint64_t off = c->src_slot * stride;
        llmdd_request *req;
        for (uint32_t t = 0; t < nt; t++)
            memset((uint8_t *)(uintptr_t)n->kv.tensor_addrs[t] + off, 0,
                   stride);
        t0 = cli_now_ns();
        st = llmdd_push_kv_cache_async(n->dd, &n->kv, &dst, c->src_slot, -1,
                                       NULL, &o, &req);
        if (st != LLM_SUCCESS) {
            demo_fail(r, st, "llmdd_push_kv_cache_async(LLMDD_XFER_LAYERWISE)");
            return;
        }
        for (uint32_t l = 0; l < nt / 2 && st == LLM_SUCCESS; l++) {
            for (uint32_t t = 2 * l; t < 2 * l + 2; t++)
                cli_fill((uint8_t *)(uintptr_t)n->kv.tensor_addrs[t] + off,
                         stride, seed, t, off);
            st = llmdd_request_layer_ready(req, l);
        }
        if (st == LLM_SUCCESS)
            st = llmdd_request_wait(req, -1);
        llmdd_request_free(req);
        r->ns = cli_now_ns() - t0;
        r->bytes = stride * nt;
        if (st != LLM_SUCCESS)
            demo_fail(r, st, "layer-wise push");
        return;
    }
    case DM_WAIT_NOTIFY: {
        /* Readable once a notification waits; it comes after the bytes. */
        struct pollfd pfd = {.fd = llmdd_notify_fd(n->dd), .events = POLLIN};
        int wait_ms = cfg->timeout_ms + atoi(CLI_WAIT_MS);
        llmdd_notify *note = calloc(1, sizeof(*note));
        size_t count = 0;
        if (note == NULL) {
            demo_fail(r, LLM_OUT_OF_MEMORY, "calloc");
            return;
        }
        int k = poll(&pfd, 1, wait_ms);
        r->ns = cli_now_ns() - t0;
        if (k != 1) {
            demo_fail(r, LLM_WAIT_PROC_TIMEOUT, "poll(llmdd_notify_fd)");
        } else if ((st = llmdd_get_notifies(n->dd, note, 1, &count)) !=
                   LLM_SUCCESS) {
            demo_fail(r, st, "llmdd_get_notifies");
        } else if (count != 1 || note->cluster_id != DEMO_PROMPT_ID ||
                   note->len != strlen(c->note) ||
                   memcmp(note->msg, c->note, note->len) != 0) {
            r->status = LLM_FAILED;
            snprintf(r->err, sizeof(r->err),
                     "notification: %zu received, from cluster %" PRIu64
                     ", \"%.*s\"; want one from cluster %d, \"%s\"",
                     count, count > 0 ? note->cluster_id : 0,
                     count > 0 ? (int)(note->len < 64 ? note->len : 64) : 0,
                     (const char *)note->msg, DEMO_PROMPT_ID, c->note);
        } else if (!cli_segs_slot(&n->kv, 0, 0, nt, c->dst_slot * stride,
                                  c->src_slot * stride, stride, &segs,
                                  &nsegs)) {
            demo_fail(r, LLM_OUT_OF_MEMORY, "verify");
        } else {
            /* Every byte is checked the moment the notification is in. */
            demo_check(r, segs, nsegs, c->remote_seed);
            r->bytes = stride * nt;
            free(segs);
        }
        free(note);
        return;
    }
    case DM_VERIFY_SLOT:
        if (!cli_segs_slot(&n->kv, 0, 0, nt, c->dst_slot * stride,
                           c->src_slot * stride, stride, &segs, &nsegs)) {
            demo_fail(r, LLM_OUT_OF_MEMORY, "verify");
            return;
        }
        demo_check(r, segs, nsegs, c->remote_seed);
        free(segs);
        return;
    default:
        demo_fail(r, LLM_PARAM_INVALID, "unknown command");
        return;
    }
    if (st != LLM_SUCCESS)
        demo_fail(r, st, what);
    else
        demo_check(r, segs, nsegs, c->remote_seed);
    free(segs);
}

int
demo_node_main(void *arg, int in_fd, int out_fd)
{
    const demo_role *role = arg;
    demo_node n = {.cfg = role->cfg, .prompt = role->prompt};
    demo_reply *r = calloc(1, sizeof(*r));
    int rc = CLI_EXIT_FAIL;

    if (r == NULL)
        return CLI_EXIT_FAIL;
    demo_setup(&n, r);
    if (cli_msg_send(out_fd, DM_READY, r, sizeof(*r), NULL, 0) != 0 ||
        r->status != LLM_SUCCESS)
        goto out;
    for (;;) {
        uint32_t type;
        void *p;
        size_t len;

        if (cli_msg_recv(in_fd, &type, &p, &len) != 0)
            break; /* the parent is done with us */
        memset(r, 0, sizeof(*r));
        if (len != sizeof(demo_cmd))
            demo_fail(r, LLM_PARAM_INVALID, "malformed command");
        else
            demo_do(&n, p, r);
        free(p);
        if (cli_msg_send(out_fd, DM_REPLY, r, sizeof(*r), NULL, 0) != 0)
            goto out;
    }
    rc = CLI_EXIT_OK;
out:
    if (n.have_paged)
        llmdd_deallocate_cache(n.dd, n.paged.cache_id);
    if (n.have_kv)
        llmdd_deallocate_cache(n.dd, n.kv.cache_id);
    llmdd_destroy(n.dd);
    free(r);
    return rc;
}
