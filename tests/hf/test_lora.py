"""LoRA fine-tuning under every layout: a user's LightningModule around ``peft.get_peft_model`` (a tiny Llama, LoRA r 8
on q_proj, v_proj and down_proj; lora_B started non-zero, as a resumed adapter's) and ``HFCausalLM(lora=...)`` against
the same module in one process on the same global batch.

HFCausalLM's cells start lora_B at PEFT's zero. Its first AdamW step moves each element of lora_B by
``lr * g / (|g| + eps)``: an element whose gradient is far below the tensor's largest (and below eps 1e-6) carries the
fp32 rounding of the whole tensor's scale, divided by ``|g| + eps`` instead of by the largest gradient. Measured under
tp2 + SP: the element of layer 1's q_proj lora_B with g = 8.1e-8 (largest 2.0e-4) off by 4.0e-11 (3 ulp of the
largest; the losses already differ by 8.6e-8 in the first forward, where the adapters add exactly zero: from the
row-parallel base layers' split sums) moves 1.0e-7 off, 3.5e-5 of lora_B's largest entry after step 1, 1.5e-5 after
step 3. The same run in float64 matches one process at 5.6e-15 (``hflora64``: every tensor and the loss in float64,
checked at rel 1e-12), so no scale or reduction is wrong; the fp32 tp cells of HFCausalLM use SGD, the AdamW ones
under tp run in float64.

Parity (fp32): losses of every step within ``rtol=1e-5``, every parameter within :func:`assert_params_close`, the
trained LoRA weights within a relative error (max difference / max entry, per tensor) of 1e-5 (QLoRA, whose NF4 base
computes in bf16: 1e-4 against one-process QLoRA); the frozen base **bitwise** equal to its initial weights; the optimizer holding only the adapters (its parameters and state, on each
rank, are this rank's share of the LoRA weights). Cases of one world size run in one launch (launches are the cost).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from lightning_par.launcher import run_distributed
from tests.support.helpers import assert_params_close, global_losses

pytest.importorskip("peft")
pytest.importorskip("transformers")

from tests.support.lora import (  # noqa: E402
    BASE,
    GLOBAL_BATCH,
    SEQ,
    STEPS,
    TokenDataset,
    lora_worker,
    make_module,
    reference,
    rel_error,
)

pytestmark = pytest.mark.distributed


def _case(name: str, strategy: str, model: str, steps: int | None = None, samples: int | None = None,
          save: str | None = None, resume: str | None = None, precision: str | None = None,
          **options: Any) -> dict[str, Any]:
    extra = {k: v for k, v in {"steps": steps, "samples": samples, "save": save, "resume": resume,
                               "precision": precision}.items() if v}
    return {"name": name, "strategy": strategy, "model": model, "options": options, **extra}


#: World 2, one launch: one cell per layout, the optimizers spread over them.
WORLD2 = [
    _case("zero3-adamw", "zero3", "peft-adamw"),
    _case("tp2-sgd", "tensor_parallel", "peft-sgd", tp_size=2),
    _case("tp2sp-adamw", "tensor_parallel", "peft-adamw", tp_size=2, sequence_parallel=True),
    _case("pp2-1f1b-sgd", "parallel_3d", "peft-sgd", pp_size=2, schedule="1f1b", num_microbatches=4),
    _case("cp2-adamw", "parallel_3d", "peft-adamw", cp_size=2),
    _case("ep2-moe-adamw", "parallel_3d", "moe-adamw", ep_size=2),
    # HFCausalLM(lora=...): the same tiny Llama and adapters, built by the package
    _case("hf-tp2sp-sgd", "tensor_parallel", "hflora-sgd", tp_size=2, sequence_parallel=True),
    _case("hf-pp2-1f1b-adamw", "parallel_3d", "hflora-adamw", pp_size=2, schedule="1f1b", num_microbatches=4),
    _case("hf-ep2-moe-sgd", "parallel_3d", "hflora-moe-sgd", ep_size=2),  # a qwen3_moe, adapters on the attention
    _case("hf-tp2sp-adamw-fp64", "tensor_parallel", "hflora64-adamw", tp_size=2, sequence_parallel=True),
    # QLoRA: the base's linear weights NF4 (bf16 compute), against one-process QLoRA at rel 1e-4
    _case("qlora-zero3-adamw", "zero3", "hfqlora-adamw"),
    # activation checkpointing (selective: the attention of each decoder layer) through the wrapper
    _case("tp2sp-acsel-sgd", "tensor_parallel", "peft-sgd", tp_size=2, sequence_parallel=True,
          activation_checkpointing="selective"),
]
#: World 2, same launch: adapter-only checkpoints (HFCausalLM's default under LoRA) against whole ones, and a resume
#: from one at the end of an epoch of 2 steps against 3 steps in one go (paths filled in by the fixture).
CHECKPOINTS2 = [
    _case("ckpt-adapter", "zero3", "hflora-adamw", steps=2, samples=2 * GLOBAL_BATCH, save="adapter.ckpt"),
    _case("ckpt-full", "zero3", "hflora-full-adamw", steps=2, samples=2 * GLOBAL_BATCH, save="full.ckpt"),
    _case("ckpt-resumed", "zero3", "hflora-adamw", steps=3, samples=2 * GLOBAL_BATCH, resume="adapter.ckpt"),
    _case("ckpt-in-one-go", "zero3", "hflora-adamw", steps=3, samples=2 * GLOBAL_BATCH),
    # a pretrained base (a save_pretrained directory), trained under tp2 + SP, saved adapter-only: the export's source
    _case("export-source", "tensor_parallel", "hflora-adamw", save="export.ckpt", tp_size=2, sequence_parallel=True),
]
#: World 2, same launch: refused before the first step, with the message's words.
REFUSED2 = [
    (_case("dora-tp2", "tensor_parallel", "dora-sgd", tp_size=2), r"DoRA \(use_dora=True.*tensor parallelism"),
    (_case("experts-ep2", "parallel_3d", "moe-experts-adamw", ep_size=2),
     r"LoRA on 'model.layers.0.mlp.experts'.*expert parallelism"),
    (_case("qlora-tp2", "tensor_parallel", "hfqlora-sgd", tp_size=2),
     r"lora.quantize_base='nf4' \(QLoRA\) is not supported under tensor parallelism"),
]
#: World 2, same launch: NCCL's device rule on the CPU (tests/support/device_rule.py) over one step of the layouts the LoRA
#: code adds collectives to (LoRA-aware tp styles, the NF4 base's broadcast, an adapter-only save).
RULE2 = [
    _case("rule-tp2sp", "tensor_parallel", "peft-sgd", steps=1, tp_size=2, sequence_parallel=True),
    _case("rule-qlora-zero3", "zero3", "hfqlora-adamw", steps=1),
    _case("rule-pp2", "parallel_3d", "hflora-sgd", steps=1, pp_size=2, schedule="1f1b", num_microbatches=4),
    _case("rule-save", "zero3", "hflora-adamw", steps=1, save="rule.ckpt"),
]
#: World 2, same launch: Lightning's "bf16-mixed" with LoRA: the frozen base's linear weights stored in bf16, the
#: adapters fp32, against one process doing the same (autocast to bf16): losses within 1e-4, adapters within 2e-2
#: (bf16 products: measured 1.7e-5 and 1.2e-2 at most; SGD, as AdamW's first step from the zero lora_B amplifies them).
BF16_2 = [
    _case("bf16-zero2-sgd", "zero2", "hflora-sgd", precision="bf16-mixed"),
    _case("bf16-zero3-sgd", "zero3", "hflora-sgd", precision="bf16-mixed"),
    _case("bf16-ddp-sgd", "ddp_overlap", "hflora-sgd", precision="bf16-mixed"),
    _case("bf16-tp2sp-sgd", "tensor_parallel", "hflora-sgd", tp_size=2, sequence_parallel=True, precision="bf16-mixed"),
]
#: World 4, one launch.
WORLD4 = [
    _case("hsdp2x2-sgd", "parallel_3d", "peft-sgd", dp_replicate_size=2, dp_shard_size=2, dp_mode="zero3"),
    _case("hf-pp2tp2sp-sgd", "parallel_3d", "hflora-sgd", pp_size=2, tp_size=2, sequence_parallel=True,
          schedule="1f1b", num_microbatches=2),
]
#: Extra cells (``slow``): the other optimizer of each layout, and dp2 x tp2 x pp2 (world 8).
SLOW2 = [
    _case("zero3-sgd", "zero3", "peft-sgd"),
    _case("tp2sp-sgd", "tensor_parallel", "peft-sgd", tp_size=2, sequence_parallel=True),
    _case("pp2-1f1b-adamw", "parallel_3d", "peft-adamw", pp_size=2, schedule="1f1b", num_microbatches=4),
    _case("cp2-a2a-sgd", "parallel_3d", "peft-sgd", cp_size=2, method="all_to_all"),
    _case("dora-zero3-sgd", "zero3", "dora-sgd"),
    _case("qlora-zero3-sgd", "zero3", "hfqlora-sgd"),
    _case("qlora-ddp_overlap-adamw", "ddp_overlap", "hfqlora-adamw"),
    _case("qlora-zero2-sgd", "zero2", "hfqlora-sgd"),
    _case("zero3-acfull-adamw", "zero3", "peft-adamw", activation_checkpointing="full"),
    _case("hf-zero3-sgd", "zero3", "hflora-sgd"),
    _case("hf-cp2-adamw", "parallel_3d", "hflora-adamw", cp_size=2),
    _case("hf-ep2-moe-adamw", "parallel_3d", "hflora-moe-adamw", ep_size=2),
    # per-block compile (aot_eager: dynamo + AOTAutograd, no C++ build) of the wrapped model's decoder layers
    _case("zero3-compile-sgd", "zero3", "peft-sgd", compile={"enabled": True, "backend": "aot_eager"}),
    _case("tp2sp-compile-sgd", "tensor_parallel", "peft-sgd", tp_size=2, sequence_parallel=True,
          compile={"enabled": True, "backend": "aot_eager"}),
]
SLOW4 = [
    _case("hsdp2x2-adamw", "parallel_3d", "peft-adamw", dp_replicate_size=2, dp_shard_size=2, dp_mode="zero3"),
    _case("tp2pp2-sgd", "parallel_3d", "peft-sgd", tp_size=2, pp_size=2, schedule="1f1b", num_microbatches=2),
    _case("tp2sppp2-adamw", "parallel_3d", "peft-adamw", tp_size=2, pp_size=2, sequence_parallel=True,
          schedule="1f1b", num_microbatches=2),
    _case("qlora-hsdp2x2-adamw", "parallel_3d", "hfqlora-adamw", dp_replicate_size=2, dp_shard_size=2,
          dp_mode="zero3"),
    _case("hf-hsdp2x2-adamw", "parallel_3d", "hflora-adamw", dp_replicate_size=2, dp_shard_size=2, dp_mode="zero3"),
]
SLOW8 = [
    _case("dp2tp2pp2-adamw", "parallel_3d", "peft-adamw", dp_size=2, tp_size=2, pp_size=2, schedule="1f1b",
          num_microbatches=2),
    _case("dp2tp2pp2-zero3-sgd", "parallel_3d", "peft-sgd", dp_size=2, tp_size=2, pp_size=2, schedule="1f1b",
          num_microbatches=2, dp_mode="zero3"),
    _case("hf-dp2tp2pp2-sgd", "parallel_3d", "hflora-sgd", dp_size=2, tp_size=2, pp_size=2, schedule="1f1b",
          num_microbatches=2),
    _case("hf-dp2tp2pp2-zero3-adamw-fp64", "parallel_3d", "hflora64-adamw", dp_size=2, tp_size=2, pp_size=2,
          schedule="1f1b", num_microbatches=2, dp_mode="zero3"),
]


@pytest.fixture(scope="module")
def data() -> TokenDataset:
    return TokenDataset(n=GLOBAL_BATCH * STEPS, seq=SEQ)


def _launch(world: int, cases: list[dict[str, Any]], data: TokenDataset) -> dict[str, list[dict[str, Any]]]:
    per_rank = run_distributed(lora_worker, world, (cases, data), timeout_s=600)
    return {case["name"]: [per_rank[r][i] for r in range(world)] for i, case in enumerate(cases)}


@pytest.fixture(scope="module")
def checkpoint_dir(tmp_path_factory) -> Any:
    return tmp_path_factory.mktemp("lora-checkpoints")


@pytest.fixture(scope="module")
def world2(data, checkpoint_dir) -> dict[str, list[dict[str, Any]]]:
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(3)
    AutoModelForCausalLM.from_config(AutoConfig.for_model("llama", **BASE)).save_pretrained(checkpoint_dir / "base")
    saves = [{**c, **{k: str(checkpoint_dir / c[k]) for k in ("save", "resume") if k in c}} for c in CHECKPOINTS2]
    saves[-1]["pretrained"] = str(checkpoint_dir / "base")
    rules = [{**c, "device_rule": True, **({"save": str(checkpoint_dir / c["save"])} if "save" in c else {})}
             for c in RULE2]
    return _launch(2, WORLD2 + BF16_2 + [c for c, _ in REFUSED2] + saves + rules, data)


@pytest.fixture(scope="module")
def world4(data) -> dict[str, list[dict[str, Any]]]:
    return _launch(4, WORLD4, data)


def check_lora_parity(runs: list[dict[str, Any]], case: dict[str, Any], data: TokenDataset) -> dict[str, float]:
    """Assert the parity of one case (see the module docstring); returns the measured relative errors."""
    errors = [r["error"] for r in runs if "error" in r]
    assert not errors, errors[0]
    ref_losses, ref_params, initial = reference(case["model"], data, case.get("precision"))
    losses = global_losses(runs)
    # QLoRA: bf16 compute on the NF4 base; float64 runs: what fp32 rounding would hide; bf16-mixed: bf16 products
    tol = 1e-4 if case["model"].startswith("hfqlora") else 1e-12 if case["model"].startswith("hflora64") else 1e-5
    bf16 = case.get("precision") == "bf16-mixed"
    lora_tol = 2e-2 if bf16 else tol
    if bf16:
        tol = 1e-4
    # float64 runs: the reported loss may be a float32 scalar (the pipeline's, read from its last stage), so the losses
    # to float32's epsilon; the weights to 1e-12
    loss_tol = max(tol, torch.finfo(torch.float32).eps)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=loss_tol, atol=0)
    trainable = [n for n in ref_params if "lora_" in n]
    assert trainable
    figures = {"loss_rel": max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses)), "lora_rel": 0.0}
    for r in runs:
        if not bf16:
            assert_params_close(r["state"], ref_params, rtol=tol, atol=tol)
        for name in trainable:
            rel = rel_error(r["state"][name], ref_params[name])
            assert rel <= lora_tol, (name, rel)
            assert r["state"][name].dtype == ref_params[name].dtype, name
            figures["lora_rel"] = max(figures["lora_rel"], rel)
            assert not torch.equal(r["state"][name], initial[name]), f"{name} did not train"
        for name in ref_params:
            if name not in trainable:  # the frozen base: bitwise its initial weights (in their dtype)
                assert r["state"][name].dtype == initial[name].dtype, (name, r["state"][name].dtype)
                assert torch.equal(r["state"][name], initial[name]), name
    # the optimizer holds the adapters only: over the ranks of one model replica, its parameters add up to the
    # trainable elements (each rank a share of them), never to a frozen weight's
    trainable_numel = sum(ref_params[n].numel() for n in trainable)
    held = runs[0]["param_numel"]
    assert 0 < held <= trainable_numel, (held, trainable_numel)
    assert runs[0]["state_numel"] in (held, 2 * held), runs[0]["state_numel"]  # momentum / Adam's two moments
    return figures


@pytest.mark.parametrize("case", WORLD2, ids=lambda c: c["name"])
def test_peft_lora_matches_one_process(world2, data, case):
    check_lora_parity(world2[case["name"]], case, data)


@pytest.mark.parametrize("case", BF16_2, ids=lambda c: c["name"])
def test_bf16_mixed_stores_the_frozen_base_in_bf16(world2, data, case):
    """Under "bf16-mixed" the frozen linear weights are bf16 (and match one process doing the same), the adapters fp32,
    and the frozen bytes per rank (``param_split_bytes``, summary.json's ``frozen_param_bytes``) are the linear
    weights' halved: each rank's share of ``linear / 2 + the rest`` (embeddings and norms stay fp32)."""
    runs = world2[case["name"]]
    check_lora_parity(runs, case, data)
    fp32 = make_module(case["model"])
    linear = {f"{m}.{k}" for m, mod in fp32.named_modules() if isinstance(mod, torch.nn.Linear) for k, _ in
              mod.named_parameters(recurse=False)}
    frozen = [(n, p) for n, p in fp32.named_parameters() if not p.requires_grad]
    assert {n for n, _ in frozen} & linear
    full_fp32 = sum(p.numel() * 4 for _, p in frozen)
    expected = sum(p.numel() * (2 if n in linear else 4) for n, p in frozen)
    assert expected < 0.65 * full_fp32
    _, _, initial = reference(case["model"], data, case["precision"])
    assert all(initial[n].dtype == (torch.bfloat16 if n in linear else torch.float32) for n, _ in frozen)
    held = [r["param_split"]["frozen_param_bytes"] for r in runs]
    if case["strategy"] in ("zero2", "ddp_overlap"):  # every rank holds the whole frozen base
        assert held == [expected] * len(runs), (held, expected)
    elif case["strategy"] == "zero3":  # each rank a half of every frozen tensor (all split evenly on dim 0)
        assert held == [expected // 2] * len(runs), (held, expected)
    else:  # tensor parallelism: the planned layers split, the rest whole
        assert all(expected // 2 <= h < expected for h in held), (held, expected)


@pytest.mark.parametrize("case", WORLD4, ids=lambda c: c["name"])
def test_peft_lora_matches_one_process_world4(world4, data, case):
    check_lora_parity(world4[case["name"]], case, data)


def _bytes(path: Any) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def test_adapter_only_checkpoint_resumes_exactly(world2, checkpoint_dir):
    import torch.distributed.checkpoint as dcp

    for name in ("ckpt-adapter", "ckpt-full", "ckpt-resumed", "ckpt-in-one-go"):
        assert "error" not in world2[name][0], world2[name][0]["error"]
    saved = dcp.FileSystemReader(str(checkpoint_dir / "adapter.ckpt")).read_metadata().state_dict_metadata
    model = [k for k in saved if k.startswith("state_dict.model.")]
    assert model and all("lora_" in k for k in model), [k for k in model if "lora_" not in k][:3]
    full = dcp.FileSystemReader(str(checkpoint_dir / "full.ckpt")).read_metadata().state_dict_metadata
    assert any("base_layer" in k for k in full)
    # tensor bytes: the adapters and their optimizer state against the whole model and the same optimizer state
    tensor_bytes = {n: sum(v.size.numel() * 4 for v in m.values() if hasattr(v, "size")) for n, m in
                    (("adapter", saved), ("full", full))}
    assert tensor_bytes["adapter"] < 0.35 * tensor_bytes["full"], tensor_bytes
    assert _bytes(checkpoint_dir / "adapter.ckpt") < _bytes(checkpoint_dir / "full.ckpt")
    # resumed from the adapters alone (the frozen base rebuilt): bitwise the run in one go
    resumed, one_go = world2["ckpt-resumed"], world2["ckpt-in-one-go"]
    assert resumed[0]["losses"] == one_go[0]["losses"][2:]
    for name, value in one_go[0]["state"].items():
        assert torch.equal(resumed[0]["state"][name], value), name


def test_exported_adapter_and_merged_model_give_the_trained_logits(world2, checkpoint_dir, data):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from lightning_par.hf.export import export_lora

    run = world2["export-source"][0]
    assert "error" not in run, run["error"]
    trained = make_module("hflora-adamw", str(checkpoint_dir / "base"))
    missing, unexpected = trained.load_state_dict(run["state"], strict=False)
    assert not unexpected and all("lora_" not in n for n in missing), (missing, unexpected)
    ids = torch.stack([data[i][0] for i in range(4)])
    trained.eval()
    with torch.no_grad():
        expected = trained(ids)
        adapter = export_lora(checkpoint_dir / "export.ckpt", checkpoint_dir / "adapter")
        assert (adapter / "adapter_config.json").is_file() and (adapter / "adapter_model.safetensors").is_file()
        base = AutoModelForCausalLM.from_pretrained(checkpoint_dir / "base")
        loaded = PeftModel.from_pretrained(base, adapter).eval()
        got = loaded(input_ids=ids).logits
        assert rel_error(got, expected) <= 1e-5, rel_error(got, expected)
        merged_dir = export_lora(checkpoint_dir / "export.ckpt", checkpoint_dir / "merged", merged=True)
        merged = AutoModelForCausalLM.from_pretrained(merged_dir).eval()
        got = merged(input_ids=ids).logits
        assert rel_error(got, expected) <= 1e-5, rel_error(got, expected)
        assert not any("lora_" in n for n, _ in merged.named_parameters())


@pytest.mark.parametrize("case", RULE2, ids=lambda c: c["name"])
def test_lora_keeps_every_collective_on_the_device(world2, case):
    for run in world2[case["name"]]:
        assert run["error"] is None, run["error"]
        assert run["collectives"] > 0 and run["violations"] == [], run


@pytest.mark.parametrize("case,match", REFUSED2, ids=lambda c: c["name"] if isinstance(c, dict) else "")
def test_peft_variant_the_layout_cannot_split_is_refused(world2, case, match):
    import re

    for run in world2[case["name"]]:
        assert "error" in run and run["error"].startswith("ValueError"), run.get("error")
        assert re.search(match, run["error"]), run["error"]


@pytest.mark.slow
@pytest.mark.parametrize("world,cases", [(2, SLOW2), (4, SLOW4), (8, SLOW8)], ids=["world2", "world4", "world8"])
def test_peft_lora_other_cells(data, world, cases):
    runs = _launch(world, cases, data)
    for case in cases:
        check_lora_parity(runs[case["name"]], case, data)
        if "compile" in case["options"]:
            assert runs[case["name"]][0]["extras"]["compile_graphs"] > 0, runs[case["name"]][0]["extras"]
