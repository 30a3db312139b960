"""Precompile time, cold vs warm cache: Llama-3-8B on TPU v6e, deviceless.

Each run is a fresh Python process (what a server start-up is) calling
``kernel.precompile`` for every token bucket 16..MAX (all three cases per executable, the
program a serving call runs). First a run without any cache (the baseline), then three
runs sharing one cache directory:

1. cold: empty cache.
2. warm: the same cache; deviceless, a module whose sha256 was verified before is not
   compiled again (``kernel.bringup`` "verified" records).
3. warm, JAX persistent cache only (``verify_cache=False``): shows what JAX's cache gives
   deviceless. libtpu writes entries but cannot load them without a device
   ("PjRtCompiler must be constructed with a Client to call DeserializeLoadedExecutable"),
   so this run compiles everything again. On a TPU host the same cache is read.

    python benchmarks/precompile.py [--tpu v6e] [--max-num-tokens 2048] [--out benchmarks/results/precompile_v6e.json]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def child(args) -> None:
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    t0 = time.perf_counter()
    import kernel
    from kernel.workload import ServingLimits
    from rpa_tune.presets import get_preset
    t_import = time.perf_counter() - t0
    model = get_preset(args.model).model()
    limits = ServingLimits(page_size=args.page_size, max_num_tokens=args.max_num_tokens,
                           max_num_seqs=args.max_num_seqs, max_model_len=args.max_model_len)
    r = kernel.precompile(model, limits, tpu=args.tpu, cache_dir=args.cache or None, progress=False,
                          verify_cache=not args.no_verify_cache, sm_scale=model.head_dim ** -0.5)
    out = r.as_dict()
    out["import_s"] = t_import
    out["process_s"] = time.perf_counter() - t0
    print("RESULT " + json.dumps(out))


def run(args, cache: str, *, verify: bool) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--child", "--cache", cache, "--tpu", args.tpu,
           "--model", args.model, "--max-num-tokens", str(args.max_num_tokens),
           "--max-num-seqs", str(args.max_num_seqs), "--max-model-len", str(args.max_model_len),
           "--page-size", str(args.page_size)] + ([] if verify else ["--no-verify-cache"])
    env = dict(os.environ, JAX_PLATFORMS="cpu", TF_CPP_MIN_LOG_LEVEL="3", TPU_WORKER_HOSTNAMES="localhost",
               ALLOW_MULTIPLE_LIBTPU_LOAD="1", RPA_TABLE=args.table or os.environ.get("RPA_TABLE", ""))
    t0 = time.perf_counter()
    p = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT)
    wall = time.perf_counter() - t0
    line = [l for l in p.stdout.splitlines() if l.startswith("RESULT ")]
    if p.returncode != 0 or not line:
        raise SystemExit(f"child failed ({p.returncode}):\n{p.stderr[-3000:]}")
    d = json.loads(line[0][7:])
    d["wall_s"] = wall
    return d


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--cache")
    ap.add_argument("--no-verify-cache", action="store_true")
    ap.add_argument("--tpu", default="v6e")
    ap.add_argument("--model", default="llama3-8b")
    ap.add_argument("--max-num-tokens", type=int, default=2048)
    ap.add_argument("--max-num-seqs", type=int, default=128)
    ap.add_argument("--max-model-len", type=int, default=8192)
    ap.add_argument("--page-size", type=int, default=128)
    ap.add_argument("--table", help="RPA_TABLE for the runs (default: the shipped tables)")
    ap.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "precompile_v6e.json"))
    args = ap.parse_args()
    if args.child:
        return child(args)
    with tempfile.TemporaryDirectory(prefix="rpa_jax_cache_") as cache:
        runs = {"no_cache": run(args, "", verify=False), "cold": run(args, cache, verify=True),
                "warm": run(args, cache, verify=True), "warm_jax_cache_only": run(args, cache, verify=False)}
    print(f"# precompile {args.model} on {args.tpu} (deviceless), buckets 16..{args.max_num_tokens}, "
          f"max_num_seqs {args.max_num_seqs}, max_model_len {args.max_model_len}, page {args.page_size}")
    cold = runs["cold"]
    print(f"{'bucket':>7}  {'decode':<22} {'prefill':<22} {'mixed':<22} {'no cache':>8} {'cold s':>7} {'warm s':>7} "
          f"{'jax-cache s':>11}")
    for i, v in enumerate(cold["variants"]):
        bs = {b["case"]: f"{tuple(b['block_sizes'])}{'*' if b['source'].startswith('table') else ''}"
              for b in v["block_sizes"]}
        w, j = runs["warm"]["variants"][i], runs["warm_jax_cache_only"]["variants"][i]
        nc = runs["no_cache"]["variants"][i]
        print(f"{v['bucket']:>7}  {bs.get('decode', ''):<22} {bs.get('prefill', ''):<22} {bs.get('mixed', ''):<22} "
              f"{nc['lower_s'] + nc['compile_s']:8.2f} {v['lower_s'] + v['compile_s']:7.2f} "
              f"{w['lower_s'] + w['compile_s']:7.2f} "
              f"{j['lower_s'] + j['compile_s']:11.2f}")
    print("(* = from a table)")
    for name, r in runs.items():
        st = {}
        for v in r["variants"]:
            st[v["status"]] = st.get(v["status"], 0) + 1
        print(f"{name:<20} precompile {r['total_s']:7.1f} s   process {r['process_s']:6.1f} s   "
              f"wall {r['wall_s']:6.1f} s   {st}")
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"config": {k: v for k, v in vars(args).items() if k not in ("child", "cache", "out")},
                   "runs": runs}, f, indent=2, sort_keys=True)
        f.write("\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
