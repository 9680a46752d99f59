# The ucx transport (src/transport/ucx): built when UCX's development files
# are found. LLMDD_WITH_UCX: AUTO builds it when pkg-config finds `ucx`, ON
# requires it, OFF leaves it out.
string(TOUPPER "${LLMDD_WITH_UCX}" _llmdd_with_ucx)
if(NOT _llmdd_with_ucx MATCHES "^(AUTO|ON|OFF)$")
  message(FATAL_ERROR "LLMDD_WITH_UCX must be AUTO, ON or OFF, not "
                      "'${LLMDD_WITH_UCX}'")
endif()
set(LLMDD_HAVE_UCX OFF)
if(NOT _llmdd_with_ucx STREQUAL "OFF")
  if(_llmdd_with_ucx STREQUAL "ON")
    pkg_check_modules(UCX REQUIRED IMPORTED_TARGET ucx)
  else()
    pkg_check_modules(UCX QUIET IMPORTED_TARGET ucx)
  endif()
  if(UCX_FOUND)
    set(LLMDD_HAVE_UCX ON)
    list(APPEND LLMDD_SOURCES
      src/transport/ucx/ucx.c
      src/transport/ucx/ucx_am.c
      src/transport/ucx/ucx_ctx.c
      src/transport/ucx/ucx_ep.c
      src/transport/ucx/ucx_serve.c
      src/transport/ucx/ucx_xfer.c
      src/transport/ucx/ucx_wire.c)
    list(APPEND LLMDD_DEFS LLMDD_HAVE_UCX)
    list(APPEND LLMDD_EXTRA_LIBS PkgConfig::UCX)
  endif()
endif()
if(LLMDD_HAVE_UCX)
  message(STATUS "llmdd: ucx transport: on (UCX ${UCX_VERSION})")
else()
  message(STATUS "llmdd: ucx transport: off (LLMDD_WITH_UCX=${LLMDD_WITH_UCX})")
endif()
unset(_llmdd_with_ucx)
