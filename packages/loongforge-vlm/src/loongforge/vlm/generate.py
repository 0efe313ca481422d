"""`loongforge-vlm generate`: a greedy answer to a prompt about images, from a trained run (its
tokenizer and image processing) or an HF Qwen2.5-VL directory (its own processor config)."""

from __future__ import annotations

from pathlib import Path

from loongforge.core.checkpoint import find_checkpoint, read_manifest
from loongforge.core.data.text import load_tokenizer, tokenizer_dir_for
from loongforge.core.errors import UserError
from loongforge.core.foundation import hf_io


def processor_for(model_path, cfg):
    """The image processing a model was trained with: a run's `data.image` section, or an HF
    directory's preprocessor_config.json (Qwen2-VL's defaults where it has none)."""
    from loongforge.vlm.data import VisionProcessorConfig
    from loongforge.vlm.recipe import processor_config

    if hf_io.is_hf_dir(model_path):
        v = cfg.tower
        return VisionProcessorConfig.from_hf(
            model_path, patch_size=v.patch_size, temporal_patch_size=v.temporal_patch_size, merge_size=v.spatial_merge_size
        )
    return processor_config(cfg, read_manifest(find_checkpoint(model_path))["config"].get("data", {}).get("image", {}))


def answer(model_path, prompt: str, images: list, max_new_tokens: int = 16) -> str:
    from loongforge.vlm.data import VisionRecord, VisionSampleEncoder
    from loongforge.vlm.model_io import load_model

    for img in images:
        if not Path(img).is_file():
            raise UserError(f"--image {img}: no such file")
    tok_dir = tokenizer_dir_for(model_path)
    if tok_dir is None:
        raise UserError(f"{model_path}: no tokenizer next to the model (a run's tokenizer/ or an HF directory's tokenizer files)")
    tok = load_tokenizer(str(tok_dir))
    model = load_model(model_path)
    content = [{"type": "image"} for _ in images] + [{"type": "text", "text": prompt}]
    record = VisionRecord([{"role": "user", "content": content}], images=[str(Path(i).resolve()) for i in images])
    enc = VisionSampleEncoder(tok, processor_for(model_path, model.cfg), max_length=model.cfg.language.max_position_embeddings)
    x = enc.prompt(record)
    ids = x["input_ids"][None]
    out = model.generate(ids, max_new_tokens, tok.eos_token_id, pixel_values=x["pixel_values"], image_grid_thw=x["image_grid_thw"])
    return tok.decode(out[0, ids.shape[1] :], skip_special_tokens=True).strip()
