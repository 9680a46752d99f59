/*
 * The tool's /metrics endpoint (`llmdd serve --metrics IP:PORT`): GET
 * /metrics answers llmdd_metrics_text in Prometheus text format 0.0.4;
 * every other path is 404, every other method 405. libmicrohttpd runs it on
 * its own thread; only the tool links libmicrohttpd, never the library.
 *
 * Clients are untrusted: at most HTTP_CONNS connections, HTTP_PER_IP from
 * one address, and each request must arrive whole within HTTP_REQUEST_MS
 * of its first byte's chance (the connection's start, or the end of its
 * previous request), or its connection is cut. libmicrohttpd's own timeout
 * counts silence, which a client trickling a header byte now and then
 * never leaves; the cap counts the whole request. A watchdog thread cuts
 * the late ones (shutdown(2): libmicrohttpd then closes them).
 */
#include <arpa/inet.h>
#include <microhttpd.h>
#include <netinet/in.h>
#include <poll.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include "common.h"

#define METRICS_CTYPE "text/plain; version=0.0.4; charset=utf-8"
#define HTTP_CONNS 32
#define HTTP_PER_IP 16
#define HTTP_IDLE_S 5        /* libmicrohttpd's silence timeout */
#define HTTP_REQUEST_MS 2000 /* a whole request, however it trickles */

/* A connection as the watchdog sees it; NULL fd slot: free. */
typedef struct {
    int fd; /* -1: free */
    int64_t since;
} http_conn;

struct cli_metrics_server {
    struct MHD_Daemon *d;
    llmdd *dd;
    pthread_mutex_t lock;
    http_conn conns[HTTP_CONNS];
    int stop_fd[2]; /* a pipe: the watchdog's stop */
    pthread_t watchdog;
    bool watching;
};

static int64_t
now_ms(void)
{
    struct timespec ts;

    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

/*
 * libmicrohttpd's connection events: a new one is tracked, a closed one
 * forgotten (before libmicrohttpd closes its fd, so the watchdog never
 * shuts down a number reused by another file).
 */
static void
conn_event(void *cls, struct MHD_Connection *c, void **ctx,
           enum MHD_ConnectionNotificationCode code)
{
    struct cli_metrics_server *s = cls;
    http_conn *hc = *ctx;

    pthread_mutex_lock(&s->lock);
    if (code == MHD_CONNECTION_NOTIFY_STARTED) {
        const union MHD_ConnectionInfo *i =
            MHD_get_connection_info(c, MHD_CONNECTION_INFO_CONNECTION_FD);
        for (int k = 0; k < HTTP_CONNS && i != NULL; k++) {
            if (s->conns[k].fd < 0) {
                s->conns[k] = (http_conn){.fd = i->connect_fd,
                                          .since = now_ms()};
                *ctx = &s->conns[k];
                break;
            }
        }
    } else if (hc != NULL) {
        hc->fd = -1;
        *ctx = NULL;
    }
    pthread_mutex_unlock(&s->lock);
}

/* A request was answered: the next one's time starts now. */
static void
request_done(void *cls, struct MHD_Connection *c, void **req_ctx,
             enum MHD_RequestTerminationCode code)
{
    struct cli_metrics_server *s = cls;
    const union MHD_ConnectionInfo *i =
        MHD_get_connection_info(c, MHD_CONNECTION_INFO_SOCKET_CONTEXT);
    (void)req_ctx;
    (void)code;

    pthread_mutex_lock(&s->lock);
    if (i != NULL && i->socket_context != NULL)
        ((http_conn *)i->socket_context)->since = now_ms();
    pthread_mutex_unlock(&s->lock);
}

static void *
watchdog_main(void *arg)
{
    struct cli_metrics_server *s = arg;

    for (;;) {
        struct pollfd p = {.fd = s->stop_fd[0], .events = POLLIN};
        if (poll(&p, 1, HTTP_REQUEST_MS / 4) != 0)
            return NULL;
        int64_t now = now_ms();
        pthread_mutex_lock(&s->lock);
        for (int k = 0; k < HTTP_CONNS; k++)
            if (s->conns[k].fd >= 0 &&
                now - s->conns[k].since > HTTP_REQUEST_MS) {
                shutdown(s->conns[k].fd, SHUT_RDWR);
                s->conns[k].since = INT64_MAX / 2; /* once */
            }
        pthread_mutex_unlock(&s->lock);
    }
}

static enum MHD_Result
reply(struct MHD_Connection *c, unsigned code, char *body, size_t len,
      const char *ctype)
{
    struct MHD_Response *r =
        MHD_create_response_from_buffer(len, body, MHD_RESPMEM_MUST_FREE);
    enum MHD_Result ok;

    if (r == NULL) {
        free(body);
        return MHD_NO;
    }
    MHD_add_response_header(r, MHD_HTTP_HEADER_CONTENT_TYPE, ctype);
    ok = MHD_queue_response(c, code, r);
    MHD_destroy_response(r);
    return ok;
}

static enum MHD_Result
metrics_handler(void *cls, struct MHD_Connection *c, const char *url,
                const char *method, const char *version,
                const char *upload_data, size_t *upload_data_size,
                void **con_cls)
{
    struct cli_metrics_server *s = cls;
    (void)version;
    (void)upload_data;
    (void)upload_data_size;
    (void)con_cls;

    if (strcmp(url, "/metrics") != 0)
        return reply(c, MHD_HTTP_NOT_FOUND, strdup("not found\n"), 10,
                     "text/plain");
    if (strcmp(method, "GET") != 0 && strcmp(method, "HEAD") != 0)
        return reply(c, MHD_HTTP_METHOD_NOT_ALLOWED,
                     strdup("method not allowed\n"), 19, "text/plain");
    /* The text may grow between measuring and writing: retry with room. */
    size_t cap = llmdd_metrics_text(s->dd, NULL, 0) + 4096;
    for (int tries = 0; tries < 4; tries++) {
        char *buf = malloc(cap);
        if (buf == NULL)
            return MHD_NO;
        size_t n = llmdd_metrics_text(s->dd, buf, cap);
        if (n < cap)
            return reply(c, MHD_HTTP_OK, buf, n, METRICS_CTYPE);
        free(buf);
        cap = n + 4096;
    }
    return MHD_NO;
}

cli_metrics_server *
cli_metrics_start(llmdd *dd, const char *ip, uint16_t port, char *err,
                  size_t cap)
{
    struct cli_metrics_server *s = calloc(1, sizeof(*s));
    struct sockaddr_in6 a6 = {.sin6_family = AF_INET6,
                              .sin6_port = htons(port)};
    struct sockaddr_in a4 = {.sin_family = AF_INET, .sin_port = htons(port)};
    const struct sockaddr *sa;
    unsigned flags = MHD_USE_INTERNAL_POLLING_THREAD;

    if (s == NULL) {
        snprintf(err, cap, "--metrics: out of memory");
        return NULL;
    }
    if (inet_pton(AF_INET, ip, &a4.sin_addr) == 1) {
        sa = (const struct sockaddr *)&a4;
    } else if (inet_pton(AF_INET6, ip, &a6.sin6_addr) == 1) {
        sa = (const struct sockaddr *)&a6;
        flags |= MHD_USE_IPv6;
    } else {
        snprintf(err, cap, "--metrics: \"%s\" is not an IP address", ip);
        free(s);
        return NULL;
    }
    s->dd = dd;
    pthread_mutex_init(&s->lock, NULL);
    for (int k = 0; k < HTTP_CONNS; k++)
        s->conns[k].fd = -1;
    if (pipe(s->stop_fd) != 0) {
        snprintf(err, cap, "--metrics: no pipe for the watchdog");
        goto err_lock;
    }
    s->d = MHD_start_daemon(
        flags, port, NULL, NULL, metrics_handler, s, MHD_OPTION_SOCK_ADDR, sa,
        MHD_OPTION_CONNECTION_TIMEOUT, (unsigned)HTTP_IDLE_S,
        MHD_OPTION_CONNECTION_LIMIT, (unsigned)HTTP_CONNS,
        MHD_OPTION_PER_IP_CONNECTION_LIMIT, (unsigned)HTTP_PER_IP,
        MHD_OPTION_NOTIFY_CONNECTION, conn_event, s,
        MHD_OPTION_NOTIFY_COMPLETED, request_done, s, MHD_OPTION_END);
    if (s->d == NULL) {
        snprintf(err, cap,
                 "--metrics: cannot serve HTTP on port %u of %s (in use?)",
                 (unsigned)port, ip);
        goto err_pipe;
    }
    if (pthread_create(&s->watchdog, NULL, watchdog_main, s) != 0) {
        snprintf(err, cap, "--metrics: cannot start the watchdog thread");
        MHD_stop_daemon(s->d);
        goto err_pipe;
    }
    s->watching = true;
    return s;
err_pipe:
    close(s->stop_fd[0]);
    close(s->stop_fd[1]);
err_lock:
    pthread_mutex_destroy(&s->lock);
    free(s);
    return NULL;
}

uint16_t
cli_metrics_port(const cli_metrics_server *s)
{
    const union MHD_DaemonInfo *i =
        MHD_get_daemon_info(s->d, MHD_DAEMON_INFO_BIND_PORT);

    return i != NULL ? i->port : 0;
}

void
cli_metrics_stop(cli_metrics_server *s)
{
    if (s == NULL)
        return;
    if (s->watching) {
        (void)!write(s->stop_fd[1], "x", 1);
        pthread_join(s->watchdog, NULL);
    }
    MHD_stop_daemon(s->d);
    close(s->stop_fd[0]);
    close(s->stop_fd[1]);
    pthread_mutex_destroy(&s->lock);
    free(s);
}

/*
 * The transport of the transfers dd called, as its metrics name it: the
 * first caller-side series of llmdd_transfers_total. "" when none moved.
 */
void
cli_transport_used(llmdd *dd, char *out, size_t cap)
{
    static const char series[] = "\nllmdd_transfers_total{side=\"caller\"";
    size_t need = llmdd_metrics_text(dd, NULL, 0) + 4096;
    char *buf = malloc(need);

    out[0] = '\0';
    if (buf == NULL)
        return;
    llmdd_metrics_text(dd, buf, need);
    const char *p = strstr(buf, series);
    const char *end = p != NULL ? strchr(p + 1, '\n') : NULL;
    const char *t = p != NULL ? strstr(p, "transport=\"") : NULL;
    if (t != NULL && (end == NULL || t < end)) {
        t += strlen("transport=\"");
        size_t n = strcspn(t, "\"");
        if (n < cap) {
            memcpy(out, t, n);
            out[n] = '\0';
        }
    }
    free(buf);
}
