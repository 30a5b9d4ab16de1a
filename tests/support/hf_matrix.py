"""The generated Hugging Face matrix: every causal-LM architecture of ``transformers``' registry, built tiny, under every
layout it claims, against one process.

Rows come from ``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES`` (no hand-picked list). Each model type's default config is read
once and shrunk generically (:func:`tiny_config`): hidden 64, 4 layers, 4 query heads over 2 key/value heads, head
width 16, intermediate 128, vocab 256, untied, no dropout, 4 experts of which 2 per token, each field set under every
name the config class knows for it (its ``attribute_map`` and the common spellings). An architecture whose config
refuses the tiny values, whose model does not build on CPU from its config alone (no remote code, no download) under
:class:`lightning_par.hf.HFCausalLM`, or whose one-process training step fails is a ``cannot build: <reason>`` row.

Layouts a model claims (:func:`claimed_layouts`), read from the model: zero3 (dp 2), tp2, tp2+SP and pp2 (1F1B, 2
micro-batches) always (with the model's own plan, the project's plan for its family, or a pipeline plan derived from
its module tree; without one the cell is a refusal before start); cp2 (ring) when it
attends through ``transformers``' attention interface (``_supports_attention_backend``); ep2 when it has an experts
module. A cell is PASS (every step's loss and the final parameters within rel 1e-5 of one process on the same global
batches, fp32), ``refused: <message>`` (a ``ValueError`` raised before the first optimizer step), or FAIL (trained and
differs, or crashed after start). The optimizers alternate over the cells: SGD with momentum, AdamW.

All architectures of one layout run in ONE launch of 2 ranks (:func:`run_layout`); the one-process references are
computed in the parent (:func:`reference`). ``python -m tests.support.hf_matrix --markdown`` prints the table; ``--docs`` writes it into docs/huggingface.md.
"""

from __future__ import annotations

import math
import os
import re
import time
import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DataLoader, DistributedSampler

from tests.support.helpers import LossRecorder, TokenDataset, quiet_trainer, reference_fit

STEPS, MICRO, SEQ, VOCAB = 4, 4, 16, 256
HIDDEN, LAYERS, HEADS, KV_HEADS, HEAD_DIM, INTERMEDIATE, POSITIONS = 64, 4, 4, 2, 16, 128, 64
RTOL = 1e-5
#: AdamW's eps and learning rate. Adam divides by sqrt(v) + eps: fp32 rounding in an entry whose gradient is near eps
#: (an embedding row of a token seen a few times: gradients about 1e-5 here) becomes a step difference of up to lr
#: (tests/helpers.assert_params_close). At lr 3e-3 and eps 1e-6 or 1e-5, 1 or 2 of 16,384 embedding entries ended
#: 1e-5 to 7e-5 apart after 4 steps with equal losses (llama and qwen3_moe under tp2+SP, several under cp2); at lr 1e-3
#: the bound of 1e-5 absolute is a hundredth of a step, while a missing reduction moves every entry by about a step.
ADAM_EPS, ADAM_LR = 1e-5, 1e-3
#: Cells whose parameters are judged with a wider absolute bound than 1e-5, each under AdamW only, with what was
#: measured. kolibri1 cp2 (AdamW): 6 of 16,384 embedding entries ended 1.9e-6 to 1.29e-5 apart (losses rel 1.7e-7),
#: each an entry whose gradient was near eps in the one step its token was seen (9.7e-6 at (43, 14), the worst),
#: where Adam's step lr * g / (sqrt(v) + eps) turns fp32 rounding of g into a step difference. The same cell under
#: SGD+momentum ends 1.4e-7 apart; in ONE process, the whole-batch gradient against the mean of two half-batch
#: gradients (equal up to rounding) already ends 6.8e-6 apart at such entries under AdamW (1.7e-7 under SGD). A
#: missing or unaveraged reduction moves entries by about a step (lr 1e-3): 3e-5 is 3 % of one. kolibri1 tp2+SP
#: (AdamW): 1 of 16,384 embedding entries 1.1e-5 apart, losses rel 8.6e-8; with SGD, or AdamW at eps 1e-3, every
#: parameter within 3e-6 (the same rounding near eps).
PARAM_ATOL: dict[tuple[str, str], float] = {("kolibri1", "cp2"): 3e-5, ("kolibri1", "tp2sp"): 3e-5}
#: Seconds without progress (a step, or the next model) after which a launch is ended and its model recorded as hung.
WATCHDOG_S = 180
LAYOUTS = ("zero3", "tp2", "tp2sp", "pp2", "cp2", "ep2")
#: Strategy registry name and options per layout (2 ranks each).
STRATEGIES: dict[str, tuple[str, dict[str, Any]]] = {
    "zero3": ("zero3", {}),
    "tp2": ("tensor_parallel", {"tp_size": 2}),
    "tp2sp": ("tensor_parallel", {"tp_size": 2, "sequence_parallel": True}),
    "pp2": ("parallel_3d", {"pp_size": 2, "schedule": "1f1b", "num_microbatches": 2}),
    "cp2": ("parallel_3d", {"cp_size": 2}),
    "ep2": ("parallel_3d", {"ep_size": 2, "dp_mode": "zero3"}),
}

@contextmanager
def quiet() -> Iterator[None]:
    """Without ``transformers``' advice and Python warnings (200 architectures print a lot of both)."""
    import warnings

    from transformers.utils import logging as hf_logging

    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        hf_logging.set_verbosity(level)


# -- the tiny config ------------------------------------------------------------------------------------------------

#: Canonical field -> (value, the spellings config classes use for it).
_FIELDS: dict[str, tuple[int, tuple[str, ...]]] = {
    "hidden_size": (HIDDEN, ("hidden_size", "n_embd", "n_embed", "d_model", "embed_dim", "model_dim", "dim")),
    "num_hidden_layers": (LAYERS, ("num_hidden_layers", "n_layer", "n_layers", "num_layers", "decoder_layers",
                                   "encoder_layers")),
    "num_attention_heads": (HEADS, ("num_attention_heads", "n_head", "n_heads", "num_heads",
                                    "decoder_attention_heads", "encoder_attention_heads")),
    "num_key_value_heads": (KV_HEADS, ("num_key_value_heads", "num_kv_heads", "n_kv_heads", "multi_query_group_num",
                                       "n_head_kv")),
    "head_dim": (HEAD_DIM, ("head_dim", "kv_channels", "attention_head_dim")),
    "rotary_dim": (HEAD_DIM // 2, ("rotary_dim",)),
    "intermediate_size": (INTERMEDIATE, ("intermediate_size", "n_inner", "ffn_dim", "decoder_ffn_dim",
                                         "encoder_ffn_dim", "ffn_hidden_size", "d_ff", "inner_hidden_size")),
    "vocab_size": (VOCAB, ("vocab_size",)),
    "max_position_embeddings": (POSITIONS, ("max_position_embeddings", "n_positions", "n_ctx", "max_seq_len",
                                            "seq_length")),
    # mixture of experts: 4 experts, 2 per token, every layer after the first sparse
    "num_experts": (4, ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")),
    "num_experts_per_tok": (2, ("num_experts_per_tok", "moe_topk", "num_experts_per_token", "top_k")),
    "moe_intermediate_size": (64, ("moe_intermediate_size", "expert_intermediate_size",
                                   "shared_expert_intermediate_size")),
    "n_group": (1, ("n_group", "topk_group")),
    "first_k_dense_replace": (1, ("first_k_dense_replace",)),
    # state-space layers (Mamba-2 heads of 32 over 128 expanded channels; chunks of the sequence's length)
    "mamba_n_heads": (4, ("mamba_n_heads",)),
    "state_size": (16, ("state_size", "mamba_d_state", "ssm_state_size", "d_state")),
    "chunk_size": (SEQ, ("chunk_size", "mamba_chunk_size")),
    "time_step_rank": (8, ("time_step_rank",)),
    # multi-head latent attention
    "kv_lora_rank": (16, ("kv_lora_rank",)),
    "q_lora_rank": (32, ("q_lora_rank",)),
    "qk_rope_head_dim": (8, ("qk_rope_head_dim",)),
    "qk_nope_head_dim": (8, ("qk_nope_head_dim",)),
    "v_head_dim": (HEAD_DIM, ("v_head_dim",)),
}
_PER_LAYER_LISTS = ("layer_types", "mlp_only_layers")


def _default_config(model_type: str) -> Any:
    from transformers import AutoConfig

    return AutoConfig.for_model(model_type)


def tiny_config(model_type: str) -> dict[str, Any]:
    """Config overrides that make ``model_type`` tiny (see the module docstring), from its default config.

    Every name in ``_FIELDS`` that the default config has (directly or through its class's ``attribute_map``) is set;
    dropout and router-jitter fields become 0 (the ranks' random streams differ from one process's); token ids beyond the small
    vocabulary move inside it; per-layer lists are cut to the first layers; ``is_decoder`` is set where the config
    has it (a causal LM attends causally); sub-configs (``config.sub_configs``) are shrunk the same way.

    Raises:
        Exception: whatever ``AutoConfig.for_model`` raises for the model type.
    """
    return {"tie_word_embeddings": False, **_shrink(_default_config(model_type))}


def _shrink(default: Any) -> dict[str, Any]:
    values = default.to_dict()
    attribute_map = dict(getattr(type(default), "attribute_map", {}) or {})
    present = set(values) | set(attribute_map)
    out: dict[str, Any] = {}
    mla = "qk_rope_head_dim" in present
    for field, (value, names) in _FIELDS.items():
        if field == "head_dim" and mla:
            value = _FIELDS["qk_rope_head_dim"][0]  # MLA: the rotary part's width is the config's head_dim
        for name in names:
            if name not in present:
                continue
            target = attribute_map.get(name, name)
            current = values.get(target, getattr(default, name, None))
            if current is None and name not in ("head_dim", "q_lora_rank", "n_inner"):
                continue  # an optional feature the architecture leaves off (a None sliding window, no MoE...)
            if isinstance(current, bool) or (current is not None and not isinstance(current, int)):
                continue  # another meaning under the same name (a list, a string)
            out[target] = value
    if mla and "qk_head_dim" in values:
        out["qk_head_dim"] = _FIELDS["qk_rope_head_dim"][0] + _FIELDS["qk_nope_head_dim"][0]
    for name, value in values.items():
        if isinstance(value, float) and re.search(r"dropout|pdrop|layerdrop|jitter", name):
            out[name] = 0.0
        elif name.endswith("_token_id") and isinstance(value, int) and not isinstance(value, bool) and value >= VOCAB:
            out[name] = VOCAB - 1
        elif name.endswith("_token_id") and isinstance(value, list):
            out[name] = [v if v < VOCAB else VOCAB - 1 for v in value if isinstance(v, int)]
        elif name == "is_decoder" and value is False:
            out[name] = True
    for name in _PER_LAYER_LISTS:
        if isinstance(values.get(name), list) and len(values[name]) > LAYERS:
            out[name] = values[name][:LAYERS] if name == "layer_types" else [i for i in values[name] if i < LAYERS]
    for name in getattr(default, "sub_configs", {}) or {}:
        sub = getattr(default, name, None)
        if sub is not None and hasattr(sub, "to_dict"):
            out[name] = {**sub.to_dict(), **_shrink(sub)}
    return out


#: A tiny model has fewer parameters than this (a config that ignores the tiny sizes is a "cannot build" row).
MAX_PARAMETERS = 5_000_000


# -- building and claims ----------------------------------------------------------------------------------------------

def registry() -> list[str]:
    """Every causal-LM model type of ``transformers``' registry, sorted."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def optimizer_of(model_type: str, layout: str) -> str:
    """SGD with momentum and AdamW alternated over the cells (by the cell's position in the table)."""
    index = registry().index(model_type) + LAYOUTS.index(layout)
    return ("sgd", "adamw")[index % 2]


def make_model(model_type: str, optimizer: str, config: dict[str, Any] | None = None) -> Any:
    """The tiny :class:`~lightning_par.hf.HFCausalLM`, seeded: every rank and the reference build the same weights."""
    from lightning_par.hf import HFCausalLM

    torch.manual_seed(0)
    lr = {"sgd": 0.1, "adamw": ADAM_LR}[optimizer]
    return HFCausalLM(model_type=model_type, config=tiny_config(model_type) if config is None else config,
                      optimizer=optimizer, learning_rate=lr, adam_eps=ADAM_EPS)


def _reason(err: BaseException) -> str:
    text = f"{type(err).__name__}: {err}".strip().splitlines()[0]
    return text[:240]


def claimed_layouts(model: Any) -> list[str]:
    """The layouts the model claims (see the module docstring), from its config and modules."""
    network = model.model
    # tp and pp are offered to every model (a plan of its own, the project's plan for its family, or one derived from
    # its module tree): without a plan a cell is a refusal before start or a PASS, never left out of the matrix
    claims = ["zero3", "tp2", "tp2sp", "pp2"]
    if getattr(network, "_supports_attention_backend", False):
        claims.append("cp2")
    if any(name.rsplit(".", 1)[-1] == "experts" for name, _ in network.named_modules()):
        claims.append("ep2")
    return claims


def probe(model_type: str) -> dict[str, Any]:
    """Build the tiny model and run one one-process training step: ``{"claims": [...]}`` or ``{"cannot": reason}``."""
    try:
        config = tiny_config(model_type)
    except Exception as err:  # noqa: BLE001 - every failure is a row of the table
        return {"cannot": f"config: {_reason(err)}"}
    try:
        from transformers import AutoConfig, AutoModelForCausalLM

        with torch.device("meta"):
            meta = AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **config))
        count = sum(p.numel() for p in meta.parameters())
        if count > MAX_PARAMETERS:
            return {"cannot": f"build: not tiny: {count / 1e6:.0f}M parameters from the tiny config"}
        model = make_model(model_type, "sgd", config)
    except Exception as err:  # noqa: BLE001
        return {"cannot": f"build: {_reason(err)}"}
    try:
        x = torch.randint(0, VOCAB, (2, SEQ))
        loss = model.training_step((x, x), 0)
        if not torch.isfinite(loss):
            return {"cannot": f"one process: loss {float(loss)}"}
        loss.backward()
    except Exception as err:  # noqa: BLE001
        return {"cannot": f"one process: {_reason(err)}"}
    return {"claims": claimed_layouts(model)}


# -- the runs ---------------------------------------------------------------------------------------------------------

def dataset() -> TokenDataset:
    return TokenDataset(n=MICRO * 2 * STEPS, seq=SEQ, vocab=VOCAB)


def _strategy(layout: str) -> Any:
    from lightning.pytorch.strategies import StrategyRegistry

    name, options = STRATEGIES[layout]
    entry = StrategyRegistry[name]
    return entry["strategy"](**{**entry["init_params"], "timeout_s": 90, **options})


def layout_worker(layout: str, model_types: list[str], data: TokenDataset, progress: str) -> None:
    """Body of one rank: fit every model type under ``layout`` in turn, in one process group, saving each record to
    ``progress/<model_type>.rank<rank>.pt``. A failure of one model is recorded (``error``, ``started``: whether a
    training batch began) and the next one runs.

    A rank that raises where its peer does not would leave the peer in a collective: the collectives' timeout
    (``timeout_s`` of the strategy) turns that into an error on the peer, recorded the same way.
    """
    import lightning as L

    from lightning_par.parallel_dims import ParallelDims

    class Started(L.Callback):
        def __init__(self) -> None:
            self.started = False

        def on_train_batch_start(self, *args: Any) -> None:
            self.started = True

    env = dict(os.environ)
    torch.set_num_threads(1)
    rank, world = int(env["RANK"]), int(env["WORLD_SIZE"])
    from lightning_par.fault.heartbeat import HeartbeatCallback, beat

    for index, model_type in enumerate(model_types):
        os.environ.clear()
        os.environ.update(env)  # Lightning's teardown removes WORLD_SIZE and friends after each fit
        beat(index, "setup")  # the launcher's watchdog ends a launch that stops progressing (a model that hangs)
        os.environ["MASTER_PORT"] = _shared_port(progress, index, rank)
        t0 = time.perf_counter()
        started, recorder = Started(), LossRecorder()
        strategy = None
        try:
            strategy = _strategy(layout)
            dims: ParallelDims = strategy.resolve_parallel_dims(world)
            coords = dims.coordinates(rank)
            sampler = DistributedSampler(data, num_replicas=dims.dp_size, rank=coords["dp"], shuffle=False)
            loader = DataLoader(data, batch_size=MICRO, sampler=sampler, drop_last=True)
            trainer = quiet_trainer(strategy, world, max_steps=STEPS, limit_val_batches=0,
                                    callbacks=[recorder, started, HeartbeatCallback()])
            trainer.fit(make_model(model_type, optimizer_of(model_type, layout)), loader)
            last_pp = coords["pp"] == dims.pp_size - 1
            record = {"losses": recorder.losses if last_pp else None, "dp": dims.dp_size,
                      "state": strategy.full_state_dict(), "seconds": time.perf_counter() - t0}
        except BaseException as err:  # noqa: BLE001 - recorded per model; the next one runs
            if isinstance(err, KeyboardInterrupt):
                raise
            record = {"error": _reason(err), "value_error": isinstance(err, ValueError),
                      "started": started.started, "trace": traceback.format_exc()[-3000:],
                      "seconds": time.perf_counter() - t0}
            _reset_process_group()
        torch.save(record, os.path.join(progress, f"{model_type}.rank{rank}.pt"))
        _wait_for_peers(progress, model_type, world)


def _shared_port(progress: str, index: int, rank: int) -> str:
    """A fresh rendezvous port per model, chosen by rank 0 and read by the others from ``progress``.

    On the same port, the next model's ``init_process_group`` on rank 1 met rank 0's previous store, still alive, and
    passed the rendezvous alone: rank 1 waited in the first broadcast and rank 0 in ``init_process_group`` for good
    (py-spy, batched zero3 launch)."""
    from lightning_par.launcher import find_free_port

    path = os.path.join(progress, f"port-{index}")
    if rank == 0:
        with open(path + ".tmp", "w") as f:
            f.write(str(find_free_port()))
        os.replace(path + ".tmp", path)
    while not os.path.exists(path):
        time.sleep(0.05)
    with open(path) as f:
        return f.read().strip()


def _wait_for_peers(progress: str, model_type: str, world: int) -> None:
    """Start the next model only when every rank has finished this one, its teardown included (a file barrier: the
    process group is gone), with :func:`_shared_port` against batched launches hanging at a model's set-up."""
    while not all(os.path.exists(os.path.join(progress, f"{model_type}.rank{r}.pt")) for r in range(world)):
        time.sleep(0.05)


def _reset_process_group() -> None:
    """After a failed fit, leave no process group behind (the next fit initialises its own)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        try:
            dist.destroy_process_group()
        except Exception:  # noqa: BLE001
            pass


def run_layout(layout: str, model_types: list[str], timeout_s: float = 3000) -> dict[str, list[dict[str, Any]]]:
    """:func:`_run_batch`, then each model type that crashed or hung after start in the batch once more alone: its
    result alone is the verdict. (Batched launches on a loaded machine hung now and then at a model that trains alone,
    after an earlier model's failure; a real crash or hang repeats alone.)"""
    out = _run_batch(layout, model_types, timeout_s)
    if len(model_types) > 1:
        for mt in model_types:
            if any("error" in r and r["started"] and not r["value_error"] for r in out[mt]):
                out[mt] = _run_batch(layout, [mt], timeout_s)[mt]
    return out


def _run_batch(layout: str, model_types: list[str], timeout_s: float) -> dict[str, list[dict[str, Any]]]:
    """Every model type under ``layout`` in one launch of 2 ranks: ``{model_type: [rank 0's record, rank 1's]}``.

    Each rank saves its record of a model type as soon as it is done. A model type that kills the launch (a rank
    aborted in native code, no progress for :data:`WATCHDOG_S`, or the world past ``timeout_s``) gets a crash record
    on both ranks, and the model types after it run in a new launch.
    """
    import tempfile

    from lightning_par.launcher import DistributedRunError, LauncherSignalled, run_distributed

    out: dict[str, list[dict[str, Any]]] = {}
    remaining = list(model_types)
    while remaining:
        with tempfile.TemporaryDirectory(prefix="hf_matrix_") as progress:
            try:
                run_distributed(layout_worker, 2, (layout, remaining, dataset(), progress), timeout_s=timeout_s,
                                watchdog_s=WATCHDOG_S, startup_grace_s=WATCHDOG_S)
                crashed = None
            except LauncherSignalled:
                raise
            except DistributedRunError as err:
                crashed = err
            done = []
            for mt in remaining:
                paths = [os.path.join(progress, f"{mt}.rank{r}.pt") for r in range(2)]
                if not all(os.path.exists(p) for p in paths):
                    break
                out[mt] = [torch.load(p, weights_only=False) for p in paths]
                done.append(mt)
            remaining = remaining[len(done):]
            if remaining:
                if crashed is None:
                    raise RuntimeError(f"{layout}: the ranks returned without records of {remaining}")
                record = {"error": f"the process died: {_reason(crashed)}", "value_error": False, "started": True,
                          "seconds": 0.0}
                out[remaining[0]] = [record, record]
                remaining = remaining[1:]
    return out


_REFERENCES: dict[tuple[str, str, int], tuple[list[float], dict[str, torch.Tensor]]] = {}


def reference(model_type: str, optimizer: str, dp: int) -> tuple[list[float], dict[str, torch.Tensor]]:
    """One process, the same global batches (``MICRO * dp`` samples per step, in order), cached."""
    from tests.support.pipeline import one_thread

    key = (model_type, optimizer, dp)
    if key not in _REFERENCES:
        with one_thread():
            _REFERENCES[key] = reference_fit(lambda: make_model(model_type, optimizer), dataset(), MICRO * dp, STEPS)
    return _REFERENCES[key]


def judge(model_type: str, layout: str, runs: list[dict[str, Any]]) -> dict[str, Any]:
    """A cell's verdict from both ranks' records: ``{"status": "PASS"|"refused"|"FAIL", "detail": ...}``.

    PASS: every step's global loss within rel :data:`RTOL` of one process, and every parameter within
    ``assert_params_close``'s bound (rel 1e-5 plus 1e-5 absolute, see :func:`tests.support.helpers.assert_params_close`; the
    cells of :data:`PARAM_ATOL` under AdamW: their measured absolute bound).
    refused: a ``ValueError`` on a rank before its first training batch (its message), and no rank finished. Anything
    else is FAIL with the measured relative errors or the error.
    """
    errors = [r for r in runs if "error" in r]
    if errors:
        first = next((r for r in errors if r["value_error"] and not r["started"]), errors[0])
        if first["value_error"] and not first["started"] and len(errors) == len(runs):
            return {"status": "refused", "detail": first["error"]}
        return {"status": "FAIL", "detail": f"crashed after start: {first['error']}"}
    dp = runs[0]["dp"]
    ref_losses, ref_params = reference(model_type, optimizer_of(model_type, layout), dp)
    reporting = [r["losses"] for r in runs if r["losses"] is not None]
    losses = [sum(step) / len(step) for step in zip(*reporting)]
    if len(losses) != STEPS:
        return {"status": "FAIL", "detail": f"{len(losses)} losses for {STEPS} steps"}
    loss_rel = max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses))
    state = runs[0]["state"]
    if sorted(state) != sorted(ref_params):
        return {"status": "FAIL", "detail": f"parameter names differ: {sorted(set(state) ^ set(ref_params))[:4]}"}
    param_ok, worst, worst_name = True, 0.0, ""
    atol = PARAM_ATOL.get((model_type, layout), 1e-5) if optimizer_of(model_type, layout) == "adamw" else 1e-5
    for name, expected in ref_params.items():
        actual = state[name]
        if not torch.allclose(actual, expected, rtol=RTOL, atol=atol):
            param_ok = False
        rel = float((actual - expected).abs().max())
        if rel > worst:
            worst, worst_name = rel, name
    detail = f"loss rel {loss_rel:.1e}, params max abs diff {worst:.1e} ({worst_name})"
    if loss_rel <= RTOL and param_ok and all(math.isfinite(v) for v in losses):
        return {"status": "PASS", "detail": detail}
    return {"status": "FAIL", "detail": f"wrong numbers: {detail}; losses {[round(v, 6) for v in losses]} vs "
                                        f"{[round(v, 6) for v in ref_losses]}"}


# -- the table --------------------------------------------------------------------------------------------------------

def probe_all(model_types: list[str], cache: str | None = None) -> dict[str, dict[str, Any]]:
    """:func:`probe` of every model type, read from / written to the JSON file ``cache`` when given."""
    import json

    if cache and os.path.exists(cache):
        with open(cache) as f:
            found = json.load(f)
        if all(mt in found for mt in model_types):
            return {mt: found[mt] for mt in model_types}
    found = {mt: probe(mt) for mt in model_types}
    if cache:
        with open(cache, "w") as f:
            json.dump(found, f, indent=1)
    return found


def run_matrix(model_types: list[str] | None = None, layouts: tuple[str, ...] = LAYOUTS,
               log: Any = None, probes: str | None = None) -> dict[str, dict[str, Any]]:
    """Every architecture's row: ``{model_type: {"cannot": reason} | {"claims": [...], layout: verdict or None}}``
    (``None``: not claimed, or not run here)."""
    model_types = registry() if model_types is None else model_types
    rows: dict[str, dict[str, Any]] = {}
    for mt, found in probe_all(model_types, probes).items():
        rows[mt] = {"cannot": found["cannot"]} if "cannot" in found else {"claims": found["claims"],
                                                                          **{l: None for l in LAYOUTS}}
    for layout in layouts:
        members = [mt for mt in model_types if layout in rows[mt].get("claims", ())]
        t0 = time.perf_counter()
        try:
            results = run_layout(layout, members)
        except Exception as err:  # noqa: BLE001 - the whole launch failed: every cell says so
            results = {mt: None for mt in members}
            launch_error = _reason(err)
        for mt in members:
            runs = results[mt]
            rows[mt][layout] = (judge(mt, layout, runs) if runs is not None
                                else {"status": "FAIL", "detail": f"launch failed: {launch_error}"})
            if runs is not None:
                rows[mt][layout]["seconds"] = round(max(r["seconds"] for r in runs), 1)
            if log is not None:
                print(f"{layout:6s} {mt:28s} {rows[mt][layout]['status']:8s} {rows[mt][layout]['detail'][:200]}",
                      file=log, flush=True)
        if log is not None:
            print(f"# {layout}: {len(members)} architectures in {time.perf_counter() - t0:.0f} s", file=log,
                  flush=True)
    return rows


def merge(parts: list[dict[str, dict[str, Any]]]) -> dict[str, dict[str, Any]]:
    """Rows of runs over disjoint cells (layouts or model types) as one table."""
    rows: dict[str, dict[str, Any]] = {}
    for part in parts:
        for mt, row in part.items():
            into = rows.setdefault(mt, dict(row))
            for key, value in row.items():
                if value is not None:
                    into[key] = value
    return dict(sorted(rows.items()))


def _short(text: str, width: int) -> str:
    text = text.replace("|", "/").replace("\n", " ")
    for prefix in ("ValueError: ", "wrong numbers: "):
        text = text.replace(prefix, "")
    return text if len(text) <= width else text[: width - 1] + "…"


def _cell(verdict: dict[str, Any] | None) -> str:
    if verdict is None:
        return "–"
    if verdict["status"] == "PASS":
        return "PASS"
    return f"{verdict['status']}: {_short(verdict['detail'], 80)}"


def markdown(rows: dict[str, dict[str, Any]]) -> str:
    """The architecture x layout table (``–``: the layout is not claimed by the model)."""
    import transformers

    lines = [f"transformers {transformers.__version__}, torch {torch.__version__}; 2 ranks (gloo, CPU), fp32, "
             f"{STEPS} steps, rel <= {RTOL}.", "",
             "| model_type | " + " | ".join(LAYOUTS) + " |", "|---|" + "---|" * len(LAYOUTS)]
    for mt, row in rows.items():
        if "cannot" in row:
            lines.append(f"| {mt} | cannot build: {_short(row['cannot'], 110)} |" + " |" * (len(LAYOUTS) - 1))
        else:
            lines.append(f"| {mt} | " + " | ".join(
                "not run" if row.get(l) is None and l in row.get("claims", ()) else _cell(row.get(l)) for l in LAYOUTS
            ) + " |")
    counts: dict[str, int] = {}
    for row in rows.values():
        if "cannot" in row:
            counts["cannot build"] = counts.get("cannot build", 0) + 1
            continue
        for l in LAYOUTS:
            if row.get(l) is not None:
                counts[row[l]["status"]] = counts.get(row[l]["status"], 0) + 1
    lines += ["", "Totals: " + ", ".join(f"{k} {v}" for k, v in sorted(counts.items()))]
    return "\n".join(lines)


#: The docs page holding the table, between these markers (``--docs``).
DOCS_PAGE = Path(__file__).resolve().parents[2] / "docs" / "huggingface.md"
_BEGIN, _END = "<!-- hf-matrix:begin -->", "<!-- hf-matrix:end -->"


def write_docs(table: str, path: Path = DOCS_PAGE) -> None:
    """Put ``table`` (:func:`markdown`) between the markers of the docs page."""
    text = path.read_text()
    head, tail = text[: text.index(_BEGIN) + len(_BEGIN)], text[text.index(_END) :]
    path.write_text(f"{head}\n{table}\n{tail}")


def main(argv: list[str] | None = None) -> None:
    """``python -m tests.support.hf_matrix [--markdown] [--docs] [--json PATH] [--layouts zero3,tp2] [--probes PATH]
    [--merge A.json B.json ...] [MODEL_TYPE ...]``."""
    import argparse
    import json
    import sys
    import warnings

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model_types", nargs="*", help="model types (default: the whole registry)")
    parser.add_argument("--layouts", default=",".join(LAYOUTS))
    parser.add_argument("--markdown", action="store_true", help="print the table as markdown")
    parser.add_argument("--docs", action="store_true", help="write the table into docs/huggingface.md")
    parser.add_argument("--json", help="write the rows as JSON here")
    parser.add_argument("--probes", help="a JSON file caching each architecture's build (read if present)")
    parser.add_argument("--merge", nargs="+", help="JSON files of earlier runs to merge into one table (runs nothing)")
    args = parser.parse_args(argv)
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    if args.merge:
        parts = []
        for path in args.merge:
            with open(path) as f:
                parts.append(json.load(f))
        rows = merge(parts)
    else:
        layouts = tuple(l for l in args.layouts.split(",") if l)
        for l in layouts:
            if l not in LAYOUTS:
                raise SystemExit(f"--layouts: {l!r} is not valid: expected some of {LAYOUTS}")
        with quiet():
            rows = run_matrix(args.model_types or None, layouts, log=sys.stderr, probes=args.probes)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    if args.markdown:
        print(markdown(rows))
    if args.docs:
        write_docs(markdown(rows))


if __name__ == "__main__":
    main()
