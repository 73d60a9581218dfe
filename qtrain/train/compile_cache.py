"""Where compiled code is kept between runs: one stable folder per user, so a second run (or `--continue`) of the
same shapes starts in seconds instead of compiling again.

torch.compile (inductor's FX graph, AOTAutograd and kernel caches) and Triton (every compiled kernel, qtrain's own
included) cache on disk; by default inductor's lives in the temp folder (`/tmp/torchinductor_USER`), which a reboot
or a fresh cloud machine empties. `--compile-cache DIR` (default `$XDG_CACHE_HOME/qtrain/compile`, else
`~/.cache/qtrain/compile`) points both at subfolders of DIR through their environment variables, before anything
compiles and before `--gpus N` starts its workers (they inherit the environment). Both caches write each entry
under a temp name and rename it into place, so runs sharing the folder never read half an entry. A user who set
`TORCHINDUCTOR_CACHE_DIR` or `TRITON_CACHE_DIR` keeps them. `--compile-cache none` leaves torch's defaults.
Importing torch._dynamo (which qtrain's modules may do before the run starts) sets `TORCHINDUCTOR_CACHE_DIR` to
torch's default folder itself; that value is torch's, not the user's, and is replaced.

A compiled block holds autograd.Functions (qtrain's RoPE and SwiGLU backward kernels, the FP8 linears), which
AOTAutograd's cache refuses by default: every start then traced the block's joint forward-backward graph again and
re-ran its passes and partitioner before inductor's own cache served the kernels (~1-1.5 s of a warm first step
on a 2-core CPU with a tiny model). torch's `autograd_cache_allow_custom_autograd_functions` lets it cache them:
dynamo traces a Function's forward and backward into the graph the cache key is made from, so a changed Function
is a new key.

The keys of both caches (hashes of the installed torch and Triton) are remembered in the folder too
(train/compile_keys.py), so a warm start does not hash 400 MB of Triton again.

The cache holds only what qtrain can make again: a default folder that cannot be written is a note, not an
error (the run compiles as it would have); a folder the user named that cannot be written is refused in the
preflight, naming it.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

from qtrain.fsio import FileSystemError, check_writable_dir, user_cache_home
from qtrain.train import compile_keys

ENV = {"inductor": "TORCHINDUCTOR_CACHE_DIR", "triton": "TRITON_CACHE_DIR"}  # subfolder -> the variable naming it
OFF = "none"
AUTO = "auto"


def default_dir() -> Path:
    """`$XDG_CACHE_HOME/qtrain/compile`, else `~/.cache/qtrain/compile`."""
    return user_cache_home() / "qtrain" / "compile"


def resolve(option: str) -> Path | None:
    """The folder `--compile-cache` names (auto: the default folder; none: None)."""
    if option == OFF:
        return None
    return default_dir() if option == AUTO else Path(option).expanduser()


def check(option: str) -> None:
    """Preflight: a folder the user named must be writable (FileSystemError naming it); auto is never refused."""
    folder = resolve(option)
    if folder is not None and option != AUTO:
        check_writable_dir(folder, "--compile-cache")


def use(option: str) -> str | None:
    """Point inductor's and Triton's caches at the folder (creating it), unless the user set their variables;
    returns a note for the log when the folder cannot be used or the user's variables win."""
    allow_autograd_function_caching()
    folder = resolve(option)
    if folder is None:
        return None
    kept = [var for var in ENV.values() if os.environ.get(var) and not _torch_default(var)]
    try:
        for sub in ENV:
            (folder / sub).mkdir(parents=True, exist_ok=True)
        check_writable_dir(folder, "--compile-cache")
    except (OSError, FileSystemError) as e:
        if option != AUTO:
            raise FileSystemError(f"--compile-cache {option}: cannot be used ({e})") from None
        return f"the compile cache {folder} cannot be written ({e}); compiled code is cached where torch puts it"
    for sub, var in ENV.items():
        if var not in kept:
            os.environ[var] = str(folder / sub)
    if kept:
        return f"compile cache: {', '.join(kept)} set in the environment, kept ({folder} serves the rest)"
    return None


def remember_keys(option: str) -> None:
    """Serve torch's and Triton's cache keys from the folder, or record them there (train/compile_keys.py); after
    `use` (importing inductor reads the variables it sets) and after the preflight (that import takes seconds)."""
    folder = resolve(option)
    if folder is not None and folder.is_dir():
        compile_keys.remember(folder)


def _torch_default(var: str) -> bool:
    """Whether `var` holds what torch itself put there: inductor's `cache_dir()` (run when torch._dynamo is
    imported) writes its default folder into TORCHINDUCTOR_CACHE_DIR."""
    utils = sys.modules.get("torch._inductor.runtime.cache_dir_utils")
    if var != ENV["inductor"] or utils is None:
        return False
    return os.environ.get(var) == os.path.abspath(utils.default_cache_dir())


def allow_autograd_function_caching() -> None:
    """Let AOTAutograd's cache serve compiled graphs that hold autograd.Functions (module docstring)."""
    import torch._functorch.config as functorch_config
    if hasattr(functorch_config, "autograd_cache_allow_custom_autograd_functions"):
        functorch_config.autograd_cache_allow_custom_autograd_functions = True
