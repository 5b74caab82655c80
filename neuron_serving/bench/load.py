"""Load benchmark: time and bytes to load a TP=2 unit from its sharded checkpoint
(``checkpoint shard --tp 2``: each rank reads only ``model-rank-{r}-part-*``)
against the full Hugging Face checkpoint on every rank.

Each trial is its own process (``python -m neuron_serving.bench.load --trial``):
the leader (rank 0, engine core in-process) plus a ``neuron-serving follower``
for rank 1, ``--enforce-eager`` and float32 for both arms. Arms alternate, and
which arm goes first alternates pair by pair.

Two ranks on one host would share the page cache (rank 1 would find the full
checkpoint already read by rank 0). To measure what a rank on its own host
reads, the follower runs in its own mount namespace with its own copy of the
checkpoint bind-mounted at the leader's path (needs root for ``unshare -m``;
without it the trial says ``separate_host_copy: false``). Before each trial the
checkpoint files of both copies are evicted from the page cache
(``posix_fadvise(DONTNEED)`` on those files only). vLLM memory-maps safetensors,
so the weights show up in ``read_bytes`` (pages faulted in from storage), not in
``rchar`` (read syscalls) - both are reported per rank.

Reported per arm: time to ready (``LLM(...)`` constructor: join, init, load,
KV cache, no compile), each rank's ``load_model`` time, ``read_bytes`` and
``rchar`` (median, min, max over repeats), and the expected bytes per rank from
the manifest (``rank_bytes``) vs the full checkpoint.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

from neuron_serving.bench.common import spread, write_result

TP = 2
TOKEN = "bench-load-token-0123456789abcdef"


def _cache_root() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "neuron-serving" / "bench-load"


def _weights(directory: Path) -> list[Path]:
    return sorted(p for p in directory.iterdir() if p.suffix == ".safetensors")


def _evict(directories: list[Path]) -> None:
    """Drop these checkpoints' pages from the page cache (only these files)."""
    for d in directories:
        for p in d.iterdir():
            if not p.is_file():
                continue
            fd = os.open(p, os.O_RDONLY)
            try:
                os.fdatasync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def _can_unshare() -> bool:
    if shutil.which("unshare") is None or os.geteuid() != 0:
        return False
    probe = subprocess.run(
        ["unshare", "-m", "--propagation", "private", "true"], capture_output=True, timeout=10
    )
    return probe.returncode == 0


def _prepare(model: str | None, cache: Path) -> tuple[Path, Path]:
    """(HF dir, sharded dir): the demo model and its tp=2 shards, made once and cached."""
    from neuron_serving.checkpoint.manifest import source_hash
    from neuron_serving.checkpoint.verify import verify

    if model is None:
        hf = cache / "demo"
        if not (hf / "config.json").is_file():
            from neuron_serving.models.demo import build_demo_model

            shutil.rmtree(hf, ignore_errors=True)
            build_demo_model(hf, seed=0)
    else:
        hf = Path(model).resolve()
    key = source_hash(hf).sha256[:12]
    sharded = cache / f"{hf.name}-tp{TP}-{key}"
    if not verify(sharded, hashes=False).ok:
        shutil.rmtree(sharded, ignore_errors=True)
        print(f"load: sharding {hf} for tp={TP} -> {sharded}", file=sys.stderr, flush=True)
        cmd = [sys.executable, "-m", "neuron_serving.cli", "checkpoint", "shard"]
        cmd += ["--model", str(hf), "--tp", str(TP), "--out", str(sharded)]
        cmd += ["--version", f"bench-{key}", "--dtype", "float32"]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=_env())
        if proc.returncode != 0:
            raise RuntimeError(f"checkpoint shard failed:\n{proc.stderr[-3000:]}")
    return hf, sharded


def _host_copy(src: Path, cache: Path) -> Path:
    """The second 'host's' copy of a checkpoint (same bytes, other inodes)."""
    dst = cache / "host1" / src.name
    if not dst.is_dir():
        tmp = dst.with_name(dst.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.copytree(src, tmp)
        tmp.rename(dst)
    return dst


def _env() -> dict[str, str]:
    return {
        **os.environ,
        "NEURON_SERVING_UNIT_TOKEN": os.environ.get("NEURON_SERVING_UNIT_TOKEN", TOKEN),
        "VLLM_CPU_OMP_THREADS_BIND": "0|1",
        "VLLM_LOGGING_STREAM": "ext://sys.stderr",
    }


def _trial(arm: str, model_dir: Path, copy: Path | None, port: int) -> dict:
    cmd = [sys.executable, "-m", "neuron_serving.bench.load", "--trial", "--arm", arm]
    cmd += ["--model", str(model_dir), "--control-port", str(port)]
    if copy is not None:
        cmd += ["--follower-copy", str(copy)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=_env())
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"{arm} trial failed (rc {proc.returncode}):\n{proc.stderr[-3000:]}")
    return json.loads(lines[-1])


def _summary(trials: list[dict]) -> dict:
    out = {
        "ready_s": spread([t["ready_s"] for t in trials]),
        "load_model_s_max_rank": spread([max(r["seconds"] for r in t["ranks"]) for t in trials]),
    }
    for rank in range(TP):
        for field in ("seconds", "read_bytes", "rchar"):
            out[f"rank{rank}_{field}"] = spread([float(t["ranks"][rank][field]) for t in trials])
    return out


def main(quick: bool, model: str | None, emit_json: bool, repeats: int | None = None) -> int:
    from neuron_serving import ports
    from neuron_serving.checkpoint.manifest import Manifest

    repeats = repeats or (2 if quick else 5)
    cache = _cache_root()
    cache.mkdir(parents=True, exist_ok=True)
    hf, sharded = _prepare(model, cache)
    separate = _can_unshare()
    copies: dict[str, Path | None] = {"full": None, "sharded": None}
    if separate:
        copies = {"full": _host_copy(hf, cache), "sharded": _host_copy(sharded, cache)}
    dirs = {"full": hf, "sharded": sharded}
    manifest = Manifest.read(sharded)
    full_bytes = sum(p.stat().st_size for p in _weights(hf))
    trials: dict[str, list[dict]] = {"sharded": [], "full": []}
    for i in range(repeats):
        order = ("sharded", "full") if i % 2 == 0 else ("full", "sharded")
        for arm in order:
            _evict([d for d in (dirs[arm], copies[arm]) if d is not None])
            trials[arm].append(_trial(arm, dirs[arm], copies[arm], ports.free_port_block(4)))
            t = trials[arm][-1]
            per_rank = ", ".join(
                f"r{r['rank']} {r['seconds']:.2f} s {r['read_bytes'] / 1e6:.1f} MB"
                for r in t["ranks"]
            )
            print(
                f"pair {i + 1}/{repeats} {arm}: ready {t['ready_s']:.1f} s; load_model {per_rank}",
                file=sys.stderr,
                flush=True,
            )
    s, f = _summary(trials["sharded"]), _summary(trials["full"])
    rank_bytes = {str(r): manifest.rank_bytes(r) for r in range(TP)}
    read_ratio = {
        str(r): s[f"rank{r}_read_bytes"]["median"] / max(f[f"rank{r}_read_bytes"]["median"], 1)
        for r in range(TP)
    }
    result = {
        "settings": {
            "tp": TP,
            "model": "demo (seed 0)" if model is None else model,
            "repeats": repeats,
            "enforce_eager": True,
            "dtype": "float32",
            "engine_core": "in-process (VLLM_ENABLE_V1_MULTIPROCESSING=0)",
            "cpu_bind": "0|1",
            "page_cache": "checkpoint files evicted (posix_fadvise DONTNEED) before each trial",
            "separate_host_copy": separate,
            "arms_alternate": True,
        },
        "checkpoint": {
            "full_weights_bytes": full_bytes,
            "sharded_rank_bytes": rank_bytes,
            "expected_read_ratio_per_rank": {r: b / full_bytes for r, b in rank_bytes.items()},
            "expected_ratio_ideal": 1 / TP,
        },
        "sharded": s,
        "full": f,
        "ready_ratio_sharded_over_full": s["ready_s"]["median"] / f["ready_s"]["median"],
        "load_model_ratio_sharded_over_full": s["load_model_s_max_rank"]["median"]
        / f["load_model_s_max_rank"]["median"],
        "read_bytes_ratio_sharded_over_full": read_ratio,
        "trials": trials,
    }
    path = write_result("load" + ("-quick" if quick else ""), result)
    print(
        f"load (tp={TP}): time to ready sharded {s['ready_s']['median']:.1f} s "
        f"({s['ready_s']['min']:.1f}..{s['ready_s']['max']:.1f}) vs full "
        f"{f['ready_s']['median']:.1f} s ({f['ready_s']['min']:.1f}..{f['ready_s']['max']:.1f}); "
        f"load_model (slowest rank) {s['load_model_s_max_rank']['median']:.2f} s vs "
        f"{f['load_model_s_max_rank']['median']:.2f} s; read_bytes per rank sharded "
        + ", ".join(f"{s[f'rank{r}_read_bytes']['median'] / 1e6:.1f}" for r in range(TP))
        + " MB vs full "
        + ", ".join(f"{f[f'rank{r}_read_bytes']['median'] / 1e6:.1f}" for r in range(TP))
        + f" MB (expected {rank_bytes['0'] / 1e6:.1f} vs {full_bytes / 1e6:.1f} MB); "
        f"written to {path}",
        file=sys.stderr,
    )
    if emit_json:
        print(json.dumps({k: v for k, v in result.items() if k != "trials"}), flush=True)
    return 0


# -- one trial, in its own process ---------------------------------------------
def _separate_host(copy: Path, model_dir: Path) -> tuple[str, ...]:
    """Follower argv prefix: its own mount namespace, where the leader's model path
    shows this 'host's' copy."""
    script = 'mount --bind "$1" "$2" && shift 2 && exec "$@"'
    return ("unshare", "-m", "--propagation", "private", "sh", "-c", script, "sh") + (
        str(copy),
        str(model_dir),
    )


def _run_trial(args: argparse.Namespace) -> int:
    """One trial; prints one JSON line."""
    from neuron_serving.unit.config import UnitConfig
    from neuron_serving.unit.inprocess import InProcessUnit, InProcessUnitConfig

    copy = Path(args.follower_copy) if args.follower_copy else None
    unit = InProcessUnit(
        InProcessUnitConfig(
            model=args.model,
            tp=TP,
            unit=UnitConfig.from_env(control_port=args.control_port, join_timeout_s=180),
            max_model_len=512,
            kv_cache_bytes=256 << 20,
            dtype="float32",
            enforce_eager=True,
            follower_argv_prefix=() if copy is None else _separate_host(copy, Path(args.model)),
            log_dir=_cache_root() / "logs" / args.arm,
        )
    )
    with unit:
        from vllm import SamplingParams

        assert unit.llm is not None
        params = SamplingParams(max_tokens=4, temperature=0.0)
        out = unit.llm.generate(["hello"], params, use_tqdm=False)
        result = {
            "arm": args.arm,
            "ready_s": unit.ready_s,
            "ranks": [st.to_dict() for st in unit.executor.load_stats],
            "tokens": list(out[0].outputs[0].token_ids),
            "separate_host_copy": copy is not None,
        }
        print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--trial", action="store_true")
    p.add_argument("--arm", choices=["sharded", "full"])
    p.add_argument("--model")
    p.add_argument("--control-port", type=int)
    p.add_argument("--follower-copy", default=None)
    a = p.parse_args()
    if a.trial:
        from neuron_serving.unit.inprocess import run_then_exit

        run_then_exit(lambda: _run_trial(a))
    sys.exit(main(False, a.model, True))
