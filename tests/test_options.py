"""Options.validate(): every rejected value / combination raises OptionsError naming the option(s); the
accepted neighbours of each rejection pass; gradient_manager_kind follows llm.q's zero-level mapping; config
files (TOML, YAML) load into options with llm.q spellings, and bad files name the file and the key."""
from __future__ import annotations

import dataclasses

import pytest

from qtrain.cli.config_file import load_config_file
from qtrain.options import ALIASES, DEFAULT_MODEL, Options, OptionsError, normalize_mapping


def _bad(expect: tuple[str, ...], **kw) -> str:
    """validate() must raise OptionsError for `kw`, with every string in `expect` in the message."""
    with pytest.raises(OptionsError) as ei:
        Options(**kw).validate()
    msg = str(ei.value)
    for s in expect:
        assert s in msg, f"{kw}: {s!r} not in {msg!r}"
    return msg


def test_defaults_validate_and_mirror_llmq():
    o = Options()
    assert o.validate() is o  # chaining
    assert isinstance(OptionsError("x"), ValueError)  # the CLI turns qtrain ValueErrors into exit code 2
    # llm.q's defaults (reference §1.1) for the options qtrain shares with it
    assert (o.model_dtype, o.opt_m_dtype, o.opt_v_dtype) == ("bf16", "fp32", "fp32")
    assert (o.batch_size, o.seq_len, o.lmhead_chunks, o.grad_accumulation) == (4, 1024, 1, 4)
    assert (o.train_seed, o.eval_seed) == (0x83B45442, 0x384B4524)
    assert (o.learning_rate, o.warmup, o.cooldown, o.final_lr_fraction, o.lr_schedule) == (1e-5, 0, 0, 1.0, "cosine")
    assert (o.beta_1, o.beta_2, o.adam_epsilon, o.weight_decay, o.grad_clip, o.z_loss) == (0.9, 0.95, 1e-8, 0.1, 1.0, 0.0)
    assert (o.steps, o.epochs, o.eval_every_n_steps, o.eval_num_steps) == (-1, 1, 100, 100)
    assert (o.out_dir, o.checkpoint_dir, o.ckpt_interval, o.ckpt_keep_n, o.ckpt_major) == ("output/%n", "ckpt/%n", 100, -1, -1)
    assert o.save_training_state is True and o.continue_from is None and o.new_data is False
    assert (o.gpus, o.zero_level, o.shard_gradients, o.all_to_all_reduce, o.offload_gradients) == (0, 1, False, False, False)
    assert o.effective_matmul_dtype == "bf16"
    assert isinstance(DEFAULT_MODEL, str) and DEFAULT_MODEL


def test_expand_substitutes_name():
    o = Options(name="run7")
    assert o.expand(o.out_dir) == "output/run7"
    assert o.expand(o.checkpoint_dir) == "ckpt/run7"
    assert o.expand("a/%n/b/%n") == "a/run7/b/run7"


# ---- bad choice values -------------------------------------------------------------------------------------
@pytest.mark.parametrize("field,opt,value", [
    ("model_dtype", "--model-dtype", "fp16"),
    ("model_dtype", "--model-dtype", "e4m3"),  # a matmul dtype, not a model dtype
    ("matmul_dtype", "--matmul-dtype", "fp16"),
    ("matmul_dtype", "--matmul-dtype", "e5m2"),
    ("gradient_dtype", "--gradient-dtype", "bf16"),
    ("opt_m_dtype", "--opt-m-dtype", "fp16"),
    ("opt_v_dtype", "--opt-v-dtype", "e4m3"),  # v has no e4m3 variant in llm.q
    ("lr_schedule", "--lr-schedule", "step"),
    ("lr_schedule", "--lr-schedule", "Cosine"),  # case matters
    ("device", "--device", "tpu"),
    ("device", "--device", "cuda:0"),
    ("compile", "--compile", "yes"),
    ("compile", "--compile", "true"),
    ("delta_rule_precision", "--delta-rule-precision", "bf16"),
    ("delta_rule_precision", "--delta-rule-precision", "tf32x3"),  # the kernels' name, not the option's
])
def test_bad_choice_names_option_and_value(field, opt, value):
    msg = _bad((opt, repr(value)), **{field: value})
    assert "must be one of" in msg


@pytest.mark.parametrize("field,value", [
    ("lr_schedule", "cosine"), ("lr_schedule", "linear"), ("lr_schedule", "wsd"),
    ("device", "auto"), ("device", "cpu"), ("device", "cuda"),
    ("compile", "auto"), ("compile", "on"), ("compile", "off"),
    ("matmul_dtype", "bf16"), ("matmul_dtype", ""),
    ("opt_m_dtype", "bf16"), ("opt_v_dtype", "bf16"),
    ("delta_rule_precision", "fp32"), ("delta_rule_precision", "tf32"),
])
def test_good_choice_values_pass(field, value):
    Options(**{field: value}).validate()


def test_gradient_dtype_only_with_fp8_matmuls():
    _bad(("--gradient-dtype", "--matmul-dtype e4m3"), gradient_dtype="e5m2")
    _bad(("--gradient-dtype", "--matmul-dtype e4m3"), gradient_dtype="e4m3", matmul_dtype="bf16")


# ---- dtype combinations ------------------------------------------------------------------------------------
@pytest.mark.parametrize("m,v", [("bf16", "fp32"), ("fp32", "bf16"), ("bf16", "bf16")])
def test_fp32_model_rejects_low_precision_moments(m, v):
    _bad(("--model-dtype fp32", "--opt-m-dtype", "--opt-v-dtype"), model_dtype="fp32", opt_m_dtype=m, opt_v_dtype=v)


def test_dtype_combinations_that_pass():
    Options(model_dtype="fp32").validate()
    Options(model_dtype="fp32", matmul_dtype="fp32").validate()
    for m in ("fp32", "bf16"):
        for v in ("fp32", "bf16"):
            Options(model_dtype="bf16", opt_m_dtype=m, opt_v_dtype=v).validate()
    assert Options(model_dtype="fp32").effective_matmul_dtype == "fp32"



def test_bf16_matmuls_under_fp32_weights_are_refused():
    """The block linears run in the model dtype (or e4m3): bf16 matmuls with fp32 weights would change nothing while
    the plan and the log header said "matmul bf16" (issue 41), so the combination is refused."""
    _bad(("--matmul-dtype bf16", "--model-dtype fp32"), model_dtype="fp32", matmul_dtype="bf16")


def test_fp32_master_under_a_bf16_model():
    o = Options(model_dtype="bf16", master_dtype="fp32").validate()
    assert o.separate_master and o.effective_master_dtype == "fp32"
    assert not Options(model_dtype="bf16", master_dtype="bf16").validate().separate_master
    assert Options(model_dtype="fp32").effective_master_dtype == "fp32"
    Options(master_dtype="fp32", matmul_dtype="e4m3", persistent_quants=True, zero_level=2).validate()
    _bad(("--master-dtype bf16", "--model-dtype fp32"), model_dtype="fp32", master_dtype="bf16")
    _bad(("--master-dtype fp32", "--opt-m-dtype"), master_dtype="fp32", opt_m_dtype="bf16")
    _bad(("--master-dtype fp32", "--opt-v-dtype"), master_dtype="fp32", opt_v_dtype="bf16")
    Options(master_dtype="fp32", zero_level=3).validate()
    _bad(("--master-dtype fp32", "--offload-master"), master_dtype="fp32", zero_level=3, offload_master=True)
    _bad(("--master-dtype", "'fp16'", "must be one of"), master_dtype="fp16")
    assert Options(master_dtype="fp32", grad_accum_dtype="bf16").validate().effective_grad_accum_dtype == "bf16"
    assert Options(master_dtype="fp32").effective_grad_accum_dtype == "fp32"
    _bad(("--grad-accum-dtype bf16", "--master-dtype fp32"), model_dtype="fp32", grad_accum_dtype="bf16")
    _bad(("--grad-accum-dtype fp32", "--master-dtype fp32"), grad_accum_dtype="fp32")


def test_fp8_policy():
    Options(matmul_dtype="e4m3", fp8_policy="auto", fp8_min_size=0).validate()
    assert Options().fp8_policy == "auto"  # a policy without e4m3 matmuls is simply unused
    Options(fp8_policy="all").validate()
    _bad(("--fp8-policy", "'some'", "must be one of"), matmul_dtype="e4m3", fp8_policy="some")
    _bad(("--fp8-min-size", "-1"), matmul_dtype="e4m3", fp8_policy="auto", fp8_min_size=-1)
    _bad(("--fp8-min-block-gflop", "-1"), matmul_dtype="e4m3", fp8_min_block_gflop=-1.0)
    _bad(("--fp8-min-block-gflop", "nan"), matmul_dtype="e4m3", fp8_min_block_gflop=float("nan"))


def test_e4m3_first_moment_needs_bf16_second_moment():
    _bad(("--opt-m-dtype e4m3", "--opt-v-dtype bf16"), opt_m_dtype="e4m3", opt_v_dtype="fp32")
    Options(model_dtype="bf16", opt_m_dtype="e4m3", opt_v_dtype="bf16").validate()  # wired (tests/test_opt_m_e4m3.py)
    Options(opt_m_dtype="e4m3", opt_v_dtype="bf16", shard_weights=True, offload_master=True, offload_opt_m=True,
            offload_opt_v=True).validate()


def test_e4m3_first_moment_refusals():
    _bad(("--model-dtype fp32", "--opt-m-dtype"), model_dtype="fp32", opt_m_dtype="e4m3", opt_v_dtype="bf16")
    _bad(("--opt-m-dtype e4m3", "stochastic rounding", "--no-stochastic-rounding"), opt_m_dtype="e4m3",
         opt_v_dtype="bf16", stochastic_rounding=False)


def test_fp32_matmuls_with_bf16_model_rejected():
    _bad(("--matmul-dtype fp32", "--model-dtype bf16"), matmul_dtype="fp32")


def test_not_yet_implemented_features_are_refused_by_name():
    # Current state: these are llm.q features qtrain does not run yet. Update when they are wired in.
    Options(matmul_dtype="e4m3").validate()  # FP8 block linears: wired (tests/test_numerics_convergence.py)
    Options(opt_m_dtype="e4m3", opt_v_dtype="bf16").validate()  # block-scaled FP8 Adam m: wired (tests/test_opt_m_e4m3.py)
    Options(zero_level=3).validate()  # sharded weights + gradients: implemented (tests/test_sharded_weights.py)
    assert Options(zero_level=3).weights_sharded and Options(zero_level=3).gradient_manager_kind == "reduce-scatter"
    # persistent (and offloaded) e4m3 weight shards: wired (tests/test_persistent_quants.py)
    Options(persistent_quants=True, zero_level=3, matmul_dtype="e4m3").validate()
    Options(persistent_quants=True, offload_quants=True, shard_weights=True, matmul_dtype="e4m3").validate()


# ---- sizes / counts ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("field", ["batch_size", "seq_len", "grad_accumulation", "lmhead_chunks", "epochs",
                                   "eval_every_n_steps", "ckpt_interval"])
@pytest.mark.parametrize("value", [0, -1])
def test_non_positive_sizes_rejected(field, value):
    opt = "--" + field.replace("_", "-")
    _bad((opt, ">= 1", str(value)), **{field: value})


@pytest.mark.parametrize("steps", [0, -2, -100])
def test_steps_zero_or_below_minus_one_rejected(steps):
    _bad(("--steps", str(steps)), steps=steps)


def test_steps_minus_one_and_positive_pass():
    Options(steps=-1).validate()
    Options(steps=1).validate()


def test_eval_num_steps():
    _bad(("--eval-num-steps",), eval_num_steps=-1)
    Options(eval_num_steps=0).validate()  # 0 = no periodic eval batches


def test_gpus_negative_rejected():
    _bad(("--gpus",), gpus=-1)
    Options(gpus=0).validate()
    Options(gpus=3).validate()


@pytest.mark.parametrize("b,t,n", [(4, 1024, 3), (1, 8, 16), (3, 5, 2), (2, 6, 5)])
def test_lmhead_chunks_must_divide_tokens(b, t, n):
    msg = _bad(("--lmhead-chunks", str(n), str(b * t)), batch_size=b, seq_len=t, lmhead_chunks=n)
    assert "divide" in msg


@pytest.mark.parametrize("b,t,n", [(4, 1024, 4096), (4, 1024, 8), (3, 5, 15), (3, 5, 3), (1, 8, 1)])
def test_lmhead_chunks_dividing_tokens_pass(b, t, n):
    Options(batch_size=b, seq_len=t, lmhead_chunks=n).validate()


# ---- optimiser / schedule ----------------------------------------------------------------------------------
@pytest.mark.parametrize("lr", [0.0, -1e-4])
def test_learning_rate_must_be_positive(lr):
    _bad(("--learning-rate",), learning_rate=lr)


@pytest.mark.parametrize("f", [-0.1, 1.5])
def test_final_lr_fraction_range(f):
    _bad(("--final-lr-fraction",), final_lr_fraction=f)


@pytest.mark.parametrize("f", [0.0, 0.1, 1.0])
def test_final_lr_fraction_bounds_pass(f):
    Options(final_lr_fraction=f).validate()


def test_negative_warmup_or_cooldown():
    _bad(("--warmup",), warmup=-1)
    _bad(("--cooldown",), cooldown=-1)


def test_warmup_plus_cooldown_exceeding_steps():
    msg = _bad(("--warmup", "--cooldown", "--steps"), steps=10, warmup=6, cooldown=5)
    assert "6" in msg and "5" in msg and "10" in msg
    _bad(("--warmup", "--steps"), steps=10, warmup=11)
    _bad(("--cooldown", "--steps"), steps=10, cooldown=11)
    Options(steps=10, warmup=5, cooldown=5).validate()  # exactly steps is fine
    Options(steps=-1, warmup=10_000, cooldown=10_000).validate()  # steps unknown until the data is seen


@pytest.mark.parametrize("kw,opt", [
    ({"beta_1": 1.0}, "--beta-1"), ({"beta_1": -0.1}, "--beta-1"),
    ({"beta_2": 1.0}, "--beta-2"), ({"beta_2": -0.5}, "--beta-2"),
    ({"adam_epsilon": 0.0}, "--adam-epsilon"), ({"adam_epsilon": -1e-8}, "--adam-epsilon"),
    ({"weight_decay": -0.1}, "--weight-decay"), ({"z_loss": -1e-4}, "--z-loss"),
])
def test_optimizer_hyperparameters(kw, opt):
    _bad((opt,), **kw)


def test_optimizer_hyperparameters_edges_pass():
    Options(beta_1=0.0, beta_2=0.0, weight_decay=0.0, z_loss=0.0, grad_clip=0.0).validate()
    Options(grad_clip=-1.0).validate()  # <= 0 disables clipping


# ---- flag dependencies -------------------------------------------------------------------------------------
def test_init_proj_to_zero_needs_from_scratch():
    _bad(("--init-proj-to-zero", "--from-scratch"), init_proj_to_zero=True)
    Options(init_proj_to_zero=True, from_scratch=True).validate()


def test_new_data_needs_continue():
    _bad(("--new-data", "--continue"), new_data=True)
    Options(new_data=True, continue_from="latest").validate()
    Options(new_data=True, continue_from="300").validate()


@pytest.mark.parametrize("z", [-1, 4])
def test_zero_level_range(z):
    _bad(("--zero-level", str(z)), zero_level=z)


def test_zero_level_and_shard_gradients_exclusive():
    _bad(("--zero-level", "--shard-gradients", "mutually exclusive"), zero_level=2, shard_gradients=True)
    Options(zero_level=1, shard_gradients=True).validate()  # 1 is the default, so no conflict
    Options(zero_level=0, shard_gradients=True).validate()


@pytest.mark.parametrize("z", [0, 1])
def test_all_to_all_needs_sharded_gradients(z):
    _bad(("--all-to-all-reduce", "--shard-gradients", "--zero-level 2"), zero_level=z, all_to_all_reduce=True)


@pytest.mark.parametrize("z", [0, 1])
def test_offload_gradients_needs_sharded_gradients(z):
    _bad(("--offload-gradients", "unsharded gradients cannot be offloaded"), zero_level=z, offload_gradients=True)


@pytest.mark.parametrize("kw", [
    {"shard_gradients": True, "offload_gradients": True},
    {"zero_level": 2, "offload_gradients": True},
    {"shard_gradients": True, "all_to_all_reduce": True},
    {"zero_level": 2, "all_to_all_reduce": True, "offload_gradients": True},
])
def test_sharded_gradient_combinations_pass(kw):
    Options(**kw).validate()


# ---- gradient manager mapping (llm.q: zero-level 2 => sharded gradients) -----------------------------------
@pytest.mark.parametrize("kw,kind", [
    ({}, "unsharded"),
    ({"zero_level": 0}, "unsharded"),
    ({"zero_level": 1}, "unsharded"),
    ({"zero_level": 2}, "reduce-scatter"),
    ({"shard_gradients": True}, "reduce-scatter"),
    ({"zero_level": 0, "shard_gradients": True}, "reduce-scatter"),
    ({"zero_level": 2, "all_to_all_reduce": True}, "all-to-all"),
    ({"shard_gradients": True, "all_to_all_reduce": True}, "all-to-all"),
    ({"shard_gradients": True, "offload_gradients": True}, "reduce-scatter"),  # offload does not change the kind
    ({"all_to_all_reduce": True}, "unsharded"),  # (validate rejects this one)
])
def test_gradient_manager_kind(kw, kind):
    assert Options(**kw).gradient_manager_kind == kind


# ---- mappings / config files -------------------------------------------------------------------------------
def test_to_dict_from_mapping_roundtrip():
    o = Options(batch_size=8, learning_rate=3e-4, continue_from="latest", shard_gradients=True, name="x")
    d = o.to_dict()
    assert set(d) == Options.field_names()
    assert Options.from_mapping(d) == o
    assert Options.from_mapping(Options().to_dict()) == Options()


def test_from_mapping_accepts_llmq_spellings_and_aliases():
    o = Options.from_mapping({"batch": 8, "seq-length": 256, "lr": 3e-4, "grad-accumulation": 2,
                              "use-all-to-all-reduce": True, "offload_grads": True, "continue": "latest",
                              "shard-gradients": True})
    assert (o.batch_size, o.seq_len, o.learning_rate, o.grad_accumulation) == (8, 256, 3e-4, 2)
    assert o.all_to_all_reduce and o.offload_gradients and o.shard_gradients
    assert o.continue_from == "latest"
    for alias, target in ALIASES.items():
        assert target in Options.field_names(), alias


def test_from_mapping_unknown_key_names_source_and_key():
    with pytest.raises(OptionsError) as ei:
        Options.from_mapping({"batch": 8, "bogus-option": 1}, source="my.toml")
    assert "my.toml" in str(ei.value) and "bogus-option" in str(ei.value)


def test_mapping_same_option_twice_rejected():
    with pytest.raises(OptionsError, match="batch_size"):
        normalize_mapping({"batch": 8, "batch_size": 4}, source="f.toml")


@pytest.mark.parametrize("key,value,field,expect", [
    ("lr", "3e-4", "learning_rate", 3e-4),       # what PyYAML makes of `lr: 3e-4`
    ("learning_rate", 1, "learning_rate", 1.0),  # TOML/YAML integer for a float option
    ("train_seed", "0x83b45442", "train_seed", 0x83B45442),
    ("batch", "8", "batch_size", 8),
    ("continue", True, "continue_from", "latest"),
    ("continue", False, "continue_from", None),
    ("continue", 300, "continue_from", "300"),
    ("continue", "ckpt/run/step_00000300", "continue_from", "ckpt/run/step_00000300"),
])
def test_mapping_values_coerced_to_field_types(key, value, field, expect):
    got = normalize_mapping({key: value})[field]
    assert got == expect and type(got) is type(expect)


@pytest.mark.parametrize("key,value", [
    ("batch_size", "eight"), ("batch_size", 8.5), ("batch_size", True), ("learning_rate", "fast"),
    ("learning_rate", False), ("from_scratch", "yes"), ("from_scratch", 1), ("model_dtype", 16),
    ("continue", 1.5), ("seq_len", [1024]),
])
def test_mapping_ill_typed_values_name_source_and_key(key, value):
    with pytest.raises(OptionsError) as ei:
        normalize_mapping({key: value}, source="--config run.toml")
    assert "run.toml" in str(ei.value) and key in str(ei.value)


def _write(tmp_path, name: str, text: str) -> str:
    p = tmp_path / name
    p.write_text(text)
    return str(p)


def test_load_toml(tmp_path):
    path = _write(tmp_path, "run.toml", """
model = "Qwen/Qwen2.5-0.5B"
batch-size = 8
seq_len = 256
lr = 3e-4
train_seed = 0x1234
shard-gradients = true
lr_schedule = "wsd"
""")
    d = load_config_file(path)
    o = Options.from_mapping(d, source=path).validate()
    assert (o.model, o.batch_size, o.seq_len, o.learning_rate) == ("Qwen/Qwen2.5-0.5B", 8, 256, 3e-4)
    assert o.train_seed == 0x1234 and o.shard_gradients and o.lr_schedule == "wsd"
    assert o.gradient_manager_kind == "reduce-scatter"


def test_load_yaml(tmp_path):
    pytest.importorskip("yaml")
    for ext in ("yaml", "yml"):
        path = _write(tmp_path, f"run.{ext}", """
model: Qwen/Qwen2.5-0.5B
batch: 8
seq-length: 256
lr: 3e-4          # PyYAML reads this as a string; options must still get a float
warmup: 10
final_lr_fraction: 0.1
eval_seed: 0x384b4524
from_scratch: true
continue:
""")
        o = Options.from_mapping(load_config_file(path), source=path).validate()
        assert (o.model, o.batch_size, o.seq_len, o.learning_rate) == ("Qwen/Qwen2.5-0.5B", 8, 256, 3e-4)
        assert isinstance(o.learning_rate, float)
        assert (o.warmup, o.final_lr_fraction, o.eval_seed, o.from_scratch) == (10, 0.1, 0x384B4524, True)
        assert o.continue_from is None  # `continue:` with no value = not given


def test_empty_config_files(tmp_path):
    assert load_config_file(_write(tmp_path, "e.toml", "")) == {}
    assert Options.from_mapping(load_config_file(_write(tmp_path, "c.toml", "# nothing\n"))) == Options()


def test_empty_yaml_file(tmp_path):
    pytest.importorskip("yaml")
    assert load_config_file(_write(tmp_path, "e.yaml", "")) == {}


def test_malformed_toml_names_file(tmp_path):
    path = _write(tmp_path, "broken.toml", "batch_size = \nlr = [1,\n")
    with pytest.raises(OptionsError) as ei:
        load_config_file(path)
    assert path in str(ei.value) and "TOML" in str(ei.value)


def test_non_utf8_toml_names_file(tmp_path):
    p = tmp_path / "latin1.toml"
    p.write_bytes(b'name = "caf\xe9"\n')
    with pytest.raises(OptionsError) as ei:
        load_config_file(str(p))
    assert str(p) in str(ei.value)


def test_malformed_yaml_names_file(tmp_path):
    pytest.importorskip("yaml")
    path = _write(tmp_path, "broken.yaml", "lr: [1e-4,\nbatch: 8\n  : :\n")
    with pytest.raises(OptionsError) as ei:
        load_config_file(path)
    assert path in str(ei.value) and "YAML" in str(ei.value)


def test_yaml_that_is_not_a_table_names_file(tmp_path):
    pytest.importorskip("yaml")
    path = _write(tmp_path, "list.yaml", "- batch: 8\n- lr: 1e-4\n")
    with pytest.raises(OptionsError) as ei:
        load_config_file(path)
    assert path in str(ei.value)


def test_missing_config_file(tmp_path):
    for path, says in ((str(tmp_path / "nope.toml"), "not found"), (str(tmp_path), "is a directory")):
        with pytest.raises(ValueError) as ei:  # OptionsError / fsio.InputError: one line naming the path
            load_config_file(path)
        assert path in str(ei.value) and says in str(ei.value)


def test_unknown_key_in_file_names_file_and_key(tmp_path):
    path = _write(tmp_path, "run.toml", "batch = 8\nlearning-rat = 1e-4\n")
    with pytest.raises(OptionsError) as ei:
        Options.from_mapping(load_config_file(path), source=path)
    assert path in str(ei.value) and "learning-rat" in str(ei.value)


def test_toml_tables_are_sections_one_level_deep(tmp_path):
    # a table groups options (issue 19: torchtitan-style configs); a table inside a table is an error naming both
    path = _write(tmp_path, "run.toml", "[train]\nbatch = 8\n")
    assert Options.from_mapping(load_config_file(path), source=path).batch_size == 8
    path = _write(tmp_path, "deep.toml", "[train]\n[train.optim]\nlr = 1e-4\n")
    with pytest.raises(OptionsError) as ei:
        load_config_file(path)
    assert path in str(ei.value) and "[train.optim]" in str(ei.value)


def test_every_field_has_a_type_the_loaders_understand():
    import typing
    hints = typing.get_type_hints(Options)
    for f in dataclasses.fields(Options):
        assert f.name == "continue_from" or hints[f.name] in (bool, bool | None, int, float, str), f.name


def test_every_field_is_in_one_help_section():
    """--help groups the options by `SECTIONS`: each field in exactly one (a new field needs its topic there)."""
    from qtrain.options import SECTIONS
    listed = [n for names in SECTIONS.values() for n in names]
    assert sorted(listed) == sorted(Options.field_names()), set(listed) ^ Options.field_names()


def test_verbose_and_quiet_exclude_each_other():
    assert Options(verbose=True).validate().verbose and Options(quiet=True).validate().quiet
    with pytest.raises(OptionsError, match="--verbose and --quiet"):
        Options(verbose=True, quiet=True).validate()
