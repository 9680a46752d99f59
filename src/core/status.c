#include <llmdd/llmdd.h>

#define STR(x)                                                                 \
    case x:                                                                    \
        return #x

const char *
llmdd_status_str(llmdd_status s)
{
    switch (s) {
        STR(LLM_SUCCESS);
        STR(LLM_FAILED);
        STR(LLM_WAIT_PROC_TIMEOUT);
        STR(LLM_KV_CACHE_NOT_EXIST);
        STR(LLM_REPEAT_REQUEST);
        STR(LLM_REQUEST_ALREADY_COMPLETED);
        STR(LLM_PARAM_INVALID);
        STR(LLM_ENGINE_FINALIZED);
        STR(LLM_NOT_YET_LINK);
        STR(LLM_ALREADY_LINK);
        STR(LLM_LINK_FAILED);
        STR(LLM_UNLINK_FAILED);
        STR(LLM_NOTIFY_PROMPT_UNLINK_FAILED);
        STR(LLM_CLUSTER_NUM_EXCEED_LIMIT);
        STR(LLM_PROCESSING_LINK);
        STR(LLM_DEVICE_OUT_OF_MEMORY);
        STR(LLM_PREFIX_ALREADY_EXIST);
        STR(LLM_PREFIX_NOT_EXIST);
        STR(LLM_SEQ_LEN_OVER_LIMIT);
        STR(LLM_NO_FREE_BLOCK);
        STR(LLM_BLOCKS_OUT_OF_MEMORY);
        STR(LLM_CACHE_INCOMPATIBLE);
        STR(LLM_CACHE_KEY_ALREADY_EXIST);
        STR(LLM_COPY_CACHE_FAILED);
        STR(LLM_CACHE_ID_ALREADY_EXIST);
        STR(LLM_EXIST_LINK);
        STR(LLM_FEATURE_NOT_ENABLED);
        STR(LLM_TIMEOUT);
        STR(LLM_LINK_BUSY);
        STR(LLM_OUT_OF_MEMORY);
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
