"""What the planner knows of the hardware: this machine's accelerator and the GPUs' peak FLOP/s for MFU."""

from __future__ import annotations

from gptpipe.train.data import available_host_ram

# Dense bf16/fp16 peak FLOP/s per GPU by model name (fp32 runs count TF32 at half of it).
PEAK_TFLOPS = {"H200": 989.0, "H100": 989.0, "A100": 312.0, "L40S": 362.0, "A10G": 125.0, "L4": 121.0,
               "V100": 125.0}


def detect_device() -> tuple[bool, str, float]:
    """(on_gpu, name, bytes of memory) of this machine's first accelerator, or of host RAM on CPU."""
    try:
        import torch

        if torch.cuda.is_available():
            props = torch.cuda.get_device_properties(0)
            return True, props.name, float(props.total_memory)
    except ImportError:
        pass
    return False, "CPU", float(available_host_ram())


def peak_flops(device_name: str, precision: str, override_tflops: float | None) -> float | None:
    """Dense peak FLOP/s of one GPU for MFU (None on CPU or an unknown GPU without an override)."""
    if override_tflops:
        return override_tflops * 1e12
    for key, tflops in PEAK_TFLOPS.items():
        if key in device_name.upper():
            return tflops * 1e12 / (2 if precision == "fp32" else 1)
    return None


def liger_available() -> bool:
    """Whether Liger's kernels are installed (then a GPU run's loss never holds the full logits)."""
    try:
        import liger_kernel  # noqa: F401
    except ImportError:
        return False
    return True
