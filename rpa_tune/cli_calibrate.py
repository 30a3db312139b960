"""``rpa-tune calibrate``: the device-cost model's constants for one TPU generation, fitted on
the device (``--backend tpu``) or on recorded rows (``--from-fixture``); logic in
``rpa_tune.calibrate``. Registered on the main Typer app by ``register(app)`` (one line in
``rpa_tune/cli.py``).
"""
from __future__ import annotations

import re
from pathlib import Path
from typing import Optional

import typer

from .cli_common import TPU_METAVAR, JsonFlag, KernelChoice, fail, parse_tpu, value
from .ui import _console

VERSION_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._+-]*$")


def calibrate_cmd(
    tpu: Optional[str] = typer.Option(None, "--tpu", parser=parse_tpu, metavar=TPU_METAVAR,
                                      help="The generation to calibrate: this machine's TPU (with --backend tpu); "
                                           "with --from-fixture, checked against the fixture's."),
    backend: Optional[str] = typer.Option(None, "--backend", metavar="tpu",
                                          help="tpu (the default without --from-fixture): time the probe set on "
                                               "this machine's TPU.", show_default=False),
    kernel: Optional[KernelChoice] = typer.Option(None, "--kernel", case_sensitive=False,
                                                  help="Fit only this kernel's probes (rows). Default: both kernels.",
                                                  show_default=False),
    from_fixture: Optional[Path] = typer.Option(None, "--from-fixture", metavar="FILE",
                                                help="Fit recorded measured rows instead (no device), e.g. "
                                                     "rpa_tune/data/paper_tpu7x_rpa_v3.json or the "
                                                     "<generation>.rows.json a device run wrote.",
                                                show_default=False),
    out: Optional[Path] = typer.Option(None, "--out", metavar="FILE",
                                       help="Write the calibration here. Default with --backend tpu: "
                                            "calibrations/<generation>.json in the user cache, which the compile "
                                            "backend uses for that generation; with --from-fixture: not written.",
                                       show_default=False),
    write: bool = typer.Option(False, "--write", help="Also write it into the package data "
                                                      "(rpa_tune/data/device_calibration.json)."),
    version: Optional[str] = typer.Option(None, "--version", help="The calibration's version (rows priced with it "
                                          "name it). Default: <generation>-device-<n> (-fixture-<n>), n one past "
                                          "the highest written.", show_default=False),
    json_out: JsonFlag = False,
):
    """Fit the device-cost model for one TPU generation and write the calibration the compile
    backend prices that generation with (docs/tuning.md, "Calibrating on a TPU")."""
    from . import calibrate as cal_mod
    if version is not None and not VERSION_RE.match(version):
        fail(f"--version {version!r}: letters, digits and . _ + - only")
    kern = value(kernel)
    console = _console(stderr=json_out)
    if from_fixture is not None:
        if backend is not None:
            fail(f"--backend {backend!r} with --from-fixture: a fixture's rows are already measured; drop --backend")
        try:
            gen, source, rows = cal_mod.load_fixture(str(from_fixture))
        except cal_mod.CalibrateError as e:
            fail(str(e))
        if tpu is not None and tpu != gen:
            fail(f"--tpu {tpu}: the fixture {str(from_fixture)!r} holds {gen} rows")
        if kern is not None:
            rows = [m for m in rows if m.kernel == kern]
            if not rows:
                fail(f"--kernel {kern}: the fixture {str(from_fixture)!r} has no rows of it")
        version = version or cal_mod.next_version(gen, "fixture", cal_mod.known_paths(gen, out and str(out)))
        left, rows_json = [], None
    else:
        backend = backend or "tpu"
        if backend != "tpu":
            fail(f"--backend {backend!r}: calibrate times probes on a device; valid: tpu (or --from-fixture FILE "
                 "to fit recorded rows)")
        if tpu is None:
            fail("--tpu is required with --backend tpu: the generation of this machine's TPU")
        from .evaluators.tpu import probe_devices, tpu_generation_present
        probe = probe_devices()
        here = tpu_generation_present(probe)
        if here != tpu:
            found = f"a TPU {here}" if here else f"no TPU ({probe.get('platform')})"
            fail(f"--backend tpu needs a TPU {tpu} here, found {found}; use --from-fixture FILE to fit recorded rows")
        gen = tpu
        out = out or Path(cal_mod.user_calibration_path(gen))
        version = version or cal_mod.next_version(gen, "device", cal_mod.known_paths(gen, str(out)))
        kernels = (kern,) if kern else cal_mod.KERNELS
        cal_mod.log(f"calibrate {gen}: timing the probe set on the device ({', '.join(kernels)}), then each "
                    "probe's static estimate (compile backend; cached on disk)")
        rows, left = cal_mod.measure_on_device(gen, kernels, progress=cal_mod.log)
        source = f"rpa-tune calibrate on a {gen} device ({len(rows)} probes timed)"
        rows_json = cal_mod.fixture_json(rows, gen, cal_mod.shard(gen), source)
    try:
        rep = cal_mod.fit_rows(rows, version, source, left)
    except cal_mod.CalibrateError as e:
        fail(str(e), code=1 if from_fixture is None else 2)
    written = cal_mod.write_files(rep, out=out and str(out), package=write, rows_json=rows_json)
    if json_out:
        from .ui import print_json
        print_json(dict(rep.to_json(), written=written))
    else:
        cal_mod.print_report(rep, console)
    default = cal_mod.user_calibration_path(gen)
    for w in written:
        if w == default:
            how = f"the compile backend prices {gen} with it (rows name {version})"
        elif w.endswith(".rows.json"):
            how = "the rows it was fitted to (--from-fixture reads them)"
        elif w == cal_mod._package_path():
            how = f"package data: shipped for {gen}"
        else:
            how = f"use it with RPA_TUNE_DEVICE_CALIBRATION={w}"
        console.print(f"wrote {w}: {how}")


def register(app: typer.Typer) -> None:
    """Add ``calibrate`` to the main app."""
    app.command("calibrate")(calibrate_cmd)
