"""Multi-node, simulated on one machine: `torchrun --nnodes 2 --nproc-per-node 2` twice (node ranks 0 and 1,
static rendezvous on 127.0.0.1), each launcher starting two `qtrain train` ranks on CPU (gloo).

* Shared checkpoint directory (both nodes write into the same absolute path): the 4-rank run trains like one
  process on the global batch (batch 1 x 4 ranks vs batch 4; losses within 1e-5 relative: the same sums in
  another order), its checkpoint holds all 4 ranks' shards in one complete directory, and one process resumes
  it (4 -> 1, resharding) and continues like the single-process run.
* Node-local checkpoint directories (a relative --checkpoint-dir, each launcher in its own working directory:
  the same path on two "machines"): each node commits its own copy holding its ranks' shards, with
  `distributed.ranks` in the meta; the run's losses are bit-identical to the shared-directory run (where
  checkpoints go changes nothing else); resuming such a checkpoint on another world size is refused naming the
  ranks the directory holds, and a rank that needs a file the directory lacks is told which, and why.
* Hybrid sharding with one shard group per node (--shard-group-size 2) and node-local directories: each node
  holds a whole copy of the state, so each node's directory is a complete checkpoint (one process resumes
  from node 1's), and the run trains like the flat one (losses within 1e-6: a hierarchical reduction).
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from qtrain.observe.log import read_log
from qtrain.parallel.dist import free_port
from qtrain.train import checkpoint_io as cio
from qtrain.train import checkpointing
from tests.run_utils import make_run_root, qtrain_run, subprocess_env, train_argv

# in CI (issue 20): three 2x2 torchrun pairs, three single processes, ~2 minutes on 2 cores

STEPS, EVERY = 4, 2
KINDS = ("weights", "adam.m", "adam.v")


def _torchrun_pair(argv: list[str], cwds: list[Path]) -> None:
    """Two torchrun launchers (node ranks 0 and 1, 2 processes each) running `qtrain <argv>`."""
    port = free_port()
    procs = [subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "2", "--node-rank",
         str(node), "--master-addr", "127.0.0.1", "--master-port", str(port), "-m", "qtrain.cli.main", *argv],
        cwd=cwd, env=subprocess_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for node, cwd in enumerate(cwds)]
    outs = [p.communicate(timeout=600)[0] for p in procs]
    for node, (p, out) in enumerate(zip(procs, outs)):
        assert p.returncode == 0, f"node {node} exited {p.returncode}:\n{out[-4000:]}"


def _losses(path: Path) -> dict[int, float]:
    return {e["step"]: e["loss"] for e in read_log(path) if e["log"] == "step"}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = make_run_root(tmp_path_factory.mktemp("multinode"), tokens=6000)
    common = dict(steps=STEPS, ckpt_interval=EVERY, seed=3)
    solo = qtrain_run(train_argv(root, name="solo", batch_size=4, **common), cwd=root)
    assert solo.returncode == 0, solo.stderr[-4000:]
    _torchrun_pair(train_argv(root, name="shared", batch_size=1, **common), [root, root])
    nodes = [root / "node0", root / "node1"]
    for n in nodes:
        n.mkdir()
    _torchrun_pair(train_argv(root, name="local", batch_size=1, checkpoint_dir="ckpt", **common), nodes)
    _torchrun_pair(train_argv(root, name="hybrid", batch_size=1, checkpoint_dir="ckpt_h", shard_group_size=2,
                              **common), nodes)
    hybrid_resumed = qtrain_run(train_argv(root, name="hybrid", batch_size=4, checkpoint_dir="ckpt_h",
                                           log_file=root / "logs" / "hybrid-resumed.jsonl",
                                           extra=("--continue", str(EVERY)), **common), cwd=nodes[1])
    assert hybrid_resumed.returncode == 0, hybrid_resumed.stderr[-4000:]
    resumed = qtrain_run(train_argv(root, name="shared", batch_size=4, log_file=root / "logs" / "resumed.jsonl",
                                    extra=("--continue", str(EVERY)), **common), cwd=root)
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    return root


def test_two_nodes_train_like_one_process_on_the_global_batch(runs):
    solo, shared = _losses(runs / "logs" / "solo.jsonl"), _losses(runs / "logs" / "shared.jsonl")
    assert sorted(shared) == sorted(solo) == list(range(STEPS))
    for s in solo:
        assert shared[s] == pytest.approx(solo[s], rel=1e-5), f"step {s}"
    assert len({round(v, 6) for v in solo.values()}) == STEPS  # the loss moves: the steps are real updates


def test_shared_directory_holds_every_rank_and_resumes_on_one_process(runs):
    path = runs / "ckpt" / "shared" / f"step_{EVERY:08d}"  # (the resumed run rewrote step STEPS: 1 rank)
    meta, files = cio.read_checkpoint(path)
    assert meta["distributed"] == {"world": 4}
    assert files.names == sorted(f"{k}.shard_{r:03d}_of_004" for k in KINDS for r in range(4))
    assert not list(path.glob(".rank_*")), "the writers' markers are removed before the commit"
    solo, resumed = _losses(runs / "logs" / "solo.jsonl"), _losses(runs / "logs" / "resumed.jsonl")
    assert sorted(resumed) == list(range(EVERY, STEPS))
    for s in resumed:
        assert resumed[s] == pytest.approx(solo[s], rel=1e-5), f"step {s} after resuming 4 -> 1"


def test_node_local_directories_hold_their_nodes_ranks(runs):
    shared, local = _losses(runs / "logs" / "shared.jsonl"), _losses(runs / "logs" / "local.jsonl")
    assert local == shared
    for node, ranks in ((0, [0, 1]), (1, [2, 3])):
        path = runs / f"node{node}" / "ckpt" / f"step_{STEPS:08d}"
        meta, files = cio.read_checkpoint(path)
        assert meta["distributed"]["world"] == 4 and meta["distributed"]["ranks"] == ranks
        assert files.names == sorted(f"{k}.shard_{r:03d}_of_004" for k in KINDS for r in ranks)
        other = 2 if node == 0 else 0
        assert checkpointing.missing_files(str(path), meta, ranks[0], 4) is None
        msg = checkpointing.missing_files(str(path), meta, other, 4)
        assert f"rank {other} of 4 needs weights.shard_{other:03d}_of_004.safetensors" in msg
        assert f"holds the shards of ranks {ranks[0]}-{ranks[1]}" in msg and "shared filesystem" in msg
    # the meta of a node-local copy is the run's: the same step, loader position and options as node 0's; only
    # where the shards are and their digests (those of the files in that directory) are the node's own
    m0, m1 = (json.loads((runs / f"node{n}" / "ckpt" / f"step_{STEPS:08d}" / cio.META_FILE).read_text())
              for n in (0, 1))
    own = ("distributed", cio.DIGESTS)
    assert {k: v for k, v in m0.items() if k not in own} == {k: v for k, v in m1.items() if k not in own}
    for node, meta in enumerate((m0, m1)):
        ranks = (0, 1) if node == 0 else (2, 3)
        assert sorted(meta[cio.DIGESTS]) == sorted(f"{k}.shard_{r:03d}_of_004.safetensors" for k in KINDS for r in ranks)


def test_node_local_checkpoint_at_another_world_size_is_refused(runs):
    r = qtrain_run(train_argv(runs, name="local", batch_size=4, steps=STEPS, ckpt_interval=EVERY, seed=3,
                              checkpoint_dir="ckpt", log_file=runs / "logs" / "refused.jsonl",
                              extra=("--continue",)), cwd=runs / "node0")
    assert r.returncode == 2, r.stderr[-4000:]
    assert "written by 4 rank(s) into a checkpoint directory local to each node" in r.stderr
    assert "holds the shards of ranks 0-1 only" in r.stderr and "this run has 1" in r.stderr


def test_hybrid_sharding_per_node_makes_each_local_directory_complete(runs):
    flat, hybrid = _losses(runs / "logs" / "shared.jsonl"), _losses(runs / "logs" / "hybrid.jsonl")
    assert sorted(hybrid) == sorted(flat)
    for s in flat:
        assert hybrid[s] == pytest.approx(flat[s], rel=1e-6), f"step {s}"
    for node in (0, 1):
        meta, files = cio.read_checkpoint(runs / f"node{node}" / "ckpt_h" / f"step_{EVERY:08d}")
        assert meta["distributed"] == {"world": 2, "replicas": 2}
        assert files.names == sorted(f"{k}.shard_{r:03d}_of_002" for k in KINDS for r in range(2))
    solo, resumed = _losses(runs / "logs" / "solo.jsonl"), _losses(runs / "logs" / "hybrid-resumed.jsonl")
    assert sorted(resumed) == list(range(EVERY, STEPS))
    for s in resumed:
        assert resumed[s] == pytest.approx(solo[s], rel=1e-5), f"step {s} after resuming node 1's copy on 1 rank"
