/*
 * Shared by the fuzz targets. Each target defines LLVMFuzzerTestOneInput and,
 * when it needs set-up, LLVMFuzzerInitialize. Built with clang and
 * -fsanitize=fuzzer they are libFuzzer targets; built with the default
 * compiler and replay.c they replay a corpus (a regression test under CTest).
 */
#ifndef LLMDD_TESTS_FUZZ_H
#define LLMDD_TESTS_FUZZ_H

#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);
int LLVMFuzzerInitialize(int *argc, char ***argv);

/* A broken contract is a crash, so the fuzzer keeps the input. */
#define FUZZ_CHECK(cond)                                                       \
    do {                                                                       \
        if (!(cond)) {                                                         \
            fprintf(stderr, "%s:%d: check failed: %s\n", __FILE__, __LINE__,  \
                    #cond);                                                    \
            abort();                                                           \
        }                                                                      \
    } while (0)

#endif
