"""`loongforge-embodied train`: the shipped demo trains (loss falls), resume gives the same
losses as an uninterrupted run, 2 gloo processes equal one, and bad input is one line, exit 2."""

import json

import pytest
from conftest import losses, run_cli

MODULE = "loongforge.embodied.cli"
SMALL = ["train.micro_batch_size=4", "train.global_batch_size=8", "train.log_interval=1"]


def train(args, nproc: int = 1):
    return run_cli(["train", "pi_tiny", *args], nproc=nproc, module=MODULE)


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    d = tmp_path_factory.mktemp("straight")
    r = train([*SMALL, "train.train_iters=4", f"checkpoint.run_dir={d}"])
    assert r.returncode == 0, r.stderr[-3000:]
    return d


def test_demo_trains_and_writes_its_run_dir(straight):
    got = losses(straight)
    assert sorted(got) == [1, 2, 3, 4]
    assert all(v == v and v > 0 for v in got.values())
    assert (straight / "checkpoints" / "latest").read_text() == "step_00000004"
    norm = json.loads((straight / "normalizer.json").read_text())
    (stats,) = norm.values()
    assert set(stats["features"]) == {"observation.state", "action"}
    assert (straight / "data" / "demo" / "meta" / "info.json").is_file()


def test_resume_gives_the_uninterrupted_losses(straight, tmp_path):
    first = train([*SMALL, "train.train_iters=2", f"checkpoint.run_dir={tmp_path}"])
    assert first.returncode == 0, first.stderr[-3000:]
    second = train([*SMALL, "train.train_iters=4", f"checkpoint.run_dir={tmp_path}"])
    assert second.returncode == 0, second.stderr[-3000:]
    assert "at step 2" in second.stdout, second.stdout[-2000:]
    want, got = losses(straight), losses(tmp_path)
    assert sorted(got) == [1, 2, 3, 4]
    for step in (3, 4):
        assert abs(got[step] - want[step]) <= 1e-6 * abs(want[step]), (step, got[step], want[step])


@pytest.mark.slow
def test_two_gloo_processes_equal_one(straight, tmp_path):
    """DDP, ZeRO-1 and FSDP2 on 2 gloo processes give the one-process losses; so does FSDP2 with
    LoRA adapters (frozen and trainable weights in one sharded layer)."""
    lora = ["lora.rank=4", "train.ema_decay=0.9"]
    one_lora = tmp_path / "one_lora"
    r = train([*SMALL, "train.train_iters=4", *lora, f"checkpoint.run_dir={one_lora}"])
    assert r.returncode == 0, r.stderr[-3000:]
    for mode, extra, ref in (("ddp", [], straight), ("zero1", [], straight), ("fsdp", [], straight), ("fsdp", lora, one_lora)):
        d = tmp_path / f"{mode}{len(extra)}"
        r = train([*SMALL, "train.train_iters=4", f"parallel.data_parallel_mode={mode}", *extra, f"checkpoint.run_dir={d}"], nproc=2)
        assert r.returncode == 0, r.stderr[-3000:]
        want, got = losses(ref), losses(d)
        assert sorted(got) == sorted(want) == [1, 2, 3, 4]
        for step in want:
            assert abs(got[step] - want[step]) <= 1e-5 * abs(want[step]), (mode, extra, step, got[step], want[step])
    assert losses(one_lora) != losses(straight)


@pytest.mark.parametrize(
    "override,message",
    [
        ("parallel.stack=megatron", "embodied policies train on the torch stack"),
        ("data.datasets=[{root: /nonexistent/robot}]", "/nonexistent/robot is not a LeRobot dataset"),
        ("data.cameras=[observation.images.side]", "observation.images.side"),
        ("policy.expert.num_layers=3", "must equal policy.backbone.num_layers"),
        ("policy.max_action_dim=1", "raise policy.max_state_dim"),
        ("data.normalization={action: MEDIAN}", "unknown normalization mode 'MEDIAN'"),
        ("freeze=[vision,head]", "freeze: unknown part 'head'"),
        ("train.ema_decay=1.0", "train.ema_decay=1.0 must be in [0, 1)"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(tmp_path, override, message):
    r = train([*SMALL, "train.train_iters=1", f"checkpoint.run_dir={tmp_path}", override])
    assert r.returncode == 2, r.stderr[-3000:]
    last = r.stderr.strip().splitlines()[-1]
    assert message in last, last
    assert "Traceback" not in r.stderr


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    d = tmp_path_factory.mktemp("trained")
    r = train(["train.train_iters=60", f"checkpoint.run_dir={d}"])
    assert r.returncode == 0, r.stderr[-3000:]
    return d


def test_eval_reports_lower_action_error_after_training(straight, trained):
    def mse(run):
        r = run_cli(["eval", str(run), "--episodes", "6", "7", "--every", "4"], module=MODULE)
        assert r.returncode == 0, r.stderr[-3000:]
        return json.loads(r.stdout.strip().splitlines()[-1])

    early, late = mse(straight), mse(trained)
    assert early["frames"] == late["frames"] == 20
    assert late["action_mse_normalized"] < 0.8 * early["action_mse_normalized"], (early, late)
    bad = run_cli(["eval", str(trained), "--episodes", "99"], module=MODULE)
    assert bad.returncode == 2 and "--episodes: 99 is not an episode" in bad.stderr.strip().splitlines()[-1]


def test_server_speaks_openpi_protocol(trained):
    import asyncio
    import threading
    import urllib.request

    import numpy as np
    from loongforge.core.parallel import free_port
    from loongforge.embodied.data import LeRobotDataset
    from loongforge.embodied.serving import PolicyRunner, packb, serve_async, unpackb
    from websockets.sync.client import connect

    runner = PolicyRunner.from_run_dir(trained)
    ds = LeRobotDataset(trained / "data" / "demo")
    item = ds.get(ds.episode(6).start + 3)
    obs = {c: item[c] for c in runner.inputs.cameras}
    obs.update({"observation.state": np.asarray(item["observation.state"], np.float32), "prompt": item["task"]})
    want = runner.infer(obs)["actions"]

    port, started, server = free_port(), threading.Event(), []
    loop = asyncio.new_event_loop()

    def ready(s):
        server.append(s)
        started.set()

    def run():
        try:
            loop.run_until_complete(serve_async(runner, "127.0.0.1", port, ready=ready))
        except asyncio.CancelledError:
            pass  # closed by the test

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    assert started.wait(30)
    assert urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz").read() == b"OK\n"
    with connect(f"ws://127.0.0.1:{port}", compression=None, max_size=None) as ws:
        meta = unpackb(ws.recv())
        assert meta["cameras"] == runner.inputs.cameras and meta["chunk_size"] == 8
        ws.send(packb(obs))
        out = unpackb(ws.recv())
        assert out["actions"].shape == (8, 2) and np.array_equal(out["actions"], want)
        assert out["server_timing"]["infer_ms"] > 0
        ws.send(packb({"prompt": "no state"}))
        assert "lacks 'observation.state'" in ws.recv()
    loop.call_soon_threadsafe(server[0].close)
    thread.join(30)
    assert not thread.is_alive()


def test_frozen_parts_keep_their_weights_and_the_ema_is_served(tmp_path):
    """Frozen parts stay as they started; with `train.ema_decay` the checkpoints hold the EMA of
    the trained parts (step 2's is decay * step 1's + (1 - decay) * step 2's weights), and
    serving and eval read it."""
    import torch
    from loongforge.core.checkpoint.dcp_io import read_model_state
    from loongforge.embodied.serving import read_run

    frozen = ("vision.", "projector.", "backbone.")
    r = train(
        [
            *SMALL,
            "train.train_iters=2",
            "train.save_interval=1",
            "train.ema_decay=0.75",
            "freeze=[vision,projector,backbone]",
            f"checkpoint.run_dir={tmp_path}",
        ]
    )
    assert r.returncode == 0, r.stderr[-3000:]
    steps = [tmp_path / "checkpoints" / f"step_0000000{i}" for i in (1, 2)]
    one, two = (read_model_state(s) for s in steps)
    for name in one:
        same = bool((one[name] == two[name]).all())
        assert same == name.startswith(frozen), name
    ema1, ema2 = (read_model_state(s, ema=True) for s in steps)
    trained = [n for n in two if not n.startswith(frozen) and two[n].is_floating_point()]
    for name in two:
        if name.startswith(frozen):
            assert torch.equal(ema2[name], two[name]), name
    for name in trained:
        torch.testing.assert_close(ema2[name], 0.75 * ema1[name] + 0.25 * two[name], rtol=1e-6, atol=1e-7, msg=name)
    assert any(not torch.allclose(ema2[n], two[n]) for n in trained)
    _, served = read_run(tmp_path)
    assert all(torch.equal(served[n], ema2[n]) for n in ema2)


def test_convert_to_lerobot_and_back(trained, straight, tmp_path):
    """`convert` writes the run's weights under LeRobot's names; `checkpoint.load` of that
    directory starts a run from exactly those weights (lr 0 keeps them for the check); an
    existing output and an EMA the run lacks are one-line errors that touch nothing."""
    import torch
    from loongforge.core.checkpoint.dcp_io import read_model_state
    from safetensors.torch import load_file

    out = tmp_path / "lerobot"
    r = run_cli(["convert", str(trained), str(out)], module=MODULE)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "no config.json" in r.stdout and sorted(p.name for p in out.iterdir()) == ["model.safetensors"]
    names = load_file(str(out / "model.safetensors"))
    assert "model.paligemma_with_expert.paligemma.model.language_model.layers.0.self_attn.q_proj.weight" in names
    assert "model.action_out_proj.weight" in names
    again = tmp_path / "again"
    r = train(
        [
            "train.train_iters=1",
            "train.lr=0",
            "train.min_lr=0",
            "train.weight_decay=0",
            f"checkpoint.load={out}",
            f"checkpoint.run_dir={again}",
        ]
    )
    assert r.returncode == 0, r.stderr[-3000:]
    want = read_model_state(next((trained / "checkpoints").glob("step_*")))
    got = read_model_state(next((again / "checkpoints").glob("step_*")))
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    assert losses(again)[1] < 0.8 * losses(straight)[1]  # it starts where the trained run ended
    before = (out / "model.safetensors").read_bytes()
    for args, message in (
        ([str(trained), str(out)], "output directory exists and is not empty"),
        ([str(trained), str(tmp_path / "x"), "--weights", "ema"], "kept no EMA"),
    ):
        r = run_cli(["convert", *args], module=MODULE)
        assert r.returncode == 2 and message in r.stderr.strip().splitlines()[-1], r.stderr[-2000:]
    assert (out / "model.safetensors").read_bytes() == before and not (tmp_path / "x").exists()


def test_lerobot_config_names_the_published_shapes():
    """The shipped pi05 / pi0 configs have LeRobot's published shapes, which its config.json names;
    other shapes have none."""
    from loongforge.core.config import load_config
    from loongforge.embodied.config import CONFIG_DIR, PiRunConfig
    from loongforge.embodied.policies.lerobot_format import lerobot_config

    for name, variant, state_mode in (("pi05", "pi05", "QUANTILES"), ("pi0", "pi0", "MEAN_STD")):
        cfg = load_config(PiRunConfig, CONFIG_DIR / f"{name}.yaml")
        policy = cfg.policy.resolved()
        modes = {"state": cfg.data.normalization["observation.state"], "action": cfg.data.normalization["action"]}
        got = lerobot_config(policy, ["observation.images.base_0_rgb"], 8, 7, modes, cfg.data.max_prompt_tokens)
        assert got["type"] == variant and got["paligemma_variant"] == "gemma_2b" and got["action_expert_variant"] == "gemma_300m"
        assert got["normalization_mapping"]["STATE"] == state_mode and got["image_resolution"] == [224, 224]
        assert got["input_features"]["observation.state"] == {"type": "STATE", "shape": [8]}
        assert got["output_features"] == {"action": {"type": "ACTION", "shape": [7]}}
    tiny = load_config(PiRunConfig, CONFIG_DIR / "pi_tiny.yaml")
    assert lerobot_config(tiny.policy.resolved(), [], 8, 4, modes, 48) is None


def test_lora_on_the_backbone_from_lerobot_weights(straight, tmp_path):
    """lora.rank > 0: adapters on the backbone's layer linears start from the loaded LeRobot
    weights; the backbone's own weights stay as loaded while the adapters and the other parts
    train; serving and convert see the adapters merged in."""
    import torch
    from loongforge.core.checkpoint.dcp_io import read_model_state
    from loongforge.core.foundation.lora import merge_adapters
    from loongforge.embodied.serving import read_run

    lerobot = tmp_path / "lerobot"
    assert run_cli(["convert", str(straight), str(lerobot)], module=MODULE).returncode == 0
    run = tmp_path / "lora"
    r = train(
        [*SMALL, "train.train_iters=2", "train.save_interval=1", "lora.rank=4", f"checkpoint.load={lerobot}", f"checkpoint.run_dir={run}"]
    )
    assert r.returncode == 0, r.stderr[-3000:]
    start = read_model_state(next((straight / "checkpoints").glob("step_*")))
    one, two = (read_model_state(run / "checkpoints" / f"step_0000000{i}") for i in (1, 2))
    adapters = sorted(k for k in two if k.endswith((".lora_a", ".lora_b")))
    assert len(adapters) == 2 * 4 * 2 and all(k.startswith("backbone.layers.") for k in adapters)  # 4 linears x 2 layers
    for k, v in start.items():
        if k.startswith("backbone."):
            assert torch.equal(two[k], v), k  # loaded, then frozen
    assert not torch.equal(one["backbone.layers.0.linear_qkv.lora_b"], two["backbone.layers.0.linear_qkv.lora_b"])
    assert not torch.equal(two["expert.layers.0.linear_qkv.weight"], start["expert.layers.0.linear_qkv.weight"])
    _, served = read_run(run)
    assert served.keys() == start.keys()
    want = merge_adapters(two, 16.0 / 4)
    assert all(torch.equal(served[k], want[k]) for k in served)
    assert not torch.equal(served["backbone.layers.0.linear_qkv.weight"], start["backbone.layers.0.linear_qkv.weight"])
    r = train(
        [*SMALL, "train.train_iters=1", "lora.rank=4", "lora.target_modules=[vision.nothing*]", f"checkpoint.run_dir={tmp_path / 'bad'}"]
    )
    assert r.returncode == 2 and "matched no linear" in r.stderr.strip().splitlines()[-1], r.stderr[-2000:]
    assert not (tmp_path / "bad").exists()
