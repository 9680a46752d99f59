"""TensorDesc and Tensor: the V1 API's host tensors (get_cache_tensors
returns them), over numpy arrays."""

import numpy as np

from .data_type import DataType
from .status import LLMException, LLMStatusCode, check_ints

# DataType -> numpy dtype; BF16 has none: its bits are kept as uint16.
_NP = {DataType.DT_FLOAT: np.float32, DataType.DT_FLOAT16: np.float16,
       DataType.DT_INT8: np.int8, DataType.DT_INT16: np.int16, DataType.DT_INT32: np.int32,
       DataType.DT_INT64: np.int64, DataType.DT_UINT8: np.uint8,
       DataType.DT_UINT16: np.uint16, DataType.DT_UINT32: np.uint32,
       DataType.DT_UINT64: np.uint64, DataType.DT_DOUBLE: np.float64,
       DataType.DT_BOOL: np.bool_, DataType.DT_BF16: np.uint16}
_DT = {np.dtype(v): k for k, v in _NP.items() if k != DataType.DT_BF16}


class TensorDesc:
    def __init__(self, dtype, shape):
        if not isinstance(dtype, DataType):
            raise TypeError(f"dtype only support ['DataType'], but got {type(dtype)}.")
        if not isinstance(shape, (list, tuple)):
            raise TypeError(f"shape only support ['list', 'tuple'], but got {type(shape)}.")
        self._dtype = dtype
        self._shape = check_ints("shape", shape)

    dtype = property(lambda self: self._dtype)
    shape = property(lambda self: self._shape)

    def __repr__(self):
        return f"TensorDesc(dtype={self._dtype}, shape={self._shape})"

    __str__ = __repr__


class Tensor:
    """Tensor(numpy array[, TensorDesc]) or Tensor(another Tensor: a copy).
    The reference's third form, a native tensor handle (an int), names a
    tensor of its device runtime, which llmdd does not have."""

    def __init__(self, data, tensor_desc=None):
        if tensor_desc is not None and not isinstance(tensor_desc, TensorDesc):
            raise TypeError("tensor_desc must be a TensorDesc")
        if isinstance(data, Tensor):
            self._array = data._array.copy()
            self._desc = data._desc
            return
        if isinstance(data, int) and not isinstance(data, bool):
            raise LLMException("Tensor from a native tensor handle needs the reference's "
                               "device runtime; llmdd has none",
                               status_code=LLMStatusCode.LLM_FEATURE_NOT_ENABLED)
        if not isinstance(data, np.ndarray):
            raise TypeError(f"data only support ['ndarray', 'Tensor', 'int'], "
                            f"but got {type(data)}.")
        if not data.flags.c_contiguous:
            raise RuntimeError("The data is not c_contiguous")
        if tensor_desc is None:
            dt = _DT.get(data.dtype)
            if dt is None:
                raise RuntimeError(f"The dtype of data:{data.dtype} is not valid")
            tensor_desc = TensorDesc(dt, list(data.shape))
        elif list(data.shape) != tensor_desc.shape:
            raise RuntimeError(f"The shape of data:{data.shape} is not same as tensor_desc "
                               f"shape:{tensor_desc.shape}")
        elif data.dtype != np.dtype(_NP.get(tensor_desc.dtype, object)):
            raise RuntimeError(f"The dtype of data:{data.dtype} is not same as tensor_desc "
                               f"dtype:{tensor_desc.dtype}")
        self._array = data
        self._desc = tensor_desc

    @property
    def tensor_desc(self):
        return self._desc

    def numpy(self, copy=False):
        """The data as a numpy array (BF16 widened to float32, as the
        reference does); copy=False shares the memory where it can."""
        if not isinstance(copy, bool):
            raise TypeError("copy must be a bool")
        if self._desc.dtype == DataType.DT_BF16:
            return (self._array.astype(np.uint32) << 16).view(np.float32)
        return self._array.copy() if copy else self._array

    def __repr__(self):
        return f"Tensor({self._array}, tensor_desc={self._desc})"
