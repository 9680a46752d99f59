/* Helpers for the tests of the `llmdd` tool; see cli_util.h. */
#include "harness/cli_util.h"

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#define CU_MAX_ARGS 64
#define CU_MAX_BG 8

static pid_t cu_bg_pids[CU_MAX_BG];

static void
cu_track(pid_t pid, bool add)
{
    for (int i = 0; i < CU_MAX_BG; i++) {
        if (add ? cu_bg_pids[i] == 0 : cu_bg_pids[i] == pid) {
            cu_bg_pids[i] = add ? pid : 0;
            return;
        }
    }
}

void
cu_reap_all(void)
{
    for (int i = 0; i < CU_MAX_BG; i++) {
        if (cu_bg_pids[i] > 0) {
            th_wait(cu_bg_pids[i], 0, NULL); /* kills and reaps it */
            cu_bg_pids[i] = 0;
        }
    }
}

/* Builds argv: the tool, then args. */
static void
cu_argv(const char **argv, const char *const *args)
{
    int n = 0;

    argv[n++] = LLMDD_CLI;
    for (; args != NULL && args[n - 1] != NULL && n < CU_MAX_ARGS - 1; n++)
        argv[n] = args[n - 1];
    argv[n] = NULL;
}

void
cu_tmpname(char *buf, size_t cap, const char *suffix)
{
    static unsigned counter;

    snprintf(buf, cap, "/tmp/llmdd-cli-test-%d-%u%s", (int)getpid(), counter++,
             suffix);
    unlink(buf);
}

char *
cu_read_file(const char *path, size_t *len)
{
    FILE *f = fopen(path, "rb");
    char *buf = NULL;
    size_t n = 0, cap = 0;

    if (f == NULL)
        return NULL;
    for (;;) {
        if (n + 4096 + 1 > cap) {
            cap = (n + 4096 + 1) * 2;
            char *nb = realloc(buf, cap);
            if (nb == NULL) {
                free(buf);
                fclose(f);
                return NULL;
            }
            buf = nb;
        }
        size_t k = fread(buf + n, 1, 4096, f);
        n += k;
        if (k == 0)
            break;
    }
    fclose(f);
    buf[n] = '\0';
    if (len != NULL)
        *len = n;
    return buf;
}

static void
cu_fill_result(cu_result *r, int status)
{
    if (WIFEXITED(status)) {
        r->code = WEXITSTATUS(status);
    } else {
        r->code = -1;
        r->signal = WIFSIGNALED(status) ? WTERMSIG(status) : 0;
    }
}

/*
 * A UBSan report in the tool's captured stderr, passed on to the test's
 * own output. gcc's UBSan beside ASan writes its reports to stderr
 * whatever log_path says (tests/harness/san_run.sh catches the others),
 * and a test whose output has one fails (tests/CMakeLists.txt).
 */
static void
cu_pass_on_reports(const char *err)
{
    if (strstr(err, "runtime error: ") != NULL)
        fprintf(stderr, "---- the llmdd process's stderr:\n%s\n----\n", err);
}

cu_result
cu_run(int timeout_s, const char *const *args)
{
    const char *argv[CU_MAX_ARGS];
    char outp[64], errp[64];
    cu_result r = {0};
    bool to;

    cu_argv(argv, args);
    cu_tmpname(outp, sizeof(outp), ".out");
    cu_tmpname(errp, sizeof(errp), ".err");
    int fds[3] = {open("/dev/null", O_RDONLY | O_CLOEXEC),
                  open(outp, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600),
                  open(errp, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600)};
    assert_true(fds[0] >= 0 && fds[1] >= 0 && fds[2] >= 0);
    pid_t pid = th_spawn(argv, fds);
    for (int i = 0; i < 3; i++)
        close(fds[i]);
    assert_true(pid >= 0);
    int status;
    int waited = th_wait(pid, timeout_s * 1000, &status);
    assert_true(waited >= 0);
    to = waited == 1;
    cu_fill_result(&r, status);
    r.out = cu_read_file(outp, NULL);
    r.err = cu_read_file(errp, NULL);
    if (r.out == NULL)
        r.out = strdup("");
    if (r.err == NULL)
        r.err = strdup("");
    cu_pass_on_reports(r.err);
    unlink(outp);
    unlink(errp);
    if (to) {
        cu_dump("timed out", &r);
        fail_msg("llmdd %s did not finish within %d s", argv[1], timeout_s);
    }
    return r;
}

void
cu_result_free(cu_result *r)
{
    free(r->out);
    free(r->err);
    r->out = r->err = NULL;
}

void
cu_dump(const char *what, const cu_result *r)
{
    fprintf(stderr,
            "---- %s: exit %d signal %d\n---- stdout:\n%s\n---- stderr:\n%s"
            "\n----\n",
            what, r->code, r->signal, r->out ? r->out : "",
            r->err ? r->err : "");
}

void
cu_start(cu_bg *b, const char *const *args)
{
    const char *argv[CU_MAX_ARGS];
    int p[2];

    memset(b, 0, sizeof(*b));
    cu_argv(argv, args);
    cu_tmpname(b->errpath, sizeof(b->errpath), ".err");
    int fds[3] = {
        open("/dev/null", O_RDONLY | O_CLOEXEC), -1,
        open(b->errpath, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600)};
    assert_true(fds[0] >= 0 && fds[2] >= 0);
    assert_int_equal(pipe2(p, O_CLOEXEC), 0);
    fds[1] = p[1];
    b->pid = th_spawn(argv, fds);
    for (int i = 0; i < 3; i++)
        close(fds[i]);
    assert_true(b->pid >= 0);
    cu_track(b->pid, true);
    b->out = p[0];
}

static void
cu_seen_add(cu_bg *b, const char *p, size_t n)
{
    if (n < sizeof(b->seen) - b->nseen - 1) {
        memcpy(b->seen + b->nseen, p, n);
        b->nseen += n;
        b->seen[b->nseen] = '\0';
    }
}

/* Reads what is there into b->buf; 0 at end of file or on timeout. */
static ssize_t
cu_fill(cu_bg *b, int64_t deadline)
{
    struct pollfd pfd = {.fd = b->out, .events = POLLIN};
    int64_t left = deadline - th_now_ms();

    if (left <= 0 || b->nbuf == sizeof(b->buf) || poll(&pfd, 1, (int)left) != 1)
        return 0;
    ssize_t k = read(b->out, b->buf + b->nbuf, sizeof(b->buf) - b->nbuf);
    if (k > 0) {
        cu_seen_add(b, b->buf + b->nbuf, (size_t)k);
        b->nbuf += (size_t)k;
    }
    return k;
}

bool
cu_wait_line(cu_bg *b, const char *needle, char *line, size_t cap,
             int timeout_s)
{
    int64_t deadline = th_now_ms() + timeout_s * 1000;

    for (;;) {
        char *nl = memchr(b->buf, '\n', b->nbuf);
        if (nl != NULL) {
            size_t n = (size_t)(nl - b->buf) + 1;
            char l[sizeof(b->buf) + 1];
            memcpy(l, b->buf, n);
            l[n] = '\0';
            memmove(b->buf, b->buf + n, b->nbuf - n);
            b->nbuf -= n;
            if (strstr(l, needle) != NULL) {
                snprintf(line, cap, "%s", l);
                return true;
            }
            continue;
        }
        if (cu_fill(b, deadline) <= 0)
            return false;
    }
}

cu_result
cu_stop(cu_bg *b, int sig, int timeout_s)
{
    cu_result r = {0};
    bool to;

    if (sig != 0)
        kill(b->pid, sig);
    int status;
    int waited = th_wait(b->pid, timeout_s * 1000, &status);
    cu_track(b->pid, false);
    assert_true(waited >= 0);
    to = waited == 1;
    cu_fill_result(&r, status);
    /* It has exited: the rest of its output is in the pipe. */
    b->nbuf = 0;
    while (cu_fill(b, th_now_ms() + 1000) > 0)
        b->nbuf = 0;
    close(b->out);
    b->out = -1;
    r.out = strdup(b->seen);
    r.err = cu_read_file(b->errpath, NULL);
    if (r.err == NULL)
        r.err = strdup("");
    cu_pass_on_reports(r.err);
    unlink(b->errpath);
    if (to) {
        cu_dump("timed out", &r);
        fail_msg("a background llmdd did not stop within %d s", timeout_s);
    }
    return r;
}

uint16_t
cu_free_port(void)
{
    return th_free_port();
}

bool
cu_transport_built(const char *name)
{
    const char *list = llmdd_transport_list();
    size_t n = strlen(name);

    for (const char *p = strstr(list, name); p != NULL; p = strstr(p + 1, name))
        if ((p == list || p[-1] == ',') && (p[n] == ',' || p[n] == '\0'))
            return true;
    return false;
}

int
cu_count(const char *hay, const char *needle)
{
    int n = 0;

    for (const char *p = strstr(hay, needle); p != NULL;
         p = strstr(p + strlen(needle), needle))
        n++;
    return n;
}

int
cu_main(const char *group, const struct CMUnitTest *tests, size_t n, int argc,
        char **argv)
{
    signal(SIGPIPE, SIG_IGN);
    if (argc > 1)
        cmocka_set_test_filter(argv[1]);
    return _cmocka_run_group_tests(group, tests, n, NULL, NULL);
}
