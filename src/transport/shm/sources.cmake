# The shm transport: same-kernel peers share memfds and use CMA.
list(APPEND LLMDD_SOURCES
  src/transport/shm/shm.c
  src/transport/shm/shm_sock.c
  src/transport/shm/shm_xfer.c)
list(APPEND LLMDD_DEFS LLMDD_HAVE_SHM)
