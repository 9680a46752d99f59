/*
 * llmdd stats: polls a /metrics endpoint (`llmdd serve --metrics`) and
 * prints live rates: transfers/s and bytes/s by side and operation, and a
 * p50 interpolated from the latency histogram's buckets over the interval,
 * as Prometheus's histogram_quantile does.
 *
 * The HTTP client is a minimal one for our own endpoint: one GET over a
 * fresh connection with HTTP/1.0 (so the body ends at the close), every
 * read bounded by STATS_REPLY_MAX and a deadline. The operations and
 * buckets are learnt from the text, so the list of them stays in the
 * library alone.
 */
#include <errno.h>
#include <getopt.h>
#include <math.h>
#include <netdb.h>
#include <poll.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include "common.h"

#define STATS_REPLY_MAX (8u << 20) /* far above any instance's text */
#define STATS_TIMEOUT_MS 5000
#define STATS_ROWS 32 /* (side, op) pairs */
#define STATS_BUCKETS 64

static const char stats_usage[] =
    "Usage: llmdd stats --metrics-url http://IP:PORT/metrics [--interval S]\n"
    "                   [--count N]\n"
    "\n"
    "Polls the /metrics endpoint of `llmdd serve --metrics IP:PORT` and\n"
    "prints, every interval, transfers/s and bytes/s by side (caller: the\n"
    "instance called them; served: it answered a peer's request) and\n"
    "operation, and the p50 latency interpolated from the histogram.\n"
    "\n"
    "Options:\n"
    "  -u, --metrics-url URL  http://IP:PORT[/PATH] ([IPv6]:PORT for IPv6;\n"
    "                         the path defaults to /metrics)\n"
    "  -i, --interval S       seconds between reports (default 1; 0.05 to\n"
    "                         3600)\n"
    "  -n, --count N          stop after N reports (default: until Ctrl-C)\n"
    "  -h, --help             this text\n";

typedef struct {
    char side[16], op[32];
    double xfers, bytes;
    double le[STATS_BUCKETS], cum[STATS_BUCKETS]; /* summed over transports */
    size_t nb;
} stats_row;

typedef struct {
    stats_row rows[STATS_ROWS];
    size_t n;
    double links_in, links_out, in_flight;
    int64_t at_ns;
} stats_snap;

/* ---- A bounded HTTP/1.0 GET. ---- */

static int
stats_wait(int fd, short ev, int64_t deadline)
{
    int64_t left = (deadline - cli_now_ns()) / 1000000;
    struct pollfd p = {.fd = fd, .events = ev};

    if (left <= 0)
        return -1;
    int rc = poll(&p, 1, (int)left);
    return rc == 1 ? 0 : -1;
}

static int
stats_connect(const char *ip, uint16_t port, int64_t deadline)
{
    struct addrinfo hints = {.ai_flags = AI_NUMERICHOST | AI_NUMERICSERV,
                             .ai_socktype = SOCK_STREAM},
                    *ai;
    char ps[8];
    int fd, err = 0;
    socklen_t el = sizeof(err);

    snprintf(ps, sizeof(ps), "%u", (unsigned)port);
    if (getaddrinfo(ip, ps, &hints, &ai) != 0)
        return -1;
    fd = socket(ai->ai_family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    if (fd >= 0 && connect(fd, ai->ai_addr, ai->ai_addrlen) != 0 &&
        (errno != EINPROGRESS || stats_wait(fd, POLLOUT, deadline) != 0 ||
         getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &el) != 0 || err != 0)) {
        close(fd);
        fd = -1;
    }
    freeaddrinfo(ai);
    return fd;
}

/* The body of a 200 reply, malloc'd and NUL-terminated; NULL and a message
 * in err otherwise. */
static char *
stats_get(const char *ip, uint16_t port, const char *path, char *err,
          size_t cap)
{
    int64_t deadline = cli_now_ns() + (int64_t)STATS_TIMEOUT_MS * 1000000;
    char req[512];
    char *buf = NULL;
    size_t len = 0, sent = 0;
    int n = snprintf(req, sizeof(req),
                     "GET %s HTTP/1.0\r\nHost: %s\r\n"
                     "Accept: text/plain\r\n\r\n",
                     path, ip);
    int fd = stats_connect(ip, port, deadline);

    if (fd < 0) {
        snprintf(err, cap, "cannot connect to %s port %u", ip, (unsigned)port);
        return NULL;
    }
    while (sent < (size_t)n) {
        ssize_t w = send(fd, req + sent, (size_t)n - sent, MSG_NOSIGNAL);
        if (w < 0 && (errno != EAGAIN || stats_wait(fd, POLLOUT, deadline)))
            goto err_io;
        sent += w > 0 ? (size_t)w : 0;
    }
    buf = malloc(STATS_REPLY_MAX + 1);
    if (buf == NULL)
        goto err_io;
    for (;;) {
        if (len == STATS_REPLY_MAX) {
            snprintf(err, cap, "reply larger than %u bytes", STATS_REPLY_MAX);
            goto err;
        }
        ssize_t r = recv(fd, buf + len, STATS_REPLY_MAX - len, 0);
        if (r == 0)
            break;
        if (r < 0 && (errno != EAGAIN || stats_wait(fd, POLLIN, deadline)))
            goto err_io;
        len += r > 0 ? (size_t)r : 0;
    }
    close(fd);
    buf[len] = '\0';
    char *body = strstr(buf, "\r\n\r\n");
    if (len < 12 || strncmp(buf, "HTTP/1.", 7) != 0 || body == NULL) {
        snprintf(err, cap, "not an HTTP reply");
        free(buf);
        return NULL;
    }
    if (strncmp(buf + 8, " 200", 4) != 0) {
        char *eol = strchr(buf, '\r');
        snprintf(err, cap, "%.*s", (int)(eol - buf), buf);
        free(buf);
        return NULL;
    }
    body += 4;
    memmove(buf, body, len + 1 - (size_t)(body - buf));
    return buf;

err_io:
    snprintf(err, cap, "%s port %u: %s", ip, (unsigned)port,
             errno == 0 || errno == EAGAIN ? "timed out" : strerror(errno));
err:
    close(fd);
    free(buf);
    return NULL;
}

/* ---- The exposition text: only the lines we show. ---- */

/* The value of label `key` in `{...}` (labels[0..len)); our endpoint's
 * values never need escapes. */
static bool
stats_label(const char *labels, size_t len, const char *key, char *out,
            size_t cap)
{
    size_t kl = strlen(key);

    for (size_t i = 1; i + kl + 2 < len; i++) {
        if ((labels[i - 1] != '{' && labels[i - 1] != ',') ||
            strncmp(labels + i, key, kl) != 0 || labels[i + kl] != '=' ||
            labels[i + kl + 1] != '"')
            continue;
        const char *v = labels + i + kl + 2;
        const char *q = memchr(v, '"', len - (size_t)(v - labels));
        if (q == NULL || (size_t)(q - v) >= cap)
            return false;
        memcpy(out, v, (size_t)(q - v));
        out[q - v] = '\0';
        return true;
    }
    return false;
}

static stats_row *
stats_row_of(stats_snap *s, const char *side, const char *op)
{
    for (size_t i = 0; i < s->n; i++)
        if (strcmp(s->rows[i].side, side) == 0 &&
            strcmp(s->rows[i].op, op) == 0)
            return &s->rows[i];
    if (s->n == STATS_ROWS)
        return NULL;
    stats_row *r = &s->rows[s->n++];
    memset(r, 0, sizeof(*r));
    snprintf(r->side, sizeof(r->side), "%s", side);
    snprintf(r->op, sizeof(r->op), "%s", op);
    return r;
}

/* Adds a bucket's count, keeping the buckets sorted by bound. */
static void
stats_bucket(stats_row *r, double le, double v)
{
    size_t i = 0;

    while (i < r->nb && r->le[i] < le)
        i++;
    if (i < r->nb && r->le[i] == le) {
        r->cum[i] += v;
        return;
    }
    if (r->nb == STATS_BUCKETS)
        return;
    memmove(r->le + i + 1, r->le + i, (r->nb - i) * sizeof(double));
    memmove(r->cum + i + 1, r->cum + i, (r->nb - i) * sizeof(double));
    r->le[i] = le;
    r->cum[i] = v;
    r->nb++;
}

static void
stats_line(stats_snap *s, const char *p, size_t len)
{
    char side[16] = "caller", op[32], le[32], dir[8];
    size_t nl = 0, ll = 0;

    while (nl < len && p[nl] != '{' && p[nl] != ' ')
        nl++;
    const char *labels = p + nl;
    if (nl < len && p[nl] == '{') {
        const char *e = memchr(labels, '}', len - nl);
        if (e == NULL)
            return;
        ll = (size_t)(e - labels) + 1;
    }
    if (nl + ll >= len || p[nl + ll] != ' ')
        return;
    double v = strtod(p + nl + ll + 1, NULL);
#define IS(name) (nl == strlen(name) && strncmp(p, name, nl) == 0)
    if (IS("llmdd_transfers_in_flight")) {
        s->in_flight = v;
    } else if (IS("llmdd_links") &&
               stats_label(labels, ll, "direction", dir, sizeof(dir))) {
        *(strcmp(dir, "in") == 0 ? &s->links_in : &s->links_out) = v;
    } else if ((IS("llmdd_transfers_total") ||
                IS("llmdd_transfer_bytes_total")) &&
               stats_label(labels, ll, "side", side, sizeof(side)) &&
               stats_label(labels, ll, "op", op, sizeof(op))) {
        stats_row *r = stats_row_of(s, side, op);
        if (r != NULL)
            *(IS("llmdd_transfers_total") ? &r->xfers : &r->bytes) += v;
    } else if (IS("llmdd_transfer_duration_seconds_bucket") &&
               stats_label(labels, ll, "op", op, sizeof(op)) &&
               stats_label(labels, ll, "le", le, sizeof(le))) {
        stats_row *r = stats_row_of(s, "caller", op);
        if (r != NULL)
            stats_bucket(
                r, strcmp(le, "+Inf") == 0 ? INFINITY : strtod(le, NULL), v);
    }
#undef IS
}

static void
stats_parse(stats_snap *s, const char *text)
{
    memset(s, 0, sizeof(*s));
    s->at_ns = cli_now_ns();
    for (const char *p = text; *p != '\0';) {
        const char *e = strchr(p, '\n');
        size_t len = e != NULL ? (size_t)(e - p) : strlen(p);
        if (len > 0 && p[0] != '#')
            stats_line(s, p, len);
        p += len + (e != NULL);
    }
}

/* ---- Reports. ---- */

/* The median of the calls between two snapshots, in ns; -1 when none,
 * -2 when it lies past the last finite bound. */
static double
stats_p50(const stats_row *now, const stats_row *then)
{
    double d[STATS_BUCKETS];

    if (now->nb == 0)
        return -1;
    for (size_t i = 0; i < now->nb; i++) {
        d[i] = now->cum[i];
        if (then != NULL && then->nb == now->nb && then->le[i] == now->le[i])
            d[i] -= then->cum[i];
    }
    double total = d[now->nb - 1], want = total / 2;
    if (total <= 0)
        return -1;
    for (size_t i = 0; i < now->nb; i++) {
        if (d[i] < want)
            continue;
        if (isinf(now->le[i]))
            return -2;
        double lo = i > 0 ? now->le[i - 1] : 0, prev = i > 0 ? d[i - 1] : 0;
        double f = d[i] > prev ? (want - prev) / (d[i] - prev) : 1;
        return (lo + (now->le[i] - lo) * f) * 1e9;
    }
    return -1;
}

static void
stats_report(const char *url, const stats_snap *now, const stats_snap *then)
{
    double secs = (double)(now->at_ns - then->at_ns) / 1e9;
    char b[32], t[32];

    printf("%s over %.2f s: links in %.0f out %.0f, transfers in flight "
           "%.0f\n",
           url, secs, now->links_in, now->links_out, now->in_flight);
    if (now->n == 0) {
        printf("  no transfers yet\n");
        return;
    }
    printf("  %-7s %-12s %12s %14s %10s\n", "side", "op", "transfers/s",
           "bytes/s", "p50");
    for (size_t i = 0; i < now->n; i++) {
        const stats_row *r = &now->rows[i], *o = NULL;
        for (size_t j = 0; j < then->n && o == NULL; j++)
            if (strcmp(then->rows[j].side, r->side) == 0 &&
                strcmp(then->rows[j].op, r->op) == 0)
                o = &then->rows[j];
        double dx = r->xfers - (o ? o->xfers : 0);
        double db = r->bytes - (o ? o->bytes : 0);
        double p = stats_p50(r, o);
        cli_fmt_bytes(b, sizeof(b), (uint64_t)(db > 0 ? db / secs : 0));
        if (p == -1)
            snprintf(t, sizeof(t), "-");
        else if (p == -2)
            snprintf(t, sizeof(t), "> 10 s");
        else
            cli_fmt_ns(t, sizeof(t), (int64_t)p);
        printf("  %-7s %-12s %12.1f %12s/s %10s\n", r->side, r->op,
               dx > 0 ? dx / secs : 0, b, t);
    }
}

/* "http://HOST:PORT[/PATH]" into ip, port and path. */
static bool
stats_url(const char *url, char *ip, size_t ipcap, uint16_t *port, char *path,
          size_t pcap)
{
    char hp[LLMDD_IP_LEN + 16];

    if (strncmp(url, "http://", 7) != 0)
        return false;
    url += 7;
    const char *slash = strchr(url, '/');
    size_t hl = slash != NULL ? (size_t)(slash - url) : strlen(url);
    if (hl == 0 || hl >= sizeof(hp))
        return false;
    memcpy(hp, url, hl);
    hp[hl] = '\0';
    if (!cli_parse_hostport(hp, 1, ip, ipcap, port))
        return false;
    const char *p = slash != NULL ? slash : "/metrics";
    if (strlen(p) >= pcap || strpbrk(p, " \r\n") != NULL)
        return false;
    snprintf(path, pcap, "%s", p);
    return true;
}

typedef struct {
    const char *url;
    double interval;
    uint64_t count;
} stats_cfg;

static int
stats_opt(void *ctx, int opt, const char *arg)
{
    stats_cfg *c = ctx;
    char *end;

    switch (opt) {
    case 'u':
        c->url = arg;
        break;
    case 'i':
        c->interval = strtod(arg, &end);
        if (end == arg || *end != '\0' || !(c->interval >= 0.05) ||
            c->interval > 3600)
            return cli_usage_err("--interval: \"%s\" is not 0.05..3600 "
                                 "seconds",
                                 arg);
        break;
    case 'n':
        if (!cli_parse_u64(arg, 1, UINT64_MAX, &c->count))
            return cli_usage_err("--count: bad number \"%s\"", arg);
        break;
    default:
        return cli_usage_err("bad option");
    }
    return 0;
}

int
cli_stats(int argc, char **argv)
{
    static const struct option longopts[] = {
        {"metrics-url", required_argument, NULL, 'u'},
        {"interval", required_argument, NULL, 'i'},
        {"count", required_argument, NULL, 'n'},
        {NULL, 0, NULL, 0},
    };
    const cli_args a = {.usage = stats_usage};
    stats_cfg c = {.interval = 1};
    char ip[LLMDD_IP_LEN], path[256], err[256];
    uint16_t port = 0;
    stats_snap *snaps = NULL;
    int rc = cli_args_parse(&a, longopts, "u:i:n:", stats_opt, &c, argc, argv);

    if (rc != 0)
        return rc < 0 ? CLI_EXIT_OK : rc;
    if (c.url == NULL)
        return cli_usage_err("--metrics-url is required");
    if (!stats_url(c.url, ip, sizeof(ip), &port, path, sizeof(path)))
        return cli_usage_err("--metrics-url: \"%s\" is not "
                             "http://IP:PORT[/PATH]",
                             c.url);
    setvbuf(stdout, NULL, _IOLBF, 0);
    rc = CLI_EXIT_FAIL;
    snaps = calloc(2, sizeof(*snaps)); /* too big for the stack */
    if (snaps == NULL) {
        cli_err("out of memory");
        goto out;
    }
    struct timespec nap = {
        .tv_sec = (time_t)c.interval,
        .tv_nsec = (long)((c.interval - (double)(time_t)c.interval) * 1e9)};
    for (uint64_t i = 0; c.count == 0 || i <= c.count; i++) {
        if (i > 0)
            nanosleep(&nap, NULL);
        char *text = stats_get(ip, port, path, err, sizeof(err));
        if (text == NULL) {
            cli_err("%s: %s", c.url, err);
            goto out;
        }
        stats_parse(&snaps[i % 2], text);
        free(text);
        if (i > 0)
            stats_report(c.url, &snaps[i % 2], &snaps[(i + 1) % 2]);
    }
    rc = CLI_EXIT_OK;
out:
    free(snaps);
    return rc;
}
