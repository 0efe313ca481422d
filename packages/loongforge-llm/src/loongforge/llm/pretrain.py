"""The pretraining recipe, and the setup every LLM recipe shares (`train`): core's trainer hooks
filled with a megatron-core GPT model stage, the recipe's data and HF import/export."""

from __future__ import annotations

import dataclasses
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator, Optional

import torch.distributed as dist

from loongforge.core.accelerator import get_accelerator
from loongforge.core.checkpoint import find_checkpoint, load_megatron, read_manifest, verify_files
from loongforge.core.errors import UserError
from loongforge.core.foundation import hf_io
from loongforge.core.foundation.hf_mapping import hf_to_lf as map_hf_to_lf
from loongforge.core.foundation.lora import is_adapter_key
from loongforge.core.foundation.model import load_lf_state
from loongforge.core.foundation.spec import ModelConfig, build_gpt_model
from loongforge.core.ops import OpTable
from loongforge.core.parallel import init_parallel, on_rank0
from loongforge.core.registry import registry
from loongforge.core.train.trainer import Trainer, TrainHooks, fingerprint, move_aside, prepare_run_dir
from loongforge.llm import data as text_data
from loongforge.llm.model_io import copy_tokenizer, lf_to_hf, lf_to_peft, model_config_from_manifest, run_converter_subprocess
from loongforge.llm.tokenizer import load_tokenizer, resolve_tokenizer_path


def resolve_model_config(cfg) -> tuple[ModelConfig, str | None]:
    """The model config, and where its starting weights come from ('hf', 'lf' or None)."""
    load = cfg.checkpoint.load
    if load:
        if hf_io.is_hf_dir(load):
            fam, mcfg = hf_io.read_hf_config(load, {n: registry().get("family", n) for n in registry().names("family")})
            return fam.resolve(mcfg), "hf"
        step = find_checkpoint(load)
        if step is None:
            raise UserError(f"checkpoint.load={load}: neither an HF model directory nor a LoongForge checkpoint")
        return model_config_from_manifest(read_manifest(step)), "lf"
    fam = registry().get("family", cfg.model.family)
    return fam.resolve(cfg.model), None


def validate(cfg, mcfg: ModelConfig, tok, world: int) -> None:
    t, par = cfg.train, cfg.parallel
    mp = par.tensor_model_parallel_size * par.pipeline_model_parallel_size
    dp = world // mp
    if t.global_batch_size % (t.micro_batch_size * dp):
        raise UserError(
            f"train.global_batch_size={t.global_batch_size} must be a multiple of micro_batch_size*data_parallel_size={t.micro_batch_size * dp}"
        )
    if mcfg.vocab_size % par.tensor_model_parallel_size:
        raise UserError(f"model.vocab_size={mcfg.vocab_size} must be divisible by tensor_model_parallel_size={par.tensor_model_parallel_size}")
    if len(tok) > mcfg.vocab_size:
        raise UserError(f"tokenizer has {len(tok)} tokens but model.vocab_size is {mcfg.vocab_size}; raise model.vocab_size or use a matching tokenizer")
    if cfg.data.seq_length > mcfg.max_position_embeddings:
        raise UserError(f"data.seq_length={cfg.data.seq_length} exceeds model.max_position_embeddings={mcfg.max_position_embeddings}")
    cfg.lora.validate()
    if cfg.checkpoint.load_optimizer and (not cfg.checkpoint.load or hf_io.is_hf_dir(cfg.checkpoint.load)):
        raise UserError("checkpoint.load_optimizer=true takes the optimizer state of a LoongForge checkpoint: set checkpoint.load to one (HF directories hold none)")
    if cfg.checkpoint.load_optimizer:
        step = find_checkpoint(cfg.checkpoint.load)
        if step is not None and read_manifest(step)["trainer"]["optimizer_steps"] == 0:
            raise UserError(f"{step} holds no optimizer state (no optimizer step was taken); drop checkpoint.load_optimizer")
    if cfg.checkpoint.load_optimizer and cfg.lora.enabled:
        raise UserError("checkpoint.load_optimizer=true cannot be combined with LoRA (the base checkpoint's optimizer state is for all weights)")
    if cfg.lora.enabled and not cfg.checkpoint.load:
        raise UserError("lora.rank > 0 trains adapters on frozen weights: set checkpoint.load to the base model (HF directory or LoongForge checkpoint)")


def run_identity(cfg, mcfg: ModelConfig) -> str:
    t = dataclasses.asdict(cfg.train)
    for k in ("train_iters", "log_interval", "eval_interval", "eval_iters", "save_interval", "max_bad_steps", "recompute"):
        t.pop(k)
    return fingerprint({"model": dataclasses.asdict(mcfg), "data": dataclasses.asdict(cfg.data), "train": t, "load": cfg.checkpoint.load,
                        "lora": dataclasses.asdict(cfg.lora)})


def check_same_model(saved: ModelConfig, wanted: ModelConfig, where: Path) -> None:
    for f in dataclasses.fields(ModelConfig):
        a, b = getattr(saved, f.name), getattr(wanted, f.name)
        if a != b:
            raise UserError(f"cannot resume from {where}: its model.{f.name} is {a!r}, the config asks for {b!r}")


def ensure_data(cfg, tok, run_dir: Path) -> list:
    """`data.data_path` as given, or the raw `data.corpus` preprocessed once into run_dir/data."""
    if cfg.data.data_path:
        return cfg.data.data_path
    if not cfg.data.corpus:
        raise UserError("set data.data_path (preprocessed prefixes) or data.corpus (raw text files)")
    prefix = run_dir / "data" / "corpus_text_document"
    if not Path(f"{prefix}.idx").is_file():
        on_rank0(lambda: text_data.preprocess([str(resolve_corpus(c)) for c in cfg.data.corpus], tok, str(prefix)))
    return [str(prefix)]


def resolve_corpus(item: str) -> Path:
    if item == "tiny":
        return Path(__file__).parent / "assets" / "tiny_corpus.jsonl"
    return Path(item)


@dataclass
class RunData:
    """What a recipe's data side gives the shared training setup."""

    batches: Callable[[int], Iterator[list[dict]]]  # first step -> micro-batch lists (with loss_weights)
    tokens_per_step: int
    micro_batch_rows: int  # rows of one micro-batch (1 for THD packs)
    eval_batches: Optional[Callable[[], list]] = None


def with_mean_weights(mbs: list[dict]) -> list[dict]:
    """Each micro-batch's loss is the mean over its unmasked tokens."""
    for mb in mbs:
        mask = mb["loss_mask"].float()
        mb["loss_weights"] = mask / mask.sum().clamp(min=1)
    return mbs


def pretrain_data(cfg, tok, ctx, run_dir: Path, device) -> RunData:
    data_cfg = dataclasses.replace(cfg.data, data_path=ensure_data(cfg, tok, run_dir))
    t = cfg.train
    n_evals = (t.train_iters // t.eval_interval + 1) if t.eval_interval else 0
    train_ds, valid_ds, _ = text_data.build_gpt_datasets(
        data_cfg, tok, t.seed, [t.train_iters * t.global_batch_size, max(1, n_evals * t.eval_iters * t.global_batch_size), 0],
        run_dir / "data" / "cache",
    )

    def batches(start):
        for mbs in text_data.step_batches(train_ds, start, t.global_batch_size, t.micro_batch_size, ctx.dp_rank, ctx.dp_size, device):
            yield with_mean_weights(mbs)

    def eval_batches():
        if valid_ds is None:
            return []
        it = text_data.step_batches(valid_ds, 0, t.global_batch_size, t.micro_batch_size, ctx.dp_rank, ctx.dp_size, device)
        return [with_mean_weights(next(it)) for _ in range(t.eval_iters)]

    return RunData(batches, t.global_batch_size * cfg.data.seq_length, t.micro_batch_size, eval_batches if t.eval_interval else None)


def run(cfg) -> dict:
    return train(cfg, pretrain_data)


def train(cfg, make_data: Callable) -> dict:
    """The setup every LLM recipe shares: devices and groups, tokenizer, model config and its
    starting weights, run directory, then core's trainer. `make_data(cfg, tok, ctx, run_dir,
    device)` returns the recipe's RunData."""
    acc = get_accelerator()
    par = cfg.parallel
    ctx = init_parallel(par.tensor_model_parallel_size, par.pipeline_model_parallel_size, acc.backend, acc.device_type)
    tok = load_tokenizer(cfg.data.tokenizer)
    mcfg, source = resolve_model_config(cfg)
    validate(cfg, mcfg, tok, dist.get_world_size())
    ops = OpTable.build(cfg.ops, registry(), acc.device_type)
    run_dir = Path(cfg.checkpoint.run_dir)
    identity = run_identity(cfg, mcfg)
    resume_from = prepare_run_dir(cfg.checkpoint, identity)
    if resume_from is not None:
        check_same_model(model_config_from_manifest(read_manifest(resume_from)), mcfg, resume_from)

    def prepare():
        if resume_from is None and cfg.checkpoint.overwrite:
            moved = move_aside(run_dir)
            if moved:
                print(f"moved the previous checkpoints to {moved}", flush=True)
        run_dir.mkdir(parents=True, exist_ok=True)
        if not (run_dir / "tokenizer").exists():
            (run_dir / "tokenizer").mkdir()
            copy_tokenizer(resolve_tokenizer_path(cfg.data.tokenizer), run_dir / "tokenizer")

    on_rank0(prepare)
    device = acc.device()
    data = make_data(cfg, tok, ctx, run_dir, device)
    t = cfg.train

    lora = cfg.lora if cfg.lora.enabled else None

    def build():
        return build_gpt_model(mcfg, ctx, ops, recompute=t.recompute, lora=lora).to(device)

    def initial_weights(model, optimizer):
        """The starting weights (for LoRA: the frozen base, which its checkpoints do not hold),
        and with checkpoint.load_optimizer the AdamW state of the LoongForge checkpoint (returning
        how many steps it has seen, for AdamW's bias correction after a resume)."""
        if source is None:
            return
        src = cfg.checkpoint.load
        if source == "hf" and ctx.tp_size * ctx.pp_size == 1:
            load_lf_state(model, map_hf_to_lf(registry().get("family", mcfg.family).mapping, hf_io.load_hf_state(src), mcfg))
            return
        if source == "hf":
            # Convert once on rank 0 into a TP=1 checkpoint; dist_checkpointing reshards it.
            tmp = run_dir / "hf_import"

            def convert():
                if find_checkpoint(tmp) is None:
                    shutil.rmtree(tmp, ignore_errors=True)
                    run_converter_subprocess("hf-to-lf", src, tmp)

            on_rank0(convert)
            src = tmp
        step = find_checkpoint(src)
        on_rank0(lambda: verify_files(step))
        if optimizer is not None and cfg.checkpoint.load_optimizer:
            done = read_manifest(step)["trainer"]["optimizer_steps"]
            # the moments keep their own bias-correction count; the run's step and LR schedule start at 0
            load_megatron(step, model, optimizer, optimizer_steps=done)
            return done
        load_megatron(step, model, select=lambda k: not is_adapter_key(k))

    def on_saved(step_dir: Path, final: bool):
        if final and cfg.checkpoint.export_hf:
            single = dist.get_world_size() == 1
            export_hf(step_dir, run_dir / "hf", in_process=single)
            if lora is not None:
                export_hf(step_dir, run_dir / "hf_adapter", in_process=single, direction="lf-to-peft")

    hooks = TrainHooks(
        build=build,
        batches=data.batches,
        act_shape=(cfg.data.seq_length, data.micro_batch_rows, mcfg.hidden_size),
        tokens_per_step=data.tokens_per_step,
        flops_per_token=mcfg.flops_per_token(cfg.data.seq_length, frozen_weights=lora is not None),
        eval_batches=data.eval_batches,
        initial_weights=initial_weights,
        on_saved=on_saved,
        save_trainable_only=lora is not None,
        ops=ops,
    )
    run_config = dataclasses.asdict(cfg)
    run_config["model"] = dataclasses.asdict(mcfg)
    trainer = Trainer(t, cfg.checkpoint, ctx, acc, hooks, run_config, identity)
    return trainer.run(resume_from)


def export_hf(step_dir: Path, out: Path, in_process: bool, direction: str = "lf-to-hf") -> None:
    """Write `out` from a checkpoint: an HF model directory (LoRA merged in), or with
    direction="lf-to-peft" the LoRA adapter in PEFT's format. A previous export there is
    replaced only once the new one is complete."""
    new = out.with_name(out.name + ".new")
    shutil.rmtree(new, ignore_errors=True)
    if in_process:
        (lf_to_hf if direction == "lf-to-hf" else lf_to_peft)(step_dir, new)
    else:
        run_converter_subprocess(direction, step_dir, new)
    if out.exists():
        shutil.rmtree(out)
    new.rename(out)
    print(f"exported {'HF model' if direction == 'lf-to-hf' else 'PEFT adapter'} to {out}", flush=True)
