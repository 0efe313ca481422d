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
    t.add_argument("config", help="YAML file, or the name of a shipped config (pi_tiny)")
    t.add_argument("overrides", nargs="*", help="key=value overrides, e.g. train.lr=1e-4")
    return p


@cli_entry
def main(argv: list[str]) -> int:
    args = parser().parse_args([a for a in argv if a != "--debug"])
    if args.cmd == "train":
        from loongforge.core.recipes import train

        return train(args.config, args.overrides, prefer="embodied")
    return 2


if __name__ == "__main__":
    raise SystemExit(main())
