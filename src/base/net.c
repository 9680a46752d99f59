#include "base/net.h"

#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <stdio.h>
#include <string.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include "base/log.h"
#include "base/wire.h"

int64_t
llmdd__now_ms(void)
{
    struct timespec ts;

    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

void
llmdd__sockaddr_str(const llmdd__sockaddr *a, char *buf, size_t len)
{
    char ip[INET6_ADDRSTRLEN] = "?";

    if (a->addr.ss_family == AF_INET) {
        const struct sockaddr_in *v4 = (const struct sockaddr_in *)&a->addr;
        inet_ntop(AF_INET, &v4->sin_addr, ip, sizeof(ip));
        snprintf(buf, len, "%s:%u", ip, ntohs(v4->sin_port));
    } else if (a->addr.ss_family == AF_INET6) {
        const struct sockaddr_in6 *v6 = (const struct sockaddr_in6 *)&a->addr;
        inet_ntop(AF_INET6, &v6->sin6_addr, ip, sizeof(ip));
        snprintf(buf, len, "[%s]:%u", ip, ntohs(v6->sin6_port));
    } else {
        snprintf(buf, len, "?");
    }
}

/* The thread's work and, once made, its own eventfd (closed at exit). */
static _Thread_local struct {
    llmdd__cancel *c;
    int waker; /* 0: not made yet (fd 0 is never an eventfd of ours) */
    llmdd__armed node;
    bool inside; /* node is on c's list */
} tls;

static pthread_key_t waker_key;
static pthread_once_t waker_once = PTHREAD_ONCE_INIT;

static void
waker_close(void *p)
{
    close((int)(intptr_t)p - 1);
}

static void
waker_key_make(void)
{
    (void)pthread_key_create(&waker_key, waker_close);
}

/* The calling thread's eventfd, made on first use; -1 when it cannot be. */
static int
waker_fd(void)
{
    if (tls.waker > 0)
        return tls.waker;
    pthread_once(&waker_once, waker_key_make);
    int fd = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
    if (fd < 0) {
        log_error("no eventfd for a transfer thread: %s", strerror(errno));
        return -1;
    }
    if (pthread_setspecific(waker_key, (void *)(intptr_t)(fd + 1)) != 0) {
        close(fd);
        return -1;
    }
    tls.waker = fd;
    return fd;
}

static void
armed_add(llmdd__cancel *c, llmdd__armed *a)
{
    a->prev = NULL;
    a->next = c->armed;
    if (c->armed != NULL)
        c->armed->prev = a;
    c->armed = a;
}

static void
armed_remove(llmdd__cancel *c, llmdd__armed *a)
{
    if (a->prev != NULL)
        a->prev->next = a->next;
    else
        c->armed = a->next;
    if (a->next != NULL)
        a->next->prev = a->prev;
}

bool
llmdd__cancelled(void)
{
    const llmdd__cancel *c = tls.c;

    return c != NULL && atomic_load(&c->flag);
}

void
llmdd__cancel_init(llmdd__cancel *c)
{
    atomic_init(&c->flag, false);
    pthread_mutex_init(&c->lock, NULL);
    c->armed = NULL;
}

void
llmdd__cancel_fini(llmdd__cancel *c)
{
    pthread_mutex_destroy(&c->lock);
}

void
llmdd__cancel_fire(llmdd__cancel *c)
{
    uint64_t one = 1;

    pthread_mutex_lock(&c->lock);
    atomic_store(&c->flag, true);
    for (llmdd__armed *a = c->armed; a != NULL; a = a->next) {
        if (a->cut)
            continue;
        a->cut = true;
        if (a->waker)
            (void)!write(a->fd, &one, sizeof(one));
        else
            shutdown(a->fd, SHUT_RDWR);
    }
    pthread_mutex_unlock(&c->lock);
}

int
llmdd__cancel_enter(llmdd__cancel *c, bool wake)
{
    tls.c = c;
    tls.inside = false;
    if (c == NULL || !wake)
        return 0;
    int fd = waker_fd();
    if (fd < 0) {
        tls.c = NULL;
        return -1;
    }
    uint64_t v;
    (void)!read(fd, &v, sizeof(v)); /* a fire meant for earlier work */
    tls.node = (llmdd__armed){.fd = fd, .waker = true};
    pthread_mutex_lock(&c->lock);
    armed_add(c, &tls.node);
    tls.inside = true;
    pthread_mutex_unlock(&c->lock);
    return 0;
}

void
llmdd__cancel_leave(void)
{
    llmdd__cancel *c = tls.c;

    if (c != NULL && tls.inside) {
        pthread_mutex_lock(&c->lock);
        armed_remove(c, &tls.node);
        pthread_mutex_unlock(&c->lock);
    }
    tls.c = NULL;
    tls.inside = false;
}

int
llmdd__cancel_arm(llmdd__armed *a, int fd)
{
    llmdd__cancel *c = tls.c;
    int rc = LLMDD__CANCEL_ARMED;

    if (c == NULL)
        return LLMDD__CANCEL_NONE;
    *a = (llmdd__armed){.fd = fd};
    pthread_mutex_lock(&c->lock);
    if (atomic_load(&c->flag))
        rc = LLMDD__CANCEL_FIRED;
    else
        armed_add(c, a);
    pthread_mutex_unlock(&c->lock);
    return rc;
}

bool
llmdd__cancel_disarm(llmdd__armed *a)
{
    llmdd__cancel *c = tls.c;
    bool cut;

    if (c == NULL)
        return false;
    pthread_mutex_lock(&c->lock);
    cut = a->cut;
    armed_remove(c, a);
    pthread_mutex_unlock(&c->lock);
    return cut;
}

int
llmdd__wait_fd(int stop_fd, int fd, short events, int64_t deadline_ms)
{
    int waker = tls.inside ? tls.node.fd : -1;

    for (;;) {
        struct pollfd p[3] = {{.fd = fd, .events = events},
                              {.fd = stop_fd, .events = POLLIN},
                              {.fd = waker, .events = POLLIN}};
        if (waker >= 0 && atomic_load(&tls.c->flag))
            return -1; /* fired before this thread was inside */
        int64_t left = deadline_ms - llmdd__now_ms();
        if (left <= 0)
            return 0;
        int n = poll(p, 3, left > 60000 ? 60000 : (int)left);
        if (n < 0) {
            if (errno == EINTR)
                continue;
            return -1;
        }
        if (n == 0)
            continue;
        if (p[1].revents != 0 || p[2].revents != 0)
            return -1; /* stopping, or this thread's request was cancelled */
        if (p[0].revents & (events | POLLERR | POLLHUP | POLLNVAL))
            return 1;
    }
}

int
llmdd__read_full(int stop_fd, int fd, void *buf, size_t len,
                 int64_t deadline_ms)
{
    uint8_t *p = buf;

    while (len > 0) {
        ssize_t n = recv(fd, p, len, MSG_DONTWAIT);
        if (n > 0) {
            p += n;
            len -= (size_t)n;
            continue;
        }
        if (n == 0)
            return -1;
        if (errno == EINTR)
            continue;
        if (errno != EAGAIN && errno != EWOULDBLOCK)
            return -1;
        if (llmdd__wait_fd(stop_fd, fd, POLLIN, deadline_ms) != 1)
            return -1;
    }
    return 0;
}

int
llmdd__write_full(int stop_fd, int fd, const void *buf, size_t len,
                  int64_t deadline_ms)
{
    const uint8_t *p = buf;

    while (len > 0) {
        ssize_t n = send(fd, p, len, MSG_DONTWAIT | MSG_NOSIGNAL);
        if (n >= 0) {
            p += n;
            len -= (size_t)n;
            continue;
        }
        if (errno == EINTR)
            continue;
        if (errno != EAGAIN && errno != EWOULDBLOCK)
            return -1;
        if (llmdd__wait_fd(stop_fd, fd, POLLOUT, deadline_ms) != 1)
            return -1;
    }
    return 0;
}

int
llmdd__send_msg(int stop_fd, int fd, uint16_t type, const void *payload,
                size_t len, int64_t deadline_ms)
{
    uint8_t hdr[LLMDD_WIRE_HDR_LEN];
    struct iovec iov[2] = {{hdr, sizeof(hdr)}, {(void *)payload, len}};
    struct msghdr mh = {.msg_iov = iov, .msg_iovlen = len > 0 ? 2 : 1};

    llmdd__wire_frame_encode(hdr, type, (uint32_t)len);
    /* Small messages nearly always go in one call; finish by hand if not. */
    ssize_t n = sendmsg(fd, &mh, MSG_DONTWAIT | MSG_NOSIGNAL);
    if (n < 0) {
        if (errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR)
            return -1;
        n = 0;
    }
    size_t sent = (size_t)n;
    if (sent < sizeof(hdr)) {
        if (llmdd__write_full(stop_fd, fd, hdr + sent, sizeof(hdr) - sent,
                              deadline_ms) != 0)
            return -1;
        sent = sizeof(hdr);
    }
    sent -= sizeof(hdr);
    if (sent < len)
        return llmdd__write_full(stop_fd, fd, (const uint8_t *)payload + sent,
                                 len - sent, deadline_ms);
    return 0;
}

int
llmdd__recv_msg(int stop_fd, int fd, uint16_t *type, uint8_t *buf, size_t cap,
                size_t *len, int64_t deadline_ms, bool *timed_out)
{
    uint8_t hdr[LLMDD_WIRE_HDR_LEN];
    llmdd__frame f;

    *timed_out = false;
    if (llmdd__read_full(stop_fd, fd, hdr, sizeof(hdr), deadline_ms) != 0)
        goto err;
    if (llmdd__wire_frame_decode(hdr, &f) != 0 || f.len > cap) {
        uint16_t v;
        if (llmdd__wire_frame_foreign(hdr, &v))
            log_error("peer speaks llmdd protocol version %u; this side "
                      "speaks %u (llmdd %s): refused",
                      v, LLMDD_WIRE_VERSION, llmdd_version());
        return -1;
    }
    if (llmdd__read_full(stop_fd, fd, buf, f.len, deadline_ms) != 0)
        goto err;
    *type = f.type;
    *len = f.len;
    return 0;
err:
    *timed_out = llmdd__now_ms() >= deadline_ms;
    return -1;
}

bool
llmdd__sockaddr_loopback(const llmdd__sockaddr *a)
{
    if (a->addr.ss_family == AF_INET) {
        const struct sockaddr_in *v4 = (const struct sockaddr_in *)&a->addr;
        return (ntohl(v4->sin_addr.s_addr) >> 24) == 127;
    }
    if (a->addr.ss_family == AF_INET6) {
        const struct sockaddr_in6 *v6 = (const struct sockaddr_in6 *)&a->addr;
        /* A dual-stack listener sees an IPv4 peer as ::ffff:a.b.c.d. */
        if (IN6_IS_ADDR_V4MAPPED(&v6->sin6_addr))
            return v6->sin6_addr.s6_addr[12] == 127;
        return IN6_IS_ADDR_LOOPBACK(&v6->sin6_addr);
    }
    return false;
}

/*
 * Whether fd's connection stays on this host: its peer is a loopback
 * address, or the very address of this end (a host reaching one of its own
 * addresses goes over loopback too).
 */
static bool
sock_same_host(int fd)
{
    llmdd__sockaddr me = {.len = sizeof(me.addr)};
    llmdd__sockaddr peer = {.len = sizeof(peer.addr)};

    if (getsockname(fd, (struct sockaddr *)&me.addr, &me.len) != 0 ||
        getpeername(fd, (struct sockaddr *)&peer.addr, &peer.len) != 0)
        return false;
    if (llmdd__sockaddr_loopback(&peer))
        return true;
    if (me.addr.ss_family != peer.addr.ss_family)
        return false;
    if (me.addr.ss_family == AF_INET) {
        const struct sockaddr_in *a = (const struct sockaddr_in *)&me.addr;
        const struct sockaddr_in *b = (const struct sockaddr_in *)&peer.addr;
        return a->sin_addr.s_addr == b->sin_addr.s_addr;
    }
    if (me.addr.ss_family == AF_INET6) {
        const struct sockaddr_in6 *a = (const struct sockaddr_in6 *)&me.addr;
        const struct sockaddr_in6 *b = (const struct sockaddr_in6 *)&peer.addr;
        return IN6_ARE_ADDR_EQUAL(&a->sin6_addr, &b->sin6_addr);
    }
    return false;
}

void
llmdd__sock_tune(int fd, uint32_t user_timeout_ms)
{
    int one = 1;
    unsigned int uto = user_timeout_ms;

    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
    if (uto > 0)
        setsockopt(fd, IPPROTO_TCP, TCP_USER_TIMEOUT, &uto, sizeof(uto));
    /* Where the system does not offer it, the default stays. */
    if (sock_same_host(fd))
        (void)setsockopt(fd, IPPROTO_TCP, TCP_CONGESTION, LLMDD__SAME_HOST_CC,
                         sizeof(LLMDD__SAME_HOST_CC) - 1);
}

void
llmdd__sock_keepalive(int fd)
{
    int one = 1, idle = 5, intvl = 2, cnt = 3;

    setsockopt(fd, SOL_SOCKET, SO_KEEPALIVE, &one, sizeof(one));
    setsockopt(fd, IPPROTO_TCP, TCP_KEEPIDLE, &idle, sizeof(idle));
    setsockopt(fd, IPPROTO_TCP, TCP_KEEPINTVL, &intvl, sizeof(intvl));
    setsockopt(fd, IPPROTO_TCP, TCP_KEEPCNT, &cnt, sizeof(cnt));
}

/* Whether a failed connect's errno says the peer refused it or did not
 * answer (the far side's doing, which a later try may not meet), rather
 * than a failure of our own. */
static bool
connect_missed(int err)
{
    return err == ECONNREFUSED || err == ETIMEDOUT || err == EHOSTUNREACH ||
           err == ENETUNREACH || err == ECONNRESET || err == ECONNABORTED;
}

int
llmdd__connect(int stop_fd, const llmdd__sockaddr *addr,
               const llmdd__sockaddr *from, int64_t deadline_ms,
               enum llmdd__log_level miss_level, llmdd_status *status)
{
    char name[80];
    int fd, err = 0;
    socklen_t elen = sizeof(err);

    llmdd__sockaddr_str(addr, name, sizeof(name));
    fd = socket(addr->addr.ss_family,
                SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    if (fd < 0) {
        log_error("socket: %s", strerror(errno));
        *status = LLM_LINK_FAILED;
        return -1;
    }
    /* Binding first picks the interface (local_ip_infos); port 0, since
     * every connection of a link needs its own. */
    if (from != NULL && from->addr.ss_family != AF_UNSPEC &&
        bind(fd, (const struct sockaddr *)&from->addr, from->len) != 0) {
        err = errno;
        llmdd__sockaddr_str(from, name, sizeof(name));
        log_error("bind to local address %s: %s", name, strerror(err));
        close(fd);
        *status = LLM_LINK_FAILED;
        return -1;
    }
    if (connect(fd, (const struct sockaddr *)&addr->addr, addr->len) == 0)
        return fd;
    if (errno != EINPROGRESS) {
        err = errno;
        goto fail;
    }
    int w = llmdd__wait_fd(stop_fd, fd, POLLOUT, deadline_ms);
    if (w == 0) {
        LLMDD_LOG(miss_level, "connect to %s: timed out", name);
        close(fd);
        *status = LLM_TIMEOUT;
        return -1;
    }
    if (w < 0 || getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &elen) != 0 ||
        err != 0)
        goto fail;
    return fd;
fail:
    if (err == 0)
        err = ECONNABORTED; /* stop_fd fired, or no SO_ERROR to read */
    LLMDD_LOG(connect_missed(err) ? miss_level : LLMDD_LOG_ERROR,
              "connect to %s: %s", name, strerror(err));
    close(fd);
    *status = LLM_LINK_FAILED;
    return -1;
}
