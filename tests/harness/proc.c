/* The process and time helpers of every test directory; see proc.h. */
#include "harness/proc.h"

#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <setjmp.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <cmocka.h>

int64_t
th_now_ms(void)
{
    struct timespec ts;

    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

void
th_sleep_ms(int ms)
{
    struct timespec ts = {ms / 1000, (long)(ms % 1000) * 1000000L};

    while (nanosleep(&ts, &ts) != 0 && errno == EINTR)
        ;
}

pid_t
th_spawn(const char *const *argv, const int fds[3])
{
    /* Buffered output would otherwise be written twice, once by the
     * child's exit path should exec fail. */
    fflush(NULL);
    pid_t pid = fork();
    if (pid != 0)
        return pid;
    /* Only async-signal-safe calls: the parent may have threads. */
    for (int i = 0; i < 3; i++)
        if (fds[i] >= 0 && dup2(fds[i], i) < 0)
            _exit(127);
    execvp(argv[0], (char *const *)argv);
    _exit(127);
}

int
th_wait(pid_t pid, int timeout_ms, int *status)
{
    int64_t deadline = th_now_ms() + timeout_ms;
    int st = 0, rc;

    for (;;) {
        pid_t r = waitpid(pid, &st, WNOHANG);
        if (r == pid) {
            rc = 0;
            break;
        }
        if (r < 0 && errno != EINTR) {
            rc = -1;
            break;
        }
        if (timeout_ms >= 0 && th_now_ms() >= deadline) {
            kill(pid, SIGCONT);
            kill(pid, SIGKILL);
            while (waitpid(pid, &st, 0) < 0 && errno == EINTR)
                ;
            rc = 1;
            break;
        }
        /* Bounded polling for a child's exit, not a synchronisation. */
        th_sleep_ms(5);
    }
    if (status != NULL)
        *status = st;
    return rc;
}

int
th_exit_code(int status)
{
    if (WIFEXITED(status))
        return WEXITSTATUS(status);
    return WIFSIGNALED(status) ? 128 + WTERMSIG(status) : -1;
}

/* ---- A child on two pipes. ---- */

int
th_child_spawn(th_child *c, const char *const *argv)
{
    int in[2], out[2];

    memset(c, 0, sizeof(*c));
    c->in = c->out = -1;
    if (pipe2(in, O_CLOEXEC) != 0)
        return -1;
    if (pipe2(out, O_CLOEXEC) != 0) {
        close(in[0]);
        close(in[1]);
        return -1;
    }
    c->pid = th_spawn(argv, (const int[3]){in[0], out[1], -1});
    close(in[0]);
    close(out[1]);
    if (c->pid < 0) {
        close(in[1]);
        close(out[0]);
        return -1;
    }
    c->in = in[1];
    c->out = out[0];
    return 0;
}

int
th_child_write(th_child *c, const char *line)
{
    size_t len = strlen(line);

    if (c->in < 0)
        return -1;
    /* A dead child must not kill us with SIGPIPE. */
    signal(SIGPIPE, SIG_IGN);
    return write(c->in, line, len) == (ssize_t)len ? 0 : -1;
}

int
th_child_readline(th_child *c, char *line, size_t cap, int timeout_ms)
{
    int64_t deadline = th_now_ms() + timeout_ms;

    for (;;) {
        char *nl = memchr(c->buf, '\n', c->blen);
        if (nl != NULL) {
            size_t n = (size_t)(nl - c->buf);
            snprintf(line, cap, "%.*s", (int)n, c->buf);
            c->blen -= n + 1;
            memmove(c->buf, nl + 1, c->blen);
            return 0;
        }
        if (c->blen == sizeof(c->buf) || c->out < 0)
            return -1;
        int64_t left = deadline - th_now_ms();
        struct pollfd p = {.fd = c->out, .events = POLLIN};
        if (left <= 0 || poll(&p, 1, (int)left) <= 0)
            return -1;
        ssize_t k = read(c->out, c->buf + c->blen, sizeof(c->buf) - c->blen);
        if (k <= 0)
            return -1;
        c->blen += (size_t)k;
    }
}

void
th_child_close_in(th_child *c)
{
    if (c->in >= 0)
        close(c->in);
    c->in = -1;
}

int
th_child_reap(th_child *c, int timeout_ms)
{
    int status = 0, rc = -1;

    th_child_close_in(c);
    if (c->pid > 0) {
        if (th_wait(c->pid, timeout_ms, &status) == 0)
            rc = th_exit_code(status);
        c->pid = 0;
    }
    if (c->out >= 0)
        close(c->out);
    c->out = -1;
    return rc;
}

/* ---- Sockets. ---- */

int
th_socket(bool listen_too, uint16_t *port_out)
{
    struct sockaddr_in sa = {.sin_family = AF_INET};
    socklen_t len = sizeof(sa);
    int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);

    assert_true(fd >= 0);
    sa.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    assert_int_equal(bind(fd, (struct sockaddr *)&sa, sizeof(sa)), 0);
    assert_int_equal(getsockname(fd, (struct sockaddr *)&sa, &len), 0);
    if (listen_too)
        assert_int_equal(listen(fd, 16), 0);
    *port_out = ntohs(sa.sin_port);
    return fd;
}

uint16_t
th_free_port(void)
{
    uint16_t port;

    close(th_socket(false, &port));
    return port;
}
