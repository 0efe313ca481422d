"""`loongforge`: what is installed (`info`) and whether this machine can train (`doctor`)."""

from __future__ import annotations

import argparse
import sys
from importlib.metadata import PackageNotFoundError, distributions, version

from loongforge.core.errors import cli_entry

EXAMPLES = """examples:
  loongforge info            # packages, registered components, accelerators, devices
  loongforge doctor          # checks imports and runs one tiny training step on this machine
  LOONGFORGE_DEVICE=cpu loongforge doctor"""


def _pkgs() -> list[tuple[str, str]]:
    names = sorted({d.metadata["Name"] for d in distributions() if (d.metadata["Name"] or "").startswith("loongforge-")})
    return [(n, version(n)) for n in names]


def info() -> int:
    import torch

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
    print(f"tiny megatron-core forward/backward: loss {float(loss):.4f} {'ok' if ok else 'NOT FINITE'}")
    return 0 if ok else 1


@cli_entry
def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="loongforge", description="LoongForge core tools.", epilog=EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("cmd", choices=["info", "doctor"])
    args = p.parse_args(argv)
    return info() if args.cmd == "info" else doctor()


if __name__ == "__main__":
    sys.exit(main())
