"""What the planner and the engine know of the hardware: this machine's accelerator, the GPUs' peak FLOP/s for
MFU, the ranks sharing a node, and whether Liger's fused loss can run (one decision for both)."""

from __future__ import annotations

import os
import re
import shutil
import sysconfig
from dataclasses import dataclass
from pathlib import Path

# Dense bf16/fp16 peak FLOP/s per GPU, by a pattern of the name torch reports (fp32 runs count TF32 at half of it).
# First match wins: the H100's PCIe and NVL boards are slower than the SXM one ("NVIDIA H100 80GB HBM3"), and
# "L4" must not match "L40"/"L40S".
PEAK_TFLOPS = [(r"H100.*NVL", 835.0), (r"H100.*PCIE", 756.0), (r"H100", 989.0), (r"H200", 989.0),
               (r"A100", 312.0), (r"L40S", 362.0), (r"L40\b", 181.0), (r"A10G", 125.0), (r"L4\b", 121.0),
               (r"V100", 125.0)]

# The architectures (model.arch, or a base model's model_type) Liger patches, with its function
# (liger_kernel.transformers.apply_liger_kernel_to_<name>) and the name of its fused-MLP switch: apply_liger in
# runtime/engine.py. It has no GPT-2 patch. Mixtral's experts stay eager (the planner counts them so).
LIGER_ARCHS = {"llama": ("llama", "swiglu"), "mistral": ("mistral", "swiglu"), "qwen2": ("qwen2", "swiglu"),
               "qwen3": ("qwen3", "swiglu"), "gemma2": ("gemma2", "geglu"), "gemma3_text": ("gemma3_text", "geglu"),
               "mixtral": ("mixtral", None)}


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
    for pattern, tflops in PEAK_TFLOPS:
        if re.search(pattern, device_name.upper()):
            return tflops * 1e12 / (2 if precision == "fp32" else 1)
    return None


def ranks_per_node(world_size: int) -> int:
    """Ranks of this launch on this node: torchrun's LOCAL_WORLD_SIZE, the deepspeed launcher's LOCAL_SIZE,
    else this machine's GPU count, else all of them (one machine)."""
    for name in ("LOCAL_WORLD_SIZE", "LOCAL_SIZE"):
        if os.environ.get(name):
            return max(1, min(world_size, int(os.environ[name])))
    try:
        import torch

        gpus = torch.cuda.device_count()
    except ImportError:
        gpus = 0
    return min(world_size, gpus) if gpus else world_size


def host_threads_per_rank(world_size: int) -> int:
    """This node's cores split between its ranks (for CPU training and the host AdamW step of an offload)."""
    return max(1, (os.cpu_count() or 1) // ranks_per_node(world_size))


def liger_missing(arch: str) -> str | None:
    """Why Liger's patch for `arch` (one of LIGER_ARCHS) cannot be applied here, None when it can.

    Imports what engine.apply_liger calls: `liger_kernel.transformers` imports transformers' model modules, and
    raises under a transformers version it does not know even where `import liger_kernel` works."""
    try:
        import liger_kernel.transformers
    except ImportError as exc:
        if exc.name in ("liger_kernel", "triton"):
            return f"{exc.name} is not installed (pip install -e .[gpu])"
        return f"liger_kernel.transformers does not import here ({type(exc).__name__}: {exc})"
    except Exception as exc:  # a transformers it does not support fails in other ways too (AttributeError...)
        return f"liger_kernel.transformers does not import here ({type(exc).__name__}: {exc})"
    function = f"apply_liger_kernel_to_{LIGER_ARCHS[arch][0]}"
    if not hasattr(liger_kernel.transformers, function):
        return f"this liger-kernel has no {function}"
    return None


def triton_missing() -> str | None:
    """Why Triton (Liger's kernels, torch.compile's inductor) cannot run here, None when it can.

    Triton compiles a small C launcher at first use with the host C compiler (CC, else gcc, else clang) and the
    Python headers: without them the first training step raises."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return "triton is not installed"
    if not (os.environ.get("CC") or shutil.which("gcc") or shutil.which("clang")):
        return "no C compiler (gcc, clang or $CC) for Triton's launcher"
    include = sysconfig.get_paths()["include"]
    if not (Path(include) / "Python.h").is_file():
        return f"no Python headers ({include}/Python.h) for Triton's launcher"
    return None


@dataclass(frozen=True)
class LossPath:
    """Whether Liger's fused linear cross-entropy computes the training loss, and why (for the plan and the log)."""

    fused: bool
    why: str


def loss_path(arch: str, on_gpu: bool, liger_kernels: bool, other_machine: bool = False) -> LossPath:
    """The one decision of the loss path: the planner reserves its memory, the engine applies it.

    `other_machine`: planning for a GPU from another machine (`gptpipe plan --gpu-name`), whose install is
    assumed to be the GPU one (the [gpu] extra with a C compiler), whatever this machine has."""
    if not on_gpu:
        return LossPath(False, "on CPU: transformers' loss over the full logits")
    if not liger_kernels:
        return LossPath(False, "train.liger_kernels is false: transformers' loss over the full logits")
    if arch not in LIGER_ARCHS:
        return LossPath(False, f"Liger has no {arch} patch: transformers' loss over the full logits")
    if other_machine:
        return LossPath(True, "Liger's fused linear cross-entropy (assumed: the GPU machine has the [gpu] extra)")
    unusable = liger_missing(arch)
    if unusable:
        return LossPath(False, f"Liger cannot patch {arch}: {unusable}; transformers' loss over the full logits")
    missing = triton_missing()
    if missing:
        return LossPath(False, f"Liger's kernels cannot build: {missing}; transformers' loss over the full logits")
    return LossPath(True, "Liger's fused linear cross-entropy")


def available_host_ram() -> int:
    """Bytes that can be allocated without swapping (the kernel's MemAvailable, through psutil)."""
    import psutil

    return int(psutil.virtual_memory().available)
