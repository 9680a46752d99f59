// llm_datadist::llmdd_ext: KV layouts and slice transfers from C++. A
// prompt (NHD, block 16, heads 2..3 of 4) and a decoder (HND, block 32,
// all heads) in one process over tcp; the decoder pulls one slice and every
// byte is checked against the coordinates, untouched bytes included; then
// the errors.
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <map>
#include <string>
#include <vector>

#include "llm_datadist/llm_datadist.h"

using namespace llm_datadist;
using namespace llm_datadist::llmdd_ext;

namespace {

int passed, failed;

#define CHECK(cond)                                                            \
    do {                                                                       \
        if (cond) {                                                            \
            passed++;                                                          \
        } else {                                                               \
            failed++;                                                          \
            std::fprintf(stderr, "%s:%d: CHECK(%s) failed\n", __FILE__,        \
                         __LINE__, #cond);                                     \
        }                                                                      \
    } while (0)

constexpr uint32_t kHd = 8; // head bytes

uint8_t Byte(uint64_t t, uint32_t h, uint32_t b)
{
    return static_cast<uint8_t>(t * 131 + h * 17 + b * 3 + 1);
}

CacheDesc Desc(int64_t blocks, int64_t block_bytes)
{
    CacheDesc d;
    d.placement = CachePlacement::kHost;
    d.num_tensors = 1;
    d.data_type = DT_UINT8;
    d.shape = {blocks, block_bytes};
    return d;
}

} // namespace

int main()
{
    LlmDataDist prompt(1, LlmRole::kPrompt), dec(2, LlmRole::kDecoder);
    std::map<AscendString, AscendString> po, dopt;
    po[OPTION_LISTEN_IP_INFO] = "127.0.0.1:0";
    po["llm.Transport"] = "tcp";
    dopt["llm.Transport"] = "tcp";
    CHECK(prompt.Initialize(po) == LLM_SUCCESS);
    CHECK(dec.Initialize(dopt) == LLM_SUCCESS);
    llmdd_ip_info bound;
    CHECK(llmdd_listen_address(prompt.NativeHandle(), &bound) == LLM_SUCCESS);

    KvLayout pl = MakeLayout("NHD", 16, 2, 2, 4, kHd);
    KvLayout dl = MakeLayout("HND", 32, 0, 4, 4, kHd);
    Cache pc, dc;
    CHECK(AllocateCacheLayout(prompt, Desc(4, 16 * 2 * kHd), pl, pc) ==
          LLM_SUCCESS);
    CHECK(AllocateCacheLayout(dec, Desc(2, 32 * 4 * kHd), dl, dc) ==
          LLM_SUCCESS);
    // The product rule and a bad name are the library's refusals.
    Cache bad;
    CHECK(AllocateCacheLayout(prompt, Desc(4, 100), pl, bad) ==
          LLM_PARAM_INVALID);
    CHECK(AllocateCacheLayout(prompt, Desc(4, 16 * 2 * kHd),
                              MakeLayout("NXD", 16, 2, 2, 4, kHd),
                              bad) == LLM_PARAM_INVALID);

    std::vector<uint64_t> ptab = {2, 0, 3, 1}, dtab = {1, 0};
    auto *p = reinterpret_cast<uint8_t *>(pc.tensor_addrs[0]);
    for (uint64_t t = 0; t < 64; t++)
        for (uint32_t h = 0; h < 2; h++)
            for (uint32_t b = 0; b < kHd; b++)
                p[ptab[t / 16] * 16 * 2 * kHd + (t % 16) * 2 * kHd + h * kHd +
                  b] = Byte(t, h + 2, b);
    auto *d = reinterpret_cast<uint8_t *>(dc.tensor_addrs[0]);
    std::memset(d, 0xEE, 2 * 32 * 4 * kHd);

    ClusterInfo ci;
    ci.remote_cluster_id = 1;
    IpInfo remote;
    remote.ip = "127.0.0.1";
    remote.port = bound.port;
    ci.remote_ip_infos.push_back(remote);
    std::vector<Status> rets;
    CHECK(dec.LinkLlmClusters({ci}, rets, 5000) == LLM_SUCCESS);

    KvLayout got;
    CHECK(QueryRemoteLayout(dec, 1, pc.cache_id, got) == LLM_SUCCESS);
    CHECK(std::memcmp(&got, &pl, sizeof(got)) == 0);
    std::vector<TpPiece> plan;
    CHECK(TpPlan(4, 2, 1, 0, plan) == LLM_SUCCESS);
    CHECK(plan.size() == 2 && plan[1].head_begin == 2 && plan[1].head_end == 4);

    Slice s;
    s.src_blocks = ptab;
    s.dst_blocks = dtab;
    s.token_begin = 5;
    s.token_end = 60;
    s.head_begin = 2;
    s.head_end = 4;
    CacheIndex src{1, pc.cache_id, 0};
    CHECK(PullKvSlices(dec, {src}, {s}, dc) == LLM_SUCCESS);
    int wrong = 0;
    for (uint64_t t = 0; t < 64; t++)
        for (uint32_t h = 0; h < 4; h++)
            for (uint32_t b = 0; b < kHd; b++) {
                uint8_t v = d[dtab[t / 32] * 32 * 4 * kHd + h * 32 * kHd +
                              (t % 32) * kHd + b];
                bool moved = t >= 5 && t < 60 && h >= 2;
                wrong += v != (moved ? Byte(t, h, b) : 0xEE);
            }
    CHECK(wrong == 0);

    // Errors: a slice count that does not match, heads the prompt lacks.
    CHECK(PullKvSlices(dec, {src, src}, {s}, dc) == LLM_PARAM_INVALID);
    Slice h01 = s;
    h01.head_begin = 0;
    h01.head_end = 2;
    CHECK(PullKvSlices(dec, {src}, {h01}, dc) == LLM_PARAM_INVALID);
    CHECK(TpPlan(6, 4, 2, 0, plan) == LLM_PARAM_INVALID);

    std::printf("layout_ext: %d passed, %d failed\n", passed, failed);
    return failed == 0 ? 0 : 1;
}
