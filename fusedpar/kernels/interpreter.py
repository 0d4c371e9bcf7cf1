"""Whether fusedpar's Triton kernels run compiled or in Triton's interpreter: triton decides
when it decorates a kernel, so ``TRITON_INTERPRET=1`` must be set before fusedpar's kernel
modules are imported (tests/conftest.py does so on machines without a GPU)."""

import os

import torch


def interpreting() -> bool:
    """True when the kernels were decorated for the interpreter (they then run on CPU tensors)."""
    from .signal import signal_peers_kernel  # any of fusedpar's kernels tells

    return type(signal_peers_kernel).__name__ == "InterpretedFunction"


def triton_device_reasons(device: torch.device) -> list[str]:
    """Why the Triton kernels cannot run on ``device`` in this process ([] if they can)."""
    if device.type == "cpu":
        if interpreting():
            return []
        late = " (it was set too late)" if os.environ.get("TRITON_INTERPRET") == "1" else ""
        return ["Triton kernels run on CPU only in the interpreter: set TRITON_INTERPRET=1 "
                "before importing fusedpar" + late]
    if device.type == "cuda":
        return ["TRITON_INTERPRET=1 is set: the interpreter cannot run on CUDA tensors"] \
            if interpreting() else []
    return [f"no Triton kernels for device type {device.type!r}"]
