"""Each user error: one line on stderr naming what is wrong, exit code 2, nothing overwritten."""

import errno
import hashlib
import json
import os
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
        ("parallel.context_parallel_size=2", ["parallel.context_parallel_size=2: this recipe has no context parallelism"]),
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


# Sizes, intervals and rates: checked when the config is loaded, before anything is built.
BAD_TRAIN_VALUES = [
    ("train.micro_batch_size=0", "train.micro_batch_size=0 must be at least 1"),
    ("train.global_batch_size=-4", "train.global_batch_size=-4 must be at least 1"),
    ("train.train_iters=0", "train.train_iters=0 must be at least 1"),
    ("train.save_interval=-1", "train.save_interval=-1 must be at least 0"),
    ("train.log_interval=0", "train.log_interval=0 must be at least 1"),
    ("train.eval_interval=-5", "train.eval_interval=-5 must be at least 0"),
    ("train.eval_iters=0", "train.eval_iters=0 must be at least 1 when train.eval_interval=50"),
    ("checkpoint.keep_last=-1", "checkpoint.keep_last=-1 must be at least 0"),
    ("train.max_bad_steps=0", "train.max_bad_steps=0 must be at least 1"),
    ("train.lr=-1e-3", "train.lr=-0.001 must be at least 0"),
    ("train.clip_grad=-1", "train.clip_grad=-1.0 must be at least 0"),
]


@pytest.mark.parametrize("override,message", BAD_TRAIN_VALUES)
def test_config_value_out_of_range_is_refused_when_loaded(override, message):
    from loongforge.core.errors import UserError
    from loongforge.core.recipes import resolve

    with pytest.raises(UserError) as e:
        resolve("tiny", [override], prefer="llm")
    assert str(e.value).startswith(message), str(e.value)


def test_config_values_at_their_limits_are_accepted():
    from loongforge.core.recipes import resolve

    limits = ["train.save_interval=0", "train.eval_interval=0", "train.eval_iters=0", "checkpoint.keep_last=0", "train.clip_grad=0"]
    _, cfg = resolve("tiny", [*limits, "train.lr=0", "train.train_iters=1", "train.log_interval=1", "train.max_bad_steps=1"], prefer="llm")
    assert cfg.train.train_iters == 1 and cfg.train.eval_iters == 0 and cfg.train.lr == 0


@pytest.mark.parametrize("override,message", [BAD_TRAIN_VALUES[2], BAD_TRAIN_VALUES[6]])
def test_config_value_out_of_range_on_the_cli(override, message, tmp_path):
    args = ["train", "tiny", "train.eval_interval=50", f"checkpoint.run_dir={tmp_path / 'run'}", override]
    _one_line_error(run_cli(args), message)
    assert not (tmp_path / "run").exists()


def test_empty_and_textless_corpus_files(tmp_path):
    """The CLI: one line, exit 2, no checkpoint; the other cases through the same data step in process."""
    import re

    from loongforge.core.data.text import load_tokenizer
    from loongforge.core.errors import UserError
    from loongforge.core.recipes import resolve
    from loongforge.llm.pretrain import ensure_data

    cases = [
        ("empty.jsonl", "", "data file is empty: {}"),
        ("empty.txt", "", "data file is empty: {}"),
        ("blank.txt", "\n  \n\n", "data file is empty: {}"),
        ("notext.jsonl", '{"text": ""}\n{"text": "  "}\n{"text": null}\n', "no usable text in {}"),
        ("missing.jsonl", None, "{}"),  # named with what is wrong: not found / not a file
    ]
    for name, content, _ in cases:
        if content is not None:
            (tmp_path / name).write_text(content)
    name, _, needle = cases[0]
    run = tmp_path / "run_cli"
    _one_line_error(
        run_cli(["train", "tiny", *FAST, "train.train_iters=2", f"checkpoint.run_dir={run}", f"data.corpus=[{tmp_path / name}]"]),
        needle.format(tmp_path / name),
    )
    assert not (run / "checkpoints").exists()
    tok = load_tokenizer("tiny")
    for name, _, needle in cases[1:]:
        f, run = tmp_path / name, tmp_path / f"run_{name}"
        _, cfg = resolve("tiny", [f"data.corpus=[{f}]"], prefer="llm")
        with pytest.raises(UserError, match=re.escape(needle.format(f))):
            ensure_data(cfg, tok, run)
        assert not list(run.rglob("*.idx")), name


def test_preprocess_skips_null_rows_and_refuses_textless_data(tmp_path):
    import json

    from loongforge.core.data.text import load_tokenizer
    from loongforge.core.errors import UserError
    from loongforge.llm.data import preprocess

    tok = load_tokenizer("tiny")
    f = tmp_path / "d.jsonl"
    f.write_text('{"text": null}\n{"text": "Ada gave the kite to Ben."}\n')
    info = preprocess([str(f)], tok, str(tmp_path / "o"))
    assert info["documents"] == 1 and info["tokens"] == len(tok("Ada gave the kite to Ben.", add_special_tokens=False)["input_ids"]) + 1
    d = tmp_path / "dir"
    d.mkdir()
    (d / "a.jsonl").write_text(json.dumps({"text": "hello"}) + "\n")
    (d / "b.jsonl").write_text("")
    with pytest.raises(UserError, match=f"data file is empty: {d / 'b.jsonl'}"):
        preprocess([str(d)], tok, str(tmp_path / "o2"))
    (d / "b.jsonl").unlink()
    (d / "c.jsonl").write_text(json.dumps({"text": 5}) + "\n")
    with pytest.raises(UserError):  # an int column is no text; a.jsonl alone would be fine
        preprocess([str(d / "c.jsonl")], tok, str(tmp_path / "o3"))
    assert not list(tmp_path.glob("o2*")) and not list(tmp_path.glob("o3*"))


@pytest.mark.parametrize(
    "extra,needle",
    [
        (["--prompt", ""], "--prompt is empty"),
        (["--prompt", "hi", "--max-new-tokens", "0"], "--max-new-tokens=0 must be at least 1"),
        (["--prompt", "hi", "--max-new-tokens", "-3"], "--max-new-tokens=-3 must be at least 1"),
    ],
)
def test_generate_bad_arguments(extra, needle, tmp_path):
    # checked before the model (here: no model at all) is looked at
    _one_line_error(run_cli(["generate", str(tmp_path / "no-such-run"), *extra]), needle)


# File-system errors a user can fix: one line naming the path, exit 2, `--debug` re-raises.
@pytest.mark.parametrize(
    "err,command,needles",
    [
        (
            OSError(errno.ENOSPC, "No space left on device", "/some/path"),
            "train",
            ["no space left on device writing /some/path", "checkpoint.run_dir", "saved checkpoints are untouched"],
        ),
        (OSError(errno.ENOSPC, "No space left on device"), "convert", ["no space left on device (free space or use another directory)"]),
        (OSError(errno.EROFS, "Read-only file system", "/ro/x"), "train", ["/ro/x is on a read-only file system", "checkpoint.run_dir"]),
        (PermissionError(errno.EACCES, "Permission denied", "/x"), "train", ["permission denied: /x", "permissions"]),
        (PermissionError(errno.EPERM, "Operation not permitted", "/a", None, "/b"), "convert", ["permission denied: /a -> /b"]),
    ],
)
def test_os_error_message(err, command, needles):
    from loongforge.core.errors import os_error_message

    message = os_error_message(err, command)
    assert message is not None and "\n" not in message
    for n in needles:
        assert n in message, message


def test_os_error_message_leaves_other_errors_alone():
    from loongforge.core.errors import os_error_message

    assert os_error_message(OSError(errno.EIO, "Input/output error", "/x"), "train") is None
    assert os_error_message(FileNotFoundError(errno.ENOENT, "No such file or directory", "/x"), "train") is None


def _raising(err):
    def train(*args, **kwargs):
        raise err

    return train


@pytest.mark.parametrize(
    "err,needle",
    [
        (PermissionError(errno.EACCES, "Permission denied", "/x/run/checkpoints"), "error: permission denied: /x/run/checkpoints ("),
        (OSError(errno.ENOSPC, "No space left on device", "/x/run/checkpoints/.tmp-step_00000002/common.pt"), "writing /x/run/checkpoints"),
        (OSError(errno.EROFS, "Read-only file system", "/x/run"), "error: /x/run is on a read-only file system"),
    ],
)
def test_cli_reports_os_errors_in_one_line(err, needle, monkeypatch, capsys):
    import loongforge.core.recipes
    from loongforge.llm.cli import main

    monkeypatch.setattr(loongforge.core.recipes, "train", _raising(err))
    assert main(["train", "tiny", "checkpoint.run_dir=/x/run"]) == 2
    lines = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and needle in lines[0], lines
    monkeypatch.setattr(loongforge.core.recipes, "train", _raising(err))
    with pytest.raises(OSError):  # --debug: the traceback
        main(["train", "tiny", "--debug"])


def test_cli_keeps_the_traceback_of_other_os_errors(monkeypatch):
    import loongforge.core.recipes
    from loongforge.llm.cli import main

    monkeypatch.setattr(loongforge.core.recipes, "train", _raising(OSError(errno.EIO, "Input/output error", "/x")))
    with pytest.raises(OSError, match="Input/output error"):
        main(["train", "tiny"])


def test_disk_full_on_preprocess(tmp_path):
    # /dev/full answers every write with ENOSPC, for root too: the output's temporary file points there
    if not Path("/dev/full").exists():
        pytest.skip("no /dev/full")
    f = tmp_path / "d.jsonl"
    f.write_text('{"text": "Ada gave the kite to Ben."}\n' * 2000)
    (tmp_path / "o.bin.tmp").symlink_to("/dev/full")
    r = run_cli(["preprocess", "--input", str(f), "--tokenizer", "tiny", "--output-prefix", str(tmp_path / "o")])
    assert r.returncode == 2, r.stderr[-3000:]
    errors = [ln for ln in r.stderr.splitlines() if ln.startswith("error:") or "Traceback" in ln]  # besides the progress bars
    assert errors == [f"error: no space left on device writing {tmp_path} (free space there or use another directory)"]
    assert r.stderr.rstrip().endswith(errors[0]) and not (tmp_path / "o.bin").exists() and not (tmp_path / "o.bin.tmp").exists()


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only directories")
def test_read_only_run_dir(tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o555)
    try:
        r = run_cli(["train", "tiny", *FAST, "train.train_iters=2", f"checkpoint.run_dir={ro / 'run'}"])
    finally:
        ro.chmod(0o755)
    line = _one_line_error(r, str(ro))
    assert "permission denied" in line and "Traceback" not in r.stderr


def test_sft_dry_run_shows_trained_spans_and_bad_rows(tmp_path):
    rows = tmp_path / "rows.jsonl"
    rows.write_text(
        json.dumps({"messages": [{"role": "user", "content": "Who has the kite?"}, {"role": "assistant", "content": "Ben has it."}]})
        + "\n"
        + json.dumps(
            {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hi."}, {"role": "user", "content": "Who?"}]}
        )
        + "\n"
    )
    args = ["preprocess", "--sft", "--input", str(rows), "--format", "openai", "--tokenizer", "tiny", "--template", "qwen2"]
    r = run_cli([*args, "--dry-run", "5"])
    assert r.returncode == 0, r.stderr[-3000:]
    assert "[[Ben has it.<|im_end|>\n]]" in r.stdout
    assert "row 1: bad row, skipped in training (no_final_assistant" in r.stdout
    assert not list(tmp_path.glob("*/"))  # nothing written
    _one_line_error(run_cli([*args, "--dry-run", "-1"]), "--dry-run=-1")
    _one_line_error(run_cli([*args, "--dry-run", "1", "--template-kwargs", "[1]"]), "--template-kwargs is not a JSON object")
    _one_line_error(run_cli([*args[:-1], "qwen3_thinking", "--dry-run", "1"]), "unknown chat template 'qwen3_thinking'; built-in: llama3")


def test_cli_called_in_process_keeps_the_callers_process_group(monkeypatch):
    """`main()` tears down only the process group and accelerator it set up itself: a program
    (or test) that calls it in process with its own group keeps that group."""
    import loongforge.core.recipes
    import torch.distributed as dist
    from loongforge.core.parallel import free_port
    from loongforge.llm.cli import main

    made = not dist.is_initialized()
    if made:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        monkeypatch.setattr(loongforge.core.recipes, "train", _raising(OSError(errno.ENOSPC, "No space left on device", "/x")))
        assert main(["train", "tiny"]) == 2
        assert dist.is_initialized()
        dist.barrier()  # still usable
    finally:
        if made:
            dist.destroy_process_group()
