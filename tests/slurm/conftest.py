"""The Slurm tests' cluster (tests/slurm/cluster.py): started once per session by the first test that needs it and
stopped by that fixture at the end, whatever happened. Where it cannot run (not root, no apt to install Slurm, no
network namespaces) every `slurm` test skips with the one-line reason."""

from __future__ import annotations

import pytest
from cluster import Cluster, SlurmUnavailable


@pytest.fixture(scope="session")
def slurm(tmp_path_factory):
    try:
        cluster = Cluster(tmp_path_factory.mktemp("slurm"))
    except SlurmUnavailable as e:
        pytest.skip(f"no Slurm cluster here: {e}")
    try:
        yield cluster
    finally:
        cluster.stop()
