"""`loongforge-vlm generate`: a greedy answer to a prompt about images, from a trained run (its
tokenizer and image processing) or an HF VLM directory (its own processor config)."""

from __future__ import annotations

from pathlib import Path

from loongforge.core.checkpoint import find_checkpoint, read_manifest
from loongforge.core.data.text import load_tokenizer, tokenizer_dir_for
from loongforge.core.errors import UserError
from loongforge.core.foundation import hf_io


def encoder_for(model_path, cfg, tok):
    """The sample encoder a model was trained with: a run's `data.image` section, or an HF
    directory's preprocessor_config.json (the family's defaults where it has none)."""
    from loongforge.vlm.data import LlavaSampleEncoder, VisionProcessorConfig, VisionSampleEncoder
    from loongforge.vlm.model import vlm_arch
    from loongforge.vlm.recipe import sample_encoder

    longest = cfg.language.max_position_embeddings
    if not hf_io.is_hf_dir(model_path):
        image = read_manifest(find_checkpoint(model_path))["config"].get("data", {}).get("image", {})
        return sample_encoder(cfg, tok, image, longest)
    if not vlm_arch(cfg.arch).grids:
        return LlavaSampleEncoder.from_hf(tok, model_path, longest)
    v = cfg.tower
    processor = VisionProcessorConfig.from_hf(
        model_path, patch_size=v.patch_size, temporal_patch_size=v.temporal_patch_size, merge_size=v.spatial_merge_size
    )
    return VisionSampleEncoder(tok, processor, max_length=longest)


def answer(model_path, prompt: str, images: list, max_new_tokens: int = 16) -> str:
    from loongforge.vlm.data import VisionRecord
    from loongforge.vlm.model_io import load_model
    from loongforge.vlm.recipe import VISION_INPUTS

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
    x = encoder_for(model_path, model.cfg, tok).prompt(record)
    ids = x["input_ids"][None]
    vision = {k: x[k] for k in VISION_INPUTS if x.get(k) is not None}
    out = model.generate(ids, max_new_tokens, tok.eos_token_id, **vision)
    return tok.decode(out[0, ids.shape[1] :], skip_special_tokens=True).strip()
