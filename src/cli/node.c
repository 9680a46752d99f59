/*
 * Nodes of the llmdd tool: an instance in a child process or a thread,
 * driven over pipes; see common.h.
 */
#include "common.h"

#include <errno.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

/* ---- Nodes. ---- */

struct cli_node_thread {
    pthread_t tid;
    cli_node_fn fn;
    void *arg;
    int in_fd, out_fd;
    int rc;
};

/* Parent-side pipe ends of every node, which each later child closes. */
#define CM_NODES_MAX 256
static int cm_parent_fds[2 * CM_NODES_MAX];
static size_t cm_nparent_fds;

static void
cm_forget_fd(int fd)
{
    for (size_t i = 0; i < cm_nparent_fds; i++) {
        if (cm_parent_fds[i] == fd) {
            cm_parent_fds[i] = cm_parent_fds[--cm_nparent_fds];
            return;
        }
    }
}

static void *
cm_node_thread(void *p)
{
    struct cli_node_thread *t = p;

    t->rc = t->fn(t->arg, t->in_fd, t->out_fd);
    close(t->in_fd);
    close(t->out_fd);
    return NULL;
}

int
cli_node_start(cli_node *n, const char *name, bool threaded, cli_node_fn fn,
               void *arg)
{
    int cmd[2], rep[2];

    memset(n, 0, sizeof(*n));
    n->cmd_fd = n->rep_fd = -1;
    snprintf(n->name, sizeof(n->name), "%s", name);
    if (cm_nparent_fds + 2 > sizeof(cm_parent_fds) / sizeof(int)) {
        cli_err("too many nodes");
        return -1;
    }
    if (pipe(cmd) != 0)
        goto err;
    if (pipe(rep) != 0) {
        close(cmd[0]);
        close(cmd[1]);
        goto err;
    }
    if (threaded) {
        n->thr = calloc(1, sizeof(*n->thr));
        if (n->thr == NULL)
            goto err_pipes;
        n->thr->fn = fn;
        n->thr->arg = arg;
        n->thr->in_fd = cmd[0];
        n->thr->out_fd = rep[1];
        if (pthread_create(&n->thr->tid, NULL, cm_node_thread, n->thr) != 0) {
            free(n->thr);
            n->thr = NULL;
            goto err_pipes;
        }
        n->threaded = true;
    } else {
        fflush(NULL); /* the child must not write our buffered output */
        n->pid = fork();
        if (n->pid < 0)
            goto err_pipes;
        if (n->pid == 0) {
            for (size_t i = 0; i < cm_nparent_fds; i++)
                close(cm_parent_fds[i]);
            close(cmd[1]);
            close(rep[0]);
            int rc = fn(arg, cmd[0], rep[1]);
            close(cmd[0]);
            close(rep[1]);
            fflush(NULL);
            exit(rc);
        }
        close(cmd[0]);
        close(rep[1]);
    }
    n->cmd_fd = cmd[1];
    n->rep_fd = rep[0];
    cm_parent_fds[cm_nparent_fds++] = n->cmd_fd;
    cm_parent_fds[cm_nparent_fds++] = n->rep_fd;
    return 0;
err_pipes:
    close(cmd[0]);
    close(cmd[1]);
    close(rep[0]);
    close(rep[1]);
err:
    cli_err("cannot start the %s node: %s", name, strerror(errno));
    return -1;
}

int
cli_node_wait(cli_node *n, int timeout_ms)
{
    struct pollfd pfd = {.fd = n->rep_fd, .events = POLLIN};
    int64_t deadline = cli_now_ns() + (int64_t)timeout_ms * 1000000;

    for (;;) {
        int left = -1;
        if (timeout_ms >= 0) {
            int64_t ns = deadline - cli_now_ns();
            if (ns <= 0)
                return 0;
            left = (int)((ns + 999999) / 1000000);
        }
        int k = poll(&pfd, 1, left);
        if (k > 0)
            return 1;
        if (k < 0 && errno != EINTR)
            return 1; /* the read that follows reports the error */
    }
}

void
cli_node_kill(cli_node *n)
{
    if (n->threaded) {
        n->abandoned = true;
        return;
    }
    if (n->pid > 0) {
        kill(n->pid, SIGKILL);
        while (waitpid(n->pid, NULL, 0) < 0 && errno == EINTR)
            ;
        n->pid = 0;
    }
}

int
cli_node_stop(cli_node *n)
{
    int rc = 0;

    if (n->cmd_fd < 0 && n->rep_fd < 0)
        return 0;
    if (n->abandoned) {
        /* Its thread may still use the pipes: leave them to exit(). */
        n->cmd_fd = n->rep_fd = -1;
        return -1;
    }
    if (n->cmd_fd >= 0) {
        cm_forget_fd(n->cmd_fd);
        close(n->cmd_fd);
        n->cmd_fd = -1;
    }
    if (n->threaded) {
        pthread_join(n->thr->tid, NULL);
        rc = n->thr->rc;
        free(n->thr);
        n->thr = NULL;
    } else if (n->pid == 0) {
        rc = -1; /* killed by cli_node_kill */
    } else {
        int status;
        while (waitpid(n->pid, &status, 0) < 0 && errno == EINTR)
            ;
        if (WIFEXITED(status)) {
            rc = WEXITSTATUS(status);
        } else {
            cli_err("the %s process died of signal %d (%s)", n->name,
                    WTERMSIG(status), strsignal(WTERMSIG(status)));
            rc = -1;
        }
        n->pid = 0;
    }
    if (n->rep_fd >= 0) {
        cm_forget_fd(n->rep_fd);
        close(n->rep_fd);
        n->rep_fd = -1;
    }
    return rc;
}

int
cli_write_full(int fd, const void *p, size_t len)
{
    const uint8_t *b = p;

    while (len > 0) {
        ssize_t k = write(fd, b, len);
        if (k < 0 && errno == EINTR)
            continue;
        if (k <= 0)
            return -1;
        b += k;
        len -= (size_t)k;
    }
    return 0;
}

int
cli_read_full(int fd, void *p, size_t len)
{
    uint8_t *b = p;

    while (len > 0) {
        ssize_t k = read(fd, b, len);
        if (k < 0 && errno == EINTR)
            continue;
        if (k <= 0)
            return -1;
        b += k;
        len -= (size_t)k;
    }
    return 0;
}

int
cli_msg_send(int fd, uint32_t type, const void *a, size_t alen, const void *b,
             size_t blen)
{
    cli_msg_hdr h = {.type = type, .len = alen + blen};

    if (h.len > CLI_MSG_MAX)
        return -1;
    if (cli_write_full(fd, &h, sizeof(h)) != 0 ||
        (alen > 0 && cli_write_full(fd, a, alen) != 0) ||
        (blen > 0 && cli_write_full(fd, b, blen) != 0))
        return -1;
    return 0;
}

int
cli_msg_recv(int fd, uint32_t *type, void **payload, size_t *len)
{
    cli_msg_hdr h;
    void *p = NULL;

    if (cli_read_full(fd, &h, sizeof(h)) != 0 || h.len > CLI_MSG_MAX)
        return -1;
    if (h.len > 0) {
        p = malloc(h.len);
        if (p == NULL || cli_read_full(fd, p, h.len) != 0) {
            free(p);
            return -1;
        }
    }
    *type = h.type;
    *payload = p;
    *len = h.len;
    return 0;
}
