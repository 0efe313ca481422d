"""LoRA adapters start from the run seed and each linear's name, never from what the global
generator has produced before the model is built."""

import subprocess
import sys

from conftest import cli_env

CODE = """
import torch

from loongforge.core.accelerator import get_accelerator
from loongforge.core.foundation.families import LLAMA
from loongforge.core.foundation.lora import LoRAConfig
from loongforge.core.foundation.spec import ModelConfig, build_gpt_model
from loongforge.core.parallel import init_parallel

acc = get_accelerator("cpu")
ctx = init_parallel(1, 1, acc.backend, acc.device_type)
cfg = LLAMA.resolve(ModelConfig())
lora = LoRAConfig(rank=4, target_modules=["all-linear"])

def build(seed, draws):
    acc.manual_seed(seed)  # what the trainer does before building: the run seed
    torch.rand(draws)  # then something else uses the global generator (or not)
    model = build_gpt_model(cfg, ctx, lora=lora)
    sd = model.state_dict()
    return {k: v.clone() for k, v in sd.items() if k.endswith("lora_a")}, sd["decoder.layers.0.mlp.linear_fc1.weight"].clone()

a, base_a = build(7, 0)
b, base_b = build(7, 12345)
c, _ = build(8, 0)
assert len(a) == 4 * cfg.num_layers, sorted(a)
assert not torch.equal(base_a, base_b), "the global generator was not consumed differently"
assert all(torch.equal(a[k], b[k]) for k in a), "adapters depend on the global RNG state"
assert not any(torch.equal(a[k], c[k]) for k in a), "adapters ignore the run seed"
names = sorted(a)
assert not torch.equal(a[names[0]][:, :8], a[names[1]][:, :8]), "two linears got the same adapter"
print("ok")
"""


def test_lora_adapters_do_not_depend_on_the_global_rng_state():
    r = subprocess.run([sys.executable, "-c", CODE], env=cli_env(), capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stderr[-3000:]
