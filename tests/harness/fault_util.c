#include "harness/fault_util.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

long
fu_env(const char *name, long def)
{
    const char *v = getenv(name);
    char *end;

    if (v == NULL || *v == '\0')
        return def;
    long n = strtol(v, &end, 10);
    return *end == '\0' && n > 0 ? n : def;
}

int
fu_margin_ms(void)
{
    return (int)fu_env("LLMDD_FAULT_MARGIN_MS", 300L * FU_SLOW);
}

uint64_t
fu_seed(void)
{
    uint64_t s = (uint64_t)fu_env("LLMDD_FAULT_SEED", 0);

    if (s == 0)
        s = (uint64_t)time(NULL) * 2654435761u ^ (uint64_t)getpid();
    return s != 0 ? s : 1;
}

uint32_t
fu_rand(uint64_t *s)
{
    *s ^= *s << 13;
    *s ^= *s >> 7;
    *s ^= *s << 17;
    return (uint32_t)(*s >> 32);
}

const char *
fu_decoder_path(void)
{
    return LLMDD_FAULT_DECODER;
}

/* ---- /proc. ---- */

long
fu_proc_status(pid_t pid, const char *field)
{
    char path[64], line[256];
    size_t flen = strlen(field);
    long v = -1;

    snprintf(path, sizeof(path), "/proc/%d/status", (int)pid);
    FILE *f = fopen(path, "r");
    if (f == NULL)
        return -1;
    while (fgets(line, sizeof(line), f) != NULL) {
        if (strncmp(line, field, flen) == 0 && line[flen] == ':') {
            v = strtol(line + flen + 1, NULL, 10);
            break;
        }
    }
    fclose(f);
    return v;
}

int
fu_fd_count(pid_t pid)
{
    char path[64];
    int n = 0;

    snprintf(path, sizeof(path), "/proc/%d/fd", (int)pid);
    DIR *d = opendir(path);
    if (d == NULL)
        return -1;
    for (struct dirent *e; (e = readdir(d)) != NULL;)
        if (e->d_name[0] != '.')
            n++;
    closedir(d);
    return pid == getpid() ? n - 1 : n; /* not the DIR's own fd */
}

/* Lists a process's open fds on stderr: what a failed fu_settles left. */
static void
fu_fd_dump(pid_t pid)
{
    char path[64], link[320], target[256];

    snprintf(path, sizeof(path), "/proc/%d/fd", (int)pid);
    DIR *d = opendir(path);
    if (d == NULL)
        return;
    for (struct dirent *e; (e = readdir(d)) != NULL;) {
        if (e->d_name[0] == '.')
            continue;
        snprintf(link, sizeof(link), "%s/%s", path, e->d_name);
        ssize_t n = readlink(link, target, sizeof(target) - 1);
        target[n < 0 ? 0 : n] = '\0';
        fprintf(stderr, "  fd %s -> %s\n", e->d_name, target);
    }
    closedir(d);
}

bool
fu_settles(pid_t pid, int max_fds, long max_threads, int timeout_ms)
{
    int64_t deadline = th_now_ms() + timeout_ms;

    for (;;) {
        int fds = fu_fd_count(pid);
        long threads = fu_proc_status(pid, "Threads");
        if (fds >= 0 && fds <= max_fds && threads >= 0 &&
            threads <= max_threads)
            return true;
        if (th_now_ms() >= deadline) {
            fprintf(stderr, "pid %d: %d fds (want <= %d), %ld threads "
                            "(want <= %ld)\n",
                    (int)pid, fds, max_fds, threads, max_threads);
            fu_fd_dump(pid);
            return false;
        }
        th_sleep_ms(20);
    }
}

/* ---- The raw wire client. ---- */

int
fu_connect(uint16_t port)
{
    struct sockaddr_in a = {.sin_family = AF_INET,
                            .sin_port = htons(port),
                            .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    int one = 1;
    int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);

    if (fd < 0)
        return -1;
    if (connect(fd, (struct sockaddr *)&a, sizeof(a)) != 0) {
        close(fd);
        return -1;
    }
    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
    return fd;
}

int
fu_send_all(int fd, const void *buf, size_t len)
{
    const uint8_t *p = buf;

    while (len > 0) {
        ssize_t n = send(fd, p, len, MSG_NOSIGNAL);
        if (n < 0 && errno == EINTR)
            continue;
        if (n <= 0)
            return -1;
        p += n;
        len -= (size_t)n;
    }
    return 0;
}

int
fu_send_frame(int fd, uint16_t type, const void *payload, size_t len)
{
    uint8_t hdr[LLMDD_WIRE_HDR_LEN];

    llmdd__wire_frame_encode(hdr, type, (uint32_t)len);
    if (fu_send_all(fd, hdr, sizeof(hdr)) != 0)
        return -1;
    return len > 0 ? fu_send_all(fd, payload, len) : 0;
}

int
fu_recv_all(int fd, void *buf, size_t len, int timeout_ms)
{
    int64_t deadline = th_now_ms() + timeout_ms;
    uint8_t *p = buf;

    while (len > 0) {
        int64_t left = deadline - th_now_ms();
        struct pollfd pf = {.fd = fd, .events = POLLIN};
        if (left <= 0) {
            errno = ETIMEDOUT;
            return -1;
        }
        int r = poll(&pf, 1, (int)left);
        if (r < 0 && errno == EINTR)
            continue;
        if (r <= 0) {
            errno = r == 0 ? ETIMEDOUT : errno;
            return -1;
        }
        ssize_t n = recv(fd, p, len, MSG_DONTWAIT);
        if (n < 0 && (errno == EINTR || errno == EAGAIN))
            continue;
        if (n <= 0)
            return -1;
        p += n;
        len -= (size_t)n;
    }
    return 0;
}

int
fu_recv_frame(int fd, uint16_t *type, uint8_t *buf, size_t cap, size_t *len,
              int timeout_ms)
{
    uint8_t hdr[LLMDD_WIRE_HDR_LEN];
    llmdd__frame f;

    if (fu_recv_all(fd, hdr, sizeof(hdr), timeout_ms) != 0 ||
        llmdd__wire_frame_decode(hdr, &f) != 0 || f.len > cap ||
        fu_recv_all(fd, buf, f.len, timeout_ms) != 0)
        return -1;
    *type = f.type;
    *len = f.len;
    return 0;
}

bool
fu_closed_within(int fd, int timeout_ms)
{
    int64_t deadline = th_now_ms() + timeout_ms;
    uint8_t scratch[4096];

    for (;;) {
        int64_t left = deadline - th_now_ms();
        struct pollfd pf = {.fd = fd, .events = POLLIN};
        if (left <= 0 || poll(&pf, 1, (int)left) == 0)
            return false;
        ssize_t n = recv(fd, scratch, sizeof(scratch), MSG_DONTWAIT);
        if (n == 0 || (n < 0 && errno != EAGAIN && errno != EINTR))
            return true;
    }
}

int
fu_raw_link(uint16_t port, uint64_t cluster, const char *transport,
            uint8_t token[16], uint32_t *status)
{
    return fu_raw_link_terms(port, cluster, transport, FU_TERMS, token,
                             status);
}

int
fu_raw_link_terms(uint16_t port, uint64_t cluster, const char *transport,
                  llmdd__link_terms terms, uint8_t token[16],
                  uint32_t *status)
{
    llmdd__hello h;
    llmdd__hello_reply rep;
    llmdd__confirm conf;
    llmdd__result res;
    uint8_t buf[512];
    uint16_t type;
    size_t len;
    int fd = fu_connect(port);

    *status = LLM_FAILED;
    if (fd < 0)
        return -1;
    memset(&h, 0, sizeof(h));
    h.kind = CONN_CTRL;
    h.cluster_id = cluster;
    h.role = LLMDD_ROLE_MIX;
    h.pid = (uint32_t)getpid();
    h.nonce = cluster * 7919u;
    memset(h.boot_id, 0x42, sizeof(h.boot_id)); /* never the same host */
    snprintf(h.transport, sizeof(h.transport), "%s", transport);
    h.terms = terms;
    len = llmdd__wire_hello_encode(&h, buf, sizeof(buf));
    if (fu_send_frame(fd, WMSG_HELLO, buf, len) != 0 ||
        fu_recv_frame(fd, &type, buf, sizeof(buf), &len, 5000) != 0 ||
        type != WMSG_HELLO_REPLY ||
        llmdd__wire_hello_reply_decode(buf, len, &rep) != 0)
        goto err;
    if (rep.status != LLM_SUCCESS) {
        *status = rep.status;
        goto err;
    }
    memset(&conf, 0, sizeof(conf));
    snprintf(conf.transport, sizeof(conf.transport), "%s", transport);
    len = llmdd__wire_confirm_encode(&conf, buf, sizeof(buf));
    if (fu_send_frame(fd, WMSG_CONFIRM, buf, len) != 0 ||
        fu_recv_frame(fd, &type, buf, sizeof(buf), &len, 5000) != 0 ||
        type != WMSG_RESULT || llmdd__wire_result_decode(buf, len, &res) != 0)
        goto err;
    *status = res.status;
    if (res.status != LLM_SUCCESS)
        goto err;
    memcpy(token, res.token, 16);
    return fd;
err:
    close(fd);
    return -1;
}

int
fu_raw_data(uint16_t port, const uint8_t token[16], uint32_t flags,
            uint32_t *status)
{
    llmdd__hello h = {.kind = CONN_DATA, .flags = flags};
    uint8_t buf[64];
    uint16_t type;
    size_t len;
    int fd = fu_connect(port);

    *status = LLM_FAILED;
    if (fd < 0)
        return -1;
    memcpy(h.token, token, sizeof(h.token));
    len = llmdd__wire_hello_encode(&h, buf, sizeof(buf));
    if (fu_send_frame(fd, WMSG_HELLO, buf, len) != 0 ||
        fu_recv_frame(fd, &type, buf, sizeof(buf), &len, 5000) != 0 ||
        type != WMSG_DATA_REPLY ||
        llmdd__wire_u32_decode(buf, len, status) != 0)
        goto err;
    if (*status == LLM_SUCCESS)
        return fd;
err:
    close(fd);
    return -1;
}

/* ---- The recording relay. ---- */

#define RELAY_PAIRS 64
#define RELAY_CAPTURE_MAX (64u << 20)

struct fu_relay {
    pthread_t thread;
    int lfd, stop[2];
    uint16_t target;
    int a[RELAY_PAIRS], b[RELAY_PAIRS]; /* client side, target side */
    int npairs, conns;
    uint8_t *cap;
    size_t len, cap_size;
};

static void
relay_record(fu_relay *r, const uint8_t *p, size_t n)
{
    if (r->len + n > r->cap_size) {
        size_t want = r->cap_size ? r->cap_size : 1u << 16;
        while (want < r->len + n && want < RELAY_CAPTURE_MAX)
            want *= 2;
        uint8_t *m = want >= r->len + n ? realloc(r->cap, want) : NULL;
        if (m == NULL)
            return; /* past the cap: stop recording, keep relaying */
        r->cap = m;
        r->cap_size = want;
    }
    memcpy(r->cap + r->len, p, n);
    r->len += n;
}

static void
relay_drop(fu_relay *r, int i)
{
    close(r->a[i]);
    close(r->b[i]);
    r->npairs--;
    r->a[i] = r->a[r->npairs];
    r->b[i] = r->b[r->npairs];
}

static void *
relay_main(void *arg)
{
    fu_relay *r = arg;
    static uint8_t buf[1 << 16];
    struct pollfd pfd[2 + 2 * RELAY_PAIRS];

    for (;;) {
        int n = 0;
        pfd[n++] = (struct pollfd){.fd = r->stop[0], .events = POLLIN};
        pfd[n++] = (struct pollfd){.fd = r->lfd, .events = POLLIN};
        for (int i = 0; i < r->npairs; i++) {
            pfd[n++] = (struct pollfd){.fd = r->a[i], .events = POLLIN};
            pfd[n++] = (struct pollfd){.fd = r->b[i], .events = POLLIN};
        }
        if (poll(pfd, (nfds_t)n, -1) < 0) {
            if (errno == EINTR)
                continue;
            break;
        }
        if (pfd[0].revents != 0)
            break;
        if ((pfd[1].revents & POLLIN) && r->npairs < RELAY_PAIRS) {
            int c = accept4(r->lfd, NULL, NULL, SOCK_CLOEXEC);
            int t = c >= 0 ? fu_connect(r->target) : -1;
            if (t >= 0) {
                r->a[r->npairs] = c;
                r->b[r->npairs] = t;
                r->npairs++;
                r->conns++;
            } else if (c >= 0) {
                close(c);
            }
            continue; /* the pair indices below are stale now */
        }
        for (int i = r->npairs - 1; i >= 0; i--) {
            for (int side = 0; side < 2; side++) {
                short ev = pfd[2 + 2 * i + side].revents;
                if (ev == 0)
                    continue;
                int from = side ? r->b[i] : r->a[i];
                int to = side ? r->a[i] : r->b[i];
                ssize_t k = recv(from, buf, sizeof(buf), MSG_DONTWAIT);
                if (k < 0 && (errno == EAGAIN || errno == EINTR))
                    continue;
                if (k <= 0 || fu_send_all(to, buf, (size_t)k) != 0) {
                    relay_drop(r, i);
                    break;
                }
                relay_record(r, buf, (size_t)k);
            }
        }
    }
    while (r->npairs > 0)
        relay_drop(r, 0);
    return NULL;
}

fu_relay *
fu_relay_start(uint16_t target, uint16_t *port)
{
    struct sockaddr_in a = {.sin_family = AF_INET,
                            .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    socklen_t alen = sizeof(a);
    fu_relay *r = calloc(1, sizeof(*r));

    if (r == NULL)
        return NULL;
    r->target = target;
    r->lfd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (r->lfd < 0 || bind(r->lfd, (struct sockaddr *)&a, sizeof(a)) != 0 ||
        listen(r->lfd, 64) != 0 ||
        getsockname(r->lfd, (struct sockaddr *)&a, &alen) != 0 ||
        pipe2(r->stop, O_CLOEXEC) != 0)
        goto err;
    if (pthread_create(&r->thread, NULL, relay_main, r) != 0)
        goto err_pipe;
    *port = ntohs(a.sin_port);
    return r;
err_pipe:
    close(r->stop[0]);
    close(r->stop[1]);
err:
    if (r->lfd >= 0)
        close(r->lfd);
    free(r);
    return NULL;
}

uint8_t *
fu_relay_stop(fu_relay *r, size_t *len, int *conns)
{
    uint8_t *cap;

    (void)!write(r->stop[1], "x", 1);
    pthread_join(r->thread, NULL);
    close(r->stop[0]);
    close(r->stop[1]);
    close(r->lfd);
    cap = r->cap;
    *len = r->len;
    *conns = r->conns;
    free(r);
    return cap;
}
