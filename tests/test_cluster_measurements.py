"""`calibrate --cluster X --from-measurements F`: a malformed file is one paragraph naming it and the field."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest

from testbed.cli.main import main
from testbed.cluster.fit import HostProbe
from testbed.cluster.measurements import check_measurements
from testbed.errors import InputError

PROBE = HostProbe(loopback_bandwidth=2e9, loopback_latency_s=2e-5, across_latency_s=5e-5)
GOOD = {"cluster": "t", "topology": "eth-4x2", "scale": 0.001, "mtu": 1500, "link_rate_bps": 1e8,
        "probe": PROBE.to_dict(), "load_before": 1.0, "load_after": 1.5, "bucket_bytes": 3028,
        "rows": [{"op": op, "bytes": size, "measured_s": 1e-3 + size / 1e7, "ok": True, "calls_s": [1e-3]}
                 for op in ("all_reduce", "all_gather") for size in (4096, 65536, 1 << 20)]}


def _with(path: tuple, value: object) -> dict:
    doc = copy.deepcopy(GOOD)
    where = doc
    for key in path[:-1]:
        where = where[key]
    if value is KeyError:
        del where[path[-1]]
    else:
        where[path[-1]] = value
    return doc


CASES = [
    (("rows", 0, "op"), "all_to_all", "rows[0].op"),
    (("rows", 0, "op"), None, "rows[0].op"),
    (("rows", 0, "bytes"), None, "rows[0].bytes"),
    (("rows", 0, "bytes"), 10**400, "rows[0].bytes"),
    (("rows", 0, "bytes"), 1.5, "rows[0].bytes"),
    (("rows", 0, "measured_s"), 0, "rows[0].measured_s"),
    (("rows", 0, "measured_s"), -1e-3, "rows[0].measured_s"),
    (("rows", 0, "measured_s"), 10**400, "rows[0].measured_s"),
    (("rows", 0, "measured_s"), KeyError, "rows[0].measured_s"),
    (("rows", 0, "ok"), "yes", "rows[0].ok"),
    (("rows", 0, "calls_s"), [0], "rows[0].calls_s"),
    (("rows", 0), 1, "rows[0]"),
    (("rows",), [1], "rows[0]"),
    (("rows",), [], "rows"),
    (("rows",), {"op": "all_reduce"}, "rows"),
    (("load_before",), KeyError, "load_before"),
    (("load_after",), "high", "load_after"),
    (("scale",), 10**400, "scale"),
    (("scale",), 1e300, "scale"),
    (("mtu",), 10**30, "mtu"),
    (("cluster",), "../x", "cluster"),
    (("cluster",), None, "cluster"),
    (("topology",), "eth-4x2\0", "topology"),
    (("topology",), ["eth-4x2"], "topology"),
    (("topology",), "no-such-topology", "topology"),
    (("topology",), 0, "topology"),
    (("topology",), float("inf"), "topology"),
    (("probe",), None, "probe"),
    (("probe", "loopback_bandwidth"), 0, "probe.loopback_bandwidth"),
    (("probe", "across_latency_s"), KeyError, "probe.across_latency_s"),
    (("link_rate_bps",), float("nan"), "link_rate_bps"),
    (("bucket_bytes",), -1, "bucket_bytes"),
]


@pytest.mark.parametrize("path, value, field", CASES, ids=[f"{c[2]}={c[1]!r}"[:40] for c in CASES])
def test_each_malformed_field_is_named(tmp_path: Path, path: tuple, value: object, field: str,
                                       capsys: pytest.CaptureFixture) -> None:
    bad = tmp_path / "bad.measurements.json"
    bad.write_text(json.dumps(_with(path, value)))
    assert main(["calibrate", "--cluster", "t", "--out", str(tmp_path / "c.yaml"), "--from-measurements",
                 str(bad)]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert "bad.measurements.json" in err and field in err, err
    assert not (tmp_path / "c.yaml").exists()


@pytest.mark.parametrize("text", ["", "\0\0\0", "[1]", "null", '{"rows": [1]}', "[" * 100000, "{" + '"a":1,' * 5 + "}",
                                  '{"cluster": "t", "rows": NaN}', "1" * 5000])
def test_files_that_are_not_measurements_are_named(tmp_path: Path, text: str, capsys: pytest.CaptureFixture) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text(text)
    assert main(["calibrate", "--cluster", "t", "--out", str(tmp_path / "c.yaml"), "--from-measurements",
                 str(bad)]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and "bad.json" in err and len(err.strip().splitlines()) == 1, err


def test_a_valid_file_passes_and_keeps_fields_the_refit_does_not_read() -> None:
    doc = {**copy.deepcopy(GOOD), "min_call_s": 0.5, "queue": {"kind": "fifo"}}
    assert check_measurements(doc)["min_call_s"] == 0.5
    with pytest.raises(InputError, match="ok: false"):
        check_measurements(_with(("rows",), [{**GOOD["rows"][0], "ok": False}]))
