# The `llmdd` tool: uses only the public API (<llmdd/llmdd.h>), cJSON and,
# for the /metrics endpoint of `llmdd serve`, libmicrohttpd (the library
# itself never links it).
pkg_check_modules(MHD REQUIRED IMPORTED_TARGET libmicrohttpd)
add_executable(llmdd_cli
  src/cli/main.c
  src/cli/messages.c
  src/cli/args.c
  src/cli/shape.c
  src/cli/fill.c
  src/cli/node.c
  src/cli/demo.c
  src/cli/demo_node.c
  src/cli/serve.c
  src/cli/pull.c
  src/cli/bench.c
  src/cli/bench_args.c
  src/cli/bench_node.c
  src/cli/bench_base.c
  src/cli/bench_report.c
  src/cli/bench_fleet.c
  src/cli/bench_fleet_node.c
  src/cli/bench_discovery.c
  src/cli/bench_slices.c
  src/cli/info.c
  src/cli/metrics_http.c
  src/cli/stats.c
)
set_target_properties(llmdd_cli PROPERTIES OUTPUT_NAME llmdd)
target_link_libraries(llmdd_cli PRIVATE llmdd PkgConfig::CJSON PkgConfig::MHD
                      Threads::Threads)
