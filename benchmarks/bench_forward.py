"""Benchmark: the sharded forward against the unsharded model on the same cores, for every kind of mesh.

MiniMax-H3 at a compute-bound size (default: hidden 1024, 16 heads of 64, ffn 2816, 5 blocks, 2000 packed rows,
float32, seeded random weights) is converted at tp=1 and tp=2 in a temporary folder. Each job is a fresh set of
processes:

  unsharded/W   the plain diffusers model (from_pretrained) in one process with W threads
  unsharded/1   the same on 1 thread (serial: the work itself, immune to threads that wait for a busy core)
  <mesh>        W = tp x ring x ulysses gloo ranks (load_sharded), 1 thread each

so a mesh of W ranks is compared with the unsharded model on W threads: the same cores, the same thread count.
The column "x W / serial" is step * W / (unsharded/1 step): 1.00 is perfect scaling, what W ranks cost over the
serial work. On a loaded machine (other jobs on the cores) the W-thread baseline suffers most (its OpenMP
threads wait for each other), so read its ratio with the load average printed beside it; the CPU columns (process
CPU time of a step, summed over the ranks, against the serial model's) show the work sharding adds, which the
neighbours disturb much less (an OpenMP baseline's spinning threads inflate its own CPU time).
Repetitions alternate: every --runs repetition runs every job once, in an order that rotates, and the ratio of
a mesh is the median over repetitions of (mesh step / unsharded step of the same repetition and W). A step is
one forward pass under no_grad; its time is the slowest rank's, the ranks starting each step together (a
barrier). Each job: --warmup untimed steps, then --steps timed ones (their median), then one profiled step.

The profile split (torch.profiler, one step of rank 0, self CPU time of each op) is bucketed into matmul
(mm/addmm/bmm), attention (the SDPA kernels), collectives (the c10d functional ops and their waits: time the
rank spends issuing and waiting for them), preshard's own hooks (the CP split/gather hooks and the CP attention
entry, wrapped in record_function for this step only; their self time excludes the ops they call), other ops,
and the rest (Python between ops, diffusers' own code). Shares are of the profiled step.

--compile BACKEND adds, per job, torch.compile(model, fullgraph=True) with that backend: its first call
(compile time) and its steady-state step, against the eager step of the same job.

    python benchmarks/bench_forward.py                     # tp2, ulysses2, ring2, tp2xring2, tp2xulysses2; 7 runs
    python benchmarks/bench_forward.py --meshes ring2,tp2xring2 --runs 5
    python benchmarks/bench_forward.py --compile inductor --meshes tp2,ulysses2,ring2 --runs 1
    python benchmarks/bench_forward.py --hidden 256 --heads 4 --layers 2 --rows 400 --runs 1   # a quick look
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _harness import bench_env, loadavg

MESHES = {
    "tp2": (2, 1, 1),
    "ulysses2": (1, 1, 2),
    "ring2": (1, 2, 1),
    "tp2xring2": (2, 2, 1),
    "tp2xulysses2": (2, 1, 2),
    "ring2xulysses2": (1, 2, 2),
    "ulysses4": (1, 1, 4),
    "ring4": (1, 4, 1),
}
BUCKETS = ("matmul", "attention", "collectives", "preshard hooks", "other ops", "python/untracked")


def model_config(args: argparse.Namespace) -> dict:
    from preshard.examples.minimax_h3 import tiny_config

    head_dim = args.hidden // args.heads
    return tiny_config(
        num_attention_heads=args.heads,
        attention_head_dim=head_dim,
        hidden_size=args.hidden,
        num_layers=args.layers,
        num_refiner_layers=1,
        ffn_dim=args.ffn,
        text_dim=args.hidden,
        freq_dim=256,
        time_embed_hidden_dim=args.hidden,
        time_embed_dim=args.hidden // 2,
        rope_freq_dim=head_dim // 8,
    )


# --------------------------------------------------------------------------------------------------
# One process of a job


def _bucket(key: str) -> str:
    k = key.lower()
    if k.startswith("preshard:"):
        return "preshard hooks"
    if any(s in k for s in ("c10d", "gloo", "wait_tensor", "all_to_all", "all_gather", "all_reduce", "comms")):
        return "collectives"
    if "scaled_dot_product" in k or "flash_attention" in k or "efficient_attention" in k:
        return "attention"
    if k in ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm"):
        return "matmul"
    return "other ops"


def _label_preshard(net) -> None:
    """Wrap preshard's CP hooks and CP attention entry in record_function, for the profiled step."""
    import functools

    from torch.profiler import record_function

    def labelled(fn, label):
        @functools.wraps(fn)
        def run(*a, **kw):
            with record_function(label):
                return fn(*a, **kw)

        return run

    for module in net.modules():
        for hooks in (module._forward_pre_hooks, module._forward_hooks):
            for key in list(hooks):
                hooks[key] = labelled(hooks[key], "preshard:hook")
    runtime = getattr(net, "_preshard_cp", None)
    if runtime is not None:
        runtime.attend = labelled(runtime.attend, "preshard:attend")


def _profile_split(net, step) -> dict[str, float]:
    from torch.profiler import ProfilerActivity, profile

    _label_preshard(net)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        t0 = time.perf_counter()
        step()
        wall_us = (time.perf_counter() - t0) * 1e6
    split = dict.fromkeys(BUCKETS, 0.0)
    for evt in prof.key_averages():
        split[_bucket(evt.key)] += evt.self_cpu_time_total
    split["python/untracked"] = max(0.0, wall_us - sum(split.values()))
    return {k: v / 1e6 for k, v in split.items()} | {"profiled_step_s": wall_us / 1e6}


def child(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    from diffusers import MiniMaxH3Transformer3DModel as H3

    from preshard.examples.minimax_h3 import make_inputs

    torch.set_num_threads(args.threads)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    if world > 1:
        dist.init_process_group("gloo")
    config = json.loads(Path(args.config).read_text())
    if args.mesh == "unsharded":
        net = H3.from_pretrained(args.checkpoint, torch_dtype=torch.float32).eval()
    else:
        from preshard.runtime.load import load_sharded

        _, ring, ulysses = MESHES[args.mesh]
        net = load_sharded(H3, args.checkpoint, ring=ring, ulysses=ulysses)
    inputs = make_inputs(config, args.rows)

    cpu_times: list[float] = []

    def timed_steps(model, n: int) -> list[float]:
        times, cpu = [], []
        for _ in range(n):
            if world > 1:
                dist.barrier()
            t0, c0 = time.perf_counter(), time.process_time()
            with torch.no_grad():
                model(**inputs, return_dict=False)
            times.append(time.perf_counter() - t0)
            cpu.append(time.process_time() - c0)
        if world > 1:  # the slowest rank's time, step by step; CPU time summed over the ranks
            t = torch.tensor(times, dtype=torch.float64)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            times = t.tolist()
            c = torch.tensor(cpu, dtype=torch.float64)
            dist.all_reduce(c, op=dist.ReduceOp.SUM)
            cpu = c.tolist()
        cpu_times[:] = cpu
        return times

    result: dict = {}
    timed_steps(net, args.warmup)
    result["steps"] = timed_steps(net, args.steps)
    result["cpu"] = list(cpu_times)
    if args.compile:
        torch._dynamo.reset()
        compiled = torch.compile(net, backend=args.compile, fullgraph=True)
        result["compile_s"] = max(timed_steps(compiled, 1))
        timed_steps(compiled, args.warmup)
        result["compiled_steps"] = timed_steps(compiled, args.steps)
    if args.profile:

        def step():
            if world > 1:
                dist.barrier()
            with torch.no_grad():
                net(**inputs, return_dict=False)

        result["profile"] = _profile_split(net, step)
    if world > 1:
        dist.barrier()
        dist.destroy_process_group()
    if rank == 0:
        Path(args.out).write_text(json.dumps(result))


# --------------------------------------------------------------------------------------------------
# The parent: build, convert, alternate jobs, print the table


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_job(args, work: Path, mesh: str, world: int, checkpoint: Path, tag: str) -> dict:
    out = work / f"result-{tag}.json"
    out.unlink(missing_ok=True)
    port = _free_port()
    threads = world if mesh == "unsharded" else 1
    ranks = 1 if mesh == "unsharded" else world
    cmd = [
        sys.executable, __file__, "--child", "--mesh", mesh, "--checkpoint", str(checkpoint),
        "--config", str(work / "config.json"), "--threads", str(threads), "--rows", str(args.rows),
        "--steps", str(args.steps), "--warmup", str(args.warmup), "--out", str(out),
    ] + ([] if args.profile else ["--no-profile"]) + (["--compile", args.compile] if args.compile else [])  # fmt: skip
    procs = []
    for rank in range(ranks):
        env = bench_env(
            MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(ranks),
            LOCAL_RANK=str(rank), OMP_NUM_THREADS=str(threads),
        )  # fmt: skip
        log = open(work / f"log-{tag}-{rank}.txt", "wb")  # noqa: SIM115 - closed below
        procs.append((subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT), log))
    failed = []
    for rank, (proc, log) in enumerate(procs):
        try:
            code = proc.wait(timeout=args.timeout)
        except subprocess.TimeoutExpired:
            for p, _ in procs:
                p.kill()
            code = "timeout"
        log.close()
        if code != 0:
            failed.append((rank, code))
    if failed:
        rank, code = failed[0]
        text = (work / f"log-{tag}-{rank}.txt").read_text(errors="replace")[-3000:]
        raise SystemExit(f"job {tag} failed (rank {rank}: {code}):\n{text}")
    return json.loads(out.read_text())


def prepare(args, work: Path) -> dict[int, Path]:
    import torch

    from preshard.converter.convert import convert_checkpoint
    from preshard.examples.minimax_h3 import build_model, save_checkpoint

    config = model_config(args)
    (work / "config.json").write_text(json.dumps(config))
    torch.manual_seed(0)
    source = save_checkpoint(build_model(config, seed=0, dtype="float32"), work / "source")
    tps = sorted({MESHES[m][0] for m in args.meshes})
    out = {0: source}
    for tp in tps:
        convert_checkpoint(source, work / f"tp{tp}", tp=tp, progress=False)
        out[tp] = work / f"tp{tp}"
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--mesh", help=argparse.SUPPRESS)
    parser.add_argument("--checkpoint", help=argparse.SUPPRESS)
    parser.add_argument("--config", help=argparse.SUPPRESS)
    parser.add_argument("--threads", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    parser.add_argument("--meshes", default="tp2,ulysses2,ring2,tp2xring2,tp2xulysses2")
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--ffn", type=int, default=2816)
    parser.add_argument("--layers", type=int, default=5)
    parser.add_argument("--rows", type=int, default=2000)
    parser.add_argument("--runs", type=int, default=7, help="alternating repetitions of every job (default 7)")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--no-profile", dest="profile", action="store_false")
    parser.add_argument("--compile", choices=("aot_eager", "inductor", "eager"), default=None)
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds per job")
    parser.add_argument("--keep", action="store_true", help="keep the temporary folder")
    args = parser.parse_args()
    if args.child:
        return child(args)
    args.meshes = [m.strip() for m in args.meshes.split(",") if m.strip()]
    unknown = [m for m in args.meshes if m not in MESHES]
    if unknown:
        raise SystemExit(f"unknown meshes {unknown}; choose from {sorted(MESHES)}")

    work = Path(tempfile.mkdtemp(prefix="bench-forward-"))
    try:
        start_load = loadavg()
        print(f"# load average at start: {start_load}", flush=True)
        checkpoints = prepare(args, work)
        worlds = sorted({MESHES[m][0] * MESHES[m][1] * MESHES[m][2] for m in args.meshes})
        jobs = [("unsharded", 1)] + [("unsharded", w) for w in worlds]
        jobs += [(m, MESHES[m][0] * MESHES[m][1] * MESHES[m][2]) for m in args.meshes]
        results: dict[tuple[str, int], list[dict]] = {job: [] for job in jobs}
        for run in range(args.runs):
            order = jobs[run % len(jobs) :] + jobs[: run % len(jobs)]
            for mesh, world in order:
                checkpoint = checkpoints[0] if mesh == "unsharded" else checkpoints[MESHES[mesh][0]]
                res = run_job(args, work, mesh, world, checkpoint, f"{mesh}-{world}-{run}")
                res["load"] = loadavg().split()[0]
                results[(mesh, world)].append(res)
                print(f"# run {run + 1}/{args.runs} {mesh} (W={world}): step {statistics.median(res['steps']):.3f} s"
                      f" (load {res['load']})", flush=True)  # fmt: skip
        print_table(args, results, jobs, start_load)
    finally:
        if args.keep:
            print(f"# kept {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)


def print_table(args, results, jobs, start_load: str) -> None:
    def med(xs):
        return statistics.median(xs)

    print()
    print(f"MiniMax-H3 hidden {args.hidden}, {args.heads} heads, ffn {args.ffn}, {args.layers} blocks, "
          f"{args.rows} rows, float32; {args.runs} alternating runs x {args.steps} steps")  # fmt: skip
    header = "| job | W | step s (median) | unsharded/W step s | ratio (median of runs) | runs | x W / serial |"
    print(header + " CPU s (all ranks) | CPU / serial CPU |")
    print("|---|---|---|---|---|---|---|---|---|")
    serial = [med(r["steps"]) for r in results[("unsharded", 1)]]
    serial_cpu = [med(r["cpu"]) for r in results[("unsharded", 1)]]
    for mesh, world in jobs:
        steps = [med(r["steps"]) for r in results[(mesh, world)]]
        base = [med(r["steps"]) for r in results[("unsharded", world)]]
        ratios = [s / b for s, b in zip(steps, base)]
        runs = ", ".join(f"{x:.2f}" for x in ratios)
        ratio = "1.00 (baseline)" if mesh == "unsharded" else f"{med(ratios):.3f}"
        work = med([s * world / b for s, b in zip(steps, serial)])
        cpu = [med(r["cpu"]) for r in results[(mesh, world)]]
        cpu_ratio = med([c / b for c, b in zip(cpu, serial_cpu)])
        print(f"| {mesh} | {world} | {med(steps):.3f} | {med(base):.3f} | {ratio} | {runs} | {work:.2f} | "
              f"{med(cpu):.2f} | {cpu_ratio:.2f} |")  # fmt: skip
    if args.compile:
        print()
        print(f"torch.compile(fullgraph=True, backend={args.compile}): first call and steady state vs eager")
        print("| job | W | compile s (first call) | compiled step s | eager step s | compiled / eager |")
        print("|---|---|---|---|---|---|")
        for mesh, world in jobs:
            rs = results[(mesh, world)]
            comp = med([med(r["compiled_steps"]) for r in rs])
            eager = med([med(r["steps"]) for r in rs])
            first = med([r["compile_s"] for r in rs])
            print(f"| {mesh} | {world} | {first:.1f} | {comp:.3f} | {eager:.3f} | {comp / eager:.3f} |")
    if args.profile:
        print()
        print("Profile of one step, rank 0 (seconds of self CPU time; share of the profiled step)")
        print("| job | W | profiled step s | " + " | ".join(BUCKETS) + " |")
        print("|---|---|---|" + "---|" * len(BUCKETS))
        for mesh, world in jobs:
            prof = results[(mesh, world)][-1]["profile"]
            total = prof["profiled_step_s"]
            cells = " | ".join(f"{prof[b]:.3f} ({100 * prof[b] / total:.0f}%)" for b in BUCKETS)
            print(f"| {mesh} | {world} | {total:.3f} | {cells} |")
    loads = [r["load"] for rs in results.values() for r in rs]
    print()
    print(f"load average: {start_load} at start; 1-min load after each job {min(loads)}..{max(loads)}; "
          f"{os.cpu_count()} CPUs")  # fmt: skip


if __name__ == "__main__":
    main()
