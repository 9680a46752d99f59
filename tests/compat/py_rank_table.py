"""The reference's rank-table samples on llmdd: both sides call
LLMDataDist.link(comm_name, cluster_rank_info, rank_table) with the same
table (a single-machine one: both ranks at one host_ip) and poll
query_register_mem_status until OK; the decoder then pulls a cache slot by
CacheKey, pulls blocks by BlocksCacheKey and pulls a slot into blocks
(pull_blocks from a CacheKey with no source blocks); both unlink(comm_id).
The prompt calls link() a little after the decoder, as two hosts would.
Every byte is checked.

    py_rank_table.py                (starts both processes)
"""

import argparse
import json
import logging
import os
import socket
import sys
import time

import torch
import torch.distributed as dist

from compat_common import check, free_port, init_process_group, launch, pattern, same
from llm_datadist import (LLMDataDist, LLMRole, LLMConfig, CacheDesc, DataType, Placement,
                          CacheKey, BlocksCacheKey, RegisterMemStatus)

logging.basicConfig(format="%(asctime)s %(message)s", level=logging.INFO)

CACHE_NUM_TENSORS = 4
CACHE_SHAPE = [2, 256]          # float16: 512-byte slots
BLOCKS_SHAPE = [8, 64]          # float16: 128-byte blocks, four a slot


def init_llm_datadist(role, cluster_id):
    datadist = LLMDataDist(role, cluster_id)
    llm_config = LLMConfig()
    llm_config.device_id = 0
    llm_config.enable_cache_manager = True
    llm_config.mem_pool_cfg = '{"memory_size": 67108864}'
    llm_config.sync_kv_timeout = 10000
    datadist.init(llm_config.generate_options())
    return datadist


def rank_table(host_ip):
    return {"server_count": "1", "status": "completed", "version": "1.2",
            "server_list": [{"device": [
                {"device_id": "0", "device_ip": "192.0.2.10", "rank_id": "0"},
                {"device_id": "1", "device_ip": "192.0.2.11", "rank_id": "1"}],
                "host_ip": host_ip, "server_id": "1"}]}


def link(datadist):
    cluster_rank_info = {1: 0, 2: 1}
    comm_id = datadist.link("link", cluster_rank_info, json.dumps(rank_table("127.0.0.1")))
    end = time.monotonic() + 60
    while True:
        ret = datadist.query_register_mem_status(comm_id)
        if ret == RegisterMemStatus.OK:
            logging.info("query_register_mem_status ok")
            return comm_id
        check(ret != RegisterMemStatus.FAILED, "link failed")
        check(time.monotonic() < end, "link did not complete")
        time.sleep(0.01)


def desc(shape):
    return CacheDesc(num_tensors=CACHE_NUM_TENSORS, shape=shape,
                     data_type=DataType.DT_FLOAT16, placement=Placement.DEVICE)


def run_prompt(datadist):
    dist.barrier()  # the decoder called link() first
    comm_id = link(datadist)
    cache_manager = datadist.cache_manager
    cache_key = CacheKey(prompt_cluster_id=1, req_id=0, model_id=0)
    cache = cache_manager.allocate_cache(desc(CACHE_SHAPE), [cache_key, CacheKey(1, req_id=1)])
    from torchair.llm_datadist import create_npu_tensors
    tensors = create_npu_tensors(cache.cache_desc.shape, torch.float16, cache.tensor_addrs)
    for t, tensor in enumerate(tensors):
        tensor.copy_(pattern(50 + t, CACHE_SHAPE))
    blocks = [pattern(60 + t, BLOCKS_SHAPE).npu() for t in range(CACHE_NUM_TENSORS)]
    blocks_cache = cache_manager.register_blocks_cache(
        desc(BLOCKS_SHAPE), [t.data_ptr() for t in blocks], BlocksCacheKey(1, 0))
    dist.barrier()  # cache ready
    dist.barrier()  # decoder pulls end
    datadist.unlink(comm_id)
    dist.barrier()  # wait peer unlink end
    cache_manager.remove_cache_key(cache_key)
    cache_manager.deallocate_cache(cache)
    cache_manager.unregister_cache(blocks_cache.cache_id)
    datadist.finalize()
    logging.info("[prompt] end")


def run_decoder(datadist):
    cache_manager = datadist.cache_manager
    dst = [torch.zeros(*CACHE_SHAPE, dtype=torch.float16).npu()
           for _ in range(CACHE_NUM_TENSORS)]
    cache = cache_manager.register_cache(desc(CACHE_SHAPE), [t.data_ptr() for t in dst])
    dblocks = [torch.zeros(*BLOCKS_SHAPE, dtype=torch.float16).npu()
               for _ in range(CACHE_NUM_TENSORS)]
    blocks_cache = cache_manager.register_blocks_cache(desc(BLOCKS_SHAPE),
                                                       [t.data_ptr() for t in dblocks])
    comm_id = datadist.link("link", {1: 0, 2: 1}, json.dumps(rank_table("127.0.0.1")))
    check(datadist.query_register_mem_status(comm_id) == RegisterMemStatus.PREPARING,
          "linked before the prompt called link()")
    dist.barrier()  # the decoder called link() first
    end = time.monotonic() + 60
    while datadist.query_register_mem_status(comm_id) != RegisterMemStatus.OK:
        check(time.monotonic() < end, "link did not complete")
        time.sleep(0.01)
    dist.barrier()  # cache ready
    cache_manager.pull_cache(CacheKey(prompt_cluster_id=1, req_id=1), cache, batch_index=0)
    cache_manager.pull_blocks(BlocksCacheKey(1, 0), blocks_cache, src_blocks=[7, 0],
                              dst_blocks=[0, 1])
    cache_manager.pull_blocks(CacheKey(prompt_cluster_id=1, req_id=0, model_id=0),
                              blocks_cache, src_blocks=[], dst_blocks=[4, 6, 5, 2])
    for t in range(CACHE_NUM_TENSORS):
        src = pattern(50 + t, CACHE_SHAPE)
        want = torch.zeros(*CACHE_SHAPE, dtype=torch.float16)
        want[0] = src[1]
        check(same(dst[t].cpu(), want), f"pulled slot {t} differs")
        want = torch.zeros(*BLOCKS_SHAPE, dtype=torch.float16)
        sb = pattern(60 + t, BLOCKS_SHAPE)
        want[0], want[1] = sb[7], sb[0]
        for k, b in enumerate((4, 6, 5, 2)):
            want[b] = src[0][k * 64:(k + 1) * 64]
        check(same(dblocks[t].cpu(), want), f"pulled blocks {t} differ")
    logging.info("[decoder] pull_cache, pull_blocks and a slot into blocks checked")
    dist.barrier()  # decoder pulls end
    datadist.unlink(comm_id)
    dist.barrier()  # wait peer unlink end
    cache_manager.unregister_cache(cache.cache_id)
    cache_manager.unregister_cache(blocks_cache.cache_id)
    datadist.finalize()
    logging.info("[decoder] end")


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--rank", type=int)
    parser.add_argument("--cluster_id", type=int)
    args = parser.parse_args()
    if args.rank is None:
        base = free_port()
        while True:     # ranks 0 and 1 listen at base and base + 1
            try:
                with socket.socket() as s:
                    s.bind(("127.0.0.1", base + 1))
                break
            except OSError:
                base = free_port()
        os.environ["LLMDD_RANK_BASE_PORT"] = str(base)
        sys.exit(launch(os.path.abspath(__file__), [["--cluster_id", "1"],
                                                    ["--cluster_id", "2"]]))
    torch.npu.set_device(0)
    init_process_group(args.rank)
    role = LLMRole.PROMPT if args.cluster_id == 1 else LLMRole.DECODER
    datadist = init_llm_datadist(role, args.cluster_id)
    if role == LLMRole.PROMPT:
        run_prompt(datadist)
    else:
        run_decoder(datadist)
    dist.destroy_process_group()
