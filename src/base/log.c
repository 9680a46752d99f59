#include "base/log.h"

#include <pthread.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <time.h>
#include <unistd.h>

static int log_level = LLMDD_LOG_WARN;
static bool log_json;
static pthread_once_t log_once = PTHREAD_ONCE_INIT;

static const char *const level_names[] = {"error", "warn", "info", "debug"};

static void
log_init(void)
{
    const char *env = getenv("LLMDD_LOG_LEVEL");
    const char *fmt = getenv("LLMDD_LOG_FORMAT");

    log_json = fmt != NULL && strcasecmp(fmt, "json") == 0;
    if (env == NULL || *env == '\0')
        return;
    for (int i = 0; i < 4; i++) {
        if (strcasecmp(env, level_names[i]) == 0 ||
            (env[0] == '0' + i && env[1] == '\0')) {
            log_level = i;
            return;
        }
    }
    if (strcasecmp(env, "warning") == 0 || strcasecmp(env, "trace") == 0)
        log_level = env[0] == 'w' || env[0] == 'W' ? LLMDD_LOG_WARN
                                                   : LLMDD_LOG_DEBUG;
}

int
llmdd__log_enabled(enum llmdd__log_level level)
{
    pthread_once(&log_once, log_init);
    return (int)level <= log_level;
}

/* "2026-01-31T12:34:56.789Z": what collectors parse without configuration. */
static void
log_time(char *buf, size_t cap)
{
    struct timespec ts;
    struct tm tm;

    clock_gettime(CLOCK_REALTIME, &ts);
    gmtime_r(&ts.tv_sec, &tm);
    size_t n = strftime(buf, cap, "%Y-%m-%dT%H:%M:%S", &tm);
    snprintf(buf + n, cap - n, ".%03ldZ", ts.tv_nsec / 1000000L);
}

/* msg as the body of a JSON string: quotes, backslashes and control bytes
 * escaped; bytes from 0x80 pass as they are (our messages are UTF-8).
 * Returns the length written; stops whole escapes short of cap. */
static size_t
log_escape(char *out, size_t cap, const char *msg)
{
    size_t n = 0;

    for (const unsigned char *p = (const unsigned char *)msg; *p; p++) {
        char e[8];
        size_t el;
        if (*p == '"' || *p == '\\') {
            e[0] = '\\';
            e[1] = (char)*p;
            el = 2;
        } else if (*p == '\n' || *p == '\t' || *p == '\r') {
            e[0] = '\\';
            e[1] = *p == '\n' ? 'n' : *p == '\t' ? 't' : 'r';
            el = 2;
        } else if (*p < 0x20 || *p == 0x7f) {
            el = (size_t)snprintf(e, sizeof(e), "\\u%04x", *p);
        } else {
            e[0] = (char)*p;
            el = 1;
        }
        if (n + el > cap)
            break;
        memcpy(out + n, e, el);
        n += el;
    }
    return n;
}

void
llmdd__log(enum llmdd__log_level level, const char *fmt, ...)
{
    char msg[1024], ts[40], line[4096];
    va_list ap;
    int n;

    pthread_once(&log_once, log_init); /* callers may skip log_enabled */
    va_start(ap, fmt);
    vsnprintf(msg, sizeof(msg), fmt, ap);
    va_end(ap);
    log_time(ts, sizeof(ts));
    if (log_json) {
        n = snprintf(line, sizeof(line),
                     "{\"ts\":\"%s\",\"level\":\"%s\",\"pid\":%d,\"tid\":%d,"
                     "\"msg\":\"",
                     ts, level_names[level], (int)getpid(), (int)gettid());
        /* Room for the closing quote, brace and newline. */
        n += (int)log_escape(line + n, sizeof(line) - (size_t)n - 3, msg);
        memcpy(line + n, "\"}\n", 3);
        n += 3;
    } else {
        n = snprintf(line, sizeof(line), "llmdd %s %d/%d %s: %s", ts,
                     (int)getpid(), (int)gettid(), level_names[level], msg);
        if (n > (int)sizeof(line) - 2)
            n = (int)sizeof(line) - 2;
        line[n++] = '\n';
    }
    (void)!write(STDERR_FILENO, line, (size_t)n);
}
