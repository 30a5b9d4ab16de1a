"""The GPU check: one call on a machine with one NVIDIA GPU (``scripts/gpu_check.sh``), under 8 minutes.

It trains a ~1B-parameter Llama-shaped model (Hugging Face ``LlamaForCausalLM`` built from a config, random weights:
16 layers x 2048, SwiGLU 8192, 32 heads with 8 key/value heads, vocabulary 32000; 1.1 B parameters) in bf16
(``precision="bf16-mixed"``: bf16 autocast, fp32 master weights and AdamW state) at sequence length 2048, through
Lightning's ``Trainer``, in six rows:

=========  ==================================================================================================
layout     ``plain``: Lightning's own single-device strategy; ``zero3``: lightning_par's ``ZeroStrategy(stage=3)`` at
           world 1 (FSDP2 per decoder layer, nccl process group of one rank)
mode       ``eager``; ``compiled``: every decoder layer compiled on its own (:func:`compile_blocks`);
           ``compiled+float8``: the same after torchao float8 (tensorwise) on every linear layer but the LM head
           (``strategy.float8`` under zero3, with the float8 all-gather; :func:`lightning_par.float8.convert_float8`
           on the plain network)
=========  ==================================================================================================

and reports, for each, **tokens/s** (``batch * seq * steps`` over the timed steps' wall time, the GPU synchronised at
both ends), **MFU** (``flops_per_token * tokens/s`` over the GPU's bf16 dense peak from Lightning's table;
``flops_per_token = 6 N + 12 n_layer hidden seq``, PaLM, Chowdhery et al. 2022, App. B; float8 rows are counted
against the same bf16 peak, as torchtitan reports them) and **peak memory** (``torch.cuda.max_memory_allocated``
over the timed steps), with the graphs dynamo compiled (one per distinct layer class and mode: the layers share
theirs) and the float8 layers, so a row that silently did not compile or convert shows it. Each row runs in its own process (a clean allocator and process group), with a time limit.

``--layouts`` runs the other part of the check (:func:`run_layouts`): one short fit (two optimizer steps) of every
layout of :data:`LAYOUTS` with two ranks (four for HSDP) on the **one** GPU, each rank a node of one device on
``cuda:0`` under the backend map ``cuda:gloo``: NCCL refuses two ranks on one device, and a map without a ``cpu``
entry keeps NCCL's device rule (a CPU tensor in a collective raises ``No backend type associated with device type
cpu``) while gloo moves the CUDA tensors through the host. Each layout is one launch with its own time limit; the
output is one Markdown table. ``--layouts --dry-run`` runs the same on the CPU (gloo, every rank on the CPU).

After the throughput table, the MoE row (:func:`moe_table`): one MoE block at 64 experts, ``torch._grouped_mm``
against the per-expert loop in bf16 (issue 49), with the ratio.

``--dry-run`` runs every piece on the CPU with a tiny Llama (2 layers x 64, sequence 64, 2 timed steps, compiled with
``backend="aot_eager"``), in this process: the tests run it, so the GPU path is the same code with other sizes.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

__all__ = ["LAYOUTS", "LLAMA_1B", "LLAMA_TINY", "MOE_GPU", "ROWS", "RowResult", "compile_blocks", "flops_per_token",
           "main", "markdown", "measure_row", "moe_table", "run_layouts", "sync_worker"]

#: ~1B Llama shape (Llama 3.2 1B's layers with a 32000-token vocabulary and an untied head): 1.10e9 parameters.
LLAMA_1B: dict[str, Any] = dict(
    hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
    vocab_size=32000, max_position_embeddings=2048, rope_theta=500000.0, tie_word_embeddings=False,
)
#: The dry run's shape (every dimension a multiple of 16 for float8).
LLAMA_TINY: dict[str, Any] = dict(
    hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
    vocab_size=256, max_position_embeddings=64, tie_word_embeddings=False,
)
#: (layout, mode) in table order.
ROWS: tuple[tuple[str, str], ...] = tuple(
    (layout, mode) for layout in ("plain", "zero3") for mode in ("eager", "compiled", "compiled+float8")
)


@dataclass
class RowResult:
    """One row's figures (``None`` where the device has none: MFU and memory on the CPU)."""

    layout: str
    mode: str
    params: int
    tokens_per_s: float
    step_s: float
    mfu: float | None
    peak_mem_gib: float | None
    loss: float
    compiled_graphs: int = 0
    float8_layers: int = 0
    error: str | None = None


def flops_per_token(config: dict[str, Any], seq: int, params_no_embedding: int) -> float:
    """Training FLOPs per token: ``6 N + 12 n_layer hidden seq`` (PaLM, App. B), ``N`` without the embedding."""
    return float(6 * params_no_embedding + 12 * config["num_hidden_layers"] * config["hidden_size"] * seq)


def compile_blocks(network: Any, backend: str = "inductor") -> int:
    """Compile each decoder layer of ``network`` on its own: the layer's ``forward`` becomes one compiled function
    shared by every layer (the layer passed as an argument, so dynamo traces one graph for all of them, its
    parameters inputs), while the module hooks of FSDP2 or a reducer stay outside the graph (they run in
    ``nn.Module.__call__``, around ``forward``). Lazy: the graph is traced at the first call, after any float8
    conversion or sharding.

    Returns:
        The number of layers compiled.
    """
    import torch

    from lightning_par import contract

    paths = contract.checkpoint_modules(network, "full")
    compiled: dict[type, Any] = {}
    for path in paths:
        layer = network.get_submodule(path)
        cls = type(layer)
        fn = compiled.setdefault(cls, torch.compile(cls.forward, backend=backend))
        layer.forward = functools.partial(fn, layer)
    return len(paths)


def _module(config: dict[str, Any]) -> Any:
    from lightning_par.hf import HFCausalLM

    return HFCausalLM(model_type="llama", config=config, learning_rate=3e-4)


class _Timer:
    """A Lightning callback timing the optimizer steps after ``warmup``, the device synchronised at both ends."""

    def __new__(cls, warmup: int, device: Any) -> Any:
        import lightning as L
        import torch

        class Timer(L.Callback):
            def __init__(self) -> None:
                self.start = None
                self.end = None
                self.loss = float("nan")

            def _sync(self) -> None:
                if device.type == "cuda":
                    torch.cuda.synchronize(device)

            def on_train_batch_start(self, trainer: Any, *args: Any) -> None:
                if trainer.global_step == warmup and self.start is None:
                    self._sync()
                    if device.type == "cuda":
                        torch.cuda.reset_peak_memory_stats(device)
                    self.start = time.perf_counter()

            def on_train_batch_end(self, trainer: Any, module: Any, outputs: Any, *args: Any) -> None:
                loss = outputs["loss"] if isinstance(outputs, dict) else outputs
                self.loss = float(loss.detach())
                self._sync()
                self.end = time.perf_counter()

        return Timer()


def measure_row(layout: str, mode: str, *, config: dict[str, Any], seq: int, batch: int, steps: int, warmup: int,
                device: str, backend: str = "inductor") -> RowResult:
    """Train ``warmup + steps`` steps of one row and return its figures (see the module docstring)."""
    import lightning as L
    import torch
    from lightning.fabric.utilities.throughput import get_available_flops
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_par.float8 import Float8Options, convert_float8

    if (layout, mode) not in ROWS:
        raise ValueError(f"row {layout}:{mode} is not valid: expected one of {[f'{a}:{b}' for a, b in ROWS]}.")
    torch.manual_seed(0)
    dev = torch.device(device)
    module = _module(config)
    network = module.model
    float8 = mode.endswith("float8")
    params = sum(p.numel() for p in network.parameters())
    embedding = network.get_input_embeddings().weight.numel()
    if layout == "plain":
        strategy: Any = "auto"
        if float8:
            convert_float8(network, Float8Options(enabled=True))
    else:
        from lightning_par.strategies import ZeroStrategy

        strategy = ZeroStrategy(stage=3, float8={"enabled": float8}, timeout_s=600)
    if mode != "eager":
        compile_blocks(network, backend)
    g = torch.Generator().manual_seed(0)
    total = warmup + steps
    tokens = torch.randint(0, config["vocab_size"], (batch * total, seq + 1), generator=g)
    loader = DataLoader(TensorDataset(tokens[:, :-1], tokens[:, 1:]), batch_size=batch, shuffle=False)
    timer = _Timer(warmup, dev)
    trainer = L.Trainer(
        accelerator=dev.type, devices=1, strategy=strategy, precision="bf16-mixed", max_steps=total,
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        num_sanity_val_steps=0, limit_val_batches=0, callbacks=[timer], use_distributed_sampler=False,
    )
    from lightning_par.compat import dynamo_counters

    counters = dynamo_counters()
    graphs_before = counters["stats"]["unique_graphs"]
    trainer.fit(module, loader)
    elapsed = timer.end - timer.start
    tokens_per_s = batch * seq * steps / elapsed
    peak = get_available_flops(dev, torch.bfloat16) if dev.type == "cuda" else None
    fpt = flops_per_token(config, seq, params - embedding)
    return RowResult(
        layout=layout, mode=mode, params=params, tokens_per_s=tokens_per_s, step_s=elapsed / steps,
        mfu=fpt * tokens_per_s / peak if peak else None,
        peak_mem_gib=torch.cuda.max_memory_allocated(dev) / 2**30 if dev.type == "cuda" else None,
        loss=timer.loss,
        compiled_graphs=counters["stats"]["unique_graphs"] - graphs_before,
        float8_layers=sum(type(m).__name__ == "Float8Linear" for m in module.modules()),
    )


def markdown(results: list[RowResult], header: str) -> str:
    """The table: one line per row, tokens/s also as a ratio to the same layout's eager row."""
    lines = [header, "", "| layout | mode | params | tokens/s | / eager | MFU | step (s) | peak memory (GiB) | loss | "
             "graphs | float8 layers |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    eager = {r.layout: r.tokens_per_s for r in results if r.mode == "eager" and r.error is None}
    for r in results:
        if r.error is not None:
            lines.append(f"| {r.layout} | {r.mode} | - | FAILED | - | - | - | - | - | - | {r.error} |")
            continue
        ratio = f"{r.tokens_per_s / eager[r.layout]:.2f}" if r.layout in eager else "-"
        mfu = f"{r.mfu:.1%}" if r.mfu is not None else "-"
        mem = f"{r.peak_mem_gib:.1f}" if r.peak_mem_gib is not None else "-"
        lines.append(f"| {r.layout} | {r.mode} | {r.params / 1e9:.2f}B | {r.tokens_per_s:.0f} | {ratio} | {mfu} | "
                     f"{r.step_s:.3f} | {mem} | {r.loss:.4f} | {r.compiled_graphs} | {r.float8_layers} |")
    return "\n".join(lines)


def _axis_layouts() -> dict[str, tuple[int, str, str, dict[str, Any]]]:
    """The layouts the axes' own benchmarks add to the two-rank part: a module-level ``GPU_CHECK_LAYOUTS`` in any
    module of :mod:`lightning_par.benchmarks` (an axis's options are named in its own folder and benchmark only)."""
    import importlib
    import pkgutil

    import lightning_par.benchmarks as benchmarks

    out: dict[str, tuple[int, str, str, dict[str, Any]]] = {}
    for info in pkgutil.iter_modules(benchmarks.__path__):
        if info.name != "gpu_check":
            out.update(getattr(importlib.import_module(f"{benchmarks.__name__}.{info.name}"), "GPU_CHECK_LAYOUTS", {}))
    return out


#: The two-rank part: layout name -> (ranks, model: ``"gpt"`` or ``"moegpt"``, strategy registry name, options).
LAYOUTS: dict[str, tuple[int, str, str, dict[str, Any]]] = {
    "ddp_overlap": (2, "gpt", "ddp_overlap", {}),
    "zero1": (2, "gpt", "parallel_3d", {"dp_mode": "zero1"}),
    "zero2": (2, "gpt", "parallel_3d", {"dp_mode": "zero2"}),
    "zero3": (2, "gpt", "parallel_3d", {"dp_mode": "zero3"}),
    "hsdp2x2-zero3": (4, "gpt", "parallel_3d", {"dp_replicate_size": 2, "dp_shard_size": 2, "dp_mode": "zero3"}),
    "tp2-sp": (2, "gpt", "parallel_3d", {"tp_size": 2, "sequence_parallel": True}),
    "pp2-1f1b": (2, "gpt", "parallel_3d", {"pp_size": 2, "schedule": "1f1b", "num_microbatches": 4}),
    "pp2-interleaved_1f1b": (2, "gpt", "parallel_3d", {"pp_size": 2, "schedule": "interleaved_1f1b",
                                                       "num_microbatches": 4}),
    "pp2-zbv_zero_bubble": (2, "gpt", "parallel_3d", {"pp_size": 2, "schedule": "zbv_zero_bubble",
                                                      "num_microbatches": 4}),
    **_axis_layouts(),  # the layouts an axis's own benchmark names (the context-parallel methods)
    "ep2": (2, "moegpt", "parallel_3d", {"ep_size": 2}),
}


def _layout_worker(name: str, accelerator: str, backend: str, steps: int, count_syncs: bool = False) -> dict[str, Any]:
    """One rank of one layout: every rank a node of one device (``devices=1``, ``num_nodes=world``), so that two
    ranks share the one GPU. With ``count_syncs``, the last step runs under
    :class:`~lightning_par.profiling.host_syncs.SyncRecorder` (CUDA's sync debug mode ``"warn"`` on a GPU) and the
    result holds ``"syncs"``: its synchronisations by site (:func:`~lightning_par.profiling.host_syncs.count_syncs`)."""
    import lightning as L
    import torch
    from lightning.pytorch.strategies import StrategyRegistry
    from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

    from lightning_par.models import GPTConfig, GPTLightningModule

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    os.environ.update(NODE_RANK=str(rank), LOCAL_RANK="0", LOCAL_WORLD_SIZE="1")
    torch.set_num_threads(1)
    _, model, registry_name, options = LAYOUTS[name]
    torch.manual_seed(0)
    moe = {"num_experts": 4, "moe_every": 2} if model == "moegpt" else {}
    config = GPTConfig(n_layer=4, n_head=2, n_embd=32, block_size=16, vocab_size=256, dropout=0.0, **moe)
    module = GPTLightningModule(config, learning_rate=3e-3)
    entry = StrategyRegistry[registry_name]
    strategy = entry["strategy"](**{**entry["init_params"], "timeout_s": 60, "process_group_backend": backend,
                                    **options})
    dims = strategy.resolve_parallel_dims(world)
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, config.vocab_size, (8 * dims.dp_size * steps, config.block_size + 1), generator=g)
    data = TensorDataset(tokens[:, :-1], tokens[:, 1:])
    sampler = DistributedSampler(data, num_replicas=dims.dp_size, rank=dims.coordinates(rank)["dp"], shuffle=False)
    recorder = _LastStepSyncs(steps, cuda=accelerator == "cuda") if count_syncs else None
    trainer = L.Trainer(
        accelerator=accelerator, devices=1, num_nodes=world, strategy=strategy, max_steps=steps, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
        limit_val_batches=0, use_distributed_sampler=False, callbacks=[recorder] if recorder is not None else None,
    )
    start = time.perf_counter()
    trainer.fit(module, DataLoader(data, batch_size=8, sampler=sampler, drop_last=True))
    loss = trainer.callback_metrics.get("train_loss")
    out = {"loss": float(loss) if loss is not None else float("nan"), "seconds": time.perf_counter() - start,
           "device": str(strategy.root_device), "backend": str(dist_backend()),
           "gpu": torch.cuda.get_device_name(0) if accelerator == "cuda" else "CPU"}
    if recorder is not None:
        from lightning_par.profiling.host_syncs import count_syncs as count

        if recorder.events is None:
            raise RuntimeError(f"{name}: the last step ({steps}) never ran, so no synchronisation was counted")
        out["syncs"] = dict(count(recorder.events))
    return out


class _LastStepSyncs:
    """A Lightning callback: the last training step (batch start to batch end, the optimizer step included) under a
    :class:`~lightning_par.profiling.host_syncs.SyncRecorder`; ``events`` its warnings (``None`` until it ran)."""

    def __new__(cls, steps: int, cuda: bool) -> Any:
        import lightning as L

        from lightning_par.profiling.host_syncs import SyncRecorder

        class LastStepSyncs(L.Callback):
            def __init__(self) -> None:
                self.events: list[Any] | None = None
                self._rec: SyncRecorder | None = None

            def on_train_batch_start(self, trainer: Any, *args: Any) -> None:
                if trainer.global_step == steps - 1:
                    self._rec = SyncRecorder(cuda=cuda).__enter__()

            def on_train_batch_end(self, trainer: Any, *args: Any) -> None:
                if self._rec is not None:
                    self._rec.__exit__(None, None, None)
                    self.events, self._rec = self._rec.events, None

        return LastStepSyncs()


def sync_worker(names: list[str], accelerator: str, backend: str, steps: int = 2) -> list[dict[str, Any]]:
    """One rank of the host-sync count (``tests/profiling/test_host_syncs_gpu.py``): each layout of ``names`` (all of one world
    size) in turn in this process group, its last step's synchronisations counted (``_layout_worker(...,
    count_syncs=True)``); a layout's exception is returned as its ``"error"``, and the next layout runs."""
    env = dict(os.environ)
    results = []
    for name in names:
        os.environ.clear()
        os.environ.update(env)  # Lightning's teardown removes WORLD_SIZE and friends after each fit
        try:
            out = _layout_worker(name, accelerator, backend, steps, count_syncs=True)
            results.append({"name": name, "error": None, "syncs": out["syncs"], "device": out["device"],
                            "backend": out["backend"], "gpu": out["gpu"]})
        except Exception as err:  # noqa: BLE001 - the test reports it, by layout
            results.append({"name": name, "error": f"{type(err).__name__}: {err}"[:1500], "syncs": {}})
    return results


def measure_syncs(dry_run: bool = False, timeout_s_per_layout: float = 15.0) -> dict[str, list[dict[str, Any]]]:
    """Every layout of :data:`LAYOUTS` for two steps, the second's synchronisations counted by site on every rank
    (:func:`sync_worker`): one spawned launch per world size on the one GPU under ``cuda:gloo`` (the CPU under gloo
    with ``dry_run``, where nothing is counted: it checks the path). Returns ``{layout: [result of rank 0, ...]}``."""
    from lightning_par.launcher import run_distributed

    accelerator, backend = ("cpu", "gloo") if dry_run else ("cuda", "cuda:gloo")
    out: dict[str, list[dict[str, Any]]] = {}
    for world in sorted({layout[0] for layout in LAYOUTS.values()}):
        names = [n for n, layout in LAYOUTS.items() if layout[0] == world]
        per_rank = run_distributed(sync_worker, world, (names, accelerator, backend, 2),
                                   timeout_s=30 + timeout_s_per_layout * len(names),
                                   start_method=None if dry_run else "spawn")
        for i, name in enumerate(names):
            out[name] = [per_rank[r][i] for r in range(world)]
    return out


def sync_table(measured: dict[str, list[dict[str, Any]]]) -> tuple[str, bool]:
    """The Markdown table of :func:`measure_syncs` (per layout and rank: the package's synchronisations by site, the
    others', and whether they are within ``docs/host-syncs.md``) and whether every row is."""
    from lightning_par.profiling.host_syncs import check_counts, expected_syncs, step_facts

    lines = ["| layout | rank | package syncs (site: count) | other | within docs/host-syncs.md |",
             "|---|---|---|---|---|"]
    ok = True
    for name, results in measured.items():
        for rank, res in enumerate(results):
            if res["error"] is not None:
                ok = False
                cause = " ".join(res["error"].split())[:200].replace("|", "/")
                lines.append(f"| {name} | {rank} | - | - | FAILED: {cause} |")
                continue
            syncs = dict(res["syncs"])
            other = syncs.pop("other", 0)
            problems = check_counts(syncs, expected_syncs(step_facts(LAYOUTS[name], rank)))
            ok = ok and not problems
            listed = "; ".join(f"{k} {v}" for k, v in sorted(syncs.items())) or "none"
            verdict = "yes" if not problems else "NO: " + "; ".join(problems)
            lines.append(f"| {name} | {rank} | {listed} | {other} | {verdict} |")
    return "\n".join(lines), ok


def dist_backend() -> str:
    """The default process group's backend, as torch names it (``"cuda:gloo"``), or ``"-"`` without one."""
    import torch.distributed as dist

    return dist.get_backend() if dist.is_initialized() else "-"


def run_layouts(dry_run: bool, names: list[str] | None = None, timeout_s: float = 60.0, steps: int = 2) -> str:
    """Run each layout of :data:`LAYOUTS` (or ``names``) in its own launch on the one GPU (CPU with ``dry_run``) and
    return the Markdown table: layout, ranks, device and backend of rank 0, status, loss of the last step, seconds.

    Raises:
        ValueError: a name that is not in :data:`LAYOUTS` (the message lists them).
    """
    import torch

    from lightning_par.launcher import run_distributed

    names = list(LAYOUTS) if names is None else names
    for name in names:
        if name not in LAYOUTS:
            raise ValueError(f"layouts: {name!r} is not valid: expected some of {sorted(LAYOUTS)}.")
    accelerator, backend = ("cpu", "gloo") if dry_run else ("cuda", "cuda:gloo")
    lines = ["| layout | ranks | device (rank 0) | backend | status | loss | seconds |", "|---|---|---|---|---|---|---|"]
    # fork while this process has not touched CUDA (the ranks start in seconds); spawn once it has
    start_method = "spawn" if torch.cuda.is_initialized() else None
    gpu = "CPU"
    for name in names:
        ranks = LAYOUTS[name][0]
        begin = time.perf_counter()
        try:
            out = run_distributed(_layout_worker, ranks, (name, accelerator, backend, steps), timeout_s=timeout_s,
                                  start_method=start_method)[0]
            gpu = out["gpu"]
            lines.append(f"| {name} | {ranks} | {out['device']} | {out['backend']} | ok | {out['loss']:.4f} | "
                         f"{out['seconds']:.1f} |")
        except Exception as err:  # noqa: BLE001 - one failed layout is one row of the table
            cause = " ".join(str(err).split())[:200].replace("|", "/")
            lines.append(f"| {name} | {ranks} | - | {backend} | FAILED: {cause} | - | "
                         f"{time.perf_counter() - begin:.1f} |")
        print(lines[-1], flush=True)
    where = "CPU (dry run: gloo, every rank on the CPU)" if dry_run else f"{gpu} (every rank on cuda:0)"
    header = (f"Every layout with two ranks (four for HSDP) on one device: {where}; {steps} optimizer steps of a "
              f"4-layer GPT (n_embd 32), backend {backend}.")
    return "\n".join([header, "", *lines])


#: The MoE row (issue 49): one MoE block at 64 experts, top-2, forward + backward, ``torch._grouped_mm`` against the
#: per-expert loop (:mod:`lightning_par.benchmarks.moe`), bf16 on the GPU: DeepSeek-V2-Lite's widths (2048, experts of
#: 1408), 8192 tokens (256 routed copies per expert). The dry run: fp32 on the CPU, widths 64 and 128, 512 tokens.
MOE_GPU: dict[str, int] = dict(num_experts=64, dim=2048, hidden=1408, tokens=8192, steps=10)
MOE_DRY: dict[str, int] = dict(num_experts=64, dim=64, hidden=128, tokens=512, steps=2)


def moe_table(dry_run: bool) -> str:
    """The MoE row of the throughput part: :data:`MOE_GPU` on ``cuda:0`` in bf16 (:data:`MOE_DRY` on the CPU in fp32
    with ``dry_run``), the grouped form, the padded ``bmm``, the loop and the indexed loop taking turns step by step
    (:func:`lightning_par.benchmarks.moe.measure`); the Markdown table with the loop / grouped ratio."""
    import torch

    from lightning_par.benchmarks import moe

    spec = MOE_DRY if dry_run else MOE_GPU
    device, dtype = ("cpu", torch.float32) if dry_run else ("cuda", torch.bfloat16)
    row = moe.measure(spec["num_experts"], spec["dim"], spec["hidden"], spec["tokens"], spec["steps"], device=device,
                      dtype=dtype)
    where = "CPU, fp32 (dry run: figures mean nothing)" if dry_run else f"{torch.cuda.get_device_name(0)}, bf16"
    return moe.render([row], spec, device=device, title=(
        f"MoE block forward + backward on {where}: {spec['num_experts']} experts, top-2, width {spec['dim']}, expert "
        f"width {spec['hidden']}, {spec['tokens']} tokens; fastest of {spec['steps']} steps, the forms in turns."))


def _settings(dry_run: bool) -> dict[str, Any]:
    if dry_run:
        return dict(config=LLAMA_TINY, seq=64, batch=2, steps=2, warmup=1, device="cpu", backend="aot_eager")
    return dict(config=LLAMA_1B, seq=2048, batch=4, steps=10, warmup=3, device="cuda", backend="inductor")


def _row_in_subprocess(row: str, json_path: Path, timeout_s: float) -> RowResult:
    layout, mode = row.split(":")
    cmd = [sys.executable, "-m", "lightning_par.benchmarks.gpu_check", "--row", row, "--json", str(json_path)]
    try:
        proc = subprocess.run(cmd, timeout=timeout_s, capture_output=True, text=True)
    except subprocess.TimeoutExpired:
        return RowResult(layout, mode, 0, 0.0, 0.0, None, None, float("nan"), error=f"timed out after {timeout_s:.0f} s")
    if proc.returncode != 0 or not json_path.exists():
        sys.stderr.write(proc.stdout[-4000:] + proc.stderr[-8000:])
        last = (proc.stderr.strip().splitlines() or ["no output"])[-1][:200]
        return RowResult(layout, mode, 0, 0.0, 0.0, None, None, float("nan"), error=f"exit {proc.returncode}: {last}")
    result = RowResult(**json.loads(json_path.read_text()))
    json_path.unlink()  # only the tables stay next to $OUT (the device tool brings back 8 files at most)
    return result


def main(argv: list[str] | None = None) -> int:
    """Run the rows and write the table. Returns the exit status (non-zero: no CUDA device without ``--dry-run``,
    or a row failed)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true", help="tiny model on the CPU, every row in this process")
    parser.add_argument("--out", default="gpu_check.md", help="where the Markdown table is written")
    parser.add_argument("--rows", default=",".join(f"{a}:{b}" for a, b in ROWS),
                        help="comma-separated layout:mode rows")
    parser.add_argument("--row-timeout-s", type=float, default=150.0, help="time limit of one row (GPU run)")
    parser.add_argument("--layouts", action="store_true",
                        help="the two-rank part: every layout with two ranks on the one GPU (CPU with --dry-run)")
    parser.add_argument("--layout-timeout-s", type=float, default=60.0, help="time limit of one layout's launch")
    parser.add_argument("--host-syncs", action="store_true",
                        help="count each layout's synchronisations in one step against docs/host-syncs.md")
    parser.add_argument("--row", help=argparse.SUPPRESS)
    parser.add_argument("--json", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    settings = _settings(args.dry_run)
    if args.host_syncs:
        table, ok = sync_table(measure_syncs(args.dry_run))
        where = "CPU (dry run: gloo; nothing is counted, the path is checked)" if args.dry_run else "cuda:0, cuda:gloo"
        table = f"Synchronisations in one training step, every layout on {where}:\n\n{table}"
        Path(args.out).write_text(table + "\n")
        print(table)
        return 0 if ok else 1
    if args.layouts:
        table = run_layouts(args.dry_run, timeout_s=args.layout_timeout_s)
        Path(args.out).write_text(table + "\n")
        print(table)
        return 1 if "FAILED" in table else 0
    if args.row:  # one row, in its own process (the GPU run)
        layout, mode = args.row.split(":")
        result = measure_row(layout, mode, **settings)
        Path(args.json).write_text(json.dumps(asdict(result)))
        return 0
    import torch

    if not args.dry_run and not torch.cuda.is_available():
        print("gpu_check: FAILED: no CUDA device is visible to torch (torch.cuda.is_available() is False). This check "
              "measures a GPU; run it on a machine with one NVIDIA GPU, or pass --dry-run to test it on the CPU.",
              file=sys.stderr)
        return 2
    rows = [r.strip() for r in args.rows.split(",") if r.strip()]
    for row in rows:
        if tuple(row.split(":")) not in ROWS:
            parser.error(f"--rows: {row!r} is not valid: expected some of {[f'{a}:{b}' for a, b in ROWS]}")
    start = time.perf_counter()
    results = []
    for row in rows:
        if args.dry_run:
            layout, mode = row.split(":")
            results.append(measure_row(layout, mode, **settings))
            continue
        json_path = Path(args.out).with_suffix(f".{row.replace(':', '_').replace('+', '_')}.json")
        json_path.unlink(missing_ok=True)
        results.append(_row_in_subprocess(row, json_path, args.row_timeout_s))
        print(markdown(results[-1:], f"row {row}:"), flush=True)
    where = "CPU (dry run: tiny Llama, figures mean nothing)" if args.dry_run else torch.cuda.get_device_name(0)
    cfg = settings["config"]
    header = (f"GPU check on {where}: Llama-shaped {cfg['num_hidden_layers']} x {cfg['hidden_size']}, bf16-mixed, "
              f"seq {settings['seq']}, batch {settings['batch']}, {settings['steps']} timed steps after "
              f"{settings['warmup']}; {time.perf_counter() - start:.0f} s.")
    table = markdown(results, header)
    moe_failed = False
    try:  # the MoE row: grouped_mm vs the per-expert loop (a failure is reported, the throughput table kept)
        table += "\n\n" + moe_table(args.dry_run)
    except Exception as err:  # noqa: BLE001 - any failure of the row is the check's finding
        table += f"\n\nMoE row: FAILED: {type(err).__name__}: {str(err)[:300]}"
        moe_failed = True
    Path(args.out).write_text(table + "\n")
    print(table)
    return 1 if any(r.error for r in results) or moe_failed else 0


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())
