/*
 * Fuzz target: what a metadata server hands back (src/meta/entry.c). The
 * first byte picks the decoder: a published entry (another host wrote it),
 * base64 (every key and value of the gateway), the llm.MetadataServer
 * text. Checks the contracts: an accepted entry is within its limits and
 * encodes to text that decodes to the same entry; base64 never writes past
 * its buffer and round-trips (as bytes).
 */
#include <string.h>

#include "fuzz/fuzz.h"
#include "meta/meta.h"

#define INPUT_MAX (LLMDD_META_VALUE_MAX + 64)

static void
check_entry(const llmdd__meta_entry *e)
{
    char buf[LLMDD_META_VALUE_MAX];
    llmdd__meta_entry again;

    FUZZ_CHECK(e->role >= 1 && e->role <= 3);
    FUZZ_CHECK(e->pid >= 1);
    FUZZ_CHECK(e->naddrs >= 1 && e->naddrs <= LLMDD_META_ADDRS_MAX);
    FUZZ_CHECK(e->ntransports <= LLMDD_META_TRANSPORTS_MAX);
    for (size_t i = 0; i < e->naddrs; i++) {
        FUZZ_CHECK(memchr(e->addrs[i].ip, '\0', LLMDD_IP_LEN) != NULL);
        FUZZ_CHECK(e->addrs[i].port >= 1);
    }
    size_t n = llmdd__meta_entry_encode(e, buf, sizeof(buf));
    FUZZ_CHECK(n > 0);
    FUZZ_CHECK(llmdd__meta_entry_decode(buf, n, &again) == LLM_SUCCESS);
    FUZZ_CHECK(memcmp(&again, e, sizeof(again)) == 0);
}

int
LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    static char text[INPUT_MAX + 1];
    uint8_t out[INPUT_MAX];
    char enc[INPUT_MAX * 2];

    if (size < 1 || size > INPUT_MAX)
        return 0;
    const char *s = (const char *)data + 1;
    size_t len = size - 1;
    memcpy(text, s, len);
    text[len] = '\0';
    switch (data[0] % 3) {
    case 0: {
        llmdd__meta_entry e;
        memset(&e, 0, sizeof(e));
        if (llmdd__meta_entry_decode(s, len, &e) == LLM_SUCCESS)
            check_entry(&e);
        break;
    }
    case 1: {
        memset(out, 0xa5, sizeof(out));
        size_t cap = len % 7 == 0 ? len : len / 2; /* sometimes too small */
        long n = llmdd__b64_decode(s, len, out, cap);
        FUZZ_CHECK(n >= -1 && n <= (long)cap);
        for (size_t i = n > 0 ? (size_t)n : 0; i < sizeof(out) && i < cap + 8;
             i++)
            FUZZ_CHECK(i < cap || out[i] == 0xa5);
        if (n >= 0) { /* non-canonical padding bits: compare bytes */
            uint8_t back[INPUT_MAX];
            size_t m = llmdd__b64_encode(out, (size_t)n, enc, sizeof(enc));
            FUZZ_CHECK(m == len);
            FUZZ_CHECK(llmdd__b64_decode(enc, m, back, sizeof(back)) == n);
            FUZZ_CHECK(memcmp(back, out, (size_t)n) == 0);
        }
        break;
    }
    default: {
        char urls[LLMDD_META_ENDPOINTS_MAX][300];
        size_t n = 0;
        if (llmdd__meta_server_parse(text, urls, &n) == LLM_SUCCESS) {
            FUZZ_CHECK(n >= 1 && n <= LLMDD_META_ENDPOINTS_MAX);
            for (size_t i = 0; i < n; i++)
                FUZZ_CHECK(strncmp(urls[i], "http://", 7) == 0);
        }
        (void)llmdd__meta_prefix_valid(text);
        break;
    }
    }
    return 0;
}
