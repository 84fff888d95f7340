"""A tree of more directories than the process may open, removed by sandbox/util.py
remove_tree (a stopped host's directory at ``down``, a partial rootfs) from a process that
gevent has patched, as an import of pyinfra_cli patches one (the test suite's is): the tree
goes whole. On a temporary directory; no containers, no root needed."""

from __future__ import annotations

import subprocess
import sys

from sandbox.util import REPO_ROOT

# In a process of its own: the patch cannot be undone in this one.
REMOVE = r"""
import resource, sys
from pathlib import Path
import pyinfra_cli  # runs gevent's monkey.patch_all()
import gevent
gevent.get_hub()  # the loop its os.close defers to, as in a process that ran a command
resource.setrlimit(resource.RLIMIT_NOFILE, (64, 64))
from sandbox.util import remove_tree
print(remove_tree(Path(sys.argv[1]), step="gpu-sbx-1: remove its directory"),
      Path(sys.argv[1]).exists())
"""


def test_a_tree_of_more_directories_than_descriptors_goes_from_a_patched_process(tmp_path):
    host_dir = tmp_path / "gpu-sbx-1"
    for number in range(300):
        package = host_dir / "upper" / "opt" / "envs" / f"package{number}" / "sub"
        package.mkdir(parents=True)
        (package / "module.py").write_text("")
    proc = subprocess.run([sys.executable, "-c", REMOVE, str(host_dir)], cwd=REPO_ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == "None False\n"
    assert not host_dir.exists()
