/*
 * The tool's /metrics endpoint (`llmdd serve --metrics IP:PORT`): GET
 * /metrics answers llmdd_metrics_text in Prometheus text format 0.0.4;
 * every other path is 404, every other method 405. libmicrohttpd runs it on
 * its own thread; only the tool links libmicrohttpd, never the library.
 */
#include <arpa/inet.h>
#include <microhttpd.h>
#include <netinet/in.h>
#include <stdlib.h>
#include <string.h>

#include "common.h"

#define METRICS_CTYPE "text/plain; version=0.0.4; charset=utf-8"

struct cli_metrics_server {
    struct MHD_Daemon *d;
    llmdd *dd;
};

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
    s->d = MHD_start_daemon(
        flags, port, NULL, NULL, metrics_handler, s, MHD_OPTION_SOCK_ADDR, sa,
        MHD_OPTION_CONNECTION_TIMEOUT, (unsigned)10,
        MHD_OPTION_CONNECTION_LIMIT, (unsigned)16, MHD_OPTION_END);
    if (s->d == NULL) {
        snprintf(err, cap,
                 "--metrics: cannot serve HTTP on port %u of %s (in use?)",
                 (unsigned)port, ip);
        free(s);
        return NULL;
    }
    return s;
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
    MHD_stop_daemon(s->d);
    free(s);
}
