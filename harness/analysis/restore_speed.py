"""How fast an agent's cache comes back after a restart: block files, the single file, mlx-lm's file, the disk.

``python -m harness.analysis.restore_speed [--tokens 2048 8192 32768] [--rounds 5] [--before ../main]``

A synthetic cache of a real geometry (Qwen3-Coder-30B-A3B: 48 layers, 4 KV heads, head_dim 128,
bfloat16; a cache's bytes do not depend on its values) is written through the store in both layouts
and by mlx-lm's ``save_prompt_cache``, once per size under ``--dir``. Then, per size and round, in
this order (interleaved, so a slow moment of the machine hits every variant alike)::

    blocks        AgentCacheStore(layout="blocks").load + convert.reconstruct, this tree's code
    blocks@before the same with --before's code (another checkout of the package)
    file          the single-file layout (``--cache-layout file``), load + reconstruct
    mlx-lm        mlx_lm.models.cache.load_prompt_cache of the same arrays, evaluated (no checksums)
    mlx-lm+xxh3   the same, then every tensor's xxh3-128 checked (on two threads): the work a restore does
    floor         a plain sequential read of the block files' bytes, 16 MiB at a time, into one buffer
    floor-fresh   the same read into one buffer of all their bytes, fresh from the kernel (as a restore's
                  arrays are): what placing the bytes in new memory adds to the disk on this machine

each with the page cache dropped first (fsync, then POSIX_FADV_DONTNEED, for every file of the
benchmark), and again with the page cache warm (the variant's files read once just before), beside a
memcpy of the same bytes (numpy, into memory already touched). Every trial runs in a fresh process, as a restart does: its
arrays are fresh memory, not MLX's or malloc's cache of an earlier trial; the process's start and
the store's directory scan are not timed. Prints a table of medians and ratios, writes JSON
(``--out``, raw samples included).
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
FP = "qwen3-coder-30b-a3b-synthetic"
LAYERS, HEADS, HEAD_DIM, DTYPE = 48, 4, 128, "bfloat16"
COLD = ("blocks", "blocks@before", "file", "mlx-lm", "mlx-lm+xxh3", "floor", "floor-fresh")
WARM = ("blocks", "blocks@before", "file", "mlx-lm", "mlx-lm+xxh3", "memcpy")
INTO = ("into-readv", "into-copy", "into-readv-threads")  # reading block files into arrays already made


# ---------------------------------------------------------------- in a trial's own process (either tree)


def _spec():
    from semantic.cache.spec import LayerSpec, ModelCacheSpec

    return ModelCacheSpec(tuple(LayerSpec("global", HEADS, HEAD_DIM, HEAD_DIM, DTYPE) for _ in range(LAYERS)))


def _files(d: Path, variant: str) -> list[Path]:
    """The files a variant reads, in the order a restore reads them (block files: by position)."""
    if variant in ("blocks", "floor", "memcpy") or variant.startswith("into-"):
        order = json.loads((d / "order.json").read_text())
        return [d / "blocks" / p for p in order] + sorted((d / "blocks").glob("*.kvm"))
    if variant == "file":
        return sorted((d / "file").glob("*.safetensors"))
    return [d / "mlxlm.safetensors"]


def _drop(paths) -> None:
    """Evict the files' pages from the page cache (clean pages go without root)."""
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def _warm(paths) -> None:
    buf = memoryview(bytearray(16 << 20))
    for p in paths:
        with open(p, "rb", buffering=0) as f:
            while f.readinto(buf):
                pass


def _trial(d: Path, variant: str, warm: bool) -> dict:
    """One timed restore (or read) of the cache in ``d``, in this process; seconds and a check."""
    import semantic  # noqa: F401  (before MLX: it picks MLX's BLAS)
    import mlx.core as mx

    n = json.loads((d / "ready.json").read_text())["tokens"]
    kind = variant.split("@")[0]
    paths = _files(d, kind)
    if kind in ("blocks", "file"):
        from semantic.cache.convert import reconstruct
        from semantic.cache.pool import BlockPool
        from semantic.store import AgentCacheStore

        spec = _spec()
        pool = BlockPool(spec, n // 256 + 2)
        store = AgentCacheStore(d / kind, spec, FP, 10**13, pool=pool, layout=kind)  # the scan: not timed

        def run():
            blocks = store.load("a")
            caches = reconstruct(blocks)
            return blocks, caches
    elif kind in ("mlx-lm", "mlx-lm+xxh3"):
        from mlx_lm.models.cache import load_prompt_cache

        want = json.loads((d / "ready.json").read_text())["mlxlm_xxh3"]

        def run():
            caches = load_prompt_cache(str(paths[0]))
            mx.eval([(c.keys, c.values) for c in caches])
            if kind == "mlx-lm+xxh3":  # the same work as a restore: every tensor checked against its xxh3-128
                assert _xxh3([x for c in caches for x in (c.keys, c.values)]) == want
            return None, caches
    elif kind == "floor":
        buf = memoryview(bytearray(16 << 20))

        def run():
            for p in paths:
                with open(p, "rb", buffering=0) as f:
                    while f.readinto(buf):
                        pass
            return None, None
    elif kind == "floor-fresh":
        total, held = sum(p.stat().st_size for p in paths), []

        def run():
            buf, at = memoryview(mmap.mmap(-1, total)), 0
            held.append(buf)  # unmapped after the timing, as a restore's arrays outlive it
            for p in paths:
                with open(p, "rb", buffering=0) as f:
                    while k := f.readinto(buf[at: at + (16 << 20)]):
                        at += k
            assert at == total
            return None, None
    elif kind.startswith("into-"):
        from semantic.store import blockread

        jobs = _into_jobs(d)
        read = {"into-readv": lambda: [blockread.read_file(j) for j in jobs],
                "into-copy": lambda: _read_by_copy(jobs),
                "into-readv-threads": lambda: blockread.read_all(jobs)}[kind]

        def run():
            read()
            return None, None
    else:  # memcpy: the cache's tensor bytes, from memory to memory already touched
        import numpy as np

        total = json.loads((d / "ready.json").read_text())["tensor_bytes"]
        src, dst = np.ones(total, np.uint8), np.zeros(total, np.uint8)
        np.copyto(dst, src)  # every page of both touched: the copy alone is timed

        def run():
            np.copyto(dst, src)
            return None, None
    # every trial starts from the same memory state: none of the benchmark's files cached but (warm) its own
    _drop([p for p in d.parent.rglob("*") if p.suffix in (".kvb", ".kvm", ".safetensors")])
    if warm and kind != "memcpy":
        _warm(paths)
    t, cpu = time.perf_counter(), time.process_time()
    blocks, caches = run()
    seconds, cpu = time.perf_counter() - t, time.process_time() - cpu
    out = {"s": seconds, "cpu_s": cpu, "peak_rss_mb": _peak_rss_mb()}
    if caches is not None:
        out["tokens"] = int(caches[0].offset)
    if blocks is not None:
        out["pieces_per_layer"] = _pieces(blocks)
    return out


def _peak_rss_mb() -> float:
    """This process's peak resident memory (VmHWM: its own, where ru_maxrss keeps the forking parent's)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def _into_jobs(d: Path) -> list:
    """Every block file of ``d``, to be read into one array per layer and side made for all its tokens (made
    here, not timed): what a restore reads, less the store around it."""
    import mlx.core as mx

    from semantic.cachefile.fileformat import MX_DTYPES
    from semantic.store import blockformat, blockread

    spec = _spec()
    infos = [blockformat.read_header(str(d / "blocks" / p), spec, FP) for p in json.loads((d / "order.json").read_text())]
    n = infos[-1].end
    slots = blockformat.block_slots(spec, infos[0].group, n)
    arrays = blockread.zeros([(s.shape, MX_DTYPES[s.dtype]) for s in slots])
    dests = {s.name: blockread.writable(a) for s, a in zip(slots, arrays)}
    return [blockread.Into(i, dests, ((0, i.end - i.start, i.start),)) for i in infos]


def _read_by_copy(jobs) -> None:
    """The other way to read a block file into place: all of it into one reused buffer, then per tensor
    its xxh3-128 and a numpy copy of its rows into their place (one thread, as ``into-readv``)."""
    import numpy as np
    import xxhash

    buf = bytearray(max(j.info.nbytes for j in jobs))
    mv, raw = memoryview(buf), np.frombuffer(buf, np.uint8)
    for job in jobs:
        info = job.info
        with open(info.path, "rb", buffering=0) as f:
            got = 0
            while got < info.nbytes and (k := f.readinto(mv[got:info.nbytes])):
                got += k
        off = 8 + int.from_bytes(mv[:8], "little")
        ((lo, hi, at),) = job.rows
        for s in info.slots:
            assert xxhash.xxh3_128(mv[off:off + s.nbytes]).hexdigest() == info.digests[s.name]
            heads, rows = s.shape[1], s.shape[2]
            row = s.nbytes // (heads * rows)
            dest = np.frombuffer(job.dests[s.name], np.uint8).reshape(heads, -1, row)
            dest[:, at:at + hi - lo] = raw[off:off + s.nbytes].reshape(heads, rows, row)[:, lo:hi]
            off += s.nbytes


def _xxh3(arrays) -> list[str]:
    """xxh3-128 of each evaluated array's bytes, on two threads (as the single-file layout's load hashes)."""
    from concurrent.futures import ThreadPoolExecutor

    import xxhash

    def digest(xs):
        return [xxhash.xxh3_128(memoryview(x).cast("B")).hexdigest() for x in xs]

    with ThreadPoolExecutor(1) as ex:
        other = ex.submit(digest, arrays[1::2])
        mine = digest(arrays[0::2])
        theirs = other.result()
    out = [None] * len(arrays)
    out[0::2], out[1::2] = mine, theirs
    return out


def _pieces(blocks) -> int:
    """How many runs layer 0 reconstructs from (1: handed over whole, no concatenation)."""
    from semantic.cache import convert
    from semantic.cache.blocks import segment_runs

    pieces, _, _ = convert._pieces(blocks, 0, blocks.total_tokens)
    return len(segment_runs(pieces, 0))


def _build(d: Path, n: int) -> None:
    """Write a synthetic cache of ``n`` tokens in every layout to ``d`` (once)."""
    import mlx.core as mx
    import numpy as np
    from mlx_lm.models.cache import KVCache, save_prompt_cache

    from semantic.cache.convert import extract
    from semantic.cache.pool import BlockPool
    from semantic.store import AgentCacheStore, blockformat

    d.mkdir(parents=True, exist_ok=True)
    spec = _spec()
    rng = np.random.default_rng(n)
    caches = []
    for _ in range(LAYERS):
        c = KVCache()
        k, v = (mx.array(rng.integers(0, 1 << 16, (1, HEADS, n, HEAD_DIM), dtype=np.uint16)).view(mx.bfloat16)
                for _ in range(2))
        c.keys, c.values, c.offset = k, v, n  # the arrays as they are: no copy into a step-sized buffer
        caches.append(c)
    tokens = [int(t) for t in rng.integers(1, 150_000, n)]
    pool = BlockPool(spec, n // 256 + 2)
    blocks = extract(pool, caches, tokens)
    for layout in ("blocks", "file"):
        AgentCacheStore(d / layout, spec, FP, 10**13, pool=pool, layout=layout).save("a", blocks)
    save_prompt_cache(str(d / "mlxlm.safetensors"), caches)
    mlxlm_xxh3 = _xxh3([x for c in caches for x in (c.keys, c.values)])
    infos = [blockformat.read_header(str(p), spec, FP) for p in (d / "blocks").glob("blocks-*/*.kvb")]
    order = [str(Path(i.path).relative_to(d / "blocks")) for i in sorted(infos, key=lambda i: i.start)]
    (d / "order.json").write_text(json.dumps(order))
    tensor_bytes = sum(s.nbytes for i in infos for s in i.slots)
    (d / "ready.json").write_text(json.dumps({"tokens": n, "tensor_bytes": tensor_bytes, "files": len(infos),
                                                  "mlxlm_xxh3": mlxlm_xxh3}))


def _child(argv: list[str]) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", type=Path, required=True)
    ap.add_argument("--build", type=int)
    ap.add_argument("--variant")
    ap.add_argument("--warm", action="store_true")
    a = ap.parse_args(argv)
    if a.build:
        _build(a.dir, a.build)
        return
    print(json.dumps(_trial(a.dir, a.variant, a.warm)))


# ---------------------------------------------------------------- the driver (this tree's harness)


def _run_child(tree: Path, args: list[str]) -> dict | None:
    env = {**os.environ, "PYTHONPATH": str(tree), "OPENBLAS_NUM_THREADS": "1"}
    # a script, not -m: its folder, not the tree, leads sys.path, so ``semantic`` is the tree's
    out = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--child", *args], env=env,
                         capture_output=True, text=True)
    if out.returncode:
        raise RuntimeError(f"trial {args} with {tree} failed:\n{out.stderr[-3000:]}")
    lines = out.stdout.strip().splitlines()
    return json.loads(lines[-1]) if lines else None


def _memcpy_gbs() -> float:
    import numpy as np

    a, b = np.ones(1 << 30, np.uint8), np.zeros(1 << 30, np.uint8)
    np.copyto(b, a)
    times = []
    for _ in range(5):
        t = time.perf_counter()
        np.copyto(b, a)
        times.append(time.perf_counter() - t)
    return (1 << 30) / float(np.median(times)) / 1e9


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--child"]:
        _child(argv[1:])
        return
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[2048, 8192, 32768])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--dir", type=Path, default=Path("/tmp/semantic-restore-speed"),
                    help="where the caches are written (a size's folder is kept and reused)")
    ap.add_argument("--before", type=Path, default=None,
                    help="a checkout whose semantic/ is the code to compare with (blocks@before), e.g. main's")
    ap.add_argument("--out", type=Path, default=ROOT / "results" / "restore_speed.json")
    args = ap.parse_args(argv)

    import numpy as np

    from harness import environment, stats

    before = args.before
    trees = {"": ROOT, "@before": before}
    doc = {
        "what": __doc__.splitlines()[0],
        "geometry": {"layers": LAYERS, "kv_heads": HEADS, "head_dim": HEAD_DIM, "dtype": DTYPE, "kind": "global"},
        "protocol": "each trial a fresh process; cold: fsync + POSIX_FADV_DONTNEED on the files read, then timed; "
                    "warm: the files read once, then timed; variants interleaved per round; medians",
        "machine": {"nproc": os.cpu_count(), "memcpy_1gb_gbs": round(_memcpy_gbs(), 2),
                    **{k: v for k, v in environment.machine_info().items() if k in ("processor", "ram_gb", "system", "release")}},
        "packages": environment.packages(),
        "git": environment.git_info(ROOT),
        "before": str(before) if before else None,
        "sizes": {},
    }
    print(f"nproc {doc['machine']['nproc']}, memcpy {doc['machine']['memcpy_1gb_gbs']} GB/s (numpy, 1 GB)")
    for n in args.tokens:
        d = args.dir / f"{n}"
        if not (d / "ready.json").exists():
            t = time.perf_counter()
            _run_child(ROOT, ["--dir", str(d), "--build", str(n)])
            print(f"{n} tokens: wrote the caches in {time.perf_counter() - t:.1f} s")
        info = json.loads((d / "ready.json").read_text())
        samples: dict[str, list[float]] = {}
        cpu: dict[str, list[float]] = {}
        rss: dict[str, list[float]] = {}
        checks: dict[str, set] = {}
        for _ in range(args.rounds):
            for warm, variants in ((False, COLD), (True, WARM), (False, INTO), (True, INTO)):
                for v in variants:
                    kind, _, which = v.partition("@")
                    tree = trees["@" + which if which else ""]
                    if tree is None:
                        continue
                    r = _run_child(tree, ["--dir", str(d), "--variant", kind] + (["--warm"] if warm else []))
                    samples.setdefault(f"{'warm' if warm else 'cold'} {v}", []).append(r["s"])
                    cpu.setdefault(f"{'warm' if warm else 'cold'} {v}", []).append(r["cpu_s"])
                    rss.setdefault(f"{'warm' if warm else 'cold'} {v}", []).append(r["peak_rss_mb"])
                    for k in ("tokens", "pieces_per_layer"):
                        if k in r:
                            checks.setdefault(f"{v} {k}", set()).add(r[k])
        med = {k: float(np.median(s)) for k, s in samples.items()}
        med_cpu = {k: float(np.median(s)) for k, s in cpu.items()}
        gb = info["tensor_bytes"] / 1e9
        ratios = {}
        for mode in ("cold", "warm"):
            b = med.get(f"{mode} blocks")
            for other in ("file", "mlx-lm", "mlx-lm+xxh3", "blocks@before"):
                if f"{mode} {other}" in med:
                    ratios[f"{mode} blocks / {other}"] = b / med[f"{mode} {other}"]
            if f"{mode} blocks@before" in med and f"{mode} file" in med:
                ratios[f"{mode} blocks@before / file"] = med[f"{mode} blocks@before"] / med[f"{mode} file"]
        ratios["cold floor speed share (floor / blocks)"] = med["cold floor"] / med["cold blocks"]
        ratios["cold fresh memory's share (floor / floor-fresh)"] = med["cold floor"] / med["cold floor-fresh"]
        ratios["cold blocks over a read into fresh memory (floor-fresh / blocks)"] = (med["cold floor-fresh"]
                                                                                    / med["cold blocks"])
        if "cold blocks@before" in med:
            ratios["cold floor speed share before (floor / blocks@before)"] = med["cold floor"] / med["cold blocks@before"]
        ratios["warm blocks / memcpy"] = med["warm blocks"] / med["warm memcpy"]
        for mode in ("cold", "warm"):
            ratios[f"{mode} into-copy / into-readv"] = med[f"{mode} into-copy"] / med[f"{mode} into-readv"]
        doc["sizes"][str(n)] = {
            "tokens": n, "tensor_bytes": info["tensor_bytes"], "block_files": info["files"],
            "median_s": med, "median_cpu_s": med_cpu, "ratios": ratios,
            "median_peak_rss_mb": {k: float(np.median(v)) for k, v in rss.items()}, "checks": {k: sorted(v) for k, v in checks.items()},
            "stats": {k: stats.summarize(s) for k, s in samples.items()}, "samples_s": samples, "cpu_samples_s": cpu,
        }
        _print(n, gb, med, med_cpu, {k: float(np.median(v)) for k, v in rss.items()}, ratios)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(doc, indent=1) + "\n")
    print(f"wrote {args.out}")


def _print(n: int, gb: float, med: dict, med_cpu: dict, rss: dict, ratios: dict) -> None:
    print(f"\n{n} tokens, {gb:.2f} GB of tensors")
    print(f"  {'variant':<26}{'median s':>10}{'GB/s':>8}{'CPU s':>8}{'peak RSS MB':>13}")
    for k, s in med.items():
        print(f"  {k:<26}{s:>10.3f}{gb / s:>8.2f}{med_cpu[k]:>8.3f}{rss[k]:>13.0f}")
    for k, r in ratios.items():
        print(f"  {k:<56}{r:>7.2f}")


if __name__ == "__main__":
    main()
