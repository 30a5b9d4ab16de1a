"""What the planner needs to know about a model: shapes, parameter counts per part, FLOPs per token.

A :class:`ModelSpec` describes a decoder-only transformer by its shapes (layers, hidden size, heads, vocabulary,
sequence length) and, optionally, its exact parameter count and training FLOPs per token, so a user's own model can
be planned from a handful of numbers. :func:`model_spec` converts the reference :class:`~lightning_par.models.GPTConfig`
(exact counts) or any object with the same field names into one.

Parameters are split into the parts that tensor and pipeline parallelism treat differently (Megatron-LM, Shoeybi et
al. 2019, §3; Narayanan et al. 2021, §2): per layer, the weight matrices and column-parallel biases (split over
``tp``) and the layer norms and row-parallel biases (replicated); the token embedding and the LM head (vocab-parallel,
split over ``tp``; first and last pipeline stage); the position table and final norm (replicated).

A mixture-of-experts model (``num_experts > 0``, the reference GPT's MoE blocks: every ``moe_every``-th block's MLP is
``num_experts`` experts of width ``expert_hidden_size``, each token running ``moe_top_k`` of them) has, per MoE block,
the expert weights ``E x 2 h f_e`` (split over ``ep``, not over ``tp``: lightning_par keeps a MoE block's router and
experts whole on every tp rank), the router ``E h`` and an optional shared expert (replicated); its FLOPs per token
count the *active* parameters (the ``top_k`` experts a token runs), its memory the *total*.

Pure Python: no torch import.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

__all__ = ["GPT_BLOCK_OPS", "ModelSpec", "model_spec"]

#: aten operators one forward + backward of the reference GPT's block dispatches (counted with a TorchDispatchMode;
#: ``tests/planner/test_planner.py`` recounts it).
GPT_BLOCK_OPS = 136


def _check_positive_int(owner: str, name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{owner}.{name}={value!r} is not valid: expected a positive integer.")


@dataclass(frozen=True)
class ModelSpec:
    """A decoder-only transformer as the planner sees it.

    Args:
        num_layers: transformer blocks ``L``.
        hidden_size: width of the residual stream ``h``.
        num_heads: attention heads ``a`` (tensor parallelism splits whole heads).
        vocab_size: token ids ``V``.
        seq_len: training sequence length ``s`` in tokens (the model's context; :func:`~lightning_par.planner.plan`
            may override it).
        ffn_hidden_size: MLP width; ``None`` means ``4 h``.
        num_params: exact total parameter count; ``None`` computes it from the shapes (GPT-2 layout, see
            :meth:`layer_params`). When given, the per-layer count is ``(num_params - embedding - head) / L``.
        flops_per_token: training FLOPs per token (forward + backward, no recomputation) at ``seq_len``; ``None``
            uses ``6 N + 12 L h s`` with ``N`` the non-embedding parameters (PaLM, Chowdhery et al. 2022, App. B).
        tied_embeddings: the LM head shares the token embedding (Megatron-LM's GPT); ours is untied.
        position_embedding: a learned position table (GPT-2); False for rotary/ALiBi models.
        max_seq_len: rows of the position table; ``None`` means ``seq_len`` (the GPT's ``block_size``).
        bias: linear layers and norms have biases.
        ops_per_layer: operators one block runs in forward + backward (the planner charges each the device's
            ``op_overhead_s``); ``None``: 136, the count of the reference GPT's block.
        tensors_per_layer: parameter tensors of one block (the optimizer's per-tensor cost); ``None``: 16 with
            biases, 8 without (the GPT-2 block).
        name: label for tables.
        num_experts: experts ``E`` of each mixture-of-experts block (0: a dense model).
        moe_every: every ``moe_every``-th block is a mixture of experts (blocks ``moe_every - 1``, ``2 moe_every - 1``,
            ...; the reference GPT's rule).
        moe_top_k: experts each token runs.
        expert_hidden_size: hidden width ``f_e`` of one expert; ``None``: ``4 h / moe_top_k`` (the dense MLP's active
            width, the GPT's default).
        moe_shared_expert: each MoE block also has one always-on expert of width ``f_e`` (with biases).

    Raises:
        ValueError: a size that is not a positive integer, ``hidden_size`` not divisible by ``num_heads``, a
            ``num_params`` smaller than the embedding and head alone, ``flops_per_token <= 0``, a MoE field out of range
            (``num_experts`` 1 or negative, ``moe_top_k`` above ``num_experts``), or ``num_params`` given for a MoE
            model (its parts are counted from the shapes).
    """

    num_layers: int
    hidden_size: int
    num_heads: int
    vocab_size: int
    seq_len: int
    ffn_hidden_size: int | None = None
    num_params: int | None = None
    flops_per_token: float | None = None
    tied_embeddings: bool = False
    position_embedding: bool = True
    max_seq_len: int | None = None
    bias: bool = True
    ops_per_layer: int | None = None
    tensors_per_layer: int | None = None
    name: str = "model"
    num_experts: int = 0
    moe_every: int = 1
    moe_top_k: int = 2
    expert_hidden_size: int | None = None
    moe_shared_expert: bool = False

    def __post_init__(self) -> None:
        for f in ("num_layers", "hidden_size", "num_heads", "vocab_size", "seq_len"):
            _check_positive_int("ModelSpec", f, getattr(self, f))
        for f in ("ffn_hidden_size", "max_seq_len", "ops_per_layer", "tensors_per_layer"):
            if getattr(self, f) is not None:
                _check_positive_int("ModelSpec", f, getattr(self, f))
        if self.hidden_size % self.num_heads:
            raise ValueError(
                f"ModelSpec.hidden_size={self.hidden_size} is not valid with num_heads={self.num_heads}: expected a "
                f"multiple of num_heads."
            )
        if self.num_params is not None:
            _check_positive_int("ModelSpec", "num_params", self.num_params)
            floor = self.embedding_params() + self.head_params()
            if self.num_params <= floor:
                raise ValueError(
                    f"ModelSpec.num_params={self.num_params} is not valid: the embedding and head alone hold {floor} "
                    f"parameters; expected more (or num_params=None to count from the shapes)."
                )
        if self.flops_per_token is not None and not (
            isinstance(self.flops_per_token, (int, float)) and not isinstance(self.flops_per_token, bool)
            and self.flops_per_token > 0
        ):
            raise ValueError(f"ModelSpec.flops_per_token={self.flops_per_token!r} is not valid: expected a number > 0.")
        self._check_moe()

    def _check_moe(self) -> None:
        e = self.num_experts
        if isinstance(e, bool) or not isinstance(e, int) or e < 0 or e == 1:
            raise ValueError(f"ModelSpec.num_experts={e!r} is not valid: expected 0 (dense) or an integer >= 2.")
        if not e:
            return
        for f in ("moe_every", "moe_top_k"):
            _check_positive_int("ModelSpec", f, getattr(self, f))
        if self.expert_hidden_size is not None:
            _check_positive_int("ModelSpec", "expert_hidden_size", self.expert_hidden_size)
        if self.moe_top_k > e:
            raise ValueError(f"ModelSpec.moe_top_k={self.moe_top_k} is not valid with num_experts={e}: expected at "
                             f"most num_experts.")
        if self.moe_every > self.num_layers:
            raise ValueError(f"ModelSpec.moe_every={self.moe_every} is not valid with num_layers={self.num_layers}: "
                             f"expected at most num_layers (one MoE block at least).")
        if self.num_params is not None:
            raise ValueError(f"ModelSpec.num_params={self.num_params} is not valid with num_experts={e}: a MoE "
                             f"model's dense, router and expert parameters are counted from its shapes; use None.")

    # ------------------------------------------------------------------ shapes
    @property
    def layer_ops(self) -> int:
        """Operators per block forward + backward (``ops_per_layer``, default :data:`GPT_BLOCK_OPS`)."""
        return self.ops_per_layer or GPT_BLOCK_OPS

    @property
    def layer_tensors(self) -> int:
        """Parameter tensors per block (``tensors_per_layer``, default 16 with biases, 8 without)."""
        return self.tensors_per_layer or (16 if self.bias else 8)

    @property
    def ffn(self) -> int:
        """MLP width (``4 h`` unless given)."""
        return self.ffn_hidden_size or 4 * self.hidden_size

    def with_seq_len(self, seq_len: int) -> ModelSpec:
        """The same model trained at another sequence length (the position table follows ``seq_len``)."""
        if seq_len == self.seq_len:
            return self
        _check_positive_int("plan", "seq_len", seq_len)
        fpt = self.flops_per_token
        if fpt is not None:  # move the attention term 12 L h s to the new length
            fpt = fpt + 12.0 * self.num_layers * self.hidden_size * (seq_len - self.seq_len)
        num_params = self.num_params
        if num_params is not None and self.position_embedding and self.max_seq_len is None:
            num_params += (seq_len - self.seq_len) * self.hidden_size
        return dataclasses.replace(self, seq_len=seq_len, flops_per_token=fpt, num_params=num_params)

    # ------------------------------------------------------------------ parameter counts
    def _computed_layer_params(self) -> tuple[int, int]:
        h, f, b = self.hidden_size, self.ffn, int(self.bias)
        split = 4 * h * h + 2 * h * f + b * (3 * h + f)  # q, k, v, proj; fc, proj; q/k/v and fc biases
        replicated = 2 * h * (1 + b) + b * 2 * h  # two layer norms; attention and MLP output biases
        return split, replicated

    def layer_params(self) -> tuple[int, int]:
        """Parameters of one transformer block as ``(split over tp, replicated over tp)``.

        From the shapes: ``4 h^2 + 2 h f`` matrix weights plus the ``3 h + f`` column-parallel biases are split; two
        layer norms (``2 h`` each with bias) and the two row-parallel output biases (``2 h``) are replicated. With
        ``num_params`` given, the block total is ``(num_params - embedding - head) / L`` with the same replicated part.
        """
        split, replicated = self._computed_layer_params()
        if self.num_params is None:
            return split, replicated
        per_layer = (self.num_params - self.embedding_params() - self.head_params()) / self.num_layers
        return max(0, int(round(per_layer)) - replicated), replicated

    # ------------------------------------------------------------------ mixture of experts
    @property
    def expert_hidden(self) -> int:
        """Hidden width ``f_e`` of one expert (``expert_hidden_size``, default ``4 h / moe_top_k``)."""
        return self.expert_hidden_size or max(1, 4 * self.hidden_size // self.moe_top_k)

    def is_moe(self, layer: int) -> bool:
        """Whether block ``layer`` (0-based) is a mixture of experts."""
        return self.num_experts > 0 and (layer + 1) % self.moe_every == 0

    def moe_layer_count(self) -> int:
        """MoE blocks of the model (0 when dense)."""
        return self.num_layers // self.moe_every if self.num_experts else 0

    def moe_layer_params(self) -> tuple[int, int, int]:
        """Parameters of one MoE block as ``(split over tp, replicated over tp, expert weights)``: the attention as a
        dense block's (its matrices and q/k/v biases split, the norms and output bias replicated); the router ``E h``
        and the shared expert ``2 h f_e + f_e + h`` replicated (whole on every tp rank); the experts ``E 2 h f_e``
        (split over ep only)."""
        h, b, fe = self.hidden_size, int(self.bias), self.expert_hidden
        split = 4 * h * h + b * 3 * h
        replicated = 2 * h * (1 + b) + b * h + self.num_experts * h
        if self.moe_shared_expert:
            replicated += 2 * h * fe + fe + h
        return split, replicated, self.num_experts * 2 * h * fe

    def block_params(self, layer: int) -> tuple[int, int, int]:
        """Block ``layer``'s parameters ``(split over tp, replicated over tp, expert weights)`` (0 experts when
        dense)."""
        if self.is_moe(layer):
            return self.moe_layer_params()
        return (*self.layer_params(), 0)

    def moe_mlp_flops_per_token(self) -> float:
        """Training FLOPs per token of one MoE block's router, ``moe_top_k`` experts and shared expert (``6`` per
        active weight): the part tensor parallelism does not split."""
        h, fe = self.hidden_size, self.expert_hidden
        active = self.num_experts * h + self.moe_top_k * 2 * h * fe + (2 * h * fe if self.moe_shared_expert else 0)
        return 6.0 * active

    def embedding_params(self) -> int:
        """Token embedding ``V h`` plus the position table ``max_seq_len x h`` (if learned)."""
        rows = self.max_seq_len or self.seq_len
        return self.vocab_size * self.hidden_size + (rows * self.hidden_size if self.position_embedding else 0)

    def head_params(self) -> int:
        """Final layer norm plus the LM head ``V h`` (the head counts here even when tied: with pipelining the last
        stage holds its own copy, as in Megatron-LM; for the total it is counted once, see :meth:`total_params`)."""
        h = self.hidden_size
        return h * (1 + int(self.bias)) + self.vocab_size * h

    def total_params(self) -> int:
        """All parameters, each counted once."""
        if self.num_params is not None:
            return self.num_params
        total = sum(sum(self.block_params(i)) for i in range(self.num_layers))
        total += self.embedding_params() + self.head_params()
        if self.tied_embeddings:
            total -= self.vocab_size * self.hidden_size
        return total

    def non_embedding_params(self) -> int:
        """Parameters that do arithmetic per token: blocks, final norm and the (untied) head matrix; of a MoE block
        only the router, the ``moe_top_k`` experts a token runs and the shared expert (the *active* parameters)."""
        if not self.num_experts:
            split, replicated = self.layer_params()
            return self.num_layers * (split + replicated) + self.head_params()
        total = self.head_params()
        for i in range(self.num_layers):
            split, replicated, experts = self.block_params(i)
            total += split + replicated + (experts * self.moe_top_k // self.num_experts)
        return total

    # ------------------------------------------------------------------ FLOPs
    def model_flops_per_token(self) -> float:
        """Training FLOPs per token (forward + backward, no recomputation): ``flops_per_token`` if given, else
        ``6 N + 12 L h s`` (N = :meth:`non_embedding_params`)."""
        if self.flops_per_token is not None:
            return float(self.flops_per_token)
        return float(6 * self.non_embedding_params() + 12 * self.num_layers * self.hidden_size * self.seq_len)

    def head_flops_per_token(self) -> float:
        """Training FLOPs per token of the LM head matmul: ``6 V h``."""
        return 6.0 * self.vocab_size * self.hidden_size

    def layer_flops_per_token(self) -> float:
        """Training FLOPs per token of one block: the model's total minus the head, over ``L``."""
        return (self.model_flops_per_token() - self.head_flops_per_token()) / self.num_layers

    def attention_score_flops_per_token(self) -> float:
        """Forward FLOPs per token of one block's attention scores and weighted sum (``Q K^T`` and ``A V``):
        ``4 s h``; what selective recomputation recomputes (Korthikanti et al. 2022, §5)."""
        return 4.0 * self.seq_len * self.hidden_size

    def describe(self) -> str:
        """``name: 1.23B params, L x h, a heads, V vocab, s seq``."""
        n = self.total_params()
        size = f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.2f}M" if n >= 1e6 else f"{n / 1e3:.1f}K"
        return (
            f"{self.name}: {size} params, {self.num_layers} layers x {self.hidden_size}, {self.num_heads} heads, "
            f"vocab {self.vocab_size}, seq {self.seq_len}"
        )


_SPEC_FIELDS = tuple(f.name for f in dataclasses.fields(ModelSpec))


def _moe_fields(config: Any) -> dict[str, Any]:
    """The MoE fields of a ``GPTConfig``-like object (``num_experts``, ``moe_every``, ``moe_top_k``, ``moe_hidden``,
    ``moe_shared_expert``); none for a dense one."""
    if not getattr(config, "num_experts", 0):
        return {}
    return {"num_experts": config.num_experts, "moe_every": config.moe_every, "moe_top_k": config.moe_top_k,
            "expert_hidden_size": getattr(config, "moe_hidden", None),
            "moe_shared_expert": bool(getattr(config, "moe_shared_expert", False))}


def model_spec(model: Any, seq_len: int | None = None) -> ModelSpec:
    """Convert a model description into a :class:`ModelSpec`.

    Args:
        model: a :class:`ModelSpec`; the reference :class:`~lightning_par.models.GPTConfig` or any object with its
            fields ``n_layer``, ``n_head``, ``n_embd``, ``block_size``, ``vocab_size`` (and optionally ``bias``),
            counted exactly (untied head, learned positions); or any object (e.g. a user's dataclass) or dict with
            :class:`ModelSpec`'s field names (``num_layers``, ``hidden_size``, ``num_heads``, ``vocab_size``,
            ``seq_len``, optionally ``num_params``, ``flops_per_token``, ...).
        seq_len: train at this sequence length instead of the model's own.

    Returns:
        The spec.

    Raises:
        ValueError: an object that has neither set of fields (the message lists them), or invalid values.
    """
    if isinstance(model, ModelSpec):
        spec = model
    elif all(hasattr(model, k) for k in ("n_layer", "n_head", "n_embd", "block_size", "vocab_size")):
        spec = ModelSpec(
            num_layers=model.n_layer,
            hidden_size=model.n_embd,
            num_heads=model.n_head,
            vocab_size=model.vocab_size,
            seq_len=model.block_size,
            max_seq_len=model.block_size,
            bias=bool(getattr(model, "bias", True)),
            name=type(model).__name__,
            **_moe_fields(model),
        )
    else:
        data = model if isinstance(model, dict) else {k: getattr(model, k) for k in _SPEC_FIELDS if hasattr(model, k)}
        missing = [k for k in ("num_layers", "hidden_size", "num_heads", "vocab_size", "seq_len") if k not in data]
        if missing:
            raise ValueError(
                f"model={type(model).__name__} is not valid: expected a ModelSpec, a GPTConfig (n_layer, n_head, "
                f"n_embd, block_size, vocab_size) or an object with fields {list(_SPEC_FIELDS)}; missing {missing}."
            )
        unknown = sorted(set(data) - set(_SPEC_FIELDS)) if isinstance(model, dict) else []
        if unknown:
            raise ValueError(f"model fields {unknown} are not valid: expected fields among {list(_SPEC_FIELDS)}.")
        spec = ModelSpec(**{k: data[k] for k in _SPEC_FIELDS if k in data})
    if seq_len is not None:
        spec = spec.with_seq_len(seq_len)
    return spec
