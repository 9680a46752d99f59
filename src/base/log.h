/*
 * A small leveled logger. The level comes from LLMDD_LOG_LEVEL (error, warn,
 * info, debug, or 0..4), read once; the default is warn. Lines go to stderr:
 *   llmdd 2026-01-31T12:34:56.789Z PID/TID warn: message
 * or, with LLMDD_LOG_FORMAT=json, one JSON object a line for collectors:
 *   {"ts":"...Z","level":"warn","pid":1,"tid":2,"msg":"message"}
 * Timestamps are UTC with milliseconds. Lines carry pid and tid, not the
 * instance's cluster id: the log functions take no instance, and a
 * thread-local id would have to be set on every API entry and library
 * thread; messages about a peer name its cluster, and a process usually
 * holds one instance (docs/operations.md).
 * Thread-safe: each line is written with one write(2).
 */
#ifndef LLMDD_BASE_LOG_H
#define LLMDD_BASE_LOG_H

enum llmdd__log_level {
    LLMDD_LOG_ERROR = 0,
    LLMDD_LOG_WARN = 1,
    LLMDD_LOG_INFO = 2,
    LLMDD_LOG_DEBUG = 3,
};

int llmdd__log_enabled(enum llmdd__log_level level);
void llmdd__log(enum llmdd__log_level level, const char *fmt, ...)
    __attribute__((format(printf, 2, 3)));

#define LLMDD_LOG(lvl, ...)                                                    \
    do {                                                                       \
        if (llmdd__log_enabled(lvl))                                           \
            llmdd__log(lvl, __VA_ARGS__);                                      \
    } while (0)
#define log_error(...) LLMDD_LOG(LLMDD_LOG_ERROR, __VA_ARGS__)
#define log_warn(...) LLMDD_LOG(LLMDD_LOG_WARN, __VA_ARGS__)
#define log_info(...) LLMDD_LOG(LLMDD_LOG_INFO, __VA_ARGS__)
#define log_debug(...) LLMDD_LOG(LLMDD_LOG_DEBUG, __VA_ARGS__)

#endif
