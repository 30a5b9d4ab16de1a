"""Users' models that are not the reference GPT, written as a user would: a LightningModule holding an ``nn.Sequential``
network at ``.model``, with its own tensor-parallel plan (``tp_plan()``, paths relative to the network) and its own
loss; nothing from ``lightning_par.models``.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
from torch import nn


class Block(nn.Module):
    """Pre-norm residual MLP: ``x + fc2(gelu(fc1(norm(x))))`` on ``(batch, width)``."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.fc1 = nn.Linear(width, 4 * width)
        self.fc2 = nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(F.gelu(self.fc1(self.norm(x))))


class ResidualMLP(L.LightningModule):
    """Regression ``(batch, d_in) -> (batch, d_out)``: input projection, ``depth`` residual blocks, head.

    Args:
        optimizer: ``"sgd"`` (SGD with momentum 0.9: a gradient summed instead of averaged moves it twice as far) or
            ``"adamw"``.
    """

    def __init__(self, d_in: int = 8, width: int = 16, depth: int = 3, d_out: int = 4, optimizer: str = "sgd",
                 lr: float = 0.05) -> None:
        super().__init__()
        self.save_hyperparameters()
        layers: list[tuple[str, nn.Module]] = [("0", nn.Linear(d_in, width))]
        layers += [(str(i + 1), Block(width)) for i in range(depth)]
        layers.append((str(depth + 1), nn.Linear(width, d_out)))
        self.model = nn.Sequential(OrderedDict(layers))

    def tp_plan(self) -> dict[str, str]:
        """Megatron's MLP split in every block; the projections and norms replicated."""
        depth = self.hparams.depth
        plan = {"0": "replicate", str(depth + 1): "replicate"}
        for i in range(1, depth + 1):
            plan |= {f"{i}.norm": "replicate", f"{i}.fc1": "colwise", f"{i}.fc2": "rowwise"}
        return plan

    @staticmethod
    def loss_fn(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(outputs, targets)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = self.loss_fn(self.model(x), y)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = self.loss_fn(self.model(x), y)
        self.log("val_loss", loss, sync_dist=True)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        if self.hparams.optimizer == "sgd":
            return torch.optim.SGD(self.parameters(), lr=self.hparams.lr, momentum=0.9)
        if self.hparams.optimizer in ("muon", "muon32", "torchmuon"):  # Muon on the matrices, AdamW on the rest
            return muon_optimizer(self, torch_reference=self.hparams.optimizer == "torchmuon",
                                  ns_precision="fp32" if self.hparams.optimizer == "muon32" else "bf16")
        return torch.optim.AdamW(self.parameters(), lr=self.hparams.lr / 10, eps=1e-5)


#: the Muon and AdamW hyper-parameters of the user models' ``"muon"`` optimizer (AdamW's eps as the AdamW runs').
MUON_HPARAMS = dict(lr=0.02, weight_decay=0.1, momentum=0.95)
MUON_ADAMW_HPARAMS = dict(lr=5e-3, betas=(0.9, 0.95), eps=1e-5, weight_decay=0.01)


class TorchMuonAndAdamW:
    """The one-process reference: ``torch.optim.Muon`` on the Muon side of the split, ``torch.optim.AdamW`` on the
    rest, stepped together (what a user writes by hand in one process)."""

    def __init__(self, module: nn.Module) -> None:
        from lightning_par.optim import muon_param_groups

        groups = muon_param_groups(module, adamw_weight_decay=MUON_ADAMW_HPARAMS["weight_decay"])
        adamw = MUON_ADAMW_HPARAMS
        self.muon = torch.optim.Muon([p for g in groups if g["use_muon"] for p in g["params"]], **MUON_HPARAMS)
        self.adamw = torch.optim.AdamW(
            [{"params": g["params"], "weight_decay": g["weight_decay"]} for g in groups if not g["use_muon"]],
            lr=adamw["lr"], betas=adamw["betas"], eps=adamw["eps"],
        )
        self.param_groups = self.muon.param_groups + self.adamw.param_groups

    @classmethod
    def like(cls, optimizer: Any) -> "TorchMuonAndAdamW":
        """torch's two optimizers over the groups of a :class:`~lightning_par.optim.MuonAdamW`, with its
        hyper-parameters."""
        out = cls.__new__(cls)
        muon_keys = ("lr", "weight_decay", "momentum", "nesterov", "ns_coefficients", "eps", "ns_steps",
                     "adjust_lr_fn")
        adamw_keys = ("lr", "betas", "eps", "weight_decay")
        muon = [g for g in optimizer.param_groups if g["use_muon"]]
        adamw = [g for g in optimizer.param_groups if not g["use_muon"]]
        out.muon = torch.optim.Muon([{"params": list(g["params"]), **{k: g[k] for k in muon_keys}} for g in muon])
        out.adamw = torch.optim.AdamW([{"params": list(g["params"]), **{k: g[k] for k in adamw_keys}} for g in adamw])
        out.param_groups = out.muon.param_groups + out.adamw.param_groups
        return out

    def step(self) -> None:
        self.muon.step()
        self.adamw.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.muon.zero_grad(set_to_none)
        self.adamw.zero_grad(set_to_none)


def muon_optimizer(module: nn.Module, torch_reference: bool = False, ns_precision: str = "bf16") -> Any:
    """lightning_par's :class:`~lightning_par.optim.MuonAdamW` over ``module`` with :data:`MUON_HPARAMS`, or (with
    ``torch_reference``) torch's two optimizers doing the same in one process."""
    if torch_reference:
        return TorchMuonAndAdamW(module)
    from lightning_par.optim import MuonAdamW, muon_param_groups

    adamw = MUON_ADAMW_HPARAMS
    return MuonAdamW(
        muon_param_groups(module, adamw_weight_decay=adamw["weight_decay"]), **MUON_HPARAMS,
        adamw_lr=adamw["lr"], adamw_betas=adamw["betas"], adamw_eps=adamw["eps"],
        adamw_weight_decay=adamw["weight_decay"], ns_precision=ns_precision,
    )


def make_mlp(optimizer: str = "sgd", depth: int = 3) -> ResidualMLP:
    """Seeded: every rank and the reference build the same initial model."""
    torch.manual_seed(0)
    return ResidualMLP(optimizer=optimizer, depth=depth)


# ---------------------------------------------------------------------------------------------------- two streams
class TwoStreamLayer(nn.Module):
    """A layer on a pair of streams ``(h, s)``, each ``(batch, width)``: ``h += tanh(lin(h))``, then ``s += h``."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.lin = nn.Linear(width, width)

    def forward(self, h: torch.Tensor, s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = h + torch.tanh(self.lin(h))
        return h, s + h


class _TwoStreamStage(nn.Module):
    """Some layers of a :class:`TwoStreamNet` (the input projection when first, the head when last), under the
    network's own attribute names."""

    def __init__(self, net: TwoStreamNet, layers: list[str], first: bool, last: bool) -> None:
        super().__init__()
        self.inp = net.inp if first else None
        self.layers = nn.ModuleDict({k.split(".", 1)[1]: net.layers[k.split(".", 1)[1]] for k in layers})
        self.head = net.head if last else None

    def forward(self, *args: torch.Tensor) -> Any:
        if self.inp is not None:
            x, mask = args
            h = self.inp(x) * mask
            s = torch.zeros_like(h)
        else:
            h, s = args
        for layer in self.layers.values():
            h, s = layer(h, s)
        return self.head(torch.cat([h, s], dim=-1)) if self.head is not None else (h, s)


class TwoStreamNet(nn.Module):
    """A network whose first stage takes two inputs ``(x, mask)`` and whose stages pass a tuple ``(h, s)``; it tells
    the pipeline where it may be cut (``pipeline_layers``) and how to build a stage (``pipeline_stage``)."""

    def __init__(self, d_in: int = 8, width: int = 16, depth: int = 4, d_out: int = 4) -> None:
        super().__init__()
        self.inp = nn.Linear(d_in, width)
        self.layers = nn.ModuleDict({str(i): TwoStreamLayer(width) for i in range(depth)})
        self.head = nn.Linear(2 * width, d_out)

    def pipeline_layers(self) -> list[str]:
        return [f"layers.{k}" for k in self.layers]

    def pipeline_stage(self, layers: list[str], *, first: bool, last: bool) -> nn.Module:
        return _TwoStreamStage(self, layers, first, last)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return _TwoStreamStage(self, self.pipeline_layers(), True, True)(x, mask)


class TwoStreamModule(L.LightningModule):
    """Batches are dicts ``{"x", "mask", "y"}``, mapped for the pipeline by ``pipeline_batch``; the loss reads a dict of
    targets (``pipeline_loss``)."""

    def __init__(self, build: bool = True) -> None:
        super().__init__()
        if build:  # else configure_model builds it
            self.model = TwoStreamNet()

    @staticmethod
    def pipeline_batch(batch: dict[str, torch.Tensor]) -> tuple[tuple[torch.Tensor, ...], dict[str, torch.Tensor]]:
        return (batch["x"], batch["mask"]), {"y": batch["y"]}

    @staticmethod
    def pipeline_loss(outputs: torch.Tensor, targets: dict[str, torch.Tensor]) -> torch.Tensor:
        return F.mse_loss(outputs, targets["y"])

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        inputs, targets = self.pipeline_batch(batch)
        return self.pipeline_loss(self.model(*inputs), targets)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)


class DictDataset(torch.utils.data.Dataset):
    """``n`` fixed ``{"x": (8,), "mask": (16,) of 0/1, "y": (4,)}`` samples."""

    def __init__(self, n: int = 64, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.x, self.y = torch.randn(n, 8, generator=g), torch.randn(n, 4, generator=g)
        self.mask = (torch.rand(n, 16, generator=g) > 0.2).float()

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"x": self.x[i], "mask": self.mask[i], "y": self.y[i]}


# ---------------------------------------------------------------------------------------------------- attention
class Attention(nn.Module):
    """Causal self-attention without biases through ``F.scaled_dot_product_attention``:
    ``(batch, seq, width) -> (batch, seq, width)``. Under tensor parallelism ``q``/``k``/``v`` are column shards and
    ``o`` a row shard; the local head count follows from the local width."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.head_dim = width // heads
        self.q, self.k, self.v = (nn.Linear(width, width, bias=False) for _ in range(3))
        self.o = nn.Linear(width, width, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q, k, v = (t.view(b, s, -1, self.head_dim).transpose(1, 2) for t in (self.q(x), self.k(x), self.v(x)))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (b, local heads, s, head_dim)
        return self.o(y.transpose(1, 2).reshape(b, s, -1))


class Layer(nn.Module):
    """Post-norm residual layer: ``norm1(x + attn(x))``, then ``norm2(h + down(relu(up(h))))``."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.attn = Attention(width, heads)
        self.norm1 = nn.LayerNorm(width)
        self.up = nn.Linear(width, 2 * width)
        self.down = nn.Linear(2 * width, width)
        self.norm2 = nn.LayerNorm(width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm1(x + self.attn(x))
        return self.norm2(h + self.down(F.relu(self.up(h))))


class AttentionNet(nn.Module):
    """A user's causal LM network: token embedding plus learned positions read from ``position_ids``, post-norm
    layers in a ``ModuleDict``, a head. Speaks the model contract itself: ``tp_plan()``, ``pipeline_layers()`` /
    ``pipeline_stage()``, ``attention_heads()``."""

    def __init__(self, vocab: int = 256, width: int = 32, heads: int = 4, depth: int = 2, max_len: int = 32) -> None:
        super().__init__()
        self.heads = heads
        self.embed: nn.Module | None = nn.Embedding(vocab, width)
        self.pos: nn.Module | None = nn.Embedding(max_len, width)
        self.layers = nn.ModuleDict({str(i): Layer(width, heads) for i in range(depth)})
        self.head: nn.Module | None = nn.Linear(width, vocab)

    def attention_heads(self) -> int:
        return self.heads

    def tp_plan(self) -> dict[str, str]:
        plan = {"embed": "replicate", "pos": "replicate", "head": "replicate"}
        for i in self.layers:
            plan |= {f"layers.{i}.attn.{p}": "colwise" for p in ("q", "k", "v")}
            plan |= {f"layers.{i}.attn.o": "rowwise", f"layers.{i}.up": "colwise", f"layers.{i}.down": "rowwise"}
        return plan

    def pipeline_layers(self) -> list[str]:
        return [f"layers.{i}" for i in self.layers]

    def pipeline_stage(self, layers: list[str], *, first: bool, last: bool) -> AttentionNet:
        view = AttentionNet.__new__(AttentionNet)
        nn.Module.__init__(view)
        view.heads = self.heads
        view.embed, view.pos = (self.embed, self.pos) if first else (None, None)
        view.layers = nn.ModuleDict({name.split(".")[1]: self.layers[name.split(".")[1]] for name in layers})
        view.head = self.head if last else None
        return view

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor | None = None) -> torch.Tensor:
        if self.embed is not None:
            if position_ids is None:
                position_ids = torch.arange(x.shape[1], device=x.device)
            x = self.embed(x) + self.pos(position_ids)
        for layer in self.layers.values():
            x = layer(x)
        return self.head(x) if self.head is not None else x


class AttentionLM(L.LightningModule):
    """A user's causal language model (not the GPT): batches ``(x, y)``, or ``(x, y, position_ids)`` under context
    parallelism (``pipeline_batch`` then hands the positions to the first stage); SGD with momentum or AdamW."""

    def __init__(self, optimizer: str = "sgd") -> None:
        super().__init__()
        self.optimizer_name = optimizer
        self.model = AttentionNet()

    @staticmethod
    def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1))

    def pipeline_batch(self, batch: Any) -> tuple[Any, torch.Tensor]:
        x, y, *positions = batch
        return ((x, positions[0].expand(x.shape[0], -1).contiguous()) if positions else x), y

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y, *positions = batch
        return self.loss_fn(self.model(x, *positions), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        if self.optimizer_name == "adamw":
            return torch.optim.AdamW(self.parameters(), lr=3e-3, eps=1e-6)
        if self.optimizer_name in ("muon", "muon32"):  # Muon on the matrices, AdamW on the rest
            return muon_optimizer(self, ns_precision="fp32" if self.optimizer_name == "muon32" else "bf16")
        return torch.optim.SGD(self.parameters(), lr=0.3, momentum=0.9)


def make_attention_lm(optimizer: str = "sgd") -> AttentionLM:
    """Seeded: every rank and the reference build the same initial model."""
    torch.manual_seed(0)
    return AttentionLM(optimizer)


# ---------------------------------------------------------------------------------------------------- mixture of experts
class UserExperts(nn.Module):
    """A user's experts (the expert contract of :mod:`lightning_par.contract`): ``E`` ReLU MLPs with biases, stacked on
    dim 0, run on tokens sorted by expert."""

    def __init__(self, num_experts: int, width: int, hidden: int) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(1)
        self.up = nn.Parameter(torch.randn(num_experts, width, hidden, generator=g) * 0.1)
        self.up_bias = nn.Parameter(torch.zeros(num_experts, hidden))
        self.down = nn.Parameter(torch.randn(num_experts, hidden, width, generator=g) * 0.1)

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        from torch.distributed.tensor import DTensor

        up, bias, down = (w.to_local() if isinstance(w, DTensor) else w for w in (self.up, self.up_bias, self.down))
        chunks = x.split(counts.tolist())
        return torch.cat([F.relu(c @ up[e] + bias[e]) @ down[e] for e, c in enumerate(chunks)])


class UserMoE(nn.Module):
    """A user's top-1 (Switch) mixture of experts with its own router and a per-sequence load-balancing loss."""

    def __init__(self, width: int, num_experts: int = 4, hidden: int = 48) -> None:
        super().__init__()
        self.router = nn.Linear(width, num_experts, bias=False)
        self.experts = UserExperts(num_experts, width, hidden)
        self.num_experts = num_experts

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        from lightning_par.aux_loss import attach_aux_loss

        b, s, d = h.shape
        probs = self.router(h).softmax(-1)
        weight, expert = probs.max(-1)  # (b, s)
        share = F.one_hot(expert, self.num_experts).float().mean(1)  # per sequence (no cp here)
        aux = self.num_experts * (share * probs.mean(1)).sum(-1).mean()
        expert, weight = expert.reshape(-1), weight.reshape(-1)
        order = torch.argsort(expert, stable=True)
        out = self.experts(h.reshape(-1, d)[order], torch.bincount(expert, minlength=self.num_experts))
        out = out * weight[order, None]  # bf16 under autocast: accumulate in its dtype
        y = torch.zeros(b * s, d, dtype=out.dtype, device=out.device).index_add_(0, order, out).reshape(b, s, d)
        return attach_aux_loss(y, 0.01 * aux)


class MoELayer(nn.Module):
    """Post-norm residual layer with a mixture of experts in place of the MLP."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.attn = Attention(width, heads)
        self.norm1 = nn.LayerNorm(width)
        self.moe = UserMoE(width)
        self.norm2 = nn.LayerNorm(width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm1(x + self.attn(x))
        return self.norm2(h + self.moe(h))


class MoENet(AttentionNet):
    """:class:`AttentionNet` with :class:`MoELayer` layers; names its experts (``expert_modules()``) and keeps
    routers and experts whole on every tp rank."""

    def __init__(self, depth: int = 2, width: int = 32, heads: int = 4) -> None:
        super().__init__(width=width, heads=heads, depth=depth)
        self.layers = nn.ModuleDict({str(i): MoELayer(width, heads) for i in range(depth)})

    def tp_plan(self) -> dict[str, str]:
        plan = {"embed": "replicate", "pos": "replicate", "head": "replicate"}
        for i in self.layers:
            plan |= {f"layers.{i}.attn.{p}": "colwise" for p in ("q", "k", "v")}
            plan |= {f"layers.{i}.attn.o": "rowwise", f"layers.{i}.moe": "replicate"}
        return plan

    def expert_modules(self) -> list[str]:
        return [f"layers.{i}.moe.experts" for i in self.layers]


class MoELM(AttentionLM):
    """A user's causal LM with mixture-of-experts layers (not the GPT)."""

    def __init__(self, optimizer: str = "sgd") -> None:
        super().__init__(optimizer)
        self.model = MoENet()


def make_moe_lm(optimizer: str = "sgd") -> MoELM:
    """Seeded: every rank and the reference build the same initial model."""
    torch.manual_seed(0)
    return MoELM(optimizer)

class ConvBlock(nn.Module):
    """``relu(bn(conv(x)))`` on ``(batch, c_in, h, w)`` -> ``(batch, c_out, h, w)``: BatchNorm keeps running statistics
    (buffers) that each replica updates from its own batch."""

    def __init__(self, c_in: int, c_out: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(c_in, c_out, 3, padding=1)
        self.bn = nn.BatchNorm2d(c_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(self.bn(self.conv(x)))


class Head(nn.Module):
    """Global average pool, BatchNorm1d, then a linear classifier: ``(batch, c, h, w)`` -> ``(batch, classes)``."""

    def __init__(self, c: int, classes: int) -> None:
        super().__init__()
        self.bn = nn.BatchNorm1d(c)
        self.fc = nn.Linear(c, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.bn(x.mean(dim=(2, 3))))


class TinyBNNet(L.LightningModule):
    """A small CNN with BatchNorm (the buffers torch DDP broadcasts before each forward), as a user writes one in place
    of a torchvision ResNet: images ``(batch, 3, 8, 8)`` -> ``classes`` logits, cross-entropy, SGD with momentum.

    Its network at ``.model`` is an ``nn.Sequential`` of blocks (pipeline stages split it); its tp plan replicates
    every block (a CNN has no Megatron split), so a dp x tp x pp layout runs it too.
    """

    def __init__(self, width: int = 8, classes: int = 4, lr: float = 0.1) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.model = nn.Sequential(
            OrderedDict([("0", ConvBlock(3, width)), ("1", ConvBlock(width, width)), ("2", Head(width, classes))])
        )

    def tp_plan(self) -> dict[str, str]:
        return {"0": "replicate", "1": "replicate", "2": "replicate"}

    @staticmethod
    def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits, targets)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return self.loss_fn(self.model(x), y)

    def validation_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = self.loss_fn(self.model(x), y)
        self.log("val_loss", loss, sync_dist=True)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.hparams.lr, momentum=0.9)


class ImageDataset(torch.utils.data.Dataset):
    """``n`` fixed random images ``(3, 8, 8)`` with labels in ``[0, classes)``; rank-dependent shards come from the
    sampler. The images of one sample index are shifted by ``index % 3`` so replicas' batch statistics differ."""

    def __init__(self, n: int = 64, classes: int = 4, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randn(n, 3, 8, 8, generator=g) + (torch.arange(n) % 3).view(n, 1, 1, 1)
        self.y = torch.randint(0, classes, (n,), generator=g)

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[i], self.y[i]
