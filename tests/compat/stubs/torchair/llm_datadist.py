"""torchair.llm_datadist.create_npu_tensors on host memory: tensors that view
the memory at each address (a cache's tensor_addrs), so a program fills and
reads a registered or allocated cache through torch as it does on Ascend."""

import ctypes

import numpy as np
import torch

_VIEW = {torch.float32: np.float32, torch.float16: np.float16, torch.int32: np.int32,
         torch.int8: np.int8, torch.uint8: np.uint8, torch.int64: np.int64,
         torch.int16: np.int16, torch.float64: np.float64, torch.bfloat16: np.int16}


def create_npu_tensors(shape, dtype, addrs):
    """One tensor of `shape` and `dtype` per address, sharing its memory."""
    n = 1
    for d in shape:
        n *= int(d)
    out = []
    for addr in addrs:
        nbytes = n * torch.tensor([], dtype=dtype).element_size()
        buf = (ctypes.c_uint8 * nbytes).from_address(int(addr))
        arr = np.frombuffer(buf, dtype=_VIEW[dtype]).reshape([int(d) for d in shape])
        t = torch.from_numpy(arr)
        out.append(t.view(dtype) if dtype == torch.bfloat16 else t)
    return out
