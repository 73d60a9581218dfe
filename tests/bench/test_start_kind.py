"""The `start` kind on the CPU (its dry run's tiny model, uncompiled): the start-up phases from the run log, and
under `profile` the functions that took the start's seconds, read back from the cProfile file the run wrote."""
from __future__ import annotations

import os

from bench import start


def test_profiled_start_names_the_functions_and_the_phases(tmp_path, monkeypatch):
    monkeypatch.setenv("OUT", str(tmp_path))
    res = start.run(**start.dry_run({"model": "Qwen2.5-0.5B", "batch": 2, "profile": True}))
    assert list(res["phases"]) == ["imports", "device", "preflight", "weights", "blocks", "model", "ready"]
    assert res["start_s"] >= res["first_step_s"] > 0
    assert os.path.dirname(res["profile_file"]) == str(tmp_path) and os.path.getsize(res["profile_file"]) > 0
    names = [name for name, _ in res["profile_top"]]
    seconds = [s for _, s in res["profile_top"]]
    assert seconds == sorted(seconds, reverse=True) and len(names) == 40
    assert any("run_training" in n for n in names), names  # qtrain's own frames, not just the interpreter's
    assert not any("importlib" in n for n in names)  # the import machinery is left out
