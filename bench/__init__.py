"""qtrain's benchmarks: one harness (`python -m bench.run SUITE`) that runs the cases of a suite file
(bench/suites/NAME.toml), each in its own process, against this checkout or another one.

This package must not import qtrain or torch at import time: the harness picks which checkout's qtrain a
case imports (bench/case.py) only after `bench` itself is loaded. See bench/README.md.
"""
