/* A C consumer of the installed library: it links and says its version. */
#include <llmdd/llmdd.h>
#include <stdio.h>
#include <string.h>

int
main(void)
{
    llmdd *dd;

    if (llmdd_create(1, LLMDD_ROLE_MIX, &dd) != LLM_SUCCESS ||
        llmdd_initialize(dd, NULL, 0) != LLM_SUCCESS)
        return 1;
    llmdd_destroy(dd);
    printf("c consumer: llmdd %s, %s\n", llmdd_version(),
           llmdd_status_str(LLM_TIMEOUT));
    return strcmp(llmdd_status_str(LLM_TIMEOUT), "LLM_TIMEOUT") != 0;
}
