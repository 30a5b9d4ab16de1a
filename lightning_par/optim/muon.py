"""Muon on the hidden weight matrices, AdamW on the rest, exact under every sharding of the parameters.

Muon (Jordan et al. 2024, https://kellerjordan.github.io/posts/muon/; at scale: Liu et al. 2025, "Muon is Scalable for
LLM Training", arXiv:2502.16982) keeps a momentum buffer per weight matrix and replaces the update by its
Newton-Schulz orthogonalisation. :class:`MuonAdamW` runs torch 2.13's ``torch.optim.Muon`` arithmetic: the same
momentum (``buf.lerp_(g, 1 - mu)``, Nesterov ``g.lerp(buf, mu)``), the same bf16 quintic iteration
(``torch.optim._muon._zeropower_via_newtonschulz``, called, not copied), the same ``adjust_lr_fn`` and decoupled
weight decay; the other parameters take torch's own ``AdamW`` step. In one process it equals ``torch.optim.Muon``
plus ``torch.optim.AdamW`` bit for bit (``tests/optim/test_muon.py``).

Distribution: the scheme and why
--------------------------------
Everything in Muon but the orthogonalisation is elementwise, so it runs on whatever part of the matrix this rank
holds, with no communication, and the momentum buffer is sharded exactly like the parameter (a ZeRO-1/2 row chunk,
an FSDP2 ``Shard(0)`` DTensor, a tensor-parallel column/row block, an expert-parallel rank's experts). The
orthogonalisation needs the whole matrix. Scheme (``MuonAdamW.step``):

* **owner** (a matrix split along one tensor dim over one mesh dim: ZeRO-1/2 chunks over dp, FSDP2 ``Shard(0)``
  over dp or, under HSDP, over each replica's shard group, tp column/row blocks): each matrix gets one owner among
  the ranks holding its pieces, assigned greedily by Newton-Schulz flops (:func:`assign_owners`, the same on every
  rank); every rank sends its piece of the fp32 update to the owner (``dist.gather``), the owner orthogonalises the
  whole matrix, and scatters each rank its piece of the bf16 result (``dist.scatter``). All gathers of a step are
  launched before any is waited for, then every owner iterates on its matrices at once, then all scatters.
* **all-gather** (a matrix split over two mesh dims, e.g. FSDP + TP's strided shards): the update is all-gathered
  (``DTensor.full_tensor``) and every rank of the group orthogonalises it, keeping its own slice.
* **local** (a matrix held whole: DDP, ``ddp_overlap``, pipeline stages, context parallelism; a stack of expert
  matrices split only along its expert dim, as expert parallelism and ZeRO/FSDP's dim-0 shards of it do): nothing
  is communicated, each rank orthogonalises the matrices it holds.

Cost per step, for ``M`` elements of Muon matrices each in ``n`` pieces (fp32 update, bf16 result):

* bytes received: an owner ``4 m k (n - 1) / n`` per matrix it owns, every other rank ``2 m k / n`` per matrix; with
  owners balanced, about ``6 M (n - 1) / n^2`` per rank, against ``4 M (n - 1) / n`` for the all-gather scheme;
  AdamW under the same layout moves nothing at the step;
* memory: an owner holds the whole fp32 update and bf16 result of its matrices during the step (about
  ``6 M / n`` bytes per rank with owners balanced) plus the iteration's temporaries, freed at the end of the step;
* compute: each matrix is orthogonalised once (owner) — ``n`` times under the all-gather fallback.

Sources read (the schemes, not their code): Megatron-LM's owner-based Muon for its FSDP (NVIDIA/Megatron-LM pull
request #6425: one owner per sharded matrix reconstructs it, orthogonalises, scatters the updates back); the design
note for distributed ``torch.optim.Muon`` (one rank per parameter, no redundant iteration); Moonlight's distributed
Muon over ZeRO-1 (Liu et al. 2025, arXiv:2502.16982, §2.3: all-gather the update over dp, orthogonalise on every rank,
keep the local part), which is this module's fallback; MindSpore hyper-parallel's RFC #513 comparing all-gather,
all-to-all and broadcast variants. Measured here (``recipes/benchmark.py --only muon``, GPT small, dp 2 zero2, CPU):
the owner scheme cut Muon's step-time overhead over AdamW from 3.6x to 2.2x (CPU time) and the bytes received from
1.57 MB to 1.18 MB per step against the all-gather scheme.

The split rule (:func:`muon_param_groups`): Muon takes a trainable parameter of 2 or more dimensions owned by a
module that is not an embedding, the output head or a router; everything else (embeddings, the head, norms, biases,
routers) goes to AdamW. A parameter of more than two dimensions (a grouped-experts tensor ``(E, d_in, d_out)``) is a
stack of matrices over its leading dimensions, each orthogonalised on its own (``adjust_lr`` from its last two
dimensions). Override the rule with ``is_muon(name, param, module) -> bool``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch import Tensor, nn
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate, Shard
from lightning_par.compat import local_tensor, muon_reference
from lightning_par.optim.registry import OptimizerEntry

__all__ = ["MUON", "MuonAdamW", "MuonOptions", "build_muon", "default_is_muon", "muon_param_groups", "muon_split"]

# torch's Muon (torch.optim._muon, through the register): its Newton-Schulz coefficients, defaults and iteration
_TORCH_MUON = muon_reference()
DEFAULT_A, DEFAULT_B, DEFAULT_C = _TORCH_MUON.a, _TORCH_MUON.b, _TORCH_MUON.c
DEFAULT_NS_STEPS, EPS = _TORCH_MUON.ns_steps, _TORCH_MUON.eps
_zeropower_via_newtonschulz = _TORCH_MUON.zeropower

#: a module whose class name contains one of these keeps its parameters on AdamW.
_ADAMW_MODULE_WORDS = ("embedding", "router", "norm")
#: a parameter whose owning module's attribute name is one of these is the output head or a router: AdamW.
_ADAMW_MODULE_NAMES = ("lm_head", "head", "output", "classifier", "score", "router", "gate", "wte", "wpe")


def default_is_muon(name: str, param: Tensor, module: nn.Module) -> bool:
    """The default split rule: whether the trainable parameter ``name`` (owned by ``module``) takes Muon.

    Muon: 2 or more dimensions, and ``module`` is not an embedding, a norm or a router (by class name), and its
    attribute name is not an output head or a router (``lm_head``, ``head``, ``output``, ``classifier``, ``score``,
    ``router``, ``gate``, ``wte``, ``wpe``). A Llama ``gate_proj`` is a hidden matrix (Muon); a Mixtral/Qwen-MoE
    ``gate`` is a router (AdamW).
    """
    if param.dim() < 2:
        return False
    kind = type(module).__name__.lower()
    if any(word in kind for word in _ADAMW_MODULE_WORDS):
        return False
    parts = name.split(".")
    owner = parts[-2] if len(parts) > 1 else ""
    return owner not in _ADAMW_MODULE_NAMES


def muon_split(
    module: nn.Module, is_muon: Callable[[str, Tensor, nn.Module], bool] | None = None
) -> tuple[list[tuple[str, Tensor]], list[tuple[str, Tensor]]]:
    """``(muon, adamw)``: the trainable named parameters of ``module`` on each side of the split rule.

    ``module.get_output_embeddings()`` (a Hugging Face model's head), when it exists, is always AdamW; a parameter
    shared by several modules (tied embeddings) is decided once, at its first name.
    """
    rule = is_muon or default_is_muon
    head = set()
    for sub in module.modules():
        get = getattr(sub, "get_output_embeddings", None)
        if callable(get):
            try:
                out = get()
            except Exception:  # noqa: BLE001 - a model without a head may raise; then it has none
                out = None
            if isinstance(out, nn.Module):
                head |= {id(p) for p in out.parameters()}
    owners = {name: sub for name, sub in module.named_modules()}
    muon, adamw = [], []
    for name, p in module.named_parameters():
        if not p.requires_grad:
            continue
        owner = owners[name.rsplit(".", 1)[0]] if "." in name else module
        (muon if id(p) not in head and rule(name, p, owner) else adamw).append((name, p))
    return muon, adamw


def muon_param_groups(
    module: nn.Module,
    *,
    is_muon: Callable[[str, Tensor, nn.Module], bool] | None = None,
    adamw_weight_decay: float = 0.0,
    adamw_decay_matrices: bool = True,
) -> list[dict[str, Any]]:
    """Param groups for :class:`MuonAdamW`: one Muon group, and AdamW groups with and without weight decay.

    Args:
        module: the model.
        is_muon: the split rule (default :func:`default_is_muon`).
        adamw_weight_decay: AdamW's decoupled weight decay on its parameters of 2 or more dimensions (embeddings,
            head) when ``adamw_decay_matrices``; vectors (norms, biases) never decay.
        adamw_decay_matrices: decay AdamW's matrices (the recipe GPT's habit) or not.

    Returns:
        Non-empty groups only, each with ``"use_muon"``.
    """
    muon, adamw = muon_split(module, is_muon)
    decay = [p for _, p in adamw if p.dim() >= 2 and adamw_decay_matrices]
    no_decay = [p for _, p in adamw if not (p.dim() >= 2 and adamw_decay_matrices)]
    groups = [
        {"params": [p for _, p in muon], "use_muon": True},
        {"params": decay, "use_muon": False, "weight_decay": adamw_weight_decay},
        {"params": no_decay, "use_muon": False, "weight_decay": 0.0},
    ]
    return [g for g in groups if g["params"]]


def _adjust_lr(lr: float, adjust_lr_fn: str | None, shape: torch.Size) -> float:
    """torch's ``_adjust_lr`` for the matrix ``shape[-2:]`` (torch reads ``shape[:2]``: the same for a matrix)."""
    a, b = shape[-2], shape[-1]
    if adjust_lr_fn is None or adjust_lr_fn == "original":
        return lr * math.sqrt(max(1, a / b))
    if adjust_lr_fn == "match_rms_adamw":
        return lr * 0.2 * math.sqrt(max(a, b))
    return lr


#: the precisions of the Newton-Schulz iteration: torch's (bf16) and fp32.
NS_PRECISIONS = ("bf16", "fp32")


def _newton_schulz_fp32(grad: Tensor, coefficients: tuple[float, float, float], steps: int, eps: float) -> Tensor:
    """torch's ``_zeropower_via_newtonschulz`` loop, step for step, in fp32 instead of bf16.

    Why: bf16 rounds each entry to 8 bits, so two layouts whose reduced gradients differ by one fp32 ulp (a tensor-
    parallel partial sum, a context-parallel gradient summed in another order) can round an entry of the iteration's
    input to neighbouring bf16 values, and the 8-step trajectories then drift apart at ~1e-4 (measured in
    tests/optim/test_muon_distributed.py). In fp32 the same layouts agree at 1e-5: use it to check a layout, bf16 to train.
    """
    a, b, c = coefficients
    ortho = grad.float()
    if grad.size(0) > grad.size(1):
        ortho = ortho.T
    ortho = ortho.div(ortho.norm().clamp(min=eps))
    for _ in range(steps):
        gram = ortho @ ortho.T
        update = torch.addmm(gram, gram, gram, beta=b, alpha=c)
        ortho = torch.addmm(ortho, update, ortho, beta=a)
    if grad.size(0) > grad.size(1):
        ortho = ortho.T
    return ortho


def _orthogonalise(
    update: Tensor, coefficients: tuple[float, float, float], steps: int, eps: float, precision: str = "bf16"
) -> Tensor:
    """torch's Newton-Schulz on a matrix, or on each matrix of a stack ``(..., m, k)`` (bf16: torch's own function;
    fp32: :func:`_newton_schulz_fp32`)."""
    iterate = _zeropower_via_newtonschulz if precision == "bf16" else _newton_schulz_fp32
    if update.dim() == 2:
        return iterate(update, coefficients, steps, eps)
    flat = update.reshape(-1, *update.shape[-2:])
    out = torch.stack([iterate(m, coefficients, steps, eps) for m in flat])
    return out.reshape(update.shape)


class MuonAdamW(torch.optim.Optimizer):
    """Muon on the groups with ``use_muon=True``, torch's AdamW on the others; one optimizer for Lightning.

    Args:
        params: param groups, each with ``"use_muon"`` (:func:`muon_param_groups` builds them), or a module (split by
            :func:`default_is_muon`). A group's own keys override the defaults below.
        lr: Muon's learning rate (torch's default 1e-3; Keller Jordan's 0.02 with ``adjust_lr_fn=None``).
        weight_decay, momentum, nesterov, ns_coefficients, eps, ns_steps, adjust_lr_fn: ``torch.optim.Muon``'s.
        ns_precision: ``"bf16"`` (torch's iteration, the default) or ``"fp32"`` (the same loop in fp32: layouts
            agree at 1e-5 where bf16 rounding makes them drift at ~1e-4; see :func:`_newton_schulz_fp32`).
        adamw_lr, adamw_betas, adamw_eps, adamw_weight_decay: ``torch.optim.AdamW``'s for the AdamW groups
            (a group's ``weight_decay`` wins over ``adamw_weight_decay``).

    Sharded parameters: a DTensor parameter (FSDP2, tensor parallelism) is assembled through its mesh, a plain tensor
    that is one rank's piece of a larger parameter (a ZeRO-1/2 chunk) through the view the engine registers with
    :meth:`set_global_views`: each matrix whole on one owner rank (see the module docstring for the scheme and its
    cost). ``step`` is then collective: every rank holding a piece of a Muon parameter must step.

    Raises:
        ValueError: a Muon parameter with fewer than 2 dimensions, a group without ``"use_muon"``, or an invalid
            hyper-parameter (torch's messages).
    """

    def __init__(
        self,
        params: Iterable[Any] | nn.Module,
        lr: float = 1e-3,
        weight_decay: float = 0.1,
        momentum: float = 0.95,
        nesterov: bool = True,
        ns_coefficients: tuple[float, float, float] = (DEFAULT_A, DEFAULT_B, DEFAULT_C),
        eps: float = EPS,
        ns_steps: int = DEFAULT_NS_STEPS,
        adjust_lr_fn: str | None = None,
        *,
        ns_precision: str = "bf16",
        adamw_lr: float = 1e-3,
        adamw_betas: tuple[float, float] = (0.9, 0.999),
        adamw_eps: float = 1e-8,
        adamw_weight_decay: float = 0.01,
    ) -> None:
        if isinstance(params, nn.Module):
            params = muon_param_groups(params, adamw_weight_decay=adamw_weight_decay)
        groups = [dict(g) for g in params]
        if not groups or not all(isinstance(g, dict) and "use_muon" in g for g in groups):
            raise ValueError(
                "MuonAdamW params must be param groups (dicts) each with 'use_muon': True or False, "
                "e.g. lightning_par.optim.muon_param_groups(module), or a module."
            )
        # torch's own checks and defaults, on both sides.
        torch.optim.Muon([torch.zeros(1, 1)], lr, weight_decay, momentum, nesterov, ns_coefficients, eps, ns_steps,
                         adjust_lr_fn)
        adamw_defaults = torch.optim.AdamW(
            [torch.zeros(1)], lr=adamw_lr, betas=adamw_betas, eps=adamw_eps, weight_decay=adamw_weight_decay
        ).defaults
        muon_defaults = {
            "lr": lr, "weight_decay": weight_decay, "momentum": momentum, "nesterov": nesterov,
            "ns_coefficients": tuple(ns_coefficients), "eps": eps, "ns_steps": ns_steps, "adjust_lr_fn": adjust_lr_fn,
            "ns_precision": ns_precision,
        }
        if ns_precision not in NS_PRECISIONS:
            raise ValueError(f"MuonAdamW ns_precision={ns_precision!r} is not valid: expected one of {NS_PRECISIONS}.")
        for g in groups:
            for key, value in (muon_defaults if g["use_muon"] else adamw_defaults).items():
                g.setdefault(key, value)
        super().__init__(groups, {})
        for g in self.param_groups:
            if g["use_muon"]:
                for p in g["params"]:
                    if p.dim() < 2:
                        raise ValueError(
                            f"MuonAdamW: a Muon group holds a parameter of shape {tuple(p.shape)}: Muon needs 2 or "
                            f"more dimensions (put vectors in a group with use_muon=False)."
                        )
        #: id(tensor the optimizer steps) -> its DTensor of the whole parameter's shape (ZeRO-1/2 chunks).
        self._global_views: dict[int, Callable[[Tensor], DTensor]] = {}
        self._adamw = torch.optim.AdamW([torch.zeros(1)])  # steps this optimizer's AdamW groups (see step)
        #: bytes this rank received for whole matrices in the last step: as an owner, the other pieces of its
        #: matrices (fp32); otherwise, its pieces of the results (bf16); all-gathers ``(n-1)/n`` of each matrix.
        self.gather_bytes_last_step = 0

    def set_global_views(self, views: dict[int, Callable[[Tensor], DTensor]]) -> None:
        """Register, for tensors this optimizer steps that are one rank's piece of a parameter (``id(tensor)``),
        a function mapping a tensor of that piece's shape to a DTensor of the whole parameter (what a ZeRO-1/2 engine
        calls when it re-points the param groups at its chunks)."""
        self._global_views.update(views)

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """One step: Muon on the ``use_muon`` groups, then torch's AdamW on the others.

        Collective when parameters are sharded: every rank holding a piece of a Muon parameter must step.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.gather_bytes_last_step = 0
        self._muon_groups([g for g in self.param_groups if g["use_muon"]])
        adamw_groups = [g for g in self.param_groups if not g["use_muon"]]
        if adamw_groups:
            # torch's AdamW step on these groups and this optimizer's state (shared dicts: nothing is copied).
            self._adamw.param_groups = adamw_groups
            self._adamw.state = self.state
            torch.optim.AdamW.step(self._adamw)
        return loss

    def _muon_groups(self, groups: list[dict[str, Any]]) -> None:
        """Muon on every parameter of ``groups``: momentum on this rank's pieces, the whole matrices orthogonalised
        (owner scheme, all-gather fallback, or locally), each piece updated."""
        mats: list[_Matrix] = []
        for group in groups:
            mu = group["momentum"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                grad = p.grad
                state = self.state[p]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(grad, memory_format=torch.preserve_format)
                buf = state["momentum_buffer"]
                buf.lerp_(grad, 1 - mu)  # torch.optim.Muon's arithmetic, on this rank's piece
                update = grad.lerp(buf, mu) if group["nesterov"] else buf
                spec = update if isinstance(update, DTensor) else self._global_views.get(id(p), lambda u: None)(update)
                mats.append(_Matrix.of(p, group, update, spec))
        # Owners: per process group, each matrix to the member with the least Newton-Schulz work so far.
        by_group: dict[Any, list[_Matrix]] = {}
        for m in mats:
            if m.kind == "owner":
                by_group.setdefault(m.pg, []).append(m)
        for members in by_group.values():
            n = members[0].n
            for m, owner in zip(members, assign_owners([tuple(m.shape[-2:]) for m in members], n,
                                                       [m.batch for m in members])):
                m.owner = owner
        owned = [m for m in mats if m.kind == "owner"]
        # 1. every piece to its matrix's owner (launched together, then waited for)
        works = [m.launch_gather() for m in owned]
        for w in works:
            w.wait()
        # 2. orthogonalise: owned matrices on their owner, the fallbacks and local matrices here
        for m in mats:
            g = m.group
            args = (g["ns_coefficients"], g["ns_steps"], g["eps"], g.get("ns_precision", "bf16"))
            if m.kind == "owner":
                if m.owner == m.me:
                    m.ortho_whole = _orthogonalise(m.assemble(), *args)
            elif m.kind == "gather":
                whole = m.spec.full_tensor()
                self.gather_bytes_last_step += (whole.numel() - m.local.numel()) * whole.element_size()
                m.ortho = m.piece_of(_orthogonalise(whole, *args))
            else:
                m.ortho = _orthogonalise(m.local, *args)
        # 3. each owner's result back to the pieces
        works = [m.launch_scatter() for m in owned]
        for w in works:
            w.wait()
        for m in owned:
            m.finish_scatter()
            self.gather_bytes_last_step += m.received_bytes
        # 4. torch's update on this rank's piece
        for m in mats:
            g = m.group
            lr, wd = g["lr"], g["weight_decay"]
            adjusted = _adjust_lr(lr, g["adjust_lr_fn"], m.shape)
            target = local_tensor(m.p)
            target.mul_(1 - lr * wd)
            target.add_(m.ortho, alpha=-adjusted)


def newton_schulz_flops(shape: tuple[int, int], ns_steps: int = DEFAULT_NS_STEPS) -> float:
    """Flops of torch's Newton-Schulz iteration on an ``m x k`` matrix: ``ns_steps * 2 (2 p^2 q + p^3)`` with
    ``p = min(m, k)``, ``q = max(m, k)`` (Gram matrix, its square, the product with the matrix)."""
    p, q = min(shape), max(shape)
    return ns_steps * 2.0 * (2 * p * p * q + p**3)


def assign_owners(shapes: list[tuple[int, int]], n: int, batch: list[int] | None = None) -> list[int]:
    """The owner (a member index in ``[0, n)``) of each matrix: in order, the member with the least Newton-Schulz
    flops so far (the lowest index on ties); ``batch[i]`` matrices of ``shapes[i]`` (an expert stack) count as one
    item. Deterministic: every rank computes the same assignment."""
    load = [0.0] * n
    out = []
    for i, shape in enumerate(shapes):
        owner = min(range(n), key=lambda r: (load[r], r))
        load[owner] += newton_schulz_flops(shape) * (batch[i] if batch else 1)
        out.append(owner)
    return out


def _chunk_sizes(size: int, n: int) -> list[int]:
    """``torch.chunk``'s (and ``Shard``'s) piece sizes of a dimension of ``size`` over ``n`` ranks."""
    chunk = -(-size // n)
    return [max(0, min(chunk, size - i * chunk)) for i in range(n)]


class _Matrix:
    """One Muon parameter in one step: this rank's piece of its update and how its whole matrix is formed.

    ``kind``: ``"local"`` (held whole), ``"owner"`` (split along one tensor dim over one mesh dim: gathered to an
    owner, orthogonalised there, scattered back) or ``"gather"`` (any other split, e.g. FSDP + TP's two mesh dims:
    all-gathered and orthogonalised on every rank).
    """

    def __init__(self, p: Tensor, group: dict[str, Any], local: Tensor, shape: torch.Size) -> None:
        self.p, self.group, self.local, self.shape = p, group, local, shape
        self.batch = math.prod(shape[:-2]) if len(shape) > 2 else 1
        self.kind = "local"
        self.spec: DTensor | None = None
        self.ortho: Tensor | None = None
        self.ortho_whole: Tensor | None = None
        self.received_bytes = 0

    @classmethod
    def of(cls, p: Tensor, group: dict[str, Any], update: Tensor, spec: DTensor | None) -> "_Matrix":
        if spec is None:
            return cls(p, group, update, update.shape)
        local = update.to_local() if isinstance(update, DTensor) else update
        m = cls(p, group, local, spec.shape)
        mesh, placements = spec.device_mesh, spec.placements
        split = [(i, pl) for i, pl in enumerate(placements) if not pl.is_replicate() and mesh.size(i) > 1]
        matrix_dims = (spec.ndim - 2, spec.ndim - 1)
        if all(pl.is_shard() and pl.dim not in matrix_dims for _, pl in split):
            return m  # split only along a stack's leading dim (experts): every matrix is whole here
        m.spec = spec
        m.kind = "gather"
        if len(split) == 1 and type(split[0][1]) is Shard:
            mesh_dim, pl = split[0]
            n = mesh.size(mesh_dim)
            sizes = _chunk_sizes(spec.shape[pl.dim], n)
            me = mesh.get_local_rank(mesh_dim)
            if sizes[me] == local.shape[pl.dim]:
                m.kind, m.pg, m.dim, m.n, m.me, m.sizes = "owner", mesh.get_group(mesh_dim), pl.dim, n, me, sizes
        return m

    def piece_of(self, whole: Tensor) -> Tensor:
        """This rank's piece of a whole matrix (a local slice, by the spec's placements)."""
        mesh = self.spec.device_mesh
        replicated = DTensor.from_local(whole, mesh, [Replicate()] * mesh.ndim, run_check=False)
        return replicated.redistribute(mesh, self.spec.placements).to_local()

    def _padded_shape(self) -> list[int]:
        shape = list(self.local.shape)
        shape[self.dim] = self.sizes[0]
        return shape

    def _pad(self, t: Tensor) -> Tensor:
        if t.shape[self.dim] == self.sizes[0]:
            return t.contiguous()
        out = t.new_zeros(self._padded_shape())
        out.narrow(self.dim, 0, t.shape[self.dim]).copy_(t)
        return out

    def launch_gather(self) -> Any:
        owner = dist.get_global_rank(self.pg, self.owner)
        self.gathered = [self.local.new_empty(self._padded_shape()) for _ in range(self.n)] if self.owner == self.me \
            else None
        if self.owner == self.me:
            self.received_bytes += (self.n - 1) * self.gathered[0].numel() * self.gathered[0].element_size()
        return dist.gather(self._pad(self.local), self.gathered, dst=owner, group=self.pg, async_op=True)

    def assemble(self) -> Tensor:
        parts = [t.narrow(self.dim, 0, size) for t, size in zip(self.gathered, self.sizes)]
        self.gathered = None
        return torch.cat(parts, dim=self.dim)

    def launch_scatter(self) -> Any:
        owner = dist.get_global_rank(self.pg, self.owner)
        dtype = torch.bfloat16 if self.group.get("ns_precision", "bf16") == "bf16" else torch.float32
        self.received = self.local.new_empty(self._padded_shape(), dtype=dtype)
        pieces = None
        if self.owner == self.me:
            whole = self.ortho_whole
            pieces, start = [], 0
            for size in self.sizes:
                pieces.append(self._pad(whole.narrow(self.dim, start, size)))
                start += size
            self.ortho_whole = None
        else:
            self.received_bytes += self.received.numel() * self.received.element_size()
        return dist.scatter(self.received, pieces, src=owner, group=self.pg, async_op=True)

    def finish_scatter(self) -> None:
        self.ortho = self.received.narrow(self.dim, 0, self.sizes[self.me])
        self.received = None


@dataclass(frozen=True)
class MuonOptions:
    """Muon's hyper-parameters as a module or a recipe gives them (``muon_lr``, ``model.muon_lr``, ...): their one
    declaration, read by :data:`MUON` (:mod:`lightning_par.optim.registry`).

    Attributes:
        lr: Muon's learning rate (before ``adjust_lr_fn``'s shape factor; Keller Jordan's 0.02), scheduled like the
            module's own rate.
        weight_decay: Muon's decoupled weight decay; ``None`` takes the module's ``weight_decay``.
        momentum: Muon's (Nesterov) momentum.
        adjust_lr_fn: ``torch.optim.Muon``'s ``adjust_lr_fn``: ``None``/``"original"`` or ``"match_rms_adamw"``.
        ns_precision: ``"bf16"`` (torch's Newton-Schulz) or ``"fp32"`` (layouts agree at 1e-5: docs/muon.md).

    Raises:
        ValueError: an invalid value, named by its keyword (``muon_lr=-1.0 is not valid: expected ...``).
    """

    lr: float = 0.02
    weight_decay: Optional[float] = None
    momentum: float = 0.95
    adjust_lr_fn: Optional[str] = None
    ns_precision: str = "bf16"

    def __post_init__(self) -> None:
        def check(name: str, ok: bool, valid: str) -> None:
            if not ok:
                raise ValueError(f"muon_{name}={getattr(self, name)!r} is not valid: expected {valid}.")

        number = (int, float)
        check("lr", isinstance(self.lr, number) and not isinstance(self.lr, bool) and self.lr > 0, "a positive float")
        check("weight_decay", self.weight_decay is None or (isinstance(self.weight_decay, number)
                                                           and self.weight_decay >= 0), "None or a float >= 0")
        check("momentum", isinstance(self.momentum, number) and 0 <= self.momentum < 1, "a float in [0, 1)")
        check("adjust_lr_fn", self.adjust_lr_fn in (None, "original", "match_rms_adamw"),
              "None, 'original' or 'match_rms_adamw'")
        check("ns_precision", self.ns_precision in NS_PRECISIONS, "'bf16' or 'fp32'")


def build_muon(module: nn.Module, options: MuonOptions, base: Any) -> MuonAdamW:
    """:class:`MuonAdamW` over ``module`` split by :func:`default_is_muon`: Muon with ``options``, AdamW with the
    module's own settings ``base`` (:class:`lightning_par.optim.registry.BaseHParams`)."""
    return MuonAdamW(
        muon_param_groups(module, adamw_weight_decay=base.weight_decay),
        lr=options.lr,
        weight_decay=base.weight_decay if options.weight_decay is None else options.weight_decay,
        momentum=options.momentum,
        adjust_lr_fn=options.adjust_lr_fn,
        ns_precision=options.ns_precision,
        adamw_lr=base.learning_rate,
        adamw_betas=tuple(base.betas),
        adamw_eps=base.eps,
        adamw_weight_decay=base.weight_decay,
    )


#: Muon's entry in :data:`lightning_par.optim.registry.OPTIMIZERS` (``optimizer="muon"``).
MUON = OptimizerEntry("muon", MuonOptions, build_muon)
