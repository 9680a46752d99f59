# The `llmdd` tool: uses only the public API (<llmdd/llmdd.h>) and cJSON.
add_executable(llmdd_cli
  src/cli/main.c
  src/cli/common.c
  src/cli/demo.c
  src/cli/serve.c
  src/cli/pull.c
  src/cli/bench.c
  src/cli/info.c
)
set_target_properties(llmdd_cli PROPERTIES OUTPUT_NAME llmdd)
target_link_libraries(llmdd_cli PRIVATE llmdd PkgConfig::CJSON Threads::Threads)
