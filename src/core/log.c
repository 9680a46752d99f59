#include "core/log.h"

#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <time.h>
#include <unistd.h>

static int log_level = LLMDD_LOG_WARN;
static pthread_once_t log_once = PTHREAD_ONCE_INIT;

static const char *const level_names[] = {"error", "warn", "info", "debug"};

static void
log_init(void)
{
    const char *env = getenv("LLMDD_LOG_LEVEL");

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

void
llmdd__log(enum llmdd__log_level level, const char *fmt, ...)
{
    char line[1024];
    struct timespec ts;
    va_list ap;
    int n;

    clock_gettime(CLOCK_REALTIME, &ts);
    n = snprintf(line, sizeof(line), "llmdd %ld.%06ld %d %s: ",
                 (long)ts.tv_sec, ts.tv_nsec / 1000L, (int)getpid(),
                 level_names[level]);
    va_start(ap, fmt);
    n += vsnprintf(line + n, sizeof(line) - (size_t)n - 1, fmt, ap);
    va_end(ap);
    if (n > (int)sizeof(line) - 2)
        n = (int)sizeof(line) - 2;
    line[n++] = '\n';
    (void)!write(STDERR_FILENO, line, (size_t)n);
}
