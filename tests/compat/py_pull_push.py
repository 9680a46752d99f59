"""A prompt and a decoder written the way the reference's Python samples are
(llm_datadist's cache manager over "NPU" tensors, keys naming the prompt's
caches, torch.distributed barriers between the steps), run on llmdd:

1. The decoder links and pulls a cache slot by CacheKey, blocks by
   BlocksCacheKey and a slot into blocks (pull_blocks from a CacheKey with
   no source blocks); it pushes a slot (CacheKeyByIdAndIndex) and blocks
   (BlocksCacheKey) into the prompt, and so does the prompt into the
   decoder; the prompt also pulls from the decoder. Roles are labels.
2. Both switch roles: the decoder unlinks by cluster id and becomes a
   prompt that listens, the prompt becomes a decoder, links to it and
   pushes blocks back, layer by layer.

Every byte of every cache is checked after each step.

    py_pull_push.py                 (starts both processes)
"""

import argparse
import logging
import os
import sys

import torch
import torch.distributed as dist

from compat_common import (check, exchange, free_port, init_process_group, launch,
                           pattern, same)
from llm_datadist import (LLMDataDist, LLMRole, LLMConfig, CacheDesc, DataType, Placement,
                          CacheKey, BlocksCacheKey, CacheKeyByIdAndIndex, LLMClusterInfo,
                          LLMStatusCode)

logging.basicConfig(format="%(asctime)s %(message)s", level=logging.INFO)

PROMPT_CLUSTER_ID = 0
DECODER_CLUSTER_ID = 1
NUM_TENSORS = 4
CACHE_SHAPE = [4, 64]        # 4 slots of 128 bytes (float16)
BLOCKS_SHAPE = [8, 32]       # 8 blocks of 64 bytes: a slot is two blocks


def init_llm_datadist(role, cluster_id, listen):
    datadist = LLMDataDist(role, cluster_id)
    llm_config = LLMConfig()
    llm_config.device_id = 0
    llm_config.enable_cache_manager = True
    llm_config.sync_kv_timeout = 10000
    if listen:
        llm_config.listen_ip_info = listen
    datadist.init(llm_config.generate_options())
    logging.info(f"init {role} success, cluster_id={cluster_id}")
    return datadist


def npu_tensors(shape, seeds):
    """One "device" tensor per seed: the pattern, or zeros for seed None."""
    return [(torch.zeros(*shape, dtype=torch.float16) if s is None else
             pattern(s, shape)).npu() for s in seeds]


def desc(shape):
    return CacheDesc(num_tensors=NUM_TENSORS, shape=shape, data_type=DataType.DT_FLOAT16,
                     placement=Placement.DEVICE)


def link(datadist, remote_cluster_id, port):
    cluster = LLMClusterInfo()
    cluster.remote_cluster_id = remote_cluster_id
    cluster.append_local_ip_info("127.0.0.1", 0)
    cluster.append_remote_ip_info("127.0.0.1", port)
    ret, rets = datadist.link_clusters([cluster], 5000)
    check(ret == LLMStatusCode.LLM_SUCCESS, f"link failed: {ret} {rets}")


def unlink(datadist, remote_cluster_id):
    cluster = LLMClusterInfo()                 # a link is known by its id
    cluster.remote_cluster_id = remote_cluster_id
    ret, rets = datadist.unlink_clusters([cluster], 5000)
    check(ret == LLMStatusCode.LLM_SUCCESS, f"unlink failed: {ret} {rets}")


def expect_blocks(tensors, expected):
    """expected[t] is the whole tensor t as it must be."""
    for t, want in zip(tensors, expected):
        check(same(t.cpu(), want), "blocks differ")


def run_prompt(args):
    datadist = init_llm_datadist(LLMRole.PROMPT, PROMPT_CLUSTER_ID, f"127.0.0.1:{args.port}")
    cm = datadist.cache_manager
    kv = npu_tensors(CACHE_SHAPE, range(10, 14))
    kv_cache = cm.register_cache(desc(CACHE_SHAPE), [t.data_ptr() for t in kv],
                                 [CacheKey(PROMPT_CLUSTER_ID, req_id=i) for i in range(4)])
    blocks = npu_tensors(BLOCKS_SHAPE, range(20, 24))
    blocks_cache = cm.register_blocks_cache(desc(BLOCKS_SHAPE), [t.data_ptr() for t in blocks],
                                            BlocksCacheKey(PROMPT_CLUSTER_ID, 0))
    target = npu_tensors(CACHE_SHAPE, [None] * 4)
    target_cache = cm.register_cache(desc(CACHE_SHAPE), [t.data_ptr() for t in target])
    tblocks = npu_tensors(BLOCKS_SHAPE, [None] * 4)
    tblocks_cache = cm.register_blocks_cache(desc(BLOCKS_SHAPE),
                                             [t.data_ptr() for t in tblocks],
                                             BlocksCacheKey(PROMPT_CLUSTER_ID, 1))
    ids = exchange({"target": target_cache.cache_id})
    dist.barrier()  # caches ready
    dist.barrier()  # the decoder pulled and pushed
    want = [torch.zeros(*CACHE_SHAPE, dtype=torch.float16) for _ in range(4)]
    for t in range(4):
        want[t][2] = pattern(30 + t, CACHE_SHAPE)[0]
    expect_blocks(target, want)
    want = [torch.zeros(*BLOCKS_SHAPE, dtype=torch.float16) for _ in range(4)]
    for t in range(4):
        want[t][5:7] = pattern(40 + t, BLOCKS_SHAPE)[0:2]
    expect_blocks(tblocks, want)
    logging.info("[prompt] the decoder's pushes landed")

    # A prompt pulls and pushes too: the decoder's slot 3 into our target's
    # slot 0, its blocks 2 and 3 into our blocks 0 and 1; our slot 1 into
    # its slot 3, our blocks 6 and 7 into its blocks 6 and 7.
    d = ids[1]
    cm.pull_cache(CacheKeyByIdAndIndex(DECODER_CLUSTER_ID, d["src"], 3), target_cache, 0)
    cm.pull_blocks(BlocksCacheKey(DECODER_CLUSTER_ID, 1), tblocks_cache, [2, 3], [0, 1])
    want = [torch.zeros(*CACHE_SHAPE, dtype=torch.float16) for _ in range(4)]
    want_b = [torch.zeros(*BLOCKS_SHAPE, dtype=torch.float16) for _ in range(4)]
    for t in range(4):
        want[t][2] = pattern(30 + t, CACHE_SHAPE)[0]
        want[t][0] = pattern(30 + t, CACHE_SHAPE)[3]
        want_b[t][5:7] = pattern(40 + t, BLOCKS_SHAPE)[0:2]
        want_b[t][0:2] = pattern(40 + t, BLOCKS_SHAPE)[2:4]
    expect_blocks(target, want)
    expect_blocks(tblocks, want_b)
    cm.push_cache(CacheKeyByIdAndIndex(DECODER_CLUSTER_ID, d["dst"], 3), kv_cache, 1)
    cm.push_blocks(BlocksCacheKey(DECODER_CLUSTER_ID, 0), blocks_cache, [6, 7], [6, 7])
    dist.barrier()  # the prompt pulled and pushed
    dist.barrier()  # the decoder checked, unlinked and listens as a prompt
    port2 = exchange(None)[1]

    # Switch: a decoder now (not listening), link to the old decoder and
    # push blocks 0..3 back, one layer (K and V) at a time.
    datadist.switch_role(LLMRole.DECODER)
    link(datadist, DECODER_CLUSTER_ID, port2)
    for layer in range(NUM_TENSORS // 2):
        cm.push_blocks(BlocksCacheKey(DECODER_CLUSTER_ID, 0), blocks_cache, [0, 1, 2, 3],
                       [0, 1, 2, 3], src_layer_range=range(layer, layer + 1),
                       dst_layer_range=range(layer, layer + 1))
    dist.barrier()  # pushed back
    dist.barrier()  # checked
    unlink(datadist, DECODER_CLUSTER_ID)
    dist.barrier()  # unlinked
    for c in (kv_cache, target_cache):
        cm.unregister_cache(c.cache_id)
    for c in (blocks_cache, tblocks_cache):
        cm.unregister_cache(c.cache_id)
    datadist.finalize()
    logging.info("[prompt] end")


def run_decoder(args):
    datadist = init_llm_datadist(LLMRole.DECODER, DECODER_CLUSTER_ID, None)
    cm = datadist.cache_manager
    dst = npu_tensors(CACHE_SHAPE, [None] * 4)
    dst_cache = cm.register_cache(desc(CACHE_SHAPE), [t.data_ptr() for t in dst])
    dblocks = npu_tensors(BLOCKS_SHAPE, [None] * 4)
    dblocks_cache = cm.register_blocks_cache(desc(BLOCKS_SHAPE),
                                             [t.data_ptr() for t in dblocks],
                                             BlocksCacheKey(DECODER_CLUSTER_ID, 0))
    src = npu_tensors(CACHE_SHAPE, range(30, 34))
    src_cache = cm.register_cache(desc(CACHE_SHAPE), [t.data_ptr() for t in src])
    sblocks = npu_tensors(BLOCKS_SHAPE, range(40, 44))
    sblocks_cache = cm.register_blocks_cache(desc(BLOCKS_SHAPE),
                                             [t.data_ptr() for t in sblocks],
                                             BlocksCacheKey(DECODER_CLUSTER_ID, 1))
    ids = exchange({"dst": dst_cache.cache_id, "src": src_cache.cache_id})
    dist.barrier()  # caches ready
    link(datadist, PROMPT_CLUSTER_ID, args.port)

    # Pulls: slot 2 (req 2) into our slot 1; blocks {1, 2, 5} into {0, 3, 4};
    # slot 3 (req 3), a cache without blocks, into blocks {7, 2}.
    cm.pull_cache(CacheKey(prompt_cluster_id=PROMPT_CLUSTER_ID, req_id=2), dst_cache, 1)
    cm.pull_blocks(BlocksCacheKey(PROMPT_CLUSTER_ID, 0), dblocks_cache, [1, 2, 5], [0, 3, 4])
    cm.pull_blocks(CacheKey(PROMPT_CLUSTER_ID, req_id=3), dblocks_cache, src_blocks=[],
                   dst_blocks=[7, 2])
    want_dst = [torch.zeros(*CACHE_SHAPE, dtype=torch.float16) for _ in range(4)]
    want_blk = [torch.zeros(*BLOCKS_SHAPE, dtype=torch.float16) for _ in range(4)]
    for t in range(4):
        want_dst[t][1] = pattern(10 + t, CACHE_SHAPE)[2]
        pb = pattern(20 + t, BLOCKS_SHAPE)
        want_blk[t][0], want_blk[t][3], want_blk[t][4] = pb[1], pb[2], pb[5]
        slot = pattern(10 + t, CACHE_SHAPE)[3]
        want_blk[t][7], want_blk[t][2] = slot[:32], slot[32:]
    expect_blocks(dst, want_dst)
    expect_blocks(dblocks, want_blk)
    logging.info("[decoder] pulls checked")

    # A decoder pushes: our slot 0 into the prompt's target slot 2, our
    # blocks 0 and 1 into its blocks cache (model 1) blocks 5 and 6.
    cm.push_cache(CacheKeyByIdAndIndex(PROMPT_CLUSTER_ID, ids[0]["target"], 2), src_cache, 0)
    cm.push_blocks(BlocksCacheKey(PROMPT_CLUSTER_ID, 1), sblocks_cache, [0, 1], [5, 6])
    dist.barrier()  # the decoder pulled and pushed
    dist.barrier()  # the prompt pulled and pushed
    for t in range(4):
        want_dst[t][3] = pattern(10 + t, CACHE_SHAPE)[1]
        want_blk[t][6:8] = pattern(20 + t, BLOCKS_SHAPE)[6:8]
    expect_blocks(dst, want_dst)
    expect_blocks(dblocks, want_blk)
    for t in range(4):
        check(same(src[t], pattern(30 + t, CACHE_SHAPE)), "a source changed")
        check(same(sblocks[t], pattern(40 + t, BLOCKS_SHAPE)), "a source changed")
    logging.info("[decoder] the prompt's pushes landed")

    # Switch: unlink by id, become a prompt that listens.
    unlink(datadist, PROMPT_CLUSTER_ID)
    port2 = free_port()
    datadist.switch_role(LLMRole.PROMPT, {"llm.listenIpInfo": f"127.0.0.1:{port2}"})
    dist.barrier()  # listening as a prompt
    exchange(port2)
    dist.barrier()  # pushed back
    for t in range(4):
        want_blk[t][0:4] = pattern(20 + t, BLOCKS_SHAPE)[0:4]
    expect_blocks(dblocks, want_blk)
    logging.info("[decoder] the switched prompt's pushes landed")
    dist.barrier()  # checked
    dist.barrier()  # unlinked
    for c in (dst_cache, src_cache, dblocks_cache, sblocks_cache):
        cm.unregister_cache(c.cache_id)
    datadist.finalize()
    logging.info("[decoder] end")


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--rank", type=int)
    parser.add_argument("--port", type=int)
    args = parser.parse_args()
    if args.rank is None:
        port = str(free_port())
        sys.exit(launch(os.path.abspath(__file__), [["--port", port], ["--port", port]]))
    torch.npu.set_device(0)
    init_process_group(args.rank)
    if args.rank == 0:
        run_prompt(args)
    else:
        run_decoder(args)
    dist.destroy_process_group()
