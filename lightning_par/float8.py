"""float8 training through torchao (an optional extra: ``pip install 'lightning_par[float8]'``).

Micikevicius et al. 2022 ("FP8 Formats for Deep Learning"): the matrix products of the chosen ``nn.Linear`` layers
run in float8 (``e4m3`` for inputs and weights, ``e5m2`` for the output gradient under the tensorwise recipe), with
scales computed from each tensor's absolute maximum at every step ("dynamic scaling"); the master weights, the
optimizer and everything outside those products keep their precision. torchao's ``Float8Linear``
(``torchao.float8.convert_to_float8_training``) does the casting and calls ``torch._scaled_mm``; this module decides
which layers, and makes the conversion compose with the other axes in :func:`lightning_par.parallelize.parallelize`,
as torchtitan does (``torchtitan/components/quantization/float8.py``):

* the conversion runs in the ``read`` phase, on the whole network, before the pipeline cut and the tensor-parallel
  split (parameter names do not change: ``Float8Linear`` keeps ``weight`` and ``bias``);
* under tensor parallelism the plan's ``colwise`` / ``rowwise`` layers that were converted take torchao's float8 styles
  (``Float8ColwiseParallel`` / ``Float8RowwiseParallel``): the same sharding as torch's styles, the activation cast to
  float8 before its collective. Their weight scale is the amax over the whole (sharded) weight, so tp ranks agree
  with one process;
* under ``zero3`` (and HSDP) the weights are all-gathered in float8 (``enable_fsdp_float8_all_gather``: half the
  bytes of bf16) and, after every optimizer step, their scales are computed for all weights in one all-reduce
  (``precompute_float8_dynamic_scale_for_fsdp``), instead of one per weight inside each all-gather.

Recipes (``recipe``): ``"tensorwise"`` (one scale per tensor; the only one torchao's float8 all-gather and float8 tp
styles support) and ``"rowwise"`` (one scale per row, power-of-two scales, e4m3 everywhere: torchao's more accurate
recipe, slower on H100).

What is refused before training starts, naming the reason: torchao missing; ``rowwise`` under tp or with the float8
all-gather; the float8 all-gather without ``zero3``; any axis but dp and tp above size 1 (pipeline, context and expert
parallelism are not verified against one process in this version); a selected layer whose dimensions are not multiples of 16 (``torch._scaled_mm``'s
constraint on CUDA) or, under tp, planned with a style other than ``colwise``/``rowwise``/none; no layer selected; a
CUDA device of compute capability below 8.9 (float8 matrix units start with Ada and Hopper) or any other device but
the CPU; sequence parallelism on the CPU (gloo has no float8 all-gather).

On the CPU (this project's test machines) ``torch._scaled_mm`` runs with float8 inputs (torch 2.13): the numbers are
float8's, so the tests here check float8 training for correctness against one process; its speed is a GPU question
(``scripts/gpu_check.sh``).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from fnmatch import fnmatchcase
from typing import Any

import torch
from torch import nn

from lightning_par.axis_registry import Axis, Build
from lightning_par.validation import check_bool, check_choice

__all__ = [
    "FLOAT8",
    "FLOAT8_RECIPES",
    "Float8Options",
    "MIN_CUDA_CAPABILITY",
    "check_float8_device",
    "check_float8_run",
    "convert_float8",
    "float8_available",
    "float8_modules",
]

_log = logging.getLogger(__name__)

#: Valid values of ``float8.recipe``.
FLOAT8_RECIPES: tuple[str, ...] = ("tensorwise", "rowwise")
#: Float8 matrix units: NVIDIA compute capability 8.9 (Ada) and later (Hopper 9.0, Blackwell 10.0).
MIN_CUDA_CAPABILITY: tuple[int, int] = (8, 9)
#: ``torch._scaled_mm`` on CUDA needs both dimensions of a weight to be multiples of this.
_DIM_MULTIPLE = 16
#: tp plan styles a float8 layer may have (torchao's float8 styles exist for these two).
_FLOAT8_TP_STYLES = ("colwise", "rowwise")
#: The layout sizes float8 is verified under (any other size above 1 is refused).
_VERIFIED_SIZES = ("dp_size", "dp_replicate_size", "dp_shard_size", "tp_size")
_INSTALL = "pip install 'lightning_par[float8]' (torchao>=0.18)"


def float8_available() -> bool:
    """Whether torchao's float8 training is importable."""
    try:
        import torchao.float8  # noqa: F401
    except Exception:  # noqa: BLE001 - any import failure means "not available"
        return False
    return True


def _names(name: str, value: Any) -> tuple[str, ...]:
    if isinstance(value, str):
        value = (value,)
    try:
        out = tuple(value)
    except TypeError:
        out = None
    if out is None or not all(isinstance(v, str) and v for v in out):
        raise ValueError(
            f"float8.{name}={value!r} is not valid: expected a list of module path patterns (fnmatch: "
            f"'blocks.*.mlp.*'), e.g. ['*']."
        )
    return out


@dataclass(frozen=True)
class Float8Options:
    """float8 training (``strategy.float8``).

    Attributes:
        enabled: convert the selected ``nn.Linear`` layers to torchao's ``Float8Linear``.
        recipe: one of :data:`FLOAT8_RECIPES`.
        include: fnmatch patterns of module paths (relative to the network, ``*`` also matches dots; a pattern with
            no dot also matches a path's last component) selecting the ``nn.Linear`` layers to convert; ``["*"]``:
            every one.
        exclude: patterns (as ``include``) of paths never converted; by default the LM head (``lm_head``;
            torchtitan's ``output``): its logits feed the loss, and torchtitan keeps it in high precision too.
        fsdp_all_gather: all-gather the weights in float8 under ``zero3``/HSDP (tensorwise only). ``None``: on
            exactly when the dp mode is ``zero3`` and the recipe tensorwise.
        precompute_scales: with the float8 all-gather, compute every weight's scale in one all-reduce after each
            optimizer step (else each all-gather computes its own).

    Raises:
        ValueError: an invalid value, naming the field and what would be valid.
    """

    enabled: bool = False
    recipe: str = "tensorwise"
    include: tuple[str, ...] = ("*",)
    exclude: tuple[str, ...] = ("lm_head", "output")
    fsdp_all_gather: bool | None = None
    precompute_scales: bool = True

    def __post_init__(self) -> None:
        check_bool("float8.enabled", self.enabled)
        check_choice("float8.recipe", self.recipe, FLOAT8_RECIPES)
        object.__setattr__(self, "include", _names("include", self.include))
        object.__setattr__(self, "exclude", _names("exclude", self.exclude) if len(self.exclude) else ())
        if self.fsdp_all_gather is not None:
            check_bool("float8.fsdp_all_gather", self.fsdp_all_gather)
        check_bool("float8.precompute_scales", self.precompute_scales)

    def all_gather(self, dp_mode: str) -> bool:
        """Whether the weights are all-gathered in float8 under ``dp_mode``."""
        if self.fsdp_all_gather is None:
            return dp_mode == "zero3" and self.recipe == "tensorwise"
        return self.fsdp_all_gather


def _matches(path: str, pattern: str) -> bool:
    """``pattern`` (fnmatch) matches the whole ``path``, or, having no dot, its last component."""
    return fnmatchcase(path, pattern) or ("." not in pattern and fnmatchcase(path.rsplit(".", 1)[-1], pattern))


def float8_modules(network: nn.Module, options: Float8Options) -> dict[str, nn.Linear]:
    """The ``nn.Linear`` layers of ``network`` the options select, by path relative to ``network``, in module
    order."""
    out: dict[str, nn.Linear] = {}
    for path, module in network.named_modules():
        if not path or not isinstance(module, nn.Linear):
            continue
        if any(_matches(path, p) for p in options.include) and not any(_matches(path, p) for p in options.exclude):
            out[path] = module
    return out


def check_float8_device(device: torch.device) -> None:
    """Refuse a device that cannot run float8 matrix products.

    Raises:
        ValueError: a CUDA device of compute capability below :data:`MIN_CUDA_CAPABILITY`, or a device other than
            CUDA and the CPU.
    """
    if device.type == "cpu":
        return
    if device.type == "cuda":
        cap = torch.cuda.get_device_capability(device)
        if tuple(cap) < MIN_CUDA_CAPABILITY:
            raise ValueError(
                f"float8.enabled=True is not valid on {torch.cuda.get_device_name(device)} (compute capability "
                f"{cap[0]}.{cap[1]}): float8 matrix products need compute capability "
                f"{MIN_CUDA_CAPABILITY[0]}.{MIN_CUDA_CAPABILITY[1]} or later (Ada, Hopper, Blackwell). Use "
                f"float8.enabled=False (bf16)."
            )
        return
    raise ValueError(
        f"float8.enabled=True is not valid on device {device.type!r}: torchao's float8 training runs on NVIDIA GPUs "
        f"(compute capability >= 8.9) and, for correctness checks, on the CPU."
    )


def check_float8_run(device: torch.device, tp_size: int, sequence_parallel: bool) -> None:
    """Refuse what the device of a run cannot take (called by :func:`~lightning_par.parallelize.parallelize`, before
    any step): :func:`check_float8_device`, and tensor parallelism with sequence parallelism on the CPU, whose
    backward all-gathers float8 gradients over the sequence (gloo has no float8 collectives: "Invalid scalar type",
    measured with torch 2.13).

    Raises:
        ValueError: naming the device or the option.
    """
    check_float8_device(device)
    if device.type == "cpu" and tp_size > 1 and sequence_parallel:
        raise ValueError(
            f"float8.enabled=True is not valid with sequence_parallel=True on the CPU (tp_size={tp_size}): torchao's "
            f"float8 tensor-parallel styles all-gather float8 tensors over the sequence, which gloo cannot send. Use "
            f"sequence_parallel=False on the CPU (float8 tp without sequence parallelism runs), or a CUDA device "
            f"(nccl)."
        )


def _plan_styles(network: nn.Module, plan: Any) -> dict[str, Any]:
    from lightning_par.tensor_parallel.plan import expand_plan

    return expand_plan(network, plan)


def _check(module: nn.Module, network: nn.Module, dims: Any, options: Any) -> None:
    f8: Float8Options = options.float8
    if not f8.enabled:
        if f8.fsdp_all_gather:
            raise ValueError("float8.fsdp_all_gather=True is not valid with float8.enabled=False: enable float8 first.")
        return
    if not float8_available():
        raise ValueError(f"float8.enabled=True needs torchao's float8 training, which is not installed: {_INSTALL}.")
    from lightning_par import contract

    contract.check_not_compiled(module, "float8.enabled=True", "swaps the nn.Linear layers named by their paths")
    for size in type(dims).size_names():
        value = getattr(dims, size)
        if size not in _VERIFIED_SIZES and value > 1:
            raise ValueError(
                f"float8.enabled=True is not valid with {size}={value}: float8 training is verified against one "
                f"process under dp (ddp, zero1/2/3, HSDP) and tp in this version, not on this axis. Use {size}=1, or "
                f"float8.enabled=False."
            )
    if dims.tp_enabled and f8.recipe != "tensorwise":
        raise ValueError(
            f"float8.recipe={f8.recipe!r} is not valid with tp_size={dims.tp_size}: torchao's float8 tensor-parallel "
            f"styles (Float8ColwiseParallel/Float8RowwiseParallel) support tensorwise scaling only. Use "
            f"float8.recipe='tensorwise'."
        )
    if f8.fsdp_all_gather:
        if options.dp_mode != "zero3":
            raise ValueError(
                f"float8.fsdp_all_gather=True is not valid with dp_mode={options.dp_mode!r}: only zero3 (FSDP2) "
                f"all-gathers weights. Use dp_mode='zero3' (strategy zero3 or HSDP), or leave it unset."
            )
        if f8.recipe != "tensorwise":
            raise ValueError(
                f"float8.fsdp_all_gather=True is not valid with float8.recipe={f8.recipe!r}: torchao all-gathers "
                f"float8 weights with tensorwise scales only. Use float8.recipe='tensorwise' or "
                f"float8.fsdp_all_gather=False."
            )
    selected = float8_modules(network, f8)
    if not selected:
        raise ValueError(
            f"float8.enabled=True selects no nn.Linear layer of {type(network).__name__} with "
            f"float8.include={list(f8.include)} and float8.exclude={list(f8.exclude)}: widen include, or disable "
            f"float8."
        )
    for path, linear in selected.items():
        bad = [d for d in (linear.in_features, linear.out_features) if d % _DIM_MULTIPLE]
        if bad:
            raise ValueError(
                f"float8 layer {path!r} is not valid: its shape (in_features={linear.in_features}, out_features="
                f"{linear.out_features}) has a dimension that is not a multiple of {_DIM_MULTIPLE} (torch._scaled_mm "
                f"needs it). Add {path!r} to float8.exclude."
            )
    if dims.tp_enabled:
        plan = contract.tp_plan(module, network, options.tensor_parallel.plan)
        for path, style in _plan_styles(network, plan).items():
            if path in selected and not (isinstance(style, str) and style in _FLOAT8_TP_STYLES):
                raise ValueError(
                    f"float8 layer {path!r} is not valid with tp_size={dims.tp_size}: its plan style {style!r} has "
                    f"no float8 form (torchao's float8 styles are {list(_FLOAT8_TP_STYLES)}). Add {path!r} to "
                    f"float8.exclude."
                )


def convert_float8(network: nn.Module, options: Float8Options, dp_mode: str = "ddp") -> list[str]:
    """Swap the layers ``options`` selects for torchao's ``Float8Linear`` in place (the step
    :func:`~lightning_par.parallelize.parallelize` runs; also usable on a plain network with no strategy).

    Args:
        network: the network (its paths are what ``include``/``exclude`` match).
        options: the float8 options (``enabled`` is not consulted).
        dp_mode: the dp mode the network will run under (``"zero3"``: the weights become torchao's float8 all-gather
            tensors, if :meth:`Float8Options.all_gather`).

    Returns:
        The converted paths, sorted.
    """
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    selected = float8_modules(network, options)
    config = Float8LinearConfig.from_recipe_name(options.recipe)
    if options.all_gather(dp_mode):
        from dataclasses import replace

        config = replace(config, enable_fsdp_float8_all_gather=True)
    ids = {id(m) for m in selected.values()}
    convert_to_float8_training(network, module_filter_fn=lambda m, fqn: id(m) in ids, config=config)
    return sorted(selected)


def _convert(build: Build) -> None:
    """Swap the selected layers for ``Float8Linear`` on the whole network (after the tp step has read its plan,
    before the pipeline cut and the split), and give the tp plan torchao's float8 styles for them."""
    f8: Float8Options = build.options.float8
    if not f8.enabled:
        return
    check_float8_run(build.device, build.dims.tp_size, build.options.tensor_parallel.sequence_parallel)
    network = build.network
    assert network is not None
    all_gather = f8.all_gather(build.options.dp_mode)
    converted = convert_float8(network, f8, build.options.dp_mode)
    if build.plan is not None:
        build.plan = _float8_plan(network, build.plan, set(converted), build.options.tensor_parallel.sequence_parallel)
    if all_gather and f8.precompute_scales:
        from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

        build.optimizer_step_hooks.append(lambda: precompute_float8_dynamic_scale_for_fsdp(network))

    def summary() -> dict[str, Any]:
        return {
            "float8_recipe": f8.recipe,
            "float8_linears": len(converted),
            "float8_fsdp_all_gather": all_gather,
        }

    build.summaries.append(summary)
    _log.info("float8 (%s): %d nn.Linear layers converted%s", f8.recipe, len(converted),
              ", weights all-gathered in float8" if all_gather else "")


def _float8_plan(network: nn.Module, plan: Any, converted: set[str], sequence_parallel: bool) -> dict[str, Any]:
    """``plan`` with exact paths, torchao's float8 styles on the converted ``colwise``/``rowwise`` layers."""
    from torch.distributed.tensor import Replicate, Shard
    from torchao.float8.float8_tensor_parallel import Float8ColwiseParallel, Float8RowwiseParallel

    out: dict[str, Any] = {}
    for path, style in _plan_styles(network, plan).items():
        if path in converted and style == "colwise":
            style = Float8ColwiseParallel()
        elif path in converted and style == "rowwise":
            style = Float8RowwiseParallel(output_layouts=Shard(1) if sequence_parallel else Replicate())
        out[path] = style
    return out


#: float8 training: a technique on no mesh axis, in the registry for its place in ``parallelize()`` (the ``read``
#: phase, after the tp axis has read its plan).
FLOAT8 = Axis(
    name="float8",
    option_groups=("float8",),
    check=_check,
    steps=(("read", _convert),),
)

