"""VLM packs written once by `loongforge-vlm preprocess` (safetensors shards: each pack's tokens,
labels, loss weights, M-RoPE rows, sample bounds and pixels, plus a metadata file that training
checks against its own config) and read back lazily, memory-mapped, by `data.prepacked`."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from loongforge.core.errors import UserError
from loongforge.core.outputs import require_new_dir

META = "loongforge_vlm.json"
VERSION = 1
PACKS_PER_SHARD = 64
TENSORS = (
    "tokens",
    "labels",
    "loss_weights",
    "positions",
    "cu_seqlens",
    "pixel_values",
    "image_grid_thw",
    "pixel_values_videos",
    "video_grid_thw",
    "image_sizes",
    "batch_num_images",
)


def pack_identity(cfg, tok) -> dict:
    """What decides a run's packs beyond its data files: the checks `PrepackedVisionPacks` makes."""
    from loongforge.vlm.recipe import processing_identity, token_ids

    processor = processing_identity(cfg.model, dataclasses.asdict(cfg.data.image))
    identity = {
        "seq_length": cfg.data.seq_length,
        "tokenizer_size": len(tok),
        "token_ids": token_ids(tok, cfg.model.arch),
        **{f"processor.{k}": v for k, v in processor.items()},
    }
    return json.loads(json.dumps(identity))  # as the metadata file holds it (lists, not tuples)


def write_prepacked(cfg, tok, out_dir) -> dict:
    """Encode and pack `cfg.data` once into `out_dir` (new): shards of packs and the metadata.
    The demo set (data.paths=[demo]) is generated into `out_dir/data/demo`."""
    from loongforge.vlm.recipe import encoded_samples, pack_all
    from safetensors.torch import save_file
    from tqdm import tqdm

    out = require_new_dir(out_dir)
    tmp = out.with_name(out.name + ".tmp")
    tmp.mkdir(parents=True, exist_ok=True)
    samples, bad = encoded_samples(cfg, tok, tmp)
    packs, sizes, efficiency = pack_all(cfg, samples)
    for n, start in enumerate(tqdm(range(0, len(packs), PACKS_PER_SHARD), desc="write", unit="shard", mininterval=1.0)):
        tensors = {
            f"{start + i}.{key}": pack[key].contiguous()
            for i, pack in enumerate(packs[start : start + PACKS_PER_SHARD])
            for key in TENSORS
            if pack.get(key) is not None
        }
        save_file(tensors, str(tmp / f"packs-{n:05d}.safetensors"))
    meta = {
        "version": VERSION,
        **pack_identity(cfg, tok),
        "packs": len(packs),
        "samples": len(samples),
        "packing_efficiency": efficiency,
        "bad_samples": dict(bad),
        "sizes": sizes,  # per pack, per sample: [tokens, [patches of each image / video]]
        "data": dataclasses.asdict(cfg.data),
    }
    (tmp / META).write_text(json.dumps(meta))
    if out.exists():
        out.rmdir()
    tmp.rename(out)
    return {k: meta[k] for k in ("packs", "samples", "packing_efficiency", "bad_samples")} | {"output_dir": str(out)}


class PrepackedVisionPacks:
    """The packs of a `preprocess` directory, each read on demand; `sizes` give their costs."""

    def __init__(self, path, cfg, tok):
        root = Path(path)
        meta_path = root / META
        if not meta_path.is_file():
            raise UserError(f"data.prepacked={path}: not a `loongforge-vlm preprocess` output (no {META})")
        self.meta = json.loads(meta_path.read_text())
        if self.meta.get("version") != VERSION:
            raise UserError(f"data.prepacked={path}: format version {self.meta.get('version')} is not {VERSION}; preprocess again")
        want = pack_identity(cfg, tok)
        for key, value in want.items():  # a key the directory lacks (written before it was recorded) differs too
            if self.meta.get(key) != value:
                raise UserError(
                    f"data.prepacked={path} was written with {key}={self.meta.get(key)!r}, this run has {value!r}; preprocess again "
                    "with this config"
                )
        self.files = sorted(root.glob("packs-*.safetensors"))
        if len(self.files) != -(-self.meta["packs"] // PACKS_PER_SHARD):
            raise UserError(f"data.prepacked={path}: {len(self.files)} shard files for {self.meta['packs']} packs; preprocess again")
        self.sizes = self.meta["sizes"]

    def __len__(self) -> int:
        return self.meta["packs"]

    def __getitem__(self, i: int) -> dict:
        from safetensors import safe_open

        i = int(i)
        with safe_open(str(self.files[i // PACKS_PER_SHARD]), framework="pt") as f:
            names = set(f.keys())
            return {key: f.get_tensor(f"{i}.{key}") if f"{i}.{key}" in names else None for key in TENSORS}
