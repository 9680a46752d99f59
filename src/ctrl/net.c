#include "ctrl/net.h"

#include <errno.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

int
llmdd__send_msg(llmdd *dd, int fd, uint16_t type, const void *payload,
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
        if (llmdd__write_full(dd, fd, hdr + sent, sizeof(hdr) - sent,
                              deadline_ms) != 0)
            return -1;
        sent = sizeof(hdr);
    }
    sent -= sizeof(hdr);
    if (sent < len)
        return llmdd__write_full(dd, fd, (const uint8_t *)payload + sent,
                                 len - sent, deadline_ms);
    return 0;
}

int
llmdd__recv_msg(llmdd *dd, int fd, uint16_t *type, uint8_t *buf, size_t cap,
                size_t *len, int64_t deadline_ms, bool *timed_out)
{
    uint8_t hdr[LLMDD_WIRE_HDR_LEN];
    llmdd__frame f;

    *timed_out = false;
    if (llmdd__read_full(dd, fd, hdr, sizeof(hdr), deadline_ms) != 0)
        goto err;
    if (llmdd__wire_frame_decode(hdr, &f) != 0 || f.len > cap)
        return -1;
    if (llmdd__read_full(dd, fd, buf, f.len, deadline_ms) != 0)
        goto err;
    *type = f.type;
    *len = f.len;
    return 0;
err:
    *timed_out = llmdd__now_ms() >= deadline_ms;
    return -1;
}

void
llmdd__sock_tune(int fd, bool keepalive)
{
    int one = 1;

    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
    if (keepalive) {
        int idle = 5, intvl = 2, cnt = 3;
        setsockopt(fd, SOL_SOCKET, SO_KEEPALIVE, &one, sizeof(one));
        setsockopt(fd, IPPROTO_TCP, TCP_KEEPIDLE, &idle, sizeof(idle));
        setsockopt(fd, IPPROTO_TCP, TCP_KEEPINTVL, &intvl, sizeof(intvl));
        setsockopt(fd, IPPROTO_TCP, TCP_KEEPCNT, &cnt, sizeof(cnt));
    }
}

int
llmdd__connect(llmdd *dd, const llmdd__sockaddr *addr, int64_t deadline_ms,
               llmdd_status *status)
{
    return llmdd__connect_from(dd, addr, NULL, deadline_ms, status);
}

int
llmdd__connect_from(llmdd *dd, const llmdd__sockaddr *addr,
                    const llmdd__sockaddr *from, int64_t deadline_ms,
                    llmdd_status *status)
{
    char name[80];
    int fd, err = 0;
    socklen_t elen = sizeof(err);

    llmdd__sockaddr_str(addr, name, sizeof(name));
    fd = socket(addr->addr.ss_family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC,
                0);
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
    int w = llmdd__wait_fd(dd, fd, POLLOUT, deadline_ms);
    if (w == 0) {
        log_error("connect to %s: timed out", name);
        close(fd);
        *status = LLM_TIMEOUT;
        return -1;
    }
    if (w < 0 || getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &elen) != 0 ||
        err != 0)
        goto fail;
    return fd;
fail:
    log_error("connect to %s: %s", name, strerror(err ? err : ECONNABORTED));
    close(fd);
    *status = LLM_LINK_FAILED;
    return -1;
}

int
llmdd__data_connect(llmdd__link *link, uint32_t flags, int64_t deadline)
{
    llmdd *dd = link->dd;
    llmdd__hello h = {.kind = CONN_DATA, .flags = flags};
    uint8_t buf[64];
    llmdd_status st;
    uint16_t type;
    uint32_t status;
    size_t len;
    bool to;
    int fd;

    fd = llmdd__connect_from(dd, &link->peer.addr, &link->bind_addr,
                             deadline, &st);
    if (fd < 0)
        return -1;
    llmdd__sock_tune(fd, false);
    memcpy(h.token, link->token, sizeof(h.token));
    len = llmdd__wire_hello_encode(&h, buf, sizeof(buf));
    if (llmdd__send_msg(dd, fd, WMSG_HELLO, buf, len, deadline) != 0 ||
        llmdd__recv_msg(dd, fd, &type, buf, sizeof(buf), &len, deadline,
                        &to) != 0 ||
        type != WMSG_DATA_REPLY ||
        llmdd__wire_u32_decode(buf, len, &status) != 0 ||
        status != LLM_SUCCESS) {
        log_error("data connection to cluster %llu refused",
                  (unsigned long long)link->peer.cluster_id);
        close(fd);
        return -1;
    }
    return fd;
}

