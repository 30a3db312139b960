"""Every bad input of the new-user walkthrough (issue 13): exit code 2, one stderr line
``rpa-tune: error: ...`` naming the bad value and what is valid, no traceback, nothing
written. Run through the installed console script, as a user would."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from cli_checks import assert_one_error_line

RPA_TUNE = str(Path(sys.executable).with_name("rpa-tune"))
SPACE = """
generation = "v6e"
[decode]
bq = [1]
cq = [1]
bkv = [128, 256, 512]
ckv = [128, 256]
rules = [{rule!r}]
"""


def run(args, cwd, env=None, timeout=300):
    e = dict(os.environ, COLUMNS="250")
    e.update(env or {})
    return subprocess.run([RPA_TUNE, *args], capture_output=True, text=True, env=e, timeout=timeout, cwd=cwd)


def _files(d: Path) -> set:
    return {p.relative_to(d) for p in d.rglob("*")}


def _space(tmp, rule):
    p = tmp / "space.toml"
    p.write_text(SPACE.format(rule=rule))
    return str(p)


def _binary(tmp):
    p = tmp / "workload.json"
    p.write_bytes(b"\xff\xfe\x00\x81\x90binary")
    return str(p)


def _table(tmp):
    p = tmp / "bad_table.json"
    p.write_text('{"schema_version": 1, "entries": [{"key": {"generation": "v6e"}}]}')
    return str(p)


# (arguments; a callable making them from the temporary directory), needles of the error line
CASES = {
    "precompile-tpu": (["precompile", "--tpu", "v9"], ["'v9'", "v4, v5e, v5p, v6e, tpu7x"]),
    "precompile-page-size": (["precompile", "--tpu", "v6e", "--page-size", "0"], ["--page-size", "'0'", "greater than or equal to 8"]),
    "precompile-page-size-pow2": (["precompile", "--tpu", "v6e", "--page-size", "96"],
                                  ["--page-size 96", "power of two"]),
    "precompile-buckets": (["precompile", "--tpu", "v6e", "--buckets", "0"], ["--buckets '0'", "int >= 1"]),
    "precompile-heads": (["precompile", "--tpu", "v6e", "--q-heads", "30", "--kv-heads", "8", "--head-dim", "128"],
                         ["--q-heads 30", "multiple of --kv-heads 8"]),
    "precompile-cases": (["precompile", "--tpu", "v6e", "--cases", "decod"], ["'decod'", "decode, prefill, mixed"]),
    "precompile-no-tpu": (["precompile"], ["no local TPU", "--tpu v4|v5e|v5p|v6e|tpu7x"]),
    "sweep-workload-binary": (lambda t: ["sweep", "--tpu", "v6e", "--workload", _binary(t)],
                              ["workload.json", "not UTF-8", "JSON or CSV"]),
    "sweep-space-div-zero": (lambda t: ["sweep", "--tpu", "v6e", "--space", _space(t, "bkv // (ckv - ckv) > 0"),
                                        "--dry-run"], ["space.toml", "bkv // (ckv - ckv) > 0", "division", "ckv="]),
    "sweep-space-pow": (lambda t: ["sweep", "--tpu", "v6e", "--space", _space(t, "bkv ** 100000 > 0")],
                        ["bkv ** 100000 > 0", "uses **", "allowed:"]),
    "sweep-space-empty": (lambda t: ["sweep", "--tpu", "v6e", "--space", _space(t, "bkv < 0")],
                          ["space.toml", "no legal candidate", "6 illegal", "bkv < 0"]),
    "sweep-tpu": (["sweep", "--tpu", "v9"], ["'v9'", "v4, v5e, v5p, v6e, tpu7x"]),
    "sweep-budget": (["sweep", "--tpu", "v6e", "--budget", "0"], ["--budget", "'0'", "greater than or equal to 1"]),
    "sweep-buckets": (["sweep", "--tpu", "v6e", "--buckets", "64,x"], ["--buckets '64,x'", "list of ints"]),
    "export-tpu": (["export", "--tpu", "v9", "--results", "res", "--out", "tables"], ["'v9'", "v6e, tpu7x"]),
    "export-no-results": (["export", "--results", "nowhere", "--out", "tables"], ["nowhere", "does not exist"]),
    "diff-bad-table": (lambda t: ["diff", _table(t), _table(t)], ["bad_table.json", "key misses"]),
    "show-case": (["show", "--case", "training"], ["'training'", "'decode', 'prefill', 'mixed'"]),
    "report-no-results": (["report", "--results", "nowhere", "--out", "page"], ["--results 'nowhere'",
                                                                             "not a directory"]),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_bad_input_one_line_exit_2_nothing_written(name, tmp_path):
    args, needles = CASES[name]
    work = tmp_path / "work"
    work.mkdir()
    if callable(args):
        args = args(tmp_path)
    before = _files(work)
    r = run(args, cwd=work, env={"JAX_PLATFORMS": "cpu"})
    assert_one_error_line(r, needles)
    assert _files(work) == before, "nothing may be written on bad input"


@pytest.mark.parametrize("spelling", ["V6E", "tpu-v6e", "TPU v6 lite"])
def test_one_alias_rule_for_tpu(spelling, tmp_path):
    """Every command accepts what the kernel accepts (kernel.config.get_generation)."""
    r = run(["sweep", "--tpu", spelling, "--dry-run", "--json", "--results", str(tmp_path / "r")], cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["key"]["generation"] == "v6e"
    r = run(["sweep", "--tpu", "v7x", "--dry-run", "--json", "--results", str(tmp_path / "r")], cwd=tmp_path)
    assert r.returncode == 0 and json.loads(r.stdout)["key"]["generation"] == "tpu7x", r.stderr
    assert not (tmp_path / "r").exists()


def test_without_the_tune_extra_the_command_says_what_to_install(tmp_path):
    """A serving install (kernel only) runs `rpa-tune` into one line naming the extra."""
    code = ("import sys; sys.modules['optuna'] = None; sys.modules['pandas'] = None; "
            "from rpa_tune.__main__ import main; sys.exit(main())")
    r = subprocess.run([sys.executable, "-c", code, "sweep", "--tpu", "v6e"], capture_output=True, text=True,
                       cwd=tmp_path, timeout=120)
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr == ("rpa-tune: error: the tuner needs optuna, pandas (not installed); install the 'tune' "
                        "extra: pip install 'rpa-tune[tune]'\n")
