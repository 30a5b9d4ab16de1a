"""Every bad input of the recipe fails before any process starts, with a message naming the field, the value and what
would be valid (one row per bad input below). ``launch_job`` runs with the launcher replaced by a function that
fails the test: each case must be rejected by the config composition or by ``preflight``, never inside a rank."""

from __future__ import annotations

import re

import pytest
from hydra import compose, initialize_config_dir
from hydra.errors import ConfigCompositionException

import lightning_par.train as train
from lightning_par.config.schema import register_configs
from tests.config.test_compose import CONF
from tests.support.compose import Composer

register_configs()

BASE = ["model=tiny", "data=synthetic", "trainer=smoke"]

#: (overrides, expected message). {tmp} is a temporary directory.
PREFLIGHT = [
    # trainer.*
    ("trainer.val_check_interval=0", "trainer.val_check_interval=0 is not valid: expected an integer >= 1"),
    ("trainer.val_check_interval=-1", "trainer.val_check_interval=-1 is not valid: expected an integer >= 1"),
    ("trainer.accumulate_grad_batches=0", "trainer.accumulate_grad_batches=0 is not valid: expected an integer >= 1"),
    ("trainer.max_steps=-1", "trainer.max_steps=-1 is not valid: expected an integer >= 1"),
    ("trainer.max_steps=0", "trainer.max_steps=0 is not valid: expected an integer >= 1"),
    ("trainer.log_every_n_steps=0", "trainer.log_every_n_steps=0 is not valid: expected an integer >= 1"),
    ("trainer.gradient_clip_val=-1", "trainer.gradient_clip_val=-1.0 is not valid: expected a finite norm >= 0"),
    ("trainer.gradient_clip_val=nan", "trainer.gradient_clip_val=nan is not valid: expected a finite norm >= 0"),
    ("trainer.gradient_clip_val=inf", "trainer.gradient_clip_val=inf is not valid: expected a finite norm >= 0"),
    ("trainer.precision=bf17", "trainer.precision='bf17' is not valid: expected one of ['32-true', '16-mixed'"),
    ("trainer.accelerator=tpu", "trainer.accelerator='tpu' is not valid: expected one of ['auto', 'cpu', 'gpu'"),
    ("trainer.accelerator=gpu", "trainer.accelerator='gpu' is not valid on this machine: torch finds no CUDA GPU"),
    ("trainer.job_timeout_s=0", "trainer.job_timeout_s=0.0 is not valid: expected a number of seconds > 0"),
    ("trainer.peak_flops_per_device=-1", "trainer.peak_flops_per_device=-1.0 is not valid: expected FLOP/s > 0"),
    ("trainer.checkpoint_every_n_steps=0", "trainer.checkpoint_every_n_steps=0 is not valid: expected an integer >= 1"),
    ("trainer.keep_last_k=0", "trainer.keep_last_k=0 is not valid: expected an integer >= 1, or -1 (keep all)"),
    ("trainer.on_nonfinite=ignore", "trainer.on_nonfinite='ignore' is not valid: expected one of ['stop', 'skip']"),
    ("trainer.max_consecutive_skips=0", "trainer.max_consecutive_skips=0 is not valid: expected an integer >= 1"),
    ("trainer.watchdog_s=0", "trainer.watchdog_s=0.0 is not valid: expected a number of seconds > 0 or null"),
    ("trainer.watchdog_startup_s=-5", "trainer.watchdog_startup_s=-5.0 is not valid: expected a number of seconds > 0"),
    ("trainer.preemption_signal=SIGKILL",
     "trainer.preemption_signal='SIGKILL' is not valid: expected one of ['SIGTERM', 'SIGUSR1'], or null"),
    ("trainer.preemption_grace_s=0", "trainer.preemption_grace_s=0.0 is not valid: expected a number of seconds > 0"),
    ("trainer.preemption_grace_s=nan", "trainer.preemption_grace_s=nan is not valid: expected a number of seconds > 0"),
    # run-wide
    ("seed=-1", "seed=-1 is not valid: expected an integer in [0, 4294967295]"),
    ("seed=4294967296", "seed=4294967296 is not valid: expected an integer in [0, 4294967295]"),
    ("ckpt_path=last", "ckpt_path='last' is not valid here: there is no complete checkpoint"),
    ("ckpt_path=/no/such/step-3.ckpt", "ckpt_path='/no/such/step-3.ckpt' is not valid: it does not exist"),
    # checkpoints the format's own check refuses (see tests/checkpoint/test_checkpoint_verify.py for every kind)
    ("ckpt_path={tmp}/small.txt", "ckpt_path='{tmp}/small.txt' is not valid: checkpoint '{tmp}/small.txt' is a file"),
    ("ckpt_path={tmp}", "ckpt_path='{tmp}' is not valid: checkpoint '{tmp}' is incomplete or not a lightning_par "
                        "checkpoint"),
    # model vs data, data
    ("model.vocab_size=64", "model.vocab_size=64 is not valid for this data: its token ids go up to 255"),
    # a model larger than the machine's memory (issue 50): named by field, not by an allocation error in every rank
    ("model.vocab_size=2147483648", "model.vocab_size=2147483648 is not valid: the model's parameters alone take "),
    ("model.vocab_size=2147483648", "Its largest tensor, model.wte.weight of shape (2147483648, 32), is "
                                    "model.vocab_size x model.n_embd"),
    ("data=stdlib data.path=/no/such/corpus", "ByteCorpusDataModule path='/no/such/corpus' is not valid: it does not exist"),
    ("data.path={tmp}/small.txt", "ByteCorpusDataModule path='{tmp}/small.txt' is not valid with synthetic=True"),
    ("data=stdlib data.path={tmp}/small.txt", "corpus (path='{tmp}/small.txt') of 3 tokens is too small for block_size=32"),
    # 700 bytes at dp 2 (the case): one batch of windows in all, none per replica; trained 0 steps and exited 0
    ("data=stdlib data.path={tmp}/corpus700.txt data.batch_size=16 parallel=dp2",
     "corpus (path='{tmp}/corpus700.txt') of 700 tokens is too small for dp_size=2, batch_size=16 and block_size=32"),
    ("data.batch_size=100000", "corpus (synthetic=True) of 200000 tokens is too small for block_size=32 and batch_size=100000"),
    ("data.batch_size=0", "ByteCorpusDataModule batch_size=0 is not valid: expected an integer >= 1"),
    ("data.num_workers=-1", "ByteCorpusDataModule num_workers=-1 is not valid: expected an integer >= 0"),
    ("data.val_batches=0", "ByteCorpusDataModule val_batches=0 is not valid: expected an integer >= 1"),
    # model
    ("model.preset=huge", "GPT preset name='huge' is not valid: expected one of"),
    ("model.n_layer=0", "GPTConfig.n_layer=0 is not valid: expected a positive integer"),
    ("model.n_head=3", "GPTConfig.n_embd=32 is not valid with n_head=3"),
    ("model.block_size=0", "GPTConfig.block_size=0 is not valid: expected a positive integer"),
    ("model.vocab_size=0", "GPTConfig.vocab_size=0 is not valid: expected a positive integer"),
    ("model.dropout=1.5", "GPTConfig.dropout=1.5 is not valid: expected a number in [0, 1)"),
    ("model.learning_rate=0", "GPTLightningModule learning_rate=0.0 is not valid: expected a positive float"),
    ("model.learning_rate=inf", "model.learning_rate=inf is not valid: expected a finite number > 0"),
    ("model.learning_rate=nan", "model.learning_rate=nan is not valid: expected a finite number > 0"),
    ("data.block_size=64", "data.block_size=64 is not valid for this model: it was built for sequences of at most "
                           "32 tokens"),
    ("model.weight_decay=-1", "GPTLightningModule weight_decay=-1.0 is not valid: expected a float >= 0"),
    ("model.warmup_steps=-1", "GPTLightningModule warmup_steps=-1 is not valid: expected an integer >= 0"),
    ("model.min_lr_ratio=2", "GPTLightningModule min_lr_ratio=2.0 is not valid: expected a float in [0, 1]"),
    ("model.adam_eps=0", "GPTLightningModule adam_eps=0.0 is not valid: expected a positive float"),
    # model=hf (a Hugging Face causal LM)
    ("model=hf model.model_type=gpt5", "HFCausalLM model_type='gpt5' is not valid: expected a transformers model type"),
    ("model=hf model.model_type=null",
     "HFCausalLM model_type=None is not valid: expected exactly one of model_type and pretrained"),
    ("model=hf model.pretrained={tmp} model.model_type=llama",
     "HFCausalLM model_type='llama' is not valid: expected exactly one of model_type and pretrained"),
    ("model=hf model.pretrained={tmp}", "HFCausalLM pretrained='{tmp}' is not valid: expected a local directory "
                                        "written by save_pretrained (config.json and model.safetensors"),
    ("model=hf model.optimizer=lamb", "HFCausalLM optimizer='lamb' is not valid: expected one of ('adamw', 'sgd', 'muon')"),
    ("model=hf model.lora.r=-1", "lora.r=-1 is not valid: expected the adapters' rank, a positive int"),
    ("model=hf model.lora.r=8 model.lora.target_modules=[]", "lora.target_modules=[] is not valid"),
    ("model=hf model.lora.r=8 model.lora.quantize_base=int3", "lora.quantize_base='int3' is not valid"),
    ("model=hf model.lora.r=8 model.lora.quantize_base=nf4 strategy=tensor_parallel parallel=tp2",
     "lora.quantize_base='nf4' (QLoRA) is not supported under tensor parallelism"),
    ("model=hf model.lora.r=8 model.optimizer=muon", "HFCausalLM optimizer='muon' is not valid: expected 'adamw' or "
                                                     "'sgd' with LoRA"),
    ("model=hf model.lora.r=8 model.lora.target_modules=[nope_proj]", "nope_proj"),
    ("model=hf strategy=tensor_parallel parallel=tp4",
     "LlamaForCausalLM.config.num_key_value_heads=2 is not divisible by tp_size=4"),
    ("model=hf strategy=tensor_parallel parallel=tp2 +model.config.tie_word_embeddings=true",
     "LlamaForCausalLM.config.tie_word_embeddings=True is not valid with tensor parallelism (tp_size=2)"),
    # layout
    ("parallel.world_size=0", "world_size=0 is not valid: expected an integer >= 1"),
    # the 10,000 ranks on 2 cores: refused before any fork (trainer.allow_oversubscribe=true lifts it)
    ("parallel.world_size=10000", "parallel.world_size=10000 is not valid on this machine: the recipe would start "
                                  "10000 processes on"),
    ("parallel.world_size=3 parallel.dp_size=2", "dp_size * tp_size * pp_size = 2 * 1 * 1 = 2 does not equal world_size=3"),
    ("parallel=tp2 strategy=ddp_overlap", "parallel.tp_size=2 is not valid for strategy 'ddp_overlap'"),
    ("parallel.tp_size=3 parallel.world_size=3 strategy=tensor_parallel", "GPTConfig.n_embd=32 is not divisible by tp_size=3"),
    ("parallel=pp2 strategy=gpipe model.n_layer=1", "the model has 1 layers but the pipeline has 2 virtual stages"),
    # strategy options (the strategies' own constructors and validate_model)
    ("strategy=zero3 strategy.zero.cpu_offload=true", "cpu_offload=True is not valid on a CPU device"),
    ("strategy.reducer.bucket_cap_mb=0", "bucket_cap_mb=0.0 is not valid: expected a number > 0 (MiB)"),
    ("strategy.reducer.comm_hook=foo", "comm_hook='foo' is not valid: expected one of ['none', 'fp16', 'bf16', 'powersgd']"),
    ("strategy.reducer.powersgd_rank=0", "powersgd_rank=0 is not valid: expected an integer >= 1"),
    ("strategy.timeout_s=0", "timeout_s=0.0 is not valid: expected a number > 0 and <= 1e+09 (seconds)"),
    ("strategy.timeout_s=1e15", "timeout_s=1000000000000000.0 is not valid: expected a number > 0 and <= 1e+09 (seconds)"),
    ("strategy.timeout_s=nan", "timeout_s=nan is not valid: expected a number > 0 and <= 1e+09 (seconds)"),
    ("strategy=pipeline parallel=pp2 strategy.pipeline.schedule=foo", "schedule='foo' is not valid: expected one of"),
    ("strategy=1f1b parallel=pp2 strategy.pipeline.schedule=gpipe",
     "strategy.pipeline.schedule='gpipe' contradicts strategy='1f1b'"),
    ("strategy=gpipe parallel=pp2 strategy.pipeline.num_microbatches=0", "num_microbatches=0 is not valid: expected an integer >= 1"),
    ("strategy=gpipe parallel=pp2 strategy.pipeline.split=[1,1,1]", "split=[1, 1, 1] has 3 entries but the pipeline has 2 virtual stages"),
    ("strategy=zero3 strategy.zero.mixed_precision=fp8", "mixed_precision='fp8' is not valid: expected None or one of"),
    ("strategy=zero3 strategy.reducer.bucket_cap_mb=10", "bucket_cap_mb=10.0 is not valid with dp_mode='zero3'"),
    ("strategy=parallel_3d strategy.dp_mode=zero4", "dp_mode='zero4' is not valid: expected one of"),
    ("strategy=tensor_parallel parallel=tp2 strategy.tensor_parallel.sequence_parallel=true model.block_size=31",
     "GPTConfig.block_size=31 is not divisible by tp_size=2, which sequence_parallel=True needs"),
]

#: Rejected by Hydra/OmegaConf when the config is composed (typed schemas, known options).
COMPOSE = [
    "parallel.dp_size=two",
    "strategy=foo",
    "trainer.max_stepz=3",
    "trainer.on_nonfinite=[stop]",
    "trainer.async_checkpoint=maybe",
    "trainer.allow_oversubscribe=maybe",
]


@pytest.fixture(scope="module", autouse=True)
def _hydra():
    """One Hydra initialisation for the module (each costs about half a second)."""
    with initialize_config_dir(config_dir=str(CONF), version_base=None):
        yield


#: ``hydra.compose`` with the group part composed once per distinct selection (tests/support/compose.py); the
#: compose-time rejections below and the equality check call ``hydra.compose`` itself.
_COMPOSER = Composer(CONF)


def _compose(overrides: list[str]):
    return _COMPOSER(BASE + overrides)


def _hydra_compose(overrides: list[str]):
    return compose(config_name="config", overrides=BASE + overrides)


@pytest.fixture
def no_launch(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("a process was about to start: the bad input was not caught before start-up")

    monkeypatch.setattr(train, "run_distributed", refuse)
    monkeypatch.setattr(train, "train_worker", refuse)
    for var in ("RANK", "WORLD_SIZE", "SLURM_PROCID", "SLURM_NTASKS"):
        monkeypatch.delenv(var, raising=False)


@pytest.mark.parametrize(("overrides", "message"), PREFLIGHT, ids=[c[0] for c in PREFLIGHT])
def test_rejected_before_any_process_starts(overrides, message, tmp_path, no_launch):
    (tmp_path / "small.txt").write_text("abc")
    (tmp_path / "corpus700.txt").write_text("lightning_par " * 50)
    cfg = _compose(overrides.format(tmp=tmp_path).split())
    with pytest.raises(ValueError, match=re.escape(message.format(tmp=tmp_path))):
        train.launch_job(cfg, tmp_path / "run")
    assert not (tmp_path / "run" / ".heartbeat").exists()


@pytest.mark.parametrize("override", COMPOSE)
def test_rejected_when_the_config_is_composed(override):
    with pytest.raises(ConfigCompositionException):
        _hydra_compose([override])
    with pytest.raises(ConfigCompositionException):  # the cached path refuses it the same way
        _compose([override])


#: One row of each kind the table uses: a value, a value into a typed float, a list, an added key, a group choice with
#: values, two group choices with a list, a path.
SAME = [
    "trainer.max_steps=0",
    "trainer.gradient_clip_val=nan",
    "model=hf model.lora.r=8 model.lora.target_modules=[nope_proj]",
    "model=hf strategy=tensor_parallel parallel=tp2 +model.config.tie_word_embeddings=true",
    "strategy=gpipe parallel=pp2 strategy.pipeline.split=[1,1,1]",
    "data=stdlib data.path={tmp}/small.txt",
    "parallel.world_size=9 trainer.allow_oversubscribe=true",
]


@pytest.mark.parametrize("overrides", SAME)
def test_the_cached_compose_equals_hydra_compose(overrides, tmp_path):
    """The helper the rows above go through gives exactly the config ``hydra.compose`` gives: same values, same
    types (YAML of the unresolved config), same struct flag."""
    from omegaconf import OmegaConf

    overrides = overrides.format(tmp=tmp_path).split()
    cached, composed = _compose(overrides), _hydra_compose(overrides)
    assert OmegaConf.to_yaml(cached) == OmegaConf.to_yaml(composed)
    assert OmegaConf.is_struct(cached) and OmegaConf.is_struct(composed)
    cached.trainer.max_steps = 12345  # a copy: the next call does not see it
    assert _compose(overrides).trainer.max_steps == composed.trainer.max_steps


def test_a_run_directory_in_use_is_refused(tmp_path, monkeypatch):
    """Two jobs given the same hydra.run.dir: the second fails at once instead of mixing logs and checkpoints."""
    import fcntl

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    with open(run_dir / ".lock", "a+") as held:
        fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
        held.write("4242")
        held.flush()
        with pytest.raises(RuntimeError, match=re.escape("is in use by another job (pid 4242)")):
            with train._claim(run_dir):
                pass
    with train._claim(run_dir):  # free again once the holder let go (or died)
        pass


def test_oversubscribing_the_cores_is_an_explicit_choice(monkeypatch):
    """More than 4 CPU processes per core are refused naming the cores and the override; with
    trainer.allow_oversubscribe=true the machine check passes."""
    monkeypatch.setattr(train, "_usable_cores", lambda: 2)
    cfg = _compose(["parallel.world_size=9"])
    dims = train.build_parallel_dims(cfg)
    with pytest.raises(ValueError, match=re.escape("parallel.world_size=9 is not valid on this machine: the recipe "
                                                   "would start 9 processes on 2 CPU cores. Expected "
                                                   "parallel.world_size <= 8 (4 per core)")):
        train._check_machine(cfg, dims, None)
    train._check_machine(_compose(["parallel.world_size=9", "trainer.allow_oversubscribe=true"]), dims, None)
    train._check_machine(cfg, dims, 9)  # under torchrun/SLURM the processes exist already
    train._check_machine(_compose(["parallel.world_size=8"]), train.build_parallel_dims(_compose([
        "parallel.world_size=8"])), None)
