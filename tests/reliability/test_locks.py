"""A run's name follows its --out-dir when --name is not given (the new user's second fine-tune, issue 41)."""
from __future__ import annotations

import json

from qtrain.cli.main import main
from tests.run_utils import make_run_root, train_argv


# ---- the run's name follows --out-dir ---------------------------------------------------------------------------

def test_the_run_name_follows_the_out_dir_unless_given():
    from qtrain.cli.main import build_parser
    from qtrain.cli.options import options_from_args

    def opts(*flags: str):
        return options_from_args(build_parser().parse_args(["train", *flags]))

    assert opts().name == "qtrain-default"  # the embedded default keeps its name
    assert opts("--out-dir", "output/ft-1/").name == "ft-1"
    assert opts("--out-dir", "output/ft-1").expand(opts("--out-dir", "output/ft-1").checkpoint_dir) == "ckpt/ft-1"
    assert opts("--out-dir", "models/my model (v2)").name == "my_model_v2"  # made a valid run name
    assert opts("--out-dir", "output/ft-1", "--name", "mine").name == "mine"  # --name wins
    assert opts("--out-dir", "out/%n").name == "qtrain-default"  # the name makes the folder, not the reverse
    assert opts("--model", "m", "--out-dir", "output/a").name == "a"
    assert opts("--model", "m").name == "qtrain"


def test_two_fine_tunes_into_two_folders_both_run(tmp_path, monkeypatch, capsys):
    """The new user's case: --checkpoint-dir and --log-file left at their defaults, one --out-dir per fine-tune.
    The second used to be refused as the first's outputs (both were named `qtrain`)."""
    root = make_run_root(tmp_path)
    monkeypatch.chdir(root)
    for folder in ("ft-a", "ft-b"):
        rc = main(train_argv(root, steps=2, name=None, checkpoint_dir=None, log_file=None,
                             out_dir=root / "output" / folder))
        assert rc == 0, (folder, capsys.readouterr().err[-2000:])
    for folder in ("ft-a", "ft-b"):
        assert (root / "ckpt" / folder / "step_00000002").is_dir() and (root / "logs" / f"{folder}.jsonl").is_file()
        assert json.loads((root / "output" / folder / "qtrain-export.json").read_text())["name"] == folder
