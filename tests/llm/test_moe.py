"""Qwen3-MoE: our megatron-core model against HF transformers' Qwen3MoeForCausalLM on tiny random
configs (logits, greedy tokens, HF -> LF -> HF), training with the router's losses and load
metrics, EP=2 on 2 gloo processes against EP=1 (all-gather and all-to-all dispatch), TP=2 with
sequence parallelism, resume across EP sizes, and bad input."""

import json
import re
import shutil

import pytest
import torch
from conftest import FAST, assert_greedy_matches_hf, assert_round_trip, logits_error, losses, make_hf_model, run_cli, spread_router
from loongforge.llm import load_model
from safetensors.torch import load_file

MOE = dict(moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2, head_dim=16)
CASES = {
    # a dense first layer (mlp_only_layers), renormalized top-k probabilities
    "normtopk-densefirst": dict(mlp_only_layers=[0], norm_topk_prob=True, num_hidden_layers=3),
    # every second layer MoE (decoder_sparse_step), the softmax over all experts kept
    "softmax-sparsestep": dict(decoder_sparse_step=2, norm_topk_prob=False, num_hidden_layers=4, tie_word_embeddings=True),
}


@pytest.fixture(scope="module", params=sorted(CASES))
def pair(request, tmp_path_factory):
    d = tmp_path_factory.mktemp(request.param)
    hf = make_hf_model("qwen3_moe", d / "init", **MOE, **CASES[request.param])
    spread_router(hf)
    hf.save_pretrained(str(d / "hf"))
    return hf, d / "hf", load_model(d / "hf")


def test_logits_match_hf(pair):
    hf, d, ours = pair
    torch.manual_seed(1)
    x = torch.randint(0, 512, (2, 48))
    assert logits_error(hf, ours, x) < 1e-5
    # negative control: the other renormalization gives other logits
    assert logits_error(hf, load_model_with(d, norm_topk_prob=not hf.config.norm_topk_prob), x) > 1e-3


def load_model_with(hf_dir, **changes):
    import tempfile

    tmp = tempfile.mkdtemp()
    shutil.copytree(hf_dir, f"{tmp}/m")
    c = json.loads(open(f"{tmp}/m/config.json").read())
    c.update(changes)
    open(f"{tmp}/m/config.json", "w").write(json.dumps(c))
    return load_model(f"{tmp}/m")


def test_greedy_generation_matches_hf(pair):
    assert_greedy_matches_hf(pair[0], pair[2])


def test_hf_lf_hf_roundtrip_is_bit_identical(pair, tmp_path):
    hf, d, _ = pair
    c = assert_round_trip(hf, d, tmp_path)
    assert any(".experts.7.down_proj" in k for k in load_file(str(d / "model.safetensors")))
    # the exported config names the MoE layout as HF does
    orig = json.loads((d / "config.json").read_text())
    for key in ("num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob", "decoder_sparse_step", "mlp_only_layers"):
        assert c[key] == orig[key], key
    assert c["num_experts"] == orig.get("num_experts", orig.get("num_local_experts"))


# ---- training ----------------------------------------------------------------------------

STEPS = 4
ROUTER = ["model.moe_aux_loss_coeff=0.01", "model.moe_z_loss_coeff=0.001"]


@pytest.fixture(scope="module")
def hf_moe(tmp_path_factory):
    """A 3-layer Qwen3-MoE over the tiny tokenizer's vocabulary: a dense first layer, 8 experts, top-2."""
    d = tmp_path_factory.mktemp("hf_moe")
    hf = make_hf_model("qwen3_moe", d / "init", **MOE, num_hidden_layers=3, mlp_only_layers=[0], norm_topk_prob=True)
    spread_router(hf)
    hf.save_pretrained(str(d / "hf"))
    return d / "hf"


def _train(run_dir, hf, *extra, nproc=1, steps=STEPS):
    args = ["train", "tiny", *FAST, f"train.train_iters={steps}", f"checkpoint.load={hf}", f"checkpoint.run_dir={run_dir}", *ROUTER]
    r = run_cli([*args, *extra], nproc=nproc)
    assert r.returncode == 0, r.stderr[-3000:]
    return r


def _rows(run_dir):
    """A run's metrics.jsonl rows."""
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _assert_close(got, want, keys, rel=1e-5):
    """Every step's `keys` of `got` within `rel` of `want`'s."""
    assert [r["step"] for r in got] == [r["step"] for r in want]
    for g, w in zip(got, want):
        for k in keys:
            assert abs(g[k] - w[k]) <= rel * abs(w[k]), (g["step"], k, g[k], w[k])


@pytest.fixture(scope="module")
def single(hf_moe, tmp_path_factory):
    d = tmp_path_factory.mktemp("moe_single")
    _train(d, hf_moe, "train.save_interval=2")
    return d


def test_training_logs_router_losses_and_expert_load(single):
    rows = [json.loads(x) for x in (single / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    last = rows[-1]
    for layer in (1, 2):  # layer 0 is dense
        assert last[f"moe/layer{layer}/load_max_mean"] >= 1.0
        assert 0.5 < last[f"moe/layer{layer}/load_balancing_loss"] < 8.0  # 1.0 when balanced, E / k at worst
        assert last[f"moe/layer{layer}/z_loss"] > 0
    assert "moe/layer0/load_max_mean" not in last
    assert rows[-1]["loss"] < rows[0]["loss"]


def test_capacity_factor_drops_tokens_only_past_capacity(single, hf_moe, tmp_path):
    """A capacity no expert reaches gives the dropless run's losses (through megatron-core's
    token-dropping dispatcher); a tight one drops tokens and changes them."""
    _train(tmp_path / "wide", hf_moe, "model.moe_capacity_factor=100", steps=1)
    _train(tmp_path / "tight", hf_moe, "model.moe_capacity_factor=0.5", steps=1)
    want, wide, tight = losses(single), losses(tmp_path / "wide"), losses(tmp_path / "tight")
    assert abs(wide[1] - want[1]) <= 1e-5 * abs(want[1]), (wide[1], want[1])
    assert abs(tight[1] - want[1]) > 1e-4 * abs(want[1])


@pytest.mark.parametrize("kind", ["seq_aux_loss", "global_aux_loss"])
def test_other_load_balancing_losses_train_and_are_logged(kind, hf_moe, tmp_path):
    _train(tmp_path, hf_moe, f"model.moe_aux_loss_type={kind}", steps=1)
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    name = {"seq_aux_loss": "seq_load_balancing_loss", "global_aux_loss": "global_load_balancing_loss"}[kind]
    assert all(0.5 < r[f"moe/layer{n}/{name}"] < 8.0 for r in rows for n in (1, 2))
    assert "moe/layer1/load_balancing_loss" not in rows[0]


@pytest.fixture(scope="module")
def ep2(hf_moe, tmp_path_factory):
    """The same run at EP=2 on 2 gloo processes (data parallel 2 for everything but the experts)."""
    d = tmp_path_factory.mktemp("moe_ep2")
    _train(d, hf_moe, "train.save_interval=2", "parallel.expert_model_parallel_size=2", nproc=2)
    return d


@pytest.mark.slow
def test_expert_parallel_two_processes_match_one(single, ep2):
    manifest = json.loads((ep2 / "checkpoints" / "step_00000004" / "manifest.json").read_text())
    assert manifest["parallel"]["expert_model_parallel_size"] == 2 and manifest["parallel"]["data_parallel_size"] == 2
    assert len(_rows(ep2)) == STEPS
    _assert_close(_rows(ep2), _rows(single), ("loss", "grad_norm"))


@pytest.mark.slow
@pytest.mark.parametrize("sp", [False, True])
def test_hot_expert_replication_keeps_the_math(sp, single, hf_moe, tmp_path):
    """EP=2 with two spare slots per rank, re-planned every step: hot experts get copies on the
    other rank (each (token, expert) pair computed by one copy, the copies' gradients summed
    into the home weight), and the losses and gradient norms are those of one process. With
    TP=2 and sequence parallelism on the same two ranks, each routes half of the sequence: the
    plan comes from both halves' counts, the same on both ranks."""
    extra = ["parallel.expert_model_parallel_size=2", "parallel.expert_spare_slots=2", "parallel.expert_replan_interval=1"]
    if sp:
        extra += ["parallel.tensor_model_parallel_size=2", "parallel.sequence_parallel=true"]
    _train(tmp_path, hf_moe, "train.save_interval=2", *extra, nproc=2)
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    one = [json.loads(x) for x in (single / "metrics.jsonl").read_text().splitlines()]
    assert rows[0]["moe/layer1/replicas"] == rows[0]["moe/layer2/replicas"] == 0  # the first step runs before any plan
    assert all(r["moe/layer1/replicas"] + r["moe/layer2/replicas"] > 0 for r in rows[1:])  # (a balanced layer may need none)
    for got, want in zip(rows, one):
        assert abs(got["loss"] - want["loss"]) <= 1e-5 * abs(want["loss"]), (got["step"], got["loss"], want["loss"])
        assert abs(got["grad_norm"] - want["grad_norm"]) <= 1e-5 * want["grad_norm"], got["step"]


def test_routing_trace_of_a_run_feeds_the_balance_simulator(single, tmp_path):
    """tools/record_routing_trace.py records a trained run's routing on text; the simulator reads it."""
    import subprocess
    import sys
    from pathlib import Path

    from conftest import cli_env

    tools = Path(__file__).resolve().parents[2] / "tools"
    corpus = Path(__file__).resolve().parents[2] / "packages/loongforge-llm/src/loongforge/llm/assets/tiny_corpus.jsonl"
    trace = tmp_path / "trace.jsonl"
    args = ["--text", str(corpus), "--out", str(trace), "--tokens-per-step", "256", "--seq-length", "64", "--steps", "4"]
    r = subprocess.run(
        [sys.executable, str(tools / "record_routing_trace.py"), str(single), *args], env=cli_env(), capture_output=True, text=True
    )
    assert r.returncode == 0, r.stderr[-2000:]
    rows = [json.loads(x) for x in trace.read_text().splitlines()]
    assert sorted({(x["step"], x["layer"]) for x in rows}) == [(s, layer) for s in range(4) for layer in (1, 2)]
    assert all(sum(x["tokens_per_expert"]) == 256 * 2 for x in rows)  # every token routed to its top-2
    r = subprocess.run(
        [sys.executable, str(tools / "moe_balance_sim.py"), "--trace", str(trace), "--ep", "2", "--spare", "1", "--window", "2"],
        env=cli_env(),
        capture_output=True,
        text=True,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    assert "layer 1" in r.stdout and "mean over 2 layers" in r.stdout
    r = subprocess.run(
        [sys.executable, str(tools / "record_routing_trace.py"), str(single), *args], env=cli_env(), capture_output=True, text=True
    )
    assert r.returncode == 2 and r.stderr.strip().startswith("error: --out") and "exists" in r.stderr  # never overwritten


def _cut_to_step_2(src, dst):
    """A copy of a finished run as if it had been stopped right after its step-2 checkpoint."""
    shutil.copytree(src, dst)
    shutil.rmtree(dst / "checkpoints" / "step_00000004")
    (dst / "checkpoints" / "latest").write_text("step_00000002")


@pytest.mark.slow
@pytest.mark.parametrize("saved_ep,resumed_ep", [(2, 1), (1, 2)])
def test_resume_at_another_expert_parallel_size(saved_ep, resumed_ep, single, ep2, hf_moe, tmp_path):
    src = ep2 if saved_ep == 2 else single
    d = tmp_path / "resumed"
    _cut_to_step_2(src, d)
    r = _train(d, hf_moe, "train.save_interval=2", f"parallel.expert_model_parallel_size={resumed_ep}", nproc=resumed_ep)
    assert "resumed from" in r.stdout
    want, got = losses(single), losses(d)
    for step in (3, 4):
        assert abs(got[step] - want[step]) <= 1e-5 * abs(want[step]), (step, got[step], want[step])


@pytest.mark.slow
@pytest.mark.parametrize("ep", [2, 1])
def test_tensor_parallel_with_sequence_parallel_matches_one(ep, single, hf_moe, tmp_path):
    """TP=2 on attention and the dense layer with megatron-core's sequence parallelism, on 2 gloo
    processes: at EP=2 the experts split over the same two ranks (each gathers both ranks'
    shares of the sequence); at EP=1 both hold every expert and route their own share (their
    expert gradients summed over the TP ranks). The aux and z losses, the q/k norms (whose
    gradients sum over TP) and the routers (on 1/2 of the sequence each) all take part; losses
    and the gradient norm equal one process at every step, the logged router statistics (each
    rank's share summed over TP) at the first two.

    The statistics swing with the weights at this learning rate (layer 2's z-loss 200, 33, 13,
    30 over the four steps), so from the third step on they also amplify the fp32 reordering of
    the TP sums in the weights (z-loss within 1e-7 at steps 1-2, 1.4e-6 at step 3, 1.5e-5 at step
    4 in one run); the first two test how they are reduced."""
    layout = ["parallel.tensor_model_parallel_size=2", "parallel.sequence_parallel=true", f"parallel.expert_model_parallel_size={ep}"]
    _train(tmp_path, hf_moe, *layout, nproc=2)
    manifest = json.loads((tmp_path / "checkpoints" / f"step_{STEPS:08d}" / "manifest.json").read_text())
    assert manifest["parallel"]["tensor_model_parallel_size"] == 2 and manifest["parallel"]["data_parallel_size"] == 1
    got, want = _rows(tmp_path), _rows(single)
    assert len(got) == STEPS
    _assert_close(got, want, ("loss", "grad_norm"))
    router = ("moe/layer1/load_balancing_loss", "moe/layer1/z_loss", "moe/layer2/z_loss", "moe/layer2/load_max_mean")
    _assert_close(got[:2], want[:2], router)


# ---- all-to-all dispatch (parallel.moe_token_dispatcher_type=alltoall, megatron-core's, run on gloo) ----

ALLTOALL = ["parallel.expert_model_parallel_size=2", "parallel.moe_token_dispatcher_type=alltoall"]


@pytest.mark.slow
def test_alltoall_at_ep2_matches_one_process_and_allgather(single, ep2, hf_moe, tmp_path):
    """8 experts over 2 ranks (4 local experts each, so the received tokens are re-sorted by local
    expert), top-2: the losses and gradient norms of every step are one process's and the
    all-gather dispatcher's within 1e-5; the EP load metrics are the all-gather run's."""
    _train(tmp_path, hf_moe, *ALLTOALL, nproc=2)
    got, one, gathered = _rows(tmp_path), _rows(single), _rows(ep2)
    assert len(got) == STEPS
    _assert_close(got, one, ("loss", "grad_norm"))
    _assert_close(got, gathered, ("loss", "grad_norm", "moe/layer1/ep_load_max_mean", "moe/layer2/ep_load_max_mean"))


@pytest.mark.slow
def test_alltoall_with_a_capacity_factor_drops_as_one_process(hf_moe, tmp_path):
    """Token dropping is the router's (over each rank's micro-batch), so a tight capacity at EP=2
    with all-to-all gives the losses of one process with megatron's all-gather dispatcher."""
    tight = "model.moe_capacity_factor=0.5"
    _train(tmp_path / "one", hf_moe, tight, steps=2)
    _train(tmp_path / "a2a", hf_moe, tight, *ALLTOALL, nproc=2, steps=2)
    _assert_close(_rows(tmp_path / "a2a"), _rows(tmp_path / "one"), ("loss", "grad_norm"))


@pytest.mark.parametrize(
    "extra,needles",
    [
        (
            ["parallel.moe_token_dispatcher_type=alltoall", "parallel.expert_spare_slots=1"],
            ["parallel.expert_spare_slots=1 with parallel.moe_token_dispatcher_type=alltoall", "moe_token_dispatcher_type=allgather"],
        ),
        (["parallel.moe_token_dispatcher_type=all2all"], ["parallel.moe_token_dispatcher_type='all2all'", "allgather, alltoall"]),
    ],
)
def test_bad_dispatcher_settings_on_the_cli(extra, needles, tmp_path):
    r = run_cli(["train", "tiny", *FAST, "train.train_iters=2", f"checkpoint.run_dir={tmp_path / 'run'}", *MOE_TINY, *extra])
    _one_line_error(r, *needles)
    assert not (tmp_path / "run").exists()


def test_alltoall_in_one_process_with_a_capacity_factor_matches_allgather():
    """At EP=1 a capacity factor takes megatron's dispatchers: the all-to-all one (built and run
    without CUDA) gives the all-gather one's loss and gradients."""
    import torch
    from loongforge.core.accelerator import get_accelerator
    from loongforge.core.foundation.families import QWEN3_MOE
    from loongforge.core.foundation.spec import ModelConfig, build_gpt_model
    from loongforge.core.parallel import init_parallel

    acc = get_accelerator()
    ctx = init_parallel(1, 1, acc.backend, acc.device_type)
    cfg = QWEN3_MOE.resolve(
        ModelConfig(family="qwen3_moe", num_layers=2, num_query_groups=2, num_experts=8, moe_ffn_hidden_size=32, moe_capacity_factor=1.0)
    )
    x = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(1))
    results, state = [], None
    for dispatcher in ("allgather", "alltoall"):
        model = build_gpt_model(cfg, ctx, moe_token_dispatcher_type=dispatcher)
        state = state or model.state_dict()
        model.load_state_dict(state)
        loss = model(x, None, None, labels=x, loss_mask=torch.ones(2, 32))
        loss.backward()
        results.append((loss.detach(), {n: p.grad for n, p in model.named_parameters()}))
    assert type(model.decoder.layers[0].mlp.token_dispatcher).__name__ == "AlltoAllDispatcher"
    (loss_ag, grads_ag), (loss_a2a, grads_a2a) = results
    assert torch.allclose(loss_a2a, loss_ag, rtol=1e-6, atol=0)
    for n in grads_ag:
        assert torch.allclose(grads_a2a[n], grads_ag[n], rtol=1e-5, atol=1e-7), n


# ---- bad input ---------------------------------------------------------------------------


def _one_line_error(r, *needles):
    assert r.returncode == 2, (r.returncode, r.stderr[-3000:])
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), r.stderr[-3000:]
    for n in needles:
        assert n in lines[0], lines[0]


MOE_TINY = ["model.family=qwen3_moe", "model.num_experts=4", "model.moe_ffn_hidden_size=32", "model.vocab_size=512"]


@pytest.mark.parametrize(
    "extra,nproc,needles",
    [
        (["model.moe_top_k=5"], 1, ["model.moe_top_k=5", "model.num_experts=4"]),
        (["model.num_experts=6", "parallel.expert_model_parallel_size=4"], 1, ["expert_model_parallel_size=4", "world size 1"]),
        (["model.num_experts=5", "parallel.expert_model_parallel_size=2"], 2, ["expert_model_parallel_size=2", "num_experts=5"]),
        (["parallel.expert_spare_slots=1"], 1, ["expert_spare_slots=1", "expert_model_parallel_size > 1"]),
    ],
)
def test_bad_moe_settings_on_the_cli(extra, nproc, needles, tmp_path):
    """One case per place the CLI checks MoE settings (the model config, the process layout, the
    layout against the model, the replication options): one line, exit 2, nothing written."""
    r = run_cli(["train", "tiny", *FAST, "train.train_iters=2", f"checkpoint.run_dir={tmp_path / 'run'}", *MOE_TINY, *extra], nproc=nproc)
    if nproc == 1:
        _one_line_error(r, *needles)
    else:  # every rank reports; each line is the same one-line error
        assert r.returncode != 0
        errors = {ln for ln in r.stderr.splitlines() if ln.startswith("error: ")}
        assert len(errors) == 1, r.stderr[-3000:]
        assert all(n in next(iter(errors)) for n in needles), errors
    assert not (tmp_path / "run" / "checkpoints").exists()


@pytest.mark.parametrize(
    "change,ep,tp,needle",
    [
        (
            dict(moe_aux_loss_type="global"),
            1,
            1,
            "model.moe_aux_loss_type='global': choose one of aux_loss, seq_aux_loss, global_aux_loss, none",
        ),
        (dict(moe_dense_layers=[7]), 1, 1, "model.moe_dense_layers: layer 7 does not exist"),
        (dict(num_experts=0), 2, 1, "needs a MoE model"),
        (dict(), 1, 2, "needs parallel.sequence_parallel=true"),
        (dict(moe_score_function="relu"), 1, 1, "model.moe_score_function='relu'"),
        (dict(moe_expert_bias=True), 1, 1, "moe_expert_bias=true needs model.moe_score_function=sigmoid"),
        (dict(moe_score_function="sigmoid", moe_norm_topk_prob=False), 1, 1, "moe_norm_topk_prob=false with sigmoid"),
        (dict(moe_groups=3), 1, 1, "the groups must divide model.num_experts=4"),
        (dict(moe_groups=2, moe_group_top_k=2, moe_top_k=2), 1, 1, "needs moe_top_k = 2 * moe_group_top_k"),
        (dict(moe_capacity_factor=0.0), 1, 1, "model.moe_capacity_factor=0.0 must be > 0"),
    ],
)
def test_bad_moe_settings_are_named(change, ep, tp, needle):
    from loongforge.core.errors import UserError
    from loongforge.core.foundation.families import QWEN3_MOE
    from loongforge.core.foundation.spec import ModelConfig, validate_moe

    cfg = QWEN3_MOE.resolve(ModelConfig(**{"family": "qwen3_moe", "num_experts": 4, "moe_ffn_hidden_size": 32, **change}))
    with pytest.raises(UserError, match=re.escape(needle)):
        validate_moe(cfg, ep, tp)


def test_moe_families_refuse_the_torch_stack(tmp_path):
    _one_line_error(
        run_cli(
            ["train", "tiny", *FAST, "train.train_iters=2", f"checkpoint.run_dir={tmp_path / 'run'}", *MOE_TINY, "parallel.stack=torch"]
        ),
        "qwen3_moe family",
        "parallel.stack=megatron",
    )


@pytest.mark.parametrize(
    "change,needles",
    [
        ({"use_sliding_window": True}, ["use_sliding_window=True", "qwen3_moe"]),
        ({"shared_expert_intermediate_size": 64}, ["'shared_expert_intermediate_size'", "not implemented"]),
    ],
)
def test_hf_config_features_we_do_not_implement_are_named(change, needles, hf_moe, tmp_path):
    d = tmp_path / "m"
    shutil.copytree(hf_moe, d)
    c = json.loads((d / "config.json").read_text())
    c.update(change)
    (d / "config.json").write_text(json.dumps(c))
    _one_line_error(run_cli(["convert", "hf-to-lf", str(d), str(tmp_path / "out")]), *needles)
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
def test_lora_on_a_moe_model_exports_peft_that_transformers_loads(hf_moe, rows_file, tmp_path):
    """LoRA SFT on Qwen3-MoE: adapters on the attention linears (router and experts frozen and
    adapter-free); peft on HF's Qwen3MoeForCausalLM with the exported adapter and the merged
    export both give our logits."""
    import peft
    import transformers

    r = run_cli(
        [
            "train",
            "lora",
            "train.train_iters=3",
            "train.lr_warmup_iters=0",
            "lora.dropout=0.0",
            "lora.target_modules=[linear_qkv,linear_proj]",
            "data.seq_length=256",
            "train.micro_batch_size=1",
            "train.global_batch_size=3",
            f"data.datasets=[{{path: {rows_file}, format: alpaca}}]",
            f"checkpoint.load={hf_moe}",
            f"checkpoint.run_dir={tmp_path}",
        ]
    )
    assert r.returncode == 0, r.stderr[-3000:]
    targets = json.loads((tmp_path / "hf_adapter" / "adapter_config.json").read_text())["target_modules"]
    assert sorted(targets) == ["k_proj", "o_proj", "q_proj", "v_proj"]
    ids = torch.randint(0, 500, (2, 24), generator=torch.Generator().manual_seed(0))
    ours = load_model(tmp_path)(ids)
    with torch.no_grad():
        base = transformers.AutoModelForCausalLM.from_pretrained(str(hf_moe), dtype=torch.float32).eval()
        base_logits = base(ids).logits
        theirs = peft.PeftModel.from_pretrained(base, str(tmp_path / "hf_adapter")).eval()(ids).logits
        merged = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"), dtype=torch.float32).eval()(ids).logits
    rel = lambda a, b: float((a - b).norm() / b.norm())  # noqa: E731
    assert rel(base_logits, ours) > 1e-3  # the adapters changed the model
    assert rel(theirs, ours) < 1e-5 and rel(merged, ours) < 1e-5, (rel(theirs, ours), rel(merged, ours))


def test_bf16_autocast_forward_and_backward():
    """Under bf16 autocast (the GPU trainer's compute) the router stays in fp32 (megatron's
    gating backward computes in the router's dtype) and the model trains."""
    from loongforge.core.accelerator import get_accelerator
    from loongforge.core.foundation.families import QWEN3_MOE
    from loongforge.core.foundation.spec import ModelConfig, build_gpt_model
    from loongforge.core.parallel import init_parallel

    acc = get_accelerator()
    ctx = init_parallel(1, 1, acc.backend, acc.device_type)
    cfg = QWEN3_MOE.resolve(
        ModelConfig(family="qwen3_moe", num_layers=2, num_query_groups=2, num_experts=8, moe_top_k=2, moe_ffn_hidden_size=32)
    )
    model = build_gpt_model(cfg, ctx, params_dtype=torch.bfloat16)
    x = torch.randint(0, 256, (2, 12))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = model(x, None, None, labels=x, loss_mask=torch.ones(2, 12))
    loss.backward()
    router = model.decoder.layers[0].mlp.router
    assert torch.isfinite(loss) and router.weight.grad is not None and router.weight.grad.abs().sum() > 0
