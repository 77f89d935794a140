"""pytest plugin: N emulated host devices for JAX, and fixtures to test parallel code on them.

Registered as the ``pytest11`` entry point ``testbed``, so any project with testbed installed gets it
(``-p no:testbed`` turns it off). Before JAX's backend starts it sets XLA_FLAGS
``--xla_force_host_platform_device_count=N`` (``--testbed-devices N`` or the ini option
``testbed_devices``; default 8; 0 leaves the environment alone) and, unless set, ``JAX_PLATFORMS=cpu``.
A device count already in XLA_FLAGS (a conftest of the project, the environment) is kept unless the
option is given; when the backend already started the fixtures skip, saying why.

Fixtures: ``testbed_devices`` (the N devices), ``mesh_factory`` (``mesh_factory((2, 4), ("data",
"model"))``: a ``jax.make_mesh`` over them), ``reference_device`` (a single-device context and runner).
"""

from __future__ import annotations

import math
import os
from typing import Any, Callable, Sequence

import pytest

from testbed.testing.devices import (MAX_HOST_DEVICES, DeviceRequest, ReferenceDevice, parse_device_count,
                                     request_host_devices)

DEFAULT_DEVICES = 8
_REQUEST = pytest.StashKey[DeviceRequest]()


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("testbed", "testbed: emulated JAX devices")
    group.addoption("--testbed-devices", default=None, dest="testbed_devices", metavar="N",
                    help=f"emulated host devices for JAX, 0 to {MAX_HOST_DEVICES} (default: ini testbed_devices, "
                         f"else {DEFAULT_DEVICES}; 0: leave XLA_FLAGS alone)")
    parser.addini("testbed_devices", f"emulated host devices for JAX, 0 to {MAX_HOST_DEVICES} "
                                     f"(default {DEFAULT_DEVICES})", default="")


def _wanted(config: pytest.Config) -> tuple[int, bool]:
    """(device count, whether the user chose it) from the command line, else the ini file, else the default."""
    option = getattr(config.known_args_namespace, "testbed_devices", None)
    if option is None:
        option = getattr(config.option, "testbed_devices", None)
    try:
        if option is not None:
            return parse_device_count(option, "--testbed-devices"), True
    except ValueError as err:  # pytest prints a UsageError as one line, exit status 4
        raise pytest.UsageError(str(err)) from None
    ini = str(config.getini("testbed_devices") or "").strip()
    if not ini:
        return DEFAULT_DEVICES, False
    try:
        return parse_device_count(ini, f"ini value testbed_devices ({config.inipath or 'ini file'})"), True
    except ValueError as err:
        raise pytest.UsageError(str(err)) from None


def _request(config: pytest.Config) -> DeviceRequest:
    if _REQUEST not in config.stash:
        n, chosen = _wanted(config)
        request = request_host_devices(n, override=chosen)
        if n > 0:
            os.environ.setdefault("JAX_PLATFORMS", "cpu")
        config.stash[_REQUEST] = request
    return config.stash[_REQUEST]


@pytest.hookimpl(tryfirst=True)
def pytest_load_initial_conftests(early_config: pytest.Config, parser: pytest.Parser, args: list[str]) -> None:
    # Earliest point: before the project's conftest files (which may import JAX) are loaded.
    _request(early_config)


def pytest_configure(config: pytest.Config) -> None:
    request = _request(config)
    if request.message:
        config.issue_config_time_warning(pytest.PytestConfigWarning(request.message), stacklevel=2)


def pytest_report_header(config: pytest.Config) -> str | None:
    request = _request(config)
    if request.action == "off":
        return None
    return f"testbed: {request.count or request.requested} emulated host devices requested for JAX ({request.action})"


@pytest.fixture(scope="session")
def testbed_devices(pytestconfig: pytest.Config) -> list[Any]:
    """The N devices tests run on (N from ``--testbed-devices``/XLA_FLAGS); skips when JAX has fewer."""
    import jax

    request = _request(pytestconfig)
    n = request.count if request.action == "kept" and request.count else request.requested
    if n <= 0:
        pytest.skip("testbed plugin off (--testbed-devices 0)")
    devices = jax.devices()
    if len(devices) < n:
        pytest.skip(request.message or f"testbed: {n} devices requested, JAX has {len(devices)} "
                                       f"(XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r})")
    return DeviceList(devices[:n])


class DeviceList(list):
    """The session's devices; a slice asking for more than there are fails, saying both numbers (a plain
    list would silently give fewer, and JAX fail later on a mesh of the wrong size)."""

    def __getitem__(self, index: Any) -> Any:
        __tracebackhide__ = True
        if isinstance(index, slice) and index.step in (None, 1) and (index.start or 0) >= 0:
            stop = index.stop
            if stop is not None and stop > len(self):
                pytest.fail(f"testbed_devices[{index.start or ''}:{stop}] asks for {stop - (index.start or 0)} "
                            f"devices, but this pytest run has {len(self)} (--testbed-devices / ini testbed_devices "
                            f"{len(self)}): run with --testbed-devices {stop} or more", pytrace=False)
        return super().__getitem__(index)


@pytest.fixture(scope="session")
def mesh_factory(testbed_devices: list[Any]) -> Callable[..., Any]:
    """``mesh_factory(shape, names, axis_types=None, devices=None)``: a ``jax.make_mesh`` over the first
    prod(shape) test devices; ``axis_types`` is JAX's AxisType tuple, or "auto"/"explicit"/"manual" for all axes."""
    import jax

    def make(shape: Sequence[int], names: Sequence[str], axis_types: Any = None,
             devices: Sequence[Any] | None = None) -> Any:
        __tracebackhide__ = True
        shape, names = tuple(int(s) for s in shape), tuple(names)
        if len(shape) != len(names):
            raise ValueError(f"mesh shape {shape} and axis names {names} differ in length")
        pool = list(devices if devices is not None else testbed_devices)
        size = math.prod(shape)
        if size > len(pool):
            pytest.fail(f"mesh {shape} needs {size} devices, but this pytest run has {len(pool)} "
                        f"(--testbed-devices / ini testbed_devices): run with --testbed-devices {size} or more",
                        pytrace=False)
        if isinstance(axis_types, str):
            axis_types = (getattr(jax.sharding.AxisType, axis_types.capitalize()),) * len(shape)
        return jax.make_mesh(shape, names, axis_types=axis_types, devices=pool[:size])

    return make


@pytest.fixture(scope="session")
def reference_device(testbed_devices: list[Any]) -> ReferenceDevice:
    """The first test device as a single-device context (``with reference_device:``) and runner
    (``reference_device(fn, *args)``)."""
    return ReferenceDevice(testbed_devices[0])
