"""`--config FILE` with sections (issue 19): one level of TOML tables / YAML mappings, flattened; a key set
twice (across sections, or spelled two ways) and a table inside a section are errors naming the file and both
places; Python 3.10 reads TOML through `tomli` (declared in pyproject.toml)."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from qtrain.cli.config_file import load_config_file
from qtrain.cli.main import build_parser
from qtrain.cli.options import options_from_args
from qtrain.options import OptionsError

TORCHTITAN_STYLE = """
name = "sectioned"

[model]
model = "Qwen2.5-0.5B"
from-scratch = true
model-dtype = "bf16"

[optimizer]
lr = 3e-4
beta-2 = 0.99
weight_decay = 0.05

[training]
batch = 4
seq-len = 256
steps = 100
warmup = 10
grad-accumulation = 2

[parallelism]
zero-level = 2
"""


def parse(path: str, *flags: str):
    return options_from_args(build_parser().parse_args(["train", "--config", path, *flags]))


def test_toml_sections_are_flattened(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text(TORCHTITAN_STYLE)
    o = parse(str(path))
    assert (o.name, o.model, o.from_scratch, o.learning_rate, o.beta_2, o.weight_decay) == \
        ("sectioned", "Qwen2.5-0.5B", True, 3e-4, 0.99, 0.05)
    assert (o.batch_size, o.seq_len, o.steps, o.warmup, o.grad_accumulation, o.zero_level) == (4, 256, 100, 10, 2, 2)
    assert parse(str(path), "--lr", "1e-4", "--seq-len", "128").learning_rate == 1e-4  # flags still win


def test_yaml_sections_are_flattened(tmp_path):
    pytest.importorskip("yaml")
    path = tmp_path / "run.yaml"
    path.write_text("model:\n  model: Qwen2.5-0.5B\n  from-scratch: true\noptimizer:\n  lr: 3e-4\n"
                    "training:\n  batch: 4\n  steps: 20\n")
    o = parse(str(path))
    assert (o.model, o.from_scratch, o.learning_rate, o.batch_size, o.steps) == ("Qwen2.5-0.5B", True, 3e-4, 4, 20)


@pytest.mark.parametrize("text,places", [
    ("[a]\nlr = 1e-4\n[b]\nlr = 2e-4\n", ["[a] lr", "[b] lr"]),
    ("seq_len = 64\n[training]\nseq-len = 128\n", ["top level seq_len", "[training] seq-len"]),
])
def test_a_key_set_twice_names_both_places(tmp_path, text, places):
    path = tmp_path / "run.toml"
    path.write_text(text)
    with pytest.raises(OptionsError) as ei:
        load_config_file(str(path))
    msg = str(ei.value)
    assert str(path) in msg and "set twice" in msg and all(p in msg for p in places), msg


def test_two_spellings_of_one_option_in_two_sections(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text("[optimizer]\nlr = 1e-4\n[schedule]\nlearning_rate = 2e-4\n")
    with pytest.raises(OptionsError, match="given twice"):
        parse(str(path))


def test_python_310_reads_toml_through_tomli():
    text = (Path(__file__).parents[2] / "pyproject.toml").read_text()
    deps = text[text.index("dependencies = ["):text.index("]", text.index("dependencies = ["))]
    assert re.search(r"""["']tomli[^"']*;\s*python_version\s*<\s*['"]3\.11['"]["']""", deps), deps
    assert 'requires-python = ">=3.10"' in text
    src = (Path(__file__).parents[2] / "qtrain" / "cli" / "config_file.py").read_text()
    assert "import tomli as tomllib" in src
