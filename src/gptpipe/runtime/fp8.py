"""FP8 training (train.precision: fp8): torchao's float8 linears on top of the bf16 DeepSpeed engine.

The engine, its weights, gradients, optimizer states and checkpoints stay bf16/fp32 exactly as with
train.precision bf16: torchao's `Float8Linear` is an `nn.Linear` that keeps its high-precision weight (the
state_dict's keys and dtypes do not change, so resume and stage 4 see a bf16 run's checkpoint) and casts the
input, the weight and, in backward, the output's gradient to float8 with a scale for each matmul.

Which layers convert (`layer_choice`): those torchao's own size filter for the recipe passes
(`torchao.float8._auto_filter_for_recipe`, thresholds from its H100 benchmarks: below them the casts cost more
than the faster matmul saves; every dimension must be a multiple of 16), never lm_head: Liger's fused loss reads
its weight directly (its forward never runs) and torchtitan keeps the output head in bf16 for accuracy too.

The recipe (train.fp8_recipe): tensorwise, one scale per tensor, is the default: the fastest, and what
torchao's `Float8LinearConfig()` gives unless told otherwise (torchao's docs: up to 1.25x over bf16 at 8 GPUs / 8B;
torchtitan's Llama-3 8B on 8 H100s, compiled, commit 7a04053: bf16 5,760 tokens/s, rowwise 6,424 (1.12x), tensorwise
7,186 (1.25x)). rowwise (one power-of-2 scale per row) is more accurate where a few values are far larger than the
rest, at less speed; the speed here (1b preset, one GPU) is bench/gpu_check.sh's to measure.

The casts and scales are many small elementwise kernels that torch.compile fuses: torchao's float8 is meant to
run compiled. Where train.compile compiles the whole model, that covers them; where it does not (off, or
uncompiled because of Liger's kernels), `compile_converted` compiles each converted linear on its own, so the
fused Liger kernels around them stay eager.

FP8 matmuls need an NVIDIA GPU of compute capability 8.9 or higher (Ada: L4, L40S, RTX 4090; Hopper: H100,
H200; Blackwell) and torchao (the [fp8] extra): `unavailable` says why a run cannot, and stage 3 refuses
before any work (an explicit request, never a silent fallback to bf16).
"""

from __future__ import annotations

import importlib.util
import logging
from dataclasses import dataclass
from typing import Any

import torch

INSTALL = "pip install -e .[fp8]"
MIN_CAPABILITY = (8, 9)
GPUS = "an NVIDIA GPU of compute capability >= 8.9 (H100/H200, L4/L40S, RTX 4090, Blackwell)"
KEPT = ("lm_head",)  # module names (fqn substrings) never converted: see the module doc


@dataclass(frozen=True)
class LayerChoice:
    """One nn.Linear of the model and whether it trains in FP8, and why."""

    name: str
    out_features: int
    in_features: int
    converted: bool
    why: str

    def line(self) -> str:
        return f"{self.name} ({self.out_features}x{self.in_features}): {'fp8' if self.converted else 'bf16'}, " \
               f"{self.why}"


def unavailable(device: torch.device | None = None) -> str | None:
    """Why train.precision fp8 cannot run on `device` (None: this machine's first CUDA device, or the CPU), None
    when it can. Does not import torchao (its import loads CUDA extensions and logs on CPU machines)."""
    problems = []
    if importlib.util.find_spec("torchao") is None:
        problems.append(f"torchao is not installed ({INSTALL})")
    if device is None:
        device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    if device.type != "cuda":
        problems.append(f"this machine has no CUDA GPU; FP8 matmuls need {GPUS}")
    else:
        capability = torch.cuda.get_device_capability(device)
        if capability < MIN_CAPABILITY:
            problems.append(f"{torch.cuda.get_device_name(device)} has compute capability "
                            f"{capability[0]}.{capability[1]}, FP8 matmuls need {GPUS}")
    return "; ".join(problems) or None


class _TorchaoStartupNotices(logging.Filter):
    """torchao's import notices that say nothing about a run: on a CPU build of torch its CUDA extensions cannot
    load ("Failed to load ..._C_mxfp8...so"; the float8 training path calls torch._scaled_mm, not them), and
    torch deprecates how it registers its enums ("<enum 'KernelPreference'> is an Enum subclass ...
    register_constant()"). transformers imports torchao whenever it is installed (its quantizers), so a stage that
    builds a model prints them; filtered (by their exact text, torchao's other warnings still show) from when this
    module is imported: stage 3's planner and engine import it."""

    def filter(self, record: logging.LogRecord) -> bool:
        text = record.getMessage()
        return not (text.startswith("Failed to load") and "torchao" in text
                    or "is an Enum subclass" in text and "register_constant()" in text)


logging.getLogger("torchao").addFilter(_TorchaoStartupNotices())
logging.getLogger("torch.utils._pytree").addFilter(_TorchaoStartupNotices())


def _float8() -> Any:
    """torchao.float8 (the [fp8] extra), imported where it is used: it loads CUDA extensions."""
    import torchao.float8
    import torchao.float8.float8_linear  # Float8Linear, for compile_converted

    return torchao.float8


def layer_choice(model: torch.nn.Module, recipe: str) -> list[LayerChoice]:
    """Each nn.Linear of `model` (any device, the meta device too: only shapes are read), in module order, with
    torchao's decision for `recipe` (see the module doc) and the reason."""
    float8 = _float8()
    passes = float8._auto_filter_for_recipe(recipe, filter_fqns=list(KEPT))
    choices = []
    for name, module in model.named_modules():
        if not isinstance(module, torch.nn.Linear):
            continue
        n, k = module.weight.shape
        if passes(module, name):
            why = f"passes torchao's {recipe} size filter"
        elif any(kept in name for kept in KEPT):
            why = "output head: Liger's fused loss reads its weight, torchtitan keeps it bf16 too"
        elif n % 16 or k % 16:
            why = "a dimension not a multiple of 16, which FP8 matmuls need"
        else:
            why = f"too small for FP8 to pay: under torchao's {recipe} thresholds, measured on H100"
        choices.append(LayerChoice(name, n, k, passes(module, name), why))
    return choices


def describe(choices: list[LayerChoice], recipe: str) -> str:
    """One line for the plan and the log: the linears in FP8 and those left in bf16, grouped by kind and shape (a
    transformer's layers repeat), each bf16 group with its reason."""
    groups: dict[tuple[bool, str, int, int, str], int] = {}
    for c in choices:
        key = (c.converted, c.name.rsplit(".", 1)[-1], c.out_features, c.in_features, "" if c.converted else c.why)
        groups[key] = groups.get(key, 0) + 1

    def kinds(converted: bool) -> str:
        return ", ".join(f"{count}x {kind} {n}x{k}" + (f" ({why})" if why else "")
                         for (flag, kind, n, k, why), count in groups.items() if flag == converted) or "none"

    return (f"{recipe} scaling, {sum(c.converted for c in choices)} of {len(choices)} linears in FP8: "
            f"{kinds(True)}; bf16: {kinds(False)}")


def nothing_converts(choices: list[LayerChoice], arch: str) -> str | None:
    """Why FP8 would change nothing for this model (a refusal), None when some layer converts."""
    if any(c.converted for c in choices):
        return None
    if not any(c.name != "lm_head" for c in choices):
        return (f"model.arch {arch} has no nn.Linear layers besides lm_head (transformers' GPT-2 uses Conv1D), so "
                "no matmul would run in FP8: use train.precision=bf16")
    return ("no linear layer of this model is large enough for FP8 to pay (torchao's size filter; e.g. the 1b "
            "preset's MLPs are): use train.precision=bf16 or a larger model.preset")


def model_choice(hf_config: Any, recipe: str) -> list[LayerChoice]:
    """`layer_choice` for the model `hf_config` describes, built on the meta device (no memory): what the planner
    shows and checks before anything is built."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return layer_choice(AutoModelForCausalLM.from_config(hf_config), recipe)


def largest_converted(choices: list[LayerChoice]) -> tuple[int, int] | None:
    """(out, in) of the converted linear with the most weights plus rows: whose casts the planner counts."""
    converted = [c for c in choices if c.converted]
    best = max(converted, key=lambda c: (c.out_features * c.in_features, c.out_features + c.in_features),
               default=None)
    return (best.out_features, best.in_features) if best else None


def convert(model: torch.nn.Module, recipe: str) -> list[LayerChoice]:
    """Swap the layers `layer_choice` picks for torchao's Float8Linear, in place; returns the choice."""
    float8 = _float8()
    choices = layer_choice(model, recipe)
    chosen = {c.name for c in choices if c.converted}
    float8.convert_to_float8_training(model, config=float8.Float8LinearConfig.from_recipe_name(recipe),
                                      module_filter_fn=lambda module, name: name in chosen)
    return choices


def compile_converted(model: torch.nn.Module, backend: str) -> int:
    """torch.compile each Float8Linear of `model` on its own (the casts and scales fused); returns how many.
    For runs whose whole model is not compiled (see the module doc)."""
    float8 = _float8()
    layers = [m for m in model.modules() if isinstance(m, float8.float8_linear.Float8Linear)]
    for layer in layers:
        layer.compile(backend=backend)
    return len(layers)
