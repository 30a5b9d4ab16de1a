"""Test machinery for tensor parallelism: a user model with its own plan, and per-layer checks run on gloo ranks."""

from __future__ import annotations

import os
from typing import Any

import lightning as L
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from lightning_par.models import GPT, GPTConfig
from lightning_par.models.gpt_tp_plan import gpt_tp_plan
from lightning_par.tensor_parallel import (
    CommVolume,
    apply_tensor_parallel,
    megatron_layer_comm_bytes,
    resolve_style,
    strip_vocab_padding,
    sync_tp_partial_grads,
    vocab_parallel_loss,
)
from lightning_par.tensor_parallel.state_dict import unpad_vocab_state


class ToyLM(L.LightningModule):
    """A model that is not our GPT: embedding, one pre-norm feed-forward residual block, norm, untied head.

    Its vocabulary (37 by default) is odd, so every tp size > 1 pads it.
    """

    PLAN = {
        "embed": "vocab_embedding",
        "norm": "sequence_parallel",
        "ffn": "colwise_input",
        "ffn.0": "colwise",
        "ffn.2": "rowwise",
        "out_norm": "sequence_parallel",
        "head": "vocab_head",
    }

    def __init__(self, vocab: int = 37, d: int = 16, learning_rate: float = 3e-3) -> None:
        super().__init__()
        self.learning_rate = learning_rate
        self.embed = nn.Embedding(vocab, d)
        self.norm = nn.LayerNorm(d)
        self.ffn = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))
        self.out_norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)  # (batch, seq, d), or (batch, seq / tp, d) with sequence parallelism
        h = h + self.ffn(self.norm(h))
        return self.head(self.out_norm(h))

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        logits = self(x)
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.learning_rate, eps=1e-5)  # see test_tensor_parallel


def unpadded_state(module: nn.Module, strategy: Any) -> dict[str, torch.Tensor]:
    """``state_fn`` for ``run_fit``: gathered parameters with the vocabulary padding removed."""
    return strip_vocab_padding(module, {n: p.full_tensor() if hasattr(p, "full_tensor") else p.detach()
                                        for n, p in module.named_parameters()})


# ---------------------------------------------------------------------------------------------- layer checks
def _err(a: torch.Tensor, b: torch.Tensor) -> float:
    """Largest absolute difference relative to the largest magnitude of ``b`` (0 when equal)."""
    return float((a.detach() - b.detach()).abs().max() / b.detach().abs().max().clamp_min(1e-30))


def _chunk(t: torch.Tensor, dim: int, mesh: Any) -> torch.Tensor:
    return t.chunk(mesh.size(), dim=dim)[mesh.get_local_rank()]


def _linear_case(style: str, sp: bool, mesh: Any, seed: int) -> dict[str, float]:
    torch.manual_seed(seed)
    ref = nn.Linear(8, 12) if style == "colwise" else nn.Linear(12, 8)
    par = nn.Linear(ref.in_features, ref.out_features)
    par.load_state_dict(ref.state_dict())
    x = torch.randn(2, 4, ref.in_features, requires_grad=True)
    g = torch.randn(2, 4, ref.out_features)
    (ref(x) * g).sum().backward()
    y_ref = ref(x).detach()
    from torch.distributed.tensor.parallel import parallelize_module

    parallelize_module(par, mesh, resolve_style(style, sp), src_data_rank=None)
    if style == "colwise":
        xp = x.detach().clone().requires_grad_(True)  # replicated input
        out = par(xp)  # (2, 4, 12 / tp)
        (out * _chunk(g, -1, mesh)).sum().backward()
        return {
            "out": _err(out, _chunk(y_ref, -1, mesh)),
            "input_grad": _err(xp.grad, x.grad),  # all-reduced in backward
            "weight_grad": _err(par.weight.grad.to_local(), _chunk(ref.weight.grad, 0, mesh)),
            "bias_grad": _err(par.bias.grad.to_local(), _chunk(ref.bias.grad, 0, mesh)),
        }
    xp = _chunk(x.detach(), -1, mesh).clone().requires_grad_(True)  # input sharded on features
    out = par(xp)  # (2, 4, 8) all-reduced, or (2, 4 / tp, 8) reduce-scattered with sequence parallelism
    expected, upstream = (_chunk(y_ref, 1, mesh), _chunk(g, 1, mesh)) if sp else (y_ref, g)
    (out * upstream).sum().backward()
    bias_grad = par.bias.grad.full_tensor()
    return {
        "out": _err(out, expected),
        "input_grad": _err(xp.grad, _chunk(x.grad, -1, mesh)),
        "weight_grad": _err(par.weight.grad.to_local(), _chunk(ref.weight.grad, 1, mesh)),
        "bias_grad": _err(bias_grad, ref.bias.grad),
    }


def _embedding_case(vocab: int, sp: bool, mesh: Any, seed: int) -> dict[str, float]:
    torch.manual_seed(seed)
    ref = nn.Embedding(vocab, 8)
    par = nn.Embedding(vocab, 8)
    par.load_state_dict(ref.state_dict())
    ids = torch.randint(0, vocab, (3, 4))
    ids[0, :2] = vocab - 1  # the last real id sits next to the padding
    g = torch.randn(3, 4, 8)
    (ref(ids) * g).sum().backward()
    from torch.distributed.tensor.parallel import parallelize_module

    parallelize_module(par, mesh, resolve_style("vocab_embedding", sp), src_data_rank=None)
    out = par(ids)
    expected, upstream = (_chunk(ref(ids).detach(), 1, mesh), _chunk(g, 1, mesh)) if sp else (ref(ids).detach(), g)
    (out * upstream).sum().backward()
    full_grad = par.weight.grad.full_tensor()
    return {
        "out": _err(out, expected),
        "weight_grad": _err(full_grad[:vocab], ref.weight.grad),
        "padding_grad": float(full_grad[vocab:].abs().sum()) if full_grad.shape[0] > vocab else 0.0,
        "grad_is_shard": float(par.weight.grad.to_local().shape[0] * mesh.size() != full_grad.shape[0]),
        "padded_rows": float(par.weight.shape[0] - vocab),
    }


def _head_loss_case(vocab: int, sp: bool, mesh: Any, seed: int) -> dict[str, float]:
    torch.manual_seed(seed)
    ref = nn.Linear(8, vocab, bias=False)
    par = nn.Linear(8, vocab, bias=False)
    par.load_state_dict(ref.state_dict())
    x = torch.randn(3, 4, 8, requires_grad=True)
    y = torch.randint(0, vocab, (3, 4))
    y[0, 0] = vocab - 1
    ref_logits = ref(x)
    ref_loss = F.cross_entropy(ref_logits.reshape(-1, vocab), y.reshape(-1))
    ref_loss.backward()
    from torch.distributed.tensor.parallel import parallelize_module

    parallelize_module(par, mesh, resolve_style("vocab_head", sp), src_data_rank=None)
    xp = (_chunk(x.detach(), 1, mesh) if sp else x.detach()).clone().requires_grad_(True)
    with vocab_parallel_loss():
        logits = par(xp)  # DTensor (3, 4, padded_vocab), Shard(-1)
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
        loss.backward()
    full_logits = logits.full_tensor().detach()
    w_grad = par.weight.grad.full_tensor()
    x_grad_ref = _chunk(x.grad, 1, mesh) if sp else x.grad
    return {
        "loss": abs(float(loss.full_tensor()) - float(ref_loss)) / float(ref_loss),
        "logits": _err(full_logits[..., :vocab], ref_logits),
        "padded_logits_are_min": float(bool((full_logits[..., vocab:] == torch.finfo(torch.float32).min).all())),
        "input_grad": _err(xp.grad, x_grad_ref),
        "weight_grad": _err(w_grad[:vocab], ref.weight.grad),
        "padding_grad": float(w_grad[vocab:].abs().sum()),
        "padded_rows": float(par.weight.shape[0] - vocab),
    }


def _gpt_comm_case(n_layer: int, sp: bool, mesh: Any, batch: int, seq: int, d: int) -> float:
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=n_layer, n_head=4, n_embd=d, block_size=seq, vocab_size=64))
    apply_tensor_parallel(model, mesh, gpt_tp_plan(), sp)
    x = torch.randint(0, 64, (batch, seq))
    counter = CommVolume(mesh.get_group())
    with counter, vocab_parallel_loss():
        logits = model(x)
        F.cross_entropy(logits.reshape(-1, logits.shape[-1]), x.reshape(-1)).backward()
        sync_tp_partial_grads(model, mesh.get_group())  # the norms' partial gradients under sequence parallelism
    return counter.sent_bytes


def _state_dict_case(mesh: Any) -> dict[str, float]:
    """A padded tp model's checkpoint state (model and AdamW state, padding cut off as views) round-trips through
    ``torch.distributed.checkpoint``: into one process (plain tensors) and into another tp model."""
    import tempfile

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

    cfg = GPTConfig(n_layer=1, n_head=4, n_embd=16, block_size=8, vocab_size=30)
    torch.manual_seed(0)
    par = GPT(cfg)
    apply_tensor_parallel(par, mesh, gpt_tp_plan(), False)
    opt = torch.optim.AdamW(par.parameters(), lr=1e-3)
    x = torch.randint(0, 30, (2, 8))
    with vocab_parallel_loss():
        logits = par(x)
        F.cross_entropy(logits.reshape(-1, logits.shape[-1]), x.reshape(-1)).backward()
    opt.step()
    model_state, opt_state = par.state_dict(), get_optimizer_state_dict(par, opt)
    unpad_vocab_state(par, model_state, [opt_state])
    unpadded = float(model_state["wte.weight"].shape[0] == 30 and opt_state["state"]["wte.weight"]["exp_avg"].shape[0] == 30)
    box = [tempfile.mkdtemp() if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box, src=0)
    dcp.save({"model": model_state, "optim": opt_state}, checkpoint_id=box[0])
    full = {k: (v.full_tensor() if hasattr(v, "full_tensor") else v)[:30] if k in ("wte.weight", "lm_head.weight")
            else (v.full_tensor() if hasattr(v, "full_tensor") else v) for k, v in par.state_dict().items()}
    # into one process: plain tensors of the unpadded shapes
    torch.manual_seed(2)
    plain = GPT(cfg).state_dict()
    dcp.load({"model": plain}, checkpoint_id=box[0], no_dist=True)
    model_err = max(_err(plain[k], v) if v.abs().max() > 0 else float((plain[k] - v).abs().max()) for k, v in full.items())
    keys_match = float(plain.keys() == full.keys())
    # into another tp model (another seed): parameters and optimizer state equal the saved ones
    torch.manual_seed(1)
    par2 = GPT(cfg)
    apply_tensor_parallel(par2, mesh, gpt_tp_plan(), False)
    opt2 = torch.optim.AdamW(par2.parameters(), lr=1e-3)
    state2, opt_state2 = par2.state_dict(), get_optimizer_state_dict(par2, opt2)
    unpad_vocab_state(par2, state2, [opt_state2])
    dcp.load({"model": state2, "optim": opt_state2}, checkpoint_id=box[0])
    set_optimizer_state_dict(par2, opt2, opt_state2)
    for k, v in par2.state_dict().items():
        got = (v.full_tensor() if hasattr(v, "full_tensor") else v)
        model_err = max(model_err, float((got[: full[k].shape[0]] - full[k]).abs().max()))
    a, b = get_optimizer_state_dict(par, opt)["state"], get_optimizer_state_dict(par2, opt2)["state"]
    opt_err = 0.0
    for name, per_param in a.items():
        rows = 30 if name in ("wte.weight", "lm_head.weight") else None
        for key, value in per_param.items():
            va = value.full_tensor() if hasattr(value, "full_tensor") else value
            vb = b[name][key].full_tensor() if hasattr(b[name][key], "full_tensor") else b[name][key]
            opt_err = max(opt_err, float((va[:rows] - vb[:rows]).abs().max()) if va.dim() else float((va - vb).abs()))
    return {"model": model_err, "keys_match": keys_match, "optimizer": opt_err, "unpadded": unpadded}


def layer_checks_worker() -> dict[str, Any]:
    """Every layer-level case at tp 2 (the inner axis of a 2 x 2 mesh) and tp 4, on 4 ranks.

    Returns (same on every rank up to rounding) ``{case name: {metric: value}}``; errors are relative to the largest
    magnitude of the reference.
    """
    from torch.distributed.device_mesh import init_device_mesh

    from lightning_par.launcher import init_process_group_from_env

    init_process_group_from_env(timeout_s=60)
    mesh2 = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))["tp"]
    mesh4 = init_device_mesh("cpu", (4,), mesh_dim_names=("tp",))
    out: dict[str, Any] = {}
    for t, mesh in ((2, mesh2), (4, mesh4)):
        for sp in (False, True):
            for style in ("colwise", "rowwise"):
                out[f"{style}-tp{t}-sp{int(sp)}"] = _linear_case(style, sp, mesh, seed=t)
            for vocab in (12, 10):  # 10: padded at tp 4 (and 12 at tp 2 and 4 is not)
                out[f"embedding-v{vocab}-tp{t}-sp{int(sp)}"] = _embedding_case(vocab, sp, mesh, seed=t)
                out[f"head_loss-v{vocab}-tp{t}-sp{int(sp)}"] = _head_loss_case(vocab, sp, mesh, seed=t)
            batch, seq, d = 2, 8, 32
            per_layer = _gpt_comm_case(2, sp, mesh, batch, seq, d) - _gpt_comm_case(1, sp, mesh, batch, seq, d)
            # Sequence parallelism adds the all-reduce of the two LayerNorms' Partial weight and bias gradients.
            ln_grads = 4 * d * 4 * 2 * (t - 1) / t if sp else 0.0
            out[f"comm-tp{t}-sp{int(sp)}"] = {
                "measured": per_layer,
                "theory": megatron_layer_comm_bytes(batch, seq, d, t, bytes_per_element=4) + ln_grads,
            }
        out[f"state_dict-tp{t}"] = _state_dict_case(mesh)
    out["rank"] = int(os.environ["RANK"])
    dist.barrier()
    return out
