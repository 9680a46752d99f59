#include <llmdd/llmdd.h>
#include <stdio.h>

int
main(void)
{
    printf("llmdd %s\n", llmdd_version());
    return 0;
}
