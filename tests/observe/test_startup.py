"""The startup measurement and the compiling line."""
from __future__ import annotations

import io
import json
import subprocess
import sys
import time

from qtrain.cli.main import main
from qtrain.observe.startup import Compiling, process_start, seconds_since_start
from tests.run_utils import make_run_root, train_argv


def test_process_start_is_before_this_module_ran_and_recent():
    code = "import time; t=time.time(); from qtrain.observe.startup import process_start as p; print(t - p())"
    since = float(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout)
    assert 0 <= since < 600  # the interpreter started before its first line ran, and not long before
    assert process_start() <= time.time() and seconds_since_start() > 0


class _Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_compiling_line_on_a_terminal_is_redrawn_and_erased():
    out = _Tty()
    with Compiling(True, "the model", stream=out, interval_s=0.01):
        time.sleep(0.1)
    text = out.getvalue()
    assert "compiling the model ... " in text and text.endswith("\r\x1b[K")


def test_compiling_line_in_a_file_once_and_nothing_when_disabled():
    out = io.StringIO()
    with Compiling(True, "the model", stream=out):
        pass
    assert out.getvalue() == "compiling the model ...\n"
    out = io.StringIO()
    with Compiling(False, "the model", stream=out):
        pass
    assert out.getvalue() == ""


def test_the_run_log_records_the_time_to_the_first_step(tmp_path):
    root = make_run_root(tmp_path)
    assert main(train_argv(root, steps=2)) == 0
    events = [json.loads(line) for line in (root / "logs" / "run.jsonl").read_text().splitlines()]
    startup = [e for e in events if e["log"] == "startup"]
    first = next(e for e in events if e["log"] == "step")
    assert len(startup) == 1 and startup[0]["step"] == 0 and startup[0]["compiled"] is False
    assert startup[0]["seconds_to_first_step"] >= startup[0]["first_step_s"] > 0
    assert abs(startup[0]["first_step_s"] * 1000 - first["duration_ms"]) <= 5.01  # that step, to 0.01 s
    # where the seconds before the first step went: every phase, in order, each ending before the first step does
    ends = startup[0]["phases"]
    assert list(ends) == ["imports", "device", "preflight", "weights", "blocks", "model", "ready"], ends
    assert list(ends.values()) == sorted(ends.values())
    assert ends["ready"] <= startup[0]["seconds_to_first_step"] - startup[0]["first_step_s"] + 0.02  # rounding
