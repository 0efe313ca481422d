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
    """DDP, ZeRO-1, FSDP2 and HSDP (a 2 x 1 mesh: replicas x shards) on 2 gloo processes give the
    one-process losses; so does FSDP2 with LoRA adapters (frozen and trainable weights in one
    sharded layer)."""
    lora = ["lora.rank=4", "train.ema_decay=0.9"]
    one_lora = tmp_path / "one_lora"
    r = train([*SMALL, "train.train_iters=4", *lora, f"checkpoint.run_dir={one_lora}"])
    assert r.returncode == 0, r.stderr[-3000:]
    hsdp = ["parallel.data_parallel_replicas=2"]
    runs = (("ddp", [], straight), ("zero1", [], straight), ("fsdp", [], straight), ("hsdp", hsdp, straight), ("fsdp", lora, one_lora))
    for mode, extra, ref in runs:
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


# lerobot 0.4.4's processor files for pi0.5 / pi0 (`make_pi05_pre_post_processors`,
# `make_pi0_pre_post_processors`, saved by `DataProcessorPipeline._save_pretrained`)
PI05_PRE = [
    "rename_observations_processor",
    "to_batch_processor",
    "normalizer_processor",
    "pi05_prepare_state_tokenizer_processor_step",
    "tokenizer_processor",
    "device_processor",
]
PI0_PRE = [
    "rename_observations_processor",
    "to_batch_processor",
    "pi0_new_line_processor",
    "tokenizer_processor",
    "device_processor",
    "normalizer_processor",
]
POST = ["unnormalizer_processor", "device_processor"]
PROCESSOR_FILES = [
    "policy_postprocessor.json",
    "policy_postprocessor_step_0_unnormalizer_processor.safetensors",
    "policy_preprocessor.json",
    "policy_preprocessor_step_2_normalizer_processor.safetensors",
]
# the constructor arguments of lerobot 0.4.4's step classes, by registry name (what
# `_instantiate_step`'s `step_class(**config)` accepts)
NORMALIZER_FIELDS = {"features", "norm_map", "stats", "device", "dtype", "eps", "normalize_observation_keys"}
LEROBOT_STEP_FIELDS = {
    "rename_observations_processor": {"rename_map"},
    "to_batch_processor": {"to_batch_action_processor", "to_batch_observation_processor", "to_batch_complementary_data_processor"},
    "normalizer_processor": NORMALIZER_FIELDS,
    "unnormalizer_processor": NORMALIZER_FIELDS,
    "pi05_prepare_state_tokenizer_processor_step": {"max_state_dim", "task_key"},
    "pi0_new_line_processor": set(),
    "tokenizer_processor": {"tokenizer_name", "tokenizer", "max_length", "task_key", "padding_side", "padding", "truncation"},
    "device_processor": {"device", "float_dtype"},
}


def lerobot_load_pipeline(directory, config_filename):
    """lerobot 0.4.4's `DataProcessorPipeline.from_pretrained` for a local directory, reduced to
    what it reads: `_load_config`, `_is_processor_config`, `_resolve_step_class` (registry names),
    `_instantiate_step` (the config as constructor arguments), `_load_step_state` and
    `_NormalizationMixin.load_state_dict` (keys split at the last dot, float32)."""
    import torch
    from safetensors.torch import load_file

    with open(directory / config_filename) as f:
        config = json.load(f)
    assert isinstance(config.get("steps"), list)
    steps = []
    for entry in config["steps"]:
        assert isinstance(entry, dict) and "registry_name" in entry, entry
        cfg = entry.get("config", {})
        assert set(cfg) <= LEROBOT_STEP_FIELDS[entry["registry_name"]], entry
        stats = None
        if "state_file" in entry:
            stats = {}
            for flat_key, tensor in load_file(str(directory / entry["state_file"])).items():
                key, stat = flat_key.rsplit(".", 1)
                stats.setdefault(key, {})[stat] = tensor.to(dtype=torch.float32)
        steps.append((entry["registry_name"], cfg, stats))
    return config.get("name", "DataProcessorPipeline"), steps


def lerobot_transform(cfg, stats, key, feature_type, x, inverse):
    """`_NormalizationMixin._apply_transform` of lerobot 0.4.4 (float32 tensors)."""
    import torch

    mode = cfg["norm_map"].get(feature_type, "IDENTITY")
    if mode == "IDENTITY" or key not in stats:
        return x
    s, eps = stats[key], torch.tensor(cfg["eps"], dtype=x.dtype)
    if mode == "MEAN_STD":
        return x * s["std"] + s["mean"] if inverse else (x - s["mean"]) / (s["std"] + cfg["eps"])
    low, high = {"MIN_MAX": ("min", "max"), "QUANTILES": ("q01", "q99"), "QUANTILE10": ("q10", "q90")}[mode]
    denom = s[high] - s[low]
    denom = torch.where(denom == 0, eps, denom)
    return (x + 1.0) * denom / 2.0 + s[low] if inverse else 2.0 * (x - s[low]) / denom - 1.0


@pytest.fixture(scope="module")
def exported(trained, tmp_path_factory):
    """`convert` of the trained run: (the LeRobot directory, the command's stdout)."""
    out = tmp_path_factory.mktemp("export") / "lerobot"
    r = run_cli(["convert", str(trained), str(out)], module=MODULE)
    assert r.returncode == 0, r.stderr[-3000:]
    return out, r.stdout


def test_convert_to_lerobot_and_back(trained, straight, exported, tmp_path):
    """`convert` writes the run's weights under LeRobot's names; `checkpoint.load` of that
    directory starts a run from exactly those weights (lr 0 keeps them for the check); an
    existing output and an EMA the run lacks are one-line errors that touch nothing."""
    import torch
    from loongforge.core.checkpoint.dcp_io import read_model_state
    from safetensors.torch import load_file

    out, stdout = exported
    assert "no config.json" in stdout and sorted(p.name for p in out.iterdir()) == ["model.safetensors", *PROCESSOR_FILES]
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


def test_convert_writes_lerobot_processor_files(trained, exported, tmp_path):
    """`convert` writes LeRobot 0.4.4's pi0.5 processor files: the steps its factory makes, the
    (un)normalizer's stats as LeRobot flattens them (float32 of the run's), JSON as
    `save_pretrained` writes it. LeRobot's loading and normalizing logic reads them to the run's
    normalization; `lerobot_normalizer` reads them back bit-identical; pi0 has its own step order;
    a malformed file is a one-line error naming the file and the key."""
    import shutil

    import numpy as np
    import torch
    from loongforge.core.errors import UserError
    from loongforge.embodied.convert import lerobot_normalizer
    from loongforge.embodied.data.normalize import Normalizer
    from loongforge.embodied.lerobot_processor import pi_processor_files, policy_features, stats_state, write_processor_files
    from safetensors.torch import save, save_file

    out, _ = exported
    run = Normalizer.from_state_dict(next(iter(json.loads((trained / "normalizer.json").read_text()).values())))
    io = json.loads((trained / "policy_io.json").read_text())
    want = {f"{f}.{s}": torch.from_numpy(v).to(torch.float32) for f, d in run.stats.items() for s, v in d.items()}
    assert sorted(want) == ["action.q01", "action.q99", "observation.state.q01", "observation.state.q99"]

    pre_name, pre = lerobot_load_pipeline(out, "policy_preprocessor.json")
    post_name, post = lerobot_load_pipeline(out, "policy_postprocessor.json")
    assert (pre_name, [n for n, _, _ in pre]) == ("policy_preprocessor", PI05_PRE)
    assert (post_name, [n for n, _, _ in post]) == ("policy_postprocessor", POST)
    for name in ("policy_preprocessor.json", "policy_postprocessor.json"):  # json.dump(indent=2), each state file there
        text = (out / name).read_text()
        assert text == json.dumps(json.loads(text), indent=2)
        for entry in json.loads(text)["steps"]:
            assert "state_file" not in entry or (out / entry["state_file"]).read_bytes() == save(want), entry
    (_, norm_cfg, norm_stats), (_, unnorm_cfg, unnorm_stats) = pre[2], post[0]
    cameras = {c: {"type": "VISUAL", "shape": [3, 32, 32]} for c in io["cameras"]}
    assert norm_cfg == {
        "eps": 1e-8,
        "features": {
            **cameras,
            "observation.state": {"type": "STATE", "shape": [io["state_dim"]]},
            "action": {"type": "ACTION", "shape": [io["action_dim"]]},
        },
        "norm_map": {"VISUAL": "IDENTITY", "STATE": "QUANTILES", "ACTION": "QUANTILES"},
    }
    assert unnorm_cfg == {**norm_cfg, "features": {"action": norm_cfg["features"]["action"]}}
    assert pre[4][1] == {
        "max_length": 48,
        "task_key": "task",
        "padding_side": "right",
        "padding": "max_length",
        "truncation": True,
        "tokenizer_name": "google/paligemma-3b-pt-224",
    }
    assert pre[3][1] == pre[1][1] == {} and post[1][1] == {"device": "cpu", "float_dtype": None}
    for stats in (norm_stats, unnorm_stats):
        assert all(torch.equal(stats[k.rsplit(".", 1)[0]][k.rsplit(".", 1)[1]], v) for k, v in want.items())
    # LeRobot's transforms with these files equal the run's normalizer on float32 inputs, bit for bit
    g = torch.Generator().manual_seed(0)
    state, action = torch.randn(3, io["state_dim"], generator=g), torch.randn(3, 8, io["action_dim"], generator=g)
    for inverse in (False, True):
        ours = (run.unnormalize if inverse else run.normalize)({"observation.state": state, "action": action})
        lerobot_state = lerobot_transform(norm_cfg, norm_stats, "observation.state", "STATE", state, inverse)
        lerobot_action = lerobot_transform(unnorm_cfg, unnorm_stats, "action", "ACTION", action, inverse)
        assert torch.equal(lerobot_state, ours["observation.state"]) and torch.equal(lerobot_action, ours["action"])

    back = lerobot_normalizer(out)  # the round trip: the files' tensors, bit-identical
    assert back.modes == run.modes and back.eps == run.eps
    assert all(np.array_equal(back.stats[f][s], want[f"{f}.{s}"].numpy()) for f, d in run.stats.items() for s in d)
    x = {"observation.state": state.numpy(), "action": action.numpy()}
    for fn in ("normalize", "unnormalize"):
        assert all(np.array_equal(getattr(back, fn)(x)[k], getattr(run, fn)(x)[k]) for k in x)
    assert lerobot_normalizer(tmp_path) is None

    # pi0: its step order, MEAN_STD through the same files
    mean_std = Normalizer(
        {"s": {"mean": [0.5, 1.0], "std": [2.0, 0.0]}, "a": {"mean": [3.0], "std": [4.0]}}, {"s": "MEAN_STD", "a": "MEAN_STD"}
    )
    inputs, outputs = policy_features(["observation.images.top"], 224, 2, 1)
    modes = {"VISUAL": "IDENTITY", "STATE": "MEAN_STD", "ACTION": "MEAN_STD"}
    pi0 = pi_processor_files("pi0", inputs, outputs, modes, stats_state(mean_std, {"s": "observation.state", "a": "action"}), 1e-8, 48)
    (tmp_path / "pi0").mkdir()
    written = write_processor_files(pi0, tmp_path / "pi0")
    assert sorted(written) == sorted(p.name for p in (tmp_path / "pi0").iterdir())
    assert "policy_preprocessor_step_5_normalizer_processor.safetensors" in written
    assert [n for n, _, _ in lerobot_load_pipeline(tmp_path / "pi0", "policy_preprocessor.json")[1]] == PI0_PRE
    got = lerobot_normalizer(tmp_path / "pi0", "s", "a")
    assert got.modes == mean_std.modes and all(
        np.array_equal(got.stats[f][s], mean_std.stats[f][s]) for f in got.stats for s in got.stats[f]
    )

    # malformed files: one line naming the file and the key
    bad = tmp_path / "bad"
    state_file = bad / "policy_preprocessor_step_2_normalizer_processor.safetensors"
    config = json.loads((out / "policy_preprocessor.json").read_text())

    def broken(name, content):
        shutil.rmtree(bad, ignore_errors=True)
        shutil.copytree(out, bad, ignore=shutil.ignore_patterns("model.safetensors"))
        if isinstance(content, dict):
            save_file(content, str(bad / name))
        else:
            (bad / name).write_bytes(content)
        with pytest.raises(UserError) as e:
            lerobot_normalizer(bad)
        return str(e.value)

    no_q99 = {k: v for k, v in want.items() if k != "action.q99"}
    bad_mode = json.loads(json.dumps(config))
    bad_mode["steps"][2]["config"]["norm_map"]["STATE"] = "MEDIAN"
    for name, content, words in (
        ("policy_preprocessor.json", b'{"name": "policy_preprocessor", "steps": [', ["not a JSON processor config"]),
        ("policy_preprocessor.json", json.dumps(bad_mode).encode(), ["steps[2].config.norm_map.STATE", "'MEDIAN'"]),
        (state_file.name, no_q99, ["'action.q99'", "QUANTILES"]),
        (state_file.name, b"not safetensors", ["not a safetensors file"]),
    ):
        message = broken(name, content)
        assert "\n" not in message and name in message and all(w in message for w in words), message


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
