"""`qtrain.cli.options` (issue 19): the embedded defaults adapt to a short --steps; llm.q's implementation
switches print one note each; --use-cuda-graphs is validated."""
from __future__ import annotations

import pytest

from qtrain.cli.main import build_parser
from qtrain.cli.options import LLMQ_IMPLEMENTATION_FLAGS, options_from_args
from qtrain.options import OptionsError


def parse(*argv: str):
    return options_from_args(build_parser().parse_args(["train", *argv]))


@pytest.mark.parametrize("steps,warmup", [("1", 0), ("5", 0), ("30", 3), ("100", 10), ("1000", 10)])
def test_embedded_default_warmup_fits_a_short_run(steps, warmup):
    o = parse("--steps", steps)
    assert o.model == "" and o.warmup == warmup and o.steps == int(steps)
    assert parse().warmup == 10  # --steps not given (the epoch decides): the usual 10


def test_a_warmup_the_user_gave_is_still_checked():
    with pytest.raises(OptionsError, match=r"--warmup \(10\)"):
        parse("--steps", "1", "--warmup", "10")


def test_implementation_switches_print_one_note_each(capsys):
    o = parse("--custom-matmul", "--memcpy-all-gather", "--memcpy-send-recv", "--use-write-combined")
    err = capsys.readouterr().err.splitlines()
    assert err == [f"note: {n}" for n in LLMQ_IMPLEMENTATION_FLAGS.values()]
    assert o.use_cuda_graphs is None  # unset: on where measured faster (plan.resolution.cuda_graphs_on)
    assert parse("--use-cuda-graphs").use_cuda_graphs  # it acts (train/cuda_graphs.py): no note
    assert capsys.readouterr().err.strip() == ""
