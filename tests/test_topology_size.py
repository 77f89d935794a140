"""A topology whose graph cannot fit is refused before any of it is built, with the limit stated."""

from __future__ import annotations

from pathlib import Path

import pytest

from testbed.cli.main import main
from testbed.topology.io import load_topology
from testbed.topology.routing import MAX_LINKS, link_count

DEVICE = "device: {name: host-cpu, flops: {fp32: 100GFLOP/s}, memory: 2GiB, memory_bandwidth: 50GB/s}\n"


@pytest.mark.parametrize("name", ["dgx-h100", "dgx-h100-superpod", "eth-4x2", "tpu-v4-4x4x4", "tpu-v5p-multislice",
                                  "a100-pcie-8", "llama3-h100-16k"])
def test_the_link_count_is_the_built_graphs(name: str) -> None:
    topology = load_topology(name)
    edges = topology.graph.number_of_edges()
    assert link_count(topology) == edges if topology.form.value != "torus" else link_count(topology) >= edges


def test_a_levels_topology_of_2_20_devices_and_21_million_links_is_refused(tmp_path: Path,
                                                                         capsys: pytest.CaptureFixture) -> None:
    levels = "".join(f"  - {{name: l{i}, size: 2, bandwidth: 50GB/s, latency: 5us, kind: infiniband, "
                     f"attach: device}}\n" for i in range(20))
    path = tmp_path / "huge.yaml"
    path.write_text(f"name: huge\n{DEVICE}levels:\n{levels}")
    assert main(["topology", "show", str(path)]) == 2
    err = capsys.readouterr().err
    assert "expands to 20,971,520 links" in err and f"at most {MAX_LINKS:,} links" in err and "huge.yaml" in err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1
