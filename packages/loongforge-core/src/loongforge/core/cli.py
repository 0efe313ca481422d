"""`loongforge`: train any installed recipe (`train`), what is installed (`info`), and whether
this machine can train (`doctor`)."""

from __future__ import annotations

import argparse
import sys
from importlib.metadata import PackageNotFoundError, distributions, version

from loongforge.core.errors import cli_entry

TRAIN_EXAMPLES = """examples:
  loongforge train tiny                                  # shipped demo config: tiny corpus + model, CPU ok
  loongforge train tiny train.train_iters=20 checkpoint.run_dir=runs/t
  loongforge train sft checkpoint.load=runs/tiny/hf      # shipped SFT demo (its YAML says recipe: llm.sft)
  loongforge train run.yaml recipe=llm.sft train.lr=3e-4  # your YAML; recipe= overrides its `recipe:` key
  loongforge train llm/tiny                              # PACKAGE/NAME, for a name shipped by two packages
  torchrun --nproc-per-node 2 -m loongforge.core.cli train tiny parallel.tensor_model_parallel_size=2
CONFIG is a YAML path or a shipped config (`loongforge info` lists them). The recipe is the
`recipe=` override, else the YAML's `recipe:` key, else the default recipe of the config's package."""

EXAMPLES = f"""{TRAIN_EXAMPLES}
  loongforge info            # packages, recipes, shipped configs, registered components, devices
  loongforge doctor          # checks imports and runs one tiny training step on this machine
  LOONGFORGE_DEVICE=cpu loongforge doctor
Errors you can fix print one line and exit 2; add --debug for the traceback."""


def _pkgs() -> list[tuple[str, str]]:
    names = sorted({d.metadata["Name"] for d in distributions() if (d.metadata["Name"] or "").startswith("loongforge-")})
    return [(n, version(n)) for n in names]


def info() -> int:
    import torch
    from loongforge.core.recipes import recipes, shipped_configs
    from loongforge.core.registry import registry

    reg = registry()
    print("packages:")
    for n, v in _pkgs():
        print(f"  {n} {v}")
    for dep in ("torch", "megatron-core", "transformers", "triton", "transformer-engine"):
        try:
            print(f"  ({dep} {version(dep)})")
        except PackageNotFoundError:
            print(f"  ({dep} not installed)")
    print("registered:")
    for kind in reg.kinds():
        print(f"  {kind}: {', '.join(reg.names(kind))}")
    print("recipes (loongforge train CONFIG recipe=NAME):")
    for r in recipes(reg):
        notes = [f"schema {r.schema.__module__}.{r.schema.__qualname__}", f"from {reg.origin('recipe', r.name)}"]
        notes += [f"default of {r.package} configs"] if r.default else []
        notes += [f"also {', '.join(r.aliases)}"] if r.aliases else []
        print(f"  {r.name}: {'; '.join(notes)}")
    print("shipped configs (loongforge train NAME, or PACKAGE/NAME):")
    for package, configs in shipped_configs(reg).items():
        for name, path in configs.items():
            print(f"  {package}/{name}: {path}")
    print("accelerators:")
    for name in reg.names("accelerator"):
        cls = reg.get("accelerator", name)
        print(f"  {name}: {'available' if cls.is_available() else 'not available'}")
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            print(f"  device cuda:{i} {torch.cuda.get_device_name(i)}")
    print(f"  device cpu: {torch.get_num_threads()} threads")
    return 0


def doctor() -> int:
    import torch
    from loongforge.core.accelerator import get_accelerator
    from loongforge.core.foundation.families import LLAMA
    from loongforge.core.foundation.spec import ModelConfig, build_gpt_model
    from loongforge.core.parallel import init_parallel

    acc = get_accelerator()
    print(f"accelerator: {acc.name} ({acc.backend})")
    ctx = init_parallel(1, 1, acc.backend, acc.device_type)
    acc.manual_seed(0)
    model = build_gpt_model(LLAMA.resolve(ModelConfig()), ctx).to(acc.device())
    x = torch.randint(0, 256, (2, 16), device=acc.device())
    with acc.autocast():
        loss = model(x, None, None, labels=x).float().mean()
    loss.backward()
    ok = bool(torch.isfinite(loss))
    print(f"tiny megatron-core forward/backward: loss {float(loss.detach()):.4f} {'ok' if ok else 'NOT FINITE'}")
    return 0 if ok else 1


def parser() -> argparse.ArgumentParser:
    fmt = argparse.RawDescriptionHelpFormatter
    p = argparse.ArgumentParser(
        prog="loongforge", description="LoongForge: train any installed recipe; inspect the install.", epilog=EXAMPLES, formatter_class=fmt
    )
    sub = p.add_subparsers(dest="cmd", required=True)
    t = sub.add_parser("train", help="train a recipe from a YAML or shipped config", epilog=TRAIN_EXAMPLES, formatter_class=fmt)
    t.add_argument("config", help="YAML file, or a shipped config name (tiny, sft, llm/tiny)")
    t.add_argument("overrides", nargs="*", help="key=value overrides, e.g. train.lr=3e-4 recipe=llm.sft")
    sub.add_parser("info", help="packages, recipes, shipped configs, components, devices", epilog=EXAMPLES, formatter_class=fmt)
    sub.add_parser("doctor", help="check imports and run one tiny training step", epilog=EXAMPLES, formatter_class=fmt)
    return p


@cli_entry
def main(argv: list[str]) -> int:
    args = parser().parse_args(argv)
    if args.cmd == "train":
        from loongforge.core.recipes import train

        return train(args.config, args.overrides)
    return info() if args.cmd == "info" else doctor()


if __name__ == "__main__":
    sys.exit(main())
