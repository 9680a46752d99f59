/*
 * llmdd: the command-line tool. Dispatches to a subcommand; each one parses
 * its flags with cli_args_parse (the shared ones there, its own in a
 * callback) and uses only the public API.
 */
#include <signal.h>
#include <stdio.h>
#include <string.h>

#include "common.h"

static const char main_usage[] =
    "Usage: llmdd <command> [options]\n"
    "\n"
    "Move LLM KV caches between a prompt (prefill) and a decoder process.\n"
    "\n"
    "Commands:\n"
    "  demo    a prompt and a decoder process move a Llama-3-8B-shaped KV\n"
    "          cache (slot, layer range, paged blocks, push), all verified\n"
    "  serve   a prompt node: allocate and fill caches, serve until Ctrl-C\n"
    "  pull    a decoder node: link to a prompt node, pull, verify, report\n"
    "  bench   sweep pull/push/pull-blocks/link over block sizes, with a\n"
    "          memcpy or raw-TCP baseline; tables, JSON, CSV, a plot\n"
    "  info    version, transports, option keys and environment variables\n"
    "  stats   live rates from a /metrics endpoint (`serve --metrics`)\n"
    "\n"
    "Run 'llmdd <command> --help' for its options. Exit status: 0 success,\n"
    "1 a library call or a check failed, 2 bad usage.\n";

static const struct {
    const char *name;
    const char *prog;
    int (*fn)(int, char **);
} main_cmds[] = {
    {"demo", "llmdd demo", cli_demo}, {"serve", "llmdd serve", cli_serve},
    {"pull", "llmdd pull", cli_pull}, {"bench", "llmdd bench", cli_bench},
    {"info", "llmdd info", cli_info}, {"stats", "llmdd stats", cli_stats},
};

int
main(int argc, char **argv)
{
    /* A peer that goes away must be an error status, not a signal. */
    signal(SIGPIPE, SIG_IGN);

    if (argc < 2) {
        fputs(main_usage, stderr);
        return CLI_EXIT_USAGE;
    }
    if (strcmp(argv[1], "--help") == 0 || strcmp(argv[1], "-h") == 0 ||
        strcmp(argv[1], "help") == 0) {
        fputs(main_usage, stdout);
        return CLI_EXIT_OK;
    }
    if (strcmp(argv[1], "--version") == 0) {
        printf("llmdd %s\n", llmdd_version());
        return CLI_EXIT_OK;
    }
    for (size_t i = 0; i < sizeof(main_cmds) / sizeof(main_cmds[0]); i++) {
        if (strcmp(argv[1], main_cmds[i].name) == 0) {
            /* getopt_long prefixes its messages with argv[0]. */
            cli_prog = main_cmds[i].prog;
            argv[1] = (char *)main_cmds[i].prog;
            return main_cmds[i].fn(argc - 1, argv + 1);
        }
    }
    fprintf(stderr, "llmdd: unknown command \"%s\"\n\n%s", argv[1], main_usage);
    return CLI_EXIT_USAGE;
}
