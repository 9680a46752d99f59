"""The reference's pull_blocks sample, run as its example runner runs it:
the prompt (cluster 1) registers a blocks cache of two blocks under a
BlocksCacheKey; the decoder (cluster 2) registers one of its own, pulls
both blocks by that key, then swaps them out to a host cache and back in
(swap_blocks). Both link through a rank table (LLMDataDist.link, polled
with query_register_mem_status) and unlink(comm_id) at the end; no memory
pool.

The decoder links before the prompt listens, so its first connects are
refused and retried: the run must succeed, every byte checked, and, as
the runner demands, neither side may print a line holding "error" in any
case at the default log level.

    py_pull_blocks.py               (starts both processes)
"""

import argparse
import logging
import os
import sys
import time

import torch
import torch.distributed as dist

from compat_common import (check, init_process_group, launch, pattern, rank_base_port, same,
                           single_host_rank_table, wait_link_refused)
from llm_datadist import (BlocksCacheKey, Cache, CacheDesc, DataType, LLMConfig, LLMDataDist,
                          LLMRole, Placement, RegisterMemStatus)

logging.basicConfig(format="%(asctime)s %(message)s", level=logging.INFO)

BLOCKS_SHAPE = [2, 256 * 1024]  # two blocks of 1 MiB (float32)


def init_llm_datadist(role, cluster_id):
    datadist = LLMDataDist(role, cluster_id)
    llm_config = LLMConfig()
    llm_config.device_id = 0
    llm_config.enable_cache_manager = True
    datadist.init(llm_config.generate_options())
    return datadist


def wait_linked(datadist, comm_id):
    end = time.monotonic() + 60
    while True:
        ret = datadist.query_register_mem_status(comm_id)
        if ret == RegisterMemStatus.OK:
            logging.info("query_register_mem_status ok")
            return
        check(ret != RegisterMemStatus.FAILED, "link failed")
        check(time.monotonic() < end, "link did not complete")
        time.sleep(0.01)


def blocks_desc(placement=Placement.DEVICE):
    return CacheDesc(num_tensors=1, shape=BLOCKS_SHAPE, data_type=DataType.DT_FLOAT,
                     placement=placement)


def run_prompt(datadist):
    cache_manager = datadist.cache_manager
    tensor = pattern(20, BLOCKS_SHAPE, torch.float).npu()
    blocks_cache = cache_manager.register_blocks_cache(blocks_desc(), [tensor.data_ptr()],
                                                       BlocksCacheKey(1, 0))
    logging.info("[prompt] register_blocks_cache success")
    dist.barrier()  # the decoder's first connects were refused
    comm_id = datadist.link("link", {1: 0, 2: 1}, single_host_rank_table("127.0.0.1"))
    wait_linked(datadist, comm_id)
    dist.barrier()  # cache ready
    dist.barrier()  # decoder pull_blocks end
    datadist.unlink(comm_id)
    dist.barrier()  # wait peer unlink end
    cache_manager.unregister_cache(blocks_cache.cache_id)
    datadist.finalize()
    logging.info("[prompt] finalize success")


def run_decoder(datadist):
    cache_manager = datadist.cache_manager
    tensor = torch.zeros(*BLOCKS_SHAPE, dtype=torch.float).npu()
    blocks_cache = cache_manager.register_blocks_cache(blocks_desc(), [tensor.data_ptr()])
    logging.info("[decoder] register_blocks_cache success")
    comm_id = datadist.link("link", {1: 0, 2: 1}, single_host_rank_table("127.0.0.1"))
    wait_link_refused(datadist)
    dist.barrier()  # the decoder's first connects were refused
    wait_linked(datadist, comm_id)
    dist.barrier()  # cache ready
    # Crossed, so that a block pulled to the wrong place shows.
    cache_manager.pull_blocks(BlocksCacheKey(1, 0), blocks_cache, src_blocks=[0, 1],
                              dst_blocks=[1, 0])
    src = pattern(20, BLOCKS_SHAPE, torch.float)
    check(same(tensor[0], src[1]) and same(tensor[1], src[0]), "pulled blocks differ")
    logging.info("[decoder] pull_blocks success, every byte checked")
    cpu_tensor = torch.zeros(*BLOCKS_SHAPE, dtype=torch.float)
    cpu_cache = Cache.create_cpu_cache(blocks_desc(Placement.HOST), [cpu_tensor.data_ptr()])
    cache_manager.swap_blocks(blocks_cache, cpu_cache, {0: 0, 1: 1})    # swap out
    tensor.zero_()
    cache_manager.swap_blocks(cpu_cache, blocks_cache, {0: 1, 1: 0})    # swap in
    check(same(tensor, src), "blocks swapped out and in differ")
    logging.info("[decoder] swap_blocks success")
    dist.barrier()  # decoder pull_blocks end
    datadist.unlink(comm_id)
    dist.barrier()  # wait peer unlink end
    cache_manager.unregister_cache(blocks_cache.cache_id)
    datadist.finalize()
    logging.info("[decoder] finalize success")


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--rank", type=int)
    parser.add_argument("--cluster_id", type=int)
    args = parser.parse_args()
    if args.rank is None:
        os.environ["LLMDD_RANK_BASE_PORT"] = str(rank_base_port())
        sys.exit(launch(os.path.abspath(__file__),
                        [["--cluster_id", "1"], ["--cluster_id", "2"]],
                        no_error_lines=True))
    torch.npu.set_device(0)
    init_process_group(args.rank)
    role = LLMRole.PROMPT if args.cluster_id == 1 else LLMRole.DECODER
    datadist = init_llm_datadist(role, args.cluster_id)
    if role == LLMRole.PROMPT:
        run_prompt(datadist)
    else:
        run_decoder(datadist)
    dist.destroy_process_group()
