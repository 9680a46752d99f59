// A C++ consumer of the installed headers: both the C API and the
// reference's, whose status names live in its namespaces, not in macros.
#include <llm_datadist/llm_datadist.h>
#include <llmdd/llmdd.h>

#include <cstdio>

int main()
{
    static_assert(llm_datadist::LLM_SUCCESS == 0U, "status values");
    static_assert(ge::LLM_PARAM_INVALID == 0x5010B005U, "status values");
    static_assert(llm_datadist::DT_BF16 == 27, "data types");
    llm_datadist::LlmDataDist dd(1, llm_datadist::LlmRole::kMix);
    std::map<llm_datadist::AscendString, llm_datadist::AscendString> o;
    if (dd.Initialize(o) != llm_datadist::LLM_SUCCESS)
        return 1;
    std::printf("c++ consumer: %s\n", llmdd_status_str(LLM_TIMEOUT));
    return 0;
}
