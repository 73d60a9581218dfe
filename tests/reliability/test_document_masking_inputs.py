"""--document-masking with a model whose blocks cannot keep documents apart yet (Qwen3.5: its Gated DeltaNet state and
causal convolution run along the whole row): `qtrain train` and `qtrain eval` refuse it in one `qtrain: error:`
line naming the option and the model type, exit code 2, before the model is built and nothing is written (before:
a TypeError traceback from the block, which takes no document mask)."""
from __future__ import annotations

import json

from qtrain.cli.main import main
from tests.reliability.test_qwen35_inputs import _config
from tests.run_utils import make_run_root, snapshot, train_argv

WANT = ("qtrain: error: --document-masking is not supported for qwen3_5_text yet: its Gated DeltaNet layers carry a "
        "recurrent state")


def test_train_and_eval_refuse_document_masking_for_qwen35_in_one_line(tmp_path, capsys):
    root = make_run_root(tmp_path)
    (root / "model" / "config.json").write_text(json.dumps(_config()))
    before = snapshot(root)
    capsys.readouterr()
    assert main(train_argv(root, steps=2, extra=("--document-masking",))) == 2
    assert main(["eval", "--model", str(root / "model"), "--eval-file", str(root / "eval.bin"), "--seq-len", "16",
                 "--device", "cpu", "--document-masking"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2, err
    assert all(line.startswith(WANT) and line.endswith("drop --document-masking") for line in err), err
    assert snapshot(root) == before
