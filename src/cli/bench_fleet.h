/*
 * llmdd bench --op fleet, shared by its orchestrator (bench_fleet.c) and
 * its node processes and network namespaces (bench_fleet_node.c).
 */
#ifndef LLMDD_CLI_BENCH_FLEET_H
#define LLMDD_CLI_BENCH_FLEET_H

#include "bench.h"

#define FLEET_N 8
#define FLEET_HEALTHY 5
#define FLEET_STOPPED 5
#define FLEET_FLOOD 6
#define FLEET_CUT 7
#define FLEET_SLOTS 8
#define FLEET_PERIOD_MS 20
#define FLEET_WAIT_DEFAULT "2000"
#define FLEET_DEC_ID 100 /* decoder i is cluster FLEET_DEC_ID + i */
#define FLEET_NET "10.231.9."
#define FLEET_KEY "fleet"
#define FLEET_SEED 7u
#define FLEET_LINE 4096

typedef struct {
    const bench_cfg *cfg;
    int index;         /* -1: the prompt */
    const char *netns; /* NULL: stay where the tool runs */
    uint64_t size;     /* bytes of a slot, per tensor */
} fleet_role;

/* The namespaces (A: the prompt and decoders 0-6; C: decoder 7) and the
 * veth end in C, named once fleet_ns_up made them. */
extern char fleet_ns_a[32], fleet_ns_c[32], fleet_veth_c[16];

/* llm.SyncKvCacheWaitTime of every node: -o's, else FLEET_WAIT_DEFAULT. */
int64_t fleet_wait_ms(const bench_cfg *cfg);
/* Runs a command (ip) to its end; its exit status, -1 when it cannot run. */
int fleet_run(const char *const *argv);
/* Makes namespaces A and C joined by a veth pair; false without the rights
 * (the run then leaves the partition out). fleet_ns_down removes them. */
bool fleet_ns_up(void);
void fleet_ns_down(void);
/* A node process (cli_node_start): the prompt or decoder arg names, taking
 * its commands on in_fd and answering on out_fd. */
int fleet_node_main(void *arg, int in_fd, int out_fd);

#endif
