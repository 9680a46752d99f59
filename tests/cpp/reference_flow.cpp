// A program written against LLM-DataDist's C++ header only, in the
// reference's calling conventions: a prompt process and a decoder process.
// The decoder links, pulls whole slots, by size, by layer range and by
// blocks, and checks the error codes; the prompt then pushes a slot and
// blocks back over the same link. Every byte is checked.
//
//   reference_flow            (forks the prompt itself)
#include <sys/socket.h>
#include <sys/wait.h>
#include <netinet/in.h>
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <string>
#include <vector>

#include "llm_datadist/llm_datadist.h"

using namespace llm_datadist;

namespace {

constexpr uint64_t kPromptId = 1;
constexpr uint64_t kDecoderId = 2;
constexpr int kLayers = 4;
constexpr int kTensors = 2 * kLayers;   // K and V per layer
constexpr int64_t kBatch = 4;           // slots, or blocks
constexpr int64_t kStride = 2 * 64 * 2; // bytes per slot: 2 x 64 fp16
int passed, failed;

#define CHECK(cond)                                                            \
    do {                                                                       \
        if (cond) {                                                            \
            passed++;                                                          \
        } else {                                                               \
            failed++;                                                          \
            std::fprintf(stderr, "%s:%d: CHECK(%s) failed\n", __FILE__,       \
                         __LINE__, #cond);                                     \
        }                                                                      \
    } while (0)

uint8_t Pattern(uint32_t seed, int t, int64_t off)
{
    return static_cast<uint8_t>(seed * 31u + t * 13u + off * 7u);
}

CacheDesc KvDesc()
{
    CacheDesc d;  // placement defaults to kDevice, as in the reference
    d.num_tensors = kTensors;
    d.data_type = DT_FLOAT16;
    d.shape = {kBatch, 2, 64};
    return d;
}

void Fill(const Cache &c, uint32_t seed)
{
    for (int t = 0; t < kTensors; t++) {
        auto *p = reinterpret_cast<uint8_t *>(c.tensor_addrs[t]);
        for (int64_t i = 0; i < kBatch * kStride; i++)
            p[i] = Pattern(seed, t, i);
    }
}

// Whether bytes [from, from + len) of slot `slot` of tensor t hold the
// pattern of `seed` at slot `src_slot`.
bool Holds(const Cache &c, int t, int64_t slot, uint32_t seed,
           int64_t src_slot, int64_t len = kStride)
{
    auto *p = reinterpret_cast<const uint8_t *>(c.tensor_addrs[t]);
    for (int64_t i = 0; i < len; i++)
        if (p[slot * kStride + i] != Pattern(seed, t, src_slot * kStride + i))
            return false;
    return true;
}

std::string ReadLine(int fd)
{
    std::string s;
    char ch;
    while (read(fd, &ch, 1) == 1 && ch != '\n')
        s += ch;
    return s;
}

void WriteLine(int fd, const std::string &s)
{
    std::string l = s + "\n";
    if (write(fd, l.data(), l.size()) != static_cast<ssize_t>(l.size()))
        std::exit(3);
}

uint16_t FreePort()
{
    int s = socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    socklen_t len = sizeof(a);
    bind(s, reinterpret_cast<sockaddr *>(&a), sizeof(a));
    getsockname(s, reinterpret_cast<sockaddr *>(&a), &len);
    close(s);
    return ntohs(a.sin_port);
}

// The prompt: two caches (allocated and registered), filled; serves pulls,
// then pushes into the decoder's caches when asked.
int Prompt(int in, int out, uint16_t port)
{
    LlmDataDist dd(kPromptId, LlmRole::kPrompt);
    std::map<AscendString, AscendString> options;
    std::string listen = "127.0.0.1:" + std::to_string(port);
    options[OPTION_LISTEN_IP_INFO] = listen.c_str();
    options[OPTION_DEVICE_ID] = "0";
    options[OPTION_SYNC_CACHE_WAIT_TIME] = "5000";
    options[OPTION_BUF_POOL_CFG] = "{\"buf_pool_size\": 1024}";
    if (dd.Initialize(options) != LLM_SUCCESS)
        return 2;
    Cache kv;
    if (dd.AllocateCache(KvDesc(), kv) != LLM_SUCCESS)
        return 2;
    Fill(kv, 1);
    std::vector<uint8_t> mem(kTensors * kBatch * kStride);
    std::vector<uint64_t> addrs;
    for (int t = 0; t < kTensors; t++)
        addrs.push_back(reinterpret_cast<uint64_t>(&mem[t * kBatch * kStride]));
    int64_t reg_id = -1;
    RegisterCfg cfg;
    if (dd.RegisterKvCache(KvDesc(), addrs, cfg, reg_id) != LLM_SUCCESS)
        return 2;
    Cache reg;
    reg.cache_id = reg_id;
    reg.cache_desc = KvDesc();
    for (uint64_t a : addrs)
        reg.tensor_addrs.push_back(static_cast<uintptr_t>(a));
    Fill(reg, 2);
    WriteLine(out, std::to_string(kv.cache_id) + " " + std::to_string(reg_id));

    // "push KV_ID BLOCKS_ID": push slot 1 of ours to slot 3 of theirs, and
    // blocks {0, 1} to {2, 0}.
    std::string cmd = ReadLine(in);
    long long dst_kv = 0, dst_blocks = 0;
    if (std::sscanf(cmd.c_str(), "push %lld %lld", &dst_kv, &dst_blocks) != 2)
        return 2;
    CacheIndex to_kv{kDecoderId, dst_kv, 3};
    Status a = dd.PushKvCache(kv, to_kv, 1);
    CacheIndex to_blocks{kDecoderId, dst_blocks, 0};
    Status b = dd.PushKvBlocks(reg, to_blocks, {0, 1}, {2, 0});
    CacheIndex nowhere{kDecoderId, 999, 0};
    Status c = dd.PushKvCache(kv, nowhere, 0);
    WriteLine(out, std::to_string(a) + " " + std::to_string(b) + " " +
                       std::to_string(c));
    ReadLine(in); // the decoder has checked and unlinked
    dd.Finalize();
    return 0;
}

int Decoder(int in, int out, uint16_t port)
{
    LlmDataDist dd(kDecoderId, LlmRole::kDecoder);
    std::map<AscendString, AscendString> options;
    options[OPTION_DEVICE_ID] = "0";
    options[OPTION_SYNC_CACHE_WAIT_TIME] = "5000";
    CHECK(dd.Initialize(options) == LLM_SUCCESS);

    long long kv_id = 0, reg_id = 0;
    CHECK(std::sscanf(ReadLine(in).c_str(), "%lld %lld", &kv_id, &reg_id) ==
          2);
    Cache kv, blocks;
    CHECK(dd.AllocateCache(KvDesc(), kv) == LLM_SUCCESS);
    CHECK(dd.AllocateCache(KvDesc(), blocks) == LLM_SUCCESS);

    CacheIndex src{kPromptId, kv_id, 0};
    CHECK(dd.PullKvCache(src, kv) == LLM_NOT_YET_LINK);

    ClusterInfo cluster;
    cluster.remote_cluster_id = kPromptId;
    cluster.remote_role_type = static_cast<int32_t>(LlmRole::kPrompt);
    IpInfo local, remote;
    local.ip = "127.0.0.1";
    remote.ip = "127.0.0.1";
    remote.port = port;
    cluster.local_ip_infos.push_back(local);
    cluster.remote_ip_infos.push_back(remote);
    std::vector<Status> rets;
    Status st = LLM_FAILED;
    for (int i = 0; i < 100 && st != LLM_SUCCESS; i++) {
        st = dd.LinkLlmClusters({cluster}, rets, 1000);
        if (st != LLM_SUCCESS)
            usleep(20000); // the prompt may still be binding its port
    }
    CHECK(st == LLM_SUCCESS);
    CHECK(rets.size() == 1 && rets[0] == LLM_SUCCESS);
    CHECK(dd.LinkLlmClusters({cluster}, rets) == LLM_ALREADY_LINK);

    // Whole slot 2 into our slot 0, with the defaults.
    src.batch_index = 2;
    CHECK(dd.PullKvCache(src, kv) == LLM_SUCCESS);
    bool ok = true;
    for (int t = 0; t < kTensors; t++)
        ok = ok && Holds(kv, t, 0, 1, 2);
    CHECK(ok);
    // By size: the first 100 bytes of slot 3 into our slot 1.
    src.batch_index = 3;
    CHECK(dd.PullKvCache(src, kv, 1, 100) == LLM_SUCCESS);
    ok = true;
    for (int t = 0; t < kTensors; t++)
        ok = ok && Holds(kv, t, 1, 1, 3, 100);
    CHECK(ok);
    // By layer range: layers 1..2 of the registered cache's slot 0 into our
    // layers 0..1 of slot 2.
    KvCacheExtParam ext;
    ext.src_layer_range = {1, 2};
    ext.dst_layer_range = {0, 1};
    ext.tensor_num_per_layer = 2;
    CacheIndex rsrc{kPromptId, reg_id, 0};
    CHECK(dd.PullKvCache(rsrc, kv, 2, -1, ext) == LLM_SUCCESS);
    ok = true;
    for (int t = 0; t < 4; t++) {
        auto *p = reinterpret_cast<const uint8_t *>(kv.tensor_addrs[t]);
        for (int64_t i = 0; i < kStride; i++)
            ok = ok && p[2 * kStride + i] == Pattern(2, t + 2, i);
    }
    CHECK(ok);
    // Blocks: theirs {3, 0, 1} into ours {0, 2, 3}.
    CacheIndex bsrc{kPromptId, kv_id, 0};
    CHECK(dd.PullKvBlocks(bsrc, blocks, {3, 0, 1}, {0, 2, 3}) == LLM_SUCCESS);
    ok = true;
    for (int t = 0; t < kTensors; t++)
        ok = ok && Holds(blocks, t, 0, 1, 3) && Holds(blocks, t, 2, 1, 0) &&
             Holds(blocks, t, 3, 1, 1);
    CHECK(ok);

    // The error codes.
    CacheIndex missing{kPromptId, 12345, 0};
    CHECK(dd.PullKvCache(missing, kv) == LLM_KV_CACHE_NOT_EXIST);
    src.batch_index = kBatch;
    CHECK(dd.PullKvCache(src, kv) == LLM_PARAM_INVALID);
    src.batch_index = 0;
    CHECK(dd.PullKvCache(src, kv, 0, kStride + 1) == LLM_PARAM_INVALID);
    CHECK(dd.PullKvBlocks(bsrc, blocks, {0, 1}, {0}) == LLM_PARAM_INVALID);
    CHECK(dd.PushKvCache(kv, missing) == LLM_KV_CACHE_NOT_EXIST); // any role
    CacheIndex stranger{77, kv_id, 0};
    CHECK(dd.PullKvCache(stranger, kv) == LLM_NOT_YET_LINK);
    // Local copies: slot 0 to slot 1, and blocks to two destinations.
    CHECK(dd.CopyKvCache(kv, kv, 0, 1) == LLM_SUCCESS);
    ok = true;
    for (int t = 0; t < kTensors; t++)
        ok = ok && Holds(kv, t, 1, 1, 2);
    CHECK(ok);
    CHECK(dd.CopyKvBlocks(blocks, kv, {0}, {{0}, {3}}) == LLM_SUCCESS);
    ok = true;
    for (int t = 0; t < kTensors; t++)
        ok = ok && Holds(kv, t, 0, 1, 3) && Holds(kv, t, 3, 1, 3);
    CHECK(ok);
    CHECK(dd.CopyKvBlocks(blocks, kv, {0}, {{kBatch}}) == LLM_PARAM_INVALID);

    // The prompt pushes into our caches over the same link.
    std::memset(reinterpret_cast<void *>(kv.tensor_addrs[0]), 0, 1);
    WriteLine(out, "push " + std::to_string(kv.cache_id) + " " +
                       std::to_string(blocks.cache_id));
    unsigned long a = 1, b = 1, c = 1;
    CHECK(std::sscanf(ReadLine(in).c_str(), "%lu %lu %lu", &a, &b, &c) == 3);
    CHECK(a == LLM_SUCCESS);
    CHECK(b == LLM_SUCCESS);
    CHECK(c == LLM_KV_CACHE_NOT_EXIST);
    ok = true;
    for (int t = 0; t < kTensors; t++)
        ok = ok && Holds(kv, t, 3, 1, 1) && Holds(blocks, t, 2, 2, 0) &&
             Holds(blocks, t, 0, 2, 1);
    CHECK(ok);

    CHECK(dd.UnlinkLlmClusters({cluster}, rets) == LLM_SUCCESS);
    CHECK(dd.DeallocateCache(kv.cache_id) == LLM_SUCCESS);
    CHECK(dd.DeallocateCache(kv.cache_id) == LLM_SUCCESS); // as the reference
    WriteLine(out, "bye");
    dd.Finalize();
    return 0;
}

} // namespace

int main()
{
    int to_prompt[2], to_decoder[2];
    if (pipe(to_prompt) != 0 || pipe(to_decoder) != 0)
        return 2;
    uint16_t port = FreePort();
    pid_t pid = fork();
    if (pid == 0) {
        close(to_prompt[1]);
        close(to_decoder[0]);
        _exit(Prompt(to_prompt[0], to_decoder[1], port));
    }
    close(to_prompt[0]);
    close(to_decoder[1]);
    Decoder(to_decoder[0], to_prompt[1], port);
    close(to_prompt[1]);
    int status = 0;
    waitpid(pid, &status, 0);
    CHECK(WIFEXITED(status) && WEXITSTATUS(status) == 0);
    std::printf("%d passed, %d failed\n", passed, failed);
    return failed == 0 ? 0 : 1;
}
