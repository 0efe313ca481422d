"""The registry and its recipes: import order, entry-point registration, config and recipe lookup,
and what the cpu accelerator changes in the process (nothing on torch)."""

import subprocess
import sys
from dataclasses import dataclass, field

import pytest
from conftest import cli_env
from loongforge.core.config import CheckpointConfig
from loongforge.core.errors import UserError
from loongforge.core.recipes import Recipe, find_config, find_recipe, lazy, resolve
from loongforge.core.registry import Registry, registry


def _fresh(code: str, timeout: int = 300) -> subprocess.CompletedProcess:
    r = subprocess.run([sys.executable, "-c", code], env=cli_env(), capture_output=True, text=True, timeout=timeout)
    assert r.returncode == 0, r.stderr[-3000:]
    return r


@pytest.mark.parametrize(
    "module", ["loongforge.core.registry", "loongforge.core.accelerator", "loongforge.core.plugin", "loongforge.core.recipes"]
)
def test_each_module_imports_first_in_a_fresh_interpreter(module):
    _fresh(f"import {module}")


def test_plugins_register_through_entry_points_without_megatron_or_transformers():
    r = _fresh(
        "import sys\n"
        "from loongforge.core.registry import registry\n"
        "reg = registry()\n"
        "print(reg.origin('accelerator', 'cpu'), reg.origin('family', 'llama'), reg.origin('recipe', 'llm.sft'))\n"
        "print(sorted(m for m in ('megatron', 'transformers') if m in sys.modules))\n"
    )
    assert r.stdout.split("\n")[:2] == ["loongforge-core loongforge-core loongforge-llm", "[]"], r.stdout


def test_llm_recipes_are_registered():
    from loongforge.llm.config import CONFIG_DIR, PretrainConfig, SFTConfig

    reg = registry()
    pre, sft = reg.get("recipe", "llm.pretrain"), reg.get("recipe", "llm.sft")
    assert (pre.schema, sft.schema) == (PretrainConfig, SFTConfig)
    assert pre.configs_dir == sft.configs_dir == CONFIG_DIR and pre.default and not sft.default
    assert pre.run.__name__ == "loongforge.llm.pretrain:run" and sft.run.__name__ == "loongforge.llm.sft.recipe:run"


def test_shipped_configs_name_their_recipe(tmp_path):
    shipped = {"tiny": "llm.pretrain", "llm/tiny": "llm.pretrain", "sft": "llm.sft", "lora": "llm.sft", "midtrain": "llm.pretrain"}
    for name, recipe in shipped.items():
        r, cfg = resolve(name)
        assert r.name == cfg.recipe == recipe, name
    old = tmp_path / "old.yaml"  # an older user YAML: short recipe name, shipped defaults
    old.write_text("recipe: sft\ndefaults: [sft.yaml]\ntrain: {lr: 1.0e-4}\n")
    r, cfg = resolve(str(old))
    assert r.name == cfg.recipe == "llm.sft" and cfg.train.lr == 1e-4
    bare = tmp_path / "bare.yaml"
    bare.write_text("defaults: [tiny.yaml]\n")
    assert resolve(str(bare))[0].name == "llm.pretrain"
    assert resolve(str(bare), ["recipe=pretrain"], prefer="llm")[1].recipe == "llm.pretrain"
    with pytest.raises(UserError, match="unknown config key 'data.corpus'"):
        resolve("tiny", ["recipe=llm.sft"])  # the recipe's schema validates the YAML


@dataclass
class _Run:
    recipe: str = ""
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    steps: int = 1


def _two_packages(tmp_path) -> Registry:
    reg = Registry()
    for pkg in ("aaa", "bbb"):
        d = tmp_path / pkg
        d.mkdir()
        (d / "demo.yaml").write_text("steps: 2\n")
        (d / f"only_{pkg}.yaml").write_text(f"recipe: {pkg}.train\n")
        recipe = Recipe(f"{pkg}.train", _Run, lambda cfg: {"step": cfg.steps}, d, aliases=("train",), default=True)
        reg.add("recipe", recipe.name, recipe)
    return reg


def test_lookup_across_packages(tmp_path):
    reg = _two_packages(tmp_path)
    with pytest.raises(UserError, match="shipped by several packages: name one of aaa/demo, bbb/demo"):
        find_config("demo", reg)
    assert find_config("bbb/demo", reg) == (tmp_path / "bbb" / "demo.yaml", "bbb")
    assert find_config("demo", reg, prefer="aaa") == (tmp_path / "aaa" / "demo.yaml", "aaa")
    assert find_config("only_bbb", reg)[1] == "bbb"
    assert find_recipe("train", "aaa", reg).name == "aaa.train"  # short names map within the config's package
    with pytest.raises(UserError, match="recipe 'train' is ambiguous: write one of aaa.train, bbb.train"):
        find_recipe("train", None, reg)
    with pytest.raises(UserError, match="names no recipe"):
        find_recipe(None, None, reg)
    with pytest.raises(UserError, match="unknown recipe 'aaa.trian'; did you mean 'aaa.train'"):
        find_recipe("aaa.trian", None, reg)
    r, cfg = resolve("bbb/demo", reg=reg)
    assert r.name == cfg.recipe == "bbb.train" and r.run(cfg) == {"step": 2}


def test_recipe_contract():
    with pytest.raises(ValueError, match="<package>.<name>"):
        Recipe("nodot", _Run, print)

    @dataclass
    class NoRecipeField:
        steps: int = 1

    with pytest.raises(ValueError, match="`recipe` and `checkpoint`"):
        Recipe("x.y", NoRecipeField, print)
    assert lazy("os.path:join")("a", "b") == "a/b"
    with pytest.raises(ValueError):
        lazy("os.path.join")


CPU_SETUP = """
import tempfile
from pathlib import Path

import torch
import torch.cuda

current_device, synchronize = torch.cuda.current_device, torch.cuda.synchronize
from megatron.core.dist_checkpointing.strategies import filesystem_async, state_dict_saver
from megatron.core.tensor_parallel import random as mrandom

rng_fns = (mrandom._get_cuda_rng_state, mrandom._set_cuda_rng_state)
from loongforge.core.registry import registry
registry()
import loongforge.core.accelerator as A

def torch_untouched():
    return torch.cuda.current_device is current_device and torch.cuda.synchronize is synchronize

def torch_behaviour():
    try:
        return type(torch.cuda.current_device())
    except (AssertionError, RuntimeError):
        return "raises"

before = torch_behaviour()
assert torch_untouched() and state_dict_saver.torch is torch and filesystem_async.torch is torch
acc = A.get_accelerator("cpu")
acc.manual_seed(0)
assert state_dict_saver.torch is torch, "megatron adapted before a run lays out its parallel state"

from loongforge.core.checkpoint import load_megatron, save_megatron
from loongforge.core.foundation.families import LLAMA
from loongforge.core.foundation.spec import ModelConfig, build_gpt_model
from loongforge.core.parallel import init_parallel

ctx = init_parallel(1, 1, acc.backend, acc.device_type)
assert torch_untouched(), "torch.cuda patched by prepare_megatron"
assert torch_behaviour() == before == (int if torch.cuda.is_available() else "raises"), (before, torch_behaviour())
assert state_dict_saver.torch.cuda.current_device() == torch.device("cpu") and filesystem_async.torch.cuda.synchronize() is None
assert state_dict_saver.torch.tensor is torch.tensor and state_dict_saver.torch.cuda.is_available is torch.cuda.is_available
acc.manual_seed(0)
model = build_gpt_model(LLAMA.resolve(ModelConfig()), ctx)
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
x = torch.randint(0, 256, (2, 16))
model(x, None, None, labels=x).float().mean().backward()
opt.step()
saved = {k: v.clone() for k, v in model.state_dict().items() if torch.is_tensor(v)}
d = Path(tempfile.mkdtemp()) / "ckpt"
d.mkdir()
save_megatron(d, model, opt)
with torch.no_grad():
    for p in model.parameters():
        p.add_(1.0)
load_megatron(d, model, opt, optimizer_steps=1)
assert all(torch.equal(model.state_dict()[k], v) for k, v in saved.items()), "round trip changed the weights"
assert torch_untouched()
A.release_accelerator()
assert state_dict_saver.torch is torch and filesystem_async.torch is torch
assert (mrandom._get_cuda_rng_state, mrandom._set_cuda_rng_state) == rng_fns
print("ok")
"""


def test_cpu_accelerator_leaves_torch_alone_and_checkpoints_round_trip():
    assert _fresh(CPU_SETUP).stdout.strip().endswith("ok")


def test_torch_stack_does_not_import_megatron():
    """The accelerator, its seeding and the torch stack's process group leave megatron-core
    unimported (its import takes seconds on every start of a torch-stack run)."""
    script = """
import sys

from loongforge.core.accelerator import get_accelerator
from loongforge.core.config.schema import ParallelConfig, TrainConfig
from loongforge.core.stacks.build import build_stack

acc = get_accelerator("cpu")
acc.manual_seed(0)
stack, ctx = build_stack(ParallelConfig(stack="torch"), TrainConfig(), acc, acc.train_dtype())
acc.manual_seed(1)
assert ctx is None
assert not [m for m in sys.modules if m.startswith("megatron")], sorted(m for m in sys.modules if m.startswith("megatron"))[:5]
print("ok")
"""
    assert _fresh(script).stdout.strip().endswith("ok")
