"""`loongforge-embodied`: train pi0 / pi0.5 policies on LeRobot datasets."""

from __future__ import annotations

import argparse

from loongforge.core.errors import cli_entry

EXAMPLES = """examples:
  loongforge-embodied train pi_tiny                               # demo: a generated LeRobot v3 set, a tiny pi0.5, CPU ok
  loongforge-embodied train pi_tiny train.train_iters=20 checkpoint.run_dir=runs/pi
  loongforge-embodied train pi_tiny policy.variant=pi0 'data.normalization={observation.state: MEAN_STD, action: MEAN_STD}'
  loongforge-embodied train run.yaml 'data.datasets=[{root: /data/aloha_sim_insertion_human}]' parallel.data_parallel_mode=fsdp
  torchrun --nproc-per-node 2 -m loongforge.embodied.cli train run.yaml
  loongforge-embodied serve runs/tiny-pi --port 8000              # openpi websocket clients connect here
  loongforge-embodied serve runs/pi05 --device cuda               # each chunk one CUDA graph replay (--eager: not)
  loongforge-embodied eval runs/tiny-pi --episodes 6 7            # action MSE of sampled chunks
  loongforge-embodied convert runs/tiny-pi export/tiny-pi          # LeRobot's model.safetensors (+ config.json)
  loongforge-embodied train run.yaml checkpoint.load=/models/pi05_base    # LeRobot weights in
Errors you can fix print one line and exit 2; add --debug for the traceback."""


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="loongforge-embodied",
        description="Vision-language-action policies with LoongForge.",
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = p.add_subparsers(dest="cmd", required=True)
    t = sub.add_parser("train", help="train from a YAML config", epilog=EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter)
    t.add_argument("config", help="YAML file, or the name of a shipped config (pi_tiny, pi05, pi0)")
    t.add_argument("overrides", nargs="*", help="key=value overrides, e.g. train.lr=1e-4")
    s = sub.add_parser(
        "serve",
        help="serve a trained policy over openpi's websocket protocol",
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    s.add_argument("run_dir", help="a run directory of `train` (its newest checkpoint is served)")
    s.add_argument("--host", default="0.0.0.0")
    s.add_argument("--port", type=int, default=8000)
    s.add_argument("--device", default="cpu", help="cpu or cuda")
    s.add_argument("--seed", type=int, default=0, help="noise seed of every request (the same observation gives the same actions)")
    s.add_argument("--eager", action="store_true", help="on cuda: launch each kernel instead of replaying one CUDA graph per chunk")
    e = sub.add_parser(
        "eval",
        help="action MSE of sampled chunks on held-out episodes",
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    e.add_argument("run_dir")
    e.add_argument("--dataset", default=None, help="LeRobot dataset directory (default: the run's first dataset)")
    e.add_argument("--episodes", type=int, nargs="+", required=True, help="episode indices (in episode order) to evaluate")
    e.add_argument("--every", type=int, default=1, help="evaluate every N-th frame")
    e.add_argument("--device", default="cpu")
    e.add_argument("--eager", action="store_true", help="on cuda: launch each kernel instead of replaying one CUDA graph per chunk")
    c = sub.add_parser(
        "convert",
        help="a trained run's policy as a LeRobot pi0 / pi0.5 directory",
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    c.add_argument("run_dir", help="a run directory of `train` (its newest checkpoint is converted)")
    c.add_argument("out", help="a new (or empty) directory")
    for sp in (s, e, c):
        sp.add_argument(
            "--weights",
            choices=["auto", "ema", "trained"],
            default="auto",
            help="auto: the EMA where the run kept one (train.ema_decay), else the trained weights",
        )
    return p


@cli_entry
def main(argv: list[str]) -> int:
    args = parser().parse_args([a for a in argv if a != "--debug"])
    if args.cmd == "train":
        from loongforge.core.recipes import train

        return train(args.config, args.overrides, prefer="embodied")
    ema = {"auto": None, "ema": True, "trained": False}[args.weights]
    if args.cmd == "convert":
        from pathlib import Path

        from loongforge.embodied.convert import export_lerobot

        out, with_config = export_lerobot(Path(args.run_dir), Path(args.out), ema)
        print(f"wrote {out / 'model.safetensors'}")
        if not with_config:
            print("no config.json: LeRobot's pi0 / pi0.5 configs name only the published shapes (gemma_2b / gemma_300m, SigLIP so400m/14)")
        return 0
    from loongforge.embodied.serving import PolicyRunner

    if args.cmd == "serve":
        from loongforge.embodied.serving import serve

        serve(PolicyRunner.from_run_dir(args.run_dir, args.device, args.seed, ema, cuda_graphs=not args.eager), args.host, args.port)
        return 0
    import json
    from pathlib import Path

    from loongforge.core.errors import UserError
    from loongforge.embodied.data import LeRobotDataset
    from loongforge.embodied.serving import evaluate

    if args.every < 1:
        raise UserError(f"--every={args.every} must be at least 1")
    runner = PolicyRunner.from_run_dir(args.run_dir, args.device, ema=ema, cuda_graphs=not args.eager)
    root = args.dataset or next(iter(json.loads((Path(args.run_dir) / "normalizer.json").read_text())))
    ds = LeRobotDataset(root)
    bad = [e for e in args.episodes if not 0 <= e < ds.num_episodes]
    if bad:
        raise UserError(f"--episodes: {bad[0]} is not an episode of {root} (it has {ds.num_episodes})")
    print(json.dumps(evaluate(runner, ds, args.episodes, args.every)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
