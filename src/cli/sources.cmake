# The `llmdd` tool: uses only the public API (<llmdd/llmdd.h>).
add_executable(llmdd_cli src/cli/main.c)
set_target_properties(llmdd_cli PROPERTIES OUTPUT_NAME llmdd)
target_link_libraries(llmdd_cli PRIVATE llmdd)
