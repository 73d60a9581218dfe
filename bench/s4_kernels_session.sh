#!/usr/bin/env bash
# Session 4: which inductor kernels the 1.5B e4m3 step runs, with their generated source (to see what each
# fuses), next to the CUDA-only profile.
set -u
export PYTHONPATH=. PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
export TORCHINDUCTOR_CACHE_DIR=/tmp/ind_s4; rm -rf $TORCHINDUCTOR_CACHE_DIR
timeout 200 python3 bench/profile_step.py '{"model":"Qwen2.5-1.5B","batch":16,"accum":2,"lmhead_chunks":4,"matmul_dtype":"e4m3","opt_m_dtype":"bf16","opt_v_dtype":"bf16","top":60}' 2>&1 | grep -v -i warn > $OUT/prof.txt
python3 - <<'PY'
import os, re, glob
out = os.environ.get("OUT", "/tmp/out")
names = []
for l in open(out + "/prof.txt"):
    m = re.search(r"(triton_(?:red|per|poi)_fused_\w+)", l)
    if m and m.group(1) not in names and " ms " in l and "x " in l:
        names.append(m.group(1))
files = glob.glob("/tmp/ind_s4/**/*.py", recursive=True)
src = {f: open(f, errors="replace").read() for f in files}
with open(out + "/kernels.txt", "w") as w:
    for n in names:
        for f, s in src.items():
            i = s.find(f"def {n}(")
            if i < 0:
                continue
            j = s.rfind("@triton", 0, i)
            j = s.rfind("\n\n", 0, j if j > 0 else i)
            k = s.find("\n\n\n", i)
            w.write(f"==== {n}  ({f})\n{s[max(j,0):k if k > 0 else i + 6000]}\n\n")
print(len(names), "kernels,", len(files), "files")
PY
ls -la $OUT
