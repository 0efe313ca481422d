"""Each user error: one line on stderr naming what is wrong, exit code 2, nothing overwritten."""

import hashlib
from pathlib import Path

import pytest
from conftest import FAST, run_cli

pytestmark = pytest.mark.slow


def _one_line_error(r, *needles):
    assert r.returncode == 2, (r.returncode, r.stderr[-3000:])
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, r.stderr[-3000:]
    assert lines[0].startswith("error: ")
    for n in needles:
        assert n in lines[0], lines[0]
    return lines[0]


def _tree_digest(root: Path) -> dict:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.mark.parametrize(
    "override,needles",
    [
        ("train.lrr=1e-3", ["unknown config key 'train.lrr'", "did you mean 'train.lr'"]),
        ("trian.lr=1e-3", ["unknown config key 'trian'", "did you mean 'train'"]),
        ("train.micro_batch_size=two", ["train.micro_batch_size", "Integer"]),
        ("data.data_path=[/nonexistent/corpus]", ["dataset file not found: /nonexistent/corpus.bin"]),
        ("data.tokenizer=/nonexistent/tok", ["tokenizer not found: /nonexistent/tok"]),
        ("model.family=gpt9", ["unknown family 'gpt9'"]),
        ("model.vocab_size=256", ["tokenizer has", "model.vocab_size is 256"]),
        ("checkpoint.load=/nonexistent/model", ["checkpoint.load=/nonexistent/model"]),
        ("train.global_batch_size=3", ["global_batch_size=3"]),
    ],
)
def test_train_bad_input(override, needles, tmp_path):
    r = run_cli(["train", "tiny", *FAST, "train.train_iters=2", f"checkpoint.run_dir={tmp_path / 'run'}", override])
    _one_line_error(r, *needles)
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_missing_config_file(tmp_path):
    _one_line_error(run_cli(["train", str(tmp_path / "missing.yaml")]), "config file not found")


def test_unknown_hf_model_type(tmp_path):
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text('{"model_type": "mamba9"}')
    (tmp_path / "m" / "model.safetensors").write_bytes(b"")
    _one_line_error(run_cli(["convert", "hf-to-lf", str(tmp_path / "m"), str(tmp_path / "out")]), "unknown model_type 'mamba9'")


@pytest.fixture(scope="module")
def finished_run(hf_llama4, tmp_path_factory):
    d = tmp_path_factory.mktemp("finished")
    r = run_cli(["train", "tiny", *FAST, "train.train_iters=2", f"checkpoint.load={hf_llama4}", f"checkpoint.run_dir={d}"])
    assert r.returncode == 0, r.stderr[-3000:]
    return d


def test_run_dir_of_another_run_is_refused_and_untouched(finished_run):
    before = _tree_digest(finished_run / "checkpoints")
    r = run_cli(["train", "tiny", *FAST, "train.train_iters=2", "train.lr=1e-2", f"checkpoint.run_dir={finished_run}"])
    _one_line_error(r, "holds checkpoints of another run", "checkpoint.resume=true", "checkpoint.overwrite=true")
    assert _tree_digest(finished_run / "checkpoints") == before


def test_overwrite_moves_the_old_checkpoints_aside(finished_run, tmp_path):
    import shutil

    d = tmp_path / "run"
    shutil.copytree(finished_run, d)
    before = _tree_digest(d / "checkpoints")
    r = run_cli(["train", "tiny", *FAST, "train.train_iters=2", "train.lr=1e-2", "checkpoint.overwrite=true", f"checkpoint.run_dir={d}"])
    assert r.returncode == 0, r.stderr[-3000:]
    (old,) = list(d.glob("checkpoints.old-*"))
    assert _tree_digest(old) == before
    assert (d / "checkpoints" / "latest").read_text() == "step_00000002"


def test_resume_true_continues_from_another_runs_checkpoints(finished_run, hf_llama4, tmp_path):
    import shutil

    d = tmp_path / "run"
    shutil.copytree(finished_run, d)
    args = ["train", "tiny", *FAST, "train.train_iters=3", "train.lr=1e-2", "checkpoint.resume=true", f"checkpoint.run_dir={d}"]
    # another model shape cannot continue from these weights
    _one_line_error(run_cli(args), "cannot resume from", "model.num_layers is 4, the config asks for 2")
    r = run_cli(args + [f"checkpoint.load={hf_llama4}"])
    assert r.returncode == 0, r.stderr[-3000:]
    assert "resumed from" in r.stdout and "at step 2" in r.stdout
    assert (d / "checkpoints" / "latest").read_text() == "step_00000003"


def test_corrupt_checkpoint_on_convert_and_load(finished_run, tmp_path):
    import shutil

    d = tmp_path / "run"
    shutil.copytree(finished_run, d)
    step = d / "checkpoints" / "step_00000002"
    (step / "common.pt").write_bytes(b"garbage")
    _one_line_error(run_cli(["convert", "lf-to-hf", str(d), str(tmp_path / "hf")]), "checkpoint file corrupt", "common.pt")
    assert not (tmp_path / "hf").exists()
    (step / "manifest.json").write_text("{not json")
    _one_line_error(run_cli(["generate", str(d), "--prompt", "hi"]), "corrupt manifest")


@pytest.mark.parametrize("direction", ["lf-to-hf", "hf-to-lf"])
def test_convert_refuses_a_non_empty_output(direction, finished_run, hf_llama4, tmp_path):
    out = tmp_path / "out"
    (out / "tokenizer").mkdir(parents=True)
    (out / "tokenizer" / "tokenizer.json").write_text("mine")
    src = finished_run if direction == "lf-to-hf" else hf_llama4
    _one_line_error(run_cli(["convert", direction, str(src), str(out)]), "not empty")
    assert (out / "tokenizer" / "tokenizer.json").read_text() == "mine" and sorted(p.name for p in out.rglob("*")) == [
        "tokenizer",
        "tokenizer.json",
    ]


def test_preprocess_bad_inputs(tmp_path):
    _one_line_error(
        run_cli(["preprocess", "--input", str(tmp_path / "none.jsonl"), "--tokenizer", "tiny", "--output-prefix", str(tmp_path / "o")]),
        "data input not found",
    )
    f = tmp_path / "d.jsonl"
    f.write_text('{"content": "hello"}\n')
    _one_line_error(
        run_cli(["preprocess", "--input", str(f), "--tokenizer", "tiny", "--output-prefix", str(tmp_path / "o")]),
        "no 'text' column",
        "content",
    )
    (tmp_path / "o.bin").write_bytes(b"mine")
    _one_line_error(
        run_cli(["preprocess", "--input", str(f), "--tokenizer", "tiny", "--text-key", "content", "--output-prefix", str(tmp_path / "o")]),
        "o.bin exists",
    )
    assert (tmp_path / "o.bin").read_bytes() == b"mine"
