"""A nanoGPT-sized decoder-only transformer that tensor and pipeline parallelism can cut up.

The architecture follows GPT-2 (Radford et al. 2019) as written in nanoGPT (Karpathy,
https://github.com/karpathy/nanoGPT): pre-LayerNorm blocks, learned absolute positions, GELU MLP of width
``4 * n_embd``. It differs from nanoGPT in the ways the parallel strategies need:

* ``q_proj``/``k_proj``/``v_proj`` are separate ``n_embd -> n_embd`` projections, so each can be split by columns
  (Megatron-LM, Shoeybi et al. 2019, §3) without re-ordering a fused ``c_attn`` weight.
* Attention computes its head count from the local tensor width, and no reshape hard-codes ``n_embd``: a rank that
  holds ``1/tp`` of the columns runs ``n_head / tp`` heads.
* ``lm_head`` is not tied to ``wte``: pipeline parallelism puts them on different stages.
* ``blocks`` is an ``nn.ModuleDict`` keyed by ``str(layer_index)`` and ``wte``/``wpe``/``ln_f``/``lm_head`` may be
  ``None``: a pipeline stage (:meth:`GPT.pipeline_stage`) is the model with the parts it does not run left out, and its
  parameter names (``blocks.3.attn.q_proj.weight``) match the full model's, so checkpoints line up.

It meets the model contract of :mod:`lightning_par.contract` itself: ``tp_plan()``, ``check_tensor_parallel()``,
``pipeline_layers()``, ``pipeline_stage()``, ``checkpoint_modules()`` and ``example_input()``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["GPT", "GPT_PRESETS", "Block", "CausalSelfAttention", "GPTConfig", "MLP"]

#: Named model sizes. ``"tiny"`` is for CI, ``"small"`` is the default CPU job, ``"gpt2"``/``"gpt2-medium"`` are the
#: GPT-2 shapes (Radford et al. 2019, Table 2) with the vocabulary padded to 50304 (a multiple of 64), as nanoGPT does.
GPT_PRESETS: dict[str, dict[str, int]] = {
    "tiny": {"n_layer": 2, "n_head": 2, "n_embd": 32, "block_size": 32},
    "small": {"n_layer": 4, "n_head": 4, "n_embd": 128, "block_size": 128},
    "gpt2": {"n_layer": 12, "n_head": 12, "n_embd": 768, "block_size": 1024, "vocab_size": 50304},
    "gpt2-medium": {"n_layer": 24, "n_head": 16, "n_embd": 1024, "block_size": 1024, "vocab_size": 50304},
    # mixtures of experts: "tiny"'s and "small"'s shapes with every other block's MLP replaced by 4 / 8 experts, top-2
    "moe_tiny": {"n_layer": 2, "n_head": 2, "n_embd": 32, "block_size": 32, "num_experts": 4, "moe_every": 2},
    "moe_small": {"n_layer": 4, "n_head": 4, "n_embd": 128, "block_size": 128, "num_experts": 8, "moe_every": 2},
}


def _positive_int(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"GPTConfig.{name}={value!r} is not valid: expected a positive integer.")


@dataclass
class GPTConfig:
    """Shape of a :class:`GPT`.

    Args:
        n_layer: number of transformer blocks.
        n_head: attention heads per block; must divide ``n_embd``.
        n_embd: width of the residual stream.
        block_size: longest sequence (tokens) the model accepts; size of the position table.
        vocab_size: number of token ids (256 for the byte-level corpus).
        dropout: dropout probability on embeddings, attention weights and residual branches, in ``[0, 1)``.
        bias: whether Linear and LayerNorm layers have biases (``lm_head`` never has one).
        num_experts: 0 for dense MLPs; else the experts of each mixture-of-experts block
            (:class:`~lightning_par.models.moe.MoE`).
        moe_every: every ``moe_every``-th block is a mixture of experts (blocks ``moe_every - 1``, ``2 moe_every - 1``,
            ...; 1: every block, 2: every other block).
        moe_top_k: experts per token, 1 or 2.
        moe_hidden: hidden width of each expert; ``None``: ``4 n_embd / moe_top_k`` (the dense MLP's active size).
        moe_gating: ``"softmax"`` or ``"sigmoid"``.
        moe_shared_expert: add one always-on expert of width ``moe_hidden`` to each MoE block.
        moe_capacity_factor: ``None`` (dropless) or each expert's capacity multiplier.
        moe_aux_loss_coeff: weight of the load-balancing loss.
        moe_z_loss_coeff: weight of the router z-loss.
        moe_balance: ``"aux_loss"``, ``"bias"`` (DeepSeek-V3's auxiliary-loss-free bias) or ``"both"``.
        moe_bias_update_rate: the bias's update speed per optimizer step (DeepSeek-V3: 0.001).
        moe_experts_form: ``"auto"``, ``"grouped_mm"``, ``"bmm"`` or ``"loop"``
            (:func:`~lightning_par.expert_parallel.grouped.choose_form`).

    Raises:
        ValueError: a size that is not a positive integer, ``n_embd`` not divisible by ``n_head``, ``dropout``
            outside ``[0, 1)``, ``bias`` not a bool, or a mixture-of-experts option out of range. The message names
            the field, the value and what is valid.
    """

    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 128
    block_size: int = 128
    vocab_size: int = 256
    dropout: float = 0.0
    bias: bool = True
    num_experts: int = 0
    moe_every: int = 1
    moe_top_k: int = 2
    moe_hidden: int | None = None
    moe_gating: str = "softmax"
    moe_shared_expert: bool = False
    moe_capacity_factor: float | None = None
    moe_aux_loss_coeff: float = 0.01
    moe_z_loss_coeff: float = 0.001
    moe_balance: str = "aux_loss"
    moe_bias_update_rate: float = 1e-3
    moe_experts_form: str = "auto"

    def __post_init__(self) -> None:
        for name in ("n_layer", "n_head", "n_embd", "block_size", "vocab_size"):
            _positive_int(name, getattr(self, name))
        if self.n_embd % self.n_head != 0:
            raise ValueError(
                f"GPTConfig.n_embd={self.n_embd} is not valid with n_head={self.n_head}: "
                f"expected n_embd to be a multiple of n_head."
            )
        if isinstance(self.dropout, bool) or not isinstance(self.dropout, (int, float)) or not 0 <= self.dropout < 1:
            raise ValueError(f"GPTConfig.dropout={self.dropout!r} is not valid: expected a number in [0, 1).")
        if not isinstance(self.bias, bool):
            raise ValueError(f"GPTConfig.bias={self.bias!r} is not valid: expected True or False.")
        if self.num_experts:
            from lightning_par.models.moe import check_moe_options

            _positive_int("moe_every", self.moe_every)
            check_moe_options(self.num_experts, self.moe_top_k, self.moe_gating, self.moe_capacity_factor,
                              self.moe_aux_loss_coeff, self.moe_z_loss_coeff, prefix="GPTConfig.moe_",
                              balance=self.moe_balance, bias_update_rate=self.moe_bias_update_rate,
                              experts_form=self.moe_experts_form)
            if self.moe_hidden is not None:
                _positive_int("moe_hidden", self.moe_hidden)
            if self.moe_every > self.n_layer:
                raise ValueError(
                    f"GPTConfig.moe_every={self.moe_every} is not valid with n_layer={self.n_layer}: expected at most "
                    f"n_layer, or no block would be a mixture of experts."
                )
        elif self.num_experts != 0:
            raise ValueError(f"GPTConfig.num_experts={self.num_experts!r} is not valid: expected 0 (dense) or >= 2.")

    def is_moe(self, layer: int) -> bool:
        """Whether block ``layer`` is a mixture of experts."""
        return self.num_experts > 0 and (layer + 1) % self.moe_every == 0

    @property
    def expert_hidden(self) -> int:
        """Hidden width of one expert."""
        return self.moe_hidden if self.moe_hidden is not None else max(1, 4 * self.n_embd // self.moe_top_k)

    @property
    def head_dim(self) -> int:
        """Width of one attention head, ``n_embd // n_head``."""
        return self.n_embd // self.n_head

    @classmethod
    def from_preset(cls, name: str, **overrides: Any) -> GPTConfig:
        """Build the config of a named preset (see :data:`GPT_PRESETS`), with some fields replaced.

        Args:
            name: a key of :data:`GPT_PRESETS`.
            **overrides: any :class:`GPTConfig` field, e.g. ``dropout=0.1``.

        Raises:
            ValueError: an unknown preset name or override field (the message lists the valid ones), or an
                invalid resulting config.
        """
        if name not in GPT_PRESETS:
            raise ValueError(f"GPT preset name={name!r} is not valid: expected one of {sorted(GPT_PRESETS)}.")
        valid = [f.name for f in fields(cls)]
        unknown = sorted(set(overrides) - set(valid))
        if unknown:
            raise ValueError(f"GPTConfig override(s) {unknown} are not valid: expected fields among {valid}.")
        return cls(**{**GPT_PRESETS[name], **overrides})

    def num_params(self, include_embedding: bool = True) -> int:
        """Exact parameter count of the :class:`GPT` this config builds, from the config alone.

        Per block: four ``d x d`` attention projections and the ``d x 4d`` and ``4d x d`` MLP matrices
        (``12 d^2``), two LayerNorm weights (``2d``), and with ``bias`` the LayerNorm biases (``2d``), projection
        biases (``4d``) and MLP biases (``4d + d``). Then ``ln_f``, ``wte`` (``V d``), ``wpe`` (``block_size d``) and
        the untied ``lm_head`` (``V d``).

        Args:
            include_embedding: if False, leave out the lookup tables ``wte`` and ``wpe`` (they do no arithmetic);
                the untied ``lm_head`` is a matrix multiply and is always counted.

        Returns:
            Number of scalar parameters.
        """
        return self._count(include_embedding, active=False)

    def num_active_params(self, include_embedding: bool = True) -> int:
        """:meth:`num_params` counting, in each mixture-of-experts block, only the ``moe_top_k`` experts a token runs
        (and the router and shared expert): the parameters one token's arithmetic touches."""
        return self._count(include_embedding, active=True)

    def _count(self, include_embedding: bool, active: bool) -> int:
        d, b = self.n_embd, int(self.bias)
        dense_mlp = 8 * d * d + b * 5 * d
        per_block = 4 * d * d + 2 * d + b * 6 * d  # attention (4 projections, 4 biases) and 2 LayerNorms
        total = (d + b * d) + self.vocab_size * d  # ln_f, lm_head
        for layer in range(self.n_layer):
            total += per_block
            if not self.is_moe(layer):
                total += dense_mlp
                continue
            h = self.expert_hidden
            total += self.num_experts * d + (self.moe_top_k if active else self.num_experts) * 2 * d * h
            if self.moe_shared_expert:
                total += 2 * d * h + h + d
        if include_embedding:
            total += self.vocab_size * d + self.block_size * d
        return total

    def flops_per_token(self) -> float:
        """Training FLOPs per token (forward and backward) at full context length.

        ``6 N + 12 n_layer n_embd block_size`` with ``N = num_active_params(include_embedding=False)``: ``6 N`` for the
        matrix multiplies (2 forward, 4 backward per weight) and the second term for the attention scores and the
        weighted sum of values. Source: PaLM, Chowdhery et al. 2022, App. B; also nanoGPT's ``estimate_mfu``.

        Returns:
            FLOPs per token (a float; about 8.6e8 for ``"gpt2"``).
        """
        n = self.num_active_params(include_embedding=False)
        return float(6 * n + 12 * self.n_layer * self.n_embd * self.block_size)


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention with separate Q, K, V projections.

    Tensor parallelism may replace ``q_proj``/``k_proj``/``v_proj`` by column shards and ``c_proj`` by a row shard;
    the head count is then read from the local width: ``n_local_heads = q.shape[-1] // head_dim``.

    Args:
        config: the model shape.
    """

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        d = config.n_embd
        self.head_dim: int = config.head_dim
        self.dropout: float = config.dropout
        self.q_proj = nn.Linear(d, d, bias=config.bias)
        self.k_proj = nn.Linear(d, d, bias=config.bias)
        self.v_proj = nn.Linear(d, d, bias=config.bias)
        self.c_proj = nn.Linear(d, d, bias=config.bias)
        self.resid_drop = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Attend over earlier positions.

        Args:
            x: hidden states ``(batch, seq, n_embd)``.

        Returns:
            ``(batch, seq, n_embd)`` (a partial sum on each rank when ``c_proj`` is row-sharded).
        """
        bsz, seq = x.shape[0], x.shape[1]
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        n_local_heads = q.shape[-1] // self.head_dim
        # (batch, seq, local_width) -> (batch, n_local_heads, seq, head_dim)
        q, k, v = (t.view(bsz, seq, n_local_heads, self.head_dim).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True)
        y = y.transpose(1, 2).reshape(bsz, seq, -1)
        return self.resid_drop(self.c_proj(y))


class MLP(nn.Module):
    """Position-wise feed-forward layer ``n_embd -> 4 n_embd -> n_embd`` with GELU.

    Args:
        config: the model shape.
    """

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        d = config.n_embd
        self.c_fc = nn.Linear(d, 4 * d, bias=config.bias)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(4 * d, d, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Apply the MLP.

        Args:
            x: hidden states ``(batch, seq, n_embd)``; the hidden layer is ``(batch, seq, 4 n_embd / tp)`` under tp.

        Returns:
            ``(batch, seq, n_embd)`` (a partial sum on each rank when ``c_proj`` is row-sharded).
        """
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))


class Block(nn.Module):
    """Pre-LayerNorm transformer block: ``x + attn(ln_1(x))`` then ``x + mlp(ln_2(x))``.

    Args:
        config: the model shape.
        moe: make ``mlp`` a mixture of experts (:class:`~lightning_par.models.moe.MoE`) with the config's options.
    """

    def __init__(self, config: GPTConfig, moe: bool = False) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.mlp: nn.Module = MLP(config)
        if moe:
            from lightning_par.models.moe import MoE

            c = config
            self.mlp = MoE(c.n_embd, c.expert_hidden, c.num_experts, c.moe_top_k, c.moe_gating, c.moe_shared_expert,
                           c.moe_capacity_factor, c.moe_aux_loss_coeff, c.moe_z_loss_coeff, c.moe_balance,
                           c.moe_bias_update_rate, c.moe_experts_form)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Apply the block.

        Args:
            x: hidden states ``(batch, seq, n_embd)``.

        Returns:
            ``(batch, seq, n_embd)``.
        """
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """GPT-2-style language model returning logits (the loss is computed outside, see ``GPTLightningModule``).

    A pipeline stage is made by setting ``wte``/``wpe``/``ln_f``/``lm_head`` to ``None`` and deleting keys from
    ``blocks``; :meth:`forward` then runs whatever is left.

    Args:
        config: the model shape; ``GPTConfig()`` if None.
    """

    def __init__(self, config: GPTConfig | None = None) -> None:
        super().__init__()
        self.config: GPTConfig = config if config is not None else GPTConfig()
        c = self.config
        self.wte: nn.Embedding | None = nn.Embedding(c.vocab_size, c.n_embd)
        self.wpe: nn.Embedding | None = nn.Embedding(c.block_size, c.n_embd)
        self.drop = nn.Dropout(c.dropout)
        self.blocks = nn.ModuleDict({str(i): Block(c, moe=c.is_moe(i)) for i in range(c.n_layer)})
        self.ln_f: nn.LayerNorm | None = nn.LayerNorm(c.n_embd, bias=c.bias)
        self.lm_head: nn.Linear | None = nn.Linear(c.n_embd, c.vocab_size, bias=False)
        self.init_weights()

    @torch.no_grad()
    def init_weights(self) -> None:
        """(Re-)initialise every parameter as nanoGPT does; deterministic under ``torch.manual_seed``.

        Linear and Embedding weights ~ N(0, 0.02), biases 0, LayerNorm weight 1 and bias 0, and the residual output
        projections (``*.c_proj.weight``) ~ N(0, 0.02 / sqrt(2 n_layer)) (GPT-2, Radford et al. 2019, §2.3).
        """
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, mean=0.0, std=0.02)
                if getattr(module, "bias", None) is not None:
                    nn.init.zeros_(module.bias)
            elif isinstance(module, nn.LayerNorm):
                nn.init.ones_(module.weight)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
        residual_std = 0.02 / math.sqrt(2 * self.config.n_layer)
        for name, param in self.named_parameters():
            if name.endswith("c_proj.weight") or name.endswith("experts.w2") or name.endswith("shared.2.weight"):
                nn.init.normal_(param, mean=0.0, std=residual_std)
            elif name.endswith("experts.w1"):
                nn.init.normal_(param, mean=0.0, std=0.02)

    def reset_parameters(self) -> None:
        """Alias of :meth:`init_weights` (the name ``torch`` utilities look for)."""
        self.init_weights()

    def num_params(self, include_embedding: bool = True) -> int:
        """Number of scalar parameters this module holds now (a pipeline stage holds fewer).

        Args:
            include_embedding: if False, leave out ``wte`` and ``wpe`` (when present).
        """
        total = sum(p.numel() for p in self.parameters())
        if not include_embedding:
            for table in (self.wte, self.wpe):
                if table is not None:
                    total -= table.weight.numel()
        return total

    # ------------------------------------------------------------------ the model contract (lightning_par.contract)
    def tp_plan(self) -> dict[str, str]:
        """The Megatron tensor-parallel plan, relative to this module (see :mod:`lightning_par.models.gpt_tp_plan`);
        mixture-of-experts blocks keep their router and experts whole on every tp rank."""
        from lightning_par.models.gpt_tp_plan import gpt_tp_plan

        c = self.config
        return gpt_tp_plan(moe_layers=[i for i in range(c.n_layer) if c.is_moe(i)], n_layer=c.n_layer)

    def expert_modules(self) -> list[str]:
        """The experts of every mixture-of-experts block (the model contract's, for expert parallelism):
        ``["blocks.1.mlp.experts", ...]``."""
        return [f"blocks.{k}.mlp.experts" for k in self.blocks.keys() if self.config.is_moe(int(k))]

    def check_tensor_parallel(self, tp_size: int, sequence_parallel: bool) -> None:
        """Raise ``ValueError`` if heads, width or (with sequence parallelism) ``block_size`` do not split over
        ``tp_size`` (see :func:`lightning_par.models.gpt_tp_plan.validate_gpt_tp`)."""
        from lightning_par.models.gpt_tp_plan import validate_gpt_tp

        validate_gpt_tp(self.config, tp_size, sequence_parallel)

    def pipeline_layers(self) -> list[str]:
        """The blocks, in order: pipeline stage boundaries fall between them (``["blocks.0", "blocks.1", ...]``)."""
        return [f"blocks.{k}" for k in self.blocks.keys()]

    def pipeline_stage(self, layers: list[str], *, first: bool, last: bool) -> GPT:
        """A :class:`GPT` sharing this one's modules that runs only ``layers`` (``"blocks.<k>"``), plus the embeddings
        if ``first`` and the final norm and head if ``last``. No parameter is copied; names stay the whole model's."""
        view = GPT.__new__(GPT)
        nn.Module.__init__(view)
        view.config = self.config
        view.wte = self.wte if first else None
        view.wpe = self.wpe if first else None
        view.drop = self.drop
        view.blocks = nn.ModuleDict({k.split(".", 1)[1]: self.blocks[k.split(".", 1)[1]] for k in layers})
        view.ln_f = self.ln_f if last else None
        view.lm_head = self.lm_head if last else None
        return view

    def checkpoint_modules(self, mode: str) -> list[str]:
        """What activation checkpointing recomputes (:mod:`lightning_par.activation_checkpointing`): every block for
        ``"full"``, the attention of every block for ``"selective"`` (``["blocks.0.attn", ...]``).

        Raises:
            ValueError: another mode.
        """
        if mode == "full":
            return [f"blocks.{k}" for k in self.blocks.keys()]
        if mode == "selective":
            return [f"blocks.{k}.attn" for k in self.blocks.keys()]
        raise ValueError(f"activation checkpointing mode={mode!r} is not valid: expected 'full' or 'selective'.")

    def example_input(self, batch_size: int = 1) -> torch.Tensor:
        """Token ids ``(batch_size, block_size)`` to profile the layers with (``split="time"``)."""
        device = next(self.parameters()).device
        return torch.randint(0, self.config.vocab_size, (batch_size, self.config.block_size), device=device)

    def attention_heads(self) -> int:
        """Attention heads per block (the model contract's, for context parallelism's all-to-all)."""
        return self.config.n_head

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Run the embeddings (if present), the remaining blocks, ``ln_f`` and ``lm_head`` (if present).

        Args:
            x: token ids ``(batch, seq)`` int64 when ``wte`` is present, else hidden states
                ``(batch, seq, n_embd)`` from the previous pipeline stage.
            position_ids: global positions of the tokens, ``(seq,)`` or ``(batch, seq)`` int64 (context parallelism
                gives each rank a non-contiguous piece of the sequence); ``None``: ``0 .. seq-1``.

        Returns:
            Logits ``(batch, seq, vocab_size)`` when ``lm_head`` is present, else hidden states
            ``(batch, seq, n_embd)``.

        Raises:
            ValueError: ``x`` has the wrong number of dimensions, or ``seq > block_size``.
        """
        want_dims = 2 if self.wte is not None else 3
        if x.dim() != want_dims:
            what = "token ids (batch, seq)" if want_dims == 2 else "hidden states (batch, seq, n_embd)"
            raise ValueError(f"GPT input of shape {tuple(x.shape)} is not valid: expected {what}.")
        seq = x.shape[1]
        if seq > self.config.block_size:
            raise ValueError(
                f"sequence length seq={seq} is not valid: expected at most block_size={self.config.block_size}."
            )
        if self.wte is not None:
            h = self.wte(x)
            if self.wpe is not None:
                positions = torch.arange(seq, device=x.device) if position_ids is None else position_ids
                h = h + self.wpe(positions)
            x = self.drop(h)
        for block in self.blocks.values():
            x = block(x)
        if self.ln_f is not None:
            x = self.ln_f(x)
        if self.lm_head is not None:
            x = self.lm_head(x)
        return x
