"""A host-memory stand-in for torch_npu, for the compat tests only: code
written for Ascend (torch.npu.set_device, tensor.npu()) runs on the CPU.
"Device" tensors are CPU tensors, so their data_ptr() is host memory that
llmdd registers like any other."""

import torch


class _Npu:
    """The parts of torch.npu that the reference's samples call."""

    def __init__(self):
        self._device = 0

    def set_device(self, device):
        if isinstance(device, str):
            device = int(device.rsplit(":", 1)[-1])
        self._device = int(device)

    def current_device(self):
        return self._device

    def is_available(self):
        return True

    def device_count(self):
        return 8

    def synchronize(self, device=None):
        pass


torch.npu = _Npu()
torch.Tensor.npu = lambda self, *args, **kwargs: self
