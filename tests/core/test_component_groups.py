"""Parallel groups per model component: `parallel.components` config (YAML, overrides, validation)
and a two-component model trained on 2 gloo processes with each component at its own TP."""

import os
from dataclasses import dataclass, field

import pytest
import torch
import torch.distributed as dist
from loongforge.core.config import ParallelConfig, load_config
from loongforge.core.config.schema import ComponentParallelConfig
from loongforge.core.errors import UserError
from loongforge.core.parallel import free_port
from loongforge.core.parallel.context import validate_components

KNOWN = ("vision", "language")


@dataclass
class Run:
    parallel: ParallelConfig = field(default_factory=ParallelConfig)


def _parallel(tp=1, pp=1, **components) -> ParallelConfig:
    return ParallelConfig(
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        components={k: ComponentParallelConfig(*v) for k, v in components.items()},
    )


def test_yaml_component_overrides(tmp_path):
    (tmp_path / "run.yaml").write_text(
        "parallel:\n  tensor_model_parallel_size: 2\n  components:\n    vision:\n      tensor_model_parallel_size: 1\n"
    )
    cfg = load_config(Run, tmp_path / "run.yaml", ["parallel.components.language.pipeline_model_parallel_size=1"])
    assert cfg.parallel.components == {"vision": ComponentParallelConfig(1, None), "language": ComponentParallelConfig(None, 1)}
    assert validate_components(cfg.parallel, 2, KNOWN) == {"vision": (1, 1), "language": (2, 1)}
    assert load_config(Run).parallel.components == {}
    with pytest.raises(
        UserError,
        match=r"unknown config key 'parallel.components.vision.tensor_parallel_size'; "
        r"did you mean 'parallel.components.vision.tensor_model_parallel_size'\?",
    ):
        load_config(Run, None, ["parallel.components.vision.tensor_parallel_size=1"])
    (tmp_path / "bad.yaml").write_text("parallel:\n  components:\n    vision:\n      pipeline_parallel: 1\n")
    with pytest.raises(UserError, match=r"unknown config key 'parallel.components.vision.pipeline_parallel'"):
        load_config(Run, tmp_path / "bad.yaml")
    with pytest.raises(UserError, match=r"config key 'parallel.components.vision' must be a mapping, got 1"):
        load_config(Run, None, ["parallel.components.vision=1"])
    with pytest.raises(UserError, match=r"config key 'parallel.components.vision.tensor_model_parallel_size': .*'abc'"):
        load_config(Run, None, ["parallel.components.vision.tensor_model_parallel_size=abc"])


def test_validate_components_errors():
    assert validate_components(_parallel(tp=2), 4, KNOWN) == {"vision": (2, 1), "language": (2, 1)}
    assert validate_components(_parallel(tp=2, vision=(1, None)), 2, KNOWN) == {"vision": (1, 1), "language": (2, 1)}
    with pytest.raises(
        UserError,
        match=r"^parallel.components.visoin: this model has no component 'visoin'; "
        r"its components are vision, language$",
    ):
        validate_components(_parallel(visoin=(1, None)), 2, KNOWN)
    with pytest.raises(
        UserError,
        match=r"^parallel.components.vision.tensor_model_parallel_size=3 does not divide the world size 2; "
        r"set parallel.components.vision.tensor_model_parallel_size to a divisor of 2$",
    ):
        validate_components(_parallel(vision=(3, None)), 2, KNOWN)
    # the global value counts for a component without an override, and the message says so
    with pytest.raises(
        UserError,
        match=r"^parallel.tensor_model_parallel_size=4 does not divide the world size 2; "
        r"set parallel.components.vision.tensor_model_parallel_size",
    ):
        validate_components(_parallel(tp=4), 2, KNOWN)
    with pytest.raises(
        UserError,
        match=r"^parallel.components.language.pipeline_model_parallel_size=2: component 'language' would run "
        r"pipeline parallelism, .*; set parallel.components.language.pipeline_model_parallel_size=1$",
    ):
        validate_components(_parallel(language=(1, 2)), 2, KNOWN)
    with pytest.raises(UserError, match=r"^parallel.pipeline_model_parallel_size=2: component 'vision'"):
        validate_components(_parallel(pp=2), 2, KNOWN)


# ---- the two-component model ------------------------------------------------------------------
PATCH, IMAGE_TOKENS, TEXT, BATCH, STEPS, LR = 12, 4, 8, 2, 4, 0.5


def _configs():
    from loongforge.core.foundation.families import LLAMA
    from loongforge.core.foundation.spec import ModelConfig

    encoder = LLAMA.resolve(ModelConfig(num_layers=1, hidden_size=64, num_attention_heads=4, ffn_hidden_size=128))
    decoder = LLAMA.resolve(ModelConfig(num_layers=2, hidden_size=64, num_attention_heads=4, ffn_hidden_size=176, vocab_size=256))
    return encoder, decoder


def _encoder(ctx):
    """Patch projection (megatron ColumnParallelLinear) and a one-layer megatron TransformerBlock
    (attention, MLP, parallel linears), built with the context's groups."""
    from loongforge.core.foundation.spec import block_spec, transformer_config
    from loongforge.core.ops import OpTable
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear
    from megatron.core.transformer.transformer_block import TransformerBlock

    cfg = _configs()[0]
    tc = transformer_config(cfg, ctx.tp_size, ctx.pp_size, torch.float32, recompute=False)

    class Encoder(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = ColumnParallelLinear(
                PATCH, cfg.hidden_size, config=tc, init_method=tc.init_method, bias=False, gather_output=True, tp_group=ctx.tp_group
            )
            self.block = TransformerBlock(tc, block_spec(cfg, OpTable(), cfg.num_layers, ctx), pg_collection=ctx.pg_collection())

        def forward(self, patches):  # [image tokens, batch, PATCH] -> [image tokens, batch, hidden]
            return self.block(self.proj(patches)[0], None)

    return Encoder()


class _GatherBatch(torch.autograd.Function):
    """All-gather along the batch dimension over `group`. The gradient arriving here is the whole
    batch's, the same on every rank (the decoder's TP ranks share it); the backward keeps this
    rank's slice times the group size: the data-parallel convention (each rank's gradient estimates
    the whole batch's), so the DP mean of the encoder's gradients is the whole batch's gradient."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts, dim=1)

    @staticmethod
    def backward(ctx, grad):
        n = dist.get_world_size(ctx.group)
        return grad.chunk(n, dim=1)[dist.get_rank(ctx.group)] * n, None


def _train(ctxs) -> dict:
    """STEPS of SGD of the encoder (context "vision") feeding the decoder (context "language") on
    fixed data; each vision DP rank encodes its share of the images. Returns the losses and the
    encoder's weights and step-1 gradients (before and after its DP mean)."""
    from loongforge.core.foundation.spec import build_gpt_model

    vision, language = ctxs["vision"], ctxs["language"]
    torch.manual_seed(0)
    encoder, decoder = _encoder(vision), build_gpt_model(_configs()[1], language)
    opt = torch.optim.SGD([*encoder.parameters(), *decoder.parameters()], lr=LR)
    gen = torch.Generator().manual_seed(1)
    images = torch.randn(IMAGE_TOKENS, BATCH, PATCH, generator=gen)
    tokens = torch.randint(0, 256, (BATCH, TEXT + 1), generator=gen)
    share = BATCH // vision.dp_size
    mine = images[:, vision.dp_rank * share : (vision.dp_rank + 1) * share]
    # the decoder reads [image tokens, text]; the loss is the mean over the text's next tokens
    labels = torch.cat([torch.zeros(BATCH, IMAGE_TOKENS, dtype=tokens.dtype), tokens[:, 1:]], 1)
    weights = torch.cat([torch.zeros(BATCH, IMAGE_TOKENS), torch.full((BATCH, TEXT), 1.0 / (BATCH * TEXT))], 1)

    def encoder_state(what):
        return {n: getattr(p, what).detach().clone() for n, p in encoder.named_parameters()}

    out = {"losses": [], "encoder_init": encoder_state("data")}
    for step in range(STEPS):
        opt.zero_grad(set_to_none=True)
        image_tokens = _GatherBatch.apply(encoder(mine), vision.dp_group)
        hidden = torch.cat([image_tokens, decoder.embedding(input_ids=tokens[:, :-1], position_ids=None)])
        loss = decoder(None, None, None, decoder_input=hidden, labels=labels, loss_mask=weights)
        loss.backward()
        if step == 0:
            out["grad_local"] = encoder_state("grad")
        for ctx, module in ((vision, encoder), (language, decoder)):
            if ctx.dp_size > 1:
                for p in module.parameters():
                    dist.all_reduce(p.grad, group=ctx.dp_group)
                    p.grad /= ctx.dp_size
        if step == 0:
            out["grad"] = encoder_state("grad")
        opt.step()
        out["losses"].append(loss.item())
    out["encoder_final"] = encoder_state("data")
    return out


def _ranks(group):
    return None if group is None else dist.get_process_group_ranks(group)


def _worker(rank: int, port: int, out_dir: str) -> None:
    os.environ.update(
        LOONGFORGE_DEVICE="cpu", RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)
    )
    torch.set_num_threads(1)
    from loongforge.core.accelerator import get_accelerator
    from loongforge.core.parallel import init_parallel
    from loongforge.core.parallel.context import component_contexts
    from megatron.core import parallel_state as ps

    acc = get_accelerator()
    default = init_parallel(2, 1, acc.backend, acc.device_type)  # megatron's globals: the model's TP=2
    ctxs = component_contexts({"vision": (1, 1), "language": (2, 1), "stages": (1, 2)})
    out = _train(ctxs)
    out["layouts"] = {name: c.layout() for name, c in ctxs.items()}
    out["groups"] = {
        name: {k: _ranks(getattr(c, f"{k}_group")) for k in ("tp", "pp", "dp", "mp", "cp", "embedding", "pos_embedding")}
        for name, c in ctxs.items()
    }
    out["megatron_tp"] = _ranks(ps.get_tensor_model_parallel_group())
    out["default_uses_megatron_tp"] = default.pg_collection().tp is ps.get_tensor_model_parallel_group()
    out["pg_tp_is_own"] = ctxs["vision"].pg_collection().tp is ctxs["vision"].tp_group
    torch.save(out, os.path.join(out_dir, f"rank{rank}.pt"))
    dist.destroy_process_group()


def _close(got, want, rel=1e-5):
    return all((got[n] - want[n]).abs().max() <= rel * want[n].abs().max() for n in want)


@pytest.mark.slow
def test_two_components_on_two_ranks_match_single_process(tmp_path):
    """A TP=1 encoder (vision: DP=2) feeding a TP=2 decoder (language: DP=1) on 2 gloo ranks,
    megatron's globals at TP=2, against the same model in one process (both components TP=1).

    Data split: the decoder's two TP ranks need the whole batch; each vision DP rank encodes a
    different half of the images and the halves are all-gathered into the decoder's batch. So the
    two encoder replicas see different data and their local gradients differ (checked): only
    averaging them over the vision DP group gives the single-process gradient (checked at step 1)
    and keeps the replicas identical (checked after the last step). Weights start identical to the
    single-process model's (megatron's CPU init), and the losses match for 4 SGD steps and fall."""
    from loongforge.core.accelerator import get_accelerator
    from loongforge.core.parallel import init_parallel
    from loongforge.core.parallel.context import component_contexts

    acc = get_accelerator()
    init_parallel(1, 1, acc.backend, acc.device_type)
    ref = _train(component_contexts({"vision": (1, 1), "language": (1, 1)}))

    torch.multiprocessing.spawn(_worker, args=(free_port(), str(tmp_path)), nprocs=2, join=True)
    runs = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]

    for r, run in enumerate(runs):
        assert run["layouts"]["vision"] == {"tensor_model_parallel_size": 1, "pipeline_model_parallel_size": 1, "data_parallel_size": 2}
        assert run["layouts"]["language"] == {"tensor_model_parallel_size": 2, "pipeline_model_parallel_size": 1, "data_parallel_size": 1}
        g = run["groups"]
        assert g["vision"] == {"tp": [r], "pp": [r], "dp": [0, 1], "mp": [r], "cp": [r], "embedding": None, "pos_embedding": None}
        assert g["language"] == {"tp": [0, 1], "pp": [r], "dp": [r], "mp": [0, 1], "cp": [r], "embedding": None, "pos_embedding": None}
        assert g["language"]["tp"] == run["megatron_tp"]  # megatron's rank order
        assert g["stages"] == {
            "tp": [r],
            "pp": [0, 1],
            "dp": [r],
            "mp": [0, 1],
            "cp": [r],
            "embedding": [0, 1],
            "pos_embedding": [0] if r == 0 else None,
        }
        assert run["default_uses_megatron_tp"] and run["pg_tp_is_own"]
        assert all(torch.equal(run["encoder_init"][n], w) for n, w in ref["encoder_init"].items())
        assert _close(run["grad"], ref["grad"]), r
        for step, (got, want) in enumerate(zip(run["losses"], ref["losses"]), 1):
            assert abs(got - want) <= 1e-5 * abs(want), (r, step, got, want)
    # the replicas saw different data: their own gradients differ and neither is the whole batch's
    assert not _close(runs[0]["grad_local"], runs[1]["grad_local"], rel=1e-2)
    assert not _close(runs[0]["grad_local"], ref["grad"], rel=1e-2)
    assert all(torch.equal(runs[0]["encoder_final"][n], runs[1]["encoder_final"][n]) for n in ref["encoder_final"])
    assert _close(runs[0]["encoder_final"], ref["encoder_final"])
    assert ref["losses"][-1] < ref["losses"][0] - 0.05, ref["losses"]
