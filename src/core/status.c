#include <llmdd/llmdd.h>

#include "core/internal.h"

/* The C macros are the list's mirror: a value that drifts fails the build. */
#define CHECK_MACRO(name, value) _Static_assert(name == value, #name);
LLMDD_STATUS_MAP(CHECK_MACRO)
#undef CHECK_MACRO

const char *
llmdd_status_str(llmdd_status s)
{
    switch (s) {
#define NAME(name, value)                                                      \
    case value:                                                                \
        return #name;
        LLMDD_STATUS_MAP(NAME)
#undef NAME
    default:
        return "LLM_UNKNOWN_STATUS";
    }
}

#define XSTR(x) #x
#define VSTR(a, b, c) XSTR(a) "." XSTR(b) "." XSTR(c)

const char *
llmdd_version(void)
{
    return VSTR(LLMDD_VERSION_MAJOR, LLMDD_VERSION_MINOR, LLMDD_VERSION_PATCH);
}

enum llmdd__log_level
llmdd__link_fail_level(llmdd_status st)
{
    switch (st) {
    case LLM_PROCESSING_LINK:
    case LLM_LINK_BUSY:
    case LLM_TIMEOUT:
    case LLM_ALREADY_LINK:
        return LLMDD_LOG_INFO;
    default:
        return LLMDD_LOG_ERROR;
    }
}
