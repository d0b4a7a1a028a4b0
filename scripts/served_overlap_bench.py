"""What a served reward costs a training iteration (docs/rewards_served.md, "Measured"): the reference reward server
answering after a fixed latency, one request at a time or several in flight, scored after the rollout or beside it.

    .venv/bin/python scripts/served_overlap_bench.py --profile ci --set sample.batch_size=4 --served batch_size=2
    .venv/bin/python scripts/served_overlap_bench.py --profile toy --iterations 3
    .venv/bin/python scripts/served_overlap_bench.py --in-flight-sweep   # no training: the default's measurement

Each setting trains the same method and seed from a copy of one prepared project (its prompts and base model, made
here by `prepare` and `pretrain` the first time) against ``examples/plugins/served_reward_server.py --delay-s
LATENCY`` in its own process, and reports the medians over the iterations after the first of ``time/rollout``
(sampling; with overlap, the scoring sent while it samples), ``time/reward`` (the scoring left after it) and
``time/iteration``, and whether every setting's final weights equal the first's bit for bit. The settings take turns,
one iteration each (each resuming its own run), so a load that drifts on a shared machine falls on all of them.
Sampling is each setting's own ``time/rollout``, scoring alone the ``time/reward`` of the setting that scores after
sampling with as many requests in flight; the ratios compare sampling + scoring with max(sampling, scoring) and with
their sum. ``--in-flight-sweep`` times the served reward alone on batches of 128 and 384 images (requests of 16) with
1 to 32 requests in flight: what chose the default.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

SETTINGS = {  # name -> reward.options.served
    "in-flight 1, after sampling": {"max_in_flight": 1, "overlap": False},
    "default in-flight, after sampling": {"overlap": False},
    "in-flight 1, beside sampling": {"max_in_flight": 1, "overlap": True},
    "default in-flight, beside sampling": {},
}


def _value(text: str):
    import yaml

    return yaml.safe_load(text)


def prepared(profile: str, folder: Path) -> Path:
    """A project folder with ``profile``'s prompts and base model (made by the pipeline's own stages once)."""
    done = folder / ".prepared"
    if not done.exists():
        folder.mkdir(parents=True, exist_ok=True)
        shutil.copy(ROOT / "params.yaml", folder / "params.yaml")
        env = {**os.environ, "JAGG_ROOT": str(folder), "PYTHONPATH": str(ROOT)}
        for stage in ("tasks.prepare", "tasks.pretrain"):
            subprocess.run([sys.executable, "-m", stage, "--profile", profile], cwd=folder, env=env, check=True)
        done.touch()
    return folder


def serving(latency: float) -> tuple[subprocess.Popen, str]:
    server = ROOT / "examples" / "plugins" / "served_reward_server.py"
    proc = subprocess.Popen([sys.executable, str(server), "--port", "0", "--delay-s", str(latency)],
                            stdout=subprocess.PIPE, text=True)
    line = proc.stdout.readline()
    if not line.startswith("listening on "):
        proc.kill()
        raise SystemExit("the reference reward server did not start.")
    return proc, line.split()[-1]


def in_flight_sweep(url: str) -> None:
    import time

    import torch

    from jagg_core.rewards.served import served

    print("| requests in flight | 128 images (8 requests) | 384 images (24 requests) |\n|---|---|---|")
    images = torch.rand(384, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    for k in (1, 2, 4, 8, 16, 32):
        fn, cells = served(url=url, batch_size=16, max_in_flight=k), []
        for n in (128, 384):
            best = float("inf")
            for _ in range(2):
                t0 = time.perf_counter()
                fn(images[:n], ["p"] * n, [{}] * n)
                best = min(best, time.perf_counter() - t0)
            cells.append(f"{best:.2f} s")
        print(f"| {k} | {' | '.join(cells)} |", flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--profile", default="ci")
    ap.add_argument("--method", default="jagg")
    ap.add_argument("--iterations", type=int, default=3, help="iterations per setting (the first is not counted)")
    ap.add_argument("--latency", type=float, default=0.5, help="seconds the server waits before each answer")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="a params override")
    ap.add_argument("--served", action="append", default=[], metavar="OPTION=VALUE",
                    help="a reward.options.served option for every setting (e.g. batch_size=2)")
    ap.add_argument("--folder", type=Path, default=Path(tempfile.gettempdir()) / "jagg-served-bench",
                    help="where the prepared project is kept between runs")
    ap.add_argument("--in-flight-sweep", action="store_true", help="time the served reward alone, no training")
    args = ap.parse_args()
    if args.in_flight_sweep:
        proc, url = serving(args.latency)
        try:
            in_flight_sweep(url)
        finally:
            proc.terminate()
        return 0

    import torch

    from jagg_core.setup.params_io import load_params
    from jagg_core.trainer import train
    from jagg_core.trainer.checkpoint import load_tensors

    base = prepared(args.profile, args.folder / args.profile)
    overrides = {k: _value(v) for k, v in (s.split("=", 1) for s in args.set)}
    served_common = {k: _value(v) for k, v in (s.split("=", 1) for s in args.served)}
    proc, url = serving(args.latency)
    history: dict[str, list[dict[str, float]]] = {name: [] for name in SETTINGS}
    last: dict[str, Path] = {}
    try:
        with tempfile.TemporaryDirectory(dir=args.folder) as tmp:
            roots = {name: Path(tmp) / f"setting-{k}" for k, name in enumerate(SETTINGS)}
            for root in roots.values():
                shutil.copytree(base, root)
            # round-robin, one iteration of each setting at a time (each resumes its own run): a load that drifts
            # over minutes on a shared machine falls on every setting alike
            for n in range(1, args.iterations + 1):
                for name, served in SETTINGS.items():
                    params = load_params(base / "params.yaml", args.profile, {
                        **overrides, "train.iterations": n, "train.checkpoint_every": 1, "train.log_images_every": 0,
                        "reward.weights": {"served": 1.0},
                        "reward.options.served": {"url": url, **served_common, **served}})
                    result = train(params, args.method, 0, root=roots[name], progress=False)
                    history[name] += result.history
                    last[name] = Path(result.checkpoint)
            weights = {name: load_tensors(last[name] / "trainable.safetensors") for name in SETTINGS}
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    rows = []
    for name in SETTINGS:
        counted = history[name][1:] or history[name]

        def median(key: str) -> float:
            return statistics.median(h.get(key, 0.0) for h in counted)

        rows.append((name, median("time/rollout"), median("time/reward"), median("time/iteration")))
    first = next(iter(weights.values()))
    same = all(w.keys() == first.keys() and all(torch.equal(w[k], first[k]) for k in w) for w in weights.values())
    scoring = {name: r for name, _, r, _ in rows if "after" in name}  # the judge alone, after sampling
    print(f"profile {args.profile}, {args.method}, {args.iterations} iterations (medians of the last "
          f"{max(args.iterations - 1, 1)}), a {args.latency:g} s judge; overrides {args.set} {args.served}")
    print("| setting | sampling (s) | scoring left after it (s) | sampling + scoring (s) | iteration (s) | "
          "÷ max(sampling, scoring) | ÷ (sampling + scoring) |")
    print("|---|---|---|---|---|---|---|")
    for name, s, r, it in rows:
        # this setting's own sampling (noise on a shared machine moves it between settings) and the scoring alone
        # of the after-sampling setting with the same requests in flight (the judge's latency: steady)
        c = scoring["in-flight 1, after sampling" if "in-flight 1" in name else "default in-flight, after sampling"]
        print(f"| {name} | {s:.2f} | {r:.2f} | {s + r:.2f} | {it:.2f} | {(s + r) / max(s, c):.2f} | "
              f"{(s + r) / (s + c):.2f} |")
    print(f"final weights equal bit for bit across the settings: {same}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
