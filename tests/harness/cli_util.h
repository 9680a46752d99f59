/*
 * Helpers for the tests of the `llmdd` tool: run it as a real process with
 * its output captured, or start it in the background and read its output
 * line by line. Every process started here is reaped, by cu_reap_all when an
 * assertion leaves a test early. Not thread-safe; tests use them from their
 * main thread.
 */
#ifndef LLMDD_TESTS_CLI_UTIL_H
#define LLMDD_TESTS_CLI_UTIL_H

#include <stdbool.h>
#include <stdio.h>
#include <sys/types.h>

#include "harness/harness.h"

typedef struct {
    int code;   /* exit code, or -1 when it died of a signal */
    int signal; /* the signal, when it died of one */
    char *out;  /* all of stdout, NUL-terminated */
    char *err;  /* all of stderr */
} cu_result;

/*
 * Runs `llmdd <args...>` (args NULL-terminated) and waits at most timeout_s
 * seconds (then SIGKILLs it and fails the test). Returns its result.
 */
cu_result cu_run(int timeout_s, const char *const *args);
void cu_result_free(cu_result *r);
/* Prints the command's output; for failed assertions. */
void cu_dump(const char *what, const cu_result *r);

typedef struct {
    pid_t pid;
    int out;        /* its stdout */
    char buf[4096]; /* read but not yet returned as a line */
    size_t nbuf;
    char errpath[64]; /* its stderr goes to this file */
    char seen[16384]; /* everything read from stdout so far */
    size_t nseen;
} cu_bg;

/* Starts `llmdd <args...>` in the background. */
void cu_start(cu_bg *b, const char *const *args);
/* Reads stdout lines until one contains `needle` (copied to line); false
 * when the process ends or timeout_s passes first. */
bool cu_wait_line(cu_bg *b, const char *needle, char *line, size_t cap,
                  int timeout_s);
/* Sends sig, waits at most timeout_s; returns the result with the rest of
 * its stdout appended to what cu_wait_line saw. */
cu_result cu_stop(cu_bg *b, int sig, int timeout_s);
/* Kills and reaps every background process still running. */
void cu_reap_all(void);

/* A TCP port on 127.0.0.1 that was free a moment ago. */
uint16_t cu_free_port(void);
/* A fresh temporary file name (the file does not exist). */
void cu_tmpname(char *buf, size_t cap, const char *suffix);
/* The whole file, NUL-terminated, or NULL. */
char *cu_read_file(const char *path, size_t *len);
/* Whether `name` is in llmdd_transport_list(). */
bool cu_transport_built(const char *name);
/* Counts the occurrences of needle in hay. */
int cu_count(const char *hay, const char *needle);

/* Runs the tests, or only those whose name matches argv[1] when given. */
int cu_main(const char *group, const struct CMUnitTest *tests, size_t n,
            int argc, char **argv);

#endif
