"""``strategy.compile`` without processes: its options and refusals (before any process starts), where it sits in
``parallelize()``'s order, what it does to a block (names kept, hooks outside the graph, undone by
``unparallelize``), and that a compiled block computes what the eager block computes."""

from __future__ import annotations

import pytest
import torch

from lightning_par.axis_registry import PHASES
from lightning_par.compile import COMPILE, CompileOptions, compile_blocks, compile_module, is_block_compiled
from lightning_par.parallel_dims import ParallelDims
from lightning_par.parallelize import ParallelOptions, validate
from lightning_par.strategies import STRATEGIES
from tests.support.user_models import make_attention_lm, make_moe_lm


# ---------------------------------------------------------------------------------------------------- options
def test_defaults_are_off_and_inductor() -> None:
    opts = ParallelOptions.build().compile
    assert opts == CompileOptions(enabled=False, backend="inductor", mode=None, fullgraph=False)


def test_the_builtin_backends_are_accepted_without_listing_the_registry(monkeypatch) -> None:
    """The backends accepted without ``torch._dynamo.list_backends()`` (whose first call imports every backend module,
    in every rank that builds a strategy) are in that list; any other name is still looked up there."""
    import lightning_par.compile as compile_mod

    assert set(compile_mod.BUILTIN_BACKENDS) <= set(compile_mod._backends())
    looked_up = []
    monkeypatch.setattr(compile_mod, "_backends", lambda every=True: looked_up.append(every) or ["inductor", "tvm"])
    for name in compile_mod.BUILTIN_BACKENDS:
        assert CompileOptions(backend=name).backend == name
    assert looked_up == []
    assert CompileOptions(backend="tvm").backend == "tvm" and looked_up == [True]


@pytest.mark.parametrize(("given", "match"), [
    ({"backend": "nope"}, r"compile.backend='nope' is not valid: expected one of \[.*'aot_eager'.*'inductor'"),
    ({"mode": "fast"}, r"compile.mode='fast' is not valid"),
    ({"mode": "reduce-overhead"}, r"compile.mode='reduce-overhead' is not valid here: it captures CUDA graphs.*"
                                  r"max-autotune-no-cudagraphs"),
    ({"mode": "max-autotune"}, r"compile.mode='max-autotune' is not valid here"),
    ({"mode": "max-autotune-no-cudagraphs", "backend": "aot_eager"}, r"modes are inductor's"),
    ({"enabled": "yes"}, r"compile.enabled='yes' is not valid"),
    ({"fullgraph": 1}, r"compile.fullgraph=1 is not valid"),
    ({"graphs": 1}, r"compile.graphs is not a valid option: expected one of \['enabled', 'backend', 'mode', "
                    r"'fullgraph'\]"),
])
def test_bad_options_are_refused_naming_the_field(given, match) -> None:
    with pytest.raises(ValueError, match=match):
        ParallelOptions.build(compile=given)


def test_the_group_is_given_nested_only() -> None:
    with pytest.raises(ValueError, match=r"enabled=True is not a valid option: expected one of .*'compile'"):
        ParallelOptions.build(enabled=True)
    opts = ParallelOptions.build(compile=CompileOptions(enabled=True, backend="aot_eager"))
    assert opts.compile.enabled and opts.compile.backend == "aot_eager"


@pytest.mark.parametrize("cls", STRATEGIES, ids=lambda c: c.__name__)
def test_every_strategy_takes_the_option(cls) -> None:
    strategy = cls(compile={"enabled": True, "backend": "aot_eager", "mode": None, "fullgraph": True})
    assert strategy.options.compile == CompileOptions(enabled=True, backend="aot_eager", fullgraph=True)


def test_its_place_in_the_order_is_after_tp_cp_and_checkpointing_before_the_dp_mode() -> None:
    phases = dict(COMPILE.steps)
    assert set(phases) == {"read", "compile"}
    assert PHASES["split"] < PHASES["context"] < PHASES["recompute"] < PHASES["compile"] < PHASES["data"]


# ---------------------------------------------------------------------------------------------------- refusals
def _gpt():
    from lightning_par.models import GPTConfig, GPTLightningModule

    return GPTLightningModule(GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=16))


def _validate(module, options: dict, **sizes) -> None:
    validate(module, ParallelDims(world_size=2, **sizes), ParallelOptions.build(**options))


@pytest.mark.parametrize(("sizes", "what"), [
    ({"cp_size": 2}, r"cp_size=2: context-parallel attention sends K/V"),
    ({"ep_size": 2}, r"ep_size=2: the expert all-to-all's split sizes"),
])
def test_fullgraph_is_refused_where_a_block_holds_an_untraceable_collective(sizes, what) -> None:
    module = make_moe_lm() if "ep_size" in sizes else make_attention_lm()
    options = {"compile": {"enabled": True, "fullgraph": True}, **({"dp_mode": "zero2"} if "ep_size" in sizes else {})}
    with pytest.raises(ValueError, match=rf"compile.fullgraph=True is not valid with {what}.*compile.fullgraph=False"):
        _validate(module, options, **sizes)
    _validate(module, {**options, "compile": {"enabled": True}}, **sizes)  # without fullgraph: breaks, counted


def test_selective_checkpointing_under_tp_is_refused() -> None:
    options = {"compile": {"enabled": True}, "activation_checkpointing": "selective"}
    with pytest.raises(ValueError, match=r"activation_checkpointing='selective' and tp_size=2.*Use "
                                         r"activation_checkpointing='full'"):
        _validate(_gpt(), options, tp_size=2)
    _validate(_gpt(), options)  # without tp the recomputation compiles inside the block's graph


def test_a_model_the_user_compiled_is_refused() -> None:
    module = make_attention_lm()
    module.model.layers["0"] = torch.compile(module.model.layers["0"], backend="aot_eager")
    with pytest.raises(ValueError, match=r"compile.enabled=True is not valid with AttentionLM.model.layers.0, a "
                                         r"torch.compile'd module.*Remove torch.compile"):
        _validate(module, {"compile": {"enabled": True}})


def test_a_network_without_blocks_is_refused() -> None:
    import lightning as L

    class Flat(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = torch.nn.Linear(4, 4)

    with pytest.raises(ValueError, match=r"compile.enabled=True is not valid for a network of type Linear: it "
                                         r"compiles every block on its own, and the network names none"):
        _validate(Flat(), {"compile": {"enabled": True}})


def test_the_structural_refusal_points_to_the_option() -> None:
    module = make_attention_lm()
    module.model = torch.compile(module.model, backend="aot_eager")
    with pytest.raises(ValueError, match=r"compile=\{'enabled': True\} \(strategy.compile.enabled=true"):
        _validate(module, {}, tp_size=2)


# ---------------------------------------------------------------------------------------------------- the block
def test_a_compiled_block_keeps_its_names_and_computes_the_same() -> None:
    torch._dynamo.reset()
    eager = make_attention_lm("adamw")
    compiled = make_attention_lm("adamw")
    compiled.load_state_dict(eager.state_dict())
    calls = []
    compiled.model.layers["0"].register_forward_pre_hook(lambda m, a: calls.append(1))
    paths = compile_blocks(compiled.model, ["layers.0", "layers.1"], CompileOptions(enabled=True, backend="aot_eager"))
    assert paths == ["layers.0", "layers.1"]
    assert all(is_block_compiled(compiled.model.layers[k]) for k in ("0", "1"))
    assert list(compiled.state_dict()) == list(eager.state_dict())  # no '_orig_mod'
    x = torch.randint(0, 256, (2, 16))
    for _ in range(2):
        for module in (eager, compiled):
            module.zero_grad()
            module.model(x).square().mean().backward()
        for (name, a), b in zip(eager.named_parameters(), compiled.parameters()):
            torch.testing.assert_close(b.grad, a.grad, rtol=1e-5, atol=1e-7, msg=name)
    # the module's hooks run eagerly, around the graph, at every call (a traced hook would run at tracing only)
    assert len(calls) == 2
    assert type(compiled.model.layers["0"]).__name__ == "CompiledLayer"
    assert compile_module(compiled.model.layers["0"], CompileOptions()) is compiled.model.layers["0"]  # idempotent


# ---------------------------------------------------------------------------------------------------- the recipe
@pytest.mark.parametrize("strategy", ["zero3", "1f1b"])
def test_the_recipe_sets_it_on_every_strategy(strategy) -> None:
    from pathlib import Path

    from hydra import compose, initialize_config_dir

    from lightning_par.config.build import build_strategy
    from lightning_par.config.schema import register_configs

    register_configs()
    conf = Path(__file__).resolve().parents[2] / "conf"
    parallel = {"tensor_parallel": "tp2", "1f1b": "pp2"}.get(strategy, "dp2")
    overrides = [f"strategy={strategy}", f"parallel={parallel}", "strategy.compile.enabled=true",
                 "strategy.compile.backend=aot_eager", "strategy.compile.fullgraph=true"]
    with initialize_config_dir(config_dir=str(conf), version_base=None):
        cfg = compose(config_name="config", overrides=overrides)
        bad = compose(config_name="config", overrides=[*overrides[:2], "strategy.compile.mode=reduce-overhead"])
    built = build_strategy(cfg)
    assert built.options.compile == CompileOptions(enabled=True, backend="aot_eager", fullgraph=True)
    with pytest.raises(ValueError, match=r"compile.mode='reduce-overhead' is not valid here"):
        build_strategy(bad)


def test_a_hugging_face_model_compiles_its_decoder_layers() -> None:
    """The contract names a Hugging Face model's decoder layers; one graph serves them all (no per-layer recompile)."""
    from torch._dynamo.utils import counters

    from lightning_par import contract
    from lightning_par.hf.module import HFCausalLM

    torch._dynamo.reset()
    counters.clear()  # dynamo's counters outlive reset(): an earlier test's graphs (torchao's, say) would count here
    config = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=256, max_position_embeddings=32, tie_word_embeddings=False)
    torch.manual_seed(0)
    eager = HFCausalLM(model_type="llama", config=config)
    torch.manual_seed(0)
    compiled = HFCausalLM(model_type="llama", config=config)
    paths = contract.checkpoint_modules(compiled.model, "full")
    assert paths == ["model.layers.0", "model.layers.1", "model.layers.2"]
    compile_blocks(compiled.model, paths, CompileOptions(enabled=True, backend="aot_eager"))
    x = torch.randint(0, 256, (2, 12))
    for module in (eager, compiled):
        module.model(input_ids=x, use_cache=False).logits.square().mean().backward()  # as HFCausalLM trains
    for (name, a), b in zip(eager.named_parameters(), compiled.parameters()):
        torch.testing.assert_close(b.grad, a.grad, rtol=1e-5, atol=1e-7, msg=name)
    assert counters["stats"]["unique_graphs"] == 1
