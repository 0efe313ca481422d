"""The pi0 / pi0.5 training task: LeRobot frames -> policy inputs -> flow-matching loss.

A sample is one frame of one dataset of the mixture: each camera's image (in [-1, 1], resized
with padding to the vision tower's size, optionally augmented), the normalized state, the prompt
and the normalized action chunk (`chunk_size` frames from this one, clamped to the episode as
LeRobot does). pi0.5 writes the state into the prompt as 256 bins of [-1, 1]
("Task: ..., State: 12 200 ...;\\nAction: "), pi0 feeds it as a vector and prompts with the task.
The loss is the mean squared velocity error over the chunk's real action dimensions, as LeRobot's.
"""

from __future__ import annotations

import zlib
from pathlib import Path

import numpy as np
import torch
from loongforge.core.data import rank_micro_batches
from loongforge.core.errors import UserError
from loongforge.core.foundation.lora import add_adapters, is_adapter_key
from loongforge.core.train.task import TrainingTask
from loongforge.embodied.data import DatasetMixture, LeRobotDataset, check_compatible
from loongforge.embodied.data.image_transforms import ImageAugment, ImageAugmenter, resize_with_pad
from loongforge.embodied.data.normalize import Normalizer, compute_stats
from loongforge.embodied.policies import Observation, PiConfig, PiPolicy


def state_prompt(task: str, state: np.ndarray) -> str:
    """pi0.5's prompt: the task and the normalized state as bins 0..255 of [-1, 1]."""
    bins = np.digitize(state, bins=np.linspace(-1, 1, 257)[:-1]) - 1
    text = task.strip().replace("_", " ").replace("\n", " ")
    return f"Task: {text}, State: {' '.join(map(str, bins))};\nAction: "


def dataset_normalizer(ds: LeRobotDataset, modes: dict[str, str]) -> Normalizer:
    """The dataset's stats, with the statistics a mode needs computed where the files lack them."""
    need = {"QUANTILES": ("q01", "q99"), "QUANTILE10": ("q10", "q90"), "MEAN_STD": ("mean", "std"), "MIN_MAX": ("min", "max")}
    stats = {k: dict(v) for k, v in ds.stats.items()}
    missing = [f for f, m in modes.items() if any(s not in stats.get(f, {}) for s in need.get(str(m).upper(), ()))]
    for feature, computed in compute_stats(ds, missing).items() if missing else ():
        stats[feature] = {**stats.get(feature, {}), **computed}
    return Normalizer(stats, modes)


class PolicyInputs:
    """One observation as the policy reads it (training and serving share this): each camera's
    uint8 HWC image -> [-1, 1], resized with padding to the vision tower's size (optionally
    augmented first); the normalized state zero-padded to max_state_dim; the prompt tokens."""

    def __init__(self, cfg: PiConfig, cameras: list[str], tokenizer, max_prompt_tokens: int, augment: ImageAugmenter | None = None):
        self.cfg, self.cameras, self.tok, self.max_prompt_tokens, self.augment = cfg, cameras, tokenizer, max_prompt_tokens, augment

    def prepare(self, images: dict, state: np.ndarray, task: str, augment_seed: int | None = None) -> dict:
        """`images` {camera: uint8 [h, w, 3]}, `state` normalized; `augment_seed` None: no augmentation."""
        missing = [c for c in self.cameras if c not in images]
        if missing:
            raise UserError(f"observation lacks camera {missing[0]!r} (the policy reads {', '.join(self.cameras)})")
        pixels = {c: torch.from_numpy(np.ascontiguousarray(images[c])).permute(2, 0, 1).float() / 255.0 for c in self.cameras}
        if self.augment is not None and augment_seed is not None:
            pixels = self.augment(pixels, torch.Generator().manual_seed(augment_seed))
        size = self.cfg.vision.image_size
        stacked = torch.stack([resize_with_pad(pixels[c] * 2 - 1, size, size) for c in self.cameras])
        state = np.asarray(state, np.float32).reshape(-1)
        if state.size > self.cfg.max_state_dim:
            raise UserError(f"state has {state.size} dimensions, more than policy.max_state_dim={self.cfg.max_state_dim}")
        padded = np.zeros(self.cfg.max_state_dim, np.float32)
        padded[: state.size] = state
        prompt = state_prompt(task, padded) if self.cfg.variant == "pi05" else task.strip() + "\n"
        ids = self.tok(prompt)["input_ids"][: self.max_prompt_tokens]
        tokens = np.zeros(self.max_prompt_tokens, np.int64)
        tokens[: len(ids)] = ids
        return {"images": stacked, "tokens": torch.from_numpy(tokens), "length": len(ids), "state": torch.from_numpy(padded)}

    def collate(self, samples: list[dict], device) -> dict:
        length = torch.tensor([s["length"] for s in samples])
        out = {
            "images": torch.stack([s["images"] for s in samples]).to(device),
            "image_masks": torch.ones(len(samples), len(self.cameras), dtype=torch.bool, device=device),
            "tokens": torch.stack([s["tokens"] for s in samples]).to(device),
            "token_masks": (torch.arange(self.max_prompt_tokens)[None, :] < length[:, None]).to(device),
            "state": torch.stack([s["state"] for s in samples]).to(device),
        }
        if "actions" in samples[0]:
            out["actions"] = torch.stack([s["actions"] for s in samples]).to(device)
        return out


def observation(batch: dict) -> Observation:
    return Observation(batch["images"], batch["image_masks"], batch["tokens"], batch["token_masks"], batch["state"])


class RobotSamples:
    """Policy inputs from a mixture of LeRobot datasets, one frame (position) at a time."""

    def __init__(self, datasets: list[LeRobotDataset], weights: list[float], cfg: PiConfig, data_cfg, tokenizer):
        self.cfg, self.data_cfg, self.tok = cfg, data_cfg, tokenizer
        first = datasets[0]
        self.cameras = list(data_cfg.cameras) or list(first.video_keys)
        if not self.cameras:
            raise UserError(f"{first.root}: the dataset has no cameras; the policy needs at least one")
        keys = [data_cfg.state_key, data_cfg.action_key, *self.cameras]
        check_compatible(datasets, keys)
        self.state_dim = int(np.prod(first.features[data_cfg.state_key]["shape"]))
        self.action_dim = int(np.prod(first.features[data_cfg.action_key]["shape"]))
        if self.state_dim > cfg.max_state_dim or self.action_dim > cfg.max_action_dim:
            raise UserError(
                f"{first.root}: state has {self.state_dim} and action {self.action_dim} dimensions; "
                f"raise policy.max_state_dim ({cfg.max_state_dim}) / policy.max_action_dim ({cfg.max_action_dim})"
            )
        fps = {float(d.fps) for d in datasets}
        if len(fps) > 1:
            raise UserError(f"the datasets have different frame rates ({sorted(fps)}); mix datasets of one fps")
        self.datasets = datasets
        self.deltas = {data_cfg.action_key: [k / first.fps for k in range(cfg.chunk_size)]}
        self.normalizers = [dataset_normalizer(d, dict(data_cfg.normalization)) for d in datasets]
        self.mixture = DatasetMixture(datasets, weights, seed=data_cfg.seed)
        augment = ImageAugmenter(ImageAugment(cameras=tuple(self.cameras))) if data_cfg.augment else None
        self.inputs = PolicyInputs(cfg, self.cameras, tokenizer, data_cfg.max_prompt_tokens, augment)

    def sample(self, position: int, train: bool = True) -> dict:
        d, frame = self.mixture.index(position)
        ds, key = self.datasets[d], self.data_cfg
        item = ds.get(frame, [key.state_key, *self.cameras, "task"])
        item.update(ds.window(frame, self.deltas))
        norm = self.normalizers[d].normalize(
            {key.state_key: np.asarray(item[key.state_key], np.float32), key.action_key: item[key.action_key]}
        )
        seed = zlib.crc32(f"{key.seed}:{position}".encode()) if train else None
        out = self.inputs.prepare({c: item[c] for c in self.cameras}, norm[key.state_key], item.get("task") or "", seed)
        actions = np.zeros((self.cfg.chunk_size, self.cfg.max_action_dim), np.float32)
        actions[:, : self.action_dim] = np.asarray(norm[key.action_key], np.float32).reshape(self.cfg.chunk_size, -1)
        out["actions"] = torch.from_numpy(actions)
        return out

    def batch(self, positions: list[int], device, train: bool = True) -> dict:
        out = self.inputs.collate([self.sample(p, train) for p in positions], device)
        # the flow-matching noise and times of this micro-batch: fixed by its first position, so
        # a resumed run draws what the uninterrupted one would
        out["seed"] = zlib.crc32(f"noise:{positions[0]}".encode())
        return out


def build_policy(cfg, ops=None) -> PiPolicy:
    """The run's policy: LoRA adapters where `cfg.lora` targets, every other weight of a part
    holding adapters frozen, and the `cfg.freeze` parts frozen whole."""
    model = PiPolicy(cfg.policy, ops)
    frozen = set(cfg.freeze)
    if cfg.lora.enabled:
        frozen |= {name.split(".", 1)[0] for name in add_adapters(model, cfg.lora)}
    for name, p in model.named_parameters():
        if name.split(".", 1)[0] in frozen and not is_adapter_key(name):
            p.requires_grad_(False)
    return model


class PiTask(TrainingTask):
    unit = "samples"

    def __init__(self, cfg, samples: RobotSamples, dp_rank: int, dp_size: int, device, ops, load: Path | None = None):
        self.cfg, self.samples, self.dp_rank, self.dp_size, self.device, self.ops = cfg, samples, dp_rank, dp_size, device, ops
        self.load = load
        self.units_per_step = cfg.train.global_batch_size

    def build_model(self) -> torch.nn.Module:
        model = build_policy(self.cfg, self.ops)
        # the adapters' starting values, whole: `initial_weights` adds them to the loaded weights
        self.adapters = {k: v.detach().clone() for k, v in model.state_dict().items() if is_adapter_key(k)}
        return model.to(self.device)

    def batches(self, start_step: int):
        t = self.cfg.train
        step = start_step
        while True:
            mbs = rank_micro_batches(step, t.global_batch_size, t.micro_batch_size, self.dp_rank, self.dp_size)
            yield [self.samples.batch(positions, self.device) for positions in mbs]
            step += 1

    def loss(self, model, mb):
        obs = observation(mb)
        g = torch.Generator(device=mb["actions"].device).manual_seed(mb["seed"])
        per_element = model(obs, mb["actions"], generator=g)[:, :, : self.samples.action_dim]
        return per_element.sum(), torch.tensor(float(per_element.numel()), device=per_element.device), {}

    def initial_weights(self, model, optimizer, stack) -> int:
        """A LeRobot pi0 / pi0.5 directory (`model.safetensors`) as the starting weights."""
        if self.load is None:
            return 0
        from loongforge.embodied.policies.lerobot_format import from_lerobot
        from safetensors.torch import load_file

        state = from_lerobot(self.cfg.policy, load_file(str(self.load / "model.safetensors")))
        stack.load_full_state_dict(model, {**state, **self.adapters})
        return 0
