"""The pretraining recipe, and what every LLM recipe shares (`train`): a `CausalLMTask` (core's
training-task contract for next-token prediction of a decoder family) on the stack the config
asks for, with the recipe's data and HF import/export."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator, Optional

import torch
import torch.distributed as dist
from loongforge.core.accelerator import get_accelerator
from loongforge.core.checkpoint import find_checkpoint, read_manifest, verify_files
from loongforge.core.data import rank_micro_batches
from loongforge.core.data.text import copy_tokenizer, load_tokenizer, resolve_tokenizer_path
from loongforge.core.errors import UserError
from loongforge.core.foundation import hf_io
from loongforge.core.foundation.hf_mapping import hf_to_lf as map_hf_to_lf
from loongforge.core.foundation.lora import is_adapter_key
from loongforge.core.foundation.moe import moe_metrics, routers
from loongforge.core.foundation.spec import MODEL_TRAINING_FIELDS, ModelConfig, build_gpt_model, validate_moe
from loongforge.core.ops import OpTable
from loongforge.core.outputs import replaced_dir
from loongforge.core.parallel import on_rank0
from loongforge.core.registry import registry
from loongforge.core.stacks.build import build_stack
from loongforge.core.train.precision import resolve_params_dtype
from loongforge.core.train.run_dir import files_identity, fingerprint, prepare_run_dir, run_identity, start_run_dir, weight_source
from loongforge.core.train.task import TrainingTask
from loongforge.core.train.trainer import Trainer
from loongforge.llm import data as text_data
from loongforge.llm.model_io import checkpoint_stack, lf_to_hf, lf_to_peft, model_config_from_manifest, run_converter_subprocess


def resolve_model_config(cfg) -> tuple[ModelConfig, str | None]:
    """The model config, and where its starting weights come from ('hf', 'lf' or None). Loaded
    weights give the architecture; the model section's training options (MODEL_TRAINING_FIELDS)
    come from the run's config."""
    source, where = weight_source(cfg.checkpoint.load)
    if source is None:
        return registry().get("family", cfg.model.family).resolve(cfg.model), None
    if source == "hf":
        fam, mcfg = hf_io.read_hf_config(where, {n: registry().get("family", n) for n in registry().names("family")})
        mcfg = fam.resolve(mcfg)
    else:
        mcfg = model_config_from_manifest(read_manifest(where))
    return dataclasses.replace(mcfg, **{f: getattr(cfg.model, f) for f in MODEL_TRAINING_FIELDS}), source


def validate(cfg, mcfg: ModelConfig, tok) -> None:
    """The LLM-specific checks (core checks the batch sizes against the layout)."""
    par = cfg.parallel
    if mcfg.vocab_size % par.tensor_model_parallel_size:
        raise UserError(
            f"model.vocab_size={mcfg.vocab_size} must be divisible by tensor_model_parallel_size={par.tensor_model_parallel_size}"
        )
    if len(tok) > mcfg.vocab_size:
        raise UserError(
            f"tokenizer has {len(tok)} tokens but model.vocab_size is {mcfg.vocab_size}; raise model.vocab_size or use a matching tokenizer"
        )
    sequence_parallel = par.sequence_parallel and par.tensor_model_parallel_size > 1
    validate_moe(mcfg, par.expert_model_parallel_size, par.tensor_model_parallel_size, sequence_parallel)
    if sequence_parallel and cfg.data.seq_length % par.tensor_model_parallel_size:
        raise UserError(
            f"data.seq_length={cfg.data.seq_length} must be divisible by tensor_model_parallel_size={par.tensor_model_parallel_size} "
            "with parallel.sequence_parallel=true (each TP rank holds an equal share of the sequence)"
        )
    if par.stack != "megatron" and (mcfg.num_experts or mcfg.kv_lora_rank or mcfg.mtp_num_layers):
        raise UserError(
            f"the {mcfg.family} family (experts, latent attention, multi-token prediction) runs on the megatron stack: set parallel.stack=megatron"
        )
    if cfg.data.seq_length > mcfg.max_position_embeddings:
        raise UserError(f"data.seq_length={cfg.data.seq_length} exceeds model.max_position_embeddings={mcfg.max_position_embeddings}")
    cfg.lora.validate()
    if cfg.lora.enabled and par.stack != "megatron":
        raise UserError("LoRA runs on the megatron stack: set parallel.stack=megatron (or lora.rank=0)")
    if cfg.checkpoint.load_optimizer and (not cfg.checkpoint.load or hf_io.is_hf_dir(cfg.checkpoint.load)):
        raise UserError(
            "checkpoint.load_optimizer=true takes the optimizer state of a LoongForge checkpoint: set checkpoint.load to one (HF directories hold none)"
        )
    if cfg.checkpoint.load_optimizer:
        step = find_checkpoint(cfg.checkpoint.load)
        if step is not None and read_manifest(step)["trainer"]["optimizer_steps"] == 0:
            raise UserError(f"{step} holds no optimizer state (no optimizer step was taken); drop checkpoint.load_optimizer")
    if cfg.checkpoint.load_optimizer and cfg.lora.enabled:
        raise UserError(
            "checkpoint.load_optimizer=true cannot be combined with LoRA (the base checkpoint's optimizer state is for all weights)"
        )
    if cfg.lora.enabled and not cfg.checkpoint.load:
        raise UserError(
            "lora.rank > 0 trains adapters on frozen weights: set checkpoint.load to the base model (HF directory or LoongForge checkpoint)"
        )
    if cfg.checkpoint.load and not hf_io.is_hf_dir(cfg.checkpoint.load):
        saved = checkpoint_stack(read_manifest(find_checkpoint(cfg.checkpoint.load)))
        if saved != par.stack:
            raise UserError(
                f"checkpoint.load={cfg.checkpoint.load} was saved by the {saved} stack and parallel.stack={par.stack}: "
                f"export it first (`loongforge-llm convert lf-to-hf {cfg.checkpoint.load} OUT`) and load OUT"
            )


def check_same_model(saved: ModelConfig, wanted: ModelConfig, where: Path) -> None:
    for f in dataclasses.fields(ModelConfig):
        a, b = getattr(saved, f.name), getattr(wanted, f.name)
        if a != b:
            raise UserError(f"cannot resume from {where}: its model.{f.name} is {a!r}, the config asks for {b!r}")


def ensure_data(cfg, tok, run_dir: Path) -> list:
    """`data.data_path` as given, or the raw `data.corpus` preprocessed once into
    run_dir/data/corpus-<key>, the key naming the source files (path, size, modification time)
    and the tokenizer's: a changed corpus or tokenizer is preprocessed again, never reused."""
    if cfg.data.data_path:
        return cfg.data.data_path
    if not cfg.data.corpus:
        raise UserError("set data.data_path (preprocessed prefixes) or data.corpus (raw text files)")
    sources = [resolve_corpus(c) for c in cfg.data.corpus]
    for src in sources:
        if not src.is_file():
            raise UserError(f"data.corpus: {src} is not a file")
    tok_files = sorted(p for p in resolve_tokenizer_path(cfg.data.tokenizer).iterdir() if p.is_file())
    key = fingerprint({"corpus": files_identity(sources), "tokenizer": files_identity(tok_files)})
    out = run_dir / "data" / f"corpus-{key}"
    prefix = out / "corpus_text_document"

    def build():
        if Path(f"{prefix}.idx").is_file():
            return
        with replaced_dir(out) as tmp:
            text_data.preprocess([str(s) for s in sources], tok, str(tmp / prefix.name))

    on_rank0(build)
    return [str(prefix)]


def _data_files(prefixes) -> list[Path]:
    """The .bin/.idx files of `data.data_path` (a list of prefixes, optionally weighted)."""
    return [Path(f"{p}{suffix}") for p in prefixes if not _is_number(p) for suffix in (".bin", ".idx")]


def _is_number(item) -> bool:
    try:
        float(item)
    except (TypeError, ValueError):
        return False
    return True


def resolve_corpus(item: str) -> Path:
    if item == "tiny":
        return Path(__file__).parent / "assets" / "tiny_corpus.jsonl"
    return Path(item)


@dataclass
class RunData:
    """What a recipe's data side gives the shared training setup: micro-batches with `tokens`,
    `labels` and `loss_weights` ([rows, seq] floats: a token's share of the loss before the
    trainer's normalization by the global sum of weights; optionally `packed_seq_params`)."""

    batches: Callable[[int], Iterator[list[dict]]]  # first step -> this rank's micro-batch lists
    tokens_per_step: int
    micro_batch_rows: int  # rows of one micro-batch (1 for THD packs)
    eval_batches: Optional[Callable[[], list]] = None


def stack_samples(samples: list[dict], device, weights: str = "loss_mask") -> dict:
    """One micro-batch from same-length samples: `tokens`, `labels`, and their `weights` key as
    `loss_weights`."""
    return {
        "tokens": torch.stack([s["tokens"] for s in samples]).to(device),
        "labels": torch.stack([s["labels"] for s in samples]).to(device),
        "loss_weights": torch.stack([s[weights] for s in samples]).float().to(device),
    }


def pretrain_data(cfg, tok, dp_rank: int, dp_size: int, run_dir: Path, device) -> RunData:
    data_cfg = dataclasses.replace(cfg.data, data_path=ensure_data(cfg, tok, run_dir))
    t = cfg.train
    n_evals = (t.train_iters // t.eval_interval + 1) if t.eval_interval else 0
    train_ds, valid_ds, _ = text_data.build_gpt_datasets(
        data_cfg,
        tok,
        t.seed,
        [t.train_iters * t.global_batch_size, max(1, n_evals * t.eval_iters * t.global_batch_size), 0],
        run_dir / "data" / f"cache-{fingerprint(files_identity(_data_files(data_cfg.data_path)))}",
    )

    def step_mbs(ds, step):
        return [
            stack_samples([ds[i % len(ds)] for i in idx], device)
            for idx in rank_micro_batches(step, t.global_batch_size, t.micro_batch_size, dp_rank, dp_size)
        ]

    def batches(start):
        step = start
        while True:
            yield step_mbs(train_ds, step)
            step += 1

    def eval_batches():
        return [] if valid_ds is None else [step_mbs(valid_ds, k) for k in range(t.eval_iters)]

    return RunData(batches, t.global_batch_size * cfg.data.seq_length, t.micro_batch_size, eval_batches if t.eval_interval else None)


class CausalLMTask(TrainingTask):
    """Next-token prediction of a decoder family: a megatron-core GPT stage (megatron stack) or
    the family's HF model as-is (torch stack), the loss the weighted sum of the tokens'
    cross-entropies (fused with the output projection through the op table)."""

    unit = "tokens"

    def __init__(self, cfg, mcfg: ModelConfig, source: str | None, stack, ctx, ops: OpTable, data: RunData, device, run_dir: Path):
        self.cfg, self.mcfg, self.source, self.stack, self.ctx, self.ops = cfg, mcfg, source, stack, ctx, ops
        self.data, self.device, self.run_dir = data, device, run_dir
        self.lora = cfg.lora if cfg.lora.enabled else None
        self.megatron = cfg.parallel.stack == "megatron"
        self.units_per_step = data.tokens_per_step
        self.flops_per_step = mcfg.flops_per_token(cfg.data.seq_length, frozen_weights=self.lora is not None) * data.tokens_per_step
        # (under sequence parallelism a stage sends its TP rank's share of the sequence)
        seq = cfg.data.seq_length // ctx.tp_size if ctx is not None and ctx.sequence_parallel else cfg.data.seq_length
        self.activation_shape = (seq, data.micro_batch_rows, mcfg.hidden_size)
        self.trainable_only = self.lora is not None
        self.family = registry().get("family", mcfg.family)
        self._routers = None  # the model's MoE routers, found at the first loss

    def build_model(self):
        if self.megatron:
            return build_gpt_model(
                self.mcfg,
                self.ctx,
                self.ops,
                recompute=self.cfg.train.recompute,
                lora=self.lora,
                moe_token_dispatcher_type=self.cfg.parallel.moe_token_dispatcher_type,
            ).to(self.device)
        from loongforge.core.foundation.hf_native import build_hf_causal_lm

        return build_hf_causal_lm(self.family, self.mcfg, self.ops).to(self.device)

    def batches(self, start_step):
        return self.data.batches(start_step)

    def eval_batches(self):
        return self.data.eval_batches() if self.data.eval_batches is not None else None

    def loss(self, model, mb):
        if self.megatron:
            out = model(
                mb["tokens"], None, None, labels=mb["labels"], loss_mask=mb["loss_weights"], packed_seq_params=mb.get("packed_seq_params")
            )
            if not model.post_process:
                return out  # a pipeline stage before the last: its activations
            weight = mb["loss_weights"].sum()
            if self._routers is None:
                self._routers = routers(model)
            metrics = moe_metrics(self._routers, weight)
            mtp = getattr(model, "multi_token_prediction", None)
            if mtp is not None and model.training:  # each depth's weighted loss sum: reported as its mean
                metrics.update({f"mtp_loss_{k + 1}": loss for k, loss in enumerate(mtp.losses)})
            return out, weight, metrics
        out = model(mb["tokens"], mb["labels"], mb["loss_weights"])
        return out, mb["loss_weights"].sum(), {}

    def initial_weights(self, model, optimizer, stack) -> int:
        """The starting weights (for LoRA: the frozen base, which its checkpoints do not hold),
        and with checkpoint.load_optimizer the AdamW state of the LoongForge checkpoint (returning
        how many steps it has seen, for AdamW's bias correction after a resume)."""
        if self.source is None:
            return 0
        src = self.cfg.checkpoint.load
        if self.source == "hf":
            hf_state = hf_io.load_hf_state(src)
            if self.megatron:  # the family's table maps HF names to ours; each rank takes its shards
                stack.load_full_state_dict(model, map_hf_to_lf(self.family.mapping, hf_state, self.mcfg), skip=is_adapter_key)
            else:
                stack.load_full_state_dict(model, hf_state)
            return 0
        step = find_checkpoint(src)
        on_rank0(lambda: verify_files(step))
        if optimizer is not None and self.cfg.checkpoint.load_optimizer:
            done = read_manifest(step)["trainer"]["optimizer_steps"]
            # the moments keep their own bias-correction count; the run's step and LR schedule start at 0
            stack.load(step, model, optimizer, optimizer_steps=done)
            return done
        stack.load(step, model, select=lambda k: not is_adapter_key(k))
        return 0

    def on_saved(self, step_dir: Path, final: bool) -> None:
        if final and self.cfg.checkpoint.export_hf:
            single = dist.get_world_size() == 1
            export_hf(step_dir, self.run_dir / "hf", in_process=single)
            if self.lora is not None:
                export_hf(step_dir, self.run_dir / "hf_adapter", in_process=single, direction="lf-to-peft")


def run(cfg) -> dict:
    return train(cfg, pretrain_data)


def train(cfg, make_data: Callable) -> dict:
    """The setup every LLM recipe shares: devices and groups, tokenizer, model config and its
    starting weights, run directory, then core's trainer. `make_data(cfg, tok, dp_rank, dp_size,
    run_dir, device)` returns the recipe's RunData."""
    acc = get_accelerator()
    tok = load_tokenizer(cfg.data.tokenizer)
    mcfg, source = resolve_model_config(cfg)
    params_dtype = resolve_params_dtype(cfg.train.params_dtype, acc)
    stack, ctx = build_stack(cfg.parallel, cfg.train, acc, params_dtype)
    validate(cfg, mcfg, tok)
    ops = OpTable.build(cfg.ops, registry(), acc.device_type)
    run_dir = Path(cfg.checkpoint.run_dir)
    identity = run_identity(cfg.train, model=mcfg, data=cfg.data, load=cfg.checkpoint.load, lora=cfg.lora)
    start = prepare_run_dir(cfg.checkpoint, identity)
    resume_from = start.resume_from
    if resume_from is not None:
        check_same_model(model_config_from_manifest(read_manifest(resume_from)), mcfg, resume_from)

    def copy_tok(run_dir: Path):
        # a fresh start replaces whatever tokenizer/ an earlier run left; a resume keeps its own
        if resume_from is None or not (run_dir / "tokenizer").is_dir():
            with replaced_dir(run_dir / "tokenizer") as tmp:
                copy_tokenizer(resolve_tokenizer_path(cfg.data.tokenizer), tmp)

    start_run_dir(cfg.checkpoint, start, identity, copy_tok)
    device = acc.device()
    data = make_data(cfg, tok, stack.dp_rank, stack.dp_size, run_dir, device)
    task = CausalLMTask(cfg, mcfg, source, stack, ctx, ops, data, device, run_dir)
    run_config = dataclasses.asdict(cfg)
    run_config["model"] = dataclasses.asdict(mcfg)
    trainer = Trainer(cfg.train, cfg.checkpoint, stack, acc, task, run_config, identity, ops)
    return trainer.run(resume_from, verified=True)


def export_hf(step_dir: Path, out: Path, in_process: bool, direction: str = "lf-to-hf") -> None:
    """Write `out` from a checkpoint: an HF model directory (LoRA merged in), or with
    direction="lf-to-peft" the LoRA adapter in PEFT's format. A previous export there is
    replaced only once the new one is complete and on disk."""
    with replaced_dir(out) as new:
        if in_process:
            (lf_to_hf if direction == "lf-to-hf" else lf_to_peft)(step_dir, new)
        else:
            run_converter_subprocess(direction, step_dir, new)
    print(f"exported {'HF model' if direction == 'lf-to-hf' else 'PEFT adapter'} to {out}", flush=True)
