"""bench/bench_kernels.py's set-up, without timing anything: the revision compared against is a git
worktree whose own llmd (Python and kernel sources) a worker imports, and the worktree is gone after."""
import subprocess
import sys

import pytest

from llmd.bench import bench_kernels

ROOT = bench_kernels.ROOT


def git(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True)


pytestmark = pytest.mark.skipif(git("rev-parse", "HEAD").returncode != 0, reason="not a git checkout")


@pytest.mark.heavy
def test_a_revision_is_imported_from_its_own_worktree_which_is_removed_after(tmp_path):
    code = ("import llmd, llmd.runtime.kernels as k, llmd.bench.bench_kernels as b; "
            "print(llmd.__file__); print(k.__file__); print(k._HEADER); print(b.__file__)")
    with bench_kernels.checkout("HEAD", tmp_path) as (tree, site):
        tree = tree.resolve()
        assert git("worktree", "list").stdout.count(str(tree)) == 1
        done = subprocess.run([sys.executable, "-c", code], env={"PYTHONPATH": str(site), "PATH": "/usr/bin:/bin"},
                              capture_output=True, text=True, check=True, cwd=tmp_path)
        paths = [bench_kernels.Path(p).resolve() for p in done.stdout.split()]
        assert all(p.is_relative_to(tree) for p in paths), paths
        assert paths[2] == tree / "runtime" / "kernels" / "kernels.h"        # the revision's own C sources
        head = git("show", "HEAD:runtime/kernels/kernels.h").stdout
        assert paths[2].read_text() == head
        assert not (tree / "llmd" / "runtime").exists()                 # the layout is links beside the tree
    assert not tree.exists() and str(tree) not in git("worktree", "list").stdout


def test_an_unknown_revision_is_an_error_that_names_it(tmp_path):
    with pytest.raises(SystemExit, match="cannot check out 'no-such-revision-43'"):
        with bench_kernels.checkout("no-such-revision-43", tmp_path):
            pass


@pytest.mark.parametrize("argv", [["--against", "now"], ["--products", "1,x"], ["--products", "0"]])
def test_bad_arguments_are_refused_before_anything_is_built(argv, capsys):
    with pytest.raises(SystemExit) as e:
        bench_kernels.main(argv)
    assert e.value.code == 2 and "--" in capsys.readouterr().err
