"""Strict config loading: unknown/mistyped keys name key and file; examples document defaults."""

from __future__ import annotations

from pathlib import Path
from typing import get_args, get_type_hints

import msgspec
import pytest
import yaml

from nedolm.model import ModelConfig
from nedolm.model.config import ATTN_IMPLS
from nedolm.train.base import model_config
from nedolm.train.config import (
    ConfigError,
    OptimConfig,
    ProfileConfig,
    SFTConfig,
    TrainConfig,
    ValidationConfig,
    load_run_config,
    load_sft_config,
)

EXAMPLES = Path(__file__).resolve().parents[3] / "examples"
MINIMAL = "run_dir: r\nbase_config: b.yaml\nbase_run_dir: br\ndata_dir: d\noptim: {}\ntrain: {}\n"


def _write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "sft.yaml"
    path.write_text(text, encoding="utf-8")
    return path


def test_relative_paths_resolve_against_the_yaml_dir(tmp_path: Path) -> None:
    cfg = load_sft_config(_write(tmp_path, MINIMAL + "base_checkpoint: ck/step.pt\n"))
    assert cfg.run_dir == tmp_path / "r" and cfg.data_dir == tmp_path / "d"
    assert cfg.base_checkpoint == tmp_path / "ck" / "step.pt"
    assert cfg.train == TrainConfig() and cfg.validation == ValidationConfig()


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        (
            MINIMAL.replace("train: {}", "train: {micro_batch: 4}"),
            "unknown key `micro_batch` in `train`; did you mean `micro_batch_size`?",
        ),
        (MINIMAL.replace("train: {}", "train: {seq_len: long}"), "$.train.seq_len"),
        (
            MINIMAL.replace("optim: {}", "optim: {schedule: step}"),
            "`optim.schedule`: 'step' is not one of: constant, cosine, linear, wsd",
        ),
        (MINIMAL.replace("optim: {}", "optim: {lr: 0}"), "optim.lr must be a finite number > 0"),
        (MINIMAL.replace("train: {}", "train: {keep_last: 0}"), "keep_last must be >= 1"),
        (MINIMAL + "validatoin: {}\n", "unknown key `validatoin`; did you mean `validation`?"),
        (MINIMAL + "run_dri: x\n", "unknown key `run_dri`; did you mean `run_dir`?"),
        (
            MINIMAL.replace("train: {}", "train: {parallelism: zero3}"),
            "`train.parallelism`: 'zero3' is not one of: ddp, fsdp",
        ),
        (
            MINIMAL.replace("train: {}", "train: {morph_dispatch: dense}"),
            "`train.morph_dispatch`: 'dense' is not one of: grouped, masked, sparse",
        ),
        (
            MINIMAL.replace("train: {}", "train: {attn_impl: xformers}"),
            "`train.attn_impl`: 'xformers' is not one of: auto, flash, flex, sdpa, torch_varlen",
        ),
        ("- a\n- b\n", "expected a mapping of keys, got list"),
        (MINIMAL.replace("data_dir: d\n", ""), "missing required field `data_dir`"),
        ("run_dir: [\n", "not valid YAML"),
    ],
)
def test_bad_keys_are_errors_naming_key_and_file(tmp_path: Path, text: str, needle: str) -> None:
    path = _write(tmp_path, text)
    with pytest.raises(ConfigError) as err:
        load_sft_config(path)
    assert str(path) in str(err.value) and needle in str(err.value)


@pytest.mark.parametrize(
    ("key", "value"),
    [("compile_mode", "max-autotune-no-cudagraphs"), ("compile_backend", "aot_eager")],
)
def test_torch_compile_choices_torch_offers_are_accepted(tmp_path: Path, key, value) -> None:
    text = MINIMAL.replace("train: {}", f"train: {{{key}: {value}}}")
    assert getattr(load_sft_config(_write(tmp_path, text)).train, key) == value


@pytest.mark.parametrize(
    ("key", "typo", "close"),
    [("compile_mode", "max_autotune_no_cudagraphs", "max-autotune-no-cudagraphs"),
     ("compile_backend", "inductr", "inductor")],
)  # fmt: skip
def test_torch_compile_choices_torch_lacks_are_refused(tmp_path: Path, key, typo, close) -> None:
    """Not left to the warm-up, whose failure the run survives uncompiled."""
    text = MINIMAL.replace("train: {}", f"train: {{{key}: {typo}}}")
    refusal = rf"`train\.{key}`: '{typo}' is not one of torch \S+'s: .*; did you mean '{close}'\?"
    with pytest.raises(ConfigError, match=refusal):
        load_sft_config(_write(tmp_path, text))


@pytest.mark.parametrize(
    ("key", "value", "instead"),
    [("compile_mode", "reduce-overhead", "default"),
     ("compile_mode", "max-autotune", "max-autotune-no-cudagraphs"),
     ("compile_backend", "cudagraphs", "inductor")],
)  # fmt: skip
def test_compile_choices_that_capture_cuda_graphs_are_refused(
    tmp_path: Path, key, value, instead
) -> None:
    """torch offers them, but it records a CUDA graph per distinct input size, and the compiled
    blocks trace the segment count and longest segment as sizes (test_compile_once.py shows one
    graph serving micro-batches that differ in both): a graph recorded almost every step."""
    text = MINIMAL.replace("train: {}", f"train: {{{key}: {value}}}")
    refusal = rf"`train\.{key}`: '{value}' .*CUDA graph.* use '{instead}'"
    with pytest.raises(ConfigError, match=refusal):
        load_sft_config(_write(tmp_path, text))
    compile_off = text.replace(f"{key}: {value}", f"{key}: {value}, compile: false")
    assert getattr(load_sft_config(_write(tmp_path, compile_off)).train, key) == value


def test_yaml_11_floats_are_accepted(tmp_path: Path) -> None:
    cfg = load_sft_config(_write(tmp_path, MINIMAL.replace("optim: {}", "optim: {lr: 1e-4}")))
    assert cfg.optim.lr == 1e-4


def test_missing_file_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read"):
        load_sft_config(tmp_path / "nope.yaml")


def test_example_sft_documents_every_default() -> None:
    raw = yaml.safe_load((EXAMPLES / "sft.yaml").read_text(encoding="utf-8"))
    for section, struct in (
        ("optim", OptimConfig()),
        ("train", TrainConfig()),
        ("validation", ValidationConfig()),
        ("profile", ProfileConfig()),
    ):
        documented = msgspec.convert(raw[section], type(struct), strict=False)
        assert documented == struct, section
        assert set(raw[section]) == set(struct.__struct_fields__), section
    assert set(raw) == set(SFTConfig.__struct_fields__)
    assert isinstance(load_sft_config(EXAMPLES / "sft.yaml"), SFTConfig)


def test_cluster_example_loads_with_the_recipe_it_documents() -> None:
    """The 8xH200 recipe users copy: valid, and the batch its throughput comment works out."""
    path = EXAMPLES / "sft-0.8b-8xh200.yaml"
    train = load_sft_config(path).train
    assert (train.seq_len, train.micro_batch_size, train.grad_accum_steps) == (4096, 4, 4)
    assert train.compile and train.parallelism == "ddp"
    step_tokens = 8 * train.micro_batch_size * train.grad_accum_steps * train.seq_len
    assert f"step of {step_tokens:,} tokens" in path.read_text(encoding="utf-8")


def test_example_base_is_a_valid_model_config() -> None:
    run_config = load_run_config(EXAMPLES / "base.yaml")
    cfg = model_config(run_config, morph_dispatch="sparse", attn_impl="sdpa")
    assert isinstance(cfg, ModelConfig) and cfg.morph_dispatch == "sparse"
    assert cfg.attn_impl == "sdpa"
    unset = model_config(run_config, morph_dispatch=None, attn_impl=None)
    assert (unset.morph_dispatch, unset.attn_impl) == ("masked", "auto")


def test_train_attn_impl_offers_every_backend_the_model_has() -> None:
    literal, none = get_args(get_type_hints(TrainConfig)["attn_impl"])  # Literal[...] | None
    assert set(get_args(literal)) == set(ATTN_IMPLS) and none is type(None)


def test_optim_and_train_sections_may_be_omitted(tmp_path: Path) -> None:
    text = MINIMAL.replace("optim: {}\n", "").replace("train: {}\n", "")
    cfg = load_sft_config(_write(tmp_path, text))
    assert cfg.optim == OptimConfig() and cfg.train == TrainConfig()


def test_overrides_are_typed_by_the_schema(tmp_path: Path) -> None:
    cfg = load_sft_config(
        _write(tmp_path, MINIMAL),
        overrides=[
            "optim.lr=1e-4",
            "train.max_steps=30",
            "train.compile=false",
            "validation.shard_ids=[3, 4]",
            "optim.betas=[0.8, 0.9]",
        ],
    )
    assert cfg.optim.lr == 1e-4 and cfg.optim.betas == (0.8, 0.9)
    assert cfg.train.max_steps == 30 and cfg.train.compile is False
    assert cfg.validation.shard_ids == [3, 4]


def test_an_override_fills_an_empty_section_of_the_file(tmp_path: Path) -> None:
    text = MINIMAL.replace("train: {}", "train:")  # YAML null
    cfg = load_sft_config(_write(tmp_path, text), overrides=["train.max_steps=9"])
    assert cfg.train.max_steps == 9


def test_an_override_wins_over_the_file_and_keeps_its_siblings(tmp_path: Path) -> None:
    text = MINIMAL.replace("train: {}", "train: {max_steps: 5, seq_len: 64}")
    cfg = load_sft_config(_write(tmp_path, text), overrides=["train.max_steps=9"])
    assert cfg.train.max_steps == 9 and cfg.train.seq_len == 64


@pytest.mark.parametrize(
    ("override", "needle"),
    [
        ("train.max_stesp=3", "unknown key `max_stesp` in `train`; did you mean `max_steps`?"),
        ("optimizer.lr=1", "unknown key `optimizer`; did you mean `optim`?"),
        ("optim.lr.x=1", "`optim.lr` is a value, not a section"),
        ("train.max_steps", "expected KEY.PATH=VALUE"),
        ("train.max_steps=many", "$.train.max_steps"),
        ("optim.schedule=step", "'step' is not one of: constant, cosine, linear, wsd"),
    ],
)
def test_bad_overrides_are_refused(tmp_path: Path, override: str, needle: str) -> None:
    with pytest.raises(ConfigError) as err:
        load_sft_config(_write(tmp_path, MINIMAL), overrides=[override])
    assert needle in str(err.value)


def test_max_steps_and_num_epochs_are_not_both_given(tmp_path: Path) -> None:
    text = MINIMAL.replace("train: {}", "train: {max_steps: 10, num_epochs: 3}")
    with pytest.raises(ConfigError, match=r"give max_steps \(10\) or num_epochs \(3\), not both"):
        load_sft_config(_write(tmp_path, text))
    assert load_sft_config(_write(tmp_path, MINIMAL), ["train.num_epochs=3"]).train.num_epochs == 3
