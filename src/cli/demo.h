/*
 * llmdd demo, shared by its orchestrator (demo.c) and its nodes
 * (demo_node.c): the commands the parent sends a node and the replies.
 */
#ifndef LLMDD_CLI_DEMO_H
#define LLMDD_CLI_DEMO_H

#include "common.h"

#define DEMO_PROMPT_ID 1
#define DEMO_DECODER_ID 2
#define DEMO_MAX_BLOCKS 64

typedef struct {
    cli_shape shape;
    cli_lib_opts lo;
    uint32_t seed;
    int timeout_ms;
} demo_cfg;

enum {
    DM_READY = 1,
    DM_LINK,
    DM_UNLINK,
    DM_PULL_SLOT,
    DM_PULL_LAYERS,
    DM_PULL_BLOCKS,
    DM_PUSH,
    DM_VERIFY_SLOT,
    DM_PUSH_LAYERWISE,
    DM_WAIT_NOTIFY,
    DM_REPLY,
};

typedef struct {
    uint32_t op;
    uint16_t port;
    int64_t remote_cache; /* the peer's cache the operation names */
    uint32_t remote_seed; /* its pattern, for verification */
    uint32_t src_slot, dst_slot;
    int32_t first_layer, last_layer;
    uint32_t nblocks;
    uint64_t src_blocks[DEMO_MAX_BLOCKS];
    uint64_t dst_blocks[DEMO_MAX_BLOCKS];
    char note[64]; /* the notification a layer-wise push carries */
} demo_cmd;

typedef struct {
    uint32_t status;
    uint16_t port;
    int64_t kv_id, paged_id;
    uint64_t bytes;
    int64_t ns;
    int32_t verified; /* 1 yes, 0 no, -1 not checked */
    uint64_t sum;
    char transport[16]; /* a pull's: what auto chose, from the metrics */
    char err[768];
} demo_reply;

typedef struct {
    const demo_cfg *cfg;
    bool prompt;
} demo_role;

typedef struct {
    const demo_cfg *cfg;
    bool prompt;
    llmdd *dd;
    llmdd_cache kv, paged;
    bool have_kv, have_paged;
} demo_node;

/* A node (cli_node_start): the prompt or the decoder, as arg says; it
 * takes demo_cmds on in_fd and answers demo_replies on out_fd. */
int demo_node_main(void *arg, int in_fd, int out_fd);

#endif
