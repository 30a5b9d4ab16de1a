"""ParallelMetricsCallback and RunSummaryCallback on a tiny CPU run, and build_summary's merging."""

import json
from pathlib import Path

import lightning as L
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_par.callbacks import ParallelMetricsCallback, RunSummaryCallback, build_summary

VOCAB, SEQ, MICRO_BATCH = 16, 8, 4
REQUIRED = (
    "strategy", "world_size", "dp_size", "tp_size", "pp_size", "steps", "tokens_seen", "initial_train_loss",
    "final_train_loss", "final_val_loss", "tokens_per_s", "step_time_s", "mfu", "mfu_note", "peak_memory_bytes",
    "param_bytes", "grad_bytes", "optimizer_state_bytes",
)  # fmt: skip


class TinyLM(L.LightningModule):
    """Embedding + Linear next-token model on ``(x, y)`` int64 batches."""

    def __init__(self, flops: float | None = None) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 8)
        self.head = nn.Linear(8, VOCAB)
        if flops is not None:
            self.flops_per_token = flops

    def _loss(self, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x, y = batch
        return nn.functional.cross_entropy(self.head(self.embed(x)).flatten(0, 1), y.flatten())

    def training_step(self, batch, batch_idx):
        loss = self._loss(batch)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", self._loss(batch))

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-2)


def _loader() -> DataLoader:
    g = torch.Generator().manual_seed(0)
    data = torch.randint(0, VOCAB, (64, SEQ + 1), generator=g)
    return DataLoader(TensorDataset(data[:, :-1], data[:, 1:]), batch_size=MICRO_BATCH)


def _fit(tmp_path: Path, **trainer_kwargs) -> tuple[ParallelMetricsCallback, RunSummaryCallback]:
    metrics = ParallelMetricsCallback(window=4)
    summary = RunSummaryCallback(tmp_path / "out" / "summary.json", metrics, extra={"recipe": "tiny"})
    trainer = L.Trainer(
        accelerator="cpu", devices=1, max_steps=6, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=2, val_check_interval=3,
        callbacks=[metrics, summary], **trainer_kwargs,
    )  # fmt: skip
    trainer.fit(TinyLM(), _loader(), _loader())
    return metrics, summary


def test_run_summary_json(tmp_path: Path) -> None:
    metrics, _ = _fit(tmp_path)
    data = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert set(REQUIRED) <= set(data)
    assert data["recipe"] == "tiny"
    assert data["steps"] == 6
    assert (data["world_size"], data["dp_size"], data["tp_size"], data["pp_size"]) == (1, 1, 1, 1)
    assert data["strategy"] == "single_device"  # the registry name
    assert data["tokens_seen"] == 6 * MICRO_BATCH * SEQ
    assert data["mfu"] is None and "CPU" in data["mfu_note"]
    assert data["tokens_per_s"] > 0 and data["step_time_s"] > 0
    for key in ("initial_train_loss", "final_train_loss", "final_val_loss"):
        assert isinstance(data[key], float)
    param_bytes = (VOCAB * 8 + 8 * VOCAB + VOCAB) * 4
    assert data["param_bytes"] == [param_bytes] and data["grad_bytes"] == [param_bytes]
    assert data["optimizer_state_bytes"] == [2 * param_bytes + 3 * 4]  # + one 4-byte Adam step per param
    assert data["peak_memory_bytes"][0] > 0
    # The second step's peak, counted tensor by tensor: the model state plus the activations and temporaries, which
    # for this model include at least the (batch, seq, vocab) logits and their gradient.
    state = data["step_model_state_bytes"][0]
    assert state == data["param_bytes"][0] + data["grad_bytes"][0] + data["optimizer_state_bytes"][0]
    assert data["step_peak_bytes"][0] == state + data["step_other_bytes"][0]
    assert data["step_other_bytes"][0] >= 2 * MICRO_BATCH * SEQ * VOCAB * 4
    assert data["step_peak_bytes"][0] < 100 * state  # not the process's RSS
    s = metrics.summary()
    assert s["measured_steps"] == 4  # 6 steps - 2 warm-up
    assert not list((tmp_path / "out").glob("*.tmp"))


def test_gradient_accumulation_counts_micro_batches(tmp_path: Path) -> None:
    metrics, _ = _fit(tmp_path, accumulate_grad_batches=2)
    assert metrics.summary()["tokens_seen"] == 6 * 2 * MICRO_BATCH * SEQ


def test_mfu_on_cpu_with_explicit_peak(tmp_path: Path) -> None:
    metrics = ParallelMetricsCallback(peak_flops_per_device=1e12, window=4)
    trainer = L.Trainer(
        accelerator="cpu", devices=1, max_steps=4, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0, callbacks=[metrics],
    )  # fmt: skip
    trainer.fit(TinyLM(flops=1000.0), _loader())
    s = metrics.summary()
    assert s["mfu"] == pytest.approx(1000.0 * s["tokens_per_s"] / 1e12)
    assert "mfu" in trainer.callback_metrics and "tokens_per_s" in trainer.callback_metrics
    assert "peak_mem_mb" in trainer.callback_metrics


def test_build_summary_merges_extras_and_ranks() -> None:
    rank = dict(tokens_seen=640, mfu=None, mfu_note="n/a", param_bytes=10, grad_bytes=10, optimizer_state_bytes=20)
    per_rank = [
        {**rank, "tokens_per_s": 100.0, "step_time_s": 0.2, "peak_memory_bytes": 1, "final_train_loss": None},
        {**rank, "tokens_per_s": 90.0, "step_time_s": 0.25, "peak_memory_bytes": 2, "final_train_loss": 1.5},
    ]
    common = {"strategy": "ddp", "world_size": 2, "steps": 5, "ddp_overlap_fraction": 0.7, "bubble": 0.1}
    out = build_summary(per_rank, common)
    assert out["ddp_overlap_fraction"] == 0.7 and out["bubble"] == 0.1 and out["strategy"] == "ddp"
    assert out["tokens_seen"] == 640
    assert out["tokens_per_s"] == 90.0 and out["step_time_s"] == 0.25
    assert out["peak_memory_bytes"] == [1, 2] and out["tokens_per_s_per_rank"] == [100.0, 90.0]
    assert out["final_train_loss"] == 1.5  # the last pipeline stage holds the loss
    assert out["mfu"] is None and out["mfu_note"] == "n/a"
    with pytest.warns(UserWarning, match="tokens_seen"):
        assert build_summary(per_rank, {"tokens_seen": -1})["tokens_seen"] == 640
    with pytest.raises(ValueError):
        build_summary([], common)


def test_invalid_arguments() -> None:
    with pytest.raises(ValueError, match="window"):
        ParallelMetricsCallback(window=0)
    with pytest.raises(ValueError, match="peak_flops_per_device"):
        ParallelMetricsCallback(peak_flops_per_device=0.0)
    with pytest.raises(ValueError, match="memory_step"):
        ParallelMetricsCallback(memory_step=-1)


def test_log_comm_stats_logs_the_exposed_time_every_log_every_n_steps() -> None:
    from lightning_par.callbacks.metrics import log_comm_stats
    from lightning_par.data_parallel.reducer import CommStats

    logged: list[int] = []

    class Logs(TinyLM):
        def log(self, name, value, *args, **kwargs):
            if name == "comm_exposed_ms":
                logged.append(self.trainer.global_step)
            return super().log(name, value, *args, **kwargs)

        def training_step(self, batch, batch_idx):
            log_comm_stats(self, CommStats(exposed_s=0.0025))
            log_comm_stats(self, None)  # an accumulation micro-batch: nothing
            return self._loss(batch)

    trainer = L.Trainer(
        accelerator="cpu", devices=1, max_steps=7, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0, log_every_n_steps=3,
    )  # fmt: skip
    trainer.fit(Logs(), _loader())
    assert float(trainer.callback_metrics["comm_exposed_ms"]) == pytest.approx(2.5)
    assert logged == [0, 3, 6]
    log_comm_stats(None, CommStats())  # no module: nothing, no error
