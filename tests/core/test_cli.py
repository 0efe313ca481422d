"""`loongforge info` and `loongforge doctor` as a user runs them."""

from conftest import run_cli


def test_info_lists_packages_components_and_devices():
    r = run_cli(["info"], module="loongforge.core.cli")
    assert r.returncode == 0, r.stderr[-2000:]
    out = r.stdout
    for needle in ("loongforge-core 0.1.0", "loongforge-llm 0.1.0", "loongforge-kernels 0.1.0", "family: llama, qwen2, qwen3",
                   "recipe: llm.pretrain", "cpu: available", "device cpu:"):
        assert needle in out, out


def test_doctor_runs_a_step():
    r = run_cli(["doctor"], module="loongforge.core.cli")
    assert r.returncode == 0, r.stderr[-2000:]
    assert "accelerator: cpu (gloo)" in r.stdout and " ok" in r.stdout


def test_help_shows_examples():
    r = run_cli(["train", "--help"])
    assert r.returncode == 0 and "loongforge-llm train tiny" in r.stdout
    r = run_cli(["info", "--bogus"], module="loongforge.core.cli")
    assert r.returncode == 2
