"""One run of a case, in its own process (started by bench/run.py): imports the kind, checks the parameters,
runs it (or its --dry-run version), prints the kind's own output and then one result line,
`@@bench-result@@ {json}`. A crash or an out-of-memory kill loses only this process.

The harness starts it as `python -c BOOTSTRAP SPEC` with the case's checkout first on PYTHONPATH and as the
working directory; BOOTSTRAP imports this package from the harness's own checkout and then drops that path,
so `bench` comes from the harness and `qtrain` from the case's checkout (bench/run.py: child_command).
"""
from __future__ import annotations

import importlib
import inspect
import json
import os
import sys
import time
import traceback
from typing import Any

from bench.kinds import KINDS, Skip

RESULT = "@@bench-result@@ "


def check_params(run: Any, params: dict[str, Any], kind: str) -> None:
    """Parameters the kind's run() does not take are a suite error, reported before anything runs."""
    try:
        inspect.signature(run).bind(**params)
    except TypeError as e:
        takes = ", ".join(p for p in inspect.signature(run).parameters if p not in ("options", "kwargs"))
        raise ValueError(f"params: {e} (kind {kind!r} takes: {takes})") from None


def execute(spec: dict[str, Any]) -> dict[str, Any]:
    """The result of one run: the kind's dict plus status (ok | failed | skipped) and error / reason."""
    kind = spec["kind"]
    try:
        mod = importlib.import_module(KINDS[kind].module)
        params = dict(spec["params"])
        check_params(mod.run, params, kind)
        if spec.get("dry_run"):
            params = mod.dry_run(params)
            check_params(mod.run, params, kind)
        result = dict(mod.run(**params))
        result["status"] = "ok"
    except Skip as e:
        result = {"status": "skipped", "reason": str(e)}
    except Exception as e:  # noqa: BLE001 - the harness reports it next to the other cases
        traceback.print_exc()
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        result = {"status": "failed", "error": f"{spec.get('source', '')}: {type(e).__name__}: {first}"[:600]}
    return result


def environment() -> dict[str, Any]:
    """Where the run's code and device came from (qtrain's path proves which checkout it imported)."""
    env: dict[str, Any] = {"python": sys.version.split()[0]}
    q = sys.modules.get("qtrain")
    if q is not None:
        env["qtrain_file"] = os.path.abspath(q.__file__)
    torch = sys.modules.get("torch")
    if torch is not None:
        env["torch"] = torch.__version__
        if torch.cuda.is_available():
            env["device"] = torch.cuda.get_device_name()
    return env


def main(argv: list[str] | None = None) -> int:
    spec = json.loads((argv if argv is not None else sys.argv[1:])[0])
    t0 = time.perf_counter()
    result = execute(spec)
    result["wall_s"] = round(time.perf_counter() - t0, 1)
    result["env"] = environment()
    sys.stderr.flush()
    print(RESULT + json.dumps(result, default=str), flush=True)
    return 1 if result["status"] == "failed" else 0
