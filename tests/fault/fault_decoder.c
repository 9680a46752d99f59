/*
 * A decoder process for the fault, hostile-input and load tests: links to a
 * prompt, then pulls slots of one of its caches in a loop and checks every
 * byte of every pull against the deterministic fill (harness.h).
 *
 *   fault_decoder --port P --cache ID --seed S [--desc kv|big:MIB:TENSORS]
 *                 [--cluster C] [--peer C] [--pulls N] [--wait MS]
 *                 [--auth TOKEN] [--transport T] [--go] [--tolerate]
 *
 * --desc names the remote cache's shape: kv is th_desc_kv(), big:MIB:T is
 * peer_helper's "alloc-big MIB T". Pull i copies remote slot i % batch into
 * local slot (3i + 1) % batch, alternately with pull_kv_cache and
 * pull_kv_blocks, after poisoning that local slot. --pulls 0 pulls until
 * stdin reaches EOF; --go waits for a line on stdin before the first pull.
 * Prints "LINKED" once linked, then at the end one line
 *   DONE pulls=N ok=N errors=N mismatches=N bytes=N ms=N maxms=N first=STATUS
 * and exits 0 when nothing mismatched and (unless --tolerate) nothing
 * failed, 1 otherwise, 3 when it could not set up.
 */
#include <poll.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "harness/fault_util.h"

static bool
stdin_closed(void)
{
    struct pollfd p = {.fd = 0, .events = POLLIN};
    char c[64];

    if (poll(&p, 1, 0) <= 0)
        return false;
    return read(0, c, sizeof(c)) <= 0;
}

static bool
slot_ok(const llmdd_cache *c, uint64_t stride, uint32_t seed, uint32_t src,
        uint32_t dst)
{
    for (uint32_t t = 0; t < c->desc.num_tensors; t++) {
        const uint8_t *p =
            (const uint8_t *)(uintptr_t)c->tensor_addrs[t] + dst * stride;
        for (uint64_t k = 0; k < stride; k++)
            if (p[k] != th_byte(seed, t, src * stride + k))
                return false;
    }
    return true;
}

int
main(int argc, char **argv)
{
    unsigned port = 0, seed = 0, mib = 0, tensors = 0;
    long long cache = 0, pulls = 1000;
    uint64_t self = 100 + (uint64_t)getpid() % 100000, peer = 1;
    const char *desc = "kv", *auth = NULL, *transport = NULL, *wait = NULL;
    bool go = false, tolerate = false;
    llmdd_option opts[3];
    size_t nopts = 0;

    for (int i = 1; i < argc; i++) {
        const char *k = argv[i], *v = i + 1 < argc ? argv[i + 1] : "";
        if (strcmp(k, "--go") == 0) {
            go = true;
            continue;
        }
        if (strcmp(k, "--tolerate") == 0) {
            tolerate = true;
            continue;
        }
        i++;
        if (strcmp(k, "--port") == 0)
            port = (unsigned)atoi(v);
        else if (strcmp(k, "--cache") == 0)
            cache = atoll(v);
        else if (strcmp(k, "--seed") == 0)
            seed = (unsigned)atoi(v);
        else if (strcmp(k, "--desc") == 0)
            desc = v;
        else if (strcmp(k, "--cluster") == 0)
            self = strtoull(v, NULL, 10);
        else if (strcmp(k, "--peer") == 0)
            peer = strtoull(v, NULL, 10);
        else if (strcmp(k, "--pulls") == 0)
            pulls = atoll(v);
        else if (strcmp(k, "--wait") == 0)
            wait = v;
        else if (strcmp(k, "--auth") == 0)
            auth = v;
        else if (strcmp(k, "--transport") == 0)
            transport = v;
        else
            return 3;
    }
    llmdd_cache_desc d = th_desc_kv();
    if (sscanf(desc, "big:%u:%u", &mib, &tensors) == 2) {
        d = (llmdd_cache_desc){.num_tensors = tensors,
                               .data_type = LLMDD_DT_UINT8,
                               .num_dims = 2,
                               .shape = {4, (int64_t)mib << 18}};
    }
    /* Sanitizers slow every pull down: the default wait grows with them. */
    char wait_def[16];
    snprintf(wait_def, sizeof(wait_def), "%d", 1000 * FU_SLOW);
    opts[nopts++] = (llmdd_option){"llm.SyncKvCacheWaitTime",
                                   wait != NULL ? wait : wait_def};
    if (auth != NULL)
        opts[nopts++] = (llmdd_option){"llm.AuthToken", auth};
    if (transport != NULL)
        opts[nopts++] = (llmdd_option){"llm.Transport", transport};

    llmdd *dd;
    llmdd_cache local;
    if (llmdd_create(self, LLMDD_ROLE_DECODER, &dd) != LLM_SUCCESS ||
        llmdd_initialize(dd, opts, nopts) != LLM_SUCCESS ||
        llmdd_allocate_cache(dd, &d, &local) != LLM_SUCCESS) {
        printf("ERR setup\n");
        return 3;
    }
    llmdd_status st = th_link(dd, peer, "127.0.0.1", (uint16_t)port, 5000);
    if (st != LLM_SUCCESS) {
        printf("ERR link %s\n", llmdd_status_str(st));
        llmdd_destroy(dd);
        return 3;
    }
    printf("LINKED\n");
    fflush(stdout);
    if (go) {
        char line[16];
        if (fgets(line, sizeof(line), stdin) == NULL) {
            llmdd_destroy(dd);
            return 3;
        }
    }

    uint64_t batch = (uint64_t)d.shape[0];
    uint64_t stride = th_tensor_size(&d) / batch;
    unsigned long long n = 0, ok = 0, errors = 0, mismatches = 0, bytes = 0;
    int64_t maxms = 0, start = th_now_ms();
    llmdd_status first = LLM_SUCCESS;
    for (; pulls == 0 || (long long)n < pulls; n++) {
        if (pulls == 0 && stdin_closed())
            break;
        uint32_t src = (uint32_t)(n % batch);
        uint32_t dst = (uint32_t)((3 * n + 1) % batch);
        llmdd_cache_index idx = {peer, cache, src};
        for (uint32_t t = 0; t < d.num_tensors; t++)
            memset((uint8_t *)(uintptr_t)local.tensor_addrs[t] + dst * stride,
                   (int)(0x5a ^ n), stride);
        int64_t t0 = th_now_ms();
        if (n % 2 == 0) {
            st = llmdd_pull_kv_cache(dd, &idx, &local, dst, -1, NULL);
        } else {
            uint64_t sb = src, db = dst;
            idx.batch_index = 0;
            st = llmdd_pull_kv_blocks(dd, &idx, &local, &sb, &db, 1, NULL);
        }
        int64_t ms = th_now_ms() - t0;
        maxms = ms > maxms ? ms : maxms;
        if (st != LLM_SUCCESS) {
            if (errors++ == 0)
                first = st;
            if (!tolerate)
                fprintf(stderr, "fault_decoder: pull %llu: %s\n", n,
                        llmdd_status_str(st));
            continue;
        }
        ok++;
        bytes += stride * d.num_tensors;
        if (!slot_ok(&local, stride, seed, src, dst)) {
            mismatches++;
            fprintf(stderr, "fault_decoder: pull %llu: slot %u -> %u corrupt\n",
                    n, src, dst);
        }
    }
    printf("DONE pulls=%llu ok=%llu errors=%llu mismatches=%llu bytes=%llu "
           "ms=%lld maxms=%lld first=%s\n",
           n, ok, errors, mismatches, bytes, (long long)(th_now_ms() - start),
           (long long)maxms, llmdd_status_str(first));
    fflush(stdout);
    llmdd_destroy(dd);
    return mismatches == 0 && (errors == 0 || tolerate) ? 0 : 1;
}
