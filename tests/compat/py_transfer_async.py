"""Layer-by-layer transfer as the reference's transfer_cache_async sample
writes it: the prompt computes a layer, its LayerSynchronizer lets it go,
and the layer is pushed while the next is computed. Three forms, one task
each, every byte checked by the decoder:

1. cache to cache: a blocks cache into the decoder's blocks cache named by
   a BlocksCacheKey, no block indices (block b to block b);
2. blocks: src_block_indices into dst_block_indices;
3. a slot into a slot (CacheKeyByIdAndIndex), with layer ranges.

The synchronizer fills each layer just before it lets it go, so a layer
that moved early would carry stale bytes; it also records the order.

    py_transfer_async.py            (starts both processes)
"""

import argparse
import logging
import os
import sys
import threading
from typing import Optional

import torch
import torch.distributed as dist

from compat_common import check, exchange, free_port, init_process_group, launch, pattern, same
from llm_datadist import (LLMDataDist, LLMRole, LLMConfig, CacheDesc, DataType, Placement,
                          BlocksCacheKey, CacheKeyByIdAndIndex, LLMClusterInfo, LLMStatusCode,
                          TransferWithCacheKeyConfig, LayerSynchronizer)

logging.basicConfig(format="%(asctime)s %(message)s", level=logging.INFO)

PROMPT_CLUSTER_ID = 0
DECODER_CLUSTER_ID = 1
NUM_LAYERS = 3
NUM_TENSORS = 2 * NUM_LAYERS     # K and V a layer
BLOCKS_SHAPE = [6, 16]          # 6 blocks of 16 float32
SLOT_SHAPE = [2, 48]            # 2 slots of 48 float32


class LayerSynchronizerImpl(LayerSynchronizer):
    """Computes layer i (fills its K and V) when asked whether it is ready."""

    def __init__(self, tensors, shape, seed):
        self._tensors, self._shape, self._seed = tensors, shape, seed
        self.order = []
        self.lock = threading.Lock()

    def synchronize_layer(self, layer_index: int, timeout_in_millis: Optional[int]) -> bool:
        with self.lock:
            self.order.append(layer_index)
        for t in (2 * layer_index, 2 * layer_index + 1):
            self._tensors[t].copy_(pattern(self._seed + t, self._shape, torch.float32))
        return True


def desc(shape):
    return CacheDesc(num_tensors=NUM_TENSORS, shape=shape, data_type=DataType.DT_FLOAT,
                     placement=Placement.DEVICE)


def zeros(shape):
    return [torch.zeros(*shape, dtype=torch.float32).npu() for _ in range(NUM_TENSORS)]


def init_llm_datadist(role, cluster_id, listen):
    datadist = LLMDataDist(role, cluster_id)
    llm_config = LLMConfig()
    llm_config.device_id = 0
    llm_config.enable_cache_manager = True
    llm_config.enable_remote_cache_accessible = True
    llm_config.sync_kv_timeout = 10000
    if listen:
        llm_config.listen_ip_info = listen
    datadist.init(llm_config.generate_options())
    return datadist


def run_prompt(args):
    datadist = init_llm_datadist(LLMRole.PROMPT, PROMPT_CLUSTER_ID, None)
    cm = datadist.cache_manager
    blocks = zeros(BLOCKS_SHAPE)
    blocks_cache = cm.register_blocks_cache(desc(BLOCKS_SHAPE), [t.data_ptr() for t in blocks],
                                            BlocksCacheKey(PROMPT_CLUSTER_ID, 0))
    slots = zeros(SLOT_SHAPE)
    slot_cache = cm.register_cache(desc(SLOT_SHAPE), [t.data_ptr() for t in slots])
    ids = exchange(None)
    dist.barrier()  # registered
    cluster = LLMClusterInfo()
    cluster.remote_cluster_id = DECODER_CLUSTER_ID
    cluster.append_local_ip_info("127.0.0.1", 26000)
    cluster.append_remote_ip_info("127.0.0.1", args.port)
    ret, _ = datadist.link_clusters([cluster], 5000)
    check(ret == LLMStatusCode.LLM_SUCCESS, f"link failed: {ret}")

    # 1. Cache to cache, all layers, no block indices.
    sync = LayerSynchronizerImpl(blocks, BLOCKS_SHAPE, 100)
    task = cm.transfer_cache_async(blocks_cache, sync, [TransferWithCacheKeyConfig(
        BlocksCacheKey(DECODER_CLUSTER_ID, 0), range(0, NUM_LAYERS), range(0, NUM_LAYERS))])
    check(task.get_results() == [LLMStatusCode.LLM_SUCCESS], "cache-to-cache failed")
    check(sync.order == list(range(NUM_LAYERS)), f"layers asked in order {sync.order}")
    # 2. Blocks, layers 1..2 into the decoder's layers 0..1.
    sync = LayerSynchronizerImpl(blocks, BLOCKS_SHAPE, 200)
    task = cm.transfer_cache_async(blocks_cache, sync, [TransferWithCacheKeyConfig(
        BlocksCacheKey(DECODER_CLUSTER_ID, 1), range(1, 3), range(0, 2))],
        src_block_indices=[0, 1, 4], dst_block_indices=[5, 2, 3])
    check(task.synchronize() == LLMStatusCode.LLM_SUCCESS, "blocks transfer failed")
    check(task.get_results() == [LLMStatusCode.LLM_SUCCESS], "blocks transfer failed")
    # 3. A slot: slot 1 into the decoder's slot 0, all layers.
    sync = LayerSynchronizerImpl(slots, SLOT_SHAPE, 300)
    task = cm.transfer_cache_async(slot_cache, sync, [TransferWithCacheKeyConfig(
        CacheKeyByIdAndIndex(DECODER_CLUSTER_ID, ids[1], 0), src_batch_index=1)])
    check(task.get_results() == [LLMStatusCode.LLM_SUCCESS], "slot transfer failed")
    dist.barrier()  # transferred
    dist.barrier()  # checked
    cluster = LLMClusterInfo()
    cluster.remote_cluster_id = DECODER_CLUSTER_ID
    ret, _ = datadist.unlink_clusters([cluster], 5000, force=True)
    check(ret == LLMStatusCode.LLM_SUCCESS, "unlink failed")
    cm.unregister_cache(blocks_cache.cache_id)
    cm.unregister_cache(slot_cache.cache_id)
    datadist.finalize()
    logging.info("[prompt] end")


def run_decoder(args):
    datadist = init_llm_datadist(LLMRole.DECODER, DECODER_CLUSTER_ID, f"127.0.0.1:{args.port}")
    cm = datadist.cache_manager
    whole = zeros(BLOCKS_SHAPE)
    whole_cache = cm.register_blocks_cache(desc(BLOCKS_SHAPE), [t.data_ptr() for t in whole],
                                           BlocksCacheKey(DECODER_CLUSTER_ID, 0))
    some = zeros(BLOCKS_SHAPE)
    some_cache = cm.register_blocks_cache(desc(BLOCKS_SHAPE), [t.data_ptr() for t in some],
                                          BlocksCacheKey(DECODER_CLUSTER_ID, 1))
    slot = zeros(SLOT_SHAPE)
    slot_cache = cm.register_cache(desc(SLOT_SHAPE), [t.data_ptr() for t in slot])
    exchange(slot_cache.cache_id)
    dist.barrier()  # registered
    dist.barrier()  # transferred
    for t in range(NUM_TENSORS):
        check(same(whole[t].cpu(), pattern(100 + t, BLOCKS_SHAPE, torch.float32)),
              f"cache to cache: tensor {t} differs")
        want = torch.zeros(*BLOCKS_SHAPE, dtype=torch.float32)
        if t < 4:   # layers 0..1 hold the prompt's layers 1..2
            src = pattern(200 + t + 2, BLOCKS_SHAPE, torch.float32)
            want[5], want[2], want[3] = src[0], src[1], src[4]
        check(same(some[t].cpu(), want), f"blocks: tensor {t} differs")
        want = torch.zeros(*SLOT_SHAPE, dtype=torch.float32)
        want[0] = pattern(300 + t, SLOT_SHAPE, torch.float32)[1]
        check(same(slot[t].cpu(), want), f"slot: tensor {t} differs")
    logging.info("[decoder] every layer landed")
    dist.barrier()  # checked
    cluster = LLMClusterInfo()
    cluster.remote_cluster_id = PROMPT_CLUSTER_ID
    ret, _ = datadist.unlink_clusters([cluster], 5000, force=True)
    check(ret == LLMStatusCode.LLM_SUCCESS, "unlink failed")
    for c in (whole_cache, some_cache, slot_cache):
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
