/*
 * The process and time helpers of every test directory: the monotonic clock,
 * sleeping, starting a program with chosen stdin/stdout/stderr, reaping it
 * with a deadline, a child on two pipes read line by line with a deadline,
 * and loopback sockets on free ports. The peer_helper wrapper (harness.h),
 * the fault tests' raw clients, the multi-process tests' peer table and the
 * tool's tests all build on these. Not thread-safe unless a comment says so.
 */
#ifndef LLMDD_TESTS_PROC_H
#define LLMDD_TESTS_PROC_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>

/* CLOCK_MONOTONIC in ms (thread-safe). */
int64_t th_now_ms(void);
/* Sleeps ms, resuming after signals (thread-safe). */
void th_sleep_ms(int ms);

/*
 * Starts argv[0] (a path, or a name looked up in PATH) with fds[i] as its
 * fd i, or this process's fd i where fds[i] is -1. The caller's fds should
 * be close-on-exec so that only the dup2'd copies reach the program.
 * Returns its pid, or -1.
 */
pid_t th_spawn(const char *const *argv, const int fds[3]);
/*
 * Waits for pid at most timeout_ms (< 0: without a limit), then SIGKILLs
 * it (after SIGCONT, should it be stopped) and reaps it. *status gets its
 * wait status (may be NULL). Returns 0 when it ended by itself in time, 1
 * when it had to be killed, -1 when waitpid failed.
 */
int th_wait(pid_t pid, int timeout_ms, int *status);
/* A wait status as one number: the exit code, or 128 + the signal. */
int th_exit_code(int status);

/* A child process with pipes on stdin and stdout; stderr is inherited. */
typedef struct {
    pid_t pid;
    int in, out;
    char buf[4096];
    size_t blen;
} th_child;

int th_child_spawn(th_child *c, const char *const *argv);
int th_child_write(th_child *c, const char *line);
/* One line without its newline; -1 on EOF or when timeout_ms passes. */
int th_child_readline(th_child *c, char *line, size_t cap, int timeout_ms);
void th_child_close_in(th_child *c);
/*
 * Closes its stdin and reaps it; SIGKILL after timeout_ms. Returns the exit
 * code, 128 + signal when signalled, or -1 when it had to be killed.
 */
int th_child_reap(th_child *c, int timeout_ms);

/*
 * A TCP socket bound to 127.0.0.1 on a free port (fails the test when it
 * cannot). With `listen` it accepts connections into its backlog that
 * nobody serves until the caller accepts; without it, the port refuses
 * connections and nobody else can take it while the fd is open.
 */
int th_socket(bool listen, uint16_t *port_out);
/* A TCP port on 127.0.0.1 that was free a moment ago. */
uint16_t th_free_port(void);

#endif
