"""HF <-> LoongForge name-mapping tables and the converters they drive.

A table row names one LoongForge (megatron-core, TP=1 layout) tensor, the HF tensors it is made
of and the transform between them. The same rows serve offline conversion and online load/save.
`{i}` stands for the layer index; a row may hold more placeholders (`{e}` for experts, ...), each
repeated as the config's `repeats()` says.
"""

from __future__ import annotations

import dataclasses
import itertools
import string
from dataclasses import dataclass

import torch
from loongforge.core.errors import UserError


@dataclass(frozen=True)
class Row:
    lf: str
    hf: tuple[str, ...]
    transform: str = "copy"  # copy | qkv | concat | copies (HF-only placeholders name copies of one tensor)
    optional: bool = False  # absent on one side (tied output layer, bias off, no qk norm)
    # (placeholder, config attribute): in HF names the placeholder counts from that attribute's
    # value (DeepSeek-V3's MTP module m is HF layer num_layers + m)
    hf_shift: tuple = ()
    # the LoongForge tensor the row maps instead in a model with tied embeddings (DeepSeek-V3's
    # MTP head copies are then the embedding)
    tied: str = ""


def prefixed(table, lf_prefix: str = "", hf_prefix: str = "", rename: dict[str, str] | None = None) -> tuple[Row, ...]:
    """The table's rows with a prefix before every LoongForge and every HF name: one component's
    table placed inside a composite model (a vision tower inside a policy, say). `rename` maps
    placeholders to new ones (`{"i": "v"}`), for components whose layer counts differ."""
    subs = {f"{{{a}}}": f"{{{b}}}" for a, b in (rename or {}).items()}

    def name(n: str) -> str:
        for a, b in subs.items():
            n = n.replace(a, b)
        return n

    return tuple(
        dataclasses.replace(
            r, lf=lf_prefix + name(r.lf), hf=tuple(hf_prefix + name(h) for h in r.hf), tied=lf_prefix + name(r.tied) if r.tied else ""
        )
        for r in table
    )


def _qkv_fuse(q, k, v, groups: int):
    rest = q.shape[1:]
    q = q.reshape(groups, -1, *rest)
    k = k.reshape(groups, -1, *rest)
    v = v.reshape(groups, -1, *rest)
    return torch.cat([q, k, v], dim=1).reshape(-1, *rest)


def _qkv_split(qkv, groups: int, heads: int, head_dim: int):
    rest = qkv.shape[1:]
    per = heads // groups
    x = qkv.reshape(groups, (per + 2) * head_dim, *rest)
    q, k, v = torch.split(x, [per * head_dim, head_dim, head_dim], dim=1)
    return q.reshape(-1, *rest), k.reshape(-1, *rest), v.reshape(-1, *rest)


def repeats(cfg) -> dict[str, int]:
    """How often each placeholder of a row repeats: `{i}` over the layers, and whatever else the
    config declares through a `repeats()` method (experts, vision layers, ...)."""
    return cfg.repeats() if hasattr(cfg, "repeats") else {"i": cfg.num_layers}


def _placeholders(name: str) -> list[str]:
    return sorted({f for _, f, _, _ in string.Formatter().parse(name) if f})


def _fill(name: str, values: dict[str, int]) -> str:
    """`name` with the given placeholders filled in (others stay as they are)."""
    for k, v in values.items():
        name = name.replace(f"{{{k}}}", str(v))
    return name


def _expand(row: Row, counts: dict[str, int], cfg=None):
    """Every (LoongForge name, [HF names of each stacked slice]) of a row, over the product of the
    LoongForge name's placeholders' ranges. A placeholder only the HF names hold (`{e}` of the
    per-expert HF tensors beside a LoongForge tensor of all experts) is a stacked axis: the
    LoongForge tensor stacks one slice per value along dim 0; a row without one has one slice.
    With transform "copies", each value of such a placeholder names another HF copy of the same
    LoongForge tensor instead (one item per copy)."""
    if row.tied and getattr(cfg, "tie_word_embeddings", False):
        row = dataclasses.replace(row, lf=row.tied)
    names = _placeholders(row.lf)
    stacked = sorted({p for h in row.hf for p in _placeholders(h)} - set(names))
    missing = [n for n in names + stacked if n not in counts]
    if missing:
        raise ValueError(f"mapping row {row.lf!r}: no repeat count for {{{missing[0]}}} (config repeats: {sorted(counts)})")
    if len(stacked) > 1:
        raise ValueError(f"mapping row {row.lf!r}: more than one stacked placeholder ({stacked})")
    if stacked and not counts[stacked[0]]:
        return  # no slices to stack (the experts' rows of a model without routed experts): no tensor
    shift = {p: getattr(cfg, attr) for p, attr in row.hf_shift}
    for values in itertools.product(*(range(counts[n]) for n in names)):
        fill = dict(zip(names, values))
        hf = tuple(_fill(h, {k: v + shift.get(k, 0) for k, v in fill.items()}) for h in row.hf)
        if not stacked:
            yield _fill(row.lf, fill), [hf], False
            continue
        slices = [tuple(_fill(h, {stacked[0]: j + shift.get(stacked[0], 0)}) for h in hf) for j in range(counts[stacked[0]])]
        if row.transform == "copies":
            for one in slices:
                yield _fill(row.lf, fill), [one], False
        else:
            yield _fill(row.lf, fill), slices, True


def hf_to_lf(table, hf_state: dict, cfg) -> dict:
    """HF state dict -> LoongForge TP=1 state dict (every tensor cloned, contiguous)."""
    out = {}
    used = set()
    for row in table:
        for lf_name, slices, stacked in _expand(row, repeats(cfg), cfg):
            missing = [h for hf_names in slices for h in hf_names if h not in hf_state]
            if missing:
                if row.optional:
                    continue
                raise UserError(f"HF checkpoint lacks tensor {missing[0]!r} (needed for {lf_name})")
            parts = []
            for hf_names in slices:
                used.update(hf_names)
                parts.append(_fuse(row, [hf_state[h] for h in hf_names], cfg))
            t = torch.stack(parts) if stacked else parts[0]
            if lf_name in out:  # a second HF copy of one tensor (DeepSeek-V3's MTP modules repeat the embedding and head)
                if not torch.equal(out[lf_name], t):
                    raise UserError(
                        f"HF checkpoint tensors {', '.join(slices[0])} and the one read before them differ; LoongForge shares {lf_name}"
                    )
                continue
            out[lf_name] = t.detach().clone().contiguous()
    unused = [k for k in hf_state if k not in used and not k.endswith("rotary_emb.inv_freq")]
    if getattr(cfg, "tie_word_embeddings", False):
        unused = [k for k in unused if k != "lm_head.weight"]
    if unused:
        raise UserError(f"HF checkpoint has tensor {unused[0]!r} that this family does not map ({len(unused)} unmapped)")
    return out


def _fuse(row: Row, ts: list, cfg) -> torch.Tensor:
    """A row's HF parts -> its LoongForge tensor (one slice of it, for a stacked row)."""
    if row.transform == "qkv":
        return _qkv_fuse(*ts, groups=cfg.num_query_groups)
    if row.transform == "concat":
        return torch.cat(ts, dim=0)
    (t,) = ts
    return t


def lf_to_hf(table, lf_state: dict, cfg, partial: bool = False) -> dict:
    """LoongForge TP=1 state dict -> HF state dict. `partial`: `lf_state` holds only some of the
    model's tensors (what a run trained, say); the HF tensors of those, the others skipped."""
    out = {}
    for row in table:
        for lf_name, slices, stacked in _expand(row, repeats(cfg), cfg):
            if lf_name not in lf_state:
                if row.optional or partial:
                    continue
                raise UserError(f"checkpoint lacks tensor {lf_name!r}")
            t = lf_state[lf_name]
            for hf_names, part in zip(slices, t.unbind(0) if stacked else (t,)):
                for h, p in zip(hf_names, _split(row, part, cfg)):
                    out[h] = p.detach().clone().contiguous()
    return out


def _split(row: Row, t: torch.Tensor, cfg) -> tuple:
    """One LoongForge tensor (or anything laid out like it along dim 0) -> its HF parts."""
    if row.transform == "qkv":
        return _qkv_split(t, cfg.num_query_groups, cfg.num_attention_heads, cfg.kv_channels)
    if row.transform == "concat":
        return torch.chunk(t, len(row.hf), dim=0)
    return (t,)


def lora_to_peft(table, lf_state: dict, cfg, module_name=None) -> tuple[dict, list[str]]:
    """LoRA adapters of a TP=1 LoongForge state dict -> PEFT tensors, and the HF module names
    that carry them. A fused linear's A serves each of its HF parts; its B splits like the weight
    (so `B_q A` is exactly the q rows of the fused update). `module_name`: an HF checkpoint's
    module name -> the module's path in the transformers model, where the two differ (PEFT names
    modules by the model's paths; Qwen2.5-VL checkpoints say `model.layers.` for the model's
    `model.language_model.layers.`)."""
    module_name = module_name or (lambda name: name)
    out, modules = {}, []
    for row in table:
        if not row.lf.endswith(".weight"):
            continue
        for lf_name, slices, stacked in _expand(row, repeats(cfg), cfg):
            base = lf_name.removesuffix("weight")
            if stacked or base + "lora_a" not in lf_state:  # (experts carry no adapters)
                continue
            a = lf_state[base + "lora_a"]
            for h, b in zip(slices[0], _split(row, lf_state[base + "lora_b"], cfg)):
                mod = module_name(h.removesuffix(".weight"))
                out[f"base_model.model.{mod}.lora_A.weight"] = a.detach().clone().contiguous()
                out[f"base_model.model.{mod}.lora_B.weight"] = b.detach().clone().contiguous()
                modules.append(mod)
    return out, modules
