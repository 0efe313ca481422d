"""`loongforge train`, `info` and `doctor` as a user runs them."""

import json
import os
import subprocess
import sys

from conftest import run_cli

CORE = "loongforge.core.cli"


def _one_line_error(r, *needles):
    assert r.returncode == 2, (r.returncode, r.stderr[-3000:])
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), r.stderr[-3000:]
    for n in needles:
        assert n in lines[0], lines[0]


def test_info_lists_packages_components_recipes_configs_and_devices():
    r = run_cli(["info"], module=CORE)
    assert r.returncode == 0, r.stderr[-2000:]
    out = r.stdout
    for needle in (
        "loongforge-core 0.1.0",
        "loongforge-llm 0.1.0",
        "loongforge-kernels 0.1.0",
        "family: deepseek_v3, glm4_moe, llama, qwen2, qwen3, qwen3_moe",
        "recipe: diffusion.qwen_image, diffusion.wan, embodied.pi, llm.pretrain, llm.sft",
        "cpu: available",
        "device cpu:",
        "llm.pretrain: schema loongforge.llm.config.PretrainConfig; from loongforge-llm; default of llm configs",
        "llm.sft: schema loongforge.llm.config.SFTConfig; from loongforge-llm",
        "llm/tiny: ",
        "llm/sft: ",
        "embodied/pi_tiny: ",
        "diffusion/wan_tiny: ",
        "diffusion.wan: schema loongforge.diffusion.config.WanRunConfig; from loongforge-diffusion; default of diffusion configs",
    ):
        assert needle in out, out
    tiny = next(ln for ln in out.splitlines() if ln.strip().startswith("llm/tiny: "))
    assert tiny.endswith("configs/tiny.yaml"), tiny


def test_doctor_runs_a_step():
    r = run_cli(["doctor"], module=CORE)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "accelerator: cpu (gloo)" in r.stdout and " ok" in r.stdout


def test_help_shows_examples():
    r = run_cli(["train", "--help"])
    assert r.returncode == 0 and "loongforge-llm train tiny" in r.stdout
    for args in (["--help"], ["train", "--help"]):
        r = run_cli(args, module=CORE)
        assert r.returncode == 0, r.stderr
        for example in (
            "loongforge train tiny",
            "loongforge train sft checkpoint.load=runs/tiny/hf",
            "torchrun --nproc-per-node 2 -m loongforge.core.cli train tiny parallel.tensor_model_parallel_size=2",
        ):
            assert example in r.stdout, r.stdout
    r = run_cli(["info", "--bogus"], module=CORE)
    assert r.returncode == 2


def test_train_shipped_config_by_name(tmp_path):
    run = tmp_path / "run"
    r = run_cli(["train", "tiny", "train.train_iters=2", f"checkpoint.run_dir={run}", "checkpoint.export_hf=false"], module=CORE)
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"done: step 2, run dir {run}" in r.stdout
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows if "loss" in row][-1] == 2
    assert (run / "checkpoints" / "latest").is_file()


def test_train_unknown_recipe_and_config_are_one_line_errors():
    r = run_cli(["train", "tiny", "recipe=llm.pretrian"], module=CORE)
    _one_line_error(r, "unknown recipe 'llm.pretrian'", "did you mean 'llm.pretrain'")
    _one_line_error(run_cli(["train", "tiny", "recipe=sfft"], module=CORE), "unknown recipe 'sfft'", "did you mean 'sft'")
    _one_line_error(run_cli(["train", "tinny"], module=CORE), "unknown config 'tinny'", "did you mean 'tiny'")
    _one_line_error(run_cli(["train", "llm/tinny"], module=CORE), "config file not found: llm/tinny", "did you mean 'llm/tiny'")


QUIET = """
import logging, warnings
from loongforge.core.errors import cli_entry

@cli_entry
def main(argv):
    import megatron.core  # warns at import that Transformer Engine and Apex are not installed
    warnings.warn("the user's own warning")
    return 0

filters, level = list(warnings.filters), logging.getLogger("megatron").level
assert main([]) == 0
assert warnings.filters == filters and logging.getLogger("megatron").level == level, "cli_entry left the process changed"
warnings.warn("a warning after the CLI returned")
"""


def test_cli_entry_hides_megatron_notices_only_while_it_runs():
    env = {k: v for k, v in os.environ.items() if k != "PYTHONWARNINGS"}
    r = subprocess.run([sys.executable, "-c", QUIET], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "the user's own warning" in r.stderr and "a warning after the CLI returned" in r.stderr, r.stderr
    assert "not installed" not in r.stderr, r.stderr
