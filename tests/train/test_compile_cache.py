"""--compile-cache: inductor's and Triton's caches pointed at one stable folder, the user's variables kept, a
folder the user named that cannot be written refused in the preflight, the default one never an error."""
from __future__ import annotations

import os

import pytest
import torch

from qtrain.cli.main import main
from qtrain.fsio import FileSystemError
from qtrain.train import compile_cache
from tests.run_utils import make_run_root, snapshot, train_argv


@pytest.fixture
def clean_env(monkeypatch, tmp_path):
    for var in compile_cache.ENV.values():
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    return tmp_path


def test_auto_points_both_caches_at_the_user_cache_folder(clean_env):
    assert compile_cache.use("auto") is None
    folder = clean_env / "xdg" / "qtrain" / "compile"
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(folder / "inductor")
    assert os.environ["TRITON_CACHE_DIR"] == str(folder / "triton")
    assert (folder / "inductor").is_dir() and (folder / "triton").is_dir()


def test_a_named_folder_and_none(clean_env, monkeypatch):
    compile_cache.use(str(clean_env / "mine"))
    assert os.environ["TRITON_CACHE_DIR"] == str(clean_env / "mine" / "triton")
    for var in compile_cache.ENV.values():
        monkeypatch.delenv(var)
    assert compile_cache.use("none") is None
    assert not any(os.environ.get(v) for v in compile_cache.ENV.values())  # torch's defaults stay


def test_the_users_variables_win_and_are_named(clean_env, monkeypatch):
    monkeypatch.setenv("TRITON_CACHE_DIR", str(clean_env / "theirs"))
    note = compile_cache.use("auto")
    assert os.environ["TRITON_CACHE_DIR"] == str(clean_env / "theirs") and "TRITON_CACHE_DIR" in note
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"].endswith(os.path.join("compile", "inductor"))


def test_an_unusable_folder_refused_when_named_a_note_when_default(clean_env):
    """A file where the folder would be (what root cannot write through either)."""
    blocker = clean_env / "blocker"
    blocker.write_text("a file, not a folder")
    with pytest.raises(FileSystemError, match="--compile-cache"):
        compile_cache.check(str(blocker / "cache"))
    with pytest.raises(FileSystemError, match="--compile-cache"):
        compile_cache.use(str(blocker / "cache"))
    os.environ["XDG_CACHE_HOME"] = str(blocker)
    compile_cache.check("auto")  # never refused: the cache holds only what qtrain can make again
    assert "cannot be written" in compile_cache.use("auto")
    assert not any(os.environ.get(v) for v in compile_cache.ENV.values())  # torch's defaults stay
    assert blocker.read_text() == "a file, not a folder"


def test_a_named_file_is_refused_before_anything_is_written(clean_env, capsys):
    root = make_run_root(clean_env / "run")
    (root / "cachefile").write_text("mine")
    before = snapshot(root)
    rc = main(train_argv(root, steps=2) + ["--compile-cache", str(root / "cachefile")])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and "--compile-cache" in err[0] and "cachefile" in err[0]
    assert snapshot(root) == before


def test_torchs_own_default_is_replaced(clean_env):
    """Importing torch._dynamo (qtrain's modules do, before any run starts) makes inductor write its default
    folder into TORCHINDUCTOR_CACHE_DIR; that is not the user's choice, and the run's folder replaces it."""
    import torch._dynamo  # noqa: F401  (what `import qtrain.train.loop` imports)
    from torch._inductor.runtime.cache_dir_utils import cache_dir, default_cache_dir
    assert cache_dir() == os.path.abspath(default_cache_dir())  # torch sets the variable itself, here
    assert compile_cache.use("auto") is None
    folder = clean_env / "xdg" / "qtrain" / "compile"
    assert cache_dir() == str(folder / "inductor")  # where inductor now keeps its cache
    assert os.environ["TRITON_CACHE_DIR"] == str(folder / "triton")


class _MatMul(torch.autograd.Function):
    """An autograd.Function, as a compiled block holds (qtrain's RoPE / SwiGLU / FP8 linears); matrix products
    only, so inductor makes no C++ kernel and the test compiles in seconds."""

    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        return x @ w

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        return g @ w.t(), x.t() @ g


def test_a_second_start_reuses_the_compiled_graphs_of_autograd_functions(clean_env, monkeypatch):
    """A compiled function holding an autograd.Function, compiled again after dynamo forgot it (what a second run
    does): AOTAutograd's cache serves it (by default torch bypasses that cache for such graphs, and every start
    traced the joint graph again), with the gradients of eager."""
    import torch._functorch.config as functorch_config
    from torch._dynamo.utils import counters
    monkeypatch.setattr(functorch_config, "autograd_cache_allow_custom_autograd_functions", False)  # torch's default
    compile_cache.use(str(clean_env / "cache"))
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(0))
    w = torch.randn(8, 8, generator=torch.Generator().manual_seed(1), requires_grad=True)
    g = torch.randn(4, 8, generator=torch.Generator().manual_seed(2))
    want = torch.autograd.grad(_MatMul.apply(x, w), w, g)[0]
    got = []
    for _ in range(2):
        torch._dynamo.reset()
        counters.clear()
        got.append(torch.autograd.grad(torch.compile(_MatMul.apply, dynamic=False)(x, w), w, g)[0])
    assert counters["aot_autograd"]["autograd_cache_hit"] == 1, dict(counters["aot_autograd"])
    for grad in got:
        torch.testing.assert_close(grad, want)
